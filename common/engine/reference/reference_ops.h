#pragma once

// The plain FP32 building blocks of the DeepSeek-V3 forward pass (MODEL-SPEC.md §3): the oracle
// every optimized kernel is tested against. Clarity wins over speed: scalar loops, dot products
// accumulated in double, no SIMD, no threads.
//
// Conventions: matrices are row-major float spans; `Linear` computes y = W x for W [out, in]
// (PyTorch layout). Size mismatches between spans are programmer errors (HMOE_CHECK), never
// data errors. All functions are thread-compatible (no shared state).

#include <cstdint>
#include <span>
#include <vector>

#include "common/kernels/op_params.h"
#include "common/model/model_config.h"

namespace hmoe::reference {

// y_i = weight_i * x_i / sqrt(mean_j(x_j^2) + eps). `out` may alias `x`.
void RmsNorm(std::span<const float> x, std::span<const float> weight, float eps,
             std::span<float> out);

// y = W x with W row-major [out_dim, in_dim]; y.size() == out_dim, x.size() == in_dim.
// `y` must not alias `x`.
void Linear(std::span<const float> w, int64_t out_dim, int64_t in_dim, std::span<const float> x,
            std::span<float> y);

// ---------------------------------------------------------------------------------- Q8_K

// The Q8_K rounding of an activation vector (GGUF models: a product with a block-quantized
// weight takes its activation in Q8_K, as llama.cpp does; MODEL-SPEC §5.4, docs/gguf.md). Per
// block of 256 values (the last one shorter): amax = max |x| (float); amax == 0 gives zeros;
// else d = amax / 127 and q = round-half-even(x * (127 / amax)), both in float, |q| <= 127; the
// value is d * q, returned exactly (in double). Written from that definition alone: it shares
// no code with the kernels' quantizer (common/kernels/cpu/quant_gemv.h). x must be finite.
std::vector<double> RoundToQ8K(std::span<const float> x);

// y = W x8 with x8 = RoundToQ8K(x), summed in double (the product the served GGUF engine
// computes for a block-quantized W, up to its F32 roundings). Same shapes as Linear.
void LinearQ8K(std::span<const float> w, int64_t out_dim, int64_t in_dim, std::span<const float> x,
               std::span<float> y);

// silu(z) = z / (1 + e^-z).
float Silu(float z);

// In-place softmax over `x` (max-subtracted). Entries equal to -infinity get probability 0; at
// least one entry must be finite.
void Softmax(std::span<float> x);

// Dense SwiGLU MLP (MODEL-SPEC §3.8): y = W_down (silu(W_gate x) * (W_up x)).
// gate/up are [inter, hidden], down is [hidden, inter]; x has `hidden`, y has `hidden` entries.
void SwiGluMlp(std::span<const float> gate, std::span<const float> up, std::span<const float> down,
               int64_t hidden, int64_t inter, std::span<const float> x, std::span<float> y);

// ---------------------------------------------------------------------------------- RoPE / YaRN

// YaRN correction range (MODEL-SPEC §3.4) for rotary dimension `rope_dim` (even), base
// `rope_theta`: low = max(floor(corr(beta_fast)), 0), high = min(ceil(corr(beta_slow)),
// rope_dim - 1), high += 0.001 when low == high.
struct YarnCorrectionRange {
  double low = 0;
  double high = 0;
};
YarnCorrectionRange YarnRange(int64_t rope_dim, double rope_theta, const YarnConfig& yarn);

// The rope_dim/2 inverse frequencies of the rotary pairs. Plain RoPE (base^(-2i/dim)) when
// config.rope_scaling.enabled is false, else YaRN's blend of extrapolated and interpolated
// frequencies (MODEL-SPEC §3.4). Computed in double, returned as float.
std::vector<float> YarnInvFreq(const ModelConfig& config);

// YaRN's cos/sin multiplier, Hugging Face's rule: rope_scaling.attention_factor when given; else
// g(f, mscale) / g(f, mscale_all_dim) when both are present and non-zero (1.0 for DeepSeek-V3 and
// Kimi-K2); else g(f, 1); with g(s, m) = 1 if s <= 1 else 0.1 m ln s + 1. 1.0 without YaRN.
double YarnAttentionFactor(const ModelConfig& config);

// MLA softmax scale: qk_head_dim^-0.5 * m^2 with m = 0.1 * mscale_all_dim * ln(factor) + 1 when
// YaRN is on, factor > 1 and mscale_all_dim != 0 (as Hugging Face does); else qk_head_dim^-0.5.
// DeepSeek-V3: 0.1352338. Computed independently of ModelConfig::softmax_scale() on purpose.
double MlaSoftmaxScale(const ModelConfig& config);

// Rotates `vec` (rope_dim values, interleaved pairs (x[2i], x[2i+1]) as stored in the checkpoint)
// in place by angle pos * inv_freq[i] and multiplies by `attention_factor`:
//   x'[2i] = (x[2i] cos - x[2i+1] sin) * af,  x'[2i+1] = (x[2i] sin + x[2i+1] cos) * af.
// vec.size() == 2 * inv_freq.size(). Angles are computed in double.
void ApplyRopeInterleaved(std::span<float> vec, int64_t pos, std::span<const float> inv_freq,
                          float attention_factor);

// ---------------------------------------------------------------------------------- MoE router

MoeGateParams MoeGateParamsFromConfig(const ModelConfig& config);

struct MoeGateResult {
  // The K selected experts in descending order of biased score (ties: lower id first).
  std::vector<int32_t> experts;
  // Their combine weights: unbiased sigmoid scores, normalized (if norm_topk_prob), times
  // routed_scaling_factor. Same order as `experts`.
  std::vector<float> weights;

