#pragma once

// Small synthetic checkpoints in exactly the Hugging Face layout (config.json, sharded safetensors
// and model.safetensors.index.json), written by the tests themselves: every tensor that
// ExpectedTensors(config) lists, FP8 E4M3 (+ F32 block scales) for linear weights, BF16 norms and
// embeddings, an F32 router bias, filled with seeded random bytes.

#include <stdlib.h>
#include <unistd.h>

#include <cstdint>
#include <cstring>
#include <filesystem>
#include <random>
#include <string>
#include <system_error>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"

#include "common/base/mapped_file.h"
#include "common/base/status_macros.h"
#include "common/model/dtype.h"
#include "common/model/model_config.h"
#include "common/model/safetensors.h"
#include "common/model/tensor.h"
#include "common/model/tensor_map.h"

namespace hmoe::testing {

// DeepSeek-V3's structure at toy size, with a routed-expert width of 384 = 3 FP8 blocks so that a
// 2-way NUMA split is uneven ([0, 128) and [128, 384)).
inline constexpr char kWeightdTestConfigJson[] = R"({
  "architectures": ["DeepseekV3ForCausalLM"],
  "model_type": "deepseek_v3",
  "vocab_size": 512,
  "hidden_size": 256,
  "intermediate_size": 512,
  "moe_intermediate_size": 384,
  "num_hidden_layers": 2,
  "first_k_dense_replace": 1,
  "moe_layer_freq": 1,
  "num_attention_heads": 2,
  "num_key_value_heads": 2,
  "q_lora_rank": 64,
  "kv_lora_rank": 64,
  "qk_nope_head_dim": 32,
  "qk_rope_head_dim": 16,
  "v_head_dim": 32,
  "n_routed_experts": 4,
  "n_shared_experts": 1,
  "num_experts_per_tok": 2,
  "n_group": 2,
  "topk_group": 1,
  "routed_scaling_factor": 2.5,
  "scoring_func": "sigmoid",
  "topk_method": "noaux_tc",
  "norm_topk_prob": true,
  "hidden_act": "silu",
  "rms_norm_eps": 1e-06,
  "rope_theta": 10000,
  "max_position_embeddings": 1024,
  "bos_token_id": 0,
  "eos_token_id": 1,
  "num_nextn_predict_layers": 0,
  "tie_word_embeddings": false,
  "quantization_config": {"fmt": "e4m3", "quant_method": "fp8", "weight_block_size": [128, 128],
                          "activation_scheme": "dynamic"}
}
)";

struct TestCheckpointOptions {
  std::string config_json = kWeightdTestConfigJson;
  int num_shards = 2;
  uint32_t seed = 1;
};

inline std::string RandomTensorBytes(DType dtype, int64_t n, std::mt19937& rng) {
  std::string out(static_cast<size_t>(n) * DTypeSize(dtype), '\0');
  std::uniform_real_distribution<float> dist(-1.0f, 1.0f);
  for (int64_t i = 0; i < n; ++i) {
    if (dtype == DType::kF8E4M3) {
      uint8_t c = static_cast<uint8_t>(rng() & 0xff);
      if ((c & 0x7f) == 0x7f) c = 0x38;  // Not NaN.
      out[i] = static_cast<char>(c);
    } else if (dtype == DType::kBF16) {
      const uint16_t b = FloatToBf16(dist(rng));
      std::memcpy(out.data() + 2 * i, &b, 2);
    } else {
      const float f = dtype == DType::kF32 ? 0.5f + std::abs(dist(rng)) : dist(rng);
      std::memcpy(out.data() + 4 * i, &f, 4);
    }
  }
  return out;
}

// Writes the checkpoint into `dir` (created if missing).
inline absl::Status WriteTestCheckpoint(const std::string& dir,
                                        const TestCheckpointOptions& options = {}) {
  std::error_code ec;
  std::filesystem::create_directories(dir, ec);
  if (ec) return absl::InternalError(absl::StrCat("mkdir ", dir, ": ", ec.message()));
  HMOE_ASSIGN_OR_RETURN(ModelConfig config, ModelConfig::FromJson(options.config_json));
  std::mt19937 rng(options.seed);
  std::vector<TensorToWrite> all;
  for (const ExpectedTensor& t : ExpectedTensors(config)) {
    int64_t n = 1;
    for (int64_t d : t.shape) n *= d;
    TensorToWrite w;
    w.name = t.name;
    w.shape = t.shape;
    if (t.quantizable()) {
      w.dtype = DType::kF8E4M3;
      w.data = RandomTensorBytes(w.dtype, n, rng);
      all.push_back(std::move(w));
      TensorToWrite s;
      s.name = ScaleInvName(t.name);
      s.dtype = DType::kF32;
      s.shape = ScaleInvShape(t.shape);
      s.data = RandomTensorBytes(DType::kF32, s.shape[0] * s.shape[1], rng);
      all.push_back(std::move(s));
    } else {
      w.dtype = t.kind == TensorKind::kBias ? DType::kF32 : DType::kBF16;
      w.data = RandomTensorBytes(w.dtype, n, rng);
      all.push_back(std::move(w));
    }
  }
  const int shards = std::max(1, options.num_shards);
  std::string weight_map;
  uint64_t total = 0;
  const size_t per_shard = (all.size() + shards - 1) / shards;
  for (int s = 0; s < shards; ++s) {
    const std::string file = shards == 1
                                 ? std::string("model.safetensors")
                                 : absl::StrFormat("model-%05d-of-%05d.safetensors", s + 1, shards);
    std::vector<TensorToWrite> mine;
    for (size_t i = s * per_shard; i < std::min(all.size(), (s + 1) * per_shard); ++i) {
      total += all[i].data.size();
      absl::StrAppend(&weight_map, weight_map.empty() ? "" : ",\n", "    \"", all[i].name, "\": \"",
                      file, "\"");
      mine.push_back(all[i]);
    }
    HMOE_RETURN_IF_ERROR(WriteSafetensors(absl::StrCat(dir, "/", file), mine));
  }
  if (shards > 1) {
    HMOE_RETURN_IF_ERROR(
        WriteFileAtomically(absl::StrCat(dir, "/model.safetensors.index.json"),
                            absl::StrCat("{\n  \"metadata\": {\"total_size\": ", total,
                                         "},\n  \"weight_map\": {\n", weight_map, "\n  }\n}\n")));
  }
  return WriteFileAtomically(absl::StrCat(dir, "/config.json"), options.config_json);
}

// A fresh directory under the test temp dir (or $TEST_TMPDIR), removed with its contents.
class TempDir {
 public:
  TempDir() {
    const char* base = std::getenv("TEST_TMPDIR");
    std::string tmpl =
        absl::StrCat(base != nullptr && *base ? base : "/tmp", "/hmoe_weightd.XXXXXX");
    char* p = ::mkdtemp(tmpl.data());
    path_ = p != nullptr ? tmpl : std::string();
  }
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;
  ~TempDir() {
    std::error_code ec;
    if (!path_.empty()) std::filesystem::remove_all(path_, ec);
  }
  const std::string& path() const { return path_; }
  std::string File(const std::string& name) const { return absl::StrCat(path_, "/", name); }

 private:
  std::string path_;
};

// A per-test instance name: "<prefix>-<pid>-<counter>".
inline std::string UniqueInstanceName(const std::string& prefix) {
  static int counter = 0;
  return absl::StrCat(prefix, "-", ::getpid(), "-", ++counter);
}

}  // namespace hmoe::testing
