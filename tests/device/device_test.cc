// Tests of the Device abstraction (common/device): every op on every device kind against a plain
// scalar reference (the CUDA case skips when no GPU is visible), the memory budget, event tuples
// across threads, and the ring buffer of device slots.

#include "common/device/device.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstring>
#include <numeric>
#include <random>
#include <string>
#include <thread>
#include <tuple>
#include <vector>

#include "absl/time/clock.h"
#include <gtest/gtest.h>

#include "common/device/cpu_device.h"
#include "common/device/memory_budget.h"
#include "common/device/ring_buffer.h"
#include "common/engine/reference/reference_ops.h"
#include "common/model/dtype.h"
#include "common/ops/cpu/cpu_worker_pool.h"
#include "tests/integration/test_cpu_pool.h"

namespace hmoe {
namespace {

float Bf16Round(float f) { return Bf16ToFloat(FloatToBf16(f)); }

CpuWorkerPool& Pool() { return ::hmoe::testing::TestCpuPool(); }

absl::StatusOr<std::unique_ptr<Device>> NewDevice(DeviceKind kind, size_t budget = 0) {
  if (kind == DeviceKind::kCuda) return NewCudaDevice(0, budget);
  CpuDeviceOptions options;
  options.pool = &Pool();
  options.budget_bytes = budget;
  return NewCpuDevice(options);
}

class DeviceTest : public ::testing::TestWithParam<DeviceKind> {
 protected:
  void SetUp() override {
    if (GetParam() == DeviceKind::kCuda && CudaDeviceCount() == 0) {
      GTEST_SKIP() << "no CUDA device visible";
    }
    auto device = NewDevice(GetParam());
    ASSERT_TRUE(device.ok()) << device.status();
    device_ = *std::move(device);
    auto stream = device_->CreateStream();
    ASSERT_TRUE(stream.ok()) << stream.status();
    stream_ = *std::move(stream);
  }

  // A device copy of `v`; kept alive by the fixture.
  template <typename T>
  T* Upload(const std::vector<T>& v) {
    auto buffer = device_->Allocate(std::max<size_t>(1, v.size()) * sizeof(T));
    EXPECT_TRUE(buffer.ok()) << buffer.status();
    EXPECT_TRUE(
        device_->CopyToDevice(*stream_, buffer->data(), v.data(), v.size() * sizeof(T)).ok());
    buffers_.push_back(*std::move(buffer));
    return buffers_.back().template as<T>();
  }
  template <typename T>
  T* Zeros(size_t n) {
    return Upload(std::vector<T>(n));
  }
  template <typename T>
  std::vector<T> Download(const T* p, size_t n) {
    std::vector<T> v(n);
    EXPECT_TRUE(device_->CopyToHost(*stream_, v.data(), p, n * sizeof(T)).ok());
    EXPECT_TRUE(stream_->Synchronize().ok());
    return v;
  }

