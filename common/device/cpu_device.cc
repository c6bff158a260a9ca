#include "common/device/cpu_device.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <thread>
#include <utility>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/strings/str_cat.h"

#include "common/base/logging.h"
#include "common/base/status_macros.h"
#include "common/device/cpu_internal.h"
#include "common/device/memory_budget.h"
#include "common/kernels/cpu/bf16_gemv.h"
#include "common/kernels/cpu/f32_ops.h"
#include "common/kernels/shared_math.h"
#include "common/ops/cpu/quantized_linear.h"

namespace hmoe {

std::mutex& CpuPoolMutex(const CpuWorkerPool* pool) {
  static std::mutex registry_mu;
  static auto* registry =
      new absl::flat_hash_map<const CpuWorkerPool*, std::unique_ptr<std::mutex>>();
  std::lock_guard<std::mutex> lock(registry_mu);
  std::unique_ptr<std::mutex>& mu = (*registry)[pool];
  if (mu == nullptr) mu = std::make_unique<std::mutex>();
  return *mu;
}

namespace internal {

// ---------------------------------------------------------------------------------- helpers

void ScratchBuffer::Free::operator()(std::byte* p) const { std::free(p); }

std::byte* ScratchBuffer::Get(size_t bytes) {
  if (bytes > size_) {
    const size_t rounded = std::max<size_t>(64, (bytes + 4095) / 4096 * 4096);
    data_.reset(static_cast<std::byte*>(std::aligned_alloc(64, rounded)));
    HMOE_CHECK(data_ != nullptr) << "scratch of " << rounded << " bytes";
    size_ = rounded;
  }
  return data_.get();
}

absl::Status CheckLinearWeight(const LinearWeight& w, const char* what) {
  if (w.data == nullptr || w.rows <= 0 || w.cols <= 0 || w.row_stride < w.cols) {
    return absl::InvalidArgumentError(absl::StrCat(what, ": empty or malformed weight [", w.rows,
                                                   ", ", w.cols, "] stride ", w.row_stride));
  }
  switch (w.dtype) {
    case DType::kF8E4M3:
      if (w.scale_inv == nullptr || w.scale_stride < (w.cols + 127) / 128 ||
          reinterpret_cast<uintptr_t>(w.scale_inv) % alignof(float) != 0) {
        return absl::InvalidArgumentError(
            absl::StrCat(what, ": FP8 weight without a valid (aligned) scale tensor"));
      }
      return absl::OkStatus();
    case DType::kBF16:
      return absl::OkStatus();
    case DType::kF32:
      if (reinterpret_cast<uintptr_t>(w.data) % alignof(float) != 0) {
        return absl::InvalidArgumentError(absl::StrCat(what, ": F32 weight is not 4-byte aligned"));
      }
      return absl::OkStatus();
    default:
      if (cpu::IsQuantizedLinearDType(w.dtype)) {
        const int64_t block = DTypeBlockElements(w.dtype);
        if (w.cols % block != 0 || w.row_stride % block != 0) {
          return absl::InvalidArgumentError(
              absl::StrCat(what, ": ", std::string(DTypeName(w.dtype)), " weight [", w.rows, ", ",
                           w.cols, "] stride ", w.row_stride, " is not whole blocks of ", block));
        }
        return absl::OkStatus();
      }
      return absl::InvalidArgumentError(
          absl::StrCat(what, ": unsupported weight dtype ", std::string(DTypeName(w.dtype))));
  }
}

cpu::QuantizedMatrixView QuantizedView(const LinearWeight& w) {
  cpu::QuantizedMatrixView v;
  v.dtype = w.dtype;
  v.data = static_cast<const std::byte*>(w.data);
  v.rows = w.rows;
  v.cols = w.cols;
  v.row_stride = w.row_stride;
  return v;
}

namespace {

cpu::Fp8MatrixView Fp8View(const LinearWeight& w) {
  cpu::Fp8MatrixView v;
  v.data = static_cast<const uint8_t*>(w.data);
  v.rows = w.rows;
  v.cols = w.cols;
  v.row_stride = w.row_stride;
  v.scale_inv = w.scale_inv;
  v.scale_stride = w.scale_stride;
  return v;
}

cpu::Bf16MatrixView Bf16View(const LinearWeight& w) {
  cpu::Bf16MatrixView v;
  v.data = static_cast<const std::byte*>(w.data);
  v.rows = w.rows;
  v.cols = w.cols;
  v.row_stride = w.row_stride;
  return v;
}

}  // namespace

int64_t PackedRowBytes(const CpuKernels& k, const LinearWeight& w) {
  switch (w.dtype) {
    case DType::kF8E4M3:
      return (k.fp8->PackedBytes(w.cols) + 63) / 64 * 64;
    case DType::kBF16:
      return (cpu::Bf16Gemv::PackedBytes(w.cols) + 63) / 64 * 64;
    default:
      if (k.quant != nullptr && IsBlockDType(w.dtype)) {
        return cpu::Q8KBlocks(w.cols) * static_cast<int64_t>(sizeof(cpu::BlockQ8K));
      }
      return 0;
  }
}

void PackRows(const CpuKernels& k, const LinearWeight& w, const float* x, int64_t x_stride,
              int64_t n, std::byte* packed, int64_t packed_stride) {
  for (int64_t t = 0; t < n; ++t) {
    if (w.dtype == DType::kF8E4M3) {
      k.fp8->Pack(x + t * x_stride, w.cols, 0, w.cols, packed + t * packed_stride);
    } else if (w.dtype == DType::kBF16) {
      cpu::Bf16Gemv::Pack(x + t * x_stride, w.cols, packed + t * packed_stride);
    } else if (k.quant != nullptr && IsBlockDType(w.dtype)) {
      cpu::QuantizeQ8K(x + t * x_stride, w.cols,
                       reinterpret_cast<cpu::BlockQ8K*>(packed + t * packed_stride));
    }
  }
}

void LinearRows(const CpuKernels& k, const LinearWeight& w, const std::byte* packed,
                int64_t packed_stride, const float* x, int64_t x_stride, int64_t n, int64_t m_begin,
                int64_t m_end, float* y, int64_t y_stride) {
  if (m_begin >= m_end || n <= 0) return;
  switch (w.dtype) {
    case DType::kF8E4M3:
      if (n <= cpu::kMaxMatVecTokens) {
        k.fp8->MatVec(Fp8View(w), packed, packed_stride, static_cast<int>(n), m_begin, m_end, y,
                      y_stride);
      } else {
        k.fp8->GemmRows(Fp8View(w), packed, packed_stride, n, m_begin, m_end, y, y_stride);
      }
      return;
    case DType::kBF16:
      if (n <= cpu::kMaxMatVecTokens) {
        k.bf16->MatVec(Bf16View(w), packed, packed_stride, static_cast<int>(n), m_begin, m_end, y,
                       y_stride);
      } else {
        k.bf16->GemmRows(Bf16View(w), packed, packed_stride, n, m_begin, m_end, y, y_stride);
      }
      return;
    case DType::kF32:
      cpu::MatVecF32(static_cast<const float*>(w.data), w.row_stride, w.cols, x, x_stride, n,
                     m_begin, m_end, y, y_stride);
      return;
    default:
      // GGUF block types (and F16): common/ops/cpu/quantized_linear.h.
      HMOE_CHECK(cpu::IsQuantizedLinearDType(w.dtype)) << "unsupported dtype";
      if (k.quant != nullptr && IsBlockDType(w.dtype)) {
        cpu::QuantizedLinearRowsQ8K(*k.quant, QuantizedView(w),
                                    reinterpret_cast<const cpu::BlockQ8K*>(packed),
                                    packed_stride / static_cast<int64_t>(sizeof(cpu::BlockQ8K)), n,
                                    m_begin, m_end, y, y_stride);
        return;
      }
      cpu::QuantizedLinearRows(QuantizedView(w), x, x_stride, n, m_begin, m_end, y, y_stride);
  }
}

}  // namespace internal

namespace {

using internal::CpuKernels;
using internal::ScratchBuffer;

float ReadElement(DType dtype, const void* data, int64_t i) {
  const std::byte* p = static_cast<const std::byte*>(data);
  switch (dtype) {
    case DType::kF32: {
      float f;
      std::memcpy(&f, p + 4 * i, 4);
      return f;
    }
    case DType::kBF16: {
      uint16_t b;
      std::memcpy(&b, p + 2 * i, 2);
      return kernels::Bf16BitsToFloat(b);
    }
    case DType::kF16: {
      uint16_t h;
      std::memcpy(&h, p + 2 * i, 2);
      return F16ToFloat(h);
    }
    default:
      return std::nanf("");
  }
}

absl::Status CheckVector(const VectorWeight& v, int64_t size, const char* what) {
  if (v.data == nullptr || v.size != size ||
      (v.dtype != DType::kF32 && v.dtype != DType::kBF16 && v.dtype != DType::kF16)) {
    return absl::InvalidArgumentError(absl::StrCat(what, ": expected a BF16/F16/F32 vector of ",
                                                   size, " elements, got ", v.size));
  }
  return absl::OkStatus();
}

// Memory accounting shared with the deleters of the device's buffers.
struct CpuMemory {
  explicit CpuMemory(size_t budget) : budget(budget) {}
  MemoryBudget budget;
};

void FreeCpuBuffer(void* context, void* data, size_t size_bytes) {
  std::free(data);
  static_cast<CpuMemory*>(context)->budget.Release(size_bytes);
}

class CpuStream final : public Stream {
 public:
  absl::Status Synchronize() override { return absl::OkStatus(); }
  absl::Status WaitEvent(Event&) override { return absl::OkStatus(); }
};

// Work is complete when enqueued, so an event is complete as soon as it is recorded.
class CpuEvent final : public Event {
 public:
  absl::Status Record(Stream&) override { return absl::OkStatus(); }
  absl::Status Synchronize() override { return absl::OkStatus(); }
  bool IsComplete() override { return true; }
};

class CpuDevice final : public Device {
 public:
  explicit CpuDevice(const CpuDeviceOptions& options)
      : memory_(std::make_unique<CpuMemory>(options.budget_bytes == 0 ? SIZE_MAX
                                                                      : options.budget_bytes)),
        copy_bytes_per_second_(options.copy_bytes_per_second),
        pool_(options.pool) {
    kernels_.fp8 = options.fp8_gemv != nullptr ? options.fp8_gemv : &cpu::DefaultFp8Gemv();
    kernels_.bf16 = &cpu::DefaultBf16Gemv();
    kernels_.gemm = &cpu::Fp8GemmForIsa(kernels_.fp8->isa());
    const cpu::CpuIsa isa = kernels_.fp8->isa();
    kernels_.gemm_min_tokens = options.fp8_gemm_min_tokens >= 0 ? options.fp8_gemm_min_tokens
                               : cpu::Fp8GemmMatchesGemv(isa)   ? cpu::Fp8GemmMinTokens(isa)
                                                                : INT64_MAX;
    if (options.quant_activations == cpu::QuantActivations::kQ8K) {
      kernels_.quant = &cpu::DefaultQuantGemv();
    }
  }

