#include "tools/model_writer.h"

#include <unistd.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <map>
#include <memory>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "common/base/json.h"
#include "common/base/mapped_file.h"
#include "common/model/checkpoint.h"
#include "common/model/dtype.h"
#include "common/model/tensor.h"
#include "common/model/tensor_map.h"
#include "common/model/tokenizer.h"

namespace hmoe {
namespace {

namespace fs = std::filesystem;
using ::testing::HasSubstr;

// The tiny preset written once (seed 0, FP8, 2 threads) and shared by the read-only tests;
// each test also gets a scratch directory. Writes beyond the shared one use a reduced tiny
// (2 layers, 8 experts, vocab 512) to keep the binary fast.
class ModelWriterTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    shared_root_ = new fs::path(fs::temp_directory_path() /
                                ("hmoe_model_writer_test_" + std::to_string(getpid())));
    fs::remove_all(*shared_root_);
    fs::create_directories(*shared_root_);
    const absl::Status s = WriteModel(Tiny(), SharedTiny(), {});
    ASSERT_TRUE(s.ok()) << s;
  }
  static void TearDownTestSuite() {
    fs::remove_all(*shared_root_);
    delete shared_root_;
    shared_root_ = nullptr;
  }
  void SetUp() override {
    root_ = *shared_root_ / ::testing::UnitTest::GetInstance()->current_test_info()->name();
    fs::create_directories(root_);
  }
  void TearDown() override { fs::remove_all(root_); }

  static std::string SharedTiny() { return (*shared_root_ / "tiny").string(); }
  std::string Dir(const std::string& name) const { return (root_ / name).string(); }

  static ModelPreset Tiny() {
    absl::StatusOr<ModelPreset> preset = GetPreset("tiny");
    EXPECT_TRUE(preset.ok()) << preset.status();
    return *preset;
  }
  static ModelPreset ReducedTiny() {
    ModelPreset preset = Tiny();
    EXPECT_TRUE(ApplyOverrides({.vocab_size = 512, .num_layers = 2, .experts = 8}, &preset).ok());
    return preset;
  }

  // Writes `preset` to Dir(name) and returns the directory.
  std::string Write(const ModelPreset& preset, const std::string& name,
                    const WriteOptions& options = {}) {
    const std::string dir = Dir(name);
    const absl::Status s = WriteModel(preset, dir, options);
    EXPECT_TRUE(s.ok()) << s;
    return dir;
  }

  static fs::path* shared_root_;
  fs::path root_;
};

fs::path* ModelWriterTest::shared_root_ = nullptr;

