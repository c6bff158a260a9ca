// Element- and row-wise data movement: residual add, embedding gather, row gather/scatter, the
// scatter-add of expert outputs, and writes into the paged latent cache.

#include "common/kernels/cuda/cuda_kernels.h"
#include "common/kernels/shared_math.h"

namespace hmoe::cuda {
namespace {

constexpr int kThreads = 256;

unsigned BlocksFor(int64_t n, int threads) {
  const int64_t blocks = (n + threads - 1) / threads;
  return static_cast<unsigned>(blocks < 65535 ? blocks : 65535);
}

// Grid-x for one thread block per row (grid-stride over rows beyond the limit).
unsigned RowBlocks(int64_t rows) { return static_cast<unsigned>(rows < 65535 ? rows : 65535); }

// No __restrict__: `out` may alias an input.
__global__ void AddKernel(const float* a, const float* b, float* out, int64_t n) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += stride) {
    out[i] = a[i] + b[i];
  }
}

__global__ void EmbeddingGatherKernel(WeightDesc table, const int32_t* __restrict__ ids, int64_t n,
                                      float* __restrict__ out) {
  for (int64_t t = blockIdx.x; t < n; t += gridDim.x) {
    const int64_t id = ids[t];
    const bool valid = id >= 0 && id < table.rows;
    float* row = out + t * table.cols;
    for (int64_t c = threadIdx.x; c < table.cols; c += blockDim.x) {
      row[c] = valid
                   ? kernels::LoadElementAsFloat(table.type, table.data, id * table.row_stride + c)
                   : kernels::BitsToFloat(0x7fc00000u);
    }
  }
}

__global__ void CopyRowsKernel(const float* __restrict__ src, int64_t src_stride,
                               const int32_t* __restrict__ src_rows, float* __restrict__ dst,
                               int64_t dst_stride, const int32_t* __restrict__ dst_rows, int64_t n,
                               int64_t cols) {
  for (int64_t i = blockIdx.x; i < n; i += gridDim.x) {
    const int64_t s = src_rows != nullptr ? src_rows[i] : i;
    const int64_t d = dst_rows != nullptr ? dst_rows[i] : i;
    if (s < 0 || d < 0) continue;
    const float* from = src + s * src_stride;
    float* to = dst + d * dst_stride;
    for (int64_t c = threadIdx.x; c < cols; c += blockDim.x) to[c] = from[c];
  }
}

// One thread per column walks i = 0 .. n-1 in order: every destination element gets its
// additions in increasing i, whatever the repetitions in `rows`.
__global__ void ScatterAddRowsKernel(const float* __restrict__ src, int64_t src_stride,
                                     const int32_t* __restrict__ rows,
                                     const float* __restrict__ weights, int64_t n, int64_t cols,
                                     float* __restrict__ dst, int64_t dst_stride) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t c = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; c < cols;
       c += stride) {
    for (int64_t i = 0; i < n; ++i) {
      const int64_t r = rows[i];
      if (r < 0) continue;
      dst[r * dst_stride + c] += weights[i] * src[i * src_stride + c];
    }
  }
}

__global__ void KvCacheWriteKernel(KvCacheDesc cache, const int32_t* __restrict__ slots, int64_t n,
                                   const float* __restrict__ latent, int64_t latent_stride,
                                   const float* __restrict__ k_pe, int64_t k_pe_stride,
                                   int64_t kv_lora_rank) {
  for (int64_t t = blockIdx.x; t < n; t += gridDim.x) {
    const int64_t slot = slots[t];
    if (slot < 0) continue;
    float* row = cache.base + (slot / cache.block_size) * cache.block_stride +
                 (slot % cache.block_size) * cache.row_floats;
    for (int64_t c = threadIdx.x; c < cache.row_floats; c += blockDim.x) {
      row[c] = c < kv_lora_rank ? latent[t * latent_stride + c]
                                : k_pe[t * k_pe_stride + (c - kv_lora_rank)];
    }
  }
}

}  // namespace

cudaError_t LaunchAdd(const float* a, const float* b, float* out, int64_t n, cudaStream_t stream) {
  if (n <= 0) return cudaSuccess;
  AddKernel<<<BlocksFor(n, kThreads), kThreads, 0, stream>>>(a, b, out, n);
  return cudaGetLastError();
}

cudaError_t LaunchEmbeddingGather(const WeightDesc& table, const int32_t* ids, int64_t n,
                                  float* out, cudaStream_t stream) {
  if (n <= 0 || table.cols <= 0) return cudaSuccess;
  EmbeddingGatherKernel<<<RowBlocks(n), kThreads, 0, stream>>>(table, ids, n, out);
  return cudaGetLastError();
}

cudaError_t LaunchCopyRows(const float* src, int64_t src_stride, const int32_t* src_rows,
                           float* dst, int64_t dst_stride, const int32_t* dst_rows, int64_t n,
                           int64_t cols, cudaStream_t stream) {
  if (n <= 0 || cols <= 0) return cudaSuccess;
  CopyRowsKernel<<<RowBlocks(n), kThreads, 0, stream>>>(src, src_stride, src_rows, dst, dst_stride,
                                                        dst_rows, n, cols);
  return cudaGetLastError();
}

cudaError_t LaunchScatterAddRows(const float* src, int64_t src_stride, const int32_t* rows,
                                 const float* weights, int64_t n, int64_t cols, float* dst,
                                 int64_t dst_stride, cudaStream_t stream) {
  if (n <= 0 || cols <= 0) return cudaSuccess;
  ScatterAddRowsKernel<<<BlocksFor(cols, kThreads), kThreads, 0, stream>>>(
      src, src_stride, rows, weights, n, cols, dst, dst_stride);
  return cudaGetLastError();
}

cudaError_t LaunchKvCacheWrite(const KvCacheDesc& cache, const int32_t* slots, int64_t n,
                               const float* latent, int64_t latent_stride, const float* k_pe,
                               int64_t k_pe_stride, int64_t kv_lora_rank, cudaStream_t stream) {
  if (n <= 0) return cudaSuccess;
  KvCacheWriteKernel<<<RowBlocks(n), kThreads, 0, stream>>>(cache, slots, n, latent, latent_stride,
                                                            k_pe, k_pe_stride, kv_lora_rank);
  return cudaGetLastError();
}

}  // namespace hmoe::cuda
