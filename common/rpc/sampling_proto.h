#pragma once

// hmoe.decode.v1.SamplingParams (the sampling message both workers receive) to the engine's
// SamplingParams. One conversion for both workers: the prefill worker samples a request's first
// token and the decode worker continues the same request, so both must read the message the
// same way (proto3 zeros mean "off": top_p 0 and repetition_penalty 0 become 1).

#include "common/engine/sampler.h"
#include "proto/decode.pb.h"

namespace hmoe::rpc {

// Sets temperature, top_k, top_p, min_p, repetition_penalty, presence_penalty and seed of `out`
// (max_new_tokens, stop ids and ignore_eos come from elsewhere in the request). Values are not
// validated here (ValidateSamplingParams does).
inline void SamplingFromProto(const decode::v1::SamplingParams& s, SamplingParams* out) {
  out->temperature = s.temperature();
  out->top_k = s.top_k();
  out->top_p = s.top_p() == 0.0f ? 1.0f : s.top_p();
  out->min_p = s.min_p();
  out->repetition_penalty = s.repetition_penalty() == 0.0f ? 1.0f : s.repetition_penalty();
  out->presence_penalty = s.presence_penalty();
  out->seed = s.seed();
}

}  // namespace hmoe::rpc
