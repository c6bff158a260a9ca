#include "common/model/model_config.h"

#include <string>
#include <vector>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "common/base/json.h"
#include "common/base/mapped_file.h"
#include "tests/model/test_util.h"

namespace hmoe {
namespace {

using ::hmoe::json::Value;
using ::hmoe::testing::kDeepSeekV3ConfigJson;
using ::hmoe::testing::kKimiK2ConfigJson;
using ::hmoe::testing::kT1ConfigJson;
using ::hmoe::testing::WithField;
using ::hmoe::testing::WithoutField;
using ::testing::HasSubstr;

ModelConfig ParseOk(const std::string& text) {
  absl::StatusOr<ModelConfig> c = ModelConfig::FromJson(text);
  EXPECT_TRUE(c.ok()) << c.status();
  return c.ok() ? *c : ModelConfig();
}

// The error of parsing `text`; fails the test when parsing succeeds.
std::string ParseError(const std::string& text) {
  absl::StatusOr<ModelConfig> c = ModelConfig::FromJson(text);
  EXPECT_FALSE(c.ok()) << "parsed unexpectedly: " << text;
  if (c.ok()) return "";
  EXPECT_TRUE(absl::IsInvalidArgument(c.status())) << c.status();
  return std::string(c.status().message());
}

Value Obj(const std::string& text) { return *json::Parse(text); }

TEST(ModelConfigTest, ParsesDeepSeekV3) {
  const ModelConfig c = ParseOk(kDeepSeekV3ConfigJson);
  EXPECT_EQ(c.model_type, "deepseek_v3");
  EXPECT_EQ(c.vocab_size, 129280);
  EXPECT_EQ(c.hidden_size, 7168);
  EXPECT_EQ(c.intermediate_size, 18432);
  EXPECT_EQ(c.moe_intermediate_size, 2048);
  EXPECT_EQ(c.num_hidden_layers, 61);
  EXPECT_EQ(c.num_attention_heads, 128);
  EXPECT_EQ(c.q_lora_rank, 1536);
  EXPECT_EQ(c.kv_lora_rank, 512);
  EXPECT_EQ(c.qk_nope_head_dim, 128);
  EXPECT_EQ(c.qk_rope_head_dim, 64);
  EXPECT_EQ(c.qk_head_dim(), 192);
  EXPECT_EQ(c.v_head_dim, 128);
  EXPECT_EQ(c.n_routed_experts, 256);
  EXPECT_EQ(c.n_shared_experts, 1);
  EXPECT_EQ(c.num_experts_per_tok, 8);
  EXPECT_EQ(c.n_group, 8);
  EXPECT_EQ(c.topk_group, 4);
  EXPECT_DOUBLE_EQ(c.routed_scaling_factor, 2.5);
  EXPECT_EQ(c.scoring_func, "sigmoid");
  EXPECT_EQ(c.topk_method, "noaux_tc");
  EXPECT_TRUE(c.norm_topk_prob);
  EXPECT_EQ(c.first_k_dense_replace, 3);
  EXPECT_EQ(c.moe_layer_freq, 1);
  EXPECT_DOUBLE_EQ(c.rms_norm_eps, 1e-6);
  EXPECT_DOUBLE_EQ(c.rope_theta, 10000.0);
  EXPECT_EQ(c.max_position_embeddings, 163840);
  EXPECT_TRUE(c.rope_scaling.enabled);
  EXPECT_DOUBLE_EQ(c.rope_scaling.factor, 40.0);
  EXPECT_EQ(c.rope_scaling.original_max_position_embeddings, 4096);
  EXPECT_DOUBLE_EQ(c.rope_scaling.beta_fast, 32.0);
  EXPECT_DOUBLE_EQ(c.rope_scaling.beta_slow, 1.0);
  EXPECT_DOUBLE_EQ(c.rope_scaling.mscale, 1.0);
  EXPECT_DOUBLE_EQ(c.rope_scaling.mscale_all_dim, 1.0);
  EXPECT_EQ(c.bos_token_id, 0);
  EXPECT_EQ(c.eos_token_ids, std::vector<int64_t>({1}));
  EXPECT_FALSE(c.tie_word_embeddings);
  EXPECT_EQ(c.num_nextn_predict_layers, 1);
  EXPECT_TRUE(c.quantization.fp8);
  EXPECT_EQ(c.quantization.block_rows, 128);
  EXPECT_EQ(c.quantization.block_cols, 128);
  EXPECT_FALSE(c.is_moe_layer(2));
  EXPECT_TRUE(c.is_moe_layer(3));
  EXPECT_TRUE(c.is_moe_layer(60));
}

TEST(ModelConfigTest, DeepSeekV3SoftmaxScale) {
  // MODEL-SPEC 3.6: m = 0.1 ln 40 + 1 = 1.368888, scale = 192^-0.5 m^2 = 0.1352338.
  EXPECT_NEAR(ParseOk(kDeepSeekV3ConfigJson).softmax_scale(), 0.1352338, 5e-7);
}

TEST(ModelConfigTest, ParsesKimiK2) {
  const ModelConfig c = ParseOk(kKimiK2ConfigJson);
  EXPECT_EQ(c.model_type, "kimi_k2");
  EXPECT_EQ(c.num_attention_heads, 64);
  EXPECT_EQ(c.n_routed_experts, 384);
  EXPECT_EQ(c.n_group, 1);
  EXPECT_EQ(c.topk_group, 1);
  EXPECT_DOUBLE_EQ(c.routed_scaling_factor, 2.827);
  EXPECT_EQ(c.first_k_dense_replace, 1);
  EXPECT_EQ(c.vocab_size, 163840);
  EXPECT_DOUBLE_EQ(c.rope_theta, 50000.0);
  EXPECT_DOUBLE_EQ(c.rope_scaling.factor, 32.0);
  EXPECT_DOUBLE_EQ(c.rope_scaling.beta_fast, 1.0);
  EXPECT_EQ(c.max_position_embeddings, 131072);
  EXPECT_EQ(c.bos_token_id, 163584);
  EXPECT_EQ(c.eos_token_ids, std::vector<int64_t>({163585}));
  EXPECT_EQ(c.num_nextn_predict_layers, 0);
  EXPECT_TRUE(c.quantization.fp8);
}

TEST(ModelConfigTest, KimiK2SoftmaxScale) {
  // MODEL-SPEC 3.6: m = 0.1 ln 32 + 1 = 1.346574, scale = 0.1308608.
  EXPECT_NEAR(ParseOk(kKimiK2ConfigJson).softmax_scale(), 0.1308608, 5e-7);
}

TEST(ModelConfigTest, T1SoftmaxScale) {
  // MODEL-SPEC 7.1: 48^-0.5 (0.1 ln 4 + 1)^2 = 0.187130.
  const ModelConfig c = ParseOk(kT1ConfigJson);
  EXPECT_EQ(c.qk_head_dim(), 48);
  EXPECT_NEAR(c.softmax_scale(), 0.187130, 5e-6);
}

TEST(ModelConfigTest, SoftmaxScaleWithoutYarnIsPlainInverseSqrt) {
  const ModelConfig c = ParseOk(WithField(kT1ConfigJson, "rope_scaling", Value::Null()));
  EXPECT_FALSE(c.rope_scaling.enabled);
  EXPECT_DOUBLE_EQ(c.softmax_scale(), 1.0 / std::sqrt(48.0));
  // mscale_all_dim 0 (HF's default) also leaves the scale alone.
  const ModelConfig d = ParseOk(WithField(kT1ConfigJson, "rope_scaling",
                                          Obj(R"({"type": "yarn", "factor": 4, "mscale": 1.0})")));
  EXPECT_TRUE(d.rope_scaling.enabled);
  EXPECT_DOUBLE_EQ(d.softmax_scale(), 1.0 / std::sqrt(48.0));
}

// Every combination of rope_scaling.mscale / mscale_all_dim present, absent, null or 0, against
// values computed by hand from transformers' rules (modeling_rope_utils._compute_yarn_parameters
// for cos/sin, modeling_deepseek_v3.yarn_apply_mscale for the softmax scale), factor 8 and
// qk_head_dim 48: g(s, m) = 0.1 m ln s + 1; g(8, 1) = 1.2079441541679836,
// g(8, 1) / g(8, 0.5) = 1.094179988101349, 48^-0.5 = 0.14433756729740646,
// 48^-0.5 g(8, 1)^2 = 0.21060714172072306, 48^-0.5 g(8, 0.5)^2 = 0.1759120375763974.
TEST(ModelConfigTest, YarnMscaleCombinationsFollowTransformers) {
  struct Case {
    const char* extra;  // keys added to {"type": "yarn", "factor": 8, ...}
    double cos_sin;
    double softmax;
  };
  constexpr double kG1 = 1.2079441541679836, kPlain = 0.14433756729740646,
                   kAll1 = 0.21060714172072306, kAllHalf = 0.1759120375763974;
  const Case cases[] = {
      {"", kG1, kPlain},                                         // neither
      {R"(, "mscale": 1)", kG1, kPlain},                         // mscale only
      {R"(, "mscale": 2)", kG1, kPlain},                         // its value is not used
      {R"(, "mscale_all_dim": 1)", kG1, kAll1},                  // the known trap
      {R"(, "mscale": null, "mscale_all_dim": 1)", kG1, kAll1},  // null == absent
      {R"(, "mscale": 0, "mscale_all_dim": 1)", kG1, kAll1},     // 0 == absent (truthiness)
      {R"(, "mscale": 1, "mscale_all_dim": 1)", 1.0, kAll1},     // DeepSeek-V3, Kimi-K2
      {R"(, "mscale": 1, "mscale_all_dim": 0.5)", 1.094179988101349, kAllHalf},
      {R"(, "mscale": 1, "mscale_all_dim": 0)", kG1, kPlain},
      {R"(, "mscale": 1, "mscale_all_dim": null)", kG1, kPlain},
      {R"(, "mscale": 1, "mscale_all_dim": 1, "attention_factor": 1.5)", 1.5, kAll1},
      {R"(, "attention_factor": 0.75)", 0.75, kPlain},
  };
  for (const Case& k : cases) {
    const std::string rope = std::string(R"({"type": "yarn", "factor": 8)") + k.extra + "}";
    const ModelConfig c = ParseOk(WithField(kT1ConfigJson, "rope_scaling", Obj(rope)));
    EXPECT_NEAR(c.rope_attention_factor(), k.cos_sin, 1e-15) << rope;
    EXPECT_NEAR(c.softmax_scale(), k.softmax, 1e-15) << rope;
    // What hmoe-make-model writes reads back the same way.
    const ModelConfig again = ParseOk(c.ToJson());
    EXPECT_EQ(again.rope_attention_factor(), c.rope_attention_factor()) << rope;
    EXPECT_EQ(again.softmax_scale(), c.softmax_scale()) << rope;
  }
  // factor <= 1: g is 1 whatever the mscales.
  const ModelConfig one = ParseOk(WithField(
      kT1ConfigJson, "rope_scaling", Obj(R"({"type": "yarn", "factor": 1, "mscale_all_dim": 1})")));
  EXPECT_EQ(one.rope_attention_factor(), 1.0);
  EXPECT_EQ(one.softmax_scale(), kPlain);
  // What we do not implement is refused, not misread.
  EXPECT_THAT(ParseError(WithField(kT1ConfigJson, "rope_scaling",
                                   Obj(R"({"type": "yarn", "factor": 8, "truncate": false})"))),
              HasSubstr("field \"rope_scaling.truncate\": only true"));
  EXPECT_THAT(ParseError(WithField(kT1ConfigJson, "rope_scaling",
                                   Obj(R"({"type": "yarn", "factor": 8, "attention_factor": 0})"))),
              HasSubstr("field \"rope_scaling.attention_factor\": must be a finite number > 0"));
}

TEST(ModelConfigTest, KimiTextConfigNesting) {
  // K2.5-style: the language model's fields under "text_config", quantization at the top.
  json::Value text = Obj(kKimiK2ConfigJson);
  json::Value outer = json::Value::Object();
  outer.Set("architectures", Value::Array({Value::String("KimiK25ForConditionalGeneration")}));
  outer.Set("model_type", Value::String("kimi_k25"));
  std::vector<std::pair<std::string, Value>> inner;
  for (const auto& m : text.members()) {
    if (m.first == "quantization_config") {
      outer.Set(m.first, m.second);
    } else {
      inner.push_back(m);
    }
  }
  outer.Set("text_config", Value::Object(std::move(inner)));
  const ModelConfig nested = ParseOk(json::Serialize(outer));
  EXPECT_EQ(nested, ParseOk(kKimiK2ConfigJson));
  EXPECT_TRUE(nested.quantization.fp8);
  // Errors name the nested location.
  json::Value bad = outer;
  json::Value bad_inner = *outer.Find("text_config");
  bad_inner.Set("hidden_size", Value::String("7168"));
  bad.Set("text_config", bad_inner);
  EXPECT_THAT(ParseError(json::Serialize(bad)), HasSubstr("field \"text_config.hidden_size\""));
  EXPECT_THAT(ParseError(WithField(kT1ConfigJson, "text_config", Value::Integer(1))),
              HasSubstr("field \"text_config\""));
}

TEST(ModelConfigTest, EosTokenIdMayBeAListOrNull) {
  const ModelConfig a = ParseOk(WithField(kT1ConfigJson, "eos_token_id", Obj("[1, 2, 1000]")));
  EXPECT_EQ(a.eos_token_ids, std::vector<int64_t>({1, 2, 1000}));
  const ModelConfig b = ParseOk(WithField(kT1ConfigJson, "eos_token_id", Value::Null()));
  EXPECT_TRUE(b.eos_token_ids.empty());
  EXPECT_THAT(ParseError(WithField(kT1ConfigJson, "eos_token_id", Obj("[1, \"2\"]"))),
              HasSubstr("field \"eos_token_id[1]\""));
  EXPECT_THAT(ParseError(WithField(kT1ConfigJson, "eos_token_id", Obj("[1, 5000]"))),
              HasSubstr("field \"eos_token_id\""));
}

TEST(ModelConfigTest, QLoraRankNullMeansSingleQProj) {
  const ModelConfig c = ParseOk(WithField(kT1ConfigJson, "q_lora_rank", Value::Null()));
  EXPECT_FALSE(c.q_lora_rank.has_value());
  EXPECT_THAT(ParseError(WithField(kT1ConfigJson, "q_lora_rank", Value::Integer(0))),
              HasSubstr("field \"q_lora_rank\": must be > 0"));
}

TEST(ModelConfigTest, QuantizationConfigIsOptional) {
  const ModelConfig c = ParseOk(WithoutField(kT1ConfigJson, "quantization_config"));
  EXPECT_FALSE(c.quantization.fp8);
  const ModelConfig n = ParseOk(WithField(kT1ConfigJson, "quantization_config", Value::Null()));
  EXPECT_FALSE(n.quantization.fp8);
}

TEST(ModelConfigTest, QuantizationConfigIsValidated) {
  EXPECT_THAT(ParseError(WithField(kT1ConfigJson, "quantization_config",
                                   Obj(R"({"quant_method": "compressed-tensors"})"))),
              HasSubstr("field \"quantization_config.quant_method\""));
  EXPECT_THAT(ParseError(WithField(kT1ConfigJson, "quantization_config",
                                   Obj(R"({"quant_method": "fp8", "fmt": "e5m2"})"))),
              HasSubstr("field \"quantization_config.fmt\""));
  EXPECT_THAT(
      ParseError(WithField(kT1ConfigJson, "quantization_config",
                           Obj(R"({"quant_method": "fp8", "weight_block_size": [64, 64]})"))),
      HasSubstr("field \"quantization_config.weight_block_size\""));
  EXPECT_THAT(ParseError(WithField(kT1ConfigJson, "quantization_config",
                                   Obj(R"({"quant_method": "fp8", "weight_block_size": 128})"))),
              HasSubstr("field \"quantization_config.weight_block_size\""));
  EXPECT_THAT(
      ParseError(WithField(kT1ConfigJson, "quantization_config", Obj(R"({"fmt": "e4m3"})"))),
      HasSubstr("field \"quantization_config.quant_method\": missing"));
  EXPECT_THAT(ParseError(WithField(kT1ConfigJson, "quantization_config",
                                   Obj(R"({"quant_method": "fp8", "scale_fmt": "x"})"))),
              HasSubstr("field \"quantization_config.scale_fmt\""));
  const ModelConfig v31 =
      ParseOk(WithField(kT1ConfigJson, "quantization_config",
                        Obj(R"({"quant_method": "fp8", "scale_fmt": "ue8m0"})")));
  EXPECT_EQ(v31.quantization.scale_fmt, "ue8m0");
}

TEST(ModelConfigTest, MissingRequiredFieldIsNamed) {
  for (const char* field :
       {"model_type", "vocab_size", "hidden_size", "intermediate_size", "moe_intermediate_size",
        "num_hidden_layers", "num_attention_heads", "kv_lora_rank", "qk_nope_head_dim",
        "qk_rope_head_dim", "v_head_dim", "n_routed_experts", "num_experts_per_tok"}) {
    EXPECT_THAT(ParseError(WithoutField(kT1ConfigJson, field)),
                HasSubstr(absl::StrCat("field \"", field, "\": missing")))
        << field;
  }
}

TEST(ModelConfigTest, OptionalFieldsTakeHuggingFaceDefaults) {
  std::string text = kT1ConfigJson;
  for (const char* field : {"n_shared_experts",
                            "n_group",
                            "topk_group",
                            "routed_scaling_factor",
                            "scoring_func",
                            "topk_method",
                            "norm_topk_prob",
                            "first_k_dense_replace",
                            "moe_layer_freq",
                            "hidden_act",
                            "rms_norm_eps",
                            "rope_theta",
                            "max_position_embeddings",
                            "rope_scaling",
                            "bos_token_id",
                            "eos_token_id",
                            "tie_word_embeddings",
                            "num_nextn_predict_layers",
                            "q_lora_rank",
                            "quantization_config"}) {
    text = WithoutField(text, field);
  }
  const ModelConfig c = ParseOk(text);
  EXPECT_EQ(c.n_shared_experts, 1);
  EXPECT_EQ(c.n_group, 8);
  EXPECT_EQ(c.topk_group, 4);
  EXPECT_DOUBLE_EQ(c.routed_scaling_factor, 2.5);
  EXPECT_EQ(c.scoring_func, "sigmoid");
  EXPECT_EQ(c.topk_method, "noaux_tc");
  EXPECT_TRUE(c.norm_topk_prob);
  EXPECT_EQ(c.first_k_dense_replace, 3);
  EXPECT_EQ(c.moe_layer_freq, 1);
  EXPECT_EQ(c.hidden_act, "silu");
  EXPECT_DOUBLE_EQ(c.rms_norm_eps, 1e-6);
  EXPECT_DOUBLE_EQ(c.rope_theta, 10000.0);
  EXPECT_EQ(c.max_position_embeddings, 4096);
  EXPECT_FALSE(c.rope_scaling.enabled);
  EXPECT_EQ(c.bos_token_id, 0);
  EXPECT_EQ(c.eos_token_ids, std::vector<int64_t>({1}));
  EXPECT_FALSE(c.tie_word_embeddings);
  EXPECT_EQ(c.num_nextn_predict_layers, 0);
  EXPECT_EQ(c.q_lora_rank, 1536);
  EXPECT_FALSE(c.quantization.fp8);
}

TEST(ModelConfigTest, WrongTypeIsNamed) {
  struct Case {
    const char* field;
    Value value;
    const char* expected;
  };
  const Case cases[] = {
      {"hidden_size", Value::String("7168"),
       "field \"hidden_size\": expected an integer, got string"},
      {"hidden_size", Value::Number(7168.5), "field \"hidden_size\": expected an integer"},
      {"num_hidden_layers", Value::Null(),
       "field \"num_hidden_layers\": expected an integer, got null"},
      {"q_lora_rank", Value::Bool(true), "field \"q_lora_rank\": expected an integer, got bool"},
      {"norm_topk_prob", Value::Integer(1), "field \"norm_topk_prob\": expected a boolean"},
      {"routed_scaling_factor", Value::String("2.5"),
       "field \"routed_scaling_factor\": expected a number"},
      {"scoring_func", Value::Integer(0), "field \"scoring_func\": expected a string"},
      {"model_type", Value::Array(), "field \"model_type\": expected a string, got array"},
      {"rope_scaling", Value::String("yarn"), "field \"rope_scaling\": expected an object or null"},
      {"quantization_config", Value::Array(), "field \"quantization_config\": expected an object"},
      {"tie_word_embeddings", Value::String("false"), "field \"tie_word_embeddings\""},
  };
  for (const Case& c : cases) {
    EXPECT_THAT(ParseError(WithField(kT1ConfigJson, c.field, c.value)), HasSubstr(c.expected))
        << c.field;
  }
  // Integral floating-point literals are accepted for integer fields.
  EXPECT_EQ(ParseOk(WithField(kT1ConfigJson, "hidden_size", Value::Number(256.0))).hidden_size,
            256);
}

TEST(ModelConfigTest, RopeScalingFieldsAreNamed) {
  auto with_rope = [](const std::string& rope) {
    return WithField(kT1ConfigJson, "rope_scaling", Obj(rope));
  };
  EXPECT_THAT(ParseError(with_rope(R"({"type": "linear", "factor": 2})")),
              HasSubstr("field \"rope_scaling.type\": unsupported rope scaling type \"linear\""));
  EXPECT_THAT(ParseError(with_rope(R"({"factor": 2})")), HasSubstr("field \"rope_scaling.type\""));
  EXPECT_THAT(ParseError(with_rope(R"({"type": "yarn", "factor": "4"})")),
              HasSubstr("field \"rope_scaling.factor\": expected a number"));
  EXPECT_THAT(ParseError(with_rope(R"({"type": "yarn", "factor": 0})")),
              HasSubstr("field \"rope_scaling.factor\": must be"));
  EXPECT_THAT(ParseError(with_rope(R"({"type": "yarn", "factor": -2})")),
              HasSubstr("field \"rope_scaling.factor\""));
  EXPECT_THAT(ParseError(with_rope(R"({"type": "yarn", "factor": 4, "beta_fast": 0})")),
              HasSubstr("field \"rope_scaling.beta_fast\""));
  EXPECT_THAT(ParseError(with_rope(R"({"type": "yarn", "factor": 4, "beta_slow": "1"})")),
              HasSubstr("field \"rope_scaling.beta_slow\""));
  EXPECT_THAT(ParseError(with_rope(
                  R"({"type": "yarn", "factor": 4, "original_max_position_embeddings": 0})")),
              HasSubstr("field \"rope_scaling.original_max_position_embeddings\""));
  EXPECT_THAT(ParseError(with_rope(R"({"type": "yarn", "factor": 4, "mscale_all_dim": true})")),
              HasSubstr("field \"rope_scaling.mscale_all_dim\""));
  // New-style "rope_type"; factor derived from the lengths when absent (HF).
  const ModelConfig c =
      ParseOk(with_rope(R"({"rope_type": "yarn", "original_max_position_embeddings": 256})"));
  EXPECT_TRUE(c.rope_scaling.enabled);
  EXPECT_DOUBLE_EQ(c.rope_scaling.factor, 4.0);  // 1024 / 256
  EXPECT_DOUBLE_EQ(c.rope_scaling.beta_fast, 32.0);
  EXPECT_DOUBLE_EQ(c.rope_scaling.mscale_all_dim, 0.0);
  EXPECT_FALSE(ParseOk(with_rope(R"({"rope_type": "default"})")).rope_scaling.enabled);
}

TEST(ModelConfigTest, InconsistentValuesAreNamed) {
  struct Case {
    std::vector<std::pair<const char*, Value>> set;
    const char* expected;
  };
  const Case cases[] = {
      {{{"hidden_size", Value::Integer(0)}}, "field \"hidden_size\": must be > 0, got 0"},
      {{{"vocab_size", Value::Integer(-5)}}, "field \"vocab_size\": must be > 0"},
      {{{"num_attention_heads", Value::Integer(0)}}, "field \"num_attention_heads\""},
      {{{"qk_rope_head_dim", Value::Integer(15)}}, "field \"qk_rope_head_dim\": must be even"},
      {{{"n_group", Value::Integer(3)}},
       "field \"n_group\": n_routed_experts (16) is not divisible"},
      {{{"n_group", Value::Integer(0)}}, "field \"n_group\": must be > 0"},
      {{{"topk_group", Value::Integer(5)}}, "field \"topk_group\": 5 exceeds n_group (4)"},
      {{{"topk_group", Value::Integer(1)}, {"num_experts_per_tok", Value::Integer(5)}},
       "field \"topk_group\": topk_group (1) groups of 4 experts cannot supply"},
      {{{"num_experts_per_tok", Value::Integer(17)},
        {"n_group", Value::Integer(1)},
        {"topk_group", Value::Integer(1)}},
       "field \"num_experts_per_tok\": 17 exceeds n_routed_experts (16)"},
      {{{"num_experts_per_tok", Value::Integer(0)}}, "field \"num_experts_per_tok\": must be > 0"},
      {{{"n_group", Value::Integer(16)}, {"topk_group", Value::Integer(8)}},
       "field \"n_group\": noaux_tc scores a group by its top-2"},
      {{{"first_k_dense_replace", Value::Integer(5)}}, "field \"first_k_dense_replace\""},
      {{{"first_k_dense_replace", Value::Integer(-1)}}, "field \"first_k_dense_replace\""},
      {{{"moe_layer_freq", Value::Integer(0)}}, "field \"moe_layer_freq\""},
      {{{"scoring_func", Value::String("tanh")}}, "field \"scoring_func\": unsupported \"tanh\""},
      {{{"topk_method", Value::String("top1")}}, "field \"topk_method\": unsupported \"top1\""},
      {{{"hidden_act", Value::String("gelu")}}, "field \"hidden_act\""},
      {{{"model_type", Value::String("llama")}}, "field \"model_type\": unsupported model type"},
      {{{"rms_norm_eps", Value::Number(0.0)}}, "field \"rms_norm_eps\""},
      {{{"rope_theta", Value::Number(-1.0)}}, "field \"rope_theta\""},
      {{{"routed_scaling_factor", Value::Number(0.0)}}, "field \"routed_scaling_factor\""},
      {{{"max_position_embeddings", Value::Integer(0)}}, "field \"max_position_embeddings\""},
      {{{"n_shared_experts", Value::Integer(-1)}}, "field \"n_shared_experts\""},
      {{{"bos_token_id", Value::Integer(1024)}}, "field \"bos_token_id\""},
      {{{"eos_token_id", Value::Integer(-3)}}, "field \"eos_token_id\""},
      {{{"num_nextn_predict_layers", Value::Integer(-1)}}, "field \"num_nextn_predict_layers\""},
      {{{"attention_bias", Value::Bool(true)}}, "field \"attention_bias\""},
  };
  for (const Case& c : cases) {
    std::string text = kT1ConfigJson;
    for (const auto& [field, value] : c.set) text = WithField(text, field, value);
    EXPECT_THAT(ParseError(text), HasSubstr(c.expected)) << c.expected;
  }
}

TEST(ModelConfigTest, AlternativeRoutingSettingsAreAccepted) {
  std::string text = WithField(kT1ConfigJson, "scoring_func", Value::String("softmax"));
  text = WithField(text, "topk_method", Value::String("group_limited_greedy"));
  const ModelConfig c = ParseOk(text);
  EXPECT_EQ(c.scoring_func, "softmax");
  EXPECT_EQ(c.topk_method, "group_limited_greedy");
  // n_shared_experts null means none (hub remote code).
  EXPECT_EQ(ParseOk(WithField(kT1ConfigJson, "n_shared_experts", Value::Null())).n_shared_experts,
            0);
}

TEST(ModelConfigTest, MoeLayerSelection) {
  ModelConfig c = ParseOk(WithField(kT1ConfigJson, "moe_layer_freq", Value::Integer(2)));
  EXPECT_FALSE(c.is_moe_layer(0));  // dense (first_k_dense_replace = 1)
  EXPECT_FALSE(c.is_moe_layer(1));  // 1 % 2 != 0
  EXPECT_TRUE(c.is_moe_layer(2));
  EXPECT_FALSE(c.is_moe_layer(3));
}

TEST(ModelConfigTest, BadJsonNamesFileAndOffset) {
  const std::string msg = ParseError("{\"hidden_size\": 7168,}");
  EXPECT_THAT(msg, HasSubstr("config.json"));
  EXPECT_THAT(msg, HasSubstr("at byte"));
  EXPECT_THAT(ParseError("[1, 2]"), HasSubstr("expected a JSON object"));
}

TEST(ModelConfigTest, ErrorsArePrefixedWithConfigJson) {
  EXPECT_THAT(ParseError(WithoutField(kT1ConfigJson, "hidden_size")),
              ::testing::StartsWith("config.json: field \"hidden_size\""));
}

TEST(ModelConfigTest, ToJsonRoundTrips) {
  std::vector<std::string> texts = {kDeepSeekV3ConfigJson, kKimiK2ConfigJson, kT1ConfigJson};
  texts.push_back(WithField(kT1ConfigJson, "q_lora_rank", Value::Null()));
  texts.push_back(WithField(kT1ConfigJson, "bos_token_id", Value::Null()));
  texts.push_back(WithField(kT1ConfigJson, "eos_token_id", Obj("[1, 7]")));
  texts.push_back(WithField(kT1ConfigJson, "eos_token_id", Value::Null()));
  texts.push_back(WithField(kT1ConfigJson, "rope_scaling", Value::Null()));
  texts.push_back(WithoutField(kT1ConfigJson, "quantization_config"));
  texts.push_back(WithField(kT1ConfigJson, "quantization_config",
                            Obj(R"({"quant_method": "fp8", "scale_fmt": "ue8m0"})")));
  texts.push_back(WithField(kT1ConfigJson, "rms_norm_eps", Value::Number(1.0 / 3.0)));
  for (const std::string& text : texts) {
    const ModelConfig c = ParseOk(text);
    const std::string out = c.ToJson();
    absl::StatusOr<ModelConfig> back = ModelConfig::FromJson(out);
    ASSERT_TRUE(back.ok()) << back.status() << "\n" << out;
    EXPECT_EQ(*back, c) << out;
    EXPECT_EQ(back->ToJson(), out);
  }
}

TEST(ModelConfigTest, ToJsonIsHuggingFaceShaped) {
  const std::string out = ParseOk(kDeepSeekV3ConfigJson).ToJson();
  absl::StatusOr<Value> v = json::Parse(out);
  ASSERT_TRUE(v.ok());
  EXPECT_EQ(v->Find("architectures")->items()[0].as_string(), "DeepseekV3ForCausalLM");
  EXPECT_EQ(v->Find("num_key_value_heads")->as_int(), 128);
  EXPECT_EQ(v->Find("rope_scaling")->Find("type")->as_string(), "yarn");
  EXPECT_EQ(v->Find("quantization_config")->Find("quant_method")->as_string(), "fp8");
  EXPECT_EQ(v->Find("eos_token_id")->as_int(), 1);
  EXPECT_THAT(out, HasSubstr("\"rope_theta\": 10000.0"));  // float stays float for Python
}

TEST(ModelConfigTest, DefaultConstructedConfigFailsValidation) {
  const absl::Status s = ModelConfig().Validate();
  EXPECT_TRUE(absl::IsInvalidArgument(s));
  EXPECT_THAT(s.message(), HasSubstr("field \"model_type\""));
}

TEST(ModelConfigTest, FromFile) {
  hmoe::testing::TempDir dir;
  const std::string path = dir.File("config.json");
  ASSERT_TRUE(WriteFileAtomically(path, kT1ConfigJson).ok());
  absl::StatusOr<ModelConfig> c = ModelConfig::FromFile(path);
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->hidden_size, 256);
  EXPECT_TRUE(absl::IsNotFound(ModelConfig::FromFile(dir.File("nope.json")).status()));
  ASSERT_TRUE(WriteFileAtomically(path, WithoutField(kT1ConfigJson, "v_head_dim")).ok());
  const absl::Status s = ModelConfig::FromFile(path).status();
  EXPECT_THAT(s.message(), HasSubstr(path));
  EXPECT_THAT(s.message(), HasSubstr("field \"v_head_dim\": missing"));
}

}  // namespace
}  // namespace hmoe
