// GPU kernels against the CPU reference. Label "gpu": skipped where no device is visible.
#include "common/kernels/cuda/cuda_kernels.h"

#include <cmath>
#include <cstdint>
#include <random>
#include <vector>

#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include "common/kernels/cuda/cuda_backend.h"
#include "common/kernels/shared_math.h"
#include "common/model/dtype.h"

namespace hmoe::cuda {
namespace {

class CudaKernelsTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (DeviceCount() == 0) GTEST_SKIP() << "no CUDA device: " << NoDeviceReason();
  }
};

template <typename T>
T* DeviceCopy(const std::vector<T>& host) {
  void* p = nullptr;
  EXPECT_EQ(cudaMalloc(&p, host.size() * sizeof(T)), cudaSuccess);
  EXPECT_EQ(cudaMemcpy(p, host.data(), host.size() * sizeof(T), cudaMemcpyHostToDevice),
            cudaSuccess);
  return static_cast<T*>(p);
}

TEST_F(CudaKernelsTest, DequantFp8ToBf16MatchesCpu) {
  const int64_t rows = 200, cols = 300;  // partial edge blocks in both directions
  const int64_t scale_cols = (cols + 127) / 128, scale_rows = (rows + 127) / 128;
  std::mt19937 rng(1);
  std::vector<uint8_t> w(rows * cols);
  for (auto& b : w) {
    b = static_cast<uint8_t>(rng() & 0xff);
    if ((b & 0x7f) == 0x7f) b = 0;  // no NaN codes in weights
  }
  std::vector<float> scales(scale_rows * scale_cols);
  for (size_t i = 0; i < scales.size(); ++i) scales[i] = 0.5f + static_cast<float>(i);
  uint8_t* d_w = DeviceCopy(w);
  float* d_s = DeviceCopy(scales);
  uint16_t* d_out = nullptr;
  ASSERT_EQ(cudaMalloc(reinterpret_cast<void**>(&d_out), w.size() * 2), cudaSuccess);
  ASSERT_EQ(LaunchDequantFp8ToBf16(d_w, d_s, rows, cols, d_out, nullptr), cudaSuccess);
  std::vector<uint16_t> out(w.size());
  ASSERT_EQ(cudaMemcpy(out.data(), d_out, out.size() * 2, cudaMemcpyDeviceToHost), cudaSuccess);
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t c = 0; c < cols; ++c) {
      const float want = Fp8E4M3ToFloat(w[r * cols + c]) * scales[(r / 128) * scale_cols + c / 128];
      ASSERT_EQ(out[r * cols + c], FloatToBf16(want)) << r << "," << c;
    }
  }
  cudaFree(d_w);
  cudaFree(d_s);
  cudaFree(d_out);
}

TEST_F(CudaKernelsTest, SiluMulMatchesCpu) {
  const int64_t n = 1000;
  std::vector<float> g(n), u(n);
  for (int64_t i = 0; i < n; ++i) {
    g[i] = 0.01f * static_cast<float>(i - n / 2);
    u[i] = 1.0f + 0.001f * static_cast<float>(i);
  }
  float* d_g = DeviceCopy(g);
  float* d_u = DeviceCopy(u);
  float* d_o = nullptr;
  ASSERT_EQ(cudaMalloc(reinterpret_cast<void**>(&d_o), n * 4), cudaSuccess);
  ASSERT_EQ(LaunchSiluMul(d_g, d_u, d_o, n, nullptr), cudaSuccess);
  std::vector<float> out(n);
  ASSERT_EQ(cudaMemcpy(out.data(), d_o, n * 4, cudaMemcpyDeviceToHost), cudaSuccess);
  for (int64_t i = 0; i < n; ++i) {
    const float want = kernels::SiluMul(g[i], u[i]);
    EXPECT_NEAR(out[i], want, 1e-5f * (1.0f + std::abs(want))) << i;  // device uses __expf
  }
  cudaFree(d_g);
  cudaFree(d_u);
  cudaFree(d_o);
}

TEST_F(CudaKernelsTest, PackWeightWritesExactFp8CodesAndZeroPadding) {
  // Rows 128..255 of a 300 x 200 FP8 weight, padded to 256 columns: unscaled codes as BF16.
  const int64_t rows = 300, cols = 200, out_cols = 256;
  std::vector<uint8_t> w(rows * cols);
  for (size_t i = 0; i < w.size(); ++i) w[i] = static_cast<uint8_t>((i * 37) % 0x7e);
  std::vector<float> scales(3 * 2, 3.0f);
  WeightDesc desc;
  desc.data = DeviceCopy(w);
  desc.scale_inv = DeviceCopy(scales);
  desc.rows = rows;
  desc.cols = cols;
  desc.row_stride = cols;
  desc.scale_stride = 2;
  desc.type = kernels::ElemType::kF8E4M3;
  uint16_t* d_out = nullptr;
  ASSERT_EQ(cudaMalloc(reinterpret_cast<void**>(&d_out), 128 * out_cols * 2), cudaSuccess);
  ASSERT_EQ(LaunchPackWeight(desc, 128, 128, out_cols, d_out, PackMode::kFp8CodesBf16, nullptr),
            cudaSuccess);
  std::vector<uint16_t> out(128 * out_cols);
  ASSERT_EQ(cudaMemcpy(out.data(), d_out, out.size() * 2, cudaMemcpyDeviceToHost), cudaSuccess);
  for (int64_t r = 0; r < 128; ++r) {
    for (int64_t c = 0; c < out_cols; ++c) {
      const float want = c < cols ? Fp8E4M3ToFloat(w[(128 + r) * cols + c]) : 0.0f;
      ASSERT_EQ(Bf16ToFloat(out[r * out_cols + c]), want) << r << "," << c;
    }
  }
  cudaFree(const_cast<void*>(desc.data));
  cudaFree(const_cast<float*>(desc.scale_inv));
  cudaFree(d_out);
}

