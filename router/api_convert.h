#pragma once

// The public API's wire format (proto/hmoe_v1.proto) to and from the internal forms of the
// sampling settings and the finish reason (common/sampling). The internal wire format has its own
// converter (common/rpc/sampling_proto.h); the router passes settings from one to the other
// through the internal form, so each rule is written once.

#include "common/sampling/sampling.h"
#include "proto/hmoe_v1.pb.h"

namespace hmoe::router {

// The sampling settings, max_new_tokens, stop token ids and ignore_eos of `request` (proto3
// zeros mean "off": top_p 0 and repetition_penalty 0 become 1). Not validated here:
// ValidateGenerateRequest does.
SamplingParams SamplingFromApi(const v1::GenerateRequest& request);

// kNone: FINISH_REASON_UNSPECIFIED.
v1::FinishReason FinishReasonToApi(FinishReason reason);

}  // namespace hmoe::router
