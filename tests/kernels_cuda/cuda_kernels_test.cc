// GPU kernels against the CPU reference. Label "gpu": skipped where no device is visible.
#include "common/kernels/cuda/cuda_kernels.h"

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

}  // namespace
}  // namespace hmoe::cuda
