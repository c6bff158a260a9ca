#include "common/kernels/cpu/quant_gemv.h"

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <string>

#include "absl/strings/str_cat.h"

#include "common/base/logging.h"
#include "common/kernels/cpu/quant_gemv_internal.h"
#include "common/kernels/shared_math.h"

namespace hmoe::cpu {
namespace {

using kernels::F16BitsToFloat;

// Block layouts (MODEL-SPEC 5.4; the same as common/model/gguf_quants.h, which this library does
// not link).
struct Q8_0 {
  uint16_t d;
  int8_t qs[32];
};
struct Q5_0 {
  uint16_t d;
  uint8_t qh[4];
  uint8_t qs[16];
};
struct Q4_K {
  uint16_t d;
  uint16_t dmin;
  uint8_t scales[12];
  uint8_t qs[128];
};
struct Q5_K {
  uint16_t d;
  uint16_t dmin;
  uint8_t scales[12];
  uint8_t qh[32];
  uint8_t qs[128];
};
struct Q6_K {
  uint8_t ql[128];
  uint8_t qh[64];
  int8_t scales[16];
  uint16_t d;
};
static_assert(sizeof(Q8_0) == 34 && sizeof(Q5_0) == 22 && sizeof(Q4_K) == 144 &&
              sizeof(Q5_K) == 176 && sizeof(Q6_K) == 210);

struct TypeInfo {
  int64_t block = 0;
  int64_t bytes = 0;
  const char* name = "";
};

TypeInfo InfoOf(uint32_t type) {
  switch (type) {
    case kGgmlQ5_0:
      return {32, 22, "Q5_0"};
    case kGgmlQ8_0:
      return {32, 34, "Q8_0"};
    case kGgmlQ4_K:
      return {256, 144, "Q4_K"};
    case kGgmlQ5_K:
      return {256, 176, "Q5_K"};
    case kGgmlQ6_K:
      return {256, 210, "Q6_K"};
    default:
      return {};
  }
}

// The 6-bit scale and min of sub-block j of a Q4_K / Q5_K block (MODEL-SPEC 5.4).
void ScaleMinK4(const uint8_t* s, int j, int* sc, int* m) {
  if (j < 4) {
    *sc = s[j] & 63;
    *m = s[j + 4] & 63;
  } else {
    *sc = (s[j + 4] & 15) | ((s[j - 4] >> 6) << 4);
    *m = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
  }
}

// One row of each type dotted with one Q8_K vector: integer sums per block, F32 scales.
float DotQ4K(const uint8_t* row, int64_t cols, const BlockQ8K* x) {
  float sum = 0.0f;
  for (int64_t b = 0; b < cols / 256; ++b) {
    Q4_K blk;
    std::memcpy(&blk, row + b * sizeof(Q4_K), sizeof(blk));
    const BlockQ8K& a = x[b];
    int32_t isum = 0, msum = 0;
    for (int j = 0; j < 8; ++j) {
      int sc, m;
      ScaleMinK4(blk.scales, j, &sc, &m);
      const int c = j / 2, shift = (j % 2) * 4;
      int32_t dot = 0;
      for (int l = 0; l < 32; ++l) dot += ((blk.qs[32 * c + l] >> shift) & 15) * a.qs[32 * j + l];
      isum += sc * dot;
      msum += m * (a.bsums[2 * j] + a.bsums[2 * j + 1]);
    }
    sum += F16BitsToFloat(blk.d) * a.d * static_cast<float>(isum) -
           F16BitsToFloat(blk.dmin) * a.d * static_cast<float>(msum);
  }
  return sum;
}

float DotQ5K(const uint8_t* row, int64_t cols, const BlockQ8K* x) {
  float sum = 0.0f;
  for (int64_t b = 0; b < cols / 256; ++b) {
    Q5_K blk;
    std::memcpy(&blk, row + b * sizeof(Q5_K), sizeof(blk));
    const BlockQ8K& a = x[b];
    int32_t isum = 0, msum = 0;
    for (int j = 0; j < 8; ++j) {
      int sc, m;
      ScaleMinK4(blk.scales, j, &sc, &m);
      const int c = j / 2, shift = (j % 2) * 4;
      int32_t dot = 0;
      for (int l = 0; l < 32; ++l) {
        const int q = ((blk.qs[32 * c + l] >> shift) & 15) | (((blk.qh[l] >> j) & 1) << 4);
        dot += q * a.qs[32 * j + l];
      }
      isum += sc * dot;
      msum += m * (a.bsums[2 * j] + a.bsums[2 * j + 1]);
    }
    sum += F16BitsToFloat(blk.d) * a.d * static_cast<float>(isum) -
           F16BitsToFloat(blk.dmin) * a.d * static_cast<float>(msum);
  }
  return sum;
}

float DotQ6K(const uint8_t* row, int64_t cols, const BlockQ8K* x) {
  float sum = 0.0f;
  for (int64_t b = 0; b < cols / 256; ++b) {
    Q6_K blk;
    std::memcpy(&blk, row + b * sizeof(Q6_K), sizeof(blk));
    const BlockQ8K& a = x[b];
    int32_t isum = 0;
    for (int i = 0; i < 256; i += 16) {
      // Weight i + l (l < 16): half n = i / 128, within it position p = i % 128 + l:
      // low nibble of ql[64n + p % 64] when p < 64, else its high nibble; two bits of
      // qh[32n + p % 32] at 2 * (p / 32).
      int32_t dot = 0;
      for (int l = 0; l < 16; ++l) {
        const int n = i / 128, p = i % 128 + l;
        const int lo = (blk.ql[64 * n + p % 64] >> (p < 64 ? 0 : 4)) & 15;
        const int hi = (blk.qh[32 * n + p % 32] >> (2 * (p / 32))) & 3;
        dot += ((lo | (hi << 4)) - 32) * a.qs[i + l];
      }
      isum += blk.scales[i / 16] * dot;
    }
    sum += F16BitsToFloat(blk.d) * a.d * static_cast<float>(isum);
  }
  return sum;
}

float DotQ8_0(const uint8_t* row, int64_t cols, const BlockQ8K* x) {
  float sum = 0.0f;
  for (int64_t b = 0; b < cols / 32; ++b) {
    Q8_0 blk;
    std::memcpy(&blk, row + b * sizeof(Q8_0), sizeof(blk));
    const BlockQ8K& a = x[b / 8];
    const int8_t* xq = a.qs + (b % 8) * 32;
    int32_t dot = 0;
    for (int l = 0; l < 32; ++l) dot += blk.qs[l] * xq[l];
    sum += F16BitsToFloat(blk.d) * a.d * static_cast<float>(dot);
  }
  return sum;
}

float DotQ5_0(const uint8_t* row, int64_t cols, const BlockQ8K* x) {
  float sum = 0.0f;
  for (int64_t b = 0; b < cols / 32; ++b) {
    Q5_0 blk;
    std::memcpy(&blk, row + b * sizeof(Q5_0), sizeof(blk));
    uint32_t qh;
    std::memcpy(&qh, blk.qh, sizeof(qh));
    const BlockQ8K& a = x[b / 8];
    const int8_t* xq = a.qs + (b % 8) * 32;
    int32_t dot = 0;
    for (int l = 0; l < 16; ++l) {
      const int lo = (blk.qs[l] & 15) | (((qh >> l) & 1) << 4);
      const int hi = (blk.qs[l] >> 4) | (((qh >> (l + 16)) & 1) << 4);
      dot += (lo - 16) * xq[l] + (hi - 16) * xq[l + 16];
    }
    sum += F16BitsToFloat(blk.d) * a.d * static_cast<float>(dot);
  }
  return sum;
}

using DotFn = float (*)(const uint8_t*, int64_t, const BlockQ8K*);

DotFn DotOf(uint32_t type) {
  switch (type) {
    case kGgmlQ4_K:
      return DotQ4K;
    case kGgmlQ5_K:
      return DotQ5K;
    case kGgmlQ6_K:
      return DotQ6K;
    case kGgmlQ8_0:
      return DotQ8_0;
    case kGgmlQ5_0:
      return DotQ5_0;
    default:
      return nullptr;
  }
}

// The reference: plain loops over the definitions above.
class ScalarQuantGemv final : public QuantGemv {
 public:
  CpuIsa isa() const override { return CpuIsa::kScalar; }
  void MatVec(const QuantMatrixView& w, const BlockQ8K* x, int64_t x_stride, int n, int64_t m_begin,
              int64_t m_end, float* y, int64_t y_stride) const override {
    internal::ScalarQuantMatVec(w, x, x_stride, n, m_begin, m_end, y, y_stride);
  }
};

bool CpuHasAvx512Vnni() {
  __builtin_cpu_init();
  return CpuSupports(CpuIsa::kAvx512) && __builtin_cpu_supports("avx512vnni") &&
         __builtin_cpu_supports("gfni");
}

}  // namespace

namespace internal {

QuantGemv* NewScalarQuantGemv() { return new ScalarQuantGemv(); }

void CheckQuantMatVecArgs(const QuantMatrixView& w, int64_t x_stride, int n, int64_t m_begin,
                          int64_t m_end) {
  HMOE_CHECK(n >= 1 && n <= kMaxMatVecTokens) << n << " tokens";
  HMOE_CHECK(0 <= m_begin && m_begin <= m_end && m_end <= w.rows)
      << "rows [" << m_begin << ", " << m_end << ") of " << w.rows;
  const TypeInfo info = InfoOf(w.type);
  HMOE_CHECK(info.block != 0 && w.cols > 0 && w.cols % info.block == 0)
      << "ggml type " << w.type << ", " << w.cols << " columns";
  HMOE_CHECK(x_stride >= Q8KBlocks(w.cols) || n == 1) << "x_stride " << x_stride;
}

void ScalarQuantMatVec(const QuantMatrixView& w, const BlockQ8K* x, int64_t x_stride, int n,
                       int64_t m_begin, int64_t m_end, float* y, int64_t y_stride) {
  CheckQuantMatVecArgs(w, x_stride, n, m_begin, m_end);
  const DotFn dot = DotOf(w.type);
  for (int t = 0; t < n; ++t) {
    for (int64_t m = m_begin; m < m_end; ++m) {
      y[t * y_stride + (m - m_begin)] = dot(w.data + m * w.row_stride, w.cols, x + t * x_stride);
    }
  }
}

}  // namespace internal

bool QuantGemvSupportsType(uint32_t type) { return InfoOf(type).block != 0; }

void QuantizeQ8KReference(const float* x, int64_t k, BlockQ8K* out) {
  for (int64_t b = 0; b < Q8KBlocks(k); ++b) {
    const float* v = x + b * kQ8KBlockSize;
    const int64_t len = std::min<int64_t>(kQ8KBlockSize, k - b * kQ8KBlockSize);
    BlockQ8K& blk = out[b];
    float amax = 0.0f;
    bool nan = false;
    for (int64_t i = 0; i < len; ++i) {
      nan = nan || std::isnan(v[i]);
      amax = std::max(amax, std::fabs(v[i]));
    }
    std::memset(blk.qs, 0, sizeof(blk.qs));
    if (nan) {
      // Deterministic instead of undefined (a NaN cast to int8): the block dots to NaN.
      blk.d = std::numeric_limits<float>::quiet_NaN();
    } else if (std::isinf(amax)) {
      // The infinities as +-127 at d = inf, the finite values 0: dots are +-inf (or NaN where
      // weights cancel them), as F32 arithmetic would give.
      blk.d = amax;
      for (int64_t i = 0; i < len; ++i) {
        if (std::isinf(v[i])) blk.qs[i] = static_cast<int8_t>(v[i] > 0 ? 127 : -127);
      }
    } else if (amax == 0.0f) {
      blk.d = 0.0f;
    } else {
      blk.d = amax / 127.0f;
      const float iscale = 127.0f / amax;
      for (int64_t i = 0; i < len; ++i) {
        // |x * iscale| <= 127 up to one rounding; the clamp keeps an overshoot to 127. An amax
        // below 127 / FLT_MAX (subnormal) overflows iscale: then the quotient in double.
        const float q =
            std::isinf(iscale)
                ? static_cast<float>(std::nearbyint(static_cast<double>(v[i]) * 127.0 / amax))
                : std::nearbyint(v[i] * iscale);
        blk.qs[i] = static_cast<int8_t>(std::clamp(q, -127.0f, 127.0f));
      }
    }
    for (int j = 0; j < 16; ++j) {
      int sum = 0;
      for (int i = 0; i < 16; ++i) sum += blk.qs[16 * j + i];
      blk.bsums[j] = static_cast<int16_t>(sum);
    }
  }
}

void QuantizeQ8K(const float* x, int64_t k, BlockQ8K* out) {
  // The AVX-512 quantizer where the quantized kernels run AVX-512 (not under HMOE_CPU_ISA=avx2,
  // which stands for a CPU without it); bitwise the same blocks either way.
  static const bool kAvx512 = DefaultQuantGemv().isa() == CpuIsa::kAvx512;
  if (kAvx512) {
    internal::QuantizeQ8KAvx512(x, k, out);
  } else {
    QuantizeQ8KReference(x, k, out);
  }
}

int64_t QuantRowBytes(uint32_t type, int64_t cols) {
  const TypeInfo info = InfoOf(type);
  HMOE_CHECK(info.block != 0 && cols % info.block == 0) << "ggml type " << type << ", " << cols;
  return cols / info.block * info.bytes;
}

absl::StatusOr<QuantMatrixView> MakeQuantMatrixView(uint32_t type, const void* data, int64_t rows,
                                                    int64_t cols) {
  const TypeInfo info = InfoOf(type);
  if (info.block == 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("quantized GEMV: ggml type ", type,
                     " is not supported (supported: Q4_K, Q5_K, Q6_K, Q8_0, "
                     "Q5_0)"));
  }
  if (cols <= 0 || cols % info.block != 0 || rows < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("quantized GEMV: a ", info.name, " matrix of ", rows, " x ", cols,
                     ": columns must be a positive multiple of ", info.block));
  }
  if (data == nullptr && rows > 0) {
    return absl::InvalidArgumentError("quantized GEMV: null data");
  }
  QuantMatrixView v;
  v.type = type;
  v.data = static_cast<const uint8_t*>(data);
  v.rows = rows;
  v.cols = cols;
  v.row_stride = cols / info.block * info.bytes;
  return v;
}

