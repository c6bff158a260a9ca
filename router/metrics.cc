#include "router/metrics.h"

#include <prometheus/counter.h>
#include <prometheus/family.h>
#include <prometheus/gauge.h>
#include <prometheus/histogram.h>
#include <prometheus/registry.h>
#include <prometheus/text_serializer.h>

#include <sstream>
#include <vector>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"

namespace hmoe::router {
namespace {

namespace v1 = hmoe::v1;

// 10 ms ... 120 s.
const prometheus::Histogram::BucketBoundaries& Buckets() {
  static const auto* b = new prometheus::Histogram::BucketBoundaries{
      0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 30, 60, 120};
  return *b;
}

std::string PathLabel(v1::Path path) {
  switch (path) {
    case v1::PATH_CHUNKED:
      return "chunked";
    case v1::PATH_SLP:
      return "slp";
    case v1::PATH_DSLP:
      return "dslp";
    default:
      return "none";
  }
}

// Passes everything through and keeps the Finished message.
class RecordingSink : public GenerateSink {
 public:
  explicit RecordingSink(GenerateSink* inner) : inner_(inner) {}
  bool Write(const v1::GenerateResponse& response) override {
    if (response.has_finished()) finished_ = response.finished();
    return inner_->Write(response);
  }
  bool IsCancelled() override { return inner_->IsCancelled(); }
  const std::optional<v1::Finished>& finished() const { return finished_; }

