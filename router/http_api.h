#pragma once

// hmoe-router's HTTP listener (--http-listen): the OpenAI API (router/openai_api.h) on the
// generic HTTP server (common/http/server.h), configured from the --http-* and --chat-template
// flags. Separate from main.cc so the process's wiring stays small.

#include <memory>
#include <string>

#include "absl/status/statusor.h"

#include "common/http/server.h"
#include "router/openai_api.h"
#include "router/router.h"
#include "router/worker_registry.h"

namespace hmoe {
class Tokenizer;
}

namespace hmoe::router {

class HttpApi {
 public:
  HttpApi(std::unique_ptr<OpenAiApi> api, std::unique_ptr<http::Server> server)
      : api_(std::move(api)), server_(std::move(server)) {}
  // Stops accepting (in-flight generations see their clients gone and end), waits for the
  // generation threads, then closes the server.
  ~HttpApi();
  int port() const { return server_->port(); }

 private:
  std::unique_ptr<OpenAiApi> api_;
  std::unique_ptr<http::Server> server_;
};

// Starts the HTTP API when --http-listen is set (nullptr when it is empty). `model_dir` is the
// checkpoint (--model; may be empty): the chat template and the model name come from it.
// `metrics` (may be null) is served on GET /metrics and records the HTTP requests.
// An error when the address is in use or malformed, or --chat-template cannot be loaded.
absl::StatusOr<std::unique_ptr<HttpApi>> StartHttpApiFromFlags(
    Router* router, const WorkerRegistry* registry, const Tokenizer* tokenizer,
    const RouterOptions& options, const std::string& model_dir, RouterMetrics* metrics);

}  // namespace hmoe::router
