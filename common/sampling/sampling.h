#pragma once

// A generation request's settings in the one form every layer uses (the router, both workers,
// the engine's Sampler), the rules they obey, and why a generation ended.
//
// Validation happens once, where a process receives a request: the router for the public API
// (router/validation.h), each worker for what the router sends it. Those boundaries call
// ValidateSamplingParams and CheckFitsContext; the layers below them (scheduler, engine, Sampler)
// rely on it and do not check again.

#include <cstdint>
#include <string_view>
#include <vector>

#include "absl/status/status.h"

namespace hmoe {

struct SamplingParams {
  float temperature = 0.0f;         // >= 0; 0: greedy
  int32_t top_k = 0;                // >= 0; 0: off
  float top_p = 1.0f;               // (0, 1]; 1: off
  float min_p = 0.0f;               // [0, 1]; 0: off
  float repetition_penalty = 1.0f;  // > 0; 1: off
  float presence_penalty = 0.0f;    // finite; 0: off (may be negative)
  uint64_t seed = 0;
  int64_t max_new_tokens = 16;  // >= 1
  std::vector<int32_t> stop_token_ids;
  bool ignore_eos = false;
};

// The rules above. InvalidArgument whose message starts with the field, as the public API names
// it ("sampling.top_p: must be in (0, 1] (0 on the wire: off), got 1.5"; "max_new_tokens: must be
// >= 1, got 0"). Stop token ids are checked against the vocabulary where it is known.
absl::Status ValidateSamplingParams(const SamplingParams& params);

// prompt + max_new_tokens must fit the context: InvalidArgument "<field>: too long: prompt (N
// tokens) + max_new_tokens (M) = T exceeds the context length C" otherwise. context_length <= 0:
// unchecked.
absl::Status CheckFitsContext(std::string_view field, int64_t prompt_tokens, int64_t max_new_tokens,
                              int64_t context_length);

// Why a generation ended. kNone: it goes on (Sampler::Accept).
enum class FinishReason {
  kNone,
  kEos,        // sampled an end-of-sequence token of the model
  kStop,       // sampled a stop token id (or the router matched a stop string)
  kLength,     // max_new_tokens generated
  kCancelled,  // cancelled, or the worker shut down first
  kError,      // failed: the status says why
};
// "none", "eos", "stop", "length", "cancelled", "error".
const char* FinishReasonName(FinishReason reason);

}  // namespace hmoe