std::string ReadAll(const fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  std::ostringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

// All files of `dir` with their contents, by file name.
std::map<std::string, std::string> Contents(const std::string& dir) {
  std::map<std::string, std::string> out;
  for (const auto& entry : fs::directory_iterator(dir)) {
    out[entry.path().filename().string()] = ReadAll(entry.path());
  }
  return out;
}

const ExpectedTensor& FindExpected(const std::vector<ExpectedTensor>& all,
                                   const std::string& name) {
  for (const ExpectedTensor& t : all) {
    if (t.name == name) return t;
  }
  ADD_FAILURE() << "no expected tensor " << name;
  return all.front();
}

TEST(FastFp8Test, MatchesFloatToFp8E4M3) {
  const auto check = [](float f) {
    ASSERT_EQ(internal::FastFloatToFp8E4M3(f), FloatToFp8E4M3(f)) << "f=" << f;
  };
  // A strided sweep over every float up to 512 (both signs), past the saturation point.
  for (uint32_t bits = 0; bits <= 0x44000000u; bits += 1009) {
    check(std::bit_cast<float>(bits));
    check(-std::bit_cast<float>(bits));
  }
  // Every code value, the midpoints between neighbours (ties) and their float neighbours.
  for (int code = 0; code < 0x7E; ++code) {
    const float lo = Fp8E4M3ToFloat(static_cast<uint8_t>(code));
    const float hi = Fp8E4M3ToFloat(static_cast<uint8_t>(code + 1));
    const float mid = (lo + hi) / 2;
    for (float f : {lo, hi, mid, std::nextafter(mid, 0.0f), std::nextafter(mid, 1000.0f)}) {
      check(f);
      check(-f);
    }
  }
  for (float f :
       {0.0f, -0.0f, 448.0f, 463.9f, 464.0f, 1e30f, std::numeric_limits<float>::infinity(),
        -std::numeric_limits<float>::infinity(), std::numeric_limits<float>::quiet_NaN(),
        std::numeric_limits<float>::denorm_min()}) {
    check(f);
  }
}

TEST(GeneratorTest, ValuesAreStandardNormal) {
  // embed_tokens is N(0, 1): check the moments and the 1- and 2-sigma masses of 1M draws.
  const ModelConfig config = GetPreset("tiny")->config;
  const ExpectedTensor t{
      std::string(kEmbedTokensName), {1000, 1000}, TensorKind::kEmbedding, -1, -1};
  const std::vector<float> v = GenerateTensor(t, config, 5);
  double sum = 0, sum_sq = 0, sum_4 = 0;
  int64_t within1 = 0, within2 = 0;
  for (float x : v) {
    sum += x;
    sum_sq += static_cast<double>(x) * x;
    sum_4 += static_cast<double>(x) * x * x * x;
    within1 += std::fabs(x) < 1.0f;
    within2 += std::fabs(x) < 2.0f;
  }
  const double n = static_cast<double>(v.size());
  EXPECT_NEAR(sum / n, 0.0, 0.005);
  EXPECT_NEAR(sum_sq / n, 1.0, 0.01);
  EXPECT_NEAR(sum_4 / n, 3.0, 0.05);  // kurtosis of a normal
  EXPECT_NEAR(static_cast<double>(within1) / n, 0.6827, 0.002);
  EXPECT_NEAR(static_cast<double>(within2) / n, 0.9545, 0.001);
}

TEST(PresetTest, TinyIsModelSpecT1) {
  absl::StatusOr<ModelPreset> p = GetPreset("tiny");
  ASSERT_TRUE(p.ok()) << p.status();
  const ModelConfig& c = p->config;
  EXPECT_EQ(c.vocab_size, 1024);
  EXPECT_EQ(c.hidden_size, 256);
  EXPECT_EQ(c.intermediate_size, 512);
  EXPECT_EQ(c.moe_intermediate_size, 128);
  EXPECT_EQ(c.num_hidden_layers, 4);
  EXPECT_EQ(c.first_k_dense_replace, 1);
  EXPECT_EQ(c.num_attention_heads, 4);
  EXPECT_EQ(c.q_lora_rank, 64);
  EXPECT_EQ(c.kv_lora_rank, 64);
  EXPECT_EQ(c.qk_nope_head_dim, 32);
  EXPECT_EQ(c.qk_rope_head_dim, 16);
  EXPECT_EQ(c.v_head_dim, 32);
  EXPECT_EQ(c.n_routed_experts, 16);
  EXPECT_EQ(c.n_shared_experts, 1);
  EXPECT_EQ(c.num_experts_per_tok, 4);
  EXPECT_EQ(c.n_group, 4);
  EXPECT_EQ(c.topk_group, 2);
  EXPECT_EQ(c.max_position_embeddings, 1024);
  EXPECT_DOUBLE_EQ(c.rope_scaling.factor, 4.0);
  EXPECT_EQ(c.rope_scaling.original_max_position_embeddings, 256);
  EXPECT_EQ(c.num_nextn_predict_layers, 0);
  EXPECT_NEAR(c.softmax_scale(), 0.187130, 1e-6);  // MODEL-SPEC 7.1
}

TEST(PresetTest, LargerPresetsAreValidAndFp8Friendly) {
  for (const char* name : {"small", "real-shaped"}) {
    absl::StatusOr<ModelPreset> p = GetPreset(name);
    ASSERT_TRUE(p.ok()) << name << ": " << p.status();
    EXPECT_LE(p->tokenizer_vocab_size, p->config.vocab_size);
    // Every FP8 linear's input dimension is a multiple of 128 (activation-quant GEMM).
    for (const ExpectedTensor& t : ExpectedTensors(p->config)) {
      if (t.kind == TensorKind::kLinear) {
        EXPECT_EQ(t.shape[1] % 128, 0) << name << " " << t.name;
      }
    }
  }
  const ModelConfig real = GetPreset("real-shaped")->config;
  EXPECT_EQ(real.hidden_size, 7168);
  EXPECT_EQ(real.num_attention_heads, 128);
  EXPECT_DOUBLE_EQ(real.rope_scaling.factor, 40.0);
  EXPECT_EQ(real.max_position_embeddings, 163840);
  EXPECT_EQ(GetPreset("huge").status().code(), absl::StatusCode::kInvalidArgument);
}

TEST(PresetTest, OverridesApplyAndAreValidated) {
  ModelPreset p = *GetPreset("tiny");
  ASSERT_TRUE(ApplyOverrides({.vocab_size = 512, .num_layers = 2, .experts = 8}, &p).ok());
  EXPECT_EQ(p.config.vocab_size, 512);
  EXPECT_EQ(p.tokenizer_vocab_size, 512);
  EXPECT_EQ(p.config.num_hidden_layers, 2);
  EXPECT_EQ(p.config.n_routed_experts, 8);
  ModelPreset bad = *GetPreset("tiny");
  EXPECT_EQ(ApplyOverrides({.experts = 6}, &bad).code(), absl::StatusCode::kInvalidArgument);
  ModelPreset small_vocab = *GetPreset("tiny");
  EXPECT_EQ(ApplyOverrides({.vocab_size = 100}, &small_vocab).code(),
            absl::StatusCode::kInvalidArgument);
}

TEST(PresetTest, ConfigOverrideReplacesFieldsBeforeShapes) {
  ModelPreset p = *GetPreset("tiny");
  ASSERT_TRUE(ApplyConfigOverride(R"({"hidden_size": 200, "q_lora_rank": null, "n_group": 1,
                                      "topk_group": 1, "num_attention_heads": 3,
                                      "rope_scaling": {"type": "yarn", "factor": 8,
                                                       "original_max_position_embeddings": 128,
                                                       "mscale_all_dim": 1}})",
                                  &p)
                  .ok());
  EXPECT_EQ(p.config.hidden_size, 200);
  EXPECT_FALSE(p.config.q_lora_rank.has_value());
  EXPECT_EQ(p.config.n_group, 1);
  EXPECT_EQ(p.config.num_attention_heads, 3);
  EXPECT_DOUBLE_EQ(p.config.rope_scaling.factor, 8.0);
  EXPECT_EQ(p.config.rope_scaling.mscale, 0.0);  // absent: the whole object was replaced
  EXPECT_EQ(p.config.rope_scaling.mscale_all_dim, 1.0);
  // A second override adds to the first; rope_scaling null is plain RoPE.
  ASSERT_TRUE(ApplyConfigOverride(R"({"rope_scaling": null, "vocab_size": 700})", &p).ok());
  EXPECT_FALSE(p.config.rope_scaling.enabled);
  EXPECT_EQ(p.config.hidden_size, 200);
  EXPECT_EQ(p.config.vocab_size, 700);
  EXPECT_EQ(p.tokenizer_vocab_size, 700);
  // The weights follow the shapes.
  const std::vector<ExpectedTensor> expected = ExpectedTensors(p.config);
  EXPECT_EQ(FindExpected(expected, "model.embed_tokens.weight").shape,
            (std::vector<int64_t>{700, 200}));
  EXPECT_EQ(FindExpected(expected, "model.layers.0.self_attn.q_proj.weight").shape,
            (std::vector<int64_t>{3 * 48, 200}));
}

