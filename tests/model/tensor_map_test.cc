#include "common/model/tensor_map.h"

#include <map>
#include <set>
#include <string>
#include <vector>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "common/base/json.h"
#include "tests/model/test_util.h"

namespace hmoe {
namespace {

using ::hmoe::json::Value;
using ::hmoe::testing::FakeWeightSource;
using ::hmoe::testing::kDeepSeekV3ConfigJson;
using ::hmoe::testing::kKimiK2ConfigJson;
using ::hmoe::testing::kT1ConfigJson;
using ::hmoe::testing::WithField;
using ::testing::HasSubstr;

ModelConfig Config(const std::string& text) {
  absl::StatusOr<ModelConfig> c = ModelConfig::FromJson(text);
  EXPECT_TRUE(c.ok()) << c.status();
  return *c;
}

std::map<std::string, ExpectedTensor> ByName(const std::vector<ExpectedTensor>& tensors) {
  std::map<std::string, ExpectedTensor> m;
  for (const ExpectedTensor& t : tensors) {
    EXPECT_TRUE(m.emplace(t.name, t).second) << "duplicate " << t.name;
  }
  return m;
}

using Shape = std::vector<int64_t>;

TEST(TensorNamesTest, Helpers) {
  EXPECT_EQ(LayerTensorName(3, layer_tensor::kOProj), "model.layers.3.self_attn.o_proj.weight");
  EXPECT_EQ(LayerTensorName(0, layer_tensor::kQAProj), "model.layers.0.self_attn.q_a_proj.weight");
  EXPECT_EQ(LayerTensorName(60, layer_tensor::kRouterBias),
            "model.layers.60.mlp.gate.e_score_correction_bias");
  EXPECT_EQ(LayerTensorName(7, layer_tensor::kInputLayernorm),
            "model.layers.7.input_layernorm.weight");
  EXPECT_EQ(ExpertTensorName(5, 17, kDownProj), "model.layers.5.mlp.experts.17.down_proj.weight");
  EXPECT_EQ(ExpertTensorName(3, 0, kGateProj), "model.layers.3.mlp.experts.0.gate_proj.weight");
  EXPECT_EQ(SharedExpertTensorName(4, kUpProj), "model.layers.4.mlp.shared_experts.up_proj.weight");
  EXPECT_EQ(kEmbedTokensName, "model.embed_tokens.weight");
  EXPECT_EQ(kFinalNormName, "model.norm.weight");
  EXPECT_EQ(kLmHeadName, "lm_head.weight");
}

TEST(TensorKindTest, AllowedDTypes) {
  EXPECT_TRUE(DTypeAllowed(TensorKind::kLinear, DType::kF8E4M3));
  EXPECT_TRUE(DTypeAllowed(TensorKind::kLinear, DType::kBF16));
  EXPECT_FALSE(DTypeAllowed(TensorKind::kLinear, DType::kI8));
  EXPECT_FALSE(DTypeAllowed(TensorKind::kEmbedding, DType::kF8E4M3));
  EXPECT_FALSE(DTypeAllowed(TensorKind::kRouter, DType::kF8E4M3));
  EXPECT_TRUE(DTypeAllowed(TensorKind::kRouter, DType::kBF16));
  EXPECT_FALSE(DTypeAllowed(TensorKind::kNorm, DType::kF8E4M3));
  EXPECT_TRUE(DTypeAllowed(TensorKind::kNorm, DType::kF32));
  EXPECT_TRUE(DTypeAllowed(TensorKind::kBias, DType::kF32));
  EXPECT_FALSE(DTypeAllowed(TensorKind::kBias, DType::kBF16));
  EXPECT_EQ(TensorKindName(TensorKind::kRouter), "router");
}

TEST(ExpectedTensorsTest, DeepSeekV3Inventory) {
  const ModelConfig c = Config(kDeepSeekV3ConfigJson);
  const std::vector<ExpectedTensor> tensors = ExpectedTensors(c);
  // 3 global + 3 dense layers x (9 attention/norm + 3 MLP) + 58 MoE layers x (9 + router weight
  // and bias + 256 x 3 experts + 3 shared).
  EXPECT_EQ(tensors.size(), 3u + 3 * 12 + 58 * (9 + 2 + 768 + 3));
  EXPECT_EQ(tensors.size(), 45395u);
  size_t quantizable = 0;
  for (const ExpectedTensor& t : tensors) quantizable += t.quantizable();
  EXPECT_EQ(quantizable, 3u * 8 + 58 * 776);
  const auto m = ByName(tensors);
  auto shape = [&](const std::string& name) {
    const auto it = m.find(name);
    EXPECT_NE(it, m.end()) << name;
    return it == m.end() ? Shape{} : it->second.shape;
  };
  EXPECT_EQ(tensors.front().name, "model.embed_tokens.weight");
  EXPECT_EQ(shape("model.embed_tokens.weight"), (Shape{129280, 7168}));
  EXPECT_EQ(shape("model.norm.weight"), (Shape{7168}));
  EXPECT_EQ(shape("lm_head.weight"), (Shape{129280, 7168}));
  EXPECT_FALSE(m.at("lm_head.weight").quantizable());
  EXPECT_EQ(shape("model.layers.0.input_layernorm.weight"), (Shape{7168}));
  EXPECT_EQ(shape("model.layers.0.self_attn.q_a_proj.weight"), (Shape{1536, 7168}));
  EXPECT_EQ(shape("model.layers.0.self_attn.q_a_layernorm.weight"), (Shape{1536}));
  EXPECT_EQ(shape("model.layers.0.self_attn.q_b_proj.weight"), (Shape{24576, 1536}));
  EXPECT_EQ(ScaleInvShape(shape("model.layers.0.self_attn.q_b_proj.weight")), (Shape{192, 12}));
  const Shape kv_a = shape("model.layers.0.self_attn.kv_a_proj_with_mqa.weight");
  EXPECT_EQ(kv_a, (Shape{576, 7168}));
  EXPECT_EQ(ScaleInvShape(kv_a), (Shape{5, 56}));
  EXPECT_EQ(shape("model.layers.0.self_attn.kv_a_layernorm.weight"), (Shape{512}));
  EXPECT_EQ(shape("model.layers.0.self_attn.kv_b_proj.weight"), (Shape{32768, 512}));
  EXPECT_EQ(ScaleInvShape(shape("model.layers.0.self_attn.kv_b_proj.weight")), (Shape{256, 4}));
  EXPECT_EQ(shape("model.layers.0.self_attn.o_proj.weight"), (Shape{7168, 16384}));
  EXPECT_EQ(ScaleInvShape(shape("model.layers.0.self_attn.o_proj.weight")), (Shape{56, 128}));
  EXPECT_EQ(shape("model.layers.2.mlp.gate_proj.weight"), (Shape{18432, 7168}));
  EXPECT_EQ(ScaleInvShape(shape("model.layers.2.mlp.gate_proj.weight")), (Shape{144, 56}));
  EXPECT_EQ(shape("model.layers.2.mlp.down_proj.weight"), (Shape{7168, 18432}));
  EXPECT_EQ(m.count("model.layers.3.mlp.gate_proj.weight"), 0u);
  EXPECT_EQ(m.count("model.layers.2.mlp.gate.weight"), 0u);
  EXPECT_EQ(shape("model.layers.3.mlp.gate.weight"), (Shape{256, 7168}));
  EXPECT_EQ(m.at("model.layers.3.mlp.gate.weight").kind, TensorKind::kRouter);
  EXPECT_FALSE(m.at("model.layers.3.mlp.gate.weight").quantizable());
  EXPECT_EQ(shape("model.layers.3.mlp.gate.e_score_correction_bias"), (Shape{256}));
  EXPECT_EQ(m.at("model.layers.3.mlp.gate.e_score_correction_bias").kind, TensorKind::kBias);
  EXPECT_EQ(shape("model.layers.60.mlp.experts.255.down_proj.weight"), (Shape{7168, 2048}));
  EXPECT_EQ(ScaleInvShape(shape("model.layers.60.mlp.experts.255.down_proj.weight")),
            (Shape{56, 16}));
  EXPECT_EQ(shape("model.layers.3.mlp.experts.0.up_proj.weight"), (Shape{2048, 7168}));
  EXPECT_EQ(m.at("model.layers.3.mlp.experts.9.up_proj.weight").expert, 9);
  EXPECT_EQ(m.at("model.layers.3.mlp.experts.9.up_proj.weight").layer, 3);
  EXPECT_EQ(m.count("model.layers.3.mlp.experts.256.up_proj.weight"), 0u);
  EXPECT_EQ(shape("model.layers.3.mlp.shared_experts.gate_proj.weight"), (Shape{2048, 7168}));
  EXPECT_EQ(shape("model.layers.3.mlp.shared_experts.down_proj.weight"), (Shape{7168, 2048}));
  EXPECT_EQ(m.at("model.layers.3.mlp.shared_experts.down_proj.weight").expert, -1);
  // The MTP layer is not part of the model's inventory.
  for (const ExpectedTensor& t : tensors) {
    EXPECT_EQ(t.name.find("model.layers.61."), std::string::npos) << t.name;
  }
}

TEST(ExpectedTensorsTest, KimiK2Inventory) {
  const ModelConfig c = Config(kKimiK2ConfigJson);
  const std::vector<ExpectedTensor> tensors = ExpectedTensors(c);
  EXPECT_EQ(tensors.size(), 3u + 1 * 12 + 60 * (9 + 2 + 384 * 3 + 3));
  const auto m = ByName(tensors);
  EXPECT_EQ(m.at("model.embed_tokens.weight").shape, (Shape{163840, 7168}));
  EXPECT_EQ(m.at("lm_head.weight").shape, (Shape{163840, 7168}));
  EXPECT_EQ(m.at("model.layers.0.self_attn.q_b_proj.weight").shape, (Shape{12288, 1536}));
  EXPECT_EQ(ScaleInvShape(m.at("model.layers.0.self_attn.q_b_proj.weight").shape), (Shape{96, 12}));
  EXPECT_EQ(m.at("model.layers.0.self_attn.kv_b_proj.weight").shape, (Shape{16384, 512}));
  EXPECT_EQ(ScaleInvShape(m.at("model.layers.0.self_attn.kv_b_proj.weight").shape),
            (Shape{128, 4}));
  EXPECT_EQ(m.at("model.layers.0.self_attn.o_proj.weight").shape, (Shape{7168, 8192}));
  EXPECT_EQ(ScaleInvShape(m.at("model.layers.0.self_attn.o_proj.weight").shape), (Shape{56, 64}));
  EXPECT_EQ(m.count("model.layers.0.mlp.gate_proj.weight"), 1u);  // only layer 0 is dense
  EXPECT_EQ(m.count("model.layers.1.mlp.gate_proj.weight"), 0u);
  EXPECT_EQ(m.at("model.layers.1.mlp.gate.weight").shape, (Shape{384, 7168}));
  EXPECT_EQ(m.at("model.layers.60.mlp.gate.e_score_correction_bias").shape, (Shape{384}));
  EXPECT_EQ(m.count("model.layers.60.mlp.experts.383.gate_proj.weight"), 1u);
  EXPECT_EQ(m.count("model.layers.60.mlp.experts.384.gate_proj.weight"), 0u);
}

TEST(ExpectedTensorsTest, T1Shapes) {
  // MODEL-SPEC 7.1's derived shapes.
  const auto m = ByName(ExpectedTensors(Config(kT1ConfigJson)));
  auto scale = [&](const std::string& name) { return ScaleInvShape(m.at(name).shape); };
  EXPECT_EQ(m.at("model.layers.0.self_attn.q_b_proj.weight").shape, (Shape{192, 64}));
  EXPECT_EQ(scale("model.layers.0.self_attn.q_b_proj.weight"), (Shape{2, 1}));
  EXPECT_EQ(m.at("model.layers.0.self_attn.kv_a_proj_with_mqa.weight").shape, (Shape{80, 256}));
  EXPECT_EQ(scale("model.layers.0.self_attn.kv_a_proj_with_mqa.weight"), (Shape{1, 2}));
  EXPECT_EQ(m.at("model.layers.0.self_attn.kv_b_proj.weight").shape, (Shape{256, 64}));
  EXPECT_EQ(m.at("model.layers.0.self_attn.o_proj.weight").shape, (Shape{256, 128}));
  EXPECT_EQ(m.at("model.layers.0.self_attn.q_a_proj.weight").shape, (Shape{64, 256}));
  EXPECT_EQ(scale("model.layers.0.mlp.gate_proj.weight"), (Shape{4, 2}));
  EXPECT_EQ(scale("model.layers.0.mlp.down_proj.weight"), (Shape{2, 4}));
  EXPECT_EQ(scale("model.layers.1.mlp.experts.15.gate_proj.weight"), (Shape{1, 2}));
  EXPECT_EQ(scale("model.layers.3.mlp.experts.0.down_proj.weight"), (Shape{2, 1}));
}

TEST(ExpectedTensorsTest, ConfigVariants) {
  // q_lora_rank null: one q_proj [nh * qk_head_dim, H], no q_a/q_b.
  {
    const auto m =
        ByName(ExpectedTensors(Config(WithField(kT1ConfigJson, "q_lora_rank", Value::Null()))));
    EXPECT_EQ(m.at("model.layers.0.self_attn.q_proj.weight").shape, (Shape{192, 256}));
    EXPECT_EQ(m.count("model.layers.0.self_attn.q_a_proj.weight"), 0u);
    EXPECT_EQ(m.count("model.layers.0.self_attn.q_a_layernorm.weight"), 0u);
    EXPECT_EQ(m.count("model.layers.0.self_attn.q_b_proj.weight"), 0u);
  }
  // Tied embeddings: no lm_head.
  {
    const auto m = ByName(ExpectedTensors(
        Config(WithField(kT1ConfigJson, "tie_word_embeddings", Value::Bool(true)))));
    EXPECT_EQ(m.count("lm_head.weight"), 0u);
  }
  // Without noaux_tc there is no correction bias; without shared experts no shared MLP.
  {
    std::string text = WithField(kT1ConfigJson, "topk_method", Value::String("greedy"));
    text = WithField(text, "n_shared_experts", Value::Integer(0));
    const auto m = ByName(ExpectedTensors(Config(text)));
    EXPECT_EQ(m.count("model.layers.1.mlp.gate.e_score_correction_bias"), 0u);
    EXPECT_EQ(m.count("model.layers.1.mlp.gate.weight"), 1u);
    EXPECT_EQ(m.count("model.layers.1.mlp.shared_experts.gate_proj.weight"), 0u);
  }
  // Two shared experts double the shared width.
  {
    const auto m = ByName(
        ExpectedTensors(Config(WithField(kT1ConfigJson, "n_shared_experts", Value::Integer(2)))));
    EXPECT_EQ(m.at("model.layers.1.mlp.shared_experts.gate_proj.weight").shape, (Shape{256, 256}));
    EXPECT_EQ(m.at("model.layers.1.mlp.shared_experts.down_proj.weight").shape, (Shape{256, 256}));
  }
}

// A source holding every tensor of `config`: FP8 + correct scales for linear weights.
void Fill(const ModelConfig& config, FakeWeightSource* src) {
  for (const ExpectedTensor& t : ExpectedTensors(config)) {
    if (t.quantizable()) {
      src->AddZeros(t.name, DType::kF8E4M3, t.shape);
      src->AddZeros(ScaleInvName(t.name), DType::kF32, ScaleInvShape(t.shape));
    } else {
      src->AddZeros(t.name, t.kind == TensorKind::kBias ? DType::kF32 : DType::kBF16, t.shape);
    }
  }
}

class ValidateTensorsTest : public ::testing::Test {
 protected:
  void SetUp() override { Fill(config_, &src_); }
  std::string Problems() {
    const absl::Status s = ValidateTensors(config_, src_);
    EXPECT_TRUE(absl::IsInvalidArgument(s)) << s;
    return std::string(s.message());
  }

