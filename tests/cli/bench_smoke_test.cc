// `hmoe bench` against the real service on the tiny checkpoint (issue 21 acceptance 1, the CI
// smoke run): hmoe-weightd + hmoe-decode-worker + hmoe-router as child processes (as
// tests/router/router_stack_test.cc starts them), then `hmoe bench` as a child: 10 requests of an
// open-loop load and the five scenarios at toy sizes, each JSON document parsed and checked
// against docs/bench.md's schema and against what was asked. Bad flags exit 2 before any RPC.

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
#include "tools/model_writer.h"

#include "gtest/gtest.h"
#include <nlohmann/json.hpp>

namespace hmoe::bench {
namespace {

using ::hmoe::testing::ChildOptions;
using ::hmoe::testing::ChildProcess;
using nlohmann::json;
using namespace std::chrono_literals;

constexpr char kWeightd[] = HMOE_WEIGHTD_PATH;
constexpr char kDecode[] = HMOE_DECODE_WORKER_PATH;
constexpr char kRouter[] = HMOE_ROUTER_PATH;
constexpr char kClient[] = HMOE_CLIENT_PATH;

std::string ReadFile(const std::string& path) {
  std::ifstream f(path);
  return std::string((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
}

// Runs `hmoe bench ARGS`; its exit code, stdout and stderr.
struct Ran {
  int code = -1;
  std::string out;
  std::string err;
};
Ran Bench(const std::string& dir, const std::string& tag, std::vector<std::string> args) {
  ChildOptions o;
  o.argv = {kClient, "bench"};
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
}

int ReadPort(const std::string& path) {
  const absl::Time end = absl::Now() + absl::Seconds(60);
  while (absl::Now() < end) {
    const std::string text = ReadFile(path);
    int port = 0;
    if (absl::EndsWith(text, "\n") && absl::SimpleAtoi(absl::StripSuffix(text, "\n"), &port) &&
        port > 0) {
      return port;
    }
    absl::SleepFor(absl::Milliseconds(10));
  }
  return 0;
}

bool WaitDecodeLive(const std::string& addr) {
  auto stub = v1::Hmoe::NewStub(grpc::CreateChannel(addr, grpc::InsecureChannelCredentials()));
  const absl::Time end = absl::Now() + absl::Seconds(60);
  while (absl::Now() < end) {
    grpc::ClientContext ctx;
    ctx.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(2)));
    v1::RouterStatus st;
    if (stub->GetStatus(&ctx, {}, &st).ok()) {
      for (const v1::WorkerInfo& w : st.workers()) {
        if (w.kind() == v1::WORKER_KIND_DECODE && w.state() == v1::WORKER_STATE_LIVE) return true;
      }
    }
    absl::SleepFor(absl::Milliseconds(20));
  }
  return false;
}

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

void CheckDistribution(const json& d, int64_t count) {
  EXPECT_EQ(d["count"], count) << d.dump();
  const double p50 = d["p50"], p90 = d["p90"], p99 = d["p99"], mn = d["min"], mx = d["max"];
  EXPECT_LE(mn, p50);
  EXPECT_LE(p50, p90);
  EXPECT_LE(p90, p99);
  EXPECT_LE(p99, mx);
}

TEST(BenchSmokeTest, TenRequestsAndTheScenariosOnTiny) {
  ::setenv("GRPC_CLIENT_CHANNEL_BACKUP_POLL_INTERVAL_MS", "50", 1);
  ::hmoe::testing::TempDir dir("hmoe_bench");
  ASSERT_FALSE(dir.path().empty());
  const std::string d = dir.path();
  const std::string model = d + "/tiny";
  absl::StatusOr<ModelPreset> preset = GetPreset("tiny");
  ASSERT_TRUE(preset.ok()) << preset.status();
  WriteOptions wo;
  wo.force = true;
  ASSERT_TRUE(WriteModel(*preset, model, wo).ok());
  const std::string instance = absl::StrCat("bench-", ::getpid());

  std::vector<std::unique_ptr<ChildProcess>> stack;  // destroyed in reverse: router first
  auto spawn = [&](ChildOptions o) -> ChildProcess* {
    absl::StatusOr<ChildProcess> c = ChildProcess::Start(std::move(o));
    if (!c.ok()) {
      ADD_FAILURE() << c.status();
      return nullptr;
    }
    stack.push_back(std::make_unique<ChildProcess>(*std::move(c)));
    return stack.back().get();
  };
  ChildOptions w;
  w.argv = {kWeightd,      "--model",     model, "--instance", instance, "--socket",
            d + "/w.sock", "--hugepages", "off", "--numa",     "off",    "--remove-on-exit"};
  w.env = {{"HMOE_RUNTIME_DIR", d}};
  w.stderr_path = d + "/weightd.log";
  ChildProcess* weightd = spawn(std::move(w));
  ASSERT_NE(weightd, nullptr);
  ASSERT_TRUE(weightd->WaitForOutput("SERVING instance", 60s, true).ok()) << weightd->ReadStderr();
  ChildOptions dec;
  dec.argv = {kDecode,
              "--weightd-instance",
              instance,
              "--socket",
              d + "/d.sock",
              "--router",
              "unix:" + d + "/r.sock",
              "--worker-id",
              "decode-0",
              "--threads",
              "1",
              "--pin-threads=false",
              "--heartbeat-ms",
              "100",
              "--kv-blocks",
              "256",
              "--kv-block-tokens",
              "16",
              "--drain-seconds",
              "5"};
  dec.stderr_path = d + "/decode.log";
  ASSERT_NE(spawn(std::move(dec)), nullptr);
  ChildOptions r;
  r.argv = {kRouter,
            "--listen=127.0.0.1:0",
            "--model=" + model,
            "--registry-socket=" + d + "/r.sock",
            "--port-file=" + d + "/port",
            "--drain-seconds=5"};
  r.stderr_path = d + "/router.log";
  ChildProcess* router = spawn(std::move(r));
  ASSERT_NE(router, nullptr);
  const int port = ReadPort(d + "/port");
  ASSERT_GT(port, 0) << router->ReadStderr();
  const std::string addr = absl::StrCat("127.0.0.1:", port);
  ASSERT_TRUE(WaitDecodeLive(addr)) << router->ReadStderr();

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

  for (auto it = stack.rbegin(); it != stack.rend(); ++it) {
    EXPECT_EQ((*it)->Terminate(30s).value_or(-1), 0) << (*it)->ReadStderr();
  }
}

}  // namespace
}  // namespace hmoe::bench
