#include "tools/bench/bench_runner.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <limits>
#include <thread>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"

#include "common/rpc/grpc_status.h"

#include <nlohmann/json.hpp>

namespace hmoe::bench {
namespace {

using Clock = std::chrono::steady_clock;
constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();

double Since(Clock::time_point origin, Clock::time_point t) {
  return std::chrono::duration<double>(t - origin).count();
}

// "FINISH_REASON_LENGTH" -> "length", "PATH_SLP" -> "slp".
std::string EnumSuffix(const std::string& name, size_t prefix) {
  return name.size() > prefix ? absl::AsciiStrToLower(name.substr(prefix)) : "";
}

PlannedRequest Random(int64_t prompt_tokens, int64_t max_new, int64_t vocab, std::mt19937_64& rng) {
  const LengthSpec fixed_prompt{LengthSpec::Kind::kFixed, prompt_tokens, 0, 0, ""};
  const LengthSpec fixed_new{LengthSpec::Kind::kFixed, max_new, 0, 0, ""};
  // context_length large enough that nothing is clamped: the caller checked the sizes.
  return PlanRequests(1, fixed_prompt, fixed_new, vocab, prompt_tokens + 2 * max_new + 2, rng)[0];
}

double Mean(const std::vector<double>& v) {
  if (v.empty()) return kNaN;
  double s = 0;
  for (double x : v) s += x;
  return s / static_cast<double>(v.size());
}

}  // namespace

GrpcBenchClient::GrpcBenchClient(const std::string& addr, double timeout_s)
    : channel_(grpc::CreateChannel(addr, grpc::InsecureChannelCredentials())),
      stub_(v1::Hmoe::NewStub(channel_)),
      timeout_s_(timeout_s) {}

absl::StatusOr<v1::ModelInfo> GrpcBenchClient::ModelInfo() {
  grpc::ClientContext ctx;
  ctx.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(timeout_s_)));
  v1::ModelInfo info;
  const grpc::Status s = stub_->GetModelInfo(&ctx, {}, &info);
  if (!s.ok()) {
    return absl::UnavailableError(
        absl::StrCat("GetModelInfo: ", rpc::GrpcCodeName(s.error_code()), ": ", s.error_message()));
  }
  return info;
}

absl::StatusOr<v1::RouterStatus> GrpcBenchClient::RouterStatus() {
  grpc::ClientContext ctx;
  ctx.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(timeout_s_)));
  v1::RouterStatus st;
  const grpc::Status s = stub_->GetStatus(&ctx, {}, &st);
  if (!s.ok()) {
    return absl::UnavailableError(
        absl::StrCat("GetStatus: ", rpc::GrpcCodeName(s.error_code()), ": ", s.error_message()));
  }
  return st;
}

RequestResult GrpcBenchClient::Run(const PlannedRequest& request, v1::PathHint hint,
                                   Clock::time_point origin) {
  RequestResult r;
  r.prompt_tokens = static_cast<int64_t>(request.prompt.size());
  r.max_new_tokens = request.max_new_tokens;
  v1::GenerateRequest req;
  for (int32_t id : request.prompt) req.mutable_prompt_token_ids()->add_ids(id);
  req.set_max_new_tokens(static_cast<int32_t>(request.max_new_tokens));
  req.set_ignore_eos(true);
  req.set_path_hint(hint);
  req.set_cache_prompt(request.cache_prompt);
  r.token_s.reserve(request.max_new_tokens);
  grpc::ClientContext ctx;
  ctx.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(timeout_s_)));
  r.start_s = Since(origin, Clock::now());
  auto reader = stub_->Generate(&ctx, req);
  v1::GenerateResponse msg;
  v1::Finished finished;
  bool have_finished = false;
  while (reader->Read(&msg)) {
    if (msg.has_token()) {
      r.token_s.push_back(Since(origin, Clock::now()));
      r.tokens.push_back(msg.token().token_id());
    } else if (msg.has_finished()) {
      finished = msg.finished();
      have_finished = true;
    }
  }
  const grpc::Status s = reader->Finish();
  r.end_s = Since(origin, Clock::now());
  r.ok = s.ok();
  r.status = rpc::GrpcCodeName(s.error_code());
  r.message = s.error_message();
  if (have_finished) {
    r.finish_reason = EnumSuffix(v1::FinishReason_Name(finished.reason()), 14);
    const v1::Timing& t = finished.timing();
    r.path = t.path() == v1::PATH_UNSPECIFIED ? "" : EnumSuffix(v1::Path_Name(t.path()), 5);
    r.worker_ids.assign(t.worker_ids().begin(), t.worker_ids().end());
    r.attempts = t.attempts();
    r.server_queue_s = static_cast<double>(t.queue_us()) * 1e-6;
    r.server_ttft_s = static_cast<double>(t.ttft_us()) * 1e-6;
    r.server_tpot_s = static_cast<double>(t.tpot_us()) * 1e-6;
    r.server_total_s = static_cast<double>(t.total_us()) * 1e-6;
    r.cached_prompt_tokens = finished.usage().cached_prompt_tokens();
  }
  return r;
}

