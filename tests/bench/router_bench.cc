// hmoe_router_bench: what the router adds to a request's latency (issue #6 acceptance 5).
//
// Synthetic mode (default): this process serves a synthetic decode worker (the real
// proto/decode.proto service on a unix socket, streaming --tokens tokens --token-interval-us apart
// after --first-token-delay-us) and starts the real hmoe-router binary, which the worker registers
// with. Requests alternate between calling the worker directly and going through the router (TCP
// loopback -> router -> unix socket -> worker). The worker records when it sent each token and
// the client when it received it (one process, one monotonic clock), so the per-token streaming
// overhead is measured exactly: (receive - send) through the router minus the same directly.
// TTFT is call start -> first token received. With no compute in the worker, the differences are
// the router's own cost.
//
// Stack mode (--router-addr and --decode-socket): the same comparison against a running service
// (e.g. scripts/quickstart.sh with HMOE_KEEP_RUNNING=1, or the fault-test stack), with a real
// decode worker; only TTFT and inter-token gaps are measurable there.
//
//   build/cpu/tests/bench/hmoe_router_bench [--requests 300] [--tokens 32]
//       [--token-interval-us 2000] [--first-token-delay-us 0]
//   build/cpu/tests/bench/hmoe_router_bench --router-addr 127.0.0.1:50051
//       --decode-socket /path/run/decode.sock --prompt-tokens 16 --tokens 16

#include <stdlib.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/strip.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include <grpcpp/grpcpp.h>

#include "proto/decode.grpc.pb.h"
#include "proto/hmoe_v1.grpc.pb.h"
#include "proto/worker_registry.grpc.pb.h"
#include "tests/integration/child_process.h"

ABSL_FLAG(int, requests, 300, "requests per path (direct and through the router)");
ABSL_FLAG(int, warmup, 20, "requests per path before measuring");
ABSL_FLAG(int, tokens, 32, "tokens per request");
ABSL_FLAG(int, token_interval_us, 2000, "synthetic worker: time between tokens");
ABSL_FLAG(int, first_token_delay_us, 0, "synthetic worker: time to the first token");
ABSL_FLAG(int, prompt_tokens, 8, "prompt length (token ids)");
ABSL_FLAG(std::string, router_bin, HMOE_ROUTER_PATH, "hmoe-router to start (synthetic mode)");
ABSL_FLAG(std::string, router_addr, "", "stack mode: a running router's public address");
ABSL_FLAG(std::string, decode_socket, "", "stack mode: the decode worker's unix socket path");

namespace hmoe::router {
namespace {

namespace v1 = hmoe::v1;
namespace dv1 = hmoe::decode::v1;
namespace rv1 = hmoe::registry::v1;

int64_t NowNs() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

// Streams tokens at a fixed pace and records when each was written.
class SyntheticDecode final : public dv1::DecodeService::Service {
 public:
  grpc::Status Admit(grpc::ServerContext* ctx, const dv1::AdmitRequest* request,
                     grpc::ServerWriter<dv1::AdmitResponse>* writer) override {
    const int tokens = request->max_new_tokens();
    std::vector<int64_t> sent(tokens, 0);
    const auto interval = std::chrono::microseconds(absl::GetFlag(FLAGS_token_interval_us));
    auto next = std::chrono::steady_clock::now() +
                std::chrono::microseconds(absl::GetFlag(FLAGS_first_token_delay_us));
    dv1::AdmitResponse r;
    for (int i = 0; i < tokens && !ctx->IsCancelled(); ++i) {
      std::this_thread::sleep_until(next);
      next += interval;
      r.mutable_token()->set_token_id(i % 1000);
      r.mutable_token()->set_index(i);
      sent[i] = NowNs();
      if (!writer->Write(r)) break;
    }
    r.Clear();
    r.mutable_finished()->set_reason(dv1::FINISH_REASON_LENGTH);
    r.mutable_finished()->mutable_usage()->set_completion_tokens(tokens);
    writer->Write(r);
    absl::MutexLock lock(&mu_);
    sent_[request->request_id()] = std::move(sent);
    return grpc::Status::OK;
  }
  std::vector<int64_t> Sent(const std::string& id) ABSL_LOCKS_EXCLUDED(mu_) {
    absl::MutexLock lock(&mu_);
    return sent_[id];
  }

