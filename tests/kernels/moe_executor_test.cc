#include "common/ops/cpu/moe_executor.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <map>
#include <memory>
#include <numeric>
#include <random>
#include <vector>

#include <gtest/gtest.h>

#include "common/engine/reference/reference_ops.h"
#include "common/kernels/cpu/fp8_gemv.h"
#include "common/kernels/shared_math.h"
#include "common/model/tensor.h"
#include "common/ops/cpu/cpu_worker_pool.h"

namespace hmoe {
namespace {

using cpu::Fp8MatrixView;
using kernels::Bf16BitsToFloat;
using kernels::FloatToBf16Bits;

int64_t CeilDiv(int64_t a, int64_t b) { return (a + b - 1) / b; }

float Bf16Round(float f) { return Bf16BitsToFloat(FloatToBf16Bits(f)); }

std::unique_ptr<CpuWorkerPool> MakePool(int nodes, int threads_per_node) {
  CpuWorkerPoolOptions options;
  options.num_nodes = nodes;
  options.threads_per_node = threads_per_node;
  auto pool = CpuWorkerPool::Create(options);
  EXPECT_TRUE(pool.ok()) << pool.status();
  return std::move(*pool);
}

// An FP8 matrix and its checkpoint-style Weight, owning the bytes.
struct OwnedWeight {
  std::vector<uint8_t> data;
  std::vector<float> scales;
  Weight weight;
};

OwnedWeight RandomWeight(int64_t rows, int64_t cols, std::mt19937& rng) {
  OwnedWeight w;
  w.data.resize(rows * cols);
  std::uniform_int_distribution<int> code(0, 255);
  for (uint8_t& b : w.data) {
    do {
      b = static_cast<uint8_t>(code(rng));
    } while ((b & 0x7f) == 0x7f);
  }
  std::uniform_real_distribution<float> scale(2e-4f, 1e-3f);
  w.scales.resize(CeilDiv(rows, 128) * CeilDiv(cols, 128));
  for (float& s : w.scales) s = scale(rng);
  w.weight.tensor.name = "w.weight";
  w.weight.tensor.dtype = DType::kF8E4M3;
  w.weight.tensor.shape = {rows, cols};
  w.weight.tensor.data = reinterpret_cast<const std::byte*>(w.data.data());
  w.weight.tensor.size_bytes = w.data.size();
  w.weight.has_scale = true;
  w.weight.scale_inv.name = "w.weight_scale_inv";
  w.weight.scale_inv.dtype = DType::kF32;
  w.weight.scale_inv.shape = {CeilDiv(rows, 128), CeilDiv(cols, 128)};
  w.weight.scale_inv.data = reinterpret_cast<const std::byte*>(w.scales.data());
  w.weight.scale_inv.size_bytes = w.scales.size() * 4;
  return w;
}

struct TestExpert {
  OwnedWeight gate, up, down;
  std::vector<float> gate_f, up_f, down_f;  // DequantizeToFloat of each
};

// A small MoE layer: hidden 320 (a ragged last block), experts of intermediate 384 (three
// blocks, so two nodes split it unevenly 128 + 256).
class MoeLayerFixture {
 public:
  static constexpr int64_t kHidden = 320;
  static constexpr int64_t kInter = 384;
  static constexpr int kRouted = 12;

  MoeLayerFixture() {
    std::mt19937 rng(99);
    for (int e = 0; e < kRouted + 1; ++e) {
      auto ex = std::make_unique<TestExpert>();
      ex->gate = RandomWeight(kInter, kHidden, rng);
      ex->up = RandomWeight(kInter, kHidden, rng);
      ex->down = RandomWeight(kHidden, kInter, rng);
      ex->gate_f = *DequantizeToFloat(ex->gate.weight);
      ex->up_f = *DequantizeToFloat(ex->up.weight);
      ex->down_f = *DequantizeToFloat(ex->down.weight);
      experts_.push_back(std::move(ex));
    }
  }

