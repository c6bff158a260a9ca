// hmoe-make-model --format gguf and the deepseek2 mapping (common/model/gguf_model.h): the config,
// tokenizer and every weight read back from a written GGUF are the ones the writer started from,
// for both MLA layouts and split files; damaged models get clear errors.

#include "tools/gguf_model_writer.h"

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <functional>
#include <map>
#include <set>
#include <string>
#include <vector>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "common/engine/reference/reference_model.h"
#include "common/model/gguf.h"
#include "common/model/gguf_model.h"
#include "common/model/gguf_quants.h"
#include "common/model/tensor_map.h"
#include "common/model/tokenizer.h"
#include "tests/integration/temp_dir.h"
#include "tools/gguf_f32_weights.h"
#include "tools/in_memory_weights.h"
#include "tools/tokenizer_builder.h"

namespace hmoe {
namespace {

using ::testing::HasSubstr;
using testing::TempDir;

ModelPreset Tiny() {
  absl::StatusOr<ModelPreset> p = GetPreset("tiny");
  EXPECT_TRUE(p.ok());
  return *p;
}

std::unique_ptr<GgufModel> WriteAndOpen(const TempDir& dir, const ModelPreset& preset,
                                        GgufWriteOptions options) {
  const absl::Status s = WriteGgufModel(preset, dir.path(), options);
  EXPECT_TRUE(s.ok()) << s;
  std::string open_path = dir.File("model.gguf");
  if (options.split_max_bytes > 0) {  // part 1 (the part count is the writer's choice)
    for (const auto& e : std::filesystem::directory_iterator(dir.path())) {
      if (e.path().filename().string().starts_with("model-00001-of-")) open_path = e.path();
    }
  }
  absl::StatusOr<std::unique_ptr<GgufModel>> m = GgufModel::Open(open_path);
  EXPECT_TRUE(m.ok()) << m.status();
  return m.ok() ? std::move(*m) : nullptr;
}

ModelConfig Expected(const ModelPreset& p) {
  ModelConfig c = p.config;
  c.quantization = QuantizationConfig();
  return c;
}

TEST(GgufModelWriter, TypePolicyIsQ4_K_M) {
  const GgufQuantMix m = GgufQuantMix::kQ4_K_M;
  EXPECT_EQ(GgufTypeFor(m, "blk.3.ffn_gate_exps.weight", 3, 7168), 12u);  // Q4_K
  EXPECT_EQ(GgufTypeFor(m, "blk.3.ffn_up_exps.weight", 3, 7168), 12u);    // Q4_K
  EXPECT_EQ(GgufTypeFor(m, "blk.3.ffn_down_exps.weight", 3, 2048), 14u);  // Q6_K
  EXPECT_EQ(GgufTypeFor(m, "blk.3.ffn_down_exps.weight", 3, 128), 8u);    // Q8_0 fallback
  EXPECT_EQ(GgufTypeFor(m, "blk.3.attn_q_b.weight", 2, 1536), 8u);        // Q8_0
  EXPECT_EQ(GgufTypeFor(m, "blk.3.ffn_down_shexp.weight", 2, 2048), 8u);  // Q8_0
  EXPECT_EQ(GgufTypeFor(m, "blk.3.ffn_gate_inp.weight", 2, 7168), 0u);    // F32 router
  EXPECT_EQ(GgufTypeFor(m, "blk.3.attn_norm.weight", 1, 7168), 0u);       // F32 norm
  EXPECT_EQ(GgufTypeFor(m, "output.weight", 2, 7168), 14u);               // Q6_K
  EXPECT_EQ(GgufTypeFor(m, "token_embd.weight", 2, 7168), 12u);           // Q4_K
  EXPECT_FALSE(ParseGgufQuantMix("q3_k_s").ok());
}

TEST(GgufModelWriter, ConfigAndTokenizerRoundTrip) {
  TempDir dir("gguf_model");
  const ModelPreset preset = Tiny();
  std::unique_ptr<GgufModel> m = WriteAndOpen(dir, preset, {});
  ASSERT_NE(m, nullptr);
  absl::StatusOr<ModelConfig> config = ModelConfigFromGguf(*m);
  ASSERT_TRUE(config.ok()) << config.status();
  EXPECT_EQ(*config, Expected(preset));
  EXPECT_TRUE(ValidateGgufTensors(*config, *m).ok());
  EXPECT_EQ(m->Find("general.file_type")->u, 15u);

  absl::StatusOr<std::unique_ptr<Tokenizer>> ours = TokenizerFromGguf(*m);
  ASSERT_TRUE(ours.ok()) << ours.status();
  absl::StatusOr<BuiltTokenizer> built =
      BuildTokenizer(preset.tokenizer_vocab_size, preset.config.max_position_embeddings);
  ASSERT_TRUE(built.ok());
  absl::StatusOr<std::unique_ptr<Tokenizer>> ref =
      Tokenizer::FromJson(built->tokenizer_json, built->tokenizer_config_json);
  ASSERT_TRUE(ref.ok());
  EXPECT_EQ((*ours)->vocab_size(), (*ref)->vocab_size());
  EXPECT_EQ((*ours)->bos_id(), (*ref)->bos_id());
  EXPECT_EQ((*ours)->eos_id(), (*ref)->eos_id());
  EXPECT_EQ((*ours)->pad_id(), (*ref)->pad_id());
  EXPECT_EQ((*ours)->add_bos_token(), (*ref)->add_bos_token());
  EXPECT_EQ((*ours)->chat_template(), (*ref)->chat_template());
  EXPECT_EQ(GgufChatTemplate(*m), (*ref)->chat_template());
  for (const char* text :
       {"The quick brown fox jumps over the lazy dog.", "12345 + 678 = 13023\n\n  indented",
        "<｜User｜>Hi there<｜Assistant｜>", "你好，世界！ こんにちは 😀", ""}) {
    const std::vector<int32_t> a = (*ours)->Encode(text, true);
    EXPECT_EQ(a, (*ref)->Encode(text, true)) << text;
    EXPECT_EQ((*ours)->Decode(a), (*ref)->Decode(a)) << text;
  }
}

// Dequantized HF tensors equal the generated values: exactly in F32, within the quantizer's bound
// (gguf_quants.h, bounded here by the tensor's range) in Q4_K_M.
void CheckWeights(const ModelPreset& preset, const GgufModel& m, bool exact) {
  const ModelConfig config = Expected(preset);
  for (const ExpectedTensor& t : ExpectedTensors(config)) {
    absl::StatusOr<std::vector<float>> got = DequantizeHfTensor(config, m, t.name);
    ASSERT_TRUE(got.ok()) << t.name << ": " << got.status();
    const std::vector<float> want = GenerateTensor(t, config, 0);
    ASSERT_EQ(got->size(), want.size()) << t.name;
    float lo = 0, hi = 0;
    for (float v : want) lo = std::min(lo, v), hi = std::max(hi, v);
    const float amax = std::max(-lo, hi);
    // Q8_0: d/2 <= amax/254; Q6_K: d*sc/2 <= amax/62; Q4_K: (d*sc + dmin)/2 <= range/30 + amax/126
    // (each with the fp16 round-up and d's ceil of at most one unit: +1/63 relative).
    const float bound = exact ? 0.0f : ((hi - lo) / 30 + amax / 62) * (1 + 1.0f / 63) * 1.001f;
    for (size_t i = 0; i < want.size(); ++i) {
      ASSERT_LE(std::fabs((*got)[i] - want[i]), bound) << t.name << " [" << i << "]";
    }
  }
}

TEST(GgufModelWriter, F32WeightsAreExactInBothMlaLayouts) {
  const ModelPreset preset = Tiny();
  for (bool split_kv_b : {true, false}) {
    TempDir dir("gguf_model");
    GgufWriteOptions o;
    o.mix = GgufQuantMix::kF32;
    o.split_kv_b = split_kv_b;
    std::unique_ptr<GgufModel> m = WriteAndOpen(dir, preset, o);
    ASSERT_NE(m, nullptr);
    EXPECT_EQ(*GgufUsesSplitKvB(*m), split_kv_b);
    EXPECT_EQ(m->FindTensor("blk.0.attn_kv_b.weight") == nullptr, split_kv_b);
    absl::StatusOr<ModelConfig> config = ModelConfigFromGguf(*m);
    ASSERT_TRUE(config.ok()) << config.status();
    EXPECT_EQ(*config, Expected(preset));
    CheckWeights(preset, *m, /*exact=*/true);
  }
}

TEST(GgufModelWriter, Q4_K_MWeightsWithinBound) {
  TempDir dir("gguf_model");
  const ModelPreset preset = Tiny();
  std::unique_ptr<GgufModel> m = WriteAndOpen(dir, preset, {});
  ASSERT_NE(m, nullptr);
  EXPECT_EQ(m->FindTensor("blk.1.ffn_gate_exps.weight")->type, 12u);  // Q4_K
  EXPECT_EQ(m->FindTensor("output.weight")->type, 14u);               // Q6_K
  CheckWeights(preset, *m, /*exact=*/false);
}

// The reference forward on the F32 GGUF's weights (LoadGgufAsF32Weights, what hmoe-generate
// runs) generates exactly what it generates on the writer's values: names, expert slices and
// the kv_b rebuild are all where the forward looks for them.
TEST(GgufModelWriter, ReferenceForwardOnGgufEqualsOnGeneratedWeights) {
  TempDir dir("gguf_model");
  const ModelPreset preset = Tiny();
  GgufWriteOptions o;
  o.mix = GgufQuantMix::kF32;
  std::unique_ptr<GgufModel> m = WriteAndOpen(dir, preset, o);
  ASSERT_NE(m, nullptr);
  absl::StatusOr<ModelConfig> config = ModelConfigFromGguf(*m);
  ASSERT_TRUE(config.ok()) << config.status();
  absl::StatusOr<std::unique_ptr<InMemoryWeightSource>> from_gguf =
      LoadGgufAsF32Weights(*config, *m);
  ASSERT_TRUE(from_gguf.ok()) << from_gguf.status();
  InMemoryWeightSource generated;
  for (const ExpectedTensor& t : ExpectedTensors(*config)) {
    ASSERT_TRUE(generated.AddF32(t.name, t.shape, GenerateTensor(t, *config, 0)).ok());
  }
  const std::vector<int32_t> prompt = {0, 17, 300, 5, 911, 42};
  std::vector<std::vector<int32_t>> outputs;
  for (const WeightSource* w : {static_cast<const WeightSource*>(from_gguf->get()),
                                static_cast<const WeightSource*>(&generated)}) {
    absl::StatusOr<std::unique_ptr<reference::ReferenceModel>> model =
        reference::ReferenceModel::Create(*config, *w);
    ASSERT_TRUE(model.ok()) << model.status();
    absl::StatusOr<std::vector<int32_t>> tokens = reference::GenerateGreedy(**model, prompt, 6);
    ASSERT_TRUE(tokens.ok()) << tokens.status();
    outputs.push_back(*tokens);
  }
  EXPECT_EQ(outputs[0], outputs[1]);
  EXPECT_EQ(outputs[0].size(), 6u);
}

TEST(GgufModelWriter, SplitFilesReadAsOneModel) {
  TempDir dir("gguf_model");
  const ModelPreset preset = Tiny();
  GgufWriteOptions o;
  o.mix = GgufQuantMix::kQ8_0;
  o.split_max_bytes = 1 << 20;
  std::unique_ptr<GgufModel> m = WriteAndOpen(dir, preset, o);
  ASSERT_NE(m, nullptr);
  EXPECT_GT(m->num_files(), 2);
  absl::StatusOr<ModelConfig> config = ModelConfigFromGguf(*m);
  ASSERT_TRUE(config.ok()) << config.status();
  EXPECT_TRUE(ValidateGgufTensors(*config, *m).ok());
}

TEST(GgufModelWriter, RefusesNonEmptyDirectory) {
  TempDir dir("gguf_model");
  ASSERT_TRUE(WriteGgufModel(Tiny(), dir.path(), {}).ok());
  EXPECT_EQ(WriteGgufModel(Tiny(), dir.path(), {}).code(), absl::StatusCode::kAlreadyExists);
  GgufWriteOptions o;
  o.force = true;
  EXPECT_TRUE(WriteGgufModel(Tiny(), dir.path(), o).ok());
}

// ------------------------------------------------------------------------------ damaged models

struct Edit {
  std::function<void(std::vector<std::pair<std::string, GgufValue>>*)> metadata;
  std::set<std::string> drop;
  std::map<std::string, std::vector<int64_t>> reshape;  // same element count
};

// Copies `src` to `path` with `edit` applied.
void Rewrite(const GgufModel& src, const std::string& path, const Edit& edit) {
  std::vector<std::pair<std::string, GgufValue>> md = src.file(0).metadata();
  if (edit.metadata) edit.metadata(&md);
  GgufWriter w(path);
  for (auto& [k, v] : md) w.AddMetadata(k, v);
  std::vector<const GgufTensorInfo*> kept;
  for (const GgufTensorInfo* t : src.Tensors()) {
    if (edit.drop.count(t->name)) continue;
    const auto it = edit.reshape.find(t->name);
    ASSERT_TRUE(w.AddTensor(t->name, it != edit.reshape.end() ? it->second : t->ne, t->type).ok());
    kept.push_back(t);
  }
  ASSERT_TRUE(w.Begin().ok());
  for (const GgufTensorInfo* t : kept) {
    ASSERT_TRUE(w.WriteTensorData(t->name, std::span(t->data, t->size_bytes)).ok());
  }
  ASSERT_TRUE(w.Finish().ok());
}

class DamagedGguf : public ::testing::Test {
 protected:
  void SetUp() override {
    GgufWriteOptions o;
    o.mix = GgufQuantMix::kQ8_0;
    model_ = WriteAndOpen(dir_, Tiny(), o);
    ASSERT_NE(model_, nullptr);
  }
  // The status of loading the edited model: config, then tensors.
  absl::Status Load(const Edit& edit) {
    const std::string path = dir_.File("edited.gguf");
    Rewrite(*model_, path, edit);
    absl::StatusOr<std::unique_ptr<GgufModel>> m = GgufModel::Open(path);
    if (!m.ok()) return m.status();
    absl::StatusOr<ModelConfig> c = ModelConfigFromGguf(**m);
    if (!c.ok()) return c.status();
    return ValidateGgufTensors(*c, **m);
  }
  static std::function<void(std::vector<std::pair<std::string, GgufValue>>*)> Set(std::string key,
                                                                                  GgufValue value) {
    return [key, value](std::vector<std::pair<std::string, GgufValue>>* md) {
      for (auto& [k, v] : *md) {
        if (k == key) v = value;
      }
    };
  }
  TempDir dir_{"gguf_damaged"};
  std::unique_ptr<GgufModel> model_;
};

TEST_F(DamagedGguf, UnchangedCopyLoads) { EXPECT_TRUE(Load({}).ok()) << Load({}); }

TEST_F(DamagedGguf, MissingTensor) {
  const absl::Status s =
      Load({.metadata = {}, .drop = {"blk.2.ffn_down_exps.weight"}, .reshape = {}});
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), HasSubstr("missing tensor blk.2.ffn_down_exps.weight"));
}