  // How close the selection was (docs/conformance.md "Routing flips: the score-gap rule"). With
  // b = sigmoid(logit) + bias (the selection score) over the experts of the kept groups (all
  // experts when n_group == 1): kth_score = the K-th largest b, next_score = the (K+1)-th
  // (-inf when the kept groups hold only K experts). group_gap = group score of the
  // topk_group-th kept group minus that of the best dropped group (+inf when every group is
  // kept), group score = sum of the group's two largest b.
  float kth_score = 0.0f;
  float next_score = 0.0f;
  double group_gap = 0.0;
  // The selection gap: min(kth_score - next_score, group_gap / 2). A group score is a sum of
  // two selection scores, so a perturbation of at most d per score moves a group gap by at most
  // 4d and an expert gap by at most 2d: the selection can change only if gap < 2d.
  double SelectionGap() const;
  // True when `experts` were imposed (ReferenceModel's ForwardTrace::follow_routing) rather
  // than chosen; the fields above still describe the reference's own choice.
  bool followed = false;
};

// noaux_tc routing (MODEL-SPEC §3.9) from the router logits (W_router x, E values) and the
// e_score_correction_bias (E values, or empty for none). s = sigmoid(logits) gives the weights;
// b = s + bias is used only for selection: group score = sum of the two largest b of the group
// (the largest alone when a group has one expert), the topk_group best groups are kept (ties:
// lower group first), experts of the other groups are excluded (-inf), and the K largest
// remaining b are chosen. Requires topk_group * E / n_group >= K.
MoeGateResult MoeGate(std::span<const float> router_logits, std::span<const float> bias,
                      const MoeGateParams& params);

// The combine weights MoeGate gives `experts` (any K experts, e.g. another path's choice):
// sigmoid(logit) of each, normalized over them if norm_topk_prob, times routed_scaling_factor.
std::vector<float> MoeCombineWeights(std::span<const float> router_logits,
                                     std::span<const int32_t> experts, const MoeGateParams& params);

// ---------------------------------------------------------------------------------- MLA attention

MlaDimensions MlaDimsFromConfig(const ModelConfig& config);

// Attention of a block of `n` new query tokens at absolute positions start_pos .. start_pos+n-1
// against a latent KV cache that already holds all keys 0 .. start_pos+n-1 (the new tokens'
// entries included). Query i sees keys 0 .. start_pos+i (causal).
//   q_nope  [n, nh, dn]                     non-rotary query parts
//   q_pe    [n, nh, dr]                     rotary query parts, already rotated
//   latent  [>= start_pos+n, Rkv]           normalized latents c (cache rows)
//   k_pe    [>= start_pos+n, dr]            rotated rope keys (cache rows)
//   wkv_b   [nh * (dn + dv), Rkv]           per head: W_UK rows then W_UV rows
//   out     [n, nh * dv]                    per-head outputs, before o_proj
// Naive form (MODEL-SPEC §3.6): k_nope = W_UK c, v = W_UV c per key, then standard attention.
void MlaAttentionNaive(const MlaDimensions& dims, int64_t n, int64_t start_pos,
                       std::span<const float> q_nope, std::span<const float> q_pe,
                       std::span<const float> latent, std::span<const float> k_pe,
                       std::span<const float> wkv_b, std::span<float> out);
// Weight-absorbed form (MODEL-SPEC §3.7): q~ = W_UK^T q_nope scores against c directly,
// u = sum_s P c_s, o = W_UV u. Same contract and, up to rounding, same result as the naive form.
void MlaAttentionAbsorbed(const MlaDimensions& dims, int64_t n, int64_t start_pos,
                          std::span<const float> q_nope, std::span<const float> q_pe,
                          std::span<const float> latent, std::span<const float> k_pe,
                          std::span<const float> wkv_b, std::span<float> out);

}  // namespace hmoe::reference
