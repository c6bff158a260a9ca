#pragma once

// Runs one scheduler step on the engine, either as one batch or as two micro-batches overlapped
// attention-against-MoE (paper §3.3.1, Fig. 7): micro-batch A runs on the calling (engine) thread,
// B on the runner's helper thread. Two resources, the attention device and the CPU experts, are
// each taken in strict alternation A, B, A, B, ... so the pipeline is
//
//   attention: A.embed+a0  B.embed+a0  A.a1  B.a1  ...  A.lm_head  B.lm_head
//   experts:              A.f0        B.f0  A.f1  B.f1  ...
//
// i.e. while A runs layer l's MoE, B runs layer l's attention, then A runs layer l+1's attention
// while B runs layer l's MoE. Embedding and lm_head belong to the attention resource (on a GPU they
// are device work). A micro-batch that fails drops out of the alternation so the other finishes.
//
// A sequence's computation does not depend on which micro-batch it is in (the engine's contract),
// so tokens are identical with the overlap on or off.

#include <cstdint>
#include <memory>
#include <span>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"

#include "decode_worker/step_engine.h"

namespace hmoe::decode {

// The result of one input of a step: the logits (empty when !want_logits) or the error of the
// micro-batch it ran in (its sequence then keeps its previous num_tokens()).
struct StepResult {
  absl::Status status;
  std::vector<float> logits;
};

// Where a step's inputs went (for tests and stats).
struct StepSplit {
  bool dual = false;
  size_t first_batch_inputs = 0;  // inputs [0, n) in A, [n, size) in B when dual
};

// Contiguous split of `token_counts` into two non-empty halves with the closest token totals
// (ties: the earlier split point). Returns the number of inputs in the first half; needs >= 2
// inputs.
size_t BalancedSplit(std::span<const int64_t> token_counts);

// Not thread-safe: one engine thread calls Run. Owns the helper thread (joined by the destructor).
class StepRunner {
 public:
  // Creates the step driver(s): two StepBatches when `dual_batch`, else one. `engine` must outlive
  // the runner.
  static absl::StatusOr<std::unique_ptr<StepRunner>> Create(StepEngine& engine, bool dual_batch);
  ~StepRunner();
  StepRunner(const StepRunner&) = delete;
  StepRunner& operator=(const StepRunner&) = delete;

  // Runs one step over `inputs` (non-empty). With dual batch on and at least two inputs, splits
  // them with BalancedSplit and overlaps the halves; otherwise runs them as one batch. Returns one
  // result per input, in order.
  std::vector<StepResult> Run(std::span<const StepInput> inputs);

  bool dual_batch() const { return second_ != nullptr; }
  const StepSplit& last_split() const { return last_split_; }

 private:
  StepRunner(StepEngine& engine, std::unique_ptr<StepBatch> first,
             std::unique_ptr<StepBatch> second);

  // Begin, layers and Finish of one micro-batch; `party` 0 (A) or 1 (B) takes part in the
  // alternation, -1 runs alone.
  absl::StatusOr<std::vector<std::vector<float>>> RunBatch(StepBatch& batch,
                                                           std::span<const StepInput> inputs,
                                                           int party);
  void HelperLoop(std::stop_token stop);
  bool HelperReady() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return stopping_ || helper_has_work_;
  }

  StepEngine& engine_;
  std::unique_ptr<StepBatch> first_;
  std::unique_ptr<StepBatch> second_;
  StepSplit last_split_;

  // Strict A/B alternation of the turns on one resource (party 0 = A goes first). Thread-safe.
  class Alternation {
   public:
    void Reset() ABSL_LOCKS_EXCLUDED(mu_);
    // Waits until `party` may take its `turn`-th turn (0-based): the other party has completed
    // `turn` turns (party 0) or `turn` + 1 turns (party 1), or has retired.
    void Acquire(int party, int64_t turn) ABSL_LOCKS_EXCLUDED(mu_);
    // Completes the party's current turn.
    void Release(int party) ABSL_LOCKS_EXCLUDED(mu_);
    // The party takes no more turns (finished or failed).
    void Retire(int party) ABSL_LOCKS_EXCLUDED(mu_);

   private:
    absl::Mutex mu_;
    int64_t done_[2] ABSL_GUARDED_BY(mu_) = {0, 0};
    bool retired_[2] ABSL_GUARDED_BY(mu_) = {false, false};
  };

  // One resource turn of a micro-batch: a no-op scope when `party` < 0 (no overlap).
  class Turn;

  Alternation attention_;
  Alternation ffn_;

  // Hand-off of micro-batch B to the helper thread.
  absl::Mutex mu_;
  std::span<const StepInput> helper_inputs_ ABSL_GUARDED_BY(mu_);
  bool helper_has_work_ ABSL_GUARDED_BY(mu_) = false;
  bool helper_done_ ABSL_GUARDED_BY(mu_) = false;
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  absl::StatusOr<std::vector<std::vector<float>>> helper_result_ ABSL_GUARDED_BY(mu_);
  std::jthread helper_;  // last: starts after the fields above exist, joins first
};

}  // namespace hmoe::decode
