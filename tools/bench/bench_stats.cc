#include "tools/bench/bench_stats.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>

namespace hmoe::bench {
namespace {

constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();

double SortedPercentile(const std::vector<double>& x, double q) {
  if (x.empty()) return kNaN;
  q = std::clamp(q, 0.0, 100.0);
  const double h = static_cast<double>(x.size() - 1) * q / 100.0;
  const size_t lo = static_cast<size_t>(std::floor(h));
  if (lo + 1 >= x.size()) return x.back();
  return x[lo] + (h - static_cast<double>(lo)) * (x[lo + 1] - x[lo]);
}

}  // namespace

double Percentile(std::span<const double> values, double q) {
  std::vector<double> x(values.begin(), values.end());
  std::sort(x.begin(), x.end());
  return SortedPercentile(x, q);
}

Distribution Describe(std::span<const double> values) {
  Distribution d;
  d.count = static_cast<int64_t>(values.size());
  if (values.empty()) {
    d.mean = d.min = d.max = d.p50 = d.p90 = d.p99 = kNaN;
    return d;
  }
  std::vector<double> x(values.begin(), values.end());
  std::sort(x.begin(), x.end());
  d.mean = std::accumulate(x.begin(), x.end(), 0.0) / static_cast<double>(x.size());
  d.min = x.front();
  d.max = x.back();
  d.p50 = SortedPercentile(x, 50);
  d.p90 = SortedPercentile(x, 90);
  d.p99 = SortedPercentile(x, 99);
  return d;
}

int64_t OutputTokens(const RequestRecord& r) {
  return r.counted_tokens >= 0 ? r.counted_tokens : static_cast<int64_t>(r.token_s.size());
}

double Ttft(const RequestRecord& r) {
  return r.token_s.empty() ? kNaN : r.token_s.front() - r.start_s;
}

double E2e(const RequestRecord& r) { return r.end_s - r.start_s; }

double Tpot(const RequestRecord& r) {
  const int64_t n = OutputTokens(r);
  if (r.token_s.size() < 2 || n < 2) return kNaN;
  return (r.token_s.back() - r.token_s.front()) / static_cast<double>(n - 1);
}

std::vector<double> InterTokenGaps(const RequestRecord& r) {
  std::vector<double> gaps;
  for (size_t i = 1; i < r.token_s.size(); ++i) gaps.push_back(r.token_s[i] - r.token_s[i - 1]);
  return gaps;
}

bool MeetsSlo(const RequestRecord& r, const Slo& slo) {
  if (!r.ok || r.token_s.empty()) return false;
  if (!(Ttft(r) <= slo.ttft_s)) return false;
  const double tpot = Tpot(r);
  return std::isnan(tpot) || tpot <= slo.tpot_s;
}

Summary Summarize(std::span<const RequestRecord> records, const Slo& slo) {
  Summary s;
  std::vector<double> ttft, tpot, itl, e2e;
  double first = 0, last = 0;
  for (const RequestRecord& r : records) {
    if (r.warmup) continue;
    if (s.requests == 0) {
      first = r.start_s;
      last = r.end_s;
    }
    first = std::min(first, r.start_s);
    last = std::max(last, r.end_s);
    ++s.requests;
    if (MeetsSlo(r, slo)) ++s.slo_met;
    if (!r.ok) {
      ++s.failed;
      continue;
    }
    ++s.succeeded;
    s.output_tokens += OutputTokens(r);
    s.prompt_tokens += r.prompt_tokens;
    if (!r.token_s.empty()) ttft.push_back(Ttft(r));
    if (const double t = Tpot(r); !std::isnan(t)) tpot.push_back(t);
    const std::vector<double> gaps = InterTokenGaps(r);
    itl.insert(itl.end(), gaps.begin(), gaps.end());
    e2e.push_back(E2e(r));
  }
  s.duration_s = s.requests > 0 ? last - first : 0;
  if (s.duration_s > 0) {
    s.request_throughput = static_cast<double>(s.succeeded) / s.duration_s;
    s.output_throughput = static_cast<double>(s.output_tokens) / s.duration_s;
    s.goodput = static_cast<double>(s.slo_met) / s.duration_s;
  }
  if (s.requests > 0) {
    s.slo_attainment = static_cast<double>(s.slo_met) / static_cast<double>(s.requests);
  }
  s.ttft = Describe(ttft);
  s.tpot = Describe(tpot);
  s.itl = Describe(itl);
  s.e2e = Describe(e2e);
  return s;
}

}  // namespace hmoe::bench
