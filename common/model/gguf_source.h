#pragma once

// A deepseek2 GGUF model (any part of a split model) as a WeightSource under our (Hugging Face)
// tensor names, for the engine, the workers (--model FILE.gguf) and weightd (docs/gguf.md
// "Serving a GGUF"). Tensors stay in their GGUF encoding, read in place from the mapped files:
// a LinearWeight of a GGML block type (DType::kQ4_K, ...) has PyTorch shape [out, in] with whole
// blocks per row; expert e of a stacked ffn_*_exps tensor [in, out, E] is its e-th contiguous
// slice. The one exception is kv_b_proj: it is dequantized to F32 at open (from attn_kv_b, or
// rebuilt from attn_k_b + attn_v_b in the MLA layout), held in memory this object owns: it is
// small (nh * (dn + dv) * Rkv floats per layer: 64 MiB of DeepSeek-V3's ~400 GB) and the MLA
// kernels read it per head, transposed.

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"

#include "common/model/gguf.h"
#include "common/model/model_config.h"
#include "common/model/tensor.h"

namespace hmoe {

// Whether `path` names a GGUF model (ends with ".gguf").
bool IsGgufPath(std::string_view path);

class GgufCheckpoint final : public WeightSource {
 public:
  // Opens the model: metadata -> ModelConfig (ModelConfigFromGguf), every tensor the config needs
  // checked (ValidateGgufTensors: missing tensor, wrong ne, unsupported type named with the
  // tensor), kv_b_proj dequantized. Errors of GgufModel::Open (NotFound for a missing file or
  // split part, InvalidArgument for a malformed file) and of those checks, prefixed with `path`.
  static absl::StatusOr<std::unique_ptr<GgufCheckpoint>> Open(const std::string& path);

  const std::string& path() const { return path_; }
  const GgufModel& model() const { return *model_; }
  const ModelConfig& config() const { return config_; }
  // config().ToJson(): what weightd publishes as the model's config.json.
  const std::string& config_json() const { return config_json_; }

  // The tensors of ExpectedTensors(config()) (nothing else: MTP tensors are not served).
  absl::StatusOr<TensorView> GetTensor(const std::string& name) const override;
  std::vector<std::string> TensorNames() const override;
  size_t total_tensor_bytes() const;

  // Where a tensor's bytes are: part `file` of the model (model().file(file).name() is its path)
  // at byte `file_offset`, or, for the dequantized kv_b_proj, `memory` (owned here).
  struct Location {
    int file = -1;
    uint64_t file_offset = 0;
    const std::byte* memory = nullptr;
  };
  absl::StatusOr<Location> Locate(const std::string& name) const;

 private:
  GgufCheckpoint() = default;
  struct Entry {
    TensorView view;
    Location location;
  };

  std::string path_;
  std::unique_ptr<GgufModel> model_;
  ModelConfig config_;
  std::string config_json_;
  std::map<std::string, Entry> entries_;
  std::vector<std::vector<float>> owned_;  // dequantized kv_b_proj per layer
};

}  // namespace hmoe