TEST_F(DamagedGguf, WrongShape) {
  const std::vector<int64_t> ne = model_->FindTensor("blk.1.attn_q_b.weight")->ne;
  const absl::Status s = Load(
      {.metadata = {}, .drop = {}, .reshape = {{"blk.1.attn_q_b.weight", {ne[0] * 2, ne[1] / 2}}}});
  EXPECT_THAT(s.message(), HasSubstr("tensor blk.1.attn_q_b.weight has ne [128, 96], expected "
                                     "[64, 192]"));
}

TEST_F(DamagedGguf, MetadataDisagreesWithTensors) {
  const absl::Status s = Load(
      {.metadata = Set("deepseek2.expert_count", GgufValue::U32(8)), .drop = {}, .reshape = {}});
  EXPECT_THAT(s.message(), HasSubstr("ffn_gate_exps.weight has ne [256, 128, 16], expected "
                                     "[256, 128, 8]"));
}

TEST_F(DamagedGguf, InconsistentMetadata) {
  // 5 experts per token out of groups of 4 with 2 groups kept: ModelConfig::Validate refuses.
  const absl::Status s = Load({.metadata = Set("deepseek2.expert_used_count", GgufValue::U32(50)),
                               .drop = {},
                               .reshape = {}});
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), HasSubstr("GGUF metadata gives an inconsistent config"));
}

