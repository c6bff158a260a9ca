#include "common/engine/reference/reference_ops.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <numbers>
#include <numeric>

#include "common/base/logging.h"

namespace hmoe::reference {
namespace {

double Dot(const float* a, const float* b, int64_t n) {
  double acc = 0.0;
  for (int64_t i = 0; i < n; ++i) acc += static_cast<double>(a[i]) * static_cast<double>(b[i]);
  return acc;
}

// g(s, m) of MODEL-SPEC §3.4.
double YarnMscale(double scale, double mscale) {
  if (scale <= 1.0) return 1.0;
  return 0.1 * mscale * std::log(scale) + 1.0;
}

// Dimension index at which a frequency completes `num_rotations` over the original context.
double YarnCorrectionDim(double num_rotations, int64_t rope_dim, double base,
                         double original_max_pos) {
  return static_cast<double>(rope_dim) *
         std::log(original_max_pos / (num_rotations * 2.0 * std::numbers::pi)) /
         (2.0 * std::log(base));
}

// Checks the MLA argument sizes shared by both forms.
void CheckMlaArgs(const MlaDimensions& d, int64_t n, int64_t start_pos,
                  std::span<const float> q_nope, std::span<const float> q_pe,
                  std::span<const float> latent, std::span<const float> k_pe,
                  std::span<const float> wkv_b, std::span<float> out) {
  const int64_t num_keys = start_pos + n;
  HMOE_CHECK(n >= 0 && start_pos >= 0);
  HMOE_CHECK(static_cast<int64_t>(q_nope.size()) == n * d.num_heads * d.nope_dim);
  HMOE_CHECK(static_cast<int64_t>(q_pe.size()) == n * d.num_heads * d.rope_dim);
  HMOE_CHECK(static_cast<int64_t>(latent.size()) >= num_keys * d.kv_lora_rank);
  HMOE_CHECK(static_cast<int64_t>(k_pe.size()) >= num_keys * d.rope_dim);
  HMOE_CHECK(static_cast<int64_t>(wkv_b.size()) ==
             d.num_heads * (d.nope_dim + d.v_dim) * d.kv_lora_rank);
  HMOE_CHECK(static_cast<int64_t>(out.size()) == n * d.num_heads * d.v_dim);
}

}  // namespace

void RmsNorm(std::span<const float> x, std::span<const float> weight, float eps,
             std::span<float> out) {
  HMOE_CHECK(x.size() == weight.size() && x.size() == out.size() && !x.empty());
  const double mean_sq =
      Dot(x.data(), x.data(), static_cast<int64_t>(x.size())) / static_cast<double>(x.size());
  const double inv_rms = 1.0 / std::sqrt(mean_sq + static_cast<double>(eps));
  for (size_t i = 0; i < x.size(); ++i) {
    out[i] = static_cast<float>(static_cast<double>(weight[i]) * (x[i] * inv_rms));
  }
}

void Linear(std::span<const float> w, int64_t out_dim, int64_t in_dim, std::span<const float> x,
            std::span<float> y) {
  HMOE_CHECK(static_cast<int64_t>(w.size()) == out_dim * in_dim)
      << "w.size()=" << w.size() << " out=" << out_dim << " in=" << in_dim;
  HMOE_CHECK(static_cast<int64_t>(x.size()) == in_dim);
  HMOE_CHECK(static_cast<int64_t>(y.size()) == out_dim);
  for (int64_t o = 0; o < out_dim; ++o) {
    y[o] = static_cast<float>(Dot(w.data() + o * in_dim, x.data(), in_dim));
  }
}

std::vector<double> RoundToQ8K(std::span<const float> x) {
  constexpr size_t kBlock = 256;
  std::vector<double> out(x.size(), 0.0);
  for (size_t begin = 0; begin < x.size(); begin += kBlock) {
    const size_t end = std::min(x.size(), begin + kBlock);
    float amax = 0.0f;
    for (size_t i = begin; i < end; ++i) {
      HMOE_CHECK(std::isfinite(x[i])) << "RoundToQ8K: value " << i << " is not finite";
      if (std::fabs(x[i]) > amax) amax = std::fabs(x[i]);
    }
    if (amax == 0.0f) continue;
    const float d = amax / 127.0f;
    const float inverse = 127.0f / amax;
    for (size_t i = begin; i < end; ++i) {
      const float scaled = x[i] * inverse;
      // Round half to even, by hand (no dependence on the FP rounding mode).
      double q = std::floor(static_cast<double>(scaled));
      const double frac = static_cast<double>(scaled) - q;
      if (frac > 0.5 || (frac == 0.5 && std::fmod(q, 2.0) != 0.0)) q += 1.0;
      q = std::clamp(q, -127.0, 127.0);
      out[i] = static_cast<double>(d) * q;  // exact: a float times an integer below 2^7
    }
  }
  return out;
}

void LinearQ8K(std::span<const float> w, int64_t out_dim, int64_t in_dim, std::span<const float> x,
               std::span<float> y) {
  HMOE_CHECK(static_cast<int64_t>(w.size()) == out_dim * in_dim)
      << "w.size()=" << w.size() << " out=" << out_dim << " in=" << in_dim;
  HMOE_CHECK(static_cast<int64_t>(x.size()) == in_dim);
  HMOE_CHECK(static_cast<int64_t>(y.size()) == out_dim);
  const std::vector<double> x8 = RoundToQ8K(x);
  for (int64_t o = 0; o < out_dim; ++o) {
    double sum = 0.0;
    for (int64_t i = 0; i < in_dim; ++i) sum += static_cast<double>(w[o * in_dim + i]) * x8[i];
    y[o] = static_cast<float>(sum);
  }
}

float Silu(float z) {
  return static_cast<float>(static_cast<double>(z) / (1.0 + std::exp(-static_cast<double>(z))));
}

void Softmax(std::span<float> x) {
  HMOE_CHECK(!x.empty());
  float max_value = -std::numeric_limits<float>::infinity();
  for (float v : x) max_value = std::max(max_value, v);
  HMOE_CHECK(std::isfinite(max_value)) << "softmax over no finite entry";
  double sum = 0.0;
  std::vector<double> e(x.size());
  for (size_t i = 0; i < x.size(); ++i) {
    e[i] = std::exp(static_cast<double>(x[i]) - static_cast<double>(max_value));
    sum += e[i];
  }
  for (size_t i = 0; i < x.size(); ++i) x[i] = static_cast<float>(e[i] / sum);
}

void SwiGluMlp(std::span<const float> gate, std::span<const float> up, std::span<const float> down,
               int64_t hidden, int64_t inter, std::span<const float> x, std::span<float> y) {
  std::vector<float> g(inter), u(inter);
  Linear(gate, inter, hidden, x, g);
  Linear(up, inter, hidden, x, u);
  for (int64_t i = 0; i < inter; ++i) g[i] = Silu(g[i]) * u[i];
  Linear(down, hidden, inter, g, y);
}

// ---------------------------------------------------------------------------------- RoPE / YaRN

YarnCorrectionRange YarnRange(int64_t rope_dim, double rope_theta, const YarnConfig& yarn) {
  const double l0 = static_cast<double>(yarn.original_max_position_embeddings);
  YarnCorrectionRange r;
  r.low = std::max(std::floor(YarnCorrectionDim(yarn.beta_fast, rope_dim, rope_theta, l0)), 0.0);
  r.high = std::min(std::ceil(YarnCorrectionDim(yarn.beta_slow, rope_dim, rope_theta, l0)),
                    static_cast<double>(rope_dim - 1));
  if (r.low == r.high) r.high += 0.001;  // Avoids a division by zero in the ramp.
  return r;
}

std::vector<float> YarnInvFreq(const ModelConfig& config) {
  const int64_t dim = config.qk_rope_head_dim;
  HMOE_CHECK(dim > 0 && dim % 2 == 0) << "qk_rope_head_dim=" << dim;
  const int64_t half = dim / 2;
  std::vector<float> inv_freq(half);
  const YarnConfig& yarn = config.rope_scaling;
  const YarnCorrectionRange range = YarnRange(dim, config.rope_theta, yarn);
  for (int64_t i = 0; i < half; ++i) {
    const double extra =
        std::pow(config.rope_theta, -2.0 * static_cast<double>(i) / static_cast<double>(dim));
    if (!yarn.enabled) {
      inv_freq[i] = static_cast<float>(extra);
      continue;
    }
    const double inter = extra / yarn.factor;
    const double ramp =
        std::clamp((static_cast<double>(i) - range.low) / (range.high - range.low), 0.0, 1.0);
    const double keep = 1.0 - ramp;  // 1: keep the original (extrapolated) frequency.
    inv_freq[i] = static_cast<float>(inter * (1.0 - keep) + extra * keep);
  }
  return inv_freq;
}

double YarnAttentionFactor(const ModelConfig& config) {
  const YarnConfig& yarn = config.rope_scaling;
  if (!yarn.enabled) return 1.0;
  if (yarn.attention_factor > 0.0) return yarn.attention_factor;  // given explicitly
  // Hugging Face uses the ratio only when both are present and non-zero; with one of them (or
  // neither) it is g(factor, 1), the paper's 0.1 ln s + 1, whatever the present one says.
  const bool both = yarn.mscale != 0.0 && yarn.mscale_all_dim != 0.0;
  if (!both) return YarnMscale(yarn.factor, 1.0);
  return YarnMscale(yarn.factor, yarn.mscale) / YarnMscale(yarn.factor, yarn.mscale_all_dim);
}

double MlaSoftmaxScale(const ModelConfig& config) {
  double scale = 1.0 / std::sqrt(static_cast<double>(config.qk_head_dim()));
  const YarnConfig& yarn = config.rope_scaling;
  if (yarn.enabled && yarn.mscale_all_dim != 0.0) {
    const double m = YarnMscale(yarn.factor, yarn.mscale_all_dim);
    scale *= m * m;
  }
  return scale;
}

void ApplyRopeInterleaved(std::span<float> vec, int64_t pos, std::span<const float> inv_freq,
                          float attention_factor) {
  HMOE_CHECK(vec.size() == 2 * inv_freq.size());
  for (size_t i = 0; i < inv_freq.size(); ++i) {
    const double angle = static_cast<double>(pos) * static_cast<double>(inv_freq[i]);
    const double c = std::cos(angle) * attention_factor;
    const double s = std::sin(angle) * attention_factor;
    const double x0 = vec[2 * i];
    const double x1 = vec[2 * i + 1];
    vec[2 * i] = static_cast<float>(x0 * c - x1 * s);
    vec[2 * i + 1] = static_cast<float>(x0 * s + x1 * c);
  }
}

// ---------------------------------------------------------------------------------- MoE router

MoeGateParams MoeGateParamsFromConfig(const ModelConfig& config) {
  MoeGateParams p;
  p.num_experts = config.n_routed_experts;
  p.top_k = config.num_experts_per_tok;
  p.n_group = config.n_group;
  p.topk_group = config.topk_group;
  p.norm_topk_prob = config.norm_topk_prob;
  p.routed_scaling_factor = config.routed_scaling_factor;
  return p;
}

MoeGateResult MoeGate(std::span<const float> router_logits, std::span<const float> bias,
                      const MoeGateParams& p) {
  const int64_t num_experts = p.num_experts;
  HMOE_CHECK(static_cast<int64_t>(router_logits.size()) == num_experts);
  HMOE_CHECK(bias.empty() || static_cast<int64_t>(bias.size()) == num_experts);
  HMOE_CHECK(p.n_group >= 1 && num_experts % p.n_group == 0);
  const int64_t group_size = num_experts / p.n_group;
  HMOE_CHECK(p.topk_group >= 1 && p.topk_group <= p.n_group);
  HMOE_CHECK(p.top_k >= 1 && p.top_k <= p.topk_group * group_size)
      << "top_k=" << p.top_k << " exceeds the experts of the kept groups";

  // Unbiased scores (weights) and biased scores (selection only).
  std::vector<float> scores(num_experts), biased(num_experts);
  for (int64_t e = 0; e < num_experts; ++e) {
    scores[e] = static_cast<float>(1.0 / (1.0 + std::exp(-static_cast<double>(router_logits[e]))));
    biased[e] = scores[e] + (bias.empty() ? 0.0f : bias[e]);
  }

  // Group scores: sum of the two largest biased scores of each group.
  std::vector<double> group_score(p.n_group);
  for (int64_t g = 0; g < p.n_group; ++g) {
    std::vector<float> members(biased.begin() + g * group_size,
                               biased.begin() + (g + 1) * group_size);
    std::sort(members.begin(), members.end(), std::greater<float>());
    group_score[g] = members[0] + (group_size >= 2 ? static_cast<double>(members[1]) : 0.0);
  }
  std::vector<int64_t> group_order(p.n_group);
  std::iota(group_order.begin(), group_order.end(), 0);
  std::stable_sort(group_order.begin(), group_order.end(),
                   [&](int64_t a, int64_t b) { return group_score[a] > group_score[b]; });

  // Experts of groups that were not kept are excluded from selection.
  std::vector<float> selectable(num_experts, -std::numeric_limits<float>::infinity());
  for (int64_t k = 0; k < p.topk_group; ++k) {
    const int64_t g = group_order[k];
    for (int64_t e = g * group_size; e < (g + 1) * group_size; ++e) selectable[e] = biased[e];
  }
  std::vector<int32_t> order(num_experts);
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(),
                   [&](int32_t a, int32_t b) { return selectable[a] > selectable[b]; });

