// hmoe-slp-bench: how much of the weight-copy time stream-loading prefill (SLP) hides behind
// compute, per experts-ring length, on the CPU device with capped host-to-device copies (a PCIe
// link stand-in; issue #4 acceptance 4, docs/PERFORMANCE.md).
//
//   hmoe-slp-bench --model DIR [--prompt_tokens 256] [--step_tokens 0] [--copy_gbps 2]
//                  [--rings 2,4,0] [--budget_mb 64] [--threads 2] [--repeats 3]
//
// For each ring length (0: experts per layer) it runs the prompt through the engine over
// StreamingWeights --repeats times (after one warm-up) and prints the median run: wall time, the
// loader's copy time, the model thread's wait for weights (copy time NOT hidden), the hidden
// fraction 1 - wait / copy, the model thread's compute time in that run (wall - wait) and its
// ratio to the copy time, the arena's capacity and how much anonymous memory the process gained
// over the configuration (the arena's pages that streaming touched, plus the KV pool); first the
// compute time of the same prompt with resident weights (no streaming) for reference. Exit code
// 0, or 1 with a message.

#include <algorithm>
#include <cstdio>
#include <fstream>
#include <memory>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/status/status.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"

#include "common/base/flags.h"
#include "common/base/status_macros.h"
#include "common/device/cpu_device.h"
#include "common/engine/engine.h"
#include "common/engine/kv_cache.h"
#include "common/engine/streaming_weights.h"
#include "common/engine/weights.h"
#include "common/model/checkpoint.h"
#include "common/ops/cpu/cpu_worker_pool.h"

ABSL_FLAG(std::string, model, "", "checkpoint directory");
ABSL_FLAG(int, prompt_tokens, 256, "prompt length");
ABSL_FLAG(int, step_tokens, 0,
          "prompt tokens per engine pass (0: the whole prompt in one pass); every pass streams "
          "all the weights again");
ABSL_FLAG(double, copy_gbps, 2, "cpu device copy cap in GB/s (0: uncapped memcpy)");
ABSL_FLAG(std::string, rings, "2,4,0", "ring lengths to measure (0: experts per layer)");
ABSL_FLAG(int, budget_mb, 64,
          "streaming budget (MiB) for the non-expert modules (0: the default for this device)");
ABSL_FLAG(int, threads, 2, "cpu threads for the device's ops");
ABSL_FLAG(int, repeats, 3, "measured runs per configuration (median reported)");

