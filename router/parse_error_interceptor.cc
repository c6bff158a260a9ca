#include "router/parse_error_interceptor.h"

#include <string>

#include "absl/strings/str_cat.h"
#include <grpcpp/grpcpp.h>
#include <grpcpp/support/interceptor.h>

namespace hmoe::router {
namespace {

namespace gx = grpc::experimental;

class ParseErrorInterceptor : public gx::Interceptor {
 public:
  explicit ParseErrorInterceptor(std::string method) : method_(std::move(method)) {}

  void Intercept(gx::InterceptorBatchMethods* methods) override {
    // The request arrived but did not deserialize: gRPC passes no message on.
    if (methods->QueryInterceptionHookPoint(gx::InterceptionHookPoints::POST_RECV_MESSAGE) &&
        methods->GetRecvMessage() == nullptr) {
      parse_failed_ = true;
    }
    if (parse_failed_ &&
        methods->QueryInterceptionHookPoint(gx::InterceptionHookPoints::PRE_SEND_STATUS) &&
        methods->GetSendStatus().error_code() == grpc::StatusCode::INTERNAL) {
      methods->ModifySendStatus(grpc::Status(
          grpc::StatusCode::INVALID_ARGUMENT,
          absl::StrCat(method_,
                       ": the request message could not be decoded (malformed protobuf, or a "
                       "string field that is not valid UTF-8)")));
    }
    methods->Proceed();
  }

 private:
  const std::string method_;
  bool parse_failed_ = false;
};

class ParseErrorInterceptorFactory : public gx::ServerInterceptorFactoryInterface {
 public:
  gx::Interceptor* CreateServerInterceptor(gx::ServerRpcInfo* info) override {
    // Streams of client messages end with an empty receive; only single-request methods qualify.
    if (info->type() != gx::ServerRpcInfo::Type::UNARY &&
        info->type() != gx::ServerRpcInfo::Type::SERVER_STREAMING) {
      return nullptr;
    }
    return new ParseErrorInterceptor(info->method());
  }
};

}  // namespace

std::unique_ptr<gx::ServerInterceptorFactoryInterface> NewParseErrorInterceptorFactory() {
  return std::make_unique<ParseErrorInterceptorFactory>();
}

}  // namespace hmoe::router
