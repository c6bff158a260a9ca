// Issue #4 acceptance 3 with real processes on the tiny checkpoint: hmoe-prefill-worker prefills
// a prompt and hands its KV cache (a shared-memory segment) to hmoe-decode-worker, which
// continues the sequence; this test plays the router (Prefill, Admit with the handle, Release
// after the KvImported acknowledgement). 64 greedy tokens agree with the reference forward pass
// (token agreement rule, tests/decode_worker/decode_test_util.h) and equal the decode worker's
// own single-process run, greedy and sampled (the decode worker continues the request's RNG
// after the prefill worker's first token); the segment is freed after the ack; an unclaimed one
// after the export timeout; a decode worker killed mid-import leaks no segment. Also: errors,
// draining on SIGTERM, registration with the router, bad flags.

#include <dirent.h>
#include <signal.h>
#include <unistd.h>

#include <chrono>
#include <filesystem>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include <grpcpp/grpcpp.h>
#include <gtest/gtest.h>

#include "common/engine/reference/reference_model.h"
#include "common/kv_handoff/kv_handoff.h"
#include "common/model/checkpoint.h"
#include "proto/decode.grpc.pb.h"
#include "proto/health.grpc.pb.h"
#include "proto/prefill.grpc.pb.h"
#include "proto/worker_registry.grpc.pb.h"
#include "tests/decode_worker/decode_test_util.h"
#include "tests/integration/child_process.h"
#include "tests/prefill_worker/handoff_test_util.h"

namespace hmoe::prefill {
namespace {

using ::hmoe::decode::testing::CheckAgreementWithRoutingFlips;
using ::hmoe::decode::testing::ScopedTempDir;
using ::hmoe::testing::ChildOptions;
using ::hmoe::testing::ChildProcess;
using namespace std::chrono_literals;
namespace dv1 = ::hmoe::decode::v1;

using testing::Admit;
using testing::AdmitRequest;
using testing::Eventually;
using testing::Generation;
using testing::HandOff;
using testing::HandOffEnv;
using testing::kTokens;
using testing::PrefillClient;
using testing::PrefillRequest;
using testing::Process;
using testing::Prompt;
using testing::ShmExists;
using testing::ShmWithPrefix;

constexpr char kPrefillWorker[] = HMOE_PREFILL_WORKER_PATH;
constexpr char kDecodeWorker[] = HMOE_DECODE_WORKER_PATH;

HandOffEnv* g_shared = nullptr;

class PrefillWorkerTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    // Notice a worker's GOAWAY promptly (see decode_worker_integration_test.cc).
    ::setenv("GRPC_CLIENT_CHANNEL_BACKUP_POLL_INTERVAL_MS", "50", 1);
    g_shared = testing::MakeHandOffEnv("tiny").release();
    ASSERT_NE(g_shared, nullptr);
  }
  static void TearDownTestSuite() {
    delete g_shared;
    g_shared = nullptr;
  }
  void SetUp() override { ASSERT_NE(g_shared, nullptr); }

  // A prefill worker with a small streaming budget, copies capped at 2 GB/s (the pipeline really
  // overlaps), and a unique worker id (its exports are hmoe-kv-<id>-*).
  static std::unique_ptr<Process> StartPrefill(const std::string& tag,
                                               std::vector<std::string> extra = {}) {
    std::vector<std::string> flags = {
        "--worker-id",         PrefillId(tag), "--stream-budget-mb", "4", "--copy-gbps", "2",
        "--max-prompt-tokens", "1000"};
    flags.insert(flags.end(), extra.begin(), extra.end());
    return Process::Start(*g_shared, kPrefillWorker, "prefill-" + tag, flags);
  }
  static std::string PrefillId(const std::string& tag) {
    return absl::StrCat("pw-", ::getpid(), "-", tag);
  }
  static std::string ExportPrefix(const std::string& tag) {
    return absl::StrCat("hmoe-kv-", PrefillId(tag), "-");
  }
  static std::unique_ptr<Process> StartDecode(const std::string& tag) {
    return Process::Start(*g_shared, kDecodeWorker, "decode-" + tag, {"--kv-blocks", "64"});
  }
};

