#pragma once

// The plain FP32 forward pass of a DeepSeek-V3-family model (MODEL-SPEC.md §3): embedding, MLA
// attention (naive or weight-absorbed), dense SwiGLU or noaux_tc MoE with shared experts, final
// norm and lm_head. It dequantizes every weight to float once at load, so it is meant for tiny
// and small test models only. It is the oracle every optimized path is compared with: it favours
// obvious correctness over speed (see reference_ops.h).

#include <cstdint>
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
};

// Optional per-layer intermediates of one Forward() call, for tests and activation statistics.
struct ForwardTrace {
  // hidden[0] = embeddings, hidden[l + 1] = residual stream after layer l; each [n, hidden_size].
  std::vector<std::vector<float>> hidden;
  // routing[l][t] = the router's choice for token t in layer l; empty for dense layers.
  std::vector<std::vector<MoeGateResult>> routing;
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
  void FeedForward(int64_t layer, std::span<const float> x, std::span<float> out,
                   MoeGateResult* routing) const;

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
