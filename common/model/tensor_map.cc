#include "common/model/tensor_map.h"

#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace hmoe {
namespace {

// DTypeName() as an absl::string_view (not the same type as std::string_view in this abseil).
absl::string_view DTypeStr(DType t) {
  const std::string_view s = DTypeName(t);
  return absl::string_view(s.data(), s.size());
}

constexpr size_t kMaxReportedProblems = 8;

absl::string_view AsAbsl(std::string_view s) { return absl::string_view(s.data(), s.size()); }

std::string ShapeString(const std::vector<int64_t>& shape) {
  return absl::StrCat("[", absl::StrJoin(shape, ", "), "]");
}

}  // namespace

std::string LayerTensorName(int64_t layer, std::string_view suffix) {
  return absl::StrCat("model.layers.", layer, ".", AsAbsl(suffix));
}

std::string ExpertTensorName(int64_t layer, int64_t expert, std::string_view proj) {
  return absl::StrCat("model.layers.", layer, ".mlp.experts.", expert, ".", AsAbsl(proj),
                      ".weight");
}

std::string SharedExpertTensorName(int64_t layer, std::string_view proj) {
  return absl::StrCat("model.layers.", layer, ".mlp.shared_experts.", AsAbsl(proj), ".weight");
}

std::string_view TensorKindName(TensorKind kind) {
  switch (kind) {
    case TensorKind::kLinear:
      return "linear";
    case TensorKind::kEmbedding:
      return "embedding";
    case TensorKind::kRouter:
      return "router";
    case TensorKind::kNorm:
      return "norm";
    case TensorKind::kBias:
      return "bias";
  }
  return "?";
}

bool DTypeAllowed(TensorKind kind, DType dtype) {
  const bool float_type = dtype == DType::kBF16 || dtype == DType::kF16 || dtype == DType::kF32;
  switch (kind) {
    case TensorKind::kLinear:
      return float_type || dtype == DType::kF8E4M3 || IsBlockDType(dtype);
    case TensorKind::kEmbedding:
    case TensorKind::kRouter:
      return float_type || IsBlockDType(dtype);  // GGUF models quantize them
    case TensorKind::kNorm:
      return float_type;
    case TensorKind::kBias:
      return dtype == DType::kF32;
  }
  return false;
}

std::vector<ExpectedTensor> ExpectedTensors(const ModelConfig& c) {
  namespace lt = layer_tensor;
  std::vector<ExpectedTensor> out;
  const int64_t h = c.hidden_size;
  const int64_t nh = c.num_attention_heads;
  auto add = [&](std::string name, std::vector<int64_t> shape, TensorKind kind, int64_t layer,
                 int64_t expert = -1) {
    out.push_back({std::move(name), std::move(shape), kind, layer, expert});
  };
  add(std::string(kEmbedTokensName), {c.vocab_size, h}, TensorKind::kEmbedding, -1);
  for (int64_t l = 0; l < c.num_hidden_layers; ++l) {
    auto layer = [&](std::string_view suffix, std::vector<int64_t> shape, TensorKind kind) {
      add(LayerTensorName(l, suffix), std::move(shape), kind, l);
    };
    layer(lt::kInputLayernorm, {h}, TensorKind::kNorm);
    if (c.q_lora_rank.has_value()) {
      layer(lt::kQAProj, {*c.q_lora_rank, h}, TensorKind::kLinear);
      layer(lt::kQALayernorm, {*c.q_lora_rank}, TensorKind::kNorm);
      layer(lt::kQBProj, {nh * c.qk_head_dim(), *c.q_lora_rank}, TensorKind::kLinear);
    } else {
      layer(lt::kQProj, {nh * c.qk_head_dim(), h}, TensorKind::kLinear);
    }
    layer(lt::kKvAProjWithMqa, {c.kv_lora_rank + c.qk_rope_head_dim, h}, TensorKind::kLinear);
    layer(lt::kKvALayernorm, {c.kv_lora_rank}, TensorKind::kNorm);
    layer(lt::kKvBProj, {nh * (c.qk_nope_head_dim + c.v_head_dim), c.kv_lora_rank},
          TensorKind::kLinear);
    layer(lt::kOProj, {h, nh * c.v_head_dim}, TensorKind::kLinear);
    layer(lt::kPostAttentionLayernorm, {h}, TensorKind::kNorm);
    if (!c.is_moe_layer(l)) {
      const int64_t inter = c.intermediate_size;
      layer(lt::kMlpGateProj, {inter, h}, TensorKind::kLinear);
      layer(lt::kMlpUpProj, {inter, h}, TensorKind::kLinear);
      layer(lt::kMlpDownProj, {h, inter}, TensorKind::kLinear);
      continue;
    }
    const int64_t e = c.n_routed_experts;
    const int64_t inter = c.moe_intermediate_size;
    layer(lt::kRouterWeight, {e, h}, TensorKind::kRouter);
    if (c.topk_method == "noaux_tc") layer(lt::kRouterBias, {e}, TensorKind::kBias);
    for (int64_t x = 0; x < e; ++x) {
      add(ExpertTensorName(l, x, kGateProj), {inter, h}, TensorKind::kLinear, l, x);
      add(ExpertTensorName(l, x, kUpProj), {inter, h}, TensorKind::kLinear, l, x);
      add(ExpertTensorName(l, x, kDownProj), {h, inter}, TensorKind::kLinear, l, x);
    }
    if (c.n_shared_experts > 0) {
      const int64_t shared = inter * c.n_shared_experts;
      add(SharedExpertTensorName(l, kGateProj), {shared, h}, TensorKind::kLinear, l);
      add(SharedExpertTensorName(l, kUpProj), {shared, h}, TensorKind::kLinear, l);
      add(SharedExpertTensorName(l, kDownProj), {h, shared}, TensorKind::kLinear, l);
    }
  }
  add(std::string(kFinalNormName), {h}, TensorKind::kNorm, -1);
  if (!c.tie_word_embeddings) {
    add(std::string(kLmHeadName), {c.vocab_size, h}, TensorKind::kEmbedding, -1);
  }
  return out;
}

