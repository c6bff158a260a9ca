#include "common/kernels/cpu/fp8_gemv.h"

#include <cpuid.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <cerrno>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <string>

#include "absl/strings/str_cat.h"

#include "common/base/logging.h"
#include "common/kernels/cpu/fp8_gemv_internal.h"
#include "common/kernels/shared_math.h"

namespace hmoe::cpu {
namespace {

constexpr int64_t kScaleBlock = 128;

int64_t CeilDiv(int64_t a, int64_t b) { return (a + b - 1) / b; }
int64_t RoundUp(int64_t a, int64_t b) { return CeilDiv(a, b) * b; }

bool CpuHasAvx2() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
         __builtin_cpu_supports("f16c");
}

bool CpuHasAvx512() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512vbmi");
}

bool CpuHasAvx512Bf16() { return CpuHasAvx512() && __builtin_cpu_supports("avx512bf16"); }

// AMX-TILE and AMX-BF16 in cpuid leaf 7 (EDX bits 24 and 22), plus the OS's permission to use the
// tile data state (Linux >= 5.16 grants it per process on request). Asked once per process.
bool CpuHasAmx() {
  static const bool kAmx = [] {
    if (!CpuHasAvx512Bf16()) return false;
    unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
    if (__get_cpuid_count(7, 0, &eax, &ebx, &ecx, &edx) == 0) return false;
    if ((edx & (1u << 24)) == 0 || (edx & (1u << 22)) == 0) return false;
#if defined(__linux__) && defined(SYS_arch_prctl)
    constexpr int kArchReqXcompPerm = 0x1023;
    constexpr int kXfeatureXtiledata = 18;
    if (syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) != 0) {
      HMOE_LOG(INFO) << "cpu kernels: the CPU has AMX but the OS refused the tile state ("
                     << std::strerror(errno) << "); not using amx";
      return false;
    }
    return true;
#else
    return false;
#endif
  }();
  return kAmx;
}

constexpr CpuIsa kAllIsas[] = {CpuIsa::kScalar, CpuIsa::kAvx2, CpuIsa::kAvx512, CpuIsa::kAvx512Bf16,
                               CpuIsa::kAmx};

// The reference: plain loops over the definition in the header, F32 activations rounded to BF16
// in natural order.
class ScalarFp8Gemv final : public Fp8Gemv {
 public:
  ScalarFp8Gemv() {
    for (int i = 0; i < 256; ++i) table_[i] = kernels::Fp8E4M3ToFloatBits(static_cast<uint8_t>(i));
  }

  CpuIsa isa() const override { return CpuIsa::kScalar; }

  int64_t PackedBytes(int64_t k) const override {
    const int64_t bytes = RoundUp(k, kPackGroup) * static_cast<int64_t>(sizeof(float));
    // Pad to 4 * odd cache lines: then the packed tokens of a batch, read side by side, fall into
    // different L1 sets (a multiple of 4 KiB would put them all in the same few sets).
    int64_t lines = (bytes + 63) / 64;
    lines = (lines + 3) / 4 * 4;
    if (lines % 8 == 0) lines += 4;
    return lines * 64;
  }

  void Pack(const float* x, int64_t k, int64_t k_begin, int64_t k_end,
            std::byte* packed) const override {
    HMOE_CHECK(k_begin % kPackGroup == 0 && k_begin <= k_end && k_end <= k);
    float* out = reinterpret_cast<float*>(packed);
    for (int64_t i = k_begin; i < k_end; ++i) {
      out[i] = kernels::Bf16BitsToFloat(kernels::FloatToBf16Bits(x[i - k_begin]));
    }
    if (k_end == k) {
      for (int64_t i = k; i < RoundUp(k, kPackGroup); ++i) out[i] = 0.0f;
      const int64_t used = RoundUp(k, kPackGroup) * static_cast<int64_t>(sizeof(float));
      std::memset(packed + used, 0, PackedBytes(k) - used);
    }
  }

  void MatVec(const Fp8MatrixView& w, const std::byte* packed, int64_t packed_stride, int n,
              int64_t m_begin, int64_t m_end, float* y, int64_t y_stride) const override {
    HMOE_CHECK(n >= 1 && n <= kMaxMatVecTokens);
    HMOE_CHECK(0 <= m_begin && m_begin <= m_end && m_end <= w.rows);
    for (int t = 0; t < n; ++t) {
      const float* x = reinterpret_cast<const float*>(packed + t * packed_stride);
      for (int64_t m = m_begin; m < m_end; ++m) {
        const uint8_t* row = w.data + m * w.row_stride;
        const float* scales = w.scale_inv + (m / kScaleBlock) * w.scale_stride;
        float total = 0.0f;
        for (int64_t k0 = 0; k0 < w.cols; k0 += kScaleBlock) {
          const int64_t k1 = std::min(w.cols, k0 + kScaleBlock);
          float block = 0.0f;
          for (int64_t k = k0; k < k1; ++k) block += table_[row[k]] * x[k];
          total += block * scales[k0 / kScaleBlock];
        }
        y[t * y_stride + (m - m_begin)] = total;
      }
    }
  }