 private:
  absl::Mutex mu_;
  absl::flat_hash_map<std::string, std::vector<int64_t>> sent_ ABSL_GUARDED_BY(mu_);
};

// One request as the client saw it.
struct Sample {
  int64_t start_ns = 0;
  std::vector<int64_t> received_ns;
};

struct Series {
  std::vector<double> ttft_us;
  std::vector<double> gap_us;    // between consecutive tokens
  std::vector<double> token_us;  // send -> receive (synthetic mode)
};

double Percentile(std::vector<double> v, double p) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  const size_t i = std::min(v.size() - 1, static_cast<size_t>(p * static_cast<double>(v.size())));
  return v[i];
}

void Add(Series& s, const Sample& sample, const std::vector<int64_t>& sent) {
  if (sample.received_ns.empty()) return;
  s.ttft_us.push_back((sample.received_ns[0] - sample.start_ns) / 1e3);
  for (size_t i = 1; i < sample.received_ns.size(); ++i) {
    s.gap_us.push_back((sample.received_ns[i] - sample.received_ns[i - 1]) / 1e3);
  }
  for (size_t i = 0; i < sample.received_ns.size() && i < sent.size(); ++i) {
    s.token_us.push_back((sample.received_ns[i] - sent[i]) / 1e3);
  }
}

Sample Direct(dv1::DecodeService::Stub* stub, const std::string& id,
              const std::vector<int32_t>& prompt, int tokens) {
  dv1::AdmitRequest req;
  req.set_request_id(id);
  for (int32_t t : prompt) req.add_prompt_token_ids(t);
  req.set_max_new_tokens(tokens);
  req.set_ignore_eos(true);
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(120));
  Sample s;
  s.start_ns = NowNs();
  auto reader = stub->Admit(&ctx, req);
  dv1::AdmitResponse r;
  while (reader->Read(&r)) {
    if (r.has_token()) s.received_ns.push_back(NowNs());
  }
  const grpc::Status st = reader->Finish();
  if (!st.ok()) std::fprintf(stderr, "direct %s: %s\n", id.c_str(), st.error_message().c_str());
  return s;
}

Sample ThroughRouter(v1::Hmoe::Stub* stub, const std::string& id,
                     const std::vector<int32_t>& prompt, int tokens) {
  v1::GenerateRequest req;
  req.set_request_id(id);
  for (int32_t t : prompt) req.mutable_prompt_token_ids()->add_ids(t);
  req.set_max_new_tokens(tokens);
  req.set_ignore_eos(true);
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(120));
  Sample s;
  s.start_ns = NowNs();
  auto reader = stub->Generate(&ctx, req);
  v1::GenerateResponse r;
  while (reader->Read(&r)) {
    if (r.has_token()) s.received_ns.push_back(NowNs());
  }
  const grpc::Status st = reader->Finish();
  if (!st.ok()) std::fprintf(stderr, "router %s: %s\n", id.c_str(), st.error_message().c_str());
  return s;
}

void Report(const Series& direct, const Series& routed, bool synthetic) {
  auto row = [](const char* what, const std::vector<double>& d, const std::vector<double>& r) {
    const double d50 = Percentile(d, 0.5), d99 = Percentile(d, 0.99);
    const double r50 = Percentile(r, 0.5), r99 = Percentile(r, 0.99);
    std::printf("| %s | %.1f | %.1f | %.1f | %.1f | %+.1f | %+.1f | %zu |\n", what, d50, d99, r50,
                r99, r50 - d50, r99 - d99, r.size());
  };
  std::printf(
      "| µs | direct p50 | direct p99 | router p50 | router p99 | added p50 | added p99 | samples "
      "|\n| --- | --- | --- | --- | --- | --- | --- | --- |\n");
  row("TTFT", direct.ttft_us, routed.ttft_us);
  row("inter-token gap", direct.gap_us, routed.gap_us);
  if (synthetic) row("token send -> receive", direct.token_us, routed.token_us);
}

