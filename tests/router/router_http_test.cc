// The OpenAI HTTP API of hmoe-router (issue 17) against the real router process: the router runs
// with --model on the tiny checkpoint (its tokenizer and chat template) and --http-listen on a
// free port; this test plays the decode worker (proto/decode.proto), which echoes the prompt ids
// back (so a chat answer is the rendered prompt, token for token) or, for max_new_tokens 777,
// streams two tokens and then waits until the router cancels the call. Checks the endpoints,
// streaming, every bad input of docs/api.md's table (each an OpenAI error object, the server
// serving on), and that a client dropping a stream cancels its request on the worker at once.

#include <sys/resource.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <filesystem>
#include <fstream>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include <grpcpp/grpcpp.h>

#include "proto/decode.grpc.pb.h"
#include "proto/hmoe_v1.grpc.pb.h"
#include "proto/worker_registry.grpc.pb.h"
#include "tests/integration/child_process.h"
#include "tests/integration/temp_dir.h"
#include "tests/router/http_client.h"
#include "tools/gguf_model_writer.h"
#include "tools/model_writer.h"

#include "gtest/gtest.h"
#include <nlohmann/json.hpp>

namespace hmoe::router {
namespace {

using ::hmoe::testing::ChildOptions;
using ::hmoe::testing::ChildProcess;
using ::hmoe::testing::HttpCall;
using ::hmoe::testing::HttpConnection;
using ::hmoe::testing::HttpResponse;
using ::hmoe::testing::SseData;
using json = nlohmann::json;
namespace dv1 = hmoe::decode::v1;
namespace rv1 = hmoe::registry::v1;

constexpr char kRouter[] = HMOE_ROUTER_PATH;
constexpr int32_t kHangingMaxTokens = 777;
constexpr int32_t kEndlessMaxTokens = 779;

class FakeDecodeService final : public dv1::DecodeService::Service {
 public:
  grpc::Status Admit(grpc::ServerContext* context, const dv1::AdmitRequest* request,
                     grpc::ServerWriter<dv1::AdmitResponse>* writer) override {
    dv1::AdmitResponse r;
    if (request->max_new_tokens() == kHangingMaxTokens) {
      for (int i = 0; i < 2; ++i) {
        r.mutable_token()->set_token_id(request->prompt_token_ids(0));
        r.mutable_token()->set_index(i);
        writer->Write(r);
      }
      hanging_.Notify();
      while (!context->IsCancelled()) absl::SleepFor(absl::Milliseconds(2));
      cancelled_.Notify();
      return grpc::Status(grpc::StatusCode::CANCELLED, "cancelled");
    }
    if (request->max_new_tokens() == kEndlessMaxTokens) {
      // Tokens (each one decode step) for as long as the router keeps the call.
      int64_t i = 0;
      for (; !context->IsCancelled(); ++i) {
        r.mutable_token()->set_token_id(request->prompt_token_ids(0));
        r.mutable_token()->set_index(static_cast<int32_t>(i));
        if (!writer->Write(r)) break;
        if (i == 0) endless_started_.Notify();
      }
      endless_tokens_ = i;
      endless_cancelled_.Notify();
      return grpc::Status(grpc::StatusCode::CANCELLED, "cancelled");
    }
    const int n = std::min(request->prompt_token_ids_size(), request->max_new_tokens());
    for (int i = 0; i < n; ++i) {
      r.mutable_token()->set_token_id(request->prompt_token_ids(i));
      r.mutable_token()->set_index(i);
      writer->Write(r);
    }
    r.mutable_finished()->set_reason(n < request->max_new_tokens() ? dv1::FINISH_REASON_EOS
                                                                   : dv1::FINISH_REASON_LENGTH);
    r.mutable_finished()->set_stop_token_id(-1);
    r.mutable_finished()->mutable_usage()->set_completion_tokens(n);
    // A prefix cache that holds all but the last prompt token, unless the request opts out.
    r.mutable_finished()->mutable_usage()->set_cached_tokens(
        request->no_prefix_cache() ? 0 : request->prompt_token_ids_size() - 1);
    writer->Write(r);
    return grpc::Status::OK;
  }

