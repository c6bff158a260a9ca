// Pure parts of router/openai_api.h: the reasoning/content split, error objects, status mapping.

#include "router/openai_api.h"

#include <string>
#include <vector>

#include "gtest/gtest.h"
#include <nlohmann/json.hpp>

namespace hmoe::router {
namespace {

struct Split {
  std::string reasoning, content;
};

// Feeds `pieces` one by one, then flushes.
Split SplitPieces(bool in_thought, const std::vector<std::string>& pieces) {
  ReasoningSplitter s(in_thought);
  Split out;
  for (const std::string& p : pieces) s.Push(p, &out.reasoning, &out.content);
  s.Flush(&out.reasoning, &out.content);
  return out;
}

TEST(ReasoningSplitterTest, PromptOpenedThoughtEndsAtTheCloseTag) {
  const Split a = SplitPieces(true, {"let me think", "</think>\n\nThe answer"});
  EXPECT_EQ(a.reasoning, "let me think");
  EXPECT_EQ(a.content, "The answer");
  // The tag split over pieces, one byte at a time.
  std::vector<std::string> bytes;
  for (char c : std::string("ab</think>  cd")) bytes.emplace_back(1, c);
  const Split b = SplitPieces(true, bytes);
  EXPECT_EQ(b.reasoning, "ab");
  EXPECT_EQ(b.content, "cd");
  // A '<' that is not a tag is released as thought.
  const Split c = SplitPieces(true, {"x < y", "</thin", "k>z"});
  EXPECT_EQ(c.reasoning, "x < y");
  EXPECT_EQ(c.content, "z");
}

TEST(ReasoningSplitterTest, GenerationOpeningAThought) {
  const Split a = SplitPieces(false, {"<thi", "nk>hmm</think>ok"});
  EXPECT_EQ(a.reasoning, "hmm");
  EXPECT_EQ(a.content, "ok");
  // No thought: everything is content, a later <think> included.
  const Split b = SplitPieces(false, {"<b>", "hi <think>"});
  EXPECT_EQ(b.reasoning, "");
  EXPECT_EQ(b.content, "<b>hi <think>");
  // Unfinished thought at the end: it stays thought; an unfinished tag prefix is released.
  const Split c = SplitPieces(true, {"still thinking </th"});
  EXPECT_EQ(c.reasoning, "still thinking </th");
  EXPECT_EQ(c.content, "");
  const Split d = SplitPieces(false, {"<th"});
  EXPECT_EQ(d.content, "<th");
}

TEST(ReasoningSplitterTest, PromptOpensThought) {
  EXPECT_TRUE(PromptOpensThought("<｜Assistant｜><think>\n"));
  EXPECT_FALSE(PromptOpensThought("<｜Assistant｜></think>"));
  EXPECT_FALSE(PromptOpensThought("<think>a</think> <｜Assistant｜>"));
  EXPECT_FALSE(PromptOpensThought("<｜Assistant｜>"));
}

TEST(OpenAiErrorTest, ErrorObjectAndStatuses) {
  const nlohmann::json e = nlohmann::json::parse(ErrorBody(400, "n: only 1", "n"));
  EXPECT_EQ(e["error"]["message"], "n: only 1");
  EXPECT_EQ(e["error"]["type"], "invalid_request_error");
  EXPECT_EQ(e["error"]["param"], "n");
  EXPECT_TRUE(e["error"]["code"].is_null());
  EXPECT_EQ(HttpStatusOf(absl::StatusCode::kInvalidArgument), 400);
  EXPECT_EQ(HttpStatusOf(absl::StatusCode::kNotFound), 404);
  EXPECT_EQ(HttpStatusOf(absl::StatusCode::kResourceExhausted), 429);
  EXPECT_EQ(HttpStatusOf(absl::StatusCode::kUnavailable), 503);
  EXPECT_EQ(HttpStatusOf(absl::StatusCode::kInternal), 500);
}

}  // namespace
}  // namespace hmoe::router