absl::Status ValidateTensors(const ModelConfig& config, const WeightSource& source) {
  std::vector<std::string> problems;
  size_t num_problems = 0;
  auto problem = [&](std::string p) {
    if (problems.size() < kMaxReportedProblems) problems.push_back(std::move(p));
    ++num_problems;
  };
  for (const ExpectedTensor& t : ExpectedTensors(config)) {
    absl::StatusOr<TensorView> view = source.GetTensor(t.name);
    if (!view.ok()) {
      problem(absl::IsNotFound(view.status())
                  ? absl::StrCat("missing tensor \"", t.name, "\"")
                  : absl::StrCat("tensor \"", t.name, "\": ", view.status().message()));
      continue;
    }
    if (view->shape != t.shape) {
      problem(absl::StrCat("tensor \"", t.name, "\" has shape ", ShapeString(view->shape),
                           ", expected ", ShapeString(t.shape)));
      continue;
    }
    if (!DTypeAllowed(t.kind, view->dtype)) {
      problem(absl::StrCat("tensor \"", t.name, "\" has dtype ", DTypeStr(view->dtype),
                           ", not allowed for a ", AsAbsl(TensorKindName(t.kind)), " tensor"));
      continue;
    }
    if (view->dtype != DType::kF8E4M3) continue;
    const std::string scale_name = ScaleInvName(t.name);
    absl::StatusOr<TensorView> scale = source.GetTensor(scale_name);
    if (!scale.ok()) {
      problem(absl::StrCat("FP8 weight \"", t.name, "\" has no scale tensor \"", scale_name, "\""));
      continue;
    }
    const std::vector<int64_t> scale_shape = ScaleInvShape(t.shape);
    if (scale->dtype != DType::kF32) {
      problem(absl::StrCat("scale tensor \"", scale_name, "\" has dtype ", DTypeStr(scale->dtype),
                           ", expected F32"));
    } else if (scale->shape != scale_shape) {
      problem(absl::StrCat("scale tensor \"", scale_name, "\" has shape ",
                           ShapeString(scale->shape), ", expected ", ShapeString(scale_shape)));
    }
  }
  if (num_problems == 0) return absl::OkStatus();
  std::string msg =
      absl::StrCat("checkpoint does not match the config (", num_problems, " problem",
                   num_problems == 1 ? "" : "s", "): ", absl::StrJoin(problems, "; "));
  if (num_problems > problems.size()) {
    absl::StrAppend(&msg, "; and ", num_problems - problems.size(), " more");
  }
  return absl::InvalidArgumentError(msg);
}

}  // namespace hmoe