  // The layer's weights split for `nodes` nodes; the last test expert is the shared one.
  MoeLayerWeights Layer(int nodes) const {
    MoeLayerWeights layer;
    layer.hidden = kHidden;
    for (size_t e = 0; e < experts_.size(); ++e) {
      const TestExpert& ex = *experts_[e];
      auto split = SplitExpert(*Fp8ViewOfWeight(ex.gate.weight), *Fp8ViewOfWeight(ex.up.weight),
                               *Fp8ViewOfWeight(ex.down.weight), nodes);
      EXPECT_TRUE(split.ok()) << split.status();
      (e < kRouted ? layer.routed : layer.shared).push_back(*split);
    }
    return layer;
  }

  // The plain F32 reference (common/engine's SwiGluMlp on DequantizeToFloat weights).
  std::vector<float> Reference(const std::vector<float>& x, const std::vector<int32_t>& ids,
                               const std::vector<float>& weights, int top_k) const {
    const int64_t n = static_cast<int64_t>(x.size()) / kHidden;
    std::vector<float> out(x.size(), 0.0f), y(kHidden);
    for (int64_t t = 0; t < n; ++t) {
      std::span<const float> xt(x.data() + t * kHidden, kHidden);
      auto add = [&](const TestExpert& ex, float w) {
        reference::SwiGluMlp(ex.gate_f, ex.up_f, ex.down_f, kHidden, kInter, xt, y);
        for (int64_t i = 0; i < kHidden; ++i) out[t * kHidden + i] += w * y[i];
      };
      for (int j = 0; j < top_k; ++j) add(*experts_[ids[t * top_k + j]], weights[t * top_k + j]);
      add(*experts_.back(), 1.0f);
    }
    return out;
  }

  // FP64 model of what the executor computes (activation and h rounded to BF16), plus the
  // magnitude sum |w_e| * sum |down * h| bounding the effect of one-ulp BF16 rounding flips.
  void Bf16Model(const std::vector<float>& x, const std::vector<int32_t>& ids,
                 const std::vector<float>& weights, int top_k, std::vector<double>* y,
                 std::vector<double>* magnitude) const {
    const int64_t n = static_cast<int64_t>(x.size()) / kHidden;
    y->assign(x.size(), 0.0);
    magnitude->assign(x.size(), 0.0);
    std::vector<float> xb(kHidden), hb(kInter);
    for (int64_t t = 0; t < n; ++t) {
      for (int64_t i = 0; i < kHidden; ++i) xb[i] = Bf16Round(x[t * kHidden + i]);
      auto add = [&](const TestExpert& ex, double w) {
        for (int64_t r = 0; r < kInter; ++r) {
          double g = 0, u = 0;
          for (int64_t k = 0; k < kHidden; ++k) {
            g += static_cast<double>(ex.gate_f[r * kHidden + k]) * xb[k];
            u += static_cast<double>(ex.up_f[r * kHidden + k]) * xb[k];
          }
          hb[r] = Bf16Round(static_cast<float>(g / (1.0 + std::exp(-g)) * u));
        }
        for (int64_t i = 0; i < kHidden; ++i) {
          double s = 0, m = 0;
          for (int64_t r = 0; r < kInter; ++r) {
            s += static_cast<double>(ex.down_f[i * kInter + r]) * hb[r];
            m += std::fabs(static_cast<double>(ex.down_f[i * kInter + r]) * hb[r]);
          }
          (*y)[t * kHidden + i] += w * s;
          (*magnitude)[t * kHidden + i] += std::fabs(w) * m;
        }
      };
      for (int j = 0; j < top_k; ++j) add(*experts_[ids[t * top_k + j]], weights[t * top_k + j]);
      add(*experts_.back(), 1.0);
    }
  }

