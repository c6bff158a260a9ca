// hmoe-router: the public gRPC API (proto/hmoe_v1.proto) in front of the workers, plus the worker
// registry (proto/worker_registry.proto). Wiring only: the logic lives in hmoe_router_lib.
// See docs/api.md.

#include <malloc.h>
#include <signal.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <condition_variable>
#include <cstring>
#include <memory>
#include <mutex>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include <grpcpp/ext/proto_server_reflection_plugin.h>
#include <grpcpp/grpcpp.h>

#include "common/base/flags.h"
#include "common/base/logging.h"
#include "common/base/unix_socket.h"
#include "common/model/model_config.h"
#include "common/model/tokenizer.h"
#include "router/clock.h"
#include "router/decode_client.h"
#include "router/health_service.h"
#include "router/parse_error_interceptor.h"
#include "router/prefill_client.h"
#include "router/registry_service.h"
#include "router/router.h"
#include "router/router_service.h"
#include "router/validation.h"
#include "router/worker_registry.h"

ABSL_FLAG(std::string, listen, "127.0.0.1:50051",
          "public gRPC address (host:port; port 0 picks one)");
ABSL_FLAG(std::string, registry_socket, "",
          "unix socket for the worker registry (its directory is created 0700); empty: serve the "
          "registry on --listen too");
ABSL_FLAG(std::string, model, "", "checkpoint directory: config.json limits and the tokenizer");
ABSL_FLAG(int, vocab_size, 0, "vocabulary size without --model");
ABSL_FLAG(int, context_length, 0, "context length without --model (0: unchecked)");
ABSL_FLAG(int, chunk_threshold, 2048, "prompts with fewer tokens take chunked prefill");
ABSL_FLAG(int, decode_idle_window_s, 300, "DSLP only when decode was idle this long");
ABSL_FLAG(int, max_inflight, 256,
          "requests in flight; RESOURCE_EXHAUSTED beyond (or beyond the room the live decode "
          "workers advertise, when less)");
ABSL_FLAG(int, max_prefill_queue, 64,
          "long prompts waiting for a prefill worker; RESOURCE_EXHAUSTED beyond");
ABSL_FLAG(bool, cpu_devices_shared, true,
          "workers on \"cpu\" devices compete for one device (off: CPU prefill workers count as "
          "not sharing the decode worker's device, so SLP runs next to decode)");
ABSL_FLAG(std::string, dslp_ep_mode, "default",
          "DSLP expert parallelism: default, standard, small_ep");
ABSL_FLAG(int, max_request_bytes, 4 << 20, "largest accepted request message");
ABSL_FLAG(int, heartbeat_interval_ms, 0,
          "heartbeat period the router asks workers for; 0: a third of --heartbeat_timeout_ms "
          "(at most 1000); the timeout must be at least twice the period");
ABSL_FLAG(int, heartbeat_timeout_ms, 3000, "a worker silent this long is dead");
ABSL_FLAG(int, retry_wait_ms, 5000, "how long a retried request waits for a live decode worker");
ABSL_FLAG(int, max_dispatch_attempts, 3,
          "dispatches of a request that has streamed no token yet (the first plus retries after a "
          "worker failed); 1: no retries");
ABSL_FLAG(int, dslp_failure_grace_ms, 2000,
          "when a DSLP rank reports a broken group, how long the other ranks may take to report");
ABSL_FLAG(double, drain_seconds, 30, "on SIGTERM, how long in-flight requests may finish");
ABSL_FLAG(std::string, port_file, "", "write the bound public port here (tests)");

