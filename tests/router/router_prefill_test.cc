// The router's SLP/DSLP paths (router.h) against fake prefill and decode workers and a fake clock,
// without gRPC (so TSan sees everything): the policy's path choices as the router applies them,
// the KV hand-off (Prefill -> Admit with the handle and first token -> Release after KvImported,
// and Release on every failure), DSLP group membership, the fallback from DSLP to SLP, retries of
// requests that streamed nothing, the FCFS prefill queue with its bound, and cancellation while
// waiting for or running a prefill. Also PrefillQueue on its own.

#include <atomic>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"

#include "router/clock.h"
#include "router/prefill_queue.h"
#include "router/router.h"
#include "router/worker_registry.h"
#include "tests/router/fake_decode_client.h"
#include "tests/router/fake_prefill_client.h"

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace hmoe::router {
namespace {

namespace v1 = hmoe::v1;
namespace dv1 = hmoe::decode::v1;
namespace pv1 = hmoe::prefill::v1;
using testing::EventLog;
using testing::FakeFactory;
using testing::FakePrefillFactory;
using testing::Gate;
using testing::PrefillLog;
using testing::PrefillScript;
using testing::Script;
using testing::WorkerLog;

constexpr int kThreshold = 16;  // prompts of >= 16 tokens are long

class Sink : public GenerateSink {
 public:
  bool Write(const v1::GenerateResponse& r) override ABSL_LOCKS_EXCLUDED(mu_) {
    absl::MutexLock lock(&mu_);
    responses_.push_back(r);
    return true;
  }
  bool IsCancelled() override { return cancelled_.load(std::memory_order_relaxed); }
  void CancelClient() { cancelled_.store(true, std::memory_order_relaxed); }
  std::vector<v1::GenerateResponse> responses() ABSL_LOCKS_EXCLUDED(mu_) {
    absl::MutexLock lock(&mu_);
    return responses_;
  }
  std::vector<int32_t> tokens() {
    std::vector<int32_t> out;
    for (const auto& r : responses()) {
      if (r.has_token()) out.push_back(r.token().token_id());
    }
    return out;
  }
  // The Finished message (default instance when the stream has none).
  v1::Finished finished() {
    const std::vector<v1::GenerateResponse> r = responses();
    return !r.empty() && r.back().has_finished() ? r.back().finished() : v1::Finished();
  }

 private:
  // Relaxed: a plain flag polled by the router's watcher, which re-checks under its own locks.
  std::atomic<bool> cancelled_{false};
  absl::Mutex mu_;
  std::vector<v1::GenerateResponse> responses_ ABSL_GUARDED_BY(mu_);
};

class RouterPrefillTest : public ::testing::Test {
 protected:
  // `retry_wait`: how long a retry waits for a live decode worker. Short by default so that the
  // tests where none comes end quickly; a test where another thread brings one back passes a
  // generous one.
  void Start(RouterOptions options = {}, absl::Duration retry_wait = absl::Milliseconds(200)) {
    options.limits = {.vocab_size = 1000, .context_length = 4096};
    options.policy.chunk_threshold_tokens = kThreshold;
    options.cancel_poll = absl::Milliseconds(2);
    options.retry_wait = retry_wait;
    router_ = std::make_unique<Router>(options, &registry_, &decode_, &prefill_, nullptr, &clock_);
  }
  void AddDecode(const std::string& id, const std::string& device, Script script) {
    decode_.Set("fake:" + id, std::move(script));
    Register(id, WorkerKind::kDecode, device);
  }
  void AddPrefill(const std::string& id, const std::string& device, PrefillScript script = {}) {
    prefill_.Set("fake:" + id, id, std::move(script));
    Register(id, WorkerKind::kPrefill, device);
  }
  void Register(const std::string& id, WorkerKind kind, const std::string& device) {
    WorkerIdentity w;
    w.worker_id = id;
    w.kind = kind;
    w.endpoint = "fake:" + id;
    w.device = device;
    ASSERT_TRUE(registry_.Register(w).ok());
  }
  static v1::GenerateRequest Request(const std::string& id, int prompt_tokens, int max_new = 8) {
    v1::GenerateRequest r;
    r.set_request_id(id);
    for (int i = 0; i < prompt_tokens; ++i) r.mutable_prompt_token_ids()->add_ids(100 + i);
    r.set_max_new_tokens(max_new);
    return r;
  }
  absl::Status Generate(const v1::GenerateRequest& r, Sink* sink,
                        absl::Duration timeout = absl::Seconds(30)) {
    return router_->Generate(r, absl::Now() + timeout, sink);
  }
  // A short request through the decode worker: decode was active just now (fake clock).
  void MakeDecodeActive() {
    Sink sink;
    ASSERT_TRUE(Generate(Request("warm", 4), &sink).ok());
    ASSERT_EQ(sink.finished().timing().path(), v1::PATH_CHUNKED);
  }
  // Bounded wait (not a timing assertion).
  template <typename F>
  void WaitUntil(F done, const std::string& what) {
    const absl::Time end = absl::Now() + absl::Seconds(30);
    while (!done() && absl::Now() < end) absl::SleepFor(absl::Milliseconds(1));
    ASSERT_TRUE(done()) << what;
  }
  size_t Prefills(const std::string& worker) {
    PrefillLog& log = prefill_.log("fake:" + worker);
    absl::MutexLock lock(&log.mu);
    return log.prefills.size();
  }
  std::vector<std::string> Released(const std::string& worker) {
    PrefillLog& log = prefill_.log("fake:" + worker);
    absl::MutexLock lock(&log.mu);
    return log.released;
  }

  EventLog events_;
  FakeClock clock_;
  WorkerRegistry registry_{&clock_, {.heartbeat_timeout = absl::Hours(1)}};
  FakeFactory decode_{&events_};
  FakePrefillFactory prefill_{&events_};
  std::unique_ptr<Router> router_;
};

TEST_F(RouterPrefillTest, LongPromptNextToDecodeTakesSlpOffTheDecodeDeviceAndHandsOverTheKv) {
  Start();
  AddDecode("d0", "cuda:0", {.tokens = {21, 22, 23}});
  AddPrefill("p0", "cuda:0");
  AddPrefill("p1", "cuda:1", {.first_token = 20});
  MakeDecodeActive();

  Sink sink;
  v1::GenerateRequest req = Request("long", 40);
  req.mutable_sampling()->set_seed(5);
  ASSERT_TRUE(Generate(req, &sink).ok());
  EXPECT_EQ(sink.tokens(), (std::vector<int32_t>{20, 21, 22, 23}));
  const v1::Finished f = sink.finished();
  EXPECT_EQ(f.timing().path(), v1::PATH_SLP);
  ASSERT_EQ(f.timing().worker_ids_size(), 2);
  EXPECT_EQ(f.timing().worker_ids(0), "d0");
  EXPECT_EQ(f.timing().worker_ids(1), "p1");
  EXPECT_EQ(f.usage().prompt_tokens(), 40);
  EXPECT_GT(f.timing().ttft_us(), 0);

  EXPECT_EQ(Prefills("p0"), 0u);
  {
    PrefillLog& log = prefill_.log("fake:p1");
    absl::MutexLock lock(&log.mu);
    ASSERT_EQ(log.prefills.size(), 1u);
    EXPECT_EQ(log.prefills[0].request_id(), "long");
    EXPECT_EQ(log.prefills[0].prompt_token_ids_size(), 40);
    EXPECT_EQ(log.prefills[0].sampling().seed(), 5u);
    EXPECT_FALSE(log.prefills[0].has_dslp());
    EXPECT_EQ(log.released, (std::vector<std::string>{"long"}));
  }
  {
    WorkerLog& log = decode_.log("fake:d0");
    absl::MutexLock lock(&log.mu);
    ASSERT_EQ(log.admitted.size(), 2u);
    const dv1::AdmitRequest& a = log.admitted[1];
    EXPECT_EQ(a.kv_handle().shm_name(), "kv-p1-long");
    EXPECT_EQ(a.kv_handle().num_tokens(), 40);
    EXPECT_EQ(a.first_token_id(), 20);
    EXPECT_EQ(a.prompt_token_ids_size(), 40);  // for the repetition penalty
  }
  // Release only after the decode worker acknowledged the import.
  const int imported = events_.IndexOf("kv_imported:long");
  const int released = events_.IndexOf("release:long");
  ASSERT_GE(imported, 0);
  EXPECT_GT(released, imported);
  EXPECT_LT(events_.IndexOf("prefill:long"), events_.IndexOf("admit:long"));
}

TEST_F(RouterPrefillTest, LongPromptOnlySharedPrefillWorkersNextToDecodeIsChunked) {
  Start();
  AddDecode("d0", "cuda:0", {.tokens = {1}});
  AddPrefill("p0", "cuda:0");
  MakeDecodeActive();
  Sink sink;
  ASSERT_TRUE(Generate(Request("long", 40), &sink).ok());
  EXPECT_EQ(sink.finished().timing().path(), v1::PATH_CHUNKED);
  EXPECT_EQ(Prefills("p0"), 0u);
}

TEST_F(RouterPrefillTest, CpuDevicesCountAsDistinctWhenConfigured) {
  RouterOptions options;
  options.policy.cpu_devices_shared = false;
  Start(options);
  AddDecode("d0", "cpu", {.tokens = {1}});
  AddPrefill("p0", "cpu");
  MakeDecodeActive();
  Sink sink;
  ASSERT_TRUE(Generate(Request("long", 40), &sink).ok());
  EXPECT_EQ(sink.finished().timing().path(), v1::PATH_SLP);
}

TEST_F(RouterPrefillTest, LongPromptWithDecodeIdleForTheWindowIsDslpOverEveryPrefillWorker) {
  Start();
  AddDecode("d0", "cuda:0", {.tokens = {31}});
  AddPrefill("p0", "cuda:0", {.first_token = 30});
  AddPrefill("p1", "cuda:1", {.first_token = 99});
  MakeDecodeActive();
  clock_.Advance(absl::Minutes(5));  // the idle window has passed

  Sink sink;
  ASSERT_TRUE(Generate(Request("dslp", 40), &sink).ok());
  EXPECT_EQ(sink.tokens(), (std::vector<int32_t>{30, 31}));  // rank 0's first token
  const v1::Finished f = sink.finished();
  EXPECT_EQ(f.timing().path(), v1::PATH_DSLP);
  ASSERT_EQ(f.timing().worker_ids_size(), 3);
  EXPECT_EQ(f.timing().worker_ids(1), "p0");
  EXPECT_EQ(f.timing().worker_ids(2), "p1");

  std::string group;
  for (int rank = 0; rank < 2; ++rank) {
    PrefillLog& log = prefill_.log(absl::StrCat("fake:p", rank));
    absl::MutexLock lock(&log.mu);
    ASSERT_EQ(log.prefills.size(), 1u);
    const pv1::PrefillRequest& p = log.prefills[0];
    EXPECT_EQ(p.request_id(), "dslp");
    EXPECT_EQ(p.prompt_token_ids_size(), 40);
    ASSERT_TRUE(p.has_dslp());
    EXPECT_EQ(p.dslp().rank(), rank);
    EXPECT_EQ(p.dslp().world_size(), 2);
    EXPECT_FALSE(p.dslp().group_id().empty());
    EXPECT_EQ(p.dslp().shm_group(), p.dslp().group_id());
    if (rank == 0) group = p.dslp().group_id();
    EXPECT_EQ(p.dslp().group_id(), group);
  }
  // Rank 0 holds the hand-off; rank 1 returned no handle, so nothing to release there.
  EXPECT_EQ(Released("p0"), (std::vector<std::string>{"dslp"}));
  EXPECT_TRUE(Released("p1").empty());
  WorkerLog& log = decode_.log("fake:d0");
  absl::MutexLock lock(&log.mu);
  EXPECT_EQ(log.admitted.back().kv_handle().shm_name(), "kv-p0-dslp");
}

TEST_F(RouterPrefillTest, LongPromptOnAFreshRouterIsDslp) {
  Start();
  AddDecode("d0", "cuda:0", {.tokens = {31}});
  AddPrefill("p0", "cuda:0");
  AddPrefill("p1", "cuda:1");
  Sink sink;
  ASSERT_TRUE(Generate(Request("fresh", 40), &sink).ok());
  EXPECT_EQ(sink.finished().timing().path(), v1::PATH_DSLP);
}

TEST_F(RouterPrefillTest, DslpGroupReleasesEveryRankThatReturnedAHandle) {
  Start();
  AddDecode("d0", "cuda:0", {.tokens = {31}});
  AddPrefill("p0", "cuda:0", {.every_rank_returns_a_handle = true});
  AddPrefill("p1", "cuda:1", {.every_rank_returns_a_handle = true});
  Sink sink;
  ASSERT_TRUE(Generate(Request("both", 40), &sink).ok());
  EXPECT_EQ(Released("p0"), (std::vector<std::string>{"both"}));
  EXPECT_EQ(Released("p1"), (std::vector<std::string>{"both"}));
}

TEST_F(RouterPrefillTest, DslpRefusedAsUnimplementedIsRetriedAsSlp) {
  Start();
  AddDecode("d0", "cuda:0", {.tokens = {31}});
  const absl::Status no_dslp = absl::UnimplementedError("dslp: not implemented");
  AddPrefill("p0", "cuda:0", {.first_token = 11, .dslp_status = no_dslp});
  AddPrefill("p1", "cuda:1", {.first_token = 12, .dslp_status = no_dslp});
  Sink sink;
  ASSERT_TRUE(Generate(Request("fallback", 40), &sink).ok());
  const v1::Finished f = sink.finished();
  EXPECT_EQ(f.timing().path(), v1::PATH_SLP);
  EXPECT_EQ(f.timing().attempts(), 2);
  EXPECT_EQ(sink.tokens(), (std::vector<int32_t>{11, 31}));    // SLP on the first free worker
  EXPECT_EQ(registry_.Find("p0")->state, WorkerState::kLive);  // not a dead worker
  EXPECT_EQ(registry_.Find("p1")->state, WorkerState::kLive);
}

// A prompt the workers cannot split (INVALID_ARGUMENT from the ranks, e.g. a rank's share beyond
// their --max-step-tokens) is retried as SLP when DSLP was the policy's choice, and relayed when
// the client asked for DSLP.
TEST_F(RouterPrefillTest, DslpPromptTheWorkersCannotSplitIsRetriedAsSlp) {
  Start();
  AddDecode("d0", "cuda:0", {.tokens = {31}});
  const absl::Status split = absl::InvalidArgumentError("prompt_token_ids: 40 tokens over 2 ranks");
  AddPrefill("p0", "cuda:0", {.first_token = 11, .dslp_status = split});
  AddPrefill("p1", "cuda:1", {.first_token = 12, .dslp_status = split});
  Sink sink;
  ASSERT_TRUE(Generate(Request("split", 40), &sink).ok());
  EXPECT_EQ(sink.finished().timing().path(), v1::PATH_SLP);
  EXPECT_EQ(sink.finished().timing().attempts(), 2);
  v1::GenerateRequest hinted = Request("hinted-split", 40);
  hinted.set_path_hint(v1::PATH_HINT_DSLP);
  Sink sink2;
  const absl::Status s = Generate(hinted, &sink2);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_TRUE(absl::StrContains(s.message(), "40 tokens over 2 ranks")) << s;
  EXPECT_EQ(registry_.Find("p0")->state, WorkerState::kLive);
  EXPECT_EQ(registry_.Find("p1")->state, WorkerState::kLive);
}

TEST_F(RouterPrefillTest, DslpHintWhenDslpIsRefusedIsFailedPrecondition) {
  Start();
  AddDecode("d0", "cuda:0", {.tokens = {31}});
  const absl::Status no_dslp = absl::UnimplementedError("dslp: not implemented");
  AddPrefill("p0", "cuda:0", {.dslp_status = no_dslp});
  AddPrefill("p1", "cuda:1", {.dslp_status = no_dslp});
  Sink sink;
  v1::GenerateRequest req = Request("hinted", 4);
  req.set_path_hint(v1::PATH_HINT_DSLP);
  const absl::Status s = Generate(req, &sink);
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition) << s;
  EXPECT_TRUE(sink.responses().empty());
}

TEST_F(RouterPrefillTest, PrefillWorkerDyingBeforeAnyTokenIsRetriedWithoutIt) {
  Start();
  AddDecode("d0", "cuda:0", {.tokens = {5, 6}});
  AddPrefill("p0", "cuda:0");
  AddPrefill("p1", "cuda:1", {.status = absl::UnavailableError("socket closed")});
  MakeDecodeActive();
  Sink sink;
  ASSERT_TRUE(Generate(Request("retry", 40), &sink).ok());
  const v1::Finished f = sink.finished();
  EXPECT_EQ(f.timing().attempts(), 2);
  // p1 is dead; p0 shares the decode device, so the retry prefills on the decode worker.
  EXPECT_EQ(f.timing().path(), v1::PATH_CHUNKED);
  EXPECT_EQ(sink.tokens(), (std::vector<int32_t>{5, 6}));
  EXPECT_EQ(registry_.Find("p1")->state, WorkerState::kDead);
}

TEST_F(RouterPrefillTest, PrefillErrorsAboutTheRequestAreRelayed) {
  Start();
  AddDecode("d0", "cuda:0", {.tokens = {5}});
  AddPrefill("p1", "cuda:1",
             {.status = absl::ResourceExhaustedError("device budget cannot hold the prompt")});
  Sink sink;
  const absl::Status s = Generate(Request("big", 40), &sink);
  EXPECT_EQ(s.code(), absl::StatusCode::kResourceExhausted) << s;
  EXPECT_NE(s.message().find("prefill worker p1"), std::string::npos) << s;
  EXPECT_EQ(registry_.Find("p1")->state, WorkerState::kLive);
}

TEST_F(RouterPrefillTest, DecodeRefusingTheHandoffStillReleasesIt) {
  Start();
  AddDecode("d0", "cuda:0",
            {.tokens = {5}, .import_error = absl::InvalidArgumentError("kv_handle: bad layout")});
  AddPrefill("p1", "cuda:1");
  Sink sink;
  const absl::Status s = Generate(Request("refused", 40), &sink);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_EQ(Released("p1"), (std::vector<std::string>{"refused"}));
  EXPECT_TRUE(sink.tokens().empty());
}

TEST_F(RouterPrefillTest, DecodeDyingBeforeTheImportRetriesAndReleasesBothHandoffs) {
  Start({}, absl::Seconds(30));  // the restart thread below must re-register d0 within it
  AddDecode("d0", "cuda:0", {.tokens = {5}, .import_error = absl::UnavailableError("killed")});
  AddPrefill("p1", "cuda:1", {.first_token = 4});
  Sink sink;
  std::jthread restart([&] {
    WaitUntil([&] { return registry_.Find("d0")->state == WorkerState::kDead; }, "d0 dead");
    decode_.Set("fake:d0-new", {.tokens = {5}});
    WorkerIdentity w;
    w.worker_id = "d0";
    w.kind = WorkerKind::kDecode;
    w.endpoint = "fake:d0-new";
    w.device = "cuda:0";
    EXPECT_TRUE(registry_.Register(w).ok());
  });
  ASSERT_TRUE(Generate(Request("again", 40), &sink).ok());
  restart.join();
  EXPECT_EQ(sink.tokens(), (std::vector<int32_t>{4, 5}));
  EXPECT_EQ(sink.finished().timing().attempts(), 2);
  // The second attempt's prefill has its own id: the first one's export may still exist.
  EXPECT_EQ(Released("p1"), (std::vector<std::string>{"again", "again:2"}));
}

TEST_F(RouterPrefillTest, DecodeDyingAfterTheFirstTokenIsUnavailable) {
  Start();
  AddDecode("d0", "cuda:0", {.tokens = {5}, .end = absl::UnavailableError("socket closed")});
  AddPrefill("p1", "cuda:1", {.first_token = 4});
  Sink sink;
  const absl::Status s = Generate(Request("lost", 40), &sink);
  EXPECT_EQ(s.code(), absl::StatusCode::kUnavailable) << s;
  EXPECT_NE(s.message().find("decode worker d0 after 2 tokens"), std::string::npos) << s;
  EXPECT_EQ(sink.tokens(), (std::vector<int32_t>{4, 5}));
  EXPECT_EQ(Released("p1"), (std::vector<std::string>{"lost"}));
}

TEST_F(RouterPrefillTest, FirstTokenThatIsEosIsNotStreamed) {
  RouterOptions options;
  options.eos_token_ids = {1, 7};
  Start(options);
  AddDecode("d0", "cuda:0", {.tokens = {}, .reason = dv1::FINISH_REASON_EOS});
  AddPrefill("p1", "cuda:1", {.first_token = 7});
  Sink sink;
  ASSERT_TRUE(Generate(Request("eos", 40), &sink).ok());
  EXPECT_TRUE(sink.tokens().empty());
  EXPECT_EQ(sink.finished().reason(), v1::FINISH_REASON_EOS);
  EXPECT_EQ(Released("p1"), (std::vector<std::string>{"eos"}));

  // With ignore_eos the same token is an ordinary one.
  Sink sink2;
  v1::GenerateRequest req = Request("eos2", 40);
  req.set_ignore_eos(true);
  ASSERT_TRUE(Generate(req, &sink2).ok());
  EXPECT_EQ(sink2.tokens(), (std::vector<int32_t>{7}));
}

TEST_F(RouterPrefillTest, PrefillIsFirstComeFirstServedAndTheQueueIsBounded) {
  RouterOptions options;
  options.max_prefill_queue = 2;
  Start(options);
  AddDecode("d0", "cuda:0", {.tokens = {5}});
  Gate gate;
  AddPrefill("p1", "cuda:1", {.gate = &gate});
  std::vector<Sink> sinks(3);
  std::vector<absl::Status> results(3);
  {
    std::vector<std::jthread> clients;
    for (int i = 0; i < 3; ++i) {
      clients.emplace_back(
          [&, i] { results[i] = Generate(Request(absl::StrCat("r", i), 40), &sinks[i]); });
      // Each joins the queue after the previous one (r0 runs, r1 and r2 wait).
      if (i == 0) WaitUntil([&] { return Prefills("p1") == 1; }, "r0 prefilling");
      if (i > 0) {
        WaitUntil([&, i] { return router_->GetStatus().prefill_queue() == i; }, "queued");
      }
    }
    Sink overflow;
    EXPECT_EQ(Generate(Request("r3", 40), &overflow).code(), absl::StatusCode::kResourceExhausted);
    const v1::RouterStatus status = router_->GetStatus();
    EXPECT_EQ(status.prefill_queue(), 2);
    EXPECT_EQ(status.max_prefill_queue(), 2);
    gate.Open();
  }
  for (int i = 0; i < 3; ++i) EXPECT_TRUE(results[i].ok()) << i << ": " << results[i];
  PrefillLog& log = prefill_.log("fake:p1");
  absl::MutexLock lock(&log.mu);
  ASSERT_EQ(log.prefills.size(), 3u);
  for (int i = 0; i < 3; ++i) EXPECT_EQ(log.prefills[i].request_id(), absl::StrCat("r", i));
}

// Issue #16: the prefill queue follows the waiting room the live prefill workers advertise (as
// the admission limit follows the decode workers'), within --max-prefill-queue.
TEST_F(RouterPrefillTest, ThePrefillQueueFollowsTheAdvertisedWaitingRoom) {
  Start();  // max_prefill_queue 64
  AddDecode("d0", "cuda:0", {.tokens = {5}});
  Gate gate;
  AddPrefill("p1", "cuda:1", {.gate = &gate});
  EXPECT_EQ(router_->GetStatus().max_prefill_queue(), 64);  // p1 has not reported yet
  ASSERT_TRUE(registry_.Heartbeat("p1", {.batch_size = 1, .max_waiting = 1}).ok());
  EXPECT_EQ(router_->GetStatus().max_prefill_queue(), 1);
  std::vector<Sink> sinks(2);
  std::vector<absl::Status> results(2);
  {
    std::vector<std::jthread> clients;
    clients.emplace_back([&] { results[0] = Generate(Request("r0", 40), &sinks[0]); });
    WaitUntil([&] { return Prefills("p1") == 1; }, "r0 prefilling");
    clients.emplace_back([&] { results[1] = Generate(Request("r1", 40), &sinks[1]); });
    WaitUntil([&] { return router_->GetStatus().prefill_queue() == 1; }, "r1 queued");
    Sink overflow;
    const absl::Status s = Generate(Request("r2", 40), &overflow);
    EXPECT_EQ(s.code(), absl::StatusCode::kResourceExhausted) << s;
    EXPECT_THAT(std::string(s.message()),
                ::testing::HasSubstr("the waiting room the live prefill workers advertise"));
    gate.Open();
  }
  for (int i = 0; i < 2; ++i) EXPECT_TRUE(results[i].ok()) << i << ": " << results[i];
  // A second prefill worker adds its room.
  AddPrefill("p2", "cuda:2");
  ASSERT_TRUE(registry_.Heartbeat("p2", {.batch_size = 1, .max_waiting = 3}).ok());
  EXPECT_EQ(router_->GetStatus().max_prefill_queue(), 4);
}

TEST_F(RouterPrefillTest, CancelWhileWaitingForAPrefillWorker) {
  Start();
  AddDecode("d0", "cuda:0", {.tokens = {5}});
  Gate gate;
  AddPrefill("p1", "cuda:1", {.gate = &gate});
  Sink first, second;
  absl::Status first_result, second_result;
  std::jthread a([&] { first_result = Generate(Request("a", 40), &first); });
  WaitUntil([&] { return Prefills("p1") == 1; }, "a prefilling");
  std::jthread b([&] { second_result = Generate(Request("b", 40), &second); });
  WaitUntil([&] { return router_->GetStatus().prefill_queue() == 1; }, "b queued");
  EXPECT_TRUE(router_->Cancel("b").ok());
  b.join();
  EXPECT_TRUE(second_result.ok()) << second_result;
  EXPECT_EQ(second.finished().reason(), v1::FINISH_REASON_CANCELLED);
  EXPECT_EQ(router_->GetStatus().prefill_queue(), 0);
  gate.Open();
  a.join();
  EXPECT_TRUE(first_result.ok()) << first_result;
  EXPECT_EQ(Prefills("p1"), 1u);  // b never reached the worker
}

TEST_F(RouterPrefillTest, CancelDuringPrefillCancelsTheWorkerCall) {
  Start();
  AddDecode("d0", "cuda:0", {.tokens = {5}});
  AddPrefill("p1", "cuda:1", {.hang = true});
  Sink sink;
  absl::Status result;
  std::jthread client([&] { result = Generate(Request("c", 40), &sink); });
  WaitUntil([&] { return Prefills("p1") == 1; }, "prefilling");
  EXPECT_TRUE(router_->Cancel("c").ok());
  client.join();
  EXPECT_TRUE(result.ok()) << result;
  EXPECT_EQ(sink.finished().reason(), v1::FINISH_REASON_CANCELLED);
  PrefillLog& log = prefill_.log("fake:p1");
  absl::MutexLock lock(&log.mu);
  EXPECT_EQ(log.cancelled, 1);
}

TEST_F(RouterPrefillTest, ClientGoneDuringDslpCancelsEveryRank) {
  Start();
  AddDecode("d0", "cuda:0", {.tokens = {5}});
  AddPrefill("p0", "cuda:0", {.hang = true});
  AddPrefill("p1", "cuda:1", {.hang = true});
  Sink sink;
  absl::Status result;
  std::jthread client([&] { result = Generate(Request("gone", 40), &sink); });
  WaitUntil([&] { return Prefills("p0") == 1 && Prefills("p1") == 1; }, "both ranks running");
  sink.CancelClient();
  client.join();
  EXPECT_EQ(result.code(), absl::StatusCode::kCancelled) << result;
  for (const char* w : {"fake:p0", "fake:p1"}) {
    PrefillLog& log = prefill_.log(w);
    absl::MutexLock lock(&log.mu);
    EXPECT_EQ(log.cancelled, 1) << w;
  }
}

TEST_F(RouterPrefillTest, OneDslpRankFailingCancelsTheOthersAndRetries) {
  Start();
  AddDecode("d0", "cuda:0", {.tokens = {5}});
  AddPrefill("p0", "cuda:0", {.first_token = 3, .hang_in_dslp = true});
  AddPrefill("p1", "cuda:1", {.dslp_status = absl::UnavailableError("peer gone")});
  Sink sink;
  ASSERT_TRUE(Generate(Request("rank", 40), &sink).ok());
  // p1 is dead and p0's rank was cancelled; the retry (decode idle, one live prefill worker) is SLP
  // on p0.
  EXPECT_EQ(sink.tokens(), (std::vector<int32_t>{3, 5}));
  const v1::Finished f = sink.finished();
  EXPECT_EQ(f.timing().path(), v1::PATH_SLP);
  EXPECT_EQ(f.timing().attempts(), 2);
  EXPECT_EQ(registry_.Find("p1")->state, WorkerState::kDead);
  EXPECT_EQ(registry_.Find("p0")->state, WorkerState::kLive);
  PrefillLog& log = prefill_.log("fake:p0");
  absl::MutexLock lock(&log.mu);
  EXPECT_EQ(log.cancelled, 1);
  ASSERT_EQ(log.prefills.size(), 2u);
  EXPECT_EQ(log.prefills[1].request_id(), "rank:2");
  EXPECT_FALSE(log.prefills[1].has_dslp());
}

// A rank answering ABORTED reports a broken group (its peer died): the router does not cancel the
// other ranks at once, so the dead rank's own failed call names it; only that worker is marked
// dead and the retry (decode idle, one live prefill worker) runs SLP on the live one.
TEST_F(RouterPrefillTest, DslpRankReportingABrokenGroupLetsTheDeadRankNameItself) {
  RouterOptions o;
  o.dslp_failure_grace = absl::Seconds(30);  // the opener below must open the gate within it
  Start(o);
  AddDecode("d0", "cuda:0", {.tokens = {5}});
  Gate gate;
  AddPrefill(
      "p0", "cuda:0",
      {.first_token = 3, .dslp_status = absl::AbortedError("dslp group g failed: rank 1 died")});
  AddPrefill("p1", "cuda:1",
             {.dslp_status = absl::UnavailableError("Socket closed"), .gate = &gate});
  std::jthread opener([&] {
    WaitUntil([&] { return Prefills("p0") == 1 && Prefills("p1") == 1; }, "both ranks running");
    absl::SleepFor(absl::Milliseconds(50));  // p0's ABORTED reaches the router first
    gate.Open();
  });
  Sink sink;
  ASSERT_TRUE(Generate(Request("broken", 40), &sink).ok());
  EXPECT_EQ(sink.tokens(), (std::vector<int32_t>{3, 5}));
  EXPECT_EQ(sink.finished().timing().path(), v1::PATH_SLP);
  EXPECT_EQ(sink.finished().timing().attempts(), 2);
  EXPECT_EQ(registry_.Find("p1")->state, WorkerState::kDead);
  EXPECT_EQ(registry_.Find("p0")->state, WorkerState::kLive);
  PrefillLog& log = prefill_.log("fake:p1");
  absl::MutexLock lock(&log.mu);
  EXPECT_EQ(log.cancelled, 0);
}

// Every rank that answers reports a broken group and one never answers (a hung peer): after
// dslp_failure_grace the silent rank is cancelled; no worker is marked dead (none is known to be
// gone; heartbeats decide); without retries the request ends UNAVAILABLE naming the group.
TEST_F(RouterPrefillTest, BrokenDslpGroupWithASilentRankIsCancelledAfterTheGrace) {
  RouterOptions o;
  o.max_dispatch_attempts = 1;
  o.dslp_failure_grace = absl::Milliseconds(100);
  Start(o);
  AddDecode("d0", "cuda:0", {.tokens = {5}});
  AddPrefill("p0", "cuda:0",
             {.dslp_status = absl::AbortedError("dslp group g failed: rank 1 stopped responding")});
  AddPrefill("p1", "cuda:1", {.hang_in_dslp = true});
  Sink sink;
  const absl::Time start = absl::Now();
  const absl::Status s = Generate(Request("hung", 40), &sink);
  EXPECT_GE(absl::Now() - start, absl::Milliseconds(100));
  EXPECT_EQ(s.code(), absl::StatusCode::kUnavailable) << s;
  EXPECT_TRUE(absl::StrContains(s.message(), "DSLP group hmoe-dslp-1 failed")) << s;
  EXPECT_TRUE(absl::StrContains(s.message(), "prefill worker p0 (rank 0 of 2) reported")) << s;
  EXPECT_TRUE(absl::StrContains(s.message(), "stopped responding")) << s;
  EXPECT_EQ(registry_.Find("p0")->state, WorkerState::kLive);
  EXPECT_EQ(registry_.Find("p1")->state, WorkerState::kLive);
  PrefillLog& log = prefill_.log("fake:p1");
  absl::MutexLock lock(&log.mu);
  EXPECT_EQ(log.cancelled, 1);
}

// DSLP needs two prompt tokens per rank and ranks of one device kind.
TEST_F(RouterPrefillTest, DslpGroupsAreOfOneDeviceKindAndLongEnoughPrompts) {
  Start();
  AddDecode("d0", "cpu", {.tokens = {5}});
  AddPrefill("p0", "cuda:0", {.first_token = 3});
  AddPrefill("p1", "cpu", {.first_token = 3});
  AddPrefill("p2", "cuda:1", {.first_token = 3});
  Sink sink;
  ASSERT_TRUE(Generate(Request("kinds", 40), &sink).ok());
  EXPECT_EQ(sink.finished().timing().path(), v1::PATH_DSLP);
  EXPECT_EQ(Prefills("p1"), 0u);
  {
    PrefillLog& log = prefill_.log("fake:p2");
    absl::MutexLock lock(&log.mu);
    ASSERT_EQ(log.prefills.size(), 1u);
    EXPECT_EQ(log.prefills[0].dslp().world_size(), 2);
    EXPECT_EQ(log.prefills[0].dslp().rank(), 1);
  }
  v1::GenerateRequest hinted = Request("short", 3);
  hinted.set_path_hint(v1::PATH_HINT_DSLP);
  Sink sink2;
  const absl::Status s = Generate(hinted, &sink2);
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition) << s;
  EXPECT_TRUE(absl::StrContains(s.message(), "cannot be split")) << s;
}

