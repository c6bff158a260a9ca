// noaux_tc expert selection from router logits (the logits themselves come from an F32 cuBLAS
// GEMM). The selection is kernels::MoeGateSelect, the scalar function the CPU tests check
// against reference::MoeGate, run by one thread per token: E is a few hundred, so a single
// thread's O(E * K) scan costs microseconds, and sharing the exact code keeps the decisions
// identical to the CPU's for identical logits.

#include "common/kernels/cuda/cuda_kernels.h"
#include "common/kernels/shared_math.h"

namespace hmoe::cuda {
namespace {

constexpr int kThreads = 64;

// Dynamic shared memory: MoeGateScratchBytes (8-byte aligned first), then E floats of bias.
__global__ void __launch_bounds__(kThreads)
    MoeGateSelectKernel(const float* __restrict__ logits, int64_t logits_stride, int64_t n,
                        const void* __restrict__ bias, kernels::ElemType bias_type,
                        MoeGateParams config, int64_t scratch_bytes, int32_t* __restrict__ ids,
                        float* __restrict__ weights) {
  extern __shared__ double shared[];
  unsigned char* scratch = reinterpret_cast<unsigned char*>(shared);
  float* bias_f32 = reinterpret_cast<float*>(scratch + scratch_bytes);
  if (bias != nullptr) {
    for (int64_t e = threadIdx.x; e < config.num_experts; e += blockDim.x) {
      bias_f32[e] = kernels::LoadElementAsFloat(bias_type, bias, e);
    }
  }
  __syncthreads();
  if (threadIdx.x != 0) return;
  for (int64_t t = blockIdx.x; t < n; t += gridDim.x) {
    kernels::MoeGateSelect(logits + t * logits_stride, bias != nullptr ? bias_f32 : nullptr, config,
                           scratch, ids + t * config.top_k, weights + t * config.top_k);
  }
}

}  // namespace

cudaError_t LaunchMoeGateSelect(const float* logits, int64_t logits_stride, int64_t n,
                                const void* bias, kernels::ElemType bias_type,
                                const MoeGateParams& config, int32_t* ids, float* weights,
                                cudaStream_t stream) {
  if (n <= 0) return cudaSuccess;
  if (config.num_experts <= 0 || config.n_group <= 0 || config.num_experts % config.n_group != 0 ||
      config.top_k <= 0 || config.topk_group <= 0 || config.topk_group > config.n_group ||
      config.top_k > config.topk_group * (config.num_experts / config.n_group)) {
    return cudaErrorInvalidValue;
  }
  const int64_t scratch_bytes =
      (kernels::MoeGateScratchBytes(config.num_experts, config.n_group) + 7) / 8 * 8;
  const int64_t shared_bytes = scratch_bytes + 4 * config.num_experts;
  if (shared_bytes > 48 * 1024) return cudaErrorInvalidValue;  // E up to ~4700 experts
  const unsigned blocks = static_cast<unsigned>(n < 65535 ? n : 65535);
  MoeGateSelectKernel<<<blocks, kThreads, static_cast<size_t>(shared_bytes), stream>>>(
      logits, logits_stride, n, bias, bias_type, config, scratch_bytes, ids, weights);
  return cudaGetLastError();
}

}  // namespace hmoe::cuda
