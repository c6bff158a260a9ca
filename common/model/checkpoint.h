#pragma once

// A Hugging Face checkpoint directory of the DeepSeek-V3 family: config.json plus one
// model.safetensors or sharded model-XXXXX-of-YYYYY.safetensors with model.safetensors.index.json.
// Shards are memory-mapped read-only; tensors are views into the mappings (zero copies).

#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"

#include "common/model/model_config.h"
#include "common/model/safetensors.h"
#include "common/model/tensor.h"

namespace hmoe {

class Checkpoint final : public WeightSource {
 public:
  // Opens `dir`: parses config.json, the index (when present) and every shard header. Errors name
  // the file and the problem (missing file, bad header, tensor listed in the index but absent from
  // its shard, duplicate tensor across shards).
  static absl::StatusOr<std::unique_ptr<Checkpoint>> Open(const std::string& dir);

  const std::string& dir() const { return dir_; }
  const ModelConfig& config() const { return config_; }
  // Raw config.json text (hashed into weightd's model identity).
  const std::string& config_json() const { return config_json_; }
  // The shard files, sorted by file name.
  const std::vector<std::unique_ptr<SafetensorsFile>>& shards() const { return shards_; }

  absl::StatusOr<TensorView> GetTensor(const std::string& name) const override;
  std::vector<std::string> TensorNames() const override;
  // Total bytes of tensor data over all shards.
  size_t total_tensor_bytes() const;

 private:
  Checkpoint() = default;

  std::string dir_;
  ModelConfig config_;
  std::string config_json_;
  std::vector<std::unique_ptr<SafetensorsFile>> shards_;
  std::map<std::string, const SafetensorsFile::Entry*> index_;
};

}  // namespace hmoe
