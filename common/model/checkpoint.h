#pragma once

// A Hugging Face checkpoint directory of the DeepSeek-V3 family: config.json plus one
// model.safetensors or sharded model-XXXXX-of-YYYYY.safetensors with model.safetensors.index.json.
// Shards are memory-mapped read-only; tensors are views into the mappings (zero copies).

#include <map>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"

#include "common/model/model_config.h"
#include "common/model/safetensors.h"
#include "common/model/tensor.h"

namespace hmoe {

// model.safetensors.index.json, parsed: the shard of every tensor of "weight_map".
struct CheckpointIndex {
  std::vector<std::string> shard_names;    // sorted, unique
  std::map<std::string, size_t> shard_of;  // tensor -> index into shard_names
};

// Parses the (untrusted) index text. InvalidArgument naming the problem (not JSON, no object
// "weight_map", a shard that is not a plain file name in the directory); the caller adds the path.
absl::StatusOr<CheckpointIndex> ParseCheckpointIndex(std::string_view text);

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
