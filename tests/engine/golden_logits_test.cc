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
//      has logits, and positions > 1,000 are reached through the KV cache), and compares with
//      the BF16 error bound kEngineRelTolerance * RMS plus the top-1 agreement rule.
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
// The engine rounds activations to BF16 before every linear layer: docs/conformance.md's error
// model gives <= 0.045 * RMS(logits) for the compared logits (measured <= 0.03); a routing flip
// can add more at the flipped token, covered by the margin rule and kEngineFlipBudget.
constexpr double kEngineRelTolerance = 0.06;
// Top-1: the engine's arg-max must be the golden one wherever the golden top-1/top-2 margin
// exceeds 2 * the tolerance (a smaller margin may legitimately swap).
constexpr double kEngineMarginFactor = 2.0;
// After a routing flip the flipped token's keys and values are in every later position's
// context: those positions get this factor on the tolerance (the engine test's 0.1 / 0.03 ratio).
constexpr double kEngineAfterFlipFactor = 2.0;
// Positions whose expert set differs from the reference's (near-ties the BF16 path resolves the
// other way; exempt here, proven near-ties by the routing test of issue 19 item 2): at most this
// share of the engine's positions (observed: 18 of 1,037 = 1.7 % on kimi-like).
constexpr double kEngineFlipBudget = 0.04;
constexpr int64_t kEngineMinFlipBudget = 3;
// RMS of the engine's top-K differences over any kWindow consecutive compared positions.
constexpr size_t kWindow = 32;
constexpr double kEngineWindowRmsTolerance = 0.02;

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

  // ---- the FP32 reference: every position (and its routing, for the engine's flips).
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
  // routing of every position is recorded to tell routing flips from errors.
  const ModelConfig& config = model->checkpoint->config();
  std::vector<std::vector<std::vector<int32_t>>> engine_routing(config.num_hidden_layers);
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
  auto flipped = [&](int64_t pos) {
    for (int64_t l = 0; l < config.num_hidden_layers; ++l) {
      if (!config.is_moe_layer(l)) continue;
      std::vector<int32_t> want = trace.routing[l][pos].experts;
      std::sort(want.begin(), want.end());
      if (static_cast<int64_t>(engine_routing[l].size()) <= pos || engine_routing[l][pos] != want) {
        return true;
      }
    }
    return false;
  };
  const int64_t block_size = 16;
  auto rig = Rig::Make(*model, options, /*num_blocks=*/n / block_size + 8, block_size);
  ASSERT_NE(rig, nullptr);
  KvSequence seq = rig->cache->NewSequence();
  const int64_t first_chunk = std::min<int64_t>(64, n / 2);
  const double tol = kEngineRelTolerance * g.rms;
  int64_t compared = 0, over = 0, top1_bad = 0, flips = 0;
  std::vector<double> sq_diffs;  // per compared position: mean square top-K difference
  double worst = 0.0, worst_full = 0.0;
  int64_t worst_pos = -1;
  bool contaminated = false;  // a flip at or before this position (its KV is in the context)
  std::vector<float> logits = rig->Run(seq, std::span<const int32_t>(g.prompt.data(), first_chunk));
  for (int64_t p = 0; p < first_chunk - 1; ++p) contaminated = contaminated || flipped(p);
  for (int64_t p = first_chunk - 1; p < n; ++p) {
    if (p >= first_chunk) {
      next_position = p;
      logits = rig->Run(seq, std::span<const int32_t>(g.prompt.data() + p, 1));
    }
    ASSERT_EQ(static_cast<int64_t>(logits.size()), vocab) << "position " << p;
    const bool flip_here = flipped(p);
    contaminated = contaminated || flip_here;
    if (flip_here) {
      ++flips;  // exempt: a different expert set (the score-gap check is the routing test's)
      continue;
    }
    const double limit = contaminated ? kEngineAfterFlipFactor * tol : tol;
    const RowCheck r =
        CheckRow(g, static_cast<size_t>(p), logits.data(), kEngineMarginFactor * limit);
    ++compared;
    if (r.max_topk_diff > worst) {
      worst = r.max_topk_diff;
      worst_pos = p;
    }
    if (r.max_topk_diff > limit) ++over;
    sq_diffs.push_back(r.sum_sq_topk_diff / static_cast<double>(g.top_k));
    EXPECT_LE(r.max_topk_diff, limit) << g.name << " engine, position " << p;
    if (!r.top1_ok) {
      ++top1_bad;
      ADD_FAILURE() << g.name << " engine top-1 at position " << p << ": golden "
                    << g.topk_ids[p][0] << " with margin "
                    << g.topk_logits[p][0] - g.topk_logits[p][1] << " > "
                    << kEngineMarginFactor * limit;
    }
    const auto full = std::find(g.full_positions.begin(), g.full_positions.end(), p);
    if (full != g.full_positions.end()) {
      const std::vector<double>& want = g.full_logits[full - g.full_positions.begin()];
      double d = 0.0;
      for (int64_t v = 0; v < vocab; ++v) d = std::max(d, std::abs(logits[v] - want[v]));
      worst_full = std::max(worst_full, d);
      EXPECT_LE(d, limit) << g.name << " engine full row, position " << p;
    }
  }
  EXPECT_LE(flips,
            std::max<int64_t>(kEngineMinFlipBudget,
                              static_cast<int64_t>(kEngineFlipBudget * (n - first_chunk + 1))))
      << g.name << ": routing flips";
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
  std::printf("golden %s: engine worst window RMS difference %.3g (window %zu; tolerance %.3g)\n",
              g.name.c_str(), worst_window, window, kEngineWindowRmsTolerance * g.rms);
  std::printf(
      "golden %s: engine vs transformers over %lld positions: max |diff| top-%lld %.3g "
      "(position %lld), full rows %.3g; tolerance %.3g (%.3g * RMS %.3g, x%.1f after a flip), "
      "%lld over, %lld top-1 disagreements, %lld routing flips exempted\n",
      g.name.c_str(), static_cast<long long>(compared), static_cast<long long>(g.top_k), worst,
      static_cast<long long>(worst_pos), worst_full, tol, kEngineRelTolerance, g.rms,
      kEngineAfterFlipFactor, static_cast<long long>(over), static_cast<long long>(top1_bad),
      static_cast<long long>(flips));
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
