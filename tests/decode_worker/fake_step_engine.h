#pragma once

// A deterministic StepEngine for the scheduler's unit tests. A sequence is its token history;
// the logits after a history are a pure function of it (FakeLogits), with a unique arg-max
// (FakeNextToken), so the tokens a request must produce are known without the scheduler
// (FakeGreedy). The fake checks the StepBatch call order, that a sequence is never in two
// concurrent steps, and KV accounting (blocks are reserved per sequence, freed on destruction),
// and it records every step's composition. Optional: a gate that holds steps, a token that makes
// a step fail, and an overlap probe (a micro-batch's RunFfn(l) waits, bounded, until the other
// micro-batch of the same step has entered RunAttention(l)).
//
// KV hand-off: the fake's shape is {num_layers 1, kv_lora_rank 1, rope_dim 0}: one float per
// token, which the fake reads as the token id.

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <memory>
#include <set>
#include <span>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"

#include "decode_worker/step_engine.h"

namespace hmoe::decode::testing {

inline uint64_t HistoryHash(std::span<const int32_t> history) {
  uint64_t h = 1469598103934665603ull;
  for (int32_t t : history) {
    h ^= static_cast<uint64_t>(t) + 0x9e3779b97f4a7c15ull;
    h *= 1099511628211ull;
    h ^= h >> 29;
  }
  return h;
}

inline int32_t FakeNextToken(std::span<const int32_t> history, int64_t vocab) {
  return static_cast<int32_t>(HistoryHash(history) % static_cast<uint64_t>(vocab));
}

// Logits with a clear maximum (10) at FakeNextToken; the others in [0, 5).
inline std::vector<float> FakeLogits(std::span<const int32_t> history, int64_t vocab) {
  const uint64_t h = HistoryHash(history);
  std::vector<float> logits(static_cast<size_t>(vocab));
  for (int64_t v = 0; v < vocab; ++v) {
    logits[v] = static_cast<float>((h >> (v % 40)) % 50) / 10.0f;
  }
  logits[FakeNextToken(history, vocab)] = 10.0f;
  return logits;
}

// The greedy continuation of `prompt` (n tokens), stopping at nothing.
inline std::vector<int32_t> FakeGreedy(std::vector<int32_t> history, int n, int64_t vocab) {
  std::vector<int32_t> out;
  for (int i = 0; i < n; ++i) {
    const int32_t t = FakeNextToken(history, vocab);
    out.push_back(t);
    history.push_back(t);
  }
  return out;
}

struct FakeOptions {
  int64_t vocab = 97;
  int64_t num_layers = 3;
  int64_t max_context = 4096;
  std::vector<int32_t> eos;
  int64_t max_step_tokens = 64;
  int64_t max_step_sequences = 8;
  int64_t block_tokens = 4;
  int64_t num_blocks = 1024;
};

// One step as the fake saw it.
struct StepRecord {
  int batch = 0;                      // which StepBatch (creation order)
  std::vector<int64_t> token_counts;  // per input
};

class FakeStepEngine;

class FakeSequence final : public StepSequence {
 public:
  FakeSequence(FakeStepEngine* engine, int64_t blocks) : engine_(engine), blocks_(blocks) {}
  ~FakeSequence() override;
  int64_t num_tokens() const override { return static_cast<int64_t>(history.size()); }

  std::vector<int32_t> history;
  int64_t capacity_tokens(int64_t block_tokens) const { return blocks_ * block_tokens; }
  std::atomic<bool> busy{false};

 private:
  FakeStepEngine* engine_;
  int64_t blocks_;
};

class FakeStepEngine final : public StepEngine {
 public:
  explicit FakeStepEngine(FakeOptions options = {})
      : options_(std::move(options)), free_blocks_(options_.num_blocks) {}

