// The decode worker's step-cost fit and packing rule (decode_worker/step_cost_model.h).

#include "decode_worker/step_cost_model.h"

#include <cmath>
#include <limits>

#include <gtest/gtest.h>

namespace hmoe::decode {
namespace {

// The model's fit is fixed_us +- fixed_tol and per_token_us +- per_token_tol.
void ExpectFit(const StepCostModel& m, double fixed_us, double fixed_tol, double per_token_us,
               double per_token_tol) {
  const std::optional<StepCost> c = m.Estimate();
  ASSERT_TRUE(c.has_value());
  EXPECT_NEAR(c->fixed_us, fixed_us, fixed_tol);
  EXPECT_NEAR(c->per_token_us, per_token_us, per_token_tol);
}

TEST(StepCostModelTest, RecoversFixedAndPerTokenCosts) {
  StepCostModel m(/*decay=*/0.98, /*min_samples=*/16);
  // 2000 us + 150 us per token, steps of 1..40 tokens, with +-5 % alternating noise.
  for (int i = 0; i < 200; ++i) {
    const int64_t tokens = 1 + (i * 7) % 40;
    const double noise = (i % 2 == 0) ? 1.05 : 0.95;
    m.Add(tokens, (2000.0 + 150.0 * static_cast<double>(tokens)) * noise);
  }
  ExpectFit(m, 2000.0, 200.0, 150.0, 15.0);
}

TEST(StepCostModelTest, FollowsAChangeOfMachineMode) {
  StepCostModel m(0.9, 16);
  for (int i = 0; i < 100; ++i) m.Add(1 + i % 8, 1000.0 + 10.0 * (1 + i % 8));
  for (int i = 0; i < 100; ++i) m.Add(1 + i % 8, 4000.0 + 10.0 * (1 + i % 8));  // slower reads
  ExpectFit(m, 4000.0, 50.0, 10.0, 5.0);
}

TEST(StepCostModelTest, NoEstimateBeforeEnoughStepsOfDifferentSizes) {
  StepCostModel m(0.98, 16);
  for (int i = 0; i < 15; ++i) m.Add(1 + i % 3, 100.0 * (1 + i % 3));
  EXPECT_FALSE(m.Estimate().has_value()) << "15 samples";
  m.Add(2, 200.0);
  EXPECT_TRUE(m.Estimate().has_value()) << "16 samples";

  StepCostModel same(0.98, 16);
  for (int i = 0; i < 100; ++i) same.Add(6, 500.0);  // a steady decode batch: no spread
  EXPECT_FALSE(same.Estimate().has_value());
}

TEST(StepCostModelTest, ClampsAndIgnoresBadSamples) {
  StepCostModel m(1.0, 2);
  m.Add(0, 100.0);                                     // no tokens
  m.Add(3, -1.0);                                      // negative time
  m.Add(3, std::numeric_limits<double>::quiet_NaN());  // NaN
  EXPECT_EQ(m.samples(), 0);
  // Time falling with tokens: the slope clamps to 0 and fixed is the mean.
  m.Add(1, 300.0);
  m.Add(3, 100.0);
  const std::optional<StepCost> c = m.Estimate();
  ASSERT_TRUE(c.has_value());
  EXPECT_EQ(c->per_token_us, 0.0);
  EXPECT_DOUBLE_EQ(c->fixed_us, 200.0);
}

TEST(StepCostTest, PackingRule) {
  // sharing * per_token * (n - 1) < fixed.
  const StepCost memory_bound{.fixed_us = 10000, .per_token_us = 10};
  EXPECT_TRUE(memory_bound.WorthPacking(2, 40));                           // 2 * 10 * 39 = 780
  EXPECT_TRUE(memory_bound.WorthPacking(6, 100));                          // 6 * 10 * 99 = 5940
  EXPECT_FALSE(memory_bound.WorthPacking(6, 200));                         // 6 * 10 * 199 = 11940
  const StepCost compute_bound{.fixed_us = 75000, .per_token_us = 70000};  // this VM, real-shaped
  EXPECT_FALSE(compute_bound.WorthPacking(2, 5));
  EXPECT_TRUE(compute_bound.WorthPacking(5, 1));  // a 1-token prompt delays nobody
  const StepCost free_steps{};
  EXPECT_FALSE(free_steps.WorthPacking(1, 1));  // nothing to save
}

}  // namespace
}  // namespace hmoe::decode
