#pragma once

// The internal wire format (proto/decode.proto, which the prefill worker's messages share) to and
// from the one internal form of the sampling settings and the finish reason (common/sampling).
// One conversion for both workers and the router: the prefill worker samples a request's first
// token and the decode worker continues the same request, so both must read the message the same
// way (proto3 zeros mean "off": top_p 0 and repetition_penalty 0 become 1). Header-only: the
// router includes it without linking hmoe::rpc.

#include "common/sampling/sampling.h"
#include "proto/decode.pb.h"

namespace hmoe::rpc {

// Sets temperature, top_k, top_p, min_p, repetition_penalty, presence_penalty and seed of `out`
// (max_new_tokens, stop ids and ignore_eos come from elsewhere in the request). Values are not
// validated here: the receiving process does (ValidateSamplingParams).
inline void SamplingFromProto(const decode::v1::SamplingParams& s, SamplingParams* out) {
  out->temperature = s.temperature();
  out->top_k = s.top_k();
  out->top_p = s.top_p() == 0.0f ? 1.0f : s.top_p();
  out->min_p = s.min_p();
  out->repetition_penalty = s.repetition_penalty() == 0.0f ? 1.0f : s.repetition_penalty();
  out->presence_penalty = s.presence_penalty();
  out->seed = s.seed();
}

// The inverse of SamplingFromProto for the same fields.
inline decode::v1::SamplingParams SamplingToProto(const SamplingParams& s) {
  decode::v1::SamplingParams p;
  p.set_temperature(s.temperature);
  p.set_top_k(s.top_k);
  p.set_top_p(s.top_p);
  p.set_min_p(s.min_p);
  p.set_repetition_penalty(s.repetition_penalty);
  p.set_presence_penalty(s.presence_penalty);
  p.set_seed(s.seed);
  return p;
}

inline decode::v1::FinishReason FinishReasonToProto(FinishReason r) {
  switch (r) {
    case FinishReason::kEos:
      return decode::v1::FINISH_REASON_EOS;
    case FinishReason::kStop:
      return decode::v1::FINISH_REASON_STOP;
    case FinishReason::kLength:
      return decode::v1::FINISH_REASON_LENGTH;
    case FinishReason::kCancelled:
      return decode::v1::FINISH_REASON_CANCELLED;
    case FinishReason::kError:
      return decode::v1::FINISH_REASON_ERROR;
    case FinishReason::kNone:
      break;
  }
  return decode::v1::FINISH_REASON_UNSPECIFIED;
}

// FINISH_REASON_UNSPECIFIED and unknown values: kNone.
inline FinishReason FinishReasonFromProto(decode::v1::FinishReason r) {
  switch (r) {
    case decode::v1::FINISH_REASON_EOS:
      return FinishReason::kEos;
    case decode::v1::FINISH_REASON_STOP:
      return FinishReason::kStop;
    case decode::v1::FINISH_REASON_LENGTH:
      return FinishReason::kLength;
    case decode::v1::FINISH_REASON_CANCELLED:
      return FinishReason::kCancelled;
    case decode::v1::FINISH_REASON_ERROR:
      return FinishReason::kError;
    default:
      return FinishReason::kNone;
  }
}

}  // namespace hmoe::rpc
