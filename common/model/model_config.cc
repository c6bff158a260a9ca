#include "common/model/model_config.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

#include "common/base/json.h"
#include "common/base/mapped_file.h"
#include "common/base/status_macros.h"

namespace hmoe {
namespace {

using json::Value;

absl::Status FieldError(std::string_view path, std::string_view problem) {
  return absl::InvalidArgumentError(
      absl::StrCat("field \"", absl::string_view(path.data(), path.size()),
                   "\": ", absl::string_view(problem.data(), problem.size())));
}

std::string Quoted(const std::string& s) { return absl::StrCat("\"", s, "\""); }

// Reads typed fields from config.json. Kimi-K2.5-style configs nest the language model under
// "text_config"; lookups try that object first, then the top level, and errors name the key with
// its real location ("text_config.hidden_size").
class FieldReader {
 public:
  FieldReader(const Value& top, const Value* nested) : top_(top), nested_(nested) {}

  // Returns the value of `key` (nullptr when absent) and sets *path to where it was found.
  const Value* Lookup(std::string_view key, std::string* path) const {
    if (nested_ != nullptr) {
      if (const Value* v = nested_->Find(key)) {
        *path = absl::StrCat("text_config.", absl::string_view(key.data(), key.size()));
        return v;
      }
    }
    *path = std::string(key);
    return top_.Find(key);
  }

  // Integer field. Missing: error when `required`, else *out is unchanged. Null: error unless
  // `null_value` is given, which is then stored.
  absl::Status Int(std::string_view key, bool required, int64_t* out,
                   std::optional<int64_t> null_value = std::nullopt) const {
    std::string path;
    const Value* v = Lookup(key, &path);
    if (v == nullptr) {
      if (required) return FieldError(path, "missing");
      return absl::OkStatus();
    }
    if (v->is_null() && null_value.has_value()) {
      *out = *null_value;
      return absl::OkStatus();
    }
    return ToInt(*v, path, out);
  }

  absl::Status Double(std::string_view key, double* out) const {
    std::string path;
    const Value* v = Lookup(key, &path);
    if (v == nullptr) return absl::OkStatus();
    return ToDouble(*v, path, out);
  }

  absl::Status Bool(std::string_view key, bool* out) const {
    std::string path;
    const Value* v = Lookup(key, &path);
    if (v == nullptr) return absl::OkStatus();
    if (!v->is_bool()) {
      return FieldError(path, absl::StrCat("expected a boolean, got ", json::TypeName(v->type())));
    }
    *out = v->as_bool();
    return absl::OkStatus();
  }

  absl::Status String(std::string_view key, bool required, std::string* out) const {
    std::string path;
    const Value* v = Lookup(key, &path);
    if (v == nullptr) {
      if (required) return FieldError(path, "missing");
      return absl::OkStatus();
    }
    return ToString(*v, path, out);
  }

  static absl::Status ToInt(const Value& v, std::string_view path, int64_t* out) {
    if (v.is_integer()) {
      *out = v.as_int();
      return absl::OkStatus();
    }
    // Accept integral floating-point literals ("4096.0") that are exactly representable.
    if (v.is_number()) {
      const double d = v.as_double();
      if (std::trunc(d) == d && std::fabs(d) <= 9007199254740992.0) {
        *out = static_cast<int64_t>(d);
        return absl::OkStatus();
      }
      return FieldError(path, absl::StrCat("expected an integer, got ", d));
    }
    return FieldError(path, absl::StrCat("expected an integer, got ", json::TypeName(v.type())));
  }

  static absl::Status ToDouble(const Value& v, std::string_view path, double* out) {
    if (!v.is_number()) {
      return FieldError(path, absl::StrCat("expected a number, got ", json::TypeName(v.type())));
    }
    *out = v.as_double();
    return absl::OkStatus();
  }

  static absl::Status ToString(const Value& v, std::string_view path, std::string* out) {
    if (!v.is_string()) {
      return FieldError(path, absl::StrCat("expected a string, got ", json::TypeName(v.type())));
    }
    *out = v.as_string();
    return absl::OkStatus();
  }

