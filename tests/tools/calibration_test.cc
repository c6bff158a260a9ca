// `hmoe calibrate`'s crossing point and calibration file (tools/bench/calibration.h) against values
// computed by hand.

#include "tools/bench/calibration.h"

#include <sys/stat.h>
#include <unistd.h>

#include <cmath>
#include <fstream>
#include <limits>
#include <mutex>
#include <string>
#include <vector>

#include "absl/status/status.h"

#include "tests/integration/temp_dir.h"
#include "tools/bench/bench_runner.h"

#include "gtest/gtest.h"

namespace hmoe::bench {
namespace {

constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();

TEST(MedianTest, OddEvenEmptyAndNaN) {
  EXPECT_DOUBLE_EQ(Median(std::vector<double>{3, 1, 2}), 2);
  EXPECT_DOUBLE_EQ(Median(std::vector<double>{4, 1, 3, 2}), 2.5);
  EXPECT_DOUBLE_EQ(Median(std::vector<double>{7}), 7);
  EXPECT_TRUE(std::isnan(Median(std::vector<double>{})));
  EXPECT_TRUE(std::isnan(Median(std::vector<double>{1, kNaN, 3})));
}

TEST(FindCrossingTest, InterpolatesBetweenTheLastLossAndTheNextRung) {
  // diff = slp - chunked: +0.2 at 256, -0.6 at 512 -> 256 + 256 * 0.2 / 0.8 = 320 exactly.
  const std::vector<PathTtft> rungs = {
      {128, 0.5, 0.9}, {256, 1.0, 1.2}, {512, 2.0, 1.4}, {1024, 4.0, 2.0}};
  absl::StatusOr<Crossing> c = FindCrossing(rungs, 4096);
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->outcome, CrossingOutcome::kCrossing);
  EXPECT_DOUBLE_EQ(c->crossing_tokens, 320);
  EXPECT_EQ(c->threshold_tokens, 320);
  EXPECT_EQ(c->below_tokens, 256);
  EXPECT_EQ(c->above_tokens, 512);
  EXPECT_STREQ(CrossingOutcomeName(c->outcome), "crossing");
}

TEST(FindCrossingTest, RoundsUpAndStaysPastATie) {
  // diff +0.1 at 100, -0.2 at 200 -> 100 + 100 * 0.1 / 0.3 = 133.33.. -> 134.
  std::vector<PathTtft> rungs = {{100, 1.0, 1.1}, {200, 2.0, 1.8}};
  absl::StatusOr<Crossing> c = FindCrossing(rungs, 1000);
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_NEAR(c->crossing_tokens, 100 + 100.0 / 3, 1e-9);
  EXPECT_EQ(c->threshold_tokens, 134);
  // A tie at 100 is not a win: the crossing is 100 itself, the threshold one past it.
  rungs = {{100, 1.0, 1.0}, {200, 2.0, 1.8}};
  c = FindCrossing(rungs, 1000);
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->outcome, CrossingOutcome::kCrossing);
  EXPECT_DOUBLE_EQ(c->crossing_tokens, 100);
  EXPECT_EQ(c->threshold_tokens, 101);
}

TEST(FindCrossingTest, SlpAlwaysWinsGivesTheShortestRung) {
  const std::vector<PathTtft> rungs = {{64, 0.4, 0.3}, {128, 0.8, 0.5}, {256, 1.6, 0.9}};
  absl::StatusOr<Crossing> c = FindCrossing(rungs, 4096);
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->outcome, CrossingOutcome::kSlpAlwaysWins);
  EXPECT_EQ(c->threshold_tokens, 64);
  EXPECT_TRUE(std::isnan(c->crossing_tokens));
  EXPECT_STREQ(CrossingOutcomeName(c->outcome), "slp_always_wins");
}

TEST(FindCrossingTest, SlpNeverWinsGivesTheNoCrossingThreshold) {
  const std::vector<PathTtft> rungs = {{64, 0.3, 0.4}, {128, 0.5, 0.8}, {256, 0.9, 0.9}};
  absl::StatusOr<Crossing> c = FindCrossing(rungs, 4096);
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->outcome, CrossingOutcome::kSlpNeverWins);
  EXPECT_EQ(c->threshold_tokens, 4096);
  EXPECT_STREQ(CrossingOutcomeName(c->outcome), "slp_never_wins");
}

