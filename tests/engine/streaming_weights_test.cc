// Stream-loading prefill (SLP, issue #4) on the tiny checkpoint: the StreamArena, and the engine
// over StreamingWeights (loader, model and unloader threads; label threads, also run under TSan)
// against the engine over resident weights, bitwise; its device memory bound; its failure modes.

#include "common/engine/streaming_weights.h"

#include <cstring>
#include <span>
#include <thread>
#include <vector>

#include "absl/strings/match.h"
#include "absl/time/clock.h"
#include <gtest/gtest.h>

#include "common/engine/stream_arena.h"
#include "tests/engine/engine_test_util.h"
#include "tests/engine/slp_test_util.h"

namespace hmoe::engine_test {
namespace {

constexpr size_t kA = StreamArena::kAlignment;

// ---------------------------------------------------------------------------------- StreamArena

TEST(StreamArenaTest, AllocatesInOrderWrapsAndReclaimsFromTheOldest) {
  auto device = NewCpuDevice();
  auto arena = StreamArena::Create(*device, 10 * kA);
  ASSERT_TRUE(arena.ok()) << arena.status();
  StreamArena& a = **arena;
  const absl::Time now = absl::InfinitePast();  // never wait
  auto b1 = a.Allocate(4 * kA, now);
  auto b2 = a.Allocate(3 * kA - 7, now);  // rounded up to 3 * kA
  auto b3 = a.Allocate(3 * kA, now);
  ASSERT_TRUE(b1.ok() && b2.ok() && b3.ok());
  EXPECT_EQ(b1->offset, 0u);
  EXPECT_EQ(b2->offset, 4 * kA);
  EXPECT_EQ(b2->size_bytes, 3 * kA);
  EXPECT_EQ(b3->offset, 7 * kA);
  EXPECT_EQ(a.bytes_in_use(), 10 * kA);
  EXPECT_TRUE(absl::IsDeadlineExceeded(a.Allocate(kA, now).status()));
  // Freeing a younger block first reclaims nothing; freeing the oldest reclaims both.
  ASSERT_TRUE(a.Free(*b2).ok());
  EXPECT_TRUE(absl::IsDeadlineExceeded(a.Allocate(kA, now).status()));
  ASSERT_TRUE(a.Free(*b1).ok());
  // The front is free now ([0, 7 kA)); the end is full: the next block wraps to 0.
  auto b4 = a.Allocate(6 * kA, now);
  ASSERT_TRUE(b4.ok());
  EXPECT_EQ(b4->offset, 0u);
  EXPECT_TRUE(absl::IsDeadlineExceeded(a.Allocate(2 * kA, now).status()));
  auto b5 = a.Allocate(kA, now);  // [6 kA, 7 kA) between the wrapped head and the tail
  ASSERT_TRUE(b5.ok());
  EXPECT_EQ(b5->offset, 6 * kA);
  EXPECT_EQ(a.peak_bytes_in_use(), 10 * kA);
  EXPECT_EQ(a.num_live_blocks(), 3);
  EXPECT_EQ(a.Free(*b1).code(), absl::StatusCode::kFailedPrecondition);  // twice
  for (const auto* b : {&*b3, &*b4, &*b5}) ASSERT_TRUE(a.Free(*b).ok());
  EXPECT_EQ(a.bytes_in_use(), 0u);
  // Empty again: the next block starts at 0.
  auto b6 = a.Allocate(10 * kA, now);
  ASSERT_TRUE(b6.ok());
  EXPECT_EQ(b6->offset, 0u);
}

TEST(StreamArenaTest, ABlockLargerThanTheArenaFailsAtOnce) {
  auto device = NewCpuDevice();
  auto arena = StreamArena::Create(*device, 4 * kA);
  ASSERT_TRUE(arena.ok());
  // Even with an infinite deadline: it could never fit.
  EXPECT_EQ((*arena)->Allocate(4 * kA + 1, absl::InfiniteFuture()).status().code(),
            absl::StatusCode::kResourceExhausted);
  EXPECT_EQ((*arena)->Allocate(0, absl::InfiniteFuture()).status().code(),
            absl::StatusCode::kInvalidArgument);
}

TEST(StreamArenaTest, ABlockedAllocationProceedsWhenAnotherThreadFrees) {
  auto device = NewCpuDevice();
  auto arena = StreamArena::Create(*device, 4 * kA);
  ASSERT_TRUE(arena.ok());
  StreamArena& a = **arena;
  auto held = a.Allocate(3 * kA, absl::InfinitePast());
  ASSERT_TRUE(held.ok());
  std::thread freer([&] {
    absl::SleepFor(absl::Milliseconds(30));
    EXPECT_TRUE(a.Free(*held).ok());
  });
  auto waited = a.Allocate(2 * kA, absl::Now() + absl::Seconds(30));
  freer.join();
  ASSERT_TRUE(waited.ok()) << waited.status();
  EXPECT_EQ(a.bytes_in_use(), 2 * kA);
}

// ---------------------------------------------------------------------------------- SLP

std::vector<int32_t> Prompt() { return RandomTokens(37, 41, 1000); }

// Acceptance 1 on tiny: the first token's logits and every KV byte equal the resident-weights
// engine's, for ring lengths 2, 4 and experts-per-layer (16), with experts on the device (the
// SLP path) and on the CPU (the decode worker's path).
TEST(StreamingWeightsTest, SlpEqualsResidentPrefillBitwiseForEveryRingLength) {
  Model& model = Tiny();
  const std::vector<int32_t> prompt = Prompt();
  auto device_placed = ResidentRig(model, ExpertPlacement::kDevice);
  auto cpu_placed = ResidentRig(model, ExpertPlacement::kCpu);
  ASSERT_NE(device_placed, nullptr);
  ASSERT_NE(cpu_placed, nullptr);
  const PrefillResult want = Prefill(*device_placed->engine, *device_placed->cache, prompt);
  const PrefillResult want_cpu = Prefill(*cpu_placed->engine, *cpu_placed->cache, prompt);
  ASSERT_FALSE(want.logits.empty());
  EXPECT_EQ(want.logits, want_cpu.logits);
  EXPECT_EQ(want.kv, want_cpu.kv);
  const int64_t experts = model.checkpoint->config().n_routed_experts;
  for (int64_t ring : {int64_t{2}, int64_t{4}, experts}) {
    SCOPED_TRACE(absl::StrCat("ring of ", ring, " slots"));
    auto slp = SlpRig::Make(model, {.ring_slots = ring, .budget_bytes = 8 << 20});
    ASSERT_NE(slp, nullptr);
    EXPECT_EQ(slp->weights->ring_slots(), ring);
    StreamingStats stats;
    const PrefillResult got = slp->Run(prompt, &stats);
    ASSERT_EQ(got.logits.size(), want.logits.size());
    EXPECT_EQ(0,
              std::memcmp(got.logits.data(), want.logits.data(), got.logits.size() * sizeof(float)))
        << "max abs diff " << MaxAbsDiff(got.logits, want.logits);
    EXPECT_EQ(got.kv, want.kv);
    EXPECT_EQ(stats.passes, 1);
    EXPECT_EQ(stats.modules_loaded, slp->weights->modules_per_pass());
    EXPECT_EQ(stats.bytes_streamed, static_cast<int64_t>(slp->weights->bytes_per_pass()));
    EXPECT_LE(stats.ring_peak_slots, ring);
    EXPECT_GE(stats.ring_peak_slots, 1);
    // A second prompt on the same provider (the pipeline re-arms).
    const PrefillResult again = slp->Run(prompt);
    EXPECT_EQ(again.kv, want.kv);
  }
}

TEST(StreamingWeightsTest, DefaultBudgetIsOneGibOnAGpuAndAFewLayersOnTheCpu) {
  constexpr size_t kMiB = size_t{1} << 20;
  // GPU: the paper's 1 GiB, or the largest module when larger.
  EXPECT_EQ(DefaultStreamBudgetBytes(false, 10 * kMiB, 20 * kMiB), kDefaultStreamBudgetBytes);
  EXPECT_EQ(DefaultStreamBudgetBytes(false, 1900 * kMiB, 20 * kMiB), 1900 * kMiB);
  // Host memory: three layers' worth, capped at 1 GiB, never below the largest module.
  EXPECT_EQ(DefaultStreamBudgetBytes(true, 10 * kMiB, 20 * kMiB), 60 * kMiB);
  EXPECT_EQ(DefaultStreamBudgetBytes(true, 100 * kMiB, 20 * kMiB), 100 * kMiB);
  EXPECT_EQ(DefaultStreamBudgetBytes(true, 10 * kMiB, 600 * kMiB), kDefaultStreamBudgetBytes);
  EXPECT_EQ(DefaultStreamBudgetBytes(true, 1900 * kMiB, 600 * kMiB), 1900 * kMiB);
}

// On the CPU device the default arena is sized from the model (a few layers), not 1 GiB: the
// device holds only that much for weights outside the ring, and SLP is still exact.
TEST(StreamingWeightsTest, DefaultBudgetOnTheCpuDeviceIsSizedFromTheModel) {
  Model& model = Tiny();
  const std::vector<int32_t> prompt = Prompt();
  auto resident = ResidentRig(model, ExpertPlacement::kDevice);
  ASSERT_NE(resident, nullptr);
  const PrefillResult want = Prefill(*resident->engine, *resident->cache, prompt);
  auto slp = SlpRig::Make(model, {.ring_slots = 2, .budget_bytes = 0});
  ASSERT_NE(slp, nullptr);
  const StreamingWeights& w = *slp->weights;
  ASSERT_GT(w.largest_layer_budget_bytes(), 0u);
  EXPECT_GE(w.largest_layer_budget_bytes(), w.largest_budget_module_bytes() / 2);
  const size_t expected = DefaultStreamBudgetBytes(true, w.largest_budget_module_bytes(),
                                                   w.largest_layer_budget_bytes());
  EXPECT_EQ(w.budget_bytes(), (expected + 255) / 256 * 256);
  EXPECT_LT(w.budget_bytes(), kDefaultStreamBudgetBytes / 64);
  EXPECT_GE(w.budget_bytes(), 3 * w.largest_layer_budget_bytes());
  StreamingStats stats;
  const PrefillResult got = slp->Run(prompt, &stats);
  EXPECT_EQ(got.logits, want.logits);
  EXPECT_EQ(got.kv, want.kv);
  EXPECT_LE(stats.arena_peak_bytes, w.budget_bytes());
  RecordProperty("default_cpu_budget_bytes", static_cast<int>(w.budget_bytes()));
}

TEST(StreamingWeightsTest, MultiPassPrefillEqualsResidentWithTheSameSteps) {
  Model& model = Tiny();
  EngineOptions options;
  options.max_step_tokens = 16;  // 37 tokens: three passes, each streaming every module
  const std::vector<int32_t> prompt = Prompt();
  auto resident = ResidentRig(model, ExpertPlacement::kDevice, options);
  ASSERT_NE(resident, nullptr);
  const PrefillResult want = Prefill(*resident->engine, *resident->cache, prompt);
  auto slp = SlpRig::Make(model, {.ring_slots = 3, .budget_bytes = 4 << 20}, options);
  ASSERT_NE(slp, nullptr);
  StreamingStats stats;
  const PrefillResult got = slp->Run(prompt, &stats);
  EXPECT_EQ(got.logits, want.logits);
  EXPECT_EQ(got.kv, want.kv);
  EXPECT_EQ(stats.passes, 3);
  EXPECT_EQ(stats.modules_loaded, 3 * slp->weights->modules_per_pass());
}

// Back-to-back short prefills: each ends while the loader may still be finishing the
// bookkeeping of the last module (a race that once let the loader undo the next prefill's
// reset and stall it); every prefill must start clean and be exact.
TEST(StreamingWeightsTest, BackToBackPrefillsReArmThePipeline) {
  Model& model = Tiny();
  auto resident = ResidentRig(model, ExpertPlacement::kDevice);
  ASSERT_NE(resident, nullptr);
  CpuDeviceOptions capped;
  capped.copy_bytes_per_second = 20e9;  // the loader sleeps after each copy
  auto slp = SlpRig::Make(
      model, {.ring_slots = 2, .budget_bytes = 4 << 20, .stall_timeout = absl::Seconds(20)}, {},
      capped);
  ASSERT_NE(slp, nullptr);
  for (int i = 0; i < 40; ++i) {
    const std::vector<int32_t> prompt = RandomTokens(1 + i % 3, 100 + i, 1000);
    StreamingStats stats;
    const PrefillResult got = slp->Run(prompt, &stats);
    ASSERT_EQ(got.kv, Prefill(*resident->engine, *resident->cache, prompt).kv) << "prefill " << i;
    ASSERT_EQ(stats.modules_loaded, slp->weights->modules_per_pass()) << "prefill " << i;
  }
}

// Acceptance 2: device memory never exceeds ring + budget + activations, where activations are
// what the same engine with resident (in place) weights allocates: scratch, KV pool, constants.
// The SLP device gets exactly that much memory and no more.
TEST(StreamingWeightsTest, PeakDeviceMemoryIsRingPlusBudgetPlusActivations) {
  Model& model = Tiny();
  const std::vector<int32_t> prompt = Prompt();
  auto resident = ResidentRig(model, ExpertPlacement::kDevice);
  ASSERT_NE(resident, nullptr);
  resident->device->ResetPeakBytes();
  Prefill(*resident->engine, *resident->cache, prompt);
  const size_t activations = resident->device->peak_bytes_in_use();
  ASSERT_GT(activations, 0u);

  StreamingWeightsOptions wo{.ring_slots = 4, .budget_bytes = 2 << 20};
  auto probe = SlpRig::Make(model, wo);  // sizes of the ring and the arena
  ASSERT_NE(probe, nullptr);
  const size_t ring = probe->weights->ring_bytes();
  const size_t budget = probe->weights->budget_bytes();
  probe.reset();
  CpuDeviceOptions exact;
  exact.budget_bytes = ring + budget + activations;
  auto slp = SlpRig::Make(model, wo, {}, exact);
  ASSERT_NE(slp, nullptr);
  StreamingStats stats;
  const PrefillResult got = slp->Run(prompt, &stats);
  ASSERT_FALSE(got.logits.empty());
  EXPECT_LE(slp->device->peak_bytes_in_use(), ring + budget + activations);
  EXPECT_LE(stats.arena_peak_bytes, budget);
  EXPECT_GT(stats.arena_peak_bytes, 0u);
  EXPECT_LE(stats.ring_peak_slots, 4);
  RecordProperty("activation_bytes", static_cast<int>(activations));
  RecordProperty("ring_bytes", static_cast<int>(ring));
  RecordProperty("arena_peak_bytes", static_cast<int>(stats.arena_peak_bytes));
}

// Acceptance 2: a budget smaller than one module is a clear error at creation, not a deadlock;
// a budget of exactly the largest module works (the loader stages one module at a time).
TEST(StreamingWeightsTest, BudgetSmallerThanOneModuleFailsClearly) {
  Model& model = Tiny();
  auto probe = SlpRig::Make(model, {});
  ASSERT_NE(probe, nullptr);
  const size_t largest = probe->weights->largest_budget_module_bytes();
  probe.reset();
  auto device = NewCpuDevice({.pool = &Pool()});
  auto too_small = StreamingWeights::Create(model.checkpoint->config(), *model.checkpoint, *device,
                                            {.budget_bytes = largest - 1000});
  ASSERT_EQ(too_small.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(absl::StrContains(too_small.status().message(), "streaming budget"))
      << too_small.status();
  EXPECT_TRUE(absl::StrContains(too_small.status().message(), absl::StrCat(largest)))
      << too_small.status();

  const std::vector<int32_t> prompt = Prompt();
  auto resident = ResidentRig(model, ExpertPlacement::kDevice);
  ASSERT_NE(resident, nullptr);
  const PrefillResult want = Prefill(*resident->engine, *resident->cache, prompt);
  auto tight = SlpRig::Make(model, {.ring_slots = 1, .budget_bytes = largest});
  ASSERT_NE(tight, nullptr);
  StreamingStats stats;
  EXPECT_EQ(tight->Run(prompt, &stats).kv, want.kv);
  EXPECT_LE(stats.arena_peak_bytes, largest);
  EXPECT_EQ(stats.ring_peak_slots, 1);
}

// The model thread must follow the schedule; a module it never releases stalls the pipeline,
// which fails with DeadlineExceeded after stall_timeout; an abort frees everything and the next
// prefill is correct.
TEST(StreamingWeightsTest, ScheduleViolationsStallsAndAbortsFailCleanly) {
  Model& model = Tiny();
  // The stall timeout bounds every wait of the final full prefill too, so it leaves room for a
  // loader thread that loses the CPU on a loaded machine or under TSan.
  auto rig = SlpRig::Make(
      model, {.ring_slots = 1, .budget_bytes = 4 << 20, .stall_timeout = absl::Seconds(2)});
  ASSERT_NE(rig, nullptr);
  StreamingWeights& w = *rig->weights;
  auto stream = rig->device->CreateStream();
  ASSERT_TRUE(stream.ok());
  Stream& s = **stream;
  const std::vector<ModuleId> schedule = w.schedule();
  ASSERT_GT(schedule.size(), 4u);
  EXPECT_EQ(w.Acquire(schedule[0], s).status().code(), absl::StatusCode::kFailedPrecondition);
  ASSERT_TRUE(w.BeginPrefill(1).ok());
  EXPECT_EQ(w.BeginPrefill(1).code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(w.Acquire(schedule[1], s).status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(w.Release(schedule[0], s).code(), absl::StatusCode::kFailedPrecondition);
  // Walk to the first routed expert and hold it: with one ring slot the next expert can never
  // load.
  size_t i = 0;
  for (; schedule[i].kind != ModuleKind::kRoutedExpert; ++i) {
    ASSERT_TRUE(w.Acquire(schedule[i], s).ok());
    if (schedule[i].kind != ModuleKind::kSharedExperts) {
      ASSERT_TRUE(w.Release(schedule[i], s).ok());
    }
  }
  ASSERT_TRUE(w.Acquire(schedule[i], s).ok());
  const absl::Time start = absl::Now();
  const absl::Status stalled = w.Acquire(schedule[i + 1], s).status();
  EXPECT_EQ(stalled.code(), absl::StatusCode::kDeadlineExceeded) << stalled;
  EXPECT_GE(absl::Now() - start, absl::Milliseconds(1900));
  EXPECT_LT(absl::Now() - start, absl::Seconds(60));
  auto aborted = w.EndPrefill(/*abort=*/true);
  EXPECT_TRUE(aborted.ok()) << aborted.status();
  EXPECT_EQ(w.EndPrefill().status().code(), absl::StatusCode::kFailedPrecondition);
  // Everything was freed: a full prefill runs and matches the resident engine.
  auto resident = ResidentRig(model, ExpertPlacement::kDevice);
  ASSERT_NE(resident, nullptr);
  const std::vector<int32_t> prompt = Prompt();
  EXPECT_EQ(rig->Run(prompt).kv, Prefill(*resident->engine, *resident->cache, prompt).kv);
}

// A step abandoned between layers (a cancelled prefill), then EndPrefill(abort): the next
// prefill on the same engine and provider is correct.
TEST(StreamingWeightsTest, AbandonedStepThenAbortLeavesAWorkingPipeline) {
  Model& model = Tiny();
  auto rig = SlpRig::Make(model, {.ring_slots = 2, .budget_bytes = 4 << 20});
  ASSERT_NE(rig, nullptr);
  const std::vector<int32_t> prompt = Prompt();
  auto batch = rig->engine->NewMicroBatch();
  ASSERT_TRUE(batch.ok());
  KvSequence seq = rig->cache->NewSequence();
  SequenceInput in{&seq, prompt, true};
  ASSERT_TRUE(rig->weights->BeginPrefill(1).ok());
  ASSERT_TRUE((*batch)->BeginStep(std::span<const SequenceInput>(&in, 1)).ok());
  ASSERT_TRUE((*batch)->RunAttention(0).ok());
  ASSERT_TRUE((*batch)->RunFfn(0).ok());
  ASSERT_TRUE((*batch)->RunAttention(1).ok());
  (*batch)->AbandonStep();
  EXPECT_FALSE((*batch)->in_step());
  ASSERT_TRUE((*batch)->stream().Synchronize().ok());
  ASSERT_TRUE(rig->weights->EndPrefill(/*abort=*/true).ok());
  EXPECT_EQ(seq.num_tokens(), 0);
  auto resident = ResidentRig(model, ExpertPlacement::kDevice);
  ASSERT_NE(resident, nullptr);
  EXPECT_EQ(rig->Run(prompt).kv, Prefill(*resident->engine, *resident->cache, prompt).kv);
}

// HeadStreaming::kLastPass: a chunked prompt streams the head (final norm + lm_head) only for its
// last step, the one that wants logits, and the result is still bit-equal to resident weights.
TEST(StreamingWeightsTest, HeadIsStreamedOnlyForTheLastPass) {
  Model& model = Tiny();
  EngineOptions options;
  options.max_step_tokens = 16;  // 37 tokens: three passes
  const std::vector<int32_t> prompt = Prompt();
  auto resident = ResidentRig(model, ExpertPlacement::kDevice, options);
  ASSERT_NE(resident, nullptr);
  const PrefillResult want = Prefill(*resident->engine, *resident->cache, prompt);
  auto slp = SlpRig::Make(model, {.ring_slots = 3, .budget_bytes = 4 << 20}, options);
  ASSERT_NE(slp, nullptr);
  StreamingWeights& w = *slp->weights;
  ASSERT_GT(w.head_bytes(), 0u);
  for (int round = 0; round < 2; ++round) {  // and the pipeline re-arms for the next prompt
    ASSERT_TRUE(w.BeginPrefill(3, HeadStreaming::kLastPass).ok());
    const PrefillResult got = Prefill(*slp->engine, *slp->cache, prompt);
    auto stats = w.EndPrefill();
    ASSERT_TRUE(stats.ok()) << stats.status();
    EXPECT_EQ(got.logits, want.logits);
    EXPECT_EQ(got.kv, want.kv);
    EXPECT_EQ(stats->heads_skipped, 2);
    EXPECT_EQ(stats->modules_loaded, 3 * w.modules_per_pass() - 2);
    EXPECT_EQ(stats->bytes_streamed,
              static_cast<int64_t>(3 * w.bytes_per_pass() - 2 * w.head_bytes()));
  }
}

// HeadStreaming::kNever (a DSLP rank > 0): steps without logits run; a step that wants logits
// fails with FailedPrecondition instead of reading a head that is not there, and the pipeline
// works again after the abort.
TEST(StreamingWeightsTest, HeadNeverStreamedServesStepsWithoutLogitsOnly) {
  Model& model = Tiny();
  auto slp = SlpRig::Make(model, {.ring_slots = 2, .budget_bytes = 4 << 20});
  ASSERT_NE(slp, nullptr);
  StreamingWeights& w = *slp->weights;
  const std::vector<int32_t> prompt = Prompt();
  auto resident = ResidentRig(model, ExpertPlacement::kDevice);
  ASSERT_NE(resident, nullptr);
  const PrefillResult want = Prefill(*resident->engine, *resident->cache, prompt);

  ASSERT_TRUE(w.BeginPrefill(1, HeadStreaming::kNever).ok());
  {
    KvSequence seq = slp->cache->NewSequence();
    SequenceInput in{&seq, prompt, /*want_logits=*/false};
    auto out = slp->engine->Forward(std::span<const SequenceInput>(&in, 1));
    ASSERT_TRUE(out.ok()) << out.status();
    EXPECT_TRUE((*out)[0].empty());
    std::vector<std::byte> kv(slp->cache->ExportBytes(seq.num_tokens()));
    auto stream = slp->device->CreateStream();
    ASSERT_TRUE(stream.ok());
    ASSERT_TRUE(slp->cache->Export(seq, **stream, kv.data(), MemorySpace::kHost).ok());
    ASSERT_TRUE((*stream)->Synchronize().ok());
    EXPECT_EQ(kv, want.kv);
  }
  auto stats = w.EndPrefill();
  ASSERT_TRUE(stats.ok()) << stats.status();
  EXPECT_EQ(stats->heads_skipped, 1);
  EXPECT_EQ(stats->bytes_streamed, static_cast<int64_t>(w.bytes_per_pass() - w.head_bytes()));

  ASSERT_TRUE(w.BeginPrefill(1, HeadStreaming::kNever).ok());
  {
    KvSequence seq = slp->cache->NewSequence();
    SequenceInput in{&seq, prompt, /*want_logits=*/true};
    const absl::Status refused =
        slp->engine->Forward(std::span<const SequenceInput>(&in, 1)).status();
    EXPECT_EQ(refused.code(), absl::StatusCode::kFailedPrecondition) << refused;
    EXPECT_TRUE(absl::StrContains(refused.message(), "did not load the head")) << refused;
  }
  ASSERT_TRUE(w.EndPrefill(/*abort=*/true).ok());
  EXPECT_EQ(slp->Run(prompt).logits, want.logits);
}

// A DSLP rank streams only its own experts: the schedule leaves the others out, their Acquire
// is refused, and the loaded modules' device bytes equal the host tensors.
TEST(StreamingWeightsTest, StreamsASubsetOfExpertsWithExactBytes) {
  Model& model = Tiny();
  const ModelConfig& c = model.checkpoint->config();
  auto even = [](int64_t, int64_t expert) { return expert % 2 == 0; };
  auto rig = SlpRig::Make(model, {.budget_bytes = 4 << 20, .load_expert = even});
  ASSERT_NE(rig, nullptr);
  StreamingWeights& w = *rig->weights;
  EXPECT_EQ(w.loaded_experts_per_layer(), c.n_routed_experts / 2);
  EXPECT_EQ(w.ring_slots(), c.n_routed_experts / 2);
  auto host_device = NewCpuDevice();
  auto host = ResidentWeights::Create(c, *model.checkpoint, *host_device);
  ASSERT_TRUE(host.ok());
  auto stream = rig->device->CreateStream();
  ASSERT_TRUE(stream.ok());
  Stream& s = **stream;
  ASSERT_TRUE(w.BeginPrefill(1).ok());
  int experts = 0;
  for (const ModuleId& id : w.schedule()) {
    if (id.kind == ModuleKind::kRoutedExpert) {
      ++experts;
      EXPECT_EQ(id.expert % 2, 0);
    }
    auto got = w.Acquire(id, s);
    ASSERT_TRUE(got.ok()) << ModuleName(id) << ": " << got.status();
    auto want = (*host)->Acquire(id, s);
    ASSERT_TRUE(want.ok());
    if (id.kind == ModuleKind::kRoutedExpert || id.kind == ModuleKind::kSharedExperts) {
      for (auto [g, h] : {std::pair{&(*got)->mlp.gate, &(*want)->mlp.gate},
                          std::pair{&(*got)->mlp.up, &(*want)->mlp.up},
                          std::pair{&(*got)->mlp.down, &(*want)->mlp.down}}) {
        EXPECT_NE(g->data, h->data);  // a device copy, not the host tensor
        EXPECT_EQ(0, std::memcmp(g->data, h->data, g->rows * g->cols));
        EXPECT_EQ(0, std::memcmp(g->scale_inv, h->scale_inv,
                                 ((g->rows + 127) / 128) * ((g->cols + 127) / 128) * 4));
        EXPECT_EQ(reinterpret_cast<uintptr_t>(g->data) % 64, 0u);  // as a DeviceBuffer
      }
    }
    if (id.kind == ModuleKind::kRoutedExpert && id.expert == 0) {
      const ModuleId odd{ModuleKind::kRoutedExpert, id.layer, 1};
      const absl::Status refused = w.Acquire(odd, s).status();
      EXPECT_EQ(refused.code(), absl::StatusCode::kFailedPrecondition);
      EXPECT_TRUE(absl::StrContains(refused.message(), "not streamed")) << refused;
    }
    ASSERT_TRUE(w.Release(id, s).ok());
  }
  EXPECT_EQ(experts, (c.num_hidden_layers - c.first_k_dense_replace) * c.n_routed_experts / 2);
  auto stats = w.EndPrefill();
  ASSERT_TRUE(stats.ok()) << stats.status();
  EXPECT_EQ(stats->modules_loaded, w.modules_per_pass());
}

// A prefill worker that becomes another DSLP rank changes its expert subset between prefills:
// the schedule follows (only that rank's experts), a change during a prefill is refused, and back
// to every expert the provider prefills bit for bit as before (same ring, same arena).
TEST(StreamingWeightsTest, ExpertSubsetChangesBetweenPrefills) {
  Model& model = Tiny();
  const ModelConfig& c = model.checkpoint->config();
  const std::vector<int32_t> prompt = Prompt();
  auto rig = SlpRig::Make(model, {.ring_slots = 4, .budget_bytes = 4 << 20});
  ASSERT_NE(rig, nullptr);
  StreamingWeights& w = *rig->weights;
  const PrefillResult before = rig->Run(prompt);
  const size_t full_pass = w.bytes_per_pass();
  const size_t ring_bytes = w.ring_bytes();
  const int64_t e = c.n_routed_experts;
  for (auto [begin, end] : {std::pair<int64_t, int64_t>{0, e / 2}, {e / 3, e}, {e - 1, e}}) {
    ASSERT_TRUE(w.SetLoadedExperts([begin, end](int64_t, int64_t x) {
                   return x >= begin && x < end;
                 }).ok());
    EXPECT_EQ(w.loaded_experts_per_layer(), end - begin);
    EXPECT_EQ(w.ring_bytes(), ring_bytes);  // the ring stays
    EXPECT_LT(w.bytes_per_pass(), full_pass);
    int64_t experts = 0;
    for (const ModuleId& id : w.schedule()) {
      if (id.kind != ModuleKind::kRoutedExpert) continue;
      ++experts;
      EXPECT_TRUE(id.expert >= begin && id.expert < end) << ModuleName(id);
    }
    EXPECT_EQ(experts, (c.num_hidden_layers - c.first_k_dense_replace) * (end - begin));
    // One pass of the subset's schedule streams it (what a DSLP rank acquires).
    auto stream = rig->device->CreateStream();
    ASSERT_TRUE(stream.ok());
    ASSERT_TRUE(w.BeginPrefill(1).ok());
    EXPECT_EQ(w.SetLoadedExperts(nullptr).code(), absl::StatusCode::kFailedPrecondition);
    for (const ModuleId& id : w.schedule()) {
      ASSERT_TRUE(w.Acquire(id, **stream).ok()) << ModuleName(id);
      ASSERT_TRUE(w.Release(id, **stream).ok());
    }
    auto stats = w.EndPrefill();
    ASSERT_TRUE(stats.ok()) << stats.status();
    EXPECT_EQ(stats->bytes_streamed, static_cast<int64_t>(w.bytes_per_pass()));
  }
  ASSERT_TRUE(w.SetLoadedExperts(nullptr).ok());
  EXPECT_EQ(w.loaded_experts_per_layer(), e);
  EXPECT_EQ(w.bytes_per_pass(), full_pass);
  StreamingStats stats;
  const PrefillResult after = rig->Run(prompt, &stats);
  EXPECT_EQ(after.logits, before.logits);
  EXPECT_EQ(after.kv, before.kv);
  EXPECT_EQ(stats.bytes_streamed, static_cast<int64_t>(full_pass));
}

// With a bandwidth cap the copies take measurable time; the stats account for them (speed is
// not asserted: docs/PERFORMANCE.md reports the overlap, measured with hmoe-slp-bench).
TEST(StreamingWeightsTest, StatsAccountForCappedCopies) {
  Model& model = Tiny();
  CpuDeviceOptions capped;
  capped.copy_bytes_per_second = 2e9;
  auto rig = SlpRig::Make(model, {.ring_slots = 4, .budget_bytes = 4 << 20}, {}, capped);
  ASSERT_NE(rig, nullptr);
  StreamingStats stats;
  ASSERT_FALSE(rig->Run(Prompt(), &stats).logits.empty());
  const double min_copy_seconds = static_cast<double>(rig->weights->bytes_per_pass()) / 2e9;
  EXPECT_GE(stats.copy_seconds, 0.9 * min_copy_seconds);
  EXPECT_GE(stats.wall_seconds, stats.load_wait_seconds);
  EXPECT_GE(stats.hidden_fraction(), 0.0);
  EXPECT_LE(stats.hidden_fraction(), 1.0);
}

}  // namespace
}  // namespace hmoe::engine_test
