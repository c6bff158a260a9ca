#include "router/health_service.h"

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"

namespace hmoe::router {

namespace hv1 = grpc::health::v1;

bool HealthService::Known(const std::string& service) {
  return service.empty() || service == "hmoe.v1.Hmoe";
}

grpc::Status HealthService::Check(grpc::ServerContext*, const hv1::HealthCheckRequest* request,
                                  hv1::HealthCheckResponse* response) {
  if (!Known(request->service())) {
    return grpc::Status(grpc::StatusCode::NOT_FOUND,
                        absl::StrCat("unknown service \"", request->service(),
                                     "\" (this server reports \"\" and \"hmoe.v1.Hmoe\")"));
  }
  response->set_status(serving_() ? hv1::HealthCheckResponse::SERVING
                                  : hv1::HealthCheckResponse::NOT_SERVING);
  return grpc::Status::OK;
}

grpc::Status HealthService::Watch(grpc::ServerContext* context,
                                  const hv1::HealthCheckRequest* request,
                                  grpc::ServerWriter<hv1::HealthCheckResponse>* writer) {
  hv1::HealthCheckResponse response;
  hv1::HealthCheckResponse::ServingStatus last = hv1::HealthCheckResponse::UNKNOWN;
  while (!context->IsCancelled()) {
    // An unknown service is reported as such and watched on, as the standard service does.
    const hv1::HealthCheckResponse::ServingStatus now =
        !Known(request->service()) ? hv1::HealthCheckResponse::SERVICE_UNKNOWN
        : serving_()               ? hv1::HealthCheckResponse::SERVING
                                   : hv1::HealthCheckResponse::NOT_SERVING;
    if (now != last) {
      response.set_status(now);
      if (!writer->Write(response)) break;
      last = now;
    }
    absl::SleepFor(watch_poll_);
  }
  return grpc::Status::OK;
}

}  // namespace hmoe::router
