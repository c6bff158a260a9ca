#include "decode_worker/forward_pass_step_engine.h"

#include <utility>

#include "absl/cleanup/cleanup.h"
#include "absl/strings/str_cat.h"

#include "common/base/status_macros.h"

namespace hmoe::decode {
namespace {

class EngineSequence final : public StepSequence {
 public:
  explicit EngineSequence(KvSequence seq, PrefixCache* prefix = nullptr)
      : seq_(std::move(seq)), prefix_(prefix) {}
  // Blocks the prefix cache took while this sequence held them may exceed its budget: trim it
  // once they are the cache's alone.
  ~EngineSequence() override {
    seq_.Reset();
    if (prefix_ != nullptr) prefix_->TrimToBudget();
  }
  int64_t num_tokens() const override { return seq_.num_tokens(); }
  KvSequence& kv() { return seq_; }
  const KvSequence& kv() const { return seq_; }

 private:
  KvSequence seq_;
  PrefixCache* prefix_;
};

class EngineStepBatch final : public StepBatch {
 public:
  explicit EngineStepBatch(std::unique_ptr<MicroBatch> batch) : batch_(std::move(batch)) {}

  absl::Status Begin(std::span<const StepInput> inputs) override {
    inputs_.clear();
    inputs_.reserve(inputs.size());
    for (const StepInput& in : inputs) {
      SequenceInput s;
      s.sequence = &static_cast<EngineSequence*>(in.sequence)->kv();
      s.tokens = in.tokens;
      s.want_logits = in.want_logits;
      inputs_.push_back(s);
    }
    return batch_->BeginStep(inputs_);
  }
  absl::Status RunAttention(int64_t layer) override { return batch_->RunAttention(layer); }
  absl::Status RunFfn(int64_t layer) override { return batch_->RunFfn(layer); }
  absl::StatusOr<std::vector<std::vector<float>>> Finish() override {
    absl::StatusOr<std::vector<std::vector<float>>> out = batch_->FinishStep();
    inputs_.clear();
    return out;
  }

 private:
  std::unique_ptr<MicroBatch> batch_;
  std::vector<SequenceInput> inputs_;  // alive for the whole step
};

int64_t CeilDiv(int64_t a, int64_t b) { return (a + b - 1) / b; }

}  // namespace

size_t KvBlockBytes(const ModelConfig& config, int64_t block_tokens) {
  return static_cast<size_t>(config.num_hidden_layers * block_tokens *
                             (config.kv_lora_rank + config.qk_rope_head_dim)) *
         sizeof(float);
}

absl::StatusOr<std::unique_ptr<ForwardPassStepEngine>> ForwardPassStepEngine::Create(
    const ModelConfig& config, const WeightSource& source, Device& device, CpuWorkerPool& pool,
    const ForwardPassStepEngineOptions& options) {
  if (options.kv_blocks < 1 || options.kv_block_tokens < 1) {
    return absl::InvalidArgumentError(absl::StrCat("kv cache of ", options.kv_blocks, " blocks of ",
                                                   options.kv_block_tokens,
                                                   " tokens: both must be >= 1"));
  }
  std::unique_ptr<ForwardPassStepEngine> e(new ForwardPassStepEngine());
  e->config_ = config;
  for (int64_t id : config.eos_token_ids) e->eos_.push_back(static_cast<int32_t>(id));
  e->device_ = &device;
  ResidentWeightsOptions weight_options;
  weight_options.moe_parts = pool.num_nodes();
  HMOE_ASSIGN_OR_RETURN(e->weights_,
                        ResidentWeights::Create(config, source, device, weight_options));
  EngineOptions engine_options = options.engine;
  engine_options.max_step_tokens = options.max_step_tokens;
  engine_options.max_step_sequences = options.max_step_sequences;
  HMOE_ASSIGN_OR_RETURN(e->engine_,
                        Engine::Create(config, *e->weights_, device, pool, engine_options));
  HMOE_ASSIGN_OR_RETURN(e->kv_,
                        KvCache::Create(device, KvCacheConfig::ForModel(config, options.kv_blocks,
                                                                        options.kv_block_tokens)));
  HMOE_ASSIGN_OR_RETURN(e->import_stream_, device.CreateStream());
  if (options.prefix_cache_blocks < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("prefix cache of ", options.prefix_cache_blocks, " blocks: must be >= 0"));
  }
  if (options.prefix_cache_blocks > 0) {
    e->prefix_ = std::make_unique<PrefixCache>(*e->kv_, options.prefix_cache_blocks);
  }
  return e;
}