QuantMatrixView QuantMatrixView::RowSlice(int64_t begin, int64_t end) const {
  HMOE_CHECK(0 <= begin && begin <= end && end <= rows)
      << "rows [" << begin << ", " << end << ") of " << rows;
  QuantMatrixView v = *this;
  v.data = data + begin * row_stride;
  v.rows = end - begin;
  return v;
}

QuantGemv::QuantGemv() = default;
QuantGemv::~QuantGemv() = default;

bool QuantGemmKernelsEnabled() {
  static const bool kEnabled = [] {
    const char* env = std::getenv("HMOE_QUANT_GEMM");
    return env == nullptr || std::string(env) != "0";
  }();
  return kEnabled;
}

bool QuantGemv::GemmBlock(const QuantMatrixView&, const BlockQ8K*, int64_t, int64_t, int64_t,
                          int64_t, float*, int64_t) const {
  return false;
}

void QuantGemv::GemmRows(const QuantMatrixView& w, const BlockQ8K* x, int64_t x_stride, int64_t n,
                         int64_t m_begin, int64_t m_end, float* y, int64_t y_stride) const {
  HMOE_CHECK(n >= 1);
  HMOE_CHECK(0 <= m_begin && m_begin <= m_end && m_end <= w.rows);
  // About 256 KiB of weight rows per block: in L2 while every group of tokens passes over it.
  const int64_t block_rows =
      std::clamp<int64_t>(256 * 1024 / std::max<int64_t>(w.row_stride, 1) / 16 * 16, 16, 256);
  for (int64_t r0 = m_begin; r0 < m_end; r0 += block_rows) {
    const int64_t r1 = std::min(m_end, r0 + block_rows);
    if (QuantGemmKernelsEnabled() &&
        GemmBlock(w, x, x_stride, n, r0, r1, y + (r0 - m_begin), y_stride)) {
      continue;
    }
    for (int64_t t0 = 0; t0 < n; t0 += kMaxMatVecTokens) {
      const int nt = static_cast<int>(std::min<int64_t>(kMaxMatVecTokens, n - t0));
      MatVec(w, x + t0 * x_stride, x_stride, nt, r0, r1, y + t0 * y_stride + (r0 - m_begin),
             y_stride);
    }
  }
}

