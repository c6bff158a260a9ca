// The scheduler on the real engine (ForwardPassStepEngine over the tiny checkpoint), in process:
// continuous batching with chunked prefill and dual-batch overlap on and off agree with the
// reference forward pass and with each other, and a KV cache handed over in the hand-off format
// continues like a local prefill. Label "threads": the batching and dual-batch paths under TSan.

#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <limits>
#include <memory>
#include <span>
#include <string>
#include <variant>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include <gtest/gtest.h>

#include "common/device/cpu_device.h"
#include "common/engine/reference/reference_model.h"
#include "common/kv_handoff/export_table.h"
#include "common/kv_handoff/kv_handoff.h"
#include "common/model/checkpoint.h"
#include "common/ops/cpu/cpu_worker_pool.h"
#include "decode_worker/decode_service.h"
#include "decode_worker/forward_pass_step_engine.h"
#include "decode_worker/scheduler.h"
#include "tests/decode_worker/decode_test_util.h"

namespace hmoe::decode {
namespace {

using ::hmoe::decode::testing::ScopedTempDir;

struct Model {
  ScopedTempDir dir;
  std::unique_ptr<Checkpoint> checkpoint;
  std::unique_ptr<reference::ReferenceModel> reference;
};

Model* g_model = nullptr;

// The real engine with a gate in front of its steps: while closed, StepBatch::Begin waits. Lets a
// test submit several requests before the first step runs, so that they share steps however the
// submitting thread is scheduled (on a loaded machine it may lose the CPU between two submits for
// longer than a whole request takes).
class GatedStepEngine final : public StepEngine {
 public:
  explicit GatedStepEngine(StepEngine& inner) : inner_(inner) {}

  void Close() {
    absl::MutexLock lock(&mu_);
    open_ = false;
  }
  void Open() {
    absl::MutexLock lock(&mu_);
    open_ = true;
  }

  int64_t vocab_size() const override { return inner_.vocab_size(); }
  int64_t num_layers() const override { return inner_.num_layers(); }
  int64_t max_context_tokens() const override { return inner_.max_context_tokens(); }
  const std::vector<int32_t>& eos_token_ids() const override { return inner_.eos_token_ids(); }
  int64_t max_step_tokens() const override { return inner_.max_step_tokens(); }
  int64_t max_step_sequences() const override { return inner_.max_step_sequences(); }
  int64_t kv_block_tokens() const override { return inner_.kv_block_tokens(); }
  int64_t kv_blocks_total() const override { return inner_.kv_blocks_total(); }
  int64_t kv_blocks_free() const override { return inner_.kv_blocks_free(); }
  KvHandoffShape kv_handoff_shape() const override { return inner_.kv_handoff_shape(); }
  absl::StatusOr<std::unique_ptr<StepSequence>> NewSequence(int64_t reserve_tokens) override {
    return inner_.NewSequence(reserve_tokens);
  }
  absl::StatusOr<std::unique_ptr<StepSequence>> NewImportedSequence(
      int64_t reserve_tokens, const KvImportSource& source,
      std::span<const int32_t> prompt) override {
    return inner_.NewImportedSequence(reserve_tokens, source, prompt);
  }
  absl::StatusOr<std::unique_ptr<StepSequence>> NewSequenceFromPrefix(
      int64_t reserve_tokens, std::span<const int32_t> prompt) override {
    return inner_.NewSequenceFromPrefix(reserve_tokens, prompt);
  }
  void OfferPrefix(const StepSequence& sequence, std::span<const int32_t> tokens,
                   bool finished) override {
    inner_.OfferPrefix(sequence, tokens, finished);
  }
  int64_t CachedPrefixTokens(std::span<const int32_t> prompt) const override {
    return inner_.CachedPrefixTokens(prompt);
  }
  PrefixCacheStats prefix_cache_stats() const override { return inner_.prefix_cache_stats(); }
  absl::StatusOr<std::unique_ptr<StepBatch>> NewStepBatch() override {
    absl::StatusOr<std::unique_ptr<StepBatch>> batch = inner_.NewStepBatch();
    if (!batch.ok()) return batch.status();
    return std::make_unique<Batch>(*this, *std::move(batch));
  }
  std::string device_name() const override { return inner_.device_name(); }

 private:
  class Batch final : public StepBatch {
   public:
    Batch(GatedStepEngine& engine, std::unique_ptr<StepBatch> inner)
        : engine_(engine), inner_(std::move(inner)) {}
    absl::Status Begin(std::span<const StepInput> inputs) override {
      {
        absl::MutexLock lock(&engine_.mu_);
        engine_.mu_.Await(absl::Condition(&engine_.open_));
      }
      return inner_->Begin(inputs);
    }
    absl::Status RunAttention(int64_t layer) override { return inner_->RunAttention(layer); }
    absl::Status RunFfn(int64_t layer) override { return inner_->RunFfn(layer); }
    absl::StatusOr<std::vector<std::vector<float>>> Finish() override { return inner_->Finish(); }

   private:
    GatedStepEngine& engine_;
    std::unique_ptr<StepBatch> inner_;
  };

