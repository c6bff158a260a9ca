// CudaDevice: the Device on an NVIDIA GPU. Built only with the CUDA option (see CMakeLists.txt;
// cuda_device_stub.cc otherwise). Host code only: the kernels live in common/kernels/cuda (one
// Launch*() per kernel returning cudaError_t); this file validates arguments, turns CUDA and
// cuBLAS errors into Status, and drives cuBLAS for the linear layers.
//
// Shared with CpuDevice, not copied: the memory budget (MemoryBudget), event tuples and the
// device ring buffer (device.cc / ring_buffer.cc work on any Device through Stream and Event),
// weight validation (internal::CheckLinearWeight), and the per-element math of every kernel
// (common/kernels/shared_math.h).
//
// Streams. Each Stream owns a non-blocking CUDA stream, a cuBLAS handle bound to it for life, and a
// scratch arena for the temporaries of its ops (BF16 activations, dequantized weights, MLA
// workspaces). The arena grows with cudaMallocAsync/cudaFreeAsync in stream order, so reusing it
// for the next op on the same stream is safe without host synchronization; its bytes count
// against the device budget. A stream is used by one thread at a time (device.h), so its arena
// and handle need no locks; two streams run concurrently (dual-batch) without sharing anything.
//
// Linear layers: y = W x with cuBLAS (column-major view: y^T = W x^T, A = W with op T), following
// device.h's numerics exactly up to F32 summation order. BF16 weights: BF16 x BF16 GEMM with F32
// accumulation (CUBLAS_COMPUTE_32F) on activations rounded to BF16 (round to nearest even, as
// CpuDevice). FP8 weights, two modes (CudaDeviceOptions::fp8_linear, or HMOE_CUDA_FP8_LINEAR):
//   - bf16 (the default): each code times its 128x128 block scale, rounded to BF16 once per call
//     (LaunchFp8ToScaledBf16, 16 codes per thread, into the arena), then ONE tensor-core BF16 GEMM
//     over the full K with F32 accumulation. Numerics: each weight w = code * scale becomes
//     bf16(fl32(w)), relative error <= 2^-9 + 2^-24 (the size of the activations' own BF16
//     rounding), so an output moves by at most (2^-9 + 2^-24) * sum_c |w_c x~_c| beyond the F32
//     summation error (x~: the BF16 activations). This is device.h's one exception to the block
//     numerics.
//   - blocks: the codes dequantized to BF16 *without* their scale (exact: E4M3 fits in BF16), one
//     BF16 GEMM per 128-column block (a strided batch, K = 128) into F32 partial sums, then each
//     block's sum times its block scale, summed over the blocks (LaunchBlockScaleCombine): the
//     block structure of CpuDevice's FP8 kernels, exact up to F32 summation order, but the
//     K / 128 partial planes of M x N floats make it memory-bound.
// F32 weights: F32 GEMM, no TF32. Calls with at most
// kSmallLinearMaxTokens tokens (decode) skip cuBLAS: LaunchSmallLinear streams the weight once in
// its own dtype with the same arithmetic, and needs no temporaries.
//
// Metadata uploads (MLA tiles, row lists, per-head weight descriptors) go through
// cudaMemcpyAsync from pageable host memory, which the runtime copies to a staging buffer before
// returning, so the host vectors may be reused at once.

#include <algorithm>
#include <climits>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <initializer_list>
#include <memory>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include <cuda_runtime_api.h>

#include "common/base/logging.h"
#include "common/base/status_macros.h"
#include "common/device/cpu_internal.h"
#include "common/device/cuda_check.h"
#include "common/device/cuda_handles.h"
#include "common/device/cuda_plan.h"
#include "common/device/device.h"
#include "common/device/memory_budget.h"
#include "common/device/native_stream.h"
#include "common/kernels/cuda/cuda_backend.h"
#include "common/kernels/cuda/cuda_kernels.h"
#include "common/kernels/shared_math.h"

#include <cublas_v2.h>

namespace hmoe {
namespace {

using cuda::WeightDesc;
using internal::AlignUp;
using internal::kCudaMlaChunkBytes;
using internal::LinearMode;
using internal::LinearPlan;
using internal::MlaPlan;
using internal::PlanLinear;
using internal::PlanMla;
using internal::ScratchLayout;
using kernels::ElemType;

// The stream arenas grow in steps of this many bytes.
constexpr size_t kScratchGranule = size_t{2} << 20;

absl::StatusOr<ElemType> ElemTypeOf(DType dtype, const char* what) {
  switch (dtype) {
    case DType::kF32:
      return ElemType::kF32;
    case DType::kBF16:
      return ElemType::kBF16;
    case DType::kF16:
      return ElemType::kF16;
    case DType::kF8E4M3:
      return ElemType::kF8E4M3;
    default:
      return absl::InvalidArgumentError(
          absl::StrCat(what, ": unsupported dtype ", std::string(DTypeName(dtype))));
  }
}

// internal::CheckLinearWeight, with GGUF weights refused: the CUDA kernels read FP8, BF16 and F32
// only. Unimplemented naming the dtype for F16 and the GGML block types (issue 18: dequantizing
// them for the GPU is not done; GGUF models run on the CPU device).
absl::Status CheckCudaWeight(const LinearWeight& w, const char* what) {
  if (IsBlockDType(w.dtype) || w.dtype == DType::kF16) {
    return absl::UnimplementedError(absl::StrCat(
        what, ": ", std::string(DTypeName(w.dtype)),
        " weights (GGUF) are not supported on a CUDA device yet; serve the model on the CPU"));
  }
  return internal::CheckLinearWeight(w, what);
}

// `w` already passed CheckCudaWeight (so its dtype is FP8, BF16 or F32).
WeightDesc DescOf(const LinearWeight& w) {
  WeightDesc d;
  d.data = w.data;
  d.scale_inv = w.scale_inv;
  d.rows = w.rows;
  d.cols = w.cols;
  d.row_stride = w.row_stride;
  d.scale_stride = w.scale_stride;
  d.type = w.dtype == DType::kF8E4M3 ? ElemType::kF8E4M3
           : w.dtype == DType::kBF16 ? ElemType::kBF16
                                     : ElemType::kF32;
  return d;
}

absl::Status CheckVector(const VectorWeight& v, int64_t size, const char* what) {
  if (v.data == nullptr || v.size != size ||
      (v.dtype != DType::kF32 && v.dtype != DType::kBF16 && v.dtype != DType::kF16)) {
    return absl::InvalidArgumentError(absl::StrCat(what, ": expected a BF16/F16/F32 vector of ",
                                                   size, " elements, got ", v.size));
  }
  return absl::OkStatus();
}

// cuBLAS takes int sizes and leading dimensions.
bool FitsInt(int64_t v) { return v >= 0 && v <= INT_MAX; }

absl::Status CheckGemmDims(std::initializer_list<int64_t> dims, const char* what) {
  for (int64_t d : dims) {
    if (!FitsInt(d)) {
      return absl::InvalidArgumentError(
          absl::StrCat(what, ": dimension or stride ", d, " exceeds cuBLAS's int range"));
    }
  }
  return absl::OkStatus();
}

// Returns the kernel launcher's error as Status.
#define HMOE_LAUNCH(expr) HMOE_CUDA_RETURN_IF_ERROR(expr)

// ---------------------------------------------------------------------------------- device state

class CudaStream;

// State shared by the device, its streams and the deleters of its buffers. Outlives all of them
// (owned by the device; buffers and streams must not outlive the device).
struct CudaDeviceState {
  CudaDeviceState(int ordinal, size_t budget) : ordinal(ordinal), budget(budget) {}
  const int ordinal;
  MemoryBudget budget;
  absl::Mutex mu;
  std::vector<CudaStream*> streams ABSL_GUARDED_BY(mu);
};

void FreeCudaBuffer(void* context, void* data, size_t size_bytes) {
  auto* state = static_cast<CudaDeviceState*>(context);
  HMOE_CUDA_LOG_IF_ERROR(cudaSetDevice(state->ordinal));
  // cudaFree waits for work using the buffer; DeviceBuffers are not freed on the hot path
  // (per-op temporaries live in the streams' arenas).
  HMOE_CUDA_LOG_IF_ERROR(cudaFree(data));
  state->budget.Release(size_bytes);
}

// ---------------------------------------------------------------------------------- streams

class CudaStream final : public Stream {
 public:
  CudaStream(CudaDeviceState& state, UniqueCudaStream stream, UniqueCublasHandle cublas)
      : state_(state), stream_(std::move(stream)), cublas_(std::move(cublas)) {
    absl::MutexLock lock(&state_.mu);
    state_.streams.push_back(this);
  }