 private:
  std::array<float, 256> table_;
};

}  // namespace

std::string_view CpuIsaName(CpuIsa isa) {
  switch (isa) {
    case CpuIsa::kScalar:
      return "scalar";
    case CpuIsa::kAvx2:
      return "avx2";
    case CpuIsa::kAvx512:
      return "avx512";
    case CpuIsa::kAvx512Bf16:
      return "avx512bf16";
    case CpuIsa::kAmx:
      return "amx";
  }
  return "?";
}

bool CpuSupports(CpuIsa isa) {
  switch (isa) {
    case CpuIsa::kScalar:
      return true;
    case CpuIsa::kAvx2:
      return CpuHasAvx2();
    case CpuIsa::kAvx512:
      return CpuHasAvx512();
    case CpuIsa::kAvx512Bf16:
      return CpuHasAvx512Bf16();
    case CpuIsa::kAmx:
      return CpuHasAmx();
  }
  return false;
}

namespace {

CpuIsa SelectCpuIsa() {
  CpuIsa best = CpuIsa::kScalar;
  for (CpuIsa isa : kAllIsas) {
    if (CpuSupports(isa)) best = isa;
  }
  const char* env = std::getenv("HMOE_CPU_ISA");
  CpuIsa chosen = best;
  if (env != nullptr && *env != '\0') {
    bool honored = false;
    for (CpuIsa isa : kAllIsas) {
      if (CpuIsaName(isa) == env) {
        if (CpuSupports(isa) && static_cast<int>(isa) <= static_cast<int>(best)) {
          chosen = isa;
          honored = true;
        }
        break;
      }
    }
    if (!honored) {
      HMOE_LOG(WARNING) << "HMOE_CPU_ISA=" << env << " is unknown or not supported here; using "
                        << CpuIsaName(best);
    }
  }
  // Once per process: which kernels every CPU kernel family (FP8 and BF16 GEMV, F32 ops) uses.
  HMOE_LOG(INFO) << "cpu kernels: " << CpuIsaName(chosen) << " (this CPU supports up to "
                 << CpuIsaName(best) << (chosen != best ? ", lowered by HMOE_CPU_ISA)" : ")");
  return chosen;
}

}  // namespace

CpuIsa BestCpuIsa() {
  static const CpuIsa kIsa = SelectCpuIsa();
  return kIsa;
}

Fp8MatrixView Fp8MatrixView::Dense(const uint8_t* data, const float* scale_inv, int64_t rows,
                                   int64_t cols) {
  Fp8MatrixView v;
  v.data = data;
  v.rows = rows;
  v.cols = cols;
  v.row_stride = cols;
  v.scale_inv = scale_inv;
  v.scale_stride = CeilDiv(cols, kScaleBlock);
  return v;
}

Fp8MatrixView Fp8MatrixView::RowSlice(int64_t begin, int64_t end) const {
  HMOE_CHECK(begin % kScaleBlock == 0 && 0 <= begin && begin <= end && end <= rows)
      << "rows [" << begin << ", " << end << ") of " << rows;
  Fp8MatrixView v = *this;
  v.data = data + begin * row_stride;
  v.rows = end - begin;
  v.scale_inv = scale_inv + (begin / kScaleBlock) * scale_stride;
  return v;
}

Fp8MatrixView Fp8MatrixView::ColSlice(int64_t begin, int64_t end) const {
  HMOE_CHECK(begin % kScaleBlock == 0 && 0 <= begin && begin <= end && end <= cols)
      << "cols [" << begin << ", " << end << ") of " << cols;
  Fp8MatrixView v = *this;
  v.data = data + begin;
  v.cols = end - begin;
  v.scale_inv = scale_inv + begin / kScaleBlock;
  return v;
}

Fp8Gemv::Fp8Gemv() = default;
Fp8Gemv::~Fp8Gemv() = default;

void Fp8Gemv::GateUpSilu(const Fp8MatrixView& gate, const Fp8MatrixView& up,
                         const std::byte* packed, int64_t packed_stride, int n, int64_t m_begin,
                         int64_t m_end, std::byte* h_packed, int64_t h_packed_stride,
                         float* h_float, int64_t h_float_stride) const {
  HMOE_CHECK(gate.rows == up.rows && gate.cols == up.cols);
  HMOE_CHECK(m_begin % kPackGroup == 0 && 0 <= m_begin && m_begin <= m_end && m_end <= gate.rows);
  HMOE_CHECK(n >= 1 && n <= kMaxMatVecTokens);
  // Gate and up are read in chunks of rows so each is one long sequential stream for the
  // prefetcher; the chunk's results stay in L1.
  constexpr int64_t kChunk = 256;
  alignas(64) float g[kMaxMatVecTokens * kChunk];
  alignas(64) float u[kMaxMatVecTokens * kChunk];
  for (int64_t m0 = m_begin; m0 < m_end; m0 += kChunk) {
    const int64_t m1 = std::min(m_end, m0 + kChunk);
    MatVec(gate, packed, packed_stride, n, m0, m1, g, kChunk);
    MatVec(up, packed, packed_stride, n, m0, m1, u, kChunk);
    for (int t = 0; t < n; ++t) {
      float* gt = g + t * kChunk;
      SiluMul(gt, u + t * kChunk, m1 - m0, gt);
      Pack(gt, gate.rows, m0, m1, h_packed + t * h_packed_stride);
      if (h_float != nullptr) {
        std::memcpy(h_float + t * h_float_stride + (m0 - m_begin), gt, (m1 - m0) * sizeof(float));
      }
    }
  }
}

