// Issue #5 acceptance 1 with the real processes: S = 2 and 3 hmoe-prefill-worker processes (CPU
// device) run one prompt as a DSLP group — this test sends every rank the request the router
// would send — in both EP modes, on `tiny` and `small`, with prompt lengths that are not
// multiples of 2S. Rank 0's KV hand-off is compared with the one single-worker SLP exports for the
// same prompt (same worker binary and flags), and a real hmoe-decode-worker continues the
// sequence from the DSLP hand-off: the first token and 32 greedy tokens follow the token
// agreement rule against the FP32 reference (tests/decode_worker/decode_test_util.h).
//
// KV tolerance. Layer 0 is bit-equal (the same per-token ops on both sides); every token row of
// a later layer must be within kKvRelTolerance of the layer's RMS (max |DSLP - SLP| over the row),
// except at most MaxRoutingFlips(N) tokens: where the merged attention's other F32 summation
// order moves a router score across a near-tie, that token follows other experts from then on.
// Separate processes do not report their routing, so this test bounds the number of such tokens
// and requires each to have a routing near-tie in the FP32 reference before its first layer
// beyond the tolerance (the score-gap rule, docs/conformance.md); tests/dslp/dslp_test.cc runs
// the same comparison on rank processes that do report their routing, and verifies that every
// token beyond the tolerance is such a routing flip (docs/dslp.md "Numerics").

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <map>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include <grpcpp/grpcpp.h>
#include <gtest/gtest.h>

#include "common/kv_handoff/kv_handoff.h"
#include "proto/decode.grpc.pb.h"
#include "proto/prefill.grpc.pb.h"
#include "tests/decode_worker/decode_test_util.h"
#include "tests/dslp/kv_row_errors.h"
#include "tests/prefill_worker/handoff_test_util.h"

