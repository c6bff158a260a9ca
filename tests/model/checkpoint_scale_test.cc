// Opening a checkpoint with the real DeepSeek-V3 layout: 163 shards, ~90k tensors, 673 GB of
// tensor data. The shards are sparse files (only their headers occupy disk), so this checks that
// Checkpoint::Open parses headers only and maps data lazily. Separate from hmoe_model_test
// because it takes a second or two (label "integration").

#include <unistd.h>

#include <chrono>
#include <map>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "common/base/mapped_file.h"
#include "common/model/checkpoint.h"
#include "common/model/tensor_map.h"
#include "tests/model/test_util.h"

namespace hmoe {
namespace {

using ::hmoe::testing::kDeepSeekV3ConfigJson;
using ::hmoe::testing::ShardName;
using ::hmoe::testing::TempDir;
using ::hmoe::testing::WriteIndex;

TEST(CheckpointScaleTest, DeepSeekV3ShapedSparseCheckpoint) {
  TempDir dir;
  ASSERT_TRUE(WriteFileAtomically(dir.File("config.json"), kDeepSeekV3ConfigJson).ok());
  absl::StatusOr<ModelConfig> config = ModelConfig::FromJson(kDeepSeekV3ConfigJson);
  ASSERT_TRUE(config.ok());
  std::vector<TensorSpec> specs;
  for (const ExpectedTensor& t : ExpectedTensors(*config)) {
    if (t.quantizable()) {
      specs.push_back({t.name, DType::kF8E4M3, t.shape});
      specs.push_back({ScaleInvName(t.name), DType::kF32, ScaleInvShape(t.shape)});
    } else {
      specs.push_back({t.name, t.kind == TensorKind::kBias ? DType::kF32 : DType::kBF16, t.shape});
    }
  }
  // A few MTP (layer 61) tensors, which the model ignores.
  specs.push_back({"model.layers.61.enorm.weight", DType::kBF16, {7168}});
  specs.push_back({"model.layers.61.eh_proj.weight", DType::kBF16, {7168, 14336}});
  constexpr size_t kShards = 163;
  std::map<std::string, std::string> weight_map;
  const size_t per_shard = (specs.size() + kShards - 1) / kShards;
  for (size_t s = 0; s < kShards; ++s) {
    const std::vector<TensorSpec> mine(specs.begin() + std::min(specs.size(), s * per_shard),
                                       specs.begin() + std::min(specs.size(), (s + 1) * per_shard));
    size_t data_bytes = 0;
    for (const TensorSpec& spec : mine) {
      size_t n = DTypeSize(spec.dtype);
      for (int64_t d : spec.shape) n *= static_cast<size_t>(d);
      data_bytes += n;
      weight_map[spec.name] = ShardName(s, kShards);
    }
    absl::StatusOr<std::string> header = SafetensorsHeader(mine);
    ASSERT_TRUE(header.ok());
    const std::string path = dir.File(ShardName(s, kShards));
    ASSERT_TRUE(WriteFileAtomically(path, *header).ok());
    ASSERT_EQ(::truncate(path.c_str(), static_cast<off_t>(header->size() + data_bytes)), 0);
  }
  WriteIndex(dir, weight_map);

  const auto start = std::chrono::steady_clock::now();
  absl::StatusOr<std::unique_ptr<Checkpoint>> ckpt = Checkpoint::Open(dir.path());
  const double open_seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  ASSERT_TRUE(ckpt.ok()) << ckpt.status();
  RecordProperty("open_ms", static_cast<int>(open_seconds * 1000));  // informational only
  EXPECT_EQ((*ckpt)->shards().size(), kShards);
  EXPECT_EQ((*ckpt)->TensorNames().size(), specs.size());
  EXPECT_EQ((*ckpt)->total_tensor_bytes(), size_t{673356147040});
  EXPECT_TRUE(ValidateTensors(*config, **ckpt).ok());
  absl::StatusOr<Weight> w = (*ckpt)->GetWeight(LayerTensorName(60, layer_tensor::kKvAProjWithMqa));
  ASSERT_TRUE(w.ok()) << w.status();
  EXPECT_EQ(w->tensor.shape, (std::vector<int64_t>{576, 7168}));
  EXPECT_EQ(w->scale_inv.shape, (std::vector<int64_t>{5, 56}));
}

}  // namespace
}  // namespace hmoe
