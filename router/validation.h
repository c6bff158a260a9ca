#pragma once

// Validation of public Generate requests (proto/hmoe_v1.proto). Every error is InvalidArgument
// with a message that starts with the offending field ("sampling.top_p: must be 0 or in (0, 1],
// got 1.5"), so clients can tell what to fix. Pure functions; thread-safe.

#include <cstdint>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

#include "proto/hmoe_v1.pb.h"

namespace hmoe {
class Tokenizer;
}

namespace hmoe::router {

// What requests are checked against (from the model's config.json and tokenizer).
struct ModelLimits {
  // Token ids must be in [0, vocab_size).
  int32_t vocab_size = 0;
  // prompt + max_new_tokens must be <= context_length.
  int32_t context_length = 0;
  // Largest serialized request (0: unchecked). The gRPC server's own receive limit is set higher
  // (main.cc), so most oversized requests get this clear INVALID_ARGUMENT; beyond the transport
  // limit gRPC itself answers RESOURCE_EXHAUSTED.
  int64_t max_request_bytes = 0;
};

// Longest request id accepted.
inline constexpr int kMaxRequestIdLength = 128;

// The router's validation of a public request (gRPC, or another front end that builds the same
// message): checks every field of `request` except the prompt's length against the context
// (which needs the tokenized prompt: see ResolvePrompt). The sampling rules and the context rule
// are common/sampling's, the ones every process boundary applies. `tokenizer` may be null (then
// prompt_text, stop_strings and detokenize are rejected).
absl::Status ValidateGenerateRequest(const hmoe::v1::GenerateRequest& request,
                                     const ModelLimits& limits, const Tokenizer* tokenizer);

// The prompt's token ids: prompt_token_ids as given, or prompt_text encoded with `tokenizer`
// (special-token strings are plain text; BOS added when the tokenizer config asks for it).
// InvalidArgument for an empty prompt, an id outside the vocabulary, or prompt + max_new_tokens
// over the context length. Call after ValidateGenerateRequest.
absl::StatusOr<std::vector<int32_t>> ResolvePrompt(const hmoe::v1::GenerateRequest& request,
                                                   const ModelLimits& limits,
                                                   const Tokenizer* tokenizer);

// Checks the sampling parameters alone (fields named "sampling.<name>"): the rules of
// common/sampling, on the settings SamplingFromApi makes of them.
absl::Status ValidateSampling(const hmoe::v1::SamplingParams& sampling);

// Checks the router's --listen address: HOST:PORT (a name, an IPv4 address or a bracketed IPv6
// address; PORT 0..65535, 0 picks a free one) or unix:/absolute/path. InvalidArgument naming
// --listen otherwise (gRPC itself would bind a port other than the one meant, e.g. for 99999).
absl::Status ValidateListenAddress(const std::string& address);

// The heartbeat period (ms) the router asks workers for, from --heartbeat_timeout_ms and
// --heartbeat_interval_ms: 0 means a third of the timeout, at most 1000. A worker beating every
// period arrives a period plus its RPC time after its last beat, so a timeout under two periods
// would show live workers as DEAD for part of every period: InvalidArgument naming both flags, as
// for a timeout under 2 or a negative period.
absl::StatusOr<int> ResolveHeartbeatIntervalMs(int timeout_ms, int interval_ms);

}  // namespace hmoe::router