// Acceptance 3: prefill worker -> KV handle -> decode worker continues the sequence.
TEST_F(PrefillWorkerTest, HandOffToTheDecodeWorkerContinuesTheSequence) {
  auto prefill = StartPrefill("handoff");
  auto decode = StartDecode("handoff");
  ASSERT_NE(prefill, nullptr);
  ASSERT_NE(decode, nullptr);
  PrefillClient client(*prefill);
  struct Case {
    std::string name;
    dv1::SamplingParams sampling;
  };
  std::vector<Case> cases(2);
  cases[0].name = "greedy";
  cases[1].name = "sampled";
  cases[1].sampling.set_temperature(0.8f);
  cases[1].sampling.set_top_k(50);
  cases[1].sampling.set_repetition_penalty(1.05f);
  cases[1].sampling.set_seed(1234);
  for (const Case& c : cases) {
    SCOPED_TRACE(c.name);
    const std::vector<int32_t> prompt = Prompt(40, c.name.size());
    v1::PrefillResponse prefilled;
    const grpc::Status s = client.Prefill(PrefillRequest(c.name, prompt, c.sampling), &prefilled);
    ASSERT_TRUE(s.ok()) << s.error_message() << prefill->child().ReadStderr();
    ASSERT_TRUE(prefilled.kv_handle().has_shm_name());
    const std::string segment = prefilled.kv_handle().shm_name();
    EXPECT_TRUE(absl::StartsWith(segment, ExportPrefix("handoff"))) << segment;
    EXPECT_EQ(prefilled.kv_handle().num_tokens(), 40);
    EXPECT_EQ(prefilled.kv_handle().layout_version(), kKvHandoffLayoutVersion);
    EXPECT_EQ(prefilled.prompt_tokens(), 40);
    EXPECT_GT(prefilled.timing().prefill_us(), 0);
    EXPECT_GT(prefilled.timing().bytes_streamed(), 0);
    EXPECT_GT(prefilled.timing().peak_device_bytes(), 0);
    EXPECT_TRUE(ShmExists(segment));
    EXPECT_EQ(client.Status().exports(), 1);

    // The router's part: admit with the handle, release once the decode worker acknowledges.
    bool released = false;
    const Generation g = Admit(*decode, HandOff(c.name, prompt, prefilled, c.sampling),
                               [&] { released = client.Release(c.name).ok(); });
    ASSERT_TRUE(g.status.ok()) << g.status.error_message() << decode->child().ReadStderr();
    EXPECT_TRUE(g.kv_imported_first);
    EXPECT_TRUE(released);
    EXPECT_FALSE(ShmExists(segment));  // freed after the ack
    EXPECT_EQ(client.Status().exports(), 0);
    EXPECT_EQ(client.Release(c.name).error_code(), grpc::StatusCode::NOT_FOUND);
    ASSERT_TRUE(g.finished);
    EXPECT_EQ(g.finish.reason(), dv1::FINISH_REASON_LENGTH);
    EXPECT_EQ(g.finish.usage().imported_tokens(), 40);
    std::vector<int32_t> tokens = {prefilled.first_token_id()};
    tokens.insert(tokens.end(), g.tokens.begin(), g.tokens.end());
    ASSERT_EQ(tokens.size(), static_cast<size_t>(kTokens));

    // The decode worker alone (chunked prefill of the whole prompt in one step): the same
    // tokens, bitwise (SLP computes the prompt exactly as the decode worker does), sampled ones
    // included — so the RNG stream continues where the prefill worker's first token left it.
    const Generation alone = Admit(*decode, AdmitRequest(c.name + "-alone", prompt, c.sampling));
    ASSERT_TRUE(alone.status.ok()) << alone.status.error_message();
    EXPECT_EQ(tokens, alone.tokens);
    if (c.name == "greedy") {
      // The same tokens as the decode worker alone, which prefills the prompt in one chunk
      // (--chunk-size 512): replayed in process that way with the engine's routing, under the
      // score-gap rule and the derived per-step tolerances (docs/conformance.md).
      auto agreement = CheckAgreementWithRoutingFlips(*g_shared->checkpoint, *g_shared->reference,
                                                      prompt, tokens, /*chunk_size=*/512);
      ASSERT_TRUE(agreement.ok()) << agreement.status();
      EXPECT_TRUE(agreement->ok()) << agreement->detail;
      RecordProperty("greedy_divergences", agreement->divergences);
    }
  }
  EXPECT_EQ(client.Status().prefills(), 2);
  EXPECT_EQ(prefill->Terminate(), 0);
  EXPECT_EQ(decode->Terminate(), 0);
  EXPECT_TRUE(ShmWithPrefix(ExportPrefix("handoff")).empty());
}

