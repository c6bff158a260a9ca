// Router (router.h) driven from many threads without gRPC: concurrent requests, Cancel and client
// cancellation from other threads, status queries while requests run.

#include <atomic>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"

#include "router/clock.h"
#include "router/router.h"
#include "router/worker_registry.h"
#include "tests/router/fake_decode_client.h"

#include "gtest/gtest.h"

namespace hmoe::router {
namespace {

namespace v1 = hmoe::v1;
using testing::FakeFactory;
using testing::Script;

class CollectingSink : public GenerateSink {
 public:
  bool Write(const v1::GenerateResponse& r) override ABSL_LOCKS_EXCLUDED(mu_) {
    absl::MutexLock lock(&mu_);
    responses_.push_back(r);
    return true;
  }
  // Memory order: a plain flag read by the watcher; relaxed is enough, the router re-checks
  // under its own locks.
  bool IsCancelled() override { return cancelled_.load(std::memory_order_relaxed); }
  void CancelClient() { cancelled_.store(true, std::memory_order_relaxed); }
  std::vector<v1::GenerateResponse> responses() ABSL_LOCKS_EXCLUDED(mu_) {
    absl::MutexLock lock(&mu_);
    return responses_;
  }

 private:
  std::atomic<bool> cancelled_{false};
  absl::Mutex mu_;
  std::vector<v1::GenerateResponse> responses_ ABSL_GUARDED_BY(mu_);
};

class RouterThreadsTest : public ::testing::Test {
 protected:
  RouterThreadsTest() {
    RouterOptions options;
    options.limits = {.vocab_size = 1000, .context_length = 512};
    options.cancel_poll = absl::Milliseconds(2);
    options.retry_wait = absl::Milliseconds(100);
    router_ = std::make_unique<Router>(options, &registry_, &factory_, nullptr, nullptr, &clock_);
  }
  void AddDecodeWorker(const std::string& id, Script script) {
    factory_.Set("fake:" + id, std::move(script));
    WorkerIdentity w;
    w.worker_id = id;
    w.kind = WorkerKind::kDecode;
    w.endpoint = "fake:" + id;
    w.device = "cpu";
    ASSERT_TRUE(registry_.Register(w).ok());
  }
  static v1::GenerateRequest Request(const std::string& id = "") {
    v1::GenerateRequest r;
    r.set_request_id(id);
    r.mutable_prompt_token_ids()->add_ids(1);
    r.set_max_new_tokens(8);
    return r;
  }
  // Bounded wait (not a timing assertion) until `n` requests are in flight.
  void WaitForInflight(int n) {
    const absl::Time end = absl::Now() + absl::Seconds(30);
    while (router_->inflight() != n && absl::Now() < end) absl::SleepFor(absl::Milliseconds(1));
    ASSERT_EQ(router_->inflight(), n);
  }

