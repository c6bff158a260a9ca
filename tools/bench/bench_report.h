#pragma once

// The JSON document `hmoe bench --json FILE` writes (schema "hmoe-bench/1", docs/bench.md) and
// the text tables it prints.

#include <string>
#include <vector>

#include "tools/bench/bench_runner.h"
#include "tools/bench/bench_stats.h"

#include <nlohmann/json.hpp>

namespace hmoe::bench {

inline constexpr char kSchema[] = "hmoe-bench/1";

nlohmann::json DistributionJson(const Distribution& d);
nlohmann::json SummaryJson(const Summary& s);
nlohmann::json RequestJson(const RequestResult& r);
nlohmann::json ScenariosJson(const ScenarioReport& report);
// The document's "server" object: the router's address, model limits, thresholds and workers
// (an empty worker list when GetStatus failed).
nlohmann::json ServerJson(const std::string& addr, const v1::ModelInfo& info,
                          const absl::StatusOr<v1::RouterStatus>& st);

// Human-readable tables (milliseconds for TTFT/TPOT/ITL).
std::string SummaryText(const Summary& s, const Slo& slo);

// Prompt tokens the prefix cache supplied over the measured, successful requests.
struct PrefixCacheSummary {
  int64_t prompt_tokens = 0;
  int64_t cached_prompt_tokens = 0;
  double hit_rate = 0;  // cached / prompt tokens (NaN without requests)
  int64_t requests_with_hits = 0;
};
PrefixCacheSummary SummarizePrefixCache(const std::vector<RequestResult>& requests);
std::string PrefixCacheText(const PrefixCacheSummary& c);
nlohmann::json PrefixCacheJson(const PrefixCacheSummary& c);
std::string ScenariosText(const ScenarioReport& report);

}  // namespace hmoe::bench
