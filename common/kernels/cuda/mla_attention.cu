// The attention core of weight-absorbed MLA (MODEL-SPEC §3.7) over a paged latent cache, for
// prefill and decode alike. The projections around it (q~ = W_UK^T q_nope, out = W_UV u) are
// cuBLAS GEMMs issued by the CUDA device (FP8 weights: BF16 codes on tensor cores, then
// LaunchMlaBlockScale); this file gathers the queries and runs
//
//   u = sum_s softmax_s(scale * [q~ | q_pe] . [c_s | k_pe_s]) c_s
//
// flash-style: a thread block owns up to kMlaTileRows (query, head) rows of one sequence (they
// share the sequence's keys: MLA's latent cache is common to all heads), walks the keys in tiles
// of kMlaKeyTile staged in shared memory, scores the tile (one warp per (row, key) dot product),
// folds it into each row's running max and sum with kernels::OnlineSoftmaxStep, and accumulates
// p * c in registers. Memory is O(rows * (Rkv + dr)) per block, independent of the context length:
// no N x N score matrix exists.

#include "common/kernels/cuda/cuda_kernels.h"
#include "common/kernels/shared_math.h"

namespace hmoe::cuda {
namespace {

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;
constexpr int kDimsPerThread = kMlaMaxLatent / kThreads;

static_assert(kMlaMaxLatent % kThreads == 0, "latent dims are spread evenly over the threads");

__device__ float WarpSum(float v) {
  for (int offset = 16; offset > 0; offset /= 2) v += __shfl_xor_sync(0xffffffffu, v, offset);
  return v;
}

__global__ void MlaGatherQKernel(const float* __restrict__ q, int64_t q_stride,
                                 const int32_t* __restrict__ q_rows, int64_t num_rows,
                                 MlaDimensions s, float* __restrict__ q_nope_out, bool round_bf16,
                                 float* __restrict__ qcat) {
  const int64_t dq = s.nope_dim + s.rope_dim;
  const int64_t row_floats = s.kv_lora_rank + s.rope_dim;
  const int64_t n = num_rows * s.num_heads * dq;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += stride) {
    const int64_t th = i / dq;  // t * nh + h
    const int64_t c = i - th * dq;
    const int64_t t = th / s.num_heads;
    const int64_t h = th - t * s.num_heads;
    const float v = q[static_cast<int64_t>(q_rows[t]) * q_stride + h * dq + c];
    if (c < s.nope_dim) {
      q_nope_out[th * s.nope_dim + c] =
          round_bf16 ? kernels::Bf16BitsToFloat(kernels::FloatToBf16Bits(v)) : v;
    } else {
      qcat[th * row_floats + s.kv_lora_rank + (c - s.nope_dim)] = v;
    }
  }
}

// Where the partial variant (kPartial) merges its result (LaunchMlaAttendPartial).
struct PartialOut {
  const int32_t* q_rows = nullptr;
  float* u = nullptr;
  float* lse = nullptr;
  bool first = false;
};

// Shared memory (floats): q rows [kMlaTileRows][D], key tile [kMlaKeyTile][D], probabilities
// [kMlaTileRows][kMlaKeyTile], then per row: running max, running sum, correction. D = Rkv + dr.
// kPartial: keys limited to [tile.key_begin, tile.key_end), result merged into `partial`.
template <bool kPartial>
__global__ void __launch_bounds__(kThreads)
    MlaAttendKernel(MlaDimensions s, const float* __restrict__ qcat, KvCacheDesc cache,
                    const int32_t* __restrict__ block_tables, const MlaTile* __restrict__ tiles,
                    float* __restrict__ u, PartialOut partial) {
  extern __shared__ float smem[];
  const int64_t d_row = cache.row_floats;
  const int64_t rkv = s.kv_lora_rank;
  float* q_s = smem;
  float* k_s = q_s + kMlaTileRows * d_row;
  float* p_s = k_s + kMlaKeyTile * d_row;
  float* max_s = p_s + kMlaTileRows * kMlaKeyTile;
  float* sum_s = max_s + kMlaTileRows;
  float* corr_s = sum_s + kMlaTileRows;

  const MlaTile tile = tiles[blockIdx.x];
  const int heads = tile.num_heads;
  const int rows = tile.num_queries * heads;  // row r: query r / heads, head r % heads
  const int tid = static_cast<int>(threadIdx.x);
  const int warp = tid / 32;
  const int lane = tid % 32;

  for (int64_t i = tid; i < rows * d_row; i += kThreads) {
    const int64_t r = i / d_row;
    const int64_t c = i - r * d_row;
    const int64_t t = tile.first_row + r / heads;
    const int64_t h = tile.first_head + r % heads;
    q_s[i] = qcat[(t * s.num_heads + h) * d_row + c];
  }
  if (tid < kMlaTileRows) {
    max_s[tid] = kernels::NegInfinity();
    sum_s[tid] = 0.0f;
  }
  float acc[kMlaTileRows][kDimsPerThread];
#pragma unroll
  for (int r = 0; r < kMlaTileRows; ++r) {
#pragma unroll
    for (int d = 0; d < kDimsPerThread; ++d) acc[r][d] = 0.0f;
  }
  const int32_t* table = block_tables + tile.table_offset;
  int64_t num_keys = tile.first_pos + tile.num_queries;  // the last query sees them all
  int64_t first_key = 0;
  if constexpr (kPartial) {
    num_keys = num_keys < tile.key_end ? num_keys : tile.key_end;
    first_key = tile.key_begin;
  }
  __syncthreads();

  for (int64_t k0 = first_key / kMlaKeyTile * kMlaKeyTile; k0 < num_keys; k0 += kMlaKeyTile) {
    const int64_t nk = num_keys - k0 < kMlaKeyTile ? num_keys - k0 : kMlaKeyTile;
    // Stage the key tile (cache rows [c | k_pe]) in shared memory.
    for (int64_t i = tid; i < nk * d_row; i += kThreads) {
      const int64_t j = i / d_row;
      const int64_t c = i - j * d_row;
      const int64_t key = k0 + j;
      const int64_t block = table[key / cache.block_size];
      k_s[i] = cache.base[block * cache.block_stride + (key % cache.block_size) * d_row + c];
    }
    __syncthreads();
    // Scores: one warp per (row, key) pair; masked and out-of-range keys are -infinity.
    for (int pair = warp; pair < rows * kMlaKeyTile; pair += kWarps) {
      const int r = pair / kMlaKeyTile;
      const int j = pair % kMlaKeyTile;
      const int64_t pos = tile.first_pos + r / heads;
      const bool visible = j < nk && k0 + j <= pos && k0 + j >= first_key;  // warp-uniform
      float dot = 0.0f;
      if (visible) {
        for (int64_t c = lane; c < d_row; c += 32) dot += q_s[r * d_row + c] * k_s[j * d_row + c];
      }
      dot = WarpSum(dot);
      if (lane == 0) {
        p_s[r * kMlaKeyTile + j] = visible ? dot * s.softmax_scale : kernels::NegInfinity();
      }
    }
    __syncthreads();
    if (tid < rows) {
      corr_s[tid] = kernels::OnlineSoftmaxStep(&max_s[tid], &sum_s[tid], &p_s[tid * kMlaKeyTile],
                                               kMlaKeyTile);
    }
    __syncthreads();
    // acc = acc * correction + sum_j p_j c_j over this thread's latent dims.
#pragma unroll
    for (int r = 0; r < kMlaTileRows; ++r) {
      if (r < rows) {
        const float corr = corr_s[r];
#pragma unroll
        for (int d = 0; d < kDimsPerThread; ++d) acc[r][d] *= corr;
        for (int64_t j = 0; j < nk; ++j) {
          const float p = p_s[r * kMlaKeyTile + j];
          if (p == 0.0f) continue;
#pragma unroll
          for (int d = 0; d < kDimsPerThread; ++d) {
            const int64_t dim = tid + d * kThreads;
            if (dim < rkv) acc[r][d] += p * k_s[j * d_row + dim];
          }
        }
      }
    }
    __syncthreads();  // k_s and p_s are overwritten by the next tile
  }

  if constexpr (kPartial) {
    // Per row: the coefficients of the old state and of this call's (unnormalized) result, and
    // the new log-sum-exp, in the probabilities' shared memory (free after the last tile).
    float* coef_s = p_s;
    if (tid < rows) {
      const int64_t t = tile.first_row + tid / heads;
      const int64_t h = tile.first_head + tid % heads;
      const int64_t idx = static_cast<int64_t>(partial.q_rows[t]) * s.num_heads + h;
      const float neg_inf = kernels::NegInfinity();
      float c_old = 1.0f, c_new = 0.0f, lse = 0.0f;
      bool keep = false;
      if (sum_s[tid] == 0.0f) {  // no visible key in this call
        keep = !partial.first;
        c_old = 0.0f;
        lse = neg_inf;
      } else {
        const float lse_new = max_s[tid] + logf(sum_s[tid]);
        const float lse_old = partial.first ? neg_inf : partial.lse[idx];
        if (lse_old == neg_inf) {
          c_old = 0.0f;
          c_new = 1.0f / sum_s[tid];
          lse = lse_new;
        } else {
          const float m = lse_old > lse_new ? lse_old : lse_new;
          const float w_old = expf(lse_old - m);
          const float w_new = expf(lse_new - m);
          const float total = w_old + w_new;
          c_old = w_old / total;
          c_new = w_new / (total * sum_s[tid]);
          lse = m + logf(total);
        }
      }
      coef_s[3 * tid] = keep ? -1.0f : c_old;  // -1: leave the row alone
      coef_s[3 * tid + 1] = c_new;
      coef_s[3 * tid + 2] = lse;
    }
    __syncthreads();
#pragma unroll
    for (int r = 0; r < kMlaTileRows; ++r) {
      if (r < rows && coef_s[3 * r] >= 0.0f) {
        const float c_old = coef_s[3 * r];
        const float c_new = coef_s[3 * r + 1];
        const int64_t t = tile.first_row + r / heads;
        const int64_t h = tile.first_head + r % heads;
        float* out = partial.u + (static_cast<int64_t>(partial.q_rows[t]) * s.num_heads + h) * rkv;
#pragma unroll
        for (int d = 0; d < kDimsPerThread; ++d) {
          const int64_t dim = tid + d * kThreads;
          if (dim < rkv) {
            // The old state is not read when its weight is 0 (it may be uninitialized).
            const float old = c_old != 0.0f ? c_old * out[dim] : 0.0f;
            out[dim] = old + c_new * acc[r][d];
          }
        }
      }
    }
    if (tid < rows && coef_s[3 * tid] >= 0.0f) {
      const int64_t t = tile.first_row + tid / heads;
      const int64_t h = tile.first_head + tid % heads;
      partial.lse[static_cast<int64_t>(partial.q_rows[t]) * s.num_heads + h] = coef_s[3 * tid + 2];
    }
  } else {
#pragma unroll
    for (int r = 0; r < kMlaTileRows; ++r) {
      if (r < rows) {
        const float inv = 1.0f / sum_s[r];  // > 0: every query sees key 0
        const int64_t t = tile.first_row + r / heads;
        const int64_t h = tile.first_head + r % heads;
        float* out = u + (t * s.num_heads + h) * rkv;
#pragma unroll
        for (int d = 0; d < kDimsPerThread; ++d) {
          const int64_t dim = tid + d * kThreads;
          if (dim < rkv) out[dim] = acc[r][d] * inv;
        }
      }
    }
  }
}

// LaunchMlaBlockScale. No __restrict__: y may alias partials (one block, same strides): each
// element is read before it is written, by the same thread.
__global__ void MlaBlockScaleKernel(const float* partials, int64_t num_blocks, int64_t plane_stride,
                                    int64_t p_stride, int64_t p_head_stride, int64_t rows,
                                    int64_t heads, int64_t cols,
                                    const float* __restrict__ scale_inv, int64_t scale_stride,
                                    const WeightDesc* __restrict__ descs, int64_t row_base,
                                    int64_t row_step, float* y, int64_t y_stride,
                                    int64_t y_head_stride) {
  const int64_t n = rows * heads * cols;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += stride) {
    const int64_t t = i / (heads * cols);
    const int64_t rest = i - t * heads * cols;
    const int64_t h = rest / cols;
    const int64_t j = rest - h * cols;
    const float* scales = descs != nullptr ? descs[h].scale_inv : scale_inv;
    const int64_t ss = descs != nullptr ? descs[h].scale_stride : scale_stride;
    const float* sc = scales + ((row_base + h * row_step + j) / 128) * ss;
    const float* p = partials + t * p_stride + h * p_head_stride + j;
    float acc = 0.0f;
    for (int64_t b = 0; b < num_blocks; ++b) acc += sc[b] * p[b * plane_stride];
    y[t * y_stride + h * y_head_stride + j] = acc;
  }
}

}  // namespace