 private:
  GenerateSink* inner_;
  std::optional<v1::Finished> finished_;
};

prometheus::Histogram* NewHistogram(prometheus::Registry& registry, const std::string& name,
                                    const std::string& help) {
  return &prometheus::BuildHistogram().Name(name).Help(help).Register(registry).Add({}, Buckets());
}

}  // namespace

RouterMetrics::RouterMetrics() : registry_(std::make_shared<prometheus::Registry>()) {
  requests_ = &prometheus::BuildCounter()
                   .Name("hmoe_requests_total")
                   .Help("Generate requests finished, by path taken and outcome")
                   .Register(*registry_);
  ttft_ = NewHistogram(*registry_, "hmoe_time_to_first_token_seconds",
                       "Arrival at the router to the first token streamed");
  tpot_ = NewHistogram(*registry_, "hmoe_time_per_output_token_seconds",
                       "Mean time between streamed tokens of a request");
  e2e_ = NewHistogram(*registry_, "hmoe_request_duration_seconds",
                      "Arrival at the router to the end of the request");
  queue_ = NewHistogram(*registry_, "hmoe_queue_time_seconds",
                        "Arrival at the router to the dispatch to a worker");
  prompt_tokens_ = &prometheus::BuildCounter()
                        .Name("hmoe_prompt_tokens_total")
                        .Help("Prompt tokens of finished requests")
                        .Register(*registry_)
                        .Add({});
  generated_tokens_ = &prometheus::BuildCounter()
                           .Name("hmoe_generation_tokens_total")
                           .Help("Tokens generated for finished requests")
                           .Register(*registry_)
                           .Add({});
}

RouterMetrics::~RouterMetrics() = default;

std::string RouterMetrics::Outcome(const absl::Status& status, const v1::Finished* finished) {
  if (status.ok()) {
    return finished != nullptr && finished->reason() == v1::FINISH_REASON_CANCELLED ? "cancelled"
                                                                                    : "ok";
  }
  switch (status.code()) {
    case absl::StatusCode::kCancelled:
    case absl::StatusCode::kDeadlineExceeded:
      return "cancelled";
    case absl::StatusCode::kInvalidArgument:
    case absl::StatusCode::kFailedPrecondition:
    case absl::StatusCode::kAlreadyExists:
      return "invalid";
    case absl::StatusCode::kResourceExhausted:
      return "rejected";
    case absl::StatusCode::kUnavailable:
      return "unavailable";
    default:
      return "error";
  }
}

absl::Status RouterMetrics::Generate(Router* router, const v1::GenerateRequest& request,
                                     absl::Time deadline, GenerateSink* sink) {
  RecordingSink recording(sink);
  const absl::Status status = router->Generate(request, deadline, &recording);
  const v1::Finished* f = recording.finished().has_value() ? &*recording.finished() : nullptr;
  requests_
      ->Add({{"path", f != nullptr ? PathLabel(f->timing().path()) : "none"},
             {"outcome", Outcome(status, f)}})
      .Increment();
  if (f != nullptr) {
    const v1::Timing& t = f->timing();
    if (t.ttft_us() > 0) ttft_->Observe(static_cast<double>(t.ttft_us()) * 1e-6);
    if (t.tpot_us() > 0) tpot_->Observe(static_cast<double>(t.tpot_us()) * 1e-6);
    e2e_->Observe(static_cast<double>(t.total_us()) * 1e-6);
    if (t.path() != v1::PATH_UNSPECIFIED) {
      queue_->Observe(static_cast<double>(t.queue_us()) * 1e-6);
    }
    prompt_tokens_->Increment(f->usage().prompt_tokens());
    generated_tokens_->Increment(f->usage().completion_tokens());
  }
  return status;
}

std::string RouterMetrics::Scrape(const Router& router) const {
  const v1::RouterStatus s = router.GetStatus();
  // Gauges of the status as of now, in a registry of their own (workers come and go).
  prometheus::Registry now;
  const auto gauge = [&now](const std::string& name, const std::string& help) -> auto& {
    return prometheus::BuildGauge().Name(name).Help(help).Register(now);
  };
  gauge("hmoe_requests_inflight", "Requests admitted by the router and not finished")
      .Add({})
      .Set(s.inflight());
  gauge("hmoe_requests_inflight_limit", "The router's --max-inflight")
      .Add({})
      .Set(s.max_inflight());
  gauge("hmoe_prefill_queue_requests", "Long prompts waiting for a prefill worker")
      .Add({})
      .Set(s.prefill_queue());
  auto& up = gauge("hmoe_worker_up", "1 while the worker is live, 0 when draining or dead");
  auto& running = gauge("hmoe_worker_running_requests", "Requests the worker runs");
  auto& waiting = gauge("hmoe_worker_waiting_requests", "Requests waiting in the worker's queue");
  auto& batch = gauge("hmoe_worker_batch_size", "The worker's batch size (decode slots)");
  auto& kv_used = gauge("hmoe_worker_kv_blocks_used", "KV cache blocks in use");
  auto& kv_total = gauge("hmoe_worker_kv_blocks_total", "KV cache blocks of the worker");
  auto& tps = gauge("hmoe_worker_tokens_per_second", "Tokens per second, as the worker reports");
  auto& prefix_tokens =
      gauge("hmoe_worker_prefix_cache_tokens", "Tokens the decode worker's prefix cache holds");
  const auto counter = [&now](const std::string& name, const std::string& help) -> auto& {
    return prometheus::BuildCounter().Name(name).Help(help).Register(now);
  };
  auto& prefix_hit_tokens = counter("hmoe_worker_prefix_cache_hit_tokens_total",
                                    "Prompt tokens reused from the prefix cache since the worker "
                                    "started");
  auto& prefix_hits = counter("hmoe_worker_prefix_cache_hits_total",
                              "Requests that reused a cached prefix since the worker started");
  auto& prefix_evicted = counter("hmoe_worker_prefix_cache_evicted_blocks_total",
                                 "KV blocks evicted from the prefix cache since the worker "
                                 "started");
  for (const v1::WorkerInfo& w : s.workers()) {
    std::string kind = v1::WorkerKind_Name(w.kind());
    absl::AsciiStrToLower(&kind);
    if (absl::StartsWith(kind, "worker_kind_")) kind = kind.substr(12);
    const prometheus::Labels labels = {{"worker", w.worker_id()}, {"kind", kind}};
    up.Add(labels).Set(w.state() == v1::WORKER_STATE_LIVE ? 1 : 0);
    running.Add(labels).Set(w.running());
    waiting.Add(labels).Set(w.waiting());
    batch.Add(labels).Set(w.batch_size());
    kv_used.Add(labels).Set(static_cast<double>(w.kv_blocks_total() - w.kv_blocks_free()));
    kv_total.Add(labels).Set(static_cast<double>(w.kv_blocks_total()));
    tps.Add(labels).Set(w.tokens_per_second());
    if (w.kind() == v1::WORKER_KIND_DECODE) {
      prefix_tokens.Add(labels).Set(static_cast<double>(w.prefix_cache_tokens()));
      prefix_hit_tokens.Add(labels).Increment(static_cast<double>(w.prefix_cache_hit_tokens()));
      prefix_hits.Add(labels).Increment(static_cast<double>(w.prefix_cache_hits()));
      prefix_evicted.Add(labels).Increment(static_cast<double>(w.prefix_cache_evicted_blocks()));
    }
  }
  std::vector<prometheus::MetricFamily> families = registry_->Collect();
  for (prometheus::MetricFamily& f : now.Collect()) families.push_back(std::move(f));
  std::ostringstream out;
  prometheus::TextSerializer().Serialize(out, families);
  return out.str();
}

}  // namespace hmoe::router