  StepEngine& inner_;
  absl::Mutex mu_;
  bool open_ ABSL_GUARDED_BY(mu_) = true;
};

class DecodeEngineTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    g_model = new Model();
    ASSERT_FALSE(g_model->dir.path().empty());
    const std::string path = g_model->dir.File("tiny");
    ASSERT_TRUE(testing::WritePreset("tiny", path).ok());
    auto ckpt = Checkpoint::Open(path);
    ASSERT_TRUE(ckpt.ok()) << ckpt.status();
    g_model->checkpoint = *std::move(ckpt);
    auto ref =
        reference::ReferenceModel::Create(g_model->checkpoint->config(), *g_model->checkpoint);
    ASSERT_TRUE(ref.ok()) << ref.status();
    g_model->reference = *std::move(ref);
  }
  static void TearDownTestSuite() {
    delete g_model;
    g_model = nullptr;
  }

  void SetUp() override {
    ASSERT_NE(g_model, nullptr);
    ASSERT_NE(g_model->reference, nullptr);
    CpuWorkerPoolOptions po;
    po.num_nodes = 1;
    po.threads_per_node = 2;
    po.pin_threads = false;
    auto pool = CpuWorkerPool::Create(po);
    ASSERT_TRUE(pool.ok()) << pool.status();
    pool_ = *std::move(pool);
    CpuDeviceOptions dopt;
    dopt.pool = pool_.get();
    device_ = NewCpuDevice(dopt);
  }

  std::unique_ptr<ForwardPassStepEngine> MakeEngine(int batch, int chunk, int64_t kv_blocks = 64,
                                                    int64_t prefix_cache_blocks = 0) {
    ForwardPassStepEngineOptions o;
    o.prefix_cache_blocks = prefix_cache_blocks;
    o.max_step_tokens = chunk + batch;
    o.max_step_sequences = batch;
    o.kv_blocks = kv_blocks;
    o.kv_block_tokens = 16;
    auto e = ForwardPassStepEngine::Create(g_model->checkpoint->config(), *g_model->checkpoint,
                                           *device_, *pool_, o);
    EXPECT_TRUE(e.ok()) << e.status();
    return e.ok() ? *std::move(e) : nullptr;
  }

  std::unique_ptr<CpuWorkerPool> pool_;
  std::unique_ptr<Device> device_;
};

std::vector<int32_t> Prompt(int n, int seed) {
  std::vector<int32_t> p;
  for (int i = 0; i < n; ++i) p.push_back(static_cast<int32_t>(2 + (seed * 131 + i * 37) % 1000));
  return p;
}

struct Result {
  std::vector<int32_t> tokens;
  FinishEvent finish;
  bool kv_imported = false;
};

Result Collect(RequestChannel& ch) {
  Result r;
  const absl::Time deadline = absl::Now() + absl::Seconds(120);
  while (true) {
    std::optional<RequestEvent> e = ch.Pop(deadline);
    if (!e.has_value()) {
      ADD_FAILURE() << "timed out";
      return r;
    }
    if (auto* t = std::get_if<TokenEvent>(&*e)) {
      r.tokens.push_back(t->token);
    } else if (std::holds_alternative<KvImportedEvent>(*e)) {
      r.kv_imported = true;
    } else {
      r.finish = std::get<FinishEvent>(*e);
      return r;
    }
  }
}

GenerationRequest Greedy(const std::string& id, std::vector<int32_t> prompt, int max_new) {
  GenerationRequest r;
  r.id = id;
  r.prompt = std::move(prompt);
  r.sampling.max_new_tokens = max_new;
  r.sampling.ignore_eos = true;
  return r;
}

TEST_F(DecodeEngineTest, MixedBatchAgreesWithReferenceAndDualBatchChangesNothing) {
  constexpr int kTokens = 12;
  const std::vector<int> lengths = {1, 3, 6, 9, 13, 19};
  std::vector<std::vector<int32_t>> by_mode[2];
  for (int dual = 0; dual < 2; ++dual) {
    std::unique_ptr<ForwardPassStepEngine> engine = MakeEngine(6, 8);
    ASSERT_NE(engine, nullptr);
    GatedStepEngine gated(*engine);
    SchedulerOptions so;
    so.batch_size = 6;
    so.chunk_size = 8;
    so.dual_batch = dual == 1;
    auto scheduler = Scheduler::Create(gated, so);
    ASSERT_TRUE(scheduler.ok()) << scheduler.status();
    std::vector<std::shared_ptr<RequestChannel>> channels;
    gated.Close();  // all six wait for the first step: they share the steps that follow
    for (size_t i = 0; i < lengths.size(); ++i) {
      auto ch = (*scheduler)
                    ->Submit(Greedy(absl::StrCat("r", i), Prompt(lengths[i], static_cast<int>(i)),
                                    kTokens));
      EXPECT_TRUE(ch.ok()) << ch.status();
      if (ch.ok()) channels.push_back(*ch);
    }
    gated.Open();  // before any ASSERT: the scheduler's shutdown must not wait on a closed gate
    ASSERT_EQ(channels.size(), lengths.size());
    for (size_t i = 0; i < channels.size(); ++i) {
      Result r = Collect(*channels[i]);
      ASSERT_EQ(r.finish.reason, FinishReason::kLength) << r.finish.error;
      ASSERT_EQ(r.tokens.size(), static_cast<size_t>(kTokens));
      // With the engine's routing replayed in process (the score-gap rule, docs/conformance.md).
      auto agreement = testing::CheckAgreementWithRoutingFlips(
          *g_model->checkpoint, *g_model->reference, Prompt(lengths[i], static_cast<int>(i)),
          r.tokens, /*chunk_size=*/8);
      ASSERT_TRUE(agreement.ok()) << agreement.status();
      EXPECT_TRUE(agreement->ok())
          << "dual=" << dual << " request " << i << ":" << agreement->detail;
      by_mode[dual].push_back(r.tokens);
    }
    const SchedulerStats stats = (*scheduler)->stats();
    EXPECT_GE(stats.max_running_seen, 2);
    if (dual == 1) {
      EXPECT_GT(stats.dual_steps, 0);
    }
    (*scheduler)->Shutdown();
    EXPECT_EQ(engine->kv_blocks_free(), engine->kv_blocks_total());
  }
  EXPECT_EQ(by_mode[0], by_mode[1]) << "dual-batch overlap changed tokens";
}

