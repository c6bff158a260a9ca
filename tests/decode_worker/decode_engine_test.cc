// The scheduler on the real engine (ForwardPassStepEngine over the tiny checkpoint), in process:
// continuous batching with chunked prefill and dual-batch overlap on and off agree with the
// reference forward pass and with each other, and a KV cache handed over in the hand-off format
// continues like a local prefill. Label "threads": the batching and dual-batch paths under TSan.

#include <unistd.h>

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
#include "common/kv_handoff/kv_handoff.h"
#include "common/model/checkpoint.h"
#include "common/ops/cpu/cpu_worker_pool.h"
#include "decode_worker/forward_pass_step_engine.h"
#include "decode_worker/scheduler.h"
#include "tests/decode_worker/decode_test_util.h"

namespace hmoe::decode {
namespace {

using ::hmoe::decode::testing::CheckAgreement;
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
      int64_t reserve_tokens, const KvImportSource& source) override {
    return inner_.NewImportedSequence(reserve_tokens, source);
  }
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

  std::unique_ptr<ForwardPassStepEngine> MakeEngine(int batch, int chunk, int64_t kv_blocks = 64) {
    ForwardPassStepEngineOptions o;
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
  auto agreement = CheckAgreement(ref, prompt, generated);
  ASSERT_TRUE(agreement.ok());
  EXPECT_TRUE(agreement->ok()) << agreement->detail;
}

}  // namespace
}  // namespace hmoe::decode