cudaError_t LaunchMlaGatherQ(const float* q, int64_t q_stride, const int32_t* q_rows,
                             int64_t num_rows, const MlaDimensions& shape, float* q_nope_out,
                             bool round_bf16, float* qcat, cudaStream_t stream) {
  const int64_t n = num_rows * shape.num_heads * (shape.nope_dim + shape.rope_dim);
  if (n <= 0) return cudaSuccess;
  const int64_t blocks = (n + kThreads - 1) / kThreads;
  MlaGatherQKernel<<<static_cast<unsigned>(blocks < 65535 ? blocks : 65535), kThreads, 0, stream>>>(
      q, q_stride, q_rows, num_rows, shape, q_nope_out, round_bf16, qcat);
  return cudaGetLastError();
}

namespace {

__global__ void GatherKvRowsKernel(KvCacheDesc cache, const int32_t* __restrict__ table,
                                   int64_t num_keys, float* __restrict__ dst) {
  const int64_t d = cache.row_floats;
  const int64_t n = num_keys * d;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += stride) {
    const int64_t k = i / d;
    const int64_t c = i - k * d;
    const int64_t block = table[k / cache.block_size];
    dst[i] = cache.base[block * cache.block_stride + (k % cache.block_size) * d + c];
  }
}

__device__ float BlockMax(float v, float* red) {
  for (int offset = 16; offset > 0; offset /= 2) {
    const float o = __shfl_xor_sync(0xffffffffu, v, offset);
    v = o > v ? o : v;
  }
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  if (lane == 0) red[warp] = v;
  __syncthreads();
  if (warp == 0) {
    v = lane < kWarps ? red[lane] : kernels::NegInfinity();
    for (int offset = 16; offset > 0; offset /= 2) {
      const float o = __shfl_xor_sync(0xffffffffu, v, offset);
      v = o > v ? o : v;
    }
    if (lane == 0) red[0] = v;
  }
  __syncthreads();
  v = red[0];
  __syncthreads();
  return v;
}