TEST_F(DecodeEngineTest, ImportedReferenceKvCacheContinuesLikeThePrefill) {
  constexpr int kTokens = 8;
  const std::vector<int32_t> prompt = Prompt(21, 7);
  const reference::ReferenceModel& ref = *g_model->reference;
  // The prefill side: the reference computes the prompt's cache and first token.
  reference::ReferenceKvCache cache = ref.NewCache();
  auto logits = ref.Forward(prompt, cache);
  ASSERT_TRUE(logits.ok());
  const int64_t vocab = ref.config().vocab_size;
  const float* last = logits->data() + (prompt.size() - 1) * vocab;
  const auto first = static_cast<int32_t>(std::max_element(last, last + vocab) - last);

  std::unique_ptr<ForwardPassStepEngine> engine = MakeEngine(2, 8);
  ASSERT_NE(engine, nullptr);
  const std::string name = absl::StrCat("hmoe-test-decode-kv-", ::getpid());
  {
    auto seg = KvHandoffSegment::Create(name, engine->kv_handoff_shape(),
                                        static_cast<int64_t>(prompt.size()));
    ASSERT_TRUE(seg.ok()) << seg.status();
    // Layer-major, token rows of latent then rope key (kv_handoff.h).
    float* out = reinterpret_cast<float*>(seg->payload().data());
    for (int64_t l = 0; l < cache.num_layers(); ++l) {
      for (int64_t t = 0; t < cache.size(); ++t) {
        for (int64_t c = 0; c < cache.kv_lora_rank(); ++c) {
          *out++ = cache.latent(l)[t * cache.kv_lora_rank() + c];
        }
        for (int64_t c = 0; c < cache.rope_dim(); ++c) {
          *out++ = cache.k_pe(l)[t * cache.rope_dim() + c];
        }
      }
    }
  }
  KvHandleSpec spec;
  spec.shm_name = name;
  spec.num_tokens = static_cast<int64_t>(prompt.size());
  spec.layout_version = kKvHandoffLayoutVersion;
  auto source = NewShmKvImporter()->Open(spec, engine->kv_handoff_shape());
  ASSERT_TRUE(source.ok()) << source.status();
  ASSERT_TRUE(KvHandoffSegment::Remove(name).ok());  // the mapping stays valid

  SchedulerOptions so;
  so.batch_size = 2;
  so.chunk_size = 8;
  auto scheduler = Scheduler::Create(*engine, so);
  ASSERT_TRUE(scheduler.ok());
  GenerationRequest r;
  r.id = "kv";
  r.kv = *std::move(source);
  r.kv_num_tokens = static_cast<int64_t>(prompt.size());
  r.first_token = first;
  r.sampling.max_new_tokens = kTokens;
  r.sampling.ignore_eos = true;
  auto ch = (*scheduler)->Submit(std::move(r));
  ASSERT_TRUE(ch.ok()) << ch.status();
  Result res = Collect(**ch);
  EXPECT_TRUE(res.kv_imported);
  ASSERT_EQ(res.finish.reason, FinishReason::kLength) << res.finish.error;
  std::vector<int32_t> generated = {first};
  generated.insert(generated.end(), res.tokens.begin(), res.tokens.end());
  ASSERT_EQ(generated.size(), static_cast<size_t>(kTokens));
  // The continuation replayed in process from the same imported cache, with the engine's routing:
  // the score-gap rule and the derived per-step tolerances (docs/conformance.md).
  auto agreement = testing::CheckImportedKvAgreementWithRoutingFlips(
      g_model->checkpoint->config(), *g_model->checkpoint, ref, prompt, generated);
  ASSERT_TRUE(agreement.ok()) << agreement.status();
  EXPECT_TRUE(agreement->ok()) << agreement->detail;
  // The replay is compared with the tokens it checks: another last token is refused.
  std::vector<int32_t> altered = generated;
  altered.back() = (altered.back() + 1) % static_cast<int32_t>(vocab);
  EXPECT_FALSE(testing::CheckImportedKvAgreementWithRoutingFlips(
                   g_model->checkpoint->config(), *g_model->checkpoint, ref, prompt, altered)
                   .ok());
}