std::string CompletionRequestBody(const PlannedRequest& request) {
  // As GrpcBenchClient's request: greedy (the HTTP API's default temperature is 1), forced length,
  // the prefix cache as the request says.
  return nlohmann::json{{"prompt", request.prompt},
                        {"max_tokens", request.max_new_tokens},
                        {"temperature", 0},
                        {"ignore_eos", true},
                        {"cache_prompt", request.cache_prompt},
                        {"stream", true},
                        {"stream_options", {{"include_usage", true}}}}
      .dump();
}

void ApplyCompletionEvent(absl::string_view data, double now_s, RequestResult& r,
                          CompletionEvents& e) {
  if (data == "[DONE]") {
    e.done = true;
    return;
  }
  const nlohmann::json j = nlohmann::json::parse(data, nullptr, false);
  if (j.is_discarded() || !j.is_object()) {
    if (e.error_type.empty()) {
      e.error_type = "bad_event";
      e.error_message = absl::StrCat("an event that is not a JSON object: ", data.substr(0, 200));
    }
    return;
  }
  if (const auto err = j.find("error"); err != j.end()) {
    e.error_type = "server_error";
    e.error_message = err->dump();
    if (err->is_object()) {
      if (const auto t = err->find("type"); t != err->end() && t->is_string()) {
        e.error_type = t->get<std::string>();
      }
      if (const auto m = err->find("message"); m != err->end() && m->is_string()) {
        e.error_message = m->get<std::string>();
      }
    }
    return;
  }
  if (const auto u = j.find("usage"); u != j.end() && u->is_object()) {
    e.usage = true;
    r.counted_tokens = u->value("completion_tokens", int64_t{0});
    if (const auto d = u->find("prompt_tokens_details"); d != u->end() && d->is_object()) {
      r.cached_prompt_tokens = d->value("cached_tokens", int64_t{0});
    }
  }
  const auto choices = j.find("choices");
  if (choices == j.end() || !choices->is_array() || choices->empty()) return;
  const nlohmann::json& choice = (*choices)[0];
  if (const auto text = choice.find("text");
      text != choice.end() && text->is_string() && !text->get_ref<const std::string&>().empty()) {
    r.token_s.push_back(now_s);
  }
  if (const auto f = choice.find("finish_reason"); f != choice.end() && f->is_string()) {
    r.finish_reason = f->get<std::string>();
    // No token had text (the detokenizer held everything): the end is the first arrival.
    if (r.token_s.empty()) r.token_s.push_back(now_s);
  }
}

HttpBenchClient::HttpBenchClient(const std::string& grpc_addr, std::string http_addr,
                                 double timeout_s)
    : grpc_(grpc_addr, timeout_s), http_addr_(std::move(http_addr)), timeout_s_(timeout_s) {}

HttpBenchClient::~HttpBenchClient() = default;

