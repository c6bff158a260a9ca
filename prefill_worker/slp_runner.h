#pragma once

// SlpRunner: one prompt's stream-loading prefill (paper §3.1) on the prefill worker's device —
// the engine's ordinary forward pass over StreamingWeights (ExpertPlacement::kDevice) into a KV
// cache on the device, the first token sampled from the last logits, and the KV cache exported
// for the decode worker (kv_exports.h). Everything the runner needs on the device (KV pool, step
// scratch, the streaming budget and the experts ring) is allocated at Create, so the device's
// memory in use stays within ring + budget + activations.
//
// Experts ring length (paper §3.1): ring_slots_short slots (default: the routed experts of a
// layer, capped by the device memory left) for prompts shorter than the turning point, 2
// (ping-pong) from the turning point on. The computed default turning point is where a layer's
// expert compute starts to exceed its expert copy time (TurningPointTokens), i.e. where a look-
// ahead beyond the next expert no longer buys overlap.
//
// Not thread-safe: one thread (the worker's model thread) calls Run at a time.

#include <atomic>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

#include "common/comm/collective.h"
#include "common/device/device.h"
#include "common/dslp/dslp.h"
#include "common/engine/engine.h"
#include "common/engine/kv_cache.h"
#include "common/engine/sampler.h"
#include "common/engine/streaming_weights.h"
#include "common/kv_handoff/kv_handoff.h"
#include "common/model/model_config.h"
#include "common/model/tensor.h"
#include "common/ops/cpu/cpu_worker_pool.h"
#include "prefill_worker/kv_exports.h"

namespace hmoe::prefill {

enum class KvExportKind { kShm, kCudaIpc };

struct SlpRunnerOptions {
  // Longest prompt (the KV pool holds this many tokens) and tokens per engine step (a longer
  // prompt takes several passes, each streaming every weight once). 0: max_prompt_tokens =
  // min(max_position_embeddings, 32768), max_step_tokens = max_prompt_tokens (one pass).
  int64_t max_prompt_tokens = 0;
  int64_t max_step_tokens = 0;
  int64_t kv_block_tokens = 64;
  // Streaming budget for the modules outside the ring. 0: DefaultStreamBudgetBytes — on a GPU
  // 1 GiB, raised to the largest such module when that is larger (DeepSeek-V3's BF16 lm_head is
  // 1.85 GB); on the CPU device the non-expert modules of 3 layers (at most 1 GiB, at least the
  // largest module), since its arena is process memory. An explicit value smaller than a module
  // fails Create with InvalidArgument.
  size_t stream_budget_bytes = 0;
  // Ring slots for prompts shorter than the turning point. 0: the routed experts per layer,
  // capped by the device memory left after everything else (at least 2).
  int64_t ring_slots_short = 0;
  // Prompt length from which the ring has 2 slots. 0: TurningPointTokens(...).
  int64_t turning_point_tokens = 0;
  // For the computed turning point: the device's compute rate (FLOP/s) and the host-to-device
  // copy rate (bytes/s). 0: per device kind (CUDA: 2e14 FLOP/s and 5e10 B/s, an RTX 5090 on
  // PCIe 5; CPU: 2e11 FLOP/s and 2e10 B/s, or copy_bytes_per_second when the CPU device's copies
  // are capped).
  double device_flops = 0;
  double copy_bytes_per_second = 0;
  KvExportKind export_kind = KvExportKind::kShm;
  // Pipeline stall guard (StreamingWeightsOptions::stall_timeout).
  absl::Duration stall_timeout = absl::Minutes(10);
};

// The prompt length from which the experts ring shrinks to 2: with T prompt tokens each of the E
// loaded experts of a layer gets about T * k / E tokens (k experts per token), whose compute
// (2 FLOP per parameter per token) at `device_flops` takes as long as copying the expert
// (`bytes_per_param` bytes per parameter) at `copy_bytes_per_second` when
//   T = E / k * device_flops * bytes_per_param / (2 * copy_bytes_per_second).
// Beyond it copies hide behind the previous expert's compute and two slots suffice. (DeepSeek-V3
// on an RTX 5090 over PCIe 5: 256 / 8 * 2e14 * 1 / (2 * 5e10) = 64K tokens, the paper's "e.g.
// 50K".) At least 1.
int64_t TurningPointTokens(int64_t experts_per_layer, int64_t experts_per_token,
                           double bytes_per_param, double device_flops,
                           double copy_bytes_per_second);

// One prefill's outcome.
struct SlpResult {
  // DSLP ranks > 0: -1 and no export (rank 0 samples and exports the whole prompt's cache).
  int32_t first_token = -1;
  std::unique_ptr<KvExport> kv;
  int64_t prompt_tokens = 0;
  int64_t prefix_tokens = 0;  // taken from Run's `prefix`, not computed
  int64_t prefill_us = 0;     // start to first token sampled and KV exported
  int64_t export_us = 0;
  int64_t ring_slots = 0;
  StreamingStats streaming;
  size_t peak_device_bytes = 0;
  // DSLP (RunDslp): this rank and its per-layer times and bytes sent; rank -1 for SLP.
  int dslp_rank = -1;
  DslpStats dslp;
};

class SlpRunner {
 public:
  // `config`/`source`: the model; `device`: the prefill device (a CpuDevice, possibly with a
  // budget and a copy cap, or a CudaDevice); `pool`: CPU threads for a CpuDevice's ops. All must
  // outlive the runner. InvalidArgument for bad options; ResourceExhausted when the KV pool,
  // scratch, budget and a two-slot ring do not fit the device; errors of StreamingWeights::Create
  // and Engine::Create otherwise.
  static absl::StatusOr<std::unique_ptr<SlpRunner>> Create(const ModelConfig& config,
                                                           const WeightSource& source,
                                                           Device& device, CpuWorkerPool& pool,
                                                           const SlpRunnerOptions& options);
  ~SlpRunner();

