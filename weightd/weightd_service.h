#pragma once

// gRPC handlers of hmoe.weightd.v1.WeightdService: they only translate WeightDaemon's status and
// manifest into protos. Thread-safe.

#include <grpcpp/grpcpp.h>

#include "proto/weightd.grpc.pb.h"
#include "weightd/weight_daemon.h"

namespace hmoe::weightd {

// The proto forms, also used by tests and tools.
void StatusToProto(const DaemonStatus& status, v1::WeightdStatus* out);
void ManifestToProto(const shm::Manifest& manifest, const std::vector<SegmentReport>& segments,
                     bool include_tensors, v1::Manifest* out);

class WeightdServiceImpl final : public v1::WeightdService::Service {
 public:
  // `daemon` must outlive the service.
  explicit WeightdServiceImpl(const WeightDaemon* daemon) : daemon_(daemon) {}

  grpc::Status GetStatus(grpc::ServerContext* context, const v1::GetStatusRequest* request,
                         v1::WeightdStatus* response) override;
  // UNAVAILABLE until the store is ready.
  grpc::Status GetManifest(grpc::ServerContext* context, const v1::GetManifestRequest* request,
                           v1::Manifest* response) override;

 private:
  const WeightDaemon* daemon_;
};

}  // namespace hmoe::weightd
