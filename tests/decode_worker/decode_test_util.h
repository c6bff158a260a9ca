#pragma once

// Shared by the decode-worker tests that run the real model: a temp dir, the synthetic
// checkpoints, and the token agreement rule against the FP32 reference forward pass.
//
// Token agreement rule (issue #8): greedy tokens agree with the reference; wherever they diverge,
// the reference's top-2 logit margin at that step is below kMarginTolerance (and such steps are
// rare: Agreement::ok()). Checked with teacher
// forcing: the reference runs prompt + the worker's tokens, and at every step i the worker's token
// must be the reference's arg-max after the same prefix, or within kMarginTolerance of it (then
// the reference's own top-2 margin is below the tolerance too). So every one of the tokens is
// checked, not only those before a first divergence.

#include <stdlib.h>
#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <filesystem>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include <gtest/gtest.h>

#include "common/device/cpu_device.h"
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

// Logit units. Measured on the tiny checkpoint (6 prompts x 64 greedy steps, identical inputs to
// both): the engine's logits differ from the reference's by 0.07 RMS (2% of the logit RMS of 3.0),
// except at isolated steps where a near-tie in MoE expert routing flips under the engine's BF16
// activation rounding (the router then picks another expert than the reference): there the error
// reaches ~3.7 for that token only. A token may differ from the reference's where the reference's
// top two are closer than this tolerance.
inline constexpr float kMarginTolerance = 0.5f;
// The stated tolerance of the `small` checkpoint (8 layers, 32 experts, group-limited top-4),
// whose MoE routing has many more near-ties than tiny's: where the engine's BF16 activations
// resolve one the other way (a routing flip), that token's logits move by up to ~1.2, and the
// reference's top-2 margin at a divergence caused by a flip reaches 1.16 in these tests. The
// `small` tests check the rule with this tolerance (Agreement::ok(kSmallMarginTolerance),
// every divergence counted) and, more strictly, kMarginTolerance everywhere except at steps whose
// routing is observed to have flipped (CheckAgreementWithRoutingFlips).
inline constexpr float kSmallMarginTolerance = 1.25f;

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
  int exempt = 0;                 // divergent steps exempted (routing flips, see Evaluate)
  float worst_margin = 0.0f;      // largest (reference max - reference logit of the token) there
  float worst_margin_all = 0.0f;  // the same over every divergent step, exempt ones included
  std::string detail;             // the divergent steps, for failure messages
  // The rule, plus rarity: at most 2 + steps / 32 divergent steps (4 of 64), so a systematic
  // error cannot hide under the tolerance. Exempt steps are left out.
  bool ok() const { return worst_margin < kMarginTolerance && divergences <= 2 + steps / 32; }
  // The rule with `tolerance`, every divergent step counted (no exemption).
  bool ok(float tolerance) const {
    return worst_margin_all < tolerance && divergences + exempt <= 2 + steps / 32;
  }
};

// The reference run over prompt + tokens[:-1] (teacher forcing): logits row
// prompt.size() - 1 + i is what the reference predicts for tokens[i].
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
                                                 bool with_trace = false) {
  ReferenceRun run;
  run.vocab = model.config().vocab_size;
  run.first_row = static_cast<int64_t>(prompt.size()) - 1;
  std::vector<int32_t> input = prompt;
  if (!tokens.empty()) input.insert(input.end(), tokens.begin(), tokens.end() - 1);
  reference::ReferenceKvCache cache = model.NewCache();
  absl::StatusOr<std::vector<float>> logits =
      model.Forward(input, cache, with_trace ? &run.trace : nullptr);
  if (!logits.ok()) return logits.status();
  run.logits = *std::move(logits);
  return run;
}