  DeviceKind kind() const override { return DeviceKind::kCpu; }
  std::string name() const override { return "cpu"; }
  bool host_accessible() const override { return true; }

  absl::StatusOr<DeviceBuffer> Allocate(size_t size_bytes) override {
    if (size_bytes == 0) return absl::InvalidArgumentError("cpu device: allocate 0 bytes");
    HMOE_RETURN_IF_ERROR(memory_->budget.Reserve(size_bytes, "cpu device allocate"));
    return Make(size_bytes);
  }

  absl::StatusOr<DeviceBuffer> AllocateBlocking(size_t size_bytes, absl::Time deadline) override {
    if (size_bytes == 0) return absl::InvalidArgumentError("cpu device: allocate 0 bytes");
    HMOE_RETURN_IF_ERROR(
        memory_->budget.ReserveBlocking(size_bytes, deadline, "cpu device allocate"));
    return Make(size_bytes);
  }

  size_t bytes_in_use() const override { return memory_->budget.bytes_in_use(); }
  size_t peak_bytes_in_use() const override { return memory_->budget.peak_bytes_in_use(); }
  void ResetPeakBytes() override { memory_->budget.ResetPeak(); }
  size_t budget_bytes() const override { return memory_->budget.budget_bytes(); }

  absl::StatusOr<std::unique_ptr<Stream>> CreateStream() override {
    return std::unique_ptr<Stream>(new CpuStream());
  }
  absl::StatusOr<std::unique_ptr<Event>> CreateEvent() override {
    return std::unique_ptr<Event>(new CpuEvent());
  }
  absl::Status Synchronize() override { return absl::OkStatus(); }