TEST_F(PrefillWorkerTest, UnclaimedExportIsFreedAfterTheTimeout) {
  // Long enough that the export still exists when the response has reached this test on a
  // loaded machine; short enough to wait for.
  auto prefill = StartPrefill("timeout", {"--export-timeout-seconds", "4"});
  ASSERT_NE(prefill, nullptr);
  PrefillClient client(*prefill);
  v1::PrefillResponse prefilled;
  ASSERT_TRUE(client.Prefill(PrefillRequest("t", Prompt(20, 1)), &prefilled).ok());
  const std::string segment = prefilled.kv_handle().shm_name();
  EXPECT_TRUE(ShmExists(segment));
  EXPECT_TRUE(Eventually([&] { return !ShmExists(segment); }));
  const v1::PrefillStatus st = client.Status();
  EXPECT_EQ(st.exports(), 0);
  EXPECT_EQ(st.exports_expired(), 1);
  const grpc::Status late = client.Release("t");
  EXPECT_EQ(late.error_code(), grpc::StatusCode::NOT_FOUND);
  EXPECT_TRUE(absl::StrContains(late.error_message(), "timeout")) << late.error_message();
  EXPECT_EQ(prefill->Terminate(), 0);
}

// The decode worker dies between Admit and its acknowledgement: nobody releases the export, the
// prefill worker frees it after the timeout, and no segment is left anywhere.
TEST_F(PrefillWorkerTest, DecodeWorkerKilledMidImportLeaksNoSegment) {
  auto prefill = StartPrefill("killed", {"--export-timeout-seconds", "4"});
  auto decode = StartDecode("killed");
  ASSERT_NE(prefill, nullptr);
  ASSERT_NE(decode, nullptr);
  PrefillClient client(*prefill);
  const std::vector<int32_t> prompt = Prompt(900, 7);  // the largest hand-off tiny allows here
  v1::PrefillResponse prefilled;
  ASSERT_TRUE(client.Prefill(PrefillRequest("k", prompt), &prefilled).ok());
  const std::string segment = prefilled.kv_handle().shm_name();
  ASSERT_TRUE(ShmExists(segment));
  Generation g;
  std::thread router([&] { g = Admit(*decode, HandOff("k", prompt, prefilled)); });
  ASSERT_TRUE(decode->child().Signal(SIGKILL).ok());  // while it opens / copies the hand-off
  router.join();
  EXPECT_FALSE(g.status.ok());
  auto killed = decode->child().Wait(10s);
  ASSERT_TRUE(killed.ok()) << killed.status();
  EXPECT_EQ(killed->signal, SIGKILL);
  // No acknowledgement reached the "router", so no Release: the timeout frees the segment.
  EXPECT_TRUE(Eventually([&] { return !ShmExists(segment); }));
  EXPECT_TRUE(ShmWithPrefix(ExportPrefix("killed")).empty());
  const v1::PrefillStatus st = client.Status();
  EXPECT_EQ(st.exports(), 0);
  EXPECT_EQ(st.exports_expired(), 1);
  // The prefill worker serves on; a restarted decode worker takes the next hand-off.
  auto restarted = StartDecode("killed-2");
  ASSERT_NE(restarted, nullptr);
  ASSERT_TRUE(client.Prefill(PrefillRequest("k2", Prompt(30, 8)), &prefilled).ok());
  const Generation next = Admit(*restarted, HandOff("k2", Prompt(30, 8), prefilled),
                                [&] { EXPECT_TRUE(client.Release("k2").ok()); });
  EXPECT_TRUE(next.status.ok()) << next.status.error_message();
  EXPECT_EQ(next.tokens.size(), static_cast<size_t>(kTokens - 1));
  EXPECT_EQ(prefill->Terminate(), 0);
  EXPECT_EQ(restarted->Terminate(), 0);
}

