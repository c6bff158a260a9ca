#pragma once

// Shared by the decode-worker tests that run the real model: a temp dir, the synthetic
// checkpoints, and the token agreement rule against the FP32 reference forward pass.
//
// Token agreement rule (issue #8): greedy tokens agree with the reference; wherever they diverge,
// the reference's margin between its arg-max and the token is below the tolerance (and such steps
// are rare: Agreement::ok()). Checked with teacher forcing: the reference runs prompt + the
// worker's tokens, and at every step i the worker's token must be the reference's arg-max after
// the same prefix, or within the tolerance of it. So every one of the tokens is checked, not only
// those before a first divergence. The tolerance is the step's derived one where the engine's
// routing is known (CheckRoutedAgreement, with the score-gap rule for routing flips;
// docs/conformance.md), else kMarginTolerance (CheckAgreement; which tests still use it and why
// it exempts no routing difference: docs/conformance.md "Checks without the engine's routing").

#include <stdlib.h>
#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <filesystem>
#include <limits>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include <gtest/gtest.h>

#include "common/device/cpu_device.h"
#include "common/device/device.h"
#include "common/engine/kv_cache.h"
#include "common/engine/reference/reference_model.h"
#include "common/model/checkpoint.h"
#include "common/model/gguf_source.h"
#include "common/ops/cpu/cpu_worker_pool.h"
#include "decode_worker/forward_pass_step_engine.h"
#include "tests/integration/temp_dir.h"
#include "tools/gguf_f32_weights.h"
#include "tools/gguf_model_writer.h"
#include "tools/model_writer.h"

