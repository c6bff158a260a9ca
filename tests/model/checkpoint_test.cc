#include "common/model/checkpoint.h"

#include <fcntl.h>
#include <unistd.h>

#include <cstring>
#include <map>
#include <string>
#include <vector>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "common/base/json.h"
#include "common/base/mapped_file.h"
#include "common/model/tensor_map.h"
#include "tests/model/test_util.h"

namespace hmoe {
namespace {

using ::hmoe::json::Value;
using ::hmoe::testing::kT1ConfigJson;
using ::hmoe::testing::RandomBytes;
using ::hmoe::testing::RandomF32Bytes;
using ::hmoe::testing::RandomFp8Bytes;
using ::hmoe::testing::ShardName;
using ::hmoe::testing::TempDir;
using ::hmoe::testing::WithField;
using ::hmoe::testing::WriteIndex;
using ::testing::HasSubstr;

// T1 cut down to 2 layers of 8 experts: small files, the same structure.
ModelConfig MiniConfig() {
  std::string text = WithField(kT1ConfigJson, "num_hidden_layers", Value::Integer(2));
  text = WithField(text, "n_routed_experts", Value::Integer(8));
  absl::StatusOr<ModelConfig> c = ModelConfig::FromJson(text);
  EXPECT_TRUE(c.ok()) << c.status();
  return *c;
}

// Every tensor of `config` with random contents: FP8 + scale for linear weights when the config
// is FP8, BF16 otherwise, F32 router bias.
std::vector<TensorToWrite> ModelTensors(const ModelConfig& config) {
  std::vector<TensorToWrite> out;
  uint32_t seed = 1;
  for (const ExpectedTensor& t : ExpectedTensors(config)) {
    size_t n = 1;
    for (int64_t d : t.shape) n *= static_cast<size_t>(d);
    if (t.quantizable() && config.quantization.fp8) {
      out.push_back({t.name, DType::kF8E4M3, t.shape, RandomFp8Bytes(n, seed++)});
      const std::vector<int64_t> s = ScaleInvShape(t.shape);
      out.push_back({ScaleInvName(t.name), DType::kF32, s,
                     RandomF32Bytes(static_cast<size_t>(s[0] * s[1]), seed++)});
    } else if (t.kind == TensorKind::kBias) {
      out.push_back({t.name, DType::kF32, t.shape, RandomF32Bytes(n, seed++, -0.1f, 0.1f)});
    } else {
      out.push_back({t.name, DType::kBF16, t.shape, RandomBytes(2 * n, seed++)});
    }
  }
  return out;
}

void WriteConfig(const TempDir& dir, const std::string& text) {
  ASSERT_TRUE(WriteFileAtomically(dir.File("config.json"), text).ok());
}

// Writes `tensors` round-robin into `num_shards` shards with the streaming writer (so that a
// weight and its scale land in different shards) and returns the weight_map.
std::map<std::string, std::string> WriteShards(const TempDir& dir,
                                               const std::vector<TensorToWrite>& tensors,
                                               size_t num_shards) {
  std::map<std::string, std::string> weight_map;
  for (size_t s = 0; s < num_shards; ++s) {
    std::vector<const TensorToWrite*> mine;
    for (size_t i = s; i < tensors.size(); i += num_shards) mine.push_back(&tensors[i]);
    std::vector<TensorSpec> specs;
    for (const TensorToWrite* t : mine) specs.push_back({t->name, t->dtype, t->shape});
    absl::StatusOr<std::unique_ptr<SafetensorsWriter>> w =
        SafetensorsWriter::Create(dir.File(ShardName(s, num_shards)), specs);
    EXPECT_TRUE(w.ok()) << w.status();
    for (const TensorToWrite* t : mine) {
      EXPECT_TRUE((*w)->WriteTensorData(t->name, t->data).ok());
      weight_map[t->name] = ShardName(s, num_shards);
    }
    EXPECT_TRUE((*w)->Finish().ok());
  }
  return weight_map;
}

void ExpectSameTensors(const Checkpoint& ckpt, const std::vector<TensorToWrite>& tensors) {
  std::vector<std::string> names;
  size_t total = 0;
  for (const TensorToWrite& t : tensors) {
    names.push_back(t.name);
    total += t.data.size();
    absl::StatusOr<TensorView> v = ckpt.GetTensor(t.name);
    ASSERT_TRUE(v.ok()) << v.status();
    EXPECT_EQ(v->name, t.name);
    EXPECT_EQ(v->dtype, t.dtype);
    EXPECT_EQ(v->shape, t.shape);
    ASSERT_EQ(v->size_bytes, t.data.size());
    EXPECT_EQ(std::memcmp(v->data, t.data.data(), t.data.size()), 0) << t.name;
  }
  std::sort(names.begin(), names.end());
  EXPECT_EQ(ckpt.TensorNames(), names);
  EXPECT_EQ(ckpt.total_tensor_bytes(), total);
}

TEST(CheckpointTest, SingleFileRoundTrip) {
  TempDir dir;
  const ModelConfig config = MiniConfig();
  const std::string config_text = config.ToJson();
  WriteConfig(dir, config_text);
  const std::vector<TensorToWrite> tensors = ModelTensors(config);
  ASSERT_TRUE(WriteSafetensors(dir.File("model.safetensors"), tensors).ok());
  absl::StatusOr<std::unique_ptr<Checkpoint>> ckpt = Checkpoint::Open(dir.path());
  ASSERT_TRUE(ckpt.ok()) << ckpt.status();
  EXPECT_EQ((*ckpt)->dir(), dir.path());
  EXPECT_EQ((*ckpt)->config(), config);
  EXPECT_EQ((*ckpt)->config_json(), config_text);
  EXPECT_EQ((*ckpt)->shards().size(), 1u);
  ExpectSameTensors(**ckpt, tensors);
  EXPECT_TRUE(ValidateTensors(config, **ckpt).ok());
}

TEST(CheckpointTest, ShardedRoundTrip) {
  TempDir dir;
  const ModelConfig config = MiniConfig();
  WriteConfig(dir, config.ToJson());
  const std::vector<TensorToWrite> tensors = ModelTensors(config);
  WriteIndex(dir, WriteShards(dir, tensors, 3));
  absl::StatusOr<std::unique_ptr<Checkpoint>> ckpt = Checkpoint::Open(dir.path());
  ASSERT_TRUE(ckpt.ok()) << ckpt.status();
  ASSERT_EQ((*ckpt)->shards().size(), 3u);
  for (size_t s = 0; s < 3; ++s) {
    EXPECT_EQ((*ckpt)->shards()[s]->path(), dir.File(ShardName(s, 3)));
  }
  ExpectSameTensors(**ckpt, tensors);
  EXPECT_TRUE(ValidateTensors(config, **ckpt).ok());
  // A weight and its scale from different shards.
  const std::string name = LayerTensorName(0, layer_tensor::kQAProj);
  absl::StatusOr<Weight> w = (*ckpt)->GetWeight(name);
  ASSERT_TRUE(w.ok()) << w.status();
  EXPECT_TRUE(w->has_scale);
  EXPECT_EQ(w->scale_inv.name, ScaleInvName(name));
  EXPECT_TRUE(DequantizeToFloat(*w).ok());
}

TEST(CheckpointTest, Bf16CheckpointValidates) {
  TempDir dir;
  ModelConfig config = MiniConfig();
  config.quantization = QuantizationConfig();
  WriteConfig(dir, config.ToJson());
  ASSERT_TRUE(WriteSafetensors(dir.File("model.safetensors"), ModelTensors(config)).ok());
  absl::StatusOr<std::unique_ptr<Checkpoint>> ckpt = Checkpoint::Open(dir.path());
  ASSERT_TRUE(ckpt.ok()) << ckpt.status();
  EXPECT_FALSE((*ckpt)->config().quantization.fp8);
  EXPECT_TRUE(ValidateTensors(config, **ckpt).ok());
  absl::StatusOr<Weight> w = (*ckpt)->GetWeight(LayerTensorName(1, layer_tensor::kOProj));
  ASSERT_TRUE(w.ok());
  EXPECT_FALSE(w->has_scale);
}

TEST(CheckpointTest, LoneSafetensorsFileWithAnyName) {
  TempDir dir;
  WriteConfig(dir, kT1ConfigJson);
  ASSERT_TRUE(
      WriteSafetensors(dir.File("weights.safetensors"), {{"t", DType::kU8, {1}, "x"}}).ok());
  absl::StatusOr<std::unique_ptr<Checkpoint>> ckpt = Checkpoint::Open(dir.path());
  ASSERT_TRUE(ckpt.ok()) << ckpt.status();
  EXPECT_EQ((*ckpt)->TensorNames(), std::vector<std::string>{"t"});
}

TEST(CheckpointTest, SeveralFilesWithoutIndexAreAmbiguous) {
  TempDir dir;
  WriteConfig(dir, kT1ConfigJson);
  ASSERT_TRUE(WriteSafetensors(dir.File("a.safetensors"), {{"t", DType::kU8, {1}, "x"}}).ok());
  ASSERT_TRUE(WriteSafetensors(dir.File("b.safetensors"), {{"u", DType::kU8, {1}, "x"}}).ok());
  const absl::Status s = Checkpoint::Open(dir.path()).status();
  EXPECT_TRUE(absl::IsInvalidArgument(s));
  EXPECT_THAT(s.message(), HasSubstr("2 *.safetensors files"));
  EXPECT_THAT(s.message(), HasSubstr("no model.safetensors.index.json"));
}

TEST(CheckpointTest, NoWeightsIsNotFound) {
  TempDir dir;
  WriteConfig(dir, kT1ConfigJson);
  const absl::Status s = Checkpoint::Open(dir.path()).status();
  EXPECT_TRUE(absl::IsNotFound(s));
  EXPECT_THAT(s.message(), HasSubstr(dir.path()));
}

TEST(CheckpointTest, MissingConfig) {
  TempDir dir;
  ASSERT_TRUE(WriteSafetensors(dir.File("model.safetensors"), {{"t", DType::kU8, {1}, "x"}}).ok());
  const absl::Status s = Checkpoint::Open(dir.path()).status();
  EXPECT_TRUE(absl::IsNotFound(s));
  EXPECT_THAT(s.message(), HasSubstr("missing config.json"));
  EXPECT_THAT(s.message(), HasSubstr(dir.path()));
}

TEST(CheckpointTest, MissingDirectory) {
  EXPECT_TRUE(absl::IsNotFound(Checkpoint::Open("/nonexistent/hmoe/dir").status()));
}

TEST(CheckpointTest, InvalidConfigNamesField) {
  TempDir dir;
  WriteConfig(dir, WithField(kT1ConfigJson, "hidden_size", Value::String("big")));
  ASSERT_TRUE(WriteSafetensors(dir.File("model.safetensors"), {{"t", DType::kU8, {1}, "x"}}).ok());
  const absl::Status s = Checkpoint::Open(dir.path()).status();
  EXPECT_TRUE(absl::IsInvalidArgument(s));
  EXPECT_THAT(s.message(), HasSubstr("field \"hidden_size\""));
  EXPECT_THAT(s.message(), HasSubstr(dir.path()));
}

// A sharded checkpoint of a few small tensors, for the index-consistency tests.
class ShardedCheckpointTest : public ::testing::Test {
 protected:
  void SetUp() override {
    WriteConfig(dir_, kT1ConfigJson);
    for (int i = 0; i < 6; ++i) {
      tensors_.push_back({"t" + std::to_string(i), DType::kF32, {2}, RandomBytes(8, i)});
    }
    weight_map_ = WriteShards(dir_, tensors_, 3);
  }
  absl::Status Open() {
    WriteIndex(dir_, weight_map_);
    return Checkpoint::Open(dir_.path()).status();
  }

