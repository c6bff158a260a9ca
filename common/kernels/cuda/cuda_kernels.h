#pragma once

// Kernel launchers of the CUDA backend. Each enqueues its kernel(s) on `stream` and returns the
// launch's cudaError_t (cudaGetLastError after every launch); callers (common/device's CudaDevice)
// turn it into absl::Status. Only CUDA-aware host code includes this header; it is C++17 (the .cu
// files are compiled as C++17 by nvcc) and includes no absl, gRPC or protobuf.
//
// Conventions: all pointers are device pointers unless noted; matrices are row-major with explicit
// row strides in elements; sizes are int64_t and kernels index with int64_t. A launcher with
// nothing to do (a zero size) returns cudaSuccess without launching. The per-element math lives in
// common/kernels/shared_math.h, shared with (and tested through) CPU code.

#include <cstdint>

#include <cuda_runtime_api.h>

#include "common/kernels/shared_math.h"

namespace hmoe::cuda {

// ---------------------------------------------------------------------------------- weights

// A weight matrix in device memory: element (r, c) is
// kernels::WeightElement(type, data, row_stride, scale_inv, scale_stride, r, c).
struct WeightDesc {
  const void* data = nullptr;
  const float* scale_inv = nullptr;  // FP8 only
  int64_t rows = 0;
  int64_t cols = 0;
  int64_t row_stride = 0;
  int64_t scale_stride = 0;
  kernels::ElemType type = kernels::ElemType::kF32;
};

// out[r*cols + c] = bf16(fp8(w[r*cols + c]) * scale_inv[(r/128)*ceil(cols/128) + c/128]).
cudaError_t LaunchDequantFp8ToBf16(const uint8_t* w, const float* scale_inv, int64_t rows,
                                   int64_t cols, uint16_t* out, cudaStream_t stream);

// Rows [row_begin, row_begin + num_rows) of the FP8 weight `w` as BF16 bits of
// kernels::WeightElement, i.e. bf16(fp8(code) * scale) rounded to nearest even (relative error at
// most 2^-9 + 2^-24 per weight): out[(r - row_begin) * out_stride + c] for c < w.cols
// (out_stride >= w.cols; columns past w.cols are not written). 16 codes per thread (one 16-byte
// load, two 16-byte stores) when w.data, w.row_stride, w.cols, out and out_stride allow it, else
// one. cudaErrorInvalidValue for a non-FP8 weight or rows outside it. The weight of CudaDevice's
// FP8 prefill GEMM (CudaFp8Linear::kBf16).
cudaError_t LaunchFp8ToScaledBf16(const WeightDesc& w, int64_t row_begin, int64_t num_rows,
                                  uint16_t* out, int64_t out_stride, cudaStream_t stream);

// What LaunchPackWeight(s) write for element (r, c) of a weight.
enum class PackMode : int {
  kF32 = 0,           // float: kernels::WeightElement (FP8 scaled; exact but for one rounding)
  kBf16 = 1,          // BF16 bits of kernels::WeightElement (round to nearest even)
  kFp8CodesBf16 = 2,  // FP8 only: BF16 bits of the unscaled code value (exact)
};

// Rows [row_begin, row_begin + num_rows) of `w` into a compact matrix with out_cols (>= w.cols)
// columns, the columns past w.cols zero: out[(r - row_begin) * out_cols + c] (uint16_t BF16 bits
// or float, per `mode`). row_begin must be a multiple of 128 for FP8 (scale blocks are addressed
// by absolute row).
cudaError_t LaunchPackWeight(const WeightDesc& w, int64_t row_begin, int64_t num_rows,
                             int64_t out_cols, void* out, PackMode mode, cudaStream_t stream);

// The same for `count` whole weights whose descriptors are in device memory (`descs`,
// count <= 65535): weight i goes to out + i * item_stride elements (out_cols = its cols).
// max_elements bounds rows * cols of every weight (it sizes the grid).
cudaError_t LaunchPackWeights(const WeightDesc* descs, int count, int64_t max_elements, void* out,
                              int64_t item_stride, PackMode mode, cudaStream_t stream);

// dst[t * dst_stride + c] = bf16(src[t * src_stride + c]) (round to nearest even) for t < rows,
// c < cols, and 0 for cols <= c < dst_cols: the BF16 activations of a linear layer.
cudaError_t LaunchF32ToBf16(const float* src, int64_t src_stride, int64_t rows, int64_t cols,
                            uint16_t* dst, int64_t dst_stride, int64_t dst_cols,
                            cudaStream_t stream);

// x[i] = float(bf16(x[i])) for i < n, in place (BF16-rounded activations kept in F32).
cudaError_t LaunchRoundToBf16(float* x, int64_t n, cudaStream_t stream);

// The block-scaled FP8 product: partials holds, for each 128-column block b < num_blocks of a
// weight, P_b[t * cols + r] = sum over the block's columns of code(r, c) * x(t, c) (t < rows,
// r < cols; P_b at partials + b * rows * cols). Writes
//   y[t * y_stride + r] = sum_b scale_inv[((row_begin + r) / 128) * scale_stride + b] * P_b[t, r]
// summing b in increasing order in F32: each block's sum scaled by its scale, as CpuDevice.
cudaError_t LaunchBlockScaleCombine(const float* partials, int64_t num_blocks, int64_t rows,
                                    int64_t cols, const float* scale_inv, int64_t scale_stride,
                                    int64_t row_begin, float* y, int64_t y_stride,
                                    cudaStream_t stream);

// Linear layers of few tokens (decode), straight from the weight in any dtype, with CpuDevice's
// numerics: for batch item b < batch and token t < n,
//   y[b * y_batch_stride + t * y_stride + r] = sum_c W_b[R, c] * x~[b * x_batch_stride + t *
//   x_stride + c]
// for r < rows, where R = row_base + b * row_step + r (an absolute row of the weight: FP8 scales
// are addressed by it) and x~ = x rounded to BF16 when `round_bf16` (as CpuDevice packs the
// activations of FP8/BF16 weights). FP8: each 128-column block summed in F32 over the exact code
// values, times the block's scale, summed over the blocks in order; BF16/F32: F32 sums.
// W_b = descs[b] (device array) when descs is non-null, else `single` for every b. One warp per
// output row (all tokens at once): the weight is read once per 8 tokens, which makes this the
// bandwidth-bound path for n <= kSmallLinearMaxTokens. FP8 rows of whole 128-column blocks with
// 16-byte aligned data and row stride (DeepSeek-V3's) are loaded 16 codes per lane (8 lanes per
// block, a butterfly for the block sum); other weights one element per lane. batch <= 65535.
inline constexpr int64_t kSmallLinearMaxTokens = 16;
cudaError_t LaunchSmallLinear(const WeightDesc& single, const WeightDesc* descs, int64_t batch,
                              int64_t row_base, int64_t row_step, int64_t rows, const float* x,
                              int64_t x_batch_stride, int64_t x_stride, int64_t n, bool round_bf16,
                              float* y, int64_t y_batch_stride, int64_t y_stride,
                              cudaStream_t stream);

// ---------------------------------------------------------------------------------- elementwise

// out[i] = silu(gate[i]) * up[i] for n floats. `out` may alias `gate` or `up`.
cudaError_t LaunchSiluMul(const float* gate, const float* up, float* out, int64_t n,
                          cudaStream_t stream);

// out[i] = a[i] + b[i] for n floats. `out` may alias `a` or `b`.
cudaError_t LaunchAdd(const float* a, const float* b, float* out, int64_t n, cudaStream_t stream);

// out[t * table.cols + c] = table[ids[t]][c] as F32 for t < n (table BF16 or F32). A row whose id
// is outside [0, table.rows) is filled with NaN (the device cannot report the error).
cudaError_t LaunchEmbeddingGather(const WeightDesc& table, const int32_t* ids, int64_t n,
                                  float* out, cudaStream_t stream);

// dst[dst_row(i) * dst_stride + c] = src[src_row(i) * src_stride + c] for i < n, c < cols, where
// src_row(i) = src_rows ? src_rows[i] : i and likewise for dst (gather and scatter). Rows with a
// negative index are skipped. Source and destination rows must not overlap.
cudaError_t LaunchCopyRows(const float* src, int64_t src_stride, const int32_t* src_rows,
                           float* dst, int64_t dst_stride, const int32_t* dst_rows, int64_t n,
                           int64_t cols, cudaStream_t stream);

// dst[rows[i] * dst_stride + c] += weights[i] * src[i * src_stride + c] for i < n, c < cols; each
// destination element receives its additions in increasing i (deterministic). Negative rows are
// skipped.
cudaError_t LaunchScatterAddRows(const float* src, int64_t src_stride, const int32_t* rows,
                                 const float* weights, int64_t n, int64_t cols, float* dst,
                                 int64_t dst_stride, cudaStream_t stream);

// A paged latent cache layer (common/device/device.h KvLayerView).
struct KvCacheDesc {
  float* base = nullptr;
  int64_t block_size = 0;
  int64_t block_stride = 0;
  int64_t row_floats = 0;
};

// Slot slots[t] of `cache` receives latent[t * latent_stride ..+ kv_lora_rank] followed by
// k_pe[t * k_pe_stride ..+ row_floats - kv_lora_rank], t < n. Negative slots are skipped.
cudaError_t LaunchKvCacheWrite(const KvCacheDesc& cache, const int32_t* slots, int64_t n,
                               const float* latent, int64_t latent_stride, const float* k_pe,
                               int64_t k_pe_stride, int64_t kv_lora_rank, cudaStream_t stream);

// ---------------------------------------------------------------------------------- norm, rope

// y[t * y_stride + i] = RmsNormApply(x[t * x_stride + i], inv_rms(t), weight[i]) for t < n,
// i < dim: one thread block per row, the sum of squares in double. `weight` has `weight_type`
// (F32/BF16/F16, any alignment). `y` may alias `x` (same stride).
cudaError_t LaunchRmsNorm(const float* x, int64_t x_stride, int64_t n, int64_t dim,
                          const void* weight, kernels::ElemType weight_type, float eps, float* y,
                          int64_t y_stride, cudaStream_t stream);

// In-place interleaved RoPE on x + t * x_stride + h * head_stride (rope_dim values) for t < n,
// h < num_heads, at position positions[t], with inv_freq[rope_dim / 2] and attention_factor:
// one thread block per token, angles in double (RopeCosSin / RopeRotatePair).
cudaError_t LaunchRopeInterleaved(float* x, int64_t x_stride, int64_t n, int64_t num_heads,
                                  int64_t head_stride, int64_t rope_dim, const int32_t* positions,
                                  const float* inv_freq, float attention_factor,
                                  cudaStream_t stream);

// ---------------------------------------------------------------------------------- MoE gate

// For each token t < n: kernels::MoeGateSelect over logits[t * logits_stride ..+ E] and the bias
// (E elements of bias_type, any alignment, or null), writing ids[t * K ..+ K] and
// weights[t * K ..+ K]. One small thread block per token.
cudaError_t LaunchMoeGateSelect(const float* logits, int64_t logits_stride, int64_t n,
                                const void* bias, kernels::ElemType bias_type,
                                const MoeGateParams& config, int32_t* ids, float* weights,
                                cudaStream_t stream);

// ---------------------------------------------------------------------------------- MLA

// Rows and keys per thread block of LaunchMlaAttend; the largest kv_lora_rank it supports.
inline constexpr int kMlaTileRows = 16;
inline constexpr int kMlaKeyTile = 16;
inline constexpr int kMlaMaxLatent = 1024;
// Its dynamic shared memory for cache rows of `row_floats` (= Rkv + dr) floats. Must not exceed
// 99 KiB (the opt-in limit of sm_120; sm_90 allows more): row_floats <= 782.
inline int64_t MlaAttendSharedBytes(int64_t row_floats) {
  return static_cast<int64_t>(sizeof(float)) * ((kMlaTileRows + kMlaKeyTile) * row_floats +
                                                kMlaTileRows * kMlaKeyTile + 3 * kMlaTileRows);
}
inline constexpr int64_t kMlaMaxSharedBytes = 99 * 1024;

// One thread block of LaunchMlaAttend: the (query, head) rows
//   query first_row + i at absolute position first_pos + i, i < num_queries,
//   head first_head + j, j < num_heads,
// of one sequence (num_queries * num_heads <= kMlaTileRows), whose block table starts at
// block_tables[table_offset]. Query i sees keys 0 .. first_pos + i.
// LaunchMlaAttendPartial only: the queries see keys [key_begin, key_end) (and causality).
struct MlaTile {
  int64_t first_row = 0;
  int64_t first_pos = 0;
  int64_t table_offset = 0;
  int32_t num_queries = 0;
  int32_t first_head = 0;
  int32_t num_heads = 0;
  int32_t reserved = 0;
  int64_t key_begin = 0;
  int64_t key_end = INT64_MAX;
};

// Gathers the queries of the compact rows t < num_rows (q row q_rows[t]) per head h:
//   q_nope (dn values) -> q_nope_out[(t * nh + h) * dn ..]  (rounded to BF16 values when
//                         `round_bf16`, as a linear layer with FP8/BF16 weights sees them),
//   q_pe   (dr values) -> qcat[(t * nh + h) * (Rkv + dr) + Rkv ..].
// q row layout: head h at q + row * q_stride + h * (dn + dr), q_nope then q_pe.
cudaError_t LaunchMlaGatherQ(const float* q, int64_t q_stride, const int32_t* q_rows,
                             int64_t num_rows, const MlaDimensions& shape, float* q_nope_out,
                             bool round_bf16, float* qcat, cudaStream_t stream);

// The attention core of weight-absorbed MLA, flash-style: for each tile's rows (t, h), with
// qcat[(t * nh + h)] = [q~ (Rkv) | q_pe (dr)] and each cache row [c (Rkv) | k_pe (dr)],
//   u[(t * nh + h) * Rkv ..] = sum_s softmax_s(softmax_scale * qcat . row_s) c_s
// over the visible keys s, walking the keys in tiles of kMlaKeyTile with an online softmax
// (kernels::OnlineSoftmaxStep): no score matrix beyond kMlaTileRows x kMlaKeyTile ever exists.
// One thread block per tile; `tiles` (num_tiles) and block_tables in device memory. Requires
// Rkv <= kMlaMaxLatent and MlaAttendSharedBytes(Rkv + dr) <= kMlaMaxSharedBytes
// (cudaErrorInvalidValue otherwise).
cudaError_t LaunchMlaAttend(const MlaDimensions& shape, const float* qcat, const KvCacheDesc& cache,
                            const int32_t* block_tables, const MlaTile* tiles, int64_t num_tiles,
                            float* u, cudaStream_t stream);

// The GEMM form of the same attention (the CUDA device's default, HMOE_CUDA_MLA_ATTENTION): the
// device gathers one sequence's keys into a dense [num_keys, row_floats] matrix
// (LaunchGatherKvRows), scores a block of (query, head) rows against all of them with one F32
// cuBLAS GEMM (scaled by softmax_scale), turns each row into probabilities over its visible keys
// (LaunchMlaMaskedSoftmax: keys past the row's position get 0), and forms u = P c with a second
// F32 GEMM. F32 throughout, as LaunchMlaAttend; only the summation order differs.
//
// dst[k * row_floats + c] = cache row of key k (block_table[k / block_size]), k < num_keys.
cudaError_t LaunchGatherKvRows(const KvCacheDesc& cache, const int32_t* block_table,
                               int64_t num_keys, float* dst, cudaStream_t stream);
// For each of num_rows rows of `scores` (row i: [num_keys] floats at scores + i * num_keys, row i
// belongs to query i / num_heads at absolute position first_pos + i / num_heads): softmax over
// keys 0 .. position (in place), 0 for the later keys.
cudaError_t LaunchMlaMaskedSoftmax(float* scores, int64_t num_rows, int64_t num_keys,
                                   int64_t num_heads, int64_t first_pos, cudaStream_t stream);

// Context-parallel variant (Device::MlaAttentionPartial): each tile's queries see only the keys
// [key_begin, key_end) of their sequence (and causality), and the attention over them is merged
// into the running state of the query row q_rows[t] (t: the tile's compact row) and head h:
//   state_u[(q_rows[t] * nh + h) * Rkv ..], state_lse[q_rows[t] * nh + h]
// (softmax-weighted latent average and log-sum-exp of the keys seen so far; -inf: none), or
// overwrites it when `first`. Rows that see no key keep their state (first: u = 0, lse = -inf).
cudaError_t LaunchMlaAttendPartial(const MlaDimensions& shape, const float* qcat,
                                   const KvCacheDesc& cache, const int32_t* block_tables,
                                   const MlaTile* tiles, int64_t num_tiles, const int32_t* q_rows,
                                   float* state_u, float* state_lse, bool first,
                                   cudaStream_t stream);

// The block scales of MLA's FP8 projections (CudaDevice runs them as BF16 GEMMs of the exact code
// values, one per 128-column block, with F32 accumulation), for `heads` heads at once: for
// t < rows, h < heads, j < cols,
//   y[t * y_stride + h * y_head_stride + j] =
//       sum_b S_h[((row_base + h * row_step + j) / 128) * s_h + b]
//             * partials[b * plane_stride + t * p_stride + h * p_head_stride + j]
// summed over b < num_blocks in increasing order in F32 (as LaunchBlockScaleCombine: each
// block's sum times its scale), where S_h, s_h are descs[h].scale_inv, descs[h].scale_stride
// when `descs` (device array of per-head weights) is non-null, else scale_inv, scale_stride.
// y may alias partials when num_blocks is 1 and the strides agree (in place).
cudaError_t LaunchMlaBlockScale(const float* partials, int64_t num_blocks, int64_t plane_stride,
                                int64_t p_stride, int64_t p_head_stride, int64_t rows,
                                int64_t heads, int64_t cols, const float* scale_inv,
                                int64_t scale_stride, const WeightDesc* descs, int64_t row_base,
                                int64_t row_step, float* y, int64_t y_stride, int64_t y_head_stride,
                                cudaStream_t stream);

}  // namespace hmoe::cuda