TEST_F(PrefillWorkerTest, BadRequestsGetTheDocumentedCodes) {
  auto prefill =
      StartPrefill("errors", {"--drain-seconds", "0.5", "--dslp-join-timeout-seconds", "0.3"});
  ASSERT_NE(prefill, nullptr);
  PrefillClient client(*prefill);
  v1::PrefillResponse resp;
  v1::PrefillRequest bad = PrefillRequest("bad", {1, 2, 5000});
  grpc::Status s = client.Prefill(bad, &resp);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_TRUE(absl::StrContains(s.error_message(), "prompt_token_ids[2]")) << s.error_message();
  EXPECT_EQ(client.Prefill(PrefillRequest("long", Prompt(1001, 1)), &resp).error_code(),
            grpc::StatusCode::INVALID_ARGUMENT);
  // DSLP: a bad group names the field; a group whose other rank never comes is ABORTED (the
  // group did not form) and leaves no shared-memory object.
  v1::PrefillRequest dslp = PrefillRequest("dslp", Prompt(4, 1));
  dslp.mutable_dslp()->set_world_size(2);
  s = client.Prefill(dslp, &resp);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_TRUE(absl::StrContains(s.error_message(), "dslp.group_id")) << s.error_message();
  const std::string group = absl::StrCat("test-lonely-", ::getpid());
  dslp.mutable_dslp()->set_group_id(group);
  dslp.mutable_dslp()->set_shm_group(group);
  s = client.Prefill(dslp, &resp);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::ABORTED);
  EXPECT_TRUE(absl::StrContains(s.error_message(), "did not form")) << s.error_message();
  EXPECT_TRUE(ShmWithPrefix("hmoe.comm." + group).empty());
  ASSERT_TRUE(client.Prefill(PrefillRequest("dup", Prompt(4, 1)), &resp).ok());
  EXPECT_EQ(client.Prefill(PrefillRequest("dup", Prompt(4, 1)), &resp).error_code(),
            grpc::StatusCode::ALREADY_EXISTS);
  EXPECT_EQ(client.Release("nobody").error_code(), grpc::StatusCode::NOT_FOUND);
  EXPECT_EQ(client.Cancel("nobody").error_code(), grpc::StatusCode::NOT_FOUND);
  const v1::PrefillStatus st = client.Status();
  EXPECT_EQ(st.worker_id(), PrefillId("errors"));
  EXPECT_EQ(st.device(), "cpu");
  EXPECT_EQ(st.exports(), 1);
  EXPECT_GT(st.ring_slots(), 0);
  EXPECT_GT(st.ring_slot_bytes(), 0);
  EXPECT_GT(st.last_peak_device_bytes(), 0);
  // SIGTERM: drains (nobody releases "dup" within --drain-seconds), exits 0, frees the export.
  EXPECT_EQ(prefill->Terminate(), 0);
  EXPECT_TRUE(ShmWithPrefix(ExportPrefix("errors")).empty());
}

class FakeRegistry final : public registry::v1::WorkerRegistry::Service {
 public:
  grpc::Status Register(grpc::ServerContext*, const registry::v1::RegisterRequest* req,
                        registry::v1::RegisterResponse* resp) override {
    absl::MutexLock lock(&mu_);
    registers_.push_back(*req);
    resp->set_heartbeat_interval_ms(20);
    return grpc::Status::OK;
  }
  grpc::Status Heartbeat(grpc::ServerContext*, const registry::v1::HeartbeatRequest* req,
                         registry::v1::HeartbeatResponse*) override {
    absl::MutexLock lock(&mu_);
    heartbeats_.push_back(*req);
    return grpc::Status::OK;
  }
  std::vector<registry::v1::RegisterRequest> registers() {
    absl::MutexLock lock(&mu_);
    return registers_;
  }
  std::vector<registry::v1::HeartbeatRequest> heartbeats() {
    absl::MutexLock lock(&mu_);
    return heartbeats_;
  }

