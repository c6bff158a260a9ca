#include "common/engine/reference/reference_model.h"

#include <algorithm>
#include <cmath>
#include <string>
#include <utility>

#include "absl/strings/str_cat.h"

#include "common/base/logging.h"
#include "common/base/status_macros.h"
#include "common/model/tensor_map.h"

namespace hmoe::reference {
namespace {

// Hugging Face builds q_a_layernorm and kv_a_layernorm with the RMSNorm default eps (1e-6)
// whatever config.rms_norm_eps says (MODEL-SPEC §3.2).
constexpr float kLatentNormEps = 1e-6f;

absl::Status CheckSupported(const ModelConfig& c) {
  if (c.scoring_func != "sigmoid") {
    return absl::UnimplementedError(
        absl::StrCat("reference model: scoring_func \"", c.scoring_func, "\" (only sigmoid)"));
  }
  if (c.n_routed_experts > 0 && c.topk_method != "noaux_tc") {
    return absl::UnimplementedError(
        absl::StrCat("reference model: topk_method \"", c.topk_method, "\" (only noaux_tc)"));
  }
  if (c.hidden_act != "silu") {
    return absl::UnimplementedError(
        absl::StrCat("reference model: hidden_act \"", c.hidden_act, "\" (only silu)"));
  }
  const bool dims_ok = c.vocab_size > 0 && c.hidden_size > 0 && c.num_hidden_layers > 0 &&
                       c.num_attention_heads > 0 && c.kv_lora_rank > 0 && c.qk_nope_head_dim > 0 &&
                       c.qk_rope_head_dim > 0 && c.qk_rope_head_dim % 2 == 0 && c.v_head_dim > 0 &&
                       (!c.q_lora_rank.has_value() || *c.q_lora_rank > 0) &&
                       c.max_position_embeddings > 0 && c.moe_layer_freq > 0;
  if (!dims_ok) {
    return absl::InvalidArgumentError(
        "reference model: config has a non-positive dimension or an odd qk_rope_head_dim");
  }
  if (c.n_routed_experts > 0) {
    const bool moe_ok = c.moe_intermediate_size > 0 && c.num_experts_per_tok > 0 && c.n_group > 0 &&
                        c.n_routed_experts % c.n_group == 0 && c.topk_group > 0 &&
                        c.topk_group <= c.n_group &&
                        c.num_experts_per_tok <= c.topk_group * (c.n_routed_experts / c.n_group);
    if (!moe_ok) {
      return absl::InvalidArgumentError(absl::StrCat(
          "reference model: inconsistent MoE config (experts ", c.n_routed_experts, ", n_group ",
          c.n_group, ", topk_group ", c.topk_group, ", top-k ", c.num_experts_per_tok, ")"));
    }
  }
  return absl::OkStatus();
}

// The error model's rounding points per residual branch (docs/conformance.md "The error model
// and the tolerances"): the longest chain of rounded projection inputs from the branch input to
// its output. Attention: q_a, q_b, o (kv_a's input is q_a's; kv_b and the absorbed W_UK/W_UV are
// F32). MLP: gate/up, down.
constexpr double kAttentionRoundings = 3.0;
constexpr double kMlpRoundings = 2.0;

double Norm2(std::span<const float> v) {
  double s = 0.0;
  for (float x : v) s += static_cast<double>(x) * x;
  return std::sqrt(s);
}

double Sq(double x) { return x * x; }

double Rms(std::span<const float> v) {
  return v.empty() ? 0.0 : Norm2(v) / std::sqrt(static_cast<double>(v.size()));
}

// First-order size of RMSNorm(h + d) - RMSNorm(h) for an error d of 2-norm `error` in a random
// direction: the normalization's Jacobian is diag(weight) (I - h h^T / |h|^2) / rms(h), which
// scales such a d by at most rms(weight) / rms(h).
double NormOutputError(std::span<const float> h, double rms_weight, double error) {
  const double rms = Rms(h);
  return rms > 0.0 ? rms_weight * error / rms : 0.0;
}

}  // namespace

// ---------------------------------------------------------------------------------- KV cache

ReferenceKvCache::ReferenceKvCache(const ModelConfig& config)
    : kv_lora_rank_(config.kv_lora_rank),
      rope_dim_(config.qk_rope_head_dim),
      latent_(config.num_hidden_layers),
      k_pe_(config.num_hidden_layers),
      attention_input_error_(config.num_hidden_layers, 0.0) {}

void ReferenceKvCache::Clear() {
  num_tokens_ = 0;
  for (auto& v : latent_) v.clear();
  for (auto& v : k_pe_) v.clear();
  std::fill(attention_input_error_.begin(), attention_input_error_.end(), 0.0);
}

// ---------------------------------------------------------------------------------- loading

ReferenceModel::ReferenceModel(const ModelConfig& config, Options options)
    : config_(config), options_(options) {}

absl::StatusOr<std::unique_ptr<ReferenceModel>> ReferenceModel::Create(const ModelConfig& config,
                                                                       const WeightSource& weights,
                                                                       Options options) {
  HMOE_RETURN_IF_ERROR(CheckSupported(config));
  std::unique_ptr<ReferenceModel> model(new ReferenceModel(config, options));
  model->inv_freq_ = YarnInvFreq(config);
  model->attention_factor_ = static_cast<float>(YarnAttentionFactor(config));
  model->mla_dims_ = MlaDimsFromConfig(config);
  model->gate_params_ = MoeGateParamsFromConfig(config);
  HMOE_RETURN_IF_ERROR(model->Load(weights));
  return model;
}

absl::StatusOr<ReferenceModel::Matrix> ReferenceModel::LoadMatrix(const WeightSource& weights,
                                                                  const std::string& name,
                                                                  int64_t rows,
                                                                  int64_t cols) const {
  HMOE_ASSIGN_OR_RETURN(Weight w, weights.GetWeight(name));
  const std::vector<int64_t>& shape = w.tensor.shape;
  if (shape.size() != 2 || shape[0] != rows || shape[1] != cols) {
    std::string got;
    for (int64_t d : shape) absl::StrAppend(&got, got.empty() ? "" : ",", d);
    return absl::InvalidArgumentError(
        absl::StrCat("tensor ", name, ": expected shape [", rows, ",", cols, "], got [", got, "]"));
  }
  Matrix m;
  m.rows = rows;
  m.cols = cols;
  m.q8k_input = options_.q8k_activation_tensors.count(name) > 0;
  HMOE_ASSIGN_OR_RETURN(m.data, DequantizeToFloat(w));
  if (static_cast<int64_t>(m.data.size()) != rows * cols) {
    return absl::InternalError(absl::StrCat("tensor ", name, ": dequantized to ", m.data.size(),
                                            " values, expected ", rows * cols));
  }
  return m;
}

absl::StatusOr<ReferenceModel::Matrix> ReferenceModel::LoadVector(const WeightSource& weights,
                                                                  const std::string& name,
                                                                  int64_t size) const {
  HMOE_ASSIGN_OR_RETURN(Weight w, weights.GetWeight(name));
  if (w.tensor.shape.size() != 1 || w.tensor.shape[0] != size) {
    std::string got;
    for (int64_t d : w.tensor.shape) absl::StrAppend(&got, got.empty() ? "" : ",", d);
    return absl::InvalidArgumentError(
        absl::StrCat("tensor ", name, ": expected shape [", size, "], got [", got, "]"));
  }
  Matrix m;
  m.rows = 1;
  m.cols = size;
  HMOE_ASSIGN_OR_RETURN(m.data, DequantizeToFloat(w));
  if (static_cast<int64_t>(m.data.size()) != size) {
    return absl::InternalError(absl::StrCat("tensor ", name, ": dequantized to ", m.data.size(),
                                            " values, expected ", size));
  }
  return m;
}

absl::StatusOr<ReferenceModel::Mlp> ReferenceModel::LoadMlp(const WeightSource& weights,
                                                            const std::string& gate_name,
                                                            const std::string& up_name,
                                                            const std::string& down_name,
                                                            int64_t inter) const {
  const int64_t hidden = config_.hidden_size;
  Mlp mlp;
  HMOE_ASSIGN_OR_RETURN(mlp.gate, LoadMatrix(weights, gate_name, inter, hidden));
  HMOE_ASSIGN_OR_RETURN(mlp.up, LoadMatrix(weights, up_name, inter, hidden));
  HMOE_ASSIGN_OR_RETURN(mlp.down, LoadMatrix(weights, down_name, hidden, inter));
  return mlp;
}

absl::Status ReferenceModel::Load(const WeightSource& weights) {
  const ModelConfig& c = config_;
  const int64_t hidden = c.hidden_size;
  const int64_t nh = c.num_attention_heads;
  HMOE_ASSIGN_OR_RETURN(embed_,
                        LoadMatrix(weights, std::string(kEmbedTokensName), c.vocab_size, hidden));
  HMOE_ASSIGN_OR_RETURN(final_norm_, LoadVector(weights, std::string(kFinalNormName), hidden));
  if (c.tie_word_embeddings) {
    lm_head_ = embed_;
  } else {
    HMOE_ASSIGN_OR_RETURN(lm_head_,
                          LoadMatrix(weights, std::string(kLmHeadName), c.vocab_size, hidden));
  }

  layers_.resize(c.num_hidden_layers);
  for (int64_t l = 0; l < c.num_hidden_layers; ++l) {
    Layer& layer = layers_[l];
    namespace lt = layer_tensor;
    auto name = [l](std::string_view suffix) { return LayerTensorName(l, suffix); };
    HMOE_ASSIGN_OR_RETURN(layer.input_norm, LoadVector(weights, name(lt::kInputLayernorm), hidden));
    HMOE_ASSIGN_OR_RETURN(layer.post_norm,
                          LoadVector(weights, name(lt::kPostAttentionLayernorm), hidden));
    if (c.q_lora_rank.has_value()) {
      const int64_t rq = *c.q_lora_rank;
      HMOE_ASSIGN_OR_RETURN(layer.q_a, LoadMatrix(weights, name(lt::kQAProj), rq, hidden));
      HMOE_ASSIGN_OR_RETURN(layer.q_a_norm, LoadVector(weights, name(lt::kQALayernorm), rq));
      HMOE_ASSIGN_OR_RETURN(layer.q_b,
                            LoadMatrix(weights, name(lt::kQBProj), nh * c.qk_head_dim(), rq));
    } else {
      HMOE_ASSIGN_OR_RETURN(layer.q,
                            LoadMatrix(weights, name(lt::kQProj), nh * c.qk_head_dim(), hidden));
    }
    HMOE_ASSIGN_OR_RETURN(layer.kv_a, LoadMatrix(weights, name(lt::kKvAProjWithMqa),
                                                 c.kv_lora_rank + c.qk_rope_head_dim, hidden));
    HMOE_ASSIGN_OR_RETURN(layer.kv_a_norm,
                          LoadVector(weights, name(lt::kKvALayernorm), c.kv_lora_rank));
    HMOE_ASSIGN_OR_RETURN(layer.kv_b,
                          LoadMatrix(weights, name(lt::kKvBProj),
                                     nh * (c.qk_nope_head_dim + c.v_head_dim), c.kv_lora_rank));
    HMOE_ASSIGN_OR_RETURN(layer.o,
                          LoadMatrix(weights, name(lt::kOProj), hidden, nh * c.v_head_dim));

    layer.is_moe = c.is_moe_layer(l);
    if (!layer.is_moe) {
      HMOE_ASSIGN_OR_RETURN(layer.dense,
                            LoadMlp(weights, name(lt::kMlpGateProj), name(lt::kMlpUpProj),
                                    name(lt::kMlpDownProj), c.intermediate_size));
      continue;
    }
    const int64_t num_experts = c.n_routed_experts;
    HMOE_ASSIGN_OR_RETURN(layer.router,
                          LoadMatrix(weights, name(lt::kRouterWeight), num_experts, hidden));
    HMOE_ASSIGN_OR_RETURN(layer.router_bias,
                          LoadVector(weights, name(lt::kRouterBias), num_experts));
    layer.experts.resize(num_experts);
    for (int64_t e = 0; e < num_experts; ++e) {
      HMOE_ASSIGN_OR_RETURN(
          layer.experts[e],
          LoadMlp(weights, ExpertTensorName(l, e, kGateProj), ExpertTensorName(l, e, kUpProj),
                  ExpertTensorName(l, e, kDownProj), c.moe_intermediate_size));
    }
    layer.has_shared = c.n_shared_experts > 0;
    if (layer.has_shared) {
      HMOE_ASSIGN_OR_RETURN(layer.shared, LoadMlp(weights, SharedExpertTensorName(l, kGateProj),
                                                  SharedExpertTensorName(l, kUpProj),
                                                  SharedExpertTensorName(l, kDownProj),
                                                  c.moe_intermediate_size * c.n_shared_experts));
    }
  }
  return absl::OkStatus();
}

// ---------------------------------------------------------------------------------- forward

void ReferenceModel::Apply(const Matrix& w, std::span<const float> x, std::span<float> y) {
  if (w.q8k_input) {
    LinearQ8K(w.data, w.rows, w.cols, x, y);
  } else {
    Linear(w.data, w.rows, w.cols, x, y);
  }
}

void ReferenceModel::RunMlp(const Mlp& mlp, int64_t hidden, int64_t inter, std::span<const float> x,
                            std::span<float> y) {
  if (!mlp.gate.q8k_input && !mlp.up.q8k_input && !mlp.down.q8k_input) {
    SwiGluMlp(mlp.gate.data, mlp.up.data, mlp.down.data, hidden, inter, x, y);
    return;
  }
  std::vector<float> g(inter), u(inter);
  Apply(mlp.gate, x, g);
  Apply(mlp.up, x, u);
  for (int64_t i = 0; i < inter; ++i) g[i] = Silu(g[i]) * u[i];
  Apply(mlp.down, g, y);
}

void ReferenceModel::Attention(int64_t layer_index, std::span<const float> x, int64_t n,
                               int64_t start_pos, ReferenceKvCache& cache,
                               std::span<float> out) const {
  const Layer& layer = layers_[layer_index];
  const ModelConfig& c = config_;
  const int64_t hidden = c.hidden_size;
  const int64_t nh = c.num_attention_heads;
  const int64_t dn = c.qk_nope_head_dim;
  const int64_t dr = c.qk_rope_head_dim;
  const int64_t dq = c.qk_head_dim();
  const int64_t rkv = c.kv_lora_rank;

  std::vector<float> q_nope(n * nh * dn), q_pe(n * nh * dr);
  std::vector<float>& latent = cache.latent_[layer_index];
  std::vector<float>& k_pe = cache.k_pe_[layer_index];
  HMOE_CHECK(static_cast<int64_t>(latent.size()) == start_pos * rkv);
  HMOE_CHECK(static_cast<int64_t>(k_pe.size()) == start_pos * dr);

  for (int64_t t = 0; t < n; ++t) {
    const int64_t pos = start_pos + t;
    std::span<const float> xt = x.subspan(t * hidden, hidden);

    // Queries: q = W_qb RMSNorm(W_qa x), or q = W_q x without a q LoRA; [nh, dn + dr].
    std::vector<float> q(nh * dq);
    if (c.q_lora_rank.has_value()) {
      const int64_t rq = *c.q_lora_rank;
      std::vector<float> cq(rq);
      Apply(layer.q_a, xt, cq);
      RmsNorm(cq, layer.q_a_norm.data, kLatentNormEps, cq);
      Apply(layer.q_b, cq, q);
    } else {
      Apply(layer.q, xt, q);
    }
    for (int64_t h = 0; h < nh; ++h) {
      std::copy_n(q.begin() + h * dq, dn, q_nope.begin() + (t * nh + h) * dn);
      std::span<float> rope(q_pe.data() + (t * nh + h) * dr, dr);
      std::copy_n(q.begin() + h * dq + dn, dr, rope.begin());
      ApplyRopeInterleaved(rope, pos, inv_freq_, attention_factor_);
    }

    // Keys: the normalized latent c and the single rotated rope key, appended to the cache.
    std::vector<float> kva(rkv + dr);
    Apply(layer.kv_a, xt, kva);
    std::span<float> c_kv(kva.data(), rkv);
    RmsNorm(c_kv, layer.kv_a_norm.data, kLatentNormEps, c_kv);
    std::span<float> rope_key(kva.data() + rkv, dr);
    ApplyRopeInterleaved(rope_key, pos, inv_freq_, attention_factor_);
    latent.insert(latent.end(), c_kv.begin(), c_kv.end());
    k_pe.insert(k_pe.end(), rope_key.begin(), rope_key.end());
  }

  std::vector<float> heads(n * nh * c.v_head_dim);
  if (options_.mla_form == MlaForm::kNaive) {
    MlaAttentionNaive(mla_dims_, n, start_pos, q_nope, q_pe, latent, k_pe, layer.kv_b.data, heads);
  } else {
    MlaAttentionAbsorbed(mla_dims_, n, start_pos, q_nope, q_pe, latent, k_pe, layer.kv_b.data,
                         heads);
  }
  const int64_t head_width = nh * c.v_head_dim;
  for (int64_t t = 0; t < n; ++t) {
    Apply(layer.o, std::span<const float>(heads).subspan(t * head_width, head_width),
          out.subspan(t * hidden, hidden));
  }
}

void ReferenceModel::FeedForward(int64_t layer_index, std::span<const float> x,
                                 std::span<float> out, MoeGateResult* routing,
                                 const std::vector<int32_t>* follow, const ErrorModel* model,
                                 double input_error, double* gap_tolerance) const {
  const Layer& layer = layers_[layer_index];
  const int64_t hidden = config_.hidden_size;
  if (!layer.is_moe) {
    RunMlp(layer.dense, hidden, config_.intermediate_size, x, out);
    return;
  }
  std::vector<float> router_logits(config_.n_routed_experts);
  Linear(layer.router.data, config_.n_routed_experts, hidden, x, router_logits);
  MoeGateResult gate = MoeGate(router_logits, layer.router_bias.data, gate_params_);
  if (gap_tolerance != nullptr) {
    // |d(b_a - b_b)| <= max sigmoid' * |(w_a - w_b) . dx| <= max sigmoid' * kappa * 2 max|w_e|
    // * |dx| / sqrt(hidden) (docs/conformance.md "Routing flips: the score-gap rule").
    double w_max = 0.0, slope_max = 0.0;
    for (int64_t e = 0; e < config_.n_routed_experts; ++e) {
      w_max = std::max(
          w_max, Norm2(std::span<const float>(layer.router.data).subspan(e * hidden, hidden)));
      const double s = 1.0 / (1.0 + std::exp(-static_cast<double>(router_logits[e])));
      slope_max = std::max(slope_max, s * (1.0 - s));
    }
    *gap_tolerance = model->kappa * slope_max * 2.0 * w_max * input_error /
                     std::sqrt(static_cast<double>(hidden));
  }
  if (follow != nullptr) {
    std::vector<int32_t> want = *follow, have = gate.experts;
    std::sort(want.begin(), want.end());
    std::sort(have.begin(), have.end());
    if (want != have) {
      HMOE_CHECK(static_cast<int64_t>(follow->size()) == gate_params_.top_k);
      gate.experts = *follow;
      gate.weights = MoeCombineWeights(router_logits, gate.experts, gate_params_);
      gate.followed = true;
    }
  }

  // Accumulate the weighted expert outputs and the shared expert in double.
  std::vector<double> acc(hidden, 0.0);
  std::vector<float> y(hidden);
  for (size_t k = 0; k < gate.experts.size(); ++k) {
    const Mlp& expert = layer.experts[gate.experts[k]];
    RunMlp(expert, hidden, config_.moe_intermediate_size, x, y);
    for (int64_t i = 0; i < hidden; ++i) acc[i] += static_cast<double>(gate.weights[k]) * y[i];
  }
  if (layer.has_shared) {
    RunMlp(layer.shared, hidden, config_.moe_intermediate_size * config_.n_shared_experts, x, y);
    for (int64_t i = 0; i < hidden; ++i) acc[i] += y[i];
  }
  for (int64_t i = 0; i < hidden; ++i) out[i] = static_cast<float>(acc[i]);
  if (routing != nullptr) *routing = std::move(gate);
}

absl::StatusOr<std::vector<float>> ReferenceModel::Forward(std::span<const int32_t> tokens,
                                                           ReferenceKvCache& cache,
                                                           ForwardTrace* trace) const {
  const ModelConfig& c = config_;
  const int64_t n = static_cast<int64_t>(tokens.size());
  const int64_t start = cache.size();
  if (n == 0) return absl::InvalidArgumentError("forward: no tokens");
  for (int64_t t = 0; t < n; ++t) {
    if (tokens[t] < 0 || tokens[t] >= c.vocab_size) {
      return absl::InvalidArgumentError(absl::StrCat("forward: token ", t, " has id ", tokens[t],
                                                     ", outside [0, ", c.vocab_size, ")"));
    }
  }
  if (start + n > c.max_position_embeddings) {
    return absl::InvalidArgumentError(
        absl::StrCat("forward: positions ", start, "..", start + n - 1,
                     " exceed max_position_embeddings ", c.max_position_embeddings));
  }
  if (cache.num_layers() != c.num_hidden_layers || cache.kv_lora_rank() != c.kv_lora_rank ||
      cache.rope_dim() != c.qk_rope_head_dim) {
    return absl::InvalidArgumentError("forward: the KV cache was made for another model shape");
  }

  const int64_t hidden = c.hidden_size;
  const float eps = static_cast<float>(c.rms_norm_eps);
  std::vector<float> h(n * hidden);
  for (int64_t t = 0; t < n; ++t) {
    std::copy_n(embed_.data.begin() + static_cast<int64_t>(tokens[t]) * hidden, hidden,
                h.begin() + t * hidden);
  }
  // The error model (traced runs only): err[t] is the RMS size (2-norm) of the engine's error in
  // token t's residual stream; docs/conformance.md "The error model and the tolerances".
  // Per rounding, the relative error is uniform in [-u, u]: variance u^2 / 3 per value.
  const double u2 = trace != nullptr ? Sq(trace->error_model.unit_roundoff) / 3.0 : 0.0;
  std::vector<double> err(n, 0.0);
  auto row = [&](std::vector<float>& v, int64_t t) {
    return std::span<float>(v).subspan(t * hidden, hidden);
  };
  if (trace != nullptr) {
    trace->hidden.assign(1, h);
    trace->routing.assign(c.num_hidden_layers, {});
    trace->gap_tolerance.assign(c.num_hidden_layers, {});
    trace->residual_error.assign(c.num_hidden_layers, std::vector<double>(n, 0.0));
    trace->final_input_error.assign(n, 0.0);
  }

  std::vector<float> normed(n * hidden), delta(n * hidden);
  for (int64_t l = 0; l < c.num_hidden_layers; ++l) {
    const Layer& layer = layers_[l];
    // h = h + MLA(RMSNorm_in(h)).
    for (int64_t t = 0; t < n; ++t) {
      RmsNorm(row(h, t), layer.input_norm.data, eps, row(normed, t));
    }
    if (trace != nullptr) {
      // Attention mixes every visible token: take the largest relative input error among them.
      double& in_err = cache.attention_input_error_[l];
      const double g = Rms(layer.input_norm.data);
      for (int64_t t = 0; t < n; ++t) {
        const double x_norm = Norm2(row(normed, t));
        if (x_norm > 0.0) in_err = std::max(in_err, NormOutputError(row(h, t), g, err[t]) / x_norm);
      }
    }
    Attention(l, normed, n, start, cache, delta);
    for (int64_t i = 0; i < n * hidden; ++i) h[i] += delta[i];
    if (trace != nullptr) {
      const double rel = std::sqrt(Sq(cache.attention_input_error_[l]) + kAttentionRoundings * u2);
      for (int64_t t = 0; t < n; ++t) err[t] = std::hypot(err[t], rel * Norm2(row(delta, t)));
    }

    // h = h + FFN(RMSNorm_post(h)).
    if (trace != nullptr && layer.is_moe) {
      trace->routing[l].resize(n);
      trace->gap_tolerance[l].assign(n, 0.0);
    }
    const double g_post = trace != nullptr ? Rms(layer.post_norm.data) : 0.0;
    for (int64_t t = 0; t < n; ++t) {
      std::span<float> nt = row(normed, t);
      RmsNorm(row(h, t), layer.post_norm.data, eps, nt);
      const bool traced_moe = trace != nullptr && layer.is_moe;
      MoeGateResult* routing = traced_moe ? &trace->routing[l][t] : nullptr;
      const std::vector<int32_t>* follow =
          traced_moe && trace->follow_routing ? trace->follow_routing(l, start + t) : nullptr;
      const double in_err = trace != nullptr ? NormOutputError(row(h, t), g_post, err[t]) : 0.0;
      FeedForward(l, nt, row(delta, t), routing, follow,
                  trace != nullptr ? &trace->error_model : nullptr, in_err,
                  traced_moe ? &trace->gap_tolerance[l][t] : nullptr);
      if (trace != nullptr) {
        const double x_norm = Norm2(nt);
        const double rel = std::sqrt(Sq(x_norm > 0.0 ? in_err / x_norm : 0.0) + kMlpRoundings * u2);
        err[t] = std::hypot(err[t], rel * Norm2(row(delta, t)));
      }
    }
    for (int64_t i = 0; i < n * hidden; ++i) h[i] += delta[i];
    if (trace != nullptr) {
      trace->hidden.push_back(h);
      for (int64_t t = 0; t < n; ++t) {
        const double h_norm = Norm2(row(h, t));
        trace->residual_error[l][t] = h_norm > 0.0 ? err[t] / h_norm : 0.0;
      }
    }
  }
  cache.num_tokens_ = start + n;

  // logits = lm_head RMSNorm_final(h), for every position.
  std::vector<float> logits(n * c.vocab_size);
  const double g_final = trace != nullptr ? Rms(final_norm_.data) : 0.0;
  for (int64_t t = 0; t < n; ++t) {
    std::span<float> nt = row(normed, t);
    RmsNorm(row(h, t), final_norm_.data, eps, nt);
    Apply(lm_head_, nt, std::span<float>(logits).subspan(t * c.vocab_size, c.vocab_size));
    if (trace != nullptr) {
      // The lm_head's own input rounding adds u |x|.
      trace->final_input_error[t] =
          std::hypot(NormOutputError(row(h, t), g_final, err[t]), std::sqrt(u2) * Norm2(nt));
    }
  }
  return logits;
}

double ReferenceModel::LogitPairTolerance(const ForwardTrace& trace, int64_t t, int32_t a,
                                          int32_t b) const {
  const int64_t hidden = config_.hidden_size;
  HMOE_CHECK(t >= 0 && t < static_cast<int64_t>(trace.final_input_error.size()));
  HMOE_CHECK(a >= 0 && a < config_.vocab_size && b >= 0 && b < config_.vocab_size);
  const float* wa = lm_head_.data.data() + static_cast<int64_t>(a) * hidden;
  const float* wb = lm_head_.data.data() + static_cast<int64_t>(b) * hidden;
  double d2 = 0.0;
  for (int64_t i = 0; i < hidden; ++i) {
    const double d = static_cast<double>(wa[i]) - wb[i];
    d2 += d * d;
  }
  return trace.error_model.kappa * std::sqrt(d2) * trace.final_input_error[t] /
         std::sqrt(static_cast<double>(hidden));
}

// ---------------------------------------------------------------------------------- generation

absl::StatusOr<std::vector<int32_t>> GenerateGreedy(const ReferenceModel& model,
                                                    std::span<const int32_t> prompt,
                                                    int max_new_tokens,
                                                    std::vector<std::vector<float>>* step_logits) {
  if (prompt.empty()) return absl::InvalidArgumentError("generate: empty prompt");
  if (max_new_tokens < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("generate: max_new_tokens ", max_new_tokens, " is negative"));
  }
  // The last generated token is never fed back, so the positions used are
  // 0 .. prompt.size() + max_new_tokens - 2; fail before any work when they do not fit.
  const int64_t last_position = static_cast<int64_t>(prompt.size()) + max_new_tokens - 2;
  if (max_new_tokens > 0 && last_position >= model.config().max_position_embeddings) {
    return absl::InvalidArgumentError(absl::StrCat(
        "generate: ", prompt.size(), " prompt tokens + ", max_new_tokens,
        " new tokens exceed max_position_embeddings ", model.config().max_position_embeddings));
  }
  if (step_logits != nullptr) step_logits->clear();
  const int64_t vocab = model.config().vocab_size;
  ReferenceKvCache cache = model.NewCache();
  std::vector<int32_t> generated;
  std::span<const int32_t> input = prompt;
  int32_t next = 0;
  for (int step = 0; step < max_new_tokens; ++step) {
    HMOE_ASSIGN_OR_RETURN(std::vector<float> logits, model.Forward(input, cache));
    std::span<const float> last =
        std::span<const float>(logits).subspan((input.size() - 1) * vocab, vocab);
    int64_t best = 0;
    for (int64_t i = 0; i < vocab; ++i) {
      if (!std::isfinite(last[i])) {
        return absl::InternalError(
            absl::StrCat("generate: logit ", i, " at step ", step, " is not finite"));
      }
      if (last[i] > last[best]) best = i;
    }
    next = static_cast<int32_t>(best);
    generated.push_back(next);
    if (step_logits != nullptr) step_logits->emplace_back(last.begin(), last.end());
    input = std::span<const int32_t>(&next, 1);
  }
  return generated;
}

}  // namespace hmoe::reference