// The token agreement rule over `tokens`. Steps with exempt[i] set (a routing flip at that
// position: the engine's BF16 path chose other experts than the reference at a near-tie, as
// docs/engine.md describes) are counted in `exempt` instead of being checked.
inline Agreement Evaluate(const ReferenceRun& run, const std::vector<int32_t>& tokens,
                          const std::vector<bool>* exempt = nullptr) {
  Agreement a;
  for (size_t i = 0; i < tokens.size(); ++i) {
    const float* row = run.row(i);
    const int64_t best = std::max_element(row, row + run.vocab) - row;
    ++a.steps;
    if (best == tokens[i]) continue;
    const float margin = row[best] - row[tokens[i]];
    a.worst_margin_all = std::max(a.worst_margin_all, margin);
    if (exempt != nullptr && i < exempt->size() && (*exempt)[i]) {
      ++a.exempt;
      absl::StrAppend(&a.detail, " step ", i, ": token ", tokens[i], " vs reference ", best,
                      " (margin ", margin, ", routing flip: exempt)");
      continue;
    }
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

// The token agreement rule with the routing-flip exemption (docs/engine.md), for checkpoints
// whose MoE routing has near-ties that the engine's BF16 activations resolve differently from the
// FP32 reference (the `small` checkpoint: a few percent of positions). The worker's computation is
// replayed in process — `prompt` in chunks of `chunk_size`, then `tokens` one per step, exactly
// as the worker's scheduler runs a request (the engine's results do not depend on what else
// shares a step) — with the engine's expert routing observed, and the reference runs teacher-
// forced with its routing traced. A step whose position was routed to other experts than the
// reference's in any MoE layer is exempt; every other step follows the rule. Errors: the replay
// does not reproduce the worker's tokens (then the exemption would not describe the worker), or
// flips are not rare (more than one position in five; measured on `small`: 0-11 %, more with
// longer contexts, since a flipped position's KV perturbs the positions after it).
// `weights` with `config`: any checkpoint the worker serves (safetensors or a GGUF).
inline absl::StatusOr<Agreement> CheckAgreementWithRoutingFlips(
    const ModelConfig& config, const WeightSource& checkpoint,
    const reference::ReferenceModel& model, const std::vector<int32_t>& prompt,
    const std::vector<int32_t>& tokens, int64_t chunk_size) {
  CpuWorkerPoolOptions pool_options;
  pool_options.num_nodes = 1;
  pool_options.threads_per_node = 2;
  pool_options.pin_threads = false;
  absl::StatusOr<std::unique_ptr<CpuWorkerPool>> pool = CpuWorkerPool::Create(pool_options);
  if (!pool.ok()) return pool.status();
  CpuDeviceOptions device_options;
  device_options.pool = pool->get();
  std::unique_ptr<Device> device = NewCpuDevice(device_options);
  // routing[l][position] = sorted experts, MoE layers only.
  std::vector<std::vector<std::vector<int32_t>>> routing(config.num_hidden_layers);
  ForwardPassStepEngineOptions options;
  options.max_step_tokens = chunk_size + 1;
  options.max_step_sequences = 1;
  options.kv_block_tokens = 64;
  options.kv_blocks = static_cast<int64_t>(prompt.size() + tokens.size()) / 64 + 2;
  options.engine.routing_observer = [&](int64_t layer, int64_t n, int64_t k, const int32_t* ids) {
    for (int64_t t = 0; t < n; ++t) {
      std::vector<int32_t> e(ids + t * k, ids + (t + 1) * k);
      std::sort(e.begin(), e.end());
      routing[layer].push_back(std::move(e));
    }
  };
  absl::StatusOr<std::unique_ptr<ForwardPassStepEngine>> engine =
      ForwardPassStepEngine::Create(config, checkpoint, *device, **pool, options);
  if (!engine.ok()) return engine.status();
  KvSequence seq = (*engine)->kv_cache().NewSequence();
  std::vector<int32_t> replayed;
  auto argmax = [](const std::vector<float>& l) {
    return static_cast<int32_t>(std::max_element(l.begin(), l.end()) - l.begin());
  };
  for (size_t begin = 0; begin < prompt.size(); begin += chunk_size) {
    const size_t n = std::min<size_t>(chunk_size, prompt.size() - begin);
    SequenceInput in{&seq, std::span<const int32_t>(prompt).subspan(begin, n),
                     begin + n == prompt.size()};
    absl::StatusOr<std::vector<std::vector<float>>> out =
        (*engine)->engine().Forward(std::span<const SequenceInput>(&in, 1));
    if (!out.ok()) return out.status();
    if (in.want_logits) replayed.push_back(argmax((*out)[0]));
  }
  for (size_t i = 0; i + 1 < tokens.size(); ++i) {
    SequenceInput in{&seq, std::span<const int32_t>(&tokens[i], 1), true};
    absl::StatusOr<std::vector<std::vector<float>>> out =
        (*engine)->engine().Forward(std::span<const SequenceInput>(&in, 1));
    if (!out.ok()) return out.status();
    replayed.push_back(argmax((*out)[0]));
  }
  if (replayed != tokens) {
    return absl::InternalError("the in-process replay does not reproduce the worker's tokens");
  }
  absl::StatusOr<ReferenceRun> run = RunReference(model, prompt, tokens, /*with_trace=*/true);
  if (!run.ok()) return run.status();
  const int64_t positions = static_cast<int64_t>(prompt.size() + tokens.size()) - 1;
  std::vector<bool> flipped(positions, false);
  int64_t flips = 0;
  for (int64_t l = 0; l < config.num_hidden_layers; ++l) {
    if (routing[l].empty()) continue;
    if (static_cast<int64_t>(routing[l].size()) != positions ||
        static_cast<int64_t>(run->trace.routing[l].size()) != positions) {
      return absl::InternalError(absl::StrCat("routing of layer ", l, " has ", routing[l].size(),
                                              " positions, expected ", positions));
    }
    for (int64_t p = 0; p < positions; ++p) {
      std::vector<int32_t> want = run->trace.routing[l][p].experts;
      std::sort(want.begin(), want.end());
      if (want != routing[l][p] && !flipped[p]) {
        flipped[p] = true;
        ++flips;
      }
    }
  }
  if (flips * 5 > positions) {
    return absl::InternalError(
        absl::StrCat("routing flips at ", flips, " of ", positions, " positions: not rare"));
  }
  std::vector<bool> exempt(tokens.size(), false);
  for (size_t i = 0; i < tokens.size(); ++i) exempt[i] = flipped[prompt.size() - 1 + i];
  Agreement a = Evaluate(*run, tokens, &exempt);
  absl::StrAppend(&a.detail, " (routing flips at ", flips, " of ", positions, " positions)");
  return a;
}
inline absl::StatusOr<Agreement> CheckAgreementWithRoutingFlips(
    const Checkpoint& checkpoint, const reference::ReferenceModel& model,
    const std::vector<int32_t>& prompt, const std::vector<int32_t>& tokens, int64_t chunk_size) {
  return CheckAgreementWithRoutingFlips(checkpoint.config(), checkpoint, model, prompt, tokens,
                                        chunk_size);
}

}  // namespace hmoe::decode::testing
