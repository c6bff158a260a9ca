#include "router/openai_api.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <utility>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/strip.h"
#include "absl/time/clock.h"

#include "common/base/status_macros.h"
#include "common/chat/jinja.h"
#include "common/model/tokenizer.h"

namespace hmoe::router {
namespace {

namespace v1 = hmoe::v1;
using json = nlohmann::ordered_json;

constexpr absl::string_view kThinkOpen = "<think>";
constexpr absl::string_view kThinkClose = "</think>";
// OpenAI's documented default of a legacy completion.
constexpr int32_t kDefaultCompletionMaxTokens = 16;

std::string Dump(const json& j) {
  return j.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
}

absl::string_view ErrorType(int status) {
  switch (status) {
    case 400:
    case 404:
    case 405:
    case 409:
    case 413:
    case 431:
    case 505:
      return "invalid_request_error";
    case 408:
      return "timeout_error";
    case 429:
      return "rate_limit_error";
    case 503:
      return "service_unavailable_error";
    default:
      return "server_error";
  }
}

// A request error with the field it concerns.
struct FieldError {
  std::string* param;
  absl::Status operator()(absl::string_view field, absl::string_view message) const {
    *param = std::string(field);
    return absl::InvalidArgumentError(absl::StrCat(field, ": ", message));
  }
};

std::string TypeName(const json& j) {
  if (j.is_number()) return "number";
  return j.type_name();
}

// The value of `key` when present and not null.
const json* Field(const json& body, absl::string_view key) {
  auto it = body.find(std::string(key));
  if (it == body.end() || it->is_null()) return nullptr;
  return &*it;
}

absl::Status GetNumber(const json& body, absl::string_view key, const FieldError& bad,
                       std::optional<double>* out) {
  const json* v = Field(body, key);
  if (v == nullptr) return absl::OkStatus();
  if (!v->is_number()) return bad(key, absl::StrCat("expected a number, got ", TypeName(*v)));
  *out = v->get<double>();
  if (!std::isfinite(**out)) return bad(key, "must be finite");
  return absl::OkStatus();
}

absl::Status GetInt(const json& body, absl::string_view key, const FieldError& bad,
                    std::optional<int64_t>* out) {
  const json* v = Field(body, key);
  if (v == nullptr) return absl::OkStatus();
  if (v->is_number_integer()) {
    *out = v->get<int64_t>();
  } else if (v->is_number_unsigned()) {
    const uint64_t u = v->get<uint64_t>();
    *out = u > static_cast<uint64_t>(std::numeric_limits<int64_t>::max())
               ? std::numeric_limits<int64_t>::max()
               : static_cast<int64_t>(u);
  } else if (v->is_number_float() && std::floor(v->get<double>()) == v->get<double>() &&
             std::fabs(v->get<double>()) < 9e15) {
    *out = static_cast<int64_t>(v->get<double>());
  } else {
    return bad(key, absl::StrCat("expected an integer, got ", TypeName(*v)));
  }
  return absl::OkStatus();
}

absl::Status GetBool(const json& body, absl::string_view key, const FieldError& bad, bool* out) {
  const json* v = Field(body, key);
  if (v == nullptr) return absl::OkStatus();
  if (!v->is_boolean()) return bad(key, absl::StrCat("expected a boolean, got ", TypeName(*v)));
  *out = v->get<bool>();
  return absl::OkStatus();
}

// The router's validation names proto fields ("sampling.top_p: ...", "max_new_tokens: ..."):
// the OpenAI parameter they come from.
std::string ParamOf(absl::string_view message, bool chat) {
  const size_t colon = message.find(':');
  if (colon == absl::string_view::npos) return "";
  absl::string_view field = message.substr(0, colon);
  if (absl::ConsumePrefix(&field, "sampling.")) return std::string(field);
  if (field == "max_new_tokens") return chat ? "max_completion_tokens" : "max_tokens";
  if (absl::StartsWith(field, "prompt")) return chat ? "messages" : "prompt";
  if (field == "stop_strings") return "stop";
  return "";
}

std::string FinishReasonOf(v1::FinishReason reason) {
  switch (reason) {
    case v1::FINISH_REASON_LENGTH:
      return "length";
    default:
      return "stop";
  }
}

// The longest suffix of `s` that is a proper prefix of `tag`.
size_t PartialTagSuffix(absl::string_view s, absl::string_view tag) {
  for (size_t n = std::min(s.size(), tag.size() - 1); n > 0; --n) {
    if (s.substr(s.size() - n) == tag.substr(0, n)) return n;
  }
  return 0;
}

}  // namespace

std::string ErrorBody(int status, absl::string_view message, absl::string_view param,
                      absl::string_view code) {
  json error = {{"message", std::string(message)},
                {"type", std::string(ErrorType(status))},
                {"param", param.empty() ? json(nullptr) : json(std::string(param))},
                {"code", code.empty() ? json(nullptr) : json(std::string(code))}};
  return Dump(json{{"error", std::move(error)}});
}

int HttpStatusOf(absl::StatusCode code) {
  switch (code) {
    case absl::StatusCode::kOk:
      return 200;
    case absl::StatusCode::kInvalidArgument:
    case absl::StatusCode::kFailedPrecondition:
    case absl::StatusCode::kOutOfRange:
      return 400;
    case absl::StatusCode::kNotFound:
      return 404;
    case absl::StatusCode::kAlreadyExists:
      return 409;
    case absl::StatusCode::kResourceExhausted:
      return 429;
    case absl::StatusCode::kCancelled:
      return 499;
    case absl::StatusCode::kUnimplemented:
      return 501;
    case absl::StatusCode::kUnavailable:
      return 503;
    case absl::StatusCode::kDeadlineExceeded:
      return 504;
    default:
      return 500;
  }
}

bool PromptOpensThought(absl::string_view prompt) {
  const size_t open = prompt.rfind(kThinkOpen);
  if (open == absl::string_view::npos) return false;
  const size_t close = prompt.rfind(kThinkClose);
  return close == absl::string_view::npos || close < open;
}

void ReasoningSplitter::Push(absl::string_view text, std::string* reasoning, std::string* content) {
  held_.append(text.data(), text.size());
  while (!held_.empty()) {
    if (at_start_) {
      if (held_.size() < kThinkOpen.size() && kThinkOpen.substr(0, held_.size()) == held_) return;
      at_start_ = false;
      if (absl::StartsWith(held_, kThinkOpen)) {
        held_.erase(0, kThinkOpen.size());
        in_thought_ = true;
      }
      continue;
    }
    if (in_thought_) {
      const size_t close = held_.find(kThinkClose.data(), 0, kThinkClose.size());
      if (close != std::string::npos) {
        reasoning->append(held_, 0, close);
        held_.erase(0, close + kThinkClose.size());
        in_thought_ = false;
        after_thought_ = true;
        continue;
      }
      // '<' is ASCII: keeping a tag prefix never splits a UTF-8 character.
      const size_t keep = PartialTagSuffix(held_, kThinkClose);
      reasoning->append(held_, 0, held_.size() - keep);
      held_.erase(0, held_.size() - keep);
      return;
    }
    if (after_thought_) {
      const size_t first = held_.find_first_not_of(" \t\r\n");
      if (first == std::string::npos) {
        held_.clear();
        return;
      }
      held_.erase(0, first);
      after_thought_ = false;
    }
    content->append(held_);
    held_.clear();
  }
}

void ReasoningSplitter::Flush(std::string* reasoning, std::string* content) {
  if (in_thought_) {
    reasoning->append(held_);
  } else {
    content->append(held_);
  }
  held_.clear();
}

namespace {

// Where Router::Generate's responses go: OpenAI JSON, complete or as server-sent events.
class HttpSink : public GenerateSink {
 public:
  HttpSink(const OpenAiApi::Translated& t, std::shared_ptr<http::Responder> responder,
           int64_t created)
      : t_(t), responder_(std::move(responder)), created_(created) {
    if (t.chat) splitter_.emplace(t.thought_open);
  }

