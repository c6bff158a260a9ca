#pragma once

// Where a worker process's weights come from (hmoe-prefill-worker, hmoe-decode-worker): a
// checkpoint directory opened directly (tests, CPU-only use), or the shared memory of a running
// hmoe-weightd instance (WeightStore, the production path).

#include <memory>
#include <string>

#include "absl/status/statusor.h"

#include "common/model/checkpoint.h"
#include "common/model/gguf_source.h"
#include "common/model/model_config.h"
#include "common/model/tensor.h"
#include "common/shm/weight_store.h"

namespace hmoe::shm {

// The opened weights; keeps the source alive. Move-only (owns the source).
struct WeightSourceHolder {
  std::unique_ptr<Checkpoint> checkpoint;  // set with a model directory
  std::unique_ptr<GgufCheckpoint> gguf;    // set with a GGUF file (*.gguf)
  std::unique_ptr<WeightStore> store;      // set with a weightd instance
  ModelConfig config;
  // For logs and registration: the directory, or "weightd:<instance> (<model identity>)".
  std::string description;

  // The one source that is set.
  const WeightSource& source() const {
    if (checkpoint != nullptr) return *checkpoint;
    if (gguf != nullptr) return *gguf;
    return *store;
  }
};

// The workers' choice of weights, --model DIR or --weightd-instance NAME: InvalidArgument naming
// both flags unless exactly one is given.
absl::Status CheckWeightSourceFlags(const std::string& model_dir, const std::string& instance);

// Opens the checkpoint in `model_dir` (a directory, or a GGUF file: GgufCheckpoint) when it is
// not empty, else attaches to the weightd
// `instance`. Errors of Checkpoint::Open and WeightStore::Attach; an instance whose config.json
// does not parse keeps ModelConfig::FromJson's code with a message naming the instance;
// InvalidArgument when both are empty.
absl::StatusOr<WeightSourceHolder> OpenWeights(const std::string& model_dir,
                                               const std::string& instance);

}  // namespace hmoe::shm
