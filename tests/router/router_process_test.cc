// hmoe-router and the hmoe client as real processes: the router on loopback port 0 with its
// registry on a unix socket in an owner-only directory; this test plays a decode worker (the real
// proto/decode.proto service, echoing the prompt ids) that registers through that socket. Checks
// health, status, a streamed generation through the router, a validation error's exit code and
// message, server reflection (what grpcurl uses), and a clean SIGTERM exit. Binary paths come from
// $<TARGET_FILE:...>.

#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <fstream>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "google/protobuf/descriptor.pb.h"
#include <grpcpp/generic/generic_stub.h>
#include <grpcpp/grpcpp.h>

#include "proto/decode.grpc.pb.h"
#include "proto/health.grpc.pb.h"
#include "proto/reflection.grpc.pb.h"
#include "proto/worker_registry.grpc.pb.h"
#include "tests/integration/child_process.h"
#include "tests/integration/temp_dir.h"

#include "gtest/gtest.h"

namespace hmoe::router {
namespace {

using ::hmoe::testing::ChildOptions;
using ::hmoe::testing::ChildProcess;
namespace dv1 = hmoe::decode::v1;
namespace rv1 = hmoe::registry::v1;

constexpr char kRouter[] = HMOE_ROUTER_PATH;
constexpr char kClient[] = HMOE_CLIENT_PATH;

class EchoDecodeService final : public dv1::DecodeService::Service {
 public:
  grpc::Status Admit(grpc::ServerContext*, const dv1::AdmitRequest* request,
                     grpc::ServerWriter<dv1::AdmitResponse>* writer) override {
    dv1::AdmitResponse r;
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
};

struct RunResult {
  int exit_code = -1;
  std::string out;
  std::string err;
};

class RouterProcessTest : public ::testing::Test {
 protected:
  void SetUp() override { ASSERT_FALSE(dir_.empty()); }

  RunResult Client(std::vector<std::string> args) {
    args.insert(args.begin(), kClient);
    return Run(std::move(args));
  }

  // Runs `argv` to its exit (60 s at most).
  RunResult Run(std::vector<std::string> argv) {
    static int counter = 0;
    const std::string tag = absl::StrCat(dir_, "/run", ++counter);
    ChildOptions options;
    options.argv = std::move(argv);
    options.stdout_path = tag + ".out";
    options.stderr_path = tag + ".err";
    RunResult result;
    absl::StatusOr<ChildProcess> child = ChildProcess::Start(std::move(options));
    EXPECT_TRUE(child.ok()) << child.status();
    if (!child.ok()) return result;
    absl::StatusOr<int> code = child->WaitForExit(std::chrono::seconds(60));
    EXPECT_TRUE(code.ok()) << code.status();
    result.exit_code = code.value_or(-1);
    result.out = child->ReadStdout();
    result.err = child->ReadStderr();
    return result;
  }

  // Starts hmoe-router on a free loopback port with its registry on a unix socket; returns the
  // port (0 on failure).
  int StartRouter(std::vector<std::string> flags = {}) {
    const std::string port_file = dir_ + "/port";
    registry_socket_ = dir_ + "/sockets/registry.sock";
    ChildOptions options;
    options.argv = {kRouter,
                    "--listen=127.0.0.1:0",
                    "--vocab_size=1000",
                    "--context_length=256",
                    "--port_file=" + port_file,
                    "--registry_socket=" + registry_socket_};
    options.argv.insert(options.argv.end(), flags.begin(), flags.end());
    options.stderr_path = dir_ + "/router.err";
    absl::StatusOr<ChildProcess> router = ChildProcess::Start(std::move(options));
    EXPECT_TRUE(router.ok()) << router.status();
    if (!router.ok()) return 0;
    router_ = std::make_unique<ChildProcess>(*std::move(router));
    if (!router_->WaitForOutput("SERVING", std::chrono::seconds(30), true).ok()) {
      ADD_FAILURE() << router_->ReadStderr();
      return 0;
    }
    int port = 0;
    std::ifstream(port_file) >> port;
    return port;
  }

