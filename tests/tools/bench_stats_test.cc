// `hmoe bench`'s statistics and workload (tools/bench): percentiles, per-request metrics, SLOs,
// goodput, the Fig. 18 normalization, length and arrival generators, against values computed by
// hand. Tolerances: the inputs are exact binary fractions or short decimal sums of magnitude
// <= 100, so results agree with the hand values to a few ulps; 1e-12 bounds that.

#include "tools/bench/bench_stats.h"

#include <algorithm>
#include <cmath>
#include <random>
#include <vector>

#include "tools/bench/bench_runner.h"
#include "tools/bench/workload.h"

#include "gtest/gtest.h"

namespace hmoe::bench {
namespace {

constexpr double kTol = 1e-12;

TEST(PercentileTest, InterpolatesBetweenClosestRanks) {
  const std::vector<double> x = {4, 1, 3, 2};  // sorted: 1 2 3 4, n - 1 = 3
  EXPECT_NEAR(Percentile(x, 0), 1, kTol);
  EXPECT_NEAR(Percentile(x, 50), 2.5, kTol);   // h = 1.5
  EXPECT_NEAR(Percentile(x, 90), 3.7, kTol);   // h = 2.7: 3 + 0.7 * (4 - 3)
  EXPECT_NEAR(Percentile(x, 99), 3.97, kTol);  // h = 2.97
  EXPECT_NEAR(Percentile(x, 100), 4, kTol);
  const std::vector<double> y = {50, 10, 40, 20, 30};  // n - 1 = 4
  EXPECT_NEAR(Percentile(y, 50), 30, kTol);            // h = 2 exactly
  EXPECT_NEAR(Percentile(y, 90), 46, kTol);            // h = 3.6: 40 + 0.6 * 10
  EXPECT_NEAR(Percentile(y, 99), 49.6, kTol);          // h = 3.96
  EXPECT_NEAR(Percentile(y, 25), 20, kTol);            // h = 1
  EXPECT_NEAR(Percentile(y, 10), 14, kTol);            // h = 0.4: 10 + 0.4 * 10
}

TEST(PercentileTest, EdgeCases) {
  EXPECT_TRUE(std::isnan(Percentile(std::vector<double>{}, 50)));
  EXPECT_EQ(Percentile(std::vector<double>{7}, 0), 7);
  EXPECT_EQ(Percentile(std::vector<double>{7}, 99), 7);
  // q outside [0, 100] is clamped.
  EXPECT_EQ(Percentile(std::vector<double>{1, 2}, -5), 1);
  EXPECT_EQ(Percentile(std::vector<double>{1, 2}, 150), 2);
}

TEST(DescribeTest, MeanMinMaxAndPercentiles) {
  const Distribution d = Describe(std::vector<double>{50, 10, 40, 20, 30});
  EXPECT_EQ(d.count, 5);
  EXPECT_NEAR(d.mean, 30, kTol);
  EXPECT_EQ(d.min, 10);
  EXPECT_EQ(d.max, 50);
  EXPECT_NEAR(d.p50, 30, kTol);
  EXPECT_NEAR(d.p90, 46, kTol);
  EXPECT_NEAR(d.p99, 49.6, kTol);
  const Distribution e = Describe(std::vector<double>{});
  EXPECT_EQ(e.count, 0);
  EXPECT_TRUE(std::isnan(e.mean));
  EXPECT_TRUE(std::isnan(e.p99));
}

RequestRecord Rec(double start, std::vector<double> tokens, double end, bool ok = true) {
  RequestRecord r;
  r.ok = ok;
  r.start_s = start;
  r.token_s = std::move(tokens);
  r.end_s = end;
  return r;
}

TEST(RequestMetricsTest, TtftTpotGapsEndToEnd) {
  const RequestRecord r = Rec(1.0, {1.5, 1.625, 1.875}, 2.0);
  EXPECT_NEAR(Ttft(r), 0.5, kTol);
  EXPECT_NEAR(Tpot(r), 0.1875, kTol);  // (1.875 - 1.5) / 2
  const std::vector<double> gaps = InterTokenGaps(r);
  ASSERT_EQ(gaps.size(), 2u);
  EXPECT_NEAR(gaps[0], 0.125, kTol);
  EXPECT_NEAR(gaps[1], 0.25, kTol);
  EXPECT_NEAR(E2e(r), 1.0, kTol);
  // One token: TTFT but no TPOT; none: neither.
  EXPECT_NEAR(Ttft(Rec(0, {0.25}, 0.5)), 0.25, kTol);
  EXPECT_TRUE(std::isnan(Tpot(Rec(0, {0.25}, 0.5))));
  EXPECT_TRUE(std::isnan(Ttft(Rec(0, {}, 0.5))));
  EXPECT_TRUE(InterTokenGaps(Rec(0, {}, 0.5)).empty());
}

TEST(SloTest, BoundsAreInclusiveAndBothMustHold) {
  const Slo slo{/*ttft_s=*/0.5, /*tpot_s=*/0.125};
  EXPECT_TRUE(MeetsSlo(Rec(0, {0.5, 0.625, 0.75}, 1), slo));   // TTFT 0.5, TPOT 0.125: equal
  EXPECT_FALSE(MeetsSlo(Rec(0, {0.75, 0.8, 0.85}, 1), slo));   // TTFT over
  EXPECT_FALSE(MeetsSlo(Rec(0, {0.25, 0.5, 0.75}, 1), slo));   // TPOT 0.25 over
  EXPECT_TRUE(MeetsSlo(Rec(0, {0.25}, 1), slo));               // one token: no TPOT to miss
  EXPECT_FALSE(MeetsSlo(Rec(0, {}, 1), slo));                  // no token
  EXPECT_FALSE(MeetsSlo(Rec(0, {0.25, 0.3}, 1, false), slo));  // failed
}

TEST(SummarizeTest, ThroughputGoodputAndAttainmentByHand) {
  const Slo slo{/*ttft_s=*/1.0, /*tpot_s=*/0.1};
  std::vector<RequestRecord> r;
  // Warm-up: left out entirely (its times would otherwise stretch the duration).
  r.push_back(Rec(-10, {-9.5, -9.4}, -9));
  r.back().warmup = true;
  // A: meets (TTFT 0.5, TPOT 0.05), 3 tokens, 100 prompt tokens.
  r.push_back(Rec(0, {0.5, 0.55, 0.6}, 0.75));
  r.back().prompt_tokens = 100;
  // B: misses TTFT (2.0), 2 tokens, 50 prompt tokens.
  r.push_back(Rec(1, {3, 3.0625}, 3.5));
  r.back().prompt_tokens = 50;
  // C: misses TPOT (0.25), 3 tokens.
  r.push_back(Rec(2, {2.25, 2.5, 2.75}, 4));
  // D: failed after one token (its tokens are not counted).
  r.push_back(Rec(3, {3.5}, 3.75, /*ok=*/false));
  const Summary s = Summarize(r, slo);
  EXPECT_EQ(s.requests, 4);
  EXPECT_EQ(s.succeeded, 3);
  EXPECT_EQ(s.failed, 1);
  EXPECT_NEAR(s.duration_s, 4.0, kTol);  // first start 0, last end 4
  EXPECT_EQ(s.output_tokens, 8);         // 3 + 2 + 3
  EXPECT_EQ(s.prompt_tokens, 150);
  EXPECT_EQ(s.slo_met, 1);
  EXPECT_NEAR(s.slo_attainment, 0.25, kTol);
  EXPECT_NEAR(s.goodput, 0.25, kTol);             // 1 / 4 s
  EXPECT_NEAR(s.request_throughput, 0.75, kTol);  // 3 / 4 s
  EXPECT_NEAR(s.output_throughput, 2.0, kTol);    // 8 / 4 s
  // TTFT over A, B, C: 0.5, 2.0, 0.25.
  EXPECT_EQ(s.ttft.count, 3);
  EXPECT_NEAR(s.ttft.mean, 2.75 / 3, kTol);
  EXPECT_NEAR(s.ttft.p50, 0.5, kTol);
  EXPECT_NEAR(s.ttft.p90, 1.7, kTol);  // sorted 0.25 0.5 2.0, h = 1.8: 0.5 + 0.8 * 1.5
  // TPOT: 0.05, 0.0625, 0.25; ITL: 0.05 0.05 | 0.0625 | 0.25 0.25.
  EXPECT_EQ(s.tpot.count, 3);
  EXPECT_NEAR(s.tpot.p50, 0.0625, kTol);
  EXPECT_EQ(s.itl.count, 5);
  EXPECT_NEAR(s.itl.p50, 0.0625, kTol);
  EXPECT_NEAR(s.itl.mean, 0.6625 / 5, kTol);
  // End-to-end: 0.75, 2.5, 2.
  EXPECT_NEAR(s.e2e.max, 2.5, kTol);
  EXPECT_NEAR(s.e2e.p50, 2.0, kTol);
}

TEST(SummarizeTest, NothingMeasured) {
  const Summary s = Summarize(std::vector<RequestRecord>{}, Slo{});
  EXPECT_EQ(s.requests, 0);
  EXPECT_EQ(s.duration_s, 0);
  EXPECT_EQ(s.goodput, 0);
  EXPECT_EQ(s.slo_attainment, 0);
}

TEST(ScenarioTest, ParsesShapes) {
  absl::StatusOr<ScenarioShape> s = ParseScenario("1P+2D");
  ASSERT_TRUE(s.ok()) << s.status();
  EXPECT_EQ(s->prefills, 1);
  EXPECT_EQ(s->decodes, 2);
  s = ParseScenario("2D");
  ASSERT_TRUE(s.ok());
  EXPECT_EQ(s->prefills, 0);
  EXPECT_EQ(s->decodes, 2);
  for (const char* bad : {"", "P", "1X", "0D", "1P+", "+1D", "1p", "65D", "xP"}) {
    absl::StatusOr<ScenarioShape> b = ParseScenario(bad);
    EXPECT_FALSE(b.ok()) << bad;
    if (!b.ok()) {
      EXPECT_EQ(b.status().code(), absl::StatusCode::kInvalidArgument);
      EXPECT_NE(b.status().message().find("--scenario"), absl::string_view::npos);
    }
  }
}

ScenarioResult Result(const char* name, int p, int d, double ttft, double tpot, double total) {
  ScenarioResult r;
  r.shape = {name, p, d};
  r.mean_p_ttft_s = ttft;
  r.mean_d_tpot_s = tpot;
  r.mean_total_s = total;
  return r;
}

TEST(ScenarioTest, NormalizesToOnePrefillAndOneDecode) {
  const double nan = std::nan("");
  std::vector<ScenarioResult> r = {Result("1P", 1, 0, 20, nan, 20.5),
                                   Result("1D", 0, 1, nan, 0.05, 24),
                                   Result("1P+2D", 1, 2, 25, 0.075, 41)};
  Normalize(r);
  EXPECT_NEAR(r[0].norm_p_ttft, 1, kTol);
  EXPECT_NEAR(r[0].norm_total, 1, kTol);
  EXPECT_TRUE(std::isnan(r[0].norm_d_tpot));
  EXPECT_NEAR(r[1].norm_d_tpot, 1, kTol);
  EXPECT_NEAR(r[1].norm_total, 24 / 20.5, kTol);
  EXPECT_NEAR(r[2].norm_p_ttft, 1.25, kTol);
  EXPECT_NEAR(r[2].norm_d_tpot, 1.5, kTol);
  EXPECT_NEAR(r[2].norm_total, 2, kTol);
  // Without a 1P baseline the prefill ratios are undefined.
  std::vector<ScenarioResult> only = {Result("2D", 0, 2, nan, 0.06, 30)};
  Normalize(only);
  EXPECT_TRUE(std::isnan(only[0].norm_d_tpot));
  EXPECT_TRUE(std::isnan(only[0].norm_total));
}

TEST(WorkloadTest, ParsesLengthSpecs) {
  absl::StatusOr<LengthSpec> s = ParseLengthSpec("128", false, "--prompt-len");
  ASSERT_TRUE(s.ok());
  EXPECT_EQ(s->kind, LengthSpec::Kind::kFixed);
  EXPECT_EQ(s->a, 128);
  s = ParseLengthSpec("uniform:4:64", false, "--prompt-len");
  ASSERT_TRUE(s.ok());
  EXPECT_EQ(s->kind, LengthSpec::Kind::kUniform);
  EXPECT_EQ(s->b, 64);
  s = ParseLengthSpec("chat", true, "--output-len");
  ASSERT_TRUE(s.ok());
  EXPECT_EQ(s->kind, LengthSpec::Kind::kLogNormal);
  EXPECT_EQ(s->a, 120);
  for (const char* bad : {"", "0", "-3", "x", "uniform:5:4", "uniform:0:4", "uniform:1",
                          "lognormal:100:-1", "lognormal:100:nan", "zipf:1:2"}) {
    absl::StatusOr<LengthSpec> b = ParseLengthSpec(bad, false, "--prompt-len");
    EXPECT_FALSE(b.ok()) << bad;
    if (!b.ok()) {
      EXPECT_EQ(b.status().code(), absl::StatusCode::kInvalidArgument);
      EXPECT_NE(b.status().message().find("--prompt-len"), absl::string_view::npos);
    }
  }
}

TEST(WorkloadTest, SamplesWithinBoundsAndCaps) {
  std::mt19937_64 rng(1);
  const LengthSpec fixed = *ParseLengthSpec("100", false, "f");
  EXPECT_EQ(SampleLength(fixed, 1000, rng), 100);
  EXPECT_EQ(SampleLength(fixed, 60, rng), 60);  // capped
  const LengthSpec uni = *ParseLengthSpec("uniform:3:5", false, "f");
  std::vector<int> seen(6, 0);
  for (int i = 0; i < 3000; ++i) {
    const int64_t n = SampleLength(uni, 1000, rng);
    ASSERT_GE(n, 3);
    ASSERT_LE(n, 5);
    ++seen[n];
  }
  // Each value has probability 1/3: 1000 expected, standard deviation ~26; 800 is > 7 sigma.
  for (int v = 3; v <= 5; ++v) EXPECT_GT(seen[v], 800) << v;
  // The lognormal's median is MEDIAN: the sample median of 20001 draws lies within 3 % (its
  // standard error is ~1.25 sigma / sqrt(n) = 0.9 % here).
  const LengthSpec ln = *ParseLengthSpec("lognormal:200:1", false, "f");
  std::vector<int64_t> v;
  for (int i = 0; i < 20001; ++i) v.push_back(SampleLength(ln, 1 << 30, rng));
  std::nth_element(v.begin(), v.begin() + 10000, v.end());
  EXPECT_NEAR(static_cast<double>(v[10000]), 200, 6);
  EXPECT_EQ(SampleLength(ln, 1, rng), 1);
}

TEST(WorkloadTest, ArrivalTimes) {
  std::mt19937_64 rng(7);
  ArrivalSpec burst;
  burst.kind = ArrivalSpec::Kind::kBurst;
  burst.rate = 6;
  burst.burst_size = 3;  // a burst every 0.5 s
  const std::vector<double> b = ArrivalTimes(burst, 7, rng);
  const std::vector<double> want = {0, 0, 0, 0.5, 0.5, 0.5, 1.0};
  ASSERT_EQ(b.size(), want.size());
  for (size_t i = 0; i < b.size(); ++i) EXPECT_NEAR(b[i], want[i], kTol) << i;

  ArrivalSpec poisson;
  poisson.rate = 4;
  const int n = 40001;
  const std::vector<double> p = ArrivalTimes(poisson, n, rng);
  ASSERT_EQ(p.size(), static_cast<size_t>(n));
  EXPECT_EQ(p[0], 0);
  EXPECT_TRUE(std::is_sorted(p.begin(), p.end()));
  // Mean gap 1 / rate = 0.25 s; its standard error is 0.25 / sqrt(40000) = 0.5 %: 3 % is 6 sigma.
  EXPECT_NEAR(p.back() / (n - 1), 0.25, 0.25 * 0.03);

  ArrivalSpec closed;
  closed.kind = ArrivalSpec::Kind::kClosed;
  EXPECT_TRUE(ArrivalTimes(closed, 5, rng).empty());
  EXPECT_FALSE(ParseArrivalKind("uniform").ok());
  EXPECT_EQ(*ParseArrivalKind("closed"), ArrivalSpec::Kind::kClosed);
}

TEST(WorkloadTest, PlannedRequestsFitTheContextAndVocabulary) {
  std::mt19937_64 rng(3);
  const LengthSpec prompt = *ParseLengthSpec("chat", false, "p");
  const LengthSpec output = *ParseLengthSpec("chat", true, "o");
  const std::vector<PlannedRequest> plan = PlanRequests(500, prompt, output, 1024, 512, rng);
  ASSERT_EQ(plan.size(), 500u);
  for (const PlannedRequest& r : plan) {
    ASSERT_GE(r.max_new_tokens, 1);
    ASSERT_GE(r.prompt.size(), 1u);
    ASSERT_LE(static_cast<int64_t>(r.prompt.size()) + r.max_new_tokens, 512);
    for (int32_t id : r.prompt) {
      ASSERT_GE(id, 10);
      ASSERT_LT(id, 1024);
    }
  }
  // The same seed gives the same workload.
  std::mt19937_64 a(9), b(9);
  const std::vector<PlannedRequest> x = PlanRequests(20, prompt, output, 1024, 4096, a);
  const std::vector<PlannedRequest> y = PlanRequests(20, prompt, output, 1024, 4096, b);
  for (size_t i = 0; i < x.size(); ++i) {
    EXPECT_EQ(x[i].prompt, y[i].prompt);
    EXPECT_EQ(x[i].max_new_tokens, y[i].max_new_tokens);
  }
}

}  // namespace
}  // namespace hmoe::bench
