#pragma once

// The Hugging Face tensor inventory of the DeepSeek-V3 family (MODEL-SPEC 2.1): which tensors a
// checkpoint for a given ModelConfig holds, their shapes and dtype classes. This file is the one
// place tensor names are spelled; everything else (engine, weightd, test-model writer) calls these
// helpers.

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/status.h"

#include "common/model/dtype.h"
#include "common/model/model_config.h"
#include "common/model/tensor.h"

namespace hmoe {

// Global tensor names.
inline constexpr std::string_view kEmbedTokensName = "model.embed_tokens.weight";
inline constexpr std::string_view kFinalNormName = "model.norm.weight";
inline constexpr std::string_view kLmHeadName = "lm_head.weight";

// Per-layer suffixes, for LayerTensorName().
namespace layer_tensor {
inline constexpr std::string_view kInputLayernorm = "input_layernorm.weight";
inline constexpr std::string_view kPostAttentionLayernorm = "post_attention_layernorm.weight";
inline constexpr std::string_view kQProj = "self_attn.q_proj.weight";  // q_lora_rank == null
inline constexpr std::string_view kQAProj = "self_attn.q_a_proj.weight";
inline constexpr std::string_view kQALayernorm = "self_attn.q_a_layernorm.weight";
inline constexpr std::string_view kQBProj = "self_attn.q_b_proj.weight";
inline constexpr std::string_view kKvAProjWithMqa = "self_attn.kv_a_proj_with_mqa.weight";
inline constexpr std::string_view kKvALayernorm = "self_attn.kv_a_layernorm.weight";
inline constexpr std::string_view kKvBProj = "self_attn.kv_b_proj.weight";
inline constexpr std::string_view kOProj = "self_attn.o_proj.weight";
// Dense MLP (layers < first_k_dense_replace).
inline constexpr std::string_view kMlpGateProj = "mlp.gate_proj.weight";
inline constexpr std::string_view kMlpUpProj = "mlp.up_proj.weight";
inline constexpr std::string_view kMlpDownProj = "mlp.down_proj.weight";
// MoE router.
inline constexpr std::string_view kRouterWeight = "mlp.gate.weight";
inline constexpr std::string_view kRouterBias = "mlp.gate.e_score_correction_bias";
}  // namespace layer_tensor

// Projection names of an MLP (dense, routed expert or shared expert).
inline constexpr std::string_view kGateProj = "gate_proj";
inline constexpr std::string_view kUpProj = "up_proj";
inline constexpr std::string_view kDownProj = "down_proj";

// "model.layers.<layer>.<suffix>", e.g. LayerTensorName(3, layer_tensor::kOProj).
std::string LayerTensorName(int64_t layer, std::string_view suffix);
// "model.layers.<layer>.mlp.experts.<expert>.<proj>.weight"; proj is kGateProj/kUpProj/kDownProj.
std::string ExpertTensorName(int64_t layer, int64_t expert, std::string_view proj);
// "model.layers.<layer>.mlp.shared_experts.<proj>.weight".
std::string SharedExpertTensorName(int64_t layer, std::string_view proj);

// How a tensor is stored and what dtypes it may have.
enum class TensorKind {
  kLinear,     // 2-D [out, in] projection: F8_E4M3 with a "_scale_inv" sibling, or BF16/F16/F32,
               // or a GGML block type (GGUF models)
  kEmbedding,  // embed_tokens / lm_head: BF16/F16/F32 or a GGML block type, never FP8
  kRouter,     // mlp.gate.weight [E, H]: BF16/F16/F32 or a GGML block type, never FP8
  kNorm,       // 1-D RMSNorm weight: BF16/F16/F32
  kBias,       // mlp.gate.e_score_correction_bias [E]: F32
};

// "linear", "embedding", "router", "norm" or "bias".
std::string_view TensorKindName(TensorKind kind);
// Whether a tensor of `kind` may be stored as `dtype` (F8_E4M3 only for kLinear).
bool DTypeAllowed(TensorKind kind, DType dtype);

struct ExpectedTensor {
  std::string name;
  std::vector<int64_t> shape;
  TensorKind kind = TensorKind::kLinear;
  int64_t layer = -1;   // decoder layer, -1 for global tensors
  int64_t expert = -1;  // routed expert index, -1 otherwise

  // An FP8 checkpoint stores this weight as F8_E4M3 plus a F32 "<name>_scale_inv" of shape
  // ScaleInvShape(shape); a BF16 checkpoint stores it as BF16.
  bool quantizable() const { return kind == TensorKind::kLinear; }
};

// Every tensor of a checkpoint for `config`, scale tensors not included, in a fixed order:
// embed_tokens; then for each layer 0..num_hidden_layers-1 its norms, attention, and dense MLP or
// router, experts and shared experts; then model.norm and (unless tie_word_embeddings) lm_head.
// MTP layers (>= num_hidden_layers) are not listed. The router bias is listed for noaux_tc only.
std::vector<ExpectedTensor> ExpectedTensors(const ModelConfig& config);

// Checks that `source` holds every ExpectedTensors(config) tensor with the right shape and an
// allowed dtype, and that FP8 weights have a F32 scale of the right shape. Extra tensors (MTP
// layers, anything else) are ignored. InvalidArgument listing the first few problems by name and
// the total number of problems.
absl::Status ValidateTensors(const ModelConfig& config, const WeightSource& source);

}  // namespace hmoe