  absl::Status CopyToDevice(Stream&, void* dst, const void* src, size_t bytes) override {
    const auto start = std::chrono::steady_clock::now();
    HMOE_RETURN_IF_ERROR(Copy(dst, src, bytes));
    if (copy_bytes_per_second_ > 0) {
      // The capped link: the copy completes bytes / cap seconds after it started.
      const auto done =
          start +
          std::chrono::duration_cast<std::chrono::steady_clock::duration>(
              std::chrono::duration<double>(static_cast<double>(bytes) / copy_bytes_per_second_));
      std::this_thread::sleep_until(done);
    }
    return absl::OkStatus();
  }
  absl::Status CopyToHost(Stream&, void* dst, const void* src, size_t bytes) override {
    return Copy(dst, src, bytes);
  }
  absl::Status CopyOnDevice(Stream&, void* dst, const void* src, size_t bytes) override {
    return Copy(dst, src, bytes);
  }
  absl::Status Memset(Stream&, void* dst, int value, size_t bytes) override {
    if (bytes == 0) return absl::OkStatus();
    if (dst == nullptr) return absl::InvalidArgumentError("cpu device: memset of null");
    std::memset(dst, value, bytes);
    return absl::OkStatus();
  }

  // ---------------------------------------------------------------------------------- ops

