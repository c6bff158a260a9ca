// CudaDevice beyond tests/device/device_test.cc (which runs every op on every device kind with
// small shapes): the no-GPU behaviour that CI can check, ScopedHostRegister, and CudaDevice
// against CpuDevice on DeepSeek-V3-like shapes that exercise the CUDA code's chunking (several
// weight row chunks and token chunks in one Linear), the MLA kernel's real shared-memory
// footprint (kv_lora_rank 512 + rope 64) with FP8 projections, and the router at E = 256.
// Label "gpu": the device comparisons skip (with the reason) where no GPU is visible.

#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <numeric>
#include <random>
#include <span>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "common/device/cpu_device.h"
#include "common/device/cuda_host_register.h"
#include "common/device/cuda_plan.h"
#include "common/device/device.h"
#include "common/kernels/cuda/cuda_backend.h"
#include "common/model/dtype.h"

namespace hmoe {
namespace {

TEST(CudaDeviceTest, NewCudaDeviceIsUnavailableWithTheReasonWithoutGpu) {
  absl::StatusOr<std::unique_ptr<Device>> device = NewCudaDevice(0);
  if (CudaDeviceCount() > 0) {
    ASSERT_TRUE(device.ok()) << device.status();
    EXPECT_EQ((*device)->kind(), DeviceKind::kCuda);
    EXPECT_EQ((*device)->name(), "cuda:0");
    EXPECT_FALSE((*device)->host_accessible());
    return;
  }
  ASSERT_EQ(device.status().code(), absl::StatusCode::kUnavailable) << device.status();
  const std::string reason = cuda::NoDeviceReason();
  EXPECT_FALSE(reason.empty());
  EXPECT_NE(std::string(device.status().message()).find(reason), std::string::npos)
      << device.status();
}

TEST(CudaDeviceTest, OrdinalPastTheLastDeviceIsUnavailable) {
  EXPECT_EQ(NewCudaDevice(CudaDeviceCount()).status().code(), absl::StatusCode::kUnavailable);
  EXPECT_EQ(NewCudaDevice(-1).status().code(), absl::StatusCode::kUnavailable);
}

// A read-only anonymous mapping of `pages` pages filled with a byte pattern (like weightd's).
struct ReadOnlyMapping {
  explicit ReadOnlyMapping(size_t pages) : bytes(pages * static_cast<size_t>(getpagesize())) {
    void* p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    EXPECT_NE(p, MAP_FAILED);
    data = static_cast<std::byte*>(p);
    for (size_t i = 0; i < bytes; ++i) data[i] = static_cast<std::byte>(i * 7 + 1);
    EXPECT_EQ(mprotect(data, bytes, PROT_READ), 0);
  }
  ~ReadOnlyMapping() { munmap(data, bytes); }
  size_t bytes;
  std::byte* data = nullptr;
};

TEST(ScopedHostRegisterTest, RegistersAReadOnlyMappingOrSaysWhyNot) {
  ReadOnlyMapping mapping(4);
  absl::StatusOr<ScopedHostRegister> reg =
      ScopedHostRegister::Create(mapping.data, mapping.bytes, /*read_only=*/true);
  if (CudaDeviceCount() == 0) {
    EXPECT_EQ(reg.status().code(), absl::StatusCode::kUnavailable) << reg.status();
    return;
  }
  ASSERT_TRUE(reg.ok()) << reg.status();
  EXPECT_EQ(reg->data(), mapping.data);
  EXPECT_EQ(reg->size_bytes(), mapping.bytes);
  // Registering the same range twice is refused while the first registration lives.
  EXPECT_EQ(ScopedHostRegister::Create(mapping.data, mapping.bytes).status().code(),
            absl::StatusCode::kAlreadyExists);
  // An asynchronous copy from the registered pages round-trips.
  auto device = NewCudaDevice(0);
  ASSERT_TRUE(device.ok()) << device.status();
  auto stream = (*device)->CreateStream();
  ASSERT_TRUE(stream.ok());
  auto buffer = (*device)->Allocate(mapping.bytes);
  ASSERT_TRUE(buffer.ok());
  std::vector<std::byte> back(mapping.bytes);
  ASSERT_TRUE((*device)->CopyToDevice(**stream, buffer->data(), mapping.data, mapping.bytes).ok());
  ASSERT_TRUE((*device)->CopyToHost(**stream, back.data(), buffer->data(), mapping.bytes).ok());
  ASSERT_TRUE((*stream)->Synchronize().ok());
  EXPECT_EQ(std::memcmp(back.data(), mapping.data, mapping.bytes), 0);
  // Moving keeps one registration; Reset releases it, so the range can be registered again.
  ScopedHostRegister moved = *std::move(reg);
  moved.Reset();
  EXPECT_TRUE(moved.empty());
  EXPECT_TRUE(ScopedHostRegister::Create(mapping.data, mapping.bytes).ok());
}

// ---------------------------------------------------------------------------------- planning

struct PlanCase {
  std::vector<MlaSegment> segments;
  int64_t num_heads;
  int64_t chunk_rows;
};

TEST(CudaPlanTest, MlaTilesCoverEveryRowAndHeadExactlyOnce) {
  std::vector<MlaSegment> decode;
  for (int64_t i = 0; i < 9; ++i) decode.push_back({i, 1, 3 * i + 1, 2 * i});
  const std::vector<MlaSegment> prefill = {{0, 37, 6, 0}, {40, 1, 0, 5}, {37, 3, 100, 7}};
  const std::vector<PlanCase> cases = {{decode, 128, 1000}, {decode, 3, 4},    {prefill, 1, 1000},
                                       {prefill, 3, 7},     {prefill, 128, 1}, {prefill, 5, 16}};
  for (const PlanCase& pc : cases) {
    SCOPED_TRACE(::testing::Message() << "heads " << pc.num_heads << " chunk " << pc.chunk_rows);
    const internal::MlaPlan plan = internal::PlanMla(pc.segments, pc.num_heads, pc.chunk_rows);
    // Compact rows: the segments' rows in order; remember each row's segment and position.
    std::vector<int32_t> want_rows;
    std::vector<size_t> seg_of;
    std::vector<int64_t> pos_of;
    for (size_t s = 0; s < pc.segments.size(); ++s) {
      for (int64_t i = 0; i < pc.segments[s].num_queries; ++i) {
        want_rows.push_back(static_cast<int32_t>(pc.segments[s].query_begin + i));
        seg_of.push_back(s);
        pos_of.push_back(pc.segments[s].start_pos + i);
      }
    }
    ASSERT_EQ(plan.q_rows, want_rows);
    const int64_t total = static_cast<int64_t>(want_rows.size());
    const int64_t chunks = (total + plan.chunk_rows - 1) / plan.chunk_rows;
    ASSERT_EQ(static_cast<int64_t>(plan.chunk_tiles.size()), chunks + 1);
    std::vector<int> covered(total * pc.num_heads, 0);
    for (int64_t c = 0; c < chunks; ++c) {
      const int64_t c0 = c * plan.chunk_rows;
      const int64_t chunk_len = std::min(plan.chunk_rows, total - c0);
      for (int64_t ti = plan.chunk_tiles[c]; ti < plan.chunk_tiles[c + 1]; ++ti) {
        const cuda::MlaTile& t = plan.tiles[ti];
        ASSERT_GE(t.num_queries, 1);
        ASSERT_GE(t.num_heads, 1);
        ASSERT_LE(t.num_queries * t.num_heads, cuda::kMlaTileRows);
        ASSERT_GE(t.first_row, 0);
        ASSERT_LE(t.first_row + t.num_queries, chunk_len);
        ASSERT_LE(t.first_head + t.num_heads, pc.num_heads);
        const int64_t r0 = c0 + t.first_row;
        const MlaSegment& seg = pc.segments[seg_of[r0]];
        EXPECT_EQ(t.first_pos, pos_of[r0]);
        EXPECT_EQ(t.table_offset, seg.block_table_offset);
        for (int64_t i = 0; i < t.num_queries; ++i) {
          ASSERT_EQ(seg_of[r0 + i], seg_of[r0]) << "a tile spans two sequences";
          EXPECT_EQ(pos_of[r0 + i], t.first_pos + i);
          for (int64_t h = 0; h < t.num_heads; ++h) {
            ++covered[(r0 + i) * pc.num_heads + t.first_head + h];
          }
        }
      }
    }
    for (size_t i = 0; i < covered.size(); ++i) ASSERT_EQ(covered[i], 1) << "(row, head) " << i;
  }
  // Decode packs 16 heads of one query per block; prefill 16 queries of one head.
  const internal::MlaPlan d = internal::PlanMla(decode, 128, 1000);
  EXPECT_EQ(d.tiles.size(), 9u * 8u);
  EXPECT_EQ(d.tiles[0].num_heads, 16);
  const internal::MlaPlan p = internal::PlanMla(prefill, 128, 1000);
  EXPECT_EQ(p.tiles[0].num_queries, 16);
  EXPECT_EQ(p.tiles[0].num_heads, 1);
}

TEST(CudaPlanTest, LinearChunksBoundTheTemporaries) {
  alignas(16) static const uint8_t kAny[16] = {};
  auto weight = [](DType dtype, int64_t rows, int64_t cols, const void* data) {
    return LinearWeight{dtype, data, rows, cols, cols, nullptr, (cols + 127) / 128};
  };
  const int64_t limit = internal::kCudaActivationChunkBytes;
  struct Case {
    LinearWeight w;
    bool f32;
    int64_t n;
    bool fp8_blocks;
    internal::LinearMode mode;
    bool direct;
  };
  using internal::LinearMode;
  const Case cases[] = {
      {weight(DType::kF8E4M3, 18432, 7168, kAny), false, 1, true, LinearMode::kFp8Blocks, false},
      {weight(DType::kF8E4M3, 4700, 7168, kAny), false, 5000, true, LinearMode::kFp8Blocks, false},
      {weight(DType::kF8E4M3, 300, 520, kAny), false, 19, true, LinearMode::kFp8Blocks, false},
      {weight(DType::kF8E4M3, 18432, 7168, kAny), false, 1, false, LinearMode::kFp8Bf16, false},
      {weight(DType::kF8E4M3, 4700, 7168, kAny), false, 9000, false, LinearMode::kFp8Bf16, false},
      {weight(DType::kF8E4M3, 300, 523, kAny), false, 19, false, LinearMode::kFp8Bf16, false},
      {weight(DType::kBF16, 4096, 7168, kAny), false, 4096, true, LinearMode::kBf16, true},
      {weight(DType::kBF16, 77, 100, kAny + 1), false, 3, false, LinearMode::kBf16, false},
      {weight(DType::kF32, 50, 33, kAny), false, 9, false, LinearMode::kF32, true},
      {weight(DType::kBF16, 256, 7168, kAny), true, 4096, false, LinearMode::kF32, false},
      {weight(DType::kF8E4M3, 256, 7168, kAny), true, 4096, false, LinearMode::kF32, false},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(::testing::Message() << DTypeName(c.w.dtype) << " [" << c.w.rows << ", "
                                      << c.w.cols << "] n=" << c.n << " blocks " << c.fp8_blocks);
    const internal::LinearPlan p = internal::PlanLinear(c.w, c.f32, c.n, c.fp8_blocks);
    EXPECT_EQ(p.mode, c.mode);
    EXPECT_EQ(p.direct, c.direct);
    EXPECT_EQ(p.num_blocks, (c.w.cols + 127) / 128);
    // Leading dimensions: whole 128-blocks (per-block GEMMs), 8-element multiples (the one-GEMM
    // FP8 path), the weight's columns otherwise.
    EXPECT_EQ(p.k_padded, c.mode == LinearMode::kFp8Blocks ? p.num_blocks * 128
                          : c.mode == LinearMode::kFp8Bf16 ? (c.w.cols + 7) / 8 * 8
                                                           : c.w.cols);
    // Row chunks: everything, or whole 128-row blocks (FP8 scales are per 128 rows).
    EXPECT_TRUE(p.row_chunk == c.w.rows || (p.row_chunk % 128 == 0 && p.row_chunk < c.w.rows));
    EXPECT_GE(p.token_chunk, 1);
    EXPECT_LE(p.token_chunk, c.n);
    // Each temporary stays within its bound (or is a single minimal chunk).
    const int64_t elem = c.mode == LinearMode::kF32 ? 4 : 2;
    if (c.mode != LinearMode::kF32) {
      EXPECT_TRUE(p.token_chunk * p.k_padded * 2 <= limit || p.token_chunk == 1);
    } else {
      EXPECT_EQ(p.token_chunk, c.n);
    }
    if (!p.direct) {
      EXPECT_TRUE(p.row_chunk * p.k_padded * elem <= limit || p.row_chunk == 128);
      EXPECT_GE(p.w_offset,
                p.x_offset + (c.mode == LinearMode::kF32
                                  ? 0
                                  : static_cast<size_t>(p.token_chunk * p.k_padded * 2)));
    }
    if (c.mode == LinearMode::kFp8Blocks) {
      EXPECT_TRUE(p.num_blocks * p.token_chunk * p.row_chunk * 4 <= limit || p.token_chunk == 1);
      EXPECT_GE(p.partial_offset, p.w_offset + static_cast<size_t>(p.row_chunk * p.k_padded * 2));
    }
    EXPECT_GE(p.bytes,
              p.w_offset + (p.direct ? 0 : static_cast<size_t>(p.row_chunk * p.k_padded * elem)));
    EXPECT_LE(p.bytes, static_cast<size_t>(3 * limit + 3 * internal::kScratchAlign));
    EXPECT_EQ(p.bytes % internal::kScratchAlign, 0u);
  }
  // The chunked FP8 cases really split: several row chunks, token chunks of the partial sums
  // (blocks) or of the BF16 activations (one GEMM).
  const LinearWeight big = weight(DType::kF8E4M3, 4700, 7168, kAny);
  const internal::LinearPlan blocks = internal::PlanLinear(big, false, 5000, /*fp8_blocks=*/true);
  EXPECT_EQ(blocks.row_chunk, 4608);
  EXPECT_EQ(blocks.token_chunk, 65);  // 64 MiB / (56 blocks * 4608 rows * 4 bytes)
  const internal::LinearPlan one = internal::PlanLinear(big, false, 9000, /*fp8_blocks=*/false);
  EXPECT_EQ(one.row_chunk, 4608);     // 64 MiB / (7168 * 2 bytes), whole 128-row blocks
  EXPECT_EQ(one.token_chunk, 4681);   // 64 MiB / (7168 * 2 bytes)
  EXPECT_EQ(one.partial_offset, 0u);  // no partial sums
  // The default is the one-GEMM path.
  EXPECT_EQ(internal::PlanLinear(big, false, 100).mode, LinearMode::kFp8Bf16);
}

// HMOE_CUDA_FP8_LINEAR is read (and checked) before the GPU is looked for: this runs everywhere.
TEST(CudaDeviceTest, BadFp8LinearEnvironmentIsInvalidArgumentNamingTheValue) {
  ASSERT_EQ(setenv("HMOE_CUDA_FP8_LINEAR", "fast", 1), 0);
  const absl::Status bad = NewCudaDevice(0).status();
  CudaDeviceOptions explicit_mode;
  explicit_mode.fp8_linear = CudaFp8Linear::kBlocks;  // the option wins over the environment
  const absl::Status chosen = NewCudaDevice(CudaDeviceCount(), explicit_mode).status();
  ASSERT_EQ(unsetenv("HMOE_CUDA_FP8_LINEAR"), 0);
  EXPECT_EQ(bad.code(), absl::StatusCode::kInvalidArgument) << bad;
  EXPECT_NE(std::string(bad.message()).find("\"fast\""), std::string::npos) << bad;
  EXPECT_EQ(chosen.code(), absl::StatusCode::kUnavailable) << chosen;  // past the last GPU
  for (const char* good : {"bf16", "blocks", ""}) {
    ASSERT_EQ(setenv("HMOE_CUDA_FP8_LINEAR", good, 1), 0);
    const absl::Status st = NewCudaDevice(CudaDeviceCount()).status();
    ASSERT_EQ(unsetenv("HMOE_CUDA_FP8_LINEAR"), 0);
    EXPECT_EQ(st.code(), absl::StatusCode::kUnavailable) << good << ": " << st;
  }
}

// ---------------------------------------------------------------------------------- GPU vs CPU

std::vector<float> RandomFloats(size_t n, uint32_t seed, float stddev = 1.0f) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> dist(0.0f, stddev);
  std::vector<float> v(n);
  for (float& x : v) x = dist(rng);
  return v;
}

// A row-major FP8 weight with 128x128 block scales and its dense (dequantized) values.
struct Fp8Weight {
  int64_t rows = 0, cols = 0;
  std::vector<uint8_t> codes;
  std::vector<float> scales;
  std::vector<float> dense;
};

Fp8Weight MakeFp8(int64_t rows, int64_t cols, uint32_t seed) {
  Fp8Weight w{rows, cols, std::vector<uint8_t>(rows * cols), {}, std::vector<float>(rows * cols)};
  const int64_t sc = (cols + 127) / 128;
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> scale(0.5e-3f, 2e-3f);
  w.scales.resize(((rows + 127) / 128) * sc);
  for (float& s : w.scales) s = scale(rng);
  const std::vector<float> values = RandomFloats(rows * cols, seed + 1, 0.05f);
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t c = 0; c < cols; ++c) {
      const float s = w.scales[(r / 128) * sc + c / 128];
      w.codes[r * cols + c] = FloatToFp8E4M3(values[r * cols + c] / s);
      w.dense[r * cols + c] = Fp8E4M3ToFloat(w.codes[r * cols + c]) * s;
    }
  }
  return w;
}