TEST_F(CudaKernelsTest, Fp8ToScaledBf16RoundsCodeTimesScaleOnBothPaths) {
  // Rows 100..299 of a 300-row FP8 weight (scale row blocks 0, 1, 2): 512 columns with a 16-byte
  // aligned row stride take the 16-codes-per-thread path; 500 columns (row stride 500) the
  // one-code path. The output rows are wider than the weight (out_stride 520 / 509): the extra
  // columns stay untouched (0xffff).
  struct Case {
    int64_t cols, row_stride, out_stride;
  };
  for (const Case& k : {Case{512, 528, 520}, Case{500, 500, 509}}) {
    SCOPED_TRACE(::testing::Message() << "cols " << k.cols);
    const int64_t rows = 300, row_begin = 100, num_rows = 200;
    const int64_t scale_stride = (k.cols + 127) / 128 + 1;  // a padded scale row
    std::mt19937 rng(7);
    std::vector<uint8_t> w(rows * k.row_stride);
    for (auto& b : w) {
      b = static_cast<uint8_t>(rng() & 0xff);
      if ((b & 0x7f) == 0x7f) b = 0;  // no NaN codes in weights
    }
    std::vector<float> scales(3 * scale_stride);
    std::uniform_real_distribution<float> scale(0.5e-3f, 2e-3f);
    for (float& s : scales) s = scale(rng);  // 24-bit mantissas: code * scale really rounds
    WeightDesc desc;
    desc.data = DeviceCopy(w);
    desc.scale_inv = DeviceCopy(scales);
    desc.rows = rows;
    desc.cols = k.cols;
    desc.row_stride = k.row_stride;
    desc.scale_stride = scale_stride;
    desc.type = kernels::ElemType::kF8E4M3;
    std::vector<uint16_t> out(num_rows * k.out_stride, 0xffff);
    uint16_t* d_out = DeviceCopy(out);
    ASSERT_EQ(LaunchFp8ToScaledBf16(desc, row_begin, num_rows, d_out, k.out_stride, nullptr),
              cudaSuccess);
    ASSERT_EQ(cudaMemcpy(out.data(), d_out, out.size() * 2, cudaMemcpyDeviceToHost), cudaSuccess);
    for (int64_t r = 0; r < num_rows; ++r) {
      const int64_t wr = row_begin + r;
      for (int64_t c = 0; c < k.out_stride; ++c) {
        const uint16_t want = c < k.cols ? FloatToBf16(Fp8E4M3ToFloat(w[wr * k.row_stride + c]) *
                                                       scales[(wr / 128) * scale_stride + c / 128])
                                         : uint16_t{0xffff};
        ASSERT_EQ(out[r * k.out_stride + c], want) << r << "," << c;
      }
    }
    cudaFree(const_cast<void*>(desc.data));
    cudaFree(const_cast<float*>(desc.scale_inv));
    cudaFree(d_out);
  }
}

TEST_F(CudaKernelsTest, F32ToBf16RoundsAndZeroPadsOnBothPaths) {
  // 64 columns padded to 72 with 16-byte aligned strides (4 per thread), and 61 padded to 67
  // with odd strides (one per thread).
  struct Case {
    int64_t cols, src_stride, dst_cols, dst_stride;
  };
  for (const Case& k : {Case{64, 68, 72, 76}, Case{61, 63, 67, 69}}) {
    SCOPED_TRACE(::testing::Message() << "cols " << k.cols);
    const int64_t rows = 70;
    std::mt19937 rng(9);
    std::normal_distribution<float> dist(0.0f, 3.0f);
    std::vector<float> src(rows * k.src_stride);
    for (float& v : src) v = dist(rng);
    std::vector<uint16_t> dst(rows * k.dst_stride, 0xffff);
    uint16_t* d_dst = DeviceCopy(dst);
    ASSERT_EQ(LaunchF32ToBf16(DeviceCopy(src), k.src_stride, rows, k.cols, d_dst, k.dst_stride,
                              k.dst_cols, nullptr),
              cudaSuccess);
    ASSERT_EQ(cudaMemcpy(dst.data(), d_dst, dst.size() * 2, cudaMemcpyDeviceToHost), cudaSuccess);
    for (int64_t r = 0; r < rows; ++r) {
      for (int64_t c = 0; c < k.dst_stride; ++c) {
        const uint16_t want = c < k.cols       ? FloatToBf16(src[r * k.src_stride + c])
                              : c < k.dst_cols ? uint16_t{0}
                                               : uint16_t{0xffff};
        ASSERT_EQ(dst[r * k.dst_stride + c], want) << r << "," << c;
      }
    }
    cudaFree(d_dst);
  }
}