// ------------------------------------------------------------------------------ prefix cache
// (issue 23). Reusing a prefix's KV must give exactly the tokens a full prefill gives: the KV of a
// token depends only on the tokens before it, and the engine's results do not depend on how a
// prompt is chunked or what shares a step. Each case compares the cache-on tokens with the same
// request run alone on an engine without a prefix cache (greedy).

class PrefixCacheEngineTest : public DecodeEngineTest {
 protected:
  static constexpr int kNew = 8;

  // A scheduler of six 64-token chunks over `engine` (which must outlive it).
  static std::unique_ptr<Scheduler> Start(StepEngine& engine, bool dual_batch = false) {
    SchedulerOptions so;
    so.batch_size = 6;
    so.chunk_size = 64;
    so.dual_batch = dual_batch;
    auto s = Scheduler::Create(engine, so);
    EXPECT_TRUE(s.ok()) << s.status();
    return s.ok() ? *std::move(s) : nullptr;
  }

  // The tokens of `prompt` run alone without a prefix cache (memoized).
  std::vector<int32_t> Expected(const std::vector<int32_t>& prompt) {
    for (const auto& [p, tokens] : expected_) {
      if (p == prompt) return tokens;
    }
    if (off_ == nullptr) {
      off_engine_ = MakeEngine(6, 64, 512, 0);
      off_ = Start(*off_engine_);
      if (off_ == nullptr) return {};
    }
    auto ch = off_->Submit(Greedy(absl::StrCat("off", expected_.size()), prompt, kNew));
    EXPECT_TRUE(ch.ok()) << ch.status();
    if (!ch.ok()) return {};
    Result r = Collect(**ch);
    EXPECT_EQ(r.finish.reason, FinishReason::kLength) << r.finish.error;
    EXPECT_EQ(r.finish.cached_tokens, 0);
    expected_.emplace_back(prompt, r.tokens);
    return r.tokens;
  }

  void TearDown() override {
    off_.reset();
    off_engine_.reset();
  }

  std::unique_ptr<ForwardPassStepEngine> off_engine_;
  std::unique_ptr<Scheduler> off_;
  std::vector<std::pair<std::vector<int32_t>, std::vector<int32_t>>> expected_;
};

// Fills every free block of the engine's pool with NaN, so that a row the prefix cache should
// have copied but did not cannot pass for the right one (the pool hands out the last freed block
// first, which often holds exactly that row). Only while the scheduler is idle.
void PoisonFreeBlocks(ForwardPassStepEngine& engine) {
  KvCache& kv = engine.kv_cache();
  for (int64_t l = 0; l < kv.config().num_layers; ++l) {
    const KvLayerView v = kv.layer_view(l);
    for (int32_t b = 0; b < kv.num_blocks(); ++b) {
      if (kv.block_refs(b) != 0) continue;
      std::fill(v.base + b * v.block_stride, v.base + (b + 1) * v.block_stride,
                std::numeric_limits<float>::quiet_NaN());
    }
  }
}

std::vector<int32_t> Concat(std::vector<int32_t> a, const std::vector<int32_t>& b) {
  a.insert(a.end(), b.begin(), b.end());
  return a;
}

// A 1,000-token shared prefix: the second request reuses all of it (62 shared blocks of 16 and 8
// rows copied) and produces the tokens of a full prefill; so does an identical prompt (all but
// its last token reused) and the next turn of a chat (prompt + answer + new text).
TEST_F(PrefixCacheEngineTest, ASharedThousandTokenPrefixGivesTheTokensOfAFullPrefill) {
  std::unique_ptr<ForwardPassStepEngine> engine = MakeEngine(6, 64, 512, 512);
  ASSERT_NE(engine, nullptr);
  std::unique_ptr<Scheduler> scheduler = Start(*engine);
  ASSERT_NE(scheduler, nullptr);
  const std::vector<int32_t> prefix = Prompt(1000, 11);
  const std::vector<int32_t> a = Concat(prefix, Prompt(4, 1));
  const std::vector<int32_t> b = Concat(prefix, Prompt(7, 2));
  auto run = [&](const std::string& id, const std::vector<int32_t>& prompt) {
    PoisonFreeBlocks(*engine);
    auto ch = scheduler->Submit(Greedy(id, prompt, kNew));
    EXPECT_TRUE(ch.ok()) << ch.status();
    return ch.ok() ? Collect(**ch) : Result{};
  };
  Result ra = run("a", a);
  EXPECT_EQ(ra.finish.cached_tokens, 0);
  EXPECT_EQ(ra.tokens, Expected(a));
  Result rb = run("b", b);
  EXPECT_EQ(rb.finish.cached_tokens, 1000);
  EXPECT_EQ(rb.tokens, Expected(b));
  Result again = run("a2", a);
  EXPECT_EQ(again.finish.cached_tokens, static_cast<int32_t>(a.size()) - 1);
  EXPECT_EQ(again.tokens, ra.tokens);
  // The next turn: a, its answer (all of whose tokens but the last were fed back) and 3 more.
  const std::vector<int32_t> turn = Concat(Concat(a, ra.tokens), Prompt(3, 3));
  Result rt = run("turn", turn);
  EXPECT_EQ(rt.finish.cached_tokens, static_cast<int32_t>(a.size() + ra.tokens.size()) - 1);
  EXPECT_EQ(rt.tokens, Expected(turn));
  const SchedulerStats st = scheduler->stats();
  EXPECT_EQ(st.prefix_cache.lookups, 4);
  EXPECT_EQ(st.prefix_cache.hits, 3);
  EXPECT_EQ(st.prefix_cache.evicted_blocks, 0);
  scheduler->Shutdown();
  // Every block is free or held by the cache alone.
  EXPECT_EQ(engine->kv_blocks_free(), engine->kv_blocks_total());
}

