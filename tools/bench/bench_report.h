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

// Human-readable tables (milliseconds for TTFT/TPOT/ITL).
std::string SummaryText(const Summary& s, const Slo& slo);
std::string ScenariosText(const ScenarioReport& report);

}  // namespace hmoe::bench
