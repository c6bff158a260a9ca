#pragma once

// Runs one scheduler step on the engine, either as one batch or as two micro-batches overlapped
// attention-against-MoE (paper §3.3.1, Fig. 7): micro-batch A runs on the calling (engine) thread,
// B on the runner's helper thread, and two resource locks, the attention device and the CPU
// experts, make them alternate so that while A runs layer l's MoE, B runs layer l's attention,
// then A runs layer l+1's attention while B runs layer l's MoE, and so on. Embedding and lm_head
// (Begin/Finish) take the attention lock, as on a GPU they are device work.
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

  // Begin, layers and Finish of one micro-batch, taking the resource locks when `overlap`.
  absl::StatusOr<std::vector<std::vector<float>>> RunBatch(StepBatch& batch,
                                                           std::span<const StepInput> inputs,
                                                           bool overlap);
  void HelperLoop(std::stop_token stop);
  bool HelperReady() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return stopping_ || helper_has_work_;
  }

  StepEngine& engine_;
  std::unique_ptr<StepBatch> first_;
  std::unique_ptr<StepBatch> second_;
  StepSplit last_split_;

  // The two resources the micro-batches alternate on.
  absl::Mutex attention_mu_;
  absl::Mutex ffn_mu_;

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