// Six requests in one batch (dual batch on: two micro-batches on two threads read the shared
// blocks at once), hits and misses mixed; then the same with a budget of 3 blocks, which evicts
// all the time: results stay exact.
TEST_F(PrefixCacheEngineTest, MixedHitsAndMissesInABatchOfSixAndATinyBudgetStayExact) {
  const std::vector<int32_t> prefix = Prompt(200, 21);
  for (int64_t budget : {512, 3}) {
    SCOPED_TRACE(absl::StrCat("budget ", budget));
    std::unique_ptr<ForwardPassStepEngine> engine = MakeEngine(6, 64, 512, budget);
    ASSERT_NE(engine, nullptr);
    GatedStepEngine gated(*engine);
    std::unique_ptr<Scheduler> scheduler = Start(gated, /*dual_batch=*/true);
    ASSERT_NE(scheduler, nullptr);
    // Warm the cache with the prefix and one continuation.
    const std::vector<int32_t> warm = Concat(prefix, Prompt(5, 30));
    auto w = scheduler->Submit(Greedy("warm", warm, kNew));
    ASSERT_TRUE(w.ok()) << w.status();
    EXPECT_EQ(Collect(**w).tokens, Expected(warm));
    const std::vector<std::vector<int32_t>> prompts = {
        Concat(prefix, Prompt(9, 31)),           // hit: the prefix
        Prompt(40, 32),                          // miss
        warm,                                    // hit: all but the last token
        Concat(prefix, Prompt(70, 33)),          // hit, long suffix (two chunks)
        Prompt(17, 34),                          // miss
        Concat(Prompt(100, 21), Prompt(4, 35)),  // hit: the prefix's first 100 tokens
    };
    std::vector<std::shared_ptr<RequestChannel>> channels;
    PoisonFreeBlocks(*engine);
    gated.Close();
    for (size_t i = 0; i < prompts.size(); ++i) {
      auto ch = scheduler->Submit(Greedy(absl::StrCat("r", i), prompts[i], kNew));
      EXPECT_TRUE(ch.ok()) << ch.status();
      if (ch.ok()) channels.push_back(*ch);
    }
    gated.Open();
    ASSERT_EQ(channels.size(), prompts.size());
    for (size_t i = 0; i < prompts.size(); ++i) {
      Result r = Collect(*channels[i]);
      ASSERT_EQ(r.finish.reason, FinishReason::kLength) << r.finish.error;
      EXPECT_EQ(r.tokens, Expected(prompts[i])) << "request " << i;
      if (budget == 512) {
        const int32_t want[] = {200, 0, static_cast<int32_t>(warm.size()) - 1, 200, 0, 100};
        EXPECT_EQ(r.finish.cached_tokens, want[i]) << "request " << i;
      }
    }
    const SchedulerStats st = scheduler->stats();
    EXPECT_GE(st.max_running_seen, 6);
    EXPECT_GT(st.dual_steps, 0);
    if (budget == 3) {
      EXPECT_GT(st.prefix_cache.evicted_blocks, 0);
      EXPECT_LE(st.prefix_cache.cached_blocks, 3);
    }
    scheduler->Shutdown();
    EXPECT_EQ(engine->kv_blocks_free(), engine->kv_blocks_total());
  }
}