TEST(PresetTest, ConfigOverrideErrorsNameTheProblem) {
  struct Case {
    const char* json;
    const char* expected;
  };
  const Case cases[] = {
      {"[1, 2]", "expected a JSON object, got array"},
      {"{\"hidden_size\": 256", "config override: "},  // a JSON syntax error
      {R"({"hidden_sise": 256})", "unknown field \"hidden_sise\""},
      {R"({"rope_scaling": {"type": "yarn", "factor": 4, "mscale_al_dim": 1}})",
       "unknown field \"rope_scaling.mscale_al_dim\""},
      {R"({"quantization_config": null})", "set by --dtype"},
      {R"({"text_config": {}})", "nested configs are not supported"},
      {R"({"hidden_size": "256"})", "field \"hidden_size\": expected an integer, got string"},
      {R"({"n_group": 3})", "field \"n_group\""},
      {R"({"qk_rope_head_dim": 15})", "must be even"},
      {R"({"vocab_size": 100})", "below the built tokenizer's minimum"},
      {R"({"rope_scaling": {"type": "yarn", "factor": 4, "truncate": false}})",
       "rope_scaling.truncate"},
  };
  for (const Case& c : cases) {
    ModelPreset p = *GetPreset("tiny");
    const ModelPreset before = p;
    const absl::Status s = ApplyConfigOverride(c.json, &p);
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << c.json << ": " << s;
    EXPECT_THAT(std::string(s.message()), HasSubstr(c.expected)) << c.json;
    EXPECT_EQ(p.config, before.config) << "a failed override must leave the preset alone";
  }
}