  absl::Notification hanging_, cancelled_;
  absl::Notification endless_started_, endless_cancelled_;
  std::atomic<int64_t> endless_tokens_{0};
};

struct Shared {
  ::hmoe::testing::TempDir temp{"hmoe_router_http"};
  std::string model;
};
Shared* g_shared = nullptr;

class RouterHttpTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    g_shared = new Shared();
    g_shared->model = g_shared->temp.path() + "/tiny";
    absl::StatusOr<ModelPreset> preset = GetPreset("tiny");
    ASSERT_TRUE(preset.ok());
    ASSERT_TRUE(WriteModel(*preset, g_shared->model, {}).ok());
  }
  static void TearDownTestSuite() {
    delete g_shared;
    g_shared = nullptr;
  }

  void SetUp() override {
    ASSERT_NE(g_shared, nullptr);
    dir_ = g_shared->temp.path() + "/" +
           ::testing::UnitTest::GetInstance()->current_test_info()->name();
    std::filesystem::create_directories(dir_);
    std::filesystem::permissions(dir_, std::filesystem::perms::owner_all);
  }

  void TearDown() override {
    if (router_ != nullptr) {
      absl::StatusOr<int> code = router_->Terminate(std::chrono::seconds(30));
      EXPECT_TRUE(code.ok()) << code.status();
      EXPECT_EQ(code.value_or(-1), 0) << router_->ReadStderr();
    }
    if (worker_ != nullptr) worker_->Shutdown();
  }

  // Starts the router; returns the HTTP port (0 on failure).
  int StartRouter(std::vector<std::string> flags = {}) {
    ChildOptions o;
    o.argv = {kRouter,
              "--listen=127.0.0.1:0",
              "--model=" + g_shared->model,
              "--port_file=" + dir_ + "/port",
              "--registry_socket=" + dir_ + "/sockets/registry.sock",
              "--heartbeat_timeout_ms=600000",
              "--drain_seconds=5",
              "--http_listen=127.0.0.1:0",
              "--http_port_file=" + dir_ + "/http_port",
              "--http_read_timeout_ms=1000"};
    o.argv.insert(o.argv.end(), flags.begin(), flags.end());
    o.stderr_path = dir_ + "/router.err";
    absl::StatusOr<ChildProcess> router = ChildProcess::Start(std::move(o));
    EXPECT_TRUE(router.ok()) << router.status();
    if (!router.ok()) return 0;
    router_ = std::make_unique<ChildProcess>(*std::move(router));
    if (!router_->WaitForOutput("SERVING", std::chrono::seconds(30), true).ok()) {
      ADD_FAILURE() << router_->ReadStderr();
      return 0;
    }
    int port = 0;
    std::ifstream(dir_ + "/port") >> grpc_port_;
    std::ifstream(dir_ + "/http_port") >> port;
    return port;
  }

  // Serves the fake decode worker and registers it with the router.
  void RegisterWorker() {
    const std::string socket = dir_ + "/sockets/decode.sock";
    grpc::ServerBuilder builder;
    builder.AddListeningPort("unix:" + socket, grpc::InsecureServerCredentials());
    builder.RegisterService(&fake_);
    worker_ = builder.BuildAndStart();
    ASSERT_NE(worker_, nullptr);
    auto registry = rv1::WorkerRegistry::NewStub(grpc::CreateChannel(
        "unix:" + dir_ + "/sockets/registry.sock", grpc::InsecureChannelCredentials()));
    rv1::RegisterRequest reg;
    reg.set_worker_id("fake-decode");
    reg.set_kind(rv1::WORKER_KIND_DECODE);
    reg.set_endpoint("unix:" + socket);
    reg.set_device("cpu");
    reg.set_pid(getpid());
    grpc::ClientContext ctx;
    ctx.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(10)));
    rv1::RegisterResponse response;
    ASSERT_TRUE(registry->Register(&ctx, reg, &response).ok());
  }

  hmoe::v1::RouterStatus GetStatus() {
    auto stub = hmoe::v1::Hmoe::NewStub(grpc::CreateChannel(absl::StrCat("127.0.0.1:", grpc_port_),
                                                            grpc::InsecureChannelCredentials()));
    grpc::ClientContext ctx;
    ctx.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(10)));
    hmoe::v1::RouterStatus status;
    EXPECT_TRUE(stub->GetStatus(&ctx, {}, &status).ok());
    return status;
  }

  std::string dir_;
  int grpc_port_ = 0;
  FakeDecodeService fake_;
  std::unique_ptr<grpc::Server> worker_;
  std::unique_ptr<ChildProcess> router_;
};