  TempDir dir_;
  std::vector<TensorToWrite> tensors_;
  std::map<std::string, std::string> weight_map_;
};

TEST_F(ShardedCheckpointTest, Opens) { EXPECT_TRUE(Open().ok()); }

TEST_F(ShardedCheckpointTest, MissingShard) {
  ASSERT_EQ(::unlink(dir_.File(ShardName(2, 3)).c_str()), 0);
  const absl::Status s = Open();
  EXPECT_TRUE(absl::IsNotFound(s));
  EXPECT_THAT(s.message(), HasSubstr("missing shard model-00003-of-00003.safetensors"));
}

TEST_F(ShardedCheckpointTest, TensorInIndexButNotInShard) {
  weight_map_["ghost"] = ShardName(1, 3);
  const absl::Status s = Open();
  EXPECT_TRUE(absl::IsInvalidArgument(s));
  EXPECT_THAT(s.message(),
              HasSubstr("tensor \"ghost\" is listed in model.safetensors.index.json for shard "
                        "model-00002-of-00003.safetensors, which does not contain it"));
}

TEST_F(ShardedCheckpointTest, TensorInShardButNotInIndex) {
  weight_map_.erase("t4");
  const absl::Status s = Open();
  EXPECT_TRUE(absl::IsInvalidArgument(s));
  EXPECT_THAT(s.message(), HasSubstr("tensor \"t4\" in shard model-00002-of-00003.safetensors is "
                                     "not listed in model.safetensors.index.json"));
}

TEST_F(ShardedCheckpointTest, IndexNamesWrongShard) {
  weight_map_["t0"] = ShardName(1, 3);  // t0 is in shard 1
  const absl::Status s = Open();
  EXPECT_TRUE(absl::IsInvalidArgument(s));
  EXPECT_THAT(s.message(), HasSubstr("tensor \"t0\" is in shard model-00001-of-00003.safetensors "
                                     "but model.safetensors.index.json lists it in shard "
                                     "model-00002-of-00003.safetensors"));
}

TEST_F(ShardedCheckpointTest, TensorInTwoShards) {
  // Rewrite shard 3 with a copy of t0 (which lives in shard 1).
  ASSERT_TRUE(
      WriteSafetensors(dir_.File(ShardName(2, 3)), {tensors_[2], tensors_[5], tensors_[0]}).ok());
  const absl::Status s = Open();
  EXPECT_TRUE(absl::IsInvalidArgument(s));
  EXPECT_THAT(s.message(),
              HasSubstr("tensor \"t0\" is present in two shards: model-00001-of-00003.safetensors "
                        "and model-00003-of-00003.safetensors"));
}

TEST_F(ShardedCheckpointTest, ShardOutsideDirectoryIsRejected) {
  weight_map_["t0"] = "../model-00001-of-00003.safetensors";
  const absl::Status s = Open();
  EXPECT_TRUE(absl::IsInvalidArgument(s));
  EXPECT_THAT(s.message(), HasSubstr("tensor \"t0\": shard is not a file name in the directory"));
}

TEST_F(ShardedCheckpointTest, CorruptShardNamesFile) {
  ASSERT_TRUE(WriteFileAtomically(dir_.File(ShardName(1, 3)), "garbage!garbage!").ok());
  const absl::Status s = Open();
  EXPECT_TRUE(absl::IsInvalidArgument(s));
  EXPECT_THAT(s.message(), HasSubstr(dir_.File(ShardName(1, 3))));
}

TEST_F(ShardedCheckpointTest, BadIndex) {
  const std::string index_path = dir_.File("model.safetensors.index.json");
  ASSERT_TRUE(WriteFileAtomically(index_path, R"({"metadata": {}})").ok());
  absl::Status s = Checkpoint::Open(dir_.path()).status();
  EXPECT_THAT(s.message(), HasSubstr("missing or non-object \"weight_map\""));
  EXPECT_THAT(s.message(), HasSubstr(index_path));
  ASSERT_TRUE(WriteFileAtomically(index_path, R"({"weight_map": {"t0": 1}})").ok());
  s = Checkpoint::Open(dir_.path()).status();
  EXPECT_THAT(s.message(), HasSubstr("tensor \"t0\": shard is not a file name"));
  ASSERT_TRUE(WriteFileAtomically(index_path, R"({"weight_map": )").ok());
  s = Checkpoint::Open(dir_.path()).status();
  EXPECT_TRUE(absl::IsInvalidArgument(s));
  EXPECT_THAT(s.message(), HasSubstr("at byte"));
}

TEST_F(ShardedCheckpointTest, GetTensorMissingIsNotFound) {
  ASSERT_TRUE(Open().ok());
  absl::StatusOr<std::unique_ptr<Checkpoint>> ckpt = Checkpoint::Open(dir_.path());
  ASSERT_TRUE(ckpt.ok());
  const absl::Status s = (*ckpt)->GetTensor("nope").status();
  EXPECT_TRUE(absl::IsNotFound(s));
  EXPECT_THAT(s.message(), HasSubstr("\"nope\""));
}

TEST(CheckpointIndexTest, ParsesShardsSortedAndUnique) {
  absl::StatusOr<CheckpointIndex> index = ParseCheckpointIndex(
      R"({"metadata": {}, "weight_map": {"a": "s2.safetensors", "b": "s1.safetensors",
          "c": "s2.safetensors"}})");
  ASSERT_TRUE(index.ok()) << index.status();
  EXPECT_EQ(index->shard_names, (std::vector<std::string>{"s1.safetensors", "s2.safetensors"}));
  EXPECT_EQ(index->shard_of, (std::map<std::string, size_t>{{"a", 1}, {"b", 0}, {"c", 1}}));
}

TEST(CheckpointIndexTest, MalformedIndexesAreInvalidArgument) {
  for (const char* bad : {"", "[]", "{", R"({"weight_map": []})", R"({"weight_map": {"a": 1}})",
                          R"({"weight_map": {"a": "../x"}})", R"({"weight_map": {"a": ".."}})",
                          R"({"weight_map": {"a": ""}})", R"({"weight_map": {"a": "d/x"}})"}) {
    absl::StatusOr<CheckpointIndex> index = ParseCheckpointIndex(bad);
    EXPECT_EQ(index.status().code(), absl::StatusCode::kInvalidArgument) << bad;
  }
}

}  // namespace
}  // namespace hmoe
