// common/sampling: the one statement of the sampling rules every process boundary applies, the
// context check, the finish reasons' names.

#include "common/sampling/sampling.h"

#include <cmath>
#include <functional>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include <gtest/gtest.h>

namespace hmoe {
namespace {

TEST(SamplingTest, EachRuleNamesItsField) {
  struct Case {
    std::string field;
    std::function<void(SamplingParams&)> mutate;
  };
  const std::vector<Case> cases = {
      {"max_new_tokens:", [](SamplingParams& p) { p.max_new_tokens = 0; }},
      {"sampling.temperature:", [](SamplingParams& p) { p.temperature = -1; }},
      {"sampling.temperature:", [](SamplingParams& p) { p.temperature = NAN; }},
      {"sampling.temperature:", [](SamplingParams& p) { p.temperature = INFINITY; }},
      {"sampling.top_k:", [](SamplingParams& p) { p.top_k = -2; }},
      {"sampling.top_p:", [](SamplingParams& p) { p.top_p = 0; }},
      {"sampling.top_p:", [](SamplingParams& p) { p.top_p = 1.5f; }},
      {"sampling.top_p:", [](SamplingParams& p) { p.top_p = NAN; }},
      {"sampling.min_p:", [](SamplingParams& p) { p.min_p = 2; }},
      {"sampling.min_p:", [](SamplingParams& p) { p.min_p = -0.5f; }},
      {"sampling.repetition_penalty:", [](SamplingParams& p) { p.repetition_penalty = 0; }},
      {"sampling.repetition_penalty:", [](SamplingParams& p) { p.repetition_penalty = INFINITY; }},
      {"sampling.presence_penalty:", [](SamplingParams& p) { p.presence_penalty = NAN; }},
  };
  for (const Case& c : cases) {
    SamplingParams p;
    c.mutate(p);
    const absl::Status s = ValidateSamplingParams(p);
    EXPECT_TRUE(absl::IsInvalidArgument(s)) << c.field << ": " << s;
    EXPECT_TRUE(absl::StartsWith(s.message(), c.field)) << s;
  }
  SamplingParams ok;
  ok.temperature = 0.7f;
  ok.top_k = 40;
  ok.top_p = 0.9f;
  ok.min_p = 0.05f;
  ok.repetition_penalty = 1.1f;
  ok.presence_penalty = -0.5f;
  ok.max_new_tokens = 1;
  EXPECT_TRUE(ValidateSamplingParams(ok).ok());
  EXPECT_TRUE(ValidateSamplingParams(SamplingParams{}).ok());
}

TEST(SamplingTest, PromptAndNewTokensMustFitTheContext) {
  EXPECT_TRUE(CheckFitsContext("prompt_token_ids", 6, 4, 10).ok());
  const absl::Status s = CheckFitsContext("prompt_token_ids", 7, 4, 10);
  EXPECT_TRUE(absl::IsInvalidArgument(s));
  EXPECT_EQ(s.message(),
            "prompt_token_ids: too long: prompt (7 tokens) + max_new_tokens (4) = 11 exceeds the "
            "context length 10");
  EXPECT_TRUE(CheckFitsContext("prompt_text", 1 << 20, 1 << 20, 0).ok());  // 0: unchecked
}

TEST(SamplingTest, FinishReasonNames) {
  EXPECT_STREQ(FinishReasonName(FinishReason::kNone), "none");
  EXPECT_STREQ(FinishReasonName(FinishReason::kEos), "eos");
  EXPECT_STREQ(FinishReasonName(FinishReason::kStop), "stop");
  EXPECT_STREQ(FinishReasonName(FinishReason::kLength), "length");
  EXPECT_STREQ(FinishReasonName(FinishReason::kCancelled), "cancelled");
  EXPECT_STREQ(FinishReasonName(FinishReason::kError), "error");
}

}  // namespace
}  // namespace hmoe