json Parse(const std::string& body) { return json::parse(body, nullptr, false); }

// The response is an OpenAI error object with `status`; returns it.
json ExpectError(const HttpResponse& r, int status, const std::string& what) {
  EXPECT_EQ(r.status, status) << what << ": " << r.body;
  json j = Parse(r.body);
  EXPECT_TRUE(j.is_object() && j.contains("error")) << what << ": " << r.body;
  if (!j.is_object() || !j.contains("error")) return json::object();
  const json& e = j["error"];
  EXPECT_TRUE(e.contains("message") && e["message"].is_string() &&
              !e["message"].get<std::string>().empty())
      << what;
  EXPECT_TRUE(e.contains("type") && e["type"].is_string()) << what;
  EXPECT_TRUE(e.contains("param")) << what;
  EXPECT_TRUE(e.contains("code")) << what;
  return e;
}

const char kChat[] = R"({"model":"tiny","messages":[{"role":"user","content":"Hello there"}],
  "max_tokens":200,"temperature":0})";

TEST_F(RouterHttpTest, HealthModelsChatAndCompletions) {
  const int port = StartRouter();
  ASSERT_GT(port, 0);
  // No decode worker yet: 503 with the reason.
  json e = ExpectError(HttpCall(port, "GET", "/health"), 503, "health without a worker");
  EXPECT_TRUE(absl::StrContains(e["message"].get<std::string>(), "no live decode worker"));
  RegisterWorker();
  HttpResponse r = HttpCall(port, "GET", "/health");
  EXPECT_EQ(r.status, 200) << r.body;

  r = HttpCall(port, "GET", "/v1/models");
  ASSERT_EQ(r.status, 200) << r.body;
  json models = Parse(r.body);
  ASSERT_EQ(models["data"].size(), 1u);
  EXPECT_EQ(models["data"][0]["id"], "tiny");
  EXPECT_EQ(models["object"], "list");

  // The echo worker returns the prompt: the answer is the rendered chat template.
  r = HttpCall(port, "POST", "/v1/chat/completions", kChat);
  ASSERT_EQ(r.status, 200) << r.body;
  json chat = Parse(r.body);
  EXPECT_EQ(chat["object"], "chat.completion");
  EXPECT_TRUE(absl::StartsWith(chat["id"].get<std::string>(), "chatcmpl-"));
  EXPECT_EQ(chat["model"], "tiny");
  EXPECT_EQ(chat["choices"][0]["message"]["role"], "assistant");
  EXPECT_EQ(chat["choices"][0]["message"]["content"],
            "<｜begin▁of▁sentence｜><｜User｜>Hello there<｜Assistant｜>");
  EXPECT_EQ(chat["choices"][0]["finish_reason"], "stop");
  const int prompt_tokens = chat["usage"]["prompt_tokens"];
  EXPECT_GT(prompt_tokens, 3);
  EXPECT_EQ(chat["usage"]["completion_tokens"], prompt_tokens);
  EXPECT_EQ(chat["usage"]["total_tokens"], 2 * prompt_tokens);
  EXPECT_EQ(chat["usage"]["prompt_tokens_details"]["cached_tokens"], prompt_tokens - 1);
  // "cache_prompt": false reaches the decode worker as no_prefix_cache.
  {
    json off = Parse(kChat);
    off["cache_prompt"] = false;
    HttpResponse o = HttpCall(port, "POST", "/v1/chat/completions", off.dump());
    ASSERT_EQ(o.status, 200) << o.body;
    EXPECT_EQ(Parse(o.body)["usage"]["prompt_tokens_details"]["cached_tokens"], 0) << o.body;
  }

  // Streaming: a role chunk, content deltas that add up to the same text, the finish reason, the
  // usage chunk, [DONE].
  json body = Parse(kChat);
  body["stream"] = true;
  body["stream_options"] = {{"include_usage", true}};
  r = HttpCall(port, "POST", "/v1/chat/completions", body.dump());
  ASSERT_EQ(r.status, 200) << r.body;
  EXPECT_TRUE(absl::StartsWith(r.Header("content-type"), "text/event-stream"));
  std::vector<std::string> events = SseData(r.body);
  ASSERT_GE(events.size(), 4u) << r.body;
  EXPECT_EQ(events.back(), "[DONE]");
  std::string text;
  std::string finish;
  bool saw_usage = false;
  for (size_t i = 0; i + 1 < events.size(); ++i) {
    json c = Parse(events[i]);
    ASSERT_FALSE(c.is_discarded()) << events[i];
    EXPECT_EQ(c["object"], "chat.completion.chunk");
    if (i == 0) {
      EXPECT_EQ(c["choices"][0]["delta"]["role"], "assistant");
    }
    if (c["choices"].empty()) {
      saw_usage = true;
      EXPECT_EQ(c["usage"]["completion_tokens"], prompt_tokens);
      continue;
    }
    if (c["choices"][0]["delta"].contains("content")) {
      text += c["choices"][0]["delta"]["content"].get<std::string>();
    }
    if (!c["choices"][0]["finish_reason"].is_null()) finish = c["choices"][0]["finish_reason"];
  }
  EXPECT_EQ(text, chat["choices"][0]["message"]["content"]);
  EXPECT_EQ(finish, "stop");
  EXPECT_TRUE(saw_usage);

  // The list-of-parts form renders the same.
  json parts = Parse(kChat);
  parts["messages"][0]["content"] = json::array({{{"type", "text"}, {"text", "Hello there"}}});
  r = HttpCall(port, "POST", "/v1/chat/completions", parts.dump());
  ASSERT_EQ(r.status, 200) << r.body;
  EXPECT_EQ(Parse(r.body)["choices"][0]["message"]["content"],
            chat["choices"][0]["message"]["content"]);

  // Completions: the text is encoded as plain text with BOS (as gRPC's prompt_text); the echo
  // returns the text with the BOS token's text in front. max_tokens 3 cuts it: "length".
  r = HttpCall(port, "POST", "/v1/completions",
               R"({"prompt":"The quick brown fox","max_tokens":100})");
  ASSERT_EQ(r.status, 200) << r.body;
  json completion = Parse(r.body);
  EXPECT_EQ(completion["object"], "text_completion");
  EXPECT_EQ(completion["choices"][0]["text"], "<｜begin▁of▁sentence｜>The quick brown fox");
  r = HttpCall(port, "POST", "/v1/completions",
               R"({"prompt":"The quick brown fox","max_tokens":2,"stream":true})");
  ASSERT_EQ(r.status, 200) << r.body;
  events = SseData(r.body);
  ASSERT_GE(events.size(), 2u);
  EXPECT_EQ(events.back(), "[DONE]");
  EXPECT_EQ(Parse(events[events.size() - 2])["choices"][0]["finish_reason"], "length");

  // Prometheus metrics: the six requests above counted, their TTFT observed.
  r = HttpCall(port, "GET", "/metrics");
  ASSERT_EQ(r.status, 200);
  EXPECT_TRUE(absl::StartsWith(r.Header("content-type"), "text/plain; version=0.0.4"));
  EXPECT_TRUE(absl::StrContains(r.body, "hmoe_requests_total{outcome=\"ok\",path=\"chunked\"} 6"))
      << r.body;
  EXPECT_TRUE(absl::StrContains(r.body, "hmoe_time_to_first_token_seconds_count 6")) << r.body;
  EXPECT_TRUE(absl::StrContains(r.body, "hmoe_worker_up{kind=\"decode\",worker=\"fake-decode\"} 1"))
      << r.body;
  EXPECT_TRUE(absl::StrContains(
      r.body, "hmoe_worker_prefix_cache_tokens{kind=\"decode\",worker=\"fake-decode\"} 0"))
      << r.body;

  // Keep-alive: two requests on one connection.
  HttpConnection c(port);
  ASSERT_TRUE(c.SendRequest("GET", "/v1/models", ""));
  EXPECT_EQ(c.ReadResponse().status, 200);
  ASSERT_TRUE(c.SendRequest("POST", "/v1/chat/completions", kChat));
  EXPECT_EQ(c.ReadResponse().status, 200);
}