TEST_F(RouterPrefillTest, StatusCountsRequestsOnPrefillWorkers) {
  Start();
  AddDecode("d0", "cuda:0", {.tokens = {5}});
  Gate gate;
  AddPrefill("p1", "cuda:1", {.gate = &gate});
  Sink sink;
  std::jthread client([&] { EXPECT_TRUE(Generate(Request("s", 40), &sink).ok()); });
  WaitUntil([&] { return Prefills("p1") == 1; }, "prefilling");
  const v1::RouterStatus status = router_->GetStatus();
  for (const v1::WorkerInfo& w : status.workers()) {
    EXPECT_EQ(w.router_inflight(), w.worker_id() == "p1" ? 1 : 0) << w.worker_id();
  }
  gate.Open();
}

// ------------------------------------------------------------------------------ PrefillQueue

class PrefillQueueTest : public ::testing::Test {
 protected:
  absl::StatusOr<std::vector<std::string>> Acquire(const std::vector<std::string>& candidates,
                                                   PrefillQueue::Need need,
                                                   absl::Duration timeout = absl::Seconds(10)) {
    return queue_.Acquire(
        candidates, need, absl::Now() + timeout, [&] { return cancelled_.load(); },
        [&](const std::string& id) { return id != dead_; });
  }
  PrefillQueue queue_{{.max_waiting = 4, .poll = absl::Milliseconds(1)}};
  std::atomic<bool> cancelled_{false};
  std::string dead_;
};

