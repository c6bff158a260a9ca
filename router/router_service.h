#pragma once

// gRPC handlers of the public API (proto/hmoe_v1.proto): they translate between proto/gRPC and
// Router (router.h) and hold no logic. Thread-safe.

#include <grpcpp/grpcpp.h>

#include "proto/hmoe_v1.grpc.pb.h"
#include "router/metrics.h"
#include "router/router.h"

namespace hmoe::router {

class RouterService final : public hmoe::v1::Hmoe::Service {
 public:
  // `router` and `metrics` (may be null: none recorded) must outlive the service.
  explicit RouterService(Router* router, RouterMetrics* metrics = nullptr)
      : router_(router), metrics_(metrics) {}

  grpc::Status Generate(grpc::ServerContext* context, const hmoe::v1::GenerateRequest* request,
                        grpc::ServerWriter<hmoe::v1::GenerateResponse>* writer) override;
  grpc::Status Cancel(grpc::ServerContext* context, const hmoe::v1::CancelRequest* request,
                      hmoe::v1::CancelResponse* response) override;
  grpc::Status GetModelInfo(grpc::ServerContext* context,
                            const hmoe::v1::GetModelInfoRequest* request,
                            hmoe::v1::ModelInfo* response) override;
  grpc::Status GetStatus(grpc::ServerContext* context, const hmoe::v1::GetStatusRequest* request,
                         hmoe::v1::RouterStatus* response) override;

 private:
  Router* const router_;
  RouterMetrics* const metrics_;
};

}  // namespace hmoe::router