// config.json carries the override as given (rope_scaling keys it leaves out stay out, as
// transformers must see them), reads back as the generating config, and the weights are the
// same bytes for the same seed and override.
TEST_F(ModelWriterTest, ConfigOverrideIsWrittenAsGivenAndDeterministic) {
  ModelPreset p = ReducedTiny();
  ASSERT_TRUE(ApplyConfigOverride(R"({"hidden_size": 200, "moe_intermediate_size": 72,
                                      "rope_scaling": {"type": "yarn", "factor": 8,
                                                       "original_max_position_embeddings": 128,
                                                       "mscale_all_dim": 1}})",
                                  &p)
                  .ok());
  const std::string a = Write(p, "a");
  const std::string b = Write(p, "b");
  EXPECT_EQ(Contents(a), Contents(b));
  const std::string config_text = ReadAll(fs::path(a) / "config.json");
  absl::StatusOr<json::Value> config = json::Parse(config_text);
  ASSERT_TRUE(config.ok()) << config.status();
  const json::Value* rope = config->Find("rope_scaling");
  ASSERT_NE(rope, nullptr);
  EXPECT_EQ(rope->Find("mscale"), nullptr) << config_text;
  ASSERT_NE(rope->Find("mscale_all_dim"), nullptr);
  EXPECT_EQ(config->Find("hidden_size")->as_int(), 200);
  EXPECT_NE(config->Find("quantization_config"), nullptr);  // --dtype fp8 (the default)
  absl::StatusOr<std::unique_ptr<Checkpoint>> ckpt = Checkpoint::Open(a);
  ASSERT_TRUE(ckpt.ok()) << ckpt.status();
  EXPECT_EQ((*ckpt)->config(), p.config);
  EXPECT_TRUE(ValidateTensors((*ckpt)->config(), **ckpt).ok());
  // BF16: the override stays, the quantization goes.
  const std::string bf16 = Write(p, "bf16", {.fp8 = false});
  absl::StatusOr<json::Value> bf16_config = json::Parse(ReadAll(fs::path(bf16) / "config.json"));
  ASSERT_TRUE(bf16_config.ok());
  EXPECT_EQ(bf16_config->Find("quantization_config"), nullptr);
  EXPECT_EQ(bf16_config->Find("hidden_size")->as_int(), 200);
}