RequestResult HttpBenchClient::Run(const PlannedRequest& request, v1::PathHint,
                                   Clock::time_point origin) {
  RequestResult r;
  r.protocol = "http";
  r.prompt_tokens = static_cast<int64_t>(request.prompt.size());
  r.max_new_tokens = request.max_new_tokens;
  const std::string body = CompletionRequestBody(request);
  r.token_s.reserve(request.max_new_tokens);
  // A pooled connection the server has closed fails before any answer: then once more on a new
  // one.
  for (int attempt = 0; attempt < 2; ++attempt) {
    std::unique_ptr<HttpClient> conn;
    {
      std::lock_guard<std::mutex> l(mu_);
      if (!idle_.empty()) {
        conn = std::move(idle_.back());
        idle_.pop_back();
      }
    }
    const bool reused = conn != nullptr;
    if (!reused) {
      conn = std::make_unique<HttpClient>();
      if (absl::Status c = conn->Connect(http_addr_); !c.ok()) {
        r.start_s = r.end_s = Since(origin, Clock::now());
        r.status = "NO_RESPONSE";
        r.message = std::string(c.message());
        return r;
      }
    }
    r.token_s.clear();
    r.counted_tokens = -1;
    r.finish_reason.clear();
    r.cached_prompt_tokens = 0;
    CompletionEvents e;
    const HttpResponse resp = conn->Post(
        "/v1/completions", body,
        [&](absl::string_view data) {
          ApplyCompletionEvent(data, Since(origin, Clock::now()), r, e);
        },
        [&] { r.start_s = Since(origin, Clock::now()); }, absl::Seconds(timeout_s_));
    r.end_s = Since(origin, Clock::now());
    if (reused && resp.status == 0 && attempt == 0) continue;
    if (!resp.transport_error.empty()) {
      r.status = resp.status == 0 ? "NO_RESPONSE" : "INCOMPLETE";
      r.message = resp.transport_error;
    } else if (resp.status != 200) {
      r.status = absl::StrCat("HTTP ", resp.status);
      r.message = resp.body;
      nlohmann::json j = nlohmann::json::parse(resp.body, nullptr, false);
      if (j.is_object() && j.contains("error") && j["error"].is_object() &&
          j["error"].contains("message") && j["error"]["message"].is_string()) {
        r.message = j["error"]["message"].get<std::string>();
      }
    } else if (!e.error_type.empty()) {
      r.status = absl::StrCat("HTTP error event: ", e.error_type);
      r.message = e.error_message;
    } else if (!e.done || !e.usage || r.finish_reason.empty()) {
      r.status = "INCOMPLETE";
      r.message = "the event stream ended without a finish reason, usage and [DONE]";
    } else {
      r.status = "OK";
      r.ok = true;
    }
    if (resp.transport_error.empty() && resp.keep_alive) {
      std::lock_guard<std::mutex> l(mu_);
      idle_.push_back(std::move(conn));
    }
    break;
  }
  return r;
}

