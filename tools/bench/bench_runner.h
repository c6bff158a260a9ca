#pragma once

// `hmoe bench`'s runs against a router's public API (docs/bench.md): an open- or closed-loop load
// (RunLoad) and the paper's concurrency scenarios 1P, 1D, 1P+1D, 2D, 1P+2D (RunScenarios). Every
// request is timed on the client (steady clock): send, each streamed token, end of stream. Over
// gRPC (GrpcBenchClient) the router's own Timing (queue, TTFT, path, workers, attempts) is kept
// next to it; over the OpenAI HTTP API (HttpBenchClient: /v1/completions with server-sent events)
// the times are per event and the router's Timing is not available.

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include <grpcpp/grpcpp.h>

#include "proto/hmoe_v1.grpc.pb.h"
#include "tools/bench/bench_stats.h"
#include "tools/bench/http_client.h"
#include "tools/bench/workload.h"

namespace hmoe::bench {

// A request's client-side record plus what the API returned.
struct RequestResult : RequestRecord {
  int64_t index = 0;
  std::string scenario;  // scenario runs: its name ("1P+2D"), and
  int repeat = 0;        //   the repetition
  char role = 0;         //   'P' or 'D'; 0 for a load run or calibration
  int64_t max_new_tokens = 0;
  std::string protocol = "grpc";  // "grpc" or "http" (HttpBenchClient)
  // gRPC: the status code name ("OK", "RESOURCE_EXHAUSTED", ...); HTTP: "OK", "HTTP <code>" for
  // another status than 200, "HTTP error event: <type>" for an error event inside the stream,
  // "NO_RESPONSE" when the exchange failed, "INCOMPLETE" for a stream without a finish reason,
  // usage or [DONE].
  std::string status;
  std::string message;        // the status message when not OK
  std::string finish_reason;  // "length", "eos", ... ("" when no Finished message came)
  std::string path;           // "chunked", "slp", "dslp" ("" when unknown; always over HTTP)
  std::vector<std::string> worker_ids;
  int attempts = 0;
  // The router's Timing, in seconds.
  double server_queue_s = 0;
  double server_ttft_s = 0;
  double server_tpot_s = 0;
  double server_total_s = 0;
  // Prompt tokens the decode worker's prefix cache supplied (Usage.cached_prompt_tokens).
  int64_t cached_prompt_tokens = 0;
  // Multi-turn runs (LoadOptions::turns > 1): the conversation and the turn (from 0); -1 / 0
  // otherwise.
  int64_t conversation = -1;
  int turn = 0;
  // The streamed token ids (the next turn's prompt includes them; gRPC only).
  std::vector<int32_t> tokens;
};

// Where the requests of a run go; thread-safe.
class BenchClient {
 public:
  virtual ~BenchClient() = default;
  virtual absl::StatusOr<v1::ModelInfo> ModelInfo() = 0;
  virtual absl::StatusOr<v1::RouterStatus> RouterStatus() = 0;
  // Sends one request (ignore_eos: it generates exactly max_new_tokens unless it fails; greedy;
  // the prefix cache per request.cache_prompt) and records it, with times relative to `origin`.
  virtual RequestResult Run(const PlannedRequest& request, v1::PathHint hint,
                            std::chrono::steady_clock::time_point origin) = 0;
  // Whether the records carry the streamed token ids (multi-turn runs need them).
  virtual bool StreamsTokenIds() const = 0;
};

// The router's gRPC API: one channel, a call per request.
class GrpcBenchClient final : public BenchClient {
 public:
  GrpcBenchClient(const std::string& addr, double timeout_s);
  absl::StatusOr<v1::ModelInfo> ModelInfo() override;
  absl::StatusOr<v1::RouterStatus> RouterStatus() override;
  RequestResult Run(const PlannedRequest& request, v1::PathHint hint,
                    std::chrono::steady_clock::time_point origin) override;
  bool StreamsTokenIds() const override { return true; }

