// hmoe-prefill-worker's library in-process on the tiny checkpoint (label threads: also run under
// TSan): the computed ring turning point, KV exports and their table (Release, timeout, stale
// segments), the SLP runner against the resident-weights engine (first token, sampled and
// greedy, and the exported KV bytes), and the FCFS scheduler (queue bound, duplicate ids,
// cancellation, validation, shutdown).

#include <atomic>
#include <cstring>
#include <filesystem>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include <gtest/gtest.h>

#include "common/kv/kv_handoff.h"
#include "prefill_worker/kv_exports.h"
#include "prefill_worker/prefill_scheduler.h"
#include "prefill_worker/prefill_service.h"
#include "prefill_worker/slp_runner.h"
#include "tests/engine_fast/engine_test_util.h"

namespace hmoe::prefill {
namespace {

using engine_test::Model;
using engine_test::Pool;
using engine_test::RandomTokens;
using engine_test::Rig;
using engine_test::Tiny;

std::string ShmPath(const std::string& name) { return "/dev/shm/" + name; }

std::string UniqueName(const std::string& tag) {
  static std::atomic<int> counter{0};
  return absl::StrCat("hmoe-test-prefill-", ::getpid(), "-", tag, "-", counter++);
}

// ---------------------------------------------------------------------------------- ring policy

TEST(TurningPointTest, MatchesThePapersScaleAndDegeneratesToOne) {
  // DeepSeek-V3 (256 experts, 8 per token, FP8) on an RTX 5090 over PCIe 5.
  EXPECT_EQ(TurningPointTokens(256, 8, 1.0, 2e14, 5e10), 64000);
  // Half the bandwidth: twice the tokens before compute covers the copies.
  EXPECT_EQ(TurningPointTokens(256, 8, 1.0, 2e14, 2.5e10), 128000);
  EXPECT_EQ(TurningPointTokens(16, 4, 1.0, 2e11, 2e10), 20);
  EXPECT_EQ(TurningPointTokens(0, 8, 1.0, 2e14, 5e10), 1);
  EXPECT_EQ(TurningPointTokens(256, 8, 1.0, 0, 5e10), 1);
}

// ---------------------------------------------------------------------------------- exports

class FakeExport final : public KvExport {
 public:
  explicit FakeExport(std::atomic<int>* freed) : freed_(freed) {
    spec_.shm_name = "fake";
    spec_.num_tokens = 1;
  }
  ~FakeExport() override { freed_->fetch_add(1); }
  const KvHandleSpec& handle() const override { return spec_; }
  size_t size_bytes() const override { return 100; }
  std::string description() const override { return "fake"; }

