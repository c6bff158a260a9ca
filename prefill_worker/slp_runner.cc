#include "prefill_worker/slp_runner.h"

#include <algorithm>
#include <cmath>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"

#include "common/base/logging.h"
#include "common/base/status_macros.h"
#include "common/device/ring_buffer.h"

namespace hmoe::prefill {
namespace {

constexpr int64_t kDefaultMaxPromptTokens = 32768;
// Defaults of the computed turning point (see SlpRunnerOptions).
constexpr double kCudaFlops = 2e14;
constexpr double kCudaCopyBytesPerSecond = 5e10;
constexpr double kCpuFlops = 2e11;
constexpr double kCpuCopyBytesPerSecond = 2e10;

int64_t Micros(absl::Duration d) { return absl::ToInt64Microseconds(d); }

}  // namespace

int64_t TurningPointTokens(int64_t experts_per_layer, int64_t experts_per_token,
                           double bytes_per_param, double device_flops,
                           double copy_bytes_per_second) {
  if (experts_per_layer <= 0 || experts_per_token <= 0 || bytes_per_param <= 0 ||
      device_flops <= 0 || copy_bytes_per_second <= 0) {
    return 1;
  }
  const double t = static_cast<double>(experts_per_layer) / static_cast<double>(experts_per_token) *
                   device_flops * bytes_per_param / (2.0 * copy_bytes_per_second);
  return std::max<int64_t>(1, static_cast<int64_t>(std::ceil(std::min(t, 1e15))));
}

SlpRunner::~SlpRunner() = default;

absl::StatusOr<std::unique_ptr<SlpRunner>> SlpRunner::Create(const ModelConfig& config,
                                                             const WeightSource& source,
                                                             Device& device, CpuWorkerPool& pool,
                                                             const SlpRunnerOptions& options) {
  if (options.max_prompt_tokens < 0 || options.max_step_tokens < 0 || options.kv_block_tokens < 1 ||
      options.ring_slots_short < 0 || options.turning_point_tokens < 0 ||
      options.device_flops < 0 || options.copy_bytes_per_second < 0) {
    return absl::InvalidArgumentError("slp runner: negative or zero option");
  }
  if (options.max_prompt_tokens > config.max_position_embeddings) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--max-prompt-tokens ", options.max_prompt_tokens,
        " exceeds the model's max_position_embeddings ", config.max_position_embeddings));
  }
  std::unique_ptr<SlpRunner> r(new SlpRunner());
  r->config_ = config;
  r->device_ = &device;
  r->export_kind_ = options.export_kind;
  r->max_prompt_tokens_ = options.max_prompt_tokens > 0
                              ? options.max_prompt_tokens
                              : std::min(config.max_position_embeddings, kDefaultMaxPromptTokens);
  r->max_step_tokens_ = options.max_step_tokens > 0
                            ? std::min(options.max_step_tokens, r->max_prompt_tokens_)
                            : r->max_prompt_tokens_;

  // The streaming provider starts with the smallest ring; the short-prompt ring is sized below,
  // once everything else is on the device.
  StreamingWeightsOptions wo;
  wo.budget_bytes = options.stream_budget_bytes;
  wo.stall_timeout = options.stall_timeout;
  wo.ring_slots = 1;
  HMOE_ASSIGN_OR_RETURN(r->weights_, StreamingWeights::Create(config, source, device, wo));
  const int64_t loaded = r->weights_->loaded_experts_per_layer();
  if (loaded >= 2) HMOE_RETURN_IF_ERROR(r->weights_->SetRingSlots(2));

  EngineOptions eo;
  eo.max_step_tokens = r->max_step_tokens_;
  eo.max_step_sequences = 1;
  eo.experts = ExpertPlacement::kDevice;
  HMOE_ASSIGN_OR_RETURN(r->engine_, Engine::Create(config, *r->weights_, device, pool, eo));
  const int64_t blocks =
      (r->max_prompt_tokens_ + options.kv_block_tokens - 1) / options.kv_block_tokens;
  HMOE_ASSIGN_OR_RETURN(
      r->cache_,
      KvCache::Create(device, KvCacheConfig::ForModel(config, blocks, options.kv_block_tokens)));
  HMOE_ASSIGN_OR_RETURN(r->batch_, r->engine_->NewMicroBatch());

  // Short-prompt ring: every loaded expert of a layer, or as many as the memory left holds.
  const size_t slot = r->weights_->ring_slot_bytes();
  if (loaded == 0 || slot == 0) {
    r->ring_slots_short_ = 0;
  } else if (options.ring_slots_short > 0) {
    r->ring_slots_short_ = options.ring_slots_short;
  } else {
    const size_t budget = device.budget_bytes();
    const size_t in_use = device.bytes_in_use() - r->weights_->ring_bytes();
    // A ring of n slots takes n * slot bytes plus its alignment margin.
    const size_t margin = DeviceRingBuffer::kAlignmentMargin;
    const int64_t fit = budget == SIZE_MAX || budget <= in_use + margin
                            ? (budget == SIZE_MAX ? loaded : 0)
                            : static_cast<int64_t>((budget - in_use - margin) / slot);
    r->ring_slots_short_ = std::min(loaded, fit);
    if (r->ring_slots_short_ < std::min<int64_t>(2, loaded)) {
      return absl::ResourceExhaustedError(absl::StrCat(
          "slp runner: ", device.name(), " has room for ", fit, " expert ring slot(s) of ", slot,
          " bytes after the KV pool, step scratch and streaming budget; at least 2 are needed"));
    }
  }

  // Turning point.
  if (options.turning_point_tokens > 0) {
    r->turning_point_ = options.turning_point_tokens;
  } else {
    const bool cuda = device.kind() == DeviceKind::kCuda;
    const double flops =
        options.device_flops > 0 ? options.device_flops : (cuda ? kCudaFlops : kCpuFlops);
    const double copy = options.copy_bytes_per_second > 0
                            ? options.copy_bytes_per_second
                            : (cuda ? kCudaCopyBytesPerSecond : kCpuCopyBytesPerSecond);
    const double params = 3.0 * static_cast<double>(config.hidden_size) *
                          static_cast<double>(config.moe_intermediate_size);
    const double bytes_per_param = params > 0 ? static_cast<double>(slot) / params : 1.0;
    r->turning_point_ =
        TurningPointTokens(loaded, config.num_experts_per_tok, bytes_per_param, flops, copy);
  }
  return r;
}

