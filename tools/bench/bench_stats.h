#pragma once

// Statistics of `hmoe bench` (docs/bench.md): percentiles, per-request latency metrics, SLO
// attainment and goodput. Pure functions over plain records, no I/O and no clock, so the unit
// tests (tests/tools/bench_stats_test.cc) check them against values computed by hand.

#include <cstdint>
#include <span>
#include <string>
#include <vector>

namespace hmoe::bench {

// The q-th percentile (q in [0, 100]) of `values` by linear interpolation between closest ranks
// (Hyndman & Fan type 7, numpy.percentile's default): with the n values sorted ascending as
// x[0..n-1] and h = (n - 1) * q / 100, it is x[floor(h)] + (h - floor(h)) * (x[floor(h) + 1] -
// x[floor(h)]). p0 is the minimum, p100 the maximum, p50 of an even count the mean of the two
// middle values. NaN for no values; q is clamped to [0, 100].
double Percentile(std::span<const double> values, double q);

// count, mean, min, max and p50/p90/p99 of a sample (all NaN but count when it is empty).
struct Distribution {
  int64_t count = 0;
  double mean = 0;
  double min = 0;
  double max = 0;
  double p50 = 0;
  double p90 = 0;
  double p99 = 0;
};
Distribution Describe(std::span<const double> values);

// One request as the client saw it. Times are seconds on the client's monotonic clock, relative
// to the start of the run.
struct RequestRecord {
  bool ok = false;              // the call ended with status OK
  double start_s = 0;           // the call was made
  double end_s = 0;             // the stream ended
  std::vector<double> token_s;  // arrival time of each streamed token (or event, see below)
  // The generated tokens when the stream does not bring one message per token (HTTP: events carry
  // text, one or more tokens, and usage counts them); -1: token_s.size().
  int64_t counted_tokens = -1;
  int64_t prompt_tokens = 0;
  bool warmup = false;  // left out of the summary
};

// Per-request metrics derived from a record (NaN where undefined).
//   output tokens: counted_tokens when >= 0, else token_s.size();
//   ttft: first token - start (NaN without tokens);
//   e2e: end - start;
//   itl: the gaps between consecutive entries of token_s (tokens, or HTTP events);
//   tpot: (last token - first token) / (n - 1) with n the output tokens (NaN with fewer than two
//   tokens or fewer than two entries of token_s); for one entry per token, the mean of the gaps.
int64_t OutputTokens(const RequestRecord& r);
double Ttft(const RequestRecord& r);
double E2e(const RequestRecord& r);
double Tpot(const RequestRecord& r);
std::vector<double> InterTokenGaps(const RequestRecord& r);

// Service-level objectives (the paper's: TTFT <= 30 s, TPOT <= 50 ms, i.e. > 20 tok/s).
struct Slo {
  double ttft_s = 30;
  double tpot_s = 0.050;
};

// A request meets the SLOs when it succeeded, streamed at least one token, its TTFT <= ttft_s and
// its TPOT <= tpot_s (a request without a TPOT, e.g. of a single token, meets that part). Bounds
// are inclusive.
bool MeetsSlo(const RequestRecord& r, const Slo& slo);

struct Summary {
  int64_t requests = 0;  // measured (warm-up left out)
  int64_t succeeded = 0;
  int64_t failed = 0;
  // From the first measured request's start to the last measured request's end (0 without any).
  double duration_s = 0;
  int64_t output_tokens = 0;      // output tokens of the succeeded requests
  int64_t prompt_tokens = 0;      // prompt tokens of the succeeded requests
  double request_throughput = 0;  // succeeded / duration_s (requests/s)
  double output_throughput = 0;   // output_tokens / duration_s (tokens/s)
  int64_t slo_met = 0;            // requests meeting both SLOs (MeetsSlo)
  double slo_attainment = 0;      // slo_met / requests (failed requests count as misses)
  double goodput = 0;             // slo_met / duration_s (requests/s)
  // Over the succeeded requests (itl: every gap of every succeeded request).
  Distribution ttft;
  Distribution tpot;
  Distribution itl;
  Distribution e2e;
};
Summary Summarize(std::span<const RequestRecord> records, const Slo& slo);

}  // namespace hmoe::bench