// Requests that share and extend one prefix while its first request is still decoding: they
// reuse its prompt's full blocks (offered when its prefill finished) while it appends to its own
// last block, and everything stays exact.
TEST_F(PrefixCacheEngineTest, ConcurrentRequestsShareAndExtendARunningPrefix) {
  std::unique_ptr<ForwardPassStepEngine> engine = MakeEngine(6, 64, 512, 512);
  ASSERT_NE(engine, nullptr);
  std::unique_ptr<Scheduler> scheduler = Start(*engine, /*dual_batch=*/true);
  ASSERT_NE(scheduler, nullptr);
  const std::vector<int32_t> base = Prompt(150, 41);  // 9 full blocks of 16 + 6 tokens
  GenerationRequest first = Greedy("base", base, 40);
  auto ch0 = scheduler->Submit(std::move(first));
  ASSERT_TRUE(ch0.ok()) << ch0.status();
  // Wait for its first token: its prompt is prefilled and offered, and it keeps decoding.
  std::optional<RequestEvent> e = (*ch0)->Pop(absl::Now() + absl::Seconds(120));
  ASSERT_TRUE(e.has_value() && std::holds_alternative<TokenEvent>(*e));
  std::vector<std::vector<int32_t>> prompts;
  std::vector<std::shared_ptr<RequestChannel>> channels;
  std::vector<int32_t> p = base;
  for (int i = 0; i < 4; ++i) {
    p = Concat(p, Prompt(5 + i, 50 + i));  // each extends the one before
    prompts.push_back(p);
    auto ch = scheduler->Submit(Greedy(absl::StrCat("ext", i), p, kNew));
    ASSERT_TRUE(ch.ok()) << ch.status();
    channels.push_back(*ch);
  }
  for (size_t i = 0; i < channels.size(); ++i) {
    Result r = Collect(*channels[i]);
    ASSERT_EQ(r.finish.reason, FinishReason::kLength) << r.finish.error;
    EXPECT_GE(r.finish.cached_tokens, 144) << "request " << i;
    EXPECT_EQ(r.tokens, Expected(prompts[i])) << "request " << i;
  }
  Result r0 = Collect(**ch0);
  ASSERT_EQ(r0.finish.reason, FinishReason::kLength) << r0.finish.error;
  scheduler->Shutdown();
  EXPECT_EQ(engine->kv_blocks_free(), engine->kv_blocks_total());
}

// Opting out reuses nothing and offers nothing; cached blocks filling the pool give way to new
// requests, opted out or not.
TEST_F(PrefixCacheEngineTest, ARequestCanOptOutAndCachedBlocksGiveWay) {
  // 32 blocks of 16 tokens: three cached 150-token requests hold 30 of them.
  std::unique_ptr<ForwardPassStepEngine> engine = MakeEngine(6, 64, 32, 32);
  ASSERT_NE(engine, nullptr);
  std::unique_ptr<Scheduler> scheduler = Start(*engine);
  ASSERT_NE(scheduler, nullptr);
  auto run = [&](GenerationRequest r) {
    auto ch = scheduler->Submit(std::move(r));
    EXPECT_TRUE(ch.ok()) << ch.status();
    return ch.ok() ? Collect(**ch) : Result{};
  };
  for (int i = 0; i < 3; ++i) run(Greedy(absl::StrCat("fill", i), Prompt(150, 70 + i), kNew));
  EXPECT_GE(scheduler->stats().prefix_cache.cached_blocks, 27);
  const std::vector<int32_t> prompt = Prompt(300, 61);  // 20 blocks with its 8 new tokens
  for (int i = 0; i < 2; ++i) {
    GenerationRequest r = Greedy(absl::StrCat("off", i), prompt, kNew);
    r.use_prefix_cache = false;
    Result res = run(std::move(r));
    ASSERT_EQ(res.finish.reason, FinishReason::kLength) << res.finish.error;
    EXPECT_EQ(res.finish.cached_tokens, 0);
    EXPECT_EQ(res.tokens, Expected(prompt));
  }
  const SchedulerStats st = scheduler->stats();
  EXPECT_EQ(st.prefix_cache.lookups, 3);
  EXPECT_GT(st.prefix_cache.evicted_blocks, 0);
  // Nothing of the opted-out prompt was kept.
  EXPECT_EQ(engine->CachedPrefixTokens(prompt), 0);
  // A cached request that needs most of the pool evicts the rest too.
  Result big = run(Greedy("big", Prompt(480, 62), kNew));
  ASSERT_EQ(big.finish.reason, FinishReason::kLength) << big.finish.error;
  EXPECT_EQ(big.tokens, Expected(Prompt(480, 62)));
}