  absl::Status Linear(Stream&, const LinearWeight& w, const float* x, int64_t x_stride, int64_t n,
                      float* y, int64_t y_stride) override {
    HMOE_RETURN_IF_ERROR(internal::CheckLinearWeight(w, "linear"));
    if (n < 0 ||
        (n > 0 && (x == nullptr || y == nullptr || x_stride < w.cols || y_stride < w.rows))) {
      return absl::InvalidArgumentError(
          absl::StrCat("linear: bad activations (n ", n, ", x_stride ", x_stride, ", y_stride ",
                       y_stride, ") for [", w.rows, ", ", w.cols, "]"));
    }
    if (n == 0) return absl::OkStatus();
    if (w.dtype == DType::kF8E4M3 && n >= kernels_.gemm_min_tokens) {
      LinearFp8Gemm(w, x, x_stride, n, y, y_stride);
      return absl::OkStatus();
    }
    const int64_t packed_stride = internal::PackedRowBytes(kernels_, w);
    std::byte* packed = nullptr;
    if (packed_stride > 0 && kernels_.quant != nullptr && IsBlockDType(w.dtype)) {
      packed = PackQ8K(w, x, x_stride, n, packed_stride);
    } else if (packed_stride > 0) {
      packed = pack_scratch_.Get(static_cast<size_t>(packed_stride * n));
      // Decode-sized batches pack on the caller; prefill-sized ones split the tokens over the
      // pool first (packing is a visible share of a prefill GEMM otherwise).
      ParallelRange(n, n > cpu::kMaxMatVecTokens, [&](int64_t t0, int64_t t1) {
        internal::PackRows(kernels_, w, x + t0 * x_stride, x_stride, t1 - t0,
                           packed + t0 * packed_stride, packed_stride);
      });
    }
    // Rows in multiples of 16 (whole tiles), evenly over the threads.
    const int64_t units = (w.rows + 15) / 16;
    Parallel([&](int thread, int threads) {
      const int64_t m0 = std::min(w.rows, units * thread / threads * 16);
      const int64_t m1 = std::min(w.rows, units * (thread + 1) / threads * 16);
      internal::LinearRows(kernels_, w, packed, packed_stride, x, x_stride, n, m0, m1, y + m0,
                           y_stride);
    });
    return absl::OkStatus();
  }

  absl::Status RmsNorm(Stream&, const float* x, int64_t x_stride, int64_t n, int64_t dim,
                       const VectorWeight& weight, float eps, float* y, int64_t y_stride) override {
    HMOE_RETURN_IF_ERROR(CheckVector(weight, dim, "rms norm weight"));
    if (n < 0 || dim <= 0 ||
        (n > 0 && (x == nullptr || y == nullptr || x_stride < dim || y_stride < dim))) {
      return absl::InvalidArgumentError("rms norm: bad arguments");
    }
    std::vector<float>& w = norm_weight_;
    w.resize(dim);
    for (int64_t i = 0; i < dim; ++i) w[i] = ReadElement(weight.dtype, weight.data, i);
    auto rows = [&](int64_t t0, int64_t t1) {
      for (int64_t t = t0; t < t1; ++t) {
        const float* xt = x + t * x_stride;
        float* yt = y + t * y_stride;
        double sum = 0.0;
        for (int64_t i = 0; i < dim; ++i) sum += static_cast<double>(xt[i]) * xt[i];
        const float inv = static_cast<float>(1.0 / std::sqrt(sum / dim + eps));
        for (int64_t i = 0; i < dim; ++i) yt[i] = w[i] * (xt[i] * inv);
      }
    };
    ParallelRange(n, n * dim >= (1 << 16), rows);
    return absl::OkStatus();
  }