namespace {

// Multi-turn load (LoadOptions::turns > 1): conversations in place of requests.
std::vector<RequestResult> RunConversations(BenchClient& client, const v1::ModelInfo& info,
                                            const LoadOptions& o) {
  const int conversations = o.warmup + o.requests;
  std::mt19937_64 rng(o.seed);
  // Turn 0 of each conversation, then every later turn's message and output length, all planned
  // up front from the seed (the answers themselves come from the server).
  const std::vector<PlannedRequest> first = PlanRequests(
      conversations, o.prompt, o.output, info.vocab_size(), info.context_length(), rng);
  std::vector<std::vector<PlannedRequest>> later(conversations);
  for (int c = 0; c < conversations; ++c) {
    later[c] = PlanRequests(o.turns - 1, o.prompt, o.output, info.vocab_size(),
                            info.context_length(), rng);
  }
  std::mt19937_64 arrival_rng(o.seed ^ 0x9e3779b97f4a7c15ULL);
  const std::vector<double> at = ArrivalTimes(o.arrival, o.requests, arrival_rng);
  std::vector<std::vector<RequestResult>> results(conversations);
  const Clock::time_point origin = Clock::now();
  auto converse = [&](int c) {
    PlannedRequest turn = first[c];
    for (int t = 0; t < o.turns; ++t) {
      RequestResult r = client.Run(turn, o.hint, origin);
      r.conversation = c;
      r.turn = t;
      r.warmup = c < o.warmup;
      const bool ok = r.ok;
      results[c].push_back(r);
      if (!ok || t + 1 == o.turns) break;
      // The history as a chat client resends it: the prompt, the answer, the new message.
      PlannedRequest next;
      next.prompt = turn.prompt;
      next.prompt.insert(next.prompt.end(), r.tokens.begin(), r.tokens.end());
      const PlannedRequest& message = later[c][t];
      next.prompt.insert(next.prompt.end(), message.prompt.begin(), message.prompt.end());
      next.max_new_tokens = message.max_new_tokens;
      if (static_cast<int64_t>(next.prompt.size()) + next.max_new_tokens > info.context_length()) {
        break;
      }
      turn = std::move(next);
    }
  };
  for (int c = 0; c < o.warmup; ++c) converse(c);
  const Clock::time_point begin = Clock::now();
  std::vector<std::thread> threads;
  if (o.arrival.kind == ArrivalSpec::Kind::kClosed) {
    std::atomic<int> next{0};
    for (int k = 0; k < std::max(o.arrival.concurrency, 1); ++k) {
      threads.emplace_back([&] {
        for (int i = next++; i < o.requests; i = next++) converse(o.warmup + i);
      });
    }
  } else {
    for (int i = 0; i < o.requests; ++i) {
      std::this_thread::sleep_until(begin + std::chrono::duration_cast<Clock::duration>(
                                                std::chrono::duration<double>(at[i])));
      threads.emplace_back(converse, o.warmup + i);
    }
  }
  for (std::thread& t : threads) t.join();
  std::vector<RequestResult> out;
  for (auto& turns : results) {
    for (RequestResult& r : turns) out.push_back(std::move(r));
  }
  for (size_t i = 0; i < out.size(); ++i) out[i].index = static_cast<int64_t>(i);
  return out;
}

}  // namespace

std::vector<RequestResult> RunLoad(BenchClient& client, const v1::ModelInfo& info,
                                   const LoadOptions& o) {
  if (o.turns > 1) return RunConversations(client, info, o);
  std::mt19937_64 rng(o.seed);
  const std::vector<PlannedRequest> plan = PlanRequests(
      o.warmup + o.requests, o.prompt, o.output, info.vocab_size(), info.context_length(), rng);
  std::mt19937_64 arrival_rng(o.seed ^ 0x9e3779b97f4a7c15ULL);
  const std::vector<double> at = ArrivalTimes(o.arrival, o.requests, arrival_rng);
  std::vector<RequestResult> results(plan.size());
  const Clock::time_point origin = Clock::now();
  for (int i = 0; i < o.warmup; ++i) {
    results[i] = client.Run(plan[i], o.hint, origin);
    results[i].warmup = true;
  }
  const Clock::time_point begin = Clock::now();
  auto run = [&](int i) { results[o.warmup + i] = client.Run(plan[o.warmup + i], o.hint, origin); };
  std::vector<std::thread> threads;
  if (o.arrival.kind == ArrivalSpec::Kind::kClosed) {
    std::atomic<int> next{0};
    for (int c = 0; c < std::max(o.arrival.concurrency, 1); ++c) {
      threads.emplace_back([&] {
        for (int i = next++; i < o.requests; i = next++) run(i);
      });
    }
  } else {
    for (int i = 0; i < o.requests; ++i) {
      std::this_thread::sleep_until(begin + std::chrono::duration_cast<Clock::duration>(
                                                std::chrono::duration<double>(at[i])));
      threads.emplace_back(run, i);
    }
  }
  for (std::thread& t : threads) t.join();
  for (size_t i = 0; i < results.size(); ++i) results[i].index = static_cast<int64_t>(i);
  return results;
}

absl::StatusOr<ScenarioShape> ParseScenario(const std::string& name) {
  ScenarioShape shape;
  shape.name = name;
  for (absl::string_view term : absl::StrSplit(name, '+')) {
    int n = 0;
    if (term.size() < 2 || !absl::SimpleAtoi(term.substr(0, term.size() - 1), &n) || n < 1 ||
        n > 64 || (term.back() != 'P' && term.back() != 'D')) {
      return absl::InvalidArgumentError(absl::StrCat(
          "--scenario: \"", name, "\": want terms like 1P or 2D joined by '+' (e.g. 1P+2D)"));
    }
    (term.back() == 'P' ? shape.prefills : shape.decodes) += n;
  }
  return shape;
}

