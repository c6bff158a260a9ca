// hmoe_gpu_bench (issue 20, "GPU benchmark"): the Device API's heavy ops on a real GPU, each as a
// fraction of the card's peak measured in the same run. A plain program (not Google Benchmark):
// every measurement is independent (a failing op prints its error and the tool goes on), times
// come from CUDA events on one stream, and a watchdog ends the run if the GPU stops making
// progress, so the tool never hangs. See docs/PERFORMANCE.md "GPU benchmark (hmoe_gpu_bench)".
//
//   hmoe_gpu_bench [--device N|cuda:N] [--json PATH] [--ops REGEX] [--max-m M] [--reps R]
//                  [--target-ms T]
//
// Yardsticks first (always run: they are the denominators): cuBLAS BF16 GEMM at 8192^3 (F32
// accumulation, tensor cores), cuBLAS F32 SGEMM at 8192^3 (no TF32), device-to-device copy and a
// read kernel over 1 GiB (bandwidth), host-to-device copy of 1 GiB from page-locked memory. Then
// the ops, through the project's Device (NewCudaDevice): FP8 block-scaled Linear at DeepSeek-V3
// shapes and M = 1 ... 16384 tokens (each next to a cuBLAS BF16 GEMM of the same M, N, K), MLA
// prefill and decode attention, the MoE gate, and CopyToDevice from registered host memory.
// Last, cuBLASLt FP8 GEMMs (the FP8 peak, and DeepSeek-V3's 128x128 / 1x128 block scaling at the
// linear shapes): the vendor path issue 20 item 3 would put under Device::Linear.
//
// Exit status: 0 every measurement ran, 1 some failed or were skipped for memory, 2 no CUDA device
// (or a CPU-only build), 3 the watchdog stopped a stuck run, 64 bad flags.

#include <cublasLt.h>
#include <sys/mman.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <fstream>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <regex>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include <cuda_runtime_api.h>

#include "common/device/cuda_host_register.h"
#include "common/device/device.h"
#include "common/device/native_stream.h"
#include "common/kernels/cuda/cuda_backend.h"
#include "tests/bench/gpu_bench_kernels.h"

#include <cublas_v2.h>
#include <nlohmann/json.hpp>

namespace hmoe {
namespace {

using json = nlohmann::json;
using Clock = std::chrono::steady_clock;

constexpr size_t kGiB = size_t{1} << 30;
constexpr size_t kMiB = size_t{1} << 20;

// ---------------------------------------------------------------------------------- flags

struct Options {
  int device = 0;
  std::string json_path;
  std::string ops = ".*";
  int64_t max_m = 16384;
  int max_reps = 20;
  double target_ms = 200.0;
  // Seconds without progress (one measurement stuck) and in all after which the watchdog exits.
  double stall_s = 60.0;
  double hard_limit_s = 300.0;
  // After this many seconds, each remaining measurement runs once (the run stays short).
  double soft_limit_s = 120.0;
};

constexpr char kUsage[] =
    "usage: hmoe_gpu_bench [--device N|cuda:N] [--json PATH] [--ops REGEX] [--max-m M]\n"
    "                      [--reps R] [--target-ms T] [--soft-limit-s S] [--hard-limit-s S]\n"
    "  --device      GPU ordinal (default 0)\n"
    "  --json        also write the results as JSON to PATH (rewritten after every result)\n"
    "  --ops         only the ops whose id matches REGEX (std::regex search), e.g.\n"
    "                'linear/.*/M=(512|4096)$' or 'mla|moe_gate'; the yardsticks always run\n"
    "  --max-m       largest token count of the linear and gate shapes (default 16384)\n"
    "  --reps        most timed repetitions per op (default 20; at least 3 unless over time)\n"
    "  --target-ms   stop repeating an op once this much was timed (default 200)\n"
    "  --soft-limit-s  after this many seconds every remaining op is timed once (default 120)\n"
    "  --hard-limit-s  the watchdog ends the run after this many seconds (default 300)\n";

bool ParseInt(const std::string& s, int64_t* out) {
  char* end = nullptr;
  errno = 0;
  const long long v = std::strtoll(s.c_str(), &end, 10);
  if (s.empty() || errno != 0 || *end != '\0') return false;
  *out = v;
  return true;
}

bool ParseDouble(const std::string& s, double* out) {
  char* end = nullptr;
  errno = 0;
  const double v = std::strtod(s.c_str(), &end);
  if (s.empty() || errno != 0 || *end != '\0' || !std::isfinite(v)) return false;
  *out = v;
  return true;
}

// Returns an error message, or "" when the flags are good.
std::string ParseFlags(int argc, char** argv, Options* o) {
  for (int i = 1; i < argc; ++i) {
    std::string arg = argv[i];
    std::string value;
    bool has_value = false;
    if (const size_t eq = arg.find('='); eq != std::string::npos && arg.rfind("--", 0) == 0) {
      value = arg.substr(eq + 1);
      arg = arg.substr(0, eq);
      has_value = true;
    }
    if (arg == "-h" || arg == "--help") {
      std::fputs(kUsage, stdout);
      std::exit(0);
    }
    const bool known = arg == "--device" || arg == "--json" || arg == "--ops" || arg == "--max-m" ||
                       arg == "--reps" || arg == "--target-ms" || arg == "--soft-limit-s" ||
                       arg == "--hard-limit-s";
    if (!known) return absl::StrCat("unknown flag '", arg, "'");
    if (!has_value) {
      if (i + 1 >= argc) return absl::StrCat(arg, " needs a value");
      value = argv[++i];
    }
    int64_t n = 0;
    double d = 0;
    if (arg == "--device") {
      std::string v = value;
      if (v.rfind("cuda:", 0) == 0) v = v.substr(5);
      if (!ParseInt(v, &n) || n < 0 || n > 1024) {
        return absl::StrCat("--device: '", value, "' is not a GPU ordinal (N or cuda:N)");
      }
      o->device = static_cast<int>(n);
    } else if (arg == "--json") {
      if (value.empty()) return "--json: empty path";
      o->json_path = value;
    } else if (arg == "--ops") {
      try {
        std::regex re(value);
      } catch (const std::regex_error& e) {
        return absl::StrCat("--ops: bad regular expression '", value, "': ", e.what());
      }
      o->ops = value;
    } else if (arg == "--max-m") {
      if (!ParseInt(value, &n) || n < 1) return absl::StrCat("--max-m: '", value, "' is not >= 1");
      o->max_m = n;
    } else if (arg == "--reps") {
      if (!ParseInt(value, &n) || n < 1 || n > 100000) {
        return absl::StrCat("--reps: '", value, "' is not in [1, 100000]");
      }
      o->max_reps = static_cast<int>(n);
    } else if (arg == "--target-ms" || arg == "--soft-limit-s" || arg == "--hard-limit-s") {
      if (!ParseDouble(value, &d) || d <= 0) {
        return absl::StrCat(arg, ": '", value, "' is not a positive number");
      }
      (arg == "--target-ms"      ? o->target_ms
       : arg == "--soft-limit-s" ? o->soft_limit_s
                                 : o->hard_limit_s) = d;
    }
  }
  return "";
}

// ---------------------------------------------------------------------------------- watchdog

// The main thread reports progress; the watchdog thread ends the process (exit status 3) when one
// measurement makes none for Options::stall_s or the run exceeds Options::hard_limit_s: a hung
// kernel or a host wait on a dead GPU must not hang the GPU check. The JSON file on disk holds
// every result finished so far (it is rewritten atomically after each).
class Watchdog {
 public:
  Watchdog(double stall_s, double hard_s) : stall_s_(stall_s), hard_s_(hard_s) {
    Progress("start");
    thread_ = std::thread([this] { Run(); });
  }
  ~Watchdog() {
    stop_.store(true);
    thread_.join();
  }
  void Progress(const std::string& what) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      what_ = what;
    }
    last_.store(Seconds());
  }
  double Seconds() const { return std::chrono::duration<double>(Clock::now() - start_).count(); }

 private:
  void Run() {
    while (!stop_.load()) {
      std::this_thread::sleep_for(std::chrono::milliseconds(200));
      const double now = Seconds();
      const bool stalled = now - last_.load() > stall_s_;
      if (stalled || now > hard_s_) {
        std::string what;
        {
          std::lock_guard<std::mutex> lock(mu_);
          what = what_;
        }
        std::fprintf(stderr,
                     "\nhmoe_gpu_bench: WATCHDOG: %s after %.0f s (at '%s'); the GPU or the host "
                     "wait is stuck. Results so far are in the JSON file, if one was asked for. "
                     "Exiting with status 3.\n",
                     stalled ? "no progress for the stall limit" : "hard time limit reached", now,
                     what.c_str());
        std::fflush(stdout);
        std::fflush(stderr);
        std::_Exit(3);
      }
    }
  }

  const double stall_s_, hard_s_;
  const Clock::time_point start_ = Clock::now();
  std::atomic<double> last_{0.0};
  std::atomic<bool> stop_{false};
  std::mutex mu_;
  std::string what_;
  std::thread thread_;
};

// ---------------------------------------------------------------------------------- errors

absl::Status CudaError(cudaError_t err, const char* what) {
  cudaGetLastError();
  return absl::InternalError(
      absl::StrCat(what, ": ", cudaGetErrorName(err), " (", cudaGetErrorString(err), ")"));
}