// The same inputs on a CudaDevice and a CpuDevice.
class CudaVsCpuTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (CudaDeviceCount() == 0) GTEST_SKIP() << "no CUDA device: " << cuda::NoDeviceReason();
    auto gpu = NewCudaDevice(0, gpu_options_);
    ASSERT_TRUE(gpu.ok()) << gpu.status();
    gpu_ = *std::move(gpu);
    cpu_ = NewCpuDevice();
    auto gs = gpu_->CreateStream();
    ASSERT_TRUE(gs.ok()) << gs.status();
    gpu_stream_ = *std::move(gs);
    auto cs = cpu_->CreateStream();
    ASSERT_TRUE(cs.ok());
    cpu_stream_ = *std::move(cs);
  }

  // A device copy of `bytes` on the GPU (kept alive by the fixture).
  template <typename T>
  T* Gpu(const std::vector<T>& v) {
    auto buffer = gpu_->Allocate(std::max<size_t>(1, v.size() * sizeof(T)));
    EXPECT_TRUE(buffer.ok()) << buffer.status();
    EXPECT_TRUE(
        gpu_->CopyToDevice(*gpu_stream_, buffer->data(), v.data(), v.size() * sizeof(T)).ok());
    buffers_.push_back(*std::move(buffer));
    return buffers_.back().template as<T>();
  }
  template <typename T>
  std::vector<T> FromGpu(const T* p, size_t n) {
    std::vector<T> v(n);
    EXPECT_TRUE(gpu_->CopyToHost(*gpu_stream_, v.data(), p, n * sizeof(T)).ok());
    EXPECT_TRUE(gpu_stream_->Synchronize().ok());
    return v;
  }

  CudaDeviceOptions gpu_options_;  // set before SetUp
  std::unique_ptr<Device> gpu_, cpu_;
  std::unique_ptr<Stream> gpu_stream_, cpu_stream_;
  std::vector<DeviceBuffer> buffers_;
};