  // Prefills `prompt` (validated by the caller: 1 ..max_prompt_tokens() ids in [0, vocab)),
  // samples the first token with `sampling` (step 0 of the request's sampler: the decode worker
  // continues at step 1) and exports the KV cache (a shared-memory export is named
  // `export_name`). `cancelled` is checked between layers: Cancelled then. Errors of the
  // pipeline, the engine and the export; the device holds nothing of the prompt afterwards
  // either way.
  //
  // `prefix` (optional): the KV of the prompt's first prefix->header().num_tokens tokens (fewer
  // than the prompt's; its header validated against kv_cache_config()), a hand-off from the decode
  // worker's prefix cache. It is copied into the KV pool and only the rest of the prompt is
  // prefilled; the export holds the whole prompt. The result equals a run without it when the
  // prefix's KV is what this runner computes for those tokens (the engine's results do not
  // depend on how a prompt is split into steps).
  absl::StatusOr<SlpResult> Run(std::span<const int32_t> prompt, const SamplingParams& sampling,
                                const std::string& export_name, const std::atomic<bool>& cancelled,
                                const KvImportSource* prefix = nullptr);

  // One rank of a distributed prefill (DSLP, common/dslp) of `prompt` over `comm` (a joined
  // group: every rank runs the same prompt): the same engine, KV pool and streaming pipeline as
  // Run, but the provider streams only this rank's routed experts (plus attention, dense and
  // shared modules and the head), the forward pass is DslpRank's (zig-zag context parallelism,
  // `ep_mode` expert parallelism) in one pass, and at the end every rank holds the whole
  // prompt's KV cache: rank 0 samples the first token and exports it as Run does, the other
  // ranks export nothing. Errors: InvalidArgument (CheckDslpPrompt), the collective's Unavailable
  // when a peer died or left (the group is broken), Cancelled, and Run's errors.
  absl::StatusOr<SlpResult> RunDslp(std::span<const int32_t> prompt, const SamplingParams& sampling,
                                    const std::string& export_name,
                                    const std::atomic<bool>& cancelled, Collective& comm,
                                    EpMode ep_mode);
  // InvalidArgument (naming prompt_token_ids or dslp.world_size) unless a prompt of
  // `prompt_tokens` tokens can be prefilled by a group of `world_size` ranks of this runner's
  // size: at least 2 * world_size and at most max_prompt_tokens() tokens, every rank's share
  // (two zig-zag chunks) within max_step_tokens(), and no more ranks than routed experts.
  absl::Status CheckDslpPrompt(int64_t prompt_tokens, int world_size) const;

  // The ring length Run uses for a prompt of `prompt_tokens` tokens.
  int64_t RingSlotsFor(int64_t prompt_tokens) const;

  const ModelConfig& config() const { return config_; }
  Device& device() const { return *device_; }
  int64_t max_prompt_tokens() const { return max_prompt_tokens_; }
  int64_t max_step_tokens() const { return max_step_tokens_; }
  int64_t ring_slots_short() const { return ring_slots_short_; }
  int64_t turning_point_tokens() const { return turning_point_; }
  const StreamingWeights& weights() const { return *weights_; }
  int64_t kv_blocks_total() const { return cache_->num_blocks(); }
  const KvCacheConfig& kv_cache_config() const { return cache_->config(); }
  int64_t kv_blocks_free() const { return cache_->num_free_blocks(); }
  KvExportKind export_kind() const { return export_kind_; }

 private:
  SlpRunner() = default;
  // The engine steps of one prompt; the last step's logits.
  absl::StatusOr<std::vector<float>> RunSteps(KvSequence& seq, std::span<const int32_t> prompt,
                                              const std::atomic<bool>& cancelled);
  // Makes the provider stream the routed experts of `rank` of `world` ranks (all for 1 rank).
  absl::Status UseExpertsOf(int rank, int world);
  // After a failed prefill: stops the step and the streaming pipeline where they are.
  void AbortPrefill();

  ModelConfig config_;
  Device* device_ = nullptr;
  int64_t max_prompt_tokens_ = 0;
  int64_t max_step_tokens_ = 0;
  int64_t ring_slots_short_ = 0;
  int64_t turning_point_ = 0;
  KvExportKind export_kind_ = KvExportKind::kShm;
  std::unique_ptr<StreamingWeights> weights_;
  std::unique_ptr<Engine> engine_;
  std::unique_ptr<KvCache> cache_;
  std::unique_ptr<MicroBatch> batch_;
  // The expert subset the provider streams: rank expert_rank_ of expert_world_.
  int expert_rank_ = 0;
  int expert_world_ = 1;
};

}  // namespace hmoe::prefill