__device__ float BlockSum(float v, float* red) {
  v = WarpSum(v);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  if (lane == 0) red[warp] = v;
  __syncthreads();
  if (warp == 0) {
    v = WarpSum(lane < kWarps ? red[lane] : 0.0f);
    if (lane == 0) red[0] = v;
  }
  __syncthreads();
  v = red[0];
  __syncthreads();
  return v;
}

// One block per row.
__global__ void __launch_bounds__(kThreads)
    MlaMaskedSoftmaxKernel(float* __restrict__ scores, int64_t num_keys, int64_t num_heads,
                           int64_t first_pos) {
  __shared__ float red[kWarps];
  const int64_t row = blockIdx.x;
  float* p = scores + row * num_keys;
  const int64_t pos = first_pos + row / num_heads;
  const int64_t visible = pos + 1 < num_keys ? pos + 1 : num_keys;
  float m = kernels::NegInfinity();
  for (int64_t k = threadIdx.x; k < visible; k += kThreads) m = p[k] > m ? p[k] : m;
  m = BlockMax(m, red);
  float sum = 0.0f;
  for (int64_t k = threadIdx.x; k < visible; k += kThreads) {
    const float e = kernels::ExpF(p[k] - m);
    p[k] = e;
    sum += e;
  }
  sum = BlockSum(sum, red);
  const float inv = sum > 0.0f ? 1.0f / sum : 0.0f;
  for (int64_t k = threadIdx.x; k < num_keys; k += kThreads) p[k] = k < visible ? p[k] * inv : 0.0f;
}

}  // namespace