  // The registry as a worker sees it.
  std::unique_ptr<rv1::WorkerRegistry::Stub> RegistryStub() {
    return rv1::WorkerRegistry::NewStub(
        grpc::CreateChannel("unix:" + registry_socket_, grpc::InsecureChannelCredentials()));
  }

  ::hmoe::testing::TempDir temp_dir_{"hmoe_router_process"};  // removed after the test
  const std::string dir_ = temp_dir_.path();
  std::string registry_socket_;
  std::unique_ptr<ChildProcess> router_;
};

TEST_F(RouterProcessTest, ServesHealthStatusAndGenerationThroughAFakeWorker) {
  const std::string port_file = dir_ + "/port";
  const std::string registry_socket = dir_ + "/sockets/registry.sock";
  ChildOptions options;
  options.argv = {kRouter, "--listen=127.0.0.1:0", "--vocab_size=1000", "--context_length=256",
                  "--port_file=" + port_file, "--registry_socket=" + registry_socket,
                  // This test registers once and never heartbeats: the worker must stay LIVE
                  // however long the client processes below take to start on a loaded machine.
                  "--heartbeat_timeout_ms=600000"};
  options.stderr_path = dir_ + "/router.err";
  absl::StatusOr<ChildProcess> router = ChildProcess::Start(std::move(options));
  ASSERT_TRUE(router.ok()) << router.status();
  ASSERT_TRUE(router->WaitForOutput("SERVING", std::chrono::seconds(30), true).ok())
      << router->ReadStderr();
  int port = 0;
  std::ifstream(port_file) >> port;
  ASSERT_GT(port, 0);
  const std::string addr = absl::StrCat("--addr=127.0.0.1:", port);

  struct stat st;
  ASSERT_EQ(stat((dir_ + "/sockets").c_str(), &st), 0);
  EXPECT_EQ(st.st_mode & 0777, 0700u);

  // No decode worker yet: nothing can be served (issue #16 finding 3).
  RunResult health = Client({"health", addr});
  EXPECT_EQ(health.exit_code, 1) << health.err;
  EXPECT_EQ(health.out, "NOT_SERVING\n");

  // No decode worker yet.
  RunResult r = Client({"generate", addr, "--prompt-ids", "1,2,3", "--max-new-tokens", "4"});
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_TRUE(absl::StrContains(r.err, "UNAVAILABLE: no live decode worker")) << r.err;

  // Be a decode worker: serve decode.proto on a unix socket and register.
  const std::string worker_socket = dir_ + "/sockets/echo.sock";
  EchoDecodeService echo;
  grpc::ServerBuilder builder;
  builder.AddListeningPort("unix:" + worker_socket, grpc::InsecureServerCredentials());
  builder.RegisterService(&echo);
  std::unique_ptr<grpc::Server> worker = builder.BuildAndStart();
  ASSERT_NE(worker, nullptr);
  auto registry = rv1::WorkerRegistry::NewStub(
      grpc::CreateChannel("unix:" + registry_socket, grpc::InsecureChannelCredentials()));
  rv1::RegisterRequest reg;
  reg.set_worker_id("echo-decode");
  reg.set_kind(rv1::WORKER_KIND_DECODE);
  reg.set_endpoint("unix:" + worker_socket);
  reg.set_device("cpu");
  reg.set_pid(getpid());
  grpc::ClientContext ctx;
  ctx.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(10)));
  rv1::RegisterResponse reg_response;
  ASSERT_TRUE(registry->Register(&ctx, reg, &reg_response).ok());

  health = Client({"health", addr});
  EXPECT_EQ(health.exit_code, 0) << health.err;
  EXPECT_EQ(health.out, "SERVING\n");
  health = Client({"health", addr, "--service=hmoe.v1.Hmoe"});
  EXPECT_EQ(health.exit_code, 0) << health.err;
  EXPECT_EQ(health.out, "SERVING\n");

  RunResult status = Client({"status", addr});
  EXPECT_EQ(status.exit_code, 0) << status.err;
  EXPECT_TRUE(absl::StrContains(status.out, "echo-decode")) << status.out;
  EXPECT_TRUE(absl::StrContains(status.out, "LIVE")) << status.out;