TEST_F(PrefillQueueTest, AnyTakesTheFirstFreeCandidate) {
  auto a = Acquire({"p0", "p1"}, PrefillQueue::Need::kAny);
  ASSERT_TRUE(a.ok());
  EXPECT_EQ(*a, (std::vector<std::string>{"p0"}));
  auto b = Acquire({"p0", "p1"}, PrefillQueue::Need::kAny);
  ASSERT_TRUE(b.ok());
  EXPECT_EQ(*b, (std::vector<std::string>{"p1"}));
  EXPECT_TRUE(queue_.busy("p0"));
  queue_.Release(*a);
  EXPECT_FALSE(queue_.busy("p0"));
}

TEST_F(PrefillQueueTest, AllWaitsForEveryCandidate) {
  auto a = Acquire({"p1"}, PrefillQueue::Need::kAny);
  ASSERT_TRUE(a.ok());
  absl::StatusOr<std::vector<std::string>> all;
  std::jthread waiter([&] { all = Acquire({"p0", "p1"}, PrefillQueue::Need::kAll); });
  while (queue_.waiting() != 1) absl::SleepFor(absl::Milliseconds(1));
  EXPECT_FALSE(queue_.busy("p0"));  // not taken while p1 is busy
  queue_.Release(*a);
  waiter.join();
  ASSERT_TRUE(all.ok()) << all.status();
  EXPECT_EQ(*all, (std::vector<std::string>{"p0", "p1"}));
}