TEST_F(ModelWriterTest, TinyReopensValidatesAndIsSharded) {
  const std::string dir = SharedTiny();
  absl::StatusOr<std::unique_ptr<Checkpoint>> ckpt = Checkpoint::Open(dir);
  ASSERT_TRUE(ckpt.ok()) << ckpt.status();
  const ModelConfig& config = (*ckpt)->config();
  EXPECT_TRUE(config.quantization.fp8);
  EXPECT_EQ(config.vocab_size, 1024);
  EXPECT_TRUE(ValidateTensors(config, **ckpt).ok()) << ValidateTensors(config, **ckpt);
  EXPECT_GE((*ckpt)->shards().size(), 2u);

  // Every expected tensor exists with the dtype the real checkpoint uses.
  for (const ExpectedTensor& t : ExpectedTensors(config)) {
    absl::StatusOr<TensorView> view = (*ckpt)->GetTensor(t.name);
    ASSERT_TRUE(view.ok()) << view.status();
    switch (t.kind) {
      case TensorKind::kLinear: {
        EXPECT_EQ(view->dtype, DType::kF8E4M3) << t.name;
        absl::StatusOr<TensorView> scale = (*ckpt)->GetTensor(ScaleInvName(t.name));
        ASSERT_TRUE(scale.ok()) << scale.status();
        EXPECT_EQ(scale->dtype, DType::kF32);
        EXPECT_EQ(scale->shape, ScaleInvShape(t.shape));
        break;
      }
      case TensorKind::kBias:
        EXPECT_EQ(view->dtype, DType::kF32) << t.name;
        break;
      default:
        EXPECT_EQ(view->dtype, DType::kBF16) << t.name;
    }
  }
}

TEST_F(ModelWriterTest, IndexIsConsistentWithShards) {
  const std::string dir = SharedTiny();
  absl::StatusOr<json::Value> index =
      json::Parse(ReadAll(fs::path(dir) / "model.safetensors.index.json"));
  ASSERT_TRUE(index.ok()) << index.status();
  const json::Value* weight_map = index->Find("weight_map");
  ASSERT_NE(weight_map, nullptr);
  absl::StatusOr<std::unique_ptr<Checkpoint>> ckpt = Checkpoint::Open(dir);
  ASSERT_TRUE(ckpt.ok()) << ckpt.status();

  std::set<std::string> files_in_index;
  int64_t total = 0;
  size_t count = 0;
  for (const auto& shard : (*ckpt)->shards()) {
    const std::string file = fs::path(shard->path()).filename().string();
    EXPECT_THAT(file, ::testing::MatchesRegex("model-0000[0-9]-of-0000[0-9]\\.safetensors"));
    for (const auto& [name, entry] : shard->entries()) {
      const json::Value* mapped = weight_map->Find(name);
      ASSERT_NE(mapped, nullptr) << name;
      EXPECT_EQ(mapped->as_string(), file) << name;
      total += static_cast<int64_t>(entry.view.size_bytes);
      ++count;
    }
    files_in_index.insert(file);
  }
  EXPECT_EQ(count, weight_map->members().size());
  EXPECT_EQ(index->Find("metadata")->Find("total_size")->as_int(), total);
  EXPECT_EQ(static_cast<int64_t>((*ckpt)->total_tensor_bytes()), total);
  // Every shard file in the directory is referenced.
  for (const auto& entry : fs::directory_iterator(dir)) {
    const std::string name = entry.path().filename().string();
    if (name.ends_with(".safetensors")) {
      EXPECT_EQ(files_in_index.count(name), 1u) << name;
    }
  }
  // Shards respect the 1 MiB default (a single tensor may exceed it on its own).
  for (const auto& shard : (*ckpt)->shards()) {
    if (shard->entries().size() > 1) {
      EXPECT_LE(shard->file_size(), (1u << 20) + 65536);
    }
  }
}

TEST_F(ModelWriterTest, SameSeedIsByteIdenticalDifferentSeedDiffers) {
  WriteOptions single_thread;
  single_thread.num_threads = 1;
  const auto a = Contents(SharedTiny());
  const auto b = Contents(Write(Tiny(), "b", single_thread));  // thread count must not matter
  ASSERT_EQ(a.size(), b.size());
  for (const auto& [name, bytes] : a) {
    ASSERT_EQ(b.count(name), 1u) << name;
    EXPECT_TRUE(bytes == b.at(name)) << name << " differs between identical runs";
  }
  WriteOptions seed1;
  seed1.seed = 1;
  const auto c = Contents(Write(ReducedTiny(), "c", seed1));
  const auto d = Contents(Write(ReducedTiny(), "d"));
  ASSERT_EQ(c.size(), d.size());
  int differing_shards = 0;
  for (const auto& [name, bytes] : c) {
    if (name.ends_with(".safetensors") && d.count(name) > 0 && d.at(name) != bytes) {
      ++differing_shards;
    }
  }
  EXPECT_GT(differing_shards, 0);
  EXPECT_EQ(c.at("config.json"), d.at("config.json"));
}