// --model FILE.gguf (issue 18): the limits, tokenizer and chat template come from the GGUF's
// metadata and behave as the checkpoint directory's (the GGUF of tiny is written from the same
// tokenizer.json and tokenizer_config.json).
TEST_F(RouterHttpTest, AGgufModelGivesTheTokenizerAndChatTemplateOfItsMetadata) {
  absl::StatusOr<ModelPreset> preset = GetPreset("tiny");
  ASSERT_TRUE(preset.ok());
  ASSERT_TRUE(WriteGgufModel(*preset, dir_ + "/gguf", GgufWriteOptions{}).ok());
  const int port = StartRouter({"--model=" + dir_ + "/gguf/model.gguf"});
  ASSERT_GT(port, 0);
  RegisterWorker();
  HttpResponse r = HttpCall(port, "GET", "/v1/models");
  ASSERT_EQ(r.status, 200) << r.body;
  EXPECT_EQ(Parse(r.body)["data"][0]["id"], "model.gguf");
  EXPECT_EQ(Parse(r.body)["data"][0]["max_model_len"], preset->config.max_position_embeddings);
  json chat = Parse(kChat);
  chat["model"] = "model.gguf";
  r = HttpCall(port, "POST", "/v1/chat/completions", chat.dump());
  ASSERT_EQ(r.status, 200) << r.body;
  EXPECT_EQ(Parse(r.body)["choices"][0]["message"]["content"],
            "<｜begin▁of▁sentence｜><｜User｜>Hello there<｜Assistant｜>");
  r = HttpCall(port, "POST", "/v1/completions",
               R"({"prompt":"The quick brown fox","max_tokens":100})");
  ASSERT_EQ(r.status, 200) << r.body;
  EXPECT_EQ(Parse(r.body)["choices"][0]["text"], "<｜begin▁of▁sentence｜>The quick brown fox");
}