  ~CudaStream() override {
    {
      absl::MutexLock lock(&state_.mu);
      state_.streams.erase(std::find(state_.streams.begin(), state_.streams.end(), this));
    }
    HMOE_CUDA_LOG_IF_ERROR(cudaSetDevice(state_.ordinal));
    ReleaseScratch();
    // cublas_ is destroyed before stream_ (reverse declaration order).
  }

  absl::Status Synchronize() override {
    HMOE_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(get()));
    return absl::OkStatus();
  }
  absl::Status WaitEvent(Event& event) override;

  cudaStream_t get() const { return stream_.get(); }
  cublasHandle_t cublas() const { return cublas_.get(); }

  // A device scratch area of at least `bytes` (256-byte aligned) for the work this op enqueues
  // on this stream; the next op on the stream may reuse it (stream order). Grows within the
  // device budget: ResourceExhausted when it does not fit.
  absl::StatusOr<std::byte*> Scratch(size_t bytes) {
    if (bytes <= scratch_bytes_) return scratch_;
    ReleaseScratch();
    const size_t size = AlignUp(bytes + bytes / 4, kScratchGranule);
    HMOE_RETURN_IF_ERROR(state_.budget.Reserve(size, "cuda device scratch"));
    void* data = nullptr;
    if (const cudaError_t err = cudaMallocAsync(&data, size, get()); err != cudaSuccess) {
      cudaGetLastError();  // out of memory is not sticky
      state_.budget.Release(size);
      return absl::ResourceExhaustedError(absl::StrCat("cuda device scratch: cudaMallocAsync of ",
                                                       size,
                                                       " bytes failed: ", cudaGetErrorName(err)));
    }
    scratch_ = static_cast<std::byte*>(data);
    scratch_bytes_ = size;
    return scratch_;
  }

 private:
  void ReleaseScratch() {
    if (scratch_ == nullptr) return;
    // Freed in stream order: after the work already enqueued that uses it.
    HMOE_CUDA_LOG_IF_ERROR(cudaFreeAsync(scratch_, get()));
    state_.budget.Release(scratch_bytes_);
    scratch_ = nullptr;
    scratch_bytes_ = 0;
  }

  CudaDeviceState& state_;
  UniqueCudaStream stream_;
  UniqueCublasHandle cublas_;
  std::byte* scratch_ = nullptr;
  size_t scratch_bytes_ = 0;
};

class CudaEvent final : public Event {
 public:
  explicit CudaEvent(UniqueCudaEvent event) : event_(std::move(event)) {}
  cudaEvent_t get() const { return event_.get(); }

  absl::Status Record(Stream& stream) override {
    HMOE_CUDA_RETURN_IF_ERROR(cudaEventRecord(get(), static_cast<CudaStream&>(stream).get()));
    return absl::OkStatus();
  }
  absl::Status Synchronize() override {
    HMOE_CUDA_RETURN_IF_ERROR(cudaEventSynchronize(get()));
    return absl::OkStatus();
  }
  bool IsComplete() override {
    const cudaError_t err = cudaEventQuery(get());
    if (err == cudaSuccess) return true;
    if (err == cudaErrorNotReady) {
      cudaGetLastError();  // "not ready" is a state, not an error: keep it out of later checks
    } else {
      HMOE_LOG(ERROR) << "cudaEventQuery failed: " << cudaGetErrorName(err);
    }
    return false;
  }