absl::StatusOr<std::unique_ptr<QuantGemv>> NewQuantGemv(CpuIsa isa) {
  switch (isa) {
    case CpuIsa::kScalar:
      return std::unique_ptr<QuantGemv>(internal::NewScalarQuantGemv());
    case CpuIsa::kAvx2:
      if (!CpuSupports(CpuIsa::kAvx2)) break;
      return std::unique_ptr<QuantGemv>(internal::NewAvx2QuantGemv());
    case CpuIsa::kAvx512:
    case CpuIsa::kAvx512Bf16:
    case CpuIsa::kAmx:
      if (!CpuHasAvx512Vnni()) break;
      return std::unique_ptr<QuantGemv>(internal::NewAvx512VnniQuantGemv());
  }
  return absl::UnavailableError(absl::StrCat("quantized cpu kernels ", std::string(CpuIsaName(isa)),
                                             ": not supported by this CPU"));
}

const QuantGemv& DefaultQuantGemv() {
  static const QuantGemv* const kGemv = [] {
    CpuIsa isa = BestCpuIsa();
    if ((isa == CpuIsa::kAvx512 || isa == CpuIsa::kAvx512Bf16 || isa == CpuIsa::kAmx) &&
        !CpuHasAvx512Vnni()) {
      isa = CpuIsa::kAvx2;
    }
    auto gemv = NewQuantGemv(isa);
    HMOE_CHECK(gemv.ok()) << gemv.status();
    return gemv->release();
  }();
  return *kGemv;
}

}  // namespace hmoe::cpu