  int64_t vocab_size() const override { return options_.vocab; }
  int64_t num_layers() const override { return options_.num_layers; }
  int64_t max_context_tokens() const override { return options_.max_context; }
  const std::vector<int32_t>& eos_token_ids() const override { return options_.eos; }
  int64_t max_step_tokens() const override { return options_.max_step_tokens; }
  int64_t max_step_sequences() const override { return options_.max_step_sequences; }
  int64_t kv_block_tokens() const override { return options_.block_tokens; }
  int64_t kv_blocks_total() const override { return options_.num_blocks; }
  int64_t kv_blocks_free() const override {
    absl::MutexLock lock(&mu_);
    return free_blocks_;
  }
  KvHandoffShape kv_handoff_shape() const override {
    KvHandoffShape s;
    s.num_layers = 1;
    s.kv_lora_rank = 1;
    s.rope_dim = 0;
    return s;
  }

  absl::StatusOr<std::unique_ptr<StepSequence>> NewSequence(int64_t reserve_tokens) override {
    const int64_t blocks = (reserve_tokens + options_.block_tokens - 1) / options_.block_tokens;
    absl::MutexLock lock(&mu_);
    if (blocks > free_blocks_) {
      return absl::ResourceExhaustedError(
          absl::StrCat("fake kv: need ", blocks, " blocks, ", free_blocks_, " free"));
    }
    free_blocks_ -= blocks;
    return std::unique_ptr<StepSequence>(new FakeSequence(this, blocks));
  }

  absl::StatusOr<std::unique_ptr<StepSequence>> NewImportedSequence(
      int64_t reserve_tokens, const KvImportSource& source,
      std::span<const int32_t> prompt) override {
    (void)prompt;  // the fake has no prefix cache
    const int64_t n = static_cast<int64_t>(source.header().num_tokens);
    if (n > reserve_tokens) return absl::InvalidArgumentError("fake: import beyond reservation");
    if (source.payload().size() < static_cast<size_t>(n) * sizeof(float)) {
      return absl::InvalidArgumentError("fake: short payload");
    }
    absl::StatusOr<std::unique_ptr<StepSequence>> seq = NewSequence(reserve_tokens);
    if (!seq.ok()) return seq.status();
    auto& fake = static_cast<FakeSequence&>(**seq);
    std::vector<float> values(static_cast<size_t>(n));
    std::memcpy(values.data(), source.payload().data(), values.size() * sizeof(float));
    for (float v : values) fake.history.push_back(static_cast<int32_t>(v));
    return seq;
  }

  absl::StatusOr<std::unique_ptr<StepBatch>> NewStepBatch() override;
  std::string device_name() const override { return "fake"; }

  // --- test controls and observations (thread-safe).

  // While held, Begin blocks (and counts itself in blocked_steps()).
  void HoldSteps() {
    absl::MutexLock lock(&mu_);
    held_ = true;
  }
  void ReleaseSteps() {
    absl::MutexLock lock(&mu_);
    held_ = false;
  }
  int blocked_steps() const {
    absl::MutexLock lock(&mu_);
    return blocked_;
  }
  // A step containing `token` as input fails in RunFfn(0) with Internal.
  void FailOnToken(int32_t token) {
    absl::MutexLock lock(&mu_);
    fail_token_ = token;
  }
  void EnableOverlapProbe() {
    absl::MutexLock lock(&mu_);
    probe_ = true;
  }
  int overlaps_observed() const {
    absl::MutexLock lock(&mu_);
    return overlaps_;
  }
  int probe_timeouts() const {
    absl::MutexLock lock(&mu_);
    return probe_timeouts_;
  }
  std::vector<StepRecord> steps() const {
    absl::MutexLock lock(&mu_);
    return steps_;
  }
  std::vector<std::string> errors() const {
    absl::MutexLock lock(&mu_);
    return errors_;
  }

 private:
  friend class FakeSequence;
  friend class FakeStepBatch;

  void ReturnBlocks(int64_t blocks) {
    absl::MutexLock lock(&mu_);
    free_blocks_ += blocks;
  }
  void Error(std::string e) {
    absl::MutexLock lock(&mu_);
    errors_.push_back(std::move(e));
  }
  bool NotHeld() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return !held_; }