  FakeClock clock_;
  WorkerRegistry registry_{&clock_, {}};
  FakeFactory factory_;
  std::unique_ptr<Router> router_;
};

TEST_F(RouterThreadsTest, ConcurrentRequestsAllComplete) {
  AddDecodeWorker("d0", {.tokens = {4, 5, 6}});
  AddDecodeWorker("d1", {.tokens = {4, 5, 6}});
  constexpr int kThreads = 8;
  std::vector<CollectingSink> sinks(kThreads);
  std::vector<absl::Status> results(kThreads);
  {
    std::vector<std::jthread> threads;
    for (int i = 0; i < kThreads; ++i) {
      threads.emplace_back([&, i] {
        for (int j = 0; j < 5; ++j) {
          results[i].Update(router_->Generate(Request(), absl::InfiniteFuture(), &sinks[i]));
        }
      });
    }
    threads.emplace_back([&] {
      for (int j = 0; j < 50; ++j) router_->GetStatus();
    });
  }
  for (int i = 0; i < kThreads; ++i) {
    EXPECT_TRUE(results[i].ok()) << results[i];
    const std::vector<v1::GenerateResponse> r = sinks[i].responses();
    ASSERT_EQ(r.size(), 5u * 4u);
    EXPECT_TRUE(r.back().has_finished());
  }
  const v1::RouterStatus status = router_->GetStatus();
  EXPECT_EQ(status.inflight(), 0);
  EXPECT_EQ(status.requests_total(), kThreads * 5);
  EXPECT_EQ(status.ms_since_decode_active(), 0);  // the fake clock did not move
}

TEST_F(RouterThreadsTest, CancelFromAnotherThread) {
  AddDecodeWorker("d0", {.tokens = {4}, .hang = true});
  CollectingSink sink;
  absl::Status result;
  std::jthread request(
      [&] { result = router_->Generate(Request("r1"), absl::InfiniteFuture(), &sink); });
  WaitForInflight(1);
  EXPECT_TRUE(router_->Cancel("r1").ok());
  request.join();
  EXPECT_TRUE(result.ok()) << result;
  const std::vector<v1::GenerateResponse> r = sink.responses();
  ASSERT_FALSE(r.empty());
  ASSERT_TRUE(r.back().has_finished());
  EXPECT_EQ(r.back().finished().reason(), v1::FINISH_REASON_CANCELLED);
  EXPECT_EQ(router_->Cancel("r1").code(), absl::StatusCode::kNotFound);
}

TEST_F(RouterThreadsTest, ClientGoneIsNoticedByTheWatcher) {
  AddDecodeWorker("d0", {.tokens = {4}, .hang = true});
  CollectingSink sink;
  absl::Status result;
  std::jthread request(
      [&] { result = router_->Generate(Request(), absl::InfiniteFuture(), &sink); });
  WaitForInflight(1);
  sink.CancelClient();
  request.join();
  EXPECT_EQ(result.code(), absl::StatusCode::kCancelled) << result;
  EXPECT_EQ(router_->inflight(), 0);
}

TEST_F(RouterThreadsTest, DuplicateInflightIdIsAlreadyExists) {
  AddDecodeWorker("d0", {.tokens = {4}, .hang = true});
  CollectingSink sink;
  absl::Status result;
  std::jthread request(
      [&] { result = router_->Generate(Request("same"), absl::InfiniteFuture(), &sink); });
  WaitForInflight(1);
  CollectingSink other;
  EXPECT_EQ(router_->Generate(Request("same"), absl::InfiniteFuture(), &other).code(),
            absl::StatusCode::kAlreadyExists);
  EXPECT_TRUE(router_->Cancel("same").ok());
  request.join();
  EXPECT_TRUE(result.ok()) << result;
}

TEST_F(RouterThreadsTest, NewRequestWaitsForARestartingDecodeWorkerAndCanBeCancelled) {
  RouterOptions options;
  options.limits = {.vocab_size = 1000, .context_length = 512};
  options.cancel_poll = absl::Milliseconds(2);
  options.retry_wait = absl::Seconds(60);
  router_ = std::make_unique<Router>(options, &registry_, &factory_, nullptr, nullptr, &clock_);
  AddDecodeWorker("d0", {.tokens = {4}});
  registry_.MarkDead("d0", 1);  // known, but being restarted
  CollectingSink sink;
  absl::Status result;
  std::jthread request(
      [&] { result = router_->Generate(Request("w"), absl::InfiniteFuture(), &sink); });
  WaitForInflight(1);
  absl::SleepFor(absl::Milliseconds(20));
  EXPECT_TRUE(sink.responses().empty());  // waiting, not failed
  EXPECT_TRUE(router_->Cancel("w").ok());
  request.join();
  EXPECT_TRUE(result.ok()) << result;
  ASSERT_FALSE(sink.responses().empty());
  EXPECT_EQ(sink.responses().back().finished().reason(), v1::FINISH_REASON_CANCELLED);

  // And a request that waits gets served once the worker is back.
  CollectingSink served;
  std::jthread second(
      [&] { result = router_->Generate(Request("x"), absl::InfiniteFuture(), &served); });
  WaitForInflight(1);
  ASSERT_TRUE(registry_.Heartbeat("d0", {}).ok());  // alive again
  second.join();
  EXPECT_TRUE(result.ok()) << result;
  EXPECT_EQ(served.responses().size(), 2u);
}

TEST_F(RouterThreadsTest, DrainingRejectsNewRequests) {
  AddDecodeWorker("d0", {.tokens = {4}});
  router_->StartDraining();
  CollectingSink sink;
  EXPECT_EQ(router_->Generate(Request(), absl::InfiniteFuture(), &sink).code(),
            absl::StatusCode::kUnavailable);
}

}  // namespace
}  // namespace hmoe::router
