#pragma once

// What a decode-worker step costs, learned from the worker's own steps, and the packing rule
// built on it.
//
// A step's time is fitted as fixed + per_token * tokens (weighted least squares with exponential
// forgetting, so the fit follows the machine: bandwidth modes, longer contexts). `fixed` is what
// every step pays whatever it carries — above all reading the weights — and `per_token` what one
// more token adds (compute, and the experts it adds).
//
// Packing rule. A step S1 already carries `sharing` sequences (decode tokens and prefill
// chunks), each of which ends S1 with a token or a chunk done. Taking a prefill chunk of n more
// tokens into S1 delays those `sharing` events by per_token * n. Not taking it puts the chunk
// into the next step S2 (it is next in FIFO order), so it finishes one step later — by S2's
// time, at least fixed + per_token * sharing (every sequence of S1 is in S2 with >= 1 token) —
// while S2's events happen at the same time either way (S2 starts per_token * n later when S1
// took the chunk, and runs per_token * n shorter). Packing lowers the summed latency when
//   sharing * per_token * n < fixed + per_token * sharing,
// i.e. sharing * per_token * (n - 1) < fixed. On a memory-bound node (many cores per memory
// channel, GPU attention) `fixed` dominates and short prompts share steps; on a compute-bound
// one (this 2-core VM: the FP8 GEMV is compute-bound from ~3 tokens) they do not, except
// 1-token prompts. Until the fit has enough steps of different sizes, nothing is packed.
//
// Thread-compatible (the scheduler's engine thread owns it).

#include <cstdint>
#include <optional>

namespace hmoe::decode {

struct StepCost {
  double fixed_us = 0;      // >= 0
  double per_token_us = 0;  // >= 0

  // Whether a chunk of `tokens` prompt tokens should join a step of `sharing` sequences.
  bool WorthPacking(int64_t sharing, int64_t tokens) const {
    return static_cast<double>(sharing) * per_token_us * static_cast<double>(tokens - 1) < fixed_us;
  }
};

class StepCostModel {
 public:
  // `decay`: weight kept by the older samples per new one (0 < decay <= 1); `min_samples`:
  // steps before an estimate is given.
  explicit StepCostModel(double decay = 0.98, int min_samples = 16);

  // One step of `tokens` tokens (>= 1) that took `micros`.
  void Add(int64_t tokens, double micros);

  // The fit, or nullopt until min_samples steps with at least two different token counts (the
  // weighted spread of token counts must be >= 0.25 token^2). Both terms are clamped at 0.
  std::optional<StepCost> Estimate() const;

  int samples() const { return samples_; }

 private:
  double decay_;
  int min_samples_;
  int samples_ = 0;
  // Exponentially weighted sums: weights, tokens, micros, tokens^2, tokens*micros.
  double w_ = 0, x_ = 0, y_ = 0, xx_ = 0, xy_ = 0;
};

}  // namespace hmoe::decode
