#pragma once

// The gRPC life of a worker process (hmoe-prefill-worker, hmoe-decode-worker) around its
// service: serving it on the worker's unix socket with gRPC's health service, registering with
// the router (heartbeats carrying the worker's load), and the shutdown after the drain. The
// process skeleton (flags, signals, exit codes, the socket folder) is common/process.

#include <functional>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "absl/time/time.h"

#include "common/rpc/registry_client.h"

namespace grpc {
class Server;
class Service;
}  // namespace grpc

namespace hmoe::rpc {

struct WorkerServerOptions {
  std::string service_name;  // the service health reports on, e.g. "hmoe.decode.v1.DecodeService"
  std::string socket_path;   // prepared with process::PrepareSocketPath
  // What the registry hears; `router` empty: run without a router.
  WorkerKind kind = WorkerKind::kDecode;
  std::string router;
  std::string worker_id;
  absl::Duration heartbeat_interval = absl::Seconds(1);
  std::string device;
  std::string model;
  absl::Time start;  // the process start
};

// Serves `service` on unix:`socket_path` (made 0600) with gRPC's standard health service
// reporting SERVING for the server ("") and for `service_name`. Unavailable when the server
// cannot be started.
absl::StatusOr<std::unique_ptr<grpc::Server>> ServeOnUnixSocket(const std::string& socket_path,
                                                                grpc::Service* service,
                                                                const std::string& service_name);
// Sets the health status of the server ("") and of `service_name` (NOT_SERVING while draining).
void SetServing(grpc::Server& server, const std::string& service_name, bool serving);

// A worker's served service and its registration. Thread-compatible (main's thread).
class WorkerServer {
 public:
  // Serves `service` (ServeOnUnixSocket) and, with a router, starts registering; `load` is
  // called before each heartbeat on the registry client's thread (RegistryClient).
  static absl::StatusOr<std::unique_ptr<WorkerServer>> Start(
      const WorkerServerOptions& options, grpc::Service* service,
      std::function<WorkerLoadReport()> load);
  ~WorkerServer();  // Shutdown()

  // Health NOT_SERVING for the server and the service: the start of the drain.
  void StopServing();
  // Shuts the server down (5 s for calls still open), stops the registration and removes the
  // socket. Idempotent.
  void Shutdown();

 private:
  WorkerServer(const WorkerServerOptions& options, std::unique_ptr<grpc::Server> server);

  WorkerServerOptions options_;
  std::unique_ptr<grpc::Server> server_;
  std::unique_ptr<RegistryClient> registry_;
  bool shut_down_ = false;
};

}  // namespace hmoe::rpc