// Both FP8 prefill modes of CudaDevice against CpuDevice (the block numerics of device.h).
class CudaFp8LinearTest : public CudaVsCpuTest,
                          public ::testing::WithParamInterface<CudaFp8Linear> {
 protected:
  void SetUp() override {
    gpu_options_.fp8_linear = GetParam();
    CudaVsCpuTest::SetUp();
  }
};

TEST_P(CudaFp8LinearTest, OverSeveralRowAndTokenChunksMatchesCpuWithinTheModesBound) {
  const bool blocks_mode = GetParam() == CudaFp8Linear::kBlocks;
  struct Case {
    int64_t rows, cols, n, x_pad;
  };
  const Case cases[] = {
      // Two weight row chunks (4608 rows each at most); blocks: at 70 tokens, two token chunks of
      // the block partial sums (65 tokens each at most).
      {4700, 7168, 70, 8},
      // One row chunk converted once for several token chunks (blocks: 1170 tokens each).
      {256, 7168, 1200, 4},
      // Partial column block, 520 % 16 != 0 and an odd activation stride: the one-element
      // conversion kernels.
      {300, 520, 40, 3},
      // Decode sizes (LaunchSmallLinear, the block numerics in both modes): 16 codes per lane
      // over two token groups (8 + 1), aligned and odd activation strides; one code per lane.
      {4700, 7168, 9, 8},
      {640, 1536, 16, 1},
      {300, 520, 5, 3},
  };
  for (const Case& k : cases) {
    SCOPED_TRACE(::testing::Message() << "[" << k.rows << ", " << k.cols << "] n=" << k.n);
    const int64_t rows = k.rows, cols = k.cols, n = k.n;
    const int64_t x_stride = cols + k.x_pad, y_stride = rows + 4;
    const int64_t num_blocks = (cols + 127) / 128;
    const bool blocks = blocks_mode || n <= 16;  // decode calls keep the block numerics
    const Fp8Weight w = MakeFp8(rows, cols, 1);
    const std::vector<float> x = RandomFloats(n * x_stride, 2);
    LinearWeight cpu_w{DType::kF8E4M3, w.codes.data(),  rows,      cols,
                       cols,           w.scales.data(), num_blocks};
    LinearWeight gpu_w = cpu_w;
    gpu_w.data = Gpu(w.codes);
    gpu_w.scale_inv = Gpu(w.scales);
    std::vector<float> want(n * y_stride, 0.0f);
    ASSERT_TRUE(
        cpu_->Linear(*cpu_stream_, cpu_w, x.data(), x_stride, n, want.data(), y_stride).ok());
    float* y = Gpu(std::vector<float>(n * y_stride, 0.0f));
    ASSERT_TRUE(gpu_->Linear(*gpu_stream_, gpu_w, Gpu(x), x_stride, n, y, y_stride).ok());
    const std::vector<float> got = FromGpu(y, n * y_stride);
    // Every 13th row plus the rows around the row-chunk boundary (4608) and the last row.
    std::vector<int64_t> checked = {rows - 1};
    if (rows > 4608) checked.insert(checked.end(), {4607, 4608});
    for (int64_t r = 0; r < rows; r += 13) checked.push_back(r);
    // Oracles from host data, in double, on the BF16-rounded activations x~ both devices see:
    // the exact block product sum_c w_c x~_c (w = code * scale), the same with each weight
    // rounded to BF16 (what the one-GEMM mode multiplies), and mag = sum_c |w_c x~_c|.
    // Bounds: F32 summation of K terms is within gamma = K * 2^-23 * mag whatever the order (2^-23
    // per addition allows truncating accumulators); a BF16 weight is within (2^-9 + 2^-23) |w|.
    //   blocks: both devices sum exact products in F32: the old tight 1e-5 * mag + 1e-7;
    //   bf16:   |gpu - cpu| <= (2^-9 + 2^-23) mag + gamma_K (gpu) + gamma_(K + blocks + 1)
    //           (cpu: block sums, the scaling, the sum over blocks).
    const double u_w = std::ldexp(1.0, -9) + std::ldexp(1.0, -23);
    const double gamma = static_cast<double>(2 * cols + num_blocks + 1) * std::ldexp(1.0, -23);
    double err_exact = 0.0, err_bf16w = 0.0;  // squared distances of the GPU from both oracles
    for (int64_t t = 0; t < n; ++t) {
      for (int64_t r : checked) {
        double exact = 0.0, bf16w = 0.0, mag = 0.0;
        for (int64_t c = 0; c < cols; ++c) {
          const double xv = Bf16ToFloat(FloatToBf16(x[t * x_stride + c]));
          const double wv = w.dense[r * cols + c];
          exact += wv * xv;
          bf16w += static_cast<double>(Bf16ToFloat(FloatToBf16(w.dense[r * cols + c]))) * xv;
          mag += std::abs(wv * xv);
        }
        const double g = got[t * y_stride + r];
        err_exact += (g - exact) * (g - exact);
        err_bf16w += (g - bf16w) * (g - bf16w);
        const double tol = blocks ? 1e-5 * mag + 1e-7 : (u_w + gamma) * mag;
        ASSERT_NEAR(g, want[t * y_stride + r], tol) << "t " << t << " r " << r;
      }
    }
    // The mode really is the one asked for: its oracle is orders of magnitude closer (F32
    // summation error only) than the other's (the BF16 rounding of the weights, ~2^-9).
    if (blocks) {
      EXPECT_LT(err_exact * 100, err_bf16w);
    } else {
      EXPECT_LT(err_bf16w * 100, err_exact);
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Modes, CudaFp8LinearTest,
                         ::testing::Values(CudaFp8Linear::kBf16, CudaFp8Linear::kBlocks),
                         [](const ::testing::TestParamInfo<CudaFp8Linear>& info) {
                           return std::string(info.param == CudaFp8Linear::kBlocks ? "Blocks"
                                                                                   : "Bf16");
                         });

TEST_F(CudaVsCpuTest, MoeGateAtDeepSeekShapesMatchesCpu) {
  const int64_t e = 256, hidden = 7168, n = 33, k = 8;
  std::vector<uint16_t> router(e * hidden);
  const std::vector<float> rv = RandomFloats(e * hidden, 3, 0.02f);
  for (size_t i = 0; i < router.size(); ++i) router[i] = FloatToBf16(rv[i]);
  const std::vector<float> bias = RandomFloats(e, 4, 0.05f);
  const std::vector<float> x = RandomFloats(n * hidden, 5);
  MoeGateParams p;
  p.num_experts = e;
  p.top_k = k;
  p.n_group = 8;
  p.topk_group = 4;
  p.routed_scaling_factor = 2.5f;
  std::vector<int32_t> want_ids(n * k);
  std::vector<float> want_w(n * k);
  ASSERT_TRUE(cpu_->MoeGate(*cpu_stream_, x.data(), hidden, n,
                            {DType::kBF16, router.data(), e, hidden, hidden, nullptr, 0},
                            {DType::kF32, bias.data(), e}, p, want_ids.data(), want_w.data())
                  .ok());
  int32_t* ids = Gpu(std::vector<int32_t>(n * k));
  float* weights = Gpu(std::vector<float>(n * k));
  ASSERT_TRUE(gpu_->MoeGate(*gpu_stream_, Gpu(x), hidden, n,
                            {DType::kBF16, Gpu(router), e, hidden, hidden, nullptr, 0},
                            {DType::kF32, Gpu(bias), e}, p, ids, weights)
                  .ok());
  // Both compute the logits in F32 (different summation orders): the same choices unless two
  // experts are within F32 rounding of each other, which random data does not produce.
  EXPECT_EQ(FromGpu(ids, n * k), want_ids);
  const std::vector<float> got_w = FromGpu(weights, n * k);
  for (int64_t i = 0; i < n * k; ++i) EXPECT_NEAR(got_w[i], want_w[i], 1e-5f) << i;
}

// Higham's gamma_n: the worst-case relative error of a result that went through n roundings (a sum
// of n terms in any order, products included), at a unit roundoff of 2^-23 rather than F32's
// 2^-24: tensor-core accumulation may truncate instead of rounding to nearest (one ulp per
// operation), and the bound must hold for both devices.
double Gamma(double n) {
  constexpr double kUnit = 0x1p-23;
  return n * kUnit / (1.0 - n * kUnit);
}

TEST_F(CudaVsCpuTest, MlaAtDeepSeekShapesWithFp8ProjectionsMatchesCpu) {
  // kv_lora_rank 512 + rope 64 (the kernel's 75 KB of shared memory), FP8 kv_b and W_UK^T with
  // 128-aligned heads, 64-token cache blocks; a prefill chunk and a batch of decode queries.
  //
  // Tolerances, from bounds computed on the host in double (the oracle is this test's own
  // arithmetic on the inputs, not either device):
  //  1. The latent attention u (MlaAttentionPartial with one full key range, first = true, on
  //     both devices: the same kernels as the other ops). Each device's u differs from the exact
  //     value by at most (e^{2r} - 1 + 2 gamma_{n+T+2} e^{2r}) * sum_s w_s |c_s,i| (w: the exact
  //     softmax weights, c: the latent of key s, n keys in T tiles of 16), where r bounds the
  //     relative error of each unnormalized weight: the score error E (the F32 error of
  //     q~ = W_UK^T bf16(q_nope), gamma_{dn+4} sum |W q|, carried through the dot product with the
  //     key, plus that dot product's own gamma_{D+2} sum |q~ k|, times the softmax scale), the
  //     exp error (4 ulp) and one rescaling per tile of the online softmax. A weight perturbed by
  //     at most e^{+-r} before normalization moves by at most (e^{2r} - 1) w_s after it.
  //  2. The projection. Both devices round u to BF16 before the FP8 product, so a u_i whose F32
  //     values differ in the last bits (summation order) and lie across a BF16 rounding boundary
  //     changes the output by |W_UV[j, i]| * ulp_bf16(u_i), up to 2^-7 |u_i| |W_UV[j, i]|: a
  //     fixed relative tolerance on the output is either too tight for such a flip or too loose
  //     to catch bugs. So the GPU's output is compared with the CPU's MlaProjectLatent of the
  //     GPU's own u (read back from MlaAttentionPartial: the attention kernel computes each
  //     (row, head) independently of how rows are tiled, so that u is bitwise the u inside the
  //     GPU's MlaPrefillAttention / MlaDecodeAttention): the same BF16 inputs, so only the
  //     summation differs, and each side's block-scaled sum (128 products per block, exact, then
  //     the block scale, then the sum over the blocks) is within gamma_{128 + blocks + 2} of
  //     sum_i |W_UV[j, i] bf16(u_i)|.
  //     The GPU's MlaProjectLatent of the same u is held to the same bound.
  //  3. End to end (prefill: the CPU's MlaPrefillAttention and its MlaAttentionPartial group the
  //     rows alike, so the CPU's u is bitwise its internal one): |got - want| <= sum_i
  //     |W_UV[j, i]| |bf16(u_cpu,i) - bf16(u_gpu,i)| (the rounding flips, from the two read-back
  //     u) + both summation bounds of 2.
  const int64_t nh = 4, dn = 128, dr = 64, dv = 128, rkv = 512, row = rkv + dr, block = 64;
  const Fp8Weight kv_b = MakeFp8(nh * (dn + dv), rkv, 10);
  // W_UK_h^T [rkv, dn]: the transposed codes of kv_b's W_UK rows, with transposed block scales.
  std::vector<Fp8Weight> uk(nh);
  for (int64_t h = 0; h < nh; ++h) {
    Fp8Weight& t = uk[h];
    t.rows = rkv;
    t.cols = dn;
    t.codes.resize(rkv * dn);
    for (int64_t r = 0; r < rkv; ++r) {
      for (int64_t i = 0; i < dn; ++i)
        t.codes[r * dn + i] = kv_b.codes[(h * (dn + dv) + i) * rkv + r];
    }
    t.scales.resize(rkv / 128);
    for (int64_t rb = 0; rb < rkv / 128; ++rb) {
      t.scales[rb] = kv_b.scales[(h * (dn + dv) / 128) * (rkv / 128) + rb];
    }
  }
  // kv_b's dense value (code * scale) at row r, column i; W_UK_h^T[c, k] = kv_b(h (dn+dv) + k, c).
  auto w_at = [&](int64_t r, int64_t i) { return static_cast<double>(kv_b.dense[r * rkv + i]); };
  auto bf16 = [](float v) { return static_cast<double>(Bf16ToFloat(FloatToBf16(v))); };
  const double proj_gamma = Gamma(128 + rkv / 128 + 2);
  struct Seq {
    int64_t start_pos, num_queries;
  };
  for (const bool decode : {false, true}) {
    SCOPED_TRACE(decode ? "decode" : "prefill");
    const std::vector<Seq> seqs =
        decode ? std::vector<Seq>{{0, 1}, {200, 1}, {63, 1}, {64, 1}, {1000, 1}, {5, 2}}
               : std::vector<Seq>{{50, 80}, {0, 17}};
    // Each sequence gets consecutive blocks, in reverse order (a non-trivial block table).
    std::vector<int32_t> tables;
    std::vector<MlaSegment> segments;
    int64_t rows = 0, blocks = 0;
    for (const Seq& s : seqs) {
      const int64_t nb = (s.start_pos + s.num_queries + block - 1) / block;
      segments.push_back({rows, s.num_queries, s.start_pos, static_cast<int64_t>(tables.size())});
      for (int64_t b = 0; b < nb; ++b) tables.push_back(static_cast<int32_t>(blocks + nb - 1 - b));
      blocks += nb;
      rows += s.num_queries;
    }
    const std::vector<float> pool = RandomFloats(blocks * block * row, 20);
    const int64_t q_stride = nh * (dn + dr), out_stride = nh * dv;
    const std::vector<float> q = RandomFloats(rows * q_stride, 21);
    const std::vector<MlaKeyRange> all_keys(segments.size(), MlaKeyRange{0, INT64_MAX});

    MlaAttentionArgs args;
    args.dims = {nh, dn, dr, dv, rkv, 0.1352f};
    args.q_stride = q_stride;
    args.out_stride = out_stride;
    args.segments = segments;
    args.key_ranges = all_keys;
    // CPU: host pointers.
    std::vector<LinearWeight> cpu_uk, gpu_uk;
    for (int64_t h = 0; h < nh; ++h) {
      cpu_uk.push_back({DType::kF8E4M3, uk[h].codes.data(), rkv, dn, dn, uk[h].scales.data(), 1});
      gpu_uk.push_back({DType::kF8E4M3, Gpu(uk[h].codes), rkv, dn, dn, Gpu(uk[h].scales), 1});
    }
    std::vector<float> want(rows * out_stride);
    std::vector<float> cpu_pool = pool;
    args.q = q.data();
    args.w_uk_t = cpu_uk;
    args.kv_b = {DType::kF8E4M3,     kv_b.codes.data(), nh * (dn + dv), rkv, rkv,
                 kv_b.scales.data(), rkv / 128};
    const LinearWeight cpu_kv_b = args.kv_b;
    args.cache = {cpu_pool.data(), block, block * row, row};
    args.block_tables = tables.data();
    args.out = want.data();
    ASSERT_TRUE((decode ? cpu_->MlaDecodeAttention(*cpu_stream_, args)
                        : cpu_->MlaPrefillAttention(*cpu_stream_, args))
                    .ok());
    std::vector<float> cpu_u(rows * nh * rkv), cpu_lse(rows * nh);
    ASSERT_TRUE(
        cpu_->MlaAttentionPartial(*cpu_stream_, args, {cpu_u.data(), cpu_lse.data(), true}).ok());
    // GPU: the same arguments in device memory.
    args.q = Gpu(q);
    args.w_uk_t = gpu_uk;
    args.kv_b.data = Gpu(kv_b.codes);
    args.kv_b.scale_inv = Gpu(kv_b.scales);
    args.cache.base = Gpu(pool);
    args.block_tables = Gpu(tables);
    // The GPU attention in both forms (HMOE_CUDA_MLA_ATTENTION): "tiles" computes each (row,
    // head) exactly as MlaAttentionPartial does (checks 2 and 3 rely on that: they project the
    // partial op's u); "gemm" (the default) sums in another order, checked end to end below
    // (check 4) with a bound that allows for that.
    float* out = Gpu(std::vector<float>(rows * out_stride));
    args.out = out;
    ASSERT_EQ(::setenv("HMOE_CUDA_MLA_ATTENTION", "tiles", 1), 0);
    ASSERT_TRUE((decode ? gpu_->MlaDecodeAttention(*gpu_stream_, args)
                        : gpu_->MlaPrefillAttention(*gpu_stream_, args))
                    .ok());
    const std::vector<float> got = FromGpu(out, rows * out_stride);
    ASSERT_EQ(::setenv("HMOE_CUDA_MLA_ATTENTION", "gemm", 1), 0);
    ASSERT_TRUE((decode ? gpu_->MlaDecodeAttention(*gpu_stream_, args)
                        : gpu_->MlaPrefillAttention(*gpu_stream_, args))
                    .ok());
    const std::vector<float> got_gemm = FromGpu(out, rows * out_stride);
    ASSERT_EQ(::unsetenv("HMOE_CUDA_MLA_ATTENTION"), 0);
    float* gpu_u_dev = Gpu(std::vector<float>(rows * nh * rkv));
    float* gpu_lse_dev = Gpu(std::vector<float>(rows * nh));
    ASSERT_TRUE(gpu_->MlaAttentionPartial(*gpu_stream_, args, {gpu_u_dev, gpu_lse_dev, true}).ok());
    const std::vector<float> gpu_u = FromGpu(gpu_u_dev, rows * nh * rkv);
    // The CPU's projection of the GPU's u, and the GPU's own MlaProjectLatent of it.
    std::vector<float> ref(rows * out_stride);
    ASSERT_TRUE(cpu_->MlaProjectLatent(*cpu_stream_, args.dims, cpu_kv_b, gpu_u.data(), rows,
                                       ref.data(), out_stride)
                    .ok());
    float* proj_dev = Gpu(std::vector<float>(rows * out_stride));
    ASSERT_TRUE(gpu_->MlaProjectLatent(*gpu_stream_, args.dims, args.kv_b, gpu_u_dev, rows,
                                       proj_dev, out_stride)
                    .ok());
    const std::vector<float> proj = FromGpu(proj_dev, rows * out_stride);

    const double scale = args.dims.softmax_scale;
    double worst_u = 0.0, worst_proj = 0.0, worst_end = 0.0;  // largest |difference| / bound
    double worst_gemm = 0.0;
    double max_end_diff = 0.0;
    for (const MlaSegment& seg : segments) {
      for (int64_t qi = 0; qi < seg.num_queries; ++qi) {
        const int64_t t = seg.query_begin + qi;
        const int64_t nk = seg.start_pos + qi + 1;  // keys 0 .. pos
        std::vector<const float*> keys(nk);
        for (int64_t s = 0; s < nk; ++s) {
          keys[s] = pool.data() +
                    (static_cast<int64_t>(tables[seg.block_table_offset + s / block]) * block +
                     s % block) *
                        row;
        }
        for (int64_t h = 0; h < nh; ++h) {
          SCOPED_TRACE(::testing::Message() << "row " << t << " head " << h);
          const float* qt = q.data() + t * q_stride + h * (dn + dr);
          // 1. q~ exactly, and a bound on each device's error in it.
          std::vector<double> qt_exact(rkv), qt_err(rkv);
          for (int64_t c = 0; c < rkv; ++c) {
            double sum = 0.0, mag = 0.0;
            for (int64_t k = 0; k < dn; ++k) {
              const double p = w_at(h * (dn + dv) + k, c) * bf16(qt[k]);
              sum += p;
              mag += std::abs(p);
            }
            qt_exact[c] = sum;
            qt_err[c] = Gamma(dn + 4) * mag;
          }
          std::vector<double> w(nk);
          double max_score = -INFINITY, max_err = 0.0;
          for (int64_t s = 0; s < nk; ++s) {
            double dot = 0.0, mag = 0.0, carried = 0.0;
            for (int64_t c = 0; c < rkv; ++c) {
              dot += qt_exact[c] * keys[s][c];
              mag += (std::abs(qt_exact[c]) + qt_err[c]) * std::abs(keys[s][c]);
              carried += qt_err[c] * std::abs(keys[s][c]);
            }
            for (int64_t c = 0; c < dr; ++c) {
              dot += static_cast<double>(qt[dn + c]) * keys[s][rkv + c];
              mag += std::abs(static_cast<double>(qt[dn + c]) * keys[s][rkv + c]);
            }
            w[s] = scale * dot;
            max_score = std::max(max_score, w[s]);
            max_err = std::max(max_err, scale * (carried + Gamma(row + 2) * mag));
          }
          double total = 0.0;
          for (double& v : w) total += (v = std::exp(v - max_score));
          for (double& v : w) v /= total;
          const double tiles = static_cast<double>(nk / 16 + 2);
          const double exp_err = 4 * 0x1p-23;
          const double r = max_err + exp_err + tiles * (exp_err + 0x1p-23);
          const double factor =
              std::expm1(2 * r) + 2 * Gamma(static_cast<double>(nk) + tiles + 2) * std::exp(2 * r);
          const float* ucpu = cpu_u.data() + (t * nh + h) * rkv;
          const float* ugpu = gpu_u.data() + (t * nh + h) * rkv;
          // Check 4 (gemm form): its u is within u_bound[c] of the CPU's (the bound of check 1
          // holds for any summation order and fewer rescales), so BF16(u) lies between the
          // roundings of the interval's ends (rounding is monotone).
          std::vector<double> u_lo(rkv), u_hi(rkv);
          for (int64_t c = 0; c < rkv; ++c) {
            double mag = 0.0;
            for (int64_t s = 0; s < nk; ++s) mag += w[s] * std::abs(keys[s][c]);
            const double bound = 2 * factor * mag;  // both devices
            const double lo_exact = ucpu[c] - bound, hi_exact = ucpu[c] + bound;
            float lo = static_cast<float>(lo_exact), hi = static_cast<float>(hi_exact);
            if (lo > lo_exact) lo = std::nextafter(lo, -INFINITY);
            if (hi < hi_exact) hi = std::nextafter(hi, INFINITY);
            u_lo[c] = bf16(lo);
            u_hi[c] = bf16(hi);
            const double diff = std::abs(static_cast<double>(ugpu[c]) - ucpu[c]);
            ASSERT_LE(diff, bound) << "u dim " << c << ": gpu " << ugpu[c] << " cpu " << ucpu[c];
            worst_u = std::max(worst_u, diff / bound);
          }
          // 2 and 3: the projection.
          for (int64_t j = 0; j < dv; ++j) {
            const int64_t wr = h * (dn + dv) + dn + j;
            double mag_gpu = 0.0, mag_cpu = 0.0, flips = 0.0;
            for (int64_t c = 0; c < rkv; ++c) {
              const double a = std::abs(w_at(wr, c));
              mag_gpu += a * std::abs(bf16(ugpu[c]));
              mag_cpu += a * std::abs(bf16(ucpu[c]));
              flips += a * std::abs(bf16(ugpu[c]) - bf16(ucpu[c]));
            }
            const int64_t o = t * out_stride + h * dv + j;
            const double proj_bound = 2 * proj_gamma * mag_gpu;
            const double proj_diff = std::abs(static_cast<double>(got[o]) - ref[o]);
            ASSERT_LE(proj_diff, proj_bound) << "output " << j << ": gpu " << got[o]
                                             << ", cpu projection of the gpu's u " << ref[o];
            worst_proj = std::max(worst_proj, proj_diff / proj_bound);
            ASSERT_LE(std::abs(static_cast<double>(proj[o]) - ref[o]), proj_bound)
                << "output " << j << ": gpu MlaProjectLatent " << proj[o] << ", cpu " << ref[o];
            if (!decode) {
              // 4. The gemm form end to end: the BF16 u it projects is within [u_lo, u_hi].
              double gemm_flips = 0.0, gemm_mag = 0.0;
              for (int64_t c = 0; c < rkv; ++c) {
                const double a = std::abs(w_at(wr, c));
                const double b = bf16(ucpu[c]);
                gemm_flips += a * std::max(u_hi[c] - b, b - u_lo[c]);
                gemm_mag += a * std::max(std::abs(u_lo[c]), std::abs(u_hi[c]));
              }
              const double gemm_bound = gemm_flips + proj_gamma * (gemm_mag + mag_cpu);
              const double gemm_diff = std::abs(static_cast<double>(got_gemm[o]) - want[o]);
              ASSERT_LE(gemm_diff, gemm_bound)
                  << "output " << j << ": gpu (gemm form) " << got_gemm[o] << ", cpu " << want[o];
              worst_gemm = std::max(worst_gemm, gemm_diff / gemm_bound);
              const double end_bound = flips + proj_gamma * (mag_gpu + mag_cpu);
              const double end_diff = std::abs(static_cast<double>(got[o]) - want[o]);
              ASSERT_LE(end_diff, end_bound)
                  << "output " << j << ": gpu " << got[o] << ", cpu " << want[o];
              worst_end = std::max(worst_end, end_diff / end_bound);
              max_end_diff = std::max(max_end_diff, end_diff);
            }
          }
        }
      }
    }
    // The margins, for the record (a ratio near 1 means the bound is tight for this data).
    std::printf(
        "%s: largest |diff| / bound: u %.3g, projection %.3g, end to end %.3g (largest "
        "end-to-end |diff| %.3g), gemm form end to end %.3g\n",
        decode ? "decode" : "prefill", worst_u, worst_proj, worst_end, max_end_diff, worst_gemm);
  }
}

}  // namespace
}  // namespace hmoe
