#include "common/device/cuda_plan.h"

#include <algorithm>

namespace hmoe::internal {

LinearPlan PlanLinear(const LinearWeight& w, bool f32, int64_t n, bool fp8_blocks) {
  LinearPlan p;
  p.mode = f32 || w.dtype == DType::kF32 ? LinearMode::kF32
           : w.dtype == DType::kBF16     ? LinearMode::kBf16
           : fp8_blocks                  ? LinearMode::kFp8Blocks
                                         : LinearMode::kFp8Bf16;
  const int64_t elem = p.mode == LinearMode::kF32 ? 4 : 2;
  p.direct = p.mode == LinearMode::kF32
                 ? w.dtype == DType::kF32
                 : p.mode == LinearMode::kBf16 && reinterpret_cast<uintptr_t>(w.data) % 2 == 0;
  p.num_blocks = (w.cols + 127) / 128;
  // kFp8Bf16: rows of 16-byte multiples, which the vectorized conversions and the tensor-core
  // GEMM kernels prefer.
  p.k_padded = p.mode == LinearMode::kFp8Blocks ? p.num_blocks * 128
               : p.mode == LinearMode::kFp8Bf16 ? (w.cols + 7) / 8 * 8
                                                : w.cols;
  p.row_chunk = w.rows;
  if (!p.direct) {
    // Multiples of 128 rows, as FP8 block scales require.
    p.row_chunk = std::max<int64_t>(128, kCudaWeightChunkBytes / (p.k_padded * elem) / 128 * 128);
    p.row_chunk = std::min(p.row_chunk, w.rows);
  }
  p.token_chunk = n;
  if (p.mode != LinearMode::kF32) {
    p.token_chunk = std::clamp<int64_t>(kCudaActivationChunkBytes / (p.k_padded * 2), 1, n);
  }
  if (p.mode == LinearMode::kFp8Blocks) {
    const int64_t per_token = p.num_blocks * p.row_chunk * 4;
    p.token_chunk = std::clamp<int64_t>(kCudaActivationChunkBytes / per_token, 1, p.token_chunk);
  }
  ScratchLayout layout;
  if (p.mode != LinearMode::kF32) {
    p.x_offset = layout.Add(static_cast<size_t>(p.token_chunk * p.k_padded * 2));
  }
  if (!p.direct) p.w_offset = layout.Add(static_cast<size_t>(p.row_chunk * p.k_padded * elem));
  if (p.mode == LinearMode::kFp8Blocks) {
    p.partial_offset =
        layout.Add(static_cast<size_t>(p.num_blocks * p.token_chunk * p.row_chunk * 4));
  }
  p.bytes = layout.size();
  return p;
}

MlaPlan PlanMla(std::span<const MlaSegment> segments, int64_t num_heads, int64_t chunk_rows,
                std::span<const MlaKeyRange> key_ranges) {
  MlaPlan plan;
  std::vector<int64_t> seg_of_row, pos_of_row;
  for (size_t si = 0; si < segments.size(); ++si) {
    const MlaSegment& seg = segments[si];
    for (int64_t i = 0; i < seg.num_queries; ++i) {
      plan.q_rows.push_back(static_cast<int32_t>(seg.query_begin + i));
      seg_of_row.push_back(static_cast<int64_t>(si));
      pos_of_row.push_back(seg.start_pos + i);
    }
  }
  const int64_t total = static_cast<int64_t>(plan.q_rows.size());
  plan.chunk_rows = std::max<int64_t>(1, chunk_rows);
  for (int64_t c0 = 0; c0 < total; c0 += plan.chunk_rows) {
    const int64_t c1 = std::min(total, c0 + plan.chunk_rows);
    plan.chunk_tiles.push_back(static_cast<int64_t>(plan.tiles.size()));
    for (int64_t r = c0; r < c1;) {
      int64_t run_end = r + 1;
      while (run_end < c1 && seg_of_row[run_end] == seg_of_row[r]) ++run_end;
      const int64_t queries_per_tile = std::min<int64_t>(cuda::kMlaTileRows, run_end - r);
      const int64_t heads_per_tile =
          std::min<int64_t>(num_heads, std::max<int64_t>(1, cuda::kMlaTileRows / queries_per_tile));
      for (int64_t q0 = r; q0 < run_end; q0 += queries_per_tile) {
        for (int64_t h0 = 0; h0 < num_heads; h0 += heads_per_tile) {
          cuda::MlaTile t;
          t.first_row = q0 - c0;
          t.first_pos = pos_of_row[q0];
          t.table_offset = segments[seg_of_row[q0]].block_table_offset;
          t.num_queries = static_cast<int32_t>(std::min(queries_per_tile, run_end - q0));
          t.first_head = static_cast<int32_t>(h0);
          t.num_heads = static_cast<int32_t>(std::min(heads_per_tile, num_heads - h0));
          if (!key_ranges.empty()) {
            t.key_begin = key_ranges[seg_of_row[q0]].begin;
            t.key_end = key_ranges[seg_of_row[q0]].end;
          }
          plan.tiles.push_back(t);
        }
      }
      r = run_end;
    }
  }
  plan.chunk_tiles.push_back(static_cast<int64_t>(plan.tiles.size()));
  return plan;
}

}  // namespace hmoe::internal