 private:
  std::vector<std::unique_ptr<TestExpert>> experts_;
};

const MoeLayerFixture& Fixture() {
  static const MoeLayerFixture* fixture = new MoeLayerFixture();
  return *fixture;
}

// Random distinct experts per token and DeepSeek-like weights (normalized, times 2.5).
void RandomRouting(int64_t n, int top_k, std::mt19937& rng, std::vector<int32_t>* ids,
                   std::vector<float>* weights) {
  ids->clear();
  weights->clear();
  std::vector<int32_t> all(MoeLayerFixture::kRouted);
  std::iota(all.begin(), all.end(), 0);
  std::uniform_real_distribution<float> score(0.1f, 1.0f);
  for (int64_t t = 0; t < n; ++t) {
    std::shuffle(all.begin(), all.end(), rng);
    float sum = 0;
    std::vector<float> w(top_k);
    for (float& v : w) sum += (v = score(rng));
    for (int j = 0; j < top_k; ++j) {
      ids->push_back(all[j]);
      weights->push_back(w[j] / sum * 2.5f);
    }
  }
}

std::vector<float> RandomX(int64_t n, std::mt19937& rng) {
  std::normal_distribution<float> dist(0.0f, 1.0f);
  std::vector<float> x(n * MoeLayerFixture::kHidden);
  for (float& v : x) v = dist(rng);
  return x;
}

std::vector<float> RunForward(int nodes, int threads_per_node, const std::vector<float>& x,
                              const std::vector<int32_t>& ids, const std::vector<float>& weights,
                              int top_k, MoeExecutorOptions options = {}) {
  std::unique_ptr<CpuWorkerPool> pool = MakePool(nodes, threads_per_node);
  options.max_intermediate = MoeLayerFixture::kInter;
  options.gate_up_task_rows = 128;  // several tasks per expert even at these small shapes
  options.down_task_rows = 128;
  auto executor =
      MoeExecutor::Create(pool.get(), &cpu::DefaultFp8Gemv(), MoeLayerFixture::kHidden, options);
  EXPECT_TRUE(executor.ok()) << executor.status();
  const MoeLayerWeights layer = Fixture().Layer(nodes);
  std::vector<float> out(x.size(), -1.0f);
  const absl::Status s = (*executor)->Forward(layer, x, {top_k, ids, weights}, out);
  EXPECT_TRUE(s.ok()) << s;
  return out;
}

struct PoolShape {
  int nodes;
  int threads_per_node;
};

class MoeExecutorPoolTest : public ::testing::TestWithParam<PoolShape> {};

// A batch with its references, computed once and shared by every pool split.
struct Case {
  int top_k = 0;
  std::vector<float> x;
  std::vector<int32_t> ids;
  std::vector<float> weights;
  std::vector<float> reference;   // common/engine's F32 forward
  std::vector<double> model;      // FP64 model of the executor's BF16 roundings
  std::vector<double> magnitude;  // bounds the model's one-ulp rounding flips
};

const Case& GetCase(int n, int top_k) {
  static std::map<std::pair<int, int>, Case>* cases = new std::map<std::pair<int, int>, Case>;
  Case& c = (*cases)[{n, top_k}];
  if (c.x.empty()) {
    std::mt19937 rng(n * 100 + top_k);
    c.top_k = top_k;
    RandomRouting(n, top_k, rng, &c.ids, &c.weights);
    c.x = RandomX(n, rng);
    c.reference = Fixture().Reference(c.x, c.ids, c.weights, top_k);
    Fixture().Bf16Model(c.x, c.ids, c.weights, top_k, &c.model, &c.magnitude);
  }
  return c;
}

// The acceptance check of the executor: router-weighted routed experts plus the shared expert
// equal common/engine's F32 reference within BF16 tolerance (relative L2 error <= 1e-2), and the
// FP64 model of the same BF16 roundings within one BF16 ulp of the h values (4e-3 of the
// magnitude sum).
void ExpectMatchesReferences(const Case& c, int nodes, int threads_per_node) {
  const std::vector<float> out =
      RunForward(nodes, threads_per_node, c.x, c.ids, c.weights, c.top_k);
  double err2 = 0, ref2 = 0;
  for (size_t i = 0; i < out.size(); ++i) {
    err2 += (out[i] - c.reference[i]) * static_cast<double>(out[i] - c.reference[i]);
    ref2 += static_cast<double>(c.reference[i]) * c.reference[i];
  }
  EXPECT_LT(std::sqrt(err2 / ref2), 1e-2);
  for (size_t i = 0; i < out.size(); ++i) {
    ASSERT_NEAR(out[i], c.model[i], 4e-3 * c.magnitude[i]) << "element " << i;
  }
}

// For every pool split, including several virtual NUMA nodes on one node.
TEST_P(MoeExecutorPoolTest, MatchesReferenceForwardWithinBf16Tolerance) {
  const PoolShape shape = GetParam();
  for (int n : {1, 3, 8}) {
    SCOPED_TRACE(::testing::Message() << "batch " << n);
    ExpectMatchesReferences(GetCase(n, 4), shape.nodes, shape.threads_per_node);
  }
}

INSTANTIATE_TEST_SUITE_P(Splits, MoeExecutorPoolTest,
                         ::testing::Values(PoolShape{1, 1}, PoolShape{1, 2}, PoolShape{2, 1},
                                           PoolShape{2, 2}, PoolShape{3, 1}, PoolShape{4, 1}),
                         [](const ::testing::TestParamInfo<PoolShape>& info) {
                           return "nodes" + std::to_string(info.param.nodes) + "x" +
                                  std::to_string(info.param.threads_per_node);
                         });

// Dynamic scheduling never changes results: each output element has one summation order.
TEST(MoeExecutorTest, ResultsDoNotDependOnThreadCount) {
  std::mt19937 rng(4);
  std::vector<int32_t> ids;
  std::vector<float> weights;
  RandomRouting(6, 8, rng, &ids, &weights);
  const std::vector<float> x = RandomX(6, rng);
  EXPECT_EQ(RunForward(2, 1, x, ids, weights, 8), RunForward(2, 2, x, ids, weights, 8));
  EXPECT_EQ(RunForward(1, 1, x, ids, weights, 8), RunForward(1, 2, x, ids, weights, 8));
}

TEST(MoeExecutorTest, SharedExpertOnlyWhenTopKIsZero) {
  ExpectMatchesReferences(GetCase(2, 0), 2, 1);
}

TEST(MoeExecutorTest, RejectsBadInput) {
  std::unique_ptr<CpuWorkerPool> pool = MakePool(2, 1);
  MoeExecutorOptions options;
  options.max_tokens = 2;
  options.max_intermediate = MoeLayerFixture::kInter;
  auto executor =
      MoeExecutor::Create(pool.get(), &cpu::DefaultFp8Gemv(), MoeLayerFixture::kHidden, options);
  ASSERT_TRUE(executor.ok());
  const MoeLayerWeights layer = Fixture().Layer(2);
  std::vector<float> x(MoeLayerFixture::kHidden, 0.5f), out(x.size());
  const std::vector<int32_t> bad_id = {MoeLayerFixture::kRouted};
  const std::vector<float> w1 = {1.0f};
  EXPECT_EQ((*executor)->Forward(layer, x, {1, bad_id, w1}, out).code(),
            absl::StatusCode::kInvalidArgument);
  std::vector<float> x3(3 * MoeLayerFixture::kHidden), out3(x3.size());
  const std::vector<int32_t> ids3 = {0, 1, 2};
  const std::vector<float> w3 = {1, 1, 1};
  EXPECT_EQ((*executor)->Forward(layer, x3, {1, ids3, w3}, out3).code(),
            absl::StatusCode::kInvalidArgument);  // more tokens than max_tokens
  const MoeLayerWeights one_part = Fixture().Layer(1);
  const std::vector<int32_t> ok_id = {3};
  EXPECT_EQ((*executor)->Forward(one_part, x, {1, ok_id, w1}, out).code(),
            absl::StatusCode::kInvalidArgument);  // parts do not match the pool's nodes
  EXPECT_TRUE((*executor)->Forward(layer, x, {1, ok_id, w1}, out).ok());
  EXPECT_EQ((*executor)->last_active_experts(), 2);  // expert 3 + the shared one
}

TEST(MoeExecutorTest, CreateRejectsTaskRowsOffScaleBlocks) {
  std::unique_ptr<CpuWorkerPool> pool = MakePool(1, 1);
  MoeExecutorOptions options;
  options.gate_up_task_rows = 100;
  EXPECT_EQ(MoeExecutor::Create(pool.get(), &cpu::DefaultFp8Gemv(), 256, options).status().code(),
            absl::StatusCode::kInvalidArgument);
}

TEST(MoeWeightsTest, Fp8ViewOfWeightMatchesDequantizeToFloat) {
  std::mt19937 rng(6);
  const OwnedWeight w = RandomWeight(200, 300, rng);
  auto view = Fp8ViewOfWeight(w.weight);
  ASSERT_TRUE(view.ok()) << view.status();
  const std::vector<float> want = *DequantizeToFloat(w.weight);
  for (int64_t r = 0; r < 200; ++r) {
    for (int64_t c = 0; c < 300; ++c) {
      ASSERT_EQ(kernels::DequantFp8Element(view->data[r * view->row_stride + c], view->scale_inv,
                                           view->scale_stride, r, c),
                want[r * 300 + c]);
    }
  }
  Weight no_scale = w.weight;
  no_scale.has_scale = false;
  EXPECT_EQ(Fp8ViewOfWeight(no_scale).status().code(), absl::StatusCode::kInvalidArgument);
}

TEST(MoeWeightsTest, SplitExpertCutsOnScaleBlocks) {
  std::mt19937 rng(7);
  const OwnedWeight gate = RandomWeight(640, 256, rng), up = RandomWeight(640, 256, rng),
                    down = RandomWeight(256, 640, rng);
  auto split = SplitExpert(*Fp8ViewOfWeight(gate.weight), *Fp8ViewOfWeight(up.weight),
                           *Fp8ViewOfWeight(down.weight), 3);
  ASSERT_TRUE(split.ok()) << split.status();
  ASSERT_EQ(split->parts.size(), 3u);
  int64_t row = 0;
  for (const MoeExpertPart& part : split->parts) {
    EXPECT_EQ(part.gate.data, gate.data.data() + row * 256);
    EXPECT_EQ(part.down.data, down.data.data() + row);
    EXPECT_EQ(part.down.cols, part.gate.rows);
    EXPECT_EQ(part.down.row_stride, 640);
    row += part.gate.rows;
  }
  EXPECT_EQ(row, 640);
  EXPECT_EQ(split->parts[0].gate.rows, 128);  // 5 blocks over 3 parts: 1 + 2 + 2
  EXPECT_FALSE(SplitExpert(*Fp8ViewOfWeight(gate.weight), *Fp8ViewOfWeight(up.weight),
                           *Fp8ViewOfWeight(gate.weight), 2)
                   .ok());
}

TEST(CpuWorkerPoolTest, RunCallsEveryThreadOncePerRun) {
  std::unique_ptr<CpuWorkerPool> pool = MakePool(3, 2);
  ASSERT_EQ(pool->num_threads(), 6);
  EXPECT_EQ(pool->NodeOfThread(5), 2);
  EXPECT_EQ(pool->IndexInNode(5), 1);
  std::vector<std::atomic<int>> calls(6);
  for (int run = 0; run < 300; ++run) {
    pool->Run([&](int t) { calls[t].fetch_add(1, std::memory_order_relaxed); });
  }
  for (int t = 0; t < 6; ++t) EXPECT_EQ(calls[t].load(), 300) << t;
}

TEST(CpuWorkerPoolTest, WritesOfAJobAreVisibleAfterRun) {
  std::unique_ptr<CpuWorkerPool> pool = MakePool(1, 2);
  std::vector<int> slot(2, 0);
  for (int run = 1; run <= 500; ++run) {
    pool->Run([&](int t) { slot[t] = run; });
    ASSERT_EQ(slot[0], run);
    ASSERT_EQ(slot[1], run);
  }
}

TEST(CpuWorkerPoolTest, RejectsNegativeSizes) {
  CpuWorkerPoolOptions options;
  options.num_nodes = -1;
  EXPECT_EQ(CpuWorkerPool::Create(options).status().code(), absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace hmoe
