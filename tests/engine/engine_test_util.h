#pragma once

// Shared fixtures of the engine tests: the tiny checkpoint written once per process, a 2-thread
// pool, an engine "rig" (which records the engine's routing of what it runs), comparison helpers
// and ExpectLastLogitsMatchReference, the check against the FP32 reference under its error model
// and the score-gap rule (docs/conformance.md).

#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <map>
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

// The engine's routing of one sequence: [layer][position] = its experts, sorted; empty for dense
// layers.
using EngineRouting = std::vector<std::vector<std::vector<int32_t>>>;

// Everything one engine needs.
struct Rig {
  std::unique_ptr<Device> device;
  std::unique_ptr<ResidentWeights> weights;
  std::unique_ptr<Engine> engine;
  std::unique_ptr<KvCache> cache;
  // Unless the caller passes its own EngineOptions::routing_observer: the engine's routing of every
  // position each sequence ran through Run (positions in order; a sequence that starts empty
  // starts a new record). Not for sequences run through engine->Forward directly.
  std::map<const KvSequence*, EngineRouting> routing;
  const KvSequence* running = nullptr;  // the sequence of the Run in progress

  static std::unique_ptr<Rig> Make(const Model& model, EngineOptions options = {},
                                   int64_t num_blocks = 64, int64_t block_size = 16,
                                   ResidentWeightsOptions weight_options = {},
                                   CpuDeviceOptions device_options = {}) {
    auto rig = std::make_unique<Rig>();
    if (!options.routing_observer) {
      Rig* self = rig.get();
      const int64_t layers = model.checkpoint->config().num_hidden_layers;
      options.routing_observer = [self, layers](int64_t layer, int64_t n, int64_t top_k,
                                                const int32_t* ids) {
        if (self->running == nullptr) return;
        EngineRouting& r = self->routing[self->running];
        r.resize(layers);
        for (int64_t t = 0; t < n; ++t) {
          std::vector<int32_t> set(ids + t * top_k, ids + (t + 1) * top_k);
          std::sort(set.begin(), set.end());
          r[layer].push_back(std::move(set));
        }
      };
    }
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
    if (seq.num_tokens() == 0) routing.erase(&seq);
    SequenceInput in{&seq, tokens, true};
    running = &seq;
    auto out = engine->Forward(std::span<const SequenceInput>(&in, 1));
    running = nullptr;
    EXPECT_TRUE(out.ok()) << out.status();
    if (!out.ok()) return {};
    return (*out)[0];
  }
};

// The engine's logits `got` of the last of `tokens`, all of which `seq` ran through rig.Run (so
// their routing is recorded), against the FP32 reference under its error model
// (docs/conformance.md "Routing flips: the score-gap rule", "The error model and the
// tolerances"): the reference runs `tokens` following the engine's experts where they differ,
// each such difference must be a near-tie (SelectionGap() below gap_tolerance), and every logit
// difference l[best] - l[v] of the engine (best = the reference's arg-max) must be within
// ReferenceModel::LogitPairTolerance of the reference's; nothing is exempted.
inline void ExpectLastLogitsMatchReference(const Model& model, const Rig& rig,
                                           const KvSequence& seq, std::span<const int32_t> tokens,
                                           const std::vector<float>& got) {
  const ModelConfig& config = model.checkpoint->config();
  const auto n = static_cast<int64_t>(tokens.size());
  ASSERT_EQ(seq.num_tokens(), n) << "the sequence ran other tokens";
  const auto it = rig.routing.find(&seq);
  ASSERT_NE(it, rig.routing.end()) << "no routing recorded (a caller's observer, or not Run)";
  const EngineRouting& routing = it->second;
  for (int64_t l = 0; l < config.num_hidden_layers; ++l) {
    if (!config.is_moe_layer(l)) continue;
    ASSERT_EQ(static_cast<int64_t>(routing[l].size()), n) << "engine routing of layer " << l;
  }
  reference::ForwardTrace trace;
  trace.follow_routing = [&](int64_t l, int64_t p) -> const std::vector<int32_t>* {
    return &routing[l][p];
  };
  reference::ReferenceKvCache cache = model.reference->NewCache();
  auto ref = model.reference->Forward(tokens, cache, &trace);
  ASSERT_TRUE(ref.ok()) << ref.status();
  int flips = 0;
  for (int64_t l = 0; l < config.num_hidden_layers; ++l) {
    if (!config.is_moe_layer(l)) continue;
    for (int64_t p = 0; p < n; ++p) {
      const reference::MoeGateResult& g = trace.routing[l][p];
      if (!g.followed) continue;
      ++flips;
      EXPECT_LT(g.SelectionGap(), trace.gap_tolerance[l][p])
          << "position " << p << " layer " << l << ": the engine routed differently where the "
          << "reference has no near-tie";
    }
  }
  const int64_t vocab = config.vocab_size;
  ASSERT_EQ(static_cast<int64_t>(got.size()), vocab);
  const float* r = ref->data() + (n - 1) * vocab;
  const int32_t best = static_cast<int32_t>(std::max_element(r, r + vocab) - r);
  int beyond = 0;
  double worst = 0.0;
  for (int32_t v = 0; v < vocab; ++v) {
    if (v == best) continue;
    const double d =
        (static_cast<double>(got[best]) - got[v]) - (static_cast<double>(r[best]) - r[v]);
    const double tol = model.reference->LogitPairTolerance(trace, n - 1, best, v);
    worst = std::max(worst, std::abs(d) / tol);
    if (!(std::abs(d) < tol) && beyond++ < 5) {
      ADD_FAILURE() << "logits " << best << " - " << v << " differ from the reference's by " << d
                    << ", tolerance " << tol;
    }
  }
  EXPECT_EQ(beyond, 0) << "logit pairs beyond the error model's tolerance (worst " << worst
                       << " of it; " << flips << " routing flips followed)";
}

}  // namespace hmoe::engine_test
