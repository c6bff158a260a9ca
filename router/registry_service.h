#pragma once

// gRPC handlers of the worker registry (proto/worker_registry.proto) that workers call on the
// router; they translate to WorkerRegistry (worker_registry.h). Thread-safe.

#include <grpcpp/grpcpp.h>

#include "proto/worker_registry.grpc.pb.h"
#include "router/worker_registry.h"

namespace hmoe::router {

class RegistryService final : public hmoe::registry::v1::WorkerRegistry::Service {
 public:
  // `registry` must outlive the service.
  explicit RegistryService(router::WorkerRegistry* registry) : registry_(registry) {}

  grpc::Status Register(grpc::ServerContext* context,
                        const hmoe::registry::v1::RegisterRequest* request,
                        hmoe::registry::v1::RegisterResponse* response) override;
  grpc::Status Heartbeat(grpc::ServerContext* context,
                         const hmoe::registry::v1::HeartbeatRequest* request,
                         hmoe::registry::v1::HeartbeatResponse* response) override;

 private:
  router::WorkerRegistry* const registry_;
};

}  // namespace hmoe::router