 private:
  UniqueCudaEvent event_;
};

absl::Status CudaStream::WaitEvent(Event& event) {
  HMOE_CUDA_RETURN_IF_ERROR(cudaStreamWaitEvent(get(), static_cast<CudaEvent&>(event).get(), 0));
  return absl::OkStatus();
}

CudaStream& Cuda(Stream& stream) { return static_cast<CudaStream&>(stream); }

// ---------------------------------------------------------------------------------- GEMM

// C_b = A_b B_b for b < batch, in row-major terms: C_b [n, m] (ldc) = B_b [n, k] (ldb) times
// A_b^T, A_b [m, k] (lda) a weight. A and B are BF16 (bf16) or F32; C is F32; F32 accumulation.
absl::Status GemmStridedBatched(cublasHandle_t handle, bool bf16, int64_t m, int64_t n, int64_t k,
                                const void* a, int64_t lda, int64_t stride_a, const void* b,
                                int64_t ldb, int64_t stride_b, float* c, int64_t ldc,
                                int64_t stride_c, int64_t batch) {
  HMOE_RETURN_IF_ERROR(CheckGemmDims({m, n, k, lda, ldb, ldc, batch}, "gemm"));
  const float alpha = 1.0f;
  const float beta = 0.0f;
  const cudaDataType ab = bf16 ? CUDA_R_16BF : CUDA_R_32F;
  HMOE_CUBLAS_RETURN_IF_ERROR(cublasGemmStridedBatchedEx(
      handle, CUBLAS_OP_T, CUBLAS_OP_N, static_cast<int>(m), static_cast<int>(n),
      static_cast<int>(k), &alpha, a, ab, static_cast<int>(lda), stride_a, b, ab,
      static_cast<int>(ldb), stride_b, &beta, c, CUDA_R_32F, static_cast<int>(ldc), stride_c,
      static_cast<int>(batch), CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
  return absl::OkStatus();
}

// y[t * y_stride + r] = sum_c W[r][c] x[t * x_stride + c] for t < n, r < w.rows, as planned;
// `scratch` holds plan.bytes of the stream's arena.
absl::Status RunLinear(CudaStream& s, const LinearPlan& plan, std::byte* scratch,
                       const LinearWeight& w, const float* x, int64_t x_stride, int64_t n, float* y,
                       int64_t y_stride) {
  HMOE_RETURN_IF_ERROR(
      CheckGemmDims({w.rows, plan.k_padded, w.row_stride, x_stride, y_stride}, "linear"));
  const WeightDesc desc = DescOf(w);
  const bool f32 = plan.mode == LinearMode::kF32;
  const int64_t elem = f32 ? 4 : 2;
  auto* xb = reinterpret_cast<uint16_t*>(scratch + plan.x_offset);
  auto* partials = reinterpret_cast<float*>(scratch + plan.partial_offset);
  // With one row chunk, the converted weight stays in the arena across token chunks.
  bool packed = false;
  for (int64_t t0 = 0; t0 < n; t0 += plan.token_chunk) {
    const int64_t tn = std::min(plan.token_chunk, n - t0);
    const void* b = x + t0 * x_stride;
    int64_t ldb = x_stride;
    if (!f32) {
      HMOE_LAUNCH(cuda::LaunchF32ToBf16(x + t0 * x_stride, x_stride, tn, w.cols, xb, plan.k_padded,
                                        plan.k_padded, s.get()));
      b = xb;
      ldb = plan.k_padded;
    }
    for (int64_t r0 = 0; r0 < w.rows; r0 += plan.row_chunk) {
      const int64_t rn = std::min(plan.row_chunk, w.rows - r0);
      const void* a = static_cast<const std::byte*>(w.data) + r0 * w.row_stride * elem;
      int64_t lda = w.row_stride;
      if (!plan.direct) {
        if (!packed) {
          if (plan.mode == LinearMode::kFp8Bf16) {
            HMOE_LAUNCH(cuda::LaunchFp8ToScaledBf16(
                desc, r0, rn, reinterpret_cast<uint16_t*>(scratch + plan.w_offset), plan.k_padded,
                s.get()));
          } else {
            const cuda::PackMode mode = plan.mode == LinearMode::kF32 ? cuda::PackMode::kF32
                                        : plan.mode == LinearMode::kBf16
                                            ? cuda::PackMode::kBf16
                                            : cuda::PackMode::kFp8CodesBf16;
            HMOE_LAUNCH(cuda::LaunchPackWeight(desc, r0, rn, plan.k_padded, scratch + plan.w_offset,
                                               mode, s.get()));
          }
          packed = rn == w.rows;
        }
        a = scratch + plan.w_offset;
        lda = plan.k_padded;
      }
      float* out = y + t0 * y_stride + r0;
      if (plan.mode != LinearMode::kFp8Blocks) {
        // kFp8Bf16 included: one GEMM over all w.cols columns of the scaled BF16 weight.
        HMOE_RETURN_IF_ERROR(GemmStridedBatched(s.cublas(), !f32, rn, tn, w.cols, a, lda, 0, b, ldb,
                                                0, out, y_stride, 0, 1));
        continue;
      }
      // One GEMM per 128-column block: partials[blk][t][r], then the scaled sum over blocks.
      HMOE_RETURN_IF_ERROR(GemmStridedBatched(s.cublas(), /*bf16=*/true, rn, tn, 128, a, lda, 128,
                                              b, ldb, 128, partials, rn, tn * rn, plan.num_blocks));
      HMOE_LAUNCH(cuda::LaunchBlockScaleCombine(partials, plan.num_blocks, tn, rn, w.scale_inv,
                                                w.scale_stride, r0, out, y_stride, s.get()));
    }
  }
  return absl::OkStatus();
}

// ---------------------------------------------------------------------------------- MLA

// internal::CheckMlaAttentionArgs plus what the CUDA kernels add: W_UK^T heads of one dtype, row
// indices that fit int32, and the attention kernel's shared-memory limits.
absl::Status ValidateMla(const MlaAttentionArgs& a, bool partial) {
  for (const LinearWeight& w : a.w_uk_t) HMOE_RETURN_IF_ERROR(CheckCudaWeight(w, "mla W_UK^T"));
  if (!partial) HMOE_RETURN_IF_ERROR(CheckCudaWeight(a.kv_b, "mla kv_b"));
  HMOE_RETURN_IF_ERROR(internal::CheckMlaAttentionArgs(a, partial));
  const MlaDimensions& d = a.dims;
  for (const LinearWeight& w : a.w_uk_t) {
    if (w.dtype != a.w_uk_t[0].dtype) {
      return absl::InvalidArgumentError("mla attention: W_UK^T heads of different dtypes");
    }
  }
  for (const MlaSegment& s : a.segments) {
    if (s.query_begin + s.num_queries > INT32_MAX) {
      return absl::InvalidArgumentError("mla attention: bad segment");
    }
  }
  if (d.kv_lora_rank > cuda::kMlaMaxLatent ||
      cuda::MlaAttendSharedBytes(a.cache.row_floats) > cuda::kMlaMaxSharedBytes) {
    return absl::UnimplementedError(absl::StrCat(
        "mla attention on cuda: kv_lora_rank ", d.kv_lora_rank, " + rope_dim ", d.rope_dim,
        " exceeds the kernel's limits (kv_lora_rank <= ", cuda::kMlaMaxLatent,
        ", kv_lora_rank + rope_dim <= 782)"));
  }
  return absl::OkStatus();
}

// How MLA's projections run for more than kSmallLinearMaxTokens rows (the weights are packed into
// the stream's arena on every call, see RunMlaAttention):
//   kF32: the weight converted to compact F32 (FP8 scaled: one F32 rounding of code * scale;
//         BF16 and F32 exact), one F32 GEMM per head on activations rounded to BF16 for FP8/BF16
//         weights (no tensor cores);
//   kFp8: the FP8 codes as exact BF16 (compact, columns zero-padded to whole 128-blocks) times
//         the BF16 activations on tensor cores (F32 accumulation), one GEMM per 128-column block
//         into F32 partial sums, then each block's sum times its block scale, summed over the
//         blocks in order (LaunchMlaBlockScale): CpuDevice's FP8 numerics up to F32 summation
//         order (E4M3 codes and BF16 activations multiply exactly), as RunLinear's kFp8.
enum class MlaProjMode { kF32, kFp8 };

struct MlaProjPlan {
  MlaProjMode mode = MlaProjMode::kF32;
  int64_t k_padded = 0;    // columns of the packed weight and of the BF16 activations
  int64_t num_blocks = 0;  // kFp8: 128-column blocks
  int64_t elem_bytes = 4;  // of the packed weight
};

// `max_k_blocks`: the most 128-column blocks the kFp8 mode may use (W_UK^T: 1, so that the block
// scale is applied to the GEMM's output in place; kv_b: any).
MlaProjPlan PlanMlaProj(const LinearWeight& w, int64_t max_k_blocks) {
  MlaProjPlan p;
  const int64_t blocks = (w.cols + 127) / 128;
  if (w.dtype == DType::kF8E4M3 && blocks <= max_k_blocks) {
    p.mode = MlaProjMode::kFp8;
    p.num_blocks = blocks;
    p.k_padded = blocks * 128;
    p.elem_bytes = 2;
  } else {
    p.k_padded = w.cols;
  }
  return p;
}

cuda::PackMode PackModeOf(const MlaProjPlan& p) {
  return p.mode == MlaProjMode::kFp8 ? cuda::PackMode::kFp8CodesBf16 : cuda::PackMode::kF32;
}

// o[t, h, :] = W_UV_h u[t, h] for t < rn, h < nh (u and o compact: [rn, nh, rkv] / [rn, nh, dv]),
// W_UV_h = rows h * (dn + dv) + dn .. + dv of kv_b, packed (all nh * (dn + dv) rows) at `packed`
// as `plan` says. `act`: room for rn * nh * plan.k_padded floats (kF32 with a BF16 kv_b: u rounded
// to BF16 values; kFp8: u as BF16); `partials`: plan.num_blocks * rn * nh * dv floats (kFp8).
absl::Status ProjectUv(CudaStream& s, const MlaDimensions& d, const LinearWeight& kv_b,
                       const MlaProjPlan& plan, const void* packed, const float* u, int64_t rn,
                       void* act, float* partials, float* o) {
  const int64_t nh = d.num_heads, dn = d.nope_dim, dv = d.v_dim, rkv = d.kv_lora_rank;
  const int64_t k = plan.k_padded;
  if (plan.mode == MlaProjMode::kF32) {
    const float* x = u;
    if (kv_b.dtype != DType::kF32) {  // BF16 weights: BF16-valued activations
      auto* r = static_cast<float*>(act);
      HMOE_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(r, u, static_cast<size_t>(rn * nh * rkv) * 4,
                                                cudaMemcpyDeviceToDevice, s.get()));
      HMOE_LAUNCH(cuda::LaunchRoundToBf16(r, rn * nh * rkv, s.get()));
      x = r;
    }
    return GemmStridedBatched(s.cublas(), /*bf16=*/false, dv, rn, rkv,
                              static_cast<const float*>(packed) + dn * rkv, rkv, (dn + dv) * rkv, x,
                              nh * rkv, rkv, o, nh * dv, dv, nh);
  }
  // kFp8: u to BF16 (zero-padded to whole blocks), one GEMM per block over all heads.
  auto* ub = static_cast<uint16_t*>(act);
  HMOE_LAUNCH(cuda::LaunchF32ToBf16(u, rkv, rn * nh, rkv, ub, k, k, s.get()));
  const auto* w = static_cast<const uint16_t*>(packed) + dn * k;
  const int64_t plane = rn * nh * dv;
  for (int64_t b = 0; b < plan.num_blocks; ++b) {
    HMOE_RETURN_IF_ERROR(GemmStridedBatched(s.cublas(), /*bf16=*/true, dv, rn, 128, w + b * 128, k,
                                            (dn + dv) * k, ub + b * 128, nh * k, k,
                                            partials + b * plane, nh * dv, dv, nh));
  }
  HMOE_LAUNCH(cuda::LaunchMlaBlockScale(partials, plan.num_blocks, plane, nh * dv, dv, rn, nh, dv,
                                        kv_b.scale_inv, kv_b.scale_stride, nullptr, dn, dn + dv, o,
                                        nh * dv, dv, s.get()));
  return absl::OkStatus();
}

// Bytes per query row of the temporaries of RunMlaAttention / RunMlaProject beyond their F32
// buffers: the BF16 q_nope and u (u: up to whole 128-blocks, F32 when copied to be rounded) and
// the per-block partial sums of the W_UV projection. Independent of the weights' dtypes, so the
// chunking (and the tiles) of a call do not depend on them.
int64_t MlaProjRowBytes(const MlaDimensions& d) {
  const int64_t blocks = (d.kv_lora_rank + 127) / 128;
  return d.num_heads * (2 * d.nope_dim + 4 * blocks * 128 + 4 * blocks * d.v_dim);
}

// Weight-absorbed MLA (device.h MlaAttentionArgs) for both device ops:
//   1. upload the plan (row list, tiles) and the per-head W_UK^T descriptors;
//   2. per chunk of rows: gather q_nope and q_pe; q~ = W_UK_h^T q_nope for every head, written
//      next to q_pe; the flash-style attention core (u); out_h = W_UV_h u; scatter the rows to
//      `out`.
// The projections follow CpuDevice's numerics (activations rounded to BF16 for FP8/BF16 weights,
// FP8 summed per 128-column block then scaled, F32 accumulation). With few rows (decode) they run
// straight from the weights (LaunchSmallLinear, batched over the heads: the weights are read once,
// nothing is converted); otherwise as MlaProjMode says: FP8 W_UK^T (nope_dim <= 128: one block
// along K, so the scale applies to the GEMM's output rows in place) and FP8 kv_b as BF16 codes on
// tensor cores, other dtypes as F32 GEMMs.
//
// The weights are packed (FP8 -> BF16 codes: nh * Rkv * dn + nh * (dn + dv) * Rkv elements, about
// 50 MB of writes for DeepSeek-V3, some 20 us of an H100's bandwidth) on every call, not cached:
// with stream-loaded layers (SLP) a layer's weights live in memory that later holds another
// layer's, so a cache keyed by the weight's device address could return another layer's codes,
// and the Device API carries no load generation to key it safely.
// With `partial` (MlaAttentionPartial): the attention core honours the key ranges and merges
// into the state (LaunchMlaAttendPartial); there is no projection.
// HMOE_CUDA_MLA_ATTENTION: "gemm" (default) scores each sequence's keys with cuBLAS F32 GEMMs
// (cuda_kernels.h, LaunchMlaMaskedSoftmax); "tiles" keeps the tiled kernel (LaunchMlaAttend), which
// the first H100 run measured at 1.4-1.6 TFLOP/s in prefill and 14 ms per layer for one decode
// query at 4K context (docs/PERFORMANCE.md "GPU check"). MlaAttentionPartial always tiles.
absl::StatusOr<bool> MlaAttentionGemm() {
  const char* env = std::getenv("HMOE_CUDA_MLA_ATTENTION");
  if (env == nullptr || *env == '\0' || std::strcmp(env, "gemm") == 0) return true;
  if (std::strcmp(env, "tiles") == 0) return false;
  return absl::InvalidArgumentError(
      absl::StrCat("HMOE_CUDA_MLA_ATTENTION=\"", env, "\": expected \"gemm\" or \"tiles\""));
}

// Scores of a GEMM-attention block are capped at this many bytes (the rows of a run are split).
constexpr int64_t kMlaScoreBytes = int64_t{256} << 20;

// One sequence's consecutive query rows within a chunk of RunMlaAttention.
struct MlaRun {
  int64_t first_row = 0;  // chunk-local
  int64_t rows = 0;
  int64_t first_pos = 0;
  int64_t table_offset = 0;
};

// The runs of a chunk's tiles (those with first_head 0 cover each query once, in order).
std::vector<MlaRun> MlaRunsOf(std::span<const cuda::MlaTile> tiles) {
  std::vector<MlaRun> runs;
  for (const cuda::MlaTile& t : tiles) {
    if (t.first_head != 0) continue;
    if (!runs.empty()) {
      MlaRun& last = runs.back();
      if (last.table_offset == t.table_offset && last.first_row + last.rows == t.first_row &&
          last.first_pos + last.rows == t.first_pos) {
        last.rows += t.num_queries;
        continue;
      }
    }
    runs.push_back({t.first_row, t.num_queries, t.first_pos, t.table_offset});
  }
  return runs;
}

// u[(row * nh + h) * rkv ...] for the runs' rows: gather, score GEMM, masked softmax, P c GEMM.
absl::Status MlaAttendGemm(CudaStream& s, const MlaDimensions& d, const float* qcat,
                           const cuda::KvCacheDesc& cache, const int32_t* block_tables,
                           std::span<const MlaRun> runs, float* kv, float* scores,
                           int64_t score_floats, float* u) {
  const int64_t nh = d.num_heads, rkv = d.kv_lora_rank, rf = cache.row_floats;
  for (const MlaRun& run : runs) {
    const int64_t keys = run.first_pos + run.rows;  // the last query sees them all
    HMOE_LAUNCH(
        cuda::LaunchGatherKvRows(cache, block_tables + run.table_offset, keys, kv, s.get()));
    const int64_t step = std::max<int64_t>(1, score_floats / (nh * keys));
    for (int64_t q = 0; q < run.rows; q += step) {
      const int64_t m = std::min(step, run.rows - q) * nh;  // (query, head) rows
      HMOE_RETURN_IF_ERROR(CheckGemmDims({keys, m, rf}, "mla attention gemm"));
      const float scale = d.softmax_scale, one = 1.0f, zero = 0.0f;
      // scores[i][k] = scale * qcat_row_i . kv_k (column-major: kv^T as op T, qcat rows as op N).
      HMOE_CUBLAS_RETURN_IF_ERROR(
          cublasSgemm(s.cublas(), CUBLAS_OP_T, CUBLAS_OP_N, static_cast<int>(keys),
                      static_cast<int>(m), static_cast<int>(rf), &scale, kv, static_cast<int>(rf),
                      qcat + (run.first_row + q) * nh * rf, static_cast<int>(rf), &zero, scores,
                      static_cast<int>(keys)));
      HMOE_LAUNCH(cuda::LaunchMlaMaskedSoftmax(scores, m, keys, nh, run.first_pos + q, s.get()));
      // u_i = sum_k p_ik c_k (c: the first rkv floats of each key row).
      HMOE_CUBLAS_RETURN_IF_ERROR(cublasSgemm(
          s.cublas(), CUBLAS_OP_N, CUBLAS_OP_N, static_cast<int>(rkv), static_cast<int>(m),
          static_cast<int>(keys), &one, kv, static_cast<int>(rf), scores, static_cast<int>(keys),
          &zero, u + (run.first_row + q) * nh * rkv, static_cast<int>(rkv)));
    }
  }
  return absl::OkStatus();
}

absl::Status RunMlaAttention(CudaStream& s, const MlaAttentionArgs& a,
                             const MlaPartialState* partial = nullptr) {
  HMOE_RETURN_IF_ERROR(ValidateMla(a, partial != nullptr));
  bool gemm_attend = false;
  if (partial == nullptr) {
    HMOE_ASSIGN_OR_RETURN(gemm_attend, MlaAttentionGemm());
  }
  if (partial != nullptr) {
    if (a.key_ranges.size() != a.segments.size()) {
      return absl::InvalidArgumentError(absl::StrCat("mla partial attention: ", a.key_ranges.size(),
                                                     " key ranges for ", a.segments.size(),
                                                     " segments"));
    }
    if (partial->u == nullptr || partial->lse == nullptr) {
      return absl::InvalidArgumentError("mla partial attention: no state");
    }
  }
  const MlaDimensions& d = a.dims;
  const int64_t nh = d.num_heads, dn = d.nope_dim, dr = d.rope_dim, dv = d.v_dim;
  const int64_t rkv = d.kv_lora_rank;
  const int64_t row_floats = rkv + dr;
  const bool uk_round = a.w_uk_t[0].dtype != DType::kF32;
  const bool uv_round = a.kv_b.dtype != DType::kF32;
  const int64_t kvb_rows = nh * (dn + dv);
  const MlaProjPlan uk_plan = PlanMlaProj(a.w_uk_t[0], /*max_k_blocks=*/1);
  const MlaProjPlan uv_plan =
      partial != nullptr ? MlaProjPlan{} : PlanMlaProj(a.kv_b, /*max_k_blocks=*/INT64_MAX);

  const int64_t row_bytes = 4 * nh * (dn + row_floats + rkv + dv) + MlaProjRowBytes(d);
  const MlaPlan plan = PlanMla(a.segments, a.dims.num_heads, kCudaMlaChunkBytes / row_bytes,
                               partial != nullptr ? a.key_ranges : std::span<const MlaKeyRange>());
  const int64_t total_rows = static_cast<int64_t>(plan.q_rows.size());
  if (total_rows == 0) return absl::OkStatus();
  const int64_t chunk = std::min(plan.chunk_rows, total_rows);
  HMOE_RETURN_IF_ERROR(CheckGemmDims(
      {nh * dn, nh * row_floats, nh * rkv, nh * dv, chunk, nh * uv_plan.k_padded}, "mla"));
  if (nh > 65535) return absl::InvalidArgumentError("mla attention: more than 65535 heads");
  // Decode-sized calls (one chunk of few rows) read the projection weights directly.
  const bool small = total_rows <= cuda::kSmallLinearMaxTokens;

  // Host metadata: [q_rows][tiles][W_UK^T descriptors], uploaded in one copy.
  ScratchLayout meta;
  const size_t rows_off = meta.Add(plan.q_rows.size() * sizeof(int32_t));
  const size_t tiles_off = meta.Add(plan.tiles.size() * sizeof(cuda::MlaTile));
  const size_t descs_off = meta.Add(static_cast<size_t>(nh) * sizeof(WeightDesc));
  std::vector<std::byte> host(meta.size());
  std::memcpy(host.data() + rows_off, plan.q_rows.data(), plan.q_rows.size() * sizeof(int32_t));
  std::memcpy(host.data() + tiles_off, plan.tiles.data(),
              plan.tiles.size() * sizeof(cuda::MlaTile));
  for (int64_t h = 0; h < nh; ++h) {
    const WeightDesc desc = DescOf(a.w_uk_t[h]);
    std::memcpy(host.data() + descs_off + h * sizeof(WeightDesc), &desc, sizeof(desc));
  }

  ScratchLayout layout;
  const size_t meta_off = layout.Add(meta.size());
  const size_t uk_off =
      small ? 0 : layout.Add(static_cast<size_t>(nh * rkv * dn * uk_plan.elem_bytes));
  const bool project = !small && partial == nullptr;
  const size_t kvb_off =
      project ? layout.Add(static_cast<size_t>(kvb_rows * uv_plan.k_padded * uv_plan.elem_bytes))
              : 0;
  const size_t qn_off = layout.Add(static_cast<size_t>(chunk * nh * dn * 4));
  const size_t qb_off = small ? 0 : layout.Add(static_cast<size_t>(chunk * nh * dn * 2));
  const size_t qcat_off = layout.Add(static_cast<size_t>(chunk * nh * row_floats * 4));
  const size_t u_off = layout.Add(static_cast<size_t>(chunk * nh * rkv * 4));
  const size_t act_off =
      project ? layout.Add(static_cast<size_t>(chunk * nh * uv_plan.k_padded * 4)) : 0;
  const size_t part_off =
      project ? layout.Add(static_cast<size_t>(uv_plan.num_blocks * chunk * nh * dv * 4)) : 0;
  const size_t o_off = layout.Add(static_cast<size_t>(chunk * nh * dv * 4));
  // GEMM attention: one sequence's keys, and a block of scores (at least one query's heads).
  int64_t max_keys = 0;
  for (const MlaSegment& seg : a.segments) {
    max_keys = std::max(max_keys, seg.start_pos + seg.num_queries);
  }
  const int64_t score_floats =
      std::max(nh * max_keys, std::min(chunk * nh * max_keys, kMlaScoreBytes / 4));
  const size_t kv_off =
      gemm_attend ? layout.Add(static_cast<size_t>(max_keys * a.cache.row_floats * 4)) : 0;
  const size_t scores_off = gemm_attend ? layout.Add(static_cast<size_t>(score_floats * 4)) : 0;
  HMOE_ASSIGN_OR_RETURN(std::byte * scratch, s.Scratch(layout.size()));

  std::byte* meta_dev = scratch + meta_off;
  HMOE_CUDA_RETURN_IF_ERROR(
      cudaMemcpyAsync(meta_dev, host.data(), host.size(), cudaMemcpyHostToDevice, s.get()));
  const auto* q_rows_dev = reinterpret_cast<const int32_t*>(meta_dev + rows_off);
  const auto* tiles_dev = reinterpret_cast<const cuda::MlaTile*>(meta_dev + tiles_off);
  const auto* descs_dev = reinterpret_cast<const WeightDesc*>(meta_dev + descs_off);

  std::byte* uk = scratch + uk_off;
  std::byte* kvb = scratch + kvb_off;
  const WeightDesc kv_b = partial != nullptr ? WeightDesc{} : DescOf(a.kv_b);
  if (!small) {
    HMOE_LAUNCH(cuda::LaunchPackWeights(descs_dev, static_cast<int>(nh), rkv * dn, uk, rkv * dn,
                                        PackModeOf(uk_plan), s.get()));
    if (project) {
      HMOE_LAUNCH(cuda::LaunchPackWeight(kv_b, 0, kvb_rows, uv_plan.k_padded, kvb,
                                         PackModeOf(uv_plan), s.get()));
    }
  }

  MlaDimensions shape;
  shape.num_heads = nh;
  shape.nope_dim = dn;
  shape.rope_dim = dr;
  shape.v_dim = dv;
  shape.kv_lora_rank = rkv;
  shape.softmax_scale = d.softmax_scale;
  cuda::KvCacheDesc cache;
  cache.base = a.cache.base;
  cache.block_size = a.cache.block_size;
  cache.block_stride = a.cache.block_stride;
  cache.row_floats = a.cache.row_floats;

  auto* qn = reinterpret_cast<float*>(scratch + qn_off);
  auto* qb = reinterpret_cast<uint16_t*>(scratch + qb_off);
  auto* qcat = reinterpret_cast<float*>(scratch + qcat_off);
  auto* u = reinterpret_cast<float*>(scratch + u_off);
  auto* partials = reinterpret_cast<float*>(scratch + part_off);
  auto* o = reinterpret_cast<float*>(scratch + o_off);
  for (size_t c = 0; c + 1 < plan.chunk_tiles.size(); ++c) {
    const int64_t r0 = static_cast<int64_t>(c) * plan.chunk_rows;
    const int64_t rn = std::min(plan.chunk_rows, total_rows - r0);
    HMOE_LAUNCH(cuda::LaunchMlaGatherQ(a.q, a.q_stride, q_rows_dev + r0, rn, shape, qn, uk_round,
                                       qcat, s.get()));
    // q~[t, h, 0:Rkv] = W_UK_h^T q_nope[t, h], head h = batch entry h.
    if (small) {
      HMOE_LAUNCH(cuda::LaunchSmallLinear(WeightDesc{}, descs_dev, nh, 0, 0, rkv, qn, dn, nh * dn,
                                          rn, uk_round, qcat, row_floats, nh * row_floats,
                                          s.get()));
    } else if (uk_plan.mode == MlaProjMode::kF32) {
      HMOE_RETURN_IF_ERROR(GemmStridedBatched(s.cublas(), /*bf16=*/false, rkv, rn, dn, uk, dn,
                                              rkv * dn, qn, nh * dn, dn, qcat, nh * row_floats,
                                              row_floats, nh));
    } else {
      // The code sums of the single 128-column block (q_nope is BF16-valued already: exact),
      // then each W_UK^T row's block scale, in place.
      HMOE_LAUNCH(cuda::LaunchF32ToBf16(qn, dn, rn * nh, dn, qb, dn, dn, s.get()));
      HMOE_RETURN_IF_ERROR(GemmStridedBatched(s.cublas(), /*bf16=*/true, rkv, rn, dn, uk, dn,
                                              rkv * dn, qb, nh * dn, dn, qcat, nh * row_floats,
                                              row_floats, nh));
      HMOE_LAUNCH(cuda::LaunchMlaBlockScale(qcat, 1, 0, nh * row_floats, row_floats, rn, nh, rkv,
                                            nullptr, 0, descs_dev, 0, 0, qcat, nh * row_floats,
                                            row_floats, s.get()));
    }
    const int64_t t0 = plan.chunk_tiles[c];
    if (partial != nullptr) {
      HMOE_LAUNCH(cuda::LaunchMlaAttendPartial(shape, qcat, cache, a.block_tables, tiles_dev + t0,
                                               plan.chunk_tiles[c + 1] - t0, q_rows_dev + r0,
                                               partial->u, partial->lse, partial->first, s.get()));
      continue;
    }
    if (gemm_attend) {
      const std::vector<MlaRun> runs = MlaRunsOf(std::span<const cuda::MlaTile>(
          plan.tiles.data() + t0, static_cast<size_t>(plan.chunk_tiles[c + 1] - t0)));
      HMOE_RETURN_IF_ERROR(MlaAttendGemm(
          s, shape, qcat, cache, a.block_tables, runs, reinterpret_cast<float*>(scratch + kv_off),
          reinterpret_cast<float*>(scratch + scores_off), score_floats, u));
    } else {
      HMOE_LAUNCH(cuda::LaunchMlaAttend(shape, qcat, cache, a.block_tables, tiles_dev + t0,
                                        plan.chunk_tiles[c + 1] - t0, u, s.get()));
    }
    // o[t, h, :] = W_UV_h u[t, h]: W_UV_h is rows h * (dn + dv) + dn .. + dv of kv_b.
    if (small) {
      HMOE_LAUNCH(cuda::LaunchSmallLinear(kv_b, nullptr, nh, dn, dn + dv, dv, u, rkv, nh * rkv, rn,
                                          uv_round, o, dv, nh * dv, s.get()));
    } else {
      HMOE_RETURN_IF_ERROR(
          ProjectUv(s, d, a.kv_b, uv_plan, kvb, u, rn, scratch + act_off, partials, o));
    }
    HMOE_LAUNCH(cuda::LaunchCopyRows(o, nh * dv, nullptr, a.out, a.out_stride, q_rows_dev + r0, rn,
                                     nh * dv, s.get()));
  }
  return absl::OkStatus();
}

// MlaProjectLatent: out[t, h] = W_UV_h u[t, h], the projection step of RunMlaAttention (small
// batches straight from the weight, otherwise kv_b packed as MlaProjMode says and ProjectUv over
// all heads), then the rows copied to `out`.
absl::Status RunMlaProject(CudaStream& s, const MlaDimensions& d, const LinearWeight& kv_b_w,
                           const float* u, int64_t n, float* out, int64_t out_stride) {
  if (d.num_heads <= 0 || d.nope_dim <= 0 || d.v_dim <= 0 || d.kv_lora_rank <= 0 || n < 0) {
    return absl::InvalidArgumentError("mla projection: non-positive dimension");
  }
  HMOE_RETURN_IF_ERROR(CheckCudaWeight(kv_b_w, "mla projection kv_b"));
  if (kv_b_w.rows < d.num_heads * (d.nope_dim + d.v_dim) || kv_b_w.cols != d.kv_lora_rank) {
    return absl::InvalidArgumentError("mla projection: kv_b has the wrong shape");
  }
  if (n == 0) return absl::OkStatus();
  if (u == nullptr || out == nullptr || out_stride < d.num_heads * d.v_dim) {
    return absl::InvalidArgumentError("mla projection: bad pointers or stride");
  }
  const int64_t nh = d.num_heads, dn = d.nope_dim, dv = d.v_dim, rkv = d.kv_lora_rank;
  const int64_t kvb_rows = nh * (dn + dv);
  const bool uv_round = kv_b_w.dtype != DType::kF32;
  const bool small = n <= cuda::kSmallLinearMaxTokens;
  const WeightDesc kv_b = DescOf(kv_b_w);
  const MlaProjPlan plan = PlanMlaProj(kv_b_w, /*max_k_blocks=*/INT64_MAX);
  // Rows per pass bound the temporaries (the activations to round, partial sums, the outputs).
  const int64_t chunk =
      std::max<int64_t>(1, kCudaMlaChunkBytes / (4 * nh * dv + MlaProjRowBytes(d)));
  const int64_t rows = std::min(chunk, n);
  HMOE_RETURN_IF_ERROR(
      CheckGemmDims({nh * rkv, nh * dv, rows, nh * plan.k_padded}, "mla projection"));
  ScratchLayout layout;
  const size_t kvb_off =
      small ? 0 : layout.Add(static_cast<size_t>(kvb_rows * plan.k_padded * plan.elem_bytes));
  // kF32: a copy of u to round (floats); kFp8: u as BF16, whole blocks.
  const size_t act_off = layout.Add(static_cast<size_t>(rows * nh * plan.k_padded * 4));
  const size_t part_off = layout.Add(static_cast<size_t>(plan.num_blocks * rows * nh * dv * 4));
  const size_t o_off = layout.Add(static_cast<size_t>(rows * nh * dv * 4));
  HMOE_ASSIGN_OR_RETURN(std::byte * scratch, s.Scratch(layout.size()));
  std::byte* kvb = scratch + kvb_off;
  auto* partials = reinterpret_cast<float*>(scratch + part_off);
  auto* o = reinterpret_cast<float*>(scratch + o_off);
  if (!small) {
    HMOE_LAUNCH(
        cuda::LaunchPackWeight(kv_b, 0, kvb_rows, plan.k_padded, kvb, PackModeOf(plan), s.get()));
  }
  for (int64_t r0 = 0; r0 < n; r0 += chunk) {
    const int64_t rn = std::min(chunk, n - r0);
    const float* ur0 = u + r0 * nh * rkv;
    if (small) {
      HMOE_LAUNCH(cuda::LaunchSmallLinear(kv_b, nullptr, nh, dn, dn + dv, dv, ur0, rkv, nh * rkv,
                                          rn, uv_round, o, dv, nh * dv, s.get()));
    } else {
      HMOE_RETURN_IF_ERROR(
          ProjectUv(s, d, kv_b_w, plan, kvb, ur0, rn, scratch + act_off, partials, o));
    }
    HMOE_LAUNCH(cuda::LaunchCopyRows(o, nh * dv, nullptr, out + r0 * out_stride, out_stride,
                                     nullptr, rn, nh * dv, s.get()));
  }
  return absl::OkStatus();
}

// ---------------------------------------------------------------------------------- device

class CudaDevice final : public Device {
 public:
  CudaDevice(int ordinal, size_t budget, bool fp8_blocks)
      : ordinal_(ordinal),
        fp8_blocks_(fp8_blocks),
        state_(std::make_unique<CudaDeviceState>(ordinal, budget)) {}

  DeviceKind kind() const override { return DeviceKind::kCuda; }
  std::string name() const override { return absl::StrCat("cuda:", ordinal_); }
  bool host_accessible() const override { return false; }

  // --- memory

  absl::StatusOr<DeviceBuffer> Allocate(size_t size_bytes) override {
    if (size_bytes == 0) return absl::InvalidArgumentError("cuda device: allocate 0 bytes");
    HMOE_RETURN_IF_ERROR(state_->budget.Reserve(size_bytes, "cuda device allocate"));
    return Make(size_bytes);
  }
  absl::StatusOr<DeviceBuffer> AllocateBlocking(size_t size_bytes, absl::Time deadline) override {
    if (size_bytes == 0) return absl::InvalidArgumentError("cuda device: allocate 0 bytes");
    HMOE_RETURN_IF_ERROR(
        state_->budget.ReserveBlocking(size_bytes, deadline, "cuda device allocate"));
    return Make(size_bytes);
  }
  size_t bytes_in_use() const override { return state_->budget.bytes_in_use(); }
  size_t peak_bytes_in_use() const override { return state_->budget.peak_bytes_in_use(); }
  void ResetPeakBytes() override { state_->budget.ResetPeak(); }
  size_t budget_bytes() const override { return state_->budget.budget_bytes(); }

  // --- streams and events

  absl::StatusOr<std::unique_ptr<Stream>> CreateStream() override {
    HMOE_RETURN_IF_ERROR(Enter());
    HMOE_ASSIGN_OR_RETURN(UniqueCudaStream stream, NewCudaStream());
    HMOE_ASSIGN_OR_RETURN(UniqueCublasHandle cublas, NewCublasHandle(stream.get()));
    return std::unique_ptr<Stream>(new CudaStream(*state_, std::move(stream), std::move(cublas)));
  }
  absl::StatusOr<std::unique_ptr<Event>> CreateEvent() override {
    HMOE_RETURN_IF_ERROR(Enter());
    HMOE_ASSIGN_OR_RETURN(UniqueCudaEvent event, NewCudaEvent());
    return std::unique_ptr<Event>(new CudaEvent(std::move(event)));
  }
  // Waits for every stream of this device, one by one (no cudaDeviceSynchronize: other users of
  // the GPU are not waited for).
  absl::Status Synchronize() override {
    HMOE_RETURN_IF_ERROR(Enter());
    absl::MutexLock lock(&state_->mu);
    for (CudaStream* stream : state_->streams) HMOE_RETURN_IF_ERROR(stream->Synchronize());
    return absl::OkStatus();
  }

  // --- copies

  absl::Status CopyToDevice(Stream& s, void* dst, const void* src, size_t bytes) override {
    return Copy(s, dst, src, bytes, cudaMemcpyHostToDevice);
  }
  absl::Status CopyToHost(Stream& s, void* dst, const void* src, size_t bytes) override {
    return Copy(s, dst, src, bytes, cudaMemcpyDeviceToHost);
  }
  absl::Status CopyOnDevice(Stream& s, void* dst, const void* src, size_t bytes) override {
    return Copy(s, dst, src, bytes, cudaMemcpyDeviceToDevice);
  }
  absl::Status Memset(Stream& s, void* dst, int value, size_t bytes) override {
    if (bytes == 0) return absl::OkStatus();
    if (dst == nullptr) return absl::InvalidArgumentError("memset: null pointer");
    HMOE_RETURN_IF_ERROR(Enter());
    HMOE_CUDA_RETURN_IF_ERROR(cudaMemsetAsync(dst, value, bytes, Cuda(s).get()));
    return absl::OkStatus();
  }

  // --- compute ops

  absl::Status Linear(Stream& s, const LinearWeight& w, const float* x, int64_t x_stride, int64_t n,
                      float* y, int64_t y_stride) override {
    HMOE_RETURN_IF_ERROR(CheckCudaWeight(w, "linear"));
    if (n < 0 ||
        (n > 0 && (x == nullptr || y == nullptr || x_stride < w.cols || y_stride < w.rows))) {
      return absl::InvalidArgumentError(
          absl::StrCat("linear: bad activations (n ", n, ", x_stride ", x_stride, ", y_stride ",
                       y_stride, ") for [", w.rows, ", ", w.cols, "]"));
    }
    if (n == 0) return absl::OkStatus();
    HMOE_RETURN_IF_ERROR(Enter());
    CudaStream& cs = Cuda(s);
    if (n <= cuda::kSmallLinearMaxTokens) {
      // Decode: straight from the weight, no temporaries.
      HMOE_LAUNCH(cuda::LaunchSmallLinear(DescOf(w), nullptr, 1, 0, 0, w.rows, x, 0, x_stride, n,
                                          /*round_bf16=*/w.dtype != DType::kF32, y, 0, y_stride,
                                          cs.get()));
      return absl::OkStatus();
    }
    const LinearPlan plan = PlanLinear(w, /*f32=*/false, n, fp8_blocks_);
    std::byte* scratch = nullptr;
    if (plan.bytes > 0) {
      HMOE_ASSIGN_OR_RETURN(scratch, cs.Scratch(plan.bytes));
    }
    return RunLinear(cs, plan, scratch, w, x, x_stride, n, y, y_stride);
  }

  absl::Status RmsNorm(Stream& s, const float* x, int64_t x_stride, int64_t n, int64_t dim,
                       const VectorWeight& weight, float eps, float* y, int64_t y_stride) override {
    HMOE_RETURN_IF_ERROR(CheckVector(weight, dim, "rms norm weight"));
    if (n < 0 || dim <= 0 ||
        (n > 0 && (x == nullptr || y == nullptr || x_stride < dim || y_stride < dim))) {
      return absl::InvalidArgumentError("rms norm: bad arguments");
    }
    HMOE_ASSIGN_OR_RETURN(const ElemType type, ElemTypeOf(weight.dtype, "rms norm weight"));
    HMOE_RETURN_IF_ERROR(Enter());
    HMOE_LAUNCH(cuda::LaunchRmsNorm(x, x_stride, n, dim, weight.data, type, eps, y, y_stride,
                                    Cuda(s).get()));
    return absl::OkStatus();
  }

  absl::Status RopeInterleaved(Stream& s, float* x, int64_t x_stride, int64_t n, int64_t num_heads,
                               int64_t head_stride, int64_t rope_dim, const int32_t* positions,
                               const float* inv_freq, float attention_factor) override {
    if (n < 0 || num_heads <= 0 || rope_dim <= 0 || rope_dim % 2 != 0 || rope_dim > 4096 ||
        (n > 0 && (x == nullptr || positions == nullptr || inv_freq == nullptr))) {
      return absl::InvalidArgumentError("rope: bad arguments");
    }
    HMOE_RETURN_IF_ERROR(Enter());
    HMOE_LAUNCH(cuda::LaunchRopeInterleaved(x, x_stride, n, num_heads, head_stride, rope_dim,
                                            positions, inv_freq, attention_factor, Cuda(s).get()));
    return absl::OkStatus();
  }

  absl::Status SiluMul(Stream& s, const float* gate, const float* up, int64_t count,
                       float* out) override {
    if (count < 0 || (count > 0 && (gate == nullptr || up == nullptr || out == nullptr))) {
      return absl::InvalidArgumentError("silu mul: bad arguments");
    }
    HMOE_RETURN_IF_ERROR(Enter());
    HMOE_LAUNCH(cuda::LaunchSiluMul(gate, up, out, count, Cuda(s).get()));
    return absl::OkStatus();
  }

  absl::Status Add(Stream& s, const float* a, const float* b, int64_t count, float* out) override {
    if (count < 0 || (count > 0 && (a == nullptr || b == nullptr || out == nullptr))) {
      return absl::InvalidArgumentError("add: bad arguments");
    }
    HMOE_RETURN_IF_ERROR(Enter());
    HMOE_LAUNCH(cuda::LaunchAdd(a, b, out, count, Cuda(s).get()));
    return absl::OkStatus();
  }

  absl::Status EmbeddingGather(Stream& s, const LinearWeight& table, const int32_t* ids, int64_t n,
                               float* out) override {
    if (IsBlockDType(table.dtype)) HMOE_RETURN_IF_ERROR(CheckCudaWeight(table, "embedding gather"));
    if ((table.dtype != DType::kBF16 && table.dtype != DType::kF32) || table.data == nullptr ||
        table.rows <= 0 || table.cols <= 0 || table.row_stride < table.cols || n < 0 ||
        (n > 0 && (ids == nullptr || out == nullptr))) {
      return absl::InvalidArgumentError("embedding gather: bad arguments (table must be BF16/F32)");
    }
    HMOE_RETURN_IF_ERROR(Enter());
    // Out-of-range ids cannot be reported from the device: their rows become NaN.
    HMOE_LAUNCH(cuda::LaunchEmbeddingGather(DescOf(table), ids, n, out, Cuda(s).get()));
    return absl::OkStatus();
  }

  absl::Status MoeGate(Stream& s, const float* x, int64_t x_stride, int64_t n,
                       const LinearWeight& router, const VectorWeight& bias,
                       const MoeGateParams& params, int32_t* ids, float* weights) override {
    const int64_t e = params.num_experts;
    if (e <= 0 || params.top_k <= 0 || params.n_group <= 0 || e % params.n_group != 0 ||
        params.topk_group <= 0 || params.topk_group > params.n_group ||
        params.top_k > params.topk_group * (e / params.n_group)) {
      return absl::InvalidArgumentError("moe gate: inconsistent parameters");
    }
    if (IsBlockDType(router.dtype))
      HMOE_RETURN_IF_ERROR(CheckCudaWeight(router, "moe gate router"));
    if ((router.dtype != DType::kBF16 && router.dtype != DType::kF32) || router.data == nullptr ||
        router.rows != e || router.cols <= 0 || router.row_stride < router.cols) {
      return absl::InvalidArgumentError(
          absl::StrCat("moe gate: router must be BF16/F32 [", e, ", hidden]"));
    }
    HMOE_RETURN_IF_ERROR(CheckCudaWeight(router, "moe gate router"));
    ElemType bias_type = ElemType::kF32;
    if (!bias.empty()) {
      HMOE_RETURN_IF_ERROR(CheckVector(bias, e, "moe gate bias"));
      HMOE_ASSIGN_OR_RETURN(bias_type, ElemTypeOf(bias.dtype, "moe gate bias"));
    }
    if (n < 0 || (n > 0 && (x == nullptr || ids == nullptr || weights == nullptr ||
                            x_stride < router.cols))) {
      return absl::InvalidArgumentError("moe gate: bad activations");
    }
    if (n == 0) return absl::OkStatus();
    HMOE_RETURN_IF_ERROR(Enter());
    CudaStream& cs = Cuda(s);
    // Logits [n, E] in F32 math (no BF16 rounding: routing decisions are discrete), then the
    // selection. The arena holds the logits and the GEMM's temporaries side by side.
    const bool small = n <= cuda::kSmallLinearMaxTokens;
    const LinearPlan plan = small ? LinearPlan{} : PlanLinear(router, /*f32=*/true, n);
    ScratchLayout layout;
    const size_t logits_off = layout.Add(static_cast<size_t>(n * e) * sizeof(float));
    const size_t linear_off = layout.Add(plan.bytes);
    HMOE_ASSIGN_OR_RETURN(std::byte * scratch, cs.Scratch(layout.size()));
    auto* logits = reinterpret_cast<float*>(scratch + logits_off);
    if (small) {
      HMOE_LAUNCH(cuda::LaunchSmallLinear(DescOf(router), nullptr, 1, 0, 0, e, x, 0, x_stride, n,
                                          /*round_bf16=*/false, logits, 0, e, cs.get()));
    } else {
      HMOE_RETURN_IF_ERROR(
          RunLinear(cs, plan, scratch + linear_off, router, x, x_stride, n, logits, e));
    }
    MoeGateParams config = params;
    config.num_experts = e;
    HMOE_LAUNCH(cuda::LaunchMoeGateSelect(logits, e, n, bias.empty() ? nullptr : bias.data,
                                          bias_type, config, ids, weights, cs.get()));
    return absl::OkStatus();
  }

  absl::Status KvCacheWrite(Stream& s, const KvLayerView& cache, const int32_t* slots, int64_t n,
                            const float* latent, int64_t latent_stride, const float* k_pe,
                            int64_t k_pe_stride, int64_t kv_lora_rank) override {
    const int64_t rope_dim = cache.row_floats - kv_lora_rank;
    if (cache.base == nullptr || cache.block_size <= 0 || kv_lora_rank <= 0 || rope_dim <= 0 ||
        n < 0 || (n > 0 && (slots == nullptr || latent == nullptr || k_pe == nullptr))) {
      return absl::InvalidArgumentError("kv cache write: bad arguments");
    }
    HMOE_RETURN_IF_ERROR(Enter());
    cuda::KvCacheDesc desc;
    desc.base = cache.base;
    desc.block_size = cache.block_size;
    desc.block_stride = cache.block_stride;
    desc.row_floats = cache.row_floats;
    // Negative slots (an error on the CPU) are skipped: the device cannot report them.
    HMOE_LAUNCH(cuda::LaunchKvCacheWrite(desc, slots, n, latent, latent_stride, k_pe, k_pe_stride,
                                         kv_lora_rank, Cuda(s).get()));
    return absl::OkStatus();
  }

  absl::Status MlaDecodeAttention(Stream& s, const MlaAttentionArgs& args) override {
    HMOE_RETURN_IF_ERROR(Enter());
    return RunMlaAttention(Cuda(s), args);
  }

  absl::Status MlaPrefillAttention(Stream& s, const MlaAttentionArgs& args) override {
    HMOE_RETURN_IF_ERROR(Enter());
    return RunMlaAttention(Cuda(s), args);
  }

  absl::Status MlaAttentionPartial(Stream& s, const MlaAttentionArgs& args,
                                   const MlaPartialState& state) override {
    HMOE_RETURN_IF_ERROR(Enter());
    return RunMlaAttention(Cuda(s), args, &state);
  }

  absl::Status MlaProjectLatent(Stream& s, const MlaDimensions& dims, const LinearWeight& kv_b,
                                const float* u, int64_t n, float* out,
                                int64_t out_stride) override {
    HMOE_RETURN_IF_ERROR(Enter());
    return RunMlaProject(Cuda(s), dims, kv_b, u, n, out, out_stride);
  }

  absl::Status GatherRows(Stream& s, const float* src, int64_t src_stride, const int32_t* rows,
                          int64_t n, int64_t cols, float* dst, int64_t dst_stride) override {
    if (n < 0 || cols < 0 || (n > 0 && (src == nullptr || rows == nullptr || dst == nullptr))) {
      return absl::InvalidArgumentError("gather rows: bad arguments");
    }
    HMOE_RETURN_IF_ERROR(Enter());
    HMOE_LAUNCH(cuda::LaunchCopyRows(src, src_stride, rows, dst, dst_stride, nullptr, n, cols,
                                     Cuda(s).get()));
    return absl::OkStatus();
  }

  absl::Status ScatterAddRows(Stream& s, const float* src, int64_t src_stride, const int32_t* rows,
                              const float* weights, int64_t n, int64_t cols, float* dst,
                              int64_t dst_stride) override {
    if (n < 0 || cols < 0 ||
        (n > 0 && (src == nullptr || rows == nullptr || weights == nullptr || dst == nullptr))) {
      return absl::InvalidArgumentError("scatter add rows: bad arguments");
    }
    HMOE_RETURN_IF_ERROR(Enter());
    HMOE_LAUNCH(cuda::LaunchScatterAddRows(src, src_stride, rows, weights, n, cols, dst, dst_stride,
                                           Cuda(s).get()));
    return absl::OkStatus();
  }

 private:
  // Makes this device current for the calling thread (cheap when it already is).
  absl::Status Enter() const {
    HMOE_CUDA_RETURN_IF_ERROR(cudaSetDevice(ordinal_));
    return absl::OkStatus();
  }

  absl::StatusOr<DeviceBuffer> Make(size_t size_bytes) {
    void* data = nullptr;
    if (cudaSetDevice(ordinal_) != cudaSuccess || cudaMalloc(&data, size_bytes) != cudaSuccess) {
      cudaGetLastError();  // out of memory is not sticky
      state_->budget.Release(size_bytes);
      return absl::ResourceExhaustedError(
          absl::StrCat(name(), ": cudaMalloc of ", size_bytes, " bytes failed"));
    }
    return DeviceBuffer(data, size_bytes, &FreeCudaBuffer, state_.get());
  }

  absl::Status Copy(Stream& s, void* dst, const void* src, size_t bytes, cudaMemcpyKind kind) {
    if (bytes == 0) return absl::OkStatus();
    if (dst == nullptr || src == nullptr) return absl::InvalidArgumentError("copy: null pointer");
    HMOE_RETURN_IF_ERROR(Enter());
    HMOE_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(dst, src, bytes, kind, Cuda(s).get()));
    return absl::OkStatus();
  }

  const int ordinal_;
  const bool fp8_blocks_;  // CudaFp8Linear::kBlocks
  std::unique_ptr<CudaDeviceState> state_;
};

// CudaDeviceOptions::fp8_linear with kFromEnvironment resolved: true for kBlocks.
absl::StatusOr<bool> Fp8LinearBlocks(CudaFp8Linear mode) {
  if (mode == CudaFp8Linear::kBf16) return false;
  if (mode == CudaFp8Linear::kBlocks) return true;
  const char* env = std::getenv("HMOE_CUDA_FP8_LINEAR");
  if (env == nullptr || *env == '\0' || std::strcmp(env, "bf16") == 0) return false;
  if (std::strcmp(env, "blocks") == 0) return true;
  return absl::InvalidArgumentError(
      absl::StrCat("HMOE_CUDA_FP8_LINEAR=\"", env, "\": expected \"bf16\" or \"blocks\""));
}

}  // namespace