TEST_F(PrefillQueueTest, TheHeadBlocksLaterRequestsEvenWhenTheirWorkerIsFree) {
  auto a = Acquire({"p1"}, PrefillQueue::Need::kAny);
  ASSERT_TRUE(a.ok());
  absl::StatusOr<std::vector<std::string>> head, behind;
  std::jthread h([&] { head = Acquire({"p0", "p1"}, PrefillQueue::Need::kAll); });
  while (queue_.waiting() != 1) absl::SleepFor(absl::Milliseconds(1));
  std::jthread b([&] { behind = Acquire({"p0"}, PrefillQueue::Need::kAny); });
  while (queue_.waiting() != 2) absl::SleepFor(absl::Milliseconds(1));
  absl::SleepFor(absl::Milliseconds(20));
  EXPECT_FALSE(queue_.busy("p0"));  // FCFS: `behind` did not jump the queue
  queue_.Release(*a);
  h.join();
  ASSERT_TRUE(head.ok());
  queue_.Release(*head);
  b.join();
  ASSERT_TRUE(behind.ok());
  EXPECT_EQ(*behind, (std::vector<std::string>{"p0"}));
}

TEST_F(PrefillQueueTest, ErrorsLeaveTheQueue) {
  auto a = Acquire({"p0"}, PrefillQueue::Need::kAny);
  ASSERT_TRUE(a.ok());
  EXPECT_EQ(Acquire({"p0"}, PrefillQueue::Need::kAny, absl::Milliseconds(10)).status().code(),
            absl::StatusCode::kDeadlineExceeded);
  dead_ = "p0";
  EXPECT_EQ(Acquire({"p0"}, PrefillQueue::Need::kAny).status().code(),
            absl::StatusCode::kUnavailable);
  EXPECT_EQ(Acquire({"p0", "p1"}, PrefillQueue::Need::kAll).status().code(),
            absl::StatusCode::kUnavailable);
  dead_.clear();
  cancelled_ = true;
  EXPECT_EQ(Acquire({"p0"}, PrefillQueue::Need::kAny).status().code(),
            absl::StatusCode::kCancelled);
  EXPECT_EQ(Acquire({}, PrefillQueue::Need::kAny).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(queue_.waiting(), 0);
}

TEST_F(PrefillQueueTest, FullQueueIsResourceExhausted) {
  auto a = Acquire({"p0"}, PrefillQueue::Need::kAny);
  ASSERT_TRUE(a.ok());
  std::vector<std::jthread> waiters;
  for (int i = 0; i < 4; ++i) {
    waiters.emplace_back([&] { (void)Acquire({"p0"}, PrefillQueue::Need::kAny); });
  }
  while (queue_.waiting() != 4) absl::SleepFor(absl::Milliseconds(1));
  EXPECT_EQ(Acquire({"p0"}, PrefillQueue::Need::kAny).status().code(),
            absl::StatusCode::kResourceExhausted);
  cancelled_ = true;
  queue_.Poke();
}

}  // namespace
}  // namespace hmoe::router