 private:
  std::atomic<int>* freed_;
  KvHandleSpec spec_;
};

TEST(ExportTableTest, ReleaseFreesOnceAndDuplicatesAreRefused) {
  std::atomic<int> freed{0};
  ExportTable table(absl::Minutes(5));
  ASSERT_TRUE(table.Add("a", std::make_unique<FakeExport>(&freed)).ok());
  ASSERT_TRUE(table.Add("b", std::make_unique<FakeExport>(&freed)).ok());
  EXPECT_EQ(table.count(), 2);
  EXPECT_EQ(table.bytes(), 200);
  EXPECT_EQ(table.Add("a", std::make_unique<FakeExport>(&freed)).code(),
            absl::StatusCode::kAlreadyExists);
  EXPECT_EQ(freed.load(), 1);  // the refused one
  ASSERT_TRUE(table.Release("a").ok());
  EXPECT_EQ(freed.load(), 2);
  EXPECT_EQ(table.Release("a").code(), absl::StatusCode::kNotFound);
  EXPECT_FALSE(table.Contains("a"));
  EXPECT_TRUE(table.Contains("b"));
  EXPECT_EQ(table.count(), 1);
  EXPECT_EQ(table.expired(), 0);
}

TEST(ExportTableTest, UnreleasedExportsAreFreedAfterTheTimeoutAndOnDestruction) {
  std::atomic<int> freed{0};
  {
    ExportTable table(absl::Milliseconds(100));
    ASSERT_TRUE(table.Add("late", std::make_unique<FakeExport>(&freed)).ok());
    const absl::Time deadline = absl::Now() + absl::Seconds(10);
    while (table.count() > 0 && absl::Now() < deadline) absl::SleepFor(absl::Milliseconds(5));
    EXPECT_EQ(table.count(), 0);
    EXPECT_EQ(table.expired(), 1);
    EXPECT_EQ(freed.load(), 1);
    const absl::Status late = table.Release("late");
    EXPECT_EQ(late.code(), absl::StatusCode::kNotFound);
    EXPECT_TRUE(absl::StrContains(late.message(), "timeout")) << late;
  }
  {
    ExportTable table(absl::Minutes(5));
    ASSERT_TRUE(table.Add("x", std::make_unique<FakeExport>(&freed)).ok());
  }
  EXPECT_EQ(freed.load(), 2);
}

TEST(ExportTableTest, StaleSegmentsOfThisWorkerAreRemoved) {
  const std::string prefix = absl::StrCat("hmoe-test-stale-", ::getpid(), "-");
  KvHandoffShape shape{2, 4, 2};
  for (const std::string& name : {prefix + "1", prefix + "2", prefix + "x1"}) {
    ASSERT_TRUE(KvHandoffSegment::Create(name, shape, 1).ok());
  }
  const std::string other = absl::StrCat("hmoe-test-stale-", ::getpid(), "0-1");
  ASSERT_TRUE(KvHandoffSegment::Create(other, shape, 1).ok());
  auto removed = RemoveStaleShmExports(prefix);
  ASSERT_TRUE(removed.ok()) << removed.status();
  EXPECT_EQ(*removed, 3);
  EXPECT_FALSE(std::filesystem::exists(ShmPath(prefix + "1")));
  EXPECT_TRUE(std::filesystem::exists(ShmPath(other)));
  EXPECT_TRUE(KvHandoffSegment::Remove(other).ok());
  EXPECT_EQ(RemoveStaleShmExports("hmoe-").status().code(), absl::StatusCode::kInvalidArgument);
}

// ---------------------------------------------------------------------------------- runner

struct RunnerRig {
  std::unique_ptr<Device> device;
  std::unique_ptr<SlpRunner> runner;