  absl::Status RopeInterleaved(Stream&, float* x, int64_t x_stride, int64_t n, int64_t num_heads,
                               int64_t head_stride, int64_t rope_dim, const int32_t* positions,
                               const float* inv_freq, float attention_factor) override {
    if (n < 0 || num_heads <= 0 || rope_dim <= 0 || rope_dim % 2 != 0 ||
        (n > 0 && (x == nullptr || positions == nullptr || inv_freq == nullptr))) {
      return absl::InvalidArgumentError("rope: bad arguments");
    }
    const int64_t half = rope_dim / 2;
    auto rows = [&](int64_t t0, int64_t t1) {
      std::vector<float> cs(2 * half);
      for (int64_t t = t0; t < t1; ++t) {
        // Angles in double, as the reference (positions reach 1e5 and more).
        for (int64_t i = 0; i < half; ++i) {
          const double angle = static_cast<double>(positions[t]) * static_cast<double>(inv_freq[i]);
          cs[2 * i] = static_cast<float>(std::cos(angle) * attention_factor);
          cs[2 * i + 1] = static_cast<float>(std::sin(angle) * attention_factor);
        }
        for (int64_t h = 0; h < num_heads; ++h) {
          float* v = x + t * x_stride + h * head_stride;
          for (int64_t i = 0; i < half; ++i) {
            const double x0 = v[2 * i];
            const double x1 = v[2 * i + 1];
            const double c = cs[2 * i];
            const double s = cs[2 * i + 1];
            v[2 * i] = static_cast<float>(x0 * c - x1 * s);
            v[2 * i + 1] = static_cast<float>(x0 * s + x1 * c);
          }
        }
      }
    };
    ParallelRange(n, n * num_heads * rope_dim >= (1 << 16), rows);
    return absl::OkStatus();
  }

  absl::Status SiluMul(Stream&, const float* gate, const float* up, int64_t count,
                       float* out) override {
    if (count < 0 || (count > 0 && (gate == nullptr || up == nullptr || out == nullptr))) {
      return absl::InvalidArgumentError("silu mul: bad arguments");
    }
    ParallelRange(count, count >= (1 << 16), [&](int64_t i0, int64_t i1) {
      for (int64_t i = i0; i < i1; ++i) out[i] = kernels::SiluMul(gate[i], up[i]);
    });
    return absl::OkStatus();
  }

  absl::Status Add(Stream&, const float* a, const float* b, int64_t count, float* out) override {
    if (count < 0 || (count > 0 && (a == nullptr || b == nullptr || out == nullptr))) {
      return absl::InvalidArgumentError("add: bad arguments");
    }
    ParallelRange(count, count >= (1 << 17), [&](int64_t i0, int64_t i1) {
      for (int64_t i = i0; i < i1; ++i) out[i] = a[i] + b[i];
    });
    return absl::OkStatus();
  }

  absl::Status EmbeddingGather(Stream&, const LinearWeight& table, const int32_t* ids, int64_t n,
                               float* out) override {
    const bool quantized = cpu::IsQuantizedLinearDType(table.dtype);
    if ((table.dtype != DType::kBF16 && table.dtype != DType::kF32 && !quantized) ||
        table.data == nullptr || table.rows <= 0 || table.cols <= 0 ||
        table.row_stride < table.cols || n < 0 || (n > 0 && (ids == nullptr || out == nullptr))) {
      return absl::InvalidArgumentError(
          "embedding gather: bad arguments (table must be BF16/F32 or a GGML block type)");
    }
    if (quantized) HMOE_RETURN_IF_ERROR(internal::CheckLinearWeight(table, "embedding gather"));
    for (int64_t t = 0; t < n; ++t) {
      if (ids[t] < 0 || ids[t] >= table.rows) {
        return absl::InvalidArgumentError(
            absl::StrCat("embedding gather: id ", ids[t], " outside [0, ", table.rows, ")"));
      }
    }
    for (int64_t t = 0; t < n; ++t) {
      if (quantized) {
        cpu::DequantizeRow(internal::QuantizedView(table), ids[t], out + t * table.cols);
        continue;
      }
      const std::byte* row = static_cast<const std::byte*>(table.data) +
                             DTypeBytes(table.dtype, ids[t] * table.row_stride);
      HMOE_RETURN_IF_ERROR(
          ConvertToFloat(table.dtype, row, static_cast<size_t>(table.cols), out + t * table.cols));
    }
    return absl::OkStatus();
  }