namespace {

using hmoe::router::Router;

// The socket's directory must be ours alone: create it 0700, or refuse a looser existing one.
bool PrepareSocketDir(const std::string& socket_path) {
  const size_t slash = socket_path.rfind('/');
  if (slash == std::string::npos || slash == 0) {
    HMOE_LOG(ERROR) << "--registry_socket must be an absolute path in a private directory";
    return false;
  }
  const std::string dir = socket_path.substr(0, slash);
  if (mkdir(dir.c_str(), 0700) != 0 && errno != EEXIST) {
    HMOE_LOG(ERROR) << "mkdir " << dir << ": " << std::strerror(errno);
    return false;
  }
  struct stat st;
  if (stat(dir.c_str(), &st) != 0 || st.st_uid != geteuid() || (st.st_mode & 077) != 0) {
    HMOE_LOG(ERROR) << "socket directory " << dir << " must be owned by us with mode 0700";
    return false;
  }
  // A stale socket is removed; one a running router accepts on is refused.
  if (absl::Status s = hmoe::ClaimUnixSocketPath(socket_path, "--registry-socket"); !s.ok()) {
    HMOE_LOG(ERROR) << s.message();
    return false;
  }
  return true;
}

}  // namespace

int main(int argc, char** argv) {
  hmoe::SetUsage("hmoe-router --listen 127.0.0.1:50051 --model DIR");
  std::vector<std::string> storage;
  std::vector<char*> args = hmoe::NormalizeFlagNames(argc, argv, storage);
  absl::ParseCommandLine(static_cast<int>(args.size()), args.data());

  if (absl::Status s = hmoe::router::ValidateListenAddress(absl::GetFlag(FLAGS_listen)); !s.ok()) {
    HMOE_LOG(ERROR) << s.message();
    return 2;
  }
  // A unix --listen path a running router accepts on is refused (gRPC would unlink it and bind).
  if (const std::string listen = absl::GetFlag(FLAGS_listen); absl::StartsWith(listen, "unix:")) {
    if (absl::Status s = hmoe::ClaimUnixSocketPath(listen.substr(5), "--listen"); !s.ok()) {
      HMOE_LOG(ERROR) << s.message();
      return absl::IsInvalidArgument(s) ? 2 : 1;
    }
  }
  hmoe::router::RouterOptions options;
  std::unique_ptr<hmoe::Tokenizer> tokenizer;
  const std::string model_dir = absl::GetFlag(FLAGS_model);
  options.limits.vocab_size = absl::GetFlag(FLAGS_vocab_size);
  options.limits.context_length = absl::GetFlag(FLAGS_context_length);
  if (!model_dir.empty()) {
    absl::StatusOr<hmoe::ModelConfig> config =
        hmoe::ModelConfig::FromFile(model_dir + "/config.json");
    if (!config.ok()) {
      HMOE_LOG(ERROR) << config.status();
      return 1;
    }
    options.limits.vocab_size = static_cast<int32_t>(config->vocab_size);
    options.limits.context_length = static_cast<int32_t>(config->max_position_embeddings);
    options.bos_token_id = static_cast<int32_t>(config->bos_token_id);
    if (!config->eos_token_ids.empty()) {
      options.eos_token_id = static_cast<int32_t>(config->eos_token_ids[0]);
    }
    for (const auto id : config->eos_token_ids) {
      options.eos_token_ids.push_back(static_cast<int32_t>(id));
    }
    absl::StatusOr<std::unique_ptr<hmoe::Tokenizer>> t = hmoe::Tokenizer::Load(model_dir);
    if (t.ok()) {
      tokenizer = *std::move(t);
    } else if (absl::IsNotFound(t.status())) {
      HMOE_LOG(WARNING) << "no tokenizer in " << model_dir << ": token-id prompts only";
    } else {
      HMOE_LOG(ERROR) << t.status();
      return 1;
    }
    options.model_name = model_dir;
  }
  if (options.limits.vocab_size <= 0) {
    HMOE_LOG(ERROR) << "give --model DIR or --vocab_size";
    return 1;
  }
  options.max_request_bytes = absl::GetFlag(FLAGS_max_request_bytes);
  options.limits.max_request_bytes = options.max_request_bytes;
  options.policy.chunk_threshold_tokens = absl::GetFlag(FLAGS_chunk_threshold);
  options.policy.decode_idle_window = absl::Seconds(absl::GetFlag(FLAGS_decode_idle_window_s));
  options.max_inflight = absl::GetFlag(FLAGS_max_inflight);
  options.max_prefill_queue = absl::GetFlag(FLAGS_max_prefill_queue);
  options.policy.cpu_devices_shared = absl::GetFlag(FLAGS_cpu_devices_shared);
  // DSLP group names: unique to this instance and unpredictable, so neither another router nor
  // another user can hold the shared-memory name of a group before its ranks create it.
  options.dslp_group_prefix =
      absl::StrCat("hmoe-dslp-", getpid(), "-", absl::Hex(std::random_device()(), absl::kZeroPad8));
  if (const std::string ep = absl::GetFlag(FLAGS_dslp_ep_mode); ep == "standard") {
    options.dslp_ep_mode = 1;
  } else if (ep == "small_ep") {
    options.dslp_ep_mode = 2;
  } else if (ep != "default") {
    HMOE_LOG(ERROR) << "--dslp_ep_mode: default, standard or small_ep, got " << ep;
    return 2;
  }
  if (options.max_inflight < 1 || options.max_prefill_queue < 0 || options.max_request_bytes < 1) {
    HMOE_LOG(ERROR) << "--max_inflight and --max_request_bytes must be >= 1, "
                       "--max_prefill_queue >= 0";
    return 2;
  }
  options.retry_wait = absl::Milliseconds(absl::GetFlag(FLAGS_retry_wait_ms));
  options.max_dispatch_attempts = absl::GetFlag(FLAGS_max_dispatch_attempts);
  options.dslp_failure_grace = absl::Milliseconds(absl::GetFlag(FLAGS_dslp_failure_grace_ms));
  if (options.max_dispatch_attempts < 1 || options.dslp_failure_grace < absl::ZeroDuration()) {
    HMOE_LOG(ERROR) << "--max_dispatch_attempts must be >= 1, --dslp_failure_grace_ms >= 0";
    return 2;
  }

  // Signals are handled by sigwait below; block them before gRPC starts its threads.
  sigset_t signals;
  sigemptyset(&signals);
  sigaddset(&signals, SIGTERM);
  sigaddset(&signals, SIGINT);
  pthread_sigmask(SIG_BLOCK, &signals, nullptr);

  const int heartbeat_timeout_ms = absl::GetFlag(FLAGS_heartbeat_timeout_ms);
  const absl::StatusOr<int> heartbeat_interval_ms = hmoe::router::ResolveHeartbeatIntervalMs(
      heartbeat_timeout_ms, absl::GetFlag(FLAGS_heartbeat_interval_ms));
  if (!heartbeat_interval_ms.ok()) {
    HMOE_LOG(ERROR) << heartbeat_interval_ms.status().message();
    return 2;
  }
  hmoe::router::RealClock clock;
  hmoe::router::WorkerRegistry registry(
      &clock, {.heartbeat_timeout = absl::Milliseconds(heartbeat_timeout_ms),
               .heartbeat_interval = absl::Milliseconds(*heartbeat_interval_ms)});
  std::unique_ptr<hmoe::router::DecodeClientFactory> decode_clients =
      hmoe::router::NewGrpcDecodeClientFactory();
  std::unique_ptr<hmoe::router::PrefillClientFactory> prefill_clients =
      hmoe::router::NewGrpcPrefillClientFactory();
  Router router(options, &registry, decode_clients.get(), prefill_clients.get(), tokenizer.get(),
                &clock);
  hmoe::router::RouterService router_service(&router);
  hmoe::router::RegistryService registry_service(&registry);

  // Health answers from the registry on every call (router/health_service.h), not from a flag.
  hmoe::router::HealthService health([&router] { return router.Serving(); });
  grpc::reflection::InitProtoReflectionServerBuilderPlugin();
  int port = 0;
  grpc::ServerBuilder builder;
  // gRPC sets SO_REUSEPORT by default: a second router on the same port would start and share the
  // connections. Binding exclusively makes a port in use an error at start-up.
  builder.AddChannelArgument(GRPC_ARG_ALLOW_REUSEPORT, 0);
  {
    std::vector<std::unique_ptr<grpc::experimental::ServerInterceptorFactoryInterface>> creators;
    creators.push_back(hmoe::router::NewParseErrorInterceptorFactory());
    builder.experimental().SetInterceptorCreators(std::move(creators));
  }
  // Twice the request limit: requests in between get validation's INVALID_ARGUMENT naming the
  // limit; gRPC answers RESOURCE_EXHAUSTED beyond.
  builder.SetMaxReceiveMessageSize(2 * options.max_request_bytes);
  builder.AddListeningPort(absl::GetFlag(FLAGS_listen), grpc::InsecureServerCredentials(), &port);
  builder.RegisterService(&router_service);
  builder.RegisterService(&health);
  const std::string registry_socket = absl::GetFlag(FLAGS_registry_socket);
  std::unique_ptr<grpc::Server> registry_server;
  if (registry_socket.empty()) {
    builder.RegisterService(&registry_service);
  } else {
    if (!PrepareSocketDir(registry_socket)) return 1;
    grpc::ServerBuilder rb;
    rb.AddListeningPort("unix:" + registry_socket, grpc::InsecureServerCredentials());
    rb.RegisterService(&registry_service);
    registry_server = rb.BuildAndStart();
    if (registry_server == nullptr) {
      HMOE_LOG(ERROR) << "cannot serve the registry on unix:" << registry_socket;
      return 1;
    }
  }
  std::unique_ptr<grpc::Server> server = builder.BuildAndStart();
  if (server == nullptr || port == 0) {
    HMOE_LOG(ERROR) << "cannot listen on " << absl::GetFlag(FLAGS_listen)
                    << ": the address is in use (another router?) or not local";
    return 1;
  }
  if (const std::string port_file = absl::GetFlag(FLAGS_port_file); !port_file.empty()) {
    FILE* f = std::fopen(port_file.c_str(), "w");
    if (f != nullptr) {
      std::fprintf(f, "%d\n", port);
      std::fclose(f);
    }
  }
  HMOE_LOG(INFO) << "SERVING on port " << port << " (vocab " << options.limits.vocab_size
                 << ", context " << options.limits.context_length
                 << (tokenizer != nullptr ? ", tokenizer" : ", no tokenizer") << ")";

  // After a burst, glibc keeps the memory the request threads freed in their arenas: once the
  // router is idle (nothing in flight) after serving requests, hand it back to the system. Without
  // it the router's RSS climbed 28 % over a 30-minute soak that ended idle (docs/soak.md).
  std::jthread idle_trim([&router](std::stop_token stop) {
    std::mutex mu;
    std::condition_variable_any wake;
    int64_t trimmed_at = -1;
    std::unique_lock<std::mutex> lock(mu);
    while (!wake.wait_for(lock, stop, std::chrono::seconds(5),
                          [&stop] { return stop.stop_requested(); })) {
      const hmoe::v1::RouterStatus st = router.GetStatus();
      if (st.inflight() == 0 && st.requests_total() != trimmed_at) {
        ::malloc_trim(0);
        trimmed_at = st.requests_total();
      }
    }
  });

  int sig = 0;
  sigwait(&signals, &sig);
  HMOE_LOG(INFO) << "signal " << sig << ": draining";
  router.StartDraining();  // health: NOT_SERVING from now on
  const absl::Time drain_end = absl::Now() + absl::Seconds(absl::GetFlag(FLAGS_drain_seconds));
  while (router.inflight() > 0 && absl::Now() < drain_end) absl::SleepFor(absl::Milliseconds(20));
  server->Shutdown(absl::ToChronoTime(absl::Now() + absl::Seconds(1)));
  if (registry_server != nullptr) registry_server->Shutdown();
  if (!registry_socket.empty()) unlink(registry_socket.c_str());
  HMOE_LOG(INFO) << "stopped";
  return 0;
}
