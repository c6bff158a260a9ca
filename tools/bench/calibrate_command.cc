#include "tools/bench/calibrate_command.h"

#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <iostream>
#include <sstream>
#include <thread>

#include "absl/flags/declare.h"
#include "absl/flags/flag.h"
#include "absl/status/status.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"

#include "tools/bench/bench_report.h"
#include "tools/bench/bench_runner.h"
#include "tools/bench/calibration.h"

// Defined by hmoe_cli.cc and bench_command.cc, shared with the other commands.
ABSL_DECLARE_FLAG(std::string, addr);
ABSL_DECLARE_FLAG(uint64_t, seed);
ABSL_DECLARE_FLAG(double, timeout_s);
ABSL_DECLARE_FLAG(std::string, calibration);
ABSL_DECLARE_FLAG(std::string, label);
ABSL_DECLARE_FLAG(int, repeats);
ABSL_DECLARE_FLAG(int64_t, decode_prompt_tokens);
ABSL_DECLARE_FLAG(std::string, protocol);

ABSL_FLAG(std::string, lengths, "32,64,128,256,512,1024,2048",
          "calibrate: prompt lengths (comma-separated) at which chunked and SLP TTFT are measured");
ABSL_FLAG(std::string, batch_sizes, "1,2,4,8",
          "calibrate: decode batch sizes (comma-separated; capped by the decode worker's)");
ABSL_FLAG(int64_t, step_tokens, 32, "calibrate: forced tokens of each decode request");