ForwardPassStepEngine::~ForwardPassStepEngine() = default;

int64_t ForwardPassStepEngine::kv_blocks_free() const {
  return kv_->num_free_blocks() + (prefix_ != nullptr ? prefix_->evictable_blocks() : 0);
}

KvHandoffShape ForwardPassStepEngine::kv_handoff_shape() const {
  KvHandoffShape s;
  s.num_layers = static_cast<uint32_t>(config_.num_hidden_layers);
  s.kv_lora_rank = static_cast<uint32_t>(config_.kv_lora_rank);
  s.rope_dim = static_cast<uint32_t>(config_.qk_rope_head_dim);
  return s;
}

absl::StatusOr<std::unique_ptr<StepSequence>> ForwardPassStepEngine::NewSequence(
    int64_t reserve_tokens) {
  // Cached blocks give way: a request that opts out of the cache must not wait on it.
  if (prefix_ != nullptr) prefix_->EvictForFree(CeilDiv(reserve_tokens, kv_->config().block_size));
  KvSequence seq = kv_->NewSequence();
  HMOE_RETURN_IF_ERROR(seq.Reserve(reserve_tokens));
  return std::unique_ptr<StepSequence>(new EngineSequence(std::move(seq), prefix_.get()));
}

absl::StatusOr<std::unique_ptr<StepSequence>> ForwardPassStepEngine::NewImportedSequence(
    int64_t reserve_tokens, const KvImportSource& source, std::span<const int32_t> prompt) {
  const auto num_tokens = static_cast<int64_t>(source.header().num_tokens);
  if (num_tokens > reserve_tokens) {
    return absl::InvalidArgumentError(absl::StrCat(
        "kv import of ", num_tokens, " tokens into a reservation of ", reserve_tokens));
  }
  if (source.payload().size() < kv_->ExportBytes(num_tokens)) {
    return absl::InvalidArgumentError(absl::StrCat("kv import: payload of ",
                                                   source.payload().size(), " bytes, need ",
                                                   kv_->ExportBytes(num_tokens)));
  }
  const MemorySpace space = source.payload_on_device() ? MemorySpace::kDevice : MemorySpace::kHost;
  const int64_t block_size = kv_->config().block_size;
  const int64_t blocks = CeilDiv(reserve_tokens, block_size);
  const bool share = prefix_ != nullptr && static_cast<int64_t>(prompt.size()) == num_tokens;
  // Blocks of a cached prefix are shared, not allocated. Without side effects first: a request
  // that cannot get its blocks now waits (FIFO) and must not count a lookup at every retry.
  const int64_t shared = share ? prefix_->Match(prompt, num_tokens) / block_size : 0;
  if (blocks - shared > kv_blocks_free()) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "kv cache: ", blocks - shared, " blocks needed, ", kv_blocks_free(), " free or evictable"));
  }
  KvSequence seq = kv_->NewSequence();
  if (share) {
    HMOE_RETURN_IF_ERROR(prefix_->Acquire(prompt, num_tokens, seq, *import_stream_).status());
  }
  // The prefix is in use now, so this evicts other leaves only.
  if (prefix_ != nullptr) {
    prefix_->EvictForFree(blocks - static_cast<int64_t>(seq.block_table().size()));
  }
  if (seq.num_tokens() == num_tokens) {
    // Every token cached (the prefill worker's prompt was an earlier prompt plus nothing new).
  } else if (seq.num_tokens() > 0) {
    HMOE_RETURN_IF_ERROR(
        kv_->ImportSuffix(seq, num_tokens, *import_stream_, source.payload().data(), space));
  } else {
    HMOE_RETURN_IF_ERROR(
        kv_->Import(seq, num_tokens, *import_stream_, source.payload().data(), space));
  }
  HMOE_RETURN_IF_ERROR(import_stream_->Synchronize());
  HMOE_RETURN_IF_ERROR(seq.Reserve(reserve_tokens));
  return std::unique_ptr<StepSequence>(new EngineSequence(std::move(seq), prefix_.get()));
}

