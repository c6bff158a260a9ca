#include "common/model/gguf_model.h"

#include <algorithm>
#include <charconv>
#include <cmath>
#include <cstring>
#include <map>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

#include "common/base/json.h"
#include "common/base/status_macros.h"
#include "common/model/tokenizer_internal.h"

namespace hmoe {
namespace {

absl::string_view Av(std::string_view s) { return absl::string_view(s.data(), s.size()); }

std::string ArchKey(std::string_view key) { return absl::StrCat("deepseek2.", Av(key)); }

absl::Status KeyError(std::string_view key, std::string_view what) {
  return absl::InvalidArgumentError(absl::StrCat("GGUF metadata ", Av(key), ": ", Av(what)));
}

// Integer key: absent -> `fallback` (required keys pass nullopt).
absl::StatusOr<int64_t> IntKey(const GgufModel& m, std::string_view key,
                               std::optional<int64_t> fallback) {
  const GgufValue* v = m.Find(key);
  if (v == nullptr) {
    if (fallback) return *fallback;
    return KeyError(key, "required key is missing");
  }
  std::optional<int64_t> i = v->AsInt();
  if (!i) {
    return KeyError(key, absl::StrCat("expected an integer, got ", Av(GgufValueTypeName(v->type))));
  }
  return *i;
}

absl::StatusOr<double> FloatKey(const GgufModel& m, std::string_view key,
                                std::optional<double> fallback) {
  const GgufValue* v = m.Find(key);
  if (v == nullptr) {
    if (fallback) return *fallback;
    return KeyError(key, "required key is missing");
  }
  if (v->type == GgufValueType::kF32) {
    // The decimal with the fewest digits that rounds to this float (1e-6 stays 1e-6, not
    // 9.99999997e-07): converters wrote config.json's decimal as f32.
    char buf[64];
    const float f = static_cast<float>(v->f);
    const auto end = std::to_chars(buf, buf + sizeof(buf), f).ptr;
    double d = 0.0;
    std::from_chars(buf, end, d);
    return d;
  }
  std::optional<double> d = v->AsDouble();
  if (!d)
    return KeyError(key, absl::StrCat("expected a number, got ", Av(GgufValueTypeName(v->type))));
  return *d;
}

absl::StatusOr<std::string> StringKey(const GgufModel& m, std::string_view key,
                                      std::optional<std::string> fallback) {
  const GgufValue* v = m.Find(key);
  if (v == nullptr) {
    if (fallback) return *fallback;
    return KeyError(key, "required key is missing");
  }
  if (v->type != GgufValueType::kString) {
    return KeyError(key, absl::StrCat("expected a string, got ", Av(GgufValueTypeName(v->type))));
  }
  return v->str;
}

absl::StatusOr<bool> BoolKey(const GgufModel& m, std::string_view key, bool fallback) {
  const GgufValue* v = m.Find(key);
  if (v == nullptr) return fallback;
  if (v->type != GgufValueType::kBool) {
    return KeyError(key, absl::StrCat("expected a bool, got ", Av(GgufValueTypeName(v->type))));
  }
  return v->u != 0;
}

std::string Blk(int64_t layer, std::string_view what) {
  return absl::StrCat("blk.", layer, ".", Av(what));
}

std::string NeString(const std::vector<int64_t>& ne) {
  return absl::StrCat("[", absl::StrJoin(ne, ", "), "]");
}

// HF per-layer suffix -> GGUF per-layer name (without "blk.N.").
struct SuffixMap {
  std::string_view hf;
  std::string_view gguf;
};
constexpr SuffixMap kLayerMap[] = {
    {"input_layernorm.weight", "attn_norm.weight"},
    {"post_attention_layernorm.weight", "ffn_norm.weight"},
    {"self_attn.q_proj.weight", "attn_q.weight"},
    {"self_attn.q_a_proj.weight", "attn_q_a.weight"},
    {"self_attn.q_a_layernorm.weight", "attn_q_a_norm.weight"},
    {"self_attn.q_b_proj.weight", "attn_q_b.weight"},
    {"self_attn.kv_a_proj_with_mqa.weight", "attn_kv_a_mqa.weight"},
    {"self_attn.kv_a_layernorm.weight", "attn_kv_a_norm.weight"},
    {"self_attn.kv_b_proj.weight", "attn_kv_b.weight"},
    {"self_attn.o_proj.weight", "attn_output.weight"},
    {"mlp.gate_proj.weight", "ffn_gate.weight"},
    {"mlp.up_proj.weight", "ffn_up.weight"},
    {"mlp.down_proj.weight", "ffn_down.weight"},
    {"mlp.gate.weight", "ffn_gate_inp.weight"},
    {"mlp.gate.e_score_correction_bias", "exp_probs_b.bias"},
    {"mlp.shared_experts.gate_proj.weight", "ffn_gate_shexp.weight"},
    {"mlp.shared_experts.up_proj.weight", "ffn_up_shexp.weight"},
    {"mlp.shared_experts.down_proj.weight", "ffn_down_shexp.weight"},
};

bool ParseInt(std::string_view s, int64_t* out) {
  if (s.empty() || s.size() > 9) return false;
  int64_t v = 0;
  for (char c : s) {
    if (c < '0' || c > '9') return false;
    v = v * 10 + (c - '0');
  }
  *out = v;
  return true;
}

// Expected GGUF tensors (name -> ne) of `config`.
std::map<std::string, std::vector<int64_t>> ExpectedGguf(const ModelConfig& config,
                                                         bool split_kv_b) {
  std::map<std::string, std::vector<int64_t>> out;
  for (const ExpectedTensor& t : ExpectedTensors(config)) {
    absl::StatusOr<GgufTensorRef> ref = GgufNameForHf(t.name, split_kv_b);
    if (!ref.ok()) continue;
    std::vector<int64_t> ne(t.shape.rbegin(), t.shape.rend());
    if (ref->expert >= 0) {
      ne.push_back(config.n_routed_experts);
    } else if (t.name.ends_with(layer_tensor::kKvBProj) && split_kv_b) {
      const int64_t nh = config.num_attention_heads, rkv = config.kv_lora_rank;
      out[Blk(t.layer, "attn_k_b.weight")] = {config.qk_nope_head_dim, rkv, nh};
      out[Blk(t.layer, "attn_v_b.weight")] = {rkv, config.v_head_dim, nh};
      continue;
    }
    out[ref->gguf_name] = ne;
  }
  return out;
}

}  // namespace

absl::StatusOr<GgufTensorRef> GgufNameForHf(std::string_view hf_name, bool split_kv_b) {
  if (hf_name == kEmbedTokensName) return GgufTensorRef{"token_embd.weight", -1};
  if (hf_name == kFinalNormName) return GgufTensorRef{"output_norm.weight", -1};
  if (hf_name == kLmHeadName) return GgufTensorRef{"output.weight", -1};
  constexpr std::string_view kPrefix = "model.layers.";
  if (hf_name.starts_with(kPrefix)) {
    std::string_view rest = hf_name.substr(kPrefix.size());
    const size_t dot = rest.find('.');
    int64_t layer = 0;
    if (dot != std::string_view::npos && ParseInt(rest.substr(0, dot), &layer)) {
      const std::string_view suffix = rest.substr(dot + 1);
      for (const SuffixMap& m : kLayerMap) {
        if (suffix != m.hf) continue;
        if (suffix == layer_tensor::kKvBProj && split_kv_b) {
          return GgufTensorRef{Blk(layer, "attn_k_b.weight"), -1};
        }
        return GgufTensorRef{Blk(layer, m.gguf), -1};
      }
      constexpr std::string_view kExperts = "mlp.experts.";
      if (suffix.starts_with(kExperts)) {
        std::string_view e = suffix.substr(kExperts.size());
        const size_t edot = e.find('.');
        int64_t expert = 0;
        if (edot != std::string_view::npos && ParseInt(e.substr(0, edot), &expert)) {
          const std::string_view proj = e.substr(edot + 1);
          if (proj == "gate_proj.weight")
            return GgufTensorRef{Blk(layer, "ffn_gate_exps.weight"), expert};
          if (proj == "up_proj.weight")
            return GgufTensorRef{Blk(layer, "ffn_up_exps.weight"), expert};
          if (proj == "down_proj.weight")
            return GgufTensorRef{Blk(layer, "ffn_down_exps.weight"), expert};
        }
      }
    }
  }
  return absl::NotFoundError(absl::StrCat("no GGUF tensor for ", Av(hf_name)));
}

absl::StatusOr<bool> GgufUsesSplitKvB(const GgufModel& model) {
  const bool kv_b = model.FindTensor("blk.0.attn_kv_b.weight") != nullptr;
  const bool k_b = model.FindTensor("blk.0.attn_k_b.weight") != nullptr;
  const bool v_b = model.FindTensor("blk.0.attn_v_b.weight") != nullptr;
  if (kv_b && !k_b && !v_b) return false;
  if (!kv_b && k_b && v_b) return true;
  return absl::InvalidArgumentError(absl::StrCat(
      "GGUF layer 0 must hold either blk.0.attn_kv_b.weight or both blk.0.attn_k_b.weight and "
      "blk.0.attn_v_b.weight (has kv_b: ",
      kv_b, ", k_b: ", k_b, ", v_b: ", v_b, ")"));
}

absl::StatusOr<ModelConfig> ModelConfigFromGguf(const GgufModel& m) {
  HMOE_ASSIGN_OR_RETURN(const std::string arch, StringKey(m, "general.architecture", std::nullopt));
  if (arch != kGgufArchDeepseek2) {
    return KeyError("general.architecture",
                    absl::StrCat("\"", arch, "\" is not supported (only \"deepseek2\")"));
  }
  ModelConfig c;
  HMOE_ASSIGN_OR_RETURN(const std::string pre, StringKey(m, "tokenizer.ggml.pre", ""));
  c.model_type = pre == "kimi-k2" ? "kimi_k2" : "deepseek_v3";
  const GgufTensorInfo* embd = m.FindTensor("token_embd.weight");
  const int64_t embd_rows = embd != nullptr && embd->ne.size() == 2 ? embd->ne[1] : -1;
  HMOE_ASSIGN_OR_RETURN(c.vocab_size, IntKey(m, ArchKey("vocab_size"), embd_rows));
  if (c.vocab_size < 0)
    return KeyError(ArchKey("vocab_size"), "missing (and no token_embd.weight)");
  HMOE_ASSIGN_OR_RETURN(c.hidden_size, IntKey(m, ArchKey("embedding_length"), std::nullopt));
  HMOE_ASSIGN_OR_RETURN(c.intermediate_size,
                        IntKey(m, ArchKey("feed_forward_length"), std::nullopt));
  HMOE_ASSIGN_OR_RETURN(c.moe_intermediate_size,
                        IntKey(m, ArchKey("expert_feed_forward_length"), std::nullopt));
  HMOE_ASSIGN_OR_RETURN(const int64_t blocks, IntKey(m, ArchKey("block_count"), std::nullopt));
  HMOE_ASSIGN_OR_RETURN(const int64_t nextn, IntKey(m, ArchKey("nextn_predict_layers"), 0));
  // MTP layers count in block_count only when the file holds them (the deepseek2 converter
  // skips them): then the main layers are the first block_count - nextn.
  const bool has_nextn =
      nextn > 0 && m.FindTensor(Blk(blocks - 1, "nextn.eh_proj.weight")) != nullptr;
  c.num_hidden_layers = has_nextn ? blocks - nextn : blocks;
  // Bounds before anything is sized from them (ExpectedTensors lists every expert of every
  // layer): each layer holds tensors, and no model has more than 65536 experts.
  const int64_t num_tensors = static_cast<int64_t>(m.Tensors().size());
  if (blocks < 0 || blocks > num_tensors) {
    return KeyError(ArchKey("block_count"),
                    absl::StrCat(blocks, " layers but the file holds ", num_tensors, " tensors"));
  }
  c.num_nextn_predict_layers = has_nextn ? nextn : 0;
  HMOE_ASSIGN_OR_RETURN(c.num_attention_heads,
                        IntKey(m, ArchKey("attention.head_count"), std::nullopt));
  HMOE_ASSIGN_OR_RETURN(const int64_t q_lora, IntKey(m, ArchKey("attention.q_lora_rank"), 0));
  if (q_lora > 0) c.q_lora_rank = q_lora;
  HMOE_ASSIGN_OR_RETURN(c.kv_lora_rank, IntKey(m, ArchKey("attention.kv_lora_rank"), std::nullopt));
  HMOE_ASSIGN_OR_RETURN(c.qk_rope_head_dim,
                        IntKey(m, ArchKey("rope.dimension_count"), std::nullopt));
  int64_t key_length = 0;
  if (m.Find(ArchKey("attention.key_length_mla")) != nullptr) {
    HMOE_ASSIGN_OR_RETURN(key_length, IntKey(m, ArchKey("attention.key_length_mla"), std::nullopt));
    HMOE_ASSIGN_OR_RETURN(c.v_head_dim,
                          IntKey(m, ArchKey("attention.value_length_mla"), std::nullopt));
  } else {
    HMOE_ASSIGN_OR_RETURN(key_length, IntKey(m, ArchKey("attention.key_length"), std::nullopt));
    HMOE_ASSIGN_OR_RETURN(c.v_head_dim, IntKey(m, ArchKey("attention.value_length"), std::nullopt));
  }
  c.qk_nope_head_dim = key_length - c.qk_rope_head_dim;
  HMOE_ASSIGN_OR_RETURN(c.n_routed_experts, IntKey(m, ArchKey("expert_count"), std::nullopt));
  if (c.n_routed_experts < 0 || c.n_routed_experts > 65536) {
    return KeyError(ArchKey("expert_count"), absl::StrCat(c.n_routed_experts, " is out of range"));
  }
  HMOE_ASSIGN_OR_RETURN(c.n_shared_experts, IntKey(m, ArchKey("expert_shared_count"), 0));
  HMOE_ASSIGN_OR_RETURN(c.num_experts_per_tok,
                        IntKey(m, ArchKey("expert_used_count"), std::nullopt));
  HMOE_ASSIGN_OR_RETURN(c.n_group, IntKey(m, ArchKey("expert_group_count"), 1));
  HMOE_ASSIGN_OR_RETURN(c.topk_group, IntKey(m, ArchKey("expert_group_used_count"), 1));
  HMOE_ASSIGN_OR_RETURN(c.routed_scaling_factor, FloatKey(m, ArchKey("expert_weights_scale"), 1.0));
  HMOE_ASSIGN_OR_RETURN(c.norm_topk_prob, BoolKey(m, ArchKey("expert_weights_norm"), false));
  HMOE_ASSIGN_OR_RETURN(c.first_k_dense_replace,
                        IntKey(m, ArchKey("leading_dense_block_count"), 0));
  const bool has_bias = m.FindTensor(Blk(c.first_k_dense_replace, "exp_probs_b.bias")) != nullptr;
  HMOE_ASSIGN_OR_RETURN(const int64_t gating, IntKey(m, ArchKey("expert_gating_func"), 0));
  if (gating == 1) {
    c.scoring_func = "softmax";
  } else if (gating == 2) {
    c.scoring_func = "sigmoid";
  } else if (gating == 0) {  // absent: the V3 family (router bias) is sigmoid, V2 softmax
    c.scoring_func = has_bias ? "sigmoid" : "softmax";
  } else {
    return KeyError(ArchKey("expert_gating_func"),
                    absl::StrCat("unknown value ", gating, " (1 softmax, 2 sigmoid)"));
  }
  c.topk_method = has_bias ? "noaux_tc" : (c.n_group > 1 ? "group_limited_greedy" : "greedy");
  HMOE_ASSIGN_OR_RETURN(c.rms_norm_eps,
                        FloatKey(m, ArchKey("attention.layer_norm_rms_epsilon"), std::nullopt));
  HMOE_ASSIGN_OR_RETURN(c.rope_theta, FloatKey(m, ArchKey("rope.freq_base"), 10000.0));
  HMOE_ASSIGN_OR_RETURN(c.max_position_embeddings,
                        IntKey(m, ArchKey("context_length"), std::nullopt));
  HMOE_ASSIGN_OR_RETURN(const std::string scaling,
                        StringKey(m, ArchKey("rope.scaling.type"), "none"));
  if (scaling == "yarn") {
    YarnConfig& y = c.rope_scaling;
    y.enabled = true;
    HMOE_ASSIGN_OR_RETURN(y.factor, FloatKey(m, ArchKey("rope.scaling.factor"), std::nullopt));
    HMOE_ASSIGN_OR_RETURN(y.original_max_position_embeddings,
                          IntKey(m, ArchKey("rope.scaling.original_context_length"), std::nullopt));
    HMOE_ASSIGN_OR_RETURN(y.beta_fast, FloatKey(m, ArchKey("rope.scaling.yarn_beta_fast"), 32.0));
    HMOE_ASSIGN_OR_RETURN(y.beta_slow, FloatKey(m, ArchKey("rope.scaling.yarn_beta_slow"), 1.0));
    // Converters write yarn_log_multiplier = 0.1 * mscale_all_dim; mscale is not written: every
    // published config has mscale == mscale_all_dim, which is assumed.
    HMOE_ASSIGN_OR_RETURN(const double log_mul,
                          FloatKey(m, ArchKey("rope.scaling.yarn_log_multiplier"), 0.0));
    y.mscale_all_dim = std::round(log_mul / 0.1 * 1e6) / 1e6;  // undo 0.1 * (f32 noise)
    y.mscale = y.mscale_all_dim == 0.0 ? 1.0 : y.mscale_all_dim;
  } else if (scaling != "none") {
    return KeyError(ArchKey("rope.scaling.type"),
                    absl::StrCat("\"", scaling, "\" is not supported (yarn or none)"));
  }
  HMOE_ASSIGN_OR_RETURN(c.bos_token_id, IntKey(m, "tokenizer.ggml.bos_token_id", -1));
  HMOE_ASSIGN_OR_RETURN(const int64_t eos, IntKey(m, "tokenizer.ggml.eos_token_id", -1));
  if (eos >= 0) c.eos_token_ids = {eos};
  c.tie_word_embeddings = m.FindTensor("output.weight") == nullptr;
  c.quantization = QuantizationConfig();
  if (absl::Status s = c.Validate(); !s.ok()) {
    return absl::InvalidArgumentError(
        absl::StrCat("GGUF metadata gives an inconsistent config: ", s.message()));
  }
  return c;
}

absl::Status ValidateGgufTensors(const ModelConfig& config, const GgufModel& model) {
  HMOE_ASSIGN_OR_RETURN(const bool split, GgufUsesSplitKvB(model));
  std::vector<std::string> problems;
  for (const auto& [name, ne] : ExpectedGguf(config, split)) {
    const GgufTensorInfo* t = model.FindTensor(name);
    if (t == nullptr) {
      problems.push_back(absl::StrCat("missing tensor ", name));
    } else if (t->ne != ne) {
      problems.push_back(absl::StrCat("tensor ", name, " has ne ", NeString(t->ne), ", expected ",
                                      NeString(ne), " (from the metadata)"));
    } else if (!GgmlTypeDequantizable(t->type)) {
      problems.push_back(absl::StrCat("tensor ", name, " has type ", GgmlTypeName(t->type),
                                      ", which is not supported (supported: F32, F16, BF16, "
                                      "Q8_0, Q5_0, Q4_K, Q5_K, Q6_K)"));
    }
  }
  if (problems.empty()) return absl::OkStatus();
  const size_t shown = std::min<size_t>(problems.size(), 5);
  return absl::InvalidArgumentError(absl::StrCat(
      "GGUF tensors do not match the model: ",
      absl::StrJoin(problems.begin(), problems.begin() + static_cast<long>(shown), "; "),
      problems.size() > shown ? absl::StrCat(" (", problems.size(), " problems)") : ""));
}

absl::StatusOr<std::vector<float>> DequantizeHfTensor(const ModelConfig& config,
                                                      const GgufModel& model,
                                                      std::string_view hf_name) {
  HMOE_ASSIGN_OR_RETURN(const bool split, GgufUsesSplitKvB(model));
  HMOE_ASSIGN_OR_RETURN(const GgufTensorRef ref, GgufNameForHf(hf_name, split));
  const GgufTensorInfo* t = model.FindTensor(ref.gguf_name);
  if (t == nullptr) return absl::NotFoundError(absl::StrCat("GGUF has no tensor ", ref.gguf_name));
  if (ref.expert >= 0) {
    if (t->ne.size() != 3 || ref.expert >= t->ne[2]) {
      return absl::InvalidArgumentError(absl::StrCat(
          "tensor ", t->name, " with ne ", NeString(t->ne), " has no expert ", ref.expert));
    }
    if (!GgmlTypeDequantizable(t->type)) return model.Dequantize(t->name).status();
    const int64_t per = t->ne[0] * t->ne[1];
    size_t offset = 0;
    HMOE_RETURN_IF_ERROR(GgmlBytes(t->type, per * ref.expert, &offset));
    std::vector<float> out(static_cast<size_t>(per));
    HMOE_RETURN_IF_ERROR(DequantizeGgml(t->type, t->data + offset, per, out.data()));
    return out;
  }
  if (!(split && hf_name.ends_with(layer_tensor::kKvBProj))) return model.Dequantize(t->name);
  // kv_b_proj [nh * (dn + dv), Rkv] from k_b [nh][Rkv][dn] and v_b [nh][dv][Rkv].
  const std::string vb_name =
      ref.gguf_name.substr(0, ref.gguf_name.size() - std::string_view("attn_k_b.weight").size()) +
      "attn_v_b.weight";
  const int64_t nh = config.num_attention_heads, rkv = config.kv_lora_rank;
  const int64_t dn = config.qk_nope_head_dim, dv = config.v_head_dim;
  const GgufTensorInfo* vt = model.FindTensor(vb_name);
  if (vt == nullptr) return absl::NotFoundError(absl::StrCat("GGUF has no tensor ", vb_name));
  if (t->ne != std::vector<int64_t>{dn, rkv, nh} || vt->ne != std::vector<int64_t>{rkv, dv, nh}) {
    return absl::InvalidArgumentError(absl::StrCat("tensors ", t->name, " ", NeString(t->ne), " / ",
                                                   vb_name, " ", NeString(vt->ne),
                                                   " do not match the config"));
  }
  HMOE_ASSIGN_OR_RETURN(const std::vector<float> kb, model.Dequantize(t->name));
  HMOE_ASSIGN_OR_RETURN(const std::vector<float> vb, model.Dequantize(vb_name));
  std::vector<float> out(static_cast<size_t>(nh * (dn + dv) * rkv));
  for (int64_t h = 0; h < nh; ++h) {
    for (int64_t i = 0; i < dn; ++i) {
      for (int64_t j = 0; j < rkv; ++j) {
        out[static_cast<size_t>((h * (dn + dv) + i) * rkv + j)] =
            kb[static_cast<size_t>((h * rkv + j) * dn + i)];
      }
    }
    for (int64_t i = 0; i < dv; ++i) {
      for (int64_t j = 0; j < rkv; ++j) {
        out[static_cast<size_t>((h * (dn + dv) + dn + i) * rkv + j)] =
            vb[static_cast<size_t>((h * dv + i) * rkv + j)];
      }
    }
  }
  return out;
}

// ---------------------------------------------------------------------------------- tokenizer

namespace {

constexpr int64_t kTokenNormal = 1, kTokenUnknown = 2, kTokenControl = 3, kTokenUserDefined = 4,
                  kTokenUnused = 5, kTokenByte = 6;

json::Value PreTokenizerJson(std::string_view pre) {
  auto split = [](internal::SplitRule rule) {
    return json::Value::Object({
        {"type", json::Value::String("Split")},
        {"pattern", json::Value::Object({{"Regex", json::Value::String(std::string(
                                                       internal::SplitRuleRegex(rule)))}})},
        {"behavior", json::Value::String("Isolated")},
        {"invert", json::Value::Bool(false)},
    });
  };
  auto byte_level = [](bool use_regex) {
    return json::Value::Object({{"type", json::Value::String("ByteLevel")},
                                {"add_prefix_space", json::Value::Bool(false)},
                                {"trim_offsets", json::Value::Bool(true)},
                                {"use_regex", json::Value::Bool(use_regex)}});
  };
  if (pre == "deepseek-v3") {
    return json::Value::Object(
        {{"type", json::Value::String("Sequence")},
         {"pretokenizers",
          json::Value::Array({split(internal::SplitRule::kDigits3),
                              split(internal::SplitRule::kCjkKana),
                              split(internal::SplitRule::kDeepSeekV3), byte_level(false)})}});
  }
  return byte_level(true);  // "gpt2" / "default": GPT-2's split rule
}

}  // namespace

absl::StatusOr<GgufTokenizerJson> GgufTokenizerToJson(const GgufModel& m) {
  HMOE_ASSIGN_OR_RETURN(const std::string model,
                        StringKey(m, "tokenizer.ggml.model", std::nullopt));
  if (model != "gpt2") {
    return KeyError(
        "tokenizer.ggml.model",
        absl::StrCat("\"", model, "\" is not supported (only the gpt2 byte-level BPE)"));
  }
  HMOE_ASSIGN_OR_RETURN(const std::string pre, StringKey(m, "tokenizer.ggml.pre", "default"));
  if (pre != "deepseek-v3" && pre != "gpt2" && pre != "default") {
    return KeyError(
        "tokenizer.ggml.pre",
        absl::StrCat("pre-tokenizer \"", pre, "\" is not supported (deepseek-v3, gpt2, default)"));
  }
  const GgufValue* tokens = m.Find("tokenizer.ggml.tokens");
  if (tokens == nullptr || tokens->type != GgufValueType::kArray ||
      tokens->array_type != GgufValueType::kString) {
    return KeyError("tokenizer.ggml.tokens", "required array of strings is missing");
  }
  const size_t n = tokens->array.size();
  const GgufValue* types = m.Find("tokenizer.ggml.token_type");
  if (types != nullptr && (types->type != GgufValueType::kArray || types->array.size() != n)) {
    return KeyError("tokenizer.ggml.token_type",
                    absl::StrCat("expected an array of ", n, " integers (one per token)"));
  }
  const GgufValue* merges = m.Find("tokenizer.ggml.merges");
  if (merges == nullptr || merges->type != GgufValueType::kArray ||
      merges->array_type != GgufValueType::kString) {
    return KeyError("tokenizer.ggml.merges", "required array of strings is missing");
  }
  std::vector<std::pair<std::string, json::Value>> vocab;  // Object() at the end: Set is linear
  json::Value added = json::Value::Array();
  for (size_t id = 0; id < n; ++id) {
    int64_t type = kTokenNormal;
    if (types != nullptr) {
      std::optional<int64_t> t = types->array[id].AsInt();
      if (!t) return KeyError("tokenizer.ggml.token_type", "elements must be integers");
      type = *t;
    }
    const std::string& text = tokens->array[id].str;
    switch (type) {
      case kTokenNormal:
      case kTokenByte:
        vocab.emplace_back(text, json::Value::Integer(static_cast<int64_t>(id)));
        break;
      case kTokenUnknown:
      case kTokenControl:
      case kTokenUserDefined:
        added.Append(json::Value::Object({
            {"id", json::Value::Integer(static_cast<int64_t>(id))},
            {"content", json::Value::String(text)},
            {"single_word", json::Value::Bool(false)},
            {"lstrip", json::Value::Bool(false)},
            {"rstrip", json::Value::Bool(false)},
            {"normalized", json::Value::Bool(type == kTokenUserDefined)},
            {"special", json::Value::Bool(type != kTokenUserDefined)},
        }));
        break;
      case kTokenUnused:
        break;
      default:
        return KeyError("tokenizer.ggml.token_type",
                        absl::StrCat("token ", id, " has unknown type ", type));
    }
  }
  json::Value merge_list = json::Value::Array();
  for (const GgufValue& v : merges->array) merge_list.Append(json::Value::String(v.str));
  json::Value root = json::Value::Object({
      {"version", json::Value::String("1.0")},
      {"added_tokens", std::move(added)},
      {"normalizer", json::Value::Null()},
      {"pre_tokenizer", PreTokenizerJson(pre)},
      {"post_processor", json::Value::Null()},
      {"decoder", json::Value::Object({{"type", json::Value::String("ByteLevel")},
                                       {"add_prefix_space", json::Value::Bool(true)},
                                       {"trim_offsets", json::Value::Bool(true)},
                                       {"use_regex", json::Value::Bool(true)}})},
      {"model", json::Value::Object({{"type", json::Value::String("BPE")},
                                     {"dropout", json::Value::Null()},
                                     {"unk_token", json::Value::Null()},
                                     {"byte_fallback", json::Value::Bool(false)},
                                     {"ignore_merges", json::Value::Bool(false)},
                                     {"vocab", json::Value::Object(std::move(vocab))},
                                     {"merges", std::move(merge_list)}})},
  });
  json::Value config = json::Value::Object();
  auto token_field = [&](std::string_view key, std::string_view field) -> absl::Status {
    HMOE_ASSIGN_OR_RETURN(const int64_t id, IntKey(m, key, -1));
    if (id < 0) return absl::OkStatus();
    if (static_cast<size_t>(id) >= n) {
      return KeyError(key, absl::StrCat("token id ", id, " is beyond the ", n, " tokens"));
    }
    config.Set(std::string(field), json::Value::String(tokens->array[static_cast<size_t>(id)].str));
    return absl::OkStatus();
  };
  HMOE_RETURN_IF_ERROR(token_field("tokenizer.ggml.bos_token_id", "bos_token"));
  HMOE_RETURN_IF_ERROR(token_field("tokenizer.ggml.eos_token_id", "eos_token"));
  HMOE_RETURN_IF_ERROR(token_field("tokenizer.ggml.padding_token_id", "pad_token"));
  HMOE_ASSIGN_OR_RETURN(const bool add_bos, BoolKey(m, "tokenizer.ggml.add_bos_token", false));
  config.Set("add_bos_token", json::Value::Bool(add_bos));
  HMOE_ASSIGN_OR_RETURN(const std::string tmpl, StringKey(m, "tokenizer.chat_template", ""));
  if (!tmpl.empty()) config.Set("chat_template", json::Value::String(tmpl));
  HMOE_ASSIGN_OR_RETURN(const int64_t ctx, IntKey(m, ArchKey("context_length"), 0));
  if (ctx > 0) config.Set("model_max_length", json::Value::Integer(ctx));
  return GgufTokenizerJson{json::Serialize(root), json::Serialize(config)};
}

absl::StatusOr<std::unique_ptr<Tokenizer>> TokenizerFromGguf(const GgufModel& model) {
  HMOE_ASSIGN_OR_RETURN(const GgufTokenizerJson j, GgufTokenizerToJson(model));
  absl::StatusOr<std::unique_ptr<Tokenizer>> t =
      Tokenizer::FromJson(j.tokenizer_json, j.tokenizer_config_json);
  if (!t.ok()) {
    return absl::InvalidArgumentError(
        absl::StrCat("GGUF tokenizer (tokenizer.ggml.*): ", t.status().message()));
  }
  return t;
}

std::string GgufChatTemplate(const GgufModel& model) {
  const GgufValue* v = model.Find("tokenizer.chat_template");
  return v != nullptr && v->type == GgufValueType::kString ? v->str : std::string();
}

// ---------------------------------------------------------------------------------- writing

std::vector<std::pair<std::string, GgufValue>> GgufMetadataForConfig(const ModelConfig& c,
                                                                     bool split_kv_b,
                                                                     uint32_t file_type) {
  std::vector<std::pair<std::string, GgufValue>> md;
  auto u32 = [&](std::string_view key, int64_t v) {
    md.emplace_back(ArchKey(key), GgufValue::U32(static_cast<uint32_t>(v)));
  };
  auto f32 = [&](std::string_view key, double v) {
    md.emplace_back(ArchKey(key), GgufValue::F32(static_cast<float>(v)));
  };
  md.emplace_back("general.architecture", GgufValue::String(std::string(kGgufArchDeepseek2)));
  md.emplace_back("general.name", GgufValue::String("hybridmoe synthetic"));
  md.emplace_back("general.file_type", GgufValue::U32(file_type));
  md.emplace_back("general.quantization_version", GgufValue::U32(2));
  u32("block_count", c.num_hidden_layers);
  u32("context_length", c.max_position_embeddings);
  u32("embedding_length", c.hidden_size);
  u32("feed_forward_length", c.intermediate_size);
  u32("attention.head_count", c.num_attention_heads);
  u32("attention.head_count_kv", split_kv_b ? 1 : c.num_attention_heads);
  f32("rope.freq_base", c.rope_theta);
  f32("attention.layer_norm_rms_epsilon", c.rms_norm_eps);
  u32("expert_used_count", c.num_experts_per_tok);
  u32("expert_group_count", c.n_group);
  u32("expert_group_used_count", c.topk_group);
  u32("leading_dense_block_count", c.first_k_dense_replace);
  u32("vocab_size", c.vocab_size);
  if (c.q_lora_rank) u32("attention.q_lora_rank", *c.q_lora_rank);
  u32("attention.kv_lora_rank", c.kv_lora_rank);
  if (split_kv_b) {
    u32("attention.key_length", c.kv_lora_rank + c.qk_rope_head_dim);
    u32("attention.value_length", c.kv_lora_rank);
    u32("attention.key_length_mla", c.qk_head_dim());
    u32("attention.value_length_mla", c.v_head_dim);
  } else {
    u32("attention.key_length", c.qk_head_dim());
    u32("attention.value_length", c.v_head_dim);
  }
  u32("expert_feed_forward_length", c.moe_intermediate_size);
  u32("expert_count", c.n_routed_experts);
  u32("expert_shared_count", c.n_shared_experts);
  f32("expert_weights_scale", c.routed_scaling_factor);
  md.emplace_back(ArchKey("expert_weights_norm"), GgufValue::Bool(c.norm_topk_prob));
  u32("expert_gating_func", c.scoring_func == "softmax" ? 1 : 2);
  u32("rope.dimension_count", c.qk_rope_head_dim);
  if (c.rope_scaling.enabled) {
    md.emplace_back(ArchKey("rope.scaling.type"), GgufValue::String("yarn"));
    f32("rope.scaling.factor", c.rope_scaling.factor);
    u32("rope.scaling.original_context_length", c.rope_scaling.original_max_position_embeddings);
    f32("rope.scaling.yarn_log_multiplier", 0.1 * c.rope_scaling.mscale_all_dim);
    f32("rope.scaling.yarn_beta_fast", c.rope_scaling.beta_fast);
    f32("rope.scaling.yarn_beta_slow", c.rope_scaling.beta_slow);
  }
  return md;
}

absl::StatusOr<std::vector<std::pair<std::string, GgufValue>>> GgufTokenizerMetadata(
    std::string_view tokenizer_json, std::string_view tokenizer_config_json, int64_t vocab_size) {
  HMOE_ASSIGN_OR_RETURN(const json::Value root, json::Parse(tokenizer_json));
  HMOE_ASSIGN_OR_RETURN(const json::Value config, json::Parse(tokenizer_config_json));
  const json::Value* model = root.Find("model");
  const json::Value* vocab = model != nullptr ? model->Find("vocab") : nullptr;
  const json::Value* merges = model != nullptr ? model->Find("merges") : nullptr;
  if (vocab == nullptr || !vocab->is_object() || merges == nullptr || !merges->is_array()) {
    return absl::InvalidArgumentError("tokenizer.json: model.vocab / model.merges missing");
  }
  std::vector<std::string> text(static_cast<size_t>(vocab_size));
  std::vector<int64_t> type(static_cast<size_t>(vocab_size), -1);
  auto put = [&](int64_t id, const std::string& s, int64_t t) -> absl::Status {
    if (id < 0 || id >= vocab_size) {
      return absl::InvalidArgumentError(
          absl::StrCat("token id ", id, " is beyond the vocabulary size ", vocab_size));
    }
    text[static_cast<size_t>(id)] = s;
    type[static_cast<size_t>(id)] = t;
    return absl::OkStatus();
  };
  for (const auto& [token, id] : vocab->members()) {
    HMOE_RETURN_IF_ERROR(put(id.as_int(), token, kTokenNormal));
  }
  if (const json::Value* added = root.Find("added_tokens"); added != nullptr && added->is_array()) {
    for (const json::Value& a : added->items()) {
      const json::Value* special = a.Find("special");
      const bool is_special = special != nullptr && special->is_bool() && special->as_bool();
      HMOE_RETURN_IF_ERROR(put(a.Find("id")->as_int(), a.Find("content")->as_string(),
                               is_special ? kTokenControl : kTokenUserDefined));
    }
  }
  std::map<std::string, int64_t> ids;
  std::vector<GgufValue> tokens, types;
  for (int64_t id = 0; id < vocab_size; ++id) {
    if (type[static_cast<size_t>(id)] < 0) {
      text[static_cast<size_t>(id)] = absl::StrCat("[PAD", id, "]");
      type[static_cast<size_t>(id)] = kTokenUnused;
    }
    ids.emplace(text[static_cast<size_t>(id)], id);
    tokens.push_back(GgufValue::String(text[static_cast<size_t>(id)]));
    types.push_back(GgufValue::I32(static_cast<int32_t>(type[static_cast<size_t>(id)])));
  }
  std::vector<GgufValue> merge_values;
  for (const json::Value& mv : merges->items()) {
    if (mv.is_string()) {
      merge_values.push_back(GgufValue::String(mv.as_string()));
    } else if (mv.is_array() && mv.items().size() == 2) {
      merge_values.push_back(GgufValue::String(
          absl::StrCat(mv.items()[0].as_string(), " ", mv.items()[1].as_string())));
    } else {
      return absl::InvalidArgumentError("tokenizer.json: a merge is neither \"a b\" nor [a, b]");
    }
  }
  std::vector<std::pair<std::string, GgufValue>> md;
  md.emplace_back("tokenizer.ggml.model", GgufValue::String("gpt2"));
  md.emplace_back("tokenizer.ggml.pre", GgufValue::String("deepseek-v3"));
  md.emplace_back("tokenizer.ggml.tokens",
                  GgufValue::Array(GgufValueType::kString, std::move(tokens)));
  md.emplace_back("tokenizer.ggml.token_type",
                  GgufValue::Array(GgufValueType::kI32, std::move(types)));
  md.emplace_back("tokenizer.ggml.merges",
                  GgufValue::Array(GgufValueType::kString, std::move(merge_values)));
  auto token_id = [&](std::string_view key, std::string_view gguf_key) {
    const json::Value* v = config.Find(key);
    std::string s;
    if (v != nullptr && v->is_string()) s = v->as_string();
    if (v != nullptr && v->is_object() && v->Find("content") != nullptr) {
      s = v->Find("content")->as_string();
    }
    const auto it = ids.find(s);
    if (!s.empty() && it != ids.end()) {
      md.emplace_back(std::string(gguf_key), GgufValue::U32(static_cast<uint32_t>(it->second)));
    }
  };
  token_id("bos_token", "tokenizer.ggml.bos_token_id");
  token_id("eos_token", "tokenizer.ggml.eos_token_id");
  token_id("pad_token", "tokenizer.ggml.padding_token_id");
  const json::Value* add_bos = config.Find("add_bos_token");
  md.emplace_back("tokenizer.ggml.add_bos_token",
                  GgufValue::Bool(add_bos != nullptr && add_bos->is_bool() && add_bos->as_bool()));
  if (const json::Value* t = config.Find("chat_template"); t != nullptr && t->is_string()) {
    md.emplace_back("tokenizer.chat_template", GgufValue::String(t->as_string()));
  }
  return md;
}

}  // namespace hmoe