cudaError_t LaunchGatherKvRows(const KvCacheDesc& cache, const int32_t* block_table,
                               int64_t num_keys, float* dst, cudaStream_t stream) {
  if (num_keys <= 0) return cudaSuccess;
  const int64_t n = num_keys * cache.row_floats;
  const int64_t blocks =
      (n + kThreads - 1) / kThreads < 4096 ? (n + kThreads - 1) / kThreads : 4096;
  GatherKvRowsKernel<<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(cache, block_table,
                                                                             num_keys, dst);
  return cudaGetLastError();
}

cudaError_t LaunchMlaMaskedSoftmax(float* scores, int64_t num_rows, int64_t num_keys,
                                   int64_t num_heads, int64_t first_pos, cudaStream_t stream) {
  if (num_rows <= 0 || num_keys <= 0) return cudaSuccess;
  if (num_rows > 0x7fffffff || num_heads <= 0) return cudaErrorInvalidValue;
  MlaMaskedSoftmaxKernel<<<static_cast<unsigned>(num_rows), kThreads, 0, stream>>>(
      scores, num_keys, num_heads, first_pos);
  return cudaGetLastError();
}

cudaError_t LaunchMlaAttend(const MlaDimensions& shape, const float* qcat, const KvCacheDesc& cache,
                            const int32_t* block_tables, const MlaTile* tiles, int64_t num_tiles,
                            float* u, cudaStream_t stream) {
  if (num_tiles <= 0) return cudaSuccess;
  const int64_t shared_bytes = MlaAttendSharedBytes(cache.row_floats);
  if (shape.kv_lora_rank <= 0 || shape.kv_lora_rank > kMlaMaxLatent ||
      cache.row_floats != shape.kv_lora_rank + shape.rope_dim ||
      shared_bytes > kMlaMaxSharedBytes || num_tiles > 0x7fffffff) {
    return cudaErrorInvalidValue;
  }
  // Opt in to more than the default 48 KiB of dynamic shared memory (a cheap host call).
  if (const cudaError_t err =
          cudaFuncSetAttribute(MlaAttendKernel<false>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                               static_cast<int>(shared_bytes));
      err != cudaSuccess) {
    return err;
  }
  MlaAttendKernel<false>
      <<<static_cast<unsigned>(num_tiles), kThreads, static_cast<size_t>(shared_bytes), stream>>>(
          shape, qcat, cache, block_tables, tiles, u, PartialOut{});
  return cudaGetLastError();
}

