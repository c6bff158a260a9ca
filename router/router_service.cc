#include "router/router_service.h"

#include "absl/time/clock.h"

#include "common/rpc/grpc_status.h"

namespace hmoe::router {
namespace {

class GrpcSink : public GenerateSink {
 public:
  GrpcSink(grpc::ServerContext* context, grpc::ServerWriter<hmoe::v1::GenerateResponse>* writer)
      : context_(context), writer_(writer) {}
  bool Write(const hmoe::v1::GenerateResponse& response) override {
    return writer_->Write(response);
  }
  bool IsCancelled() override { return context_->IsCancelled(); }

 private:
  grpc::ServerContext* context_;
  grpc::ServerWriter<hmoe::v1::GenerateResponse>* writer_;
};

}  // namespace

grpc::Status RouterService::Generate(grpc::ServerContext* context,
                                     const hmoe::v1::GenerateRequest* request,
                                     grpc::ServerWriter<hmoe::v1::GenerateResponse>* writer) {
  GrpcSink sink(context, writer);
  const auto raw_deadline = context->deadline();
  const absl::Time deadline = raw_deadline == std::chrono::system_clock::time_point::max()
                                  ? absl::InfiniteFuture()
                                  : absl::FromChrono(raw_deadline);
  return rpc::ToGrpcStatus(metrics_ != nullptr
                               ? metrics_->Generate(router_, *request, deadline, &sink)
                               : router_->Generate(*request, deadline, &sink));
}

grpc::Status RouterService::Cancel(grpc::ServerContext*, const hmoe::v1::CancelRequest* request,
                                   hmoe::v1::CancelResponse*) {
  return rpc::ToGrpcStatus(router_->Cancel(request->request_id()));
}

grpc::Status RouterService::GetModelInfo(grpc::ServerContext*, const hmoe::v1::GetModelInfoRequest*,
                                         hmoe::v1::ModelInfo* response) {
  *response = router_->GetModelInfo();
  return grpc::Status::OK;
}

grpc::Status RouterService::GetStatus(grpc::ServerContext*, const hmoe::v1::GetStatusRequest*,
                                      hmoe::v1::RouterStatus* response) {
  *response = router_->GetStatus();
  return grpc::Status::OK;
}

}  // namespace hmoe::router