// A template whose generation prompt opens <think>: the echoed prompt is "thought" up to the
// </think> the user wrote, and the answer after it (whitespace after the tag dropped).
TEST_F(RouterHttpTest, ThinkingTemplateSplitsReasoningContent) {
  const std::string file = dir_ + "/thinking.jinja";
  std::ofstream(file) << "{{ bos_token }}{% for m in messages %}<｜User｜>{{ m['content'] }}"
                         "{% endfor %}<｜Assistant｜><think>\n";
  const int port = StartRouter({"--chat_template=" + file});
  ASSERT_GT(port, 0);
  RegisterWorker();
  json body = {{"messages", {{{"role", "user"}, {"content", "plan</think> \n answer"}}}},
               {"max_tokens", 100}};
  HttpResponse r = HttpCall(port, "POST", "/v1/chat/completions", body.dump());
  ASSERT_EQ(r.status, 200) << r.body;
  const json message = Parse(r.body)["choices"][0]["message"];
  EXPECT_EQ(message["reasoning_content"], "<｜begin▁of▁sentence｜><｜User｜>plan");
  // (Jinja drops the template's single trailing newline.)
  EXPECT_EQ(message["content"], "answer<｜Assistant｜><think>");

  body["stream"] = true;
  r = HttpCall(port, "POST", "/v1/chat/completions", body.dump());
  ASSERT_EQ(r.status, 200) << r.body;
  std::string reasoning, content;
  for (const std::string& e : SseData(r.body)) {
    if (e == "[DONE]") continue;
    const json delta = Parse(e)["choices"][0]["delta"];
    if (delta.contains("reasoning_content")) reasoning += delta["reasoning_content"];
    if (delta.contains("content")) content += delta["content"];
  }
  EXPECT_EQ(reasoning, message["reasoning_content"]);
  EXPECT_EQ(content, message["content"]);
}