  bool Write(const v1::GenerateResponse& response) override {
    if (!response.request_id().empty()) {
      id_ = absl::StrCat(t_.chat ? "chatcmpl-" : "cmpl-", response.request_id());
    }
    if (response.has_token()) {
      Text(response.token().text(), false);
    } else if (response.has_finished()) {
      finished_ = response.finished();
      Text(finished_->text(), true);
    }
    return !responder_->ClientGone();
  }

  bool IsCancelled() override { return responder_->ClientGone(); }

  // After Router::Generate returned `status`: the end of the response.
  void Finish(const absl::Status& status) {
    if (!status.ok() || !finished_.has_value()) {
      const absl::Status s =
          status.ok() ? absl::InternalError("the generation ended without a result") : status;
      const int http_status = HttpStatusOf(s.code());
      if (!started_) {
        const bool invalid = s.code() == absl::StatusCode::kInvalidArgument;
        responder_->Send(
            http_status, "application/json",
            ErrorBody(http_status, s.message(), invalid ? ParamOf(s.message(), t_.chat) : "",
                      invalid && absl::StrContains(s.message(), "context length")
                          ? "context_length_exceeded"
                          : ""));
      } else {
        Event(ErrorBody(http_status, s.message()));
        Event("[DONE]");
        responder_->End();
      }
      return;
    }
    const std::string reason = FinishReasonOf(finished_->reason());
    const json usage = {
        {"prompt_tokens", finished_->usage().prompt_tokens()},
        {"completion_tokens", finished_->usage().completion_tokens()},
        {"total_tokens",
         finished_->usage().prompt_tokens() + finished_->usage().completion_tokens()},
        {"prompt_tokens_details", {{"cached_tokens", finished_->usage().cached_prompt_tokens()}}}};
    if (t_.stream) {
      Start();
      json last = Chunk();
      if (t_.chat) {
        last["choices"][0]["delta"] = json::object();
      } else {
        last["choices"][0]["text"] = "";
      }
      last["choices"][0]["finish_reason"] = reason;
      Event(Dump(last));
      if (t_.include_usage) {
        json u = Chunk();
        u["choices"] = json::array();
        u["usage"] = usage;
        Event(Dump(u));
      }
      Event("[DONE]");
      responder_->End();
      return;
    }
    json choice = {{"index", 0}};
    if (t_.chat) {
      json message = {{"role", "assistant"}, {"content", content_}};
      if (t_.thought_open || !reasoning_.empty()) message["reasoning_content"] = reasoning_;
      choice["message"] = std::move(message);
    } else {
      choice["text"] = content_;
    }
    choice["logprobs"] = nullptr;
    choice["finish_reason"] = reason;
    json body = {{"id", id_},
                 {"object", t_.chat ? "chat.completion" : "text_completion"},
                 {"created", created_},
                 {"model", t_.model},
                 {"choices", json::array({std::move(choice)})},
                 {"usage", usage}};
    responder_->Send(200, "application/json", Dump(body));
  }

