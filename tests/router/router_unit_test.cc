// Unit tests of the router's pure parts: request validation, the routing policy (fake clock) and
// the worker registry (fake clock).

#include <cmath>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"

#include "common/model/tokenizer.h"
#include "common/model/tokenizer_internal.h"
#include "router/clock.h"
#include "router/policy.h"
#include "router/validation.h"
#include "router/worker_registry.h"
#include "tools/tokenizer_builder.h"

#include "gtest/gtest.h"

namespace hmoe::router {
namespace {

namespace v1 = hmoe::v1;

constexpr ModelLimits kLimits{.vocab_size = 1000, .context_length = 64, .max_request_bytes = 4096};

v1::GenerateRequest GoodRequest() {
  v1::GenerateRequest r;
  r.mutable_prompt_token_ids()->add_ids(1);
  r.mutable_prompt_token_ids()->add_ids(999);
  r.set_max_new_tokens(8);
  return r;
}

// Validation and prompt resolution together, as the router runs them.
absl::Status Check(const v1::GenerateRequest& r, const Tokenizer* tokenizer = nullptr) {
  absl::Status s = ValidateGenerateRequest(r, kLimits, tokenizer);
  if (!s.ok()) return s;
  return ResolvePrompt(r, kLimits, tokenizer).status();
}

void ExpectInvalid(const v1::GenerateRequest& r, const std::string& field,
                   const Tokenizer* tokenizer = nullptr) {
  const absl::Status s = Check(r, tokenizer);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_TRUE(absl::StartsWith(s.message(), field + ":")) << s;
}

std::unique_ptr<Tokenizer> SmallTokenizer() {
  absl::StatusOr<BuiltTokenizer> built = BuildTokenizer(kMinBuiltVocabSize, 4096);
  EXPECT_TRUE(built.ok()) << built.status();
  absl::StatusOr<std::unique_ptr<Tokenizer>> t =
      Tokenizer::FromJson(built->tokenizer_json, built->tokenizer_config_json);
  EXPECT_TRUE(t.ok()) << t.status();
  return *std::move(t);
}

TEST(ValidationTest, ListenAddresses) {
  for (const char* good : {"127.0.0.1:50051", "0.0.0.0:0", "localhost:65535", "[::1]:50051",
                           "[::]:1", "unix:/run/hmoe/router.sock"}) {
    EXPECT_TRUE(ValidateListenAddress(good).ok()) << good << ": " << ValidateListenAddress(good);
  }
  const std::vector<std::pair<std::string, std::string>> bad = {
      {"127.0.0.1:99999", "above 65535"},
      {"127.0.0.1:", "not a number"},
      {"127.0.0.1:http", "not a number"},
      {"127.0.0.1:-1", "not a number"},
      {"127.0.0.1", "no port"},
      {":50051", "no host"},
      {"::1:50051", "brackets"},
      {"[::1:50051", "brackets"},
      {"unix:relative.sock", "not absolute"},
      {"bogus", "no port"},
  };
  for (const auto& [address, why] : bad) {
    const absl::Status s = ValidateListenAddress(address);
    EXPECT_TRUE(absl::IsInvalidArgument(s)) << address << ": " << s;
    EXPECT_TRUE(absl::StrContains(s.message(), "--listen")) << s;
    EXPECT_TRUE(absl::StrContains(s.message(), why)) << address << ": " << s;
  }
}

TEST(ValidationTest, HeartbeatPeriodFollowsTheTimeoutAndMustFitTwiceInIt) {
  EXPECT_EQ(ResolveHeartbeatIntervalMs(3000, 0).value_or(-1), 1000);
  EXPECT_EQ(ResolveHeartbeatIntervalMs(9000, 0).value_or(-1), 1000);  // at most 1000 by default
  EXPECT_EQ(ResolveHeartbeatIntervalMs(1000, 0).value_or(-1), 333);
  EXPECT_EQ(ResolveHeartbeatIntervalMs(2, 0).value_or(-1), 1);
  EXPECT_EQ(ResolveHeartbeatIntervalMs(1000, 500).value_or(-1), 500);  // exactly twice is fine
  const std::vector<std::pair<std::pair<int, int>, std::string>> bad = {
      {{1000, 501}, "must be at least twice --heartbeat_interval_ms (501)"},
      {{1, 0}, "--heartbeat_timeout_ms must be >= 2"},
      {{3000, -5}, "--heartbeat_interval_ms >= 0"},
      // tests/fuzz request_validator: 2 * interval overflowed int (UBSan) and let this through.
      {{269488138, 1896878096}, "must be at least twice --heartbeat_interval_ms (1896878096)"},
      {{1000, INT32_MAX}, "must be at least twice"},
  };
  for (const auto& [flags, why] : bad) {
    const absl::StatusOr<int> r = ResolveHeartbeatIntervalMs(flags.first, flags.second);
    EXPECT_TRUE(absl::IsInvalidArgument(r.status())) << flags.first << "/" << flags.second;
    EXPECT_TRUE(absl::StrContains(r.status().message(), why)) << r.status();
  }
}

TEST(ValidationTest, GoodRequestPasses) {
  const v1::GenerateRequest r = GoodRequest();
  EXPECT_TRUE(ValidateGenerateRequest(r, kLimits, nullptr).ok());
  absl::StatusOr<std::vector<int32_t>> ids = ResolvePrompt(r, kLimits, nullptr);
  ASSERT_TRUE(ids.ok()) << ids.status();
  EXPECT_EQ(*ids, (std::vector<int32_t>{1, 999}));
}

TEST(ValidationTest, MissingPromptNamesPrompt) {
  v1::GenerateRequest r = GoodRequest();
  r.clear_prompt();
  ExpectInvalid(r, "prompt");
}

TEST(ValidationTest, EmptyTokenIdsNamesField) {
  v1::GenerateRequest r = GoodRequest();
  r.mutable_prompt_token_ids()->clear_ids();
  ExpectInvalid(r, "prompt_token_ids");
}

TEST(ValidationTest, EmptyTextNamesField) {
  v1::GenerateRequest r = GoodRequest();
  r.set_prompt_text("");
  std::unique_ptr<Tokenizer> t = SmallTokenizer();
  ExpectInvalid(r, "prompt_text", t.get());
}

TEST(ValidationTest, TextWithoutTokenizerNamesField) {
  v1::GenerateRequest r = GoodRequest();
  r.set_prompt_text("hello");
  ExpectInvalid(r, "prompt_text");
}

TEST(ValidationTest, TokenIdAtVocabSizeNamesIndex) {
  v1::GenerateRequest r = GoodRequest();
  r.mutable_prompt_token_ids()->add_ids(1000);
  ExpectInvalid(r, "prompt_token_ids[2]");
}

TEST(ValidationTest, NegativeTokenIdNamesIndex) {
  v1::GenerateRequest r = GoodRequest();
  r.mutable_prompt_token_ids()->set_ids(0, -1);
  ExpectInvalid(r, "prompt_token_ids[0]");
}

TEST(ValidationTest, PromptPlusMaxTokensOverContext) {
  v1::GenerateRequest r = GoodRequest();
  r.set_max_new_tokens(63);  // 2 + 63 > 64
  ExpectInvalid(r, "prompt_token_ids");
  r.set_max_new_tokens(62);  // exactly fits
  EXPECT_TRUE(Check(r).ok());
}

TEST(ValidationTest, MaxNewTokensBounds) {
  v1::GenerateRequest r = GoodRequest();
  r.set_max_new_tokens(0);
  ExpectInvalid(r, "max_new_tokens");
  r.set_max_new_tokens(-3);
  ExpectInvalid(r, "max_new_tokens");
  r.set_max_new_tokens(64);
  ExpectInvalid(r, "max_new_tokens");
}

TEST(ValidationTest, BadSamplingValuesNameTheField) {
  struct Case {
    std::string field;
    void (*set)(v1::SamplingParams*);
  };
  const std::vector<Case> cases = {
      {"sampling.temperature", [](v1::SamplingParams* s) { s->set_temperature(-0.5f); }},
      {"sampling.temperature", [](v1::SamplingParams* s) { s->set_temperature(NAN); }},
      {"sampling.top_k", [](v1::SamplingParams* s) { s->set_top_k(-1); }},
      {"sampling.top_p", [](v1::SamplingParams* s) { s->set_top_p(1.5f); }},
      {"sampling.top_p", [](v1::SamplingParams* s) { s->set_top_p(-0.1f); }},
      {"sampling.min_p", [](v1::SamplingParams* s) { s->set_min_p(2.0f); }},
      {"sampling.repetition_penalty",
       [](v1::SamplingParams* s) { s->set_repetition_penalty(-1.0f); }},
      {"sampling.presence_penalty",
       [](v1::SamplingParams* s) { s->set_presence_penalty(INFINITY); }},
  };
  for (const Case& c : cases) {
    v1::GenerateRequest r = GoodRequest();
    c.set(r.mutable_sampling());
    SCOPED_TRACE(c.field);
    ExpectInvalid(r, c.field);
  }
}

TEST(ValidationTest, GoodSamplingValuesPass) {
  v1::GenerateRequest r = GoodRequest();
  v1::SamplingParams* s = r.mutable_sampling();
  s->set_temperature(0.7f);
  s->set_top_k(40);
  s->set_top_p(1.0f);
  s->set_min_p(0.05f);
  s->set_repetition_penalty(1.1f);
  s->set_presence_penalty(-0.5f);
  s->set_seed(42);
  EXPECT_TRUE(Check(r).ok());
}

TEST(ValidationTest, UnknownHintNamesField) {
  v1::GenerateRequest r = GoodRequest();
  r.set_path_hint(static_cast<v1::PathHint>(17));
  ExpectInvalid(r, "path_hint");
}

TEST(ValidationTest, StopTokenOutsideVocabNamesIndex) {
  v1::GenerateRequest r = GoodRequest();
  r.add_stop_token_ids(5);
  r.add_stop_token_ids(1000);
  ExpectInvalid(r, "stop_token_ids[1]");
}

TEST(ValidationTest, StopStringsAndDetokenizeNeedTokenizer) {
  v1::GenerateRequest r = GoodRequest();
  r.add_stop_strings("\n");
  ExpectInvalid(r, "stop_strings");
  r.clear_stop_strings();
  r.set_detokenize(true);
  ExpectInvalid(r, "detokenize");
}

TEST(ValidationTest, BadRequestIdNamesField) {
  v1::GenerateRequest r = GoodRequest();
  r.set_request_id("has space");
  ExpectInvalid(r, "request_id");
  r.set_request_id(std::string(kMaxRequestIdLength + 1, 'a'));
  ExpectInvalid(r, "request_id");
  r.set_request_id("ok-id_1.2:3");
  EXPECT_TRUE(Check(r).ok());
}

TEST(ValidationTest, OversizedRequestNamesRequest) {
  v1::GenerateRequest r = GoodRequest();
  r.add_stop_strings(std::string(5000, 'x'));
  ExpectInvalid(r, "request");
}

TEST(ValidationTest, TextPromptIsEncodedWithoutParsingSpecials) {
  std::unique_ptr<Tokenizer> t = SmallTokenizer();
  v1::GenerateRequest r = GoodRequest();
  r.set_prompt_text(std::string(kEosTokenText));
  const ModelLimits limits{.vocab_size = t->vocab_size(), .context_length = 4096};
  ASSERT_TRUE(ValidateGenerateRequest(r, limits, t.get()).ok());
  absl::StatusOr<std::vector<int32_t>> ids = ResolvePrompt(r, limits, t.get());
  ASSERT_TRUE(ids.ok()) << ids.status();
  for (int32_t id : *ids) EXPECT_NE(id, kBuiltEosId);
  EXPECT_GT(ids->size(), 1u);
}

TEST(ValidationTest, TextPromptOverTheContextIsRejectedWhileEncoding) {
  std::unique_ptr<Tokenizer> t = SmallTokenizer();  // no merges: one token per byte
  const ModelLimits limits{.vocab_size = t->vocab_size(), .context_length = 64};
  const size_t bos = t->add_bos_token() ? 1 : 0;
  v1::GenerateRequest r = GoodRequest();
  r.set_max_new_tokens(8);  // room for 56 prompt tokens
  r.set_prompt_text(std::string(56 - bos, '7'));
  absl::StatusOr<std::vector<int32_t>> ids = ResolvePrompt(r, limits, t.get());
  ASSERT_TRUE(ids.ok()) << ids.status();
  EXPECT_EQ(ids->size(), 56u);
  r.set_prompt_text(std::string(57 - bos, '7'));
  EXPECT_EQ(ResolvePrompt(r, limits, t.get()).status().code(), absl::StatusCode::kInvalidArgument);
  // 1 MB of digits (issue 16): rejected without running BPE over it.
  r.set_prompt_text(std::string(1 << 20, '7'));
  ASSERT_TRUE(ValidateGenerateRequest(r, limits, t.get()).ok());
  internal::ThreadTokenizerWork() = {};
  const absl::Status s = ResolvePrompt(r, limits, t.get()).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_TRUE(absl::StrContains(s.message(), "prompt_text: prompt longer than 56 tokens")) << s;
  EXPECT_LT(internal::ThreadTokenizerWork().bpe_heap_ops, 1000u);
}

// ------------------------------------------------------------------------------------ policy

WorkerView Worker(const std::string& id, WorkerKind kind, const std::string& device,
                  int32_t running = 0) {
  WorkerView w;
  w.identity.worker_id = id;
  w.identity.kind = kind;
  w.identity.device = device;
  w.identity.endpoint = "unix:/tmp/" + id;
  w.load.running = running;
  return w;
}

class PolicyTest : public ::testing::Test {
 protected:
  PolicyInput Input(int64_t prompt_tokens, PathHintKind hint = PathHintKind::kAuto) {
    PolicyInput in;
    in.prompt_tokens = prompt_tokens;
    in.hint = hint;
    in.decode_workers = {Worker("decode", WorkerKind::kDecode, "cuda:0")};
    in.prefill_workers = {Worker("prefill0", WorkerKind::kPrefill, "cuda:0"),
                          Worker("prefill1", WorkerKind::kPrefill, "cuda:1")};
    in.now = clock_.Now();
    return in;
  }
  absl::StatusOr<RouteDecision> Decide(const PolicyInput& in) { return DecideRoute(in, options_); }

