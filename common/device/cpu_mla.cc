// Weight-absorbed MLA attention on the CPU (MODEL-SPEC §3.7), for both device ops.
//
// Work is split into tasks (head h, group of query rows). A task:
//   1. q~ = W_UK_h^T q_nope for the group's rows (one matrix-vector pass over W_UK_h^T for up to
//      the whole group), stored next to q_pe so one dot product against a cache row
//      [latent | k_pe] gives the whole score;
//   2. walks the keys of each sequence block by block (the cache's own blocks), scoring up to four
//      rows of the same sequence against each key with shared loads, with an online softmax
//      (running max and sum per row; the accumulator u is rescaled once per block), so no
//      N x N score matrix ever exists;
//   3. out_h = W_UV_h (u / sum) for the group's rows.
// Tasks are handed out dynamically (an atomic counter) over the pool's threads, largest first;
// a single group (a decode step) is split into contiguous head ranges instead.

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "absl/strings/str_cat.h"

#include "common/base/logging.h"
#include "common/base/status_macros.h"
#include "common/device/cpu_internal.h"
#include "common/kernels/cpu/f32_ops.h"

namespace hmoe::internal {
namespace {

constexpr int64_t kDecodeGroupRows = 8;
constexpr int64_t kPrefillGroupRows = 32;
// Keys per step of the online softmax. Fixed, not the cache's block size: the running max, the
// rescaling and the partial sums then happen at the same keys whatever the block size, so a
// sequence's attention is bitwise the same in caches of different block sizes (the SLP runner's
// 64-token blocks and a decode worker's 16-token blocks hand the same KV over).
constexpr int64_t kKeyTile = 16;

// A query row of a group.
struct Row {
  int64_t row = 0;      // row of q and out
  int64_t segment = 0;  // its segment
  int64_t pos = 0;      // its absolute position (it sees keys 0..pos)
};

struct Group {
  int64_t begin = 0;  // into the row list
  int64_t count = 0;
  int64_t max_pos = 0;
};

struct ThreadScratch {
  ScratchBuffer qn, packed, qcat, acc, scores, stats, out;
};

thread_local ThreadScratch tls_scratch;

// Sequence rows of one segment, [begin, begin + count) of the group, processed together, against
// the keys [range.begin, range.end) (and causality).
void AttendRun(const MlaAttentionArgs& a, const MlaSegment& seg, const MlaKeyRange& range,
               const Row* rows, int64_t count, const float* qcat, float* acc, float* scores,
               float* row_max, float* row_sum) {
  const MlaDimensions& d = a.dims;
  const int64_t rf = a.cache.row_floats;
  const int64_t rkv = d.kv_lora_rank;
  const int64_t bs = a.cache.block_size;
  constexpr int64_t tile = kKeyTile;  // scores row stride
  const int32_t* table = a.block_tables + seg.block_table_offset;
  int64_t max_pos = 0;
  for (int64_t r = 0; r < count; ++r) max_pos = std::max(max_pos, rows[r].pos);
  const int64_t num_keys = std::min(max_pos + 1, range.end);
  const int64_t first_key = range.begin;
  const float scale = d.softmax_scale;
  const float neg_inf = -std::numeric_limits<float>::infinity();

  for (int64_t k0 = first_key / tile * tile; k0 < num_keys; k0 += tile) {
    const int64_t nk = std::min(tile, num_keys - k0);
    // Keys of the tile before the range (partial attention) may not be written yet: never read.
    const int64_t j0 = std::max<int64_t>(0, first_key - k0);
    // The tile's keys may span cache blocks.
    const float* key[kKeyTile];
    for (int64_t j = j0; j < nk; ++j) {
      const int64_t pos = k0 + j;
      key[j] = a.cache.base + static_cast<int64_t>(table[pos / bs]) * a.cache.block_stride +
               (pos % bs) * rf;
    }
    // Scores [count][nk], masked (causal) to -inf.
    int64_t r = 0;
    for (; r < count; ++r) {
      for (int64_t j = 0; j < j0; ++j) scores[r * tile + j] = neg_inf;
    }
    r = 0;
    for (; r + 4 <= count; r += 4) {
      for (int64_t j = j0; j < nk; ++j) {
        float s4[4];
        cpu::Dot4F32(qcat + r * rf, rf, key[j], rf, s4);
        for (int i = 0; i < 4; ++i) {
          scores[(r + i) * tile + j] =
              k0 + j <= rows[r + i].pos && k0 + j >= first_key ? s4[i] * scale : neg_inf;
        }
      }
    }
    for (; r < count; ++r) {
      for (int64_t j = j0; j < nk; ++j) {
        scores[r * tile + j] = k0 + j <= rows[r].pos && k0 + j >= first_key
                                   ? cpu::DotF32(qcat + r * rf, key[j], rf) * scale
                                   : neg_inf;
      }
    }
    // Online softmax: rescale each row's accumulator to the new running max.
    for (r = 0; r < count; ++r) {
      float* s = scores + r * tile;
      float block_max = neg_inf;
      for (int64_t j = 0; j < nk; ++j) block_max = std::max(block_max, s[j]);
      if (block_max == neg_inf) {
        for (int64_t j = 0; j < nk; ++j) s[j] = 0.0f;
        continue;
      }
      if (block_max > row_max[r]) {
        const float correction = row_max[r] == neg_inf ? 0.0f : std::exp(row_max[r] - block_max);
        if (correction != 1.0f) {
          float* u = acc + r * rkv;
          for (int64_t i = 0; i < rkv; ++i) u[i] *= correction;
          row_sum[r] *= correction;
        }
        row_max[r] = block_max;
      }
      float sum = 0.0f;
      for (int64_t j = 0; j < nk; ++j) {
        s[j] = s[j] == neg_inf ? 0.0f : std::exp(s[j] - row_max[r]);
        sum += s[j];
      }
      row_sum[r] += sum;
    }
    // u += p c over the latent part of the keys.
    // Four rows at a time, the tile's keys in order (bitwise the same as one Axpy4F32 per key).
    r = 0;
    for (; r + 4 <= count; r += 4) {
      cpu::AxpyTile4F32(scores + r * tile + j0, tile, key + j0, nk - j0, acc + r * rkv, rkv, rkv);
    }
    for (; r < count; ++r) {
      for (int64_t j = j0; j < nk; ++j) {
        const float p = scores[r * tile + j];
        if (p != 0.0f) cpu::AxpyF32(p, key[j], acc + r * rkv, rkv);
      }
    }
  }
}

// Folds one task's attention (unnormalized acc, running max and sum per row) into the partial
// state of its rows (MlaPartialState).
void MergePartial(const MlaDimensions& d, const MlaPartialState& state, const Row* rows, int64_t n,
                  int64_t head, const float* acc, const float* row_max, const float* row_sum) {
  const int64_t rkv = d.kv_lora_rank;
  const float neg_inf = -std::numeric_limits<float>::infinity();
  for (int64_t r = 0; r < n; ++r) {
    const int64_t index = rows[r].row * d.num_heads + head;
    float* u = state.u + index * rkv;
    float& lse = state.lse[index];
    const float* a = acc + r * rkv;
    if (row_sum[r] == 0.0f) {  // no visible key in this call
      if (state.first) {
        std::fill(u, u + rkv, 0.0f);
        lse = neg_inf;
      }
      continue;
    }
    const float lse_new = row_max[r] + std::log(row_sum[r]);
    if (state.first || lse == neg_inf) {
      const float inv = 1.0f / row_sum[r];
      for (int64_t i = 0; i < rkv; ++i) u[i] = a[i] * inv;
      lse = lse_new;
      continue;
    }
    const float m = std::max(lse, lse_new);
    const float w_old = std::exp(lse - m);
    const float w_new = std::exp(lse_new - m);
    const float total = w_old + w_new;
    const float c_old = w_old / total;
    const float c_new = w_new / (total * row_sum[r]);  // acc is unnormalized
    for (int64_t i = 0; i < rkv; ++i) u[i] = c_old * u[i] + c_new * a[i];
    lse = m + std::log(total);
  }
}

void RunTask(const CpuKernels& k, const MlaAttentionArgs& a, const MlaPartialState* partial,
             const std::vector<Row>& rows, const Group& g, int64_t head) {
  const MlaDimensions& d = a.dims;
  const int64_t n = g.count;
  const int64_t rf = a.cache.row_floats;
  const int64_t rkv = d.kv_lora_rank;
  const int64_t dq = d.nope_dim + d.rope_dim;
  const Row* grow = rows.data() + g.begin;
  ThreadScratch& ts = tls_scratch;

  // 1. q~ = W_UK_h^T q_nope, next to q_pe.
  const LinearWeight& uk = a.w_uk_t[head];
  float* qn = reinterpret_cast<float*>(ts.qn.Get(n * d.nope_dim * sizeof(float)));
  for (int64_t r = 0; r < n; ++r) {
    std::memcpy(qn + r * d.nope_dim, a.q + grow[r].row * a.q_stride + head * dq,
                d.nope_dim * sizeof(float));
  }
  const int64_t uk_stride = PackedRowBytes(k, uk);
  const int64_t uv_stride = PackedRowBytes(k, a.kv_b);
  std::byte* packed = ts.packed.Get(std::max<int64_t>(64, n * std::max(uk_stride, uv_stride)));
  PackRows(k, uk, qn, d.nope_dim, n, packed, uk_stride);
  float* qcat = reinterpret_cast<float*>(ts.qcat.Get(n * rf * sizeof(float)));
  LinearRows(k, uk, packed, uk_stride, qn, d.nope_dim, n, 0, rkv, qcat, rf);
  for (int64_t r = 0; r < n; ++r) {
    std::memcpy(qcat + r * rf + rkv, a.q + grow[r].row * a.q_stride + head * dq + d.nope_dim,
                d.rope_dim * sizeof(float));
  }

  // 2. Attention over the cache, per run of rows of one segment.
  float* acc = reinterpret_cast<float*>(ts.acc.Get(n * rkv * sizeof(float)));
  std::fill(acc, acc + n * rkv, 0.0f);
  float* scores = reinterpret_cast<float*>(ts.scores.Get(n * kKeyTile * sizeof(float)));
  float* stats = reinterpret_cast<float*>(ts.stats.Get(2 * n * sizeof(float)));
  float* row_max = stats;
  float* row_sum = stats + n;
  std::fill(row_max, row_max + n, -std::numeric_limits<float>::infinity());
  std::fill(row_sum, row_sum + n, 0.0f);
  for (int64_t r0 = 0; r0 < n;) {
    int64_t r1 = r0 + 1;
    while (r1 < n && grow[r1].segment == grow[r0].segment) ++r1;
    const int64_t segment = grow[r0].segment;
    const MlaKeyRange range = partial != nullptr
                                  ? a.key_ranges[segment]
                                  : MlaKeyRange{0, std::numeric_limits<int64_t>::max()};
    AttendRun(a, a.segments[segment], range, grow + r0, r1 - r0, qcat + r0 * rf, acc + r0 * rkv,
              scores + r0 * kKeyTile, row_max + r0, row_sum + r0);
    r0 = r1;
  }
  if (partial != nullptr) {
    MergePartial(d, *partial, grow, n, head, acc, row_max, row_sum);
    return;
  }
  for (int64_t r = 0; r < n; ++r) {
    const float inv = 1.0f / row_sum[r];  // > 0: every row sees at least key 0
    float* u = acc + r * rkv;
    for (int64_t i = 0; i < rkv; ++i) u[i] *= inv;
  }

  // 3. out_h = W_UV_h u.
  PackRows(k, a.kv_b, acc, rkv, n, packed, uv_stride);
  float* o = reinterpret_cast<float*>(ts.out.Get(n * d.v_dim * sizeof(float)));
  const int64_t uv_begin = head * (d.nope_dim + d.v_dim) + d.nope_dim;
  LinearRows(k, a.kv_b, packed, uv_stride, acc, rkv, n, uv_begin, uv_begin + d.v_dim, o, d.v_dim);
  for (int64_t r = 0; r < n; ++r) {
    std::memcpy(a.out + grow[r].row * a.out_stride + head * d.v_dim, o + r * d.v_dim,
                d.v_dim * sizeof(float));
  }
}

}  // namespace

absl::Status CheckMlaAttentionArgs(const MlaAttentionArgs& a, bool partial) {
  const MlaDimensions& d = a.dims;
  if (d.num_heads <= 0 || d.nope_dim <= 0 || d.rope_dim <= 0 || d.v_dim <= 0 ||
      d.kv_lora_rank <= 0) {
    return absl::InvalidArgumentError("mla attention: non-positive dimension");
  }
  if (a.q == nullptr || a.q_stride < d.num_heads * (d.nope_dim + d.rope_dim) ||
      (!partial && (a.out == nullptr || a.out_stride < d.num_heads * d.v_dim))) {
    return absl::InvalidArgumentError("mla attention: bad q/out pointers or strides");
  }
  if (static_cast<int64_t>(a.w_uk_t.size()) != d.num_heads) {
    return absl::InvalidArgumentError(
        absl::StrCat("mla attention: ", a.w_uk_t.size(), " W_UK^T heads, expected ", d.num_heads));
  }
  for (const LinearWeight& w : a.w_uk_t) {
    HMOE_RETURN_IF_ERROR(CheckLinearWeight(w, "mla attention W_UK^T"));
    if (w.rows != d.kv_lora_rank || w.cols != d.nope_dim) {
      return absl::InvalidArgumentError(absl::StrCat("mla attention: W_UK^T is [", w.rows, ", ",
                                                     w.cols, "], expected [", d.kv_lora_rank, ", ",
                                                     d.nope_dim, "]"));
    }
  }
  if (!partial) {
    HMOE_RETURN_IF_ERROR(CheckLinearWeight(a.kv_b, "mla attention kv_b"));
    if (a.kv_b.rows < d.num_heads * (d.nope_dim + d.v_dim) || a.kv_b.cols != d.kv_lora_rank) {
      return absl::InvalidArgumentError("mla attention: kv_b has the wrong shape");
    }
  }
  if (a.cache.base == nullptr || a.cache.block_size <= 0 ||
      a.cache.row_floats != d.kv_lora_rank + d.rope_dim ||
      a.cache.block_stride < a.cache.block_size * a.cache.row_floats) {
    return absl::InvalidArgumentError("mla attention: bad cache view");
  }
  if (!a.segments.empty() && a.block_tables == nullptr) {
    return absl::InvalidArgumentError("mla attention: no block tables");
  }
  for (const MlaSegment& s : a.segments) {
    if (s.num_queries < 0 || s.start_pos < 0 || s.query_begin < 0 || s.block_table_offset < 0) {
      return absl::InvalidArgumentError("mla attention: bad segment");
    }
  }
  return absl::OkStatus();
}

absl::Status CpuMlaAttention(const CpuKernels& kernels, ParallelRunner run,
                             const MlaAttentionArgs& args, bool decode,
                             const MlaPartialState* partial) {
  HMOE_RETURN_IF_ERROR(CheckMlaAttentionArgs(args, partial != nullptr));
  if (partial != nullptr) {
    if (args.key_ranges.size() != args.segments.size()) {
      return absl::InvalidArgumentError(
          absl::StrCat("mla partial attention: ", args.key_ranges.size(), " key ranges for ",
                       args.segments.size(), " segments"));
    }
    if (partial->u == nullptr || partial->lse == nullptr) {
      return absl::InvalidArgumentError("mla partial attention: no state");
    }
  }
  // Rows in segment order; groups of rows.
  std::vector<Row> rows;
  std::vector<Group> groups;
  const int64_t limit = decode ? kDecodeGroupRows : kPrefillGroupRows;
  for (int64_t s = 0; s < static_cast<int64_t>(args.segments.size()); ++s) {
    const MlaSegment& seg = args.segments[s];
    for (int64_t i = 0; i < seg.num_queries; ++i) {
      // A new group when the current one is full, or (prefill) at a new segment.
      if (groups.empty() || groups.back().count == limit || (!decode && rows.back().segment != s)) {
        groups.push_back(Group{static_cast<int64_t>(rows.size()), 0, 0});
      }
      rows.push_back(Row{seg.query_begin + i, s, seg.start_pos + i});
      Group& g = groups.back();
      ++g.count;
      g.max_pos = std::max(g.max_pos, seg.start_pos + i);
    }
  }
  if (rows.empty()) return absl::OkStatus();
  // Largest groups (most keys) first, for balance.
  std::stable_sort(groups.begin(), groups.end(),
                   [](const Group& x, const Group& y) { return x.max_pos > y.max_pos; });
  const int64_t heads = args.dims.num_heads;
  const int64_t num_tasks = static_cast<int64_t>(groups.size()) * heads;
  std::atomic<int64_t> next{0};
  run([&](int thread, int threads) {
    if (groups.size() == 1) {
      // One group (a decode step): each thread takes a contiguous range of heads, so it streams
      // a contiguous part of W_UK^T and of kv_b (the hardware prefetcher keeps running across
      // heads; handing heads out one by one would interleave the threads' streams).
      const int64_t begin = num_tasks * thread / threads;
      const int64_t end = num_tasks * (thread + 1) / threads;
      for (int64_t task = begin; task < end; ++task) {
        RunTask(kernels, args, partial, rows, groups[0], task);
      }
      return;
    }
    while (true) {
      // Relaxed: the counter only hands out task indices; inputs were published by the pool.
      const int64_t task = next.fetch_add(1, std::memory_order_relaxed);
      if (task >= num_tasks) return;
      RunTask(kernels, args, partial, rows, groups[task / heads], task % heads);
    }
  });
  return absl::OkStatus();
}

absl::Status CpuMlaProjectLatent(const CpuKernels& kernels, ParallelRunner run,
                                 const MlaDimensions& d, const LinearWeight& kv_b, const float* u,
                                 int64_t n, float* out, int64_t out_stride) {
  if (d.num_heads <= 0 || d.nope_dim <= 0 || d.v_dim <= 0 || d.kv_lora_rank <= 0 || n < 0) {
    return absl::InvalidArgumentError("mla projection: non-positive dimension");
  }
  HMOE_RETURN_IF_ERROR(CheckLinearWeight(kv_b, "mla projection kv_b"));
  if (kv_b.rows < d.num_heads * (d.nope_dim + d.v_dim) || kv_b.cols != d.kv_lora_rank) {
    return absl::InvalidArgumentError("mla projection: kv_b has the wrong shape");
  }
  if (n == 0) return absl::OkStatus();
  if (u == nullptr || out == nullptr || out_stride < d.num_heads * d.v_dim) {
    return absl::InvalidArgumentError("mla projection: bad pointers or stride");
  }
  // Tasks (head, group of rows), as step 3 of RunTask: the same packing and kernels.
  const int64_t rkv = d.kv_lora_rank;
  const int64_t groups = (n + kPrefillGroupRows - 1) / kPrefillGroupRows;
  const int64_t num_tasks = groups * d.num_heads;
  std::atomic<int64_t> next{0};
  run([&](int, int) {
    ThreadScratch& ts = tls_scratch;
    const int64_t uv_stride = PackedRowBytes(kernels, kv_b);
    while (true) {
      // Relaxed: the counter only hands out task indices; inputs were published by the pool.
      const int64_t task = next.fetch_add(1, std::memory_order_relaxed);
      if (task >= num_tasks) return;
      const int64_t head = task % d.num_heads;
      const int64_t t0 = task / d.num_heads * kPrefillGroupRows;
      const int64_t rows = std::min(kPrefillGroupRows, n - t0);
      const float* x = u + (t0 * d.num_heads + head) * rkv;
      const int64_t x_stride = d.num_heads * rkv;
      std::byte* packed = ts.packed.Get(std::max<int64_t>(64, rows * uv_stride));
      PackRows(kernels, kv_b, x, x_stride, rows, packed, uv_stride);
      float* o = reinterpret_cast<float*>(ts.out.Get(rows * d.v_dim * sizeof(float)));
      const int64_t uv_begin = head * (d.nope_dim + d.v_dim) + d.nope_dim;
      LinearRows(kernels, kv_b, packed, uv_stride, x, x_stride, rows, uv_begin, uv_begin + d.v_dim,
                 o, d.v_dim);
      for (int64_t r = 0; r < rows; ++r) {
        std::memcpy(out + (t0 + r) * out_stride + head * d.v_dim, o + r * d.v_dim,
                    d.v_dim * sizeof(float));
      }
    }
  });
  return absl::OkStatus();
}

}  // namespace hmoe::internal
