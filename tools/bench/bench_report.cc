#include "tools/bench/bench_report.h"

#include <cmath>
#include <limits>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"

namespace hmoe::bench {
namespace {

// NaN and infinities become null.
nlohmann::json Num(double x) { return std::isfinite(x) ? nlohmann::json(x) : nlohmann::json(); }

std::string Ms(double s) { return std::isfinite(s) ? absl::StrFormat("%.1f", s * 1e3) : "-"; }
std::string Ratio(double x) { return std::isfinite(x) ? absl::StrFormat("%.2f", x) : "-"; }

}  // namespace

nlohmann::json DistributionJson(const Distribution& d) {
  return {{"count", d.count},  {"mean", Num(d.mean)}, {"min", Num(d.min)}, {"max", Num(d.max)},
          {"p50", Num(d.p50)}, {"p90", Num(d.p90)},   {"p99", Num(d.p99)}};
}

nlohmann::json SummaryJson(const Summary& s) {
  return {{"requests", s.requests},
          {"succeeded", s.succeeded},
          {"failed", s.failed},
          {"duration_s", Num(s.duration_s)},
          {"prompt_tokens", s.prompt_tokens},
          {"output_tokens", s.output_tokens},
          {"request_throughput", Num(s.request_throughput)},
          {"output_throughput", Num(s.output_throughput)},
          {"slo_met", s.slo_met},
          {"slo_attainment", Num(s.slo_attainment)},
          {"goodput", Num(s.goodput)},
          {"ttft_s", DistributionJson(s.ttft)},
          {"tpot_s", DistributionJson(s.tpot)},
          {"itl_s", DistributionJson(s.itl)},
          {"e2e_s", DistributionJson(s.e2e)}};
}

nlohmann::json RequestJson(const RequestResult& r) {
  nlohmann::json j = {{"index", r.index},
                      {"warmup", r.warmup},
                      {"status", r.status},
                      {"start_s", Num(r.start_s)},
                      {"end_s", Num(r.end_s)},
                      {"prompt_tokens", r.prompt_tokens},
                      {"max_new_tokens", r.max_new_tokens},
                      {"output_tokens", OutputTokens(r)},
                      {"ttft_s", Num(Ttft(r))},
                      {"tpot_s", Num(Tpot(r))},
                      {"e2e_s", Num(E2e(r))},
                      {"finish_reason", r.finish_reason},
                      {"path", r.path},
                      {"worker_ids", r.worker_ids},
                      {"attempts", r.attempts},
                      {"server",
                       {{"queue_s", r.server_queue_s},
                        {"ttft_s", r.server_ttft_s},
                        {"tpot_s", r.server_tpot_s},
                        {"total_s", r.server_total_s}}},
                      {"cached_prompt_tokens", r.cached_prompt_tokens}};
  if (r.protocol == "http") {
    // Not available over HTTP: null, not zeros that would read as measurements.
    for (const char* key : {"path", "worker_ids", "attempts", "server"}) j[key] = nullptr;
  }
  if (r.conversation >= 0) {
    j["conversation"] = r.conversation;
    j["turn"] = r.turn;
  }
  nlohmann::json gaps = nlohmann::json::array();
  for (double g : InterTokenGaps(r)) gaps.push_back(g);
  j["itl_s"] = std::move(gaps);
  if (!r.ok) j["message"] = r.message;
  if (!r.scenario.empty()) {
    j["scenario"] = r.scenario;
    j["repeat"] = r.repeat;
    if (r.role != 0) j["role"] = std::string(1, r.role);
  }
  return j;
}

nlohmann::json ScenariosJson(const ScenarioReport& report) {
  nlohmann::json cal = nlohmann::json::array();
  for (const CalibrationPoint& c : report.calibration) {
    cal.push_back({{"prompt_tokens", c.prompt_tokens}, {"ttft_s", Num(c.ttft_s)}});
  }
  nlohmann::json list = nlohmann::json::array();
  for (const ScenarioResult& r : report.scenarios) {
    nlohmann::json totals = nlohmann::json::array();
    for (double t : r.total_s) totals.push_back(Num(t));
    list.push_back({{"name", r.shape.name},
                    {"prefills", r.shape.prefills},
                    {"decodes", r.shape.decodes},
                    {"total_s", totals},
                    {"mean_p_ttft_s", Num(r.mean_p_ttft_s)},
                    {"mean_d_tpot_s", Num(r.mean_d_tpot_s)},
                    {"mean_d_ttft_s", Num(r.mean_d_ttft_s)},
                    {"mean_total_s", Num(r.mean_total_s)},
                    {"norm_p_ttft", Num(r.norm_p_ttft)},
                    {"norm_d_tpot", Num(r.norm_d_tpot)},
                    {"norm_total", Num(r.norm_total)}});
  }
  return {{"prefill_tokens", report.prefill_tokens},
          {"calibration", std::move(cal)},
          {"results", std::move(list)}};
}

PrefixCacheSummary SummarizePrefixCache(const std::vector<RequestResult>& requests) {
  PrefixCacheSummary c;
  for (const RequestResult& r : requests) {
    if (r.warmup || !r.ok) continue;
    c.prompt_tokens += r.prompt_tokens;
    c.cached_prompt_tokens += r.cached_prompt_tokens;
    c.requests_with_hits += r.cached_prompt_tokens > 0;
  }
  c.hit_rate = c.prompt_tokens > 0 ? static_cast<double>(c.cached_prompt_tokens) /
                                         static_cast<double>(c.prompt_tokens)
                                   : std::numeric_limits<double>::quiet_NaN();
  return c;
}

nlohmann::json PrefixCacheJson(const PrefixCacheSummary& c) {
  return {{"prompt_tokens", c.prompt_tokens},
          {"cached_prompt_tokens", c.cached_prompt_tokens},
          {"hit_rate", Num(c.hit_rate)},
          {"requests_with_hits", c.requests_with_hits}};
}

std::string PrefixCacheText(const PrefixCacheSummary& c) {
  return absl::StrFormat(
      "prefix cache: %d of %d prompt tokens reused (hit rate %.1f %%), %d requests with a hit\n",
      c.cached_prompt_tokens, c.prompt_tokens, 100 * c.hit_rate, c.requests_with_hits);
}

std::string SummaryText(const Summary& s, const Slo& slo) {
  std::string out = absl::StrFormat(
      "requests %d (%d ok, %d failed) in %.2f s: %.3f req/s, %.1f output tok/s\n"
      "SLO (TTFT <= %s ms, TPOT <= %s ms): %d met, attainment %.1f %%, goodput %.3f req/s\n"
      "%-12s %6s %10s %10s %10s %10s %10s\n",
      s.requests, s.succeeded, s.failed, s.duration_s, s.request_throughput, s.output_throughput,
      Ms(slo.ttft_s), Ms(slo.tpot_s), s.slo_met, 100 * s.slo_attainment, s.goodput, "metric (ms)",
      "n", "mean", "p50", "p90", "p99", "max");
  auto row = [&](const char* name, const Distribution& d) {
    absl::StrAppendFormat(&out, "%-12s %6d %10s %10s %10s %10s %10s\n", name, d.count, Ms(d.mean),
                          Ms(d.p50), Ms(d.p90), Ms(d.p99), Ms(d.max));
  };
  row("TTFT", s.ttft);
  row("TPOT", s.tpot);
  row("ITL", s.itl);
  row("end-to-end", s.e2e);
  return out;
}

std::string ScenariosText(const ScenarioReport& report) {
  std::string out = absl::StrFormat(
      "prefill requests: %d prompt tokens\n%-8s %12s %8s %12s %8s %12s %8s\n",
      report.prefill_tokens, "scenario", "P TTFT ms", "/1P", "D TPOT ms", "/1D", "total ms", "/1P");
  for (const ScenarioResult& r : report.scenarios) {
    absl::StrAppendFormat(&out, "%-8s %12s %8s %12s %8s %12s %12s %8s\n", r.shape.name,
                          Ms(r.mean_p_ttft_s), Ratio(r.norm_p_ttft), Ms(r.mean_d_tpot_s),
                          Ratio(r.norm_d_tpot), Ms(r.mean_d_ttft_s), Ms(r.mean_total_s),
                          Ratio(r.norm_total));
  }
  return out;
}

nlohmann::json ServerJson(const std::string& addr, const v1::ModelInfo& info,
                          const absl::StatusOr<v1::RouterStatus>& st) {
  nlohmann::json workers = nlohmann::json::array();
  if (st.ok()) {
    for (const v1::WorkerInfo& w : st->workers()) {
      workers.push_back({{"worker_id", w.worker_id()},
                         {"kind", w.kind() == v1::WORKER_KIND_PREFILL ? "prefill" : "decode"},
                         {"device", w.device()},
                         {"batch_size", w.batch_size()}});
    }
  }
  return {{"addr", addr},
          {"model", info.model()},
          {"vocab_size", info.vocab_size()},
          {"context_length", info.context_length()},
          {"chunk_threshold_tokens", info.chunk_threshold_tokens()},
          {"decode_idle_window_ms", info.decode_idle_window_ms()},
          {"workers", std::move(workers)}};
}

}  // namespace hmoe::bench