void Normalize(std::vector<ScenarioResult>& results) {
  double p_ttft = kNaN, p_total = kNaN, d_tpot = kNaN;
  for (const ScenarioResult& r : results) {
    if (r.shape.prefills == 1 && r.shape.decodes == 0) {
      p_ttft = r.mean_p_ttft_s;
      p_total = r.mean_total_s;
    }
    if (r.shape.prefills == 0 && r.shape.decodes == 1) d_tpot = r.mean_d_tpot_s;
  }
  for (ScenarioResult& r : results) {
    r.norm_p_ttft = r.mean_p_ttft_s / p_ttft;
    r.norm_d_tpot = r.mean_d_tpot_s / d_tpot;
    r.norm_total = r.mean_total_s / p_total;
  }
}

absl::StatusOr<ScenarioReport> RunScenarios(BenchClient& client, const v1::ModelInfo& info,
                                            const ScenarioOptions& o) {
  auto log = [&](const std::string& line) {
    if (o.log) o.log(line);
  };
  const int64_t context = info.context_length();
  const int64_t vocab = info.vocab_size();
  if (o.decode_prompt_tokens + o.decode_new_tokens > context) {
    return absl::InvalidArgumentError(
        absl::StrFormat("decodes of %d + %d tokens do not fit the context (%d tokens)",
                        o.decode_prompt_tokens, o.decode_new_tokens, context));
  }
  const int64_t cap = context - o.prefill_new_tokens;
  if (cap < 1)
    return absl::InvalidArgumentError("--prefill-new-tokens leaves no room for a prompt");
  std::mt19937_64 rng(o.seed);
  ScenarioReport report;
  const Clock::time_point origin = Clock::now();
  int64_t index = 0;
  auto keep = [&](RequestResult r) -> RequestResult& {
    r.index = index++;
    report.requests.push_back(std::move(r));
    return report.requests.back();
  };

  // Warm-up: one short decode (first-call costs: connections, page faults of the weights).
  {
    RequestResult& w =
        keep(client.Run(Random(o.decode_prompt_tokens, 8, vocab, rng), v1::PATH_HINT_AUTO, origin));
    w.warmup = true;
    if (!w.ok) {
      return absl::UnavailableError(
          absl::StrCat("the warm-up request failed: ", w.status, ": ", w.message));
    }
  }

  // The prefill length: TTFT is close to linear in the prompt length on these sizes, so scale the
  // last measurement to the target until within 15 % (at most 4 measurements).
  int64_t tokens = o.prefill_tokens;
  if (tokens > cap) {
    return absl::InvalidArgumentError(
        absl::StrFormat("--prefill-tokens %d does not fit the context (%d tokens with %d new)",
                        tokens, context, o.prefill_new_tokens));
  }
  if (tokens <= 0) {
    tokens = std::min<int64_t>(1024, cap);
    for (int step = 0; step < 4; ++step) {
      RequestResult& c =
          keep(client.Run(Random(tokens, o.prefill_new_tokens, vocab, rng), o.hint, origin));
      c.warmup = true;
      c.scenario = "calibration";
      if (!c.ok) {
        return absl::UnavailableError(absl::StrFormat("calibration prefill of %d tokens: %s: %s",
                                                      tokens, c.status, c.message));
      }
      const double ttft = Ttft(c);
      report.calibration.push_back({tokens, ttft});
      log(absl::StrFormat("calibration: %d tokens, TTFT %.2f s (target %.1f s), path %s", tokens,
                          ttft, o.target_s,
                          c.protocol == "http" ? "not available over HTTP" : c.path));
      if (std::abs(ttft - o.target_s) <= 0.15 * o.target_s) break;
      const int64_t next = std::clamp<int64_t>(
          static_cast<int64_t>(std::llround(static_cast<double>(tokens) * o.target_s / ttft)), 16,
          cap);
      if (next == tokens) break;  // at the context's cap
      tokens = next;
    }
    const CalibrationPoint& last = report.calibration.back();
    if (last.prompt_tokens == cap && last.ttft_s < 0.85 * o.target_s) {
      log(absl::StrFormat("calibration: capped by the context at %d tokens (%.2f s < %.1f s)", cap,
                          last.ttft_s, o.target_s));
    }
    if (last.prompt_tokens != tokens) {
      log(absl::StrFormat("calibration: using %d tokens (not measured alone)", tokens));
    }
  }
  report.prefill_tokens = tokens;

  for (const ScenarioShape& shape : o.scenarios) {
    ScenarioResult res;
    res.shape = shape;
    std::vector<double> p_ttft, d_tpot, d_ttft;
    for (int rep = 0; rep < o.repeats; ++rep) {
      std::vector<PlannedRequest> plan;
      std::vector<char> roles;
      for (int i = 0; i < shape.prefills; ++i) {
        plan.push_back(Random(tokens, o.prefill_new_tokens, vocab, rng));
        roles.push_back('P');
      }
      for (int i = 0; i < shape.decodes; ++i) {
        plan.push_back(Random(o.decode_prompt_tokens, o.decode_new_tokens, vocab, rng));
        roles.push_back('D');
      }
      std::vector<RequestResult> out(plan.size());
      {
        std::vector<std::thread> threads;
        for (size_t i = 0; i < plan.size(); ++i) {
          const v1::PathHint hint = roles[i] == 'P' ? o.hint : v1::PATH_HINT_AUTO;
          threads.emplace_back([&, i, hint] { out[i] = client.Run(plan[i], hint, origin); });
        }
        for (std::thread& t : threads) t.join();
      }
      double first = std::numeric_limits<double>::infinity(), last = -first;
      int failed = 0;
      for (size_t i = 0; i < out.size(); ++i) {
        RequestResult& r = keep(std::move(out[i]));
        r.scenario = shape.name;
        r.repeat = rep;
        r.role = roles[i];
        first = std::min(first, r.start_s);
        last = std::max(last, r.end_s);
        if (!r.ok) {
          ++failed;
          continue;
        }
        if (r.role == 'P') p_ttft.push_back(Ttft(r));
        if (r.role == 'D') {
          d_tpot.push_back(Tpot(r));
          d_ttft.push_back(Ttft(r));
        }
      }
      res.total_s.push_back(last - first);
      log(absl::StrFormat("%s #%d: total %.2f s%s", shape.name, rep + 1, last - first,
                          failed > 0 ? absl::StrCat(", ", failed, " failed") : ""));
    }
    res.mean_p_ttft_s = Mean(p_ttft);
    res.mean_d_tpot_s = Mean(d_tpot);
    res.mean_d_ttft_s = Mean(d_ttft);
    res.mean_total_s = Mean(res.total_s);
    report.scenarios.push_back(std::move(res));
  }
  Normalize(report.scenarios);
  return report;
}

