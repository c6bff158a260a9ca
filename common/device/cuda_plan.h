#pragma once

// Host-side planning of CudaDevice's ops: how a linear layer is split into chunks that bound its
// temporaries, and how MLA attention's query rows are grouped into thread-block tiles. Pure
// functions of the arguments (no CUDA calls), so they are tested without a GPU. Internal to the
// CUDA backend (includes the kernel launchers' header, hence CUDA's runtime header).

#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

#include "common/device/device.h"
#include "common/kernels/cuda/cuda_kernels.h"

namespace hmoe::internal {

// Temporaries of one op are carved from its stream's arena at this alignment.
inline constexpr size_t kScratchAlign = 256;
// Upper bounds on the temporaries of one linear-layer pass: the BF16 activations of a token
// chunk, a converted weight row chunk, and (FP8) the per-block partial sums of a token chunk.
inline constexpr int64_t kCudaActivationChunkBytes = int64_t{64} << 20;
inline constexpr int64_t kCudaWeightChunkBytes = int64_t{64} << 20;
// Upper bound on the per-row-chunk workspace of MLA attention (q~, u, ... of a chunk of rows).
inline constexpr int64_t kCudaMlaChunkBytes = int64_t{64} << 20;

inline size_t AlignUp(size_t v, size_t a) { return (v + a - 1) / a * a; }

// Offsets of the temporaries of one op in the arena.
class ScratchLayout {
 public:
  // Reserves `bytes` (kScratchAlign-aligned) and returns their offset.
  size_t Add(size_t bytes) {
    const size_t offset = size_;
    size_ = AlignUp(size_ + bytes, kScratchAlign);
    return offset;
  }
  size_t size() const { return size_; }

 private:
  size_t size_ = 0;
};

// How CudaDevice computes y = W x for n tokens (cuda_device.cc explains the numerics):
//   kF32:       F32 GEMM; F32 weights in place, others converted exactly to F32 in row chunks;
//   kBf16:      BF16 weights (in place when 2-byte aligned, else copied in row chunks) x BF16
//               activations;
//   kFp8Bf16:   FP8 codes times their block scales rounded to BF16 (row chunks, leading dimension
//               padded to a multiple of 8 elements) x BF16 activations: one GEMM over all columns
//               (CudaFp8Linear::kBf16);
//   kFp8Blocks: FP8 codes as exact BF16 (row chunks, columns zero-padded to whole 128-blocks) x
//               BF16 activations, one GEMM per 128-column block (a strided batch) into F32
//               partial sums, then each block's sum times its block scale, summed over blocks
//               (CudaFp8Linear::kBlocks).
// Token chunks bound the BF16 activations and the partial sums.
enum class LinearMode { kF32, kBf16, kFp8Bf16, kFp8Blocks };

struct LinearPlan {
  LinearMode mode = LinearMode::kF32;
  bool direct = false;     // W used in place
  int64_t k_padded = 0;    // leading dimension of the BF16 activations / packed weight
                           // (kFp8Blocks: whole blocks, zero-filled; the GEMMs' K is w.cols else)
  int64_t num_blocks = 0;  // 128-column blocks of W
  int64_t row_chunk = 0;   // weight rows per pass: all of them, or a multiple of 128
  int64_t token_chunk = 0;
  size_t x_offset = 0;        // arena offsets of the BF16 activations,
  size_t w_offset = 0;        // the converted weight rows,
  size_t partial_offset = 0;  // the FP8 block partial sums (kFp8Blocks)
  size_t bytes = 0;           // arena bytes needed
};

// `w` passed CheckLinearWeight; n > 0. f32: F32 math whatever the weight's dtype (the router).
// fp8_blocks: FP8 weights take kFp8Blocks instead of kFp8Bf16.
LinearPlan PlanLinear(const LinearWeight& w, bool f32, int64_t n, bool fp8_blocks = false);

// The query rows of an MLA call in compact order (segment by segment), in chunks of chunk_rows
// rows, and the tiles (thread blocks) of each chunk. A tile covers consecutive rows of one segment
// within one chunk (first_row is relative to its chunk) and a range of heads: up to kMlaTileRows
// queries, paired with as many heads as fit in kMlaTileRows (query, head) rows (decode: 1 query x
// 16 heads; prefill: 16 queries x 1 head). Every (row, head) is in exactly one tile.
struct MlaPlan {
  std::vector<int32_t> q_rows;       // compact row -> row of q and out
  std::vector<cuda::MlaTile> tiles;  // all chunks, chunk by chunk
  std::vector<int64_t> chunk_tiles;  // tiles of chunk c: [chunk_tiles[c], chunk_tiles[c + 1])
  int64_t chunk_rows = 0;            // max(1, chunk_rows)
};

// Segments as MlaAttentionArgs::segments (validated: rows fit in int32). With key_ranges (one
// per segment: MlaAttentionPartial), each tile carries its segment's key range.
MlaPlan PlanMla(std::span<const MlaSegment> segments, int64_t num_heads, int64_t chunk_rows,
                std::span<const MlaKeyRange> key_ranges = {});

}  // namespace hmoe::internal
