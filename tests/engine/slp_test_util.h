#pragma once

// Stream-loading prefill (SLP) test helpers shared by the tiny-model tests (label threads) and
// the small-model test (label integration): an SLP engine over StreamingWeights and a
// resident-weights engine over the same checkpoint, and a prefill that returns the last logits
// plus every byte of the KV cache.

#include <cstddef>
#include <memory>
#include <span>
#include <vector>

#include <gtest/gtest.h>

#include "common/engine/streaming_weights.h"
#include "tests/engine/engine_test_util.h"

namespace hmoe::engine_test {

// The result of prefilling one prompt: the last token's logits and the KV cache in the hand-off
// format (kv_cache.h Export).
struct PrefillResult {
  std::vector<float> logits;
  std::vector<std::byte> kv;
};

// Logits and KV of `prompt` on a fresh sequence of `cache`.
inline PrefillResult Prefill(Engine& engine, KvCache& cache, std::span<const int32_t> prompt) {
  PrefillResult r;
  KvSequence seq = cache.NewSequence();
  SequenceInput in{&seq, prompt, true};
  auto out = engine.Forward(std::span<const SequenceInput>(&in, 1));
  EXPECT_TRUE(out.ok()) << out.status();
  if (!out.ok()) return r;
  r.logits = (*out)[0];
  r.kv.resize(cache.ExportBytes(seq.num_tokens()));
  auto stream = cache.device().CreateStream();
  EXPECT_TRUE(stream.ok());
  EXPECT_TRUE(cache.Export(seq, **stream, r.kv.data(), MemorySpace::kHost).ok());
  EXPECT_TRUE((*stream)->Synchronize().ok());
  return r;
}

// Passes (engine steps) of a prompt of `tokens` tokens.
inline int64_t PassesFor(int64_t tokens, const EngineOptions& options) {
  return (tokens + options.max_step_tokens - 1) / options.max_step_tokens;
}

// An SLP engine: StreamingWeights on its own CpuDevice (experts on the device).
struct SlpRig {
  std::unique_ptr<Device> device;
  std::unique_ptr<StreamingWeights> weights;
  std::unique_ptr<Engine> engine;
  std::unique_ptr<KvCache> cache;
  EngineOptions options;

  static std::unique_ptr<SlpRig> Make(const Model& model, StreamingWeightsOptions weight_options,
                                      EngineOptions options = {},
                                      CpuDeviceOptions device_options = {}, int64_t num_blocks = 64,
                                      int64_t block_size = 16) {
    auto rig = std::make_unique<SlpRig>();
    if (device_options.pool == nullptr) device_options.pool = &Pool();
    rig->device = NewCpuDevice(device_options);
    const ModelConfig& config = model.checkpoint->config();
    auto weights =
        StreamingWeights::Create(config, *model.checkpoint, *rig->device, weight_options);
    EXPECT_TRUE(weights.ok()) << weights.status();
    if (!weights.ok()) return nullptr;
    rig->weights = std::move(*weights);
    options.experts = ExpertPlacement::kDevice;
    rig->options = options;
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

  // One prompt through the streaming pipeline; `stats` (optional) receives its stats.
  PrefillResult Run(std::span<const int32_t> prompt, StreamingStats* stats = nullptr) {
    const absl::Status begun =
        weights->BeginPrefill(PassesFor(static_cast<int64_t>(prompt.size()), options));
    EXPECT_TRUE(begun.ok()) << begun;
    if (!begun.ok()) return {};
    PrefillResult r = Prefill(*engine, *cache, prompt);
    auto ended = weights->EndPrefill();
    EXPECT_TRUE(ended.ok()) << ended.status();
    if (ended.ok() && stats != nullptr) *stats = *ended;
    return r;
  }
};

// A resident-weights engine (weights read in place) with the given expert placement.
inline std::unique_ptr<Rig> ResidentRig(const Model& model, ExpertPlacement experts,
                                        EngineOptions options = {}) {
  options.experts = experts;
  return Rig::Make(model, options);
}

}  // namespace hmoe::engine_test