int CudaDeviceCount() { return cuda::DeviceCount(); }

void* NativeCudaStream(Stream& stream) {
  auto* cuda_stream = dynamic_cast<CudaStream*>(&stream);
  return cuda_stream != nullptr ? static_cast<void*>(cuda_stream->get()) : nullptr;
}

absl::StatusOr<std::unique_ptr<Device>> NewCudaDevice(int ordinal, size_t budget_bytes) {
  CudaDeviceOptions options;
  options.budget_bytes = budget_bytes;
  return NewCudaDevice(ordinal, options);
}

absl::StatusOr<std::unique_ptr<Device>> NewCudaDevice(int ordinal,
                                                      const CudaDeviceOptions& options) {
  HMOE_ASSIGN_OR_RETURN(const bool fp8_blocks, Fp8LinearBlocks(options.fp8_linear));
  size_t budget_bytes = options.budget_bytes;
  const int count = cuda::DeviceCount();
  if (ordinal < 0 || ordinal >= count) {
    return absl::UnavailableError(absl::StrCat("cuda device ", ordinal, " not visible (", count,
                                               " device(s); ", cuda::NoDeviceReason(), ")"));
  }
  HMOE_CUDA_RETURN_IF_ERROR(cudaSetDevice(ordinal));
  if (budget_bytes == 0) {
    size_t free_bytes = 0, total_bytes = 0;
    HMOE_CUDA_RETURN_IF_ERROR(cudaMemGetInfo(&free_bytes, &total_bytes));
    budget_bytes = free_bytes;
  }
  return std::unique_ptr<Device>(new CudaDevice(ordinal, budget_bytes, fp8_blocks));
}

}  // namespace hmoe