  FakeOptions options_;
  mutable absl::Mutex mu_;
  int64_t free_blocks_ ABSL_GUARDED_BY(mu_);
  bool held_ ABSL_GUARDED_BY(mu_) = false;
  int blocked_ ABSL_GUARDED_BY(mu_) = 0;
  int32_t fail_token_ ABSL_GUARDED_BY(mu_) = -1;
  bool probe_ ABSL_GUARDED_BY(mu_) = false;
  int overlaps_ ABSL_GUARDED_BY(mu_) = 0;
  int probe_timeouts_ ABSL_GUARDED_BY(mu_) = 0;
  int num_batches_ ABSL_GUARDED_BY(mu_) = 0;
  // Per batch: step generation and the highest layer whose attention it entered in that step.
  std::vector<int64_t> batch_step_ ABSL_GUARDED_BY(mu_);
  std::vector<int64_t> attention_layer_ ABSL_GUARDED_BY(mu_);
  std::vector<bool> batch_active_ ABSL_GUARDED_BY(mu_);
  std::vector<StepRecord> steps_ ABSL_GUARDED_BY(mu_);
  std::vector<std::string> errors_ ABSL_GUARDED_BY(mu_);
};

inline FakeSequence::~FakeSequence() { engine_->ReturnBlocks(blocks_); }

class FakeStepBatch final : public StepBatch {
 public:
  FakeStepBatch(FakeStepEngine* engine, int index) : engine_(engine), index_(index) {}

  absl::Status Begin(std::span<const StepInput> inputs) override {
    if (phase_ != 0) engine_->Error("Begin during a step");
    {
      absl::MutexLock lock(&engine_->mu_);
      if (engine_->held_) {
        ++engine_->blocked_;
        engine_->mu_.Await(absl::Condition(engine_, &FakeStepEngine::NotHeld));
        --engine_->blocked_;
      }
    }
    if (inputs.empty()) return absl::InvalidArgumentError("fake: no inputs");
    int64_t total = 0;
    std::set<const StepSequence*> seen;
    StepRecord record;
    record.batch = index_;
    fail_ = false;
    int32_t fail_token;
    {
      absl::MutexLock lock(&engine_->mu_);
      fail_token = engine_->fail_token_;
    }
    for (const StepInput& in : inputs) {
      if (in.sequence == nullptr || in.tokens.empty()) {
        return absl::InvalidArgumentError("fake: empty input");
      }
      if (!seen.insert(in.sequence).second) return absl::InvalidArgumentError("fake: duplicate");
      for (int32_t t : in.tokens) {
        if (t < 0 || t >= engine_->options_.vocab) {
          return absl::InvalidArgumentError("fake: token out of range");
        }
        if (t == fail_token) fail_ = true;
      }
      auto* seq = static_cast<FakeSequence*>(in.sequence);
      if (seq->num_tokens() + static_cast<int64_t>(in.tokens.size()) >
          seq->capacity_tokens(engine_->options_.block_tokens)) {
        engine_->Error("step beyond the sequence's reservation");
        return absl::ResourceExhaustedError("fake: beyond reservation");
      }
      total += static_cast<int64_t>(in.tokens.size());
      record.token_counts.push_back(static_cast<int64_t>(in.tokens.size()));
    }
    if (total > engine_->options_.max_step_tokens ||
        static_cast<int64_t>(inputs.size()) > engine_->options_.max_step_sequences) {
      engine_->Error(absl::StrCat("step too large: ", total, " tokens, ", inputs.size(), " seqs"));
      return absl::InvalidArgumentError("fake: step too large");
    }
    for (const StepInput& in : inputs) {
      auto* seq = static_cast<FakeSequence*>(in.sequence);
      if (seq->busy.exchange(true, std::memory_order_acq_rel)) {
        engine_->Error("sequence used by two steps at once");
      }
    }
    inputs_.assign(inputs.begin(), inputs.end());
    {
      absl::MutexLock lock(&engine_->mu_);
      engine_->steps_.push_back(record);
      ++engine_->batch_step_[index_];
      engine_->attention_layer_[index_] = -1;
      engine_->batch_active_[index_] = true;
    }
    phase_ = 1;
    next_layer_ = 0;
    return absl::OkStatus();
  }