cudaError_t LaunchMlaAttendPartial(const MlaDimensions& shape, const float* qcat,
                                   const KvCacheDesc& cache, const int32_t* block_tables,
                                   const MlaTile* tiles, int64_t num_tiles, const int32_t* q_rows,
                                   float* state_u, float* state_lse, bool first,
                                   cudaStream_t stream) {
  if (num_tiles <= 0) return cudaSuccess;
  const int64_t shared_bytes = MlaAttendSharedBytes(cache.row_floats);
  if (shape.kv_lora_rank <= 0 || shape.kv_lora_rank > kMlaMaxLatent ||
      cache.row_floats != shape.kv_lora_rank + shape.rope_dim ||
      shared_bytes > kMlaMaxSharedBytes || num_tiles > 0x7fffffff || q_rows == nullptr ||
      state_u == nullptr || state_lse == nullptr) {
    return cudaErrorInvalidValue;
  }
  static_assert(3 * kMlaTileRows <= kMlaTileRows * kMlaKeyTile, "coefficients fit in p_s");
  if (const cudaError_t err =
          cudaFuncSetAttribute(MlaAttendKernel<true>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                               static_cast<int>(shared_bytes));
      err != cudaSuccess) {
    return err;
  }
  PartialOut partial;
  partial.q_rows = q_rows;
  partial.u = state_u;
  partial.lse = state_lse;
  partial.first = first;
  MlaAttendKernel<true>
      <<<static_cast<unsigned>(num_tiles), kThreads, static_cast<size_t>(shared_bytes), stream>>>(
          shape, qcat, cache, block_tables, tiles, nullptr, partial);
  return cudaGetLastError();
}

cudaError_t LaunchMlaBlockScale(const float* partials, int64_t num_blocks, int64_t plane_stride,
                                int64_t p_stride, int64_t p_head_stride, int64_t rows,
                                int64_t heads, int64_t cols, const float* scale_inv,
                                int64_t scale_stride, const WeightDesc* descs, int64_t row_base,
                                int64_t row_step, float* y, int64_t y_stride, int64_t y_head_stride,
                                cudaStream_t stream) {
  const int64_t n = rows * heads * cols;
  if (n <= 0) return cudaSuccess;
  if (num_blocks <= 0 || (descs == nullptr && scale_inv == nullptr)) return cudaErrorInvalidValue;
  const int64_t blocks = (n + kThreads - 1) / kThreads;
  MlaBlockScaleKernel<<<static_cast<unsigned>(blocks < 65535 ? blocks : 65535), kThreads, 0,
                        stream>>>(partials, num_blocks, plane_stride, p_stride, p_head_stride, rows,
                                  heads, cols, scale_inv, scale_stride, descs, row_base, row_step,
                                  y, y_stride, y_head_stride);
  return cudaGetLastError();
}

}  // namespace hmoe::cuda