// A KV hand-off whose prompt starts with a cached prefix (a prefill worker that prefilled only the
// suffix): the sequence shares the cached blocks and copies only the suffix's rows from the
// hand-off, and the request continues exactly as one that prefilled its prompt here. The
// hand-off comes from a second engine that ran the same prompt (ExportPrefix of it whole).
TEST_F(PrefixCacheEngineTest, AnImportedPromptSharesTheCachedPrefixAndCopiesOnlyTheRest) {
  const std::vector<int32_t> prefix = Prompt(200, 31);
  const std::vector<int32_t> a = Concat(prefix, Prompt(4, 1));
  const std::vector<int32_t> b = Concat(prefix, Prompt(90, 2));  // 290 tokens
  // The "prefill worker": b run whole on another engine, then its KV exported.
  std::unique_ptr<ForwardPassStepEngine> other = MakeEngine(6, 64, 512, 512);
  ASSERT_NE(other, nullptr);
  std::vector<int32_t> want;
  std::vector<std::byte> kv;
  {
    std::unique_ptr<Scheduler> s = Start(*other);
    ASSERT_NE(s, nullptr);
    auto ch = s->Submit(Greedy("b-whole", b, kNew));
    ASSERT_TRUE(ch.ok()) << ch.status();
    want = Collect(**ch).tokens;
    ASSERT_EQ(want.size(), static_cast<size_t>(kNew));
    const std::vector<int32_t> probe = Concat(b, {7});  // b's KV is cached: export all 290 rows
    auto n = other->ExportPrefix(probe, static_cast<int64_t>(b.size()),
                                 [&](int64_t tokens) -> absl::StatusOr<void*> {
                                   kv.resize(other->kv_cache().ExportBytes(tokens));
                                   return static_cast<void*>(kv.data());
                                 });
    ASSERT_TRUE(n.ok()) << n.status();
    ASSERT_EQ(*n, static_cast<int64_t>(b.size()));
  }
  std::unique_ptr<ForwardPassStepEngine> engine = MakeEngine(6, 64, 512, 512);
  ASSERT_NE(engine, nullptr);
  std::unique_ptr<Scheduler> scheduler = Start(*engine);
  ASSERT_NE(scheduler, nullptr);
  auto ch = scheduler->Submit(Greedy("a", a, kNew));  // caches the 200-token prefix
  ASSERT_TRUE(ch.ok()) << ch.status();
  ASSERT_EQ(Collect(**ch).finish.reason, FinishReason::kLength);
  const PrefixCacheStats before = scheduler->stats().prefix_cache;

  for (const bool cacheable : {true, false}) {
    SCOPED_TRACE(cacheable ? "cacheable" : "not cacheable");
    const std::string name = absl::StrCat("hmoe-test-decode-share-", ::getpid(), cacheable);
    {
      auto seg = KvHandoffSegment::Create(name, engine->kv_handoff_shape(),
                                          static_cast<int64_t>(b.size()));
      ASSERT_TRUE(seg.ok()) << seg.status();
      std::memcpy(seg->payload().data(), kv.data(), kv.size());
    }
    KvHandleSpec spec;
    spec.shm_name = name;
    spec.num_tokens = static_cast<int64_t>(b.size());
    spec.layout_version = kKvHandoffLayoutVersion;
    auto source = NewShmKvImporter()->Open(spec, engine->kv_handoff_shape());
    ASSERT_TRUE(source.ok()) << source.status();
    ASSERT_TRUE(KvHandoffSegment::Remove(name).ok());
    PoisonFreeBlocks(*engine);
    GenerationRequest r;
    r.id = absl::StrCat("b-import-", cacheable);
    r.prompt = b;
    r.kv = *std::move(source);
    r.kv_num_tokens = static_cast<int64_t>(b.size());
    r.kv_cacheable = cacheable;
    r.first_token = want[0];
    r.sampling.max_new_tokens = kNew;
    r.sampling.ignore_eos = true;
    auto imported = scheduler->Submit(std::move(r));
    ASSERT_TRUE(imported.ok()) << imported.status();
    Result res = Collect(**imported);
    ASSERT_EQ(res.finish.reason, FinishReason::kLength) << res.finish.error;
    EXPECT_EQ(res.tokens, std::vector<int32_t>(want.begin() + 1, want.end()));
  }
  const PrefixCacheStats after = scheduler->stats().prefix_cache;
  // Only the cacheable import looked the prompt up, and reused the 200 cached tokens.
  EXPECT_EQ(after.lookups - before.lookups, 1);
  EXPECT_EQ(after.hit_tokens - before.hit_tokens, 200);
  // The cacheable request's KV joined the cache when it finished: all 290 rows of b, exported
  // again, are the hand-off's bytes (the greedy tokens of `tiny` alone barely notice a wrong row).
  std::vector<std::byte> again;
  auto n = engine->ExportPrefix(Concat(b, {7}), static_cast<int64_t>(b.size()),
                                [&](int64_t tokens) -> absl::StatusOr<void*> {
                                  again.resize(engine->kv_cache().ExportBytes(tokens));
                                  return static_cast<void*>(again.data());
                                });
  ASSERT_TRUE(n.ok()) << n.status();
  EXPECT_EQ(*n, static_cast<int64_t>(b.size()));
  EXPECT_TRUE(again == kv) << "the shared prefix plus the imported suffix are not b's KV";
  scheduler->Shutdown();
  EXPECT_EQ(engine->kv_blocks_free(), engine->kv_blocks_total());
}

