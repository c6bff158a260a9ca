#pragma once

// Token sampling and stop conditions for one request.
//
// Pipeline per step (the order vLLM and Hugging Face use):
//   1. repetition penalty over every token of the prompt and the output so far: a logit l of a
//      token seen before becomes l / p when l > 0, else l * p (p = repetition_penalty, 1 = off);
//   2. presence penalty over the tokens generated so far: l -= presence_penalty for each distinct
//      token that occurs in the output (OpenAI semantics; 0 = off);
//   3. temperature == 0: greedy (arg-max, lowest id on ties) — steps 4-7 are skipped;
//   4. l /= temperature;
//   5. top-k: keep the k largest logits (0 = off; ties at the k-th value are all kept);
//   6. top-p: keep the smallest set of most likely tokens whose probability sums to >= top_p
//      (1 = off; the most likely token is always kept);
//   7. min-p: drop tokens whose probability is below min_p * (the largest probability) (0 = off);
//   8. sample from the softmax of the kept logits with a uniform number u in [0, 1) that is a
//      pure function of (seed, step): the same seed and the same logits give the same tokens,
//      whatever else runs in the process (counter-based RNG, no hidden state).
// Stop conditions: an end-of-sequence token (the model's eos_token_ids, unless ignore_eos), a
// stop token id, or max_new_tokens generated tokens.

#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

#include "common/sampling/sampling.h"

namespace hmoe {

// A uniform double in [0, 1) that depends only on (seed, step) (splitmix64-style hashing of the
// pair; 53 random bits).
double CounterUniform(uint64_t seed, uint64_t step);

// The sampling state of one request: its parameters, the prompt and the tokens generated so far.
// Not thread-safe (one request, one thread at a time).
class Sampler {
 public:
  // `eos_token_ids`: the model's end-of-sequence ids. `params` must satisfy
  // ValidateSamplingParams: the process that received them checked them (common/sampling);
  // debug builds assert it.
  static Sampler Create(const SamplingParams& params, std::span<const int32_t> prompt,
                        std::vector<int32_t> eos_token_ids);

  // Picks the next token from `logits` (vocab_size values; not modified) for step
  // generated().size(). Does not record it: call Accept. InvalidArgument for empty logits.
  absl::StatusOr<int32_t> Sample(std::span<const float> logits) const;
  // Records `token` as generated and returns why generation must stop now: kEos, kStop (a stop
  // token id), kLength, or kNone (continue).
  FinishReason Accept(int32_t token);

  const std::vector<int32_t>& generated() const { return generated_; }
  const SamplingParams& params() const { return params_; }

  // The probability distribution steps 1-7 produce for `logits` at the current state (zeros for
  // dropped tokens; a one-hot vector when greedy). For tests and logprobs.
  std::vector<double> Distribution(std::span<const float> logits) const;

 private:
  Sampler(const SamplingParams& params, std::span<const int32_t> prompt,
          std::vector<int32_t> eos_token_ids);
  // Steps 1-2 applied to a copy of `logits`.
  std::vector<float> Penalized(std::span<const float> logits) const;

  SamplingParams params_;
  std::vector<int32_t> eos_;
  std::vector<int32_t> generated_;
  // Distinct tokens of prompt + output (repetition) and of the output (presence), sorted.
  std::vector<int32_t> seen_all_;
  std::vector<int32_t> seen_output_;
};

}  // namespace hmoe