TEST_F(ModelWriterTest, Fp8WeightsDequantizeToTheGeneratedValues) {
  const std::string dir = SharedTiny();
  absl::StatusOr<std::unique_ptr<Checkpoint>> ckpt = Checkpoint::Open(dir);
  ASSERT_TRUE(ckpt.ok()) << ckpt.status();
  const std::vector<ExpectedTensor> expected = ExpectedTensors((*ckpt)->config());
  // kv_a has a partial 80-row block; the expert's down_proj a 2x1 block grid.
  for (const std::string name : {"model.layers.1.self_attn.kv_a_proj_with_mqa.weight",
                                 "model.layers.2.mlp.experts.5.down_proj.weight"}) {
    const ExpectedTensor& t = FindExpected(expected, name);
    const std::vector<float> want = GenerateTensor(t, (*ckpt)->config(), /*seed=*/0);
    absl::StatusOr<Weight> w = (*ckpt)->GetWeight(name);
    ASSERT_TRUE(w.ok()) << w.status();
    ASSERT_TRUE(w->has_scale);
    absl::StatusOr<std::vector<float>> got = DequantizeToFloat(*w);
    ASSERT_TRUE(got.ok()) << got.status();
    ASSERT_EQ(got->size(), want.size());
    std::vector<float> scales(static_cast<size_t>(w->scale_inv.num_elements()));
    std::memcpy(scales.data(), w->scale_inv.data, scales.size() * sizeof(float));
    const int64_t cols = t.shape[1];
    const int64_t scale_cols = (cols + 127) / 128;
    double max_abs = 0;
    for (size_t i = 0; i < want.size(); ++i) {
      const int64_t r = static_cast<int64_t>(i) / cols, c = static_cast<int64_t>(i) % cols;
      const float scale = scales[static_cast<size_t>((r / 128) * scale_cols + c / 128)];
      // E4M3 has 3 mantissa bits: relative rounding error <= 2^-4, plus half the subnormal step.
      const float tol = std::fabs(want[i]) * 0.0625f + scale * 0x1p-10f + 1e-7f;
      ASSERT_NEAR((*got)[i], want[i], tol) << name << " element " << i;
      max_abs = std::max(max_abs, static_cast<double>(std::fabs(want[i])));
    }
    // The block holding the largest magnitude maps it to the top of the FP8 range.
    float max_scale = 0;
    for (float s : scales) max_scale = std::max(max_scale, s);
    EXPECT_NEAR(max_scale * 448.0, max_abs, max_abs * 1e-5) << name;
  }
}

TEST_F(ModelWriterTest, WeightScalesMatchInitStd) {
  const ModelPreset tiny = Tiny();
  const std::vector<ExpectedTensor> expected = ExpectedTensors(tiny.config);
  for (const ExpectedTensor& t : expected) {
    if (t.layer > 1) continue;  // enough coverage, keeps the test fast
    const std::vector<float> v = GenerateTensor(t, tiny.config, 3);
    double sum = 0, sum_sq = 0;
    for (float x : v) {
      ASSERT_TRUE(std::isfinite(x));
      sum += x;
      sum_sq += static_cast<double>(x) * x;
    }
    const double n = static_cast<double>(v.size());
    const double mean = sum / n;
    const double stddev = std::sqrt(std::max(0.0, sum_sq / n - mean * mean));
    const InitDistribution d = InitStd(t, tiny.config);
    EXPECT_NEAR(mean, d.mean, 4 * d.stddev / std::sqrt(n) + 1e-6) << t.name;
    EXPECT_NEAR(stddev, d.stddev, d.stddev * (0.2 + 4 / std::sqrt(n))) << t.name;
  }
  // Residual outputs are scaled down relative to a plain 1/sqrt(fan_in).
  const ExpectedTensor& o = FindExpected(expected, "model.layers.0.self_attn.o_proj.weight");
  EXPECT_NEAR(InitStd(o, tiny.config).stddev, 1.0 / std::sqrt(128.0) / std::sqrt(8.0), 1e-6);
  const ExpectedTensor& bias =
      FindExpected(expected, "model.layers.1.mlp.gate.e_score_correction_bias");
  const std::vector<float> b = GenerateTensor(bias, tiny.config, 0);
  EXPECT_TRUE(std::any_of(b.begin(), b.end(), [](float x) { return x != 0.0f; }));
}