// ExportPrefix (a decode worker handing a cached prefix to a prefill worker): the RPC copies the
// longest cached prefix into a segment the worker owns until ReleasePrefixExport or the timeout,
// and names the bad field of a bad request.
TEST_F(PrefixCacheEngineTest, ExportPrefixCopiesTheCachedPrefixIntoASegmentTheWorkerOwns) {
  std::unique_ptr<ForwardPassStepEngine> engine = MakeEngine(6, 64, 512, 512);
  ASSERT_NE(engine, nullptr);
  std::unique_ptr<Scheduler> scheduler = Start(*engine);
  ASSERT_NE(scheduler, nullptr);
  auto importer = NewShmKvImporter();
  ExportTable table(absl::Minutes(5));
  const std::string names = absl::StrCat("hmoe-test-kvp-", ::getpid(), "-");
  DecodeServiceImpl service(scheduler.get(), engine.get(), importer.get(),
                            DecodeServiceInfo{"decode-test", "cpu", names, &table});
  DecodeServiceImpl without(scheduler.get(), engine.get(), importer.get(),
                            DecodeServiceInfo{"decode-test", "cpu", "", nullptr});
  const std::vector<int32_t> prefix = Prompt(200, 21);
  const std::vector<int32_t> a = Concat(prefix, Prompt(4, 1));
  const std::vector<int32_t> b = Concat(prefix, Prompt(7, 2));
  auto request = [&](const std::string& id, const std::vector<int32_t>& prompt, int64_t max) {
    v1::ExportPrefixRequest r;
    r.set_export_id(id);
    r.mutable_prompt_token_ids()->Assign(prompt.begin(), prompt.end());
    r.set_max_tokens(max);
    return r;
  };
  grpc::ServerContext context;
  v1::ExportPrefixResponse response;
  const int64_t max_b = static_cast<int64_t>(b.size()) - 1;
  // Nothing cached yet: OK, no handle.
  const v1::ExportPrefixRequest first = request("e0", b, max_b);
  ASSERT_TRUE(service.ExportPrefix(&context, &first, &response).ok());
  EXPECT_FALSE(response.has_kv_handle());
  EXPECT_EQ(table.count(), 0);

  auto ch = scheduler->Submit(Greedy("a", a, kNew));
  ASSERT_TRUE(ch.ok()) << ch.status();
  EXPECT_EQ(Collect(**ch).finish.reason, FinishReason::kLength);

  const v1::ExportPrefixRequest good = request("e1", b, max_b);
  PoisonFreeBlocks(*engine);
  response.Clear();
  grpc::Status st = service.ExportPrefix(&context, &good, &response);
  ASSERT_TRUE(st.ok()) << st.error_message();
  ASSERT_TRUE(response.has_kv_handle());
  const v1::KvHandle h = response.kv_handle();
  EXPECT_EQ(h.num_tokens(), 200);
  EXPECT_TRUE(h.shm_name().starts_with(names)) << h.shm_name();
  EXPECT_EQ(table.count(), 1);
  EXPECT_EQ(scheduler->stats().prefix_cache.exports, 1);
  // The segment opens as a hand-off of 200 tokens of this model's shape, with finite values (the
  // pool's free blocks are NaN-poisoned, so a block that is not the prefix's would show).
  KvHandleSpec spec;
  spec.shm_name = h.shm_name();
  spec.num_tokens = h.num_tokens();
  spec.layout_version = h.layout_version();
  {
    auto source = importer->Open(spec, engine->kv_handoff_shape());
    ASSERT_TRUE(source.ok()) << source.status();
    const auto* f = reinterpret_cast<const float*>((*source)->payload().data());
    const size_t count = (*source)->payload().size() / sizeof(float);
    EXPECT_EQ((*source)->payload().size(), engine->kv_cache().ExportBytes(200));
    EXPECT_TRUE(std::all_of(f, f + count, [](float x) { return std::isfinite(x); }));
  }
  // An id in use is refused.
  response.Clear();
  EXPECT_EQ(service.ExportPrefix(&context, &good, &response).error_code(),
            grpc::StatusCode::ALREADY_EXISTS);
  // Bad requests name the field; a worker without a cache refuses.
  const std::vector<std::pair<v1::ExportPrefixRequest, std::string>> bad = {
      {request("", b, max_b), "export_id"},
      {request("a/b", b, max_b), "export_id"},
      {request("e2", b, 0), "max_tokens"},
      {request("e3", b, static_cast<int64_t>(b.size())), "max_tokens"},
  };
  for (const auto& [r, field] : bad) {
    st = service.ExportPrefix(&context, &r, &response);
    EXPECT_EQ(st.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << field;
    EXPECT_NE(st.error_message().find(field), std::string::npos) << st.error_message();
  }
  EXPECT_EQ(without.ExportPrefix(&context, &good, &response).error_code(),
            grpc::StatusCode::FAILED_PRECONDITION);
  // Release frees the segment; a second Release is NOT_FOUND.
  v1::ReleasePrefixExportRequest release;
  release.set_export_id("e1");
  v1::ReleasePrefixExportResponse released;
  EXPECT_TRUE(service.ReleasePrefixExport(&context, &release, &released).ok());
  EXPECT_FALSE(std::filesystem::exists("/dev/shm/" + h.shm_name()));
  EXPECT_EQ(service.ReleasePrefixExport(&context, &release, &released).error_code(),
            grpc::StatusCode::NOT_FOUND);
  EXPECT_EQ(table.count(), 0);
  scheduler->Shutdown();
  // The pins are gone: every block is free or held by the cache alone.
  EXPECT_EQ(engine->kv_blocks_free(), engine->kv_blocks_total());
}

}  // namespace
}  // namespace hmoe::decode