TEST_F(DamagedGguf, WrongKeyType) {
  const absl::Status s = Load({.metadata = Set("deepseek2.block_count", GgufValue::String("4")),
                               .drop = {},
                               .reshape = {}});
  EXPECT_THAT(s.message(), HasSubstr("deepseek2.block_count: expected an integer, got string"));
}

TEST_F(DamagedGguf, MissingRequiredKey) {
  const absl::Status s = Load({.metadata =
                                   [](std::vector<std::pair<std::string, GgufValue>>* md) {
                                     std::erase_if(*md, [](const auto& kv) {
                                       return kv.first == "deepseek2.embedding_length";
                                     });
                                   },
                               .drop = {},
                               .reshape = {}});
  EXPECT_THAT(s.message(), HasSubstr("deepseek2.embedding_length: required key is missing"));
}

TEST_F(DamagedGguf, OtherArchitecture) {
  const absl::Status s = Load({.metadata = Set("general.architecture", GgufValue::String("llama")),
                               .drop = {},
                               .reshape = {}});
  EXPECT_THAT(s.message(), HasSubstr("\"llama\" is not supported (only \"deepseek2\")"));
}

TEST_F(DamagedGguf, NeitherMlaLayout) {
  const absl::Status s = Load({.metadata = {}, .drop = {"blk.0.attn_v_b.weight"}, .reshape = {}});
  EXPECT_THAT(s.message(), HasSubstr("must hold either blk.0.attn_kv_b.weight or both"));
}

