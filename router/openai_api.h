#pragma once

// The OpenAI-compatible HTTP API of hmoe-router (docs/api.md "OpenAI HTTP API"):
//   POST /v1/chat/completions  messages rendered with the model's chat template (common/chat),
//   POST /v1/completions       a text prompt (or token ids),
//        both with "stream": server-sent events in OpenAI's chunk schema, then "data: [DONE]";
//   GET  /v1/models            the one model served;
//   GET  /health               200 while a request can be served, 503 with the reason otherwise;
//   GET  /metrics              Prometheus text (router/metrics.h).
// A request is translated into the same hmoe.v1.GenerateRequest the gRPC API takes and served by
// the same Router::Generate (validation, policy, retries, cancellation, timing); only the JSON
// mapping lives here. Errors are OpenAI error objects {"error": {"message", "type", "param",
// "code"}} with the HTTP status of the absl code. A client that disconnects cancels its request
// (the sink reports it as cancelled; the router's watcher breaks the worker calls).
//
// Each generation runs on a thread of its own (Router::Generate blocks) and writes to its
// connection's queue, never waiting for the client. Thread-safe.

#include <atomic>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"

#include "common/chat/chat_template.h"
#include "common/http/server.h"
#include "router/metrics.h"
#include "router/router.h"
#include "router/worker_registry.h"

#include <nlohmann/json.hpp>

namespace hmoe {
class Tokenizer;
}

namespace hmoe::router {

struct OpenAiOptions {
  // The model id /v1/models lists; requests may name it or any of `model_aliases` (or omit it).
  std::string model_id = "hmoe";
  std::vector<std::string> model_aliases;
  // The context length (0: unchecked) and the default max_tokens of a chat completion when the
  // context is unchecked.
  int32_t context_length = 0;
  int32_t default_chat_max_tokens = 4096;
  // Creation time reported by /v1/models (seconds since the epoch).
  int64_t created = 0;
  // Why there is no chat template (e.g. the checkpoint's failed to load: the message names the
  // template line); /v1/chat/completions answers 400 with it.
  std::string chat_template_error;
};

// The OpenAI error object, e.g. {"error": {"message": m, "type": "invalid_request_error",
// "param": "temperature", "code": null}}. Empty `param`/`code` are JSON null.
std::string ErrorBody(int status, absl::string_view message, absl::string_view param = "",
                      absl::string_view code = "");
// The HTTP status of an absl code (InvalidArgument 400, NotFound 404, ResourceExhausted 429,
// Unavailable 503, ...).
int HttpStatusOf(absl::StatusCode code);

// Splits generated text into the thought (reasoning_content) and the answer (content) the way
// DeepSeek's API does: when the prompt ends inside an open <think> block (the template opened it)
// or the generation starts with <think>, everything up to </think> is the thought; the tags
// themselves and the whitespace right after </think> are dropped. Text that could still be the
// start of a tag is held back until it is known.
class ReasoningSplitter {
 public:
  explicit ReasoningSplitter(bool in_thought) : in_thought_(in_thought), at_start_(!in_thought) {}
  // Adds generated text; appends what is known to `reasoning` and `content`.
  void Push(absl::string_view text, std::string* reasoning, std::string* content);
  // The end of the generation: releases what was held.
  void Flush(std::string* reasoning, std::string* content);

 private:
  bool in_thought_;
  // Before any generated text: a leading <think> opens a thought.
  bool at_start_;
  bool after_thought_ = false;
  std::string held_;
};

// Whether a rendered chat prompt leaves a <think> block open (the model continues the thought).
bool PromptOpensThought(absl::string_view prompt);

class OpenAiApi {
 public:
  // `router`, `registry`, `tokenizer` (may be null: token-id completions only) and `metrics` (may
  // be null: no /metrics) must outlive this; `chat_template` may be empty (then
  // /v1/chat/completions answers 400 saying so).
  OpenAiApi(OpenAiOptions options, Router* router, const WorkerRegistry* registry,
            const Tokenizer* tokenizer, std::optional<chat::ChatTemplate> chat_template,
            RouterMetrics* metrics = nullptr);
  ~OpenAiApi();  // Join()
  OpenAiApi(const OpenAiApi&) = delete;
  OpenAiApi& operator=(const OpenAiApi&) = delete;

  // The http::Handler.
  void Handle(http::Request request, std::shared_ptr<http::Responder> responder);
  // Waits for every generation thread (their clients must be gone or done: stop the server's
  // accepting first, which cancels them).
  void Join();

  // Translates a request body into the router's request (exposed for tests). `chat`: a
  // /v1/chat/completions body, else /v1/completions. On error the status message is the client's
  // and `*param` names the field.
  struct Translated {
    hmoe::v1::GenerateRequest request;
    bool stream = false;
    bool include_usage = false;
    // Chat: the prompt leaves a <think> block open.
    bool thought_open = false;
    bool chat = false;
    // The model name to echo.
    std::string model;
  };
  absl::StatusOr<Translated> Translate(const nlohmann::ordered_json& body, bool chat,
                                       std::string* param) const;

 private:
  void Health(const std::shared_ptr<http::Responder>& responder) const;
  void Models(const std::shared_ptr<http::Responder>& responder) const;
  void Completions(const http::Request& request, std::shared_ptr<http::Responder> responder,
                   bool chat);
  void RunGeneration(Translated translated, std::shared_ptr<http::Responder> responder);

  const OpenAiOptions options_;
  Router* const router_;
  const WorkerRegistry* const registry_;
  const Tokenizer* const tokenizer_;
  const std::optional<chat::ChatTemplate> chat_template_;
  RouterMetrics* const metrics_;

  struct Worker {
    std::thread thread;
    std::shared_ptr<std::atomic<bool>> done;
  };
  absl::Mutex mu_;
  std::vector<Worker> workers_ ABSL_GUARDED_BY(mu_);
};

}  // namespace hmoe::router