int Main() {
  const int requests = absl::GetFlag(FLAGS_requests);
  const int warmup = absl::GetFlag(FLAGS_warmup);
  const int tokens = absl::GetFlag(FLAGS_tokens);
  std::vector<int32_t> prompt;
  for (int i = 0; i < absl::GetFlag(FLAGS_prompt_tokens); ++i) prompt.push_back(3 + i * 7 % 900);
  const bool synthetic = absl::GetFlag(FLAGS_router_addr).empty();

  std::string dir, decode_socket, router_addr;
  SyntheticDecode synth;
  std::unique_ptr<grpc::Server> worker;
  std::unique_ptr<testing::ChildProcess> router;
  std::unique_ptr<rv1::WorkerRegistry::Stub> registry;
  absl::Notification stop_heartbeats;
  std::jthread heartbeats;
  if (synthetic) {
    std::string tmpl = "/tmp/hmoe-rbench.XXXXXX";
    if (::mkdtemp(tmpl.data()) == nullptr) return 1;
    dir = tmpl;
    decode_socket = dir + "/decode.sock";
    grpc::ServerBuilder b;
    b.AddListeningPort("unix:" + decode_socket, grpc::InsecureServerCredentials());
    b.RegisterService(&synth);
    worker = b.BuildAndStart();
    if (worker == nullptr) return 1;
    testing::ChildOptions o;
    o.argv = {absl::GetFlag(FLAGS_router_bin),
              "--listen=127.0.0.1:0",
              "--vocab-size=1000",
              "--context-length=8192",
              "--registry-socket=" + dir + "/run/router.sock",
              "--port-file=" + dir + "/port"};
    o.stderr_path = dir + "/router.log";
    absl::StatusOr<testing::ChildProcess> child = testing::ChildProcess::Start(std::move(o));
    if (!child.ok()) {
      std::fprintf(stderr, "start router: %s\n", child.status().ToString().c_str());
      return 1;
    }
    router = std::make_unique<testing::ChildProcess>(*std::move(child));
    int port = 0;
    for (int i = 0; i < 3000 && port == 0; ++i) {
      std::ifstream f(dir + "/port");
      std::string text((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
      if (!absl::EndsWith(text, "\n") || !absl::SimpleAtoi(absl::StripSuffix(text, "\n"), &port)) {
        port = 0;
        std::this_thread::sleep_for(std::chrono::milliseconds(10));
      }
    }
    if (port == 0) {
      std::fprintf(stderr, "router did not start: %s\n", router->ReadStderr().c_str());
      return 1;
    }
    router_addr = absl::StrCat("127.0.0.1:", port);
    registry = rv1::WorkerRegistry::NewStub(grpc::CreateChannel(
        "unix:" + dir + "/run/router.sock", grpc::InsecureChannelCredentials()));
    rv1::RegisterRequest reg;
    reg.set_worker_id("synthetic-decode");
    reg.set_kind(rv1::WORKER_KIND_DECODE);
    reg.set_endpoint("unix:" + decode_socket);
    reg.set_device("cpu");
    reg.set_pid(::getpid());
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
    rv1::RegisterResponse resp;
    if (!registry->Register(&ctx, reg, &resp).ok()) return 1;
    heartbeats = std::jthread([&] {
      while (!stop_heartbeats.WaitForNotificationWithTimeout(absl::Milliseconds(500))) {
        grpc::ClientContext hc;
        hc.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(2));
        rv1::HeartbeatRequest hb;
        hb.set_worker_id("synthetic-decode");
        rv1::HeartbeatResponse hr;
        (void)registry->Heartbeat(&hc, hb, &hr);
      }
    });
  } else {
    router_addr = absl::GetFlag(FLAGS_router_addr);
    decode_socket = absl::GetFlag(FLAGS_decode_socket);
    if (decode_socket.empty()) {
      std::fprintf(stderr, "stack mode needs --decode-socket\n");
      return 2;
    }
  }

  auto decode = dv1::DecodeService::NewStub(
      grpc::CreateChannel("unix:" + decode_socket, grpc::InsecureChannelCredentials()));
  auto hmoe =
      v1::Hmoe::NewStub(grpc::CreateChannel(router_addr, grpc::InsecureChannelCredentials()));
  Series direct, routed;
  for (int i = 0; i < warmup + requests; ++i) {
    // Alternate the order so drift in the machine's load hits both paths alike.
    const std::string d_id = absl::StrCat("d", i), r_id = absl::StrCat("r", i);
    Sample d, r;
    if (i % 2 == 0) {
      d = Direct(decode.get(), d_id, prompt, tokens);
      r = ThroughRouter(hmoe.get(), r_id, prompt, tokens);
    } else {
      r = ThroughRouter(hmoe.get(), r_id, prompt, tokens);
      d = Direct(decode.get(), d_id, prompt, tokens);
    }
    if (i < warmup) continue;
    Add(direct, d, synthetic ? synth.Sent(d_id) : std::vector<int64_t>());
    Add(routed, r, synthetic ? synth.Sent(r_id) : std::vector<int64_t>());
  }
  std::printf("%s mode: %d requests per path (after %d warm-up), %d tokens each, prompt %zu tokens",
              synthetic ? "synthetic" : "stack", requests, warmup, tokens, prompt.size());
  if (synthetic) {
    std::printf(", token interval %d us, first token delay %d us",
                absl::GetFlag(FLAGS_token_interval_us), absl::GetFlag(FLAGS_first_token_delay_us));
  }
  std::printf("\n\n");
  Report(direct, routed, synthetic);

  if (synthetic) {
    stop_heartbeats.Notify();
    heartbeats = std::jthread();
    (void)router->Terminate(std::chrono::seconds(10));
    worker->Shutdown();
    std::error_code ec;
    std::filesystem::remove_all(dir, ec);
  }
  return 0;
}

}  // namespace
}  // namespace hmoe::router

int main(int argc, char** argv) {
  std::vector<std::string> storage(argv, argv + argc);
  std::vector<char*> args;
  for (std::string& a : storage) {
    if (a.rfind("--", 0) == 0) {
      for (size_t i = 2; i < a.size() && a[i] != '='; ++i) {
        if (a[i] == '-') a[i] = '_';
      }
    }
    args.push_back(a.data());
  }
  absl::ParseCommandLine(static_cast<int>(args.size()), args.data());
  return hmoe::router::Main();
}