namespace hmoe::prefill {
namespace {

using ::hmoe::decode::testing::Agreement;
using ::hmoe::decode::testing::Evaluate;
using ::hmoe::decode::testing::ReferenceRun;
using ::hmoe::decode::testing::RunReference;
using testing::Generation;
using testing::HandOffEnv;
using testing::PrefillClient;
using testing::Process;

constexpr char kPrefillWorker[] = HMOE_PREFILL_WORKER_PATH;
constexpr char kDecodeWorker[] = HMOE_DECODE_WORKER_PATH;
constexpr double kKvRelTolerance = 0.02;  // as tests/dslp/dslp_test.cc
// The GGUF cases with Q8_K activations (the default; docs/gguf.md "Numerics of a served GGUF"):
// kKvRelTolerance is sized for the FP8 path's BF16 activations, whose rounding noise is about
// 2^-9 |x| / sqrt(3) (0.11 % of a value); Q8_K's is d / sqrt(12) with d = amax / 127 per 256
// values, about 0.64 % of the values' RMS for Gaussian-like activations (amax ~ 2.8 RMS): 5.7x.
// The summation-order differences of DSLP's merged attention flip Q8_K quants (one quantum each)
// where they flipped BF16 roundings, so the same comparison gets a 5.7x wider row tolerance
// (measured on small_gguf, N = 101: rows up to 0.057 of the layer RMS outside routing flips).
// A wrong expert, token or rank still moves a row by O(1). Routing flips happen at router
// near-ties closer than that noise, so their expected number grows by the same factor:
// MaxRoutingFlips allows 5.7x the rate there (measured: 7 of 101 tokens, rows 0.27-0.48 from
// layers 5-7).
constexpr double kQ8KNoiseRatio = 5.7;
constexpr double kKvRelToleranceQ8K = 0.02 * kQ8KNoiseRatio;
constexpr int kDecodeSteps = 32;  // greedy tokens after the first
constexpr int kMaxWorkers = 3;

int MaxRoutingFlips(int64_t tokens, bool q8k = false) {
  return 2 + static_cast<int>(static_cast<double>(tokens) / 50 * (q8k ? 5.7 : 1.0));
}

// Per preset: the model and its reference, kMaxWorkers prefill workers and a decode worker.
struct Stack {
  std::unique_ptr<HandOffEnv> env;
  std::vector<std::unique_ptr<Process>> prefill;
  std::unique_ptr<Process> decode;
};

// The stacks by preset, started on first use; stopped and their temp dirs removed after the
// last test.
std::map<std::string, std::unique_ptr<Stack>>& Stacks() {
  static auto* const stacks = new std::map<std::string, std::unique_ptr<Stack>>();
  return *stacks;
}
[[maybe_unused]] ::testing::Environment* const kStopStacks = ::testing::AddGlobalTestEnvironment(
    new ::hmoe::testing::TearDownAfterLastTest([] { Stacks().clear(); }));

Stack* GetStack(const std::string& preset) {
  std::unique_ptr<Stack>& s = Stacks()[preset];
  if (s != nullptr) return s.get();
  auto stack = std::make_unique<Stack>();
  stack->env = testing::MakeHandOffEnv(preset);
  if (stack->env == nullptr) return nullptr;
  // The GGUF cases use S = 2 only.
  const int workers = preset.ends_with("-gguf") ? 2 : kMaxWorkers;
  for (int i = 0; i < workers; ++i) {
    // A unique worker id per process of this binary (exports are hmoe-kv-<id>-*; a worker
    // removes its id's leftovers at start-up, and ctest may run binaries concurrently).
    auto p = Process::Start(*stack->env, kPrefillWorker, absl::StrCat(preset, "-prefill-", i),
                            {"--worker-id", absl::StrCat("dslpw-", ::getpid(), "-", preset, "-", i),
                             "--max-prompt-tokens", "512", "--dslp-join-timeout-seconds", "60"});
    if (p == nullptr) return nullptr;
    stack->prefill.push_back(std::move(p));
  }
  stack->decode = Process::Start(*stack->env, kDecodeWorker, preset + "-decode",
                                 {"--kv-blocks", "64", "--kv-block-tokens", "16"});
  if (stack->decode == nullptr) return nullptr;
  s = std::move(stack);
  return s.get();
}

// The F32 payload of a hand-off (a copy: the worker frees the buffer on Release).
absl::StatusOr<std::vector<float>> ReadHandOff(const HandOffEnv& env,
                                               const v1::PrefillResponse& r) {
  const ModelConfig& c = env.config;
  KvHandoffShape shape;
  shape.num_layers = static_cast<uint32_t>(c.num_hidden_layers);
  shape.kv_lora_rank = static_cast<uint32_t>(c.kv_lora_rank);
  shape.rope_dim = static_cast<uint32_t>(c.qk_rope_head_dim);
  KvHandleSpec spec;
  spec.shm_name = r.kv_handle().shm_name();
  spec.num_tokens = r.kv_handle().num_tokens();
  spec.layout_version = r.kv_handle().layout_version();
  auto source = NewShmKvImporter()->Open(spec, shape);
  if (!source.ok()) return source.status();
  const std::span<const std::byte> payload = (*source)->payload();
  std::vector<float> kv(payload.size() / sizeof(float));
  std::memcpy(kv.data(), payload.data(), kv.size() * sizeof(float));
  return kv;
}

struct Case {
  std::string preset;
  int world;
  v1::EpMode mode;
  int prompt_len;
};

std::string CaseName(const ::testing::TestParamInfo<Case>& info) {
  std::string preset = info.param.preset;  // "tiny-gguf" -> "tiny_gguf" (a test name)
  std::replace(preset.begin(), preset.end(), '-', '_');
  return absl::StrCat(preset, "_S", info.param.world, "_",
                      info.param.mode == v1::EP_MODE_STANDARD ? "standard" : "small_ep", "_N",
                      info.param.prompt_len);
}

class PrefillWorkerDslpTest : public ::testing::TestWithParam<Case> {
 protected:
  static void SetUpTestSuite() {
    // Notice a worker's GOAWAY promptly (see decode_worker_integration_test.cc).
    ::setenv("GRPC_CLIENT_CHANNEL_BACKUP_POLL_INTERVAL_MS", "50", 1);
  }
};

TEST_P(PrefillWorkerDslpTest, MatchesSingleWorkerSlpAndTheDecodeWorkerContinuesIt) {
  const Case& c = GetParam();
  ASSERT_EQ(c.prompt_len % (2 * c.world) != 0, true) << "the cases use lengths not divisible by 2S";
  Stack* stack = GetStack(c.preset);
  ASSERT_NE(stack, nullptr);
  const HandOffEnv& env = *stack->env;
  const ModelConfig& config = env.config;
  // Prompt seed 7. The agreement rule's margin tolerance does not cover the engine's own routing
  // flips (docs/decode_worker.md): with seed 5 at N = 45 on tiny, step 1 of the continuation
  // diverges by 0.63 logits although the DSLP cache is bit-identical to SLP's, i.e. single-worker
  // SLP would diverge the same way; such a prompt tests the engine, not DSLP.
  const std::vector<int32_t> prompt = testing::Prompt(c.prompt_len, 7);
  const std::string id = CaseName(::testing::TestParamInfo<Case>(c, 0));

  // Single-worker SLP on worker 0.
  PrefillClient slp_client(*stack->prefill[0]);
  v1::PrefillResponse slp;
  grpc::Status s = slp_client.Prefill(testing::PrefillRequest(id + "-slp", prompt), &slp);
  ASSERT_TRUE(s.ok()) << s.error_message();
  auto slp_kv = ReadHandOff(env, slp);
  ASSERT_TRUE(slp_kv.ok()) << slp_kv.status();
  ASSERT_TRUE(slp_client.Release(id + "-slp").ok());

  // DSLP: every rank gets the same request with its own rank, concurrently (as the router does).
  std::vector<v1::PrefillResponse> responses(c.world);
  std::vector<grpc::Status> statuses(c.world);
  {
    const std::string group = absl::StrCat("hmoe-dslp-test-", ::getpid(), "-", id);
    std::vector<std::jthread> ranks;
    for (int r = 0; r < c.world; ++r) {
      ranks.emplace_back([&, r] {
        v1::PrefillRequest req = testing::PrefillRequest(id, prompt);
        v1::DslpGroup* g = req.mutable_dslp();
        g->set_group_id(group);
        g->set_shm_group(group);
        g->set_rank(r);
        g->set_world_size(c.world);
        g->set_ep_mode(c.mode);
        PrefillClient client(*stack->prefill[r]);
        statuses[r] = client.Prefill(req, &responses[r]);
      });
    }
  }
  for (int r = 0; r < c.world; ++r) {
    ASSERT_TRUE(statuses[r].ok()) << "rank " << r << ": " << statuses[r].error_message();
  }
  for (int r = 1; r < c.world; ++r) {
    EXPECT_EQ(responses[r].first_token_id(), -1) << "rank " << r;
    EXPECT_FALSE(responses[r].has_kv_handle()) << "rank " << r;
    EXPECT_GT(responses[r].timing().dslp_local_tokens(), 0) << "rank " << r;
  }
  const v1::PrefillResponse& r0 = responses[0];
  ASSERT_TRUE(r0.has_kv_handle());
  EXPECT_EQ(r0.prompt_tokens(), c.prompt_len);
  EXPECT_GT(r0.timing().dslp_bytes_sent(), 0);

  // The KV cache against SLP's.
  auto dslp_kv = ReadHandOff(env, r0);
  ASSERT_TRUE(dslp_kv.ok()) << dslp_kv.status();
  ASSERT_EQ(dslp_kv->size(), slp_kv->size());
  const bool q8k =
      c.preset.ends_with("-gguf") && cpu::DefaultQuantActivations() == cpu::QuantActivations::kQ8K;
  const double kv_tolerance = q8k ? kKvRelToleranceQ8K : kKvRelTolerance;
  const int max_flips = MaxRoutingFlips(c.prompt_len, q8k);
  const dslp_test::KvRowSummary kv = dslp_test::SummarizeKvRows(
      *dslp_kv, *slp_kv, config.num_hidden_layers, c.prompt_len, kv_tolerance);
  std::string beyond;
  for (const dslp_test::KvRowSummary::Beyond& b : kv.beyond) {
    absl::StrAppendFormat(&beyond, " [token %d: %.3f from layer %d]", b.token, b.error, b.layer);
  }
  EXPECT_EQ(kv.layer_max[0], 0.0) << "layer 0's KV is computed by the same per-token ops";
  EXPECT_LE(static_cast<int>(kv.beyond.size()), max_flips) << beyond << kv.LayerMaxima();
  std::printf(
      "[ DSLP workers ] %s: first token %d (SLP %d); KV rows within %.2g: worst %.2e, %zu token(s) "
      "beyond (routing flips, at most %d):%s%s\n",
      id.c_str(), r0.first_token_id(), slp.first_token_id(), kv_tolerance, kv.worst_within,
      kv.beyond.size(), max_flips, beyond.c_str(), kv.LayerMaxima().c_str());

  // The decode worker continues from the DSLP hand-off; then the export is released.
  decode::v1::AdmitRequest admit = testing::HandOff(id, prompt, r0);
  admit.set_max_new_tokens(1 + kDecodeSteps);
  PrefillClient rank0(*stack->prefill[0]);
  bool released = false;
  const Generation g =
      testing::Admit(*stack->decode, admit, [&] { released = rank0.Release(id).ok(); });
  ASSERT_TRUE(g.status.ok()) << g.status.error_message();
  EXPECT_TRUE(g.kv_imported_first);
  EXPECT_TRUE(released);
  std::vector<int32_t> tokens = {r0.first_token_id()};
  tokens.insert(tokens.end(), g.tokens.begin(), g.tokens.end());
  ASSERT_EQ(tokens.size(), static_cast<size_t>(1 + kDecodeSteps));
  // One traced reference run serves the agreement rule and the score-gap rule of the KV rows.
  absl::StatusOr<ReferenceRun> run =
      RunReference(*env.reference, prompt, tokens, /*with_trace=*/true);
  ASSERT_TRUE(run.ok()) << run.status();
  const Agreement agreement = Evaluate(*run, tokens);
  EXPECT_TRUE(agreement.ok()) << agreement.detail;
  // The score-gap rule (docs/conformance.md): a token row beyond the tolerance is a routing flip
  // only if the FP32 reference has a near-tie for that token at a MoE layer before the row's
  // first layer beyond it (both sides are within the error model of the reference, so their
  // expert sets can differ only there).
  // A row without a near-tie of its own is explained by an earlier token's near-tie row at an
  // earlier layer (it attends to that token's changed KV; the change is diluted by one key's
  // attention weight, so only up to 5x the tolerance: tests/dslp/dslp_test.cc PropagationSource).
  auto has_near_tie = [&](const dslp_test::KvRowSummary::Beyond& b) {
    for (int64_t l = 0; l < b.layer; ++l) {
      if (run->trace.routing[l].empty()) continue;
      if (run->trace.routing[l][b.token].SelectionGap() < run->trace.gap_tolerance[l][b.token]) {
        return true;
      }
    }
    return false;
  };
  for (const dslp_test::KvRowSummary::Beyond& b : kv.beyond) {
    bool near_tie = has_near_tie(b);
    for (const dslp_test::KvRowSummary::Beyond& v : kv.beyond) {
      if (near_tie || b.error > 5 * kv_tolerance) break;
      near_tie = v.token < b.token && v.layer < b.layer && has_near_tie(v);
    }
    EXPECT_TRUE(near_tie) << "token " << b.token << ": KV " << b.error << " from layer " << b.layer
                          << " but the reference has no routing near-tie before that layer, nor"
                          << " an earlier token with one at an earlier layer";
  }
  std::printf("[ DSLP workers ] %s: %d tokens, %d divergent (worst margin %.3f)%s\n", id.c_str(),
              agreement.steps, agreement.divergences, agreement.worst_margin,
              agreement.detail.c_str());
}

INSTANTIATE_TEST_SUITE_P(Tiny, PrefillWorkerDslpTest,
                         ::testing::Values(Case{"tiny", 2, v1::EP_MODE_STANDARD, 45},
                                           Case{"tiny", 2, v1::EP_MODE_SMALL_EP, 45},
                                           Case{"tiny", 3, v1::EP_MODE_STANDARD, 37},
                                           Case{"tiny", 3, v1::EP_MODE_SMALL_EP, 37}),
                         CaseName);

// Issue 18 acceptance 2 (prefill half): the same on Q4_K_M GGUFs (prefill and decode workers
// reading the .gguf), against the FP32 reference on the GGUF's dequantized weights: SLP, DSLP in
// both EP modes, and the decode worker continuing.
INSTANTIATE_TEST_SUITE_P(TinyGguf, PrefillWorkerDslpTest,
                         ::testing::Values(Case{"tiny-gguf", 2, v1::EP_MODE_STANDARD, 45},
                                           Case{"tiny-gguf", 2, v1::EP_MODE_SMALL_EP, 45}),
                         CaseName);
INSTANTIATE_TEST_SUITE_P(SmallGguf, PrefillWorkerDslpTest,
                         ::testing::Values(Case{"small-gguf", 2, v1::EP_MODE_STANDARD, 101}),
                         CaseName);

INSTANTIATE_TEST_SUITE_P(Small, PrefillWorkerDslpTest,
                         ::testing::Values(Case{"small", 2, v1::EP_MODE_STANDARD, 101},
                                           Case{"small", 2, v1::EP_MODE_SMALL_EP, 101},
                                           Case{"small", 3, v1::EP_MODE_STANDARD, 101},
                                           Case{"small", 3, v1::EP_MODE_SMALL_EP, 101}),
                         CaseName);

}  // namespace
}  // namespace hmoe::prefill