namespace hmoe::decode::testing {

// Logit units: the fixed tolerance of the tests that see only a worker's tokens, not the engine's
// routing (CheckAgreement; Agreement::ok()). Not derived: it must also cover a routing flip the
// test cannot see, whose effect on a token's logits is a whole expert's contribution (up to ~3.7
// on tiny). Where the engine's routing is observed (CheckRoutedAgreement and the callers of
// CheckAgreementWithRoutingFlips) each step has its own tolerance derived from the error model
// instead (docs/conformance.md "The error model and the tolerances").
inline constexpr float kMarginTolerance = 0.5f;

// A temp dir (hmoe_decode.XXXXXX) removed on destruction.
class ScopedTempDir : public ::hmoe::testing::TempDir {
 public:
  ScopedTempDir() : TempDir("hmoe_decode") {}
};

// Writes preset `name` (FP8, seed 0) to `dir`.
inline absl::Status WritePreset(const std::string& name, const std::string& dir) {
  absl::StatusOr<ModelPreset> preset = GetPreset(name);
  if (!preset.ok()) return preset.status();
  WriteOptions options;
  options.force = true;
  return WriteModel(*preset, dir, options);
}

// Writes preset `name` (seed 0, the same random weights as WritePreset) as a Q4_K_M GGUF
// `dir`/model.gguf (hmoe-make-model --format gguf --quant q4_k_m); returns its path.
inline absl::StatusOr<std::string> WriteGgufPreset(const std::string& name,
                                                   const std::string& dir) {
  absl::StatusOr<ModelPreset> preset = GetPreset(name);
  if (!preset.ok()) return preset.status();
  GgufWriteOptions options;
  options.force = true;
  options.mix = GgufQuantMix::kQ4_K_M;
  if (absl::Status s = WriteGgufModel(*preset, dir, options); !s.ok()) return s;
  return dir + "/model.gguf";
}

// The FP32 reference forward on the dequantized weights of the GGUF at `path` (issue 18's
// oracle: what the served quantized model must agree with), and the GGUF's config.
struct GgufReference {
  ModelConfig config;
  std::unique_ptr<reference::ReferenceModel> model;
};
inline absl::StatusOr<GgufReference> MakeGgufReference(const std::string& path) {
  absl::StatusOr<std::unique_ptr<GgufCheckpoint>> gguf = GgufCheckpoint::Open(path);
  if (!gguf.ok()) return gguf.status();
  GgufReference r;
  r.config = (*gguf)->config();
  absl::StatusOr<std::unique_ptr<InMemoryWeightSource>> f32 =
      LoadGgufAsF32Weights(r.config, (*gguf)->model());
  if (!f32.ok()) return f32.status();
  // The served engine rounds the activations of block-quantized weights to Q8_K unless
  // HMOE_QUANT_ACTIVATIONS=f32 (workers inherit this process's environment): so does the oracle.
  reference::ReferenceModelOptions options;
  if (cpu::DefaultQuantActivations() == cpu::QuantActivations::kQ8K) {
    options.q8k_activation_tensors = BlockQuantizedTensorNames(**gguf);
  }
  absl::StatusOr<std::unique_ptr<reference::ReferenceModel>> ref =
      reference::ReferenceModel::Create(r.config, **f32, options);
  if (!ref.ok()) return ref.status();
  r.model = *std::move(ref);
  return r;
}

struct Agreement {
  int steps = 0;
  int divergences = 0;            // steps where the token is not the reference's arg-max
  int exempt = 0;                 // always 0 (kept for reports; no step is exempted any more)
  float worst_margin = 0.0f;      // largest (reference max - reference logit of the token) there
  float worst_margin_all = 0.0f;  // the same (equal to worst_margin)
  std::string detail;             // the divergent steps, for failure messages
  // With the engine's routing (CheckRoutedAgreement): the derived per-step rule
  // (docs/conformance.md "The error model and the tolerances").
  bool derived = false;
  int beyond_tolerance = 0;         // divergent steps whose margin >= that step's tolerance
  double worst_margin_ratio = 0.0;  // largest margin / tolerance over the divergent steps
  int routing_flips = 0;            // (layer, position) pairs with another expert set
  int flipped_positions = 0;        // positions with a flip in some layer
  int unproven_flips = 0;           // flips whose reference selection gap >= its tolerance
  double worst_gap_ratio = 0.0;     // largest selection gap / tolerance over the flips
  // The rule, plus rarity: at most 2 + steps / 32 divergent steps (4 of 64), so a systematic
  // error cannot hide under the tolerance. Derived: every divergence within its step's
  // tolerance and every routing flip a proven near-tie.
  bool ok() const {
    const bool rare = divergences <= 2 + steps / 32;
    if (derived) return rare && beyond_tolerance == 0 && unproven_flips == 0;
    return worst_margin < kMarginTolerance && rare;
  }
  // The rule with a fixed `tolerance`.
  bool ok(float tolerance) const {
    return worst_margin_all < tolerance && divergences <= 2 + steps / 32 && unproven_flips == 0;
  }
};

// The error model of the engine serving `model` (docs/conformance.md): BF16 activations, or
// Q8_K ones where the reference rounds to Q8_K (a GGUF with the default HMOE_QUANT_ACTIVATIONS).
inline reference::ErrorModel ErrorModelFor(const reference::ReferenceModel& model) {
  reference::ErrorModel e;
  if (!model.options().q8k_activation_tensors.empty()) {
    e.unit_roundoff = reference::ErrorModel::kQ8KUnitRoundoff;
  }
  return e;
}

// Engine routing: routing[l][position] = the experts of that MoE layer (any order); empty
// layers for dense ones.
using EngineRouting = std::vector<std::vector<std::vector<int32_t>>>;

// The reference run over prompt + tokens[:-1] (teacher forcing): logits row
// prompt.size() - 1 + i is what the reference predicts for tokens[i]. With `follow` (the
// engine's routing over every position), the reference is traced under its error model and
// takes the engine's experts wherever they differ from its own (ForwardTrace::follow_routing).
struct ReferenceRun {
  std::vector<float> logits;
  int64_t vocab = 0;
  int64_t first_row = 0;
  reference::ForwardTrace trace;  // with_trace only

