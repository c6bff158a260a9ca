// hmoe-prefill-worker's library in-process on the tiny checkpoint (label threads: also run under
// TSan): the computed ring turning point, KV exports and their table (Release, timeout, stale
// segments), the SLP runner against the resident-weights engine (first token, sampled and
// greedy, and the exported KV bytes), and the FCFS scheduler (queue bound, duplicate ids,
// cancellation, validation, shutdown), and DSLP ranks: several runners on threads of this process
// forming shared-memory groups (rank 0's export of the whole prompt against SLP, a rank leaving
// mid-prefill, groups that never form, cancellation while joining).

#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include <gtest/gtest.h>

#include "common/kv_handoff/kv_handoff.h"
#include "prefill_worker/dslp_group.h"
#include "prefill_worker/kv_exports.h"
#include "prefill_worker/prefill_scheduler.h"
#include "prefill_worker/prefill_service.h"
#include "prefill_worker/slp_runner.h"
#include "tests/engine/engine_test_util.h"

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
    // The reaper takes the export out of the table, then frees it outside the lock.
    while ((table.count() > 0 || freed.load() < 1) && absl::Now() < deadline) {
      absl::SleepFor(absl::Milliseconds(5));
    }
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

// Names that embed their creator's pid (a decode worker's prefix exports): only those of processes
// that are gone are stale, so two stacks whose workers share an id keep each other's segments.
TEST(ExportTableTest, OnlySegmentsOfDeadProcessesAreStale) {
  const std::string base = absl::StrCat("hmoe-test-dead-", ::getpid(), "-");
  KvHandoffShape shape{2, 4, 2};
  // No process has the pid /proc/sys/kernel/pid_max (pids stay below it).
  int64_t pid_max = 0;
  {
    std::ifstream f("/proc/sys/kernel/pid_max");
    ASSERT_TRUE(f >> pid_max);
  }
  const std::string live = absl::StrCat(base, ::getpid(), "-1");
  const std::string dead = absl::StrCat(base, pid_max, "-1");
  const std::string unnamed = base + "x-1";
  for (const std::string& name : {live, dead, unnamed}) {
    ASSERT_TRUE(KvHandoffSegment::Create(name, shape, 1).ok());
  }
  auto removed = RemoveShmExportsOfDeadProcesses(base);
  ASSERT_TRUE(removed.ok()) << removed.status();
  EXPECT_EQ(*removed, 2);
  EXPECT_TRUE(std::filesystem::exists(ShmPath(live)));
  EXPECT_FALSE(std::filesystem::exists(ShmPath(dead)));
  EXPECT_FALSE(std::filesystem::exists(ShmPath(unnamed)));
  EXPECT_TRUE(KvHandoffSegment::Remove(live).ok());
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
    Sampler sampler = Sampler::Create(one, prompt, {});
    EXPECT_EQ(got->first_token, *sampler.Sample(want.logits)) << "seed " << seed;
  }
  EXPECT_EQ(rig->runner->kv_blocks_free(), rig->runner->kv_blocks_total());
}

// The first `prefix` tokens of a full hand-off payload of `n` tokens (per layer, per token), in a
// new shared-memory segment as a decode worker's ExportPrefix writes it, opened as the prefill
// worker opens it and unlinked (the mapping stays). nullptr (a test failure) on error.
std::unique_ptr<KvImportSource> PrefixSource(const std::vector<std::byte>& full, int64_t n,
                                             int64_t prefix, const KvHandoffShape& shape,
                                             bool poison = false) {
  const std::string name = UniqueName("prefix");
  {
    auto segment = KvHandoffSegment::Create(name, shape, prefix);
    if (!segment.ok()) {
      ADD_FAILURE() << segment.status();
      return nullptr;
    }
    const size_t row = (shape.kv_lora_rank + shape.rope_dim) * sizeof(float);
    std::byte* out = segment->payload().data();
    for (uint32_t l = 0; l < shape.num_layers; ++l) {
      std::memcpy(out + l * prefix * row, full.data() + l * n * row, prefix * row);
    }
    if (poison) {  // one value of the first layer's first row
      const float bad = 1e3f;
      std::memcpy(out, &bad, sizeof(bad));
    }
  }
  KvHandleSpec h;
  h.shm_name = name;
  h.num_tokens = prefix;
  h.layout_version = kKvHandoffLayoutVersion;
  auto source = NewShmKvImporter()->Open(h, shape);
  EXPECT_TRUE(KvHandoffSegment::Remove(name).ok());
  if (!source.ok()) {
    ADD_FAILURE() << source.status();
    return nullptr;
  }
  return *std::move(source);
}