  MoeGateResult result;
  result.experts.assign(order.begin(), order.begin() + p.top_k);
  result.weights = MoeCombineWeights(router_logits, result.experts, p);
  result.kth_score = selectable[order[p.top_k - 1]];
  result.next_score =
      p.top_k < num_experts ? selectable[order[p.top_k]] : -std::numeric_limits<float>::infinity();
  result.group_gap = p.topk_group < p.n_group ? group_score[group_order[p.topk_group - 1]] -
                                                    group_score[group_order[p.topk_group]]
                                              : std::numeric_limits<double>::infinity();
  return result;
}

double MoeGateResult::SelectionGap() const {
  const double expert_gap = static_cast<double>(kth_score) - static_cast<double>(next_score);
  return std::min(expert_gap, group_gap / 2.0);
}

std::vector<float> MoeCombineWeights(std::span<const float> router_logits,
                                     std::span<const int32_t> experts, const MoeGateParams& p) {
  std::vector<double> scores;
  double sum = 0.0;
  for (int32_t e : experts) {
    HMOE_CHECK(e >= 0 && e < p.num_experts);
    scores.push_back(1.0 / (1.0 + std::exp(-static_cast<double>(router_logits[e]))));
    // MoeGate's scores are floats: round the same way so both give identical weights.
    scores.back() = static_cast<float>(scores.back());
    sum += scores.back();
  }
  std::vector<float> weights;
  for (double w : scores) {
    // Hugging Face adds 1e-20 to the denominator; it only matters when all scores underflow.
    if (p.norm_topk_prob) w /= (sum + 1e-20);
    weights.push_back(static_cast<float>(w * p.routed_scaling_factor));
  }
  return weights;
}