  const float* row(size_t step) const { return logits.data() + (first_row + step) * vocab; }
};

inline absl::StatusOr<ReferenceRun> RunReference(const reference::ReferenceModel& model,
                                                 const std::vector<int32_t>& prompt,
                                                 const std::vector<int32_t>& tokens,
                                                 bool with_trace = false,
                                                 const EngineRouting* follow = nullptr) {
  ReferenceRun run;
  run.vocab = model.config().vocab_size;
  run.first_row = static_cast<int64_t>(prompt.size()) - 1;
  std::vector<int32_t> input = prompt;
  if (!tokens.empty()) input.insert(input.end(), tokens.begin(), tokens.end() - 1);
  run.trace.error_model = ErrorModelFor(model);
  if (follow != nullptr) {
    for (size_t l = 0; l < follow->size(); ++l) {
      if (!(*follow)[l].empty() && (*follow)[l].size() != input.size()) {
        return absl::InternalError(absl::StrCat("engine routing of layer ", l, " has ",
                                                (*follow)[l].size(), " positions, expected ",
                                                input.size()));
      }
    }
    run.trace.follow_routing = [follow](int64_t l, int64_t p) -> const std::vector<int32_t>* {
      if (l >= static_cast<int64_t>(follow->size()) || (*follow)[l].empty()) return nullptr;
      return &(*follow)[l][p];
    };
  }
  reference::ReferenceKvCache cache = model.NewCache();
  absl::StatusOr<std::vector<float>> logits =
      model.Forward(input, cache, with_trace || follow != nullptr ? &run.trace : nullptr);
  if (!logits.ok()) return logits.status();
  run.logits = *std::move(logits);
  return run;
}

// The token agreement rule over `tokens` with a fixed margin tolerance (kMarginTolerance in
// ok()), for runs without the engine's routing.
inline Agreement Evaluate(const ReferenceRun& run, const std::vector<int32_t>& tokens) {
  Agreement a;
  for (size_t i = 0; i < tokens.size(); ++i) {
    const float* row = run.row(i);
    const int64_t best = std::max_element(row, row + run.vocab) - row;
    ++a.steps;
    if (best == tokens[i]) continue;
    const float margin = row[best] - row[tokens[i]];
    a.worst_margin_all = std::max(a.worst_margin_all, margin);
    ++a.divergences;
    a.worst_margin = std::max(a.worst_margin, margin);
    absl::StrAppend(&a.detail, " step ", i, ": token ", tokens[i], " vs reference ", best,
                    " (margin ", margin, ")");
  }
  return a;
}

// Teacher-forced check of `tokens` (generated after `prompt`) against the reference.
inline absl::StatusOr<Agreement> CheckAgreement(const reference::ReferenceModel& model,
                                                const std::vector<int32_t>& prompt,
                                                const std::vector<int32_t>& tokens) {
  absl::StatusOr<ReferenceRun> run = RunReference(model, prompt, tokens);
  if (!run.ok()) return run.status();
  return Evaluate(*run, tokens);
}

// The score-gap rule (docs/conformance.md "Routing flips: the score-gap rule") and the derived
// token agreement rule, given the engine's routing of every position of prompt + tokens[:-1]:
// the reference runs teacher-forced, following the engine's experts where they differ from its
// own; each such difference (a routing flip) must be a near-tie of the reference — its selection
// gap (MoeGateResult::SelectionGap: K-th minus (K+1)-th selection score among the kept groups,
// or half the kept/dropped group-score gap) below the layer's gap tolerance — and every step's
// token must be the reference's arg-max or within that step's derived logit tolerance of it
// (ReferenceModel::LogitPairTolerance). No step is exempted.
inline absl::StatusOr<Agreement> CheckRoutedAgreement(const reference::ReferenceModel& model,
                                                      const std::vector<int32_t>& prompt,
                                                      const std::vector<int32_t>& tokens,
                                                      const EngineRouting& engine_routing,
                                                      ReferenceRun* run_out = nullptr) {
  absl::StatusOr<ReferenceRun> run =
      RunReference(model, prompt, tokens, /*with_trace=*/true, &engine_routing);
  if (!run.ok()) return run.status();
  Agreement a;
  a.derived = true;
  const reference::ForwardTrace& trace = run->trace;
  const int64_t positions = static_cast<int64_t>(prompt.size() + tokens.size()) - 1;
  std::vector<bool> flipped(positions, false);
  for (size_t l = 0; l < trace.routing.size(); ++l) {
    if (trace.routing[l].empty()) continue;
    if (l >= engine_routing.size() || engine_routing[l].empty()) {
      return absl::InternalError(absl::StrCat("no engine routing for MoE layer ", l));
    }
    for (int64_t p = 0; p < positions; ++p) {
      const reference::MoeGateResult& g = trace.routing[l][p];
      if (!g.followed) continue;
      ++a.routing_flips;
      if (!flipped[p]) ++a.flipped_positions;
      flipped[p] = true;
      const double gap = g.SelectionGap();
      const double tol = trace.gap_tolerance[l][p];
      const double ratio = tol > 0.0 ? gap / tol : std::numeric_limits<double>::infinity();
      a.worst_gap_ratio = std::max(a.worst_gap_ratio, ratio);
      if (!(gap < tol)) {
        ++a.unproven_flips;
        absl::StrAppend(&a.detail, " [position ", p, " layer ", l, ": routing differs, gap ", gap,
                        " >= tolerance ", tol, ": not a near-tie]");
      }
    }
  }
  for (size_t i = 0; i < tokens.size(); ++i) {
    const float* row = run->row(i);
    const int64_t best = std::max_element(row, row + run->vocab) - row;
    ++a.steps;
    if (best == tokens[i]) continue;
    const float margin = row[best] - row[tokens[i]];
    const double tol = model.LogitPairTolerance(trace, run->first_row + static_cast<int64_t>(i),
                                                static_cast<int32_t>(best), tokens[i]);
    ++a.divergences;
    a.worst_margin = std::max(a.worst_margin, margin);
    a.worst_margin_all = a.worst_margin;
    a.worst_margin_ratio = std::max(a.worst_margin_ratio, margin / tol);
    if (!(margin < tol)) ++a.beyond_tolerance;
    absl::StrAppend(&a.detail, " step ", i, ": token ", tokens[i], " vs reference ", best,
                    " (margin ", margin, ", tolerance ", tol, margin < tol ? ")" : ": beyond)");
  }
  absl::StrAppend(&a.detail, " (routing flips at ", a.flipped_positions, " of ", positions,
                  " positions, ", a.routing_flips, " layer flips, ", a.unproven_flips,
                  " not near-ties; worst gap/tolerance ", a.worst_gap_ratio, ")");
  if (run_out != nullptr) *run_out = *std::move(run);
  return a;
}

// A two-thread unpinned CPU worker pool and a CpuDevice over it (the pool outlives the device:
// declared first).
struct CpuRig {
  std::unique_ptr<CpuWorkerPool> pool;
  std::unique_ptr<Device> device;
};
inline absl::StatusOr<CpuRig> MakeCpuRig() {
  CpuWorkerPoolOptions pool_options;
  pool_options.num_nodes = 1;
  pool_options.threads_per_node = 2;
  pool_options.pin_threads = false;
  absl::StatusOr<std::unique_ptr<CpuWorkerPool>> pool = CpuWorkerPool::Create(pool_options);
  if (!pool.ok()) return pool.status();
  CpuRig rig;
  rig.pool = *std::move(pool);
  CpuDeviceOptions device_options;
  device_options.pool = rig.pool.get();
  rig.device = NewCpuDevice(device_options);
  return rig;
}

// Runs the engine as the decode worker's scheduler runs a request — `prompt` in chunks of
// `chunk_size`, then one token per step (the engine's results do not depend on what else shares
// a step) — with its expert routing observed into `routing`. Each step feeds forced[i] when
// `forced` is given (a replay of known tokens: forced->size() - 1 steps), else the arg-max
// (greedy: `new_tokens` - 1 steps). Returns the arg-max tokens (the first from the prompt), and
// their logits in `logits` when given.
inline absl::StatusOr<std::vector<int32_t>> RunEngineWithRouting(
    const ModelConfig& config, const WeightSource& checkpoint, const std::vector<int32_t>& prompt,
    const std::vector<int32_t>* forced, int64_t new_tokens, int64_t chunk_size,
    EngineRouting* routing, std::vector<std::vector<float>>* logits = nullptr) {
  if (forced != nullptr) new_tokens = static_cast<int64_t>(forced->size());
  absl::StatusOr<CpuRig> rig = MakeCpuRig();
  if (!rig.ok()) return rig.status();
  std::unique_ptr<CpuWorkerPool>& pool = rig->pool;
  std::unique_ptr<Device>& device = rig->device;
  routing->assign(config.num_hidden_layers, {});
  ForwardPassStepEngineOptions options;
  options.max_step_tokens = chunk_size + 1;
  options.max_step_sequences = 1;
  options.kv_block_tokens = 64;
  options.kv_blocks = (static_cast<int64_t>(prompt.size()) + new_tokens) / 64 + 2;
  options.engine.routing_observer = [&](int64_t layer, int64_t n, int64_t k, const int32_t* ids) {
    for (int64_t t = 0; t < n; ++t) (*routing)[layer].emplace_back(ids + t * k, ids + (t + 1) * k);
  };
  absl::StatusOr<std::unique_ptr<ForwardPassStepEngine>> engine =
      ForwardPassStepEngine::Create(config, checkpoint, *device, *pool, options);
  if (!engine.ok()) return engine.status();
  KvSequence seq = (*engine)->kv_cache().NewSequence();
  std::vector<int32_t> out;
  auto argmax = [](const std::vector<float>& l) {
    return static_cast<int32_t>(std::max_element(l.begin(), l.end()) - l.begin());
  };
  for (size_t begin = 0; begin < prompt.size(); begin += chunk_size) {
    const size_t n = std::min<size_t>(chunk_size, prompt.size() - begin);
    SequenceInput in{&seq, std::span<const int32_t>(prompt).subspan(begin, n),
                     begin + n == prompt.size()};
    absl::StatusOr<std::vector<std::vector<float>>> step =
        (*engine)->engine().Forward(std::span<const SequenceInput>(&in, 1));
    if (!step.ok()) return step.status();
    if (in.want_logits) out.push_back(argmax((*step)[0]));
    if (in.want_logits && logits != nullptr) logits->push_back((*step)[0]);
  }
  for (int64_t i = 0; i + 1 < new_tokens; ++i) {
    const int32_t next = forced != nullptr ? (*forced)[i] : out.back();
    SequenceInput in{&seq, std::span<const int32_t>(&next, 1), true};
    absl::StatusOr<std::vector<std::vector<float>>> step =
        (*engine)->engine().Forward(std::span<const SequenceInput>(&in, 1));
    if (!step.ok()) return step.status();
    out.push_back(argmax((*step)[0]));
    if (logits != nullptr) logits->push_back((*step)[0]);
  }
  return out;
}

// CheckRoutedAgreement for a continuation from a KV cache the FP32 reference computed (the tests
// that hand a reference cache to the decode worker, as a prefill worker would): `tokens` are the
// first token (the reference's arg-max after `prompt`) and the worker's continuation. The
// continuation is replayed in process — the reference's cache imported into an engine's KV cache
// in the hand-off format (KvCache::Import, as the worker imports it), then one token per step
// with the engine's routing observed — and must reproduce `tokens` (else InternalError). The
// prompt positions take the reference's own experts (their KV is the reference's, so there is
// nothing to follow); every later routing difference is checked by the score-gap rule.
inline absl::StatusOr<Agreement> CheckImportedKvAgreementWithRoutingFlips(
    const ModelConfig& config, const WeightSource& checkpoint,
    const reference::ReferenceModel& model, const std::vector<int32_t>& prompt,
    const std::vector<int32_t>& tokens) {
  if (tokens.empty()) return absl::InvalidArgumentError("no tokens to check");
  reference::ReferenceKvCache ref_cache = model.NewCache();
  reference::ForwardTrace own;
  own.error_model = ErrorModelFor(model);
  if (absl::StatusOr<std::vector<float>> l = model.Forward(prompt, ref_cache, &own); !l.ok()) {
    return l.status();
  }
  const auto n = static_cast<int64_t>(prompt.size());
  EngineRouting routing(config.num_hidden_layers);
  for (int64_t l = 0; l < config.num_hidden_layers; ++l) {
    for (const reference::MoeGateResult& g : own.routing[l]) routing[l].push_back(g.experts);
  }
  absl::StatusOr<CpuRig> rig = MakeCpuRig();
  if (!rig.ok()) return rig.status();
  std::unique_ptr<CpuWorkerPool>& pool = rig->pool;
  std::unique_ptr<Device>& device = rig->device;
  ForwardPassStepEngineOptions options;
  options.max_step_tokens = 1;
  options.max_step_sequences = 1;
  options.kv_block_tokens = 64;
  options.kv_blocks = (n + static_cast<int64_t>(tokens.size())) / 64 + 2;
  options.engine.routing_observer = [&](int64_t layer, int64_t count, int64_t k,
                                        const int32_t* ids) {
    for (int64_t t = 0; t < count; ++t) routing[layer].emplace_back(ids + t * k, ids + (t + 1) * k);
  };
  absl::StatusOr<std::unique_ptr<ForwardPassStepEngine>> engine =
      ForwardPassStepEngine::Create(config, checkpoint, *device, *pool, options);
  if (!engine.ok()) return engine.status();
  // The hand-off format (common/kv_handoff): layer-major, per token the latent then the rope key.
  std::vector<float> flat;
  for (int64_t l = 0; l < ref_cache.num_layers(); ++l) {
    for (int64_t t = 0; t < n; ++t) {
      const auto latent =
          ref_cache.latent(l).subspan(t * ref_cache.kv_lora_rank(), ref_cache.kv_lora_rank());
      const auto k_pe = ref_cache.k_pe(l).subspan(t * ref_cache.rope_dim(), ref_cache.rope_dim());
      flat.insert(flat.end(), latent.begin(), latent.end());
      flat.insert(flat.end(), k_pe.begin(), k_pe.end());
    }
  }
  KvCache& kv = (*engine)->kv_cache();
  if (flat.size() * sizeof(float) != kv.ExportBytes(n)) {
    return absl::InternalError(absl::StrCat("reference cache of ", flat.size() * sizeof(float),
                                            " bytes, the engine's hand-off format needs ",
                                            kv.ExportBytes(n)));
  }
  absl::StatusOr<std::unique_ptr<Stream>> stream = device->CreateStream();
  if (!stream.ok()) return stream.status();
  KvSequence seq = kv.NewSequence();
  if (absl::Status s = kv.Import(seq, n, **stream, flat.data(), MemorySpace::kHost); !s.ok()) {
    return s;
  }
  if (absl::Status s = (*stream)->Synchronize(); !s.ok()) return s;
  if (absl::Status s = seq.Reserve(n + static_cast<int64_t>(tokens.size())); !s.ok()) return s;
  for (size_t i = 0; i + 1 < tokens.size(); ++i) {
    SequenceInput in{&seq, std::span<const int32_t>(&tokens[i], 1), true};
    absl::StatusOr<std::vector<std::vector<float>>> step =
        (*engine)->engine().Forward(std::span<const SequenceInput>(&in, 1));
    if (!step.ok()) return step.status();
    const std::vector<float>& l = (*step)[0];
    const auto got = static_cast<int32_t>(std::max_element(l.begin(), l.end()) - l.begin());
    if (got != tokens[i + 1]) {
      return absl::InternalError(absl::StrCat("the in-process replay gives token ", got,
                                              " at step ", i + 1, ", the worker gave ",
                                              tokens[i + 1]));
    }
  }
  return CheckRoutedAgreement(model, prompt, tokens, routing);
}

// CheckRoutedAgreement for a worker's tokens: the worker's computation is replayed in process
// (RunEngineWithRouting) with the engine's expert routing observed. Errors: the replay does not
// reproduce the worker's tokens (then the routing would not describe the worker).
// `weights` with `config`: any checkpoint the worker serves (safetensors or a GGUF).
inline absl::StatusOr<Agreement> CheckAgreementWithRoutingFlips(
    const ModelConfig& config, const WeightSource& checkpoint,
    const reference::ReferenceModel& model, const std::vector<int32_t>& prompt,
    const std::vector<int32_t>& tokens, int64_t chunk_size) {
  EngineRouting routing;
  absl::StatusOr<std::vector<int32_t>> replayed =
      RunEngineWithRouting(config, checkpoint, prompt, &tokens, 0, chunk_size, &routing);
  if (!replayed.ok()) return replayed.status();
  if (*replayed != tokens) {
    return absl::InternalError("the in-process replay does not reproduce the worker's tokens");
  }
  return CheckRoutedAgreement(model, prompt, tokens, routing);
}
inline absl::StatusOr<Agreement> CheckAgreementWithRoutingFlips(
    const Checkpoint& checkpoint, const reference::ReferenceModel& model,
    const std::vector<int32_t>& prompt, const std::vector<int32_t>& tokens, int64_t chunk_size) {
  return CheckAgreementWithRoutingFlips(checkpoint.config(), checkpoint, model, prompt, tokens,
                                        chunk_size);
}

}  // namespace hmoe::decode::testing