TEST_F(RouterHttpTest, BadInputGetsOpenAiErrorsAndTheServerServesOn) {
  const int port = StartRouter();
  ASSERT_GT(port, 0);
  RegisterWorker();
  struct Case {
    std::string what, method, path, body;
    int status;
    std::string param;  // "" : null
    std::string in_message;
    std::string code = "";
  };
  std::string long_text;
  for (int i = 0; i < 3000; ++i) long_text += "word ";
  const std::vector<Case> cases = {
      {"malformed JSON", "POST", "/v1/chat/completions", "{\"messages\": [", 400, "",
       "malformed JSON"},
      {"not an object", "POST", "/v1/chat/completions", "[1,2]", 400, "", "JSON object"},
      {"wrong type", "POST", "/v1/chat/completions",
       R"({"messages":[{"role":"user","content":"hi"}],"temperature":"hot"})", 400, "temperature",
       "expected a number"},
      {"cache_prompt not a boolean", "POST", "/v1/chat/completions",
       R"({"messages":[{"role":"user","content":"hi"}],"cache_prompt":"yes"})", 400, "cache_prompt",
       "expected a boolean"},
      {"wrong content type", "POST", "/v1/chat/completions",
       R"({"messages":[{"role":"user","content":5}]})", 400, "messages[0].content",
       "expected a string or a list of parts"},
      {"no messages", "POST", "/v1/chat/completions", R"({"model":"tiny"})", 400, "messages",
       "required"},
      {"empty messages", "POST", "/v1/chat/completions", R"({"messages":[]})", 400, "messages",
       "empty"},
      {"unknown model", "POST", "/v1/chat/completions",
       R"({"model":"gpt-5","messages":[{"role":"user","content":"hi"}]})", 404, "model",
       "does not exist", "model_not_found"},
      {"n > 1", "POST", "/v1/chat/completions",
       R"({"n":2,"messages":[{"role":"user","content":"hi"}]})", 400, "n", "only n = 1"},
      {"logit_bias", "POST", "/v1/chat/completions",
       R"({"logit_bias":{"5":10},"messages":[{"role":"user","content":"hi"}]})", 400, "logit_bias",
       "not supported"},
      {"frequency_penalty", "POST", "/v1/chat/completions",
       R"({"frequency_penalty":0.5,"messages":[{"role":"user","content":"hi"}]})", 400,
       "frequency_penalty", "not supported"},
      {"top_p out of range (the router's validation)", "POST", "/v1/chat/completions",
       R"({"top_p":1.5,"messages":[{"role":"user","content":"hi"}]})", 400, "top_p",
       "sampling.top_p"},
      {"prompt over the context", "POST", "/v1/chat/completions",
       json{{"messages", {{{"role", "user"}, {"content", long_text}}}}}.dump(), 400, "messages",
       "context length", "context_length_exceeded"},
      {"completion prompt over the context", "POST", "/v1/completions",
       json{{"prompt", long_text}}.dump(), 400, "prompt", "context length",
       "context_length_exceeded"},
      {"negative max_tokens", "POST", "/v1/chat/completions",
       R"({"max_tokens":-1,"messages":[{"role":"user","content":"hi"}]})", 400, "max_tokens",
       ">= 1"},
      {"invalid UTF-8", "POST", "/v1/chat/completions",
       "{\"messages\":[{\"role\":\"user\",\"content\":\"\xff\xfe\"}]}", 400, "", "UTF-8"},
      {"no prompt", "POST", "/v1/completions", R"({"max_tokens":3})", 400, "prompt", "required"},
      {"wrong method", "GET", "/v1/chat/completions", "", 405, "", "use POST"},
      {"wrong path", "POST", "/v1/embeddings", "{}", 404, "", "no such endpoint"},
  };
  for (const Case& c : cases) {
    json e = ExpectError(HttpCall(port, c.method, c.path, c.body), c.status, c.what);
    if (e.empty()) continue;
    EXPECT_EQ(e["param"], c.param.empty() ? json(nullptr) : json(c.param)) << c.what;
    EXPECT_EQ(e["code"], c.code.empty() ? json(nullptr) : json(c.code)) << c.what;
    EXPECT_TRUE(absl::StrContains(e["message"].get<std::string>(), c.in_message))
        << c.what << ": " << e["message"];
  }

  // A 10 MB body: 413 (the limit is --max-request-bytes, 4 MiB), the connection closed.
  {
    HttpConnection c(port);
    std::string big =
        R"({"messages":[{"role":"user","content":")" + std::string(10 << 20, 'a') + "\"}]}";
    c.SendRequest("POST", "/v1/chat/completions", big);
    HttpResponse r = c.ReadResponse();
    json e = ExpectError(r, 413, "10 MB body");
    EXPECT_TRUE(absl::StrContains(r.body, "over the limit")) << r.body;
  }
  // HTTP/1.0: 505.
  {
    HttpConnection c(port);
    c.SendRequest("GET", "/v1/models", "", "HTTP/1.0");
    ExpectError(c.ReadResponse(), 505, "HTTP/1.0");
  }
  // Headers never finished: answered 408 and closed after --http-read-timeout-ms (1 s here).
  {
    HttpConnection c(port);
    ASSERT_TRUE(c.Send("POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Le"));
    HttpResponse r = c.ReadResponse();
    ExpectError(r, 408, "unfinished headers");
    EXPECT_TRUE(c.WaitClosed());
  }
  // 500 idle connections: a request on a 501st is served.
  {
    rlimit lim;
    getrlimit(RLIMIT_NOFILE, &lim);
    ASSERT_GE(lim.rlim_cur, 700u) << "raise ulimit -n";
    std::vector<std::unique_ptr<HttpConnection>> idle;
    for (int i = 0; i < 500; ++i) {
      idle.push_back(std::make_unique<HttpConnection>(port));
      ASSERT_TRUE(idle.back()->ok());
    }
    HttpResponse r = HttpCall(port, "POST", "/v1/chat/completions", kChat);
    EXPECT_EQ(r.status, 200) << r.body;
  }
  // Still serving after all of it.
  EXPECT_EQ(HttpCall(port, "POST", "/v1/chat/completions", kChat).status, 200);
  EXPECT_EQ(HttpCall(port, "GET", "/health").status, 200);
}

