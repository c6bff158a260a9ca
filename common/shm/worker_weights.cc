#include "common/shm/worker_weights.h"

#include <utility>

#include "absl/strings/str_cat.h"

namespace hmoe::shm {

absl::Status CheckWeightSourceFlags(const std::string& model_dir, const std::string& instance) {
  if (model_dir.empty() == instance.empty()) {
    return absl::InvalidArgumentError(
        "give exactly one of --model DIR and --weightd-instance NAME");
  }
  return absl::OkStatus();
}

absl::StatusOr<WeightSourceHolder> OpenWeights(const std::string& model_dir,
                                               const std::string& instance) {
  WeightSourceHolder h;
  if (!model_dir.empty() && IsGgufPath(model_dir)) {
    absl::StatusOr<std::unique_ptr<GgufCheckpoint>> gguf = GgufCheckpoint::Open(model_dir);
    if (!gguf.ok()) return gguf.status();
    h.gguf = *std::move(gguf);
    h.config = h.gguf->config();
    h.description = model_dir;
    return h;
  }
  if (!model_dir.empty()) {
    absl::StatusOr<std::unique_ptr<Checkpoint>> ckpt = Checkpoint::Open(model_dir);
    if (!ckpt.ok()) return ckpt.status();
    h.checkpoint = *std::move(ckpt);
    h.config = h.checkpoint->config();
    h.description = model_dir;
    return h;
  }
  if (instance.empty()) {
    return absl::InvalidArgumentError("open weights: neither a model directory nor an instance");
  }
  absl::StatusOr<std::unique_ptr<WeightStore>> store = WeightStore::Attach(instance);
  if (!store.ok()) return store.status();
  h.store = *std::move(store);
  absl::StatusOr<ModelConfig> config = ModelConfig::FromJson(h.store->manifest().config_json);
  if (!config.ok()) {
    return absl::Status(
        config.status().code(),
        absl::StrCat("weightd instance ", instance, " config.json: ", config.status().message()));
  }
  h.config = *std::move(config);
  h.description = absl::StrCat("weightd:", instance, " (", h.store->identity().ToString(), ")");
  return h;
}

}  // namespace hmoe::shm
