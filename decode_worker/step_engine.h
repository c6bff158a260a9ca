#pragma once

// The narrow view of the model forward the decode scheduler needs (docs/decode_worker.md): KV
// sequences from a paged pool, and step drivers that run one batch step layer by layer so two of
// them can overlap (dual-batch attention–MoE, paper §3.3.1). ForwardPassStepEngine
// (forward_pass_step_engine.h) implements it over common/engine's Engine, MicroBatch and KvCache;
// the scheduler's unit tests implement it with a deterministic fake.

#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

#include "common/engine/prefix_cache.h"
#include "common/kv_handoff/kv_handoff.h"

namespace hmoe::decode {

// One sequence's KV state in the engine's pool. Created by StepEngine::NewSequence; destroying it
// returns its blocks to the pool. Not thread-safe: one step at a time uses it.
class StepSequence {
 public:
  virtual ~StepSequence() = default;
  // Tokens whose KV is in the cache (the position of the next token).
  virtual int64_t num_tokens() const = 0;
};

// One sequence's part of a step: `tokens` (>= 1) are appended at positions num_tokens() ...
struct StepInput {
  StepSequence* sequence = nullptr;  // not owned
  std::span<const int32_t> tokens;   // valid during the step
  bool want_logits = true;           // logits of the last token
};

// A step driver with its own scratch (and stream). Call order per step: Begin, then for each
// layer l: RunAttention(l), RunFfn(l); then Finish. A failed call abandons the step (sequences
// keep their previous num_tokens()). Not thread-safe; two StepBatches of one engine may run
// concurrently on disjoint sequences.
class StepBatch {
 public:
  virtual ~StepBatch() = default;
  // InvalidArgument for bad inputs, ResourceExhausted when the KV pool cannot hold the tokens.
  virtual absl::Status Begin(std::span<const StepInput> inputs) = 0;
  // Attention of `layer` (runs on the attention device).
  virtual absl::Status RunAttention(int64_t layer) = 0;
  // Feed-forward (dense MLP or CPU experts) of `layer`.
  virtual absl::Status RunFfn(int64_t layer) = 0;
  // lm_head; commits the tokens. One entry per input: vocab logits, or empty when !want_logits.
  virtual absl::StatusOr<std::vector<std::vector<float>>> Finish() = 0;
};

// The model and its KV pool. Methods other than the StepBatch calls are used by the scheduler's
// engine thread only, except the const getters and kv_blocks_free(), which are thread-safe.
class StepEngine {
 public:
  virtual ~StepEngine() = default;

  virtual int64_t vocab_size() const = 0;
  virtual int64_t num_layers() const = 0;
  // Longest sequence (prompt + generated) the model supports.
  virtual int64_t max_context_tokens() const = 0;
  virtual const std::vector<int32_t>& eos_token_ids() const = 0;
  // What one StepBatch step accepts.
  virtual int64_t max_step_tokens() const = 0;
  virtual int64_t max_step_sequences() const = 0;

  // KV pool.
  virtual int64_t kv_block_tokens() const = 0;
  virtual int64_t kv_blocks_total() const = 0;
  // Blocks a new sequence can get: free ones plus those the prefix cache would give up.
  virtual int64_t kv_blocks_free() const = 0;
  // The hand-off shape this engine imports (kv_handoff.h).
  virtual KvHandoffShape kv_handoff_shape() const = 0;

  // A new sequence with blocks reserved for `reserve_tokens` tokens (all or nothing):
  // ResourceExhausted when the pool has too few free blocks.
  virtual absl::StatusOr<std::unique_ptr<StepSequence>> NewSequence(int64_t reserve_tokens) = 0;
  // As NewSequence, but the sequence starts with the header().num_tokens (<= reserve_tokens)
  // tokens of the hand-off `source` (its header was validated against kv_handoff_shape()), copied
  // into its blocks. ResourceExhausted (nothing reserved) when the pool cannot hold
  // reserve_tokens. `prompt`: the ids of those tokens when their KV may be shared with the prefix
  // cache (empty: it may not): the longest cached prefix of them is then taken from the cache (its
  // blocks shared as NewSequenceFromPrefix does) and only the rest is copied from `source` — which
  // a prefill worker computed against that very prefix (PrefillRequest.prefix_kv) or, with an
  // exact import, computes bit for bit as the cache holds it.
  virtual absl::StatusOr<std::unique_ptr<StepSequence>> NewImportedSequence(
      int64_t reserve_tokens, const KvImportSource& source, std::span<const int32_t> prompt) = 0;

  // Prefix cache (common/engine/prefix_cache.h). An engine without one reuses nothing (these
  // defaults).
  // As NewSequence, but the sequence starts with the longest cached prefix of `prompt`, at most
  // prompt.size() - 1 tokens (one token is always computed, for the logits), whose KV it shares:
  // its num_tokens() says how many.
  virtual absl::StatusOr<std::unique_ptr<StepSequence>> NewSequenceFromPrefix(
      int64_t reserve_tokens, std::span<const int32_t> prompt) {
    (void)prompt;
    return NewSequence(reserve_tokens);
  }
  // Offers the KV of `sequence`'s first min(num_tokens(), tokens.size()) tokens, whose ids are
  // `tokens`, to the prefix cache. `finished`: the sequence will not be written again.
  virtual void OfferPrefix(const StepSequence& sequence, std::span<const int32_t> tokens,
                           bool finished) {
    (void)sequence;
    (void)tokens;
    (void)finished;
  }
  // Leading tokens of `prompt` NewSequenceFromPrefix would reuse now. Thread-safe.
  virtual int64_t CachedPrefixTokens(std::span<const int32_t> prompt) const {
    (void)prompt;
    return 0;
  }
  // Writes the KV of the longest cached prefix of `prompt`, at most max_tokens, in the hand-off
  // format (kv_handoff.h) to the host memory `destination(n)` returns for its length n (ExportBytes
  // of n tokens), and returns n; 0 when nothing is cached (destination is not called). For a
  // prefill worker that prefills only the rest of a prompt. Thread-safe: the cached blocks are
  // pinned while they are read, on a stream of the call's own, so steps go on meanwhile. Errors
  // of `destination` and of the copy.
  using PrefixDestination = std::function<absl::StatusOr<void*>(int64_t num_tokens)>;
  virtual absl::StatusOr<int64_t> ExportPrefix(std::span<const int32_t> prompt, int64_t max_tokens,
                                               const PrefixDestination& destination) const {
    (void)prompt;
    (void)max_tokens;
    (void)destination;
    return 0;
  }
  // Thread-safe.
  virtual PrefixCacheStats prefix_cache_stats() const { return {}; }

  // A new step driver (allocates scratch; ResourceExhausted when the device budget is exceeded).
  virtual absl::StatusOr<std::unique_ptr<StepBatch>> NewStepBatch() = 0;

  // "cpu", "cuda:0".
  virtual std::string device_name() const = 0;
};

}  // namespace hmoe::decode
