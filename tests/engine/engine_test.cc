// Tests of the optimized forward pass (common/engine) on the `tiny` checkpoint, against the FP32
// reference forward (common/engine/reference).
//
// Tolerance. The fast path rounds activations to BF16 at every FP8/BF16 linear layer (the kernels'
// contract) and computes attention, norms and softmax in F32. Every comparison with the reference
// uses its error model (docs/conformance.md "The error model and the tolerances"): each logit
// difference l[a] - l[b] of the engine must be within ReferenceModel::LogitPairTolerance (kappa =
// 6 standard deviations of the BF16 rounding error propagated through the layers) of the
// reference's (ExpectLastLogitsMatchReference for one position; the decode test for all pairs of
// 64 steps), and greedy tokens follow the token agreement rule of issue #8: with the reference's
// token fed back (teacher forcing), the engine's arg-max equals the reference's at every step,
// except where the reference's margin between the two is below that pair's tolerance. Engine
// paths that are bit-identical (chunking, batching, KV block size, device copies) are compared
// bitwise.
//
// Routing flips. Expert selection is discrete: when two experts (or, with group-limited routing,
// two groups) are nearly tied in the reference, the BF16 path may pick the other one, and that
// token's hidden state then differs by a whole expert's contribution. The decode test observes
// the engine's routing (EngineOptions::routing_observer); the reference follows it
// (ForwardTrace::follow_routing) wherever it differs, and each such difference must be a near-tie
// of the reference under the score-gap rule; then every step's logits are checked against the
// error model's tolerance, none exempted (docs/conformance.md). ExpectLastLogitsMatchReference
// does the same for the single-position checks, with the routing the rig records.

#include "common/engine/engine.h"

#include <algorithm>
#include <cstring>
#include <filesystem>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include <gtest/gtest.h>

#include "tests/engine/engine_test_util.h"

