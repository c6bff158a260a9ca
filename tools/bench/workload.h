#pragma once

// The workload of `hmoe bench` (docs/bench.md): request lengths and arrival times, generated
// from a seed (no data set is downloaded). Deterministic: the same spec and seed give the same
// workload on every machine (std::mt19937_64 and our own inverse-CDF sampling, not the
// implementation-defined std:: distributions).

#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "absl/status/statusor.h"

namespace hmoe::bench {

// A distribution of token counts:
//   "N"                          fixed: always N
//   "uniform:A:B"                uniform integers in [A, B]
//   "lognormal:MEDIAN:SIGMA"     long-tailed: round(MEDIAN * exp(SIGMA * z)), z standard normal
//   "chat"                       prompts of a chat service: lognormal:160:1.0 (heavy tail of long
//                                pastes); as an output length: lognormal:120:0.8
// Every sample is clamped to [1, the cap the caller passes].
struct LengthSpec {
  enum class Kind { kFixed, kUniform, kLogNormal };
  Kind kind = Kind::kFixed;
  int64_t a = 0;     // fixed: N; uniform: A; lognormal: the median
  int64_t b = 0;     // uniform: B
  double sigma = 0;  // lognormal
  std::string text;  // as given
};
// `for_output` picks the "chat" preset of output lengths. Bad specs: INVALID_ARGUMENT naming
// `flag`.
absl::StatusOr<LengthSpec> ParseLengthSpec(const std::string& spec, bool for_output,
                                           const std::string& flag);
int64_t SampleLength(const LengthSpec& spec, int64_t cap, std::mt19937_64& rng);

// Uniform in [0, 1) from 53 random bits; a standard normal by Box-Muller.
double Uniform01(std::mt19937_64& rng);
double StandardNormal(std::mt19937_64& rng);

// When requests are sent.
struct ArrivalSpec {
  enum class Kind {
    kPoisson,  // open loop: exponential gaps with mean 1 / rate
    kBurst,    // open loop: burst_size requests at once, bursts every burst_size / rate seconds
    kClosed,   // closed loop: `concurrency` clients, each sends its next request when one ends
  };
  Kind kind = Kind::kPoisson;
  double rate = 1;  // requests per second (open loop)
  int burst_size = 1;
  int concurrency = 1;
};
absl::StatusOr<ArrivalSpec::Kind> ParseArrivalKind(const std::string& name);
const char* ArrivalKindName(ArrivalSpec::Kind kind);

// Send times in seconds from the start for `n` requests (open loop; empty for closed loop, where
// requests go as soon as a client is free). The first request goes at 0.
std::vector<double> ArrivalTimes(const ArrivalSpec& spec, int n, std::mt19937_64& rng);

// One request of the workload.
struct PlannedRequest {
  std::vector<int32_t> prompt;
  int64_t max_new_tokens = 1;
  // Whether the request may use and fill the prefix cache (gRPC `cache_prompt`, HTTP
  // `cache_prompt`). Calibration turns it off: it measures prefill paths, never cache hits.
  bool cache_prompt = true;
};
// `n` requests: lengths from the specs (prompt + output clamped to the context), prompt token ids
// uniform in [10, vocab_size) so they are neither special nor shared between requests.
std::vector<PlannedRequest> PlanRequests(int n, const LengthSpec& prompt, const LengthSpec& output,
                                         int64_t vocab_size, int64_t context_length,
                                         std::mt19937_64& rng);

}  // namespace hmoe::bench
