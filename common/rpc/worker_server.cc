#include "common/rpc/worker_server.h"

#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstring>
#include <utility>

#include "absl/strings/str_cat.h"
#include <grpcpp/grpcpp.h>
#include <grpcpp/health_check_service_interface.h>

#include "common/base/logging.h"

namespace hmoe::rpc {

absl::StatusOr<std::unique_ptr<grpc::Server>> ServeOnUnixSocket(const std::string& socket_path,
                                                                grpc::Service* service,
                                                                const std::string& service_name) {
  grpc::EnableDefaultHealthCheckService(true);
  grpc::ServerBuilder builder;
  builder.AddListeningPort("unix:" + socket_path, grpc::InsecureServerCredentials());
  builder.RegisterService(service);
  std::unique_ptr<grpc::Server> server = builder.BuildAndStart();
  if (server == nullptr) {
    return absl::UnavailableError(absl::StrCat("cannot serve gRPC on unix:", socket_path));
  }
  if (::chmod(socket_path.c_str(), 0600) != 0) {
    HMOE_LOG(WARNING) << "chmod 0600 " << socket_path << ": " << std::strerror(errno);
  }
  SetServing(*server, service_name, true);
  return server;
}

void SetServing(grpc::Server& server, const std::string& service_name, bool serving) {
  grpc::HealthCheckServiceInterface* health = server.GetHealthCheckService();
  if (health == nullptr) return;
  health->SetServingStatus(serving);
  health->SetServingStatus(service_name, serving);
}

absl::StatusOr<std::unique_ptr<WorkerServer>> WorkerServer::Start(
    const WorkerServerOptions& options, grpc::Service* service,
    std::function<WorkerLoadReport()> load) {
  absl::StatusOr<std::unique_ptr<grpc::Server>> server =
      ServeOnUnixSocket(options.socket_path, service, options.service_name);
  if (!server.ok()) return server.status();
  std::unique_ptr<WorkerServer> worker(new WorkerServer(options, *std::move(server)));
  if (options.router.empty()) {
    HMOE_LOG(INFO) << "no --router: not registering with a router";
    return worker;
  }
  RegistryClientOptions ro;
  ro.kind = options.kind;
  ro.router_target = options.router;
  ro.worker_id = options.worker_id;
  ro.endpoint = "unix:" + options.socket_path;
  ro.device = options.device;
  ro.model = options.model;
  ro.pid = ::getpid();
  ro.start_unix_ms = absl::ToUnixMillis(options.start);
  ro.heartbeat_interval = options.heartbeat_interval;
  worker->registry_ = std::make_unique<RegistryClient>(ro, std::move(load));
  return worker;
}

WorkerServer::WorkerServer(const WorkerServerOptions& options, std::unique_ptr<grpc::Server> server)
    : options_(options), server_(std::move(server)) {}

WorkerServer::~WorkerServer() { Shutdown(); }

void WorkerServer::StopServing() { SetServing(*server_, options_.service_name, false); }

void WorkerServer::Shutdown() {
  if (shut_down_) return;
  shut_down_ = true;
  server_->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(5));
  if (registry_ != nullptr) registry_->Stop();
  ::unlink(options_.socket_path.c_str());
}

}  // namespace hmoe::rpc