absl::StatusOr<CalibrateReport> RunCalibration(BenchClient& client, const v1::ModelInfo& info,
                                               const CalibrateOptions& o) {
  auto log = [&](const std::string& line) {
    if (o.log) o.log(line);
  };
  const int64_t context = info.context_length();
  const int64_t vocab = info.vocab_size();
  if (o.lengths.empty() || o.batch_sizes.empty() || o.repeats < 1) {
    return absl::InvalidArgumentError("calibration needs lengths, batch sizes and repeats >= 1");
  }
  for (int64_t length : o.lengths) {
    if (length < 1 || length + o.prefill_new_tokens > context) {
      return absl::InvalidArgumentError(
          absl::StrFormat("a prompt of %d tokens (+%d new) does not fit the context (%d tokens)",
                          length, o.prefill_new_tokens, context));
    }
  }
  if (o.decode_prompt_tokens + o.step_tokens > context) {
    return absl::InvalidArgumentError(
        absl::StrFormat("decodes of %d + %d tokens do not fit the context (%d tokens)",
                        o.decode_prompt_tokens, o.step_tokens, context));
  }
  std::mt19937_64 rng(o.seed);
  CalibrateReport report;
  const Clock::time_point origin = Clock::now();
  // Runs one request on a forced path and keeps it; its TTFT, or an error.
  auto prefill = [&](int64_t tokens, v1::PathHint hint, bool warmup) -> absl::StatusOr<double> {
    PlannedRequest request = Random(tokens, o.prefill_new_tokens, vocab, rng);
    request.cache_prompt = false;  // a hit would measure the cache, not the path
    RequestResult r = client.Run(request, hint, origin);
    r.index = static_cast<int64_t>(report.requests.size());
    r.warmup = warmup;
    r.scenario = "calibration";
    const std::string want = hint == v1::PATH_HINT_SLP ? "slp" : "chunked";
    const bool ok = r.ok;
    const std::string status = r.status, message = r.message, path = r.path;
    const double ttft = Ttft(r);
    report.requests.push_back(std::move(r));
    if (!ok) {
      return absl::UnavailableError(
          absl::StrFormat("%s prefill of %d tokens failed: %s: %s", want, tokens, status, message));
    }
    if (path != want) {
      return absl::FailedPreconditionError(absl::StrFormat(
          "a %d-token prompt hinted %s was served on the path \"%s\"", tokens, want, path));
    }
    return ttft;
  };
  for (v1::PathHint hint : {v1::PATH_HINT_CHUNKED, v1::PATH_HINT_SLP}) {
    absl::StatusOr<double> w = prefill(o.lengths.front(), hint, true);
    if (!w.ok()) return w.status();
  }
  report.prefill.resize(o.lengths.size());
  for (size_t i = 0; i < o.lengths.size(); ++i) report.prefill[i].prompt_tokens = o.lengths[i];
  for (int rep = 0; rep < o.repeats; ++rep) {
    for (LengthMeasurement& m : report.prefill) {
      const bool slp_first = rep % 2 == 1;
      for (int k = 0; k < 2; ++k) {
        const bool slp = (k == 0) == slp_first;
        absl::StatusOr<double> t =
            prefill(m.prompt_tokens, slp ? v1::PATH_HINT_SLP : v1::PATH_HINT_CHUNKED, false);
        if (!t.ok()) return t.status();
        (slp ? m.slp_ttft_s : m.chunked_ttft_s).push_back(*t);
      }
      log(absl::StrFormat("prefill #%d: %d tokens: chunked %.3f s, SLP %.3f s", rep + 1,
                          m.prompt_tokens, m.chunked_ttft_s.back(), m.slp_ttft_s.back()));
    }
  }
  for (int batch : o.batch_sizes) {
    BatchMeasurement m;
    m.batch = batch;
    for (int rep = 0; rep < o.repeats; ++rep) {
      std::vector<PlannedRequest> plan;
      for (int i = 0; i < batch; ++i) {
        plan.push_back(Random(o.decode_prompt_tokens, o.step_tokens, vocab, rng));
        plan.back().cache_prompt = false;
      }
      std::vector<RequestResult> out(plan.size());
      {
        std::vector<std::thread> threads;
        for (size_t i = 0; i < plan.size(); ++i) {
          threads.emplace_back(
              [&, i] { out[i] = client.Run(plan[i], v1::PATH_HINT_CHUNKED, origin); });
        }
        for (std::thread& t : threads) t.join();
      }
      for (RequestResult& r : out) {
        r.index = static_cast<int64_t>(report.requests.size());
        r.scenario = absl::StrCat("decode-batch-", batch);
        r.repeat = rep;
        if (!r.ok) {
          return absl::UnavailableError(absl::StrFormat(
              "a decode request of a batch of %d failed: %s: %s", batch, r.status, r.message));
        }
        m.tpot_s.push_back(Tpot(r));
        report.requests.push_back(std::move(r));
      }
    }
    log(absl::StrFormat("decode: batch %d: TPOT mean %.2f ms over %d requests", batch,
                        1e3 * Mean(m.tpot_s), m.tpot_s.size()));
    report.decode.push_back(std::move(m));
  }
  return report;
}

}  // namespace hmoe::bench
