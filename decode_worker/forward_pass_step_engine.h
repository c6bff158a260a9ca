#pragma once

// StepEngine over the real forward pass: common/engine's Engine (one MicroBatch per StepBatch),
// its paged KvCache on the attention device, and ResidentWeights reading the weight source in
// place (weightd's mapping or an mmapped checkpoint).

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"

#include "common/device/device.h"
#include "common/engine/engine.h"
#include "common/engine/kv_cache.h"
#include "common/engine/prefix_cache.h"
#include "common/engine/weights.h"
#include "common/model/model_config.h"
#include "common/model/tensor.h"
#include "common/ops/cpu/cpu_worker_pool.h"
#include "decode_worker/step_engine.h"

namespace hmoe::decode {

struct ForwardPassStepEngineOptions {
  // Engine step capacity: the scheduler needs chunk_size + batch_size tokens and batch_size
  // sequences.
  int64_t max_step_tokens = 512 + 6;
  int64_t max_step_sequences = 6;
  // KV pool: num_blocks blocks of block_tokens tokens.
  int64_t kv_blocks = 0;
  int64_t kv_block_tokens = 64;
  // Blocks of the pool the prefix cache may keep after their requests finish (0: no prefix
  // cache). Cached blocks give way to new requests whenever the pool runs short.
  int64_t prefix_cache_blocks = 0;
  // Passed to Engine::Create (max_step_tokens / max_step_sequences above override it).
  EngineOptions engine;
};

// Bytes of one KV block of `config` (all layers).
size_t KvBlockBytes(const ModelConfig& config, int64_t block_tokens);

class ForwardPassStepEngine final : public StepEngine {
 public:
  // Builds ResidentWeights over `source`, the Engine and the KV pool. `source`, `device` and
  // `pool` must outlive the result. Errors from ResidentWeights::Create, Engine::Create and
  // KvCache::Create (ResourceExhausted when the pool does not fit the device budget);
  // InvalidArgument for kv_blocks < 1.
  static absl::StatusOr<std::unique_ptr<ForwardPassStepEngine>> Create(
      const ModelConfig& config, const WeightSource& source, Device& device, CpuWorkerPool& pool,
      const ForwardPassStepEngineOptions& options);
  ~ForwardPassStepEngine() override;

  int64_t vocab_size() const override { return config_.vocab_size; }
  int64_t num_layers() const override { return config_.num_hidden_layers; }
  int64_t max_context_tokens() const override { return config_.max_position_embeddings; }
  const std::vector<int32_t>& eos_token_ids() const override { return eos_; }
  int64_t max_step_tokens() const override { return engine_->options().max_step_tokens; }
  int64_t max_step_sequences() const override { return engine_->options().max_step_sequences; }
  int64_t kv_block_tokens() const override { return kv_->config().block_size; }
  int64_t kv_blocks_total() const override { return kv_->num_blocks(); }
  int64_t kv_blocks_free() const override;
  KvHandoffShape kv_handoff_shape() const override;

  absl::StatusOr<std::unique_ptr<StepSequence>> NewSequence(int64_t reserve_tokens) override;
  absl::StatusOr<std::unique_ptr<StepSequence>> NewImportedSequence(
      int64_t reserve_tokens, const KvImportSource& source,
      std::span<const int32_t> prompt) override;
  absl::StatusOr<std::unique_ptr<StepSequence>> NewSequenceFromPrefix(
      int64_t reserve_tokens, std::span<const int32_t> prompt) override;
  void OfferPrefix(const StepSequence& sequence, std::span<const int32_t> tokens,
                   bool finished) override;
  int64_t CachedPrefixTokens(std::span<const int32_t> prompt) const override;
  absl::StatusOr<int64_t> ExportPrefix(std::span<const int32_t> prompt, int64_t max_tokens,
                                       const PrefixDestination& destination) const override;
  PrefixCacheStats prefix_cache_stats() const override;
  absl::StatusOr<std::unique_ptr<StepBatch>> NewStepBatch() override;
  std::string device_name() const override { return device_->name(); }

  Engine& engine() { return *engine_; }
  KvCache& kv_cache() { return *kv_; }

 private:
  ForwardPassStepEngine() = default;

  ModelConfig config_;
  std::vector<int32_t> eos_;
  Device* device_ = nullptr;
  std::unique_ptr<ResidentWeights> weights_;
  std::unique_ptr<Engine> engine_;
  std::unique_ptr<KvCache> kv_;
  std::unique_ptr<PrefixCache> prefix_;  // null: off; destroyed before kv_
  std::unique_ptr<Stream> import_stream_;
};

}  // namespace hmoe::decode
