#include "common/sampling/sampling.h"

#include <cmath>

#include "absl/strings/str_cat.h"

namespace hmoe {
namespace {

absl::Status Invalid(absl::string_view field, absl::string_view rule, double got) {
  return absl::InvalidArgumentError(absl::StrCat(field, ": must be ", rule, ", got ", got));
}

}  // namespace

absl::Status ValidateSamplingParams(const SamplingParams& p) {
  if (p.max_new_tokens < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("max_new_tokens: must be >= 1, got ", p.max_new_tokens));
  }
  if (!std::isfinite(p.temperature) || p.temperature < 0) {
    return Invalid("sampling.temperature", "finite and >= 0", p.temperature);
  }
  if (p.top_k < 0) return Invalid("sampling.top_k", ">= 0", p.top_k);
  if (!(p.top_p > 0.0f && p.top_p <= 1.0f)) {
    return Invalid("sampling.top_p", "in (0, 1] (0 on the wire: off)", p.top_p);
  }
  if (!(p.min_p >= 0.0f && p.min_p <= 1.0f)) return Invalid("sampling.min_p", "in [0, 1]", p.min_p);
  if (!std::isfinite(p.repetition_penalty) || !(p.repetition_penalty > 0.0f)) {
    return Invalid("sampling.repetition_penalty", "finite and > 0 (0 on the wire: off)",
                   p.repetition_penalty);
  }
  if (!std::isfinite(p.presence_penalty)) {
    return Invalid("sampling.presence_penalty", "finite", p.presence_penalty);
  }
  return absl::OkStatus();
}

absl::Status CheckFitsContext(std::string_view field, int64_t prompt_tokens, int64_t max_new_tokens,
                              int64_t context_length) {
  const int64_t total = prompt_tokens + max_new_tokens;
  if (context_length <= 0 || total <= context_length) return absl::OkStatus();
  return absl::InvalidArgumentError(
      absl::StrCat(absl::string_view(field.data(), field.size()), ": too long: prompt (",
                   prompt_tokens, " tokens) + max_new_tokens (", max_new_tokens, ") = ", total,
                   " exceeds the context length ", context_length));
}

const char* FinishReasonName(FinishReason reason) {
  switch (reason) {
    case FinishReason::kNone:
      return "none";
    case FinishReason::kEos:
      return "eos";
    case FinishReason::kStop:
      return "stop";
    case FinishReason::kLength:
      return "length";
    case FinishReason::kCancelled:
      return "cancelled";
    case FinishReason::kError:
      return "error";
  }
  return "?";
}

}  // namespace hmoe
