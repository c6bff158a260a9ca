#pragma once

// grpc.health.v1.Health of the router (proto/health.proto), answered from the router's state on
// every call instead of a flag set at start-up: the server ("") and the public API
// ("hmoe.v1.Hmoe") are SERVING while the router is not draining and at least one decode worker is
// live in the registry (a decode worker registers only once its weights are loaded and it serves,
// and is live until it dies, stops heartbeating or drains); NOT_SERVING otherwise. Other service
// names are NOT_FOUND, as the standard service answers. Watch sends the status at once and then
// each change (checked every `watch_poll`). Thread-safe.

#include <functional>

#include "absl/time/time.h"
#include <grpcpp/grpcpp.h>

#include "proto/health.grpc.pb.h"

namespace hmoe::router {

class HealthService final : public grpc::health::v1::Health::Service {
 public:
  // `serving` is called on every Check (and each Watch poll) from gRPC threads.
  explicit HealthService(std::function<bool()> serving,
                         absl::Duration watch_poll = absl::Milliseconds(100))
      : serving_(std::move(serving)), watch_poll_(watch_poll) {}

  grpc::Status Check(grpc::ServerContext* context,
                     const grpc::health::v1::HealthCheckRequest* request,
                     grpc::health::v1::HealthCheckResponse* response) override;
  grpc::Status Watch(grpc::ServerContext* context,
                     const grpc::health::v1::HealthCheckRequest* request,
                     grpc::ServerWriter<grpc::health::v1::HealthCheckResponse>* writer) override;

  // Whether `service` is one this server reports on ("" or "hmoe.v1.Hmoe").
  static bool Known(const std::string& service);

 private:
  const std::function<bool()> serving_;
  const absl::Duration watch_poll_;
};

}  // namespace hmoe::router