// ---------------------------------------------------------------------------------- MLA attention

MlaDimensions MlaDimsFromConfig(const ModelConfig& config) {
  MlaDimensions d;
  d.num_heads = config.num_attention_heads;
  d.nope_dim = config.qk_nope_head_dim;
  d.rope_dim = config.qk_rope_head_dim;
  d.v_dim = config.v_head_dim;
  d.kv_lora_rank = config.kv_lora_rank;
  d.softmax_scale = static_cast<float>(MlaSoftmaxScale(config));
  return d;
}

void MlaAttentionNaive(const MlaDimensions& d, int64_t n, int64_t start_pos,
                       std::span<const float> q_nope, std::span<const float> q_pe,
                       std::span<const float> latent, std::span<const float> k_pe,
                       std::span<const float> wkv_b, std::span<float> out) {
  CheckMlaArgs(d, n, start_pos, q_nope, q_pe, latent, k_pe, wkv_b, out);
  const int64_t num_keys = start_pos + n;
  const int64_t rkv = d.kv_lora_rank;
  const int64_t head_rows = d.nope_dim + d.v_dim;

  // Decompress every cached latent into per-head keys and values: kv[s] = W_kvb c[s].
  std::vector<float> kv(num_keys * d.num_heads * head_rows);
  for (int64_t s = 0; s < num_keys; ++s) {
    Linear(wkv_b, d.num_heads * head_rows, rkv, latent.subspan(s * rkv, rkv),
           std::span<float>(kv).subspan(s * d.num_heads * head_rows, d.num_heads * head_rows));
  }

  for (int64_t t = 0; t < n; ++t) {
    const int64_t visible = start_pos + t + 1;  // Causal: keys 0 .. start_pos + t.
    for (int64_t h = 0; h < d.num_heads; ++h) {
      const float* qn = q_nope.data() + (t * d.num_heads + h) * d.nope_dim;
      const float* qr = q_pe.data() + (t * d.num_heads + h) * d.rope_dim;
      std::vector<float> p(visible);
      for (int64_t s = 0; s < visible; ++s) {
        const float* k_nope = kv.data() + (s * d.num_heads + h) * head_rows;
        const double score =
            Dot(qn, k_nope, d.nope_dim) + Dot(qr, k_pe.data() + s * d.rope_dim, d.rope_dim);
        p[s] = static_cast<float>(score * d.softmax_scale);
      }
      Softmax(p);
      float* o = out.data() + (t * d.num_heads + h) * d.v_dim;
      for (int64_t j = 0; j < d.v_dim; ++j) {
        double acc = 0.0;
        for (int64_t s = 0; s < visible; ++s) {
          const float* v = kv.data() + (s * d.num_heads + h) * head_rows + d.nope_dim;
          acc += static_cast<double>(p[s]) * v[j];
        }
        o[j] = static_cast<float>(acc);
      }
    }
  }
}