namespace hmoe::engine_test {
namespace {

// ---------------------------------------------------------------------------------- tests

TEST(EngineTest, PrefillLogitsMatchReference) {
  Model& model = Tiny();
  auto rig = Rig::Make(model);
  ASSERT_NE(rig, nullptr);
  const std::vector<int32_t> prompt = RandomTokens(37, 1, 1000);
  KvSequence seq = rig->cache->NewSequence();
  const std::vector<float> got = rig->Run(seq, prompt);
  ExpectLastLogitsMatchReference(model, *rig, seq, prompt, got);
  EXPECT_EQ(seq.num_tokens(), 37);
}

TEST(EngineTest, DecodeLogitsAndGreedyTokensMatchReference) {
  Model& model = Tiny();
  const ModelConfig& config = model.checkpoint->config();
  // The engine's routing of every position, recorded through the observer.
  std::vector<std::vector<std::vector<int32_t>>> engine_routing(config.num_hidden_layers);
  int64_t next_position = 0;
  EngineOptions options;
  options.routing_observer = [&](int64_t layer, int64_t n, int64_t top_k, const int32_t* ids) {
    for (int64_t t = 0; t < n; ++t) {
      std::vector<int32_t> set(ids + t * top_k, ids + (t + 1) * top_k);
      std::sort(set.begin(), set.end());
      const int64_t pos = next_position + t;
      if (static_cast<int64_t>(engine_routing[layer].size()) <= pos) {
        engine_routing[layer].resize(pos + 1);
      }
      engine_routing[layer][pos] = std::move(set);
    }
  };
  auto rig = Rig::Make(model, options);
  ASSERT_NE(rig, nullptr);
  const std::vector<int32_t> prompt = RandomTokens(12, 2, 1000);
  constexpr int kSteps = 64;
  // The reference's greedy tokens: the sequence both sides are fed (teacher forcing).
  auto ref_tokens = reference::GenerateGreedy(*model.reference, prompt, kSteps);
  ASSERT_TRUE(ref_tokens.ok()) << ref_tokens.status();
  std::vector<int32_t> sequence = prompt;
  sequence.insert(sequence.end(), ref_tokens->begin(), ref_tokens->end() - 1);

  // The engine: the prompt, then one token per step, with its routing and logits.
  KvSequence seq = rig->cache->NewSequence();
  std::vector<std::vector<float>> engine_logits = {rig->Run(seq, prompt)};
  next_position = static_cast<int64_t>(prompt.size());
  for (int step = 0; step + 1 < kSteps; ++step) {
    const int32_t next = (*ref_tokens)[step];
    engine_logits.push_back(rig->Run(seq, std::span<const int32_t>(&next, 1)));
    next_position = seq.num_tokens();
  }

  // The reference over the same sequence, following the engine's experts where they differ
  // (docs/conformance.md "Routing flips: the score-gap rule"): each such flip must be a near-tie.
  reference::ReferenceKvCache ref_cache = model.reference->NewCache();
  reference::ForwardTrace trace;
  trace.follow_routing = [&](int64_t l, int64_t p) -> const std::vector<int32_t>* {
    return &engine_routing[l][p];
  };
  auto ref_logits = model.reference->Forward(sequence, ref_cache, &trace);
  ASSERT_TRUE(ref_logits.ok()) << ref_logits.status();
  int flips = 0;
  for (int64_t l = 0; l < config.num_hidden_layers; ++l) {
    if (!config.is_moe_layer(l)) continue;
    for (size_t p = 0; p < sequence.size(); ++p) {
      const reference::MoeGateResult& g = trace.routing[l][p];
      if (!g.followed) continue;
      ++flips;
      EXPECT_LT(g.SelectionGap(), trace.gap_tolerance[l][p])
          << "position " << p << " layer " << l << ": the engine routed differently where the "
          << "reference has no near-tie";
    }
  }

  // Every step: the engine's logit differences within the error model's tolerance of the
  // reference's (docs/conformance.md "The error model and the tolerances"), and so the token
  // agreement rule: the engine's arg-max is the reference's, or the reference's margin between
  // the two is below the pair's tolerance.
  const int64_t vocab = config.vocab_size;
  double worst_ratio = 0.0;
  for (int step = 0; step < kSteps; ++step) {
    const int64_t row = static_cast<int64_t>(prompt.size()) - 1 + step;
    const float* r = ref_logits->data() + row * vocab;
    const std::vector<float>& e = engine_logits[step];
    const int32_t best = static_cast<int32_t>(std::max_element(r, r + vocab) - r);
    for (int32_t v = 0; v < vocab; ++v) {
      if (v == best) continue;
      const double d = (e[best] - e[v]) - (r[best] - r[v]);
      const double tol = model.reference->LogitPairTolerance(trace, row, best, v);
      worst_ratio = std::max(worst_ratio, std::abs(d) / tol);
      ASSERT_LT(std::abs(d), tol) << "step " << step << ", logits " << best << " - " << v;
    }
    const int32_t got = ArgMax(e);
    if (got != best) {
      EXPECT_LT(r[best] - r[got], model.reference->LogitPairTolerance(trace, row, best, got))
          << "step " << step << ": engine " << got << ", reference " << best;
    }
  }
  RecordProperty("routing_flips", flips);
  RecordProperty("worst_logit_pair_error_over_tolerance", absl::StrCat(worst_ratio));
}

TEST(EngineTest, ChunkedPrefillEqualsOnePrefill) {
  Model& model = Tiny();
  auto rig = Rig::Make(model);
  ASSERT_NE(rig, nullptr);
  const std::vector<int32_t> prompt = RandomTokens(45, 3, 1000);
  KvSequence whole = rig->cache->NewSequence();
  const std::vector<float> one = rig->Run(whole, prompt);
  KvSequence chunked = rig->cache->NewSequence();
  std::vector<float> last;
  for (size_t begin = 0; begin < prompt.size(); begin += 7) {
    const size_t n = std::min<size_t>(7, prompt.size() - begin);
    last = rig->Run(chunked, std::span<const int32_t>(prompt).subspan(begin, n));
  }
  // Bitwise: a token's results do not depend on how the prompt is chunked (the attention steps
  // by 16 keys whatever the chunk, the prefill GEMMs are exact copies of the one-token GEMV).
  EXPECT_EQ(MaxAbsDiff(last, one), 0.0);
  ExpectLastLogitsMatchReference(model, *rig, chunked, prompt, last);
  // The caches agree too: the next decode step gives the same logits.
  const int32_t next = 17;
  EXPECT_EQ(MaxAbsDiff(rig->Run(chunked, std::span<const int32_t>(&next, 1)),
                       rig->Run(whole, std::span<const int32_t>(&next, 1))),
            0.0);
}

// A sequence's logits do not depend on the other sequences of its step, bitwise, for every FP8
// kernel variant this CPU has: steps of fewer than grouped_moe_min_tokens tokens run the experts
// through MoeExecutor, larger ones through the grouped path, and both must add each token's
// expert outputs in the same order (a decode worker's greedy tokens would otherwise depend on
// its other requests and on dual-batch splitting).
TEST(EngineTest, SequenceResultsDoNotDependOnTheOtherSequencesOfTheStep) {
  Model& model = Tiny();
  int tested = 0;
  for (cpu::CpuIsa isa : {cpu::CpuIsa::kScalar, cpu::CpuIsa::kAvx2, cpu::CpuIsa::kAvx512,
                          cpu::CpuIsa::kAvx512Bf16, cpu::CpuIsa::kAmx}) {
    auto gemv = cpu::NewFp8Gemv(isa);
    if (!gemv.ok()) continue;  // not supported by this CPU
    ++tested;
    SCOPED_TRACE(cpu::CpuIsaName(isa));
    EngineOptions options;
    options.fp8_gemv = gemv->get();
    CpuDeviceOptions device_options;
    device_options.fp8_gemv = gemv->get();
    auto rig = Rig::Make(model, options, 64, 16, {}, device_options);
    ASSERT_NE(rig, nullptr);
    ASSERT_LT(10, options.grouped_moe_min_tokens);
    const std::vector<int32_t> prompt = RandomTokens(10, 21, 1000);
    const std::vector<int32_t> other = RandomTokens(20, 22, 1000);
    const int32_t next = 33;
    // Alone: 10 prompt tokens, then one decode token (both executor-sized steps).
    KvSequence alone = rig->cache->NewSequence();
    const std::vector<float> alone_prefill = rig->Run(alone, prompt);
    const std::vector<float> alone_decode = rig->Run(alone, std::span<const int32_t>(&next, 1));
    // Shared: the same inputs next to a 20-token prefill (grouped-path steps).
    KvSequence shared = rig->cache->NewSequence();
    KvSequence neighbour1 = rig->cache->NewSequence();
    KvSequence neighbour2 = rig->cache->NewSequence();
    std::vector<SequenceInput> step1 = {{&neighbour1, other, true}, {&shared, prompt, true}};
    auto out1 = rig->engine->Forward(step1);
    ASSERT_TRUE(out1.ok()) << out1.status();
    std::vector<SequenceInput> step2 = {{&shared, std::span<const int32_t>(&next, 1), true},
                                        {&neighbour2, other, false}};
    auto out2 = rig->engine->Forward(step2);
    ASSERT_TRUE(out2.ok()) << out2.status();
    // A decode step shared with four other decoding sequences (attention groups several
    // sequences' query rows).
    const int32_t next2 = 34;
    const std::vector<float> alone_decode2 = rig->Run(alone, std::span<const int32_t>(&next2, 1));
    KvSequence neighbour3 = rig->cache->NewSequence();
    KvSequence neighbour4 = rig->cache->NewSequence();
    ASSERT_FALSE(rig->Run(neighbour3, other).empty());
    ASSERT_FALSE(rig->Run(neighbour4, prompt).empty());
    const int32_t others[4] = {1, 2, 3, 4};
    std::vector<SequenceInput> step3 = {
        {&neighbour1, std::span<const int32_t>(&others[0], 1), true},
        {&neighbour2, std::span<const int32_t>(&others[1], 1), true},
        {&shared, std::span<const int32_t>(&next2, 1), true},
        {&neighbour3, std::span<const int32_t>(&others[2], 1), true},
        {&neighbour4, std::span<const int32_t>(&others[3], 1), true}};
    auto out3 = rig->engine->Forward(step3);
    ASSERT_TRUE(out3.ok()) << out3.status();
    ASSERT_EQ((*out1)[1].size(), alone_prefill.size());
    ASSERT_EQ((*out2)[0].size(), alone_decode.size());
    ASSERT_EQ((*out3)[2].size(), alone_decode2.size());
    EXPECT_EQ(0, std::memcmp((*out3)[2].data(), alone_decode2.data(),
                             alone_decode2.size() * sizeof(float)))
        << "grouped decode logits differ, max abs diff " << MaxAbsDiff((*out3)[2], alone_decode2);
    EXPECT_EQ(0, std::memcmp((*out1)[1].data(), alone_prefill.data(),
                             alone_prefill.size() * sizeof(float)))
        << "prefill logits differ, max abs diff " << MaxAbsDiff((*out1)[1], alone_prefill);
    EXPECT_EQ(
        0, std::memcmp((*out2)[0].data(), alone_decode.data(), alone_decode.size() * sizeof(float)))
        << "decode logits differ, max abs diff " << MaxAbsDiff((*out2)[0], alone_decode);
  }
  EXPECT_GE(tested, 1);
}

// The KV cache's block size is a storage detail: the same prompt gives bitwise the same logits
// and KV in caches of 16- and 64-token blocks (the SLP prefill worker's cache and a decode
// worker's differ; the hand-off is checked bitwise against the resident engine). Attention must
// not step its online softmax by cache block.
TEST(EngineTest, ResultsDoNotDependOnTheKvBlockSize) {
  Model& model = Tiny();
  const std::vector<int32_t> prompt = RandomTokens(45, 3, 1000);
  const int32_t next = 17;
  std::vector<std::vector<float>> logits;
  std::vector<std::vector<std::byte>> kv;
  for (int64_t block_size : {16, 64, 7}) {
    auto rig = Rig::Make(model, {}, 1024 / block_size, block_size);
    ASSERT_NE(rig, nullptr);
    KvSequence seq = rig->cache->NewSequence();
    std::vector<float> l = rig->Run(seq, prompt);
    const std::vector<float> d = rig->Run(seq, std::span<const int32_t>(&next, 1));
    l.insert(l.end(), d.begin(), d.end());
    logits.push_back(l);
    std::vector<std::byte> bytes(rig->cache->ExportBytes(seq.num_tokens()));
    auto stream = rig->device->CreateStream();
    ASSERT_TRUE(stream.ok());
    ASSERT_TRUE(rig->cache->Export(seq, **stream, bytes.data(), MemorySpace::kHost).ok());
    kv.push_back(std::move(bytes));
  }
  for (size_t i = 1; i < logits.size(); ++i) {
    ASSERT_EQ(logits[i].size(), logits[0].size());
    EXPECT_EQ(0, std::memcmp(logits[i].data(), logits[0].data(), logits[0].size() * 4))
        << "case " << i << ", max abs diff " << MaxAbsDiff(logits[i], logits[0]);
    EXPECT_TRUE(kv[i] == kv[0]) << "case " << i;
  }
}

TEST(EngineTest, LongPromptIsSplitIntoStepsWithBoundedScratch) {
  Model& model = Tiny();
  EngineOptions options;
  options.max_step_tokens = 16;  // the 70-token prompt becomes five steps
  auto rig = Rig::Make(model, options);
  ASSERT_NE(rig, nullptr);
  const std::vector<int32_t> prompt = RandomTokens(70, 4, 1000);
  KvSequence seq = rig->cache->NewSequence();
  const size_t before = rig->device->bytes_in_use();
  const std::vector<float> got = rig->Run(seq, prompt);
  ExpectLastLogitsMatchReference(model, *rig, seq, prompt, got);
  EXPECT_EQ(seq.num_tokens(), 70);
  // The step scratch was allocated once (first Forward) and does not depend on the prompt.
  const size_t after_first = rig->device->bytes_in_use();
  KvSequence seq2 = rig->cache->NewSequence();
  rig->Run(seq2, RandomTokens(150, 5, 1000));
  EXPECT_EQ(rig->device->bytes_in_use(), after_first);
  EXPECT_GE(after_first, before);
}

TEST(EngineTest, KvExportImportRoundTrip) {
  Model& model = Tiny();
  auto rig = Rig::Make(model);
  ASSERT_NE(rig, nullptr);
  const std::vector<int32_t> prompt = RandomTokens(29, 6, 1000);
  KvSequence seq = rig->cache->NewSequence();
  rig->Run(seq, prompt);
  const size_t bytes = rig->cache->ExportBytes(seq.num_tokens());
  EXPECT_EQ(bytes, static_cast<size_t>(4 * 29 * (64 + 16) * 4));
  std::vector<std::byte> flat(bytes);
  auto stream = rig->device->CreateStream();
  ASSERT_TRUE(stream.ok());
  ASSERT_TRUE(rig->cache->Export(seq, **stream, flat.data(), MemorySpace::kHost).ok());

  // Import into a cache with another block size, on the same device (the engine's).
  auto other =
      KvCache::Create(*rig->device, KvCacheConfig::ForModel(model.checkpoint->config(), 16, 64));
  ASSERT_TRUE(other.ok()) << other.status();
  KvSequence imported = (*other)->NewSequence();
  ASSERT_TRUE((*other)->Import(imported, 29, **stream, flat.data(), MemorySpace::kHost).ok());
  EXPECT_EQ(imported.num_tokens(), 29);
  // Exporting the import gives the same bytes.
  std::vector<std::byte> again(bytes);
  ASSERT_TRUE((*other)->Export(imported, **stream, again.data(), MemorySpace::kHost).ok());
  EXPECT_EQ(flat, again);
  // Decoding from the import equals decoding from the original, and matches the reference.
  const int32_t next = 99;
  const std::vector<float> a = rig->Run(seq, std::span<const int32_t>(&next, 1));
  const std::vector<float> b = rig->Run(imported, std::span<const int32_t>(&next, 1));
  EXPECT_EQ(a, b);
  std::vector<int32_t> all = prompt;
  all.push_back(next);
  ExpectLastLogitsMatchReference(model, *rig, seq, all, a);  // = b, bitwise
  // Import into a non-empty sequence is refused.
  EXPECT_EQ((*other)->Import(imported, 29, **stream, flat.data(), MemorySpace::kHost).code(),
            absl::StatusCode::kFailedPrecondition);
}

TEST(EngineTest, KvCacheExhaustionFailsCleanly) {
  Model& model = Tiny();
  auto rig = Rig::Make(model, {}, /*num_blocks=*/4, /*block_size=*/16);
  ASSERT_NE(rig, nullptr);
  KvSequence a = rig->cache->NewSequence();
  KvSequence b = rig->cache->NewSequence();
  rig->Run(a, RandomTokens(40, 7, 1000));  // 3 blocks
  EXPECT_EQ(rig->cache->num_free_blocks(), 1);
  const std::vector<int32_t> long_prompt = RandomTokens(20, 8, 1000);  // needs 2 blocks
  const int32_t one = 5;
  std::vector<SequenceInput> inputs = {{&a, std::span<const int32_t>(&one, 1), true},
                                       {&b, long_prompt, true}};
  auto out = rig->engine->Forward(inputs);
  EXPECT_EQ(out.status().code(), absl::StatusCode::kResourceExhausted) << out.status();
  // Nothing changed: the free block is still free and `a` still has 40 tokens.
  EXPECT_EQ(rig->cache->num_free_blocks(), 1);
  EXPECT_EQ(a.num_tokens(), 40);
  EXPECT_EQ(b.num_tokens(), 0);
  // Freeing a sequence returns its blocks.
  a.Reset();
  EXPECT_EQ(rig->cache->num_free_blocks(), 4);
  EXPECT_FALSE(rig->Run(b, long_prompt).empty());
}

TEST(EngineTest, InvalidInputsAreRejected) {
  Model& model = Tiny();
  auto rig = Rig::Make(model);
  ASSERT_NE(rig, nullptr);
  KvSequence seq = rig->cache->NewSequence();
  const std::vector<int32_t> bad = {1, 5000};
  SequenceInput in{&seq, bad, true};
  EXPECT_EQ(rig->engine->Forward(std::span<const SequenceInput>(&in, 1)).status().code(),
            absl::StatusCode::kInvalidArgument);
  const std::vector<int32_t> ok = {1, 2};
  std::vector<SequenceInput> twice = {{&seq, ok, true}, {&seq, ok, true}};
  EXPECT_EQ(rig->engine->Forward(twice).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(seq.num_tokens(), 0);
  auto batch = rig->engine->NewMicroBatch();
  ASSERT_TRUE(batch.ok());
  EXPECT_EQ((*batch)->RunFfn(0).code(), absl::StatusCode::kFailedPrecondition);
}

TEST(EngineTest, ExpertsOnDeviceMatchReference) {
  Model& model = Tiny();
  EngineOptions options;
  options.experts = ExpertPlacement::kDevice;
  auto rig = Rig::Make(model, options);
  ASSERT_NE(rig, nullptr);
  const std::vector<int32_t> prompt = RandomTokens(21, 9, 1000);
  KvSequence seq = rig->cache->NewSequence();
  const std::vector<float> first = rig->Run(seq, prompt);
  ExpectLastLogitsMatchReference(model, *rig, seq, prompt, first);
  std::vector<int32_t> all = prompt;
  all.push_back(3);
  const std::vector<float> second = rig->Run(seq, std::span<const int32_t>(&all.back(), 1));
  ExpectLastLogitsMatchReference(model, *rig, seq, all, second);
}

TEST(EngineTest, DeviceCopiesUnderABudgetMatchInPlace) {
  Model& model = Tiny();
  ResidentWeightsOptions copy;
  copy.copy_to_device = true;
  CpuDeviceOptions budget;
  budget.budget_bytes = 64 << 20;
  auto rig = Rig::Make(model, {}, 64, 16, copy, budget);
  ASSERT_NE(rig, nullptr);
  EXPECT_GT(rig->weights->device_bytes(), 0u);
  auto in_place = Rig::Make(model);
  ASSERT_NE(in_place, nullptr);
  EXPECT_EQ(in_place->weights->device_bytes(), 0u);
  const std::vector<int32_t> prompt = RandomTokens(9, 14, 1000);
  KvSequence a = rig->cache->NewSequence();
  KvSequence b = in_place->cache->NewSequence();
  EXPECT_EQ(rig->Run(a, prompt), in_place->Run(b, prompt));
  // A budget too small for the weights fails with ResourceExhausted.
  auto device = NewCpuDevice({.budget_bytes = 1 << 20, .pool = &Pool()});
  auto weights =
      ResidentWeights::Create(model.checkpoint->config(), *model.checkpoint, *device, copy);
  EXPECT_EQ(weights.status().code(), absl::StatusCode::kResourceExhausted);
}

// Engines on other checkpoints: BF16 weights (grouped expert path, BF16 kernels), and heads
// aligned to the 128x128 FP8 blocks (the transposed FP8 W_UK^T, as DeepSeek-V3 uses).
TEST(EngineTest, Bf16CheckpointMatchesReference) {
  auto preset = GetPreset("tiny");
  ASSERT_TRUE(preset.ok());
  preset->config.num_hidden_layers = 2;
  auto model = WriteAndOpen("tiny_bf16", *preset, /*fp8=*/false);
  ASSERT_NE(model, nullptr);
  auto rig = Rig::Make(*model);
  ASSERT_NE(rig, nullptr);
  const std::vector<int32_t> prompt = RandomTokens(11, 30, 1000);
  KvSequence seq = rig->cache->NewSequence();
  const std::vector<float> first = rig->Run(seq, prompt);
  ExpectLastLogitsMatchReference(*model, *rig, seq, prompt, first);
  std::vector<int32_t> all = prompt;
  all.push_back(42);
  const std::vector<float> second = rig->Run(seq, std::span<const int32_t>(&all.back(), 1));
  ExpectLastLogitsMatchReference(*model, *rig, seq, all, second);
}

TEST(EngineTest, BlockAlignedHeadsUseFp8AbsorbedWeights) {
  auto preset = GetPreset("tiny");
  ASSERT_TRUE(preset.ok());
  ModelConfig& c = preset->config;
  c.num_hidden_layers = 2;
  c.num_attention_heads = 2;
  c.qk_nope_head_dim = 128;
  c.v_head_dim = 128;
  c.kv_lora_rank = 128;
  auto model = WriteAndOpen("tiny_aligned", *preset, /*fp8=*/true);
  ASSERT_NE(model, nullptr);
  auto rig = Rig::Make(*model);
  ASSERT_NE(rig, nullptr);
  auto module = rig->weights->Acquire({ModuleKind::kAttention, 0, -1},
                                      *rig->engine->device().CreateStream().value());
  ASSERT_TRUE(module.ok());
  ASSERT_EQ((*module)->attention.w_uk_t.size(), 2u);
  EXPECT_EQ((*module)->attention.w_uk_t[0].dtype, DType::kF8E4M3);
  const std::vector<int32_t> prompt = RandomTokens(13, 31, 1000);
  KvSequence seq = rig->cache->NewSequence();
  const std::vector<float> first = rig->Run(seq, prompt);
  ExpectLastLogitsMatchReference(*model, *rig, seq, prompt, first);
  std::vector<int32_t> all = prompt;
  all.push_back(77);
  const std::vector<float> second = rig->Run(seq, std::span<const int32_t>(&all.back(), 1));
  ExpectLastLogitsMatchReference(*model, *rig, seq, all, second);
}

}  // namespace
}  // namespace hmoe::engine_test
