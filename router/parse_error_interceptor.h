#pragma once

// gRPC's generated server code answers a request message it cannot parse (malformed protobuf, or a
// proto3 string field that is not valid UTF-8) with INTERNAL and an empty message, before any
// handler runs. This server interceptor turns that into INVALID_ARGUMENT saying what was wrong
// (issue #16, docs/api.md "Errors"). It applies to unary and server-streaming methods (one request
// message each); the wire format and the generated API stay as they are.

#include <memory>

#include <grpcpp/support/server_interceptor.h>

namespace hmoe::router {

// For ServerBuilder::experimental().SetInterceptorCreators.
std::unique_ptr<grpc::experimental::ServerInterceptorFactoryInterface>
NewParseErrorInterceptorFactory();

}  // namespace hmoe::router