 private:
  std::shared_ptr<grpc::Channel> channel_;
  std::unique_ptr<v1::Hmoe::Stub> stub_;
  double timeout_s_;
};

// The router's OpenAI-compatible HTTP API (docs/api.md): each request POSTs /v1/completions with
// the prompt as token ids, max_tokens, temperature 0, ignore_eos, cache_prompt, stream and
// stream_options.include_usage, and reads the server-sent events. token_s holds the arrival of
// each event carrying text (an event may carry several tokens, and a token without text makes no
// event; when none has text, the finish event's), output_tokens is usage.completion_tokens,
// cached_prompt_tokens is usage.prompt_tokens_details.cached_tokens. The path hint cannot be sent
// (only AUTO is accepted: the caller checks); path, workers, attempts and the router's Timing stay
// empty. The model's vocabulary and context and the router's status come from the gRPC API at
// `grpc_addr`. Each request has the deadline `timeout_s` (written and answered in full within it,
// or it fails with status "INCOMPLETE"/"NO_RESPONSE" and the connection is dropped). Keep-alive
// connections are pooled (one per request in flight); a request's start is taken when it is
// written, so a new connection's set-up is not part of its times.
class HttpBenchClient final : public BenchClient {
 public:
  HttpBenchClient(const std::string& grpc_addr, std::string http_addr, double timeout_s);
  ~HttpBenchClient() override;
  absl::StatusOr<v1::ModelInfo> ModelInfo() override { return grpc_.ModelInfo(); }
  absl::StatusOr<v1::RouterStatus> RouterStatus() override { return grpc_.RouterStatus(); }
  RequestResult Run(const PlannedRequest& request, v1::PathHint hint,
                    std::chrono::steady_clock::time_point origin) override;
  bool StreamsTokenIds() const override { return false; }