 private:
  json Chunk() const {
    json c = {{"id", id_},
              {"object", t_.chat ? "chat.completion.chunk" : "text_completion"},
              {"created", created_},
              {"model", t_.model},
              {"choices", json::array({json{{"index", 0}}})}};
    if (t_.chat) {
      c["choices"][0]["delta"] = json::object();
    } else {
      c["choices"][0]["text"] = "";
    }
    c["choices"][0]["logprobs"] = nullptr;
    c["choices"][0]["finish_reason"] = nullptr;
    if (t_.include_usage) c["usage"] = nullptr;
    return c;
  }

  void Event(const std::string& data) { responder_->Write(absl::StrCat("data: ", data, "\n\n")); }

  // Starts the event stream (at the first token, so errors before it get a proper status).
  void Start() {
    if (started_) return;
    started_ = true;
    responder_->StartStream(200, "text/event-stream; charset=utf-8");
    if (t_.chat) {
      json first = Chunk();
      first["choices"][0]["delta"] = {{"role", "assistant"}, {"content", ""}};
      Event(Dump(first));
    }
  }

  void Text(const std::string& piece, bool final) {
    std::string reasoning, content;
    if (splitter_.has_value()) {
      splitter_->Push(piece, &reasoning, &content);
      if (final) splitter_->Flush(&reasoning, &content);
    } else {
      content = piece;
    }
    if (!t_.stream) {
      reasoning_ += reasoning;
      content_ += content;
      return;
    }
    Start();
    if (!reasoning.empty()) {
      json c = Chunk();
      c["choices"][0]["delta"] = {{"reasoning_content", reasoning}};
      Event(Dump(c));
    }
    if (!content.empty()) {
      json c = Chunk();
      if (t_.chat) {
        c["choices"][0]["delta"] = {{"content", content}};
      } else {
        c["choices"][0]["text"] = content;
      }
      Event(Dump(c));
    }
  }