  r = Client({"generate", addr, "--prompt-ids", "7,8,9", "--max-new-tokens", "4"});
  EXPECT_EQ(r.exit_code, 0) << r.err;
  EXPECT_EQ(r.out, "7 8 9\n");
  EXPECT_TRUE(absl::StrContains(r.err, "finish LENGTH")) << r.err;
  EXPECT_TRUE(absl::StrContains(r.err, "path CHUNKED")) << r.err;

  r = Client({"generate", addr, "--prompt-ids", "7,5000", "--max-new-tokens", "4"});
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_TRUE(absl::StrContains(r.err, "INVALID_ARGUMENT: prompt_token_ids[1]")) << r.err;

  // Server reflection (what `grpcurl list` / `grpcurl describe` use): the services, and the
  // descriptor of the public API.
  namespace refl = grpc::reflection::v1alpha;
  auto reflection = refl::ServerReflection::NewStub(
      grpc::CreateChannel(absl::StrCat("127.0.0.1:", port), grpc::InsecureChannelCredentials()));
  grpc::ClientContext rctx;
  rctx.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(10)));
  auto stream = reflection->ServerReflectionInfo(&rctx);
  refl::ServerReflectionRequest list;
  list.set_list_services("");
  ASSERT_TRUE(stream->Write(list));
  refl::ServerReflectionResponse listed;
  ASSERT_TRUE(stream->Read(&listed));
  std::vector<std::string> services;
  for (const auto& svc : listed.list_services_response().service()) services.push_back(svc.name());
  EXPECT_NE(std::find(services.begin(), services.end(), "hmoe.v1.Hmoe"), services.end());
  EXPECT_NE(std::find(services.begin(), services.end(), "grpc.health.v1.Health"), services.end());
  refl::ServerReflectionRequest describe;
  describe.set_file_containing_symbol("hmoe.v1.Hmoe");
  ASSERT_TRUE(stream->Write(describe));
  refl::ServerReflectionResponse described;
  ASSERT_TRUE(stream->Read(&described));
  ASSERT_GT(described.file_descriptor_response().file_descriptor_proto_size(), 0)
      << described.DebugString();
  google::protobuf::FileDescriptorProto file;
  ASSERT_TRUE(file.ParseFromString(described.file_descriptor_response().file_descriptor_proto(0)));
  EXPECT_EQ(file.package(), "hmoe.v1");
  ASSERT_EQ(file.service_size(), 1);
  EXPECT_EQ(file.service(0).name(), "Hmoe");
  stream->WritesDone();
  EXPECT_TRUE(stream->Finish().ok());

  absl::StatusOr<int> code = router->Terminate(std::chrono::seconds(30));
  ASSERT_TRUE(code.ok()) << code.status();
  EXPECT_EQ(*code, 0) << router->ReadStderr();
  worker->Shutdown();
}

TEST_F(RouterProcessTest, HeartbeatTimeoutUnderTwoPeriodsExitsTwoNamingBothFlags) {
  // A worker beating every period arrives a period plus its RPC time after the last beat: with a
  // timeout under two periods live workers would flap to DEAD. The default period follows the
  // timeout, so the timeout alone is always fine.
  struct Case {
    std::vector<std::string> flags;
    int exit_code;
    std::string message;
  };
  const std::vector<Case> cases = {
      {{"--heartbeat_timeout_ms=1000", "--heartbeat_interval_ms=600"},
       2,
       "--heartbeat_timeout_ms (1000) must be at least twice --heartbeat_interval_ms (600)"},
      {{"--heartbeat_timeout_ms=1", "--heartbeat_interval_ms=0"},
       2,
       "--heartbeat_timeout_ms must be >= 2"},
      {{"--heartbeat_interval_ms=-5"}, 2, "--heartbeat_interval_ms >= 0"},
  };
  for (const Case& c : cases) {
    std::vector<std::string> argv = {kRouter, "--listen=127.0.0.1:0", "--vocab_size=1000",
                                     "--context_length=256",
                                     "--registry_socket=" + dir_ + "/sockets/r.sock"};
    argv.insert(argv.end(), c.flags.begin(), c.flags.end());
    const RunResult r = Run(std::move(argv));
    EXPECT_EQ(r.exit_code, c.exit_code) << c.flags[0];
    EXPECT_TRUE(absl::StrContains(r.err, c.message)) << c.flags[0] << ": " << r.err;
  }
}

