// `hmoe bench` against the real service on the tiny checkpoint (issue 21 acceptance 1, the CI
// smoke run): hmoe-weightd + hmoe-decode-worker + hmoe-router as child processes (as
// tests/router/router_stack_test.cc starts them), then `hmoe bench` as a child: 10 requests of an
// open-loop load and the five scenarios at toy sizes, the same load and 1P+1D over the OpenAI HTTP
// API (--protocol http), and `hmoe http-bench`, each JSON document parsed and checked against
// docs/bench.md's schema and against what was asked. Bad flags exit 2 before any RPC.

#include <unistd.h>

#include <chrono>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <map>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/strip.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include <grpcpp/grpcpp.h>

#include "proto/hmoe_v1.grpc.pb.h"
#include "tests/integration/child_process.h"
#include "tests/integration/temp_dir.h"
#include "tests/integration/test_stack.h"
#include "tools/model_writer.h"

#include "gtest/gtest.h"
#include <nlohmann/json.hpp>

namespace hmoe::bench {
namespace {

using ::hmoe::testing::ChildOptions;
using ::hmoe::testing::ChildProcess;
using ::hmoe::testing::TestStack;
using ::hmoe::testing::TestStackOptions;
using nlohmann::json;
using namespace std::chrono_literals;

constexpr char kWeightd[] = HMOE_WEIGHTD_PATH;
constexpr char kDecode[] = HMOE_DECODE_WORKER_PATH;
constexpr char kPrefill[] = HMOE_PREFILL_WORKER_PATH;
constexpr char kRouter[] = HMOE_ROUTER_PATH;
constexpr char kClient[] = HMOE_CLIENT_PATH;

std::string ReadFile(const std::string& path) {
  std::ifstream f(path);
  return std::string((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
}

// Runs `hmoe COMMAND ARGS`; its exit code, stdout and stderr.
struct Ran {
  int code = -1;
  std::string out;
  std::string err;
};
Ran Hmoe(const std::string& command, const std::string& dir, const std::string& tag,
         std::vector<std::string> args) {
  ChildOptions o;
  o.argv = {kClient, command};
  o.argv.insert(o.argv.end(), args.begin(), args.end());
  o.stdout_path = absl::StrCat(dir, "/", tag, ".out");
  o.stderr_path = absl::StrCat(dir, "/", tag, ".err");
  absl::StatusOr<ChildProcess> child = ChildProcess::Start(std::move(o));
  if (!child.ok()) return {};
  Ran r;
  r.code = child->WaitForExit(180s).value_or(-1);
  r.out = child->ReadStdout();
  r.err = child->ReadStderr();
  return r;
}
Ran Bench(const std::string& dir, const std::string& tag, std::vector<std::string> args) {
  return Hmoe("bench", dir, tag, std::move(args));
}
Ran Calibrate(const std::string& dir, const std::string& tag, std::vector<std::string> args) {
  return Hmoe("calibrate", dir, tag, std::move(args));
}

TEST(BenchSmokeTest, BadFlagsExitTwoWithAMessage) {
  ::hmoe::testing::TempDir dir("hmoe_bench");
  // No router at this address: flags are checked first.
  const std::vector<std::pair<std::vector<std::string>, std::string>> cases = {
      {{"--prompt-len", "zipf:1:2"}, "--prompt-len"},
      {{"--output-len", "0"}, "--output-len"},
      {{"--arrival", "uniform"}, "--arrival"},
      {{"--rate", "0"}, "--rate"},
      {{"--requests", "0"}, "--requests"},
      {{"--turns", "0"}, "--turns"},
      {{"--scenario", "1X"}, "--scenario"},
      {{"--slo-tpot", "0s"}, "--slo-tpot"},
      {{"--hint", "fast"}, "--hint"},
      {{"--protocol", "websocket"}, "--protocol"},
      {{"--protocol", "http", "--http-addr", "localhost"}, "--http-addr"},
      {{"--protocol", "http", "--http-addr", "127.0.0.1:1", "--turns", "2"}, "--turns"},
      {{"--protocol", "http", "--http-addr", "127.0.0.1:1", "--hint", "slp"}, "--hint"},
  };
  for (const auto& [args, want] : cases) {
    std::vector<std::string> a = args;
    a.push_back("--addr=127.0.0.1:1");
    const Ran r = Bench(dir.path(), "bad", a);
    EXPECT_EQ(r.code, 2) << args[0] << ": " << r.err;
    EXPECT_NE(r.err.find(want), std::string::npos) << r.err;
  }
  // No router: exit 1 naming the call.
  const Ran r = Bench(dir.path(), "noserver", {"--addr=127.0.0.1:1", "--timeout-s=2"});
  EXPECT_EQ(r.code, 1) << r.err;
  EXPECT_NE(r.err.find("GetModelInfo"), std::string::npos) << r.err;

  // `hmoe calibrate`: the same rules.
  const std::string file = "--calibration=" + dir.path() + "/node.json";
  const std::vector<std::pair<std::vector<std::string>, std::string>> calibrate_cases = {
      {{}, "--calibration"},
      {{file, "--lengths=64,x"}, "--lengths"},
      {{file, "--lengths="}, "--lengths"},
      {{file, "--batch-sizes=0"}, "--batch-sizes"},
      {{file, "--repeats=0"}, "--repeats"},
      {{file, "--step-tokens=1"}, "--step-tokens"},
      {{file, "--protocol=http"}, "--protocol"},
  };
  for (const auto& [args, want] : calibrate_cases) {
    std::vector<std::string> a = args;
    a.push_back("--addr=127.0.0.1:1");
    const Ran c = Calibrate(dir.path(), "bad", a);
    EXPECT_EQ(c.code, 2) << want << ": " << c.err;
    EXPECT_NE(c.err.find(want), std::string::npos) << c.err;
  }
  const Ran c = Calibrate(dir.path(), "noserver", {file, "--addr=127.0.0.1:1", "--timeout-s=2"});
  EXPECT_EQ(c.code, 1) << c.err;
  EXPECT_NE(c.err.find("GetModelInfo"), std::string::npos) << c.err;
  // A failed run leaves no file behind (nor its temporary).
  EXPECT_FALSE(std::filesystem::exists(dir.path() + "/node.json"));
  EXPECT_FALSE(std::filesystem::exists(dir.path() + "/node.json.tmp"));
}

// hmoe-weightd, a decode worker, `prefill_workers` prefill workers and the router (gRPC and HTTP)
// on the `tiny` checkpoint (written into `dir`), as child processes (tests/integration/
// test_stack.h); `addr` and `http_addr` are the router's. Stop() terminates them, router first,
// and checks each exits 0.
class Stack {
 public:
  // False (with a test failure) when a process did not start or the workers did not register.
  bool Start(const std::string& dir, int prefill_workers) {
    ::setenv("GRPC_CLIENT_CHANNEL_BACKUP_POLL_INTERVAL_MS", "50", 1);
    model = dir + "/tiny";
    absl::StatusOr<ModelPreset> preset = GetPreset("tiny");
    if (!preset.ok()) {
      ADD_FAILURE() << preset.status();
      return false;
    }
    WriteOptions wo;
    wo.force = true;
    if (absl::Status s = WriteModel(*preset, model, wo); !s.ok()) {
      ADD_FAILURE() << s;
      return false;
    }
    TestStackOptions o;
    o.binaries = {kWeightd, kRouter, kDecode, kPrefill};
    o.model = model;
    o.run_dir = absl::StrCat(dir, "/stack-", prefill_workers);
    o.tag = absl::StrCat("bench-", prefill_workers);
    o.prefill_workers = prefill_workers;
    o.http = true;
    o.prefill_flags = {"--threads", "1", "--pin-threads=false", "--heartbeat-ms", "100"};
    stack_ = TestStack::Start(std::move(o));
    if (stack_ == nullptr) return false;
    addr = stack_->grpc_addr();
    http_addr = stack_->http_addr();
    return true;
  }

  void Stop() { stack_.reset(); }

  std::string model;
  std::string addr;
  std::string http_addr;  // the OpenAI-compatible API (--http-listen)

 private:
  std::unique_ptr<TestStack> stack_;
};

// The fields docs/bench.md lists for every request.
void CheckRequest(const json& r, bool measured) {
  for (const char* key : {"index", "warmup", "status", "start_s", "end_s", "prompt_tokens",
                          "max_new_tokens", "output_tokens", "ttft_s", "tpot_s", "e2e_s", "itl_s",
                          "finish_reason", "path", "worker_ids", "attempts", "server"}) {
    ASSERT_TRUE(r.contains(key)) << key << " in " << r.dump();
  }
  if (!measured) return;
  EXPECT_EQ(r["status"], "OK") << r.dump();
  EXPECT_EQ(r["finish_reason"], "length");
  EXPECT_EQ(r["output_tokens"], r["max_new_tokens"]);  // ignore_eos forces the length
  EXPECT_EQ(r["itl_s"].size() + 1, r["output_tokens"].get<size_t>());
  EXPECT_EQ(r["path"], "chunked");  // no prefill worker
  EXPECT_EQ(r["worker_ids"], json::array({"decode-0"}));
  EXPECT_EQ(r["attempts"], 1);
  const double ttft = r["ttft_s"].get<double>();
  EXPECT_GT(ttft, 0);
  EXPECT_GE(r["e2e_s"].get<double>(), ttft);
  EXPECT_GE(r["end_s"].get<double>(), r["start_s"].get<double>());
  // The router's own TTFT is inside the client's (the router sees the request later and the
  // token earlier).
  EXPECT_LE(r["server"]["ttft_s"].get<double>(), ttft + 1e-3);
}

// A request sent over the OpenAI HTTP API (--protocol http): the same fields, the ones HTTP does
// not carry null; output tokens from usage (forced by ignore_eos), inter-event gaps no more than
// the tokens allow (an event carries one or more tokens).
void CheckHttpRequest(const json& r) {
  for (const char* key :
       {"index", "warmup", "status", "start_s", "end_s", "prompt_tokens", "max_new_tokens",
        "output_tokens", "ttft_s", "tpot_s", "e2e_s", "itl_s", "finish_reason", "path",
        "worker_ids", "attempts", "server", "cached_prompt_tokens"}) {
    ASSERT_TRUE(r.contains(key)) << key << " in " << r.dump();
  }
  EXPECT_EQ(r["status"], "OK") << r.dump();
  EXPECT_EQ(r["finish_reason"], "length");
  EXPECT_EQ(r["output_tokens"], r["max_new_tokens"]);
  EXPECT_LE(r["itl_s"].size() + 1, r["output_tokens"].get<size_t>());
  for (const char* key : {"path", "worker_ids", "attempts", "server"}) {
    EXPECT_TRUE(r[key].is_null()) << key << " in " << r.dump();
  }
  const double ttft = r["ttft_s"].get<double>();
  EXPECT_GT(ttft, 0);
  EXPECT_GE(r["e2e_s"].get<double>(), ttft);
}

void CheckDistribution(const json& d, int64_t count) {
  EXPECT_EQ(d["count"], count) << d.dump();
  const double p50 = d["p50"], p90 = d["p90"], p99 = d["p99"], mn = d["min"], mx = d["max"];
  EXPECT_LE(mn, p50);
  EXPECT_LE(p50, p90);
  EXPECT_LE(p90, p99);
  EXPECT_LE(p99, mx);
}

TEST(BenchSmokeTest, TenRequestsAndTheScenariosOnTiny) {
  ::hmoe::testing::TempDir dir("hmoe_bench");
  ASSERT_FALSE(dir.path().empty());
  const std::string d = dir.path();
  Stack stack;
  ASSERT_TRUE(stack.Start(d, 0));
  const std::string& addr = stack.addr;

  // --- 10 requests, open loop.
  const std::string load_json = d + "/load.json";
  Ran ran = Bench(
      d, "load",
      {"--addr=" + addr, "--requests=10", "--warmup=1", "--rate=20", "--prompt-len=uniform:4:64",
       "--output-len=uniform:2:24", "--seed=5", "--label=smoke", "--json=" + load_json});
  ASSERT_EQ(ran.code, 0) << ran.err;
  EXPECT_NE(ran.out.find("requests 10 (10 ok, 0 failed)"), std::string::npos) << ran.out;
  json doc;
  ASSERT_NO_THROW(doc = json::parse(ReadFile(load_json)));
  EXPECT_EQ(doc["schema"], "hmoe-bench/1");
  EXPECT_EQ(doc["mode"], "load");
  EXPECT_EQ(doc["label"], "smoke");
  EXPECT_EQ(doc["slo"]["ttft_s"], 30.0);
  EXPECT_EQ(doc["slo"]["tpot_s"], 0.05);
  EXPECT_EQ(doc["server"]["vocab_size"], 1024);
  EXPECT_EQ(doc["config"]["arrival"], "poisson");
  ASSERT_EQ(doc["requests"].size(), 11u);
  int warmups = 0;
  int64_t tokens = 0;
  for (const json& q : doc["requests"]) {
    const bool warm = q["warmup"];
    warmups += warm;
    CheckRequest(q, !warm);
    if (!warm) tokens += q["output_tokens"].get<int64_t>();
    EXPECT_GE(q["prompt_tokens"].get<int>(), 4);
    EXPECT_LE(q["prompt_tokens"].get<int>(), 64);
  }
  EXPECT_EQ(warmups, 1);
  const json& s = doc["summary"];
  EXPECT_EQ(s["requests"], 10);
  EXPECT_EQ(s["succeeded"], 10);
  EXPECT_EQ(s["failed"], 0);
  EXPECT_EQ(s["output_tokens"], tokens);
  EXPECT_GT(s["duration_s"].get<double>(), 0);
  EXPECT_NEAR(s["output_throughput"].get<double>(), tokens / s["duration_s"].get<double>(), 1e-9);
  EXPECT_LE(s["slo_met"].get<int>(), 10);
  EXPECT_NEAR(s["slo_attainment"].get<double>(), s["slo_met"].get<int>() / 10.0, 1e-12);
  CheckDistribution(s["ttft_s"], 10);
  CheckDistribution(s["e2e_s"], 10);
  CheckDistribution(s["tpot_s"], 10);  // every output length >= 2
  EXPECT_EQ(s["itl_s"]["count"], tokens - 10);

  // --- the same load over the OpenAI HTTP API (--protocol http): /v1/completions, streamed.
  const std::string http_json = d + "/http.json";
  ran = Bench(d, "http",
              {"--addr=" + addr, "--protocol=http", "--http-addr=" + stack.http_addr,
               "--requests=10", "--warmup=1", "--rate=20", "--prompt-len=uniform:4:64",
               "--output-len=uniform:2:24", "--seed=5", "--json=" + http_json});
  ASSERT_EQ(ran.code, 0) << ran.err;
  EXPECT_NE(ran.out.find("requests 10 (10 ok, 0 failed)"), std::string::npos) << ran.out;
  EXPECT_NE(ran.out.find("not available over HTTP"), std::string::npos) << ran.out;
  json hdoc;
  ASSERT_NO_THROW(hdoc = json::parse(ReadFile(http_json)));
  EXPECT_EQ(hdoc["schema"], "hmoe-bench/1");
  EXPECT_EQ(hdoc["mode"], "load");
  EXPECT_EQ(hdoc["protocol"], "http");
  EXPECT_EQ(hdoc["http_addr"], stack.http_addr);
  EXPECT_EQ(hdoc["server"]["vocab_size"], 1024);
  ASSERT_EQ(hdoc["requests"].size(), 11u);
  int64_t http_tokens = 0;
  for (size_t i = 0; i < hdoc["requests"].size(); ++i) {
    const json& q = hdoc["requests"][i];
    CheckHttpRequest(q);
    // The same seed plans the same requests as the gRPC run.
    EXPECT_EQ(q["prompt_tokens"], doc["requests"][i]["prompt_tokens"]);
    EXPECT_EQ(q["max_new_tokens"], doc["requests"][i]["max_new_tokens"]);
    if (!q["warmup"].get<bool>()) http_tokens += q["output_tokens"].get<int64_t>();
  }
  EXPECT_EQ(http_tokens, tokens);
  const json& hs = hdoc["summary"];
  EXPECT_EQ(hs["requests"], 10);
  EXPECT_EQ(hs["succeeded"], 10);
  EXPECT_EQ(hs["output_tokens"], tokens);
  CheckDistribution(hs["ttft_s"], 10);
  CheckDistribution(hs["e2e_s"], 10);

  // `hmoe http-bench` shares the HTTP client (tools/bench/http_client.h): a few interleaved
  // pairs and concurrent streams, each of which must end with a finish reason and [DONE].
  ran = Hmoe("http-bench", d, "http-bench",
             {"--addr=" + addr, "--http-addr=" + stack.http_addr, "--samples=4", "--streams=4",
              "--stream-tokens=6", "--max-new-tokens=3"});
  ASSERT_EQ(ran.code, 0) << ran.out << ran.err;
  EXPECT_NE(
      ran.out.find("4 concurrent SSE streams (max_tokens 6): 4 completed, 0 errors, 24 tokens"),
      std::string::npos)
      << ran.out;

  // --- a multi-turn chat (issue 23): 3 conversations of 3 turns, closed loop; each later turn
  // resends the history, so the decode worker's prefix cache supplies all of it but the last
  // answer token (never fed back) and the new message.
  const std::string chat_json = d + "/chat.json";
  ran = Bench(d, "chat",
              {"--addr=" + addr, "--requests=3", "--warmup=0", "--turns=3", "--arrival=closed",
               "--concurrency=2", "--prompt-len=uniform:8:24", "--output-len=uniform:3:6",
               "--seed=7", "--json=" + chat_json});
  ASSERT_EQ(ran.code, 0) << ran.err;
  EXPECT_NE(ran.out.find("prefix cache: "), std::string::npos) << ran.out;
  ASSERT_NO_THROW(doc = json::parse(ReadFile(chat_json)));
  EXPECT_EQ(doc["config"]["turns"], 3);
  ASSERT_EQ(doc["requests"].size(), 9u);
  int64_t expect_cached = 0, prompt_total = 0;
  std::map<int64_t, int64_t> previous;  // conversation -> previous turn's prompt + output tokens
  for (const json& q : doc["requests"]) {
    CheckRequest(q, true);
    const int64_t c = q["conversation"], turn = q["turn"];
    const int64_t cached = q["cached_prompt_tokens"];
    if (turn == 0) {
      EXPECT_EQ(cached, 0) << q.dump();
    } else {
      EXPECT_EQ(cached, previous[c] - 1) << q.dump();
      expect_cached += previous[c] - 1;
    }
    previous[c] = q["prompt_tokens"].get<int64_t>() + q["output_tokens"].get<int64_t>();
    prompt_total += q["prompt_tokens"].get<int64_t>();
  }
  const json& pc = doc["summary"]["prefix_cache"];
  EXPECT_EQ(pc["cached_prompt_tokens"], expect_cached);
  EXPECT_EQ(pc["prompt_tokens"], prompt_total);
  EXPECT_EQ(pc["requests_with_hits"], 6);

  // --- the five scenarios at toy sizes (a 64-token "prefill", 12-token decodes), once each.
  const std::string scen_json = d + "/scenarios.json";
  ran = Bench(d, "scen",
              {"--addr=" + addr, "--scenario=all", "--prefill-tokens=64", "--decode-new-tokens=12",
               "--repeats=1", "--json=" + scen_json});
  ASSERT_EQ(ran.code, 0) << ran.err;
  ASSERT_NO_THROW(doc = json::parse(ReadFile(scen_json)));
  EXPECT_EQ(doc["mode"], "scenarios");
  EXPECT_EQ(doc["scenarios"]["prefill_tokens"], 64);
  const json& res = doc["scenarios"]["results"];
  ASSERT_EQ(res.size(), 5u);
  const std::vector<std::string> names = {"1P", "1D", "1P+1D", "2D", "1P+2D"};
  for (size_t i = 0; i < names.size(); ++i) EXPECT_EQ(res[i]["name"], names[i]);
  EXPECT_DOUBLE_EQ(res[0]["norm_p_ttft"].get<double>(), 1.0);
  EXPECT_DOUBLE_EQ(res[0]["norm_total"].get<double>(), 1.0);
  EXPECT_TRUE(res[0]["norm_d_tpot"].is_null());
  EXPECT_DOUBLE_EQ(res[1]["norm_d_tpot"].get<double>(), 1.0);
  EXPECT_TRUE(res[1]["mean_p_ttft_s"].is_null());
  EXPECT_GT(res[1]["mean_d_ttft_s"].get<double>(), 0);
  EXPECT_TRUE(res[0]["mean_d_ttft_s"].is_null());
  EXPECT_GT(res[4]["norm_p_ttft"].get<double>(), 0);
  EXPECT_GT(res[4]["norm_d_tpot"].get<double>(), 0);
  // 1 warm-up + 1 + 1 + 2 + 2 + 3 scenario requests, each P/D with its role and length.
  ASSERT_EQ(doc["requests"].size(), 10u);
  for (const json& q : doc["requests"]) {
    CheckRequest(q, !q["warmup"].get<bool>());
    if (q["warmup"]) continue;
    EXPECT_EQ(q["prompt_tokens"], q["role"] == "P" ? 64 : 10) << q.dump();
    EXPECT_EQ(q["output_tokens"], q["role"] == "P" ? 4 : 12) << q.dump();
  }
  EXPECT_NE(ran.out.find("1P+2D"), std::string::npos) << ran.out;

  // Scenarios over HTTP: 1P+1D (with its baselines), once.
  const std::string hscen_json = d + "/http_scenarios.json";
  ran = Bench(
      d, "hscen",
      {"--addr=" + addr, "--protocol=http", "--http-addr=" + stack.http_addr, "--scenario=1P+1D",
       "--prefill-tokens=64", "--decode-new-tokens=12", "--repeats=1", "--json=" + hscen_json});
  ASSERT_EQ(ran.code, 0) << ran.err;
  ASSERT_NO_THROW(doc = json::parse(ReadFile(hscen_json)));
  EXPECT_EQ(doc["protocol"], "http");
  ASSERT_EQ(doc["scenarios"]["results"].size(), 3u);
  // 1 warm-up + 1 + 1 + 2 scenario requests.
  ASSERT_EQ(doc["requests"].size(), 5u);
  for (const json& q : doc["requests"]) {
    CheckHttpRequest(q);
    if (q["warmup"]) continue;
    EXPECT_EQ(q["output_tokens"], q["role"] == "P" ? 4 : 12) << q.dump();
  }

  // `hmoe calibrate` needs a prefill worker to measure SLP: exit 1 saying so, no file.
  ran = Calibrate(d, "calib-noprefill", {"--addr=" + addr, "--calibration=" + d + "/node.json"});
  EXPECT_EQ(ran.code, 1) << ran.err;
  EXPECT_NE(ran.err.find("no live prefill worker"), std::string::npos) << ran.err;
  EXPECT_FALSE(std::filesystem::exists(d + "/node.json"));

  stack.Stop();
}

// `hmoe calibrate` on tiny with a prefill worker (issue 21 item 4, the CI smoke run): a short
// ladder, the file checked against docs/bench.md's schema and against the crossing rule applied
// to its own medians; then `hmoe deploy --calibration` puts its thresholds on the router's
// command line, and rejects a missing file and a file of another kind.
TEST(BenchSmokeTest, CalibrateOnTinyAndDeployTheFile) {
  ::hmoe::testing::TempDir dir("hmoe_calibrate");
  ASSERT_FALSE(dir.path().empty());
  const std::string d = dir.path();
  Stack stack;
  ASSERT_TRUE(stack.Start(d, 1));
  const std::string file = d + "/node.json";
  const std::vector<int64_t> lengths = {8, 16, 32};
  Ran ran = Calibrate(d, "calib",
                      {"--addr=" + stack.addr, "--calibration=" + file, "--lengths=32,8,16",
                       "--batch-sizes=1,2", "--repeats=2", "--step-tokens=4", "--label=smoke"});
  ASSERT_EQ(ran.code, 0) << ran.err;
  stack.Stop();
  EXPECT_NE(ran.out.find("router: --chunk-threshold="), std::string::npos) << ran.out;
  EXPECT_FALSE(std::filesystem::exists(file + ".tmp"));
  json doc;
  ASSERT_NO_THROW(doc = json::parse(ReadFile(file)));
  EXPECT_EQ(doc["schema"], "hmoe-calibration/1");
  EXPECT_EQ(doc["label"], "smoke");
  EXPECT_FALSE(doc["host"]["cpu"].get<std::string>().empty());
  EXPECT_EQ(doc["host"]["loadavg_start"].size(), 3u);
  EXPECT_EQ(doc["host"]["loadavg_end"].size(), 3u);
  const int64_t context = doc["server"]["context_length"];
  EXPECT_EQ(doc["config"]["lengths"], json(lengths));
  EXPECT_EQ(doc["config"]["batch_sizes"], json::array({1, 2}));

  // The ladder: both paths, two repeats each, medians of them.
  const json& prefill = doc["measurements"]["prefill"];
  ASSERT_EQ(prefill.size(), lengths.size());
  std::vector<double> diffs;
  for (size_t i = 0; i < lengths.size(); ++i) {
    const json& m = prefill[i];
    EXPECT_EQ(m["prompt_tokens"], lengths[i]);
    ASSERT_EQ(m["chunked_ttft_s"].size(), 2u);
    ASSERT_EQ(m["slp_ttft_s"].size(), 2u);
    const double c0 = m["chunked_ttft_s"][0], c1 = m["chunked_ttft_s"][1];
    const double s0 = m["slp_ttft_s"][0], s1 = m["slp_ttft_s"][1];
    EXPECT_GT(c0, 0);
    EXPECT_GT(s0, 0);
    EXPECT_DOUBLE_EQ(m["chunked_median_s"].get<double>(), (c0 + c1) / 2);
    EXPECT_DOUBLE_EQ(m["slp_median_s"].get<double>(), (s0 + s1) / 2);
    diffs.push_back((s0 + s1) / 2 - (c0 + c1) / 2);
  }
  // The decode ladder: 1 request per repeat at batch 1, 2 at batch 2.
  const json& decode = doc["measurements"]["decode"];
  ASSERT_EQ(decode.size(), 2u);
  EXPECT_EQ(decode[0]["batch"], 1);
  EXPECT_EQ(decode[0]["tpot_s"].size(), 2u);
  EXPECT_EQ(decode[1]["batch"], 2);
  EXPECT_EQ(decode[1]["tpot_s"].size(), 4u);
  for (const json& m : decode) {
    EXPECT_GT(m["step_s"].get<double>(), 0);
    EXPECT_NEAR(m["tokens_per_s"].get<double>(),
                m["batch"].get<double>() / m["step_s"].get<double>(), 1e-9);
  }

  // The threshold follows the crossing rule on the file's own medians.
  const int64_t threshold = doc["router"]["chunk_threshold"];
  const std::string outcome = doc["derivation"]["chunk_threshold"]["outcome"];
  if (diffs.back() >= 0) {
    EXPECT_EQ(outcome, "slp_never_wins");
    EXPECT_EQ(threshold, context);
  } else if (diffs[0] < 0 && diffs[1] < 0) {
    EXPECT_EQ(outcome, "slp_always_wins");
    EXPECT_EQ(threshold, 8);
  } else {
    EXPECT_EQ(outcome, "crossing");
    const json& between = doc["derivation"]["chunk_threshold"]["between_tokens"];
    EXPECT_EQ(between[0], diffs[1] >= 0 ? 16 : 8);
    EXPECT_GT(threshold, between[0].get<int64_t>());
    EXPECT_LE(threshold, between[1].get<int64_t>());
  }
  // The idle window is kept (one prefill worker: no DSLP), with the reason.
  EXPECT_EQ(doc["router"]["decode_idle_window_s"],
            doc["server"]["decode_idle_window_ms"].get<int64_t>() / 1000);
  EXPECT_EQ(doc["derivation"]["decode_idle_window_s"]["kept"], true);
  EXPECT_NE(doc["derivation"]["decode_idle_window_s"]["reason"].get<std::string>().find(
                "two or more prefill workers"),
            std::string::npos);
  // Every measured request ran on the path it measured.
  int slp = 0, chunked = 0;
  for (const json& q : doc["requests"]) {
    EXPECT_EQ(q["status"], "OK") << q.dump();
    (q["path"] == "slp" ? slp : chunked) += 1;
  }
  EXPECT_EQ(slp, 1 + 2 * 3);              // warm-up + repeats x lengths
  EXPECT_EQ(chunked, 1 + 2 * 3 + 2 + 4);  // the same + the decode batches

  // `hmoe deploy --calibration` hands the thresholds to the router.
  const std::string out = d + "/deploy";
  ran = Hmoe("deploy", d, "deploy",
             {"--model=" + stack.model, "--out=" + out, "--calibration=" + file,
              "--http-listen=", "--prefill-workers=0"});
  ASSERT_EQ(ran.code, 0) << ran.err;
  const std::string conf = ReadFile(out + "/supervisord.conf");
  EXPECT_NE(conf.find(absl::StrCat("--chunk-threshold=", threshold, " --decode-idle-window-s=",
                                   doc["router"]["decode_idle_window_s"].get<int64_t>())),
            std::string::npos)
      << conf;
  EXPECT_NE(ran.out.find("router thresholds from"), std::string::npos) << ran.out;
  // A missing file and a bench document: exit 2 naming the problem, nothing written.
  std::filesystem::remove_all(out);
  ran = Hmoe("deploy", d, "deploy-missing",
             {"--model=" + stack.model, "--out=" + out, "--calibration=" + d + "/absent.json"});
  EXPECT_EQ(ran.code, 2) << ran.err;
  EXPECT_NE(ran.err.find("absent.json: No such file"), std::string::npos) << ran.err;
  EXPECT_FALSE(std::filesystem::exists(out));
  {
    std::ofstream f(d + "/bench.json");
    f << R"({"schema": "hmoe-bench/1", "mode": "load"})";
  }
  ran = Hmoe("deploy", d, "deploy-bench",
             {"--model=" + stack.model, "--out=" + out, "--calibration=" + d + "/bench.json"});
  EXPECT_EQ(ran.code, 2) << ran.err;
  EXPECT_NE(ran.err.find("hmoe-calibration/1"), std::string::npos) << ran.err;
  EXPECT_FALSE(std::filesystem::exists(out));
}

}  // namespace
}  // namespace hmoe::bench