  FakeClock clock_;
  PolicyOptions options_;  // threshold 2048, window 5 min
};

TEST_F(PolicyTest, ShortPromptIsChunkedOnDecodeWorker) {
  absl::StatusOr<RouteDecision> d = Decide(Input(2047));
  ASSERT_TRUE(d.ok()) << d.status();
  EXPECT_EQ(d->path, Path::kChunked);
  EXPECT_EQ(d->decode_worker_id, "decode");
  EXPECT_TRUE(d->prefill_worker_ids.empty());
}

TEST_F(PolicyTest, LongPromptNeverDecodedIsDslpOverAllPrefillWorkers) {
  absl::StatusOr<RouteDecision> d = Decide(Input(2048));
  ASSERT_TRUE(d.ok()) << d.status();
  EXPECT_EQ(d->path, Path::kDslp);
  EXPECT_EQ(d->prefill_worker_ids, (std::vector<std::string>{"prefill0", "prefill1"}));
}

TEST_F(PolicyTest, LongPromptAfterIdleWindowIsDslp) {
  PolicyInput in = Input(5000);
  in.last_decode_active = clock_.Now();
  clock_.Advance(absl::Minutes(5));
  in.now = clock_.Now();
  absl::StatusOr<RouteDecision> d = Decide(in);
  ASSERT_TRUE(d.ok()) << d.status();
  EXPECT_EQ(d->path, Path::kDslp);
}

TEST_F(PolicyTest, LongPromptWithRecentDecodeIsSlpOffTheDecodeDevice) {
  PolicyInput in = Input(5000);
  in.last_decode_active = clock_.Now();
  clock_.Advance(absl::Minutes(5) - absl::Seconds(1));
  in.now = clock_.Now();
  absl::StatusOr<RouteDecision> d = Decide(in);
  ASSERT_TRUE(d.ok()) << d.status();
  EXPECT_EQ(d->path, Path::kSlp);
  EXPECT_EQ(d->prefill_worker_ids, (std::vector<std::string>{"prefill1"}));
}

TEST_F(PolicyTest, LongPromptWithDecodeRunningNowIsSlp) {
  PolicyInput in = Input(5000);
  in.decode_active_now = true;
  absl::StatusOr<RouteDecision> d = Decide(in);
  ASSERT_TRUE(d.ok()) << d.status();
  EXPECT_EQ(d->path, Path::kSlp);
  EXPECT_EQ(d->prefill_worker_ids, (std::vector<std::string>{"prefill1"}));
}

TEST_F(PolicyTest, LongPromptWithDecodeButOnlySharedPrefillIsChunked) {
  PolicyInput in = Input(5000);
  in.decode_active_now = true;
  in.prefill_workers = {Worker("prefill0", WorkerKind::kPrefill, "cuda:0")};
  absl::StatusOr<RouteDecision> d = Decide(in);
  ASSERT_TRUE(d.ok()) << d.status();
  EXPECT_EQ(d->path, Path::kChunked);
}

TEST_F(PolicyTest, LongPromptIdleWithOnePrefillWorkerIsSlp) {
  PolicyInput in = Input(5000);
  in.prefill_workers = {Worker("prefill0", WorkerKind::kPrefill, "cuda:0")};
  absl::StatusOr<RouteDecision> d = Decide(in);
  ASSERT_TRUE(d.ok()) << d.status();
  EXPECT_EQ(d->path, Path::kSlp);
  EXPECT_EQ(d->prefill_worker_ids, (std::vector<std::string>{"prefill0"}));
}

TEST_F(PolicyTest, LongPromptWithoutPrefillWorkersIsChunked) {
  PolicyInput in = Input(5000);
  in.prefill_workers.clear();
  absl::StatusOr<RouteDecision> d = Decide(in);
  ASSERT_TRUE(d.ok()) << d.status();
  EXPECT_EQ(d->path, Path::kChunked);
}

TEST_F(PolicyTest, NoDecodeWorkerIsUnavailable) {
  PolicyInput in = Input(10);
  in.decode_workers.clear();
  EXPECT_EQ(Decide(in).status().code(), absl::StatusCode::kUnavailable);
}

TEST_F(PolicyTest, HintsOverridePolicy) {
  absl::StatusOr<RouteDecision> d = Decide(Input(5000, PathHintKind::kChunked));
  ASSERT_TRUE(d.ok());
  EXPECT_EQ(d->path, Path::kChunked);

  d = Decide(Input(10, PathHintKind::kDslp));
  ASSERT_TRUE(d.ok());
  EXPECT_EQ(d->path, Path::kDslp);
  EXPECT_EQ(d->prefill_worker_ids.size(), 2u);

  // SLP hint on a short prompt: off-device worker first, then the shared one.
  d = Decide(Input(10, PathHintKind::kSlp));
  ASSERT_TRUE(d.ok());
  EXPECT_EQ(d->path, Path::kSlp);
  EXPECT_EQ(d->prefill_worker_ids, (std::vector<std::string>{"prefill1", "prefill0"}));
}

TEST_F(PolicyTest, InfeasibleHintsAreFailedPrecondition) {
  PolicyInput in = Input(5000, PathHintKind::kSlp);
  in.prefill_workers.clear();
  absl::Status s = Decide(in).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition) << s;
  EXPECT_TRUE(absl::StrContains(s.message(), "path_hint")) << s;