TEST_F(DamagedGguf, UnsupportedPreTokenizer) {
  const std::string path = dir_.File("kimi.gguf");
  Rewrite(*model_, path,
          {.metadata = Set("tokenizer.ggml.pre", GgufValue::String("kimi-k2")),
           .drop = {},
           .reshape = {}});
  absl::StatusOr<std::unique_ptr<GgufModel>> m = GgufModel::Open(path);
  ASSERT_TRUE(m.ok());
  EXPECT_THAT(TokenizerFromGguf(**m).status().message(),
              HasSubstr("pre-tokenizer \"kimi-k2\" is not supported"));
  absl::StatusOr<ModelConfig> c = ModelConfigFromGguf(**m);
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->model_type, "kimi_k2");
}

TEST_F(DamagedGguf, BadTokenTypeArray) {
  const std::string path = dir_.File("tok.gguf");
  Rewrite(*model_, path,
          {.metadata = Set("tokenizer.ggml.token_type",
                           GgufValue::Array(GgufValueType::kI32, {GgufValue::I32(1)})),
           .drop = {},
           .reshape = {}});
  absl::StatusOr<std::unique_ptr<GgufModel>> m = GgufModel::Open(path);
  ASSERT_TRUE(m.ok());
  EXPECT_THAT(TokenizerFromGguf(**m).status().message(),
              HasSubstr("tokenizer.ggml.token_type: expected an array of 1024 integers"));
}

}  // namespace
}  // namespace hmoe