  static std::unique_ptr<RunnerRig> Make(SlpRunnerOptions options = {},
                                         CpuDeviceOptions device_options = {}) {
    Model& model = Tiny();
    auto rig = std::make_unique<RunnerRig>();
    device_options.pool = &Pool();
    rig->device = NewCpuDevice(device_options);
    if (options.max_prompt_tokens == 0) options.max_prompt_tokens = 256;
    if (options.stream_budget_bytes == 0) options.stream_budget_bytes = 4 << 20;
    auto runner = SlpRunner::Create(model.checkpoint->config(), *model.checkpoint, *rig->device,
                                    Pool(), options);
    EXPECT_TRUE(runner.ok()) << runner.status();
    if (!runner.ok()) return nullptr;
    rig->runner = *std::move(runner);
    return rig;
  }
};

// The resident engine's (the decode worker's path) last logits and KV export of `prompt`.
struct ResidentPrefill {
  std::vector<float> logits;
  std::vector<std::byte> kv;
};
ResidentPrefill Resident(std::span<const int32_t> prompt) {
  auto rig = Rig::Make(Tiny());
  ResidentPrefill r;
  if (rig == nullptr) return r;
  KvSequence seq = rig->cache->NewSequence();
  r.logits = rig->Run(seq, prompt);
  r.kv.resize(rig->cache->ExportBytes(seq.num_tokens()));
  auto stream = rig->device->CreateStream();
  EXPECT_TRUE(rig->cache->Export(seq, **stream, r.kv.data(), MemorySpace::kHost).ok());
  return r;
}

// The payload of a shared-memory export, read back as the decode worker does.
std::vector<std::byte> ReadExport(const KvHandleSpec& handle, const KvHandoffShape& shape) {
  auto source = NewShmKvImporter()->Open(handle, shape);
  EXPECT_TRUE(source.ok()) << source.status();
  if (!source.ok()) return {};
  std::span<const std::byte> p = (*source)->payload();
  return std::vector<std::byte>(p.begin(), p.end());
}

TEST(SlpRunnerTest, FirstTokenAndExportedKvEqualTheResidentEngine) {
  auto rig = RunnerRig::Make();
  ASSERT_NE(rig, nullptr);
  const KvHandoffShape shape =
      HandoffShapeOf(KvCacheConfig::ForModel(rig->runner->config(), 1, 64));
  const std::vector<int32_t> prompt = RandomTokens(45, 3, 1000);
  const ResidentPrefill want = Resident(prompt);
  std::atomic<bool> cancelled{false};
  // Greedy.
  const std::string name = UniqueName("greedy");
  auto greedy = rig->runner->Run(prompt, SamplingParams(), name, cancelled);
  ASSERT_TRUE(greedy.ok()) << greedy.status();
  EXPECT_EQ(greedy->first_token, engine_test::ArgMax(want.logits));
  EXPECT_EQ(greedy->kv->handle().shm_name, name);
  EXPECT_EQ(greedy->kv->handle().num_tokens, 45);
  EXPECT_TRUE(ReadExport(greedy->kv->handle(), shape) == want.kv) << "exported KV differs";
  EXPECT_EQ(greedy->prompt_tokens, 45);
  EXPECT_EQ(greedy->streaming.passes, 1);
  EXPECT_GT(greedy->streaming.bytes_streamed, 0);
  greedy->kv.reset();
  EXPECT_FALSE(std::filesystem::exists(ShmPath(name)));  // destroying the export unlinks it
  // Sampled: step 0 of the request's sampler over the same logits.
  SamplingParams sampled;
  sampled.temperature = 0.9f;
  sampled.top_p = 0.95f;
  sampled.repetition_penalty = 1.1f;
  for (uint64_t seed : {1u, 2u, 3u, 4u, 5u}) {
    sampled.seed = seed;
    auto got = rig->runner->Run(prompt, sampled, UniqueName("sampled"), cancelled);
    ASSERT_TRUE(got.ok()) << got.status();
    SamplingParams one = sampled;
    one.max_new_tokens = 1;
    auto sampler = Sampler::Create(one, prompt, {});
    ASSERT_TRUE(sampler.ok());
    EXPECT_EQ(got->first_token, *sampler->Sample(want.logits)) << "seed " << seed;
  }
  EXPECT_EQ(rig->runner->kv_blocks_free(), rig->runner->kv_blocks_total());
}

TEST(SlpRunnerTest, RingShrinksToTwoPastTheTurningPoint) {
  SlpRunnerOptions options;
  options.turning_point_tokens = 30;
  auto rig = RunnerRig::Make(options);
  ASSERT_NE(rig, nullptr);
  const int64_t experts = rig->runner->config().n_routed_experts;
  EXPECT_EQ(rig->runner->ring_slots_short(), experts);  // unlimited device: the whole layer
  EXPECT_EQ(rig->runner->RingSlotsFor(29), experts);
  EXPECT_EQ(rig->runner->RingSlotsFor(30), 2);
  std::atomic<bool> cancelled{false};
  for (int n : {20, 40, 21}) {
    const std::vector<int32_t> prompt = RandomTokens(n, 50 + n, 1000);
    auto got = rig->runner->Run(prompt, SamplingParams(), UniqueName("ring"), cancelled);
    ASSERT_TRUE(got.ok()) << got.status();
    EXPECT_EQ(got->ring_slots, n < 30 ? experts : 2);
    EXPECT_LE(got->streaming.ring_peak_slots, got->ring_slots);
    const KvHandoffShape shape =
        HandoffShapeOf(KvCacheConfig::ForModel(rig->runner->config(), 1, 64));
    EXPECT_TRUE(ReadExport(got->kv->handle(), shape) == Resident(prompt).kv) << n << " tokens";
  }
}

// Everything the runner uses on the device is allocated at Create (after the first prompt sized
// the ring): a prefill allocates nothing more, so the peak is ring + budget + activations.
TEST(SlpRunnerTest, PrefillAllocatesNothingBeyondWhatCreateReserved) {
  auto rig = RunnerRig::Make();
  ASSERT_NE(rig, nullptr);
  std::atomic<bool> cancelled{false};
  const std::vector<int32_t> prompt = RandomTokens(60, 9, 1000);
  ASSERT_TRUE(rig->runner->Run(prompt, SamplingParams(), UniqueName("m1"), cancelled).ok());
  const size_t in_use = rig->device->bytes_in_use();
  auto second = rig->runner->Run(prompt, SamplingParams(), UniqueName("m2"), cancelled);
  ASSERT_TRUE(second.ok()) << second.status();
  EXPECT_EQ(second->peak_device_bytes, in_use);
  const size_t weights =
      rig->runner->weights().ring_bytes() + rig->runner->weights().budget_bytes();
  EXPECT_LE(second->streaming.arena_peak_bytes, rig->runner->weights().budget_bytes());
  RecordProperty("activation_bytes", static_cast<int>(in_use - weights));
}

TEST(SlpRunnerTest, CancelAndExportFailuresLeaveNothingBehind) {
  auto rig = RunnerRig::Make();
  ASSERT_NE(rig, nullptr);
  const std::vector<int32_t> prompt = RandomTokens(33, 12, 1000);
  std::atomic<bool> cancelled{true};
  const std::string name = UniqueName("cancel");
  auto got = rig->runner->Run(prompt, SamplingParams(), name, cancelled);
  EXPECT_EQ(got.status().code(), absl::StatusCode::kCancelled);
  EXPECT_FALSE(std::filesystem::exists(ShmPath(name)));
  EXPECT_EQ(rig->runner->kv_blocks_free(), rig->runner->kv_blocks_total());
  // The export name is taken: AlreadyExists, and nothing of the prompt stays on the device.
  const std::string taken = UniqueName("taken");
  ASSERT_TRUE(KvHandoffSegment::Create(taken, KvHandoffShape{1, 1, 1}, 1).ok());
  cancelled = false;
  EXPECT_EQ(rig->runner->Run(prompt, SamplingParams(), taken, cancelled).status().code(),
            absl::StatusCode::kAlreadyExists);
  EXPECT_TRUE(KvHandoffSegment::Remove(taken).ok());
  EXPECT_EQ(rig->runner->kv_blocks_free(), rig->runner->kv_blocks_total());
  // Too long a prompt.
  EXPECT_EQ(
      rig->runner->Run(RandomTokens(257, 1, 1000), SamplingParams(), UniqueName("long"), cancelled)
          .status()
          .code(),
      absl::StatusCode::kInvalidArgument);
  // The runner still works.
  auto ok = rig->runner->Run(prompt, SamplingParams(), UniqueName("after"), cancelled);
  ASSERT_TRUE(ok.ok()) << ok.status();
  const KvHandoffShape shape =
      HandoffShapeOf(KvCacheConfig::ForModel(rig->runner->config(), 1, 64));
  EXPECT_TRUE(ReadExport(ok->kv->handle(), shape) == Resident(prompt).kv);
}

TEST(SlpRunnerTest, CudaIpcExportIsUnavailableOnTheCpuDevice) {
  SlpRunnerOptions options;
  options.export_kind = KvExportKind::kCudaIpc;
  auto rig = RunnerRig::Make(options);
  ASSERT_NE(rig, nullptr);
  std::atomic<bool> cancelled{false};
  auto got = rig->runner->Run(RandomTokens(5, 1, 1000), SamplingParams(), "x", cancelled);
  EXPECT_EQ(got.status().code(), absl::StatusCode::kUnavailable) << got.status();
  EXPECT_EQ(rig->runner->kv_blocks_free(), rig->runner->kv_blocks_total());
}

// ---------------------------------------------------------------------------------- scheduler

// A runner whose prefills take about half a second: the CPU device's copies are capped.
std::unique_ptr<RunnerRig> SlowRunner() {
  CpuDeviceOptions capped;
  capped.copy_bytes_per_second = 12e6;
  return RunnerRig::Make({}, capped);
}

PrefillJob Job(const std::string& id, int n = 20) {
  PrefillJob job;
  job.id = id;
  job.prompt = RandomTokens(n, static_cast<uint32_t>(id.size()), 1000);
  return job;
}

PrefillSchedulerOptions SchedulerOptions(int max_waiting) {
  PrefillSchedulerOptions o;
  o.max_waiting = max_waiting;
  o.export_prefix = absl::StrCat("hmoe-test-sched-", ::getpid(), "-");
  o.poll_interval = absl::Milliseconds(5);
  return o;
}

TEST(PrefillSchedulerTest, RunsInOrderBoundsTheQueueAndRefusesDuplicateIds) {
  auto rig = SlowRunner();
  ASSERT_NE(rig, nullptr);
  ExportTable exports(absl::Minutes(5));
  PrefillScheduler scheduler(rig->runner.get(), &exports, SchedulerOptions(1));
  absl::StatusOr<PrefillOutcome> first, second;
  std::thread a([&] { first = scheduler.Prefill(Job("a"), nullptr); });
  // Wait until "a" runs, then queue "b" behind it.
  const absl::Time deadline = absl::Now() + absl::Seconds(20);
  while (!scheduler.stats().busy && absl::Now() < deadline) absl::SleepFor(absl::Milliseconds(1));
  ASSERT_TRUE(scheduler.stats().busy);
  std::thread b([&] { second = scheduler.Prefill(Job("bb"), nullptr); });
  while (scheduler.stats().waiting < 1 && absl::Now() < deadline) {
    absl::SleepFor(absl::Milliseconds(1));
  }
  EXPECT_EQ(scheduler.stats().waiting, 1);
  EXPECT_EQ(scheduler.Prefill(Job("ccc"), nullptr).status().code(),
            absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(scheduler.Prefill(Job("a"), nullptr).status().code(), absl::StatusCode::kAlreadyExists);
  a.join();
  b.join();
  ASSERT_TRUE(first.ok()) << first.status();
  ASSERT_TRUE(second.ok()) << second.status();
  EXPECT_GT(second->queue_us, 0);
  EXPECT_NE(first->handle.shm_name, second->handle.shm_name);
  EXPECT_TRUE(std::filesystem::exists(ShmPath(first->handle.shm_name)));
  // "a" still holds its export: the id stays taken until Release.
  EXPECT_EQ(scheduler.Prefill(Job("a"), nullptr).status().code(), absl::StatusCode::kAlreadyExists);
  ASSERT_TRUE(exports.Release("a").ok());
  EXPECT_FALSE(std::filesystem::exists(ShmPath(first->handle.shm_name)));
  ASSERT_TRUE(exports.Release("bb").ok());
  const PrefillSchedulerStats stats = scheduler.stats();
  EXPECT_EQ(stats.prefills, 2);
  EXPECT_EQ(stats.prompt_tokens, 40);
}

TEST(PrefillSchedulerTest, CancelQueuedRunningAndAbandonedPrefills) {
  auto rig = SlowRunner();
  ASSERT_NE(rig, nullptr);
  ExportTable exports(absl::Minutes(5));
  PrefillScheduler scheduler(rig->runner.get(), &exports, SchedulerOptions(4));
  absl::StatusOr<PrefillOutcome> running, queued, abandoned;
  std::atomic<bool> gone{false};
  std::thread a([&] { running = scheduler.Prefill(Job("run"), nullptr); });
  const absl::Time deadline = absl::Now() + absl::Seconds(20);
  while (!scheduler.stats().busy && absl::Now() < deadline) absl::SleepFor(absl::Milliseconds(1));
  std::thread b([&] { queued = scheduler.Prefill(Job("queued"), nullptr); });
  std::thread c([&] { abandoned = scheduler.Prefill(Job("gone"), [&] { return gone.load(); }); });
  while (scheduler.stats().waiting < 2 && absl::Now() < deadline) {
    absl::SleepFor(absl::Milliseconds(1));
  }
  EXPECT_EQ(scheduler.Cancel("nobody").code(), absl::StatusCode::kNotFound);
  ASSERT_TRUE(scheduler.Cancel("queued").ok());
  gone = true;
  ASSERT_TRUE(scheduler.Cancel("run").ok());
  a.join();
  b.join();
  c.join();
  EXPECT_EQ(running.status().code(), absl::StatusCode::kCancelled) << running.status();
  EXPECT_EQ(queued.status().code(), absl::StatusCode::kCancelled) << queued.status();
  EXPECT_EQ(abandoned.status().code(), absl::StatusCode::kCancelled) << abandoned.status();
  EXPECT_EQ(exports.count(), 0);
  EXPECT_EQ(scheduler.stats().cancelled, 3);
  // The worker goes on.
  auto after = scheduler.Prefill(Job("after", 5), nullptr);
  ASSERT_TRUE(after.ok()) << after.status();
  EXPECT_EQ(after->prompt_tokens, 5);
}

TEST(PrefillSchedulerTest, BadRequestsNameTheFieldAndShutdownRefusesWork) {
  auto rig = RunnerRig::Make();
  ASSERT_NE(rig, nullptr);
  ExportTable exports(absl::Minutes(5));
  PrefillScheduler scheduler(rig->runner.get(), &exports, SchedulerOptions(4));
  struct Case {
    PrefillJob job;
    std::string field;
  };
  std::vector<Case> cases;
  cases.push_back({Job(""), "request_id"});
  PrefillJob empty = Job("e");
  empty.prompt.clear();
  cases.push_back({empty, "prompt_token_ids"});
  PrefillJob big = Job("v");
  big.prompt[3] = 5000;
  cases.push_back({big, "prompt_token_ids[3]"});
  cases.push_back({Job("long", 300), "at most 256"});
  PrefillJob temp = Job("t");
  temp.sampling.temperature = -1;
  cases.push_back({temp, "temperature"});
  for (const Case& c : cases) {
    const absl::Status s = scheduler.Prefill(c.job, nullptr).status();
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << c.field << ": " << s;
    EXPECT_TRUE(absl::StrContains(s.message(), c.field)) << s;
  }
  v1::PrefillRequest dslp;
  dslp.set_request_id("d");
  dslp.add_prompt_token_ids(1);
  dslp.mutable_dslp()->set_world_size(2);
  EXPECT_EQ(JobFromProto(dslp).status().code(), absl::StatusCode::kUnimplemented);
  scheduler.StopAccepting();
  EXPECT_EQ(scheduler.Prefill(Job("late"), nullptr).status().code(),
            absl::StatusCode::kUnavailable);
  EXPECT_TRUE(scheduler.WaitIdle(absl::Now() + absl::Seconds(1)));
  scheduler.Shutdown();
  EXPECT_TRUE(scheduler.stats().draining);
}

}  // namespace
}  // namespace hmoe::prefill