// A prefix handed over by the decode worker's prefix cache: only the rest of the prompt is
// prefilled (in one pass or several), and the first token and the exported KV of the whole prompt
// are bit for bit those of the resident engine's full prefill. A prefix whose KV is off changes
// the result, so the prefix is really used.
TEST(SlpRunnerTest, APrefixFromTheDecodeWorkerLeavesOnlyTheSuffixAndChangesNothing) {
  const std::vector<int32_t> prompt = RandomTokens(150, 8, 1000);
  const ResidentPrefill want = Resident(prompt);
  std::atomic<bool> cancelled{false};
  for (int64_t max_step : {int64_t{0}, int64_t{32}}) {
    SlpRunnerOptions options;
    options.max_step_tokens = max_step;
    auto rig = RunnerRig::Make(options);
    ASSERT_NE(rig, nullptr);
    const KvHandoffShape shape = HandoffShapeOf(rig->runner->kv_cache_config());
    for (int64_t prefix : {int64_t{1}, int64_t{64}, int64_t{100}, int64_t{149}}) {
      SCOPED_TRACE(absl::StrCat("max_step_tokens ", max_step, ", prefix ", prefix));
      std::unique_ptr<KvImportSource> source = PrefixSource(want.kv, 150, prefix, shape);
      ASSERT_NE(source, nullptr);
      auto got =
          rig->runner->Run(prompt, SamplingParams(), UniqueName("suffix"), cancelled, source.get());
      ASSERT_TRUE(got.ok()) << got.status();
      EXPECT_EQ(got->prefix_tokens, prefix);
      EXPECT_EQ(got->prompt_tokens, 150);
      EXPECT_EQ(got->first_token, engine_test::ArgMax(want.logits));
      EXPECT_EQ(got->kv->handle().num_tokens, 150);
      EXPECT_TRUE(ReadExport(got->kv->handle(), shape) == want.kv) << "exported KV differs";
      const int64_t step = max_step == 0 ? rig->runner->max_step_tokens() : max_step;
      EXPECT_EQ(got->streaming.passes, (150 - prefix + step - 1) / step);
      EXPECT_EQ(rig->runner->kv_blocks_free(), rig->runner->kv_blocks_total());
    }
    // A prefix with one value off: the prefill attends to it, so the export differs.
    std::unique_ptr<KvImportSource> source =
        PrefixSource(want.kv, 150, 100, shape, /*poison=*/true);
    ASSERT_NE(source, nullptr);
    auto got = rig->runner->Run(prompt, SamplingParams(), UniqueName("poisoned-out"), cancelled,
                                source.get());
    ASSERT_TRUE(got.ok()) << got.status();
    const std::vector<std::byte> out = ReadExport(got->kv->handle(), shape);
    const size_t row = (shape.kv_lora_rank + shape.rope_dim) * sizeof(float);
    // Layer 1's rows of the suffix were computed from layer 0's poisoned prefix.
    const size_t at = (150 + 100) * row;
    EXPECT_NE(std::memcmp(out.data() + at, want.kv.data() + at, 50 * row), 0);
  }
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

// A runner whose prefills take about two seconds (the CPU device's copies are capped): the
// tests below act on a prefill while it runs, which must hold on a loaded machine too.
std::unique_ptr<RunnerRig> SlowRunner() {
  CpuDeviceOptions capped;
  capped.copy_bytes_per_second = 3e6;
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
  KvHandleSpec prefix;
  prefix.shm_name = "hmoe-kvp-test-1";
  prefix.layout_version = kKvHandoffLayoutVersion;
  PrefillJob whole = Job("p1");
  prefix.num_tokens = static_cast<int64_t>(whole.prompt.size());  // must leave >= 1 token
  whole.prefix = prefix;
  cases.push_back({whole, "prefix_kv.num_tokens"});
  PrefillJob layout = Job("p2");
  prefix.num_tokens = 2;
  prefix.layout_version = 99;
  layout.prefix = prefix;
  cases.push_back({layout, "layout_version"});
  for (const Case& c : cases) {
    const absl::Status s = scheduler.Prefill(c.job, nullptr).status();
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << c.field << ": " << s;
    EXPECT_TRUE(absl::StrContains(s.message(), c.field)) << s;
  }
  // DSLP groups: the proto becomes a rank's job; bad groups name the field.
  v1::PrefillRequest dslp;
  dslp.set_request_id("d");
  for (int i = 0; i < 10; ++i) dslp.add_prompt_token_ids(i + 1);
  v1::DslpGroup* g = dslp.mutable_dslp();
  g->set_group_id("g-1");
  g->set_rank(1);
  g->set_world_size(2);
  g->set_shm_group("g-1");
  g->set_ep_mode(v1::EP_MODE_STANDARD);
  absl::StatusOr<PrefillJob> job = JobFromProto(dslp);
  ASSERT_TRUE(job.ok()) << job.status();
  ASSERT_TRUE(job->dslp.has_value());
  EXPECT_EQ(job->dslp->rank, 1);
  EXPECT_EQ(job->dslp->world_size, 2);
  EXPECT_TRUE(job->dslp->ep_mode_set);
  EXPECT_EQ(job->dslp->ep_mode, EpMode::kStandard);
  g->set_ep_mode(static_cast<v1::EpMode>(9));
  EXPECT_EQ(JobFromProto(dslp).status().code(), absl::StatusCode::kInvalidArgument);
  // A prefix only with a shared-memory handle, and never with DSLP.
  v1::PrefillRequest with_prefix;
  with_prefix.set_request_id("px");
  for (int i = 0; i < 10; ++i) with_prefix.add_prompt_token_ids(i + 1);
  with_prefix.mutable_prefix_kv()->set_cuda_ipc_handle(std::string(64, 'x'));
  EXPECT_EQ(JobFromProto(with_prefix).status().code(), absl::StatusCode::kInvalidArgument);
  with_prefix.mutable_prefix_kv()->set_shm_name("hmoe-kvp-test-2");
  with_prefix.mutable_prefix_kv()->set_num_tokens(4);
  absl::StatusOr<PrefillJob> prefixed = JobFromProto(with_prefix);
  ASSERT_TRUE(prefixed.ok()) << prefixed.status();
  ASSERT_TRUE(prefixed->prefix.has_value());
  EXPECT_EQ(prefixed->prefix->num_tokens, 4);
  *with_prefix.mutable_dslp() = dslp.dslp();
  with_prefix.mutable_dslp()->set_ep_mode(v1::EP_MODE_STANDARD);
  with_prefix.mutable_prefix_kv()->set_layout_version(kKvHandoffLayoutVersion);
  absl::StatusOr<PrefillJob> both = JobFromProto(with_prefix);
  ASSERT_TRUE(both.ok()) << both.status();
  const absl::Status refused = scheduler.Prefill(*both, nullptr).status();
  EXPECT_EQ(refused.code(), absl::StatusCode::kInvalidArgument) << refused;
  EXPECT_TRUE(absl::StrContains(refused.message(), "prefix_kv")) << refused;
  struct GroupCase {
    std::function<void(DslpGroupSpec&, PrefillJob&)> edit;
    std::string field;
  };
  const std::vector<GroupCase> groups = {
      {[](DslpGroupSpec& d, PrefillJob&) { d.group_id.clear(); }, "dslp.group_id"},
      {[](DslpGroupSpec& d, PrefillJob&) { d.group_id = "a/b"; }, "dslp.group_id"},
      {[](DslpGroupSpec& d, PrefillJob&) { d.rank = 2; }, "dslp.rank"},
      {[](DslpGroupSpec& d, PrefillJob&) { d.world_size = 0; }, "dslp.world_size"},
      {[](DslpGroupSpec& d, PrefillJob&) { d.world_size = 65; }, "dslp.world_size"},
      {[](DslpGroupSpec& d, PrefillJob&) { d.shm_group = "../x"; }, "dslp.shm_group"},
      {[](DslpGroupSpec& d, PrefillJob&) { d.nccl_unique_id = "id"; }, "dslp.nccl_unique_id"},
      // 2 ranks need at least 4 tokens.
      {[](DslpGroupSpec&, PrefillJob& j) { j.prompt.resize(3); }, "cannot be split"},
      // More ranks than the tiny model's routed experts.
      {[](DslpGroupSpec& d, PrefillJob& j) {
         d.world_size = 64;
         j.prompt.assign(200, 5);
       },
       "routed experts"},
  };
  for (const GroupCase& c : groups) {
    PrefillJob j = Job("grp", 10);
    DslpGroupSpec d;
    d.group_id = "g-1";
    d.shm_group = "g-1";
    d.rank = 1;
    d.world_size = 2;
    c.edit(d, j);
    j.dslp = d;
    const absl::Status s = scheduler.Prefill(j, nullptr).status();
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << c.field << ": " << s;
    EXPECT_TRUE(absl::StrContains(s.message(), c.field)) << s;
  }
  scheduler.StopAccepting();
  EXPECT_EQ(scheduler.Prefill(Job("late"), nullptr).status().code(),
            absl::StatusCode::kUnavailable);
  EXPECT_TRUE(scheduler.WaitIdle(absl::Now() + absl::Seconds(1)));
  scheduler.Shutdown();
  EXPECT_TRUE(scheduler.stats().draining);
}

// ---------------------------------------------------------------------------------- DSLP

// Token rows of a DSLP export against SLP's (layer-major, token-major F32 rows): the largest
// |DSLP - SLP| of a row relative to the RMS of SLP's layer (docs/dslp.md "Numerics": rows within
// 2 % of the layer RMS; the merged attention differs in F32 rounding order).
constexpr double kKvRelTolerance = 0.02;

double KvRowError(const std::vector<std::byte>& got_bytes, const std::vector<std::byte>& want_bytes,
                  int64_t layers) {
  if (got_bytes.size() != want_bytes.size() || want_bytes.empty()) return 1e9;
  const size_t n = want_bytes.size() / sizeof(float);
  std::vector<float> got(n), want(n);
  std::memcpy(got.data(), got_bytes.data(), got_bytes.size());
  std::memcpy(want.data(), want_bytes.data(), want_bytes.size());
  const size_t per_layer = n / layers;
  double worst = 0;
  for (int64_t l = 0; l < layers; ++l) {
    const std::vector<float> layer(want.begin() + l * per_layer,
                                   want.begin() + (l + 1) * per_layer);
    const double rms = std::max(1e-12, engine_test::Rms(layer));
    for (size_t i = 0; i < per_layer; ++i) {
      const size_t k = l * per_layer + i;
      worst = std::max(worst, std::abs(static_cast<double>(got[k]) - want[k]) / rms);
    }
  }
  return worst;
}

// Single-worker SLP of `prompt` on a fresh runner of RunnerRig's options (the reference DSLP
// agrees with: the same KV block size, which the attention's F32 rounding depends on).
struct SlpPrefill {
  int32_t first_token = -1;
  std::vector<std::byte> kv;
};
SlpPrefill Slp(std::span<const int32_t> prompt) {
  SlpPrefill r;
  auto rig = RunnerRig::Make();
  if (rig == nullptr) return r;
  std::atomic<bool> cancelled{false};
  auto got = rig->runner->Run(prompt, SamplingParams(), UniqueName("slp"), cancelled);
  EXPECT_TRUE(got.ok()) << got.status();
  if (!got.ok()) return r;
  r.first_token = got->first_token;
  r.kv = ReadExport(got->kv->handle(),
                    HandoffShapeOf(KvCacheConfig::ForModel(rig->runner->config(), 1, 64)));
  return r;
}

DslpGroupSpec Group(const std::string& name, int rank, int world) {
  DslpGroupSpec g;
  g.group_id = name;
  g.shm_group = name;
  g.rank = rank;
  g.world_size = world;
  return g;
}

bool ShmGroupExists(const std::string& name) {
  return std::filesystem::exists("/dev/shm/hmoe.comm." + name);
}

// Forwards to a collective; sets `flag` (the rank's cancel flag) when it enters its N-th
// collective: the rank gives up mid-prefill, at a point fixed by the test.
class CancellingCollective final : public Collective {
 public:
  CancellingCollective(Collective& inner, int at, std::atomic<bool>* flag)
      : inner_(inner), at_(at), flag_(flag) {}
  int rank() const override { return inner_.rank(); }
  int world_size() const override { return inner_.world_size(); }
  std::string description() const override { return inner_.description(); }
  absl::Status AllGatherV(Stream& s, const void* send, void* recv, std::span<const size_t> c,
                          std::span<const size_t> o) override {
    Tick();
    return inner_.AllGatherV(s, send, recv, c, o);
  }
  absl::Status AllToAllV(Stream& s, const void* send, std::span<const size_t> sc,
                         std::span<const size_t> so, void* recv, std::span<const size_t> rc,
                         std::span<const size_t> ro) override {
    Tick();
    return inner_.AllToAllV(s, send, sc, so, recv, rc, ro);
  }
  absl::Status RingSendRecv(Stream& s, const void* send, size_t sb, void* recv,
                            size_t rb) override {
    Tick();
    return inner_.RingSendRecv(s, send, sb, recv, rb);
  }
  absl::Status AllReduceSum(Stream& s, const float* send, float* recv, size_t count) override {
    Tick();
    return inner_.AllReduceSum(s, send, recv, count);
  }
  absl::Status Barrier() override {
    Tick();
    return inner_.Barrier();
  }
  CommCounters counters() const override { return inner_.counters(); }
  void ResetCounters() override { inner_.ResetCounters(); }
  int ops() const { return ops_; }

 private:
  void Tick() {
    if (++ops_ == at_) flag_->store(true);
  }
  Collective& inner_;
  const int at_;
  std::atomic<bool>* flag_;
  int ops_ = 0;
};

// Every rank of a group on its own runner (its own device, streaming provider and KV pool), each
// on a thread of this process, as the prefill workers of a node run them.
struct DslpRanks {
  std::vector<std::unique_ptr<RunnerRig>> rigs;
  std::vector<absl::StatusOr<SlpResult>> results;

  static std::unique_ptr<DslpRanks> Make(int world) {
    auto r = std::make_unique<DslpRanks>();
    for (int i = 0; i < world; ++i) {
      r->rigs.push_back(RunnerRig::Make());
      if (r->rigs.back() == nullptr) return nullptr;
    }
    return r;
  }

  // Runs `prompt` over a new group; results[rank]. With `give_up_at` > 0 the last rank gives up
  // (its cancel flag turns true) when it enters its give_up_at-th collective.
  void Run(std::span<const int32_t> prompt, EpMode mode, const std::string& group,
           int give_up_at = 0) {
    const int world = static_cast<int>(rigs.size());
    results.clear();
    for (int i = 0; i < world; ++i) results.emplace_back(absl::UnknownError("not run"));
    std::vector<std::atomic<bool>> flags(world);
    std::vector<std::thread> threads;
    for (int rank = 0; rank < world; ++rank) {
      threads.emplace_back([&, rank] {
        DslpJoinOptions jo;
        jo.join_timeout = absl::Seconds(20);
        jo.peer_timeout = absl::Seconds(5);
        jo.channel_bytes = 1 << 16;
        auto comm = JoinDslpGroup(Group(group, rank, world), DeviceKind::kCpu, jo, flags[rank]);
        if (!comm.ok()) {
          results[rank] = comm.status();
          return;
        }
        CancellingCollective wrapped(**comm, rank == world - 1 ? give_up_at : 0, &flags[rank]);
        results[rank] = rigs[rank]->runner->RunDslp(
            prompt, SamplingParams(), absl::StrCat(group, "-kv"), flags[rank], wrapped, mode);
      });
    }
    for (std::thread& t : threads) t.join();
  }
};

// Rank 0 of 2 and 3 ranks exports the WHOLE prompt's KV cache (each rank's zig-zag chunks reach
// it through the ring pass-KV) within the DSLP tolerance of single-worker SLP, with SLP's first
// token; the other ranks export nothing and stream only their own experts; afterwards the same
// runners prefill alone again bit for bit like the resident engine (every expert streamed).
TEST(DslpRunnerTest, RankZeroExportsTheWholePromptLikeSlpInBothEpModes) {
  const ModelConfig& config = Tiny().checkpoint->config();
  const KvHandoffShape shape = HandoffShapeOf(KvCacheConfig::ForModel(config, 1, 64));
  for (int world : {2, 3}) {
    auto ranks = DslpRanks::Make(world);
    ASSERT_NE(ranks, nullptr);
    const size_t full_pass = ranks->rigs[0]->runner->weights().bytes_per_pass();
    // 45 and 29 tokens: not multiples of 2S.
    for (int n : {45, 29}) {
      const std::vector<int32_t> prompt = RandomTokens(n, 7 + n, 1000);
      const SlpPrefill want = Slp(prompt);
      for (EpMode mode : {EpMode::kSmallEp, EpMode::kStandard}) {
        const std::string what = absl::StrCat(world, " ranks, ", n, " tokens, ", EpModeName(mode));
        ranks->Run(prompt, mode, UniqueName("dslp"));
        for (int rank = 0; rank < world; ++rank) {
          absl::StatusOr<SlpResult>& got = ranks->results[rank];
          ASSERT_TRUE(got.ok()) << what << " rank " << rank << ": " << got.status();
          EXPECT_EQ(got->dslp_rank, rank);
          EXPECT_EQ(got->dslp.world_size, world);
          EXPECT_EQ(got->prompt_tokens, n);
          EXPECT_GT(got->dslp.comm.total_sent(), 0u) << what;
          // Attention and shared experts on every rank, routed experts split, the head (lm_head)
          // only on rank 0, the one that computes logits.
          EXPECT_LT(got->streaming.bytes_streamed, static_cast<int64_t>(full_pass)) << what;
          EXPECT_EQ(got->streaming.passes, 1);
          EXPECT_EQ(got->streaming.heads_skipped, rank == 0 ? 0 : 1) << what;
          if (rank > 0) {
            EXPECT_EQ(got->kv, nullptr) << what;
            EXPECT_EQ(got->first_token, -1) << what;
            continue;
          }
          ASSERT_NE(got->kv, nullptr) << what;
          EXPECT_EQ(got->kv->handle().num_tokens, n);
          EXPECT_EQ(got->first_token, want.first_token) << what;
          const double err =
              KvRowError(ReadExport(got->kv->handle(), shape), want.kv, config.num_hidden_layers);
          EXPECT_LE(err, kKvRelTolerance) << what;
          RecordProperty(absl::StrCat("kv_rel_error_", world, "_", n, "_", EpModeName(mode)),
                         absl::StrCat(err));
        }
        for (auto& rig : ranks->rigs) {
          EXPECT_EQ(rig->runner->kv_blocks_free(), rig->runner->kv_blocks_total()) << what;
        }
      }
    }
    // Alone again: every expert streams, and the result is the resident engine's bit for bit.
    const std::vector<int32_t> prompt = RandomTokens(33, 5, 1000);
    std::atomic<bool> cancelled{false};
    auto alone = ranks->rigs[world - 1]->runner->Run(prompt, SamplingParams(), UniqueName("alone"),
                                                     cancelled);
    ASSERT_TRUE(alone.ok()) << alone.status();
    EXPECT_EQ(alone->dslp_rank, -1);
    EXPECT_EQ(alone->streaming.bytes_streamed, static_cast<int64_t>(full_pass));
    EXPECT_TRUE(ReadExport(alone->kv->handle(), shape) == Slp(prompt).kv);
  }
}

// A rank that gives up mid-prefill breaks the group: its peers fail within the peer timeout
// (Unavailable naming it, which the scheduler reports as Aborted), nothing stays in the KV pools
// or in /dev/shm, and the same runners prefill the next prompt in a new group.
TEST(DslpRunnerTest, ARankLeavingMidPrefillFailsThePeersAndANewGroupServesTheNext) {
  auto ranks = DslpRanks::Make(2);
  ASSERT_NE(ranks, nullptr);
  // Rank 1 gives up in its 6th collective (the barrier, then layer 0's ring step, all-gather and
  // partial all-to-all, then layer 1's ring step and all-gather): inside layer 1.
  const std::vector<int32_t> prompt = RandomTokens(40, 3, 1000);
  const std::string broken = UniqueName("broken");
  const absl::Time start = absl::Now();
  ranks->Run(prompt, EpMode::kSmallEp, broken, /*give_up_at=*/6);
  EXPECT_LT(absl::Now() - start, absl::Seconds(10));
  EXPECT_EQ(ranks->results[1].status().code(), absl::StatusCode::kCancelled)
      << ranks->results[1].status();
  const absl::Status& peer = ranks->results[0].status();
  EXPECT_EQ(peer.code(), absl::StatusCode::kUnavailable) << peer;
  EXPECT_TRUE(absl::StrContains(peer.message(), "rank 1")) << peer;
  const absl::Status reported = GroupFailureStatus(peer, Group(broken, 0, 2));
  EXPECT_EQ(reported.code(), absl::StatusCode::kAborted);
  EXPECT_TRUE(absl::StrContains(reported.message(), broken)) << reported;
  EXPECT_EQ(GroupFailureStatus(absl::InvalidArgumentError("x"), Group(broken, 0, 2)).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_FALSE(ShmGroupExists(broken));
  for (auto& rig : ranks->rigs) {
    EXPECT_EQ(rig->runner->kv_blocks_free(), rig->runner->kv_blocks_total());
  }
  ranks->Run(prompt, EpMode::kSmallEp, UniqueName("reformed"));
  ASSERT_TRUE(ranks->results[0].ok()) << ranks->results[0].status();
  ASSERT_TRUE(ranks->results[1].ok()) << ranks->results[1].status();
  EXPECT_EQ(ranks->results[0]->first_token, Slp(prompt).first_token);
}

// Through the scheduler (what the gRPC service calls): rank 0's outcome carries the hand-off,
// rank 1's none; a group that never forms (the other rank never comes) is Aborted after the join
// timeout and leaves no shared-memory object; a cancel while joining ends at once.
TEST(PrefillSchedulerTest, DslpRanksJoinRunAndFailCleanly) {
  auto rig0 = RunnerRig::Make();
  auto rig1 = RunnerRig::Make();
  ASSERT_NE(rig0, nullptr);
  ASSERT_NE(rig1, nullptr);
  ExportTable exports0(absl::Minutes(5)), exports1(absl::Minutes(5));
  PrefillSchedulerOptions o = SchedulerOptions(4);
  // Generous for the group that forms (its two threads may start far apart on a loaded machine,
  // and under TSan); the group that never forms uses a third scheduler with a short timeout.
  o.dslp_join.join_timeout = absl::Seconds(60);
  o.dslp_join.channel_bytes = 1 << 16;
  o.dslp_ep_mode = EpMode::kStandard;
  PrefillScheduler s0(rig0->runner.get(), &exports0, o);
  o.export_prefix += "r1-";
  PrefillScheduler s1(rig1->runner.get(), &exports1, o);

  const std::string group = UniqueName("sched");
  PrefillJob j0 = Job("req", 30), j1 = Job("req", 30);
  j0.dslp = Group(group, 0, 2);
  j1.dslp = Group(group, 1, 2);
  absl::StatusOr<PrefillOutcome> o0, o1;
  {
    std::atomic<bool> done{false};
    // What GetStatus reads while the model thread switches the expert subset and prefills.
    std::thread status([&] {
      while (!done.load()) {
        EXPECT_GT(rig1->runner->weights().ring_slot_bytes(), 0u);
        EXPECT_GT(rig1->runner->weights().ring_slots(), 0);
        (void)s1.stats();
        absl::SleepFor(absl::Microseconds(200));
      }
    });
    std::thread t0([&] { o0 = s0.Prefill(j0, nullptr); });
    std::thread t1([&] { o1 = s1.Prefill(j1, nullptr); });
    t0.join();
    t1.join();
    done = true;
    status.join();
  }
  ASSERT_TRUE(o0.ok()) << o0.status();
  ASSERT_TRUE(o1.ok()) << o1.status();
  EXPECT_TRUE(o0->exported);
  EXPECT_FALSE(o1->exported);
  EXPECT_EQ(o0->dslp_rank, 0);
  EXPECT_EQ(o1->dslp_rank, 1);
  EXPECT_EQ(o0->dslp_local_tokens + o1->dslp_local_tokens, 30);
  EXPECT_GT(o1->dslp_bytes_sent, 0);
  EXPECT_EQ(o1->first_token, -1);
  EXPECT_EQ(o0->first_token, Slp(j0.prompt).first_token);
  const v1::PrefillResponse r0 = OutcomeToProto(*o0, "w0"), r1 = OutcomeToProto(*o1, "w1");
  EXPECT_TRUE(r0.has_kv_handle());
  EXPECT_FALSE(r1.has_kv_handle());
  EXPECT_EQ(r1.first_token_id(), -1);
  EXPECT_EQ(r1.timing().dslp_local_tokens(), o1->dslp_local_tokens);
  EXPECT_EQ(exports0.count(), 1);
  EXPECT_EQ(exports1.count(), 0);
  EXPECT_EQ(s0.stats().last_dslp_group, group);
  EXPECT_EQ(s1.stats().dslp_prefills, 1);
  ASSERT_TRUE(exports0.Release("req").ok());

  // Rank 1 never comes: rank 0 creates the object, waits the join timeout, and removes it.
  PrefillSchedulerOptions short_join = o;
  short_join.dslp_join.join_timeout = absl::Milliseconds(500);
  short_join.export_prefix += "short-";
  PrefillScheduler s_short(rig0->runner.get(), &exports0, short_join);
  const std::string lonely = UniqueName("lonely");
  PrefillJob alone = Job("alone", 30);
  alone.dslp = Group(lonely, 0, 2);
  absl::StatusOr<PrefillOutcome> failed = s_short.Prefill(alone, nullptr);
  EXPECT_EQ(failed.status().code(), absl::StatusCode::kAborted) << failed.status();
  EXPECT_TRUE(absl::StrContains(failed.status().message(), "did not form")) << failed.status();
  EXPECT_FALSE(ShmGroupExists(lonely));
  // Rank 1 of a group whose rank 0 never comes, cancelled while it waits: it ends long before the
  // 60 s join timeout.
  const std::string waiting = UniqueName("waiting");
  PrefillJob late = Job("late", 30);
  late.dslp = Group(waiting, 1, 2);
  std::atomic<bool> gone{false};
  absl::StatusOr<PrefillOutcome> cancelled;
  std::thread t([&] { cancelled = s1.Prefill(late, [&] { return gone.load(); }); });
  absl::SleepFor(absl::Milliseconds(100));
  const absl::Time cancel_at = absl::Now();
  gone = true;
  t.join();
  EXPECT_EQ(cancelled.status().code(), absl::StatusCode::kCancelled) << cancelled.status();
  EXPECT_LT(absl::Now() - cancel_at, absl::Seconds(20));
  EXPECT_FALSE(ShmGroupExists(waiting));
  EXPECT_EQ(s_short.stats().failed, 1);
  EXPECT_EQ(s0.stats().failed, 0);
}

}  // namespace
}  // namespace hmoe::prefill
