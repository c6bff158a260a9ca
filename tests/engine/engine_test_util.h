#pragma once

// Shared fixtures of the engine tests: the tiny checkpoint written once per process, a 2-thread
// pool, an engine "rig", comparison helpers and the tolerances (see engine_test.cc).

#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include <gtest/gtest.h>

#include "common/base/logging.h"
#include "common/device/cpu_device.h"
#include "common/device/device.h"
#include "common/engine/engine.h"
#include "common/engine/kv_cache.h"
#include "common/engine/reference/reference_model.h"
#include "common/engine/weights.h"
#include "common/model/checkpoint.h"
#include "common/ops/cpu/cpu_worker_pool.h"
#include "tests/integration/test_cpu_pool.h"
#include "tools/model_writer.h"

namespace hmoe::engine_test {

constexpr double kLogitTolerance = 0.03;

inline double Rms(const std::vector<float>& v) {
  double s = 0.0;
  for (float x : v) s += static_cast<double>(x) * x;
  return std::sqrt(s / std::max<size_t>(1, v.size()));
}

inline double MaxAbsDiff(const std::vector<float>& a, const std::vector<float>& b) {
  EXPECT_EQ(a.size(), b.size());
  double m = 0.0;
  for (size_t i = 0; i < a.size() && i < b.size(); ++i) {
    m = std::max(m, std::abs(static_cast<double>(a[i]) - b[i]));
  }
  return m;
}

// max |a - b| relative to RMS(reference).
inline double RelMaxDiff(const std::vector<float>& got, const std::vector<float>& ref) {
  return MaxAbsDiff(got, ref) / std::max(Rms(ref), 1e-12);
}

inline int32_t ArgMax(const std::vector<float>& v) {
  return static_cast<int32_t>(std::max_element(v.begin(), v.end()) - v.begin());
}

inline std::vector<int32_t> RandomTokens(int n, uint32_t seed, int vocab) {
  std::mt19937 rng(seed);
  std::uniform_int_distribution<int> dist(0, vocab - 1);
  std::vector<int32_t> t(n);
  for (int32_t& x : t) x = dist(rng);
  return t;
}

// A checkpoint written once per process into a temp directory.
struct Model {
  std::string dir;
  std::unique_ptr<Checkpoint> checkpoint;
  std::unique_ptr<reference::ReferenceModel> reference;
};

inline std::unique_ptr<Model> WriteAndOpen(const std::string& name, ModelPreset preset, bool fp8) {
  auto m = std::make_unique<Model>();
  m->dir = absl::StrCat(::testing::TempDir(), "hmoe_engine_test_", getpid(), "_", name);
  WriteOptions options;
  options.fp8 = fp8;
  options.force = true;
  options.num_threads = 1;
  absl::Status written = WriteModel(preset, m->dir, options);
  EXPECT_TRUE(written.ok()) << written;
  auto checkpoint = Checkpoint::Open(m->dir);
  EXPECT_TRUE(checkpoint.ok()) << checkpoint.status();
  if (!checkpoint.ok()) return nullptr;
  m->checkpoint = std::move(*checkpoint);
  auto reference = reference::ReferenceModel::Create(m->checkpoint->config(), *m->checkpoint);
  EXPECT_TRUE(reference.ok()) << reference.status();
  if (!reference.ok()) return nullptr;
  m->reference = std::move(*reference);
  // The checkpoint's shards stay mapped; the files are no longer needed.
  std::error_code ignored;
  std::filesystem::remove_all(m->dir, ignored);
  return m;
}

inline Model& Tiny() {
  static Model* const model = [] {
    auto preset = GetPreset("tiny");
    HMOE_CHECK_OK(preset.status());
    return WriteAndOpen("tiny", *preset, /*fp8=*/true).release();
  }();
  return *model;
}

inline CpuWorkerPool& Pool() { return ::hmoe::testing::TestCpuPool(); }

// Everything one engine needs.
struct Rig {
  std::unique_ptr<Device> device;
  std::unique_ptr<ResidentWeights> weights;
  std::unique_ptr<Engine> engine;
  std::unique_ptr<KvCache> cache;

  static std::unique_ptr<Rig> Make(const Model& model, EngineOptions options = {},
                                   int64_t num_blocks = 64, int64_t block_size = 16,
                                   ResidentWeightsOptions weight_options = {},
                                   CpuDeviceOptions device_options = {}) {
    auto rig = std::make_unique<Rig>();
    if (device_options.pool == nullptr) device_options.pool = &Pool();
    rig->device = NewCpuDevice(device_options);
    const ModelConfig& config = model.checkpoint->config();
    weight_options.moe_parts = Pool().num_nodes();
    auto weights = ResidentWeights::Create(config, *model.checkpoint, *rig->device, weight_options);
    EXPECT_TRUE(weights.ok()) << weights.status();
    if (!weights.ok()) return nullptr;
    rig->weights = std::move(*weights);
    auto engine = Engine::Create(config, *rig->weights, *rig->device, Pool(), options);
    EXPECT_TRUE(engine.ok()) << engine.status();
    if (!engine.ok()) return nullptr;
    rig->engine = std::move(*engine);
    auto cache =
        KvCache::Create(*rig->device, KvCacheConfig::ForModel(config, num_blocks, block_size));
    EXPECT_TRUE(cache.ok()) << cache.status();
    if (!cache.ok()) return nullptr;
    rig->cache = std::move(*cache);
    return rig;
  }

  // Runs one input and returns its logits.
  std::vector<float> Run(KvSequence& seq, std::span<const int32_t> tokens) {
    SequenceInput in{&seq, tokens, true};
    auto out = engine->Forward(std::span<const SequenceInput>(&in, 1));
    EXPECT_TRUE(out.ok()) << out.status();
    if (!out.ok()) return {};
    return (*out)[0];
  }
};

// Reference logits of the last token after running `tokens` (fresh cache).
inline std::vector<float> ReferenceLast(const Model& model, std::span<const int32_t> tokens) {
  reference::ReferenceKvCache cache = model.reference->NewCache();
  auto logits = model.reference->Forward(tokens, cache);
  EXPECT_TRUE(logits.ok()) << logits.status();
  const int64_t vocab = model.checkpoint->config().vocab_size;
  return std::vector<float>(logits->end() - vocab, logits->end());
}

}  // namespace hmoe::engine_test