absl::StatusOr<std::unique_ptr<StepSequence>> ForwardPassStepEngine::NewSequenceFromPrefix(
    int64_t reserve_tokens, std::span<const int32_t> prompt) {
  if (prefix_ == nullptr || prompt.size() < 2) return NewSequence(reserve_tokens);
  const int64_t block_size = kv_->config().block_size;
  const int64_t max_reuse = static_cast<int64_t>(prompt.size()) - 1;
  // Without side effects first: a request that cannot get its blocks now waits (FIFO) and must
  // not count a lookup or copy a block at every retry.
  const int64_t shared = prefix_->Match(prompt, max_reuse) / block_size;
  if (CeilDiv(reserve_tokens, block_size) - shared > kv_blocks_free()) {
    return absl::ResourceExhaustedError(
        absl::StrCat("kv cache: ", CeilDiv(reserve_tokens, block_size), " blocks needed, ",
                     kv_blocks_free(), " free or evictable"));
  }
  KvSequence seq = kv_->NewSequence();
  HMOE_RETURN_IF_ERROR(prefix_->Acquire(prompt, max_reuse, seq, *import_stream_).status());
  const int64_t more =
      CeilDiv(reserve_tokens, block_size) - static_cast<int64_t>(seq.block_table().size());
  prefix_->EvictForFree(more);
  HMOE_RETURN_IF_ERROR(seq.Reserve(reserve_tokens));  // on failure seq lets its blocks go
  return std::unique_ptr<StepSequence>(new EngineSequence(std::move(seq), prefix_.get()));
}

void ForwardPassStepEngine::OfferPrefix(const StepSequence& sequence,
                                        std::span<const int32_t> tokens, bool finished) {
  if (prefix_ == nullptr) return;
  prefix_->Insert(tokens, static_cast<const EngineSequence&>(sequence).kv(), finished);
}

int64_t ForwardPassStepEngine::CachedPrefixTokens(std::span<const int32_t> prompt) const {
  if (prefix_ == nullptr || prompt.size() < 2) return 0;
  return prefix_->Match(prompt, static_cast<int64_t>(prompt.size()) - 1);
}

absl::StatusOr<int64_t> ForwardPassStepEngine::ExportPrefix(
    std::span<const int32_t> prompt, int64_t max_tokens,
    const PrefixDestination& destination) const {
  if (prefix_ == nullptr || max_tokens < 1) return 0;
  auto [blocks, n] = prefix_->Pin(prompt, max_tokens);
  if (n == 0) return 0;
  absl::Cleanup unpin = [&, &blocks = blocks] { kv_->Release(blocks); };
  HMOE_ASSIGN_OR_RETURN(void* dst, destination(n));
  // A stream of this call's own: the engine thread's streams are busy with steps (a device may be
  // driven from several threads, one stream each).
  HMOE_ASSIGN_OR_RETURN(std::unique_ptr<Stream> stream, kv_->device().CreateStream());
  HMOE_RETURN_IF_ERROR(kv_->ExportBlocks(blocks, n, *stream, dst, MemorySpace::kHost));
  HMOE_RETURN_IF_ERROR(stream->Synchronize());
  return n;
}

PrefixCacheStats ForwardPassStepEngine::prefix_cache_stats() const {
  return prefix_ != nullptr ? prefix_->stats() : PrefixCacheStats{};
}

absl::StatusOr<std::unique_ptr<StepBatch>> ForwardPassStepEngine::NewStepBatch() {
  HMOE_ASSIGN_OR_RETURN(std::unique_ptr<MicroBatch> batch, engine_->NewMicroBatch());
  return std::unique_ptr<StepBatch>(new EngineStepBatch(std::move(batch)));
}

}  // namespace hmoe::decode
