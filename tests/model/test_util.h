#pragma once

// Helpers shared by the hmoe_model_test sources: temp directories, real and tiny config.json
// texts, a WeightSource backed by process memory, and random tensor data.

#include <stdlib.h>
#include <unistd.h>

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <map>
#include <random>
#include <string>
#include <system_error>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include <gtest/gtest.h>

#include "common/base/json.h"
#include "common/base/mapped_file.h"
#include "common/model/dtype.h"
#include "common/model/tensor.h"
#include "tests/integration/temp_dir.h"

namespace hmoe::testing {

// "model-0000<i+1>-of-0000<n>.safetensors", as Hugging Face names shards.
inline std::string ShardName(size_t i, size_t n) {
  char buf[64];
  std::snprintf(buf, sizeof(buf), "model-%05zu-of-%05zu.safetensors", i + 1, n);
  return buf;
}

// Writes <dir>/model.safetensors.index.json with `weight_map` (tensor -> shard file name).
inline void WriteIndex(const TempDir& dir, const std::map<std::string, std::string>& weight_map) {
  // Members are collected, not Set(): Set() scans the earlier members (quadratic).
  std::vector<std::pair<std::string, json::Value>> members;
  for (const auto& [tensor, shard] : weight_map) {
    members.emplace_back(tensor, json::Value::String(shard));
  }
  json::Value index = json::Value::Object();
  index.Set("metadata", json::Value::Object({{"total_size", json::Value::Integer(0)}}));
  index.Set("weight_map", json::Value::Object(std::move(members)));
  ASSERT_TRUE(
      WriteFileAtomically(dir.File("model.safetensors.index.json"), json::Serialize(index, 2))
          .ok());
}

// DeepSeek-V3's hub config.json (MODEL-SPEC 1.1 values, hub key set).
inline constexpr char kDeepSeekV3ConfigJson[] = R"({
  "architectures": ["DeepseekV3ForCausalLM"],
  "attention_bias": false,
  "attention_dropout": 0.0,
  "auto_map": {
    "AutoConfig": "configuration_deepseek.DeepseekV3Config",
    "AutoModel": "modeling_deepseek.DeepseekV3Model",
    "AutoModelForCausalLM": "modeling_deepseek.DeepseekV3ForCausalLM"
  },
  "aux_loss_alpha": 0.001,
  "bos_token_id": 0,
  "eos_token_id": 1,
  "ep_size": 1,
  "first_k_dense_replace": 3,
  "hidden_act": "silu",
  "hidden_size": 7168,
  "initializer_range": 0.02,
  "intermediate_size": 18432,
  "kv_lora_rank": 512,
  "max_position_embeddings": 163840,
  "model_type": "deepseek_v3",
  "moe_intermediate_size": 2048,
  "moe_layer_freq": 1,
  "n_group": 8,
  "n_routed_experts": 256,
  "n_shared_experts": 1,
  "norm_topk_prob": true,
  "num_attention_heads": 128,
  "num_experts_per_tok": 8,
  "num_hidden_layers": 61,
  "num_key_value_heads": 128,
  "num_nextn_predict_layers": 1,
  "pretraining_tp": 1,
  "q_lora_rank": 1536,
  "qk_nope_head_dim": 128,
  "qk_rope_head_dim": 64,
  "quantization_config": {
    "activation_scheme": "dynamic",
    "fmt": "e4m3",
    "quant_method": "fp8",
    "weight_block_size": [128, 128]
  },
  "rms_norm_eps": 1e-06,
  "rope_scaling": {
    "beta_fast": 32,
    "beta_slow": 1,
    "factor": 40,
    "mscale": 1.0,
    "mscale_all_dim": 1.0,
    "original_max_position_embeddings": 4096,
    "type": "yarn"
  },
  "rope_theta": 10000,
  "routed_scaling_factor": 2.5,
  "scoring_func": "sigmoid",
  "seq_aux": true,
  "tie_word_embeddings": false,
  "topk_group": 4,
  "topk_method": "noaux_tc",
  "torch_dtype": "bfloat16",
  "transformers_version": "4.33.1",
  "use_cache": true,
  "v_head_dim": 128,
  "vocab_size": 129280
}
)";