  in = Input(5000, PathHintKind::kDslp);
  in.prefill_workers.pop_back();
  s = Decide(in).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition) << s;
}

TEST_F(PolicyTest, CpuDevicesShareUnlessConfigured) {
  PolicyInput in = Input(5000);
  in.decode_active_now = true;
  in.decode_workers = {Worker("decode", WorkerKind::kDecode, "cpu")};
  in.prefill_workers = {Worker("prefill0", WorkerKind::kPrefill, "cpu")};
  absl::StatusOr<RouteDecision> d = Decide(in);
  ASSERT_TRUE(d.ok());
  EXPECT_EQ(d->path, Path::kChunked);
  options_.cpu_devices_shared = false;
  d = Decide(in);
  ASSERT_TRUE(d.ok());
  EXPECT_EQ(d->path, Path::kSlp);
  EXPECT_EQ(d->prefill_worker_ids, (std::vector<std::string>{"prefill0"}));
  // GPUs with equal names still share.
  EXPECT_TRUE(SharesDevice("cuda:0", "cuda:0", options_));
  EXPECT_FALSE(SharesDevice("cuda:0", "cuda:1", options_));
  EXPECT_FALSE(SharesDevice("cpu", "cpu", options_));
}

TEST_F(PolicyTest, WithoutDslpTheIdleCaseIsSlpOverEveryPrefillWorker) {
  PolicyInput in = Input(5000);
  in.dslp_allowed = false;
  absl::StatusOr<RouteDecision> d = Decide(in);
  ASSERT_TRUE(d.ok());
  EXPECT_EQ(d->path, Path::kSlp);
  EXPECT_EQ(d->prefill_worker_ids, (std::vector<std::string>{"prefill0", "prefill1"}));
  in.hint = PathHintKind::kDslp;
  EXPECT_EQ(Decide(in).status().code(), absl::StatusCode::kFailedPrecondition);
}