TEST_F(ModelWriterTest, GenerateRowsIsIndependentOfTheSplit) {
  const ModelPreset tiny = Tiny();
  const std::vector<ExpectedTensor> expected = ExpectedTensors(tiny.config);
  const ExpectedTensor& t = FindExpected(expected, "model.layers.0.self_attn.q_b_proj.weight");
  const std::vector<float> whole = GenerateTensor(t, tiny.config, 9);
  const int64_t cols = t.shape[1];
  std::vector<float> part(static_cast<size_t>(7 * cols));
  GenerateRows(t, tiny.config, 9, 3, 10, part.data());
  for (size_t i = 0; i < part.size(); ++i) EXPECT_EQ(part[i], whole[3 * cols + i]);
  // A 1-D tensor with an odd length.
  ExpectedTensor odd{"x.weight", {7}, TensorKind::kNorm, -1, -1};
  const std::vector<float> all = GenerateTensor(odd, tiny.config, 1);
  ASSERT_EQ(all.size(), 7u);
  EXPECT_NE(all[5], all[6]);
}

TEST_F(ModelWriterTest, TokenizerLoadsAndRoundTrips) {
  const std::string dir = SharedTiny();
  absl::StatusOr<std::unique_ptr<Tokenizer>> tok = Tokenizer::Load(dir);
  ASSERT_TRUE(tok.ok()) << tok.status();
  EXPECT_EQ((*tok)->vocab_size(), 1024);
  EXPECT_EQ((*tok)->bos_id(), 0);
  EXPECT_EQ((*tok)->eos_id(), 1);
  const std::string text = "Hello, tiny model! 你好 😀\n";
  EXPECT_EQ((*tok)->Decode((*tok)->Encode(text, true), /*skip_special_tokens=*/true), text);
  absl::StatusOr<json::Value> gen = json::Parse(ReadAll(fs::path(dir) / "generation_config.json"));
  ASSERT_TRUE(gen.ok());
  EXPECT_EQ(gen->Find("bos_token_id")->as_int(), 0);
  EXPECT_EQ(gen->Find("eos_token_id")->as_int(), 1);
}

TEST_F(ModelWriterTest, Bf16OptionWritesBf16EverywhereWithoutScales) {
  WriteOptions options;
  options.fp8 = false;
  const std::string dir = Write(ReducedTiny(), "bf16", options);
  absl::StatusOr<std::unique_ptr<Checkpoint>> ckpt = Checkpoint::Open(dir);
  ASSERT_TRUE(ckpt.ok()) << ckpt.status();
  EXPECT_FALSE((*ckpt)->config().quantization.fp8);
  EXPECT_THAT(ReadAll(fs::path(dir) / "config.json"),
              ::testing::Not(HasSubstr("quantization_config")));
  EXPECT_TRUE(ValidateTensors((*ckpt)->config(), **ckpt).ok());
  for (const std::string& name : (*ckpt)->TensorNames()) {
    EXPECT_FALSE(name.ends_with("_scale_inv")) << name;
  }
  const std::vector<ExpectedTensor> expected = ExpectedTensors((*ckpt)->config());
  const ExpectedTensor& t = FindExpected(expected, "model.layers.1.mlp.experts.0.up_proj.weight");
  absl::StatusOr<TensorView> view = (*ckpt)->GetTensor(t.name);
  ASSERT_TRUE(view.ok());
  ASSERT_EQ(view->dtype, DType::kBF16);
  const std::vector<float> want = GenerateTensor(t, (*ckpt)->config(), 0);
  for (size_t i = 0; i < want.size(); ++i) {
    uint16_t bits;
    std::memcpy(&bits, view->data + 2 * i, 2);
    ASSERT_EQ(bits, FloatToBf16(want[i])) << i;
  }
}