namespace hv1 = grpc::health::v1;

// Issue #16 finding 3: the health of "" and "hmoe.v1.Hmoe" follows the registry: NOT_SERVING
// without a live decode worker, SERVING while one heartbeats, NOT_SERVING once its heartbeats stop
// for the timeout, SERVING again when it is back.
TEST_F(RouterProcessTest, HealthTracksTheLiveDecodeWorkers) {
  const int port = StartRouter({"--heartbeat_timeout_ms=1000"});
  ASSERT_GT(port, 0);
  auto health = hv1::Health::NewStub(
      grpc::CreateChannel(absl::StrCat("127.0.0.1:", port), grpc::InsecureChannelCredentials()));
  // The status of `service`, or the call's error code as a negative number.
  auto check = [&](const std::string& service) {
    grpc::ClientContext ctx;
    ctx.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(10)));
    hv1::HealthCheckRequest req;
    req.set_service(service);
    hv1::HealthCheckResponse resp;
    const grpc::Status s = health->Check(&ctx, req, &resp);
    return s.ok() ? static_cast<int>(resp.status()) : -static_cast<int>(s.error_code());
  };
  // Polls until both services report `want` (bounded: 60 s; the router reacts at once, the bound
  // only covers a loaded machine).
  auto await_both = [&](hv1::HealthCheckResponse::ServingStatus want) {
    const absl::Time end = absl::Now() + absl::Seconds(60);
    while (absl::Now() < end) {
      if (check("") == want && check("hmoe.v1.Hmoe") == want) return true;
      absl::SleepFor(absl::Milliseconds(20));
    }
    return false;
  };
  EXPECT_EQ(check(""), hv1::HealthCheckResponse::NOT_SERVING);
  EXPECT_EQ(check("hmoe.v1.Hmoe"), hv1::HealthCheckResponse::NOT_SERVING);
  EXPECT_EQ(check("no.such.Service"), -static_cast<int>(grpc::StatusCode::NOT_FOUND));

  auto registry = RegistryStub();
  rv1::RegisterRequest reg;
  reg.set_worker_id("decode-0");
  reg.set_kind(rv1::WORKER_KIND_DECODE);
  reg.set_endpoint("unix:" + dir_ + "/sockets/nobody.sock");
  reg.set_device("cpu");
  {
    grpc::ClientContext ctx;
    ctx.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(10)));
    rv1::RegisterResponse resp;
    ASSERT_TRUE(registry->Register(&ctx, reg, &resp).ok());
  }
  // Heartbeats every 100 ms while `beating`.
  std::atomic<bool> beating{true}, stop{false};
  std::thread heart([&] {
    while (!stop) {
      if (beating) {
        grpc::ClientContext ctx;
        ctx.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(2)));
        rv1::HeartbeatRequest hb;
        hb.set_worker_id("decode-0");
        rv1::HeartbeatResponse resp;
        (void)registry->Heartbeat(&ctx, hb, &resp);
      }
      absl::SleepFor(absl::Milliseconds(100));
    }
  });
  EXPECT_TRUE(await_both(hv1::HealthCheckResponse::SERVING));
  beating = false;  // the worker "dies": no more heartbeats
  EXPECT_TRUE(await_both(hv1::HealthCheckResponse::NOT_SERVING));
  beating = true;  // back
  EXPECT_TRUE(await_both(hv1::HealthCheckResponse::SERVING));
  stop = true;
  heart.join();

  absl::StatusOr<int> code = router_->Terminate(std::chrono::seconds(30));
  ASSERT_TRUE(code.ok()) << code.status();
  EXPECT_EQ(*code, 0) << router_->ReadStderr();
}

