// Tests where threads meet (label `threads`, also run under TSan): the dual-batch stepping API
// driven from two threads, and batched decode on the 2-thread pool.

#include <span>
#include <thread>
#include <vector>

#include <gtest/gtest.h>

#include "tests/engine/engine_test_util.h"

namespace hmoe::engine_test {
namespace {

TEST(EngineThreadsTest, BatchedDecodeEqualsEachSequenceAlone) {
  Model& model = Tiny();
  auto rig = Rig::Make(model);
  ASSERT_NE(rig, nullptr);
  const std::vector<std::vector<int32_t>> prompts = {
      RandomTokens(5, 10, 1000), RandomTokens(23, 11, 1000), RandomTokens(1, 12, 1000),
      RandomTokens(40, 13, 1000)};
  constexpr int kSteps = 4;
  const size_t count = prompts.size();

  // Alone: each sequence by itself, feeding fixed next tokens.
  std::vector<std::vector<std::vector<float>>> alone(count);
  for (size_t i = 0; i < count; ++i) {
    KvSequence seq = rig->cache->NewSequence();
    alone[i].push_back(rig->Run(seq, prompts[i]));
    for (int s = 0; s < kSteps; ++s) {
      const int32_t next = static_cast<int32_t>((i * 31 + s * 7) % 1000);
      alone[i].push_back(rig->Run(seq, std::span<const int32_t>(&next, 1)));
    }
  }
  // Batched: prefill together, then decode steps of all sequences together.
  std::vector<KvSequence> seqs;
  for (size_t i = 0; i < count; ++i) seqs.push_back(rig->cache->NewSequence());
  std::vector<SequenceInput> inputs;
  for (size_t i = 0; i < count; ++i) inputs.push_back({&seqs[i], prompts[i], true});
  auto out = rig->engine->Forward(inputs);
  ASSERT_TRUE(out.ok()) << out.status();
  for (size_t i = 0; i < count; ++i) {  // bitwise, as below
    EXPECT_EQ(MaxAbsDiff((*out)[i], alone[i][0]), 0.0) << "prefill of sequence " << i;
  }
  std::vector<int32_t> next(count);
  for (int s = 0; s < kSteps; ++s) {
    inputs.clear();
    for (size_t i = 0; i < count; ++i) {
      next[i] = static_cast<int32_t>((i * 31 + s * 7) % 1000);
      inputs.push_back({&seqs[i], std::span<const int32_t>(&next[i], 1), true});
    }
    out = rig->engine->Forward(inputs);
    ASSERT_TRUE(out.ok()) << out.status();
    for (size_t i = 0; i < count; ++i) {
      // Bitwise: a token's results do not depend on the other sequences of its step (batch
      // invariance; EngineTest.SequenceResultsDoNotDependOnTheOtherSequencesOfTheStep).
      EXPECT_EQ(MaxAbsDiff((*out)[i], alone[i][s + 1]), 0.0) << "step " << s << " seq " << i;
    }
  }
}

// Dual-batch stepping: micro-batch A's attention runs on one thread while B's FFN runs on
// another (then the roles swap), as the decode worker does; results equal sequential runs.
TEST(EngineThreadsTest, DualBatchOverlapEqualsSequential) {
  Model& model = Tiny();
  auto rig = Rig::Make(model);
  ASSERT_NE(rig, nullptr);
  const int64_t layers = model.checkpoint->config().num_hidden_layers;
  const std::vector<int32_t> pa = RandomTokens(6, 20, 1000);
  const std::vector<int32_t> pb = RandomTokens(9, 21, 1000);

  KvSequence sa = rig->cache->NewSequence();
  KvSequence sb = rig->cache->NewSequence();
  const std::vector<float> want_a = rig->Run(sa, pa);
  const std::vector<float> want_b = rig->Run(sb, pb);
  const int32_t ta = 7, tb = 8;
  const std::vector<float> want_a2 = rig->Run(sa, std::span<const int32_t>(&ta, 1));
  const std::vector<float> want_b2 = rig->Run(sb, std::span<const int32_t>(&tb, 1));

  KvSequence ca = rig->cache->NewSequence();
  KvSequence cb = rig->cache->NewSequence();
  auto ma = rig->engine->NewMicroBatch();
  auto mb = rig->engine->NewMicroBatch();
  ASSERT_TRUE(ma.ok() && mb.ok());
  for (int round = 0; round < 2; ++round) {
    std::vector<int32_t> a_tokens = round == 0 ? pa : std::vector<int32_t>{ta};
    std::vector<int32_t> b_tokens = round == 0 ? pb : std::vector<int32_t>{tb};
    SequenceInput ia{&ca, a_tokens, true};
    SequenceInput ib{&cb, b_tokens, true};
    ASSERT_TRUE((*ma)->BeginStep(std::span<const SequenceInput>(&ia, 1)).ok());
    ASSERT_TRUE((*mb)->BeginStep(std::span<const SequenceInput>(&ib, 1)).ok());
    // Pipeline: A.attn(l) || B.ffn(l-1), then A.ffn(l) || B.attn(l).
    absl::Status sa_status, sb_status;
    ASSERT_TRUE((*ma)->RunAttention(0).ok());
    for (int64_t l = 0; l < layers; ++l) {
      std::thread other([&] { sb_status = (*mb)->RunAttention(l); });
      sa_status = (*ma)->RunFfn(l);
      other.join();
      ASSERT_TRUE(sa_status.ok()) << sa_status;
      ASSERT_TRUE(sb_status.ok()) << sb_status;
      std::thread other2([&] { sb_status = (*mb)->RunFfn(l); });
      if (l + 1 < layers) sa_status = (*ma)->RunAttention(l + 1);
      other2.join();
      ASSERT_TRUE(sa_status.ok()) << sa_status;
      ASSERT_TRUE(sb_status.ok()) << sb_status;
    }
    auto la = (*ma)->FinishStep();
    auto lb = (*mb)->FinishStep();
    ASSERT_TRUE(la.ok() && lb.ok());
    EXPECT_EQ((*la)[0], round == 0 ? want_a : want_a2);
    EXPECT_EQ((*lb)[0], round == 0 ? want_b : want_b2);
  }
}

}  // namespace
}  // namespace hmoe::engine_test
