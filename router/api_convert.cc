#include "router/api_convert.h"

namespace hmoe::router {

SamplingParams SamplingFromApi(const v1::GenerateRequest& request) {
  const v1::SamplingParams& s = request.sampling();
  SamplingParams p;
  p.temperature = s.temperature();
  p.top_k = s.top_k();
  p.top_p = s.top_p() == 0.0f ? 1.0f : s.top_p();
  p.min_p = s.min_p();
  p.repetition_penalty = s.repetition_penalty() == 0.0f ? 1.0f : s.repetition_penalty();
  p.presence_penalty = s.presence_penalty();
  p.seed = s.seed();
  p.max_new_tokens = request.max_new_tokens();
  p.stop_token_ids.assign(request.stop_token_ids().begin(), request.stop_token_ids().end());
  p.ignore_eos = request.ignore_eos();
  return p;
}

v1::FinishReason FinishReasonToApi(FinishReason reason) {
  switch (reason) {
    case FinishReason::kEos:
      return v1::FINISH_REASON_EOS;
    case FinishReason::kStop:
      return v1::FINISH_REASON_STOP;
    case FinishReason::kLength:
      return v1::FINISH_REASON_LENGTH;
    case FinishReason::kCancelled:
      return v1::FINISH_REASON_CANCELLED;
    case FinishReason::kError:
      return v1::FINISH_REASON_ERROR;
    case FinishReason::kNone:
      break;
  }
  return v1::FINISH_REASON_UNSPECIFIED;
}

}  // namespace hmoe::router