void MlaAttentionAbsorbed(const MlaDimensions& d, int64_t n, int64_t start_pos,
                          std::span<const float> q_nope, std::span<const float> q_pe,
                          std::span<const float> latent, std::span<const float> k_pe,
                          std::span<const float> wkv_b, std::span<float> out) {
  CheckMlaArgs(d, n, start_pos, q_nope, q_pe, latent, k_pe, wkv_b, out);
  const int64_t rkv = d.kv_lora_rank;
  const int64_t head_rows = d.nope_dim + d.v_dim;

  for (int64_t t = 0; t < n; ++t) {
    const int64_t visible = start_pos + t + 1;
    for (int64_t h = 0; h < d.num_heads; ++h) {
      const float* w_uk = wkv_b.data() + h * head_rows * rkv;                 // [dn, Rkv]
      const float* w_uv = wkv_b.data() + (h * head_rows + d.nope_dim) * rkv;  // [dv, Rkv]
      const float* qn = q_nope.data() + (t * d.num_heads + h) * d.nope_dim;
      const float* qr = q_pe.data() + (t * d.num_heads + h) * d.rope_dim;

      // q~ = W_UK^T q_nope: the query moved into latent space.
      std::vector<double> q_latent(rkv, 0.0);
      for (int64_t i = 0; i < d.nope_dim; ++i) {
        for (int64_t r = 0; r < rkv; ++r)
          q_latent[r] += static_cast<double>(qn[i]) * w_uk[i * rkv + r];
      }

      std::vector<float> p(visible);
      for (int64_t s = 0; s < visible; ++s) {
        const float* c = latent.data() + s * rkv;
        double score = 0.0;
        for (int64_t r = 0; r < rkv; ++r) score += q_latent[r] * c[r];
        score += Dot(qr, k_pe.data() + s * d.rope_dim, d.rope_dim);
        p[s] = static_cast<float>(score * d.softmax_scale);
      }
      Softmax(p);

      // u = sum_s P c_s, then o = W_UV u.
      std::vector<float> u(rkv);
      for (int64_t r = 0; r < rkv; ++r) {
        double acc = 0.0;
        for (int64_t s = 0; s < visible; ++s)
          acc += static_cast<double>(p[s]) * latent[s * rkv + r];
        u[r] = static_cast<float>(acc);
      }
      Linear(std::span<const float>(w_uv, d.v_dim * rkv), d.v_dim, rkv, u,
             out.subspan((t * d.num_heads + h) * d.v_dim, d.v_dim));
    }
  }
}

}  // namespace hmoe::reference
