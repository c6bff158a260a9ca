// DSLP pieces in one process: the zig-zag plan, expert ownership, the engine's distributed-step
// validation, and whole DSLP prefills whose ranks are threads of this process (one ShmCollective
// and one engine per thread, the weights shared), compared with the single-process engine.
// Label `threads`: also runs under TSan.

#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <memory>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include <gtest/gtest.h>

#include "common/base/logging.h"
#include "common/comm/shm_collective.h"
#include "common/device/cpu_device.h"
#include "common/dslp/dslp.h"
#include "common/engine/engine.h"
#include "common/engine/kv_cache.h"
#include "common/engine/weights.h"
#include "common/model/checkpoint.h"
#include "common/ops/cpu/cpu_worker_pool.h"
#include "tests/integration/test_cpu_pool.h"
#include "tools/model_writer.h"

namespace hmoe {
namespace {

TEST(ZigZagPlanTest, SplitsIntoTwoChunksPerRankCoveringEveryPositionOnce) {
  for (int world : {1, 2, 3, 4}) {
    for (int64_t n : {2 * world, 2 * world + 1, 45, 48, 100}) {
      auto plan = ZigZagPlan::Make(n, world);
      ASSERT_TRUE(plan.ok()) << plan.status();
      std::set<int32_t> seen;
      int64_t total = 0;
      for (int r = 0; r < world; ++r) {
        EXPECT_EQ(plan->first_chunk(r), r);
        EXPECT_EQ(plan->second_chunk(r), 2 * world - 1 - r);
        const std::vector<int32_t> pos = plan->positions_of(r);
        EXPECT_EQ(static_cast<int64_t>(pos.size()), plan->tokens_of(r));
        EXPECT_TRUE(std::is_sorted(pos.begin(), pos.end()));
        seen.insert(pos.begin(), pos.end());
        total += plan->tokens_of(r);
        // Balanced: ranks differ by at most 2 tokens.
        EXPECT_LE(std::abs(plan->tokens_of(r) - plan->tokens_of(0)), 2);
      }
      EXPECT_EQ(total, n);
      EXPECT_EQ(static_cast<int64_t>(seen.size()), n);
      // Rank 0 holds the last token.
      EXPECT_EQ(plan->positions_of(0).back(), n - 1);
      for (int c = 0; c < 2 * world; ++c) {
        const int64_t len = plan->chunk_end(c) - plan->chunk_begin(c);
        EXPECT_TRUE(len == n / (2 * world) || len == n / (2 * world) + 1);
      }
    }
  }
  EXPECT_EQ(ZigZagPlan::Make(5, 3).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(ZigZagPlan::Make(5, 0).status().code(), absl::StatusCode::kInvalidArgument);
}

TEST(ExpertOwnershipTest, ContiguousRangesCoverEveryExpertOnce) {
  for (int64_t experts : {3, 7, 16, 32, 256}) {
    for (int world : {1, 2, 3}) {
      EXPECT_EQ(FirstExpertOfRank(experts, world, 0), 0);
      EXPECT_EQ(FirstExpertOfRank(experts, world, world), experts);
      for (int64_t e = 0; e < experts; ++e) {
        const int r = RankOfExpert(experts, world, e);
        EXPECT_GE(e, FirstExpertOfRank(experts, world, r));
        EXPECT_LT(e, FirstExpertOfRank(experts, world, r + 1));
      }
    }
  }
}

TEST(EpModeTest, ParsesNames) {
  EXPECT_EQ(*ParseEpMode("standard"), EpMode::kStandard);
  EXPECT_EQ(*ParseEpMode("small_ep"), EpMode::kSmallEp);
  EXPECT_EQ(*ParseEpMode("SmallEP"), EpMode::kSmallEp);
  EXPECT_EQ(ParseEpMode("ep").status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_STREQ(EpModeName(EpMode::kStandard), "standard");
}

// ---------------------------------------------------------------------------------- engines

struct TinyModel {
  std::string dir;
  std::unique_ptr<Checkpoint> checkpoint;
};

TinyModel& Tiny() {
  static TinyModel* const model = [] {
    auto m = new TinyModel();
    m->dir = absl::StrCat(::testing::TempDir(), "hmoe_dslp_unit_", ::getpid());
    auto preset = GetPreset("tiny");
    HMOE_CHECK_OK(preset.status());
    WriteOptions options;
    options.force = true;
    options.num_threads = 1;
    HMOE_CHECK_OK(WriteModel(*preset, m->dir, options));
    auto checkpoint = Checkpoint::Open(m->dir);
    HMOE_CHECK_OK(checkpoint.status());
    m->checkpoint = *std::move(checkpoint);
    std::error_code ignored;
    std::filesystem::remove_all(m->dir, ignored);  // the shards stay mapped
    return m;
  }();
  return *model;
}

CpuWorkerPool& Pool() { return ::hmoe::testing::TestCpuPool(); }

// One engine (of one rank, or the single-process reference) over the shared tiny weights.
struct Rig {
  std::unique_ptr<Device> device;
  std::unique_ptr<ResidentWeights> weights;
  std::unique_ptr<Engine> engine;
  std::unique_ptr<KvCache> cache;
  std::unique_ptr<Stream> stream;

  explicit Rig(int64_t max_tokens) {
    CpuDeviceOptions device_options;
    device_options.pool = &Pool();
    device = NewCpuDevice(device_options);
    const ModelConfig& config = Tiny().checkpoint->config();
    auto w = ResidentWeights::Create(config, *Tiny().checkpoint, *device);
    HMOE_CHECK_OK(w.status());
    weights = *std::move(w);
    EngineOptions options;
    options.max_step_tokens = max_tokens;
    options.experts = ExpertPlacement::kDevice;
    auto e = Engine::Create(config, *weights, *device, Pool(), options);
    HMOE_CHECK_OK(e.status());
    engine = *std::move(e);
    auto c = KvCache::Create(*device, KvCacheConfig::ForModel(config, 32, 8));
    HMOE_CHECK_OK(c.status());
    cache = *std::move(c);
    auto s = device->CreateStream();
    HMOE_CHECK_OK(s.status());
    stream = *std::move(s);
  }

  std::vector<float> Export(const KvSequence& seq) {
    std::vector<float> kv(cache->ExportBytes(seq.num_tokens()) / sizeof(float));
    HMOE_CHECK_OK(cache->Export(seq, *stream, kv.data(), MemorySpace::kHost));
    HMOE_CHECK_OK(stream->Synchronize());
    return kv;
  }
};

std::vector<int32_t> Prompt(int64_t n, uint32_t seed) {
  std::vector<int32_t> p(n);
  for (int64_t i = 0; i < n; ++i) p[i] = static_cast<int32_t>((i * 131 + seed * 17 + 5) % 1024);
  return p;
}

double RelMaxDiff(const std::vector<float>& a, const std::vector<float>& b, size_t begin,
                  size_t end) {
  double sq = 0, mx = 0;
  for (size_t i = begin; i < end; ++i) {
    sq += static_cast<double>(b[i]) * b[i];
    mx = std::max(mx, std::abs(static_cast<double>(a[i]) - b[i]));
  }
  return mx / std::max(1e-12, std::sqrt(sq / std::max<size_t>(1, end - begin)));
}

struct RankResult {
  absl::Status status;
  std::vector<float> logits, kv;
  DslpStats stats;
};

// A DSLP prefill with `world` ranks on threads of this process.
std::vector<RankResult> RunThreads(int world, EpMode mode, const std::vector<int32_t>& prompt) {
  static int counter = 0;
  const std::string group = absl::StrCat("dslp-unit-", ::getpid(), "-", counter++);
  std::vector<RankResult> results(world);
  std::vector<std::unique_ptr<Rig>> rigs;
  for (int r = 0; r < world; ++r) rigs.push_back(std::make_unique<Rig>(prompt.size()));
  {
    std::vector<std::jthread> threads;
    for (int r = 0; r < world; ++r) {
      threads.emplace_back([&, r] {
        RankResult& out = results[r];
        ShmCollectiveOptions o;
        o.group_name = group;
        o.rank = r;
        o.world_size = world;
        o.channel_bytes = 64 << 10;
        auto comm = ShmCollective::Create(o);
        if (!comm.ok()) {
          out.status = comm.status();
          return;
        }
        DslpOptions options;
        options.ep_mode = mode;
        auto dslp = DslpRank::Create(*rigs[r]->engine, **comm, options);
        if (!dslp.ok()) {
          out.status = dslp.status();
          return;
        }
        KvSequence seq = rigs[r]->cache->NewSequence();
        auto result = (*dslp)->Prefill(prompt, seq);
        out.status = result.status();
        if (!result.ok()) return;
        out.logits = result->logits;
        out.kv = rigs[r]->Export(seq);
        out.stats = (*dslp)->last_stats();
      });
    }
  }
  return results;
}

class DslpThreadsTest : public ::testing::TestWithParam<std::tuple<int, EpMode>> {};

TEST_P(DslpThreadsTest, RanksOnThreadsMatchTheSingleProcessPrefill) {
  const auto [world, mode] = GetParam();
  const std::vector<int32_t> prompt = Prompt(29, 3);  // 29: not a multiple of 2S
  Rig single(prompt.size());
  KvSequence seq = single.cache->NewSequence();
  SequenceInput in{&seq, prompt, true};
  auto logits = single.engine->Forward(std::span<const SequenceInput>(&in, 1));
  ASSERT_TRUE(logits.ok()) << logits.status();
  const std::vector<float> kv = single.Export(seq);

  std::vector<RankResult> ranks = RunThreads(world, mode, prompt);
  const int64_t layers = Tiny().checkpoint->config().num_hidden_layers;
  const size_t per_layer = kv.size() / layers;
  for (int r = 0; r < world; ++r) {
    ASSERT_TRUE(ranks[r].status.ok()) << "rank " << r << ": " << ranks[r].status;
    // Every rank ends with the whole prompt's cache.
    ASSERT_EQ(ranks[r].kv.size(), kv.size());
    EXPECT_EQ(std::memcmp(ranks[r].kv.data(), kv.data(), per_layer * sizeof(float)), 0)
        << "layer 0 is computed by the same per-token ops";
    for (int64_t l = 1; l < layers; ++l) {
      EXPECT_LE(RelMaxDiff(ranks[r].kv, kv, l * per_layer, (l + 1) * per_layer), 0.02)
          << "rank " << r << " layer " << l;
    }
    EXPECT_EQ(ranks[r].logits.empty(), r != 0);
    EXPECT_EQ(ranks[r].stats.layers.size(), static_cast<size_t>(layers));
    int64_t pairs = 0;
    for (const DslpLayerStats& l : ranks[r].stats.layers) pairs += l.routed_pairs;
    EXPECT_GT(pairs, 0);
  }
  ASSERT_EQ(ranks[0].logits.size(), (*logits)[0].size());
  EXPECT_LE(RelMaxDiff(ranks[0].logits, (*logits)[0], 0, ranks[0].logits.size()), 0.05);
  // Every (token, expert) pair is computed exactly once over the ranks.
  int64_t pairs = 0;
  for (const RankResult& r : ranks) {
    for (const DslpLayerStats& l : r.stats.layers) pairs += l.routed_pairs;
  }
  const ModelConfig& c = Tiny().checkpoint->config();
  int64_t moe_layers = 0;
  for (int64_t l = 0; l < c.num_hidden_layers; ++l) moe_layers += c.is_moe_layer(l) ? 1 : 0;
  EXPECT_EQ(pairs, moe_layers * static_cast<int64_t>(prompt.size()) * c.num_experts_per_tok);
}

INSTANTIATE_TEST_SUITE_P(Worlds, DslpThreadsTest,
                         ::testing::Combine(::testing::Values(1, 2, 3),
                                            ::testing::Values(EpMode::kStandard, EpMode::kSmallEp)),
                         [](const ::testing::TestParamInfo<std::tuple<int, EpMode>>& info) {
                           return absl::StrCat("S", std::get<0>(info.param), "_",
                                               EpModeName(std::get<1>(info.param)));
                         });

TEST(DslpThreadsTest, PromptShorterThanTwoChunksPerRankIsInvalid) {
  std::vector<RankResult> ranks = RunThreads(2, EpMode::kSmallEp, Prompt(3, 1));
  for (const RankResult& r : ranks) {
    EXPECT_EQ(r.status.code(), absl::StatusCode::kInvalidArgument) << r.status;
  }
}

// ---------------------------------------------------------------------------------- validation

class NoHooks final : public DistributedHooks {
 public:
  absl::Status Attention(const AttentionHookArgs&) override { return absl::OkStatus(); }
  absl::Status Route(const RouteHookArgs&) override { return absl::OkStatus(); }
  absl::Status Moe(const MoeHookArgs&) override { return absl::OkStatus(); }
};

TEST(DistributedStepTest, RejectsBadInputs) {
  Rig rig(16);
  auto batch = rig.engine->NewMicroBatch();
  ASSERT_TRUE(batch.ok());
  NoHooks hooks;
  KvSequence seq = rig.cache->NewSequence();
  const std::vector<int32_t> tokens = {1, 2, 3};
  std::vector<int32_t> positions = {0, 5, 9};
  DistributedStepInput in;
  in.sequence = &seq;
  in.total_tokens = 10;
  in.tokens = tokens;
  in.positions = positions;
  in.want_logits = true;
  in.hooks = &hooks;
  EXPECT_TRUE((*batch)->BeginDistributedStep(in).ok());
  EXPECT_EQ((*batch)->BeginDistributedStep(in).code(), absl::StatusCode::kFailedPrecondition)
      << "during a step";
  for (int64_t l = 0; l < Tiny().checkpoint->config().num_hidden_layers; ++l) {
    ASSERT_TRUE((*batch)->RunAttention(l).ok());
    ASSERT_TRUE((*batch)->RunFfn(l).ok());
  }
  auto out = (*batch)->FinishStep();
  ASSERT_TRUE(out.ok()) << out.status();
  EXPECT_EQ(seq.num_tokens(), 10) << "the whole prompt is committed";
  EXPECT_EQ(out->size(), 1u);

  KvSequence fresh = rig.cache->NewSequence();
  in.sequence = &seq;
  EXPECT_EQ((*batch)->BeginDistributedStep(in).code(), absl::StatusCode::kFailedPrecondition)
      << "sequence not empty";
  in.sequence = &fresh;
  positions = {0, 5, 5};
  EXPECT_EQ((*batch)->BeginDistributedStep(in).code(), absl::StatusCode::kInvalidArgument);
  positions = {0, 5, 8};
  EXPECT_EQ((*batch)->BeginDistributedStep(in).code(), absl::StatusCode::kInvalidArgument)
      << "logits wanted but the last token is elsewhere";
  in.want_logits = false;
  in.hooks = nullptr;
  EXPECT_EQ((*batch)->BeginDistributedStep(in).code(), absl::StatusCode::kInvalidArgument);
  in.hooks = &hooks;
  positions = {0, 5, 10};
  EXPECT_EQ((*batch)->BeginDistributedStep(in).code(), absl::StatusCode::kInvalidArgument);
  positions = {0, 5, 8};
  EXPECT_TRUE((*batch)->BeginDistributedStep(in).ok());
}

}  // namespace
}  // namespace hmoe