TEST_F(PolicyTest, DecodeWorkerWithLeastLoadIsPicked) {
  PolicyInput in = Input(10);
  in.decode_workers = {Worker("a", WorkerKind::kDecode, "cuda:0", 5),
                       Worker("b", WorkerKind::kDecode, "cuda:1", 2),
                       Worker("c", WorkerKind::kDecode, "cuda:2", 2)};
  absl::StatusOr<RouteDecision> d = Decide(in);
  ASSERT_TRUE(d.ok());
  EXPECT_EQ(d->decode_worker_id, "b");
}

// Prefix cache (issue 23): the worker holding the longest prefix wins while it has a free slot,
// and the uncached suffix, not the prompt, chooses chunked vs SLP/DSLP.
TEST_F(PolicyTest, TheDecodeWorkerHoldingTheLongestPrefixIsPickedWhileItHasRoom) {
  PolicyInput in = Input(500);
  in.decode_workers = {Worker("a", WorkerKind::kDecode, "cuda:0", 0),
                       Worker("b", WorkerKind::kDecode, "cuda:1", 3),
                       Worker("c", WorkerKind::kDecode, "cuda:2", 2)};
  for (WorkerView& w : in.decode_workers) w.load.batch_size = 6;
  in.cached_tokens = {{"b", 400}, {"c", 300}};
  absl::StatusOr<RouteDecision> d = Decide(in);
  ASSERT_TRUE(d.ok()) << d.status();
  EXPECT_EQ(d->decode_worker_id, "b");
  // Equal prefixes: the less loaded.
  in.cached_tokens = {{"b", 300}, {"c", 300}};
  EXPECT_EQ(Decide(in)->decode_worker_id, "c");
  // b is full (running + waiting >= batch size): the next longest with room.
  in.cached_tokens = {{"b", 400}, {"c", 300}};
  in.decode_workers[1].load.running = 5;
  in.decode_workers[1].load.waiting = 1;
  EXPECT_EQ(Decide(in)->decode_worker_id, "c");
  // No hit with room: the least loaded, as without a cache.
  in.cached_tokens = {{"b", 400}};
  EXPECT_EQ(Decide(in)->decode_worker_id, "a");
}

