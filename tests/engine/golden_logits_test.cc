// Golden logits from Hugging Face transformers (docs/conformance.md "Golden logits from
// transformers"): an oracle independent of our code, in CI, without torch.
//
// tests/data/golden/NAME.json.gz were written by `scripts/conformance.sh --golden` from
// transformers' DeepseekV3ForCausalLM in float32 on checkpoints made by hmoe-make-model (preset,
// seed, FP8, --config-override recorded in the file). For each file this test
//   1. regenerates the checkpoint with the same writer (WriteModel after ApplyConfigOverride, the
//      code behind hmoe-make-model) and checks the FNV-1a 64 hash of config.json and every shard
//      against the recorded ones: the weights are bit-identical to those HF saw (the generator is
//      integer hashing plus float arithmetic without libm calls, see tools/model_writer.h);
//   2. runs the FP32 reference (common/engine/reference) on the prompt and compares every
//      position's top-K logits, every row's logsumexp and the full rows with kReferenceTolerance;
//   3. runs the optimized engine (CPU device, BF16 activations) over the same prompt, a first
//      prefill chunk then one teacher-forced token per step (so every position after the chunk
//      has logits, and positions > 1,000 are reached through the KV cache), with its routing
//      observed; runs the reference again following the engine's experts where they differ
//      (each difference must be a near-tie under the score-gap rule, docs/conformance.md); and
//      compares the engine at every position, none exempted, with that reference under the
//      error model's per-pair tolerance and with the golden logits carried over to the engine's
//      routing under the BF16 bound kEngineRelTolerance * RMS and the window RMS rule.
// A mismatch message names the position, the token id and both values.

#include <zlib.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include <gtest/gtest.h>

#include "common/base/json.h"
#include "tests/engine/engine_test_util.h"

#ifndef HMOE_GOLDEN_DIR
#error "HMOE_GOLDEN_DIR must name tests/data/golden"
#endif

