// The decode scheduler against a deterministic fake engine: continuous batching, chunked prefill
// interleaved with decode, dual-batch overlap, KV admission control, cancellation, stops, KV
// hand-off import, validation and shutdown. Label "threads": also run under TSan.

#include "decode_worker/scheduler.h"

#include <unistd.h>

#include <algorithm>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <variant>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include <gtest/gtest.h>

#include "common/kv_handoff/kv_handoff.h"
#include "decode_worker/step_runner.h"
#include "tests/decode_worker/fake_step_engine.h"

namespace hmoe::decode {
namespace {

using ::hmoe::decode::testing::FakeGreedy;
using ::hmoe::decode::testing::FakeOptions;
using ::hmoe::decode::testing::FakeStepEngine;

// Everything one request produced.
struct Outcome {
  std::vector<int32_t> tokens;
  std::vector<int32_t> indices;
  bool kv_imported = false;
  bool kv_imported_first = false;
  std::optional<FinishEvent> finish;
};

Outcome Collect(RequestChannel& channel, absl::Duration timeout = absl::Seconds(30)) {
  Outcome out;
  const absl::Time deadline = absl::Now() + timeout;
  bool first = true;
  while (!out.finish.has_value()) {
    std::optional<RequestEvent> e = channel.Pop(deadline);
    if (!e.has_value()) {
      ADD_FAILURE() << "no finish event before the deadline";
      return out;
    }
    if (auto* t = std::get_if<TokenEvent>(&*e)) {
      out.tokens.push_back(t->token);
      out.indices.push_back(t->index);
    } else if (std::holds_alternative<KvImportedEvent>(*e)) {
      out.kv_imported = true;
      out.kv_imported_first = first;
    } else {
      out.finish = std::get<FinishEvent>(*e);
    }
    first = false;
  }
  return out;
}

std::vector<int32_t> Prompt(int n, int seed, int64_t vocab = 97) {
  std::vector<int32_t> p;
  for (int i = 0; i < n; ++i) p.push_back(static_cast<int32_t>((seed * 31 + i * 7 + 3) % vocab));
  return p;
}

GenerationRequest Greedy(std::string id, std::vector<int32_t> prompt, int max_new) {
  GenerationRequest r;
  r.id = std::move(id);
  r.prompt = std::move(prompt);
  r.sampling.max_new_tokens = max_new;
  r.sampling.ignore_eos = true;
  return r;
}

// The fake's steps hold 64 tokens: chunks of 8 plus a batch of up to 6 fit. One prefill chunk
// per step, so the steps do not depend on the fake's step times (the packing tests set
// prefills_per_step and the policy).
SchedulerOptions SmallChunks() {
  SchedulerOptions o;
  o.chunk_size = 8;
  o.prefills_per_step = 1;
  return o;
}

std::unique_ptr<Scheduler> MakeScheduler(FakeStepEngine& engine, SchedulerOptions options) {
  absl::StatusOr<std::unique_ptr<Scheduler>> s = Scheduler::Create(engine, options);
  EXPECT_TRUE(s.ok()) << s.status();
  return s.ok() ? *std::move(s) : nullptr;
}

// ------------------------------------------------------------------------- batching, dual batch

class SchedulerModeTest : public ::testing::TestWithParam<bool> {};

TEST_P(SchedulerModeTest, MixedBatchOfSixMatchesGreedyReference) {
  FakeStepEngine engine;
  SchedulerOptions options = SmallChunks();
  options.batch_size = 6;
  options.chunk_size = 8;
  options.dual_batch = GetParam();
  std::unique_ptr<Scheduler> scheduler = MakeScheduler(engine, options);
  ASSERT_NE(scheduler, nullptr);

  const std::vector<int> prompt_lengths = {1, 5, 8, 9, 17, 30};
  const std::vector<int> max_new = {12, 3, 20, 7, 16, 9};
  std::vector<std::shared_ptr<RequestChannel>> channels;
  // Hold the engine so all six join the batch together.
  engine.HoldSteps();
  for (size_t i = 0; i < prompt_lengths.size(); ++i) {
    auto ch = scheduler->Submit(
        Greedy(absl::StrCat("r", i), Prompt(prompt_lengths[i], static_cast<int>(i)), max_new[i]));
    ASSERT_TRUE(ch.ok()) << ch.status();
    channels.push_back(*ch);
  }
  engine.ReleaseSteps();
  for (size_t i = 0; i < channels.size(); ++i) {
    Outcome o = Collect(*channels[i]);
    ASSERT_TRUE(o.finish.has_value());
    EXPECT_EQ(o.finish->reason, FinishReason::kLength) << o.finish->error;
    EXPECT_EQ(o.tokens, FakeGreedy(Prompt(prompt_lengths[i], static_cast<int>(i)), max_new[i],
                                   engine.vocab_size()))
        << "request " << i;
    EXPECT_EQ(o.finish->completion_tokens, max_new[i]);
    EXPECT_EQ(o.finish->prompt_tokens, prompt_lengths[i]);
    for (size_t k = 0; k < o.indices.size(); ++k) EXPECT_EQ(o.indices[k], static_cast<int>(k));
  }
  EXPECT_TRUE(scheduler->WaitIdle(absl::Now() + absl::Seconds(10)));
  const SchedulerStats stats = scheduler->stats();
  EXPECT_EQ(stats.requests_finished, 6);
  EXPECT_EQ(stats.kv_blocks_free, stats.kv_blocks_total);
  EXPECT_LE(stats.max_running_seen, 6);
  EXPECT_GE(stats.max_running_seen, 2);
  if (GetParam()) {
    EXPECT_GT(stats.dual_steps, 0);
  } else {
    EXPECT_EQ(stats.dual_steps, 0);
  }
  scheduler.reset();
  EXPECT_TRUE(engine.errors().empty()) << engine.errors().front();
}

TEST_P(SchedulerModeTest, SeededSamplingIsTheSameWithAndWithoutOtherRequests) {
  // A sampled request's tokens depend on its seed and its logits only, not on the batch.
  auto run = [&](bool with_others) {
    FakeStepEngine engine;
    SchedulerOptions options = SmallChunks();
    options.chunk_size = 4;
    options.dual_batch = GetParam();
    std::unique_ptr<Scheduler> scheduler = MakeScheduler(engine, options);
    GenerationRequest r = Greedy("sampled", Prompt(10, 3), 15);
    r.sampling.temperature = 5.0f;  // the fake's logits are 0..10: a wide distribution
    r.sampling.seed = 1234;
    engine.HoldSteps();
    auto ch = scheduler->Submit(std::move(r));
    EXPECT_TRUE(ch.ok());
    std::vector<std::shared_ptr<RequestChannel>> others;
    if (with_others) {
      for (int i = 0; i < 4; ++i) {
        others.push_back(*scheduler->Submit(Greedy(absl::StrCat("o", i), Prompt(3 + i, i), 20)));
      }
    }
    engine.ReleaseSteps();
    for (auto& o : others) Collect(*o);
    return Collect(**ch).tokens;
  };
  const std::vector<int32_t> alone = run(false);
  EXPECT_EQ(alone.size(), 15u);
  EXPECT_EQ(run(true), alone);
  EXPECT_NE(alone, FakeGreedy(Prompt(10, 3), 15, 97)) << "temperature had no effect";
}

INSTANTIATE_TEST_SUITE_P(DualBatch, SchedulerModeTest, ::testing::Bool(),
                         [](const ::testing::TestParamInfo<bool>& info) {
                           return std::string(info.param ? "On" : "Off");
                         });

TEST(SchedulerTest, ChunkedPrefillInterleavesWithDecode) {
  FakeStepEngine engine;
  SchedulerOptions options = SmallChunks();
  options.chunk_size = 5;
  options.dual_batch = false;
  std::unique_ptr<Scheduler> scheduler = MakeScheduler(engine, options);
  // A short request decodes while a long prompt is prefilled in chunks of 5.
  engine.HoldSteps();
  auto a = scheduler->Submit(Greedy("short", Prompt(2, 1), 12));
  auto b = scheduler->Submit(Greedy("long", Prompt(23, 2), 4));
  ASSERT_TRUE(a.ok() && b.ok());
  engine.ReleaseSteps();
  Outcome oa = Collect(**a), ob = Collect(**b);
  EXPECT_EQ(oa.tokens, FakeGreedy(Prompt(2, 1), 12, 97));
  EXPECT_EQ(ob.tokens, FakeGreedy(Prompt(23, 2), 4, 97));

  // Step 1: the short prompt (2 tokens) alone (one chunk per step by default). Then the long
  // prompt's chunks 5,5,5,5,3 ride along with the short request's decode tokens.
  const std::vector<testing::StepRecord> steps = engine.steps();
  ASSERT_GE(steps.size(), 6u);
  EXPECT_EQ(steps[0].token_counts, (std::vector<int64_t>{2}));
  const std::vector<std::vector<int64_t>> want = {{1, 5}, {1, 5}, {1, 5}, {1, 5}, {1, 3}};
  for (size_t i = 0; i < want.size(); ++i) {
    EXPECT_EQ(steps[1 + i].token_counts, want[i]) << "step " << 1 + i;
  }
  int prefill_inputs = 0;
  for (const auto& s : steps) {
    int multi = 0;
    for (int64_t n : s.token_counts) {
      EXPECT_LE(n, 5);
      if (n > 1) ++multi;
    }
    EXPECT_LE(multi, 1) << "two prefill chunks in one step";
    prefill_inputs += multi;
  }
  EXPECT_EQ(prefill_inputs, 6);  // the short prompt's chunk and the long one's five
  EXPECT_EQ(scheduler->stats().prompt_tokens_prefilled, 25);
}

// Runs `prompts` (submitted in order while a blocker request holds the first step, so they all
// join the batch at the next step boundary) and returns the steps after the blocker's prefill.
// Packing is kAlways unless `cost` is given (then kAuto with that step cost).
std::vector<testing::StepRecord> StepsAfterBlocker(const std::vector<int>& prompts, int max_new,
                                                   int prefills_per_step,
                                                   std::optional<StepCost> cost = std::nullopt) {
  FakeStepEngine engine;
  SchedulerOptions options = SmallChunks();  // chunk 8
  options.prefills_per_step = prefills_per_step;
  options.packing = cost.has_value() ? PackingPolicy::kAuto : PackingPolicy::kAlways;
  options.fixed_step_cost = cost;
  options.batch_size = 6;
  options.dual_batch = false;
  std::unique_ptr<Scheduler> scheduler = MakeScheduler(engine, options);
  engine.HoldSteps();
  auto blocker = scheduler->Submit(Greedy("blocker", Prompt(8, 9), max_new + 8));
  EXPECT_TRUE(blocker.ok()) << blocker.status();
  while (engine.blocked_steps() == 0) absl::SleepFor(absl::Milliseconds(1));
  std::vector<std::shared_ptr<RequestChannel>> channels;
  for (size_t i = 0; i < prompts.size(); ++i) {
    auto ch = scheduler->Submit(
        Greedy(absl::StrCat("r", i), Prompt(prompts[i], static_cast<int>(i)), max_new));
    EXPECT_TRUE(ch.ok()) << ch.status();
    if (ch.ok()) channels.push_back(*ch);
  }
  engine.ReleaseSteps();
  for (size_t i = 0; i < channels.size(); ++i) {
    EXPECT_EQ(Collect(*channels[i]).tokens,
              FakeGreedy(Prompt(prompts[i], static_cast<int>(i)), max_new, 97))
        << "request " << i;
  }
  if (blocker.ok()) Collect(**blocker);
  std::vector<testing::StepRecord> steps = engine.steps();
  EXPECT_FALSE(steps.empty());
  if (!steps.empty()) {
    EXPECT_EQ(steps[0].token_counts, (std::vector<int64_t>{8}));
    steps.erase(steps.begin());
  }
  return steps;
}

TEST(SchedulerTest, OnePrefillPerStepTakesOneChunkPerStep) {
  const std::vector<testing::StepRecord> steps = StepsAfterBlocker({3, 4, 6, 1}, 3, 1);
  ASSERT_GE(steps.size(), 4u);
  EXPECT_EQ(steps[0].token_counts, (std::vector<int64_t>{1, 3}));
  EXPECT_EQ(steps[1].token_counts, (std::vector<int64_t>{1, 1, 4}));
  EXPECT_EQ(steps[2].token_counts, (std::vector<int64_t>{1, 1, 1, 6}));
  // r0 (3 new tokens) has finished; r3's 1-token prompt is the last input.
  EXPECT_EQ(steps[3].token_counts, (std::vector<int64_t>{1, 1, 1, 1}));
}

TEST(SchedulerTest, ShortPromptsShareAStepUpToOneChunkInFifoOrder) {
  // prefills_per_step 6. Prompts of 3, 4, 6 and 1 tokens, chunk 8: the first step after the
  // blocker takes 3 + 4; the 6 does not fit in the remaining 1 and ends the packing, so the 1
  // does not overtake it.
  const std::vector<testing::StepRecord> steps = StepsAfterBlocker({3, 4, 6, 1}, 3, 6);
  ASSERT_GE(steps.size(), 3u);
  EXPECT_EQ(steps[0].token_counts, (std::vector<int64_t>{1, 3, 4}));
  EXPECT_EQ(steps[1].token_counts, (std::vector<int64_t>{1, 1, 1, 6, 1}));
  EXPECT_EQ(steps[2].token_counts, (std::vector<int64_t>{1, 1, 1, 1, 1}));
  for (const auto& s : steps) {
    int64_t prefill = 0;
    for (size_t i = 1; i < s.token_counts.size(); ++i) {
      if (s.token_counts[i] > 1) prefill += s.token_counts[i];
    }
    EXPECT_LE(prefill, 8) << "more than one chunk of prompt tokens in a step";
  }
}

TEST(SchedulerTest, PromptChunksDoNotDependOnWhatSharesTheStep) {
  // prefills_per_step 6. Prompts of 3, 20 and 2 tokens, chunk 8. The 20-token prompt is always cut
  // 8, 8, 4 — never 5 to fill the step the 3-token prompt leaves. The 2-token prompt behind it
  // waits for one of its chunks, then has its turn (round robin of the first chunk).
  const std::vector<testing::StepRecord> steps = StepsAfterBlocker({3, 20, 2}, 2, 6);
  ASSERT_GE(steps.size(), 5u);
  EXPECT_EQ(steps[0].token_counts, (std::vector<int64_t>{1, 3}));
  EXPECT_EQ(steps[1].token_counts, (std::vector<int64_t>{1, 1, 8}));
  EXPECT_EQ(steps[2].token_counts, (std::vector<int64_t>{1, 2}));
  EXPECT_EQ(steps[3].token_counts, (std::vector<int64_t>{1, 8, 1}));
  EXPECT_EQ(steps[4].token_counts, (std::vector<int64_t>{1, 4}));
}

// Issue #16 finding 7: a short prompt that arrives while a long one is prefilled in chunks gets
// the next step's chunk instead of waiting for all of the long prompt's chunks; the long prompt
// then continues, cut the same way.
TEST(SchedulerTest, AShortPromptIsNotHeldBehindEveryChunkOfALongOne) {
  FakeStepEngine engine;
  SchedulerOptions options = SmallChunks();  // chunk 8
  options.dual_batch = false;
  options.packing = PackingPolicy::kAlways;
  std::unique_ptr<Scheduler> scheduler = MakeScheduler(engine, options);
  engine.HoldSteps();
  auto long_prompt = scheduler->Submit(Greedy("long", Prompt(40, 1), 3));
  ASSERT_TRUE(long_prompt.ok()) << long_prompt.status();
  // The long prompt's first chunk is in its step; the short prompt joins at the next boundary.
  while (engine.blocked_steps() == 0) absl::SleepFor(absl::Milliseconds(1));
  auto short_prompt = scheduler->Submit(Greedy("short", Prompt(2, 2), 3));
  ASSERT_TRUE(short_prompt.ok()) << short_prompt.status();
  engine.ReleaseSteps();
  EXPECT_EQ(Collect(**short_prompt).tokens, FakeGreedy(Prompt(2, 2), 3, 97));
  EXPECT_EQ(Collect(**long_prompt).tokens, FakeGreedy(Prompt(40, 1), 3, 97));
  const std::vector<testing::StepRecord> steps = engine.steps();
  ASSERT_GE(steps.size(), 6u);
  EXPECT_EQ(steps[0].token_counts, (std::vector<int64_t>{8}));
  // The short prompt's turn: its 2 tokens; the long prompt's next 8 would exceed the chunk.
  EXPECT_EQ(steps[1].token_counts, (std::vector<int64_t>{2}));
  // Then the long prompt's chunks, with the short request decoding alongside.
  EXPECT_EQ(steps[2].token_counts, (std::vector<int64_t>{8, 1}));
  EXPECT_EQ(steps[3].token_counts, (std::vector<int64_t>{8, 1}));
  int64_t long_tokens = 0;
  for (const auto& s : steps) {
    for (int64_t n : s.token_counts) long_tokens += n == 8 ? 8 : 0;
  }
  EXPECT_EQ(long_tokens, 40);  // 5 chunks of 8
}

TEST(SchedulerTest, AutoPackingPacksWhenAStepCostsItsWeightReads) {
  // Memory-bound: 10 ms a step, 1 us a token. The first step after the blocker carries the
  // blocker's decode and the 3 + 4 (1 * 1 * 2 < 10000, 2 * 1 * 3 < 10000), as kAlways would.
  const std::vector<testing::StepRecord> steps =
      StepsAfterBlocker({3, 4, 6, 1}, 3, 6, StepCost{.fixed_us = 10000, .per_token_us = 1});
  ASSERT_GE(steps.size(), 2u);
  EXPECT_EQ(steps[0].token_counts, (std::vector<int64_t>{1, 3, 4}));
  EXPECT_EQ(steps[1].token_counts, (std::vector<int64_t>{1, 1, 1, 6, 1}));
}

TEST(SchedulerTest, AutoPackingKeepsOneChunkPerStepWhenTokensCostMost) {
  // Compute-bound: 1 ms a step, 1 ms a token. Only the 1-token prompt joins a step beside an
  // older chunk (its n - 1 = 0 extra tokens delay nobody); the others get a step each.
  const std::vector<testing::StepRecord> steps =
      StepsAfterBlocker({3, 4, 6, 1}, 3, 6, StepCost{.fixed_us = 1000, .per_token_us = 1000});
  ASSERT_GE(steps.size(), 3u);
  EXPECT_EQ(steps[0].token_counts, (std::vector<int64_t>{1, 3}));
  EXPECT_EQ(steps[1].token_counts, (std::vector<int64_t>{1, 1, 4}));
  EXPECT_EQ(steps[2].token_counts, (std::vector<int64_t>{1, 1, 1, 6, 1}));
}

TEST(SchedulerTest, AutoPackingWaitsForAFit) {
  // kAuto with no fixed cost: the model has seen one step (the blocker's), too few to fit, so
  // nothing is packed yet.
  FakeStepEngine engine;
  SchedulerOptions options = SmallChunks();
  options.prefills_per_step = 6;
  options.packing = PackingPolicy::kAuto;
  options.dual_batch = false;
  std::unique_ptr<Scheduler> scheduler = MakeScheduler(engine, options);
  engine.HoldSteps();
  auto blocker = scheduler->Submit(Greedy("blocker", Prompt(8, 9), 2));
  ASSERT_TRUE(blocker.ok()) << blocker.status();
  while (engine.blocked_steps() == 0) absl::SleepFor(absl::Milliseconds(1));
  auto a = scheduler->Submit(Greedy("a", Prompt(2, 1), 1));
  auto b = scheduler->Submit(Greedy("b", Prompt(2, 2), 1));
  ASSERT_TRUE(a.ok() && b.ok());
  engine.ReleaseSteps();
  Collect(**a);
  Collect(**b);
  Collect(**blocker);
  const std::vector<testing::StepRecord> steps = engine.steps();
  ASSERT_GE(steps.size(), 3u);
  EXPECT_EQ(steps[1].token_counts, (std::vector<int64_t>{1, 2}));
  EXPECT_EQ(steps[2].token_counts, (std::vector<int64_t>{2}));
  EXPECT_EQ(scheduler->stats().packed_prefills, 0);
  EXPECT_FALSE(scheduler->stats().step_cost.has_value());
}

TEST(SchedulerTest, PrefillsPerStepBoundsThePacking) {
  // Three 2-token prompts fit one chunk of 8, but only two may share a step.
  const std::vector<testing::StepRecord> steps = StepsAfterBlocker({2, 2, 2}, 2, 2);
  ASSERT_GE(steps.size(), 2u);
  EXPECT_EQ(steps[0].token_counts, (std::vector<int64_t>{1, 2, 2}));
  EXPECT_EQ(steps[1].token_counts, (std::vector<int64_t>{1, 1, 1, 2}));
}

TEST(SchedulerTest, RunningBatchNeverExceedsBatchSize) {
  FakeStepEngine engine;
  SchedulerOptions options = SmallChunks();
  options.batch_size = 3;
  options.chunk_size = 4;
  std::unique_ptr<Scheduler> scheduler = MakeScheduler(engine, options);
  ASSERT_NE(scheduler, nullptr);
  std::vector<std::shared_ptr<RequestChannel>> channels;
  // Hold the engine while submitting: otherwise a submitting thread that loses the CPU lets the
  // early requests finish alone, and the batch never fills (seen once in CI on a loaded VM).
  engine.HoldSteps();
  for (int i = 0; i < 10; ++i) {
    auto ch = scheduler->Submit(Greedy(absl::StrCat("r", i), Prompt(3 + i, i), 5 + i));
    ASSERT_TRUE(ch.ok()) << ch.status();
    channels.push_back(*ch);
  }
  engine.ReleaseSteps();
  for (int i = 0; i < 10; ++i) {
    EXPECT_EQ(Collect(*channels[i]).tokens, FakeGreedy(Prompt(3 + i, i), 5 + i, 97));
  }
  for (const auto& s : engine.steps()) EXPECT_LE(s.token_counts.size(), 3u);
  EXPECT_LE(scheduler->stats().max_running_seen, 3);
  EXPECT_EQ(scheduler->stats().max_running_seen, 3);
}

TEST(SchedulerTest, KvAdmissionWaitsForBlocksInFifoOrder) {
  FakeOptions fo;
  fo.block_tokens = 4;
  fo.num_blocks = 10;  // 40 tokens: two requests of 5 + 15 = 20 tokens at a time
  FakeStepEngine engine(fo);
  SchedulerOptions options = SmallChunks();
  options.chunk_size = 8;
  std::unique_ptr<Scheduler> scheduler = MakeScheduler(engine, options);
  std::vector<std::shared_ptr<RequestChannel>> channels;
  for (int i = 0; i < 5; ++i) {
    auto ch = scheduler->Submit(Greedy(absl::StrCat("r", i), Prompt(5, i), 15));
    ASSERT_TRUE(ch.ok()) << ch.status();
    channels.push_back(*ch);
  }
  for (int i = 0; i < 5; ++i) {
    Outcome o = Collect(*channels[i]);
    EXPECT_EQ(o.tokens, FakeGreedy(Prompt(5, i), 15, 97));
  }
  EXPECT_LE(scheduler->stats().max_running_seen, 2);
  EXPECT_EQ(scheduler->stats().kv_blocks_free, 10);
  EXPECT_TRUE(engine.errors().empty());
}

TEST(SchedulerTest, RequestLargerThanThePoolIsResourceExhausted) {
  FakeOptions fo;
  fo.block_tokens = 4;
  fo.num_blocks = 4;  // 16 tokens
  FakeStepEngine engine(fo);
  std::unique_ptr<Scheduler> scheduler = MakeScheduler(engine, SmallChunks());
  auto ch = scheduler->Submit(Greedy("big", Prompt(10, 1), 7));
  EXPECT_TRUE(absl::IsResourceExhausted(ch.status())) << ch.status();
  EXPECT_NE(ch.status().message().find("kv cache"), std::string::npos) << ch.status();
  // Exactly the pool fits.
  auto ok = scheduler->Submit(Greedy("fits", Prompt(10, 1), 6));
  ASSERT_TRUE(ok.ok()) << ok.status();
  EXPECT_EQ(Collect(**ok).tokens.size(), 6u);
}

TEST(SchedulerTest, FullWaitingQueueIsResourceExhausted) {
  FakeStepEngine engine;
  SchedulerOptions options = SmallChunks();
  options.batch_size = 1;
  options.max_waiting = 2;
  std::unique_ptr<Scheduler> scheduler = MakeScheduler(engine, options);
  engine.HoldSteps();
  std::vector<std::shared_ptr<RequestChannel>> channels;
  // The first joins the batch (and blocks in the held step); two more wait.
  channels.push_back(*scheduler->Submit(Greedy("a", Prompt(3, 0), 2)));
  while (engine.blocked_steps() == 0) absl::SleepFor(absl::Milliseconds(1));
  channels.push_back(*scheduler->Submit(Greedy("b", Prompt(3, 1), 2)));
  channels.push_back(*scheduler->Submit(Greedy("c", Prompt(3, 2), 2)));
  auto d = scheduler->Submit(Greedy("d", Prompt(3, 3), 2));
  EXPECT_TRUE(absl::IsResourceExhausted(d.status())) << d.status();
  EXPECT_EQ(scheduler->stats().waiting, 2);
  engine.ReleaseSteps();
  for (auto& ch : channels) EXPECT_EQ(Collect(*ch).finish->reason, FinishReason::kLength);
}

// ------------------------------------------------------------------------- stops

TEST(SchedulerTest, StopTokenEndsTheRequestAndIsNotStreamed) {
  FakeStepEngine engine;
  std::unique_ptr<Scheduler> scheduler = MakeScheduler(engine, SmallChunks());
  const std::vector<int32_t> want = FakeGreedy(Prompt(6, 9), 20, 97);
  GenerationRequest r = Greedy("s", Prompt(6, 9), 20);
  r.sampling.stop_token_ids = {want[4]};
  const size_t first = std::find(want.begin(), want.end(), want[4]) - want.begin();
  auto ch = scheduler->Submit(std::move(r));
  ASSERT_TRUE(ch.ok());
  Outcome o = Collect(**ch);
  EXPECT_EQ(o.finish->reason, FinishReason::kStop);
  EXPECT_EQ(o.finish->stop_token, want[4]);
  EXPECT_EQ(o.tokens, std::vector<int32_t>(want.begin(), want.begin() + first));
  EXPECT_EQ(o.finish->completion_tokens, static_cast<int>(first) + 1);
}

TEST(SchedulerTest, EosEndsTheRequestUnlessIgnored) {
  const std::vector<int32_t> want = FakeGreedy(Prompt(4, 5), 10, 97);
  FakeOptions fo;
  fo.eos = {want[2]};
  FakeStepEngine engine(fo);
  std::unique_ptr<Scheduler> scheduler = MakeScheduler(engine, SmallChunks());
  GenerationRequest r = Greedy("e", Prompt(4, 5), 10);
  r.sampling.ignore_eos = false;
  auto ch = scheduler->Submit(std::move(r));
  ASSERT_TRUE(ch.ok());
  Outcome o = Collect(**ch);
  EXPECT_EQ(o.finish->reason, FinishReason::kEos);
  EXPECT_EQ(o.finish->stop_token, want[2]);
  const size_t first = std::find(want.begin(), want.end(), want[2]) - want.begin();
  EXPECT_EQ(o.tokens.size(), first);

  auto ignored = scheduler->Submit(Greedy("i", Prompt(4, 5), 10));  // ignore_eos
  ASSERT_TRUE(ignored.ok());
  Outcome oi = Collect(**ignored);
  EXPECT_EQ(oi.finish->reason, FinishReason::kLength);
  EXPECT_EQ(oi.tokens, want);
}

// ------------------------------------------------------------------------- cancel, errors

TEST(SchedulerTest, CancelFreesKvAtTheNextStepBoundary) {
  FakeStepEngine engine;
  SchedulerOptions options = SmallChunks();
  options.batch_size = 1;
  std::unique_ptr<Scheduler> scheduler = MakeScheduler(engine, options);
  engine.HoldSteps();
  auto running = scheduler->Submit(Greedy("run", Prompt(5, 1), 1000));
  ASSERT_TRUE(running.ok());
  while (engine.blocked_steps() == 0) absl::SleepFor(absl::Milliseconds(1));
  auto waiting = scheduler->Submit(Greedy("wait", Prompt(5, 2), 1000));
  ASSERT_TRUE(waiting.ok());
  EXPECT_LT(scheduler->stats().kv_blocks_free, scheduler->stats().kv_blocks_total);
  ASSERT_TRUE(scheduler->Cancel("wait", "client cancelled").ok());
  ASSERT_TRUE(scheduler->Cancel("run", "client cancelled").ok());
  EXPECT_TRUE(absl::IsNotFound(scheduler->Cancel("nope", "x")));
  engine.ReleaseSteps();
  Outcome r = Collect(**running), w = Collect(**waiting);
  EXPECT_EQ(r.finish->reason, FinishReason::kCancelled);
  EXPECT_EQ(w.finish->reason, FinishReason::kCancelled);
  EXPECT_TRUE(w.tokens.empty());
  EXPECT_LE(r.tokens.size(), 1u);  // at most the step that was running
  EXPECT_TRUE(scheduler->WaitIdle(absl::Now() + absl::Seconds(10)));
  EXPECT_EQ(scheduler->stats().kv_blocks_free, scheduler->stats().kv_blocks_total);
  EXPECT_EQ(scheduler->stats().requests_cancelled, 2);
  // The id can be used again.
  auto again = scheduler->Submit(Greedy("run", Prompt(5, 1), 3));
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_EQ(Collect(**again).tokens, FakeGreedy(Prompt(5, 1), 3, 97));
}

TEST(SchedulerTest, FailedStepFailsItsRequestsAndOthersContinue) {
  FakeStepEngine engine;
  SchedulerOptions options = SmallChunks();
  options.dual_batch = false;
  std::unique_ptr<Scheduler> scheduler = MakeScheduler(engine, options);
  auto good = scheduler->Submit(Greedy("good", Prompt(3, 1), 4));
  ASSERT_TRUE(good.ok());
  EXPECT_EQ(Collect(**good).finish->reason, FinishReason::kLength);
  engine.FailOnToken(Prompt(3, 2)[0]);
  auto bad = scheduler->Submit(Greedy("bad", Prompt(3, 2), 4));
  ASSERT_TRUE(bad.ok());
  Outcome o = Collect(**bad);
  EXPECT_EQ(o.finish->reason, FinishReason::kError);
  EXPECT_TRUE(absl::IsInternal(o.finish->error)) << o.finish->error;
  engine.FailOnToken(-1);
  auto after = scheduler->Submit(Greedy("after", Prompt(3, 3), 4));
  ASSERT_TRUE(after.ok());
  EXPECT_EQ(Collect(**after).tokens, FakeGreedy(Prompt(3, 3), 4, 97));
  EXPECT_EQ(scheduler->stats().requests_failed, 1);
  EXPECT_EQ(scheduler->stats().kv_blocks_free, scheduler->stats().kv_blocks_total);
}

// ------------------------------------------------------------------------- validation

TEST(SchedulerTest, BadRequestsAreInvalidArgumentNamingTheField) {
  FakeOptions fo;
  fo.max_context = 64;
  FakeStepEngine engine(fo);
  std::unique_ptr<Scheduler> scheduler = MakeScheduler(engine, SmallChunks());
  struct Case {
    GenerationRequest request;
    std::string field;
  };
  std::vector<Case> cases;
  cases.push_back({Greedy("", Prompt(3, 1), 4), "request_id"});
  cases.push_back({Greedy("x", {}, 4), "prompt_token_ids"});
  cases.push_back({Greedy("x", {1, 2, 97}, 4), "prompt_token_ids[2]"});
  cases.push_back({Greedy("x", {1, -1}, 4), "prompt_token_ids[1]"});
  cases.push_back({Greedy("x", Prompt(60, 1), 5), "too long"});
  cases.push_back({Greedy("x", Prompt(3, 1), 0), "max_new_tokens"});
  GenerationRequest stop = Greedy("x", Prompt(3, 1), 4);
  stop.sampling.stop_token_ids = {5, 1000};
  cases.push_back({std::move(stop), "stop_token_ids[1]"});
  GenerationRequest temp = Greedy("x", Prompt(3, 1), 4);
  temp.sampling.temperature = -1;
  cases.push_back({std::move(temp), "temperature"});
  for (Case& c : cases) {
    auto ch = scheduler->Submit(std::move(c.request));
    EXPECT_TRUE(absl::IsInvalidArgument(ch.status())) << c.field << ": " << ch.status();
    EXPECT_NE(ch.status().message().find(c.field), std::string::npos)
        << "want \"" << c.field << "\" in: " << ch.status().message();
  }
  EXPECT_EQ(scheduler->stats().requests_finished, 0);
}

TEST(SchedulerTest, DuplicateIdIsAlreadyExistsAndDrainingIsUnavailable) {
  FakeStepEngine engine;
  std::unique_ptr<Scheduler> scheduler = MakeScheduler(engine, SmallChunks());
  engine.HoldSteps();
  auto a = scheduler->Submit(Greedy("same", Prompt(3, 1), 2));
  ASSERT_TRUE(a.ok());
  EXPECT_TRUE(absl::IsAlreadyExists(scheduler->Submit(Greedy("same", Prompt(3, 1), 2)).status()));
  scheduler->StopAccepting();
  EXPECT_TRUE(absl::IsUnavailable(scheduler->Submit(Greedy("new", Prompt(3, 1), 2)).status()));
  EXPECT_TRUE(scheduler->stats().draining);
  engine.ReleaseSteps();
  // Draining finishes what was admitted.
  EXPECT_EQ(Collect(**a).finish->reason, FinishReason::kLength);
  EXPECT_TRUE(scheduler->WaitIdle(absl::Now() + absl::Seconds(10)));
}

TEST(SchedulerTest, ShutdownCancelsInFlightRequests) {
  FakeStepEngine engine;
  SchedulerOptions options = SmallChunks();
  options.batch_size = 1;
  std::unique_ptr<Scheduler> scheduler = MakeScheduler(engine, options);
  engine.HoldSteps();
  auto a = scheduler->Submit(Greedy("a", Prompt(3, 1), 1000));
  auto b = scheduler->Submit(Greedy("b", Prompt(3, 2), 1000));
  ASSERT_TRUE(a.ok() && b.ok());
  while (engine.blocked_steps() == 0) absl::SleepFor(absl::Milliseconds(1));
  std::thread shutdown([&] { scheduler->Shutdown(); });
  while (!scheduler->stats().draining) absl::SleepFor(absl::Milliseconds(1));
  engine.ReleaseSteps();
  shutdown.join();
  Outcome oa = Collect(**a), ob = Collect(**b);
  EXPECT_EQ(oa.finish->reason, FinishReason::kCancelled);
  EXPECT_EQ(ob.finish->reason, FinishReason::kCancelled);
  EXPECT_NE(oa.finish->error.message().find("shutting down"), std::string::npos);
  EXPECT_EQ(engine.kv_blocks_free(), engine.kv_blocks_total());
  EXPECT_TRUE(absl::IsUnavailable(scheduler->Submit(Greedy("c", Prompt(3, 1), 2)).status()));
}

TEST(SchedulerTest, BadOptionsAreInvalidArgument) {
  FakeStepEngine engine;  // 64 tokens, 8 sequences per step
  SchedulerOptions o;
  o.batch_size = 0;
  EXPECT_TRUE(absl::IsInvalidArgument(Scheduler::Create(engine, o).status()));
  o.batch_size = 9;
  EXPECT_TRUE(absl::IsInvalidArgument(Scheduler::Create(engine, o).status()));
  o.batch_size = 6;
  o.chunk_size = 59;  // 59 + 6 > 64
  EXPECT_TRUE(absl::IsInvalidArgument(Scheduler::Create(engine, o).status()));
  o.chunk_size = 58;
  o.prefills_per_step = 0;
  absl::Status s = Scheduler::Create(engine, o).status();
  EXPECT_TRUE(absl::IsInvalidArgument(s)) << s;
  EXPECT_TRUE(absl::StrContains(s.message(), "prefills per step")) << s;
  o.prefills_per_step = 1;
  EXPECT_TRUE(Scheduler::Create(engine, o).ok());
}

// ------------------------------------------------------------------------- KV hand-off

class KvImportTest : public ::testing::Test {
 protected:
  std::string Name(const std::string& tag) {
    return absl::StrCat("hmoe-test-kv-", ::getpid(), "-", tag);
  }
  void TearDown() override {
    for (const std::string& n : names_) (void)KvHandoffSegment::Remove(n);
  }
  // A hand-off segment of the fake's shape holding `tokens`.
  std::string Write(const std::string& tag, const std::vector<int32_t>& tokens,
                    const KvHandoffShape& shape) {
    const std::string name = Name(tag);
    absl::StatusOr<KvHandoffSegment> seg =
        KvHandoffSegment::Create(name, shape, static_cast<int64_t>(tokens.size()));
    EXPECT_TRUE(seg.ok()) << seg.status();
    if (!seg.ok()) return name;
    names_.push_back(name);
    auto* values = reinterpret_cast<float*>(seg->payload().data());
    for (size_t i = 0; i < tokens.size(); ++i) values[i] = static_cast<float>(tokens[i]);
    return name;
  }
  std::vector<std::string> names_;
};

TEST_F(KvImportTest, ImportedCacheContinuesLikeAPrefill) {
  FakeStepEngine engine;
  std::unique_ptr<Scheduler> scheduler = MakeScheduler(engine, SmallChunks());
  const std::vector<int32_t> prompt = Prompt(11, 4);
  const std::vector<int32_t> all = FakeGreedy(prompt, 8, 97);  // what a local prefill gives
  const std::string name = Write("a", prompt, engine.kv_handoff_shape());

  std::unique_ptr<KvImporter> importer = NewShmKvImporter();
  KvHandleSpec spec;
  spec.shm_name = name;
  spec.num_tokens = 11;
  spec.layout_version = kKvHandoffLayoutVersion;
  absl::StatusOr<std::unique_ptr<KvImportSource>> source =
      importer->Open(spec, engine.kv_handoff_shape());
  ASSERT_TRUE(source.ok()) << source.status();
  GenerationRequest r;
  r.id = "kv";
  r.kv = *std::move(source);
  r.kv_num_tokens = 11;
  r.first_token = all[0];
  r.sampling.max_new_tokens = 8;
  r.sampling.ignore_eos = true;
  auto ch = scheduler->Submit(std::move(r));
  ASSERT_TRUE(ch.ok()) << ch.status();
  Outcome o = Collect(**ch);
  EXPECT_TRUE(o.kv_imported);
  EXPECT_TRUE(o.kv_imported_first);
  EXPECT_EQ(o.finish->reason, FinishReason::kLength);
  // The first token is not streamed again; the rest continue exactly as after a local prefill.
  EXPECT_EQ(o.tokens, std::vector<int32_t>(all.begin() + 1, all.end()));
  EXPECT_EQ(o.indices.front(), 1);
  EXPECT_EQ(o.finish->completion_tokens, 8);
  EXPECT_EQ(o.finish->imported_tokens, 11);
  EXPECT_EQ(scheduler->stats().kv_tokens_imported, 11);
  EXPECT_EQ(scheduler->stats().prompt_tokens_prefilled, 0);
}

TEST_F(KvImportTest, FirstTokenThatStopsFinishesAtOnce) {
  FakeStepEngine engine;
  std::unique_ptr<Scheduler> scheduler = MakeScheduler(engine, SmallChunks());
  const std::string name = Write("b", Prompt(4, 1), engine.kv_handoff_shape());
  KvHandleSpec spec;
  spec.shm_name = name;
  spec.num_tokens = 4;
  spec.layout_version = kKvHandoffLayoutVersion;
  auto source = NewShmKvImporter()->Open(spec, engine.kv_handoff_shape());
  ASSERT_TRUE(source.ok()) << source.status();
  GenerationRequest r;
  r.id = "kv1";
  r.kv = *std::move(source);
  r.kv_num_tokens = 4;
  r.first_token = 7;
  r.sampling.max_new_tokens = 1;
  auto ch = scheduler->Submit(std::move(r));
  ASSERT_TRUE(ch.ok());
  Outcome o = Collect(**ch);
  EXPECT_TRUE(o.kv_imported);
  EXPECT_TRUE(o.tokens.empty());
  EXPECT_EQ(o.finish->reason, FinishReason::kLength);
  EXPECT_EQ(o.finish->completion_tokens, 1);
  EXPECT_TRUE(engine.steps().empty());
}

// ------------------------------------------------------------------------- step runner

TEST(StepRunnerTest, BalancedSplitKeepsOrderAndBalancesTokens) {
  EXPECT_EQ(BalancedSplit(std::vector<int64_t>{1, 1}), 1u);
  EXPECT_EQ(BalancedSplit(std::vector<int64_t>{1, 1, 1, 1, 1, 1}), 3u);
  EXPECT_EQ(BalancedSplit(std::vector<int64_t>{1, 1, 1, 1, 1}), 2u);  // tie: earlier split
  EXPECT_EQ(BalancedSplit(std::vector<int64_t>{512, 1, 1, 1}), 1u);
  EXPECT_EQ(BalancedSplit(std::vector<int64_t>{1, 1, 1, 8, 1}), 3u);
}

TEST(StepRunnerTest, DualBatchOverlapsOneBatchsMoeWithTheOthersAttention) {
  FakeOptions fo;
  fo.num_layers = 4;
  FakeStepEngine engine(fo);
  engine.EnableOverlapProbe();
  absl::StatusOr<std::unique_ptr<StepRunner>> runner = StepRunner::Create(engine, true);
  ASSERT_TRUE(runner.ok());
  std::vector<std::unique_ptr<StepSequence>> seqs;
  std::vector<int32_t> tokens = {1, 2, 3, 4};
  std::vector<StepInput> inputs;
  for (int i = 0; i < 4; ++i) {
    seqs.push_back(*engine.NewSequence(16));
    inputs.push_back(StepInput{seqs.back().get(), std::span<const int32_t>(&tokens[i], 1), true});
  }
  std::vector<StepResult> results = (*runner)->Run(inputs);
  ASSERT_EQ(results.size(), 4u);
  for (int i = 0; i < 4; ++i) {
    ASSERT_TRUE(results[i].status.ok()) << results[i].status;
    EXPECT_EQ(results[i].logits, testing::FakeLogits(std::vector<int32_t>{tokens[i]}, 97));
  }
  EXPECT_TRUE((*runner)->last_split().dual);
  EXPECT_EQ((*runner)->last_split().first_batch_inputs, 2u);
  // Micro-batch A's RunFfn(l) saw B enter RunAttention(l), for every layer: they overlapped.
  EXPECT_EQ(engine.probe_timeouts(), 0);
  EXPECT_GE(engine.overlaps_observed(), 4);
  EXPECT_TRUE(engine.errors().empty()) << engine.errors().front();
}

TEST(StepRunnerTest, ErrorInOneMicroBatchLeavesTheOtherCommitted) {
  FakeStepEngine engine;
  absl::StatusOr<std::unique_ptr<StepRunner>> runner = StepRunner::Create(engine, true);
  ASSERT_TRUE(runner.ok());
  engine.FailOnToken(50);
  auto s0 = *engine.NewSequence(8);
  auto s1 = *engine.NewSequence(8);
  const std::vector<int32_t> t0 = {3}, t1 = {50};
  std::vector<StepInput> inputs = {{s0.get(), t0, true}, {s1.get(), t1, true}};
  std::vector<StepResult> results = (*runner)->Run(inputs);
  ASSERT_EQ(results.size(), 2u);
  EXPECT_TRUE(results[0].status.ok());
  EXPECT_TRUE(absl::IsInternal(results[1].status));
  EXPECT_EQ(s0->num_tokens(), 1);
  EXPECT_EQ(s1->num_tokens(), 0);
}

TEST(StepRunnerTest, SingleInputRunsAsOneBatchEvenWithDualOn) {
  FakeStepEngine engine;
  auto runner = StepRunner::Create(engine, true);
  ASSERT_TRUE(runner.ok());
  auto s0 = *engine.NewSequence(8);
  const std::vector<int32_t> t0 = {3, 4, 5};
  std::vector<StepInput> inputs = {{s0.get(), t0, false}};
  std::vector<StepResult> results = (*runner)->Run(inputs);
  ASSERT_TRUE(results[0].status.ok());
  EXPECT_TRUE(results[0].logits.empty());
  EXPECT_FALSE((*runner)->last_split().dual);
  EXPECT_EQ(s0->num_tokens(), 3);
}

}  // namespace
}  // namespace hmoe::decode