  std::unique_ptr<Device> device_;
  std::unique_ptr<Stream> stream_;
  std::vector<DeviceBuffer> buffers_;
};

std::vector<float> RandomFloats(size_t n, uint32_t seed, float stddev = 1.0f) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> d(0.0f, stddev);
  std::vector<float> v(n);
  for (float& x : v) x = d(rng);
  return v;
}

// A host weight of each dtype with its dense float value.
struct HostWeight {
  DType dtype;
  int64_t rows, cols;
  std::vector<std::byte> bytes;
  std::vector<float> scales;
  std::vector<float> dense;  // the exact values the kernels multiply with
};

HostWeight MakeWeight(DType dtype, int64_t rows, int64_t cols, uint32_t seed) {
  HostWeight w{dtype, rows, cols, {}, {}, {}};
  std::mt19937 rng(seed);
  const std::vector<float> values = RandomFloats(rows * cols, seed, 0.1f);
  w.dense.resize(rows * cols);
  if (dtype == DType::kF8E4M3) {
    const int64_t sr = (rows + 127) / 128, sc = (cols + 127) / 128;
    std::uniform_real_distribution<float> scale(0.5e-3f, 2e-3f);
    w.scales.resize(sr * sc);
    for (float& s : w.scales) s = scale(rng);
    w.bytes.resize(rows * cols);
    for (int64_t r = 0; r < rows; ++r) {
      for (int64_t c = 0; c < cols; ++c) {
        const float s = w.scales[(r / 128) * sc + c / 128];
        const uint8_t code = FloatToFp8E4M3(values[r * cols + c] / s);
        w.bytes[r * cols + c] = static_cast<std::byte>(code);
        w.dense[r * cols + c] = Fp8E4M3ToFloat(code) * s;
      }
    }
  } else if (dtype == DType::kBF16) {
    w.bytes.resize(rows * cols * 2);
    for (int64_t i = 0; i < rows * cols; ++i) {
      const uint16_t b = FloatToBf16(values[i]);
      std::memcpy(w.bytes.data() + 2 * i, &b, 2);
      w.dense[i] = Bf16ToFloat(b);
    }
  } else {
    w.bytes.resize(rows * cols * 4);
    std::memcpy(w.bytes.data(), values.data(), w.bytes.size());
    w.dense = values;
  }
  return w;
}

// ---------------------------------------------------------------------------------- memory

TEST_P(DeviceTest, CopiesRoundTrip) {
  const std::vector<float> v = RandomFloats(1000, 1);
  float* a = Upload(v);
  float* b = Zeros<float>(1000);
  ASSERT_TRUE(device_->CopyOnDevice(*stream_, b, a, 1000 * sizeof(float)).ok());
  EXPECT_EQ(Download(b, 1000), v);
  ASSERT_TRUE(device_->Memset(*stream_, b, 0, 500 * sizeof(float)).ok());
  const std::vector<float> got = Download(b, 1000);
  EXPECT_EQ(got[499], 0.0f);
  EXPECT_EQ(got[500], v[500]);
  ASSERT_TRUE(device_->Synchronize().ok());
}

TEST_P(DeviceTest, BudgetFailsPastItAndCountsBytes) {
  auto device = NewDevice(GetParam(), 1 << 20);
  ASSERT_TRUE(device.ok());
  Device& d = **device;
  EXPECT_EQ(d.budget_bytes(), size_t{1} << 20);
  auto a = d.Allocate(600 << 10);
  ASSERT_TRUE(a.ok()) << a.status();
  EXPECT_EQ(d.bytes_in_use(), size_t{600} << 10);
  EXPECT_EQ(d.Allocate(600 << 10).status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(d.Allocate(0).status().code(), absl::StatusCode::kInvalidArgument);
  {
    auto b = d.Allocate(400 << 10);
    ASSERT_TRUE(b.ok());
    EXPECT_EQ(d.peak_bytes_in_use(), size_t{1000} << 10);
  }
  EXPECT_EQ(d.bytes_in_use(), size_t{600} << 10);
  a->Reset();
  EXPECT_EQ(d.bytes_in_use(), 0u);
  EXPECT_EQ(d.peak_bytes_in_use(), size_t{1000} << 10);
  d.ResetPeakBytes();
  EXPECT_EQ(d.peak_bytes_in_use(), 0u);
  // A request larger than the whole budget can never fit: it fails at once.
  EXPECT_EQ(d.AllocateBlocking(2 << 20, absl::InfiniteFuture()).status().code(),
            absl::StatusCode::kResourceExhausted);
}

TEST_P(DeviceTest, AllocateBlockingWaitsForFrees) {
  auto device = NewDevice(GetParam(), 1 << 20);
  ASSERT_TRUE(device.ok());
  Device& d = **device;
  auto held = d.Allocate(800 << 10);
  ASSERT_TRUE(held.ok());
  // Times out while the memory is held.
  EXPECT_EQ(d.AllocateBlocking(500 << 10, absl::Now() + absl::Milliseconds(20)).status().code(),
            absl::StatusCode::kDeadlineExceeded);
  std::atomic<bool> allocated{false};
  std::thread waiter([&] {
    auto b = d.AllocateBlocking(500 << 10, absl::InfiniteFuture());
    EXPECT_TRUE(b.ok()) << b.status();
    allocated.store(true);
  });
  // The waiter cannot succeed before the memory is freed (it does not fit); free it.
  std::this_thread::sleep_for(std::chrono::milliseconds(10));
  EXPECT_FALSE(allocated.load());
  held->Reset();
  waiter.join();
  EXPECT_TRUE(allocated.load());
}

// ---------------------------------------------------------------------------------- ops

struct LinearCase {
  DType dtype;
  int64_t rows, cols, n;
};

TEST_P(DeviceTest, LinearMatchesScalarReference) {
  for (const LinearCase& c :
       {LinearCase{DType::kF8E4M3, 300, 520, 1}, LinearCase{DType::kF8E4M3, 129, 64, 5},
        LinearCase{DType::kF8E4M3, 256, 384, 19}, LinearCase{DType::kF8E4M3, 300, 520, 100},
        LinearCase{DType::kF8E4M3, 129, 200, 16}, LinearCase{DType::kF8E4M3, 70, 130, 65},
        LinearCase{DType::kBF16, 77, 100, 3}, LinearCase{DType::kBF16, 160, 256, 12},
        LinearCase{DType::kF32, 50, 33, 9}}) {
    SCOPED_TRACE(std::string(DTypeName(c.dtype)) + " " + std::to_string(c.rows) + "x" +
                 std::to_string(c.cols) + " n=" + std::to_string(c.n));
    const HostWeight hw = MakeWeight(c.dtype, c.rows, c.cols, 3);
    LinearWeight w;
    w.dtype = c.dtype;
    w.data = Upload(hw.bytes);
    w.rows = c.rows;
    w.cols = c.cols;
    w.row_stride = c.cols;
    if (c.dtype == DType::kF8E4M3) {
      w.scale_inv = Upload(hw.scales);
      w.scale_stride = (c.cols + 127) / 128;
    }
    const int64_t x_stride = c.cols + 3, y_stride = c.rows + 1;
    const std::vector<float> x = RandomFloats(c.n * x_stride, 4);
    float* y = Zeros<float>(c.n * y_stride);
    ASSERT_TRUE(device_->Linear(*stream_, w, Upload(x), x_stride, c.n, y, y_stride).ok());
    const std::vector<float> got = Download(y, c.n * y_stride);
    // device.h's one exception: CudaDevice's FP8 prefill (more than 16 tokens) may round each
    // scaled weight to BF16 (CudaFp8Linear::kBf16, the default): relative 2^-9 + 2^-24 per
    // weight, so up to that much more of sum |w x|. K <= 520 here: 1e-5 covers F32 summation.
    const double fp8_bf16 = GetParam() == DeviceKind::kCuda && c.dtype == DType::kF8E4M3 && c.n > 16
                                ? std::ldexp(1.0, -9) + std::ldexp(1.0, -23)
                                : 0.0;
    for (int64_t t = 0; t < c.n; ++t) {
      for (int64_t r = 0; r < c.rows; ++r) {
        double want = 0, mag = 0;
        for (int64_t k = 0; k < c.cols; ++k) {
          const float xv =
              c.dtype == DType::kF32 ? x[t * x_stride + k] : Bf16Round(x[t * x_stride + k]);
          want += static_cast<double>(hw.dense[r * c.cols + k]) * xv;
          mag += std::abs(static_cast<double>(hw.dense[r * c.cols + k]) * xv);
        }
        ASSERT_NEAR(got[t * y_stride + r], want, (1e-5 + fp8_bf16) * mag + 1e-7)
            << "t " << t << " r " << r;
      }
    }
  }
  LinearWeight bad;
  EXPECT_EQ(device_->Linear(*stream_, bad, nullptr, 0, 1, nullptr, 0).code(),
            absl::StatusCode::kInvalidArgument);
}

TEST_P(DeviceTest, RmsNormMatchesReference) {
  const int64_t n = 5, dim = 300, stride = 310;
  const std::vector<float> x = RandomFloats(n * stride, 5, 2.0f);
  const HostWeight w = MakeWeight(DType::kBF16, 1, dim, 6);
  float* y = Zeros<float>(n * stride);
  const VectorWeight vw{DType::kBF16, Upload(w.bytes), dim};
  ASSERT_TRUE(device_->RmsNorm(*stream_, Upload(x), stride, n, dim, vw, 1e-6f, y, stride).ok());
  const std::vector<float> got = Download(y, n * stride);
  for (int64_t t = 0; t < n; ++t) {
    std::vector<float> want(dim);
    reference::RmsNorm(std::span<const float>(x).subspan(t * stride, dim), w.dense, 1e-6f, want);
    for (int64_t i = 0; i < dim; ++i) {
      ASSERT_NEAR(got[t * stride + i], want[i], 1e-5f * (1 + std::abs(want[i])));
    }
  }
  EXPECT_EQ(device_->RmsNorm(*stream_, y, stride, n, dim, VectorWeight{}, 1e-6f, y, stride).code(),
            absl::StatusCode::kInvalidArgument);
}

TEST_P(DeviceTest, RopeMatchesReference) {
  ModelConfig c;
  c.qk_rope_head_dim = 16;
  c.rope_theta = 10000.0;
  c.rope_scaling.enabled = true;
  c.rope_scaling.factor = 4.0;
  c.rope_scaling.original_max_position_embeddings = 256;
  const std::vector<float> inv_freq = reference::YarnInvFreq(c);
  const float af = static_cast<float>(reference::YarnAttentionFactor(c));
  const int64_t n = 4, heads = 3, head_stride = 40, stride = 130;
  const std::vector<int32_t> positions = {0, 7, 1000, 123456};
  std::vector<float> x = RandomFloats(n * stride, 7);
  float* dx = Upload(x);
  ASSERT_TRUE(device_
                  ->RopeInterleaved(*stream_, dx + 8, stride, n, heads, head_stride, 16,
                                    Upload(positions), Upload(inv_freq), af)
                  .ok());
  const std::vector<float> got = Download(dx, n * stride);
  for (int64_t t = 0; t < n; ++t) {
    for (int64_t h = 0; h < heads; ++h) {
      std::span<float> v(x.data() + t * stride + 8 + h * head_stride, 16);
      reference::ApplyRopeInterleaved(v, positions[t], inv_freq, af);
    }
  }
  for (int64_t i = 0; i < n * stride; ++i) ASSERT_NEAR(got[i], x[i], 2e-5f) << i;
}

TEST_P(DeviceTest, ElementwiseOpsGatherAndScatter) {
  const int64_t count = 1000;
  const std::vector<float> a = RandomFloats(count, 8), b = RandomFloats(count, 9);
  float* da = Upload(a);
  float* db = Upload(b);
  float* out = Zeros<float>(count);
  ASSERT_TRUE(device_->SiluMul(*stream_, da, db, count, out).ok());
  std::vector<float> got = Download(out, count);
  for (int64_t i = 0; i < count; ++i) {
    ASSERT_NEAR(got[i], reference::Silu(a[i]) * b[i], 1e-5f * (1 + std::abs(got[i])));
  }
  ASSERT_TRUE(device_->Add(*stream_, da, db, count, out).ok());
  got = Download(out, count);
  for (int64_t i = 0; i < count; ++i) ASSERT_EQ(got[i], a[i] + b[i]);

  // Gather rows 3, 0, 3 of a [10, 100] matrix; scatter-add them back weighted.
  const std::vector<int32_t> rows = {3, 0, 3};
  const std::vector<float> weights = {0.5f, 2.0f, -1.0f};
  float* g = Zeros<float>(3 * 100);
  ASSERT_TRUE(device_->GatherRows(*stream_, da, 100, Upload(rows), 3, 100, g, 100).ok());
  const std::vector<float> gathered = Download(g, 300);
  for (int i = 0; i < 3; ++i) {
    for (int c = 0; c < 100; ++c) ASSERT_EQ(gathered[i * 100 + c], a[rows[i] * 100 + c]);
  }
  float* dst = Upload(b);
  ASSERT_TRUE(
      device_->ScatterAddRows(*stream_, g, 100, Upload(rows), Upload(weights), 3, 100, dst, 100)
          .ok());
  got = Download(dst, count);
  for (int64_t r = 0; r < 10; ++r) {
    for (int64_t c = 0; c < 100; ++c) {
      float want = b[r * 100 + c];
      for (int i = 0; i < 3; ++i) {
        if (rows[i] == r) want += weights[i] * a[rows[i] * 100 + c];
      }
      ASSERT_NEAR(got[r * 100 + c], want, 1e-6f) << r << "," << c;
    }
  }
}

TEST_P(DeviceTest, EmbeddingGatherConvertsRows) {
  const HostWeight table = MakeWeight(DType::kBF16, 20, 48, 10);
  LinearWeight w{DType::kBF16, Upload(table.bytes), 20, 48, 48, nullptr, 0};
  const std::vector<int32_t> ids = {19, 0, 7};
  float* out = Zeros<float>(3 * 48);
  ASSERT_TRUE(device_->EmbeddingGather(*stream_, w, Upload(ids), 3, out).ok());
  const std::vector<float> got = Download(out, 3 * 48);
  for (int t = 0; t < 3; ++t) {
    for (int c = 0; c < 48; ++c) ASSERT_EQ(got[t * 48 + c], table.dense[ids[t] * 48 + c]);
  }
}

TEST_P(DeviceTest, MoeGateMatchesReference) {
  const int64_t e = 16, hidden = 96, n = 6;
  const HostWeight router = MakeWeight(DType::kBF16, e, hidden, 11);
  const std::vector<float> bias = RandomFloats(e, 12, 0.05f);
  const std::vector<float> x = RandomFloats(n * hidden, 13);
  MoeGateParams p;
  p.num_experts = e;
  p.top_k = 4;
  p.n_group = 4;
  p.topk_group = 2;
  p.norm_topk_prob = true;
  p.routed_scaling_factor = 2.5;
  int32_t* ids = Zeros<int32_t>(n * 4);
  float* weights = Zeros<float>(n * 4);
  ASSERT_TRUE(
      device_
          ->MoeGate(*stream_, Upload(x), hidden, n,
                    LinearWeight{DType::kBF16, Upload(router.bytes), e, hidden, hidden, nullptr, 0},
                    VectorWeight{DType::kF32, Upload(bias), e}, p, ids, weights)
          .ok());
  const std::vector<int32_t> got_ids = Download(ids, n * 4);
  const std::vector<float> got_w = Download(weights, n * 4);
  for (int64_t t = 0; t < n; ++t) {
    std::vector<float> logits(e);
    reference::Linear(router.dense, e, hidden,
                      std::span<const float>(x).subspan(t * hidden, hidden), logits);
    const reference::MoeGateResult want = reference::MoeGate(logits, bias, p);
    for (int j = 0; j < 4; ++j) {
      EXPECT_EQ(got_ids[t * 4 + j], want.experts[j]) << "token " << t;
      EXPECT_NEAR(got_w[t * 4 + j], want.weights[j], 1e-5f);
    }
  }
}

// The device's gate (production code) against reference::MoeGate (an independent implementation)
// on logits chosen exactly: an F32 router [E, n] times one-hot activations gives token t the
// logits W[:, t] without rounding (one exact product, the rest zeros), and every logit is a BF16
// value (exact in any GEMM precision). The tokens hold exact ties (equal logits, equal biases:
// the lower id wins), near-ties one ulp apart (in the logit, or in the bias under equal logits),
// groups with equal scores (the lower group wins) and random logits; each configuration runs
// with and without the correction bias. Both implementations make the same decisions and compute
// the weights in double from the same float scores, so ids must match exactly and weights to
// float rounding (4 ulp of the weight: a GPU's exp may move a score by one ulp).
TEST_P(DeviceTest, MoeGateMatchesReferenceOnTiesAndNearTies) {
  struct Case {
    const char* name;
    MoeGateParams params;
  };
  const Case cases[] = {
      {"deepseek-v3-like grouped", {32, 8, 8, 4, true, 2.5}},
      {"kimi-k2-like n_group 1", {64, 8, 1, 1, true, 2.827}},
      {"grouped, unnormalized", {16, 4, 4, 2, false, 1.0}},
      {"one expert per group", {12, 3, 12, 3, true, 1.0}},
  };
  const auto next_bf16 = [](float f) {  // the next BF16 value above f
    return Bf16ToFloat(static_cast<uint16_t>(FloatToBf16(f) + (f >= 0 ? 1 : -1)));
  };
  for (const Case& c : cases) {
    const int64_t e = c.params.num_experts, k = c.params.top_k;
    const int64_t group = e / c.params.n_group;
    std::mt19937 rng(static_cast<uint32_t>(e * 31 + k));
    std::normal_distribution<float> normal(0.0f, 1.0f);
    // Token-major logits[t][expert].
    std::vector<std::vector<float>> logits;
    // 0: all equal.
    logits.push_back(std::vector<float>(e, 0.5f));
    // 1: few distinct values (ties between experts and between groups).
    std::vector<float> few(e);
    for (int64_t i = 0; i < e; ++i) few[i] = static_cast<float>((i * 7) % 3) - 1.0f;
    logits.push_back(few);
    // 2: every group a copy of group 0 (equal group scores without the bias).
    std::vector<float> copies(e);
    for (int64_t i = 0; i < e; ++i) copies[i] = Bf16Round(0.3f * static_cast<float>(i % group));
    logits.push_back(copies);
    // 3: pairs one BF16 ulp apart.
    std::vector<float> near(e);
    for (int64_t i = 0; i < e; i += 2) {
      near[i] = Bf16Round(normal(rng));
      if (i + 1 < e) near[i + 1] = next_bf16(near[i]);
    }
    logits.push_back(near);
    // 4, 5: random.
    for (int r = 0; r < 2; ++r) {
      std::vector<float> random(e);
      for (float& l : random) l = Bf16Round(2.0f * normal(rng));
      logits.push_back(random);
    }
    const int64_t n = static_cast<int64_t>(logits.size());

    // Bias: pairs (2i, 2i+1) equal for even i, one float ulp apart for odd i.
    std::vector<float> bias(e);
    for (int64_t i = 0; i < e; i += 2) {
      bias[i] = 0.05f * normal(rng);
      if (i + 1 < e) {
        bias[i + 1] = (i / 2) % 2 == 0 ? bias[i] : std::nextafter(bias[i], 1.0f);
      }
    }

    std::vector<float> w(e * n), x(n * n, 0.0f);
    for (int64_t t = 0; t < n; ++t) {
      x[t * n + t] = 1.0f;
      for (int64_t i = 0; i < e; ++i) w[i * n + t] = logits[t][i];
    }
    const LinearWeight router{DType::kF32, Upload(w), e, n, n, nullptr, 0};
    for (const bool with_bias : {false, true}) {
      SCOPED_TRACE(::testing::Message() << c.name << (with_bias ? ", with bias" : ", no bias"));
      int32_t* ids = Zeros<int32_t>(n * k);
      float* weights = Zeros<float>(n * k);
      const VectorWeight bias_view =
          with_bias ? VectorWeight{DType::kF32, Upload(bias), e} : VectorWeight{};
      ASSERT_TRUE(
          device_->MoeGate(*stream_, Upload(x), n, n, router, bias_view, c.params, ids, weights)
              .ok());
      const std::vector<int32_t> got_ids = Download(ids, n * k);
      const std::vector<float> got_w = Download(weights, n * k);
      for (int64_t t = 0; t < n; ++t) {
        const reference::MoeGateResult want =
            reference::MoeGate(logits[t], with_bias ? bias : std::vector<float>{}, c.params);
        const std::vector<int32_t> got(got_ids.begin() + t * k, got_ids.begin() + (t + 1) * k);
        EXPECT_EQ(got, want.experts) << "token " << t;
        for (int64_t j = 0; j < k; ++j) {
          EXPECT_NEAR(got_w[t * k + j], want.weights[j], 4.8e-7 * std::abs(want.weights[j]))
              << "token " << t << " slot " << j;
        }
      }
      if (!with_bias) {
        // All-equal logits: the lowest ids of the lowest groups, equal weights.
        std::vector<int32_t> lowest(k);
        std::iota(lowest.begin(), lowest.end(), 0);
        EXPECT_EQ(std::vector<int32_t>(got_ids.begin(), got_ids.begin() + k), lowest);
      }
    }
  }
}

// A paged latent cache with a shuffled block table, and MLA attention of several sequences
// against the reference's absorbed MLA on the same keys.
class MlaTest : public DeviceTest {
 protected:
  static constexpr int64_t kHeads = 3, kDn = 32, kDr = 16, kDv = 24, kRkv = 40;
  static constexpr int64_t kRow = kRkv + kDr;

  struct Sequence {
    int64_t start_pos, num_queries;
    std::vector<int32_t> blocks;
    std::vector<float> latent, k_pe;  // all keys, contiguous, for the reference
  };

  // How Run computes the attention: one MLA op, or (context parallelism) MlaAttentionPartial
  // over key-range parts, parts[c][s] the keys of sequence s in call c (call 0 with
  // state.first), then MlaProjectLatent.
  enum class Mode { kDecode, kPrefill, kPartial };

  // Tokens per cache block of the next Run; its output (rows x out_stride) is left in out_.
  int64_t block_ = 4;
  std::vector<float> out_;

  void Run(bool decode, std::vector<Sequence>& seqs) {
    Run(decode ? Mode::kDecode : Mode::kPrefill, seqs, {});
  }

  void Run(Mode mode, std::vector<Sequence>& seqs,
           const std::vector<std::vector<MlaKeyRange>>& parts) {
    const bool decode = mode == Mode::kDecode;
    const MlaDimensions dims{kHeads, kDn, kDr, kDv, kRkv, 0.17f};
    const std::vector<float> kv_b = RandomFloats(kHeads * (kDn + kDv) * kRkv, 20, 0.2f);
    // W_UK_h^T per head, F32.
    std::vector<std::vector<float>> uk_t(kHeads, std::vector<float>(kRkv * kDn));
    for (int64_t h = 0; h < kHeads; ++h) {
      for (int64_t i = 0; i < kDn; ++i) {
        for (int64_t r = 0; r < kRkv; ++r)
          uk_t[h][r * kDn + i] = kv_b[(h * (kDn + kDv) + i) * kRkv + r];
      }
    }
    std::vector<LinearWeight> w_uk_t;
    for (int64_t h = 0; h < kHeads; ++h) {
      w_uk_t.push_back({DType::kF32, Upload(uk_t[h]), kRkv, kDn, kDn, nullptr, 0});
    }
    // Cache pool of 32 blocks; sequences get shuffled blocks.
    constexpr int64_t kPoolBlocks = 32;
    std::vector<float> pool(kPoolBlocks * block_ * kRow, std::nanf(""));
    std::vector<int32_t> free_blocks(kPoolBlocks);
    std::iota(free_blocks.begin(), free_blocks.end(), 0);
    std::shuffle(free_blocks.begin(), free_blocks.end(), std::mt19937(21));
    std::vector<int32_t> tables;
    std::vector<MlaSegment> segments;
    int64_t rows = 0;
    for (size_t s = 0; s < seqs.size(); ++s) {
      Sequence& q = seqs[s];
      const int64_t keys = q.start_pos + q.num_queries;
      q.latent = RandomFloats(keys * kRkv, 30 + s);
      q.k_pe = RandomFloats(keys * kDr, 40 + s);
      const int64_t nblocks = (keys + block_ - 1) / block_;
      MlaSegment seg{rows, q.num_queries, q.start_pos, static_cast<int64_t>(tables.size())};
      for (int64_t b = 0; b < nblocks; ++b) {
        tables.push_back(free_blocks.back());
        free_blocks.pop_back();
      }
      for (int64_t k = 0; k < keys; ++k) {
        float* row = pool.data() +
                     (tables[seg.block_table_offset + k / block_] * block_ + k % block_) * kRow;
        std::copy_n(q.latent.begin() + k * kRkv, kRkv, row);
        std::copy_n(q.k_pe.begin() + k * kDr, kDr, row + kRkv);
      }
      segments.push_back(seg);
      rows += q.num_queries;
    }
    const int64_t q_stride = kHeads * (kDn + kDr) + 5;
    const std::vector<float> q = RandomFloats(rows * q_stride, 50);
    MlaAttentionArgs args;
    args.dims = dims;
    args.q = Upload(q);
    args.q_stride = q_stride;
    args.w_uk_t = w_uk_t;
    args.kv_b = {DType::kF32, Upload(kv_b), kHeads * (kDn + kDv), kRkv, kRkv, nullptr, 0};
    args.cache = {Upload(pool), block_, block_ * kRow, kRow};
    args.block_tables = Upload(tables);
    args.segments = segments;
    const int64_t out_stride = kHeads * kDv + 3;
    args.out = Zeros<float>(rows * out_stride);
    args.out_stride = out_stride;
    if (mode == Mode::kPartial) {
      // State rows are q rows; poison it to show that `first` overwrites everything.
      MlaPartialState state;
      state.u = Upload(std::vector<float>(rows * kHeads * kRkv, std::nanf("")));
      state.lse = Upload(std::vector<float>(rows * kHeads, std::nanf("")));
      for (size_t c = 0; c < parts.size(); ++c) {
        args.key_ranges = parts[c];
        state.first = c == 0;
        const absl::Status st = device_->MlaAttentionPartial(*stream_, args, state);
        ASSERT_TRUE(st.ok()) << st;
      }
      const absl::Status st = device_->MlaProjectLatent(*stream_, args.dims, args.kv_b, state.u,
                                                        rows, args.out, args.out_stride);
      ASSERT_TRUE(st.ok()) << st;
      if (GetParam() == DeviceKind::kCpu && parts.size() == 1) {
        // One part holding every key: the same bits as the prefill op.
        const std::vector<float> partial = Download(args.out, rows * out_stride);
        ASSERT_TRUE(device_->MlaPrefillAttention(*stream_, args).ok());
        const std::vector<float> full = Download(args.out, rows * out_stride);
        ASSERT_EQ(std::memcmp(partial.data(), full.data(), partial.size() * sizeof(float)), 0);
      }
    } else {
      ASSERT_TRUE((decode ? device_->MlaDecodeAttention(*stream_, args)
                          : device_->MlaPrefillAttention(*stream_, args))
                      .ok());
    }
    const std::vector<float> got = Download(args.out, rows * out_stride);
    out_ = got;
    for (size_t s = 0; s < seqs.size(); ++s) {
      const Sequence& sq = seqs[s];
      const int64_t n = sq.num_queries;
      std::vector<float> q_nope(n * kHeads * kDn), q_pe(n * kHeads * kDr), want(n * kHeads * kDv);
      for (int64_t t = 0; t < n; ++t) {
        const float* qr = q.data() + (segments[s].query_begin + t) * q_stride;
        for (int64_t h = 0; h < kHeads; ++h) {
          std::copy_n(qr + h * (kDn + kDr), kDn, q_nope.begin() + (t * kHeads + h) * kDn);
          std::copy_n(qr + h * (kDn + kDr) + kDn, kDr, q_pe.begin() + (t * kHeads + h) * kDr);
        }
      }
      reference::MlaAttentionAbsorbed(dims, n, sq.start_pos, q_nope, q_pe, sq.latent, sq.k_pe, kv_b,
                                      want);
      for (int64_t t = 0; t < n; ++t) {
        for (int64_t i = 0; i < kHeads * kDv; ++i) {
          const float w = want[t * kHeads * kDv + i];
          ASSERT_NEAR(got[(segments[s].query_begin + t) * out_stride + i], w,
                      2e-4f * (1 + std::abs(w)))
              << "sequence " << s << " query " << t << " element " << i;
        }
      }
    }
  }
};

TEST_P(MlaTest, DecodeAttentionMatchesReference) {
  std::vector<Sequence> seqs = {{0, 1, {}, {}, {}},
                                {13, 1, {}, {}, {}},
                                {4, 1, {}, {}, {}},
                                {30, 1, {}, {}, {}},
                                {1, 2, {}, {}, {}}};
  Run(/*decode=*/true, seqs);
}

TEST_P(MlaTest, PrefillAttentionMatchesReference) {
  // 37 queries span two tiles of 32; the second sequence starts mid-block.
  std::vector<Sequence> seqs = {{0, 37, {}, {}, {}}, {6, 9, {}, {}, {}}, {0, 1, {}, {}, {}}};
  Run(/*decode=*/false, seqs);
}

// The cache's block size is a storage detail: the CPU attention steps its online softmax by a
// fixed number of keys, so the output is bitwise the same for any block size (an SLP prefill
// worker and a decode worker with different block sizes compute the same KV).
TEST_P(MlaTest, CpuAttentionDoesNotDependOnTheBlockSize) {
  if (GetParam() != DeviceKind::kCpu) GTEST_SKIP() << "bitwise promise of the CPU device only";
  for (bool decode : {false, true}) {
    std::vector<std::vector<float>> outs;
    for (int64_t block : {4, 16, 7, 64}) {
      std::vector<Sequence> seqs = {{0, decode ? 1 : 37, {}, {}, {}},
                                    {decode ? 40 : 6, decode ? 1 : 9, {}, {}, {}}};
      block_ = block;
      Run(decode, seqs);
      outs.push_back(out_);
    }
    for (size_t i = 1; i < outs.size(); ++i) {
      ASSERT_EQ(outs[i].size(), outs[0].size());
      EXPECT_EQ(0, std::memcmp(outs[i].data(), outs[0].data(), outs[0].size() * sizeof(float)))
          << (decode ? "decode" : "prefill") << ", block size case " << i;
    }
  }
}

TEST_P(MlaTest, PartialAttentionOverOneRangeIsThePrefillAttention) {
  std::vector<Sequence> seqs = {{0, 37, {}, {}, {}}, {6, 9, {}, {}, {}}};
  Run(Mode::kPartial, seqs, {{{0, 37}, {0, 15}}});
}

TEST_P(MlaTest, PartialAttentionMergesKeyRangesInAnyOrder) {
  // Sequence 0: 37 queries from position 0; sequence 1: 9 queries from 6 (15 keys). The parts
  // cover every key once, out of order, with ranges that start and end mid-block, some invisible
  // to some rows (causality) and one empty for a whole sequence; call 0 (first) leaves early rows
  // without any key.
  std::vector<Sequence> seqs = {{0, 37, {}, {}, {}}, {6, 9, {}, {}, {}}};
  Run(Mode::kPartial, seqs, {{{21, 37}, {10, 15}}, {{0, 7}, {0, 0}}, {{7, 21}, {0, 10}}});
}

TEST_P(MlaTest, PartialAttentionRejectsMissingRanges) {
  MlaAttentionArgs args;
  args.dims = {kHeads, kDn, kDr, kDv, kRkv, 0.1f};
  std::vector<MlaSegment> segments = {{0, 1, 0, 0}};
  args.segments = segments;
  MlaPartialState state;
  EXPECT_EQ(device_->MlaAttentionPartial(*stream_, args, state).code(),
            absl::StatusCode::kInvalidArgument);
}

TEST_P(DeviceTest, KvCacheWriteUsesSlots) {
  const int64_t rkv = 8, dr = 4, row = rkv + dr, block = 4;
  float* base = Upload(std::vector<float>(3 * block * row, -1.0f));
  const KvLayerView view{base, block, block * row, row};
  const std::vector<float> latent = RandomFloats(2 * 10, 60), k_pe = RandomFloats(2 * 6, 61);
  const std::vector<int32_t> slots = {9, 2};
  ASSERT_TRUE(
      device_
          ->KvCacheWrite(*stream_, view, Upload(slots), 2, Upload(latent), 10, Upload(k_pe), 6, rkv)
          .ok());
  const std::vector<float> got = Download(base, 3 * block * row);
  for (int t = 0; t < 2; ++t) {
    const float* r = got.data() + slots[t] * row;  // dense pool: slot s at s * row
    for (int i = 0; i < rkv; ++i) ASSERT_EQ(r[i], latent[t * 10 + i]);
    for (int i = 0; i < dr; ++i) ASSERT_EQ(r[rkv + i], k_pe[t * 6 + i]);
  }
  EXPECT_EQ(got[0], -1.0f);
}

// ---------------------------------------------------------------------------------- events

TEST_P(DeviceTest, EventTupleOrdersWorkAcrossThreads) {
  auto tuple = EventTuple::Create(*device_);
  ASSERT_TRUE(tuple.ok());
  EXPECT_FALSE((*tuple)->IsSet());
  EXPECT_EQ((*tuple)->Wait(*stream_, absl::Now() + absl::Milliseconds(5)).code(),
            absl::StatusCode::kDeadlineExceeded);
  const std::vector<float> data = RandomFloats(4096, 70);
  float* dst = Zeros<float>(4096);
  // Producer (a loader): copies on its own stream, then signals.
  std::thread producer([&] {
    auto stream = device_->CreateStream();
    ASSERT_TRUE(stream.ok());
    ASSERT_TRUE(device_->CopyToDevice(**stream, dst, data.data(), 4096 * sizeof(float)).ok());
    ASSERT_TRUE((*tuple)->Signal(**stream).ok());
    ASSERT_TRUE((*stream)->Synchronize().ok());
  });
  // Consumer (the model thread): waits, then its stream sees the data.
  ASSERT_TRUE((*tuple)->Wait(*stream_).ok());
  EXPECT_EQ(Download(dst, 4096), data);
  producer.join();
  EXPECT_TRUE((*tuple)->WaitHost(absl::InfiniteFuture()).ok());
  (*tuple)->Reset();
  EXPECT_FALSE((*tuple)->IsSet());
}

TEST(HostEventTest, SetWakesEveryWaiterAndStaysSetUntilReset) {
  HostEvent event;
  std::atomic<int> woken{0};
  std::vector<std::thread> waiters;
  for (int i = 0; i < 3; ++i) {
    waiters.emplace_back([&] {
      EXPECT_TRUE(event.Wait().ok());
      woken.fetch_add(1);
    });
  }
  event.Set();
  for (std::thread& t : waiters) t.join();
  EXPECT_EQ(woken.load(), 3);
  EXPECT_TRUE(event.Wait(absl::InfinitePast()).ok());  // still set
  event.Reset();
  EXPECT_EQ(event.Wait(absl::Now() + absl::Milliseconds(1), "test").code(),
            absl::StatusCode::kDeadlineExceeded);
}

// ---------------------------------------------------------------------------------- ring buffer

TEST_P(DeviceTest, RingBufferHandsOutSlotsInOrder) {
  auto ring = DeviceRingBuffer::Create(*device_, 1000, 3);
  ASSERT_TRUE(ring.ok()) << ring.status();
  EXPECT_EQ((*ring)->slot_bytes(), 1024u);
  std::vector<DeviceRingBuffer::Slot> slots;
  for (int i = 0; i < 3; ++i) {
    auto s = (*ring)->Acquire();
    ASSERT_TRUE(s.ok());
    EXPECT_EQ(s->index, i);
    slots.push_back(*s);
  }
  EXPECT_EQ(static_cast<std::byte*>(slots[1].data) - static_cast<std::byte*>(slots[0].data), 1024);
  EXPECT_EQ((*ring)->num_acquired(), 3);
  // Full: the next Acquire (slot 0 again) waits for slot 0's release.
  EXPECT_EQ((*ring)->Acquire(absl::Now() + absl::Milliseconds(5)).status().code(),
            absl::StatusCode::kDeadlineExceeded);
  // Releasing slot 1 does not free the turn of slot 0 (ring order).
  ASSERT_TRUE((*ring)->Release(slots[1]).ok());
  EXPECT_EQ((*ring)->Acquire(absl::Now() + absl::Milliseconds(5)).status().code(),
            absl::StatusCode::kDeadlineExceeded);
  std::thread unloader([&] { EXPECT_TRUE((*ring)->Release(slots[0]).ok()); });
  auto next = (*ring)->Acquire();
  unloader.join();
  ASSERT_TRUE(next.ok());
  // Timed-out attempts kept the turn: slot 0 again, then slot 1 (released above).
  EXPECT_EQ(next->index, 0);
  EXPECT_EQ(next->sequence, 3u);
  EXPECT_EQ(next->data, slots[0].data);
  auto after = (*ring)->Acquire();
  ASSERT_TRUE(after.ok());
  EXPECT_EQ(after->index, 1);
  EXPECT_TRUE((*ring)->Release(*after).ok());
  EXPECT_EQ((*ring)->Release(*after).code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(DeviceRingBuffer::Create(*device_, 0, 3).status().code(),
            absl::StatusCode::kInvalidArgument);
}

// The slots are 256-byte aligned although Device::Allocate promises only 64 bytes: rings created
// between allocations of assorted sizes start at assorted addresses, and every slot is aligned.
TEST_P(DeviceTest, RingBufferSlotsAre256ByteAlignedWhateverTheAllocation) {
  std::vector<DeviceBuffer> keep;
  int unaligned_allocations = 0;
  for (int i = 0; i < 16; ++i) {
    auto spacer = device_->Allocate(64 * static_cast<size_t>(i + 1));
    ASSERT_TRUE(spacer.ok()) << spacer.status();
    if (reinterpret_cast<uintptr_t>(spacer->data()) % 256 != 0) ++unaligned_allocations;
    keep.push_back(*std::move(spacer));
    auto ring = DeviceRingBuffer::Create(*device_, 1000 + 64 * static_cast<size_t>(i), 3);
    ASSERT_TRUE(ring.ok()) << ring.status();
    EXPECT_GE((*ring)->footprint_bytes(), (*ring)->slot_bytes() * 3);
    EXPECT_LT((*ring)->footprint_bytes(), (*ring)->slot_bytes() * 3 + 256);
    for (int s = 0; s < 3; ++s) {
      auto slot = (*ring)->Acquire();
      ASSERT_TRUE(slot.ok());
      EXPECT_EQ(reinterpret_cast<uintptr_t>(slot->data) % 256, 0u) << "ring " << i << " slot " << s;
    }
  }
  // The CPU device really hands out allocations that are not 256-byte aligned (so the rings above
  // had to align themselves).
  if (GetParam() == DeviceKind::kCpu) {
    EXPECT_GT(unaligned_allocations, 0);
  }
}

TEST_P(DeviceTest, RingBufferRespectsTheDeviceBudget) {
  // Two slots of 2048 bytes and the alignment margin fit; three slots do not.
  auto device = NewDevice(GetParam(), 4096 + DeviceRingBuffer::kAlignmentMargin);
  ASSERT_TRUE(device.ok());
  EXPECT_EQ(DeviceRingBuffer::Create(**device, 2048, 3).status().code(),
            absl::StatusCode::kResourceExhausted);
  auto ring = DeviceRingBuffer::Create(**device, 2048, 2);
  EXPECT_TRUE(ring.ok()) << ring.status();
}

// CpuDeviceOptions::fp8_gemm_min_tokens sends FP8 Linear calls of that many tokens to cpu::Fp8Gemm:
// the same reference and tolerance as the GEMV path (rows split over the test pool's threads).
TEST(CpuDeviceTest, Fp8GemmPathMatchesTheReference) {
  CpuDeviceOptions options;
  options.pool = &Pool();
  options.fp8_gemm_min_tokens = 2;
  auto device = NewCpuDevice(options);
  auto stream = device->CreateStream();
  ASSERT_TRUE(stream.ok());
  for (const auto& [rows, cols, n] :
       {std::tuple<int64_t, int64_t, int64_t>{300, 520, 100}, {129, 200, 16}, {70, 130, 2}}) {
    SCOPED_TRACE(std::to_string(rows) + "x" + std::to_string(cols) + " n=" + std::to_string(n));
    const HostWeight hw = MakeWeight(DType::kF8E4M3, rows, cols, 5);
    LinearWeight w;
    w.dtype = DType::kF8E4M3;
    w.data = hw.bytes.data();
    w.rows = rows;
    w.cols = cols;
    w.row_stride = cols;
    w.scale_inv = hw.scales.data();
    w.scale_stride = (cols + 127) / 128;
    const int64_t x_stride = cols + 3, y_stride = rows + 1;
    const std::vector<float> x = RandomFloats(n * x_stride, 6);
    std::vector<float> y(n * y_stride);
    ASSERT_TRUE(device->Linear(**stream, w, x.data(), x_stride, n, y.data(), y_stride).ok());
    for (int64_t t = 0; t < n; ++t) {
      for (int64_t r = 0; r < rows; ++r) {
        double want = 0, mag = 0;
        for (int64_t k = 0; k < cols; ++k) {
          const float xv = Bf16Round(x[t * x_stride + k]);
          want += static_cast<double>(hw.dense[r * cols + k]) * xv;
          mag += std::abs(static_cast<double>(hw.dense[r * cols + k]) * xv);
        }
        ASSERT_NEAR(y[t * y_stride + r], want, 1e-5 * mag + 1e-7) << "t " << t << " r " << r;
      }
    }
  }
}

TEST(CpuDeviceTest, CopyBandwidthCapDelaysCopiesToTheDevice) {
  CpuDeviceOptions options;
  options.copy_bytes_per_second = 100e6;  // 1 MB takes 10 ms
  auto device = NewCpuDevice(options);
  auto stream = device->CreateStream();
  ASSERT_TRUE(stream.ok());
  std::vector<std::byte> src(1 << 20), dst(1 << 20);
  const auto start = std::chrono::steady_clock::now();
  ASSERT_TRUE(device->CopyToDevice(**stream, dst.data(), src.data(), src.size()).ok());
  // A lower bound only (the copy sleeps until its modelled completion time).
  EXPECT_GE(std::chrono::steady_clock::now() - start, std::chrono::microseconds(10485));
  EXPECT_EQ(NewCudaDevice(0).status().code(),
            CudaDeviceCount() == 0 ? absl::StatusCode::kUnavailable : absl::StatusCode::kOk);
}

TEST(MemoryBudgetTest, BlockedRequestsAreServedInOrder) {
  MemoryBudget budget(100);
  ASSERT_TRUE(budget.Reserve(90, "test").ok());
  std::thread big(
      [&] { EXPECT_TRUE(budget.ReserveBlocking(60, absl::InfiniteFuture(), "big").ok()); });
  // Wait until the big request is queued: then even a request that fits is refused.
  while (budget.Reserve(1, "probe").ok()) {
    budget.Release(1);
    std::this_thread::yield();
  }
  // 10 bytes fit right now, but the big request is first in line.
  EXPECT_EQ(budget.ReserveBlocking(10, absl::Now() + absl::Milliseconds(20), "small").code(),
            absl::StatusCode::kDeadlineExceeded);
  budget.Release(90);
  big.join();
  EXPECT_EQ(budget.bytes_in_use(), 60u);
  // The timed-out ticket does not block later requests.
  EXPECT_TRUE(budget.ReserveBlocking(10, absl::InfiniteFuture(), "small").ok());
  EXPECT_GE(budget.peak_bytes_in_use(), 90u);  // 91 if a probe ran before the big request queued
  EXPECT_EQ(budget.ReserveBlocking(101, absl::InfiniteFuture(), "huge").code(),
            absl::StatusCode::kResourceExhausted);
}

INSTANTIATE_TEST_SUITE_P(AllDevices, DeviceTest,
                         ::testing::Values(DeviceKind::kCpu, DeviceKind::kCuda),
                         [](const ::testing::TestParamInfo<DeviceKind>& info) {
                           return std::string(info.param == DeviceKind::kCpu ? "Cpu" : "Cuda");
                         });
INSTANTIATE_TEST_SUITE_P(AllDevices, MlaTest,
                         ::testing::Values(DeviceKind::kCpu, DeviceKind::kCuda),
                         [](const ::testing::TestParamInfo<DeviceKind>& info) {
                           return std::string(info.param == DeviceKind::kCpu ? "Cpu" : "Cuda");
                         });

}  // namespace
}  // namespace hmoe