namespace hmoe::engine_test {
namespace {

namespace fs = std::filesystem;

// FP32 vs FP32 with bit-identical dequantized weights: only the summation order differs (our
// reference accumulates in double, torch in float32 BLAS). Measured <= 1.0e-5 on all four files;
// docs/conformance.md derives the bound.
constexpr double kReferenceTolerance = 1e-3;
// The engine rounds every linear layer's input to BF16 (unit roundoff u = 2^-8; errors uniform in
// +-u/2 of the value, standard deviation u/sqrt(12) = 1.1e-3 relative, independent between
// roundings) and keeps attention, norms and softmax in F32 on the same FP8 weights. A logit sees
// about 30 such roundings on these 2-4-layer models (q_a/kv_a, q_b, o, gate/up, down and the
// experts' per layer, lm_head), so its error has a standard deviation of at most
// sqrt(30) * 1.1e-3 = 0.6 % of the logits' RMS before amplification, <= 1.2 % with the <= 2x of
// random residual networks of this depth; the largest of ~1024 logits is within 4 sigma: 5 % of
// the RMS, rounded up to 6 % (docs/conformance.md "Engine tolerance"). Routing flips do not enter
// this bound: the engine is compared with the reference that follows its proven near-ties (the
// score-gap rule), so both sides take the same experts. The per-pair check uses the tighter
// per-position bound of the reference's error model (ReferenceModel::LogitPairTolerance).
constexpr double kEngineRelTolerance = 0.06;
// RMS of the engine's top-K differences over any kWindow consecutive compared positions: 2x the
// per-logit standard deviation bound above (<= 1 % of the RMS), since 32 x 8 differences average
// BF16 noise out but not a systematic error.
constexpr size_t kWindow = 32;
constexpr double kEngineWindowRmsTolerance = 0.02;
// The engine's routing: [layer][position] = its experts, sorted; empty for dense layers.
using EngineRouting = std::vector<std::vector<std::vector<int32_t>>>;

std::string Gunzip(const std::string& path) {
  gzFile f = gzopen(path.c_str(), "rb");
  if (f == nullptr) return "";
  std::string out;
  char buf[1 << 16];
  int n = 0;
  while ((n = gzread(f, buf, sizeof(buf))) > 0) out.append(buf, static_cast<size_t>(n));
  gzclose(f);
  return out;
}

uint64_t Fnv1a64File(const fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  std::ostringstream ss;
  ss << in.rdbuf();
  const std::string data = ss.str();
  uint64_t h = 0xCBF29CE484222325ull;
  for (char c : data) {
    h ^= static_cast<uint8_t>(c);
    h *= 0x100000001B3ull;
  }
  return h;
}

struct Golden {
  std::string name;
  json::Value root;
  std::vector<int32_t> prompt;
  int64_t vocab = 0;
  int64_t top_k = 0;
  std::vector<std::vector<int32_t>> topk_ids;
  std::vector<std::vector<double>> topk_logits;
  std::vector<double> logsumexp;
  std::vector<int64_t> full_positions;
  std::vector<std::vector<double>> full_logits;
  double rms = 0.0;  // RMS of the full rows' logits
};

std::vector<double> Doubles(const json::Value& v) {
  std::vector<double> out;
  for (const json::Value& x : v.items()) out.push_back(x.as_double());
  return out;
}

Golden Load(const std::string& name) {
  Golden g;
  g.name = name;
  const std::string path = absl::StrCat(HMOE_GOLDEN_DIR, "/", name, ".json.gz");
  const std::string text = Gunzip(path);
  EXPECT_FALSE(text.empty()) << "cannot read " << path;
  auto root = json::Parse(text);
  EXPECT_TRUE(root.ok()) << path << ": " << root.status();
  if (!root.ok()) return g;
  g.root = *root;
  EXPECT_EQ(g.root.Find("format")->as_string(), "hmoe-golden-logits-1");
  for (const json::Value& id : g.root.Find("prompt_ids")->items()) {
    g.prompt.push_back(static_cast<int32_t>(id.as_int()));
  }
  g.vocab = g.root.Find("vocab_size")->as_int();
  g.top_k = g.root.Find("top_k")->as_int();
  for (const json::Value& row : g.root.Find("topk_ids")->items()) {
    std::vector<int32_t> ids;
    for (const json::Value& id : row.items()) ids.push_back(static_cast<int32_t>(id.as_int()));
    g.topk_ids.push_back(std::move(ids));
  }
  for (const json::Value& row : g.root.Find("topk_logits")->items()) {
    g.topk_logits.push_back(Doubles(row));
  }
  g.logsumexp = Doubles(*g.root.Find("logsumexp"));
  for (const json::Value& p : g.root.Find("full_positions")->items()) {
    g.full_positions.push_back(p.as_int());
  }
  double sum_sq = 0.0;
  int64_t count = 0;
  for (const json::Value& row : g.root.Find("full_logits")->items()) {
    g.full_logits.push_back(Doubles(row));
    for (double x : g.full_logits.back()) sum_sq += x * x;
    count += static_cast<int64_t>(g.full_logits.back().size());
  }
  g.rms = std::sqrt(sum_sq / std::max<int64_t>(count, 1));
  EXPECT_EQ(g.topk_ids.size(), g.prompt.size());
  EXPECT_EQ(g.logsumexp.size(), g.prompt.size());
  return g;
}

// Regenerates the golden file's checkpoint and checks that it is the one HF saw.
std::unique_ptr<Model> Regenerate(const Golden& g) {
  const json::Value& ck = *g.root.Find("checkpoint");
  absl::StatusOr<ModelPreset> preset = GetPreset(ck.Find("preset")->as_string());
  EXPECT_TRUE(preset.ok()) << preset.status();
  if (!preset.ok()) return nullptr;
  const absl::Status s =
      ApplyConfigOverride(json::Serialize(*ck.Find("config_override")), &*preset);
  EXPECT_TRUE(s.ok()) << s;
  if (!s.ok()) return nullptr;
  const std::string dir = absl::StrCat(::testing::TempDir(), "hmoe_golden_", getpid(), "_", g.name);
  WriteOptions options;
  options.seed = static_cast<uint64_t>(ck.Find("seed")->as_int());
  options.fp8 = ck.Find("dtype")->as_string() == "fp8";
  options.force = true;
  options.num_threads = 2;
  const absl::Status written = WriteModel(*preset, dir, options);
  EXPECT_TRUE(written.ok()) << written;
  if (!written.ok()) return nullptr;
  bool identical = true;
  for (const auto& [file, hash] : ck.Find("fnv1a64")->members()) {
    const std::string got = absl::StrFormat("%016x", Fnv1a64File(fs::path(dir) / file));
    EXPECT_EQ(got, hash.as_string())
        << g.name << ": regenerated " << file
        << " differs from the file the golden logits were computed from";
    identical = identical && got == hash.as_string();
  }
  if (!identical) return nullptr;
  auto m = std::make_unique<Model>();
  m->dir = dir;
  auto checkpoint = Checkpoint::Open(dir);
  EXPECT_TRUE(checkpoint.ok()) << checkpoint.status();
  if (!checkpoint.ok()) return nullptr;
  m->checkpoint = std::move(*checkpoint);
  auto reference = reference::ReferenceModel::Create(m->checkpoint->config(), *m->checkpoint);
  EXPECT_TRUE(reference.ok()) << reference.status();
  if (!reference.ok()) return nullptr;
  m->reference = std::move(*reference);
  std::error_code ignored;
  fs::remove_all(dir, ignored);  // the shards stay mapped
  return m;
}

double LogSumExp(const float* row, int64_t n) {
  const double mx = *std::max_element(row, row + n);
  double s = 0.0;
  for (int64_t i = 0; i < n; ++i) s += std::exp(static_cast<double>(row[i]) - mx);
  return mx + std::log(s);
}

struct RowCheck {
  double max_topk_diff = 0.0;  // over the golden top-K ids
  double sum_sq_topk_diff = 0.0;
  bool top1_ok = true;  // arg-max agrees or the golden margin is below `margin`
};

RowCheck CheckRow(const Golden& g, size_t pos, const float* row, double margin) {
  RowCheck r;
  for (int64_t k = 0; k < g.top_k; ++k) {
    const int32_t id = g.topk_ids[pos][k];
    const double d = std::abs(row[id] - g.topk_logits[pos][k]);
    r.max_topk_diff = std::max(r.max_topk_diff, d);
    r.sum_sq_topk_diff += d * d;
  }
  const int32_t arg = static_cast<int32_t>(std::max_element(row, row + g.vocab) - row);
  const double golden_margin = g.topk_logits[pos][0] - g.topk_logits[pos][1];
  r.top1_ok = arg == g.topk_ids[pos][0] || golden_margin < margin;
  return r;
}

class GoldenLogitsTest : public ::testing::TestWithParam<std::string> {};

TEST_P(GoldenLogitsTest, ReferenceAndEngineMatchTransformers) {
  const Golden g = Load(GetParam());
  ASSERT_FALSE(g.prompt.empty());
  std::unique_ptr<Model> model = Regenerate(g);
  ASSERT_NE(model, nullptr);
  const int64_t n = static_cast<int64_t>(g.prompt.size());
  const int64_t vocab = g.vocab;
  ASSERT_EQ(model->checkpoint->config().vocab_size, vocab);

  // ---- the FP32 reference: every position (and its own routing, to tell the engine's flips).
  reference::ReferenceKvCache ref_cache = model->reference->NewCache();
  reference::ForwardTrace trace;
  auto ref = model->reference->Forward(g.prompt, ref_cache, &trace);
  ASSERT_TRUE(ref.ok()) << ref.status();
  ASSERT_EQ(static_cast<int64_t>(ref->size()), n * vocab);
  double ref_topk = 0.0, ref_lse = 0.0, ref_full = 0.0;
  int64_t ref_top1_bad = 0;
  for (int64_t p = 0; p < n; ++p) {
    const float* row = ref->data() + p * vocab;
    const RowCheck r = CheckRow(g, static_cast<size_t>(p), row, 2 * kReferenceTolerance);
    ref_topk = std::max(ref_topk, r.max_topk_diff);
    EXPECT_LE(r.max_topk_diff, kReferenceTolerance) << g.name << " reference, position " << p;
    if (!r.top1_ok) ++ref_top1_bad;
    const double lse = std::abs(LogSumExp(row, vocab) - g.logsumexp[p]);
    ref_lse = std::max(ref_lse, lse);
    EXPECT_LE(lse, kReferenceTolerance) << g.name << " reference logsumexp, position " << p;
  }
  for (size_t i = 0; i < g.full_positions.size(); ++i) {
    const float* row = ref->data() + g.full_positions[i] * vocab;
    for (int64_t v = 0; v < vocab; ++v) {
      ref_full = std::max(ref_full, std::abs(row[v] - g.full_logits[i][v]));
    }
  }
  EXPECT_LE(ref_full, kReferenceTolerance) << g.name << " reference full rows";
  EXPECT_EQ(ref_top1_bad, 0) << g.name << " reference top-1 disagreements";
  std::printf(
      "golden %s: reference vs transformers over %lld positions: max |diff| top-%lld "
      "%.3g, logsumexp %.3g, full rows %.3g (tolerance %.3g)\n",
      g.name.c_str(), static_cast<long long>(n), static_cast<long long>(g.top_k), ref_topk, ref_lse,
      ref_full, kReferenceTolerance);

  // ---- the optimized engine: a prefill chunk, then one teacher-forced token per step; its
  // routing of every position is recorded (EngineOptions::routing_observer).
  const ModelConfig& config = model->checkpoint->config();
  EngineRouting engine_routing(config.num_hidden_layers);
  int64_t next_position = 0;
  EngineOptions options;
  options.routing_observer = [&](int64_t layer, int64_t count, int64_t top_k, const int32_t* ids) {
    for (int64_t t = 0; t < count; ++t) {
      std::vector<int32_t> set(ids + t * top_k, ids + (t + 1) * top_k);
      std::sort(set.begin(), set.end());
      auto& per_pos = engine_routing[layer];
      if (static_cast<int64_t>(per_pos.size()) <= next_position + t) {
        per_pos.resize(next_position + t + 1);
      }
      per_pos[next_position + t] = std::move(set);
    }
  };
  const int64_t block_size = 16;
  auto rig = Rig::Make(*model, options, /*num_blocks=*/n / block_size + 8, block_size);
  ASSERT_NE(rig, nullptr);
  KvSequence seq = rig->cache->NewSequence();
  const int64_t first_chunk = std::min<int64_t>(64, n / 2);
  // engine_logits[p - (first_chunk - 1)]: the engine's logits at position p.
  std::vector<std::vector<float>> engine_logits = {
      rig->Run(seq, std::span<const int32_t>(g.prompt.data(), first_chunk))};
  for (int64_t p = first_chunk; p < n; ++p) {
    next_position = p;
    engine_logits.push_back(rig->Run(seq, std::span<const int32_t>(g.prompt.data() + p, 1)));
  }
  for (int64_t l = 0; l < config.num_hidden_layers; ++l) {
    if (!config.is_moe_layer(l)) continue;
    ASSERT_EQ(static_cast<int64_t>(engine_routing[l].size()), n) << "engine routing, layer " << l;
  }

  // ---- the score-gap rule (docs/conformance.md "Routing flips: the score-gap rule"), as in
  // every other engine-vs-reference test: the reference runs the prompt again, following the
  // engine's experts wherever they differ from its own (ForwardTrace::follow_routing), and each
  // such difference must be a near-tie of the reference: its selection gap (MoeGateResult::
  // SelectionGap) below the gap tolerance ε its error model derives for that layer and position
  // (ForwardTrace::gap_tolerance). No position is exempted: both sides then continue from the
  // same discrete choices, and every position is compared below.
  bool any_flip = false;
  for (int64_t l = 0; l < config.num_hidden_layers && !any_flip; ++l) {
    if (!config.is_moe_layer(l)) continue;
    for (int64_t p = 0; p < n && !any_flip; ++p) {
      std::vector<int32_t> own = trace.routing[l][p].experts;
      std::sort(own.begin(), own.end());
      any_flip = own != engine_routing[l][p];
    }
  }
  reference::ForwardTrace follow_trace;
  std::vector<float> follow_logits;
  const reference::ForwardTrace* ft = &trace;
  const std::vector<float>* fl = &*ref;
  if (any_flip) {  // without a flip the following run would be the first one, bit for bit
    follow_trace.follow_routing = [&](int64_t l, int64_t p) -> const std::vector<int32_t>* {
      return &engine_routing[l][p];
    };
    reference::ReferenceKvCache follow_cache = model->reference->NewCache();
    auto followed = model->reference->Forward(g.prompt, follow_cache, &follow_trace);
    ASSERT_TRUE(followed.ok()) << followed.status();
    follow_logits = *std::move(followed);
    ft = &follow_trace;
    fl = &follow_logits;
  }
  int64_t layer_flips = 0, flipped_positions = 0, unproven = 0;
  double worst_gap_ratio = 0.0;
  for (int64_t p = 0; p < n; ++p) {
    bool flipped = false;
    for (int64_t l = 0; l < config.num_hidden_layers; ++l) {
      if (!config.is_moe_layer(l) || !ft->routing[l][p].followed) continue;
      flipped = true;
      ++layer_flips;
      const double gap = ft->routing[l][p].SelectionGap();
      const double eps = ft->gap_tolerance[l][p];
      worst_gap_ratio = std::max(worst_gap_ratio, gap / eps);
      if (!(gap < eps) && unproven++ < 10) {
        ADD_FAILURE() << g.name << ": position " << p << " layer " << l
                      << ": the engine's experts differ from the reference's where the "
                      << "reference's selection gap " << gap << " is not below its tolerance "
                      << eps << " (not a near-tie)";
      }
    }
    flipped_positions += flipped;
  }

  // ---- the engine's logits at every position from first_chunk - 1 on, none exempted, against
  //  (a) the following reference, under the error model (docs/conformance.md "The error model
  //      and the tolerances"): every logit difference l[best] - l[v] (best = the reference's
  //      arg-max) within ReferenceModel::LogitPairTolerance of the reference's, and so the
  //      engine's arg-max is the reference's or the reference's margin between the two is below
  //      that pair's tolerance;
  //  (b) transformers' golden logits carried over to the engine's routing: golden + (following
  //      reference - reference), i.e. the golden logits moved by exactly what following the
  //      proven near-ties changed in the FP32 reference (0 at every position before the first
  //      flip). |engine - that| <= kEngineRelTolerance * RMS at the golden top-K ids and on the
  //      full rows, and the window RMS rule; since |reference - golden| <= kReferenceTolerance
  //      (checked above), this is the engine against the following reference to within 1e-3,
  //      with the golden file's ids and rows.
  const double tol = kEngineRelTolerance * g.rms;
  int64_t compared = 0, over = 0, pairs_over = 0, token_bad = 0;
  std::vector<double> sq_diffs;  // per position: mean square top-K difference
  double worst = 0.0, worst_full = 0.0, worst_pair_ratio = 0.0;
  int64_t worst_pos = -1;
  for (int64_t p = first_chunk - 1; p < n; ++p) {
    const std::vector<float>& e = engine_logits[p - (first_chunk - 1)];
    ASSERT_EQ(static_cast<int64_t>(e.size()), vocab) << "position " << p;
    const float* r = fl->data() + p * vocab;    // the following reference
    const float* r0 = ref->data() + p * vocab;  // the reference (compared with the golden file)
    // (a)
    const int32_t best = static_cast<int32_t>(std::max_element(r, r + vocab) - r);
    for (int32_t v = 0; v < vocab; ++v) {
      if (v == best) continue;
      const double d = (e[best] - e[v]) - (static_cast<double>(r[best]) - r[v]);
      const double pair_tol = model->reference->LogitPairTolerance(*ft, p, best, v);
      worst_pair_ratio = std::max(worst_pair_ratio, std::abs(d) / pair_tol);
      if (!(std::abs(d) < pair_tol) && pairs_over++ < 10) {
        ADD_FAILURE() << g.name << " engine, position " << p << ": logits " << best << " - " << v
                      << " differ from the reference's by " << d << ", tolerance " << pair_tol;
      }
    }
    const int32_t got = ArgMax(e);
    if (got != best) {
      const double margin = static_cast<double>(r[best]) - r[got];
      const double pair_tol = model->reference->LogitPairTolerance(*ft, p, best, got);
      if (!(margin < pair_tol)) {
        ++token_bad;
        ADD_FAILURE() << g.name << " engine arg-max at position " << p << ": " << got
                      << ", reference " << best << " with margin " << margin << " >= " << pair_tol;
      }
    }
    // (b)
    ++compared;
    double max_diff = 0.0, sum_sq = 0.0;
    for (int64_t k = 0; k < g.top_k; ++k) {
      const int32_t id = g.topk_ids[p][k];
      const double want = g.topk_logits[p][k] + (static_cast<double>(r[id]) - r0[id]);
      const double d = std::abs(e[id] - want);
      max_diff = std::max(max_diff, d);
      sum_sq += d * d;
    }
    if (max_diff > worst) {
      worst = max_diff;
      worst_pos = p;
    }
    if (max_diff > tol) ++over;
    sq_diffs.push_back(sum_sq / static_cast<double>(g.top_k));
    EXPECT_LE(max_diff, tol) << g.name << " engine vs golden top-" << g.top_k << ", position " << p;
    const auto full = std::find(g.full_positions.begin(), g.full_positions.end(), p);
    if (full != g.full_positions.end()) {
      const std::vector<double>& want = g.full_logits[full - g.full_positions.begin()];
      double d = 0.0;
      for (int64_t v = 0; v < vocab; ++v) {
        d = std::max(d, std::abs(e[v] - (want[v] + (static_cast<double>(r[v]) - r0[v]))));
      }
      worst_full = std::max(worst_full, d);
      EXPECT_LE(d, tol) << g.name << " engine full row, position " << p;
    }
  }
  EXPECT_EQ(unproven, 0) << g.name << ": routing differences that are not near-ties (the first "
                         << "10 are listed above)";
  EXPECT_EQ(pairs_over, 0) << g.name << ": engine logit pairs beyond the error model's tolerance "
                           << "(the first 10 are listed above)";
  // The RMS difference over every window of kWindow compared positions: BF16 noise averages out,
  // a systematic error (a bug confined to some positions or experts) does not.
  const size_t window = std::min<size_t>(kWindow, sq_diffs.size());
  double worst_window = 0.0;
  int64_t worst_window_start = 0;
  for (size_t start = 0; start + window <= sq_diffs.size(); ++start) {
    double sum = 0.0;
    for (size_t i = start; i < start + window; ++i) sum += sq_diffs[i];
    const double rms = std::sqrt(sum / static_cast<double>(window));
    if (rms > worst_window) {
      worst_window = rms;
      worst_window_start = static_cast<int64_t>(start);
    }
  }
  EXPECT_LE(worst_window, kEngineWindowRmsTolerance * g.rms)
      << g.name << ": RMS engine difference over the " << window << " compared positions from the "
      << worst_window_start << "-th";
  std::printf(
      "golden %s: routing flips at %lld of %lld positions (%lld layer flips), %lld not near-ties, "
      "worst selection gap / tolerance %.3g\n",
      g.name.c_str(), static_cast<long long>(flipped_positions), static_cast<long long>(n),
      static_cast<long long>(layer_flips), static_cast<long long>(unproven), worst_gap_ratio);
  std::printf(
      "golden %s: engine vs the following reference: worst logit-pair error / tolerance %.3g "
      "(%lld beyond), %lld arg-max disagreements beyond tolerance\n",
      g.name.c_str(), worst_pair_ratio, static_cast<long long>(pairs_over),
      static_cast<long long>(token_bad));
  std::printf("golden %s: engine worst window RMS difference %.3g (window %zu; tolerance %.3g)\n",
              g.name.c_str(), worst_window, window, kEngineWindowRmsTolerance * g.rms);
  std::printf(
      "golden %s: engine vs transformers (carried over to the engine's routing) over %lld "
      "positions: max |diff| top-%lld %.3g (position %lld), full rows %.3g; tolerance %.3g "
      "(%.3g * RMS %.3g), %lld over\n",
      g.name.c_str(), static_cast<long long>(compared), static_cast<long long>(g.top_k), worst,
      static_cast<long long>(worst_pos), worst_full, tol, kEngineRelTolerance, g.rms,
      static_cast<long long>(over));
}

INSTANTIATE_TEST_SUITE_P(Golden, GoldenLogitsTest,
                         ::testing::Values("tiny", "kimi-like", "odd-dims", "lite-plain-rope"),
                         [](const ::testing::TestParamInfo<std::string>& info) {
                           std::string s = info.param;
                           std::replace(s.begin(), s.end(), '-', '_');
                           return s;
                         });

}  // namespace
}  // namespace hmoe::engine_test
