// The decode worker's process seams without a process: proto <-> scheduler translation, the
// registry client against an in-process router registry that goes down and comes back, and the
// start-up helpers (flag parsing, KV sizing). Label "threads".

#include "decode_worker/decode_service.h"

#include <sys/stat.h>
#include <unistd.h>

#include <chrono>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include <grpcpp/grpcpp.h>
#include <gtest/gtest.h>

#include "common/kv_handoff/kv_handoff.h"
#include "common/rpc/grpc_status.h"
#include "common/rpc/registry_client.h"
#include "decode_worker/startup_settings.h"
#include "proto/worker_registry.grpc.pb.h"
#include "tests/decode_worker/decode_test_util.h"

namespace hmoe::decode {
namespace {

using ::hmoe::decode::testing::ScopedTempDir;
using ::hmoe::rpc::RegistryClient;
using ::hmoe::rpc::RegistryClientOptions;
using ::hmoe::rpc::WorkerLoadReport;

// ------------------------------------------------------------------------- proto translation

KvHandoffShape Shape() {
  KvHandoffShape s;
  s.num_layers = 2;
  s.kv_lora_rank = 4;
  s.rope_dim = 2;
  return s;
}

TEST(RequestFromProtoTest, ZeroSamplingFieldsMeanOff) {
  v1::AdmitRequest p;
  p.set_request_id("a");
  p.add_prompt_token_ids(3);
  p.add_prompt_token_ids(4);
  p.set_max_new_tokens(7);
  p.add_stop_token_ids(9);
  p.set_ignore_eos(true);
  p.mutable_sampling()->set_seed(42);
  p.mutable_sampling()->set_top_k(5);
  auto importer = NewShmKvImporter();
  absl::StatusOr<GenerationRequest> r = RequestFromProto(p, *importer, Shape());
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->id, "a");
  EXPECT_EQ(r->prompt, (std::vector<int32_t>{3, 4}));
  EXPECT_FALSE(r->has_kv());
  EXPECT_EQ(r->sampling.temperature, 0.0f);
  EXPECT_EQ(r->sampling.top_p, 1.0f);
  EXPECT_EQ(r->sampling.repetition_penalty, 1.0f);
  EXPECT_EQ(r->sampling.top_k, 5);
  EXPECT_EQ(r->sampling.seed, 42u);
  EXPECT_EQ(r->sampling.max_new_tokens, 7);
  EXPECT_EQ(r->sampling.stop_token_ids, (std::vector<int32_t>{9}));
  EXPECT_TRUE(r->sampling.ignore_eos);
  EXPECT_TRUE(ValidateSamplingParams(r->sampling).ok());
}

TEST(RequestFromProtoTest, KvHandleIsOpenedAndChecked) {
  const std::string name = absl::StrCat("hmoe-test-svc-kv-", ::getpid());
  ASSERT_TRUE(KvHandoffSegment::Create(name, Shape(), 3).ok());
  auto importer = NewShmKvImporter();
  v1::AdmitRequest p;
  p.set_request_id("kv");
  p.set_max_new_tokens(2);
  p.set_first_token_id(11);
  p.mutable_kv_handle()->set_shm_name(name);
  p.mutable_kv_handle()->set_num_tokens(3);
  p.mutable_kv_handle()->set_layout_version(kKvHandoffLayoutVersion);
  absl::StatusOr<GenerationRequest> r = RequestFromProto(p, *importer, Shape());
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_TRUE(r->has_kv());
  EXPECT_EQ(r->kv_num_tokens, 3);
  EXPECT_EQ(r->first_token, 11);
  // A prompt with a KV handle must match its length.
  p.add_prompt_token_ids(1);
  absl::Status s = RequestFromProto(p, *importer, Shape()).status();
  EXPECT_TRUE(absl::IsInvalidArgument(s));
  EXPECT_NE(s.message().find("prompt_token_ids"), std::string::npos) << s;
  p.clear_prompt_token_ids();
  // No location.
  p.mutable_kv_handle()->clear_shm_name();
  s = RequestFromProto(p, *importer, Shape()).status();
  EXPECT_NE(s.message().find("kv_handle"), std::string::npos) << s;
  ASSERT_TRUE(KvHandoffSegment::Remove(name).ok());
}

// Records the handle it is asked to open.
class RecordingImporter final : public KvImporter {
 public:
  absl::StatusOr<std::unique_ptr<KvImportSource>> Open(const KvHandleSpec& handle,
                                                       const KvHandoffShape&) override {
    last = handle;
    return absl::UnavailableError("recording only");
  }
  KvHandleSpec last;
};

TEST(RequestFromProtoTest, CudaIpcHandleReachesTheImporterWithItsGpu) {
  v1::AdmitRequest p;
  p.set_request_id("gpu");
  p.set_max_new_tokens(2);
  p.mutable_kv_handle()->set_cuda_ipc_handle(std::string(64, 'h'));
  p.mutable_kv_handle()->set_cuda_device("0000:65:00.0");
  p.mutable_kv_handle()->set_num_tokens(5);
  p.mutable_kv_handle()->set_layout_version(kKvHandoffLayoutVersion);
  RecordingImporter importer;
  EXPECT_TRUE(absl::IsUnavailable(RequestFromProto(p, importer, Shape()).status()));
  EXPECT_EQ(importer.last.kind, KvHandleSpec::Kind::kCudaIpc);
  EXPECT_EQ(importer.last.cuda_ipc_handle, std::string(64, 'h'));
  EXPECT_EQ(importer.last.cuda_device, "0000:65:00.0");
  EXPECT_EQ(importer.last.num_tokens, 5);
  EXPECT_EQ(importer.last.layout_version, kKvHandoffLayoutVersion);
}

TEST(EventToProtoTest, EveryEventKind) {
  v1::AdmitResponse t = EventToProto(TokenEvent{17, 3, 1000, 250});
  ASSERT_TRUE(t.has_token());
  EXPECT_EQ(t.token().token_id(), 17);
  EXPECT_EQ(t.token().index(), 3);
  EXPECT_EQ(t.token().step_us(), 250);
  v1::AdmitResponse k = EventToProto(KvImportedEvent{40, 12});
  ASSERT_TRUE(k.has_kv_imported());
  EXPECT_EQ(k.kv_imported().num_tokens(), 40);
  FinishEvent f;
  f.reason = FinishReason::kError;
  f.error = absl::InternalError("boom");
  f.completion_tokens = 5;
  v1::AdmitResponse e = EventToProto(f);
  ASSERT_TRUE(e.has_finished());
  EXPECT_EQ(e.finished().reason(), v1::FINISH_REASON_ERROR);
  EXPECT_EQ(e.finished().error_message(), "boom");
  EXPECT_EQ(e.finished().usage().completion_tokens(), 5);
  EXPECT_EQ(rpc::ToGrpcStatus(absl::ResourceExhaustedError("x")).error_code(),
            grpc::StatusCode::RESOURCE_EXHAUSTED);
  EXPECT_TRUE(absl::IsInvalidArgument(
      rpc::FromGrpcStatus(grpc::Status(grpc::StatusCode::INVALID_ARGUMENT, "y"))));
}

// ------------------------------------------------------------------------- registry client

// The router side: counts registrations and heartbeats; a heartbeat from an unknown worker is
// NOT_FOUND (as after a router restart).
class FakeRegistry final : public registry::v1::WorkerRegistry::Service {
 public:
  grpc::Status Register(grpc::ServerContext*, const registry::v1::RegisterRequest* req,
                        registry::v1::RegisterResponse* resp) override {
    absl::MutexLock lock(&mu_);
    ++registers_;
    last_ = *req;
    known_ = true;
    resp->set_heartbeat_interval_ms(20);
    return grpc::Status::OK;
  }
  grpc::Status Heartbeat(grpc::ServerContext*, const registry::v1::HeartbeatRequest* req,
                         registry::v1::HeartbeatResponse*) override {
    absl::MutexLock lock(&mu_);
    if (!known_ || req->worker_id() != last_.worker_id()) {
      return grpc::Status(grpc::StatusCode::NOT_FOUND, "unknown worker");
    }
    ++heartbeats_;
    last_load_ = req->load();
    return grpc::Status::OK;
  }
  void Forget() {
    absl::MutexLock lock(&mu_);
    known_ = false;
  }
  int registers() {
    absl::MutexLock lock(&mu_);
    return registers_;
  }
  int heartbeats() {
    absl::MutexLock lock(&mu_);
    return heartbeats_;
  }
  registry::v1::RegisterRequest last() {
    absl::MutexLock lock(&mu_);
    return last_;
  }
  registry::v1::WorkerLoad last_load() {
    absl::MutexLock lock(&mu_);
    return last_load_;
  }