// Kimi-K2-Instruct's config.json (MODEL-SPEC 1.2 values).
inline constexpr char kKimiK2ConfigJson[] = R"({
  "architectures": ["DeepseekV3ForCausalLM"],
  "attention_bias": false,
  "attention_dropout": 0.0,
  "auto_map": {
    "AutoConfig": "configuration_deepseek.DeepseekV3Config",
    "AutoModel": "modeling_deepseek.DeepseekV3Model",
    "AutoModelForCausalLM": "modeling_deepseek.DeepseekV3ForCausalLM"
  },
  "aux_loss_alpha": 0.001,
  "bos_token_id": 163584,
  "eos_token_id": 163585,
  "ep_size": 1,
  "first_k_dense_replace": 1,
  "hidden_act": "silu",
  "hidden_size": 7168,
  "initializer_range": 0.02,
  "intermediate_size": 18432,
  "kv_lora_rank": 512,
  "max_position_embeddings": 131072,
  "model_type": "kimi_k2",
  "moe_intermediate_size": 2048,
  "moe_layer_freq": 1,
  "n_group": 1,
  "n_routed_experts": 384,
  "n_shared_experts": 1,
  "norm_topk_prob": true,
  "num_attention_heads": 64,
  "num_experts_per_tok": 8,
  "num_hidden_layers": 61,
  "num_key_value_heads": 64,
  "num_nextn_predict_layers": 0,
  "pretraining_tp": 1,
  "q_lora_rank": 1536,
  "qk_nope_head_dim": 128,
  "qk_rope_head_dim": 64,
  "quantization_config": {
    "activation_scheme": "dynamic",
    "fmt": "e4m3",
    "quant_method": "fp8",
    "weight_block_size": [128, 128]
  },
  "rms_norm_eps": 1e-06,
  "rope_scaling": {
    "beta_fast": 1.0,
    "beta_slow": 1.0,
    "factor": 32.0,
    "mscale": 1.0,
    "mscale_all_dim": 1.0,
    "original_max_position_embeddings": 4096,
    "type": "yarn"
  },
  "rope_theta": 50000.0,
  "routed_scaling_factor": 2.827,
  "scoring_func": "sigmoid",
  "seq_aux": true,
  "tie_word_embeddings": false,
  "topk_group": 1,
  "topk_method": "noaux_tc",
  "torch_dtype": "bfloat16",
  "transformers_version": "4.48.3",
  "use_cache": true,
  "v_head_dim": 128,
  "vocab_size": 163840
}
)";

// MODEL-SPEC 7.1 "T1": the structure of DeepSeek-V3 at toy size.
inline constexpr char kT1ConfigJson[] = R"({
  "architectures": ["DeepseekV3ForCausalLM"],
  "model_type": "deepseek_v3",
  "vocab_size": 1024,
  "hidden_size": 256,
  "intermediate_size": 512,
  "moe_intermediate_size": 128,
  "num_hidden_layers": 4,
  "first_k_dense_replace": 1,
  "moe_layer_freq": 1,
  "num_attention_heads": 4,
  "num_key_value_heads": 4,
  "q_lora_rank": 64,
  "kv_lora_rank": 64,
  "qk_nope_head_dim": 32,
  "qk_rope_head_dim": 16,
  "v_head_dim": 32,
  "n_routed_experts": 16,
  "n_shared_experts": 1,
  "num_experts_per_tok": 4,
  "n_group": 4,
  "topk_group": 2,
  "routed_scaling_factor": 2.5,
  "scoring_func": "sigmoid",
  "topk_method": "noaux_tc",
  "norm_topk_prob": true,
  "hidden_act": "silu",
  "rms_norm_eps": 1e-06,
  "rope_theta": 10000,
  "max_position_embeddings": 1024,
  "rope_scaling": {"type": "yarn", "factor": 4, "original_max_position_embeddings": 256,
                   "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0},
  "bos_token_id": 0,
  "eos_token_id": 1,
  "num_nextn_predict_layers": 0,
  "tie_word_embeddings": false,
  "quantization_config": {"fmt": "e4m3", "quant_method": "fp8", "weight_block_size": [128, 128],
                          "activation_scheme": "dynamic"}
}
)";