void Fp8Gemv::GemmRows(const Fp8MatrixView& w, const std::byte* packed, int64_t packed_stride,
                       int64_t n, int64_t m_begin, int64_t m_end, float* y,
                       int64_t y_stride) const {
  HMOE_CHECK(n >= 1);
  HMOE_CHECK(0 <= m_begin && m_begin <= m_end && m_end <= w.rows);
  // A block of rows small enough to stay in L2 (1-2 MiB on current cores) while every group of
  // tokens passes over it; a multiple of 16 rows so tiles stay whole.
  const int64_t block_rows =
      std::clamp<int64_t>((256 * 1024 / std::max<int64_t>(w.cols, 1)) / 16 * 16, 16, 128);
  for (int64_t r0 = m_begin; r0 < m_end; r0 += block_rows) {
    const int64_t r1 = std::min(m_end, r0 + block_rows);
    for (int64_t t0 = 0; t0 < n; t0 += kMaxMatVecTokens) {
      const int nt = static_cast<int>(std::min<int64_t>(kMaxMatVecTokens, n - t0));
      MatVec(w, packed + t0 * packed_stride, packed_stride, nt, r0, r1,
             y + t0 * y_stride + (r0 - m_begin), y_stride);
    }
  }
}

absl::StatusOr<std::unique_ptr<Fp8Gemv>> NewFp8Gemv(CpuIsa isa, const Fp8GemvOptions& options) {
  if (!CpuSupports(isa)) {
    return absl::UnavailableError(
        absl::StrCat("cpu kernels ", std::string(CpuIsaName(isa)), ": not supported by this CPU"));
  }
  switch (isa) {
    case CpuIsa::kScalar:
      return std::unique_ptr<Fp8Gemv>(internal::NewScalarFp8Gemv());
    case CpuIsa::kAvx2:
      return std::unique_ptr<Fp8Gemv>(internal::NewAvx2Fp8Gemv(
          !options.prefetch             ? -1
          : options.prefetch_bytes >= 0 ? options.prefetch_bytes
                                        : internal::kAvx2DefaultPrefetchBytes));
    case CpuIsa::kAvx512:
    case CpuIsa::kAvx512Bf16:
    case CpuIsa::kAmx: {
      Fp8GemvOptions resolved = options;
      if (resolved.prefetch_bytes < 0) {
        resolved.prefetch_bytes = internal::kAvx512DefaultPrefetchBytes;
      }
      if (isa == CpuIsa::kAmx) return std::unique_ptr<Fp8Gemv>(internal::NewAmxFp8Gemv(resolved));
      return std::unique_ptr<Fp8Gemv>(isa == CpuIsa::kAvx512
                                          ? internal::NewAvx512Fp8Gemv(resolved)
                                          : internal::NewAvx512Bf16Fp8Gemv(resolved));
    }
  }
  return absl::InvalidArgumentError("cpu kernels: unknown isa");
}

const Fp8Gemv& DefaultFp8Gemv() {
  static const Fp8Gemv* const kDefault = [] {
    absl::StatusOr<std::unique_ptr<Fp8Gemv>> gemv = NewFp8Gemv(BestCpuIsa());
    HMOE_CHECK_OK(gemv.status());
    return gemv->release();
  }();
  return *kDefault;
}

void SiluMul(const float* gate, const float* up, int64_t n, float* out) {
  for (int64_t i = 0; i < n; ++i) out[i] = kernels::SiluMul(gate[i], up[i]);
}

namespace internal {
Fp8Gemv* NewScalarFp8Gemv() { return new ScalarFp8Gemv(); }

int& AmxLoadedConfig() {
  thread_local int loaded = 0;
  return loaded;
}

namespace {
// A per-thread 64-byte aligned buffer that grows on demand.
struct AmxThreadScratch {
  std::byte* data = nullptr;
  int64_t size = 0;
  ~AmxThreadScratch() { std::free(data); }
};
}  // namespace

std::byte* AmxScratch(int64_t bytes) {
  thread_local AmxThreadScratch scratch;
  if (bytes > scratch.size) {
    std::free(scratch.data);
    scratch.size = std::max<int64_t>(4096, CeilDiv(bytes, 4096) * 4096);
    scratch.data =
        static_cast<std::byte*>(std::aligned_alloc(64, static_cast<size_t>(scratch.size)));
    HMOE_CHECK(scratch.data != nullptr) << "amx scratch of " << scratch.size << " bytes";
  }
  return scratch.data;
}
}  // namespace internal

}  // namespace hmoe::cpu