TEST_F(PolicyTest, TheUncachedSuffixChoosesThePath) {
  PolicyInput in = Input(5000);
  in.decode_workers[0].load.batch_size = 6;
  EXPECT_EQ(Decide(in)->path, Path::kDslp);
  in.cached_tokens = {{"decode", 4000}};  // 1000 left: chunked on the decode worker
  absl::StatusOr<RouteDecision> d = Decide(in);
  ASSERT_TRUE(d.ok()) << d.status();
  EXPECT_EQ(d->path, Path::kChunked);
  EXPECT_EQ(d->decode_worker_id, "decode");
  EXPECT_EQ(d->cached_tokens, 4000);
  // 2048 left: a prefill worker again. DSLP would recompute the 2,952 cached tokens too (each of
  // the 2 workers ~2,500 tokens), SLP prefills only the 2,048 after them.
  in.cached_tokens = {{"decode", 2952}};
  d = Decide(in);
  ASSERT_TRUE(d.ok()) << d.status();
  EXPECT_EQ(d->path, Path::kSlp);
  EXPECT_EQ(d->cached_tokens, 2952);
  // A short prefix (1,000 < (2 - 1) x 4,000 left): DSLP over both, as without a cache.
  in.cached_tokens = {{"decode", 1000}};
  EXPECT_EQ(Decide(in)->path, Path::kDslp);
  in.cached_tokens = {{"other", 4000}};  // another worker's cache does not count
  d = Decide(in);
  EXPECT_EQ(d->path, Path::kDslp);
  EXPECT_EQ(d->cached_tokens, 0);
}