 private:
  absl::Mutex mu_;
  std::vector<registry::v1::RegisterRequest> registers_ ABSL_GUARDED_BY(mu_);
  std::vector<registry::v1::HeartbeatRequest> heartbeats_ ABSL_GUARDED_BY(mu_);
};

TEST_F(PrefillWorkerTest, RegistersWithTheRouterAsAPrefillWorkerAndHeartbeats) {
  const std::string router_sock = g_shared->dir.File("router.sock");
  FakeRegistry registry;
  grpc::ServerBuilder builder;
  builder.AddListeningPort("unix:" + router_sock, grpc::InsecureServerCredentials());
  builder.RegisterService(&registry);
  std::unique_ptr<grpc::Server> server = builder.BuildAndStart();
  ASSERT_NE(server, nullptr);
  auto prefill = StartPrefill("reg", {"--router", "unix:" + router_sock, "--heartbeat-ms", "50"});
  ASSERT_NE(prefill, nullptr);
  EXPECT_TRUE(Eventually([&] { return registry.heartbeats().size() >= 2; }))
      << prefill->child().ReadStderr();
  const auto regs = registry.registers();
  ASSERT_FALSE(regs.empty());
  EXPECT_EQ(regs[0].kind(), registry::v1::WORKER_KIND_PREFILL);
  EXPECT_EQ(regs[0].worker_id(), PrefillId("reg"));
  EXPECT_EQ(regs[0].endpoint(), "unix:" + prefill->socket());
  EXPECT_EQ(regs[0].device(), "cpu");
  EXPECT_EQ(regs[0].pid(), prefill->child().pid());
  const auto beats = registry.heartbeats();
  EXPECT_EQ(beats.back().load().batch_size(), 1);
  EXPECT_GT(beats.back().load().kv_blocks_total(), 0);
  EXPECT_EQ(prefill->Terminate(), 0);
  server->Shutdown();
}

TEST_F(PrefillWorkerTest, BadFlagsExitNonZeroWithAMessage) {
  struct Case {
    std::vector<std::string> flags;
    int code;
    std::string message;
  };
  const std::vector<Case> cases = {
      {{"--device", "gpu"}, 2, "--device"},
      {{"--kv-export", "nfs"}, 2, "--kv-export"},
      {{"--kv-export", "cuda-ipc"}, 2, "cuda"},
      {{"--export-timeout-seconds", "0"}, 2, "export-timeout"},
      {{"--max-prompt-tokens", "5000"}, 2, "max_position_embeddings"},
      {{"--stream-budget-mb", "0", "--max-prompt-tokens", "100", "--device-memory-mb", "1"},
       1,
       "do not fit"},
      {{"--device", "cuda:99"}, 1, "cuda"},  // no host has 100 GPUs: fails with and without one
      {{"--dslp-ep-mode", "tensor"}, 2, "--dslp-ep-mode"},
      {{"--dslp-join-timeout-seconds", "0"}, 2, "--dslp-join-timeout-seconds"},
  };
  int i = 0;
  for (const Case& c : cases) {
    SCOPED_TRACE(absl::StrCat("case ", i));
    std::vector<std::string> argv = {kPrefillWorker, "--model", g_shared->model, "--socket",
                                     g_shared->dir.File(absl::StrCat("flags-", i, "/p.sock"))};
    argv.insert(argv.end(), c.flags.begin(), c.flags.end());
    ChildOptions o;
    o.argv = std::move(argv);
    o.stderr_path = g_shared->dir.File(absl::StrCat("flags-", i, ".err"));
    auto child = ChildProcess::Start(std::move(o));
    ASSERT_TRUE(child.ok());
    auto code = child->WaitForExit(60s);
    ASSERT_TRUE(code.ok()) << code.status();
    EXPECT_EQ(*code, c.code) << child->ReadStderr();
    EXPECT_TRUE(absl::StrContains(child->ReadStderr(), c.message)) << child->ReadStderr();
    ++i;
  }
}

}  // namespace
}  // namespace hmoe::prefill
