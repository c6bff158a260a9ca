// Acceptance 1 of issue #4 on the `small` checkpoint (8 layers, 32 experts of 1024x512): the
// stream-loading prefill's first-token logits and every KV byte equal the resident-weights
// engine's, for ring lengths 2, 4 and experts-per-layer, in one pass and in several. Label
// integration: writing `small` takes a few seconds (too slow for the sanitizer builds).

#include <cstring>
#include <vector>

#include "absl/strings/str_cat.h"
#include <gtest/gtest.h>

#include "tests/engine/engine_test_util.h"
#include "tests/engine/slp_test_util.h"

namespace hmoe::engine_test {
namespace {

Model& Small() {
  static Model* const model = [] {
    auto preset = GetPreset("small");
    HMOE_CHECK_OK(preset.status());
    return WriteAndOpen("small", *preset, /*fp8=*/true).release();
  }();
  return *model;
}

TEST(SlpSmallTest, SlpEqualsResidentPrefillBitwiseForEveryRingLength) {
  Model& model = Small();
  const int64_t experts = model.checkpoint->config().n_routed_experts;
  ASSERT_EQ(experts, 32);
  const std::vector<int32_t> prompt = RandomTokens(40, 7, 3000);
  for (int64_t max_step : {int64_t{256}, int64_t{16}}) {  // one pass; three passes
    SCOPED_TRACE(absl::StrCat("max_step_tokens ", max_step));
    EngineOptions options;
    options.max_step_tokens = max_step;
    auto resident = ResidentRig(model, ExpertPlacement::kDevice, options);
    ASSERT_NE(resident, nullptr);
    const PrefillResult want = Prefill(*resident->engine, *resident->cache, prompt);
    ASSERT_FALSE(want.logits.empty());
    if (max_step == 256) {
      // The decode worker's placement (experts on the CPU pool) gives the same bytes too.
      auto cpu = ResidentRig(model, ExpertPlacement::kCpu, options);
      ASSERT_NE(cpu, nullptr);
      const PrefillResult cpu_result = Prefill(*cpu->engine, *cpu->cache, prompt);
      EXPECT_EQ(cpu_result.logits, want.logits);
      EXPECT_EQ(cpu_result.kv, want.kv);
    }
    for (int64_t ring : {int64_t{2}, int64_t{4}, experts}) {
      SCOPED_TRACE(absl::StrCat("ring of ", ring, " slots"));
      auto slp = SlpRig::Make(model, {.ring_slots = ring, .budget_bytes = 64 << 20}, options);
      ASSERT_NE(slp, nullptr);
      StreamingStats stats;
      const PrefillResult got = slp->Run(prompt, &stats);
      ASSERT_EQ(got.logits.size(), want.logits.size());
      EXPECT_EQ(
          0, std::memcmp(got.logits.data(), want.logits.data(), got.logits.size() * sizeof(float)))
          << "max abs diff " << MaxAbsDiff(got.logits, want.logits);
      EXPECT_TRUE(got.kv == want.kv) << "KV caches differ";
      EXPECT_EQ(stats.passes, PassesFor(40, options));
      EXPECT_LE(stats.ring_peak_slots, ring);
      EXPECT_LE(stats.arena_peak_bytes, slp->weights->budget_bytes());
    }
  }
}

}  // namespace
}  // namespace hmoe::engine_test