// Issue #16 finding 4: undecodable request bytes get INVALID_ARGUMENT with a message, not
// INTERNAL with none. Sent with a generic stub, as raw bytes.
TEST_F(RouterProcessTest, UndecodableRequestsAreInvalidArgumentWithAMessage) {
  const int port = StartRouter();
  ASSERT_GT(port, 0);
  grpc::GenericStub stub(
      grpc::CreateChannel(absl::StrCat("127.0.0.1:", port), grpc::InsecureChannelCredentials()));
  auto call = [&](const std::string& method, const std::string& bytes) {
    grpc::Slice slice(bytes);
    grpc::ByteBuffer request(&slice, 1), response;
    grpc::ClientContext ctx;
    ctx.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(10)));
    grpc::Status status;
    absl::Notification done;
    stub.UnaryCall(&ctx, method, grpc::StubOptions(), &request, &response, [&](grpc::Status s) {
      status = std::move(s);
      done.Notify();
    });
    done.WaitForNotification();
    return status;
  };
  // A field header whose length runs past the end of the message.
  const std::string truncated = std::string(
      "\x1a\x7f"
      "ab",
      4);
  // An unterminated varint.
  const std::string bad_varint = std::string("\x08\xff\xff\xff", 4);
  struct Case {
    std::string method;
    std::string bytes;
  };
  const std::vector<Case> cases = {
      // GenerateRequest.prompt_text (field 3, length-delimited) holding "\xc3\x28": not UTF-8.
      {"/hmoe.v1.Hmoe/Generate", std::string("\x1a\x02\xc3\x28", 4)},
      // CancelRequest.request_id (field 1), the same bytes.
      {"/hmoe.v1.Hmoe/Cancel", std::string("\x0a\x02\xc3\x28", 4)},
      {"/hmoe.v1.Hmoe/Generate", truncated},
      {"/hmoe.v1.Hmoe/Generate", bad_varint},
      {"/hmoe.v1.Hmoe/Cancel", truncated},
      {"/hmoe.v1.Hmoe/GetModelInfo", truncated},
      {"/hmoe.v1.Hmoe/GetStatus", bad_varint},
  };
  for (const Case& c : cases) {
    const grpc::Status s = call(c.method, c.bytes);
    EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT)
        << c.method << ": " << s.error_code() << " " << s.error_message();
    EXPECT_TRUE(absl::StrContains(s.error_message(), c.method + ": the request message could not"))
        << c.method << ": " << s.error_message();
  }
  // A well-formed request still gets its ordinary answer.
  const grpc::Status ok = call("/hmoe.v1.Hmoe/GetModelInfo", "");
  EXPECT_TRUE(ok.ok()) << ok.error_message();

  absl::StatusOr<int> code = router_->Terminate(std::chrono::seconds(30));
  ASSERT_TRUE(code.ok()) << code.status();
  EXPECT_EQ(*code, 0) << router_->ReadStderr();
}

// Issue #16 finding 5: a second router on a port in use exits non-zero saying so (gRPC's default
// SO_REUSEPORT would let both serve).
TEST_F(RouterProcessTest, ASecondRouterOnAPortInUseRefusesToStart) {
  const int port = StartRouter();
  ASSERT_GT(port, 0);
  const RunResult second =
      Run({kRouter, absl::StrCat("--listen=127.0.0.1:", port), "--vocab_size=1000",
           "--registry_socket=" + dir_ + "/sockets2/registry.sock"});
  EXPECT_EQ(second.exit_code, 1) << second.err;
  EXPECT_TRUE(absl::StrContains(second.err, absl::StrCat("cannot listen on 127.0.0.1:", port)))
      << second.err;
  EXPECT_TRUE(absl::StrContains(second.err, "in use")) << second.err;
  absl::StatusOr<int> code = router_->Terminate(std::chrono::seconds(30));
  ASSERT_TRUE(code.ok()) << code.status();
  EXPECT_EQ(*code, 0) << router_->ReadStderr();
}

}  // namespace
}  // namespace hmoe::router