namespace hmoe {
namespace {

struct Run {
  double wall = 0, copy = 0, wait = 0, loader_wait = 0;
  StreamingStats stats;
};

std::vector<int32_t> Prompt(int n, int64_t vocab) {
  std::vector<int32_t> p(n);
  for (int i = 0; i < n; ++i)
    p[i] = static_cast<int32_t>((7 + i * 131) % std::min<int64_t>(vocab, 3000));
  return p;
}

// Seconds of one prefill of `prompt` on `engine` with a fresh sequence.
absl::StatusOr<double> TimePrefill(Engine& engine, KvCache& cache,
                                   const std::vector<int32_t>& prompt) {
  KvSequence seq = cache.NewSequence();
  SequenceInput in{&seq, prompt, true};
  const absl::Time start = absl::Now();
  HMOE_RETURN_IF_ERROR(engine.Forward(std::span<const SequenceInput>(&in, 1)).status());
  return absl::ToDoubleSeconds(absl::Now() - start);
}

// The process's anonymous resident memory (RssAnon of /proc/self/status) in bytes; 0 if unknown.
double AnonRssBytes() {
  std::ifstream status("/proc/self/status");
  std::string line;
  while (std::getline(status, line)) {
    if (line.rfind("RssAnon:", 0) == 0) return std::stod(line.substr(8)) * 1024;
  }
  return 0;
}

template <typename T>
T Median(std::vector<T> v, double T::*key) {
  std::sort(v.begin(), v.end(), [&](const T& a, const T& b) { return a.*key < b.*key; });
  return v[v.size() / 2];
}

absl::Status Main() {
  const std::string dir = absl::GetFlag(FLAGS_model);
  if (dir.empty()) return absl::InvalidArgumentError("--model is required");
  const int n = absl::GetFlag(FLAGS_prompt_tokens);
  const double gbps = absl::GetFlag(FLAGS_copy_gbps);
  const int repeats = std::max(1, absl::GetFlag(FLAGS_repeats));
  HMOE_ASSIGN_OR_RETURN(std::unique_ptr<Checkpoint> ckpt, Checkpoint::Open(dir));
  const ModelConfig& config = ckpt->config();
  CpuWorkerPoolOptions po;
  po.num_nodes = 1;
  po.threads_per_node = absl::GetFlag(FLAGS_threads);
  po.pin_threads = false;
  HMOE_ASSIGN_OR_RETURN(std::unique_ptr<CpuWorkerPool> pool, CpuWorkerPool::Create(po));
  const std::vector<int32_t> prompt = Prompt(n, config.vocab_size);
  EngineOptions eo;
  const int step = absl::GetFlag(FLAGS_step_tokens) > 0 ? absl::GetFlag(FLAGS_step_tokens) : n;
  const int64_t passes = (n + step - 1) / step;
  eo.max_step_tokens = step;
  eo.max_step_sequences = 1;
  eo.experts = ExpertPlacement::kDevice;
  const KvCacheConfig kc = KvCacheConfig::ForModel(config, (n + 63) / 64, 64);

  // Compute alone: the same engine path with resident weights read in place.
  double compute = 0;
  {
    std::unique_ptr<Device> device = NewCpuDevice({.pool = pool.get()});
    HMOE_ASSIGN_OR_RETURN(std::unique_ptr<ResidentWeights> w,
                          ResidentWeights::Create(config, *ckpt, *device));
    HMOE_ASSIGN_OR_RETURN(std::unique_ptr<Engine> engine,
                          Engine::Create(config, *w, *device, *pool, eo));
    HMOE_ASSIGN_OR_RETURN(std::unique_ptr<KvCache> cache, KvCache::Create(*device, kc));
    HMOE_RETURN_IF_ERROR(TimePrefill(*engine, *cache, prompt).status());  // warm-up
    std::vector<double> times;
    for (int r = 0; r < repeats; ++r) {
      HMOE_ASSIGN_OR_RETURN(double t, TimePrefill(*engine, *cache, prompt));
      times.push_back(t);
    }
    std::sort(times.begin(), times.end());
    compute = times[times.size() / 2];
  }

  std::printf(
      "model %s, prompt %d tokens in %lld pass(es), copy cap %.2f GB/s, %d threads, budget %d "
      "MiB\n",
      dir.c_str(), n, static_cast<long long>(passes), gbps, po.threads_per_node,
      absl::GetFlag(FLAGS_budget_mb));
  std::printf("compute alone (resident weights): %.3f s\n", compute);
  std::printf("%6s %10s %8s %8s %8s %8s %10s %8s %9s %12s %10s %9s\n", "ring", "MB/pass", "wall_s",
              "compute_s", "copy_s", "wait_s", "loader_s", "hidden", "cmp/copy", "ring_MB",
              "arena_MB", "+anon_MB");
  for (absl::string_view part : absl::StrSplit(absl::GetFlag(FLAGS_rings), ',')) {
    int64_t ring = 0;
    if (!absl::SimpleAtoi(part, &ring) || ring < 0) {
      return absl::InvalidArgumentError(absl::StrCat("--rings: bad value \"", part, "\""));
    }
    const double anon_before = AnonRssBytes();
    std::unique_ptr<Device> device =
        NewCpuDevice({.copy_bytes_per_second = gbps * 1e9, .pool = pool.get()});
    StreamingWeightsOptions wo;
    wo.ring_slots = ring;
    wo.budget_bytes = static_cast<size_t>(absl::GetFlag(FLAGS_budget_mb)) << 20;
    HMOE_ASSIGN_OR_RETURN(std::unique_ptr<StreamingWeights> w,
                          StreamingWeights::Create(config, *ckpt, *device, wo));
    HMOE_ASSIGN_OR_RETURN(std::unique_ptr<Engine> engine,
                          Engine::Create(config, *w, *device, *pool, eo));
    HMOE_ASSIGN_OR_RETURN(std::unique_ptr<KvCache> cache, KvCache::Create(*device, kc));
    std::vector<Run> runs;
    for (int r = 0; r <= repeats; ++r) {
      HMOE_RETURN_IF_ERROR(w->BeginPrefill(passes));
      const absl::Time start = absl::Now();
      absl::Status s = TimePrefill(*engine, *cache, prompt).status();
      HMOE_ASSIGN_OR_RETURN(StreamingStats st, w->EndPrefill(!s.ok()));
      HMOE_RETURN_IF_ERROR(s);
      if (r == 0) continue;  // warm-up
      Run run;
      run.wall = absl::ToDoubleSeconds(absl::Now() - start);
      run.copy = st.copy_seconds;
      run.wait = st.load_wait_seconds;
      run.loader_wait = st.loader_memory_wait_seconds;
      run.stats = st;
      runs.push_back(run);
    }
    const Run m = Median(runs, &Run::wall);
    // The model thread's time not spent waiting for weights: its compute in this very run.
    const double run_compute = m.wall - m.wait;
    std::printf("%6lld %10.1f %8.3f %8.3f %8.3f %8.3f %10.3f %7.1f%% %9.2f %12.1f %10.1f %9.1f\n",
                static_cast<long long>(w->ring_slots()), w->bytes_per_pass() / 1e6, m.wall,
                run_compute, m.copy, m.wait, m.loader_wait, 100 * m.stats.hidden_fraction(),
                run_compute / m.copy, w->ring_bytes() / 1e6, w->budget_bytes() / 1e6,
                (AnonRssBytes() - anon_before) / 1e6);
  }
  return absl::OkStatus();
}

}  // namespace
}  // namespace hmoe

int main(int argc, char** argv) {
  hmoe::SetUsage(
      "hmoe-slp-bench --model DIR [--prompt_tokens 256] [--step_tokens 0] [--copy_gbps 2] "
      "[--rings 2,4,0] [--budget_mb 64] [--threads 2] [--repeats 3]");
  absl::ParseCommandLine(argc, argv);
  const absl::Status s = hmoe::Main();
  if (!s.ok()) {
    std::fprintf(stderr, "hmoe-slp-bench: %s\n", std::string(s.message()).c_str());
    return 1;
  }
  return 0;
}
