#pragma once

// The plain FP32 forward pass of a DeepSeek-V3-family model (MODEL-SPEC.md §3): embedding, MLA
// attention (naive or weight-absorbed), dense SwiGLU or noaux_tc MoE with shared experts, final
// norm and lm_head. It dequantizes every weight to float once at load, so it is meant for tiny
// and small test models only. It is the oracle every optimized path is compared with: it favours
// obvious correctness over speed (see reference_ops.h).

#include <cstdint>
#include <functional>
#include <memory>
#include <set>
#include <span>
#include <string>
#include <vector>

#include "absl/status/statusor.h"

#include "common/engine/reference/reference_ops.h"
#include "common/model/model_config.h"
#include "common/model/tensor.h"

namespace hmoe::reference {

// Which of the two mathematically equivalent MLA forms Forward() uses.
enum class MlaForm {
  kNaive,     // decompress k_nope and v from every cached latent (MODEL-SPEC §3.6)
  kAbsorbed,  // absorb W_UK into the query and W_UV into the output (MODEL-SPEC §3.7)
};

struct ReferenceModelOptions {
  MlaForm mla_form = MlaForm::kAbsorbed;
  // Weights (by name) whose products take their activation rounded to Q8_K (LinearQ8K): the
  // block-quantized weights of a GGUF model, as the served engine computes them by default
  // (docs/gguf.md, "Numerics"). Applies to the projections and MLPs (q_a, q_b, q, kv_a, o,
  // gate/up/down of dense, routed and shared experts, lm_head; a tied lm_head follows the
  // embedding's entry), never to the router or kv_b (the engine reads those in F32).
  std::set<std::string> q8k_activation_tensors;
};

// The per-layer latent KV cache of one sequence: for every cached token and layer, the normalized
// latent c (kv_lora_rank floats) and the rotated rope key k_pe (qk_rope_head_dim floats). Both
// MLA forms use the same cache. Not thread-safe; one sequence per cache.
class ReferenceKvCache {
 public:
  explicit ReferenceKvCache(const ModelConfig& config);

  // Number of cached tokens, i.e. the position of the next token.
  int64_t size() const { return num_tokens_; }
  int64_t num_layers() const { return static_cast<int64_t>(latent_.size()); }
  int64_t kv_lora_rank() const { return kv_lora_rank_; }
  int64_t rope_dim() const { return rope_dim_; }
  // Row-major [size(), kv_lora_rank] latents and [size(), rope_dim] rotated keys of `layer`.
  std::span<const float> latent(int64_t layer) const { return latent_[layer]; }
  std::span<const float> k_pe(int64_t layer) const { return k_pe_[layer]; }
  // Forgets every token.
  void Clear();

 private:
  friend class ReferenceModel;

  int64_t kv_lora_rank_;
  int64_t rope_dim_;
  int64_t num_tokens_ = 0;
  std::vector<std::vector<float>> latent_;  // per layer
  std::vector<std::vector<float>> k_pe_;    // per layer
  // Per layer: the largest relative error bound of the attention input over the cached tokens
  // (the error model of ForwardTrace; a traced Forward reads and updates it).
  std::vector<double> attention_input_error_;
};

// The optimized engine's error model (docs/conformance.md "The error model and the
// tolerances"): it computes what the reference computes on the same weights, except that the
// activation entering every FP8/BF16 projection (or, for a GGUF, every block-quantized one) is
// rounded: componentwise relative error uniform in [-unit_roundoff, unit_roundoff], independent
// roundings adding in quadrature. Everything else (norms, RoPE, softmax, the router, kv_b) is
// F32 and counts as exact at this scale.
struct ErrorModel {
  // BF16 round-to-nearest: 2^-8. A GGUF served with Q8_K activations: kQ8KUnitRoundoff.
  double unit_roundoff = 1.0 / 256.0;
  // A rounding error's projection onto a fixed direction w is bounded by kappa standard
  // deviations of a random-direction projection: |w . e| <= kappa |w| |e| / sqrt(dim).
  double kappa = 6.0;

