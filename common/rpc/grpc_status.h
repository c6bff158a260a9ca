#pragma once

// absl::StatusCode and grpc::StatusCode both mirror google.rpc.Code, so codes cross process
// boundaries unchanged (docs/style.md §3): handlers `return ToGrpcStatus(s)`, clients use
// FromGrpcStatus. Header-only on purpose: hmoe-router includes it without linking hmoe::rpc (which
// pulls in the device library the router must not link).

#include <string>

#include "absl/status/status.h"
#include <grpcpp/support/status.h>

namespace hmoe::rpc {

inline grpc::Status ToGrpcStatus(const absl::Status& s) {
  if (s.ok()) return grpc::Status::OK;
  return grpc::Status(static_cast<grpc::StatusCode>(s.code()), std::string(s.message()));
}

inline absl::Status FromGrpcStatus(const grpc::Status& s) {
  if (s.ok()) return absl::OkStatus();
  return absl::Status(static_cast<absl::StatusCode>(s.error_code()), s.error_message());
}

// "OK", "CANCELLED", ..., "UNAUTHENTICATED" (the google.rpc.Code names clients print and log);
// "CODE_<n>" for a number outside the enum.
inline std::string GrpcCodeName(grpc::StatusCode code) {
  std::string name = absl::StatusCodeToString(static_cast<absl::StatusCode>(code));
  return name.empty() ? "CODE_" + std::to_string(static_cast<int>(code)) : name;
}

}  // namespace hmoe::rpc
