#pragma once

// Prometheus metrics of hmoe-router (prometheus-cpp; served as text on the HTTP API's GET
// /metrics, docs/api.md "Metrics"). Requests are counted and timed by wrapping Router::Generate
// (both APIs call Generate through here), so router.cc stays as it is; the gauges (in flight,
// waiting, per-worker state, batch, KV blocks, tokens/s) are read from Router::GetStatus at each
// scrape. Names follow Prometheus' conventions: the hmoe_ prefix, base units (_seconds), _total
// for counters. Thread-safe.

#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/time/time.h"

#include "proto/hmoe_v1.pb.h"
#include "router/router.h"

namespace prometheus {
class Registry;
class Counter;
class Histogram;
template <typename T>
class Family;
}  // namespace prometheus

namespace hmoe::router {

class RouterMetrics {
 public:
  RouterMetrics();
  ~RouterMetrics();
  RouterMetrics(const RouterMetrics&) = delete;
  RouterMetrics& operator=(const RouterMetrics&) = delete;

  // Router::Generate, recording the request's outcome, path, timing and token counts.
  absl::Status Generate(Router* router, const hmoe::v1::GenerateRequest& request,
                        absl::Time deadline, GenerateSink* sink);

  // The request metrics and the router's status as of now, in the Prometheus text format
  // (version 0.0.4).
  std::string Scrape(const Router& router) const;

  // The outcome label of a finished request: ok, cancelled, invalid, rejected, unavailable, error.
  static std::string Outcome(const absl::Status& status, const hmoe::v1::Finished* finished);

 private:
  std::shared_ptr<prometheus::Registry> registry_;
  prometheus::Family<prometheus::Counter>* requests_;
  prometheus::Histogram* ttft_;
  prometheus::Histogram* tpot_;
  prometheus::Histogram* e2e_;
  prometheus::Histogram* queue_;
  prometheus::Counter* prompt_tokens_;
  prometheus::Counter* generated_tokens_;
};

}  // namespace hmoe::router