  ModelConfig config_ = Config(kT1ConfigJson);
  FakeWeightSource src_;
};

TEST_F(ValidateTensorsTest, CompleteSourcePasses) {
  EXPECT_TRUE(ValidateTensors(config_, src_).ok());
}

TEST_F(ValidateTensorsTest, Bf16LinearWeightsPass) {
  const std::string name = LayerTensorName(2, layer_tensor::kKvBProj);
  src_.AddZeros(name, DType::kBF16, {256, 64});
  src_.Remove(ScaleInvName(name));
  EXPECT_TRUE(ValidateTensors(config_, src_).ok());
}

TEST_F(ValidateTensorsTest, ExtraAndMtpTensorsAreIgnored) {
  src_.AddZeros("model.layers.4.enorm.weight", DType::kBF16, {256});
  src_.AddZeros("model.layers.4.self_attn.q_a_proj.weight", DType::kF8E4M3, {1, 1});
  EXPECT_TRUE(ValidateTensors(config_, src_).ok());
}

TEST_F(ValidateTensorsTest, MissingTensor) {
  src_.Remove(ExpertTensorName(2, 5, kUpProj));
  EXPECT_THAT(Problems(), HasSubstr("(1 problem): missing tensor "
                                    "\"model.layers.2.mlp.experts.5.up_proj.weight\""));
}

TEST_F(ValidateTensorsTest, WrongShape) {
  src_.AddZeros(LayerTensorName(1, layer_tensor::kOProj), DType::kBF16, {128, 256});
  EXPECT_THAT(Problems(), HasSubstr("tensor \"model.layers.1.self_attn.o_proj.weight\" has shape "
                                    "[128, 256], expected [256, 128]"));
}

TEST_F(ValidateTensorsTest, DisallowedDtype) {
  src_.AddZeros(LayerTensorName(0, layer_tensor::kInputLayernorm), DType::kF8E4M3, {256});
  EXPECT_THAT(Problems(),
              HasSubstr("tensor \"model.layers.0.input_layernorm.weight\" has dtype F8_E4M3, not "
                        "allowed for a norm tensor"));
  src_.AddZeros(LayerTensorName(0, layer_tensor::kInputLayernorm), DType::kBF16, {256});
  src_.AddZeros(LayerTensorName(1, layer_tensor::kRouterWeight), DType::kF8E4M3, {16, 256});
  EXPECT_THAT(Problems(), HasSubstr("not allowed for a router tensor"));
  src_.AddZeros(LayerTensorName(1, layer_tensor::kRouterWeight), DType::kBF16, {16, 256});
  src_.AddZeros(LayerTensorName(1, layer_tensor::kRouterBias), DType::kBF16, {16});
  EXPECT_THAT(Problems(), HasSubstr("has dtype BF16, not allowed for a bias tensor"));
}

TEST_F(ValidateTensorsTest, Fp8WithoutScale) {
  src_.Remove(ScaleInvName(SharedExpertTensorName(3, kDownProj)));
  EXPECT_THAT(Problems(), HasSubstr("FP8 weight \"model.layers.3.mlp.shared_experts.down_proj."
                                    "weight\" has no scale tensor \"model.layers.3.mlp."
                                    "shared_experts.down_proj.weight_scale_inv\""));
}

TEST_F(ValidateTensorsTest, Fp8ScaleWithWrongShapeOrDtype) {
  const std::string name = LayerTensorName(0, layer_tensor::kKvAProjWithMqa);
  src_.AddZeros(ScaleInvName(name), DType::kF32, {2, 2});
  EXPECT_THAT(Problems(), HasSubstr("scale tensor \"model.layers.0.self_attn.kv_a_proj_with_mqa."
                                    "weight_scale_inv\" has shape [2, 2], expected [1, 2]"));
  src_.AddZeros(ScaleInvName(name), DType::kBF16, {1, 2});
  EXPECT_THAT(Problems(), HasSubstr("has dtype BF16, expected F32"));
}

TEST_F(ValidateTensorsTest, ReportsFirstProblemsAndCount) {
  for (int64_t e = 0; e < 16; ++e) src_.Remove(ExpertTensorName(1, e, kGateProj));
  const std::string msg = Problems();
  EXPECT_THAT(msg, HasSubstr("(16 problems)"));
  EXPECT_THAT(msg, HasSubstr("\"model.layers.1.mlp.experts.0.gate_proj.weight\""));
  EXPECT_THAT(msg, HasSubstr("\"model.layers.1.mlp.experts.7.gate_proj.weight\""));
  EXPECT_THAT(msg, ::testing::Not(HasSubstr("experts.8.gate_proj")));
  EXPECT_THAT(msg, HasSubstr("and 8 more"));
}

}  // namespace
}  // namespace hmoe