// ---------------------------------------------------------------------------------- registry

WorkerIdentity Identity(const std::string& id, WorkerKind kind = WorkerKind::kDecode) {
  WorkerIdentity w;
  w.worker_id = id;
  w.kind = kind;
  w.endpoint = "unix:/tmp/" + id + ".sock";
  w.device = "cpu";
  return w;
}

class RegistryTest : public ::testing::Test {
 protected:
  FakeClock clock_;
  WorkerRegistry registry_{&clock_, {.heartbeat_timeout = absl::Seconds(3)}};
};

TEST_F(RegistryTest, RegisteredWorkerIsLive) {
  ASSERT_TRUE(registry_.Register(Identity("d0")).ok());
  ASSERT_TRUE(registry_.Register(Identity("p0", WorkerKind::kPrefill)).ok());
  EXPECT_EQ(registry_.Live(WorkerKind::kDecode).size(), 1u);
  EXPECT_EQ(registry_.Live(WorkerKind::kPrefill).size(), 1u);
  EXPECT_EQ(registry_.Snapshot().size(), 2u);
}

TEST_F(RegistryTest, RejectsEmptyIdOrEndpoint) {
  EXPECT_EQ(registry_.Register(Identity("")).status().code(), absl::StatusCode::kInvalidArgument);
  WorkerIdentity w = Identity("d0");
  w.endpoint.clear();
  EXPECT_EQ(registry_.Register(w).status().code(), absl::StatusCode::kInvalidArgument);
}

