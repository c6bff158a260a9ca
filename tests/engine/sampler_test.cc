// Tests of the sampler (common/engine/sampler.h): each pipeline step against hand-computed
// distributions, empirical frequencies against the distribution, determinism per seed, and the
// stop conditions.

#include "common/engine/sampler.h"

#include <cmath>
#include <map>
#include <vector>

#include <gtest/gtest.h>

namespace hmoe {
namespace {

std::vector<double> Softmax(const std::vector<double>& z) {
  double m = z[0];
  for (double v : z) m = std::max(m, v);
  std::vector<double> p(z.size());
  double s = 0;
  for (size_t i = 0; i < z.size(); ++i) s += (p[i] = std::exp(z[i] - m));
  for (double& v : p) v /= s;
  return p;
}

Sampler Make(const SamplingParams& p, std::vector<int32_t> prompt = {},
             std::vector<int32_t> eos = {}) {
  EXPECT_TRUE(ValidateSamplingParams(p).ok()) << ValidateSamplingParams(p);
  return Sampler::Create(p, prompt, eos);
}

void ExpectDistribution(const std::vector<double>& got, const std::vector<double>& want) {
  ASSERT_EQ(got.size(), want.size());
  for (size_t i = 0; i < got.size(); ++i) EXPECT_NEAR(got[i], want[i], 1e-9) << "token " << i;
}

const std::vector<float> kLogits = {1.0f, 3.0f, 2.0f, 0.5f, 3.0f, -1.0f};

TEST(SamplerTest, GreedyPicksLowestArgMax) {
  SamplingParams p;
  Sampler s = Make(p);
  EXPECT_EQ(*s.Sample(kLogits), 1);  // tie between 1 and 4: the lower id
  ExpectDistribution(s.Distribution(kLogits), {0, 1, 0, 0, 0, 0});
}

TEST(SamplerTest, TemperatureScalesLogits) {
  SamplingParams p;
  p.temperature = 0.5f;
  Sampler s = Make(p);
  std::vector<double> z;
  for (float l : kLogits) z.push_back(l / 0.5);
  ExpectDistribution(s.Distribution(kLogits), Softmax(z));
}

TEST(SamplerTest, TopKKeepsTiesAtTheThreshold) {
  SamplingParams p;
  p.temperature = 1.0f;
  p.top_k = 2;
  Sampler s = Make(p);
  // The two largest are 3.0 (ids 1 and 4).
  ExpectDistribution(s.Distribution(kLogits), {0, 0.5, 0, 0, 0.5, 0});
  p.top_k = 3;
  Sampler s3 = Make(p);
  const std::vector<double> q = Softmax({3.0, 2.0, 3.0});
  ExpectDistribution(s3.Distribution(kLogits), {0, q[0], q[1], 0, q[2], 0});
}

TEST(SamplerTest, TopPKeepsTheSmallestPrefix) {
  SamplingParams p;
  p.temperature = 1.0f;
  const std::vector<double> full = Softmax({1.0, 3.0, 2.0, 0.5, 3.0, -1.0});
  // The two 3.0 tokens hold 2 * 0.3841 = 0.768; with 2.0 (0.1413) the sum is 0.909.
  p.top_p = 0.8f;
  Sampler s = Make(p);
  const std::vector<double> q = Softmax({3.0, 2.0, 3.0});
  ExpectDistribution(s.Distribution(kLogits), {0, q[0], q[1], 0, q[2], 0});
  p.top_p = 0.3f;  // only the first of the two most likely (lower id) is needed
  Sampler s1 = Make(p);
  ExpectDistribution(s1.Distribution(kLogits), {0, 1, 0, 0, 0, 0});
  EXPECT_NEAR(full[1], 0.3841, 1e-3);
}

TEST(SamplerTest, MinPDropsUnlikelyTokens) {
  SamplingParams p;
  p.temperature = 1.0f;
  p.min_p = 0.3f;  // keep p >= 0.3 * p_max: e^(l - 3) >= 0.3 <=> l >= 3 + ln 0.3 = 1.796
  Sampler s = Make(p);
  const std::vector<double> q = Softmax({3.0, 2.0, 3.0});
  ExpectDistribution(s.Distribution(kLogits), {0, q[0], q[1], 0, q[2], 0});
}

TEST(SamplerTest, RepetitionAndPresencePenalties) {
  SamplingParams p;
  p.repetition_penalty = 2.0f;
  // Prompt holds token 1 (logit 3 -> 1.5) and token 5 (logit -1 -> -2).
  Sampler s = Make(p, {1, 5});
  EXPECT_EQ(*s.Sample(kLogits), 4);
  p.temperature = 1.0f;
  Sampler t = Make(p, {1, 5});
  ExpectDistribution(t.Distribution(kLogits), Softmax({1.0, 1.5, 2.0, 0.5, 3.0, -2.0}));

  SamplingParams q;
  q.temperature = 1.0f;
  q.presence_penalty = 1.5f;
  Sampler u = Make(q, {1});  // the prompt does not count for presence
  EXPECT_EQ(u.Accept(4), FinishReason::kNone);
  EXPECT_EQ(u.Accept(4), FinishReason::kNone);  // once per distinct token
  ExpectDistribution(u.Distribution(kLogits), Softmax({1.0, 3.0, 2.0, 0.5, 1.5, -1.0}));
}

TEST(SamplerTest, SamplesFollowTheDistributionAndAreDeterministic) {
  SamplingParams p;
  p.temperature = 1.0f;
  p.top_k = 4;
  p.seed = 1234;
  p.max_new_tokens = 1 << 20;
  Sampler s = Make(p);
  const std::vector<double> want = s.Distribution(kLogits);
  constexpr int kDraws = 20000;
  std::map<int32_t, int> counts;
  std::vector<int32_t> first;
  for (int i = 0; i < kDraws; ++i) {
    const int32_t t = *s.Sample(kLogits);
    ++counts[t];
    if (i < 50) first.push_back(t);
    s.Accept(t);  // advances the step (no penalties configured)
  }
  for (size_t i = 0; i < want.size(); ++i) {
    const double freq = static_cast<double>(counts[static_cast<int32_t>(i)]) / kDraws;
    // 5 standard deviations of a binomial proportion.
    const double sigma = std::sqrt(want[i] * (1 - want[i]) / kDraws);
    EXPECT_NEAR(freq, want[i], 5 * sigma + 1e-12) << "token " << i;
  }
  // Same seed: same tokens; another seed: a different sequence.
  Sampler again = Make(p);
  p.seed = 99;
  Sampler other = Make(p);
  int differences = 0;
  for (int i = 0; i < 50; ++i) {
    const int32_t a = *again.Sample(kLogits);
    EXPECT_EQ(a, first[i]) << "draw " << i;
    again.Accept(a);
    const int32_t b = *other.Sample(kLogits);
    differences += b != first[i];
    other.Accept(b);
  }
  EXPECT_GT(differences, 0);
}

TEST(SamplerTest, CounterUniformIsAPureFunctionInRange) {
  EXPECT_EQ(CounterUniform(7, 3), CounterUniform(7, 3));
  EXPECT_NE(CounterUniform(7, 3), CounterUniform(7, 4));
  EXPECT_NE(CounterUniform(7, 3), CounterUniform(8, 3));
  double sum = 0;
  for (int i = 0; i < 10000; ++i) {
    const double u = CounterUniform(1, i);
    ASSERT_GE(u, 0.0);
    ASSERT_LT(u, 1.0);
    sum += u;
  }
  EXPECT_NEAR(sum / 10000, 0.5, 0.02);
}

TEST(SamplerTest, StopConditions) {
  SamplingParams p;
  p.max_new_tokens = 3;
  p.stop_token_ids = {7};
  Sampler s = Make(p, {}, {2});
  EXPECT_EQ(s.Accept(1), FinishReason::kNone);
  EXPECT_EQ(s.Accept(2), FinishReason::kEos);
  Sampler t = Make(p, {}, {2});
  EXPECT_EQ(t.Accept(7), FinishReason::kStop);
  Sampler u = Make(p, {}, {2});
  EXPECT_EQ(u.Accept(1), FinishReason::kNone);
  EXPECT_EQ(u.Accept(1), FinishReason::kNone);
  EXPECT_EQ(u.Accept(1), FinishReason::kLength);
  p.ignore_eos = true;
  Sampler v = Make(p, {}, {2});
  EXPECT_EQ(v.Accept(2), FinishReason::kNone);
  EXPECT_STREQ(FinishReasonName(FinishReason::kStop), "stop");
}

TEST(SamplerTest, EmptyLogitsAreRejected) {
  // The parameters' rules are common/sampling's (tests/sampling); the Sampler trusts them.
  SamplingParams ok;
  Sampler s = Make(ok);
  EXPECT_EQ(s.Sample({}).status().code(), absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace hmoe