TEST(FindCrossingTest, NoisyLaddersAreDecidedByTheirTail) {
  // SLP wins at 64, loses at 128 (noise), wins from 256 on: the crossing is after the last loss,
  // between 128 (diff +0.1) and 256 (diff -0.3): 128 + 128 * 0.1 / 0.4 = 160.
  std::vector<PathTtft> rungs = {
      {64, 0.5, 0.4}, {128, 0.8, 0.9}, {256, 1.6, 1.3}, {512, 3.0, 2.7}, {1024, 6.0, 4.0}};
  absl::StatusOr<Crossing> c = FindCrossing(rungs, 4096);
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->outcome, CrossingOutcome::kCrossing);
  EXPECT_NEAR(c->crossing_tokens, 160, 1e-9);
  EXPECT_EQ(c->threshold_tokens, 160);
  EXPECT_EQ(c->below_tokens, 128);
  // Wins everywhere but the longest rung: no threshold sends every longer prompt to a faster
  // path, so SLP "never wins" for the router's purposes.
  rungs = {{64, 0.5, 0.4}, {128, 0.8, 0.6}, {256, 1.6, 1.7}};
  c = FindCrossing(rungs, 4096);
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->outcome, CrossingOutcome::kSlpNeverWins);
  EXPECT_EQ(c->threshold_tokens, 4096);
  // A single rung: a win is "always", a loss "never".
  rungs = {{512, 2.0, 1.0}};
  c = FindCrossing(rungs, 4096);
  ASSERT_TRUE(c.ok());
  EXPECT_EQ(c->outcome, CrossingOutcome::kSlpAlwaysWins);
  EXPECT_EQ(c->threshold_tokens, 512);
}

TEST(FindCrossingTest, RejectsBadInput) {
  const std::vector<std::pair<std::vector<PathTtft>, std::string>> cases = {
      {{}, "no prompt lengths"},
      {{{128, 1, 1}, {64, 1, 1}}, "strictly increasing"},
      {{{128, 1, 1}, {128, 1, 1}}, "strictly increasing"},
      {{{0, 1, 1}}, "strictly increasing"},
      {{{64, kNaN, 1}}, "64 tokens"},
      {{{64, 1, -1}}, "64 tokens"},
      {{{64, 1, std::numeric_limits<double>::infinity()}}, "64 tokens"},
  };
  for (const auto& [rungs, want] : cases) {
    absl::StatusOr<Crossing> c = FindCrossing(rungs, 4096);
    ASSERT_FALSE(c.ok()) << want;
    EXPECT_EQ(c.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_NE(c.status().message().find(want), std::string::npos) << c.status();
  }
  const std::vector<PathTtft> one = {{64, 1, 2}};
  EXPECT_EQ(FindCrossing(one, 0).status().code(), absl::StatusCode::kInvalidArgument);
}

TEST(ParseIntListTest, SortsDeduplicatesAndRejects) {
  absl::StatusOr<std::vector<int64_t>> v = ParseIntList("512, 64,128,64", "--lengths", 1);
  ASSERT_TRUE(v.ok()) << v.status();
  EXPECT_EQ(*v, (std::vector<int64_t>{64, 128, 512}));
  for (const char* bad : {"", "64,x", "0,64", "64,,-3", "1.5"}) {
    v = ParseIntList(bad, "--lengths", 1);
    ASSERT_FALSE(v.ok()) << bad;
    EXPECT_NE(v.status().message().find("--lengths"), std::string::npos) << v.status();
  }
}

TEST(CalibrationFileTest, RoundTrip) {
  ::hmoe::testing::TempDir dir("hmoe_calibration");
  const std::string path = dir.path() + "/node.json";
  const RouterThresholds t{320, 300};
  nlohmann::json doc = {{"schema", kCalibrationSchema},
                        {"router", ThresholdsJson(t)},
                        {"measurements", {{"prefill", nlohmann::json::array()}}}};
  {
    std::ofstream f(path);
    f << doc.dump(1);
  }
  absl::StatusOr<RouterThresholds> read = ReadCalibrationFile(path);
  ASSERT_TRUE(read.ok()) << read.status();
  EXPECT_EQ(read->chunk_threshold_tokens, 320);
  EXPECT_EQ(read->decode_idle_window_s, 300);
}

TEST(CalibrationFileTest, BadFilesNameTheProblem) {
  const std::string ok_router = R"("router": {"chunk_threshold": 100, "decode_idle_window_s": 5})";
  const std::vector<std::pair<std::string, std::string>> cases = {
      {"", "not valid JSON"},
      {"{\"schema\": ", "not valid JSON"},
      {"[1, 2]", "not a calibration file"},
      {"{" + ok_router + "}", "\"schema\" is missing"},
      {R"({"schema": "hmoe-bench/1", )" + ok_router + "}", "\"hmoe-bench/1\""},
      {R"({"schema": "hmoe-calibration/1"})", "no \"router\""},
      {R"({"schema": "hmoe-calibration/1", "router": 5})", "no \"router\""},
      {R"({"schema": "hmoe-calibration/1", "router": {"decode_idle_window_s": 5}})",
       "no \"chunk_threshold\""},
      {R"({"schema": "hmoe-calibration/1", "router": {"chunk_threshold": "2048",
          "decode_idle_window_s": 5}})",
       "must be an integer"},
      {R"({"schema": "hmoe-calibration/1", "router": {"chunk_threshold": 12.5,
          "decode_idle_window_s": 5}})",
       "must be an integer"},
      {R"({"schema": "hmoe-calibration/1", "router": {"chunk_threshold": 0,
          "decode_idle_window_s": 5}})",
       "\"chunk_threshold\" = 0 is outside"},
      {R"({"schema": "hmoe-calibration/1", "router": {"chunk_threshold": 4294967296,
          "decode_idle_window_s": 5}})",
       "is outside"},
      {R"({"schema": "hmoe-calibration/1", "router": {"chunk_threshold": 64,
          "decode_idle_window_s": -1}})",
       "\"decode_idle_window_s\" = -1 is outside"},
      {R"({"schema": "hmoe-calibration/1", "router": {"chunk_threshold": 64}})",
       "no \"decode_idle_window_s\""},
  };
  for (const auto& [text, want] : cases) {
    absl::StatusOr<RouterThresholds> t = ParseCalibration(text, "node.json");
    ASSERT_FALSE(t.ok()) << text;
    EXPECT_EQ(t.status().code(), absl::StatusCode::kInvalidArgument) << text;
    EXPECT_NE(t.status().message().find(want), std::string::npos) << t.status();
    EXPECT_NE(t.status().message().find("node.json"), std::string::npos) << t.status();
  }
}