  absl::Status MoeGate(Stream&, const float* x, int64_t x_stride, int64_t n,
                       const LinearWeight& router, const VectorWeight& bias,
                       const MoeGateParams& params, int32_t* ids, float* weights) override {
    const int64_t e = params.num_experts;
    if (e <= 0 || params.top_k <= 0 || params.n_group <= 0 || e % params.n_group != 0 ||
        params.topk_group <= 0 || params.topk_group > params.n_group ||
        params.top_k > params.topk_group * (e / params.n_group)) {
      return absl::InvalidArgumentError("moe gate: inconsistent parameters");
    }
    const bool quantized = cpu::IsQuantizedLinearDType(router.dtype);
    if ((router.dtype != DType::kBF16 && router.dtype != DType::kF32 && !quantized) ||
        router.data == nullptr || router.rows != e || router.cols <= 0 ||
        router.row_stride < router.cols) {
      return absl::InvalidArgumentError(
          absl::StrCat("moe gate: router must be BF16/F32 or a GGML block type [", e, ", hidden]"));
    }
    if (quantized) HMOE_RETURN_IF_ERROR(internal::CheckLinearWeight(router, "moe gate router"));
    if (!bias.empty()) HMOE_RETURN_IF_ERROR(CheckVector(bias, e, "moe gate bias"));
    if (n < 0 || (n > 0 && (x == nullptr || ids == nullptr || weights == nullptr ||
                            x_stride < router.cols))) {
      return absl::InvalidArgumentError("moe gate: bad activations");
    }
    if (n == 0) return absl::OkStatus();
    std::vector<float>& logits = gate_logits_;
    logits.resize(static_cast<size_t>(n * e));
    const size_t elem = DTypeSize(router.dtype);
    Parallel([&](int thread, int threads) {
      const int64_t r0 = e * thread / threads;
      const int64_t r1 = e * (thread + 1) / threads;
      if (quantized) {
        // F32 math on the dequantized rows, as for an F32 router.
        std::vector<float> row(static_cast<size_t>(router.cols));
        for (int64_t r = r0; r < r1; ++r) {
          cpu::DequantizeRow(internal::QuantizedView(router), r, row.data());
          for (int64_t t = 0; t < n; ++t) {
            logits[t * e + r] = cpu::DotF32(row.data(), x + t * x_stride, router.cols);
          }
        }
        return;
      }
      for (int64_t r = r0; r < r1; ++r) {
        const std::byte* row =
            static_cast<const std::byte*>(router.data) + r * router.row_stride * elem;
        for (int64_t t = 0; t < n; ++t) {
          logits[t * e + r] =
              router.dtype == DType::kBF16
                  ? cpu::DotBf16F32(row, x + t * x_stride, router.cols)
                  : cpu::DotF32(reinterpret_cast<const float*>(row), x + t * x_stride, router.cols);
        }
      }
    });
    std::vector<float> bias_f32;
    if (!bias.empty()) {
      bias_f32.resize(e);
      for (int64_t i = 0; i < e; ++i) bias_f32[i] = ReadElement(bias.dtype, bias.data, i);
    }
    // The production gate shared with the CUDA kernel (kernels::MoeGateSelect); the tests compare
    // it with reference::MoeGate, an independent implementation.
    std::vector<double> scratch((kernels::MoeGateScratchBytes(e, params.n_group) + 7) / 8);
    for (int64_t t = 0; t < n; ++t) {
      kernels::MoeGateSelect(logits.data() + t * e, bias_f32.empty() ? nullptr : bias_f32.data(),
                             params, scratch.data(), ids + t * params.top_k,
                             weights + t * params.top_k);
    }
    return absl::OkStatus();
  }

  absl::Status KvCacheWrite(Stream&, const KvLayerView& cache, const int32_t* slots, int64_t n,
                            const float* latent, int64_t latent_stride, const float* k_pe,
                            int64_t k_pe_stride, int64_t kv_lora_rank) override {
    const int64_t rope_dim = cache.row_floats - kv_lora_rank;
    if (cache.base == nullptr || cache.block_size <= 0 || kv_lora_rank <= 0 || rope_dim <= 0 ||
        n < 0 || (n > 0 && (slots == nullptr || latent == nullptr || k_pe == nullptr))) {
      return absl::InvalidArgumentError("kv cache write: bad arguments");
    }
    for (int64_t t = 0; t < n; ++t) {
      if (slots[t] < 0) return absl::InvalidArgumentError("kv cache write: negative slot");
      float* row = cache.base + (slots[t] / cache.block_size) * cache.block_stride +
                   (slots[t] % cache.block_size) * cache.row_floats;
      std::memcpy(row, latent + t * latent_stride, kv_lora_rank * sizeof(float));
      std::memcpy(row + kv_lora_rank, k_pe + t * k_pe_stride, rope_dim * sizeof(float));
    }
    return absl::OkStatus();
  }

  absl::Status MlaDecodeAttention(Stream&, const MlaAttentionArgs& args) override {
    auto runner = [this](absl::FunctionRef<void(int, int)> job) { Parallel(job); };
    return internal::CpuMlaAttention(kernels_, runner, args, /*decode=*/true);
  }