namespace hmoe::bench {
namespace {

int Usage(const absl::Status& s) {
  std::cerr << "calibrate: " << s.message() << "\n";
  return 2;
}

std::string ReadText(const char* path) {
  std::ifstream f(path);
  std::stringstream s;
  s << f.rdbuf();
  return s.str();
}

// The machine the measurements come from: CPU model, cores, load average.
std::string CpuModel() {
  for (absl::string_view line : absl::StrSplit(ReadText("/proc/cpuinfo"), '\n')) {
    if (absl::StartsWith(line, "model name")) {
      std::vector<absl::string_view> kv = absl::StrSplit(line, absl::MaxSplits(':', 1));
      if (kv.size() == 2) return std::string(absl::StripAsciiWhitespace(kv[1]));
    }
  }
  return "";
}
nlohmann::json LoadAverage() {
  std::vector<double> load;
  for (absl::string_view item : absl::StrSplit(ReadText("/proc/loadavg"), ' ')) {
    double v = 0;
    if (load.size() < 3 && absl::SimpleAtod(item, &v)) load.push_back(v);
  }
  return load;
}

}  // namespace

int RunCalibrateCommand(const std::vector<std::string>& argv) {
  if (const std::string protocol = absl::GetFlag(FLAGS_protocol); protocol != "grpc") {
    // Calibration forces each request's path (path_hint), which only the gRPC API carries.
    return Usage(absl::InvalidArgumentError(
        absl::StrCat("--protocol ", protocol,
                     ": calibrate speaks gRPC only (it forces each request's path "
                     "with the path hint, which the HTTP API does not take)")));
  }
  const std::string path = absl::GetFlag(FLAGS_calibration);
  if (path.empty()) {
    return Usage(absl::InvalidArgumentError(
        "--calibration FILE is required (where the thresholds and measurements go)"));
  }
  absl::StatusOr<std::vector<int64_t>> lengths =
      ParseIntList(absl::GetFlag(FLAGS_lengths), "--lengths", 1);
  if (!lengths.ok()) return Usage(lengths.status());
  absl::StatusOr<std::vector<int64_t>> batches =
      ParseIntList(absl::GetFlag(FLAGS_batch_sizes), "--batch-sizes", 1);
  if (!batches.ok()) return Usage(batches.status());
  if (batches->back() > 1024) {
    return Usage(absl::InvalidArgumentError("--batch-sizes: at most 1024 requests at once"));
  }
  CalibrateOptions o;
  o.lengths = *lengths;
  o.repeats = absl::GetFlag(FLAGS_repeats);
  o.step_tokens = absl::GetFlag(FLAGS_step_tokens);
  o.decode_prompt_tokens = absl::GetFlag(FLAGS_decode_prompt_tokens);
  o.seed = absl::GetFlag(FLAGS_seed);
  if (o.repeats < 1 || o.repeats > 100) {
    return Usage(absl::InvalidArgumentError("--repeats must be in [1, 100]"));
  }
  if (o.step_tokens < 2 || o.decode_prompt_tokens < 1) {
    return Usage(absl::InvalidArgumentError(
        "--step-tokens >= 2 and --decode-prompt-tokens >= 1 are required"));
  }
  o.log = [](const std::string& line) { std::cerr << "calibrate: " << line << std::endl; };
  // Written next to the file and renamed at the end: a failed run leaves an earlier file intact.
  const std::string tmp = path + ".tmp";
  std::ofstream out(tmp);
  if (!out) {
    std::cerr << "calibrate: cannot write " << tmp << ": " << std::strerror(errno) << "\n";
    return 1;
  }
  struct RemoveTmp {
    const std::string& tmp;
    bool keep = false;
    ~RemoveTmp() {
      if (!keep) std::remove(tmp.c_str());
    }
  } remove_tmp{tmp};

  const std::string addr = absl::GetFlag(FLAGS_addr);
  GrpcBenchClient client(addr, absl::GetFlag(FLAGS_timeout_s));
  const absl::StatusOr<v1::ModelInfo> info = client.ModelInfo();
  if (!info.ok()) {
    std::cerr << "calibrate: " << info.status().message() << "\n";
    return 1;
  }
  const absl::StatusOr<v1::RouterStatus> status = client.RouterStatus();
  if (!status.ok()) {
    std::cerr << "calibrate: " << status.status().message() << "\n";
    return 1;
  }
  int prefill_workers = 0, max_batch = 0;
  for (const v1::WorkerInfo& w : status->workers()) {
    if (w.state() != v1::WORKER_STATE_LIVE) continue;
    if (w.kind() == v1::WORKER_KIND_PREFILL) ++prefill_workers;
    if (w.kind() == v1::WORKER_KIND_DECODE) max_batch = std::max(max_batch, w.batch_size());
  }
  if (prefill_workers == 0) {
    std::cerr << "calibrate: the router at " << addr
              << " has no live prefill worker, so SLP cannot be measured: deploy with "
                 "--prefill-workers 1 (or more) and calibrate again\n";
    return 1;
  }
  for (int64_t b : *batches) {
    if (max_batch > 0 && b > max_batch) {
      o.log(absl::StrFormat("batch size %d left out: the decode worker runs at most %d", b,
                            max_batch));
      continue;
    }
    o.batch_sizes.push_back(static_cast<int>(b));
  }
  if (o.batch_sizes.empty()) o.batch_sizes.push_back(1);

  nlohmann::json doc = {
      {"schema", kCalibrationSchema},
      {"command", absl::StrJoin(argv, " ")},
      {"label", absl::GetFlag(FLAGS_label)},
      {"started_at", absl::FormatTime(absl::RFC3339_sec, absl::Now(), absl::UTCTimeZone())},
      {"host",
       {{"cpu", CpuModel()},
        {"cpus", std::thread::hardware_concurrency()},
        {"loadavg_start", LoadAverage()}}},
      {"server", ServerJson(addr, *info, status)}};

  absl::StatusOr<CalibrateReport> report = RunCalibration(client, *info, o);
  if (!report.ok()) {
    std::cerr << "calibrate: " << report.status().message() << "\n";
    return absl::IsInvalidArgument(report.status()) ? 2 : 1;
  }
  doc["host"]["loadavg_end"] = LoadAverage();
  doc["finished_at"] = absl::FormatTime(absl::RFC3339_sec, absl::Now(), absl::UTCTimeZone());

  // The crossing point from the medians of the repeats.
  std::vector<PathTtft> rungs;
  nlohmann::json prefill = nlohmann::json::array();
  std::string table = "prompt tokens   chunked TTFT   SLP TTFT   chunked/SLP  (medians)\n";
  for (const LengthMeasurement& m : report->prefill) {
    const PathTtft r{m.prompt_tokens, Median(m.chunked_ttft_s), Median(m.slp_ttft_s)};
    rungs.push_back(r);
    prefill.push_back({{"prompt_tokens", m.prompt_tokens},
                       {"chunked_ttft_s", m.chunked_ttft_s},
                       {"slp_ttft_s", m.slp_ttft_s},
                       {"chunked_median_s", r.chunked_s},
                       {"slp_median_s", r.slp_s}});
    absl::StrAppendFormat(&table, "%13d   %10.3f s  %7.3f s   %10.2f\n", m.prompt_tokens,
                          r.chunked_s, r.slp_s, r.chunked_s / r.slp_s);
  }
  nlohmann::json decode = nlohmann::json::array();
  table += "decode batch   step (mean TPOT)   tokens/s\n";
  for (const BatchMeasurement& m : report->decode) {
    double sum = 0;
    for (double t : m.tpot_s) sum += t;
    const double step = sum / static_cast<double>(m.tpot_s.size());
    decode.push_back({{"batch", m.batch},
                      {"tpot_s", m.tpot_s},
                      {"step_s", step},
                      {"tokens_per_s", m.batch / step}});
    absl::StrAppendFormat(&table, "%12d   %13.2f ms   %8.1f\n", m.batch, 1e3 * step,
                          m.batch / step);
  }
  const absl::StatusOr<Crossing> crossing = FindCrossing(rungs, info->context_length());
  if (!crossing.ok()) {
    std::cerr << "calibrate: " << crossing.status().message() << "\n";
    return 1;
  }
  RouterThresholds t;
  t.chunk_threshold_tokens = crossing->threshold_tokens;
  // The DSLP idle window is kept (see docs/bench.md "Calibration").
  t.decode_idle_window_s = (info->decode_idle_window_ms() + 999) / 1000;
  std::string idle_reason =
      "kept at the router's value: the window predicts whether decode requests arrive while a "
      "DSLP prefill holds every prefill worker, which is a property of the traffic, not a speed "
      "this node's measurements can give";
  if (prefill_workers < 2) {
    absl::StrAppend(&idle_reason,
                    "; besides, DSLP needs two or more prefill workers and this "
                    "stack has ",
                    prefill_workers);
  }
  nlohmann::json derivation = {{"outcome", CrossingOutcomeName(crossing->outcome)},
                               {"statistic", "median TTFT of the repeats per length"}};
  std::string summary;
  switch (crossing->outcome) {
    case CrossingOutcome::kCrossing:
      derivation["crossing_tokens"] = crossing->crossing_tokens;
      derivation["between_tokens"] = {crossing->below_tokens, crossing->above_tokens};
      summary = absl::StrFormat(
          "SLP beats chunked from %.0f tokens (interpolated between %d and %d)",
          crossing->crossing_tokens, crossing->below_tokens, crossing->above_tokens);
      break;
    case CrossingOutcome::kSlpAlwaysWins:
      summary = absl::StrFormat(
          "SLP beats chunked at every measured length: the crossing is below %d tokens, the "
          "shortest one (measure shorter lengths to place it)",
          crossing->threshold_tokens);
      break;
    case CrossingOutcome::kSlpNeverWins:
      summary = absl::StrFormat(
          "SLP does not beat chunked at the longest measured length (%d tokens): every prompt "
          "stays chunked (threshold = the context, %d)",
          rungs.back().prompt_tokens, crossing->threshold_tokens);
      break;
  }
  derivation["summary"] = summary;
  doc["router"] = ThresholdsJson(t);
  doc["derivation"] = {{"chunk_threshold", derivation},
                       {"decode_idle_window_s", {{"kept", true}, {"reason", idle_reason}}}};
  doc["config"] = {{"lengths", o.lengths},
                   {"batch_sizes", o.batch_sizes},
                   {"repeats", o.repeats},
                   {"prefill_new_tokens", o.prefill_new_tokens},
                   {"decode_prompt_tokens", o.decode_prompt_tokens},
                   {"step_tokens", o.step_tokens},
                   {"seed", o.seed}};
  doc["measurements"] = {{"prefill", prefill}, {"decode", decode}};
  nlohmann::json requests = nlohmann::json::array();
  for (const RequestResult& r : report->requests) requests.push_back(RequestJson(r));
  doc["requests"] = std::move(requests);

  out << doc.dump(1) << "\n";
  out.close();
  if (!out) {
    std::cerr << "calibrate: writing " << tmp << " failed\n";
    return 1;
  }
  if (std::rename(tmp.c_str(), path.c_str()) != 0) {
    std::cerr << "calibrate: cannot rename " << tmp << " to " << path << ": "
              << std::strerror(errno) << "\n";
    return 1;
  }
  remove_tmp.keep = true;
  std::cout << table << summary << "\n"
            << absl::StrFormat("router: --chunk-threshold=%d --decode-idle-window-s=%d (kept)\n",
                               t.chunk_threshold_tokens, t.decode_idle_window_s);
  std::cerr << "calibrate: wrote " << path << " (hmoe deploy --calibration " << path << ")\n";
  return 0;
}

}  // namespace hmoe::bench