  // Q8_K (docs/gguf.md "Numerics of a served GGUF"): both sides round to Q8_K, so they differ
  // where an F32 summation-order difference moves a value across a quantum boundary; through the
  // layers that difference grows to the size of the rounding itself, half a quantum amax/254 per
  // value, i.e. relative to the values' RMS amax/(254 RMS) <= 4/254 (amax <= 4 RMS, the Gaussian-
  // like activations' largest of 256).
  static constexpr double kQ8KUnitRoundoff = 4.0 / 254.0;
};

// Optional per-layer intermediates of one Forward() call, for tests and activation statistics.
struct ForwardTrace {
  // Input: the error model of gap_tolerance / final_input_error.
  ErrorModel error_model;
  // Input: when set, the MoE layers take follow_routing(layer, position)'s experts (when it
  // returns non-null and they differ from the reference's own choice) with the reference's
  // combine weights for them (MoeCombineWeights); routing[l][t].followed records it, and the
  // selection fields there still describe the reference's own choice. For tests that hold the
  // engine's routing: the reference then follows the engine through its near-ties, so the two
  // stay comparable under the error model (docs/conformance.md).
  std::function<const std::vector<int32_t>*(int64_t layer, int64_t position)> follow_routing;

  // hidden[0] = embeddings, hidden[l + 1] = residual stream after layer l; each [n, hidden_size].
  std::vector<std::vector<float>> hidden;
  // routing[l][t] = the router's choice for token t in layer l; empty for dense layers.
  std::vector<std::vector<MoeGateResult>> routing;
  // gap_tolerance[l][t] (MoE layers): the bound (kappa standard deviations of error_model) on
  // how far the engine's selection-score differences can be from the reference's at that layer:
  // a routing difference there is a near-tie only if routing[l][t].SelectionGap() is below it.
  std::vector<std::vector<double>> gap_tolerance;
  // residual_error[l][t]: the model's RMS size of |engine - reference| / |h| for the residual
  // stream after layer l (relative, 2-norm).
  std::vector<std::vector<double>> residual_error;
  // final_input_error[t]: the model's RMS size (2-norm) of the lm_head input's error.
  std::vector<double> final_input_error;
};

class ReferenceModel {
 public:
  using Options = ReferenceModelOptions;

  // Reads and dequantizes every weight the forward pass needs from `weights` (MODEL-SPEC §2.1
  // names; FP8 weights through their block scales). Errors: InvalidArgument for an inconsistent
  // config or a tensor of the wrong shape, Unimplemented for a scoring function, top-k method or
  // activation other than sigmoid / noaux_tc / silu, and the source's NotFound for a missing
  // tensor (messages name the tensor). `weights` is not used after Create returns.
  static absl::StatusOr<std::unique_ptr<ReferenceModel>> Create(const ModelConfig& config,
                                                                const WeightSource& weights,
                                                                Options options = {});

  const ModelConfig& config() const { return config_; }
  const Options& options() const { return options_; }
  // An empty cache shaped for this model.
  ReferenceKvCache NewCache() const { return ReferenceKvCache(config_); }

  // Runs `tokens` at positions cache.size() .. cache.size() + tokens.size() - 1, appends their
  // latents and rope keys to `cache`, and returns the logits, row-major
  // [tokens.size(), vocab_size]. Prefill of N tokens followed by one-token decodes gives the same
  // logits as one Forward of the whole sequence. InvalidArgument (cache untouched) for no tokens,
  // a token id outside [0, vocab_size), positions beyond max_position_embeddings, or a cache of
  // another shape. Thread-compatible: concurrent calls need distinct caches (the model is const).
  absl::StatusOr<std::vector<float>> Forward(std::span<const int32_t> tokens,
                                             ReferenceKvCache& cache,
                                             ForwardTrace* trace = nullptr) const;

  // The bound under trace.error_model on how far the engine's logit[a] - logit[b] of token t
  // (of the traced Forward) can be from the reference's: kappa |W_a - W_b| e / sqrt(hidden) with
  // W the lm_head rows and e = trace.final_input_error[t]. A token may differ from the
  // reference's arg-max a only where the reference's logit[a] - logit[b] is below it.
  double LogitPairTolerance(const ForwardTrace& trace, int64_t t, int32_t a, int32_t b) const;