 private:
  absl::Mutex mu_;
  int registers_ ABSL_GUARDED_BY(mu_) = 0;
  int heartbeats_ ABSL_GUARDED_BY(mu_) = 0;
  bool known_ ABSL_GUARDED_BY(mu_) = false;
  registry::v1::RegisterRequest last_ ABSL_GUARDED_BY(mu_);
  registry::v1::WorkerLoad last_load_ ABSL_GUARDED_BY(mu_);
};

std::unique_ptr<grpc::Server> Serve(FakeRegistry& registry, const std::string& socket) {
  grpc::ServerBuilder builder;
  builder.AddListeningPort("unix:" + socket, grpc::InsecureServerCredentials());
  builder.RegisterService(&registry);
  return builder.BuildAndStart();
}

// Polls `cond` for up to 20 s.
template <typename F>
bool Eventually(F cond) {
  const absl::Time deadline = absl::Now() + absl::Seconds(20);
  while (absl::Now() < deadline) {
    if (cond()) return true;
    absl::SleepFor(absl::Milliseconds(5));
  }
  return false;
}

TEST(RegistryClientTest, RetriesUntilTheRouterComesUpAndReRegistersAfterItForgets) {
  ScopedTempDir dir;
  const std::string socket = dir.File("router.sock");
  RegistryClientOptions o;
  o.router_target = "unix:" + socket;
  o.worker_id = "w1";
  o.endpoint = "unix:/x.sock";
  o.device = "cpu";
  o.pid = 1234;
  o.initial_backoff = absl::Milliseconds(10);
  o.max_backoff = absl::Milliseconds(50);
  o.rpc_timeout = absl::Seconds(10);  // one slow heartbeat under TSan must not unregister it
  RegistryClient client(o, [] {
    WorkerLoadReport r;
    r.running = 3;
    r.kv_blocks_total = 10;
    return r;
  });
  // No router yet: the client keeps trying without registering.
  EXPECT_TRUE(Eventually([&] { return client.register_attempts() >= 3; }));
  EXPECT_FALSE(client.registered());

  FakeRegistry registry;
  std::unique_ptr<grpc::Server> server = Serve(registry, socket);
  ASSERT_NE(server, nullptr);
  EXPECT_TRUE(Eventually([&] { return registry.heartbeats() >= 3; }));
  EXPECT_TRUE(client.registered());
  EXPECT_EQ(registry.last().worker_id(), "w1");
  EXPECT_EQ(registry.last().kind(), registry::v1::WORKER_KIND_DECODE);
  EXPECT_EQ(registry.last().pid(), 1234);
  EXPECT_EQ(registry.last_load().running(), 3);
  EXPECT_EQ(registry.last_load().kv_blocks_total(), 10);

  // The router restarts and no longer knows the worker: heartbeats get NOT_FOUND, the client
  // registers again.
  const int before = registry.registers();
  registry.Forget();
  EXPECT_TRUE(Eventually([&] { return registry.registers() > before; }));
  EXPECT_TRUE(Eventually([&] { return client.registered(); }));
  client.Stop();
  server->Shutdown();
}

TEST(RegistryClientTest, StopReturnsPromptlyWhileTheRouterIsDown) {
  ScopedTempDir dir;
  RegistryClientOptions o;
  o.router_target = "unix:" + dir.File("nobody.sock");
  o.worker_id = "w2";
  o.initial_backoff = absl::Milliseconds(10);
  o.max_backoff = absl::Seconds(30);  // Stop must not wait for a backoff sleep
  RegistryClient client(o, [] { return WorkerLoadReport(); });
  EXPECT_TRUE(Eventually([&] { return client.register_attempts() >= 2; }));
  client.Stop();
  EXPECT_FALSE(client.registered());
}

// ------------------------------------------------------------------------- start-up helpers

TEST(WorkerSetupTest, DeviceAndOnOffFlags) {
  EXPECT_EQ(ParseDeviceFlag("cpu")->kind, DeviceKind::kCpu);
  absl::StatusOr<DeviceSpec> cuda = ParseDeviceFlag("cuda:1");
  ASSERT_TRUE(cuda.ok());
  EXPECT_EQ(cuda->kind, DeviceKind::kCuda);
  EXPECT_EQ(cuda->ordinal, 1);
  for (const char* bad : {"gpu", "cuda", "cuda:", "cuda:-1", "cuda:x", ""}) {
    absl::Status s = ParseDeviceFlag(bad).status();
    EXPECT_TRUE(absl::IsInvalidArgument(s)) << bad;
    EXPECT_NE(s.message().find("--device"), std::string::npos);
  }
  EXPECT_TRUE(*ParseOnOff("dual-batch", "on"));
  EXPECT_FALSE(*ParseOnOff("dual-batch", "off"));
  EXPECT_TRUE(absl::IsInvalidArgument(ParseOnOff("dual-batch", "maybe").status()));
  // auto: overlap only with a GPU attention device.
  EXPECT_FALSE(*ResolveDualBatch("auto", DeviceKind::kCpu));
  EXPECT_TRUE(*ResolveDualBatch("auto", DeviceKind::kCuda));
  EXPECT_TRUE(*ResolveDualBatch("on", DeviceKind::kCpu));
  EXPECT_FALSE(*ResolveDualBatch("off", DeviceKind::kCuda));
  absl::Status bad = ResolveDualBatch("maybe", DeviceKind::kCpu).status();
  EXPECT_TRUE(absl::IsInvalidArgument(bad));
  EXPECT_NE(bad.message().find("--dual-batch"), std::string::npos) << bad;
}

TEST(WorkerSetupTest, KvBlocksFromCountOrMemory) {
  EXPECT_EQ(*ResolveKvBlocks(10, 0, 1000), 10);
  EXPECT_EQ(*ResolveKvBlocks(0, 1, 1000), (1 << 20) / 1000);
  EXPECT_TRUE(absl::IsInvalidArgument(ResolveKvBlocks(10, 1, 1000).status()));
  EXPECT_TRUE(absl::IsInvalidArgument(ResolveKvBlocks(0, 0, 1000).status()));
  EXPECT_TRUE(absl::IsInvalidArgument(ResolveKvBlocks(0, 1, size_t{2} << 20).status()));
  EXPECT_TRUE(absl::IsInvalidArgument(ResolveKvBlocks(-1, 0, 1000).status()));
}

}  // namespace
}  // namespace hmoe::decode