 private:
  const Value& top_;
  const Value* nested_;
};

absl::Status ParseRopeScaling(const FieldReader& r, ModelConfig* c) {
  std::string path;
  const Value* rs = r.Lookup("rope_scaling", &path);
  if (rs == nullptr || rs->is_null()) return absl::OkStatus();
  if (!rs->is_object()) {
    return FieldError(path,
                      absl::StrCat("expected an object or null, got ", json::TypeName(rs->type())));
  }
  const FieldReader sub(*rs, nullptr);
  auto sub_path = [&](std::string_view key) {
    return absl::StrCat(path, ".", absl::string_view(key.data(), key.size()));
  };
  std::string type;
  const char* type_key = rs->Find("type") != nullptr ? "type" : "rope_type";
  const Value* type_value = rs->Find(type_key);
  if (type_value == nullptr) return FieldError(sub_path("type"), "missing");
  HMOE_RETURN_IF_ERROR(FieldReader::ToString(*type_value, sub_path(type_key), &type));
  if (type == "default") return absl::OkStatus();  // HF's spelling of "no scaling"
  if (type != "yarn") {
    return FieldError(sub_path(type_key), absl::StrCat("unsupported rope scaling type ",
                                                       Quoted(type), " (supported: yarn)"));
  }
  YarnConfig& y = c->rope_scaling;
  y.enabled = true;
  // HF (_compute_yarn_parameters): the original length defaults to max_position_embeddings and a
  // missing factor is derived from the two lengths.
  y.original_max_position_embeddings = c->max_position_embeddings;
  const Value* v = nullptr;
  if ((v = rs->Find("original_max_position_embeddings")) != nullptr && !v->is_null()) {
    HMOE_RETURN_IF_ERROR(FieldReader::ToInt(*v, sub_path("original_max_position_embeddings"),
                                            &y.original_max_position_embeddings));
  }
  if (y.original_max_position_embeddings <= 0) {
    return FieldError(sub_path("original_max_position_embeddings"),
                      absl::StrCat("must be > 0, got ", y.original_max_position_embeddings));
  }
  if ((v = rs->Find("factor")) != nullptr && !v->is_null()) {
    HMOE_RETURN_IF_ERROR(FieldReader::ToDouble(*v, sub_path("factor"), &y.factor));
  } else {
    y.factor = static_cast<double>(c->max_position_embeddings) /
               static_cast<double>(y.original_max_position_embeddings);
  }
  const std::pair<const char*, double*> optional_numbers[] = {
      {"beta_fast", &y.beta_fast},
      {"beta_slow", &y.beta_slow},
      {"mscale", &y.mscale},
      {"mscale_all_dim", &y.mscale_all_dim},
      {"attention_factor", &y.attention_factor}};
  for (const auto& [key, dst] : optional_numbers) {
    if ((v = rs->Find(key)) != nullptr && !v->is_null()) {
      HMOE_RETURN_IF_ERROR(FieldReader::ToDouble(*v, sub_path(key), dst));
    }
  }
  if ((v = rs->Find("attention_factor")) != nullptr && !v->is_null() && !(y.attention_factor > 0)) {
    return FieldError(sub_path("attention_factor"),
                      absl::StrCat("must be a finite number > 0, got ", y.attention_factor));
  }
  // transformers skips the floor/ceil of the correction range when truncate is false; we do not
  // implement that variant.
  if ((v = rs->Find("truncate")) != nullptr && !v->is_null()) {
    if (!v->is_bool() || !v->as_bool()) {
      return FieldError(sub_path("truncate"), "only true (the default) is supported");
    }
  }
  return absl::OkStatus();
}

absl::Status ParseQuantization(const FieldReader& r, ModelConfig* c) {
  std::string path;
  const Value* q = r.Lookup("quantization_config", &path);
  if (q == nullptr || q->is_null()) return absl::OkStatus();  // BF16 checkpoint
  if (!q->is_object()) {
    return FieldError(path,
                      absl::StrCat("expected an object or null, got ", json::TypeName(q->type())));
  }
  auto sub_path = [&](std::string_view key) {
    return absl::StrCat(path, ".", absl::string_view(key.data(), key.size()));
  };
  const Value* v = q->Find("quant_method");
  if (v == nullptr) return FieldError(sub_path("quant_method"), "missing");
  std::string method;
  HMOE_RETURN_IF_ERROR(FieldReader::ToString(*v, sub_path("quant_method"), &method));
  if (method != "fp8") {
    return FieldError(sub_path("quant_method"),
                      absl::StrCat("unsupported quantization ", Quoted(method),
                                   " (supported: fp8 with 128x128 block scales)"));
  }
  QuantizationConfig& qc = c->quantization;
  qc.fp8 = true;
  if ((v = q->Find("fmt")) != nullptr) {
    std::string fmt;
    HMOE_RETURN_IF_ERROR(FieldReader::ToString(*v, sub_path("fmt"), &fmt));
    if (fmt != "e4m3") {
      return FieldError(sub_path("fmt"),
                        absl::StrCat("unsupported FP8 format ", Quoted(fmt), " (supported: e4m3)"));
    }
  }
  if ((v = q->Find("weight_block_size")) != nullptr) {
    if (!v->is_array() || v->items().size() != 2) {
      return FieldError(sub_path("weight_block_size"), "expected an array of 2 integers");
    }
    HMOE_RETURN_IF_ERROR(
        FieldReader::ToInt(v->items()[0], sub_path("weight_block_size"), &qc.block_rows));
    HMOE_RETURN_IF_ERROR(
        FieldReader::ToInt(v->items()[1], sub_path("weight_block_size"), &qc.block_cols));
  }
  if ((v = q->Find("activation_scheme")) != nullptr) {
    std::string scheme;
    HMOE_RETURN_IF_ERROR(FieldReader::ToString(*v, sub_path("activation_scheme"), &scheme));
  }
  if ((v = q->Find("scale_fmt")) != nullptr && !v->is_null()) {
    HMOE_RETURN_IF_ERROR(FieldReader::ToString(*v, sub_path("scale_fmt"), &qc.scale_fmt));
  }
  return absl::OkStatus();
}

absl::StatusOr<ModelConfig> Parse(std::string_view json_text) {
  HMOE_ASSIGN_OR_RETURN(const Value root, json::Parse(json_text));
  if (!root.is_object()) {
    return absl::InvalidArgumentError(
        absl::StrCat("expected a JSON object, got ", json::TypeName(root.type())));
  }
  const Value* nested = root.Find("text_config");
  if (nested != nullptr && !nested->is_object()) {
    return FieldError("text_config",
                      absl::StrCat("expected an object, got ", json::TypeName(nested->type())));
  }
  const FieldReader r(root, nested);
  ModelConfig c;
  HMOE_RETURN_IF_ERROR(r.String("model_type", /*required=*/true, &c.model_type));

  // Dimensions: required, there is no sensible default.
  const std::pair<const char*, int64_t*> required_ints[] = {
      {"vocab_size", &c.vocab_size},
      {"hidden_size", &c.hidden_size},
      {"intermediate_size", &c.intermediate_size},
      {"moe_intermediate_size", &c.moe_intermediate_size},
      {"num_hidden_layers", &c.num_hidden_layers},
      {"num_attention_heads", &c.num_attention_heads},
      {"kv_lora_rank", &c.kv_lora_rank},
      {"qk_nope_head_dim", &c.qk_nope_head_dim},
      {"qk_rope_head_dim", &c.qk_rope_head_dim},
      {"v_head_dim", &c.v_head_dim},
      {"n_routed_experts", &c.n_routed_experts},
      {"num_experts_per_tok", &c.num_experts_per_tok},
  };
  for (const auto& [key, dst] : required_ints) {
    HMOE_RETURN_IF_ERROR(r.Int(key, /*required=*/true, dst));
  }

  // q_lora_rank: null selects the single q_proj; absent takes HF's default.
  {
    std::string path;
    const Value* v = r.Lookup("q_lora_rank", &path);
    if (v == nullptr) {
      c.q_lora_rank = 1536;
    } else if (!v->is_null()) {
      int64_t rank = 0;
      HMOE_RETURN_IF_ERROR(FieldReader::ToInt(*v, path, &rank));
      c.q_lora_rank = rank;
    }
  }

  // Optional fields with the defaults of HF's DeepseekV3Config (and the hub's remote code for
  // moe_layer_freq, scoring_func and topk_method).
  c.n_shared_experts = 1;
  c.n_group = 8;
  c.topk_group = 4;
  c.routed_scaling_factor = 2.5;
  c.first_k_dense_replace = 3;
  c.max_position_embeddings = 4096;
  c.bos_token_id = 0;
  HMOE_RETURN_IF_ERROR(r.Int("n_shared_experts", false, &c.n_shared_experts, 0));
  HMOE_RETURN_IF_ERROR(r.Int("n_group", false, &c.n_group, 1));
  HMOE_RETURN_IF_ERROR(r.Int("topk_group", false, &c.topk_group, 1));
  HMOE_RETURN_IF_ERROR(r.Double("routed_scaling_factor", &c.routed_scaling_factor));
  HMOE_RETURN_IF_ERROR(r.String("scoring_func", false, &c.scoring_func));
  HMOE_RETURN_IF_ERROR(r.String("topk_method", false, &c.topk_method));
  HMOE_RETURN_IF_ERROR(r.Bool("norm_topk_prob", &c.norm_topk_prob));
  HMOE_RETURN_IF_ERROR(r.Int("first_k_dense_replace", false, &c.first_k_dense_replace));
  HMOE_RETURN_IF_ERROR(r.Int("moe_layer_freq", false, &c.moe_layer_freq));
  HMOE_RETURN_IF_ERROR(r.String("hidden_act", false, &c.hidden_act));
  HMOE_RETURN_IF_ERROR(r.Double("rms_norm_eps", &c.rms_norm_eps));
  HMOE_RETURN_IF_ERROR(r.Double("rope_theta", &c.rope_theta));
  HMOE_RETURN_IF_ERROR(r.Int("max_position_embeddings", false, &c.max_position_embeddings));
  HMOE_RETURN_IF_ERROR(r.Int("bos_token_id", false, &c.bos_token_id, -1));
  HMOE_RETURN_IF_ERROR(r.Bool("tie_word_embeddings", &c.tie_word_embeddings));
  HMOE_RETURN_IF_ERROR(r.Int("num_nextn_predict_layers", false, &c.num_nextn_predict_layers, 0));

  {
    std::string path;
    const Value* v = r.Lookup("eos_token_id", &path);
    if (v == nullptr) {
      c.eos_token_ids = {1};
    } else if (v->is_array()) {
      for (size_t i = 0; i < v->items().size(); ++i) {
        int64_t id = 0;
        HMOE_RETURN_IF_ERROR(
            FieldReader::ToInt(v->items()[i], absl::StrCat(path, "[", i, "]"), &id));
        c.eos_token_ids.push_back(id);
      }
    } else if (!v->is_null()) {
      int64_t id = 0;
      HMOE_RETURN_IF_ERROR(FieldReader::ToInt(*v, path, &id));
      c.eos_token_ids.push_back(id);
    }
  }

  {
    // No biases anywhere in MLA or the MLPs of this family; a config asking for them is a
    // different architecture.
    bool attention_bias = false;
    HMOE_RETURN_IF_ERROR(r.Bool("attention_bias", &attention_bias));
    if (attention_bias) return FieldError("attention_bias", "true is not supported");
  }

  HMOE_RETURN_IF_ERROR(ParseRopeScaling(r, &c));
  HMOE_RETURN_IF_ERROR(ParseQuantization(r, &c));
  HMOE_RETURN_IF_ERROR(c.Validate());
  return c;
}

absl::StatusOr<ModelConfig> ParseLabeled(std::string_view json_text, std::string_view label) {
  absl::StatusOr<ModelConfig> c = Parse(json_text);
  if (!c.ok()) return Annotate(c.status(), label);
  return c;
}

absl::Status CheckPositive(std::string_view field, int64_t v) {
  if (v <= 0) return FieldError(field, absl::StrCat("must be > 0, got ", v));
  return absl::OkStatus();
}

absl::Status CheckPositiveFinite(std::string_view field, double v) {
  if (!(v > 0) || !std::isfinite(v)) {
    return FieldError(field, absl::StrCat("must be a finite number > 0, got ", v));
  }
  return absl::OkStatus();
}

}  // namespace

double ModelConfig::softmax_scale() const {
  double scale = 1.0 / std::sqrt(static_cast<double>(qk_head_dim()));
  // HF DeepseekV3Attention: scale *= yarn_get_mscale(factor, mscale_all_dim)^2 when
  // mscale_all_dim is set, with yarn_get_mscale(s, m) = 1 if s <= 1 else 0.1 * m * ln(s) + 1.
  if (rope_scaling.enabled && rope_scaling.mscale_all_dim != 0.0) {
    const double m = rope_scaling.factor <= 1.0
                         ? 1.0
                         : 0.1 * rope_scaling.mscale_all_dim * std::log(rope_scaling.factor) + 1.0;
    scale *= m * m;
  }
  return scale;
}

namespace {

// HF's yarn_get_mscale(s, m): 1 when s <= 1, else 0.1 m ln s + 1.
double YarnScaleOf(double factor, double m) {
  return factor <= 1.0 ? 1.0 : 0.1 * m * std::log(factor) + 1.0;
}

}  // namespace

std::vector<float> ModelConfig::rope_inv_freq() const {
  const int64_t d = qk_rope_head_dim;
  std::vector<float> out(static_cast<size_t>(std::max<int64_t>(d, 0) / 2));
  const YarnConfig& y = rope_scaling;
  // The dimension index whose frequency turns `rotations` times over the original context:
  // d ln(L0 / (2 pi rotations)) / (2 ln theta).
  const auto dim_of = [&](double rotations) {
    constexpr double kTwoPi = 6.283185307179586476925286766559;
    return static_cast<double>(d) *
           std::log(static_cast<double>(y.original_max_position_embeddings) /
                    (rotations * kTwoPi)) /
           (2.0 * std::log(rope_theta));
  };
  double low = 0.0, high = 0.0;
  if (y.enabled) {
    low = std::max(0.0, std::floor(dim_of(y.beta_fast)));
    high = std::min(static_cast<double>(d - 1), std::ceil(dim_of(y.beta_slow)));
    if (high == low) high += 0.001;
  }
  for (size_t i = 0; i < out.size(); ++i) {
    const double theta_i = std::pow(rope_theta, -2.0 * static_cast<double>(i) / d);
    if (!y.enabled) {
      out[i] = static_cast<float>(theta_i);
      continue;
    }
    const double t = (static_cast<double>(i) - low) / (high - low);
    const double extrapolated_share = 1.0 - std::min(1.0, std::max(0.0, t));
    out[i] = static_cast<float>(theta_i / y.factor * (1.0 - extrapolated_share) +
                                theta_i * extrapolated_share);
  }
  return out;
}

double ModelConfig::rope_attention_factor() const {
  const YarnConfig& y = rope_scaling;
  if (!y.enabled) return 1.0;
  if (y.attention_factor != 0.0) return y.attention_factor;
  // transformers: `if mscale and mscale_all_dim` (both truthy) the ratio, else g(factor, 1) -- even
  // when only one of them is given, and whatever its value.
  if (y.mscale != 0.0 && y.mscale_all_dim != 0.0) {
    return YarnScaleOf(y.factor, y.mscale) / YarnScaleOf(y.factor, y.mscale_all_dim);
  }
  return YarnScaleOf(y.factor, 1.0);
}

absl::StatusOr<ModelConfig> ModelConfig::FromJson(std::string_view json_text) {
  return ParseLabeled(json_text, "config.json");
}

absl::StatusOr<ModelConfig> ModelConfig::FromFile(const std::string& path) {
  HMOE_ASSIGN_OR_RETURN(const std::string text, ReadFileToString(path));
  return ParseLabeled(text, path);
}

absl::Status ModelConfig::Validate() const {
  if (model_type != "deepseek_v3" && model_type != "kimi_k2") {
    return FieldError("model_type", absl::StrCat("unsupported model type ", Quoted(model_type),
                                                 " (supported: deepseek_v3, kimi_k2)"));
  }
  const std::pair<const char*, int64_t> positive[] = {
      {"vocab_size", vocab_size},
      {"hidden_size", hidden_size},
      {"intermediate_size", intermediate_size},
      {"moe_intermediate_size", moe_intermediate_size},
      {"num_hidden_layers", num_hidden_layers},
      {"num_attention_heads", num_attention_heads},
      {"kv_lora_rank", kv_lora_rank},
      {"qk_nope_head_dim", qk_nope_head_dim},
      {"qk_rope_head_dim", qk_rope_head_dim},
      {"v_head_dim", v_head_dim},
      {"n_routed_experts", n_routed_experts},
      {"num_experts_per_tok", num_experts_per_tok},
      {"n_group", n_group},
      {"topk_group", topk_group},
      {"moe_layer_freq", moe_layer_freq},
      {"max_position_embeddings", max_position_embeddings},
  };
  for (const auto& [field, v] : positive) HMOE_RETURN_IF_ERROR(CheckPositive(field, v));
  if (q_lora_rank.has_value()) HMOE_RETURN_IF_ERROR(CheckPositive("q_lora_rank", *q_lora_rank));
  if (qk_rope_head_dim % 2 != 0) {
    return FieldError("qk_rope_head_dim",
                      absl::StrCat("must be even (rotary pairs), got ", qk_rope_head_dim));
  }
  if (n_shared_experts < 0) {
    return FieldError("n_shared_experts", absl::StrCat("must be >= 0, got ", n_shared_experts));
  }
  if (num_experts_per_tok > n_routed_experts) {
    return FieldError(
        "num_experts_per_tok",
        absl::StrCat(num_experts_per_tok, " exceeds n_routed_experts (", n_routed_experts, ")"));
  }
  if (n_routed_experts % n_group != 0) {
    return FieldError("n_group", absl::StrCat("n_routed_experts (", n_routed_experts,
                                              ") is not divisible by n_group (", n_group, ")"));
  }
  if (topk_group > n_group) {
    return FieldError("topk_group", absl::StrCat(topk_group, " exceeds n_group (", n_group, ")"));
  }
  const int64_t experts_per_group = n_routed_experts / n_group;
  if (topk_group * experts_per_group < num_experts_per_tok) {
    return FieldError(
        "topk_group",
        absl::StrCat("topk_group (", topk_group, ") groups of ", experts_per_group,
                     " experts cannot supply num_experts_per_tok (", num_experts_per_tok, ")"));
  }
  if (scoring_func != "sigmoid" && scoring_func != "softmax") {
    return FieldError("scoring_func", absl::StrCat("unsupported ", Quoted(scoring_func),
                                                   " (supported: sigmoid, softmax)"));
  }
  if (topk_method != "noaux_tc" && topk_method != "greedy" &&
      topk_method != "group_limited_greedy") {
    return FieldError("topk_method",
                      absl::StrCat("unsupported ", Quoted(topk_method),
                                   " (supported: noaux_tc, greedy, group_limited_greedy)"));
  }
  if (topk_method == "noaux_tc" && experts_per_group < 2) {
    return FieldError("n_group", absl::StrCat("noaux_tc scores a group by its top-2 experts, but "
                                              "groups have ",
                                              experts_per_group, " expert(s)"));
  }
  if (first_k_dense_replace < 0 || first_k_dense_replace > num_hidden_layers) {
    return FieldError("first_k_dense_replace",
                      absl::StrCat("must be in [0, num_hidden_layers=", num_hidden_layers,
                                   "], got ", first_k_dense_replace));
  }
  if (hidden_act != "silu") {
    return FieldError("hidden_act",
                      absl::StrCat("unsupported ", Quoted(hidden_act), " (supported: silu)"));
  }
  HMOE_RETURN_IF_ERROR(CheckPositiveFinite("routed_scaling_factor", routed_scaling_factor));
  HMOE_RETURN_IF_ERROR(CheckPositiveFinite("rms_norm_eps", rms_norm_eps));
  HMOE_RETURN_IF_ERROR(CheckPositiveFinite("rope_theta", rope_theta));
  if (rope_scaling.enabled) {
    HMOE_RETURN_IF_ERROR(CheckPositiveFinite("rope_scaling.factor", rope_scaling.factor));
    HMOE_RETURN_IF_ERROR(CheckPositive("rope_scaling.original_max_position_embeddings",
                                       rope_scaling.original_max_position_embeddings));
    HMOE_RETURN_IF_ERROR(CheckPositiveFinite("rope_scaling.beta_fast", rope_scaling.beta_fast));
    HMOE_RETURN_IF_ERROR(CheckPositiveFinite("rope_scaling.beta_slow", rope_scaling.beta_slow));
    if (!std::isfinite(rope_scaling.mscale)) {
      return FieldError("rope_scaling.mscale", "must be finite");
    }
    if (!std::isfinite(rope_scaling.mscale_all_dim)) {
      return FieldError("rope_scaling.mscale_all_dim", "must be finite");
    }
    if (rope_scaling.attention_factor != 0.0) {
      HMOE_RETURN_IF_ERROR(
          CheckPositiveFinite("rope_scaling.attention_factor", rope_scaling.attention_factor));
    }
  }
  if (bos_token_id < -1 || bos_token_id >= vocab_size) {
    return FieldError("bos_token_id",
                      absl::StrCat(bos_token_id, " is outside [0, vocab_size=", vocab_size, ")"));
  }
  for (int64_t id : eos_token_ids) {
    if (id < 0 || id >= vocab_size) {
      return FieldError("eos_token_id",
                        absl::StrCat(id, " is outside [0, vocab_size=", vocab_size, ")"));
    }
  }
  if (num_nextn_predict_layers < 0) {
    return FieldError("num_nextn_predict_layers",
                      absl::StrCat("must be >= 0, got ", num_nextn_predict_layers));
  }
  if (quantization.fp8) {
    if (quantization.block_rows != 128 || quantization.block_cols != 128) {
      return FieldError("quantization_config.weight_block_size",
                        absl::StrCat("[", quantization.block_rows, ", ", quantization.block_cols,
                                     "] is not supported (supported: [128, 128])"));
    }
    if (!quantization.scale_fmt.empty() && quantization.scale_fmt != "ue8m0") {
      return FieldError(
          "quantization_config.scale_fmt",
          absl::StrCat("unsupported ", Quoted(quantization.scale_fmt), " (supported: ue8m0)"));
    }
  }
  return absl::OkStatus();
}

std::string ModelConfig::ToJson() const {
  Value o = Value::Object();
  o.Set("architectures", Value::Array({Value::String("DeepseekV3ForCausalLM")}));
  o.Set("model_type", Value::String(model_type));
  o.Set("vocab_size", Value::Integer(vocab_size));
  o.Set("hidden_size", Value::Integer(hidden_size));
  o.Set("intermediate_size", Value::Integer(intermediate_size));
  o.Set("moe_intermediate_size", Value::Integer(moe_intermediate_size));
  o.Set("num_hidden_layers", Value::Integer(num_hidden_layers));
  o.Set("num_attention_heads", Value::Integer(num_attention_heads));
  o.Set("num_key_value_heads", Value::Integer(num_attention_heads));
  o.Set("q_lora_rank", q_lora_rank.has_value() ? Value::Integer(*q_lora_rank) : Value::Null());
  o.Set("kv_lora_rank", Value::Integer(kv_lora_rank));
  o.Set("qk_nope_head_dim", Value::Integer(qk_nope_head_dim));
  o.Set("qk_rope_head_dim", Value::Integer(qk_rope_head_dim));
  o.Set("v_head_dim", Value::Integer(v_head_dim));
  o.Set("n_routed_experts", Value::Integer(n_routed_experts));
  o.Set("n_shared_experts", Value::Integer(n_shared_experts));
  o.Set("num_experts_per_tok", Value::Integer(num_experts_per_tok));
  o.Set("n_group", Value::Integer(n_group));
  o.Set("topk_group", Value::Integer(topk_group));
  o.Set("routed_scaling_factor", Value::Number(routed_scaling_factor));
  o.Set("scoring_func", Value::String(scoring_func));
  o.Set("topk_method", Value::String(topk_method));
  o.Set("norm_topk_prob", Value::Bool(norm_topk_prob));
  o.Set("first_k_dense_replace", Value::Integer(first_k_dense_replace));
  o.Set("moe_layer_freq", Value::Integer(moe_layer_freq));
  o.Set("hidden_act", Value::String(hidden_act));
  o.Set("rms_norm_eps", Value::Number(rms_norm_eps));
  o.Set("rope_theta", Value::Number(rope_theta));
  o.Set("max_position_embeddings", Value::Integer(max_position_embeddings));
  if (rope_scaling.enabled) {
    Value rs = Value::Object();
    rs.Set("type", Value::String("yarn"));
    rs.Set("factor", Value::Number(rope_scaling.factor));
    rs.Set("original_max_position_embeddings",
           Value::Integer(rope_scaling.original_max_position_embeddings));
    rs.Set("beta_fast", Value::Number(rope_scaling.beta_fast));
    rs.Set("beta_slow", Value::Number(rope_scaling.beta_slow));
    // 0 means absent (see YarnConfig): omitted, which transformers reads the same way.
    if (rope_scaling.mscale != 0.0) rs.Set("mscale", Value::Number(rope_scaling.mscale));
    if (rope_scaling.mscale_all_dim != 0.0) {
      rs.Set("mscale_all_dim", Value::Number(rope_scaling.mscale_all_dim));
    }
    if (rope_scaling.attention_factor != 0.0) {
      rs.Set("attention_factor", Value::Number(rope_scaling.attention_factor));
    }
    o.Set("rope_scaling", std::move(rs));
  } else {
    o.Set("rope_scaling", Value::Null());
  }
  o.Set("bos_token_id", bos_token_id >= 0 ? Value::Integer(bos_token_id) : Value::Null());
  if (eos_token_ids.size() == 1) {
    o.Set("eos_token_id", Value::Integer(eos_token_ids[0]));
  } else if (eos_token_ids.empty()) {
    o.Set("eos_token_id", Value::Null());
  } else {
    Value ids = Value::Array();
    for (int64_t id : eos_token_ids) ids.Append(Value::Integer(id));
    o.Set("eos_token_id", std::move(ids));
  }
  o.Set("tie_word_embeddings", Value::Bool(tie_word_embeddings));
  o.Set("attention_bias", Value::Bool(false));
  o.Set("num_nextn_predict_layers", Value::Integer(num_nextn_predict_layers));
  if (quantization.fp8) {
    Value q = Value::Object();
    q.Set("activation_scheme", Value::String("dynamic"));
    q.Set("fmt", Value::String("e4m3"));
    q.Set("quant_method", Value::String("fp8"));
    q.Set("weight_block_size", Value::Array({Value::Integer(quantization.block_rows),
                                             Value::Integer(quantization.block_cols)}));
    if (!quantization.scale_fmt.empty()) q.Set("scale_fmt", Value::String(quantization.scale_fmt));
    o.Set("quantization_config", std::move(q));
  }
  o.Set("torch_dtype", Value::String("bfloat16"));
  return json::Serialize(o, /*indent=*/2) + "\n";
}

}  // namespace hmoe