  absl::Status RunAttention(int64_t layer) override {
    if (phase_ != 1 || layer != next_layer_) engine_->Error("RunAttention out of order");
    absl::MutexLock lock(&engine_->mu_);
    engine_->attention_layer_[index_] = layer;
    phase_ = 2;
    return absl::OkStatus();
  }

  absl::Status RunFfn(int64_t layer) override {
    if (phase_ != 2 || layer != next_layer_) engine_->Error("RunFfn out of order");
    Probe(layer);
    if (fail_ && layer == 0) {
      Abort();
      return absl::InternalError("fake: injected failure");
    }
    phase_ = 1;
    ++next_layer_;
    return absl::OkStatus();
  }

  absl::StatusOr<std::vector<std::vector<float>>> Finish() override {
    if (phase_ != 1 || next_layer_ != engine_->options_.num_layers) {
      engine_->Error("Finish out of order");
    }
    std::vector<std::vector<float>> out;
    for (const StepInput& in : inputs_) {
      auto* seq = static_cast<FakeSequence*>(in.sequence);
      seq->history.insert(seq->history.end(), in.tokens.begin(), in.tokens.end());
      out.push_back(in.want_logits ? FakeLogits(seq->history, engine_->options_.vocab)
                                   : std::vector<float>());
    }
    Abort();
    return out;
  }

 private:
  // A failed or finished step: release the sequences.
  void Abort() {
    for (const StepInput& in : inputs_) {
      static_cast<FakeSequence*>(in.sequence)->busy.store(false, std::memory_order_release);
    }
    inputs_.clear();
    phase_ = 0;
    absl::MutexLock lock(&engine_->mu_);
    engine_->batch_active_[index_] = false;
  }

  // With the probe on, waits until every other micro-batch has entered RunAttention(layer) of this
  // same step (or finished it): a serial runner never gets there, an overlapping one gets there
  // while this RunFfn is in progress (counted as an overlap). Up to 20 s: the other micro-batch's
  // thread may lose the CPU for a while on a loaded machine or under TSan.
  void Probe(int64_t layer) {
    absl::MutexLock lock(&engine_->mu_);
    if (!engine_->probe_) return;
    const int64_t my_step = engine_->batch_step_[index_];
    for (int b = 0; b < engine_->num_batches_; ++b) {
      if (b == index_) continue;
      auto reached = [this, b, layer, my_step]() ABSL_NO_THREAD_SAFETY_ANALYSIS {
        const int64_t step = engine_->batch_step_[b];
        return step > my_step || (step == my_step && (engine_->attention_layer_[b] >= layer ||
                                                      !engine_->batch_active_[b]));
      };
      if (engine_->mu_.AwaitWithTimeout(absl::Condition(&reached), absl::Seconds(20))) {
        if (engine_->batch_step_[b] == my_step && engine_->batch_active_[b]) ++engine_->overlaps_;
      } else {
        ++engine_->probe_timeouts_;
      }
    }
  }

  FakeStepEngine* engine_;
  int index_;
  int phase_ = 0;  // 0 idle, 1 before attention, 2 before ffn
  int64_t next_layer_ = 0;
  bool fail_ = false;
  std::vector<StepInput> inputs_;
};

inline absl::StatusOr<std::unique_ptr<StepBatch>> FakeStepEngine::NewStepBatch() {
  absl::MutexLock lock(&mu_);
  const int index = num_batches_++;
  batch_step_.push_back(0);
  attention_layer_.push_back(-1);
  batch_active_.push_back(false);
  return std::unique_ptr<StepBatch>(new FakeStepBatch(this, index));
}

}  // namespace hmoe::decode::testing