TEST_F(RegistryTest, MissingHeartbeatsMakeWorkerDeadAndHeartbeatRevives) {
  ASSERT_TRUE(registry_.Register(Identity("d0")).ok());
  clock_.Advance(absl::Seconds(2));
  ASSERT_TRUE(registry_.Heartbeat("d0", {}).ok());
  clock_.Advance(absl::Seconds(3));
  EXPECT_EQ(registry_.Find("d0")->state, WorkerState::kLive);  // exactly at the timeout
  clock_.Advance(absl::Milliseconds(1));
  EXPECT_EQ(registry_.Find("d0")->state, WorkerState::kDead);
  EXPECT_TRUE(registry_.Live(WorkerKind::kDecode).empty());
  ASSERT_TRUE(registry_.Heartbeat("d0", {}).ok());
  EXPECT_EQ(registry_.Find("d0")->state, WorkerState::kLive);
}

TEST_F(RegistryTest, ReRegisterBumpsIncarnation) {
  absl::StatusOr<int64_t> first = registry_.Register(Identity("d0"));
  ASSERT_TRUE(first.ok());
  clock_.Advance(absl::Seconds(10));
  EXPECT_EQ(registry_.Find("d0")->state, WorkerState::kDead);
  WorkerIdentity restarted = Identity("d0");
  restarted.pid = 4242;
  absl::StatusOr<int64_t> second = registry_.Register(restarted);
  ASSERT_TRUE(second.ok());
  EXPECT_EQ(*second, *first + 1);
  const std::optional<WorkerView> v = registry_.Find("d0");
  EXPECT_EQ(v->state, WorkerState::kLive);
  EXPECT_EQ(v->identity.pid, 4242);
  EXPECT_EQ(v->incarnation, *second);
}

TEST_F(RegistryTest, HeartbeatFromUnknownWorkerIsNotFound) {
  EXPECT_EQ(registry_.Heartbeat("nobody", {}).code(), absl::StatusCode::kNotFound);
}

TEST_F(RegistryTest, MarkDeadIgnoresStaleIncarnation) {
  absl::StatusOr<int64_t> first = registry_.Register(Identity("d0"));
  ASSERT_TRUE(first.ok());
  absl::StatusOr<int64_t> second = registry_.Register(Identity("d0"));
  ASSERT_TRUE(second.ok());
  registry_.MarkDead("d0", *first);
  EXPECT_EQ(registry_.Find("d0")->state, WorkerState::kLive);
  registry_.MarkDead("d0", *second);
  EXPECT_EQ(registry_.Find("d0")->state, WorkerState::kDead);
  ASSERT_TRUE(registry_.Heartbeat("d0", {}).ok());
  EXPECT_EQ(registry_.Find("d0")->state, WorkerState::kLive);
}

TEST_F(RegistryTest, DrainingWorkerIsNotLive) {
  ASSERT_TRUE(registry_.Register(Identity("d0")).ok());
  ASSERT_TRUE(registry_.Heartbeat("d0", {.draining = true, .running = 3}).ok());
  EXPECT_EQ(registry_.Find("d0")->state, WorkerState::kDraining);
  EXPECT_EQ(registry_.Find("d0")->load.running, 3);
  EXPECT_TRUE(registry_.Live(WorkerKind::kDecode).empty());
}

}  // namespace
}  // namespace hmoe::router