  absl::Status MlaPrefillAttention(Stream&, const MlaAttentionArgs& args) override {
    auto runner = [this](absl::FunctionRef<void(int, int)> job) { Parallel(job); };
    return internal::CpuMlaAttention(kernels_, runner, args, /*decode=*/false);
  }

  absl::Status MlaAttentionPartial(Stream&, const MlaAttentionArgs& args,
                                   const MlaPartialState& state) override {
    auto runner = [this](absl::FunctionRef<void(int, int)> job) { Parallel(job); };
    return internal::CpuMlaAttention(kernels_, runner, args, /*decode=*/false, &state);
  }

  absl::Status MlaProjectLatent(Stream&, const MlaDimensions& dims, const LinearWeight& kv_b,
                                const float* u, int64_t n, float* out,
                                int64_t out_stride) override {
    auto runner = [this](absl::FunctionRef<void(int, int)> job) { Parallel(job); };
    return internal::CpuMlaProjectLatent(kernels_, runner, dims, kv_b, u, n, out, out_stride);
  }

  absl::Status GatherRows(Stream&, const float* src, int64_t src_stride, const int32_t* rows,
                          int64_t n, int64_t cols, float* dst, int64_t dst_stride) override {
    if (n < 0 || cols < 0 || (n > 0 && (src == nullptr || rows == nullptr || dst == nullptr))) {
      return absl::InvalidArgumentError("gather rows: bad arguments");
    }
    for (int64_t i = 0; i < n; ++i) {
      if (rows[i] < 0) return absl::InvalidArgumentError("gather rows: negative row");
      std::memcpy(dst + i * dst_stride, src + rows[i] * src_stride, cols * sizeof(float));
    }
    return absl::OkStatus();
  }

  absl::Status ScatterAddRows(Stream&, const float* src, int64_t src_stride, const int32_t* rows,
                              const float* weights, int64_t n, int64_t cols, float* dst,
                              int64_t dst_stride) override {
    if (n < 0 || cols < 0 ||
        (n > 0 && (src == nullptr || rows == nullptr || weights == nullptr || dst == nullptr))) {
      return absl::InvalidArgumentError("scatter add rows: bad arguments");
    }
    for (int64_t i = 0; i < n; ++i) {
      if (rows[i] < 0) return absl::InvalidArgumentError("scatter add rows: negative row");
    }
    // Columns split over threads; each thread adds the rows in increasing i.
    const int64_t groups = (cols + 15) / 16;
    auto job = [&](int thread, int threads) {
      const int64_t c0 = std::min(cols, groups * thread / threads * 16);
      const int64_t c1 = std::min(cols, groups * (thread + 1) / threads * 16);
      for (int64_t i = 0; i < n; ++i) {
        cpu::AxpyF32(weights[i], src + i * src_stride + c0, dst + rows[i] * dst_stride + c0,
                     c1 - c0);
      }
    };
    if (n * cols >= (1 << 16)) {
      Parallel(job);
    } else {
      job(0, 1);
    }
    return absl::OkStatus();
  }

 private:
  absl::StatusOr<DeviceBuffer> Make(size_t size_bytes) {
    const size_t rounded = (size_bytes + 63) / 64 * 64;
    void* data = std::aligned_alloc(64, rounded);
    if (data == nullptr) {
      memory_->budget.Release(size_bytes);
      return absl::ResourceExhaustedError(
          absl::StrCat("cpu device: out of host memory allocating ", size_bytes, " bytes"));
    }
    return DeviceBuffer(data, size_bytes, &FreeCpuBuffer, memory_.get());
  }

  static absl::Status Copy(void* dst, const void* src, size_t bytes) {
    if (bytes == 0) return absl::OkStatus();
    if (dst == nullptr || src == nullptr) return absl::InvalidArgumentError("copy: null pointer");
    std::memcpy(dst, src, bytes);
    return absl::OkStatus();
  }

  // Linear for many tokens on the FP8 GEMM: the activations packed once (token tiles split over
  // the threads), then the rows split over the threads in multiples of 16.
  void LinearFp8Gemm(const LinearWeight& w, const float* x, int64_t x_stride, int64_t n, float* y,
                     int64_t y_stride) {
    const cpu::Fp8Gemm& gemm = *kernels_.gemm;
    std::byte* packed = pack_scratch_.Get(static_cast<size_t>(gemm.PackedBytes(n, w.cols)));
    const int64_t tile = gemm.TokenTile();
    const int64_t tiles = (n + tile - 1) / tile;
    ParallelRange(tiles, tiles > 1, [&](int64_t i0, int64_t i1) {
      gemm.Pack(x, x_stride, n, w.cols, i0 * tile, std::min(n, i1 * tile), packed);
    });
    const cpu::Fp8MatrixView view = internal::Fp8View(w);
    const int64_t units = (w.rows + 15) / 16;
    Parallel([&](int thread, int threads) {
      const int64_t m0 = std::min(w.rows, units * thread / threads * 16);
      const int64_t m1 = std::min(w.rows, units * (thread + 1) / threads * 16);
      gemm.Multiply(view, packed, n, m0, m1, y + m0, y_stride);
    });
  }