int64_t SlpRunner::RingSlotsFor(int64_t prompt_tokens) const {
  if (ring_slots_short_ == 0) return 0;
  if (prompt_tokens >= turning_point_) return std::min<int64_t>(2, ring_slots_short_);
  return ring_slots_short_;
}

absl::StatusOr<std::vector<float>> SlpRunner::RunSteps(KvSequence& seq,
                                                       std::span<const int32_t> prompt,
                                                       const std::atomic<bool>& cancelled) {
  std::vector<float> logits;
  const int64_t n = static_cast<int64_t>(prompt.size());
  for (int64_t begin = 0; begin < n; begin += max_step_tokens_) {
    const int64_t count = std::min(max_step_tokens_, n - begin);
    SequenceInput in{&seq, prompt.subspan(begin, count), begin + count == n};
    HMOE_RETURN_IF_ERROR(batch_->BeginStep(std::span<const SequenceInput>(&in, 1)));
    for (int64_t l = 0; l < config_.num_hidden_layers; ++l) {
      // Relaxed: a flag polled between layers; a late sighting only delays the cancel.
      if (cancelled.load(std::memory_order_relaxed)) {
        return absl::CancelledError("prefill cancelled");
      }
      HMOE_RETURN_IF_ERROR(batch_->RunAttention(l));
      HMOE_RETURN_IF_ERROR(batch_->RunFfn(l));
    }
    HMOE_ASSIGN_OR_RETURN(std::vector<std::vector<float>> out, batch_->FinishStep());
    logits = std::move(out[0]);
  }
  return logits;
}

absl::Status SlpRunner::UseExpertsOf(int rank, int world) {
  if (rank == expert_rank_ && world == expert_world_) return absl::OkStatus();
  std::function<bool(int64_t, int64_t)> mine;
  if (world > 1) {
    const int64_t experts = config_.n_routed_experts;
    const int64_t begin = FirstExpertOfRank(experts, world, rank);
    const int64_t end = FirstExpertOfRank(experts, world, rank + 1);
    mine = [begin, end](int64_t, int64_t e) { return e >= begin && e < end; };
  }
  HMOE_RETURN_IF_ERROR(weights_->SetLoadedExperts(std::move(mine)));
  expert_rank_ = rank;
  expert_world_ = world;
  return absl::OkStatus();
}