TEST_F(ModelWriterTest, RefusesNonEmptyDirectoryUnlessForced) {
  const std::string dir = Dir("existing");
  fs::create_directories(dir);
  { std::ofstream(fs::path(dir) / "notes.txt") << "keep me"; }
  const absl::Status refused = WriteModel(ReducedTiny(), dir, {});
  EXPECT_EQ(refused.code(), absl::StatusCode::kAlreadyExists) << refused;
  EXPECT_FALSE(fs::exists(fs::path(dir) / "config.json"));

  // A stale shard from an earlier, larger write is removed by --force; other files stay.
  { std::ofstream(fs::path(dir) / "model-00009-of-00009.safetensors") << "stale"; }
  WriteOptions force;
  force.force = true;
  ASSERT_TRUE(WriteModel(ReducedTiny(), dir, force).ok());
  EXPECT_FALSE(fs::exists(fs::path(dir) / "model-00009-of-00009.safetensors"));
  EXPECT_TRUE(fs::exists(fs::path(dir) / "notes.txt"));
  EXPECT_TRUE(Checkpoint::Open(dir).ok());
}

TEST_F(ModelWriterTest, KimiTokenizerStyleWritesTiktokenModelAndMatchingConfigIds) {
  WriteOptions kimi;
  kimi.tokenizer_style = TokenizerStyle::kKimi;
  const std::string dir = Write(ReducedTiny(), "kimi", kimi);
  EXPECT_FALSE(fs::exists(fs::path(dir) / "tokenizer.json"));
  EXPECT_TRUE(fs::exists(fs::path(dir) / "tiktoken.model"));
  absl::StatusOr<std::unique_ptr<Checkpoint>> ckpt = Checkpoint::Open(dir);
  ASSERT_TRUE(ckpt.ok()) << ckpt.status();
  absl::StatusOr<std::unique_ptr<Tokenizer>> tokenizer = Tokenizer::Load(dir);
  ASSERT_TRUE(tokenizer.ok()) << tokenizer.status();
  EXPECT_EQ((*tokenizer)->vocab_size(), 512);
  EXPECT_EQ((*ckpt)->config().bos_token_id, (*tokenizer)->bos_id());
  ASSERT_EQ((*ckpt)->config().eos_token_ids.size(), 1u);
  EXPECT_EQ((*ckpt)->config().eos_token_ids[0], (*tokenizer)->eos_id());
  EXPECT_EQ((*tokenizer)->IdToToken((*tokenizer)->eos_id()), "[EOS]");

  // Rewriting in the DeepSeek form (--force) replaces tiktoken.model by tokenizer.json.
  WriteOptions force;
  force.force = true;
  ASSERT_TRUE(WriteModel(ReducedTiny(), dir, force).ok());
  EXPECT_FALSE(fs::exists(fs::path(dir) / "tiktoken.model"));
  EXPECT_TRUE(fs::exists(fs::path(dir) / "tokenizer.json"));
}

TEST_F(ModelWriterTest, ShardSizeOptionChangesSharding) {
  WriteOptions big;
  big.shard_size_bytes = int64_t{64} << 20;
  const std::string dir = Write(ReducedTiny(), "one_shard", big);
  absl::StatusOr<std::unique_ptr<Checkpoint>> ckpt = Checkpoint::Open(dir);
  ASSERT_TRUE(ckpt.ok()) << ckpt.status();
  EXPECT_EQ((*ckpt)->shards().size(), 1u);
  EXPECT_TRUE(fs::exists(fs::path(dir) / "model-00001-of-00001.safetensors"));
}

}  // namespace
}  // namespace hmoe
