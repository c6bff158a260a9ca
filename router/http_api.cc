#include "router/http_api.h"

#include <cstdio>
#include <optional>

#include "absl/flags/flag.h"
#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"

#include "common/base/logging.h"
#include "common/model/gguf_model.h"
#include "common/model/gguf_source.h"
#include "common/model/tokenizer.h"

ABSL_FLAG(std::string, http_listen, "",
          "OpenAI-compatible HTTP API address (host:port, e.g. 127.0.0.1:8000; port 0 picks one; "
          "empty: off)");
ABSL_FLAG(std::string, chat_template, "",
          "Jinja chat template file for /v1/chat/completions (default: the checkpoint's "
          "tokenizer_config.json chat_template)");
ABSL_FLAG(std::string, served_model_name, "",
          "model id of the HTTP API (default: the --model directory's name)");
ABSL_FLAG(int, http_read_timeout_ms, 30000,
          "an HTTP request must arrive within this; also the keep-alive idle limit");
ABSL_FLAG(int, http_max_connections, 1024, "open HTTP connections; 503 beyond");
ABSL_FLAG(int, http_io_threads, 2, "threads doing the HTTP socket work");
ABSL_FLAG(int64_t, http_max_queued_bytes, 1 << 20,
          "bytes of one HTTP response that may wait unsent for a client that does not read; past "
          "it the connection is closed and its request cancelled (docs/api.md)");
ABSL_FLAG(std::string, http_port_file, "", "write the bound HTTP port here (tests)");

namespace hmoe::router {

HttpApi::~HttpApi() {
  server_->StopAccepting();
  api_->Join();
  server_->Stop();
}

absl::StatusOr<std::unique_ptr<HttpApi>> StartHttpApiFromFlags(
    Router* router, const WorkerRegistry* registry, const Tokenizer* tokenizer,
    const RouterOptions& options, const std::string& model_dir, RouterMetrics* metrics) {
  const std::string listen = absl::GetFlag(FLAGS_http_listen);
  if (listen.empty()) return nullptr;

  OpenAiOptions o;
  std::string dir = model_dir;
  while (dir.size() > 1 && dir.back() == '/') dir.pop_back();
  o.model_id = absl::GetFlag(FLAGS_served_model_name);
  if (o.model_id.empty()) {
    o.model_id = dir.empty() ? "hmoe" : dir.substr(dir.rfind('/') + 1);
  }
  if (!model_dir.empty()) {
    o.model_aliases = {model_dir, dir};
  }
  o.context_length = options.limits.context_length;
  o.created = absl::ToUnixSeconds(absl::Now());

  std::optional<chat::ChatTemplate> chat_template;
  if (const std::string file = absl::GetFlag(FLAGS_chat_template); !file.empty()) {
    std::optional<std::string> bos, eos;
    if (tokenizer != nullptr && tokenizer->bos_id() >= 0) {
      bos = std::string(tokenizer->IdToToken(tokenizer->bos_id()));
    }
    if (tokenizer != nullptr && tokenizer->eos_id() >= 0) {
      eos = std::string(tokenizer->IdToToken(tokenizer->eos_id()));
    }
    absl::StatusOr<chat::ChatTemplate> t = chat::ChatTemplate::FromFile(file, bos, eos);
    if (!t.ok()) {
      return absl::Status(t.status().code(),
                          absl::StrCat("--chat-template ", file, ": ", t.status().message()));
    }
    chat_template = *std::move(t);
  } else if (IsGgufPath(model_dir)) {
    // tokenizer.chat_template of the GGUF, with the tokenizer's bos/eos strings.
    absl::StatusOr<chat::ChatTemplate> t =
        absl::NotFoundError(absl::StrCat(model_dir, " has no tokenizer.chat_template"));
    absl::StatusOr<std::unique_ptr<GgufModel>> gguf = GgufModel::Open(model_dir);
    if (!gguf.ok()) {
      t = gguf.status();
    } else if (const std::string source = GgufChatTemplate(**gguf); !source.empty()) {
      std::optional<std::string> bos, eos;
      if (tokenizer != nullptr && tokenizer->bos_id() >= 0) {
        bos = std::string(tokenizer->IdToToken(tokenizer->bos_id()));
      }
      if (tokenizer != nullptr && tokenizer->eos_id() >= 0) {
        eos = std::string(tokenizer->IdToToken(tokenizer->eos_id()));
      }
      t = chat::ChatTemplate::FromString(source, bos, eos);
    }
    if (t.ok()) {
      chat_template = *std::move(t);
    } else {
      HMOE_LOG(WARNING) << "no chat template: " << t.status();
      o.chat_template_error = std::string(t.status().message());
    }
  } else if (!model_dir.empty()) {
    absl::StatusOr<chat::ChatTemplate> t = chat::ChatTemplate::FromCheckpoint(model_dir);
    if (t.ok()) {
      chat_template = *std::move(t);
    } else {
      // Completions still work; chat requests get this reason.
      HMOE_LOG(WARNING) << "no chat template: " << t.status();
      o.chat_template_error = std::string(t.status().message());
    }
  } else {
    o.chat_template_error = "the router was started without --model";
  }

  auto api = std::make_unique<OpenAiApi>(std::move(o), router, registry, tokenizer,
                                         std::move(chat_template), metrics);
  http::ServerOptions so;
  // The same request limit as gRPC's (--max-request-bytes).
  so.max_body_bytes = static_cast<size_t>(std::max(1, options.max_request_bytes));
  so.read_timeout = absl::Milliseconds(absl::GetFlag(FLAGS_http_read_timeout_ms));
  so.max_connections = absl::GetFlag(FLAGS_http_max_connections);
  so.io_threads = absl::GetFlag(FLAGS_http_io_threads);
  if (absl::GetFlag(FLAGS_http_max_queued_bytes) < 1) {
    return absl::InvalidArgumentError("--http_max_queued_bytes must be >= 1");
  }
  so.max_queued_bytes = static_cast<size_t>(absl::GetFlag(FLAGS_http_max_queued_bytes));
  // A client that leaves cancels its request now, not at the router's next cancellation poll.
  so.on_client_gone = [router] { router->CheckCancellations(); };
  so.error_body = [](int status, absl::string_view message) { return ErrorBody(status, message); };
  so.error_content_type = "application/json";
  OpenAiApi* handler = api.get();
  absl::StatusOr<std::unique_ptr<http::Server>> server = http::Server::Start(
      listen, std::move(so),
      [handler](http::Request request, std::shared_ptr<http::Responder> responder) {
        handler->Handle(std::move(request), std::move(responder));
      });
  if (!server.ok()) {
    return absl::Status(server.status().code(),
                        absl::StrCat("--http-listen: ", server.status().message()));
  }
  auto result = std::make_unique<HttpApi>(std::move(api), *std::move(server));
  if (const std::string port_file = absl::GetFlag(FLAGS_http_port_file); !port_file.empty()) {
    if (FILE* f = std::fopen(port_file.c_str(), "w"); f != nullptr) {
      std::fprintf(f, "%d\n", result->port());
      std::fclose(f);
    }
  }
  HMOE_LOG(INFO) << "HTTP (OpenAI API) on " << listen << " (port " << result->port() << ")";
  return result;
}

}  // namespace hmoe::router