TEST(CalibrationFileTest, MissingUnreadableAndDirectory) {
  ::hmoe::testing::TempDir dir("hmoe_calibration");
  absl::StatusOr<RouterThresholds> t = ReadCalibrationFile(dir.path() + "/absent.json");
  EXPECT_EQ(t.status().code(), absl::StatusCode::kNotFound) << t.status();
  EXPECT_NE(t.status().message().find("absent.json"), std::string::npos);
  t = ReadCalibrationFile(dir.path());
  EXPECT_EQ(t.status().code(), absl::StatusCode::kInvalidArgument) << t.status();
  EXPECT_NE(t.status().message().find("directory"), std::string::npos);
  if (::geteuid() != 0) {  // root reads anything
    const std::string locked = dir.path() + "/locked.json";
    { std::ofstream(locked) << "{}"; }
    ASSERT_EQ(::chmod(locked.c_str(), 0), 0);
    t = ReadCalibrationFile(locked);
    EXPECT_EQ(t.status().code(), absl::StatusCode::kPermissionDenied) << t.status();
  }
}

// A router that serves every request on the hinted path at once, with fixed times, and keeps what
// it was sent.
class RecordingClient final : public BenchClient {
 public:
  absl::StatusOr<v1::ModelInfo> ModelInfo() override { return v1::ModelInfo(); }
  absl::StatusOr<v1::RouterStatus> RouterStatus() override { return v1::RouterStatus(); }
  RequestResult Run(const PlannedRequest& request, v1::PathHint hint,
                    std::chrono::steady_clock::time_point) override {
    std::lock_guard<std::mutex> lock(mu_);
    sent.push_back(request);
    RequestResult r;
    r.ok = true;
    r.path = hint == v1::PATH_HINT_SLP ? "slp" : "chunked";
    r.start_s = 0;
    for (int64_t i = 0; i < request.max_new_tokens; ++i) r.token_s.push_back(0.1 * (i + 1));
    r.end_s = r.token_s.back();
    r.tokens.assign(request.max_new_tokens, 11);
    r.finish_reason = "length";
    return r;
  }
  bool StreamsTokenIds() const override { return true; }

  std::mutex mu_;
  std::vector<PlannedRequest> sent;
};

// Calibration measures the paths, never the prefix cache: no request may use or fill it, or a
// warm cache would turn the ladder's SLP and chunked TTFTs into hit times.
TEST(RunCalibrationTest, NoRequestUsesThePrefixCache) {
  RecordingClient client;
  v1::ModelInfo info;
  info.set_context_length(4096);
  info.set_vocab_size(1000);
  CalibrateOptions o;
  o.lengths = {32, 64};
  o.batch_sizes = {1, 2};
  o.repeats = 2;
  absl::StatusOr<CalibrateReport> report = RunCalibration(client, info, o);
  ASSERT_TRUE(report.ok()) << report.status();
  // 2 warm-ups + 2 repeats x 2 lengths x 2 paths + 2 repeats x (1 + 2) decodes.
  ASSERT_EQ(client.sent.size(), 2u + 8u + 6u);
  for (const PlannedRequest& r : client.sent) EXPECT_FALSE(r.cache_prompt);
}

}  // namespace
}  // namespace hmoe::bench