 private:
  GrpcBenchClient grpc_;
  const std::string http_addr_;
  const double timeout_s_;  // deadline of each request, as the gRPC calls'
  std::mutex mu_;
  std::vector<std::unique_ptr<HttpClient>> idle_;  // guarded by mu_
};

// The body HttpBenchClient POSTs for `request` (exposed for tests).
std::string CompletionRequestBody(const PlannedRequest& request);
// What the events of one /v1/completions stream said besides `RequestResult`'s fields.
struct CompletionEvents {
  bool done = false;       // "[DONE]" came
  bool usage = false;      // the usage chunk came
  std::string error_type;  // an error event's error.type ("" when none)
  std::string error_message;
};
// Folds one event's data into `r` and `e` (exposed for tests): the arrival `now_s` of an event
// with text, finish_reason, usage (output and cached tokens), an error event, [DONE].
void ApplyCompletionEvent(absl::string_view data, double now_s, RequestResult& r,
                          CompletionEvents& e);

struct LoadOptions {
  ArrivalSpec arrival;
  int requests = 10;  // measured requests
  int warmup = 0;     // sent one at a time before them, left out of the summary
  LengthSpec prompt;
  LengthSpec output;
  uint64_t seed = 0;
  v1::PathHint hint = v1::PATH_HINT_AUTO;
  // Turns per conversation (>= 1). With more than one, each of the `requests` (and `warmup`)
  // items is a conversation: turn 0 is a planned request; turn t's prompt is turn t-1's prompt,
  // its answer and a new message of `prompt` tokens, with `output` new tokens (a chat whose
  // history is resent every turn, as OpenAI clients do). Turns of a conversation run one after
  // another; the arrival spec places conversations. A conversation ends early when its next turn
  // would not fit the context or a turn fails. Needs a client that StreamsTokenIds().
  int turns = 1;
};
// Warm-up requests first (marked warmup), then the measured ones.
std::vector<RequestResult> RunLoad(BenchClient& client, const v1::ModelInfo& info,
                                   const LoadOptions& options);

// "1P+2D" -> 1 prefill and 2 decode requests; any "<n>P" / "<n>D" terms joined by '+'.
struct ScenarioShape {
  std::string name;
  int prefills = 0;
  int decodes = 0;
};
absl::StatusOr<ScenarioShape> ParseScenario(const std::string& name);

struct ScenarioOptions {
  std::vector<ScenarioShape> scenarios;
  double target_s = 20;        // one prefill alone should last this long
  int64_t prefill_tokens = 0;  // 0: found by calibration so that 1P's TTFT ~ target_s
  int64_t prefill_new_tokens = 4;
  int64_t decode_prompt_tokens = 10;
  int64_t decode_new_tokens = 480;  // forced: ignore_eos
  int repeats = 3;
  uint64_t seed = 0;
  // The path hint of the prefill requests (and the calibration); decodes always go with AUTO.
  v1::PathHint hint = v1::PATH_HINT_AUTO;
  // Progress lines (calibration, each repetition) go here when set.
  std::function<void(const std::string&)> log;
};

struct CalibrationPoint {
  int64_t prompt_tokens = 0;
  double ttft_s = 0;
};

struct ScenarioResult {
  ScenarioShape shape;
  std::vector<double> total_s;  // per repetition: first send to last end
  double mean_p_ttft_s = 0;     // NaN without prefills
  double mean_d_tpot_s = 0;     // NaN without decodes
  double mean_d_ttft_s = 0;     // NaN without decodes (how long a decode waited for its start)
  double mean_total_s = 0;
  // Divided by the same metric of 1P (TTFT, total) and 1D (TPOT); NaN when that baseline was not
  // run or this scenario lacks the metric.
  double norm_p_ttft = 0;
  double norm_d_tpot = 0;
  double norm_total = 0;
};

struct ScenarioReport {
  int64_t prefill_tokens = 0;
  std::vector<CalibrationPoint> calibration;
  std::vector<ScenarioResult> scenarios;
  std::vector<RequestResult> requests;
};
// Runs each scenario `repeats` times (all its requests sent at once), after a calibration of the
// prefill length (unless prefill_tokens is given) and one short warm-up decode.
absl::StatusOr<ScenarioReport> RunScenarios(BenchClient& client, const v1::ModelInfo& info,
                                            const ScenarioOptions& options);

// The normalization of Fig. 18 over finished results (used by RunScenarios; exposed for tests).
void Normalize(std::vector<ScenarioResult>& results);

// `hmoe calibrate`'s measurements (docs/bench.md "Calibration"): the TTFT of each prefill path,
// forced by the request's path hint, over a ladder of prompt lengths; and the decode step time
// (the mean inter-token gap, TPOT) with `batch` requests decoding at once.
struct CalibrateOptions {
  std::vector<int64_t> lengths;  // prompt lengths, increasing; each must fit the context
  std::vector<int> batch_sizes;  // concurrent decode requests per decode measurement
  int repeats = 3;               // measurements of each path per length, and of each batch size
  int64_t prefill_new_tokens = 2;
  int64_t decode_prompt_tokens = 10;
  int64_t step_tokens = 32;  // forced tokens of each decode request
  uint64_t seed = 0;
  std::function<void(const std::string&)> log;
};
struct LengthMeasurement {
  int64_t prompt_tokens = 0;
  std::vector<double> chunked_ttft_s;  // per repeat (client TTFT)
  std::vector<double> slp_ttft_s;
};
struct BatchMeasurement {
  int batch = 0;
  std::vector<double> tpot_s;  // every request of every repeat
};
struct CalibrateReport {
  std::vector<LengthMeasurement> prefill;
  std::vector<BatchMeasurement> decode;
  std::vector<RequestResult> requests;
};
// Needs a live prefill worker (SLP). Each repeat measures every length on both paths, the order
// of the two paths alternating between repeats (so a drift of the machine's load does not favour
// one); one request per path at the shortest length warms up first. Unavailable when a request
// fails, FailedPrecondition when the router served a request on another path than the hint.
absl::StatusOr<CalibrateReport> RunCalibration(BenchClient& client, const v1::ModelInfo& info,
                                               const CalibrateOptions& options);

}  // namespace hmoe::bench
