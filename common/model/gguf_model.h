#pragma once

// DeepSeek-V3-family models in GGUF (llama.cpp arch "deepseek2"): metadata <-> ModelConfig, the
// GGUF tensor names <-> our (Hugging Face) checkpoint names, validation of a file's tensors
// against its config, and the gpt2-BPE tokenizer from tokenizer.ggml.*. docs/gguf.md has the
// key list and the name table.
//
// Tensor names (GGUF, ne order = reversed PyTorch shape; N = layer, E = routed experts):
//   token_embd.weight            model.embed_tokens.weight
//   output_norm.weight           model.norm.weight
//   output.weight                lm_head.weight (absent: tied embeddings)
//   blk.N.attn_norm.weight       model.layers.N.input_layernorm.weight
//   blk.N.attn_q.weight          .self_attn.q_proj.weight (q_lora_rank null)
//   blk.N.attn_q_a.weight        .self_attn.q_a_proj.weight
//   blk.N.attn_q_a_norm.weight   .self_attn.q_a_layernorm.weight
//   blk.N.attn_q_b.weight        .self_attn.q_b_proj.weight
//   blk.N.attn_kv_a_mqa.weight   .self_attn.kv_a_proj_with_mqa.weight
//   blk.N.attn_kv_a_norm.weight  .self_attn.kv_a_layernorm.weight
//   blk.N.attn_kv_b.weight       .self_attn.kv_b_proj.weight  (legacy layout), or
//   blk.N.attn_k_b.weight [dn, Rkv, nh] + blk.N.attn_v_b.weight [Rkv, dv, nh]  (MLA layout:
//                                per head h, kv_b rows h*(dn+dv)+i = k_b[h][:, i] (i < dn) and
//                                rows h*(dn+dv)+dn+i = v_b[h][i, :])
//   blk.N.attn_output.weight     .self_attn.o_proj.weight
//   blk.N.ffn_norm.weight        .post_attention_layernorm.weight
//   blk.N.ffn_{gate,up,down}.weight         .mlp.{gate,up,down}_proj.weight (dense layers)
//   blk.N.ffn_gate_inp.weight    .mlp.gate.weight
//   blk.N.exp_probs_b.bias       .mlp.gate.e_score_correction_bias
//   blk.N.ffn_{gate,up,down}_exps.weight [in, out, E]   .mlp.experts.e.{..}_proj.weight, e < E
//   blk.N.ffn_{gate,up,down}_shexp.weight  .mlp.shared_experts.{..}_proj.weight

#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

#include "common/model/gguf.h"
#include "common/model/model_config.h"
#include "common/model/tensor_map.h"
#include "common/model/tokenizer.h"

namespace hmoe {

inline constexpr std::string_view kGgufArchDeepseek2 = "deepseek2";

// ModelConfig from a deepseek2 GGUF's metadata (and, where metadata is silent, its tensors: the
// router bias decides topk_method, output.weight tie_word_embeddings). InvalidArgument naming the
// key for a missing required key, a value of the wrong type, another architecture, or a config
// that fails ModelConfig::Validate. quantization.fp8 is false (GGUF types are per tensor).
absl::StatusOr<ModelConfig> ModelConfigFromGguf(const GgufModel& model);

// Whether the file stores MLA as attn_k_b + attn_v_b (true) or attn_kv_b (false), from its
// tensors. InvalidArgument when layer 0 has neither (or both).
absl::StatusOr<bool> GgufUsesSplitKvB(const GgufModel& model);

// One GGUF tensor of the model as Hugging Face tensors see it.
struct GgufTensorRef {
  std::string gguf_name;
  int64_t expert = -1;  // >= 0: slice `expert` of a stacked [in, out, E] tensor
};
// The GGUF tensor holding HF tensor `hf_name` (for kv_b_proj in the MLA layout: attn_k_b; its
// values come from DequantizeHfTensor). NotFound for a name outside the table.
absl::StatusOr<GgufTensorRef> GgufNameForHf(std::string_view hf_name, bool split_kv_b);

// Checks every tensor the config needs is present with the right ne and a supported type
// (docs/gguf.md). InvalidArgument listing the first problems by name ("missing tensor ...",
// "tensor ... has ne [...], expected [...]", "tensor ... has type IQ2_XXS, which is not
// supported").
absl::Status ValidateGgufTensors(const ModelConfig& config, const GgufModel& model);

// HF tensor `hf_name` dequantized to float in PyTorch layout ([out, in] row-major; experts sliced
// out of the stacked tensors; kv_b_proj rebuilt from attn_k_b + attn_v_b in the MLA layout).
absl::StatusOr<std::vector<float>> DequantizeHfTensor(const ModelConfig& config,
                                                      const GgufModel& model,
                                                      std::string_view hf_name);

// The gpt2-BPE tokenizer from tokenizer.ggml.* (model "gpt2"; tokens, token_type, merges,
// bos/eos/padding ids, add_bos_token, pre "deepseek-v3" or "gpt2"/"default") and
// tokenizer.chat_template. Token types: 1 normal and 6 byte -> BPE vocabulary, 3 control and
// 2 unknown -> special added tokens, 4 user-defined -> non-special added tokens, 5 unused -> no
// token (a hole). InvalidArgument naming the key for what it cannot represent (another model or
// pre-tokenizer, e.g. Kimi-K2's "kimi-k2").
absl::StatusOr<std::unique_ptr<Tokenizer>> TokenizerFromGguf(const GgufModel& model);
// The same as tokenizer.json + tokenizer_config.json text (what TokenizerFromGguf feeds to
// Tokenizer::FromJson).
struct GgufTokenizerJson {
  std::string tokenizer_json;
  std::string tokenizer_config_json;
};
absl::StatusOr<GgufTokenizerJson> GgufTokenizerToJson(const GgufModel& model);
// tokenizer.chat_template ("" when absent).
std::string GgufChatTemplate(const GgufModel& model);

// Metadata for a deepseek2 GGUF of `config` (general.*, deepseek2.*); split_kv_b selects the key
// lengths of the MLA layout (key_length = Rkv + dr, value_length = Rkv, *_mla = dn + dr, dv).
std::vector<std::pair<std::string, GgufValue>> GgufMetadataForConfig(const ModelConfig& config,
                                                                     bool split_kv_b,
                                                                     uint32_t file_type);
// tokenizer.ggml.* and tokenizer.chat_template from tokenizer.json / tokenizer_config.json text;
// the token list is padded to `vocab_size` with "[PAD<id>]" tokens of type unused.
absl::StatusOr<std::vector<std::pair<std::string, GgufValue>>> GgufTokenizerMetadata(
    std::string_view tokenizer_json, std::string_view tokenizer_config_json, int64_t vocab_size);

}  // namespace hmoe