 private:
  struct Matrix {
    std::vector<float> data;  // row-major [rows, cols]; 1-D weights have rows == 1
    int64_t rows = 0;
    int64_t cols = 0;
    bool q8k_input = false;  // named in Options::q8k_activation_tensors
  };
  struct Mlp {
    Matrix gate, up, down;
  };
  struct Layer {
    Matrix input_norm, post_norm;
    Matrix q_a, q_a_norm, q_b;  // with q_lora_rank
    Matrix q;                   // without q_lora_rank ("lite" models)
    Matrix kv_a, kv_a_norm, kv_b, o;
    bool is_moe = false;
    Mlp dense;                   // !is_moe
    Matrix router, router_bias;  // is_moe
    std::vector<Mlp> experts;    // is_moe
    bool has_shared = false;
    Mlp shared;  // is_moe && n_shared_experts > 0
  };

  ReferenceModel(const ModelConfig& config, Options options);
  absl::Status Load(const WeightSource& weights);
  absl::StatusOr<Matrix> LoadMatrix(const WeightSource& weights, const std::string& name,
                                    int64_t rows, int64_t cols) const;
  absl::StatusOr<Matrix> LoadVector(const WeightSource& weights, const std::string& name,
                                    int64_t size) const;
  absl::StatusOr<Mlp> LoadMlp(const WeightSource& weights, const std::string& gate_name,
                              const std::string& up_name, const std::string& down_name,
                              int64_t inter) const;

  // y = W x (Linear, or LinearQ8K for a q8k_input weight).
  static void Apply(const Matrix& w, std::span<const float> x, std::span<float> y);
  // SwiGLU MLP through Apply (SwiGluMlp when no weight is q8k_input).
  static void RunMlp(const Mlp& mlp, int64_t hidden, int64_t inter, std::span<const float> x,
                     std::span<float> y);

  // One decoder layer's attention for the n tokens in `x` ([n, H], normalized input); appends the
  // new cache rows of `layer` and writes [n, H] to `out`.
  void Attention(int64_t layer, std::span<const float> x, int64_t n, int64_t start_pos,
                 ReferenceKvCache& cache, std::span<float> out) const;
  // Dense MLP or MoE for one token; `routing` receives the router's choice for MoE layers.
  // `follow`: experts to take instead of the router's choice (ForwardTrace::follow_routing), or
  // null. `gap_tolerance` (with a trace, MoE layers): receives the selection-gap bound for an
  // input error of 2-norm `input_error` under `model`.
  void FeedForward(int64_t layer, std::span<const float> x, std::span<float> out,
                   MoeGateResult* routing, const std::vector<int32_t>* follow = nullptr,
                   const ErrorModel* model = nullptr, double input_error = 0.0,
                   double* gap_tolerance = nullptr) const;

  ModelConfig config_;
  Options options_;
  std::vector<float> inv_freq_;
  float attention_factor_ = 1.0f;
  MlaDimensions mla_dims_;
  MoeGateParams gate_params_;
  Matrix embed_;
  Matrix final_norm_;
  Matrix lm_head_;
  std::vector<Layer> layers_;
};

// Greedy decoding: prefills `prompt`, then picks the arg-max logit (lowest id on ties) and feeds it
// back, max_new_tokens times. Does not stop at EOS (callers truncate if they want). When
// `step_logits` is given, step_logits[i] receives the vocab_size logits token i was chosen from.
// InvalidArgument for an empty prompt, max_new_tokens < 0 or a sequence that would not fit in
// max_position_embeddings (checked before any work), Forward's errors otherwise, Internal if a
// logit is not finite.
absl::StatusOr<std::vector<int32_t>> GenerateGreedy(
    const ReferenceModel& model, std::span<const int32_t> prompt, int max_new_tokens,
    std::vector<std::vector<float>>* step_logits = nullptr);

}  // namespace hmoe::reference
