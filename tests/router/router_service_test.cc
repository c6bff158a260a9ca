// The router's public API served in-process over gRPC, against fake decode workers (a fake
// DecodeClientFactory): token streaming, validation over the wire, retry before the first token,
// worker death after tokens, Cancel, client cancellation, deadlines, overload, status and stop
// strings. Thread-heavy (gRPC server threads, the router's watcher).

#include "router/router_service.h"

#include <sys/stat.h>
#include <unistd.h>

#include <map>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include <grpcpp/grpcpp.h>

#include "common/model/tokenizer.h"
#include "common/rpc/grpc_status.h"
#include "proto/decode.grpc.pb.h"
#include "proto/hmoe_v1.grpc.pb.h"
#include "proto/prefill.grpc.pb.h"
#include "router/clock.h"
#include "router/decode_client.h"
#include "router/prefill_client.h"
#include "router/registry_service.h"
#include "router/router.h"
#include "router/worker_registry.h"
#include "tests/integration/temp_dir.h"
#include "tests/router/fake_decode_client.h"
#include "tools/tokenizer_builder.h"

#include "gtest/gtest.h"

namespace hmoe::router {
namespace {

namespace v1 = hmoe::v1;
namespace dv1 = hmoe::decode::v1;
namespace pv1 = hmoe::prefill::v1;
using testing::FakeFactory;
using testing::Script;
using testing::WorkerLog;

class RouterServiceTest : public ::testing::Test {
 protected:
  void Start(RouterOptions options = {}, const Tokenizer* tokenizer = nullptr,
             DecodeClientFactory* factory = nullptr) {
    if (options.limits.vocab_size == 0)
      options.limits = {.vocab_size = 1000, .context_length = 512};
    options.retry_wait = retry_wait_;
    options.cancel_poll = absl::Milliseconds(5);
    router_ =
        std::make_unique<Router>(options, &registry_, factory != nullptr ? factory : &factory_,
                                 prefill_factory_, tokenizer, &clock_);
    service_ = std::make_unique<RouterService>(router_.get());
    registry_service_ = std::make_unique<RegistryService>(&registry_);
    grpc::ServerBuilder builder;
    builder.RegisterService(service_.get());
    builder.RegisterService(registry_service_.get());
    server_ = builder.BuildAndStart();
    ASSERT_NE(server_, nullptr);
    channel_ = server_->InProcessChannel(grpc::ChannelArguments());
    stub_ = v1::Hmoe::NewStub(channel_);
  }
  void TearDown() override {
    if (server_ != nullptr) server_->Shutdown(absl::ToChronoTime(absl::Now() + absl::Seconds(2)));
  }

  // A directory for this test's unix sockets, created on first use and removed after the test.
  std::string TempSocketDir() {
    if (socket_dir_ == nullptr) {
      socket_dir_ = std::make_unique<::hmoe::testing::TempDir>("hmoe_router_test");
    }
    return socket_dir_->path();
  }

  void AddDecodeWorker(const std::string& id, Script script, std::string endpoint = "") {
    if (endpoint.empty()) {
      endpoint = "fake:" + id;
      factory_.Set(endpoint, std::move(script));
    }
    WorkerIdentity w;
    w.worker_id = id;
    w.kind = WorkerKind::kDecode;
    w.endpoint = endpoint;
    w.device = "cpu";
    ASSERT_TRUE(registry_.Register(w).ok());
  }

  static v1::GenerateRequest Request(int num_prompt_tokens = 4, int max_new_tokens = 16) {
    v1::GenerateRequest r;
    for (int i = 0; i < num_prompt_tokens; ++i) r.mutable_prompt_token_ids()->add_ids(10 + i);
    r.set_max_new_tokens(max_new_tokens);
    return r;
  }

  struct Result {
    grpc::Status status;
    std::vector<v1::GenerateResponse> responses;
    std::vector<int32_t> tokens() const {
      std::vector<int32_t> out;
      for (const auto& r : responses) {
        if (r.has_token()) out.push_back(r.token().token_id());
      }
      return out;
    }
    const v1::Finished* finished() const {
      return !responses.empty() && responses.back().has_finished() ? &responses.back().finished()
                                                                   : nullptr;
    }
  };

  Result Generate(const v1::GenerateRequest& request, absl::Duration timeout = absl::Seconds(20)) {
    grpc::ClientContext ctx;
    ctx.set_deadline(absl::ToChronoTime(absl::Now() + timeout));
    auto reader = stub_->Generate(&ctx, request);
    Result result;
    v1::GenerateResponse r;
    while (reader->Read(&r)) result.responses.push_back(r);
    result.status = reader->Finish();
    return result;
  }