TEST_F(CudaKernelsTest, BlockScaleCombineScalesEachBlockSum) {
  // 3 blocks of partial sums for 2 tokens x 130 rows (rows 128.. use the second scale row).
  const int64_t blocks = 3, tokens = 2, rows = 130;
  std::vector<float> partials(blocks * tokens * rows);
  for (size_t i = 0; i < partials.size(); ++i) partials[i] = static_cast<float>(i % 17) - 8.0f;
  const std::vector<float> scales = {1, 2, 4, 8, 16, 32};  // 2 row blocks x 3 column blocks
  float* d_y = nullptr;
  ASSERT_EQ(cudaMalloc(reinterpret_cast<void**>(&d_y), tokens * (rows + 1) * 4), cudaSuccess);
  ASSERT_EQ(LaunchBlockScaleCombine(DeviceCopy(partials), blocks, tokens, rows, DeviceCopy(scales),
                                    3, 0, d_y, rows + 1, nullptr),
            cudaSuccess);
  std::vector<float> y(tokens * (rows + 1));
  ASSERT_EQ(cudaMemcpy(y.data(), d_y, y.size() * 4, cudaMemcpyDeviceToHost), cudaSuccess);
  for (int64_t t = 0; t < tokens; ++t) {
    for (int64_t r = 0; r < rows; ++r) {
      float want = 0.0f;
      for (int64_t b = 0; b < blocks; ++b) {
        want += scales[(r / 128) * 3 + b] * partials[b * tokens * rows + t * rows + r];
      }
      ASSERT_EQ(y[t * (rows + 1) + r], want) << t << "," << r;
    }
  }
  cudaFree(d_y);
}

// Argument checks happen on the host before any launch, so they run without a GPU.
TEST(CudaLaunchersTest, RejectUnsupportedShapesAndSkipEmptyWork) {
  MlaDimensions shape;
  shape.num_heads = 1;
  shape.nope_dim = 8;
  shape.rope_dim = 64;
  shape.v_dim = 8;
  shape.kv_lora_rank = 2048;  // > kMlaMaxLatent
  KvCacheDesc cache;
  cache.row_floats = 2048 + 64;
  MlaTile tile;
  EXPECT_EQ(LaunchMlaAttend(shape, nullptr, cache, nullptr, &tile, 1, nullptr, nullptr),
            cudaErrorInvalidValue);
  EXPECT_EQ(LaunchRopeInterleaved(nullptr, 8, 1, 1, 8, 7, nullptr, nullptr, 1.0f, nullptr),
            cudaErrorInvalidValue);
  MoeGateParams gate;
  gate.num_experts = 10;
  gate.n_group = 3;  // E % n_group != 0
  gate.top_k = 2;
  EXPECT_EQ(LaunchMoeGateSelect(nullptr, 10, 1, nullptr, kernels::ElemType::kF32, gate, nullptr,
                                nullptr, nullptr),
            cudaErrorInvalidValue);
  WeightDesc bf16;
  bf16.type = kernels::ElemType::kBF16;
  bf16.cols = 4;
  EXPECT_EQ(LaunchPackWeight(bf16, 0, 1, 4, nullptr, PackMode::kFp8CodesBf16, nullptr),
            cudaErrorInvalidValue);
  EXPECT_EQ(LaunchF32ToBf16(nullptr, 8, 1, 8, nullptr, 4, 4, nullptr), cudaErrorInvalidValue);
  WeightDesc fp8;
  fp8.type = kernels::ElemType::kF8E4M3;
  fp8.rows = 128;
  fp8.cols = 16;
  EXPECT_EQ(LaunchFp8ToScaledBf16(bf16, 0, 1, nullptr, 16, nullptr), cudaErrorInvalidValue);
  EXPECT_EQ(LaunchFp8ToScaledBf16(fp8, 0, 1, nullptr, 15, nullptr), cudaErrorInvalidValue);
  EXPECT_EQ(LaunchFp8ToScaledBf16(fp8, 100, 29, nullptr, 16, nullptr), cudaErrorInvalidValue);
  EXPECT_EQ(LaunchFp8ToScaledBf16(fp8, 0, 0, nullptr, 16, nullptr), cudaSuccess);
  // Nothing to do: no launch, success.
  EXPECT_EQ(LaunchAdd(nullptr, nullptr, nullptr, 0, nullptr), cudaSuccess);
  EXPECT_EQ(LaunchMlaAttend(shape, nullptr, cache, nullptr, nullptr, 0, nullptr, nullptr),
            cudaSuccess);
  EXPECT_EQ(
      LaunchRmsNorm(nullptr, 8, 0, 8, nullptr, kernels::ElemType::kF32, 1e-6f, nullptr, 8, nullptr),
      cudaSuccess);
}

}  // namespace
}  // namespace hmoe::cuda