void SlpRunner::AbortPrefill() {
  // Stop the pipeline where it is: the model's stream first, then the loader and unloader.
  batch_->AbandonStep();
  if (absl::Status s = batch_->stream().Synchronize(); !s.ok()) {
    HMOE_LOG(ERROR) << "synchronize after a failed prefill: " << s;
  }
  if (auto ended = weights_->EndPrefill(/*abort=*/true); !ended.ok()) {
    HMOE_LOG(ERROR) << "abort the streaming pipeline: " << ended.status();
  }
}

absl::Status SlpRunner::CheckDslpPrompt(int64_t n, int world) const {
  if (world < 1) return absl::InvalidArgumentError("dslp.world_size: must be >= 1");
  if (n > max_prompt_tokens_) {
    return absl::InvalidArgumentError(absl::StrCat(
        "prompt_token_ids: ", n, " tokens, this worker prefills at most ", max_prompt_tokens_));
  }
  if (config_.n_routed_experts > 0 && config_.n_routed_experts < world) {
    return absl::InvalidArgumentError(absl::StrCat("dslp.world_size: ", world,
                                                   " ranks for a model with ",
                                                   config_.n_routed_experts, " routed experts"));
  }
  absl::StatusOr<ZigZagPlan> plan = ZigZagPlan::Make(n, world);
  if (!plan.ok()) {
    return absl::InvalidArgumentError(absl::StrCat("prompt_token_ids: ", plan.status().message()));
  }
  int64_t most = 0;
  for (int r = 0; r < world; ++r) most = std::max(most, plan->tokens_of(r));
  if (most > max_step_tokens_) {
    return absl::InvalidArgumentError(
        absl::StrCat("prompt_token_ids: ", n, " tokens over ", world, " ranks give a rank ", most,
                     " tokens, more than one pass of this worker holds (--max-step-tokens ",
                     max_step_tokens_, "); DSLP runs a prompt in one pass"));
  }
  return absl::OkStatus();
}

absl::StatusOr<SlpResult> SlpRunner::RunDslp(std::span<const int32_t> prompt,
                                             const SamplingParams& sampling,
                                             const std::string& export_name,
                                             const std::atomic<bool>& cancelled, Collective& comm,
                                             EpMode ep_mode) {
  const absl::Time start = absl::Now();
  const int64_t n = static_cast<int64_t>(prompt.size());
  const int rank = comm.rank();
  const int world = comm.world_size();
  HMOE_RETURN_IF_ERROR(CheckDslpPrompt(n, world));
  SamplingParams first = sampling;
  first.max_new_tokens = 1;
  Sampler sampler = Sampler::Create(first, prompt, {});
  HMOE_RETURN_IF_ERROR(UseExpertsOf(rank, world));

  SlpResult result;
  result.prompt_tokens = n;
  result.dslp_rank = rank;
  result.ring_slots = RingSlotsFor(n);
  if (result.ring_slots > 0) HMOE_RETURN_IF_ERROR(weights_->SetRingSlots(result.ring_slots));
  device_->ResetPeakBytes();
  DslpOptions options;
  options.ep_mode = ep_mode;
  options.cancelled = &cancelled;
  HMOE_ASSIGN_OR_RETURN(std::unique_ptr<DslpRank> dslp,
                        DslpRank::Create(*engine_, comm, options, batch_.get()));
  // Only rank 0 computes logits (its second zig-zag chunk ends the prompt).
  HMOE_RETURN_IF_ERROR(
      weights_->BeginPrefill(1, rank == 0 ? HeadStreaming::kLastPass : HeadStreaming::kNever));
  KvSequence seq = cache_->NewSequence();
  absl::StatusOr<DslpResult> ran = dslp->Prefill(prompt, seq);
  if (!ran.ok()) {
    AbortPrefill();
    return ran.status();
  }
  HMOE_ASSIGN_OR_RETURN(result.streaming, weights_->EndPrefill());
  result.dslp = dslp->last_stats();
  if (rank == 0) {
    HMOE_ASSIGN_OR_RETURN(result.first_token, sampler.Sample(ran->logits));
    const absl::Time export_start = absl::Now();
    if (export_kind_ == KvExportKind::kCudaIpc) {
      HMOE_ASSIGN_OR_RETURN(result.kv, ExportToCudaIpc(*cache_, seq, batch_->stream()));
    } else {
      HMOE_ASSIGN_OR_RETURN(result.kv, ExportToShm(*cache_, seq, batch_->stream(), export_name));
    }
    result.export_us = Micros(absl::Now() - export_start);
  }
  result.prefill_us = Micros(absl::Now() - start);
  result.peak_device_bytes = device_->peak_bytes_in_use();
  return result;
}

