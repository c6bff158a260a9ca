#pragma once

// The model hyper-parameters of the DeepSeek-V3 family (DeepSeek-V3, R1, V3.1, Kimi-K2) as read
// from a Hugging Face config.json. Every field the forward pass needs is here, validated.

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"

namespace hmoe {

struct YarnConfig {
  bool enabled = false;  // rope_scaling.type == "yarn"
  double factor = 1.0;
  int64_t original_max_position_embeddings = 4096;
  double beta_fast = 32.0;
  double beta_slow = 1.0;
  // mscale and mscale_all_dim: 0 when the key is absent, null or 0. Hugging Face tests them for
  // truthiness (`if mscale and mscale_all_dim`), so those three spellings mean the same there too.
  double mscale = 0.0;
  double mscale_all_dim = 0.0;
  // rope_scaling.attention_factor (transformers' explicit cos/sin multiplier); 0 when absent.
  double attention_factor = 0.0;

  bool operator==(const YarnConfig&) const = default;
};

struct QuantizationConfig {
  bool fp8 = false;  // quant_method == "fp8" with fmt "e4m3"
  int64_t block_rows = 128;
  int64_t block_cols = 128;
  std::string scale_fmt;  // "" or "ue8m0" (V3.1); the dequant formula is the same

  bool operator==(const QuantizationConfig&) const = default;
};

struct ModelConfig {
  std::string model_type;  // "deepseek_v3" or "kimi_k2"
  int64_t vocab_size = 0;
  int64_t hidden_size = 0;
  int64_t intermediate_size = 0;      // dense MLP width
  int64_t moe_intermediate_size = 0;  // routed expert width
  int64_t num_hidden_layers = 0;
  int64_t num_attention_heads = 0;
  std::optional<int64_t> q_lora_rank;  // nullopt: a single q_proj ("lite" models)
  int64_t kv_lora_rank = 0;
  int64_t qk_nope_head_dim = 0;
  int64_t qk_rope_head_dim = 0;
  int64_t v_head_dim = 0;
  int64_t n_routed_experts = 0;
  int64_t n_shared_experts = 0;
  int64_t num_experts_per_tok = 0;
  int64_t n_group = 1;
  int64_t topk_group = 1;
  double routed_scaling_factor = 1.0;
  std::string scoring_func = "sigmoid";
  std::string topk_method = "noaux_tc";
  bool norm_topk_prob = true;
  int64_t first_k_dense_replace = 0;
  int64_t moe_layer_freq = 1;
  std::string hidden_act = "silu";
  double rms_norm_eps = 1e-6;
  double rope_theta = 10000.0;
  int64_t max_position_embeddings = 0;
  YarnConfig rope_scaling;
  int64_t bos_token_id = 0;            // -1 when the config says null
  std::vector<int64_t> eos_token_ids;  // config's eos_token_id (int or list; null -> empty)
  bool tie_word_embeddings = false;
  int64_t num_nextn_predict_layers = 0;
  QuantizationConfig quantization;  // quantization_config absent -> fp8 == false (BF16 weights)

  bool operator==(const ModelConfig&) const = default;

  int64_t qk_head_dim() const { return qk_nope_head_dim + qk_rope_head_dim; }
  bool is_moe_layer(int64_t layer) const {
    return n_routed_experts > 0 && layer >= first_k_dense_replace && layer % moe_layer_freq == 0;
  }
  // Softmax scale of MLA: qk_head_dim^-0.5 * mscale^2 with YaRN's mscale (MODEL-SPEC 3.6).
  double softmax_scale() const;
  // The qk_rope_head_dim / 2 inverse frequencies of the rotary pairs (MODEL-SPEC 3.4): plain RoPE
  // rope_theta^(-2i/d), or with YaRN each frequency blended between itself (extrapolation) and
  // itself / factor (interpolation) by a linear ramp over YaRN's correction range. Computed in
  // double, returned as float. The engine's table; reference::YarnInvFreq is the oracle's own.
  std::vector<float> rope_inv_freq() const;
  // YaRN's cos/sin multiplier (MODEL-SPEC 3.4), as transformers' _compute_yarn_parameters: 1
  // without YaRN; attention_factor when given; g(factor, mscale) / g(factor, mscale_all_dim) when
  // both mscale and mscale_all_dim are non-zero; else g(factor, 1) = 0.1 ln(factor) + 1 (whatever
  // the one present says), with g(s, m) = 1 if s <= 1 else 0.1 m ln s + 1.
  double rope_attention_factor() const;

  // Parses config.json text. Errors are InvalidArgument and name the field, e.g.
  // "config.json: field \"hidden_size\": expected a positive integer, got string".
  // Accepts Kimi-K2's nested "text_config" layout (fields there win over top-level ones).
  // Required: model_type ("deepseek_v3" | "kimi_k2") and the dimensions vocab_size, hidden_size,
  // intermediate_size, moe_intermediate_size, num_hidden_layers, num_attention_heads,
  // kv_lora_rank, qk_{nope,rope}_head_dim, v_head_dim, n_routed_experts, num_experts_per_tok.
  // Everything else is optional with HF DeepseekV3Config's defaults (q_lora_rank 1536, n_group 8,
  // topk_group 4, first_k_dense_replace 3, routed_scaling_factor 2.5, eos 1, ...; the hub code's
  // moe_layer_freq 1, scoring_func sigmoid, topk_method noaux_tc; num_nextn_predict_layers 0).
  // q_lora_rank null -> nullopt; rope_scaling null or absent -> no YaRN; quantization_config
  // absent -> BF16 weights; attention_bias true and non-fp8 quantization are rejected.
  static absl::StatusOr<ModelConfig> FromJson(std::string_view json_text);
  // Reads and parses `path` (a config.json file).
  static absl::StatusOr<ModelConfig> FromFile(const std::string& path);
  // Cross-field consistency (divisibility, group constraints, ranges). Called by FromJson.
  absl::Status Validate() const;
  // Serializes back to HF config.json form (what hmoe-make-model writes).
  std::string ToJson() const;
};

}  // namespace hmoe