// "Within one decode step" (issue 17 acceptance 4): the fake worker streams 2 tokens and then
// makes no further decode step until it is cancelled, and the router's cancellation poll is set to
// 10 minutes: the worker call can only be broken by the HTTP server telling the router that the
// client left (ServerOptions::on_client_gone -> Router::CheckCancellations), i.e. with zero decode
// steps between the disconnect and the freed slot. Were cancellation deferred to the next token or
// the poll, the worker would never see it and the test would fail at its 30 s wait.
TEST_F(RouterHttpTest, DroppingAStreamCancelsItsRequestAtOnce) {
  const int port = StartRouter({"--cancel_poll_ms=600000"});
  ASSERT_GT(port, 0);
  RegisterWorker();
  HttpConnection c(port);
  ASSERT_TRUE(c.SendRequest(
      "POST", "/v1/completions",
      absl::StrCat(R"({"prompt":[5,6,7],"stream":true,"max_tokens":)", kHangingMaxTokens, "}")));
  HttpResponse head;
  ASSERT_TRUE(c.ReadHead(&head));
  ASSERT_EQ(head.status, 200);
  // Two tokens arrive; then the worker holds the request.
  int tokens = 0;
  while (tokens < 2) {
    bool end = false;
    const std::string chunk = c.ReadChunk(&end);
    ASSERT_FALSE(end);
    for (const std::string& e : SseData(chunk)) tokens += e != "[DONE]";
  }
  ASSERT_TRUE(fake_.hanging_.WaitForNotificationWithTimeout(absl::Seconds(30)));
  EXPECT_EQ(GetStatus().inflight(), 1);
  c.Close();
  // The router sees the connection close and cancels the worker call (the slot is freed).
  ASSERT_TRUE(fake_.cancelled_.WaitForNotificationWithTimeout(absl::Seconds(30)));
  int inflight = -1;
  for (int i = 0; i < 500 && inflight != 0; ++i) {
    inflight = GetStatus().inflight();
    if (inflight != 0) absl::SleepFor(absl::Milliseconds(10));
  }
  EXPECT_EQ(inflight, 0);
  EXPECT_EQ(GetStatus().requests_failed(), 0);
  // And serves on.
  EXPECT_EQ(HttpCall(port, "POST", "/v1/chat/completions", kChat).status, 200);
}