#define BENCH_CUDA(expr)                                                    \
  do {                                                                      \
    if (const cudaError_t bench_err_ = (expr); bench_err_ != cudaSuccess) { \
      return CudaError(bench_err_, #expr);                                  \
    }                                                                       \
  } while (false)

#define BENCH_CUBLAS(expr)                                                                       \
  do {                                                                                           \
    if (const cublasStatus_t bench_st_ = (expr); bench_st_ != CUBLAS_STATUS_SUCCESS) {           \
      return absl::InternalError(absl::StrCat(#expr, ": ", cublasGetStatusName(bench_st_), " (", \
                                              cublasGetStatusString(bench_st_), ")"));           \
    }                                                                                            \
  } while (false)

#define BENCH_RETURN_IF_ERROR(expr)                                      \
  do {                                                                   \
    if (absl::Status bench_s_ = (expr); !bench_s_.ok()) return bench_s_; \
  } while (false)

// ---------------------------------------------------------------------------------- timing

struct Timing {
  double median_ms = 0;  // per call
  double min_ms = 0;
  int reps = 0;   // timed repetitions
  int inner = 0;  // calls per repetition (back to back: small ops are timed in batches)
};

class Timer {
 public:
  Timer(cudaStream_t stream, const Options& opt, Watchdog& dog)
      : stream_(stream), opt_(opt), dog_(dog) {}
  ~Timer() {
    if (start_ != nullptr) cudaEventDestroy(start_);
    if (stop_ != nullptr) cudaEventDestroy(stop_);
  }
  absl::Status Init() {
    BENCH_CUDA(cudaEventCreate(&start_));
    BENCH_CUDA(cudaEventCreate(&stop_));
    return absl::OkStatus();
  }

  // Times `op` (enqueues one call on the stream): one warm-up call, one timed calibration call,
  // then repetitions of `inner` back-to-back calls (inner sized so that a repetition takes >= 1
  // ms; with inner 1 the calibration call counts as the first repetition) until target_ms was
  // timed or max_reps were done, at least 3 (1 once the soft time limit has passed or when the
  // warm-up and calibration calls took more than 4 s). Reports the median and minimum time per
  // call.
  absl::StatusOr<Timing> Time(const std::string& id, const std::function<absl::Status()>& op) {
    dog_.Progress(id);
    const Clock::time_point t0 = Clock::now();
    BENCH_RETURN_IF_ERROR(op());  // warm-up: scratch arenas, cuBLAS heuristics, caches
    BENCH_CUDA(cudaStreamSynchronize(stream_));
    dog_.Progress(id);
    absl::StatusOr<double> once = TimeBatch(op, 1);
    if (!once.ok()) return once.status();
    dog_.Progress(id);
    // Over the soft time limit, or an op slower than 2 s a call: the calibration call is the one
    // repetition (the run stays bounded whatever the op costs).
    const bool hurry = dog_.Seconds() > opt_.soft_limit_s ||
                       std::chrono::duration<double>(Clock::now() - t0).count() > 4.0;
    Timing t;
    t.inner = *once >= 1.0
                  ? 1
                  : static_cast<int>(std::min(200.0, std::ceil(1.0 / std::max(*once, 1e-3))));
    std::vector<double> per_call;
    double total = 0;
    if (t.inner == 1) {  // the calibration call was a repetition of one call already
      per_call.push_back(*once);
      total = *once;
    }
    const int min_reps = hurry ? 1 : std::min(3, opt_.max_reps);
    while (static_cast<int>(per_call.size()) < opt_.max_reps &&
           (static_cast<int>(per_call.size()) < min_reps || total < opt_.target_ms)) {
      if (hurry && !per_call.empty()) break;
      absl::StatusOr<double> ms = TimeBatch(op, t.inner);
      if (!ms.ok()) return ms.status();
      dog_.Progress(id);
      per_call.push_back(*ms / t.inner);
      total += *ms;
    }
    std::sort(per_call.begin(), per_call.end());
    const size_t n = per_call.size();
    t.reps = static_cast<int>(n);
    t.min_ms = per_call.front();
    t.median_ms = n % 2 == 1 ? per_call[n / 2] : 0.5 * (per_call[n / 2 - 1] + per_call[n / 2]);
    return t;
  }

 private:
  absl::StatusOr<double> TimeBatch(const std::function<absl::Status()>& op, int inner) {
    BENCH_CUDA(cudaEventRecord(start_, stream_));
    for (int i = 0; i < inner; ++i) BENCH_RETURN_IF_ERROR(op());
    BENCH_CUDA(cudaEventRecord(stop_, stream_));
    BENCH_CUDA(cudaEventSynchronize(stop_));
    BENCH_CUDA(cudaGetLastError());
    float ms = 0;
    BENCH_CUDA(cudaEventElapsedTime(&ms, start_, stop_));
    return static_cast<double>(ms);
  }

  cudaStream_t stream_;
  const Options& opt_;
  Watchdog& dog_;
  cudaEvent_t start_ = nullptr;
  cudaEvent_t stop_ = nullptr;
};

// ---------------------------------------------------------------------------------- results

// The card's peaks measured by the yardsticks (0: not measured).
struct Peaks {
  double bf16_tflops = 0;  // cuBLAS BF16 GEMM 8192^3, F32 accumulation
  double f32_tflops = 0;   // cuBLAS SGEMM 8192^3, no TF32
  double bw_gbs = 0;       // max(D2D copy, read kernel), bytes read + written
  double h2d_gbs = 0;      // cudaMemcpyAsync from cudaHostRegister'ed memory
  double fp8_tflops = 0;   // cuBLASLt FP8 E4M3 GEMM 8192^3, per-tensor scales (measured last)
};

struct Result {
  std::string id;     // e.g. "linear/q_b_proj/M=512"
  std::string group;  // yardstick, linear, cublas_bf16, mla_prefill, mla_decode, moe_gate, h2d
  std::string shape;  // human-readable
  json shape_json = json::object();
  std::string status = "ok";  // ok, failed, skipped
  std::string error;
  Timing timing;
  double flops = 0;  // per call (0: not a compute op)
  double bytes = 0;  // per call: unique bytes that must move (0: not counted)
  // The compute peak the op is compared with ("bf16" or "f32"; "" none) and whether its bytes are
  // compared with the device bandwidth or the host-to-device peak.
  std::string compute_peak;
  bool h2d = false;
  std::string note;
};

double Tflops(const Result& r) {
  return r.flops > 0 && r.timing.median_ms > 0 ? r.flops / (r.timing.median_ms * 1e-3) / 1e12 : 0;
}
double Gbs(const Result& r) {
  return r.bytes > 0 && r.timing.median_ms > 0 ? r.bytes / (r.timing.median_ms * 1e-3) / 1e9 : 0;
}

struct Fractions {
  double compute = 0;    // achieved TFLOP/s / compute peak
  double bandwidth = 0;  // achieved GB/s / bandwidth peak
  std::string compute_ref, bandwidth_ref;
};

Fractions FractionsOf(const Result& r, const Peaks& p) {
  Fractions f;
  if (r.compute_peak == "bf16" && p.bf16_tflops > 0) {
    f.compute = Tflops(r) / p.bf16_tflops;
    f.compute_ref = "bf16_gemm_8192";
  } else if (r.compute_peak == "f32" && p.f32_tflops > 0) {
    f.compute = Tflops(r) / p.f32_tflops;
    f.compute_ref = "sgemm_8192";
  } else if (r.compute_peak == "fp8" && p.fp8_tflops > 0) {
    f.compute = Tflops(r) / p.fp8_tflops;
    f.compute_ref = "fp8_gemm_8192";
  }
  const double bw = r.h2d ? p.h2d_gbs : p.bw_gbs;
  if (r.bytes > 0 && bw > 0) {
    f.bandwidth = Gbs(r) / bw;
    f.bandwidth_ref = r.h2d ? "h2d_registered_1GiB" : "device_bandwidth";
  }
  return f;
}

class Report {
 public:
  Report(const Options& opt, json header) : opt_(opt), doc_(std::move(header)) {
    doc_["results"] = json::array();
  }

  Peaks& peaks() { return peaks_; }

  void PrintHeaderRow() const {
    std::printf("%-44s %-30s %10s %5s %9s %7s %9s %7s  %s\n", "op", "shape", "ms(median)", "reps",
                "TFLOP/s", "%cmp", "GB/s", "%bw", "note");
  }

  void Add(Result r) {
    if (r.status != "ok") {
      ++problems_;
      std::printf("%-44s %-30s %s: %s\n", r.id.c_str(), r.shape.c_str(),
                  r.status == "failed" ? "FAILED" : "SKIPPED", r.error.c_str());
    } else {
      const Fractions f = FractionsOf(r, peaks_);
      auto num = [](double v, bool percent) {
        if (v <= 0) return std::string("-");
        char buf[32];
        std::snprintf(buf, sizeof(buf), percent ? "%.1f%%" : "%.2f", percent ? 100 * v : v);
        return std::string(buf);
      };
      std::printf("%-44s %-30s %10.4f %5d %9s %7s %9s %7s  %s\n", r.id.c_str(), r.shape.c_str(),
                  r.timing.median_ms, r.timing.reps, num(Tflops(r), false).c_str(),
                  num(f.compute, true).c_str(), num(Gbs(r), false).c_str(),
                  num(f.bandwidth, true).c_str(), r.note.c_str());
    }
    std::fflush(stdout);
    doc_["results"].push_back(ToJson(r));
    results_.push_back(std::move(r));
    Write();
  }

  // The summary the acceptance asks for, then the final JSON.
  void Finish(double seconds, bool aborted, const std::string& abort_reason) {
    json summary;
    summary["seconds"] = seconds;
    summary["problems"] = problems_;
    summary["aborted"] = aborted;
    if (aborted) summary["abort_reason"] = abort_reason;
    std::printf("\nSummary (%.1f s)\n", seconds);
    // Issue 20's target: FP8 prefill linears at M >= 4096 reach >= 40 % of the measured dense GEMM
    // peak of the dtype used: BF16 for Device::Linear (it runs BF16 GEMMs), FP8 for cuBLASLt's.
    struct Group {
      const char* group;
      const char* label;
      const char* peak_name;
      double peak;
      const char* key;
    };
    const Group groups[] = {
        {"linear", "Device::Linear FP8", "BF16 GEMM", peaks_.bf16_tflops, "fp8_linear_m_ge_4096"},
        {"lt_fp8", "cuBLASLt FP8 block-scaled", "FP8 GEMM", peaks_.fp8_tflops,
         "lt_fp8_blockscaled_m_ge_4096"}};
    for (const Group& g : groups) {
      std::vector<double> fr;
      for (const Result& r : results_) {
        if (r.group == g.group && r.status == "ok" && r.shape_json.value("M", 0) >= 4096) {
          fr.push_back(FractionsOf(r, peaks_).compute);
        }
      }
      if (fr.empty() || g.peak <= 0) continue;
      std::sort(fr.begin(), fr.end());
      const double med = fr[fr.size() / 2];
      std::printf(
          "  %s at M >= 4096: %zu shapes, fraction of the %s peak (%.1f TFLOP/s): min %.1f%%, "
          "median %.1f%%, max %.1f%%; issue 20 target >= 40%%: %s\n",
          g.label, fr.size(), g.peak_name, g.peak, 100 * fr.front(), 100 * med, 100 * fr.back(),
          fr.front() >= 0.4 ? "MET by every shape"
          : med >= 0.4      ? "met by the median, not by every shape"
                            : "NOT MET");
      summary[g.key] = {{"count", fr.size()},     {"peak", g.peak_name},
                        {"peak_tflops", g.peak},  {"min_fraction", fr.front()},
                        {"median_fraction", med}, {"max_fraction", fr.back()},
                        {"target", 0.4}};
    }
    std::printf("  %d measurement(s) failed or skipped%s\n", problems_,
                aborted ? absl::StrCat("; run ABORTED: ", abort_reason).c_str() : "");
    doc_["summary"] = summary;
    Write();
  }

  int problems() const { return problems_; }

 private:
  json ToJson(const Result& r) const {
    json j;
    j["id"] = r.id;
    j["group"] = r.group;
    j["shape"] = r.shape_json;
    j["status"] = r.status;
    if (r.status != "ok") {
      j["error"] = r.error;
      return j;
    }
    const Fractions f = FractionsOf(r, peaks_);
    j["median_ms"] = r.timing.median_ms;
    j["min_ms"] = r.timing.min_ms;
    j["reps"] = r.timing.reps;
    j["calls_per_rep"] = r.timing.inner;
    if (r.flops > 0) {
      j["flops"] = r.flops;
      j["tflops"] = Tflops(r);
    }
    if (r.bytes > 0) {
      j["bytes"] = r.bytes;
      j["gbps"] = Gbs(r);
    }
    if (!f.compute_ref.empty()) {
      j["fraction_of_compute_peak"] = f.compute;
      j["compute_peak"] = f.compute_ref;
    }
    if (!f.bandwidth_ref.empty()) {
      j["fraction_of_bandwidth_peak"] = f.bandwidth;
      j["bandwidth_peak"] = f.bandwidth_ref;
    }
    if (!r.note.empty()) j["note"] = r.note;
    return j;
  }

  void Write() {
    if (opt_.json_path.empty()) return;
    doc_["peaks"] = {{"bf16_gemm_8192_tflops", peaks_.bf16_tflops},
                     {"sgemm_8192_tflops", peaks_.f32_tflops},
                     {"device_bandwidth_gbps", peaks_.bw_gbs},
                     {"h2d_registered_gbps", peaks_.h2d_gbs},
                     {"fp8_gemm_8192_tflops", peaks_.fp8_tflops}};
    const std::string tmp = opt_.json_path + ".tmp";
    {
      std::ofstream out(tmp, std::ios::trunc);
      out << doc_.dump(2) << "\n";
      if (!out) {
        std::fprintf(stderr, "hmoe_gpu_bench: cannot write %s\n", tmp.c_str());
        return;
      }
    }
    if (std::rename(tmp.c_str(), opt_.json_path.c_str()) != 0) {
      std::fprintf(stderr, "hmoe_gpu_bench: cannot rename %s to %s: %s\n", tmp.c_str(),
                   opt_.json_path.c_str(), std::strerror(errno));
    }
  }

  const Options& opt_;
  json doc_;
  Peaks peaks_;
  std::vector<Result> results_;
  int problems_ = 0;
};

// ---------------------------------------------------------------------------------- the bench

// DeepSeek-V3's FP8 linear layers [N = out, K = in].
struct LinearShape {
  const char* name;
  int64_t n, k;
};
constexpr LinearShape kLinearShapes[] = {
    {"q_a_proj", 1536, 7168},       {"q_b_proj", 24576, 1536},    {"kv_a_proj", 576, 7168},
    {"o_proj", 7168, 16384},        {"mlp_gate_up", 18432, 7168}, {"mlp_down", 7168, 18432},
    {"expert_gate_up", 2048, 7168}, {"expert_down", 7168, 2048},
};
constexpr int64_t kTokenCounts[] = {1, 8, 64, 512, 1024, 4096, 16384};

class GpuBench {
 public:
  GpuBench(const Options& opt, Device& device, Stream& stream, Watchdog& dog, Report& report)
      : opt_(opt),
        device_(device),
        stream_(stream),
        cs_(static_cast<cudaStream_t>(NativeCudaStream(stream))),
        dog_(dog),
        report_(report),
        timer_(cs_, opt, dog) {}

  ~GpuBench() {
    ReleaseHost();
    if (lt_ != nullptr) cublasLtDestroy(lt_);
    if (cublas_ != nullptr) cublasDestroy(cublas_);
  }

  absl::Status Init() {
    if (cs_ == nullptr) return absl::InternalError("the device's stream has no CUDA stream");
    BENCH_RETURN_IF_ERROR(timer_.Init());
    BENCH_CUBLAS(cublasCreate(&cublas_));
    BENCH_CUBLAS(cublasSetStream(cublas_, cs_));
    BENCH_CUBLAS(cublasSetMathMode(cublas_, CUBLAS_DEFAULT_MATH));  // no TF32
    int device = 0, l2 = 0;
    BENCH_CUDA(cudaGetDevice(&device));
    BENCH_CUDA(cudaDeviceGetAttribute(&l2, cudaDevAttrL2CacheSize, device));
    l2_bytes_ = static_cast<size_t>(std::max(l2, 1 << 20));
    absl::StatusOr<DeviceBuffer> probe = device_.Allocate(4096);
    if (!probe.ok()) return probe.status();
    probe_ = *std::move(probe);
    return absl::OkStatus();
  }

  bool Selected(const std::string& id) const { return std::regex_search(id, std::regex(opt_.ops)); }

  // True once a failure left the CUDA context unusable (a sticky error): the rest is skipped.
  bool broken() const { return broken_; }
  const std::string& broken_reason() const { return broken_reason_; }

  void RunAll() {
    Yardsticks();
    if (!broken_) Linears();
    if (!broken_) MlaPrefill();
    if (!broken_) MlaDecode();
    if (!broken_) MoeGates();
    if (!broken_) HostToDevice();
    // Last: cuBLASLt's FP8 paths are new and their scale layouts strict; should one fault the
    // context, every other result is already in.
    if (!broken_) LtFp8();
  }

 private:
  // ---- helpers

  // Allocates through the device (its budget) and reports what did not fit.
  absl::StatusOr<DeviceBuffer> Alloc(size_t bytes) {
    return device_.Allocate(std::max<size_t>(bytes, 64));
  }

  // How many copies of an operand of `bytes` the repeated calls cycle through so that together
  // they span 4x the L2 cache: back-to-back calls on one copy would read a decode op's weights
  // from L2 (50 MB on an H100), which a real decode step (other layers in between) never does.
  int64_t Rotations(size_t bytes) const {
    if (bytes == 0) return 1;
    return std::clamp<int64_t>(static_cast<int64_t>((4 * l2_bytes_ + bytes - 1) / bytes), 1, 32);
  }

  // Whether `bytes` (plus a margin for the op's scratch) fit on the GPU now.
  absl::Status CheckFits(size_t bytes, size_t margin = kGiB) {
    size_t free_bytes = 0, total_bytes = 0;
    BENCH_CUDA(cudaMemGetInfo(&free_bytes, &total_bytes));
    const size_t budget_left = device_.budget_bytes() - device_.bytes_in_use();
    if (bytes + margin > free_bytes || bytes + margin > budget_left) {
      return absl::ResourceExhaustedError(absl::StrFormat(
          "needs %.2f GiB (+%.2f GiB margin for scratch); %.2f GiB free on the GPU, %.2f GiB left "
          "in the device budget",
          bytes / double(kGiB), margin / double(kGiB), free_bytes / double(kGiB),
          budget_left / double(kGiB)));
    }
    return absl::OkStatus();
  }

  // Times `op`; on failure records the error, drains the stream and checks whether the context
  // still works (a sticky error ends the run: everything after would fail the same way).
  // Returns the result as reported (status "ok" with its timing, or "failed").
  Result Measure(Result r, const std::function<absl::Status()>& op) {
    absl::StatusOr<Timing> t = timer_.Time(r.id, op);
    if (t.ok()) {
      r.timing = *t;
    } else {
      r.status = "failed";
      r.error = std::string(t.status().message());
    }
    report_.Add(r);
    if (!t.ok()) CheckHealth(r.id);
    return r;
  }

  void Fail(Result r, const absl::Status& s, bool skipped = false) {
    r.status = skipped ? "skipped" : "failed";
    r.error = std::string(s.message());
    const std::string id = r.id;
    report_.Add(std::move(r));
    if (!skipped) CheckHealth(id);
  }

  void CheckHealth(const std::string& after) {
    cudaStreamSynchronize(cs_);
    cudaGetLastError();
    cudaError_t err = cudaMemsetAsync(probe_.data(), 0, 4096, cs_);
    if (err == cudaSuccess) err = cudaStreamSynchronize(cs_);
    if (err != cudaSuccess) {
      broken_ = true;
      broken_reason_ = absl::StrCat("the CUDA context is unusable after '", after, "' (",
                                    cudaGetErrorName(err), "): the remaining ops are skipped");
      std::printf("!! %s\n", broken_reason_.c_str());
    }
  }

  // C [m x n] (column-major, F32 or BF16) = op_T(A) [m x k] * B [k x n] with cuBLAS; A stored
  // [m rows of k] row-major (a weight W [N, K]), B [n rows of k] row-major (activations). In
  // row-major terms: C[n, m] = B A^T. BF16 (A, B) with F32 accumulation (tensor cores) or F32.
  absl::Status Gemm(bool bf16, bool c_bf16, int64_t m, int64_t n, int64_t k, const void* a,
                    const void* b, void* c) {
    const float alpha = 1.0f, beta = 0.0f;
    const cudaDataType ab = bf16 ? CUDA_R_16BF : CUDA_R_32F;
    BENCH_CUBLAS(cublasGemmEx(cublas_, CUBLAS_OP_T, CUBLAS_OP_N, static_cast<int>(m),
                              static_cast<int>(n), static_cast<int>(k), &alpha, a, ab,
                              static_cast<int>(k), b, ab, static_cast<int>(k), &beta, c,
                              c_bf16 ? CUDA_R_16BF : CUDA_R_32F, static_cast<int>(m),
                              CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
    return absl::OkStatus();
  }

  // ---- yardsticks

  void Yardsticks() {
    std::printf("\n== Yardsticks (the card's peaks, measured now) ==\n");
    report_.PrintHeaderRow();
    GemmPeak(/*bf16=*/true, /*c_bf16=*/true);
    GemmPeak(/*bf16=*/true, /*c_bf16=*/false);
    GemmPeak(/*bf16=*/false, /*c_bf16=*/false);
    if (!broken_) Bandwidth();
    if (!broken_) HostToDevicePeak();
    const Peaks& p = report_.peaks();
    std::printf(
        "-> peaks: BF16 GEMM %.1f TFLOP/s, F32 SGEMM %.1f TFLOP/s, device bandwidth %.1f GB/s, "
        "host->device %.1f GB/s\n",
        p.bf16_tflops, p.f32_tflops, p.bw_gbs, p.h2d_gbs);
  }

  void GemmPeak(bool bf16, bool c_bf16) {
    const int64_t s = 8192;
    Result r;
    r.group = "yardstick";
    r.id = bf16 ? absl::StrCat("yardstick/bf16_gemm_8192/", c_bf16 ? "c_bf16" : "c_f32")
                : "yardstick/sgemm_8192";
    r.shape = "M=N=K=8192";
    r.shape_json = {{"M", s}, {"N", s}, {"K", s}};
    r.flops = 2.0 * s * s * s;
    r.compute_peak = bf16 ? "bf16" : "f32";
    r.note = bf16 ? (c_bf16 ? "cuBLAS BF16xBF16->BF16, F32 accumulation"
                            : "cuBLAS BF16xBF16->F32, F32 accumulation")
                  : "cuBLAS SGEMM (F32, no TF32)";
    const size_t elem = bf16 ? 2 : 4;
    const size_t bytes = static_cast<size_t>(s * s) * elem;
    absl::StatusOr<DeviceBuffer> a = Alloc(bytes), b = Alloc(bytes), c = Alloc(s * s * 4);
    if (!a.ok() || !b.ok() || !c.ok()) {
      return Fail(r, !a.ok() ? a.status() : !b.ok() ? b.status() : c.status());
    }
    absl::Status fill = FillOperand(a->data(), s * s, bf16, 1);
    if (fill.ok()) fill = FillOperand(b->data(), s * s, bf16, 2);
    if (!fill.ok()) return Fail(r, fill);
    void* ap = a->data();
    void* bp = b->data();
    void* cp = c->data();
    const Result last = Measure(r, [&] { return Gemm(bf16, c_bf16, s, s, s, ap, bp, cp); });
    if (last.status == "ok") {
      double& peak = bf16 ? report_.peaks().bf16_tflops : report_.peaks().f32_tflops;
      peak = std::max(peak, Tflops(last));
    }
  }

  absl::Status FillOperand(void* p, int64_t count, bool bf16, uint32_t seed) {
    if (bf16) {
      BENCH_CUDA(gpubench::FillBf16(static_cast<uint16_t*>(p), count, seed, 1.0f, cs_));
    } else {
      BENCH_CUDA(gpubench::FillF32(static_cast<float*>(p), count, seed, 1.0f, 0.0f, cs_));
    }
    return absl::OkStatus();
  }

  void Bandwidth() {
    const size_t bytes = kGiB;
    Result copy;
    copy.group = "yardstick";
    copy.id = "yardstick/d2d_copy_1GiB";
    copy.shape = "1 GiB";
    copy.shape_json = {{"bytes", bytes}};
    copy.bytes = 2.0 * bytes;
    copy.note = "cudaMemcpyAsync D2D; bytes read + written";
    Result read = copy;
    read.id = "yardstick/read_kernel_1GiB";
    read.bytes = bytes;
    read.note = "streaming 16-byte loads over the whole GPU; bytes read";
    if (absl::Status fits = CheckFits(2 * bytes, 0); !fits.ok()) {
      Fail(copy, fits, true);
      return Fail(read, fits, true);
    }
    absl::StatusOr<DeviceBuffer> src = Alloc(bytes), dst = Alloc(bytes);
    if (!src.ok() || !dst.ok()) {
      const absl::Status s = !src.ok() ? src.status() : dst.status();
      Fail(copy, s);
      return Fail(read, s);
    }
    void* sp = src->data();
    void* dp = dst->data();
    if (const cudaError_t e = cudaMemsetAsync(sp, 1, bytes, cs_); e != cudaSuccess) {
      return Fail(copy, CudaError(e, "memset"));
    }
    std::optional<double> copy_gbs, read_gbs;
    {
      absl::StatusOr<Timing> t = timer_.Time(copy.id, [&]() -> absl::Status {
        BENCH_CUDA(cudaMemcpyAsync(dp, sp, bytes, cudaMemcpyDeviceToDevice, cs_));
        return absl::OkStatus();
      });
      if (t.ok()) {
        copy.timing = *t;
        copy_gbs = Gbs(copy);
      } else {
        copy.status = "failed";
        copy.error = std::string(t.status().message());
      }
    }
    int blocks = 0, threads = 0;
    {
      absl::StatusOr<Timing> t = absl::InternalError("no launch shape");
      if (const cudaError_t e = gpubench::ReadAllShape(&blocks, &threads); e != cudaSuccess) {
        t = CudaError(e, "ReadAllShape");
      } else {
        uint32_t* sink = static_cast<uint32_t*>(dp);
        t = timer_.Time(read.id, [&]() -> absl::Status {
          BENCH_CUDA(gpubench::ReadAll(sp, bytes / 16, sink, blocks, threads, cs_));
          return absl::OkStatus();
        });
      }
      if (t.ok()) {
        read.timing = *t;
        read_gbs = Gbs(read);
        read.note += absl::StrFormat(" (%d blocks x %d threads)", blocks, threads);
      } else {
        read.status = "failed";
        read.error = std::string(t.status().message());
      }
    }
    report_.peaks().bw_gbs = std::max(copy_gbs.value_or(0), read_gbs.value_or(0));
    report_.Add(copy);
    report_.Add(read);
    if (!copy_gbs || !read_gbs) CheckHealth("bandwidth yardsticks");
  }

  // 1 GiB of page-locked host memory (cudaHostRegister of an mmap'ed range), shared by the H2D
  // yardstick and the Device API copies.
  absl::Status EnsureHostBuffer() {
    if (host_ != nullptr) return absl::OkStatus();
    void* p = mmap(nullptr, kGiB, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED) {
      return absl::ResourceExhaustedError(absl::StrCat("mmap of 1 GiB: ", std::strerror(errno)));
    }
    std::memset(p, 0x5A, kGiB);  // fault the pages in
    host_ = p;
    return absl::OkStatus();
  }

 public:
  void ReleaseHost() {
    if (host_ != nullptr) munmap(host_, kGiB);
    host_ = nullptr;
  }

 private:
  void HostToDevicePeak() {
    Result r;
    r.group = "yardstick";
    r.id = "yardstick/h2d_registered_1GiB";
    r.shape = "1 GiB";
    r.shape_json = {{"bytes", kGiB}};
    r.bytes = double(kGiB);
    r.h2d = true;
    r.note = "cudaMemcpyAsync from cudaHostRegister'ed memory";
    if (absl::Status s = EnsureHostBuffer(); !s.ok()) return Fail(r, s);
    absl::StatusOr<DeviceBuffer> dst = Alloc(kGiB);
    if (!dst.ok()) return Fail(r, dst.status());
    if (const cudaError_t e = cudaHostRegister(host_, kGiB, cudaHostRegisterDefault);
        e != cudaSuccess) {
      return Fail(r, CudaError(e, "cudaHostRegister(1 GiB)"));
    }
    void* dp = dst->data();
    absl::StatusOr<Timing> t = timer_.Time(r.id, [&]() -> absl::Status {
      BENCH_CUDA(cudaMemcpyAsync(dp, host_, kGiB, cudaMemcpyHostToDevice, cs_));
      return absl::OkStatus();
    });
    cudaStreamSynchronize(cs_);
    if (const cudaError_t e = cudaHostUnregister(host_); e != cudaSuccess) {
      std::printf("warning: cudaHostUnregister: %s\n", cudaGetErrorName(e));
      cudaGetLastError();
    }
    if (!t.ok()) return Fail(r, t.status());
    r.timing = *t;
    report_.peaks().h2d_gbs = Gbs(r);
    report_.Add(r);
  }

  // ---- FP8 linear

  void Linears() {
    std::printf(
        "\n== FP8 block-scaled Linear (Device::Linear, 128x128 weight scales, F32 in/out) vs "
        "cuBLAS BF16 GEMM of the same M, N, K ==\n");
    report_.PrintHeaderRow();
    for (const LinearShape& shape : kLinearShapes) {
      if (broken_) return;
      std::vector<int64_t> ms;
      for (int64_t m : kTokenCounts) {
        const std::string base = absl::StrCat("linear/", shape.name, "/M=", m);
        if (m <= opt_.max_m && (Selected(base) || Selected(base + "/cublas_bf16"))) ms.push_back(m);
      }
      if (!ms.empty()) LinearShapeRun(shape, ms);
    }
  }

  void LinearShapeRun(const LinearShape& shape, const std::vector<int64_t>& ms) {
    const int64_t n = shape.n, k = shape.k;
    const int64_t m_max = ms.back();
    const int64_t kb = (k + 127) / 128, nb = (n + 127) / 128;
    const size_t w_bytes = static_cast<size_t>(n * k);
    const size_t s_bytes = static_cast<size_t>(nb * kb) * 4;
    const size_t wb_bytes = static_cast<size_t>(n * k) * 2;
    const int64_t rot = Rotations(w_bytes), rot_b = Rotations(wb_bytes);
    const size_t need = rot * w_bytes + s_bytes + rot_b * wb_bytes +
                        static_cast<size_t>(m_max * k) * 6 + static_cast<size_t>(m_max * n) * 4;
    auto all_fail = [&](const absl::Status& s, bool skipped) {
      for (int64_t m : ms) {
        Result r = LinearResult(shape, m, false);
        Fail(r, s, skipped);
        if (broken_) return;
      }
    };
    if (absl::Status fits = CheckFits(need); !fits.ok()) return all_fail(fits, true);
    absl::StatusOr<DeviceBuffer> w = Alloc(rot * w_bytes), sc = Alloc(s_bytes),
                                 wb = Alloc(rot_b * wb_bytes),
                                 x = Alloc(static_cast<size_t>(m_max * k) * 4),
                                 xb = Alloc(static_cast<size_t>(m_max * k) * 2),
                                 y = Alloc(static_cast<size_t>(m_max * n) * 4);
    for (auto* b : {&w, &sc, &wb, &x, &xb, &y}) {
      if (!b->ok()) return all_fail(b->status(), false);
    }
    absl::Status fill = [&]() -> absl::Status {
      BENCH_CUDA(gpubench::FillFp8(w->as<uint8_t>(), rot * w_bytes, 11, cs_));
      BENCH_CUDA(gpubench::FillF32(sc->as<float>(), nb * kb, 12, 0.5e-3f, 1e-3f, cs_));
      BENCH_CUDA(gpubench::FillBf16(wb->as<uint16_t>(), rot_b * n * k, 13, 0.05f, cs_));
      BENCH_CUDA(gpubench::FillF32(x->as<float>(), m_max * k, 14, 1.0f, 0.0f, cs_));
      BENCH_CUDA(gpubench::FillBf16(xb->as<uint16_t>(), m_max * k, 15, 1.0f, cs_));
      BENCH_CUDA(cudaStreamSynchronize(cs_));
      return absl::OkStatus();
    }();
    if (!fill.ok()) return all_fail(fill, false);
    LinearWeight lw;
    lw.dtype = DType::kF8E4M3;
    lw.data = w->data();
    lw.rows = n;
    lw.cols = k;
    lw.row_stride = k;
    lw.scale_inv = sc->as<float>();
    lw.scale_stride = kb;
    const float* xp = x->as<float>();
    float* yp = y->as<float>();
    const auto* w0 = w->as<uint8_t>();
    const auto* wb0 = wb->as<uint8_t>();
    const void* xbp = xb->data();
    int64_t call = 0;  // cycles through the weight copies
    for (int64_t m : ms) {
      if (broken_) return;
      Result r = LinearResult(shape, m, false);
      double fp8_ms = 0;
      if (Selected(r.id)) {
        r.note = absl::StrCat(rot, " weight copies");
        const Result got = Measure(r, [&] {
          lw.data = w0 + (call++ % rot) * w_bytes;
          return device_.Linear(stream_, lw, xp, k, m, yp, n);
        });
        if (got.status == "ok") fp8_ms = got.timing.median_ms;
      }
      if (broken_) return;
      Result c = LinearResult(shape, m, true);
      if (Selected(c.id)) {
        c.note = absl::StrCat(c.note, "; ", rot_b, " weight copies");
        const Result got = Measure(c, [&] {
          return Gemm(true, false, n, m, k, wb0 + (call++ % rot_b) * wb_bytes, xbp, yp);
        });
        if (fp8_ms > 0 && got.status == "ok") {
          std::printf("%-44s   -> FP8 Device::Linear takes %.2fx the time of cuBLAS BF16\n", "",
                      fp8_ms / got.timing.median_ms);
        }
      }
    }
  }

  Result LinearResult(const LinearShape& shape, int64_t m, bool cublas) {
    Result r;
    r.group = cublas ? "cublas_bf16" : "linear";
    r.id = absl::StrCat("linear/", shape.name, "/M=", m, cublas ? "/cublas_bf16" : "");
    r.shape = absl::StrCat("M=", m, " N=", shape.n, " K=", shape.k);
    r.shape_json = {{"M", m}, {"N", shape.n}, {"K", shape.k}, {"layer", shape.name}};
    r.flops = 2.0 * m * shape.n * shape.k;
    const double kb = double((shape.k + 127) / 128), nb = double((shape.n + 127) / 128);
    r.bytes = cublas
                  ? 2.0 * shape.n * shape.k + 2.0 * m * shape.k + 4.0 * m * shape.n
                  : double(shape.n) * shape.k + 4 * nb * kb + 4.0 * m * shape.k + 4.0 * m * shape.n;
    r.compute_peak = "bf16";
    r.note = cublas ? "BF16 weight and activations, F32 out" : "";
    return r;
  }

  // ---- MLA

  // DeepSeek-V3 MLA: 128 heads, nope 128, rope 64, v 128, kv_lora_rank 512; FP8 kv_b and W_UK^T
  // (per head [512, 128]) with 128x128 scales; a paged F32 latent cache of 64-token blocks.
  static constexpr int64_t kNh = 128, kDn = 128, kDr = 64, kDv = 128, kRkv = 512, kBlock = 64;

  struct MlaWeights {
    DeviceBuffer kvb, kvb_scales, uk, uk_scales;
    std::vector<LinearWeight> uk_views;
    LinearWeight kv_b;
  };

  absl::Status MakeMlaWeights(MlaWeights* m) {
    const int64_t kvb_rows = kNh * (kDn + kDv);
    auto alloc = [&](DeviceBuffer* b, size_t bytes) -> absl::Status {
      absl::StatusOr<DeviceBuffer> r = Alloc(bytes);
      if (!r.ok()) return r.status();
      *b = *std::move(r);
      return absl::OkStatus();
    };
    BENCH_RETURN_IF_ERROR(alloc(&m->kvb, kvb_rows * kRkv));
    BENCH_RETURN_IF_ERROR(alloc(&m->kvb_scales, (kvb_rows / 128) * (kRkv / 128) * 4));
    BENCH_RETURN_IF_ERROR(alloc(&m->uk, kNh * kRkv * kDn));
    BENCH_RETURN_IF_ERROR(alloc(&m->uk_scales, kNh * (kRkv / 128) * 4));
    BENCH_CUDA(gpubench::FillFp8(m->kvb.as<uint8_t>(), kvb_rows * kRkv, 21, cs_));
    BENCH_CUDA(gpubench::FillF32(m->kvb_scales.as<float>(), (kvb_rows / 128) * (kRkv / 128), 22,
                                 0.5e-3f, 1e-3f, cs_));
    BENCH_CUDA(gpubench::FillFp8(m->uk.as<uint8_t>(), kNh * kRkv * kDn, 23, cs_));
    BENCH_CUDA(
        gpubench::FillF32(m->uk_scales.as<float>(), kNh * (kRkv / 128), 24, 0.5e-3f, 1e-3f, cs_));
    m->kv_b = {DType::kF8E4M3, m->kvb.data(), kvb_rows, kRkv, kRkv, m->kvb_scales.as<float>(),
               kRkv / 128};
    for (int64_t h = 0; h < kNh; ++h) {
      m->uk_views.push_back({DType::kF8E4M3, m->uk.as<uint8_t>() + h * kRkv * kDn, kRkv, kDn, kDn,
                             m->uk_scales.as<float>() + h * (kRkv / 128), 1});
    }
    return absl::OkStatus();
  }

  static double MlaFlops(int64_t queries_keys_sum, int64_t rows) {
    // Per (query, head): q~ = W_UK^T q_nope (2 dn Rkv), scores over its keys (2 (Rkv + dr) each),
    // u = sum p c (2 Rkv each), out = W_UV u (2 Rkv dv): the work of the absorbed form.
    return double(kNh) * (double(rows) * (2.0 * kDn * kRkv + 2.0 * kRkv * kDv) +
                          double(queries_keys_sum) * (2.0 * (kRkv + kDr) + 2.0 * kRkv));
  }

  struct MlaCase {
    std::string id, shape;
    json shape_json;
    std::vector<MlaSegment> segments;
    int64_t rows = 0, blocks = 0, keys_sum = 0, cache_tokens = 0;
    bool decode = false;
  };

  void RunMla(const MlaCase& c, MlaWeights& w) {
    Result r;
    r.group = c.decode ? "mla_decode" : "mla_prefill";
    r.id = c.id;
    r.shape = c.shape;
    r.shape_json = c.shape_json;
    r.flops = MlaFlops(c.keys_sum, c.rows);
    const double weight_bytes = double(kNh) * (kDn + kDv) * kRkv + double(kNh) * kRkv * kDn;
    r.bytes =
        weight_bytes + 4.0 * c.cache_tokens * (kRkv + kDr) + 4.0 * c.rows * kNh * (kDn + kDr + kDv);
    r.compute_peak = "f32";
    r.note = "absorbed-form FLOPs; bytes: FP8 weights + cache + q + out";
    const int64_t row = kRkv + kDr;
    // Decode: the calls cycle through copies of the batch's cache (and block tables), so that the
    // cache is read from memory as in a real step; prefill reuses one (it is compute-bound).
    const int64_t rot = c.decode ? Rotations(static_cast<size_t>(c.blocks * kBlock * row) * 4) : 1;
    const int64_t all_blocks = rot * c.blocks;
    const size_t cache_bytes = static_cast<size_t>(all_blocks * kBlock * row) * 4;
    const size_t q_bytes = static_cast<size_t>(c.rows * kNh * (kDn + kDr)) * 4;
    const size_t out_bytes = static_cast<size_t>(c.rows * kNh * kDv) * 4;
    if (absl::Status fits = CheckFits(cache_bytes + q_bytes + out_bytes); !fits.ok()) {
      return Fail(r, fits, true);
    }
    absl::StatusOr<DeviceBuffer> cache = Alloc(cache_bytes), q = Alloc(q_bytes),
                                 out = Alloc(out_bytes), tables = Alloc(all_blocks * 4);
    for (auto* b : {&cache, &q, &out, &tables}) {
      if (!b->ok()) return Fail(r, b->status());
    }
    std::vector<int32_t> table(all_blocks);
    for (int64_t i = 0; i < all_blocks; ++i) table[i] = static_cast<int32_t>(i);
    std::vector<std::vector<MlaSegment>> segs(rot, c.segments);
    for (int64_t j = 0; j < rot; ++j) {
      for (MlaSegment& sg : segs[j]) sg.block_table_offset += j * c.blocks;
    }
    if (rot > 1) r.note += absl::StrCat("; ", rot, " cache copies");
    absl::Status fill = [&]() -> absl::Status {
      BENCH_CUDA(gpubench::FillF32(cache->as<float>(), cache_bytes / 4, 31, 1.0f, 0.0f, cs_));
      BENCH_CUDA(gpubench::FillF32(q->as<float>(), q_bytes / 4, 32, 1.0f, 0.0f, cs_));
      BENCH_CUDA(cudaMemcpyAsync(tables->data(), table.data(), all_blocks * 4,
                                 cudaMemcpyHostToDevice, cs_));
      BENCH_CUDA(cudaStreamSynchronize(cs_));
      return absl::OkStatus();
    }();
    if (!fill.ok()) return Fail(r, fill);
    MlaAttentionArgs args;
    args.dims = {kNh, kDn, kDr, kDv, kRkv, 0.1352f};
    args.q = q->as<float>();
    args.q_stride = kNh * (kDn + kDr);
    args.w_uk_t = w.uk_views;
    args.kv_b = w.kv_b;
    args.cache = {cache->as<float>(), kBlock, kBlock * row, row};
    args.block_tables = tables->as<int32_t>();
    args.segments = c.segments;
    args.out = out->as<float>();
    args.out_stride = kNh * kDv;
    int64_t call = 0;
    Measure(r, [&] {
      args.segments = segs[call++ % rot];
      return c.decode ? device_.MlaDecodeAttention(stream_, args)
                      : device_.MlaPrefillAttention(stream_, args);
    });
  }

  void MlaPrefill() {
    std::vector<MlaCase> cases;
    for (int64_t t : {int64_t{1024}, int64_t{4096}}) {
      MlaCase c;
      c.id = absl::StrCat("mla_prefill/T=", t);
      c.shape = absl::StrCat(t, " tokens, causal, 128 heads");
      c.shape_json = {{"tokens", t}, {"heads", kNh}, {"kv_lora_rank", kRkv}};
      c.segments = {{0, t, 0, 0}};
      c.rows = t;
      c.blocks = (t + kBlock - 1) / kBlock;
      c.keys_sum = t * (t + 1) / 2;
      c.cache_tokens = t;
      if (Selected(c.id)) cases.push_back(std::move(c));
    }
    RunMlaCases("MLA prefill attention (Device::MlaPrefillAttention, FP8 projections)", cases);
  }

  void MlaDecode() {
    const int64_t ctx = 4096;
    std::vector<MlaCase> cases;
    for (int64_t b : {int64_t{1}, int64_t{16}, int64_t{64}}) {
      MlaCase c;
      c.id = absl::StrCat("mla_decode/B=", b, "/ctx=", ctx);
      c.shape = absl::StrCat(b, " seq x 1 query, ctx ", ctx);
      c.shape_json = {{"batch", b}, {"context", ctx}, {"heads", kNh}, {"kv_lora_rank", kRkv}};
      const int64_t per = ctx / kBlock;
      for (int64_t i = 0; i < b; ++i) c.segments.push_back({i, 1, ctx - 1, i * per});
      c.rows = b;
      c.blocks = b * per;
      c.keys_sum = b * ctx;
      c.cache_tokens = b * ctx;
      c.decode = true;
      if (Selected(c.id)) cases.push_back(std::move(c));
    }
    RunMlaCases("MLA decode attention (Device::MlaDecodeAttention, FP8 projections)", cases);
  }

  // One table of MLA cases sharing one set of weights.
  void RunMlaCases(const char* title, const std::vector<MlaCase>& cases) {
    if (cases.empty()) return;
    std::printf("\n== %s ==\n", title);
    report_.PrintHeaderRow();
    MlaWeights w;
    if (absl::Status s = MakeMlaWeights(&w); !s.ok()) {
      for (const MlaCase& c : cases) Fail(MlaFailResult(c), s);
      return;
    }
    for (const MlaCase& c : cases) {
      if (broken_) return;
      RunMla(c, w);
    }
  }

  Result MlaFailResult(const MlaCase& c) {
    Result r;
    r.group = c.decode ? "mla_decode" : "mla_prefill";
    r.id = c.id;
    r.shape = c.shape;
    r.shape_json = c.shape_json;
    return r;
  }

  // ---- MoE gate

  void MoeGates() {
    const int64_t e = 256, hidden = 7168;
    std::vector<int64_t> ns;
    for (int64_t n :
         {int64_t{1}, int64_t{8}, int64_t{64}, int64_t{512}, int64_t{4096}, int64_t{16384}}) {
      if (n <= opt_.max_m && Selected(absl::StrCat("moe_gate/n=", n))) ns.push_back(n);
    }
    if (ns.empty()) return;
    std::printf(
        "\n== MoE gate (Device::MoeGate: BF16 router 256 x 7168 in F32 math, noaux_tc top-8 of 8 "
        "groups / top-4 groups) ==\n");
    report_.PrintHeaderRow();
    const int64_t n_max = ns.back();
    const size_t router_bytes = e * hidden * 2;
    const int64_t rot = Rotations(router_bytes);
    auto result = [&](int64_t n) {
      Result r;
      r.group = "moe_gate";
      r.id = absl::StrCat("moe_gate/n=", n);
      r.shape = absl::StrCat(n, " tokens x ", hidden, " -> ", e);
      r.shape_json = {{"tokens", n}, {"hidden", hidden}, {"experts", e}, {"top_k", 8}};
      r.flops = 2.0 * n * e * hidden;
      r.bytes = 2.0 * e * hidden + 4.0 * e + 4.0 * n * hidden + 8.0 * n * 8;
      r.compute_peak = "f32";
      r.note = absl::StrCat("router logits in F32 math; ", rot, " router copies");
      return r;
    };
    const size_t need = static_cast<size_t>(n_max * hidden) * 4 + rot * router_bytes;
    absl::Status ok = CheckFits(need);
    if (!ok.ok()) {
      for (int64_t n : ns) Fail(result(n), ok, ok.code() == absl::StatusCode::kResourceExhausted);
      return;
    }
    absl::StatusOr<DeviceBuffer> router = Alloc(rot * router_bytes), bias = Alloc(e * 4),
                                 x = Alloc(static_cast<size_t>(n_max * hidden) * 4),
                                 ids = Alloc(n_max * 8 * 4), weights = Alloc(n_max * 8 * 4);
    for (auto* b : {&router, &bias, &x, &ids, &weights}) {
      if (ok.ok() && !b->ok()) ok = b->status();
    }
    if (ok.ok()) {
      ok = [&]() -> absl::Status {
        BENCH_CUDA(gpubench::FillBf16(router->as<uint16_t>(), rot * e * hidden, 41, 0.02f, cs_));
        BENCH_CUDA(gpubench::FillF32(bias->as<float>(), e, 42, 0.05f, 0.0f, cs_));
        BENCH_CUDA(gpubench::FillF32(x->as<float>(), n_max * hidden, 43, 1.0f, 0.0f, cs_));
        BENCH_CUDA(cudaStreamSynchronize(cs_));
        return absl::OkStatus();
      }();
    }
    if (!ok.ok()) {
      for (int64_t n : ns) Fail(result(n), ok, ok.code() == absl::StatusCode::kResourceExhausted);
      return;
    }
    MoeGateParams p;
    p.num_experts = e;
    p.top_k = 8;
    p.n_group = 8;
    p.topk_group = 4;
    p.norm_topk_prob = true;
    p.routed_scaling_factor = 2.5;
    LinearWeight rw{DType::kBF16, router->data(), e, hidden, hidden, nullptr, 0};
    const auto* r0 = router->as<uint8_t>();
    int64_t call = 0;
    const VectorWeight bw{DType::kF32, bias->data(), e};
    for (int64_t n : ns) {
      if (broken_) return;
      Measure(result(n), [&] {
        rw.data = r0 + (call++ % rot) * router_bytes;
        return device_.MoeGate(stream_, x->as<float>(), hidden, n, rw, bw, p, ids->as<int32_t>(),
                               weights->as<float>());
      });
    }
  }

  // ---- cuBLASLt FP8 (what issue 20 item 3 would put under Device::Linear)

  // D [m x n] BF16 (column-major) = op_T(A) [m x k] * B [k x n], A and B FP8 E4M3 in the layout
  // of Gemm(). Block-scaled: A (the weight) has one F32 scale per 128x128 block
  // (CUBLASLT_MATMUL_MATRIX_SCALE_BLK128x128_32F), B (the activations) one per 1x128 block along
  // k (VEC128_32F), as DeepSeek-V3's checkpoints and activation quantization; otherwise no scales
  // (per-tensor 1.0: the FP8 tensor-core peak). Planned once (descriptors, heuristic algorithm),
  // run many times: the timed calls are the GEMM alone.
  class LtPlan {
   public:
    ~LtPlan() {
      if (pref_ != nullptr) cublasLtMatmulPreferenceDestroy(pref_);
      if (ld_ != nullptr) cublasLtMatrixLayoutDestroy(ld_);
      if (lb_ != nullptr) cublasLtMatrixLayoutDestroy(lb_);
      if (la_ != nullptr) cublasLtMatrixLayoutDestroy(la_);
      if (op_ != nullptr) cublasLtMatmulDescDestroy(op_);
    }

    absl::Status Init(cublasLtHandle_t lt, int64_t m, int64_t n, int64_t k, const float* a_scales,
                      const float* b_scales, void* workspace, size_t workspace_bytes) {
      lt_ = lt;
      workspace_ = workspace;
      workspace_bytes_ = workspace_bytes;
      BENCH_CUBLAS(cublasLtMatmulDescCreate(&op_, CUBLAS_COMPUTE_32F, CUDA_R_32F));
      const cublasOperation_t ta = CUBLAS_OP_T, tb = CUBLAS_OP_N;
      BENCH_CUBLAS(
          cublasLtMatmulDescSetAttribute(op_, CUBLASLT_MATMUL_DESC_TRANSA, &ta, sizeof(ta)));
      BENCH_CUBLAS(
          cublasLtMatmulDescSetAttribute(op_, CUBLASLT_MATMUL_DESC_TRANSB, &tb, sizeof(tb)));
      if (a_scales != nullptr) {
        const int32_t a_mode = CUBLASLT_MATMUL_MATRIX_SCALE_BLK128x128_32F;
        const int32_t b_mode = CUBLASLT_MATMUL_MATRIX_SCALE_VEC128_32F;
        BENCH_CUBLAS(cublasLtMatmulDescSetAttribute(op_, CUBLASLT_MATMUL_DESC_A_SCALE_MODE, &a_mode,
                                                    sizeof(a_mode)));
        BENCH_CUBLAS(cublasLtMatmulDescSetAttribute(op_, CUBLASLT_MATMUL_DESC_B_SCALE_MODE, &b_mode,
                                                    sizeof(b_mode)));
        BENCH_CUBLAS(cublasLtMatmulDescSetAttribute(op_, CUBLASLT_MATMUL_DESC_A_SCALE_POINTER,
                                                    &a_scales, sizeof(a_scales)));
        BENCH_CUBLAS(cublasLtMatmulDescSetAttribute(op_, CUBLASLT_MATMUL_DESC_B_SCALE_POINTER,
                                                    &b_scales, sizeof(b_scales)));
      }
      BENCH_CUBLAS(cublasLtMatrixLayoutCreate(&la_, CUDA_R_8F_E4M3, k, m, k));
      BENCH_CUBLAS(cublasLtMatrixLayoutCreate(&lb_, CUDA_R_8F_E4M3, k, n, k));
      BENCH_CUBLAS(cublasLtMatrixLayoutCreate(&ld_, CUDA_R_16BF, m, n, m));
      BENCH_CUBLAS(cublasLtMatmulPreferenceCreate(&pref_));
      const uint64_t ws = workspace_bytes;
      BENCH_CUBLAS(cublasLtMatmulPreferenceSetAttribute(
          pref_, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws, sizeof(ws)));
      int found = 0;
      BENCH_CUBLAS(
          cublasLtMatmulAlgoGetHeuristic(lt, op_, la_, lb_, ld_, ld_, pref_, 1, &heur_, &found));
      if (found == 0) {
        return absl::UnimplementedError("cuBLASLt offers no algorithm for this FP8 GEMM");
      }
      return absl::OkStatus();
    }

    absl::Status Run(const void* a, const void* b, void* d, cudaStream_t stream) {
      const float alpha = 1.0f, beta = 0.0f;
      BENCH_CUBLAS(cublasLtMatmul(lt_, op_, &alpha, a, la_, b, lb_, &beta, d, ld_, d, ld_,
                                  &heur_.algo, workspace_, workspace_bytes_, stream));
      return absl::OkStatus();
    }

   private:
    cublasLtHandle_t lt_ = nullptr;
    cublasLtMatmulDesc_t op_ = nullptr;
    cublasLtMatrixLayout_t la_ = nullptr, lb_ = nullptr, ld_ = nullptr;
    cublasLtMatmulPreference_t pref_ = nullptr;
    cublasLtMatmulHeuristicResult_t heur_{};
    void* workspace_ = nullptr;
    size_t workspace_bytes_ = 0;
  };

  // Plans and times one cuBLASLt FP8 GEMM (a failed plan is the result's error).
  Result MeasureLt(Result r, int64_t m, int64_t n, int64_t k, const void* a, const void* b, void* d,
                   const float* a_scales, const float* b_scales) {
    LtPlan plan;
    if (absl::Status s = plan.Init(lt_, m, n, k, a_scales, b_scales, lt_workspace_.data(),
                                   lt_workspace_.size_bytes());
        !s.ok()) {
      r.status = "failed";
      r.error = std::string(s.message());
      report_.Add(r);
      return r;
    }
    return Measure(r, [&] { return plan.Run(a, b, d, cs_); });
  }

  void LtFp8() {
    const bool peak = Selected("lt_fp8/gemm_8192");
    std::vector<std::pair<const LinearShape*, std::vector<int64_t>>> todo;
    for (const LinearShape& shape : kLinearShapes) {
      std::vector<int64_t> ms;
      for (int64_t m : kTokenCounts) {
        if (m >= 512 && m <= opt_.max_m &&
            Selected(absl::StrCat("lt_fp8/", shape.name, "/M=", m, "/blockscaled"))) {
          ms.push_back(m);
        }
      }
      if (!ms.empty()) todo.emplace_back(&shape, std::move(ms));
    }
    if (!peak && todo.empty()) return;
    std::printf(
        "\n== cuBLASLt FP8 E4M3 GEMM (not used by the Device yet: the vendor path of issue 20 item "
        "3), BF16 out ==\n");
    report_.PrintHeaderRow();
    absl::Status init = [&]() -> absl::Status {
      if (lt_ == nullptr) BENCH_CUBLAS(cublasLtCreate(&lt_));
      absl::StatusOr<DeviceBuffer> ws = Alloc(32 * kMiB);
      if (!ws.ok()) return ws.status();
      lt_workspace_ = *std::move(ws);
      return absl::OkStatus();
    }();
    if (peak) {
      const int64_t s = 8192;
      Result r;
      // A yardstick (the FP8 peak itself): no fraction of another peak, not in the summary.
      r.group = "yardstick";
      r.id = "lt_fp8/gemm_8192";
      r.shape = "M=N=K=8192";
      r.shape_json = {{"M", s}, {"N", s}, {"K", s}};
      r.flops = 2.0 * s * s * s;
      r.note = "E4M3 x E4M3 -> BF16, per-tensor scale: the FP8 peak";
      absl::StatusOr<DeviceBuffer> a = Alloc(s * s), b = Alloc(s * s), d = Alloc(s * s * 2);
      absl::Status ok = init;
      for (auto* buf : {&a, &b, &d}) {
        if (ok.ok() && !buf->ok()) ok = buf->status();
      }
      if (ok.ok()) {
        ok = [&]() -> absl::Status {
          BENCH_CUDA(gpubench::FillFp8(a->as<uint8_t>(), s * s, 51, cs_));
          BENCH_CUDA(gpubench::FillFp8(b->as<uint8_t>(), s * s, 52, cs_));
          return absl::OkStatus();
        }();
      }
      if (!ok.ok()) {
        Fail(r, ok);
      } else {
        const Result got = MeasureLt(r, s, s, s, a->data(), b->data(), d->data(), nullptr, nullptr);
        if (got.status == "ok") report_.peaks().fp8_tflops = Tflops(got);
      }
    }
    for (const auto& [shape, ms] : todo) {
      if (broken_) return;
      LtShapeRun(*shape, ms, init);
    }
  }

  void LtShapeRun(const LinearShape& shape, const std::vector<int64_t>& ms,
                  const absl::Status& init) {
    const int64_t n = shape.n, k = shape.k, m_max = ms.back();
    const int64_t kb = (k + 127) / 128, nb = (n + 127) / 128;
    auto result = [&](int64_t m) {
      Result r;
      r.group = "lt_fp8";
      r.id = absl::StrCat("lt_fp8/", shape.name, "/M=", m, "/blockscaled");
      r.shape = absl::StrCat("M=", m, " N=", n, " K=", k);
      r.shape_json = {{"M", m}, {"N", n}, {"K", k}, {"layer", shape.name}};
      r.flops = 2.0 * m * n * k;
      r.compute_peak = "fp8";
      r.note = "weight 128x128 + activation 1x128 block scales";
      return r;
    };
    // Scale buffers far larger than any layout cuBLASLt could read (padding of the token dimension
    // to 4 or 128, either major order): a wrong guess of the layout costs accuracy, never memory
    // safety.
    const size_t a_scale_bytes = static_cast<size_t>((nb + 4) * (kb + 4)) * 4 * 4;
    const size_t b_scale_bytes = static_cast<size_t>((m_max + 128) * (kb + 4)) * 4 * 4;
    const size_t need =
        static_cast<size_t>(n * k + m_max * k + m_max * n * 2) + a_scale_bytes + b_scale_bytes;
    absl::Status ok = init;
    if (ok.ok()) ok = CheckFits(need);
    const bool skipped = ok.code() == absl::StatusCode::kResourceExhausted;
    absl::StatusOr<DeviceBuffer> w = Alloc(ok.ok() ? n * k : 64),
                                 x = Alloc(ok.ok() ? m_max * k : 64),
                                 d = Alloc(ok.ok() ? m_max * n * 2 : 64),
                                 sa = Alloc(ok.ok() ? a_scale_bytes : 64),
                                 sb = Alloc(ok.ok() ? b_scale_bytes : 64);
    for (auto* buf : {&w, &x, &d, &sa, &sb}) {
      if (ok.ok() && !buf->ok()) ok = buf->status();
    }
    if (ok.ok()) {
      ok = [&]() -> absl::Status {
        BENCH_CUDA(gpubench::FillFp8(w->as<uint8_t>(), n * k, 61, cs_));
        BENCH_CUDA(gpubench::FillFp8(x->as<uint8_t>(), m_max * k, 62, cs_));
        BENCH_CUDA(gpubench::FillF32(sa->as<float>(), a_scale_bytes / 4, 63, 0.5e-3f, 1e-3f, cs_));
        BENCH_CUDA(gpubench::FillF32(sb->as<float>(), b_scale_bytes / 4, 64, 0.5e-3f, 1e-3f, cs_));
        BENCH_CUDA(cudaStreamSynchronize(cs_));
        return absl::OkStatus();
      }();
    }
    if (!ok.ok()) {
      for (int64_t m : ms) Fail(result(m), ok, skipped);
      return;
    }
    for (int64_t m : ms) {
      if (broken_) return;
      MeasureLt(result(m), n, m, k, w->data(), x->data(), d->data(), sa->as<float>(),
                sb->as<float>());
    }
  }

  // ---- host to device through the Device API

  void HostToDevice() {
    struct Size {
      const char* name;
      size_t bytes;
    };
    const Size sizes[] = {{"expert_matrix_14.7MB", size_t{7168} * 2048},
                          {"mlp_gate_132MB", size_t{18432} * 7168},
                          {"1GiB", kGiB}};
    std::vector<Size> todo;
    for (const Size& s : sizes) {
      if (Selected(absl::StrCat("h2d/device_copy/", s.name))) todo.push_back(s);
    }
    const bool pageable = Selected("h2d/pageable_1GiB");
    if (todo.empty() && !pageable) return;
    std::printf(
        "\n== Host -> device copies (Device::CopyToDevice from memory registered with "
        "ScopedHostRegister) ==\n");
    report_.PrintHeaderRow();
    auto result = [&](const std::string& id, size_t bytes, const std::string& note) {
      Result r;
      r.group = "h2d";
      r.id = id;
      r.shape = absl::StrFormat("%.1f MB", bytes / 1e6);
      r.shape_json = {{"bytes", bytes}};
      r.bytes = double(bytes);
      r.h2d = true;
      r.note = note;
      return r;
    };
    absl::Status ok = EnsureHostBuffer();
    absl::StatusOr<DeviceBuffer> dst = Alloc(kGiB);
    if (ok.ok() && !dst.ok()) ok = dst.status();
    if (!ok.ok()) {
      if (pageable) Fail(result("h2d/pageable_1GiB", kGiB, ""), ok);
      for (const Size& s : todo) {
        if (broken_) return;
        Fail(result(absl::StrCat("h2d/device_copy/", s.name), s.bytes, ""), ok);
      }
      return;
    }
    void* dp = dst->data();
    if (pageable) {
      // Without registration: what a loader that forgot ScopedHostRegister would get.
      Measure(result("h2d/pageable_1GiB", kGiB,
                     "cudaMemcpyAsync from pageable memory (no registration), for contrast"),
              [&]() -> absl::Status {
                BENCH_CUDA(cudaMemcpyAsync(dp, host_, kGiB, cudaMemcpyHostToDevice, cs_));
                return absl::OkStatus();
              });
    }
    if (todo.empty() || broken_) return;
    absl::StatusOr<ScopedHostRegister> reg =
        ScopedHostRegister::Create(host_, kGiB, /*read_only=*/false);
    for (const Size& s : todo) {
      if (broken_) return;
      Result r = result(absl::StrCat("h2d/device_copy/", s.name), s.bytes,
                        "Device::CopyToDevice, registered source");
      if (!reg.ok()) {
        Fail(r, reg.status());
        continue;
      }
      const size_t bytes = s.bytes;
      Measure(r, [&] { return device_.CopyToDevice(stream_, dp, host_, bytes); });
    }
  }

  const Options& opt_;
  Device& device_;
  Stream& stream_;
  cudaStream_t cs_;
  Watchdog& dog_;
  Report& report_;
  Timer timer_;
  cublasHandle_t cublas_ = nullptr;
  size_t l2_bytes_ = 50 * kMiB;
  cublasLtHandle_t lt_ = nullptr;
  DeviceBuffer lt_workspace_;
  DeviceBuffer probe_;
  void* host_ = nullptr;
  bool broken_ = false;
  std::string broken_reason_;
};

std::string UtcNow() {
  const std::time_t now = std::time(nullptr);
  std::tm tm{};
  gmtime_r(&now, &tm);
  char buf[64];
  std::strftime(buf, sizeof(buf), "%Y-%m-%dT%H:%M:%SZ", &tm);
  return buf;
}

// The GPU's identity and clocks (what cudaDeviceGetAttribute offers; no NVML), printed and kept
// in the JSON header.
json DescribeGpu(int ordinal) {
  json g;
  cudaDeviceProp prop{};
  if (cudaGetDeviceProperties(&prop, ordinal) == cudaSuccess) {
    g["name"] = prop.name;
    g["compute_capability"] = absl::StrCat(prop.major, ".", prop.minor);
    g["sm_count"] = prop.multiProcessorCount;
    g["memory_bytes"] = prop.totalGlobalMem;
    g["l2_bytes"] = prop.l2CacheSize;
  } else {
    cudaGetLastError();
  }
  auto attr = [&](cudaDeviceAttr a, const char* key) {
    int v = 0;
    if (cudaDeviceGetAttribute(&v, a, ordinal) == cudaSuccess) {
      g[key] = v;
    } else {
      cudaGetLastError();
    }
  };
  attr(cudaDevAttrClockRate, "sm_clock_max_khz");
  attr(cudaDevAttrMemoryClockRate, "memory_clock_max_khz");
  attr(cudaDevAttrGlobalMemoryBusWidth, "memory_bus_width_bits");
  int driver = 0, runtime = 0;
  cudaDriverGetVersion(&driver);
  cudaRuntimeGetVersion(&runtime);
  g["driver_version"] = driver;
  g["runtime_version"] = runtime;
  absl::StatusOr<std::string> libs = cuda::LibraryVersions();
  if (libs.ok()) g["libraries"] = *libs;
  char bus[32] = {};
  if (cudaDeviceGetPCIBusId(bus, sizeof(bus), ordinal) == cudaSuccess) {
    g["pci_bus_id"] = bus;
  } else {
    cudaGetLastError();
  }
  return g;
}

int Main(int argc, char** argv) {
  Options opt;
  if (const std::string err = ParseFlags(argc, argv, &opt); !err.empty()) {
    std::fprintf(stderr, "hmoe_gpu_bench: %s\n%s", err.c_str(), kUsage);
    return 64;
  }
  if (!opt.json_path.empty()) {
    std::ofstream probe(opt.json_path + ".tmp", std::ios::trunc);
    if (!probe) {
      std::fprintf(stderr, "hmoe_gpu_bench: --json: cannot write %s.tmp: %s\n",
                   opt.json_path.c_str(), std::strerror(errno));
      return 64;
    }
    probe.close();
    std::remove((opt.json_path + ".tmp").c_str());
  }
  const int count = CudaDeviceCount();
  if (count == 0) {
    std::fprintf(stderr,
                 "hmoe_gpu_bench: no CUDA device: %s. This benchmark needs an NVIDIA GPU; "
                 "nothing was measured.\n",
                 cuda::NoDeviceReason().c_str());
    return 2;
  }
  if (opt.device >= count) {
    std::fprintf(stderr, "hmoe_gpu_bench: --device %d: only %d CUDA device(s) visible\n",
                 opt.device, count);
    return 2;
  }
  std::string command;
  for (int i = 0; i < argc; ++i) absl::StrAppend(&command, i > 0 ? " " : "", argv[i]);
  json header;
  header["schema"] = "hmoe-gpu-bench/1";
  header["command"] = command;
  header["date"] = UtcNow();
  header["gpu"] = DescribeGpu(opt.device);
  const json& g = header["gpu"];
  std::printf("hmoe_gpu_bench  %s\n", header["date"].get<std::string>().c_str());
  std::printf(
      "GPU %d: %s (sm_%s), %d SMs, %.1f GiB, L2 %.0f MiB, SM clock max %.0f MHz, memory "
      "clock max %.0f MHz x %d-bit bus; driver %d, runtime %d; %s\n",
      opt.device, g.value("name", std::string("?")).c_str(),
      g.value("compute_capability", std::string("?")).c_str(), g.value("sm_count", 0),
      g.value("memory_bytes", size_t{0}) / double(kGiB), g.value("l2_bytes", 0) / double(kMiB),
      g.value("sm_clock_max_khz", 0) / 1e3, g.value("memory_clock_max_khz", 0) / 1e3,
      g.value("memory_bus_width_bits", 0), g.value("driver_version", 0),
      g.value("runtime_version", 0), g.value("libraries", std::string("")).c_str());
  std::printf(
      "Times: median per call over repetitions timed with CUDA events on one stream "
      "(up to %d reps or %.0f ms per op). %%cmp: TFLOP/s over the compute peak of the op's "
      "math (BF16 GEMM or F32 SGEMM, 8192^3); %%bw: GB/s over the device bandwidth peak "
      "(or the host->device peak for copies from the host).\n",
      opt.max_reps, opt.target_ms);
  std::fflush(stdout);

  Watchdog dog(opt.stall_s, opt.hard_limit_s);
  if (const cudaError_t e = cudaSetDevice(opt.device); e != cudaSuccess) {
    std::fprintf(stderr, "hmoe_gpu_bench: cudaSetDevice(%d): %s\n", opt.device,
                 cudaGetErrorString(e));
    return 2;
  }
  size_t free_bytes = 0, total_bytes = 0;
  if (const cudaError_t e = cudaMemGetInfo(&free_bytes, &total_bytes); e != cudaSuccess) {
    std::fprintf(stderr, "hmoe_gpu_bench: cudaMemGetInfo: %s\n", cudaGetErrorString(e));
    return 2;
  }
  // The device's budget: what is free now less room for cuBLAS workspaces and the CUDA context.
  const size_t budget = free_bytes > 2 * kGiB ? free_bytes - kGiB : free_bytes / 2;
  header["device_budget_bytes"] = budget;
  std::printf("memory: %.1f GiB free of %.1f GiB; device budget %.1f GiB\n",
              free_bytes / double(kGiB), total_bytes / double(kGiB), budget / double(kGiB));
  absl::StatusOr<std::unique_ptr<Device>> device = NewCudaDevice(opt.device, budget);
  if (!device.ok()) {
    std::fprintf(stderr, "hmoe_gpu_bench: NewCudaDevice(%d): %s\n", opt.device,
                 device.status().ToString().c_str());
    return 2;
  }
  absl::StatusOr<std::unique_ptr<Stream>> stream = (*device)->CreateStream();
  if (!stream.ok()) {
    std::fprintf(stderr, "hmoe_gpu_bench: CreateStream: %s\n", stream.status().ToString().c_str());
    return 1;
  }
  Report report(opt, header);
  bool aborted = false;
  std::string reason;
  {
    GpuBench bench(opt, **device, **stream, dog, report);
    if (absl::Status s = bench.Init(); !s.ok()) {
      std::fprintf(stderr, "hmoe_gpu_bench: setup failed: %s\n", s.ToString().c_str());
      return 1;
    }
    bench.RunAll();
    bench.ReleaseHost();
    aborted = bench.broken();
    reason = bench.broken_reason();
  }
  report.Finish(dog.Seconds(), aborted, reason);
  if (!opt.json_path.empty()) std::printf("JSON: %s\n", opt.json_path.c_str());
  return report.problems() == 0 && !aborted ? 0 : 1;
}

}  // namespace
}  // namespace hmoe

int main(int argc, char** argv) { return hmoe::Main(argc, argv); }
