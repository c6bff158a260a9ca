// hmoe-router: the public gRPC API (proto/hmoe_v1.proto) in front of the workers, plus the worker
// registry (proto/worker_registry.proto). Wiring only: the logic lives in hmoe_router_lib.
// See docs/api.md.
//
// Exit codes: 0 after SIGTERM/SIGINT (drained), 1 on a start-up or runtime error, 2 on bad flags.

#include <malloc.h>
#include <unistd.h>

#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include <grpcpp/ext/proto_server_reflection_plugin.h>
#include <grpcpp/grpcpp.h>

#include "common/base/logging.h"
#include "common/base/status_macros.h"
#include "common/model/tokenizer.h"
#include "common/process/daemon.h"
#include "common/process/socket_path.h"
#include "router/clock.h"
#include "router/decode_client.h"
#include "router/flags.h"
#include "router/health_service.h"
#include "router/http_api.h"
#include "router/parse_error_interceptor.h"
#include "router/prefill_client.h"
#include "router/registry_service.h"
#include "router/router.h"
#include "router/router_service.h"
#include "router/worker_registry.h"

namespace hmoe::router {
namespace {

absl::Status Run(process::StopSignalWatcher& signals) {
  RouterFlags flags;
  HMOE_RETURN_IF_ERROR(ReadFlags(flags));
  const RouterOptions& options = flags.options;
  const std::unique_ptr<Tokenizer>& tokenizer = flags.tokenizer;
  const std::string& registry_socket = flags.registry_socket;

  RealClock clock;
  WorkerRegistry registry(&clock,
                          {.heartbeat_timeout = absl::Milliseconds(flags.heartbeat_timeout_ms),
                           .heartbeat_interval = absl::Milliseconds(flags.heartbeat_interval_ms)});
  std::unique_ptr<DecodeClientFactory> decode_clients = NewGrpcDecodeClientFactory();
  std::unique_ptr<PrefillClientFactory> prefill_clients = NewGrpcPrefillClientFactory();
  Router router(options, &registry, decode_clients.get(), prefill_clients.get(), tokenizer.get(),
                &clock);
  RouterMetrics metrics;  // GET /metrics on the HTTP API (router/metrics.h)
  RouterService router_service(&router, &metrics);
  RegistryService registry_service(&registry);
  // Health answers from the registry on every call (router/health_service.h), not from a flag.
  HealthService health([&router] { return router.Serving(); });

  grpc::reflection::InitProtoReflectionServerBuilderPlugin();
  int port = 0;
  grpc::ServerBuilder builder;
  // gRPC sets SO_REUSEPORT by default: a second router on the same port would start and share the
  // connections. Binding exclusively makes a port in use an error at start-up.
  builder.AddChannelArgument(GRPC_ARG_ALLOW_REUSEPORT, 0);
  {
    std::vector<std::unique_ptr<grpc::experimental::ServerInterceptorFactoryInterface>> creators;
    creators.push_back(NewParseErrorInterceptorFactory());
    builder.experimental().SetInterceptorCreators(std::move(creators));
  }
  // Twice the request limit: requests in between get validation's INVALID_ARGUMENT naming the
  // limit; gRPC answers RESOURCE_EXHAUSTED beyond.
  builder.SetMaxReceiveMessageSize(2 * options.max_request_bytes);
  builder.AddListeningPort(flags.listen, grpc::InsecureServerCredentials(), &port);
  builder.RegisterService(&router_service);
  builder.RegisterService(&health);
  std::unique_ptr<grpc::Server> registry_server;
  if (registry_socket.empty()) {
    builder.RegisterService(&registry_service);
  } else {
    grpc::ServerBuilder rb;
    rb.AddListeningPort("unix:" + registry_socket, grpc::InsecureServerCredentials());
    rb.RegisterService(&registry_service);
    registry_server = rb.BuildAndStart();
    if (registry_server == nullptr) {
      return absl::UnavailableError(
          absl::StrCat("cannot serve the registry on unix:", registry_socket));
    }
  }
  std::unique_ptr<grpc::Server> server = builder.BuildAndStart();
  if (server == nullptr || port == 0) {
    return absl::UnavailableError(absl::StrCat("cannot listen on ", flags.listen,
                                               ": the address is in use (another router?) or "
                                               "not local"));
  }
  if (const std::string& port_file = flags.port_file; !port_file.empty()) {
    FILE* f = std::fopen(port_file.c_str(), "w");
    if (f != nullptr) {
      std::fprintf(f, "%d\n", port);
      std::fclose(f);
    }
  }
  // The OpenAI HTTP API (--http-listen; router/http_api.h), on the same Router.
  HMOE_ASSIGN_OR_RETURN(std::unique_ptr<HttpApi> http,
                        StartHttpApiFromFlags(&router, &registry, tokenizer.get(), options,
                                              flags.model_dir, &metrics));
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
      const v1::RouterStatus st = router.GetStatus();
      if (st.inflight() == 0 && st.requests_total() != trimmed_at) {
        ::malloc_trim(0);
        trimmed_at = st.requests_total();
      }
    }
  });

  // --- drain on SIGTERM
  signals.WaitForStop();
  router.StartDraining();  // health: NOT_SERVING from now on
  process::WaitUntil(absl::Now() + absl::Seconds(flags.drain_seconds),
                     [&router] { return router.inflight() == 0; });
  http.reset();  // ends the HTTP streams still open
  server->Shutdown(absl::ToChronoTime(absl::Now() + absl::Seconds(1)));
  if (registry_server != nullptr) registry_server->Shutdown();
  if (!registry_socket.empty()) ::unlink(registry_socket.c_str());
  HMOE_LOG(INFO) << "stopped";
  return absl::OkStatus();
}

}  // namespace
}  // namespace hmoe::router

int main(int argc, char** argv) {
  // At most two malloc arenas unless the operator sets MALLOC_ARENA_MAX. The router's work is
  // many short-lived gRPC and HTTP handler threads (a burst runs ~100 at once); with glibc's
  // default of up to 8 arenas per core each burst spreads freed memory over new arenas, which
  // malloc_trim cannot fully return, and the router's RSS drifted with the bursts it had seen
  // (+28 % over a 30-minute soak, no live-heap growth: docs/soak.md). Two arenas bound that; the
  // router spends its time in gRPC and the network, so sharing two arena locks among its threads
  // costs little (docs/soak.md). Set before the first thread exists: arenas are created lazily.
  if (std::getenv("MALLOC_ARENA_MAX") == nullptr) {
    ::mallopt(M_ARENA_MAX, 2);
  }
  return hmoe::process::RunDaemon(
      argc, argv, {.usage = "hmoe-router --listen 127.0.0.1:50051 --model DIR"}, hmoe::router::Run);
}