  // job(thread, num_threads) on every pool thread (serialized with other drivers of the pool).
  void Parallel(absl::FunctionRef<void(int, int)> job) {
    if (pool_ == nullptr || pool_->num_threads() == 1) {
      job(0, 1);
      return;
    }
    std::lock_guard<std::mutex> lock(CpuPoolMutex(pool_));
    const int threads = pool_->num_threads();
    pool_->Run([&](int thread) { job(thread, threads); });
  }

  // The Q8_K rows of x for a block-type weight (packed_stride bytes each). Decode-sized inputs
  // equal to the previous call's (the same n, cols and bytes: an expert's gate and up, q_a and
  // kv_a of one token) reuse its blocks; the F32 input is compared, never trusted by address.
  std::byte* PackQ8K(const LinearWeight& w, const float* x, int64_t x_stride, int64_t n,
                     int64_t packed_stride) {
    Q8KInput& c = q8k_input_;
    const bool cacheable = n <= cpu::kMaxMatVecTokens;
    if (cacheable && c.n == n && c.cols == w.cols && c.packed_stride == packed_stride) {
      bool same = true;
      for (int64_t t = 0; t < n && same; ++t) {
        same = std::memcmp(x + t * x_stride, c.input.data() + t * w.cols,
                           static_cast<size_t>(w.cols) * sizeof(float)) == 0;
      }
      if (same) return c.packed.Get(static_cast<size_t>(packed_stride * n));
    }
    std::byte* packed = c.packed.Get(static_cast<size_t>(packed_stride * n));
    ParallelRange(n, n > cpu::kMaxMatVecTokens, [&](int64_t t0, int64_t t1) {
      internal::PackRows(kernels_, w, x + t0 * x_stride, x_stride, t1 - t0,
                         packed + t0 * packed_stride, packed_stride);
    });
    c.n = 0;
    if (cacheable) {
      c.input.resize(static_cast<size_t>(n * w.cols));
      for (int64_t t = 0; t < n; ++t) {
        std::memcpy(c.input.data() + t * w.cols, x + t * x_stride,
                    static_cast<size_t>(w.cols) * sizeof(float));
      }
      c.n = n;
      c.cols = w.cols;
      c.packed_stride = packed_stride;
    }
    return packed;
  }

  // Items [0, count) in contiguous ranges, one per thread when `parallel`.
  void ParallelRange(int64_t count, bool parallel, absl::FunctionRef<void(int64_t, int64_t)> fn) {
    if (count <= 0) return;
    if (!parallel) {
      fn(0, count);
      return;
    }
    Parallel([&](int thread, int threads) {
      const int64_t i0 = count * thread / threads;
      const int64_t i1 = count * (thread + 1) / threads;
      if (i0 < i1) fn(i0, i1);
    });
  }

  std::unique_ptr<CpuMemory> memory_;
  const double copy_bytes_per_second_;
  CpuWorkerPool* const pool_;
  CpuKernels kernels_;
  // Scratch of the calling thread's op. Ops of two streams may run concurrently from two
  // threads, so these are per thread.
  static thread_local ScratchBuffer pack_scratch_;
  static thread_local std::vector<float> norm_weight_;
  static thread_local std::vector<float> gate_logits_;
  // The calling thread's last Q8_K-rounded input (PackQ8K); n == 0: none.
  struct Q8KInput {
    std::vector<float> input;  // [n, cols]
    int64_t n = 0;
    int64_t cols = 0;
    int64_t packed_stride = 0;
    ScratchBuffer packed;
  };
  static thread_local Q8KInput q8k_input_;
};

thread_local ScratchBuffer CpuDevice::pack_scratch_;
thread_local std::vector<float> CpuDevice::norm_weight_;
thread_local std::vector<float> CpuDevice::gate_logits_;
thread_local CpuDevice::Q8KInput CpuDevice::q8k_input_;

}  // namespace

std::unique_ptr<Device> NewCpuDevice(const CpuDeviceOptions& options) {
  return std::make_unique<CpuDevice>(options);
}

}  // namespace hmoe