// A client that opens a stream and never reads (a 4 KiB receive buffer) while its worker produces
// tokens without end: the other streams complete meanwhile, and once --http_max_queued_bytes wait
// unsent for it the router closes its connection and cancels its request (a log line names it),
// freeing the slot.
TEST_F(RouterHttpTest, ASlowReaderIsCancelledAndNeverBlocksOtherStreams) {
  const int port = StartRouter({"--http_max_queued_bytes=65536"});
  ASSERT_GT(port, 0);
  RegisterWorker();
  HttpConnection stuck(port, 60, 4096);
  ASSERT_TRUE(stuck.ok());
  ASSERT_TRUE(stuck.SendRequest(
      "POST", "/v1/completions",
      absl::StrCat(R"({"prompt":[5,6,7],"stream":true,"max_tokens":)", kEndlessMaxTokens, "}")));
  ASSERT_TRUE(fake_.endless_started_.WaitForNotificationWithTimeout(absl::Seconds(30)));
  // Four other streams, concurrently, each complete with its finish reason and [DONE].
  std::vector<HttpResponse> others(4);
  std::vector<std::thread> threads;
  for (HttpResponse& r : others) {
    threads.emplace_back([&r, port] {
      r = HttpCall(port, "POST", "/v1/completions",
                   R"({"prompt":[5,6,7,8],"stream":true,"max_tokens":4})");
    });
  }
  for (std::thread& t : threads) t.join();
  for (const HttpResponse& r : others) {
    ASSERT_EQ(r.status, 200) << r.body;
    const std::vector<std::string> events = SseData(r.body);
    ASSERT_GE(events.size(), 2u) << r.body;
    EXPECT_EQ(events.back(), "[DONE]");
    EXPECT_TRUE(absl::StrContains(r.body, R"("finish_reason":"stop")") ||
                absl::StrContains(r.body, R"("finish_reason":"length")"))
        << r.body;
  }
  // The stuck stream is cut off and its worker call cancelled.
  ASSERT_TRUE(fake_.endless_cancelled_.WaitForNotificationWithTimeout(absl::Seconds(60)));
  EXPECT_GT(fake_.endless_tokens_.load(), 65536 / 200);  // the limit was reached, not less
  int inflight = -1;
  for (int i = 0; i < 500 && inflight != 0; ++i) {
    inflight = GetStatus().inflight();
    if (inflight != 0) absl::SleepFor(absl::Milliseconds(10));
  }
  EXPECT_EQ(inflight, 0);
  EXPECT_TRUE(absl::StrContains(router_->ReadStderr(), "is not reading its response"))
      << router_->ReadStderr();
  // The stuck client finds its stream ended without [DONE] (what it had buffered, then EOF/reset).
  std::string received;
  HttpResponse head;
  if (stuck.ReadHead(&head)) {
    bool end = false;
    while (!end) received += stuck.ReadChunk(&end);
  }
  EXPECT_FALSE(absl::StrContains(received, "[DONE]"));
  // And serves on.
  EXPECT_EQ(HttpCall(port, "POST", "/v1/chat/completions", kChat).status, 200);
}

TEST_F(RouterHttpTest, APortInUseRefusesToStart) {
  const int port = StartRouter();
  ASSERT_GT(port, 0);
  ChildOptions o;
  o.argv = {kRouter, "--listen=127.0.0.1:0", "--model=" + g_shared->model,
            "--registry_socket=" + dir_ + "/sockets2/registry.sock",
            absl::StrCat("--http_listen=127.0.0.1:", port)};
  o.stderr_path = dir_ + "/second.err";
  absl::StatusOr<ChildProcess> second = ChildProcess::Start(std::move(o));
  ASSERT_TRUE(second.ok());
  absl::StatusOr<int> code = second->WaitForExit(std::chrono::seconds(60));
  ASSERT_TRUE(code.ok());
  EXPECT_EQ(*code, 1);
  EXPECT_TRUE(absl::StrContains(second->ReadStderr(), "--http-listen: cannot listen"))
      << second->ReadStderr();
}

}  // namespace
}  // namespace hmoe::router
