// shm::OpenWeights, the weight opening both worker processes share: a checkpoint directory or a
// weightd instance.

#include "common/shm/worker_weights.h"

#include <stdlib.h>
#include <unistd.h>

#include <filesystem>
#include <string>

#include "absl/strings/str_cat.h"
#include <gtest/gtest.h>

#include "tools/model_writer.h"

namespace hmoe::shm {
namespace {

TEST(OpenWeightsTest, ACheckpointDirectoryIsOpenedDirectly) {
  char tmpl[] = "/tmp/hmoe-open-weights-XXXXXX";
  ASSERT_NE(::mkdtemp(tmpl), nullptr);
  const std::string dir = tmpl;
  absl::StatusOr<ModelPreset> preset = GetPreset("tiny");
  ASSERT_TRUE(preset.ok()) << preset.status();
  WriteOptions options;
  options.force = true;
  ASSERT_TRUE(WriteModel(*preset, dir, options).ok());

  absl::StatusOr<WeightSourceHolder> w = OpenWeights(dir, "");
  ASSERT_TRUE(w.ok()) << w.status();
  EXPECT_NE(w->checkpoint, nullptr);
  EXPECT_EQ(w->store, nullptr);
  EXPECT_EQ(w->description, dir);
  EXPECT_EQ(w->config.num_hidden_layers, w->checkpoint->config().num_hidden_layers);
  EXPECT_GT(w->config.num_hidden_layers, 0);
  EXPECT_FALSE(w->source().TensorNames().empty());
  EXPECT_TRUE(w->source().GetTensor(w->source().TensorNames().front()).ok());
  std::filesystem::remove_all(dir);
}

TEST(OpenWeightsTest, MissingSourcesAreErrors) {
  EXPECT_FALSE(OpenWeights("/nonexistent/hmoe-model", "").ok());
  const absl::Status none = OpenWeights("", "").status();
  EXPECT_TRUE(absl::IsInvalidArgument(none)) << none;
  const absl::Status no_instance =
      OpenWeights("", absl::StrCat("hmoe-no-such-instance-", ::getpid())).status();
  EXPECT_TRUE(absl::IsNotFound(no_instance)) << no_instance;
}

}  // namespace
}  // namespace hmoe::shm
