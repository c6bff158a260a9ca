// Tests of the FP32 reference forward pass (common/engine/reference): every op against a small
// hand-computed case, the two MLA forms against each other, incremental decode against a full
// recompute, the FP8 weight path, and input validation.

#include <algorithm>
#include <cmath>
#include <limits>
#include <numbers>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "common/engine/reference/reference_model.h"
#include "common/engine/reference/reference_ops.h"
#include "common/model/model_config.h"
#include "common/model/tensor_map.h"
#include "tools/in_memory_weights.h"

namespace hmoe::reference {
namespace {

using ::testing::ElementsAre;
using ::testing::FloatNear;
using ::testing::HasSubstr;
using ::testing::Pointwise;

constexpr float kTight = 1e-5f;

// ---------------------------------------------------------------------------------- helpers

// Relative L2 error of `got` against `want`.
double RelError(const std::vector<float>& got, const std::vector<float>& want) {
  EXPECT_EQ(got.size(), want.size());
  double num = 0.0, den = 0.0;
  for (size_t i = 0; i < got.size() && i < want.size(); ++i) {
    num += (static_cast<double>(got[i]) - want[i]) * (static_cast<double>(got[i]) - want[i]);
    den += static_cast<double>(want[i]) * want[i];
  }
  return std::sqrt(num / std::max(den, 1e-30));
}

std::vector<float> RandomVector(std::mt19937& rng, size_t n, float stddev) {
  std::normal_distribution<float> dist(0.0f, stddev);
  std::vector<float> v(n);
  for (float& x : v) x = dist(rng);
  return v;
}

ModelConfig DeepSeekV3Config() {
  ModelConfig c;
  c.model_type = "deepseek_v3";
  c.qk_nope_head_dim = 128;
  c.qk_rope_head_dim = 64;
  c.rope_theta = 10000.0;
  c.rope_scaling.enabled = true;
  c.rope_scaling.factor = 40.0;
  c.rope_scaling.original_max_position_embeddings = 4096;
  c.rope_scaling.beta_fast = 32.0;
  c.rope_scaling.beta_slow = 1.0;
  c.rope_scaling.mscale = 1.0;
  c.rope_scaling.mscale_all_dim = 1.0;
  return c;
}

ModelConfig KimiK2Config() {
  ModelConfig c = DeepSeekV3Config();
  c.model_type = "kimi_k2";
  c.rope_theta = 50000.0;
  c.rope_scaling.factor = 32.0;
  c.rope_scaling.beta_fast = 1.0;
  c.rope_scaling.beta_slow = 1.0;
  return c;
}

// The micro model of the tests: every structural feature of DeepSeek-V3 at toy sizes
// (dense layer 0, MoE layers 1-2 with group-limited routing and a shared expert, YaRN whose ramp
// has a fractional step: rope_dim 8, L0 64 -> low 0, high 2).
ModelConfig MicroConfig() {
  ModelConfig c;
  c.model_type = "deepseek_v3";
  c.vocab_size = 64;
  c.hidden_size = 32;
  c.intermediate_size = 64;
  c.moe_intermediate_size = 16;
  c.num_hidden_layers = 3;
  c.num_attention_heads = 2;
  c.q_lora_rank = 16;
  c.kv_lora_rank = 16;
  c.qk_nope_head_dim = 8;
  c.qk_rope_head_dim = 8;
  c.v_head_dim = 8;
  c.n_routed_experts = 8;
  c.n_shared_experts = 1;
  c.num_experts_per_tok = 2;
  c.n_group = 4;
  c.topk_group = 2;
  c.routed_scaling_factor = 2.5;
  c.first_k_dense_replace = 1;
  c.max_position_embeddings = 256;
  c.rope_theta = 10000.0;
  c.rope_scaling.enabled = true;
  c.rope_scaling.factor = 4.0;
  c.rope_scaling.original_max_position_embeddings = 64;
  c.rope_scaling.beta_fast = 32.0;
  c.rope_scaling.beta_slow = 1.0;
  c.rope_scaling.mscale = 1.0;
  c.rope_scaling.mscale_all_dim = 1.0;
  c.eos_token_ids = {1};
  return c;
}

struct NamedTensor {
  std::string name;
  std::vector<int64_t> shape;
  std::vector<float> values;
  TensorKind kind = TensorKind::kLinear;
};

// Random weights for every tensor of `c` (names and shapes from ExpectedTensors), scaled so that
// activations stay of order 1 in every layer and routing is spread over the experts.
std::vector<NamedTensor> RandomWeights(const ModelConfig& c, uint32_t seed) {
  std::mt19937 rng(seed);
  std::vector<NamedTensor> out;
  for (const ExpectedTensor& t : ExpectedTensors(c)) {
    int64_t n = 1;
    for (int64_t d : t.shape) n *= d;
    const float inv_sqrt_in = 1.0f / std::sqrt(static_cast<float>(t.shape.back()));
    std::vector<float> values;
    switch (t.kind) {
      case TensorKind::kEmbedding:
        values = RandomVector(rng, n, t.name == kLmHeadName ? inv_sqrt_in : 1.0f);
        break;
      case TensorKind::kLinear:
        values = RandomVector(rng, n, inv_sqrt_in);
        break;
      case TensorKind::kRouter:
        values = RandomVector(rng, n, 2.0f * inv_sqrt_in);
        break;
      case TensorKind::kNorm:
        values = RandomVector(rng, n, 0.1f);
        for (float& x : values) x += 1.0f;
        break;
      case TensorKind::kBias:
        values = RandomVector(rng, n, 0.1f);
        break;
    }
    out.push_back({t.name, t.shape, std::move(values), t.kind});
  }
  return out;
}

enum class Storage { kF32, kFp8 };

std::unique_ptr<InMemoryWeightSource> MakeSource(const std::vector<NamedTensor>& tensors,
                                                 Storage storage) {
  auto source = std::make_unique<InMemoryWeightSource>();
  for (const NamedTensor& t : tensors) {
    if (storage == Storage::kFp8 && t.kind == TensorKind::kLinear) {
      EXPECT_TRUE(source->AddFp8(t.name, t.shape, t.values).ok()) << t.name;
    } else if (storage == Storage::kF32 || t.kind == TensorKind::kBias) {
      EXPECT_TRUE(source->AddF32(t.name, t.shape, t.values).ok()) << t.name;
    } else {
      EXPECT_TRUE(source->AddBf16(t.name, t.shape, t.values).ok()) << t.name;
    }
  }
  return source;
}

std::unique_ptr<ReferenceModel> MakeModel(const ModelConfig& config, const WeightSource& source,
                                          MlaForm form = MlaForm::kAbsorbed) {
  ReferenceModelOptions options;
  options.mla_form = form;
  absl::StatusOr<std::unique_ptr<ReferenceModel>> model =
      ReferenceModel::Create(config, source, options);
  EXPECT_TRUE(model.ok()) << model.status();
  return model.ok() ? *std::move(model) : nullptr;
}

// ---------------------------------------------------------------------------------- fixture

TEST(InMemoryWeightSourceTest, Fp8BlockQuantizationRoundTripsWithinFp8Precision) {
  // 130 x 260: 2 x 3 blocks, partial in both directions; blocks of very different magnitude.
  std::mt19937 rng(1);
  std::vector<float> v = RandomVector(rng, 130 * 260, 1.0f);
  for (int64_t r = 0; r < 130; ++r) {
    for (int64_t c = 0; c < 260; ++c) v[r * 260 + c] *= (r >= 128 ? 1000.0f : 1.0f);
  }
  InMemoryWeightSource source;
  ASSERT_TRUE(source.AddFp8("w.weight", {130, 260}, v).ok());
  absl::StatusOr<Weight> w = source.GetWeight("w.weight");
  ASSERT_TRUE(w.ok()) << w.status();
  EXPECT_EQ(w->tensor.dtype, DType::kF8E4M3);
  ASSERT_TRUE(w->has_scale);
  EXPECT_EQ(w->scale_inv.shape, (std::vector<int64_t>{2, 3}));
  absl::StatusOr<std::vector<float>> dq = DequantizeToFloat(*w);
  ASSERT_TRUE(dq.ok());
  for (size_t i = 0; i < v.size(); ++i) {
    // Half a step of a 3-bit mantissa, or the subnormal step of the block's scale.
    const float block_amax_bound = (i / 260 >= 128 ? 1000.0f : 1.0f) * 6.0f;
    const float tol = std::max(std::abs(v[i]) / 16.0f, block_amax_bound / 448.0f / 512.0f);
    ASSERT_NEAR((*dq)[i], v[i], tol) << i;
  }
  EXPECT_LT(RelError(*dq, v), 0.04);

  EXPECT_EQ(source.AddF32("w.weight", {1}, std::vector<float>{1}).code(),
            absl::StatusCode::kAlreadyExists);
  EXPECT_EQ(source.AddF32("x", {2, 2}, std::vector<float>{1}).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(source.GetTensor("nope").status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(source.TensorNames(), ElementsAre("w.weight", "w.weight_scale_inv"));
}

// ---------------------------------------------------------------------------------- basic ops

TEST(ReferenceOpsTest, RmsNormMatchesHandComputedValues) {
  // mean(x^2) = (1 + 4 + 9 + 16) / 4 = 7.5, rms = 2.738613.
  const std::vector<float> x = {1, 2, 3, 4};
  const std::vector<float> w = {1, 1, 2, 0.5};
  std::vector<float> y(4);
  RmsNorm(x, w, 0.0f, y);
  EXPECT_THAT(y, Pointwise(FloatNear(kTight), {0.365148f, 0.730297f, 2.190890f, 0.730297f}));

  // eps enters under the root: x = (3, 4), mean(x^2) = 12.5, eps 0.5 -> sqrt(13).
  std::vector<float> y2(2);
  RmsNorm(std::vector<float>{3, 4}, std::vector<float>{1, 1}, 0.5f, y2);
  EXPECT_THAT(y2, Pointwise(FloatNear(kTight), {0.832050f, 1.109400f}));
}

TEST(ReferenceOpsTest, LinearIsRowMajorMatrixTimesVector) {
  // W = [[1, 2, 3], [-1, 0, 0.5]] ([out=2, in=3]), x = (1, -1, 2): y = (5, 0).
  const std::vector<float> w = {1, 2, 3, -1, 0, 0.5};
  std::vector<float> y(2);
  Linear(w, 2, 3, std::vector<float>{1, -1, 2}, y);
  EXPECT_THAT(y, ElementsAre(5.0f, 0.0f));
}

TEST(ReferenceOpsTest, RoundToQ8KFollowsItsDefinition) {
  // One block with amax 127: d = 1, q = x rounded half to even (2.5 -> 2, -3.5 -> -4, 0.5 -> 0).
  std::vector<float> x = {127.0f, 2.5f, -3.5f, 0.5f, 1.49f, -127.0f};
  EXPECT_THAT(RoundToQ8K(x), ElementsAre(127.0, 2.0, -4.0, 0.0, 1.0, -127.0));
  // amax 254: d = 2, q = round(x / 2); an all-zero block stays zero; blocks of 256 values each
  // have their own scale (the second block here: amax 0.5, d = 0.5 / 127).
  std::vector<float> y(300, 0.0f);
  y[0] = 254.0f;
  y[1] = 3.0f;  // 1.5 -> 2 -> 4
  y[2] = 5.0f;  // 2.5 -> 2 -> 4
  y[256] = 0.5f;
  y[257] = -0.25f;  // -63.5 -> -64
  const std::vector<double> r = RoundToQ8K(y);
  EXPECT_EQ(r[0], 254.0);
  EXPECT_EQ(r[1], 4.0);
  EXPECT_EQ(r[2], 4.0);
  EXPECT_EQ(r[3], 0.0);
  const double d = static_cast<double>(0.5f / 127.0f);
  EXPECT_EQ(r[256], d * 127.0);
  EXPECT_EQ(r[257], d * -64.0);
  EXPECT_EQ(RoundToQ8K(std::vector<float>(10, 0.0f)), std::vector<double>(10, 0.0));
}

TEST(ReferenceOpsTest, LinearQ8KIsTheProductWithTheRoundedActivation) {
  const std::vector<float> w = {1, 2, 3, -1, 0.5f, 0.25f};  // [2, 3]
  const std::vector<float> x = {127.0f, 2.5f, -0.4f};       // rounds to 127, 2, 0
  std::vector<float> y(2);
  LinearQ8K(w, 2, 3, x, y);
  EXPECT_THAT(y, ElementsAre(131.0f, -126.0f));
}

TEST(ReferenceOpsTest, SiluMatchesHandComputedValues) {
  EXPECT_FLOAT_EQ(Silu(0.0f), 0.0f);
  EXPECT_NEAR(Silu(1.0f), 0.7310586f, kTight);    // 1 / (1 + e^-1)
  EXPECT_NEAR(Silu(-2.0f), -0.2384058f, kTight);  // -2 / (1 + e^2)
  EXPECT_NEAR(Silu(20.0f), 20.0f, 1e-4f);
}

TEST(ReferenceOpsTest, SoftmaxMatchesHandComputedValues) {
  std::vector<float> x = {1, 2, 3};
  Softmax(x);
  EXPECT_THAT(x, Pointwise(FloatNear(kTight), {0.0900306f, 0.2447285f, 0.6652410f}));

  // Large values do not overflow; -inf entries get exactly zero.
  std::vector<float> y = {1000, -std::numeric_limits<float>::infinity(), 1000};
  Softmax(y);
  EXPECT_THAT(y, ElementsAre(0.5f, 0.0f, 0.5f));
}

TEST(ReferenceOpsTest, SwiGluMlpMatchesHandComputedValue) {
  // hidden 1, inter 2: gate = (1, -2), up = (2, 1), down = (3, 1); x = 1.
  // y = 3 * silu(1) * 2 + 1 * silu(-2) * 1 = 4.3863515 - 0.2384058.
  std::vector<float> y(1);
  SwiGluMlp(std::vector<float>{1, -2}, std::vector<float>{2, 1}, std::vector<float>{3, 1}, 1, 2,
            std::vector<float>{1}, y);
  EXPECT_NEAR(y[0], 4.1479457f, kTight);
}

// ---------------------------------------------------------------------------------- YaRN / RoPE

TEST(ReferenceRopeTest, YarnDeepSeekV3MatchesModelSpec) {
  const ModelConfig c = DeepSeekV3Config();
  const YarnCorrectionRange range = YarnRange(64, c.rope_theta, c.rope_scaling);
  EXPECT_EQ(range.low, 10.0);
  EXPECT_EQ(range.high, 23.0);
  const std::vector<float> inv_freq = YarnInvFreq(c);
  ASSERT_EQ(inv_freq.size(), 32u);
  EXPECT_NEAR(inv_freq[0], 1.0f, 1e-6f);
  EXPECT_NEAR(inv_freq[1], 0.749894f, 1e-6f);
  EXPECT_NEAR(inv_freq[2], 0.562341f, 1e-6f);
  EXPECT_NEAR(inv_freq[3], 0.421697f, 1e-6f);
  EXPECT_NEAR(inv_freq[31] / 3.3338e-06f, 1.0f, 1e-4f);
  // Inside the ramp the frequency blends: i = 16 is (16 - 10) / 13 of the way to interpolated.
  const double extra = std::pow(10000.0, -32.0 / 64.0);
  const double ramp = 6.0 / 13.0;
  EXPECT_NEAR(inv_freq[16], extra / 40.0 * ramp + extra * (1.0 - ramp), 1e-8);
  EXPECT_DOUBLE_EQ(YarnAttentionFactor(c), 1.0);
}

TEST(ReferenceRopeTest, YarnKimiK2MatchesModelSpec) {
  const ModelConfig c = KimiK2Config();
  const YarnCorrectionRange range = YarnRange(64, c.rope_theta, c.rope_scaling);
  EXPECT_EQ(range.low, 19.0);
  EXPECT_EQ(range.high, 20.0);
  const std::vector<float> inv_freq = YarnInvFreq(c);
  EXPECT_NEAR(inv_freq[19], std::pow(50000.0, -38.0 / 64.0), 1e-9);         // kept
  EXPECT_NEAR(inv_freq[20], std::pow(50000.0, -40.0 / 64.0) / 32.0, 1e-9);  // interpolated
}

TEST(ReferenceRopeTest, YarnEqualLowHighGetsNudged) {
  // beta_fast == beta_slow on an exact integer correction dim would divide by zero.
  YarnConfig yarn;
  yarn.enabled = true;
  yarn.factor = 2.0;
  yarn.original_max_position_embeddings = 4096;
  yarn.beta_fast = 1.0;
  yarn.beta_slow = 1.0;
  const YarnCorrectionRange range = YarnRange(64, 50000.0, yarn);
  EXPECT_GT(range.high, range.low);
}

TEST(ReferenceRopeTest, WithoutYarnInvFreqIsPlainRope) {
  ModelConfig c = DeepSeekV3Config();
  c.rope_scaling.enabled = false;
  const std::vector<float> inv_freq = YarnInvFreq(c);
  for (int i = 0; i < 32; ++i) {
    EXPECT_NEAR(inv_freq[i], std::pow(10000.0, -2.0 * i / 64.0), 1e-7) << i;
  }
  EXPECT_DOUBLE_EQ(YarnAttentionFactor(c), 1.0);
  EXPECT_NEAR(MlaSoftmaxScale(c), 1.0 / std::sqrt(192.0), 1e-9);
}

TEST(ReferenceRopeTest, AttentionFactorAndSoftmaxScaleMatchModelSpec) {
  ModelConfig c = DeepSeekV3Config();
  EXPECT_NEAR(MlaSoftmaxScale(c), 0.1352338, 1e-7);
  EXPECT_NEAR(MlaSoftmaxScale(KimiK2Config()), 0.1308608, 1e-7);
  // MODEL-SPEC §7 T1 (qk 32+16, factor 4) and T2 (qk 32+32).
  ModelConfig t1 = DeepSeekV3Config();
  t1.qk_nope_head_dim = 32;
  t1.qk_rope_head_dim = 16;
  t1.rope_scaling.factor = 4.0;
  EXPECT_NEAR(MlaSoftmaxScale(t1), 0.187130, 1e-6);
  ModelConfig t2 = t1;
  t2.qk_rope_head_dim = 32;
  EXPECT_NEAR(MlaSoftmaxScale(t2), 0.162060, 1e-6);
  // The config library computes the same value independently.
  EXPECT_NEAR(c.softmax_scale(), MlaSoftmaxScale(c), 1e-12);
  EXPECT_NEAR(t1.softmax_scale(), MlaSoftmaxScale(t1), 1e-12);

  // mscale != mscale_all_dim: cos/sin carry g(40, 1) / g(40, 0) = 0.1 ln 40 + 1 = 1.368888, and
  // the softmax scale gets no mscale^2 when mscale_all_dim is 0 (Hugging Face's rule).
  c.rope_scaling.mscale_all_dim = 0.0;
  EXPECT_NEAR(YarnAttentionFactor(c), 1.3688879, 1e-6);
  EXPECT_NEAR(MlaSoftmaxScale(c), 1.0 / std::sqrt(192.0), 1e-9);
}

// The engine's tables come from ModelConfig (common/model), written independently of the
// oracle's: same formulas (MODEL-SPEC §3.4), same double arithmetic, so equal to the last bit.
TEST(ReferenceRopeTest, ModelConfigTablesMatchTheReference) {
  ModelConfig no_yarn = DeepSeekV3Config();
  no_yarn.rope_scaling.enabled = false;
  ModelConfig mscale_only = DeepSeekV3Config();
  mscale_only.rope_scaling.mscale_all_dim = 0.0;
  ModelConfig narrow = DeepSeekV3Config();
  narrow.qk_rope_head_dim = 16;
  narrow.rope_scaling.factor = 4.0;
  for (const ModelConfig& c :
       {DeepSeekV3Config(), KimiK2Config(), MicroConfig(), no_yarn, mscale_only, narrow}) {
    EXPECT_EQ(c.rope_inv_freq(), YarnInvFreq(c));
    EXPECT_EQ(c.rope_attention_factor(), YarnAttentionFactor(c));
    EXPECT_EQ(c.softmax_scale(), MlaSoftmaxScale(c));
  }
}

// The oracle's own YaRN multipliers for every mscale / mscale_all_dim combination (0 = absent,
// null or 0 in config.json), against transformers' rules computed by hand for factor 40,
// qk_head_dim 192: g(40, 1) = 0.1 ln 40 + 1 = 1.3688879454113936, g(40, 1) / g(40, 0.707) =
// 1.3688879454113936 / 1.2608037774058554 = 1.0857264, 192^-0.5 = 0.07216878364870323.
TEST(ReferenceRopeTest, MscaleCombinationsFollowTransformers) {
  constexpr double kG1 = 1.3688879454113936, kPlain = 0.07216878364870323;
  const double g_half = 0.1 * 0.707 * std::log(40.0) + 1.0;
  struct Case {
    double mscale, mscale_all_dim, attention_factor, cos_sin, softmax;
  };
  const Case cases[] = {
      {0, 0, 0, kG1, kPlain},
      {1, 0, 0, kG1, kPlain},
      {3, 0, 0, kG1, kPlain},
      {0, 1, 0, kG1, kPlain * kG1 * kG1},  // mscale_all_dim without mscale
      {1, 1, 0, 1.0, kPlain * kG1 * kG1},
      {1, 0.707, 0, kG1 / g_half, kPlain * g_half * g_half},
      {1, 1, 2.0, 2.0, kPlain * kG1 * kG1},
  };
  for (const Case& k : cases) {
    ModelConfig c = DeepSeekV3Config();
    c.rope_scaling.mscale = k.mscale;
    c.rope_scaling.mscale_all_dim = k.mscale_all_dim;
    c.rope_scaling.attention_factor = k.attention_factor;
    EXPECT_NEAR(YarnAttentionFactor(c), k.cos_sin, 1e-12) << k.mscale << " " << k.mscale_all_dim;
    EXPECT_NEAR(MlaSoftmaxScale(c), k.softmax, 1e-12) << k.mscale << " " << k.mscale_all_dim;
    // The engine's ModelConfig computes the same values independently.
    EXPECT_EQ(c.rope_attention_factor(), YarnAttentionFactor(c));
    EXPECT_EQ(c.softmax_scale(), MlaSoftmaxScale(c));
  }
  EXPECT_NEAR(kG1 / g_half, 1.0857264, 1e-7);
}

TEST(ReferenceRopeTest, RotatesInterleavedPairsAtKnownAngles) {
  // Pair 0 rotates by 2 * pi/4 = 90 degrees: (1, 0) -> (0, 1).
  // Pair 1 rotates by 2 * pi/2 = 180 degrees: (0, 1) -> (0, -1). Both scaled by 2.
  const std::vector<float> inv_freq = {static_cast<float>(std::numbers::pi / 4),
                                       static_cast<float>(std::numbers::pi / 2)};
  std::vector<float> v = {1, 0, 0, 1};
  ApplyRopeInterleaved(v, 2, inv_freq, 2.0f);
  EXPECT_THAT(v, Pointwise(FloatNear(1e-6f), {0.0f, 2.0f, 0.0f, -2.0f}));

  // 30 degrees on (2, 1): (2 cos - sin, 2 sin + cos).
  std::vector<float> w = {2, 1};
  const float angle = static_cast<float>(std::numbers::pi / 6);
  ApplyRopeInterleaved(w, 1, std::vector<float>{angle}, 1.0f);
  EXPECT_NEAR(w[0], 2 * std::sqrt(3.0f) / 2 - 0.5f, 1e-6f);
  EXPECT_NEAR(w[1], 1.0f + std::sqrt(3.0f) / 2, 1e-6f);

  // Position 0 is the identity.
  std::vector<float> u = {0.3f, -0.7f, 1.5f, 2.5f};
  ApplyRopeInterleaved(u, 0, inv_freq, 1.0f);
  EXPECT_THAT(u, ElementsAre(0.3f, -0.7f, 1.5f, 2.5f));
}

// Hugging Face's rope_interleave=True path: de-interleave (evens then odds), rotate_half with
// cos/sin = concat(freqs, freqs). MODEL-SPEC §3.5: scores must equal the interleaved form.
std::vector<float> HfDeinterleavedRope(const std::vector<float>& x, int64_t pos,
                                       const std::vector<float>& inv_freq) {
  const size_t half = inv_freq.size();
  std::vector<float> d(2 * half);
  for (size_t j = 0; j < half; ++j) {
    d[j] = x[2 * j];
    d[half + j] = x[2 * j + 1];
  }
  std::vector<float> out(2 * half);
  for (size_t j = 0; j < 2 * half; ++j) {
    const double angle = static_cast<double>(pos) * inv_freq[j % half];
    const double rotated = j < half ? -d[j + half] : d[j - half];
    out[j] = static_cast<float>(d[j] * std::cos(angle) + rotated * std::sin(angle));
  }
  return out;
}

TEST(ReferenceRopeTest, InterleavedScoresEqualHfDeinterleavedRotateHalf) {
  const ModelConfig c = DeepSeekV3Config();
  const std::vector<float> inv_freq = YarnInvFreq(c);
  std::mt19937 rng(7);
  const std::vector<float> q = RandomVector(rng, 64, 1.0f);
  const std::vector<float> k = RandomVector(rng, 64, 1.0f);
  for (auto [pq, pk] : {std::pair<int64_t, int64_t>{5, 3}, {1000, 17}, {60000, 60000}}) {
    std::vector<float> q_ours = q, k_ours = k;
    ApplyRopeInterleaved(q_ours, pq, inv_freq, 1.0f);
    ApplyRopeInterleaved(k_ours, pk, inv_freq, 1.0f);
    const std::vector<float> q_hf = HfDeinterleavedRope(q, pq, inv_freq);
    const std::vector<float> k_hf = HfDeinterleavedRope(k, pk, inv_freq);
    double ours = 0, hf = 0;
    for (int i = 0; i < 64; ++i) {
      ours += static_cast<double>(q_ours[i]) * k_ours[i];
      hf += static_cast<double>(q_hf[i]) * k_hf[i];
    }
    EXPECT_NEAR(ours, hf, 1e-3) << pq << " " << pk;
  }
}

TEST(ReferenceRopeTest, ScoreDependsOnlyOnRelativePosition) {
  const std::vector<float> inv_freq = YarnInvFreq(MicroConfig());
  std::mt19937 rng(3);
  const std::vector<float> q = RandomVector(rng, 8, 1.0f);
  const std::vector<float> k = RandomVector(rng, 8, 1.0f);
  auto score = [&](int64_t pq, int64_t pk) {
    std::vector<float> a = q, b = k;
    ApplyRopeInterleaved(a, pq, inv_freq, 1.0f);
    ApplyRopeInterleaved(b, pk, inv_freq, 1.0f);
    double s = 0;
    for (int i = 0; i < 8; ++i) s += static_cast<double>(a[i]) * b[i];
    return s;
  };
  EXPECT_NEAR(score(7, 3), score(104, 100), 1e-4);
  EXPECT_GT(std::abs(score(7, 3) - score(7, 5)), 1e-3);  // and it does depend on it
}

// ---------------------------------------------------------------------------------- MoE router

float Logit(double p) { return static_cast<float>(std::log(p / (1.0 - p))); }
float Sigmoid(float x) { return static_cast<float>(1.0 / (1.0 + std::exp(-double{x}))); }

TEST(MoeGateTest, BiasChangesSelectionButNotWeights) {
  // Scores s = sigmoid(2, 1, 0, -1) = (0.881, 0.731, 0.5, 0.269). Unbiased, top-2 is {0, 1};
  // bias +0.6 on expert 2 makes b = (0.881, 0.731, 1.1, 0.269), so {2, 0} is chosen, but the
  // weights come from the unbiased scores: 2.5 * (0.5, 0.880797) / 1.380797 = (0.905274, 1.594726).
  MoeGateParams p{.num_experts = 4,
                  .top_k = 2,
                  .n_group = 1,
                  .topk_group = 1,
                  .norm_topk_prob = true,
                  .routed_scaling_factor = 2.5};
  const std::vector<float> logits = {2, 1, 0, -1};
  const MoeGateResult unbiased = MoeGate(logits, {}, p);
  EXPECT_THAT(unbiased.experts, ElementsAre(0, 1));

  const MoeGateResult r = MoeGate(logits, std::vector<float>{0, 0, 0.6f, 0}, p);
  EXPECT_THAT(r.experts, ElementsAre(2, 0));
  const float s0 = Sigmoid(2.0f), s2 = 0.5f;
  EXPECT_THAT(r.weights,
              Pointwise(FloatNear(kTight), {2.5f * s2 / (s0 + s2), 2.5f * s0 / (s0 + s2)}));
  EXPECT_NEAR(r.weights[0], 0.905274f, 1e-5f);
  EXPECT_NEAR(r.weights[1], 1.594726f, 1e-5f);
}

TEST(MoeGateTest, GroupMaskingExcludesAnExpertThatWouldOtherwiseWin) {
  // 8 experts in 4 groups of 2, keep 2 groups, top-2. Scores (no bias):
  //   group 0: 0.90 0.10 (sum 1.00)   group 1: 0.62 0.60 (1.22)
  //   group 2: 0.58 0.56 (1.14)       group 3: 0.50 0.40 (0.90)
  // Groups 1 and 2 are kept, so expert 0 (the best single score) is excluded: {2, 3}.
  const std::vector<double> s = {0.90, 0.10, 0.62, 0.60, 0.58, 0.56, 0.50, 0.40};
  std::vector<float> logits;
  for (double v : s) logits.push_back(Logit(v));
  MoeGateParams p{.num_experts = 8,
                  .top_k = 2,
                  .n_group = 4,
                  .topk_group = 2,
                  .norm_topk_prob = true,
                  .routed_scaling_factor = 1.0};
  const MoeGateResult r = MoeGate(logits, {}, p);
  EXPECT_THAT(r.experts, ElementsAre(2, 3));
  EXPECT_THAT(r.weights, Pointwise(FloatNear(1e-5f), {0.62f / 1.22f, 0.60f / 1.22f}));

  // Without the group stage (one group), expert 0 wins.
  p.n_group = 1;
  p.topk_group = 1;
  EXPECT_THAT(MoeGate(logits, {}, p).experts, ElementsAre(0, 2));

  // With top-3 the third pick comes from group 2, never from the excluded group 0.
  p.n_group = 4;
  p.topk_group = 2;
  p.top_k = 3;
  EXPECT_THAT(MoeGate(logits, {}, p).experts, ElementsAre(2, 3, 4));
}

TEST(MoeGateTest, GroupScoreIsSumOfTopTwoBiasedScores) {
  // 6 experts in 2 groups of 3, keep 1 group, top-2.
  //   group 0: 0.95 0.05 0.90 -> top-2 sum 1.85 (max 0.95)
  //   group 1: 0.70 0.70 0.69 -> top-2 sum 1.40
  // Group 0 wins on the top-2 sum; with bias -0.5 on expert 2 its sum drops to 1.35 < 1.40 and
  // group 1 wins although expert 0 still has the best biased score.
  const std::vector<double> s = {0.95, 0.05, 0.90, 0.70, 0.70, 0.69};
  std::vector<float> logits;
  for (double v : s) logits.push_back(Logit(v));
  MoeGateParams p{.num_experts = 6,
                  .top_k = 2,
                  .n_group = 2,
                  .topk_group = 1,
                  .norm_topk_prob = true,
                  .routed_scaling_factor = 1.0};
  EXPECT_THAT(MoeGate(logits, {}, p).experts, ElementsAre(0, 2));
  const MoeGateResult r = MoeGate(logits, std::vector<float>{0, 0, -0.5f, 0, 0, 0}, p);
  EXPECT_THAT(r.experts, ElementsAre(3, 4));
  EXPECT_THAT(r.weights, Pointwise(FloatNear(1e-5f), {0.5f, 0.5f}));
}

TEST(MoeGateTest, SelectionGapIsTheKthVersusNextScoreAmongKeptGroupsOrHalfTheGroupGap) {
  // The 8-expert example above: groups 1 (1.22) and 2 (1.14) kept, group 0 (1.00) the best
  // dropped one: group gap 0.14. Top-2 among the kept experts 0.62, 0.60, 0.58, 0.56: the
  // K-th (0.60) vs the (K+1)-th (0.58), not expert 0's 0.90 (its group is dropped).
  const std::vector<double> s = {0.90, 0.10, 0.62, 0.60, 0.58, 0.56, 0.50, 0.40};
  std::vector<float> logits;
  for (double v : s) logits.push_back(Logit(v));
  MoeGateParams p{.num_experts = 8,
                  .top_k = 2,
                  .n_group = 4,
                  .topk_group = 2,
                  .norm_topk_prob = true,
                  .routed_scaling_factor = 1.0};
  MoeGateResult r = MoeGate(logits, {}, p);
  EXPECT_NEAR(r.kth_score, 0.60f, 1e-6f);
  EXPECT_NEAR(r.next_score, 0.58f, 1e-6f);
  EXPECT_NEAR(r.group_gap, 1.14 - 1.00, 1e-6);
  EXPECT_NEAR(r.SelectionGap(), 0.02, 1e-6);  // min(0.02, 0.14 / 2)
  // A bias that brings group 0 to 1.13 makes the group gap (0.01) the binding one: 0.005.
  r = MoeGate(logits, std::vector<float>{0, 0.13f, 0, 0, 0, 0, 0, 0}, p);
  EXPECT_NEAR(r.group_gap, 0.01, 1e-6);
  EXPECT_NEAR(r.SelectionGap(), 0.005, 1e-6);
  EXPECT_THAT(r.experts, ElementsAre(2, 3));
  // n_group 1: over all experts (0.90, 0.62 | 0.60), no group stage.
  p.n_group = 1;
  p.topk_group = 1;
  r = MoeGate(logits, {}, p);
  EXPECT_NEAR(r.SelectionGap(), 0.02, 1e-6);
  EXPECT_TRUE(std::isinf(r.group_gap));
  // Every expert chosen: nothing to compare with.
  p.top_k = 8;
  EXPECT_TRUE(std::isinf(MoeGate(logits, {}, p).SelectionGap()));
}

TEST(MoeGateTest, CombineWeightsOfAnotherExpertSetFollowTheSameFormula) {
  MoeGateParams p{.num_experts = 4,
                  .top_k = 2,
                  .n_group = 1,
                  .topk_group = 1,
                  .norm_topk_prob = true,
                  .routed_scaling_factor = 2.5};
  const std::vector<float> logits = {2, 1, 0, -1};
  const MoeGateResult r = MoeGate(logits, {}, p);
  EXPECT_EQ(MoeCombineWeights(logits, r.experts, p), r.weights);  // bit for bit
  const float s1 = Sigmoid(1.0f), s3 = Sigmoid(-1.0f);
  EXPECT_THAT(MoeCombineWeights(logits, std::vector<int32_t>{3, 1}, p),
              Pointwise(FloatNear(kTight), {2.5f * s3 / (s1 + s3), 2.5f * s1 / (s1 + s3)}));
}

TEST(MoeGateTest, WithoutNormalizationWeightsAreScaledSigmoidScores) {
  MoeGateParams p{.num_experts = 4,
                  .top_k = 2,
                  .n_group = 2,
                  .topk_group = 2,
                  .norm_topk_prob = false,
                  .routed_scaling_factor = 2.827};
  const MoeGateResult r = MoeGate(std::vector<float>{0, 3, -1, 1}, {}, p);
  EXPECT_THAT(r.experts, ElementsAre(1, 3));
  EXPECT_THAT(r.weights,
              Pointwise(FloatNear(1e-5f), {2.827f * Sigmoid(3.0f), 2.827f * Sigmoid(1.0f)}));
}

TEST(MoeGateTest, NormalizedWeightsSumToScalingFactor) {
  std::mt19937 rng(11);
  MoeGateParams p{.num_experts = 32,
                  .top_k = 4,
                  .n_group = 8,
                  .topk_group = 3,
                  .norm_topk_prob = true,
                  .routed_scaling_factor = 2.5};
  for (int trial = 0; trial < 20; ++trial) {
    const std::vector<float> logits = RandomVector(rng, 32, 2.0f);
    const std::vector<float> bias = RandomVector(rng, 32, 0.2f);
    const MoeGateResult r = MoeGate(logits, bias, p);
    ASSERT_EQ(r.experts.size(), 4u);
    double sum = 0;
    for (float w : r.weights) sum += w;
    EXPECT_NEAR(sum, 2.5, 1e-5);
    // The chosen experts are distinct and come from at most topk_group groups.
    std::vector<int32_t> groups;
    for (int32_t e : r.experts) groups.push_back(e / 4);
    std::sort(groups.begin(), groups.end());
    groups.erase(std::unique(groups.begin(), groups.end()), groups.end());
    EXPECT_LE(groups.size(), 3u);
    std::vector<int32_t> experts = r.experts;
    std::sort(experts.begin(), experts.end());
    EXPECT_EQ(std::unique(experts.begin(), experts.end()), experts.end());
  }
}

// ---------------------------------------------------------------------------------- MLA

TEST(MlaAttentionTest, SingleHeadMatchesHandComputedValues) {
  // nh 1, dn 1, dr 2, dv 1, Rkv 1, scale 1. W_kvb = [[2], [3]]: k_nope = 2c, v = 3c.
  // Cache: c = (1, -1), k_pe = ((1, 0), (0, 1)). Query at position 1: q_nope 0.5, q_pe (1, 1).
  // Scores: 0.5*2*1 + 1 = 2 and 0.5*2*(-1) + 1 = 0 -> P = (0.880797, 0.119203),
  // o = 3 * (0.880797 - 0.119203) = 2.284782.
  const MlaDimensions d{1, 1, 2, 1, 1, 1.0f};  // nh, dn, dr, dv, Rkv, scale
  const std::vector<float> latent = {1, -1}, k_pe = {1, 0, 0, 1}, wkv_b = {2, 3};
  for (MlaForm form : {MlaForm::kNaive, MlaForm::kAbsorbed}) {
    auto attend = form == MlaForm::kNaive ? MlaAttentionNaive : MlaAttentionAbsorbed;
    std::vector<float> out(1);
    attend(d, 1, 1, std::vector<float>{0.5f}, std::vector<float>{1, 1}, latent, k_pe, wkv_b, out);
    EXPECT_NEAR(out[0], 2.284782f, 1e-5f);

    // Both tokens as one block from position 0: token 0 sees only key 0 (o = 3 * 1), token 1
    // sees both (as above). The scale multiplies the scores: with scale 0.5, P = softmax(1, 0).
    std::vector<float> block(2);
    attend(d, 2, 0, std::vector<float>{0.5f, 0.5f}, std::vector<float>{1, 1, 1, 1}, latent, k_pe,
           wkv_b, block);
    EXPECT_NEAR(block[0], 3.0f, 1e-5f);
    EXPECT_NEAR(block[1], 2.284782f, 1e-5f);
    MlaDimensions half = d;
    half.softmax_scale = 0.5f;
    attend(half, 1, 1, std::vector<float>{0.5f}, std::vector<float>{1, 1}, latent, k_pe, wkv_b,
           out);
    EXPECT_NEAR(out[0], 3.0f * (0.7310586f - 0.2689414f), 1e-5f);
  }
}

TEST(MlaAttentionTest, AbsorbedMatchesNaiveOnRandomInputs) {
  const MlaDimensions d{3, 8, 4, 6, 12, 0.3f};  // nh, dn, dr, dv, Rkv, scale
  std::mt19937 rng(5);
  const int64_t start = 5, n = 4, keys = start + n;
  const std::vector<float> q_nope = RandomVector(rng, n * 3 * 8, 1.0f);
  const std::vector<float> q_pe = RandomVector(rng, n * 3 * 4, 1.0f);
  const std::vector<float> latent = RandomVector(rng, keys * 12, 1.0f);
  const std::vector<float> k_pe = RandomVector(rng, keys * 4, 1.0f);
  const std::vector<float> wkv_b = RandomVector(rng, 3 * 14 * 12, 0.5f);
  std::vector<float> naive(n * 3 * 6), absorbed(n * 3 * 6);
  MlaAttentionNaive(d, n, start, q_nope, q_pe, latent, k_pe, wkv_b, naive);
  MlaAttentionAbsorbed(d, n, start, q_nope, q_pe, latent, k_pe, wkv_b, absorbed);
  EXPECT_LT(RelError(absorbed, naive), 1e-5);
  // The computation is not trivially constant: the last query differs from the first.
  EXPECT_GT(std::abs(naive[0] - naive[(n - 1) * 18]), 1e-3f);
}

// ---------------------------------------------------------------------------------- model

class ReferenceModelTest : public ::testing::Test {
 protected:
  void SetUp() override {
    config_ = MicroConfig();
    tensors_ = RandomWeights(config_, 1234);
    source_ = MakeSource(tensors_, Storage::kF32);
  }

  ModelConfig config_;
  std::vector<NamedTensor> tensors_;
  std::unique_ptr<InMemoryWeightSource> source_;
  const std::vector<int32_t> prompt_ = {5, 17, 3, 60, 42, 0, 9, 33, 12};
};

TEST_F(ReferenceModelTest, NaiveAndAbsorbedMlaGiveTheSameLogits) {
  auto naive = MakeModel(config_, *source_, MlaForm::kNaive);
  auto absorbed = MakeModel(config_, *source_, MlaForm::kAbsorbed);
  ASSERT_TRUE(naive && absorbed);
  ReferenceKvCache cache_n = naive->NewCache(), cache_a = absorbed->NewCache();
  absl::StatusOr<std::vector<float>> ln = naive->Forward(prompt_, cache_n);
  absl::StatusOr<std::vector<float>> la = absorbed->Forward(prompt_, cache_a);
  ASSERT_TRUE(ln.ok() && la.ok());
  ASSERT_EQ(ln->size(), prompt_.size() * 64);
  EXPECT_LT(RelError(*la, *ln), 1e-5);
  // The caches are identical too (the form only changes how they are read).
  // The caches agree too: exactly in layer 0 (the form only changes how a cache is read), up to
  // rounding of the earlier layers' outputs above it.
  for (int64_t l = 0; l < 3; ++l) {
    const std::vector<float> a(cache_a.latent(l).begin(), cache_a.latent(l).end());
    const std::vector<float> n(cache_n.latent(l).begin(), cache_n.latent(l).end());
    if (l == 0) {
      EXPECT_EQ(a, n);
    } else {
      EXPECT_LT(RelError(a, n), 1e-5) << l;
    }
  }
}

TEST_F(ReferenceModelTest, IncrementalDecodeMatchesFullSequence) {
  for (MlaForm form : {MlaForm::kNaive, MlaForm::kAbsorbed}) {
    auto model = MakeModel(config_, *source_, form);
    ASSERT_TRUE(model);
    ReferenceKvCache full_cache = model->NewCache();
    absl::StatusOr<std::vector<float>> full = model->Forward(prompt_, full_cache);
    ASSERT_TRUE(full.ok()) << full.status();
    EXPECT_EQ(full_cache.size(), 9);

    // Prefill 5, then 4 single-token decodes.
    ReferenceKvCache cache = model->NewCache();
    std::vector<float> pieces;
    absl::StatusOr<std::vector<float>> pre =
        model->Forward(std::span<const int32_t>(prompt_).first(5), cache);
    ASSERT_TRUE(pre.ok()) << pre.status();
    pieces = *pre;
    for (size_t i = 5; i < prompt_.size(); ++i) {
      absl::StatusOr<std::vector<float>> step =
          model->Forward(std::span<const int32_t>(prompt_).subspan(i, 1), cache);
      ASSERT_TRUE(step.ok()) << step.status();
      pieces.insert(pieces.end(), step->begin(), step->end());
    }
    EXPECT_EQ(cache.size(), 9);
    EXPECT_LT(RelError(pieces, *full), 1e-6);
    // Two chunks (4 + 5) agree as well.
    ReferenceKvCache chunked = model->NewCache();
    absl::StatusOr<std::vector<float>> a =
        model->Forward(std::span<const int32_t>(prompt_).first(4), chunked);
    absl::StatusOr<std::vector<float>> b =
        model->Forward(std::span<const int32_t>(prompt_).subspan(4), chunked);
    ASSERT_TRUE(a.ok() && b.ok());
    a->insert(a->end(), b->begin(), b->end());
    EXPECT_LT(RelError(*a, *full), 1e-6);
  }
}

TEST_F(ReferenceModelTest, EarlierTokensInfluenceLaterLogits) {
  // Guards against a broken cache or mask that would make attention see only the current token.
  auto model = MakeModel(config_, *source_);
  ASSERT_TRUE(model);
  std::vector<int32_t> other = prompt_;
  other[0] = 7;
  ReferenceKvCache c1 = model->NewCache(), c2 = model->NewCache();
  absl::StatusOr<std::vector<float>> l1 = model->Forward(prompt_, c1);
  absl::StatusOr<std::vector<float>> l2 = model->Forward(other, c2);
  ASSERT_TRUE(l1.ok() && l2.ok());
  const std::vector<float> last1(l1->end() - 64, l1->end()), last2(l2->end() - 64, l2->end());
  EXPECT_GT(RelError(last1, last2), 1e-3);
  // Causality: changing the last token leaves the logits of every earlier position untouched.
  std::vector<int32_t> tail = prompt_;
  tail.back() = 7;
  ReferenceKvCache c3 = model->NewCache();
  absl::StatusOr<std::vector<float>> l3 = model->Forward(tail, c3);
  ASSERT_TRUE(l3.ok());
  const size_t head = (prompt_.size() - 1) * 64;
  EXPECT_EQ(std::vector<float>(l1->begin(), l1->begin() + head),
            std::vector<float>(l3->begin(), l3->begin() + head));
}

TEST_F(ReferenceModelTest, TraceRecordsEveryLayerAndRouting) {
  auto model = MakeModel(config_, *source_);
  ASSERT_TRUE(model);
  ReferenceKvCache cache = model->NewCache();
  ForwardTrace trace;
  ASSERT_TRUE(model->Forward(prompt_, cache, &trace).ok());
  ASSERT_EQ(trace.hidden.size(), 4u);
  for (const auto& h : trace.hidden) EXPECT_EQ(h.size(), prompt_.size() * 32);
  ASSERT_EQ(trace.routing.size(), 3u);
  EXPECT_TRUE(trace.routing[0].empty());  // dense layer
  for (int l = 1; l < 3; ++l) {
    ASSERT_EQ(trace.routing[l].size(), prompt_.size());
    for (const MoeGateResult& r : trace.routing[l]) {
      ASSERT_EQ(r.experts.size(), 2u);
      EXPECT_NE(r.experts[0], r.experts[1]);
      EXPECT_NEAR(r.weights[0] + r.weights[1], 2.5f, 1e-5f);
    }
  }
  // The embedding row is the stored one.
  ASSERT_EQ(tensors_[0].name, kEmbedTokensName);
  EXPECT_EQ(trace.hidden[0][0], tensors_[0].values[5 * 32]);
}

TEST_F(ReferenceModelTest, FollowRoutingTakesTheGivenExpertsAndKeepsItsOwnSelectionGap) {
  auto model = MakeModel(config_, *source_);
  ASSERT_TRUE(model);
  ReferenceKvCache c1 = model->NewCache();
  ForwardTrace own;
  absl::StatusOr<std::vector<float>> base = model->Forward(prompt_, c1, &own);
  ASSERT_TRUE(base.ok());
  // The error model's outputs: a tolerance per MoE layer and token, errors growing with depth.
  for (int l = 1; l < 3; ++l) {
    ASSERT_EQ(own.gap_tolerance[l].size(), prompt_.size());
    for (size_t t = 0; t < prompt_.size(); ++t) EXPECT_GT(own.gap_tolerance[l][t], 0.0);
  }
  EXPECT_GT(own.residual_error[2][0], own.residual_error[0][0]);
  EXPECT_GT(model->LogitPairTolerance(own, 0, 1, 2), 0.0);
  EXPECT_EQ(model->LogitPairTolerance(own, 0, 3, 3), 0.0);
  EXPECT_EQ(model->LogitPairTolerance(own, 0, 1, 2), model->LogitPairTolerance(own, 0, 2, 1));
  // Following the reference's own choice everywhere changes nothing.
  ReferenceKvCache c2 = model->NewCache();
  ForwardTrace same;
  same.follow_routing = [&](int64_t l, int64_t p) { return &own.routing[l][p].experts; };
  absl::StatusOr<std::vector<float>> followed = model->Forward(prompt_, c2, &same);
  ASSERT_TRUE(followed.ok());
  EXPECT_EQ(*followed, *base);
  // Other experts at one (layer, position): taken, recorded, with the reference's own gap kept.
  const std::vector<int32_t> other = {own.routing[1][2].experts[0] == 0 ? 1 : 0,
                                      own.routing[1][2].experts[0] == 2 ? 3 : 2};
  ReferenceKvCache c3 = model->NewCache();
  ForwardTrace forced;
  forced.follow_routing = [&](int64_t l, int64_t p) -> const std::vector<int32_t>* {
    return l == 1 && p == 2 ? &other : nullptr;
  };
  absl::StatusOr<std::vector<float>> changed = model->Forward(prompt_, c3, &forced);
  ASSERT_TRUE(changed.ok());
  EXPECT_TRUE(forced.routing[1][2].followed);
  EXPECT_EQ(forced.routing[1][2].experts, other);
  EXPECT_EQ(forced.routing[1][2].SelectionGap(), own.routing[1][2].SelectionGap());
  EXPECT_FALSE(forced.routing[1][1].followed);
  EXPECT_NE(*changed, *base);
  const size_t row = 64;  // position 1's logits are before the change
  EXPECT_EQ(std::vector<float>(changed->begin(), changed->begin() + 2 * row),
            std::vector<float>(base->begin(), base->begin() + 2 * row));
}

TEST_F(ReferenceModelTest, Fp8WeightsMatchDequantizedFloatWeights) {
  auto fp8_source = MakeSource(tensors_, Storage::kFp8);
  // The FP8 source really holds FP8 tensors with scales.
  absl::StatusOr<Weight> w = fp8_source->GetWeight(ExpertTensorName(1, 3, kUpProj));
  ASSERT_TRUE(w.ok()) << w.status();
  EXPECT_EQ(w->tensor.dtype, DType::kF8E4M3);
  EXPECT_TRUE(w->has_scale);

  // The same weights, dequantized to float outside the model, stored as F32.
  std::vector<NamedTensor> dequantized = tensors_;
  for (NamedTensor& t : dequantized) {
    absl::StatusOr<Weight> weight = fp8_source->GetWeight(t.name);
    ASSERT_TRUE(weight.ok());
    absl::StatusOr<std::vector<float>> values = DequantizeToFloat(*weight);
    ASSERT_TRUE(values.ok());
    t.values = *values;
  }
  auto dequantized_source = MakeSource(dequantized, Storage::kF32);

  auto fp8_model = MakeModel(config_, *fp8_source);
  auto float_model = MakeModel(config_, *source_);
  auto dequantized_model = MakeModel(config_, *dequantized_source);
  ASSERT_TRUE(fp8_model && float_model && dequantized_model);
  ReferenceKvCache c1 = fp8_model->NewCache(), c2 = float_model->NewCache(),
                   c3 = dequantized_model->NewCache();
  absl::StatusOr<std::vector<float>> fp8_logits = fp8_model->Forward(prompt_, c1);
  absl::StatusOr<std::vector<float>> float_logits = float_model->Forward(prompt_, c2);
  absl::StatusOr<std::vector<float>> dq_logits = dequantized_model->Forward(prompt_, c3);
  ASSERT_TRUE(fp8_logits.ok() && float_logits.ok() && dq_logits.ok());
  // Bit-identical to the float model on the dequantized weights, and really quantized.
  EXPECT_EQ(*fp8_logits, *dq_logits);
  EXPECT_GT(RelError(*fp8_logits, *float_logits), 1e-3);
}

TEST(ReferenceModelFp8Test, LogitsWithinQuantizationErrorOfFloatWeights) {
  // FP8 E4M3 keeps 3 mantissa bits: ~2.6% RMS error per weight, ~4% per layer here. Routing is
  // discontinuous (a flipped expert choice moves logits by far more than the weight error), so
  // the tolerance check uses an all-dense variant of the micro model; over seeds 1..12 its
  // logit error was 0.055..0.09.
  ModelConfig c = MicroConfig();
  c.first_k_dense_replace = c.num_hidden_layers;
  const std::vector<NamedTensor> tensors = RandomWeights(c, 1234);
  auto float_model = MakeModel(c, *MakeSource(tensors, Storage::kF32));
  auto fp8_model = MakeModel(c, *MakeSource(tensors, Storage::kFp8));
  ASSERT_TRUE(float_model && fp8_model);
  const std::vector<int32_t> tokens = {5, 17, 3, 60, 42, 0, 9, 33, 12};
  ReferenceKvCache c1 = float_model->NewCache(), c2 = fp8_model->NewCache();
  ForwardTrace t1, t2;
  absl::StatusOr<std::vector<float>> want = float_model->Forward(tokens, c1, &t1);
  absl::StatusOr<std::vector<float>> got = fp8_model->Forward(tokens, c2, &t2);
  ASSERT_TRUE(want.ok() && got.ok());
  EXPECT_LT(RelError(t2.hidden[1], t1.hidden[1]), 0.08);  // one layer
  const double err = RelError(*got, *want);
  EXPECT_LT(err, 0.15);
  EXPECT_GT(err, 1e-3);
}

TEST_F(ReferenceModelTest, BadTokenIdIsInvalidArgumentAndLeavesCacheUntouched) {
  auto model = MakeModel(config_, *source_);
  ASSERT_TRUE(model);
  ReferenceKvCache cache = model->NewCache();
  ASSERT_TRUE(model->Forward(std::vector<int32_t>{1, 2}, cache).ok());
  for (int32_t bad : {64, -1, 1 << 30}) {
    absl::StatusOr<std::vector<float>> r = model->Forward(std::vector<int32_t>{3, bad}, cache);
    EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument) << bad;
    EXPECT_THAT(std::string(r.status().message()), HasSubstr(absl::StrCat(bad)));
    EXPECT_EQ(cache.size(), 2);
    EXPECT_EQ(cache.latent(0).size(), 2u * 16);
  }
  EXPECT_EQ(model->Forward(std::vector<int32_t>{}, cache).status().code(),
            absl::StatusCode::kInvalidArgument);
}

TEST_F(ReferenceModelTest, PositionsBeyondMaxPositionEmbeddingsAreInvalidArgument) {
  config_.max_position_embeddings = 8;
  auto model = MakeModel(config_, *source_);
  ASSERT_TRUE(model);
  ReferenceKvCache cache = model->NewCache();
  EXPECT_EQ(model->Forward(prompt_, cache).status().code(), absl::StatusCode::kInvalidArgument);
  ASSERT_TRUE(model->Forward(std::span<const int32_t>(prompt_).first(8), cache).ok());
  absl::StatusOr<std::vector<float>> r = model->Forward(std::vector<int32_t>{1}, cache);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(r.status().message()), HasSubstr("max_position_embeddings"));
  cache.Clear();
  EXPECT_TRUE(model->Forward(std::vector<int32_t>{1}, cache).ok());
}

TEST_F(ReferenceModelTest, CacheOfAnotherShapeIsInvalidArgument) {
  auto model = MakeModel(config_, *source_);
  ASSERT_TRUE(model);
  ModelConfig other = config_;
  other.num_hidden_layers = 2;
  ReferenceKvCache cache(other);
  EXPECT_EQ(model->Forward(std::vector<int32_t>{1}, cache).status().code(),
            absl::StatusCode::kInvalidArgument);
}

TEST_F(ReferenceModelTest, MissingOrMisshapedTensorFailsCreate) {
  std::vector<NamedTensor> missing;
  for (const NamedTensor& t : tensors_) {
    if (t.name != ExpertTensorName(2, 7, kDownProj)) missing.push_back(t);
  }
  absl::StatusOr<std::unique_ptr<ReferenceModel>> r =
      ReferenceModel::Create(config_, *MakeSource(missing, Storage::kF32));
  EXPECT_EQ(r.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(std::string(r.status().message()), HasSubstr("experts.7.down_proj"));

  std::vector<NamedTensor> misshaped = tensors_;
  for (NamedTensor& t : misshaped) {
    if (t.name == LayerTensorName(0, layer_tensor::kKvBProj)) t.shape = {16, 32};
  }
  r = ReferenceModel::Create(config_, *MakeSource(misshaped, Storage::kF32));
  EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(r.status().message()), HasSubstr("kv_b_proj"));

  ModelConfig softmax_router = config_;
  softmax_router.scoring_func = "softmax";
  EXPECT_EQ(ReferenceModel::Create(softmax_router, *source_).status().code(),
            absl::StatusCode::kUnimplemented);
}

TEST_F(ReferenceModelTest, GenerateGreedyIsDeterministicAndFollowsItsLogits) {
  auto model = MakeModel(config_, *source_);
  ASSERT_TRUE(model);
  const std::vector<int32_t> prompt = {1, 2, 3};
  std::vector<std::vector<float>> step_logits;
  absl::StatusOr<std::vector<int32_t>> a = GenerateGreedy(*model, prompt, 8, &step_logits);
  absl::StatusOr<std::vector<int32_t>> b = GenerateGreedy(*model, prompt, 8);
  ASSERT_TRUE(a.ok() && b.ok()) << a.status() << b.status();
  EXPECT_EQ(*a, *b);
  ASSERT_EQ(a->size(), 8u);
  ASSERT_EQ(step_logits.size(), 8u);
  for (size_t i = 0; i < a->size(); ++i) {
    const auto& l = step_logits[i];
    EXPECT_EQ((*a)[i], std::max_element(l.begin(), l.end()) - l.begin()) << i;
  }
  // Step logits equal a full forward of prompt + generated tokens (minus the last).
  std::vector<int32_t> seq = prompt;
  seq.insert(seq.end(), a->begin(), a->end() - 1);
  ReferenceKvCache cache = model->NewCache();
  absl::StatusOr<std::vector<float>> full = model->Forward(seq, cache);
  ASSERT_TRUE(full.ok());
  for (size_t i = 0; i < a->size(); ++i) {
    const auto row = full->begin() + (prompt.size() - 1 + i) * 64;
    EXPECT_LT(RelError(step_logits[i], std::vector<float>(row, row + 64)), 1e-6) << i;
  }
  EXPECT_TRUE(GenerateGreedy(*model, prompt, 0)->empty());
  EXPECT_EQ(GenerateGreedy(*model, {}, 4).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(GenerateGreedy(*model, prompt, -1).status().code(), absl::StatusCode::kInvalidArgument);
  // max_position_embeddings 256: 3 + 254 new tokens use positions 0..255 (the last token is not
  // fed back); one more does not fit and fails up front.
  EXPECT_TRUE(GenerateGreedy(*model, prompt, 254).ok());
  EXPECT_THAT(std::string(GenerateGreedy(*model, prompt, 255).status().message()),
              HasSubstr("max_position_embeddings"));
}

TEST(ReferenceModelLiteTest, ModelWithoutQLoraRunsAndFormsAgree) {
  // "Lite" layout: a single q_proj, no shared experts, no group stage, two dense layers.
  ModelConfig c = MicroConfig();
  c.q_lora_rank.reset();
  c.n_shared_experts = 0;
  c.n_group = 1;
  c.topk_group = 1;
  c.first_k_dense_replace = 2;
  const std::vector<NamedTensor> tensors = RandomWeights(c, 99);
  auto source = MakeSource(tensors, Storage::kF32);
  auto naive = MakeModel(c, *source, MlaForm::kNaive);
  auto absorbed = MakeModel(c, *source, MlaForm::kAbsorbed);
  ASSERT_TRUE(naive && absorbed);
  const std::vector<int32_t> tokens = {4, 8, 15, 16, 23, 42};
  ReferenceKvCache cn = naive->NewCache(), ca = absorbed->NewCache();
  absl::StatusOr<std::vector<float>> ln = naive->Forward(tokens, cn);
  absl::StatusOr<std::vector<float>> la = absorbed->Forward(tokens, ca);
  ASSERT_TRUE(ln.ok() && la.ok()) << ln.status() << la.status();
  EXPECT_LT(RelError(*la, *ln), 1e-5);
}

}  // namespace
}  // namespace hmoe::reference