absl::StatusOr<SlpResult> SlpRunner::Run(std::span<const int32_t> prompt,
                                         const SamplingParams& sampling,
                                         const std::string& export_name,
                                         const std::atomic<bool>& cancelled,
                                         const KvImportSource* prefix) {
  const absl::Time start = absl::Now();
  const int64_t n = static_cast<int64_t>(prompt.size());
  if (n < 1 || n > max_prompt_tokens_) {
    return absl::InvalidArgumentError(
        absl::StrCat("prompt_token_ids: ", n, " tokens, expected 1 to ", max_prompt_tokens_));
  }
  SamplingParams first = sampling;
  first.max_new_tokens = 1;  // the prefill worker samples exactly one token
  Sampler sampler = Sampler::Create(first, prompt, {});
  HMOE_RETURN_IF_ERROR(UseExpertsOf(0, 1));  // after a DSLP prefill: every expert again

  const int64_t reused = prefix != nullptr ? static_cast<int64_t>(prefix->header().num_tokens) : 0;
  if (reused < 0 || reused >= n) {
    return absl::InvalidArgumentError(
        absl::StrCat("prefix_kv: ", reused, " tokens for a prompt of ", n, "; expected fewer"));
  }
  const int64_t todo = n - reused;
  SlpResult result;
  result.prompt_tokens = n;
  result.prefix_tokens = reused;
  result.ring_slots = RingSlotsFor(todo);
  if (result.ring_slots > 0) HMOE_RETURN_IF_ERROR(weights_->SetRingSlots(result.ring_slots));
  device_->ResetPeakBytes();
  const int64_t passes = (todo + max_step_tokens_ - 1) / max_step_tokens_;
  // Only the last step samples: earlier passes leave the head (lm_head) out.
  HMOE_RETURN_IF_ERROR(weights_->BeginPrefill(passes, HeadStreaming::kLastPass));
  KvSequence seq = cache_->NewSequence();
  if (reused > 0) {
    absl::Status imported =
        cache_->Import(seq, reused, batch_->stream(), prefix->payload().data(),
                       prefix->payload_on_device() ? MemorySpace::kDevice : MemorySpace::kHost);
    if (imported.ok()) imported = batch_->stream().Synchronize();
    if (!imported.ok()) {
      AbortPrefill();
      return imported;
    }
  }
  absl::StatusOr<std::vector<float>> logits =
      RunSteps(seq, prompt.subspan(static_cast<size_t>(reused)), cancelled);
  if (!logits.ok()) {
    AbortPrefill();
    return logits.status();
  }
  HMOE_ASSIGN_OR_RETURN(result.streaming, weights_->EndPrefill());
  HMOE_ASSIGN_OR_RETURN(result.first_token, sampler.Sample(*logits));

  const absl::Time export_start = absl::Now();
  if (export_kind_ == KvExportKind::kCudaIpc) {
    HMOE_ASSIGN_OR_RETURN(result.kv, ExportToCudaIpc(*cache_, seq, batch_->stream()));
  } else {
    HMOE_ASSIGN_OR_RETURN(result.kv, ExportToShm(*cache_, seq, batch_->stream(), export_name));
  }
  const absl::Time end = absl::Now();
  result.export_us = Micros(end - export_start);
  result.prefill_us = Micros(end - start);
  result.peak_device_bytes = device_->peak_bytes_in_use();
  return result;
}

}  // namespace hmoe::prefill