  const OpenAiApi::Translated& t_;
  std::shared_ptr<http::Responder> responder_;
  const int64_t created_;
  std::string id_;
  std::optional<ReasoningSplitter> splitter_;
  std::optional<v1::Finished> finished_;
  bool started_ = false;
  std::string reasoning_, content_;
};

}  // namespace

OpenAiApi::OpenAiApi(OpenAiOptions options, Router* router, const WorkerRegistry* registry,
                     const Tokenizer* tokenizer, std::optional<chat::ChatTemplate> chat_template,
                     RouterMetrics* metrics)
    : options_(std::move(options)),
      router_(router),
      registry_(registry),
      tokenizer_(tokenizer),
      chat_template_(std::move(chat_template)),
      metrics_(metrics) {}

OpenAiApi::~OpenAiApi() { Join(); }

void OpenAiApi::Join() {
  std::vector<Worker> workers;
  {
    absl::MutexLock lock(&mu_);
    workers.swap(workers_);
  }
  for (Worker& w : workers) w.thread.join();
}

void OpenAiApi::Handle(http::Request request, std::shared_ptr<http::Responder> responder) {
  const auto error = [&](int status, absl::string_view message) {
    responder->Send(status, "application/json", ErrorBody(status, message));
  };
  struct Route {
    absl::string_view path, method;
  };
  static constexpr Route kRoutes[] = {{"/v1/chat/completions", "POST"},
                                      {"/v1/completions", "POST"},
                                      {"/v1/models", "GET"},
                                      {"/health", "GET"},
                                      {"/metrics", "GET"}};
  for (const Route& r : kRoutes) {
    if (request.path != r.path) continue;
    if (request.method != r.method) {
      return error(405, absl::StrCat("method ", request.method, " not allowed on ", r.path,
                                     " (use ", r.method, ")"));
    }
    if (r.path == "/v1/models") return Models(responder);
    if (r.path == "/health") return Health(responder);
    if (r.path == "/metrics") {
      if (metrics_ == nullptr) return error(404, "this server keeps no metrics");
      return responder->Send(200, "text/plain; version=0.0.4; charset=utf-8",
                             metrics_->Scrape(*router_));
    }
    return Completions(request, std::move(responder), r.path == "/v1/chat/completions");
  }
  error(404, absl::StrCat("no such endpoint: ", request.method, " ", request.path,
                          " (POST /v1/chat/completions, POST /v1/completions, GET /v1/models, "
                          "GET /health, GET /metrics)"));
}

void OpenAiApi::Health(const std::shared_ptr<http::Responder>& responder) const {
  if (router_->Serving()) {
    responder->Send(200, "application/json", Dump(json{{"status", "ok"}}));
    return;
  }
  const bool decode_live = registry_ != nullptr && !registry_->Live(WorkerKind::kDecode).empty();
  responder->Send(503, "application/json",
                  ErrorBody(503,
                            decode_live ? "the router is draining (shutting down)"
                                        : "no live decode worker (none has registered with its "
                                          "weights loaded yet, or it died)",
                            "", "not_serving"));
}

void OpenAiApi::Models(const std::shared_ptr<http::Responder>& responder) const {
  json model = {{"id", options_.model_id},
                {"object", "model"},
                {"created", options_.created},
                {"owned_by", "hybridmoe"},
                {"max_model_len", options_.context_length}};
  responder->Send(200, "application/json",
                  Dump(json{{"object", "list"}, {"data", json::array({std::move(model)})}}));
}

void OpenAiApi::Completions(const http::Request& request,
                            std::shared_ptr<http::Responder> responder, bool chat) {
  // Parsing, tokenizing and generating all run on the request's own thread: a long prompt never
  // holds an I/O thread.
  auto done = std::make_shared<std::atomic<bool>>(false);
  std::thread thread([this, body = request.body, responder = std::move(responder), chat,
                      done]() mutable {
    json parsed = json::parse(body, nullptr, /*allow_exceptions=*/false);
    if (parsed.is_discarded()) {
      // Tell invalid UTF-8 apart from other syntax errors.
      std::string what = "malformed JSON";
      try {
        const json ignored = json::parse(body);
      } catch (const nlohmann::json::parse_error& e) {
        what = absl::StrCat("malformed JSON: ", e.what());
      }
      responder->Send(400, "application/json", ErrorBody(400, what));
    } else if (!parsed.is_object()) {
      responder->Send(400, "application/json",
                      ErrorBody(400, absl::StrCat("the request body must be a JSON object, got ",
                                                  TypeName(parsed))));
    } else {
      std::string param;
      absl::StatusOr<Translated> t = Translate(parsed, chat, &param);
      if (!t.ok()) {
        const int status = HttpStatusOf(t.status().code());
        responder->Send(status, "application/json",
                        ErrorBody(status, t.status().message(), param,
                                  absl::IsNotFound(t.status()) ? "model_not_found"
                                  : absl::StrContains(t.status().message(), "context length")
                                      ? "context_length_exceeded"
                                      : ""));
      } else {
        RunGeneration(*std::move(t), std::move(responder));
      }
    }
    done->store(true);
  });
  absl::MutexLock lock(&mu_);
  // Reap finished threads.
  for (auto it = workers_.begin(); it != workers_.end();) {
    if (it->done->load()) {
      it->thread.join();
      it = workers_.erase(it);
    } else {
      ++it;
    }
  }
  workers_.push_back({std::move(thread), std::move(done)});
}

void OpenAiApi::RunGeneration(Translated translated, std::shared_ptr<http::Responder> responder) {
  HttpSink sink(translated, responder, absl::ToUnixSeconds(absl::Now()));
  const absl::Status status =
      metrics_ != nullptr
          ? metrics_->Generate(router_, translated.request, absl::InfiniteFuture(), &sink)
          : router_->Generate(translated.request, absl::InfiniteFuture(), &sink);
  sink.Finish(status);
}

absl::StatusOr<OpenAiApi::Translated> OpenAiApi::Translate(const json& body, bool chat,
                                                           std::string* param) const {
  const FieldError bad{param};
  Translated t;
  t.chat = chat;
  t.model = options_.model_id;
  v1::GenerateRequest& r = t.request;

  if (const json* model = Field(body, "model"); model != nullptr) {
    if (!model->is_string()) {
      return bad("model", absl::StrCat("expected a string, got ", TypeName(*model)));
    }
    const std::string name = model->get<std::string>();
    if (name != options_.model_id &&
        std::find(options_.model_aliases.begin(), options_.model_aliases.end(), name) ==
            options_.model_aliases.end()) {
      *param = "model";
      return absl::NotFoundError(absl::StrCat("the model '", name,
                                              "' does not exist; this server serves '",
                                              options_.model_id, "' (GET /v1/models)"));
    }
    t.model = name;
  }

  // Parameters the engine cannot honour: a clear 400 rather than a silent difference.
  std::optional<int64_t> n;
  HMOE_RETURN_IF_ERROR(GetInt(body, "n", bad, &n));
  if (n.has_value() && *n != 1) return bad("n", absl::StrCat("only n = 1 is supported, got ", *n));
  if (const json* bias = Field(body, "logit_bias"); bias != nullptr) {
    if (!bias->is_object()) {
      return bad("logit_bias", absl::StrCat("expected an object, got ", TypeName(*bias)));
    }
    if (!bias->empty()) return bad("logit_bias", "not supported by this server");
  }
  std::optional<double> frequency_penalty;
  HMOE_RETURN_IF_ERROR(GetNumber(body, "frequency_penalty", bad, &frequency_penalty));
  if (frequency_penalty.value_or(0) != 0) {
    return bad("frequency_penalty",
               "not supported by this engine (use presence_penalty or repetition_penalty)");
  }
  for (absl::string_view unsupported : {"logprobs", "echo", "best_of", "suffix"}) {
    const json* v = Field(body, unsupported);
    if (v != nullptr && !(v->is_boolean() && !v->get<bool>()) &&
        !(unsupported == "best_of" && v->is_number() && v->get<double>() == 1)) {
      return bad(unsupported, "not supported by this server");
    }
  }
  if (const json* top_logprobs = Field(body, "top_logprobs"); top_logprobs != nullptr) {
    return bad("top_logprobs", "not supported by this server");
  }
  if (const json* user = Field(body, "user"); user != nullptr && !user->is_string()) {
    return bad("user", absl::StrCat("expected a string, got ", TypeName(*user)));
  }

  HMOE_RETURN_IF_ERROR(GetBool(body, "stream", bad, &t.stream));
  if (const json* so = Field(body, "stream_options"); so != nullptr) {
    if (!so->is_object()) {
      return bad("stream_options", absl::StrCat("expected an object, got ", TypeName(*so)));
    }
    if (const json* iu = Field(*so, "include_usage"); iu != nullptr) {
      if (!iu->is_boolean()) {
        return bad("stream_options.include_usage",
                   absl::StrCat("expected a boolean, got ", TypeName(*iu)));
      }
      t.include_usage = iu->get<bool>();
    }
  }

  // Sampling: OpenAI's defaults (temperature 1), the engine's names.
  v1::SamplingParams* s = r.mutable_sampling();
  std::optional<double> temperature, top_p, min_p, repetition_penalty, presence_penalty;
  std::optional<int64_t> top_k, seed;
  HMOE_RETURN_IF_ERROR(GetNumber(body, "temperature", bad, &temperature));
  HMOE_RETURN_IF_ERROR(GetNumber(body, "top_p", bad, &top_p));
  HMOE_RETURN_IF_ERROR(GetNumber(body, "min_p", bad, &min_p));
  HMOE_RETURN_IF_ERROR(GetNumber(body, "repetition_penalty", bad, &repetition_penalty));
  HMOE_RETURN_IF_ERROR(GetNumber(body, "presence_penalty", bad, &presence_penalty));
  HMOE_RETURN_IF_ERROR(GetInt(body, "top_k", bad, &top_k));
  HMOE_RETURN_IF_ERROR(GetInt(body, "seed", bad, &seed));
  s->set_temperature(static_cast<float>(temperature.value_or(1.0)));
  // top_p 1 keeps every token: the engine's "off".
  if (top_p.has_value() && *top_p != 1.0) s->set_top_p(static_cast<float>(*top_p));
  if (top_p.has_value() && *top_p == 0) return bad("top_p", "must be in (0, 1], got 0");
  s->set_min_p(static_cast<float>(min_p.value_or(0)));
  s->set_repetition_penalty(static_cast<float>(repetition_penalty.value_or(0)));
  s->set_presence_penalty(static_cast<float>(presence_penalty.value_or(0)));
  if (top_k.has_value()) {
    // -1 is the usual "off" (vLLM); the engine's is 0.
    if (*top_k < -1 || *top_k > std::numeric_limits<int32_t>::max()) {
      return bad("top_k", absl::StrCat("must be -1 (off), 0 (off) or positive, got ", *top_k));
    }
    s->set_top_k(*top_k == -1 ? 0 : static_cast<int32_t>(*top_k));
  }
  if (seed.has_value()) s->set_seed(static_cast<uint64_t>(*seed));

  bool ignore_eos = false;
  HMOE_RETURN_IF_ERROR(GetBool(body, "ignore_eos", bad, &ignore_eos));
  r.set_ignore_eos(ignore_eos);
  // llama-server's name: false opts out of the prefix cache (docs/api.md "Prefix cache").
  if (Field(body, "cache_prompt") != nullptr) {
    bool cache_prompt = true;
    HMOE_RETURN_IF_ERROR(GetBool(body, "cache_prompt", bad, &cache_prompt));
    r.set_cache_prompt(cache_prompt);
  }

  if (const json* stop = Field(body, "stop"); stop != nullptr) {
    std::vector<std::string> stops;
    if (stop->is_string()) {
      stops.push_back(stop->get<std::string>());
    } else if (stop->is_array()) {
      for (const json& e : *stop) {
        if (!e.is_string()) {
          return bad("stop", absl::StrCat("expected strings, got a ", TypeName(e)));
        }
        stops.push_back(e.get<std::string>());
      }
    } else {
      return bad("stop",
                 absl::StrCat("expected a string or a list of strings, got ", TypeName(*stop)));
    }
    for (std::string& st : stops) {
      if (st.empty()) return bad("stop", "empty stop string");
      r.add_stop_strings(std::move(st));
    }
  }

  std::optional<int64_t> max_tokens;
  const absl::string_view max_field = chat && Field(body, "max_completion_tokens") != nullptr
                                          ? "max_completion_tokens"
                                          : "max_tokens";
  HMOE_RETURN_IF_ERROR(GetInt(body, max_field, bad, &max_tokens));
  if (max_tokens.has_value() &&
      (*max_tokens < 1 || *max_tokens > std::numeric_limits<int32_t>::max())) {
    return bad(max_field, absl::StrCat("must be >= 1, got ", *max_tokens));
  }
  const int64_t context = options_.context_length;

  if (chat) {
    const json* messages = Field(body, "messages");
    if (messages == nullptr) return bad("messages", "required");
    if (!messages->is_array()) {
      return bad("messages", absl::StrCat("expected a list, got ", TypeName(*messages)));
    }
    if (messages->empty()) return bad("messages", "empty list");
    if (!chat_template_.has_value()) {
      return bad("messages",
                 absl::StrCat("no chat template",
                              options_.chat_template_error.empty()
                                  ? ""
                                  : absl::StrCat(" (", options_.chat_template_error, ")"),
                              ": start the router with --chat-template FILE, or "
                              "use /v1/completions"));
    }
    if (tokenizer_ == nullptr) {
      return bad("messages", "the router has no tokenizer (start it with --model)");
    }
    chat::ChatRequest cr;
    for (size_t i = 0; i < messages->size(); ++i) {
      const json& m = (*messages)[i];
      const std::string where = absl::StrCat("messages[", i, "]");
      if (!m.is_object()) {
        return bad(where, absl::StrCat("expected an object, got ", TypeName(m)));
      }
      const json* role = Field(m, "role");
      if (role == nullptr || !role->is_string()) {
        return bad(where + ".role", "required string");
      }
      json message = m;
      const json* content = Field(m, "content");
      if (content == nullptr) {
        message["content"] = "";
      } else if (content->is_array()) {
        // The list-of-parts form: text parts, joined with newlines (as vLLM does).
        std::vector<std::string> texts;
        for (size_t j = 0; j < content->size(); ++j) {
          const json& part = (*content)[j];
          const std::string pw = absl::StrCat(where, ".content[", j, "]");
          const json* type = part.is_object() ? Field(part, "type") : nullptr;
          if (type == nullptr || !type->is_string()) return bad(pw + ".type", "required string");
          if (type->get<std::string>() != "text") {
            return bad(pw + ".type", absl::StrCat("only text parts are supported, got '",
                                                  type->get<std::string>(), "'"));
          }
          const json* text = Field(part, "text");
          if (text == nullptr || !text->is_string()) return bad(pw + ".text", "required string");
          texts.push_back(text->get<std::string>());
        }
        message["content"] = absl::StrJoin(texts, "\n");
      } else if (!content->is_string()) {
        return bad(where + ".content",
                   absl::StrCat("expected a string or a list of parts, got ", TypeName(*content)));
      }
      cr.messages.push_back(std::move(message));
    }
    if (const json* tools = Field(body, "tools"); tools != nullptr) {
      if (!tools->is_array()) {
        return bad("tools", absl::StrCat("expected a list, got ", TypeName(*tools)));
      }
      cr.tools = *tools;
    }
    if (const json* kwargs = Field(body, "chat_template_kwargs"); kwargs != nullptr) {
      if (!kwargs->is_object()) {
        return bad("chat_template_kwargs",
                   absl::StrCat("expected an object, got ", TypeName(*kwargs)));
      }
      cr.extra = *kwargs;
    }
    absl::StatusOr<std::string> prompt = chat_template_->Render(cr);
    if (!prompt.ok()) {
      *param = "messages";
      return absl::InvalidArgumentError(
          jinja::IsRaisedByTemplate(prompt.status())
              ? std::string(prompt.status().message())
              : absl::StrCat("messages: the chat template failed: ", prompt.status().message()));
    }
    t.thought_open = PromptOpensThought(*prompt);
    // As transformers' apply_chat_template(tokenize=True): special tokens in the rendered text
    // are tokens (the template writes them), no BOS added (the template writes it).
    const size_t room =
        context > 0 ? static_cast<size_t>(std::max<int64_t>(0, context - max_tokens.value_or(1)))
                    : std::numeric_limits<size_t>::max();
    std::optional<std::vector<int32_t>> ids =
        tokenizer_->EncodeWithin(*prompt, /*add_bos=*/false, /*parse_special=*/true, room);
    if (!ids.has_value()) {
      *param = "messages";
      return absl::InvalidArgumentError(absl::StrCat(
          "messages: the rendered prompt is longer than ", room, " tokens: with ", max_field, " (",
          max_tokens.value_or(1), ") it exceeds the context length ", context));
    }
    if (!max_tokens.has_value()) {
      max_tokens = context > 0 ? context - static_cast<int64_t>(ids->size())
                               : options_.default_chat_max_tokens;
      if (*max_tokens < 1) {
        *param = "messages";
        return absl::InvalidArgumentError(
            absl::StrCat("messages: the rendered prompt (", ids->size(),
                         " tokens) leaves no room in the context length ", context));
      }
    }
    r.mutable_prompt_token_ids()->mutable_ids()->Assign(ids->begin(), ids->end());
  } else {
    const json* prompt = Field(body, "prompt");
    if (prompt == nullptr) return bad("prompt", "required");
    if (prompt->is_string()) {
      r.set_prompt_text(prompt->get<std::string>());
    } else if (prompt->is_array() && prompt->size() == 1 && (*prompt)[0].is_string()) {
      r.set_prompt_text((*prompt)[0].get<std::string>());
    } else if (prompt->is_array() && !prompt->empty() && (*prompt)[0].is_number()) {
      auto* ids = r.mutable_prompt_token_ids()->mutable_ids();
      for (const json& e : *prompt) {
        if (!e.is_number_integer() && !e.is_number_unsigned()) {
          return bad("prompt", "a token-id prompt must be a list of integers");
        }
        const int64_t id = e.get<int64_t>();
        if (id < 0 || id > std::numeric_limits<int32_t>::max()) {
          return bad("prompt", absl::StrCat("token id ", id, " out of range"));
        }
        ids->Add(static_cast<int32_t>(id));
      }
    } else if (prompt->is_array() && prompt->size() > 1) {
      return bad("prompt", "only one prompt per request is supported");
    } else {
      return bad("prompt",
                 absl::StrCat("expected a string or a list of token ids, got ", TypeName(*prompt)));
    }
    if (!max_tokens.has_value()) max_tokens = kDefaultCompletionMaxTokens;
  }
  r.set_max_new_tokens(
      static_cast<int32_t>(std::min<int64_t>(*max_tokens, std::numeric_limits<int32_t>::max())));
  r.set_detokenize(tokenizer_ != nullptr);
  return t;
}

}  // namespace hmoe::router