// `json_text` (an object) with top-level `key` set to `value` (added or replaced).
inline std::string WithField(const std::string& json_text, const std::string& key,
                             json::Value value) {
  absl::StatusOr<json::Value> v = json::Parse(json_text);
  EXPECT_TRUE(v.ok()) << v.status();
  v->Set(key, std::move(value));
  return json::Serialize(*v, 2);
}

// `json_text` (an object) without top-level `key`.
inline std::string WithoutField(const std::string& json_text, const std::string& key) {
  absl::StatusOr<json::Value> v = json::Parse(json_text);
  EXPECT_TRUE(v.ok()) << v.status();
  std::vector<std::pair<std::string, json::Value>> members;
  for (const auto& m : v->members()) {
    if (m.first != key) members.push_back(m);
  }
  return json::Serialize(json::Value::Object(std::move(members)), 2);
}

// A WeightSource over tensors held in this object (copies of the given bytes).
class FakeWeightSource final : public WeightSource {
 public:
  void Add(const std::string& name, DType dtype, std::vector<int64_t> shape, std::string bytes) {
    Stored& s = tensors_[name];
    s.bytes = std::move(bytes);
    s.view.name = name;
    s.view.dtype = dtype;
    s.view.shape = std::move(shape);
    s.view.data = reinterpret_cast<const std::byte*>(s.bytes.data());
    s.view.size_bytes = s.bytes.size();
  }
  // A zero-filled tensor of the right size.
  void AddZeros(const std::string& name, DType dtype, std::vector<int64_t> shape) {
    int64_t n = 1;
    for (int64_t d : shape) n *= d;
    Add(name, dtype, std::move(shape),
        std::string(static_cast<size_t>(n) * DTypeSize(dtype), '\0'));
  }
  void Remove(const std::string& name) { tensors_.erase(name); }

  absl::StatusOr<TensorView> GetTensor(const std::string& name) const override {
    const auto it = tensors_.find(name);
    if (it == tensors_.end()) return absl::NotFoundError(absl::StrCat("no tensor ", name));
    return it->second.view;
  }
  std::vector<std::string> TensorNames() const override {
    std::vector<std::string> names;
    for (const auto& [name, s] : tensors_) names.push_back(name);
    return names;
  }

 private:
  struct Stored {
    std::string bytes;
    TensorView view;
  };
  std::map<std::string, Stored> tensors_;  // node-based: views stay valid
};

// `n` pseudo-random bytes.
inline std::string RandomBytes(size_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::string s(n, '\0');
  for (char& c : s) c = static_cast<char>(rng() & 0xff);
  return s;
}

// `n` random F32 values in [lo, hi), as raw bytes.
inline std::string RandomF32Bytes(size_t n, uint32_t seed, float lo = 0.5f, float hi = 2.0f) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> dist(lo, hi);
  std::string s(n * 4, '\0');
  for (size_t i = 0; i < n; ++i) {
    const float f = dist(rng);
    std::memcpy(s.data() + 4 * i, &f, 4);
  }
  return s;
}

// FP8 codes that are never NaN (0x7F/0xFF are replaced).
inline std::string RandomFp8Bytes(size_t n, uint32_t seed) {
  std::string s = RandomBytes(n, seed);
  for (char& c : s) {
    if ((static_cast<unsigned char>(c) & 0x7f) == 0x7f) c = 0x38;
  }
  return s;
}

}  // namespace hmoe::testing
