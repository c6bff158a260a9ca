#pragma once

// The parameters of the model-shaped ops, one struct per concept, shared by every layer that
// describes such an op: the CPU and CUDA kernels, common/device's op arguments, the engine, and
// the FP32 reference (common/engine/reference). Plain data only (no functions, no code to share):
// the reference oracle and the production ops agree on what the parameters mean, never on how
// they are used. C++17 with no includes beyond <cstdint>, so nvcc compiles it into .cu files.

#include <cstdint>

namespace hmoe {

// noaux_tc router parameters of the MoE gate (MODEL-SPEC §3.9): sigmoid scores, the
// e_score_correction_bias for selection only, group-limited top-k, optional renormalization.
struct MoeGateParams {
  int64_t num_experts = 0;     // E, a multiple of n_group
  int64_t top_k = 0;           // K = num_experts_per_tok, <= topk_group * E / n_group
  int64_t n_group = 1;         // groups of E / n_group experts
  int64_t topk_group = 1;      // groups kept
  bool norm_topk_prob = true;  // renormalize the K selected weights to sum 1
  double routed_scaling_factor = 1.0;
};

// The head dimensions of multi-head latent attention (MODEL-SPEC §3.5-3.7).
struct MlaDimensions {
  int64_t num_heads = 0;     // nh
  int64_t nope_dim = 0;      // dn
  int64_t rope_dim = 0;      // dr
  int64_t v_dim = 0;         // dv
  int64_t kv_lora_rank = 0;  // Rkv
  float softmax_scale = 1.0f;
};

}  // namespace hmoe