  absl::Duration retry_wait_ = absl::Milliseconds(200);
  PrefillClientFactory* prefill_factory_ = nullptr;
  FakeClock clock_;
  WorkerRegistry registry_{&clock_, {}};
  FakeFactory factory_;
  std::unique_ptr<Router> router_;
  std::unique_ptr<RouterService> service_;
  std::unique_ptr<RegistryService> registry_service_;
  std::unique_ptr<grpc::Server> server_;
  std::shared_ptr<grpc::Channel> channel_;
  std::unique_ptr<v1::Hmoe::Stub> stub_;
  std::unique_ptr<::hmoe::testing::TempDir> socket_dir_;
};

TEST_F(RouterServiceTest, StreamsTokensThenFinished) {
  Start();
  AddDecodeWorker("d0", {.tokens = {5, 6, 7}});
  v1::GenerateRequest req = Request();
  req.set_request_id("abc");
  req.mutable_sampling()->set_temperature(0.5f);
  req.add_stop_token_ids(9);
  const Result r = Generate(req);
  ASSERT_TRUE(r.status.ok()) << r.status.error_message();
  EXPECT_EQ(r.tokens(), (std::vector<int32_t>{5, 6, 7}));
  EXPECT_EQ(r.responses.front().request_id(), "abc");
  ASSERT_NE(r.finished(), nullptr);
  EXPECT_EQ(r.finished()->reason(), v1::FINISH_REASON_LENGTH);
  EXPECT_EQ(r.finished()->usage().prompt_tokens(), 4);
  EXPECT_EQ(r.finished()->usage().completion_tokens(), 3);
  EXPECT_EQ(r.finished()->timing().path(), v1::PATH_CHUNKED);
  EXPECT_EQ(r.finished()->timing().attempts(), 1);
  ASSERT_EQ(r.finished()->timing().worker_ids_size(), 1);
  EXPECT_EQ(r.finished()->timing().worker_ids(0), "d0");

  WorkerLog& log = factory_.log("fake:d0");
  absl::MutexLock lock(&log.mu);
  ASSERT_EQ(log.admitted.size(), 1u);
  const dv1::AdmitRequest& a = log.admitted[0];
  EXPECT_EQ(a.request_id(), "abc");
  EXPECT_EQ(a.prompt_token_ids_size(), 4);
  EXPECT_EQ(a.max_new_tokens(), 16);
  EXPECT_FLOAT_EQ(a.sampling().temperature(), 0.5f);
  ASSERT_EQ(a.stop_token_ids_size(), 1);
  EXPECT_EQ(a.stop_token_ids(0), 9);
  EXPECT_NE(log.deadlines[0], absl::InfiniteFuture());  // the client's deadline is passed on
}

TEST_F(RouterServiceTest, InvalidRequestOverTheWire) {
  Start();
  AddDecodeWorker("d0", {.tokens = {1}});
  v1::GenerateRequest req = Request();
  req.mutable_sampling()->set_top_p(1.5f);
  const Result r = Generate(req);
  EXPECT_EQ(r.status.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_TRUE(absl::StartsWith(r.status.error_message(), "sampling.top_p"))
      << r.status.error_message();
  EXPECT_TRUE(r.responses.empty());
}

TEST_F(RouterServiceTest, NoDecodeWorkerIsUnavailable) {
  Start();
  const Result r = Generate(Request());
  EXPECT_EQ(r.status.error_code(), grpc::StatusCode::UNAVAILABLE) << r.status.error_message();
}

TEST_F(RouterServiceTest, SlpHintWithoutPrefillWorkersIsFailedPrecondition) {
  Start();
  AddDecodeWorker("d0", {.tokens = {1}});
  v1::GenerateRequest req = Request();
  req.set_path_hint(v1::PATH_HINT_SLP);
  const Result r = Generate(req);
  EXPECT_EQ(r.status.error_code(), grpc::StatusCode::FAILED_PRECONDITION);
}

TEST_F(RouterServiceTest, WorkerFailingBeforeFirstTokenIsRetriedElsewhere) {
  Start();
  AddDecodeWorker("d0", {.tokens = {}, .end = absl::UnavailableError("connection reset")});
  AddDecodeWorker("d1", {.tokens = {3, 4}});
  const Result r = Generate(Request());
  ASSERT_TRUE(r.status.ok()) << r.status.error_message();
  EXPECT_EQ(r.tokens(), (std::vector<int32_t>{3, 4}));
  EXPECT_EQ(r.finished()->timing().attempts(), 2);
  EXPECT_EQ(r.finished()->timing().worker_ids(0), "d1");
  EXPECT_EQ(registry_.Find("d0")->state, WorkerState::kDead);
  EXPECT_EQ(registry_.Find("d1")->state, WorkerState::kLive);
}

TEST_F(RouterServiceTest, RetryWaitsForTheWorkerToComeBack) {
  retry_wait_ = absl::Seconds(30);  // the re-registration below must land within the wait
  Start();
  AddDecodeWorker("d0", {.tokens = {}, .end = absl::UnavailableError("killed")});
  factory_.Set("fake:d0-restarted", {.tokens = {42}});
  std::jthread restarter([this] {
    // Wait until the first attempt has failed, then come back as a new process.
    while (registry_.Find("d0")->state != WorkerState::kDead) absl::SleepFor(absl::Milliseconds(1));
    WorkerIdentity w;
    w.worker_id = "d0";
    w.kind = WorkerKind::kDecode;
    w.endpoint = "fake:d0-restarted";
    w.device = "cpu";
    EXPECT_TRUE(registry_.Register(w).ok());
  });
  const Result r = Generate(Request());
  restarter.join();
  ASSERT_TRUE(r.status.ok()) << r.status.error_message();
  EXPECT_EQ(r.tokens(), (std::vector<int32_t>{42}));
  EXPECT_EQ(r.finished()->timing().attempts(), 2);
  EXPECT_EQ(registry_.Find("d0")->incarnation, 2);
}

TEST_F(RouterServiceTest, WorkerDyingAfterTokensIsUnavailableNamingTheWorker) {
  Start();
  AddDecodeWorker("d0", {.tokens = {3, 4}, .end = absl::UnavailableError("socket closed")});
  AddDecodeWorker("d1", {.tokens = {8}});
  const Result r = Generate(Request());
  EXPECT_EQ(r.status.error_code(), grpc::StatusCode::UNAVAILABLE);
  EXPECT_TRUE(absl::StrContains(r.status.error_message(), "d0")) << r.status.error_message();
  EXPECT_EQ(r.tokens(), (std::vector<int32_t>{3, 4}));
  EXPECT_EQ(r.finished(), nullptr);
  // The router keeps serving: the next request goes to the other worker.
  const Result next = Generate(Request());
  ASSERT_TRUE(next.status.ok()) << next.status.error_message();
  EXPECT_EQ(next.tokens(), (std::vector<int32_t>{8}));
}

TEST_F(RouterServiceTest, WorkerErrorCodesAreRelayed) {
  Start();
  AddDecodeWorker("d0", {.tokens = {}, .end = absl::ResourceExhaustedError("waiting queue full")});
  const Result r = Generate(Request());
  EXPECT_EQ(r.status.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED);
  EXPECT_EQ(registry_.Find("d0")->state, WorkerState::kLive);
}

TEST_F(RouterServiceTest, CancelRpcEndsStreamWithCancelled) {
  Start();
  AddDecodeWorker("d0", {.tokens = {5}, .hang = true});
  v1::GenerateRequest req = Request();
  req.set_request_id("to-cancel");
  grpc::ClientContext ctx;
  auto reader = stub_->Generate(&ctx, req);
  v1::GenerateResponse r;
  ASSERT_TRUE(reader->Read(&r));
  ASSERT_TRUE(r.has_token());

  grpc::ClientContext cancel_ctx;
  v1::CancelRequest cancel;
  cancel.set_request_id("to-cancel");
  v1::CancelResponse cancel_response;
  ASSERT_TRUE(stub_->Cancel(&cancel_ctx, cancel, &cancel_response).ok());

  ASSERT_TRUE(reader->Read(&r));
  ASSERT_TRUE(r.has_finished());
  EXPECT_EQ(r.finished().reason(), v1::FINISH_REASON_CANCELLED);
  EXPECT_FALSE(reader->Read(&r));
  EXPECT_TRUE(reader->Finish().ok());
  WorkerLog& log = factory_.log("fake:d0");
  absl::MutexLock lock(&log.mu);
  EXPECT_EQ(log.cancelled, 1);
}

TEST_F(RouterServiceTest, CancelOfUnknownRequestIsNotFound) {
  Start();
  grpc::ClientContext ctx;
  v1::CancelRequest cancel;
  cancel.set_request_id("nope");
  v1::CancelResponse response;
  EXPECT_EQ(stub_->Cancel(&ctx, cancel, &response).error_code(), grpc::StatusCode::NOT_FOUND);
}

TEST_F(RouterServiceTest, ClientCancellationCancelsTheWorkerStream) {
  Start();
  AddDecodeWorker("d0", {.tokens = {5}, .hang = true});
  grpc::ClientContext ctx;
  auto reader = stub_->Generate(&ctx, Request());
  v1::GenerateResponse r;
  ASSERT_TRUE(reader->Read(&r));
  ctx.TryCancel();
  EXPECT_EQ(reader->Finish().error_code(), grpc::StatusCode::CANCELLED);
  WorkerLog& log = factory_.log("fake:d0");
  absl::MutexLock lock(&log.mu);
  // Bounded wait for the router's watcher to notice (not a timing assertion).
  log.mu.AwaitWithTimeout(absl::Condition(
                              +[](int* c) { return *c > 0; }, &log.cancelled),
                          absl::Seconds(10));
  EXPECT_EQ(log.cancelled, 1);
}

TEST_F(RouterServiceTest, DeadlineIsHonoured) {
  Start();
  AddDecodeWorker("d0", {.tokens = {5}, .hang = true});
  const Result r = Generate(Request(), absl::Milliseconds(300));
  EXPECT_EQ(r.status.error_code(), grpc::StatusCode::DEADLINE_EXCEEDED);
}

TEST_F(RouterServiceTest, OverloadIsResourceExhausted) {
  RouterOptions options;
  options.max_inflight = 1;
  Start(options);
  AddDecodeWorker("d0", {.tokens = {5}, .hang = true});
  grpc::ClientContext ctx;
  auto reader = stub_->Generate(&ctx, Request());
  v1::GenerateResponse r;
  ASSERT_TRUE(reader->Read(&r));  // the first request is in flight

  const Result second = Generate(Request());
  EXPECT_EQ(second.status.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED);

  grpc::ClientContext status_ctx;
  v1::RouterStatus status;
  ASSERT_TRUE(stub_->GetStatus(&status_ctx, {}, &status).ok());
  EXPECT_EQ(status.inflight(), 1);
  EXPECT_EQ(status.requests_rejected(), 1);
  ctx.TryCancel();
  reader->Finish();
}

TEST_F(RouterServiceTest, StatusShowsWorkersAndTheirState) {
  Start();
  AddDecodeWorker("d0", {.tokens = {5}});
  AddDecodeWorker("d1", {.tokens = {5}});
  clock_.Advance(absl::Seconds(2));
  ASSERT_TRUE(registry_.Heartbeat("d1", {.running = 2, .batch_size = 6}).ok());
  clock_.Advance(absl::Seconds(2));  // d0 silent for 4 s > 3 s timeout
  grpc::ClientContext ctx;
  v1::RouterStatus status;
  ASSERT_TRUE(stub_->GetStatus(&ctx, {}, &status).ok());
  ASSERT_EQ(status.workers_size(), 2);
  EXPECT_EQ(status.workers(0).worker_id(), "d0");
  EXPECT_EQ(status.workers(0).state(), v1::WORKER_STATE_DEAD);
  EXPECT_EQ(status.workers(1).state(), v1::WORKER_STATE_LIVE);
  EXPECT_EQ(status.workers(1).running(), 2);
  EXPECT_EQ(status.workers(1).batch_size(), 6);
  EXPECT_EQ(status.ms_since_decode_active(), -1);
}

TEST_F(RouterServiceTest, RegistryServiceRegistersAndHeartbeats) {
  Start();
  auto stub = hmoe::registry::v1::WorkerRegistry::NewStub(channel_);
  hmoe::registry::v1::RegisterRequest reg;
  reg.set_worker_id("d9");
  reg.set_kind(hmoe::registry::v1::WORKER_KIND_DECODE);
  reg.set_endpoint("unix:/tmp/x.sock");
  reg.set_device("cpu");
  {
    grpc::ClientContext ctx;
    hmoe::registry::v1::RegisterResponse resp;
    ASSERT_TRUE(stub->Register(&ctx, reg, &resp).ok());
    EXPECT_GT(resp.heartbeat_interval_ms(), 0);
  }
  {
    grpc::ClientContext ctx;
    hmoe::registry::v1::HeartbeatRequest hb;
    hb.set_worker_id("d9");
    hb.mutable_load()->set_running(4);
    hmoe::registry::v1::HeartbeatResponse resp;
    ASSERT_TRUE(stub->Heartbeat(&ctx, hb, &resp).ok());
  }
  EXPECT_EQ(registry_.Find("d9")->load.running, 4);
  {
    grpc::ClientContext ctx;
    hmoe::registry::v1::HeartbeatRequest hb;
    hb.set_worker_id("unknown");
    hmoe::registry::v1::HeartbeatResponse resp;
    EXPECT_EQ(stub->Heartbeat(&ctx, hb, &resp).error_code(), grpc::StatusCode::NOT_FOUND);
  }
  {
    grpc::ClientContext ctx;
    reg.set_kind(hmoe::registry::v1::WORKER_KIND_UNSPECIFIED);
    hmoe::registry::v1::RegisterResponse resp;
    EXPECT_EQ(stub->Register(&ctx, reg, &resp).error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  }
}

TEST_F(RouterServiceTest, DetokenizesAndStopsAtStopString) {
  absl::StatusOr<BuiltTokenizer> built = BuildTokenizer(kMinBuiltVocabSize, 4096);
  ASSERT_TRUE(built.ok());
  absl::StatusOr<std::unique_ptr<Tokenizer>> tokenizer =
      Tokenizer::FromJson(built->tokenizer_json, built->tokenizer_config_json);
  ASSERT_TRUE(tokenizer.ok());
  RouterOptions options;
  options.limits = {.vocab_size = kMinBuiltVocabSize, .context_length = 512};
  Start(options, tokenizer->get());
  // Byte tokens: byte b is id kBuiltFirstByteId + b.
  std::vector<int32_t> ids;
  for (char c : std::string("hello END world")) ids.push_back(kBuiltFirstByteId + c);
  AddDecodeWorker("d0", {.tokens = ids});
  v1::GenerateRequest req = Request();
  req.set_detokenize(true);
  req.add_stop_strings("END");
  const Result r = Generate(req);
  ASSERT_TRUE(r.status.ok()) << r.status.error_message();
  std::string text;
  for (const auto& resp : r.responses) {
    if (resp.has_token()) text += resp.token().text();
    if (resp.has_finished()) text += resp.finished().text();
  }
  EXPECT_EQ(text, "hello ");
  ASSERT_NE(r.finished(), nullptr);
  EXPECT_EQ(r.finished()->reason(), v1::FINISH_REASON_STOP);
  EXPECT_EQ(r.finished()->stop_string(), "END");
  EXPECT_EQ(r.tokens().size(), 9u);  // "hello END": the worker stream is cut there
}

TEST_F(RouterServiceTest, TextPromptIsTokenized) {
  absl::StatusOr<BuiltTokenizer> built = BuildTokenizer(kMinBuiltVocabSize, 4096);
  ASSERT_TRUE(built.ok());
  absl::StatusOr<std::unique_ptr<Tokenizer>> tokenizer =
      Tokenizer::FromJson(built->tokenizer_json, built->tokenizer_config_json);
  ASSERT_TRUE(tokenizer.ok());
  RouterOptions options;
  options.limits = {.vocab_size = kMinBuiltVocabSize, .context_length = 512};
  Start(options, tokenizer->get());
  AddDecodeWorker("d0", {.tokens = {kBuiltFirstByteId + 'x'}});
  v1::GenerateRequest req = Request();
  req.set_prompt_text("hi");
  const Result r = Generate(req);
  ASSERT_TRUE(r.status.ok()) << r.status.error_message();
  WorkerLog& log = factory_.log("fake:d0");
  absl::MutexLock lock(&log.mu);
  ASSERT_EQ(log.admitted.size(), 1u);
  const std::vector<int32_t> expected =
      (*tokenizer)->Encode("hi", (*tokenizer)->add_bos_token(), false);
  EXPECT_EQ(std::vector<int32_t>(log.admitted[0].prompt_token_ids().begin(),
                                 log.admitted[0].prompt_token_ids().end()),
            expected);
}

// A decode worker speaking the real protocol (proto/decode.proto) on a unix socket, for the gRPC
// DecodeClient: it streams the prompt's ids back, then LENGTH.
class EchoDecodeService final : public dv1::DecodeService::Service {
 public:
  grpc::Status Admit(grpc::ServerContext*, const dv1::AdmitRequest* request,
                     grpc::ServerWriter<dv1::AdmitResponse>* writer) override {
    if (request->prompt_token_ids_size() == 0) {
      return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT, "prompt_token_ids: empty");
    }
    dv1::AdmitResponse r;
    if (request->has_kv_handle()) {
      {
        absl::MutexLock lock(&mu_);
        handles_.push_back(request->kv_handle().shm_name());
        first_tokens_.push_back(request->first_token_id());
      }
      r.mutable_kv_imported()->set_num_tokens(request->kv_handle().num_tokens());
      writer->Write(r);
      r.Clear();
    }
    for (int i = 0; i < request->prompt_token_ids_size(); ++i) {
      r.mutable_token()->set_token_id(request->prompt_token_ids(i));
      r.mutable_token()->set_index(i);
      writer->Write(r);
    }
    r.mutable_finished()->set_reason(dv1::FINISH_REASON_LENGTH);
    r.mutable_finished()->mutable_usage()->set_completion_tokens(request->prompt_token_ids_size());
    writer->Write(r);
    return grpc::Status::OK;
  }
  std::vector<std::string> handles() ABSL_LOCKS_EXCLUDED(mu_) {
    absl::MutexLock lock(&mu_);
    return handles_;
  }
  std::vector<int32_t> first_tokens() ABSL_LOCKS_EXCLUDED(mu_) {
    absl::MutexLock lock(&mu_);
    return first_tokens_;
  }

 private:
  absl::Mutex mu_;
  std::vector<std::string> handles_ ABSL_GUARDED_BY(mu_);
  std::vector<int32_t> first_tokens_ ABSL_GUARDED_BY(mu_);
};

// A prefill worker speaking the real protocol (proto/prefill.proto): the first token is the
// prompt's length, the handle names the request; Release is recorded.
class FakePrefillService final : public pv1::PrefillService::Service {
 public:
  grpc::Status Prefill(grpc::ServerContext*, const pv1::PrefillRequest* request,
                       pv1::PrefillResponse* response) override {
    if (request->has_dslp()) {
      return grpc::Status(grpc::StatusCode::UNIMPLEMENTED, "dslp: not implemented");
    }
    response->set_first_token_id(request->prompt_token_ids_size());
    response->mutable_kv_handle()->set_shm_name("kv-" + request->request_id());
    response->mutable_kv_handle()->set_num_tokens(request->prompt_token_ids_size());
    response->set_prompt_tokens(request->prompt_token_ids_size());
    return grpc::Status::OK;
  }
  grpc::Status Release(grpc::ServerContext*, const pv1::ReleaseRequest* request,
                       pv1::ReleaseResponse*) override {
    absl::MutexLock lock(&mu_);
    released_.push_back(request->request_id());
    return grpc::Status::OK;
  }
  std::vector<std::string> released() ABSL_LOCKS_EXCLUDED(mu_) {
    absl::MutexLock lock(&mu_);
    return released_;
  }

 private:
  absl::Mutex mu_;
  std::vector<std::string> released_ ABSL_GUARDED_BY(mu_);
};

TEST_F(RouterServiceTest, GrpcDecodeClientRelaysARealDecodeService) {
  const std::string socket = TempSocketDir() + "/echo.sock";
  unlink(socket.c_str());
  EchoDecodeService echo;
  grpc::ServerBuilder builder;
  builder.AddListeningPort("unix:" + socket, grpc::InsecureServerCredentials());
  builder.RegisterService(&echo);
  std::unique_ptr<grpc::Server> worker = builder.BuildAndStart();
  ASSERT_NE(worker, nullptr);
  std::unique_ptr<DecodeClientFactory> grpc_factory = NewGrpcDecodeClientFactory();
  Start({}, nullptr, grpc_factory.get());
  AddDecodeWorker("echo", {}, "unix:" + socket);
  const Result r = Generate(Request(3));
  ASSERT_TRUE(r.status.ok()) << r.status.error_message();
  EXPECT_EQ(r.tokens(), (std::vector<int32_t>{10, 11, 12}));
  ASSERT_NE(r.finished(), nullptr);
  EXPECT_EQ(r.finished()->usage().completion_tokens(), 3);
  worker->Shutdown();
  unlink(socket.c_str());
}

TEST_F(RouterServiceTest, GrpcDecodeClientToADeadWorkerIsUnavailable) {
  const std::string socket = TempSocketDir() + "/nobody.sock";
  unlink(socket.c_str());
  std::unique_ptr<DecodeClientFactory> grpc_factory = NewGrpcDecodeClientFactory();
  Start({}, nullptr, grpc_factory.get());
  AddDecodeWorker("gone", {}, "unix:" + socket);
  const Result r = Generate(Request());
  EXPECT_EQ(r.status.error_code(), grpc::StatusCode::UNAVAILABLE) << r.status.error_message();
  // The message says why the worker was given up on.
  EXPECT_TRUE(
      absl::StrContains(r.status.error_message(), "no live decode worker (after UNAVAILABLE"))
      << r.status.error_message();
  EXPECT_EQ(registry_.Find("gone")->state, WorkerState::kDead);
}

TEST_F(RouterServiceTest, GrpcPrefillClientRunsTheHandoffThroughRealServices) {
  const std::string dir = TempSocketDir();
  const std::string decode_socket = dir + "/handoff-decode.sock";
  const std::string prefill_socket = dir + "/handoff-prefill.sock";
  unlink(decode_socket.c_str());
  unlink(prefill_socket.c_str());
  EchoDecodeService decode;
  FakePrefillService prefill;
  grpc::ServerBuilder builder;
  builder.AddListeningPort("unix:" + decode_socket, grpc::InsecureServerCredentials());
  builder.RegisterService(&decode);
  std::unique_ptr<grpc::Server> decode_server = builder.BuildAndStart();
  ASSERT_NE(decode_server, nullptr);
  grpc::ServerBuilder prefill_builder;
  prefill_builder.AddListeningPort("unix:" + prefill_socket, grpc::InsecureServerCredentials());
  prefill_builder.RegisterService(&prefill);
  std::unique_ptr<grpc::Server> prefill_server = prefill_builder.BuildAndStart();
  ASSERT_NE(prefill_server, nullptr);

  std::unique_ptr<DecodeClientFactory> decode_factory = NewGrpcDecodeClientFactory();
  std::unique_ptr<PrefillClientFactory> prefill_factory = NewGrpcPrefillClientFactory();
  prefill_factory_ = prefill_factory.get();
  RouterOptions options;
  options.policy.chunk_threshold_tokens = 8;
  Start(options, nullptr, decode_factory.get());
  AddDecodeWorker("decode", {}, "unix:" + decode_socket);
  WorkerIdentity w;
  w.worker_id = "prefill";
  w.kind = WorkerKind::kPrefill;
  w.endpoint = "unix:" + prefill_socket;
  w.device = "cuda:1";
  ASSERT_TRUE(registry_.Register(w).ok());

  v1::GenerateRequest req = Request(12);
  req.set_request_id("handoff");
  const Result r = Generate(req);
  ASSERT_TRUE(r.status.ok()) << r.status.error_message();
  // The prefill worker's first token (12), then the decode worker's echo of the prompt.
  std::vector<int32_t> want = {12};
  for (int i = 0; i < 12; ++i) want.push_back(10 + i);
  EXPECT_EQ(r.tokens(), want);
  EXPECT_EQ(r.finished()->timing().path(), v1::PATH_SLP);
  EXPECT_EQ(decode.handles(), (std::vector<std::string>{"kv-handoff"}));
  EXPECT_EQ(decode.first_tokens(), (std::vector<int32_t>{12}));
  EXPECT_EQ(prefill.released(), (std::vector<std::string>{"handoff"}));

  // A prefill worker that is gone: the request is retried on the chunked path.
  prefill_server->Shutdown();
  unlink(prefill_socket.c_str());
  req.set_request_id("after");
  const Result after = Generate(req);
  ASSERT_TRUE(after.status.ok()) << after.status.error_message();
  EXPECT_EQ(after.finished()->timing().path(), v1::PATH_CHUNKED);
  EXPECT_EQ(after.finished()->timing().attempts(), 2);
  EXPECT_EQ(registry_.Find("prefill")->state, WorkerState::kDead);
  decode_server->Shutdown();
  unlink(decode_socket.c_str());
}

// A decode worker over real gRPC that rejects every request (as the real one does with a full
// waiting queue) or holds it until the call ends (cancelled or past its deadline).
class OverloadedDecodeService final : public dv1::DecodeService::Service {
 public:
  explicit OverloadedDecodeService(bool hang) : hang_(hang) {}
  grpc::Status Admit(grpc::ServerContext* context, const dv1::AdmitRequest*,
                     grpc::ServerWriter<dv1::AdmitResponse>*) override {
    if (!hang_) {
      return grpc::Status(grpc::StatusCode::RESOURCE_EXHAUSTED,
                          "waiting queue full (64 requests wait for a batch slot or KV blocks)");
    }
    while (!context->IsCancelled()) absl::SleepFor(absl::Milliseconds(5));
    return grpc::Status(grpc::StatusCode::CANCELLED, "client cancelled the call");
  }

 private:
  const bool hang_;
};

// Issue #16 findings 1 and 2 over real gRPC connections: a worker's RESOURCE_EXHAUSTED reaches the
// client as RESOURCE_EXHAUSTED, and neither a rejection nor a client's deadline marks the worker
// dead.
TEST_F(RouterServiceTest, WorkerRejectionOverGrpcIsResourceExhaustedAndTheWorkerStaysLive) {
  const std::string socket = TempSocketDir() + "/full.sock";
  unlink(socket.c_str());
  OverloadedDecodeService full(/*hang=*/false);
  grpc::ServerBuilder builder;
  builder.AddListeningPort("unix:" + socket, grpc::InsecureServerCredentials());
  builder.RegisterService(&full);
  std::unique_ptr<grpc::Server> worker = builder.BuildAndStart();
  ASSERT_NE(worker, nullptr);
  std::unique_ptr<DecodeClientFactory> grpc_factory = NewGrpcDecodeClientFactory();
  Start({}, nullptr, grpc_factory.get());
  AddDecodeWorker("full", {}, "unix:" + socket);
  for (int i = 0; i < 30; ++i) {
    const Result r = Generate(Request());
    EXPECT_EQ(r.status.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED)
        << i << ": " << r.status.error_message();
    EXPECT_TRUE(absl::StrContains(r.status.error_message(), "waiting queue full"))
        << r.status.error_message();
    ASSERT_EQ(registry_.Find("full")->state, WorkerState::kLive) << "after request " << i;
  }
  worker->Shutdown();
  unlink(socket.c_str());
}

TEST_F(RouterServiceTest, ClientDeadlinesNeverMarkTheWorkerDead) {
  const std::string socket = TempSocketDir() + "/slow.sock";
  unlink(socket.c_str());
  OverloadedDecodeService slow(/*hang=*/true);
  grpc::ServerBuilder builder;
  builder.AddListeningPort("unix:" + socket, grpc::InsecureServerCredentials());
  builder.RegisterService(&slow);
  std::unique_ptr<grpc::Server> worker = builder.BuildAndStart();
  ASSERT_NE(worker, nullptr);
  std::unique_ptr<DecodeClientFactory> grpc_factory = NewGrpcDecodeClientFactory();
  Start({}, nullptr, grpc_factory.get());
  AddDecodeWorker("slow", {}, "unix:" + socket);
  std::vector<std::jthread> clients;
  for (int ms = 1; ms <= 150; ms += 5) {
    clients.emplace_back([this, ms] {
      const Result r = Generate(Request(), absl::Milliseconds(ms));
      EXPECT_EQ(r.status.error_code(), grpc::StatusCode::DEADLINE_EXCEEDED)
          << ms << " ms: " << r.status.error_message();
    });
  }
  clients.clear();  // joins
  EXPECT_EQ(registry_.Find("slow")->state, WorkerState::kLive);
  worker->Shutdown();
  unlink(socket.c_str());
}

TEST_F(RouterServiceTest, WorkerRejectionIsTriedOnAnotherWorkerFirst) {
  Start();
  AddDecodeWorker("d0", {.tokens = {}, .end = absl::ResourceExhaustedError("waiting queue full")});
  AddDecodeWorker("d1", {.tokens = {7}});
  const Result r = Generate(Request());
  ASSERT_TRUE(r.status.ok()) << r.status.error_message();
  EXPECT_EQ(r.tokens(), (std::vector<int32_t>{7}));
  EXPECT_EQ(r.finished()->timing().worker_ids(0), "d1");
  EXPECT_EQ(registry_.Find("d0")->state, WorkerState::kLive);
  // Every worker full: RESOURCE_EXHAUSTED with the worker's reason, nobody marked dead.
  factory_.Set("fake:d1", {.tokens = {}, .end = absl::ResourceExhaustedError("kv pool full")});
  const Result full = Generate(Request());
  EXPECT_EQ(full.status.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED)
      << full.status.error_message();
  EXPECT_EQ(registry_.Find("d0")->state, WorkerState::kLive);
  EXPECT_EQ(registry_.Find("d1")->state, WorkerState::kLive);
}

// The router admits no more requests than its live decode workers advertise room for (running
// batch + waiting queue), so a burst is answered RESOURCE_EXHAUSTED by the router itself.
TEST_F(RouterServiceTest, AdmissionFollowsTheCapacityWorkersAdvertise) {
  Start();
  AddDecodeWorker("d0", {.tokens = {5}, .hang = true});
  ASSERT_TRUE(registry_.Heartbeat("d0", {.batch_size = 1, .max_waiting = 1}).ok());
  grpc::ClientContext ctx1, ctx2;
  auto first = stub_->Generate(&ctx1, Request());
  auto second = stub_->Generate(&ctx2, Request());
  v1::GenerateResponse r;
  ASSERT_TRUE(first->Read(&r));
  ASSERT_TRUE(second->Read(&r));
  const Result third = Generate(Request());
  EXPECT_EQ(third.status.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED);
  EXPECT_TRUE(absl::StrContains(third.status.error_message(), "2 requests"))
      << third.status.error_message();
  grpc::ClientContext status_ctx;
  v1::RouterStatus status;
  ASSERT_TRUE(stub_->GetStatus(&status_ctx, {}, &status).ok());
  EXPECT_EQ(status.max_inflight(), 2);
  ctx1.TryCancel();
  ctx2.TryCancel();
  first->Finish();
  second->Finish();
}

}  // namespace
}  // namespace hmoe::router
