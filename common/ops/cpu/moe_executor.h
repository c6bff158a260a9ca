#pragma once

// The routed-expert half of a MoE layer on the CPU (issue #7; paper §3.5, KTransformers' NUMA
// tensor parallelism):
//
//   out[t] = sum_{j < top_k} w[t][j] * E_{id[t][j]}(x[t]) + sum_{shared s} E_s(x[t])
//   E(x) = W_down (SiLU(W_gate x) * (W_up x))
//
// with FP8 block-scaled weights read in place. Each expert is split across the pool's nodes: node
// s holds rows [b_s, e_s) of gate and up and the matching columns of down, computes
// h_s = SiLU(gate_s x) * (up_s x) and down_s h_s, a partial output; partials are summed at the end.
//
// One Forward is exactly two CpuWorkerPool::Run calls (two global barriers):
//   1. Per node, a dynamic task queue of (expert, row slice) tasks: gate+up slices of every active
//      expert (SiLU * up fused, h written packed as BF16 for down), then down slices. A per-expert,
//      per-node countdown replaces a global barrier between the two: down tasks of expert e are
//      queued after the gate/up tasks of the next expert and wait only for e's own gate/up.
//   2. The router-weighted reduction of the partial outputs, split over all threads by columns.
// Results do not depend on thread timing: each output element has one fixed summation order,
// starting from zero: the shared experts, then the token's routed experts in increasing id order,
// each expert's parts in node order. That is also the order of the engine's grouped expert path,
// so with one part per expert a token's result is bitwise the same on either path.

#include <cstdint>
#include <memory>
#include <span>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

#include "common/kernels/cpu/fp8_gemv.h"
#include "common/model/tensor.h"
#include "common/ops/cpu/cpu_worker_pool.h"

namespace hmoe {

// One node's slice of an expert: gate/up [inter_s, hidden] and down [hidden, inter_s] for the same
// slice of the intermediate dimension.
struct MoeExpertPart {
  cpu::Fp8MatrixView gate;
  cpu::Fp8MatrixView up;
  cpu::Fp8MatrixView down;
};

// An expert as the executor reads it: one part per node of the pool, in node order. The parts'
// intermediate slices partition the expert's intermediate dimension (any order).
struct MoeExpertWeights {
  std::vector<MoeExpertPart> parts;
};

// The weights of one MoE layer. `routed` is indexed by expert id.
struct MoeLayerWeights {
  int64_t hidden = 0;
  std::vector<MoeExpertWeights> routed;
  std::vector<MoeExpertWeights> shared;  // applied to every token with weight 1
};

// A read-only FP8 view of `w` (F8_E4M3, 2-D, with a [ceil(r/128), ceil(c/128)] F32 scale tensor,
// 4-byte aligned). InvalidArgument otherwise.
absl::StatusOr<cpu::Fp8MatrixView> Fp8ViewOfWeight(const Weight& w);

// Splits a whole expert (gate/up [inter, hidden], down [hidden, inter]) into `num_parts` parts on
// 128-row boundaries, as evenly as the 128-blocks allow. InvalidArgument for inconsistent shapes;
// a part may be empty when inter < 128 * num_parts.
absl::StatusOr<MoeExpertWeights> SplitExpert(const cpu::Fp8MatrixView& gate,
                                             const cpu::Fp8MatrixView& up,
                                             const cpu::Fp8MatrixView& down, int num_parts);

// Routing of a batch: token t uses experts ids[t * top_k + j] with weights[t * top_k + j] (already
// normalized and scaled by routed_scaling_factor; the executor only multiplies and adds).
struct MoeRouting {
  int top_k = 0;
  std::span<const int32_t> ids;
  std::span<const float> weights;
};

struct MoeExecutorOptions {
  int max_tokens = cpu::kMaxMatVecTokens;  // largest batch Forward accepts (at most 8 for now)
  int64_t max_experts_per_batch = 0;       // 0: max_tokens * 8 + 4
  int64_t max_intermediate = 2048;         // largest expert intermediate size (whole expert)
  int64_t gate_up_task_rows = 256;         // rows of gate (and of up) per task; multiple of 128
  int64_t down_task_rows = 512;            // rows of down per task; multiple of 128
};

// Executes MoE layers on a CpuWorkerPool. Owns its scratch buffers (sized at Create), so one
// executor runs one Forward at a time; not thread-safe.
class MoeExecutor {
 public:
  // `pool` and `gemv` must outlive the executor. InvalidArgument for bad options.
  static absl::StatusOr<std::unique_ptr<MoeExecutor>> Create(CpuWorkerPool* pool,
                                                             const cpu::Fp8Gemv* gemv,
                                                             int64_t hidden,
                                                             const MoeExecutorOptions& options);
  ~MoeExecutor();
  MoeExecutor(const MoeExecutor&) = delete;
  MoeExecutor& operator=(const MoeExecutor&) = delete;

  // out[t * hidden + i] for the num_tokens = x.size() / hidden tokens of x ([N, hidden], F32).
  // InvalidArgument for mismatched sizes, expert ids out of range, experts with a part count other
  // than the pool's node count, or more tokens / distinct experts than the executor was sized for.
  absl::Status Forward(const MoeLayerWeights& layer, std::span<const float> x,
                       const MoeRouting& routing, std::span<float> out);

  // Statistics of the last Forward: distinct experts run (routed + shared) and FP8 weight bytes
  // read (including scales).
  int64_t last_active_experts() const { return last_active_experts_; }
  int64_t last_weight_bytes() const { return last_weight_bytes_; }

 private:
  struct Impl;
  explicit MoeExecutor(std::unique_ptr<Impl> impl);

  std::unique_ptr<Impl> impl_;
  int64_t last_active_experts_ = 0;
  int64_t last_weight_bytes_ = 0;
};

}  // namespace hmoe
