// hmoe-dslp-bench: measures distributed SLP on the CPU device. Forks --world_size rank processes
// (before any thread exists), each with its own CPU pool, engine and ShmCollective; every rank
// runs --warmup + --repeat prefills of the same prompt and sends the stats of its fastest measured
// prefill to the parent, which prints the per-layer time breakdown (attention phases, gate/sort,
// dispatch/combine, experts) and the bytes each rank sent to each peer, next to the paper's
// formulas (§3.2). Both EP modes with --ep_mode=both.
//
//   hmoe-dslp-bench --model DIR --world_size 2 --prompt_len 1024 --ep_mode both

#include <signal.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/time/time.h"

#include "common/base/flags.h"
#include "common/base/logging.h"
#include "common/base/status_macros.h"
#include "common/comm/shm_collective.h"
#include "common/device/cpu_device.h"
#include "common/dslp/dslp.h"
#include "common/engine/engine.h"
#include "common/engine/kv_cache.h"
#include "common/engine/weights.h"
#include "common/model/checkpoint.h"
#include "common/ops/cpu/cpu_worker_pool.h"

ABSL_FLAG(std::string, model, "", "checkpoint directory");
ABSL_FLAG(int, world_size, 2, "ranks (processes)");
ABSL_FLAG(std::string, ep_mode, "both", "standard, small_ep or both");
ABSL_FLAG(int64_t, prompt_len, 1024, "prompt tokens");
ABSL_FLAG(int, threads, 1, "CPU pool threads per rank");
ABSL_FLAG(int, warmup, 1, "prefills before measuring");
ABSL_FLAG(int, repeat, 3, "measured prefills (the fastest is reported)");

namespace hmoe {
namespace {

// What a rank sends to the parent (plain bytes through a pipe).
struct Report {
  int32_t rank = 0;
  int32_t ok = 0;
  int64_t local_tokens = 0;
  double total_s = 0;
  DslpLayerStats moe_mean;    // mean over MoE layers
  DslpLayerStats dense_mean;  // mean over dense layers
  int64_t moe_layers = 0, dense_layers = 0;
  uint64_t ring_sent[8] = {}, dispatch_sent[8] = {}, combine_sent[8] = {}, meta_sent[8] = {};
  char error[256] = {};
};

void Accumulate(DslpLayerStats& sum, const DslpLayerStats& l, double scale) {
  sum.attention_other_s += l.attention_other_s * scale;
  sum.attention_local_s += l.attention_local_s * scale;
  sum.ring_s += l.ring_s * scale;
  sum.attention_remote_s += l.attention_remote_s * scale;
  sum.attention_project_s += l.attention_project_s * scale;
  sum.gate_sort_s += l.gate_sort_s * scale;
  sum.dispatch_s += l.dispatch_s * scale;
  sum.experts_s += l.experts_s * scale;
  sum.shared_s += l.shared_s * scale;
  sum.combine_s += l.combine_s * scale;
  sum.reduce_s += l.reduce_s * scale;
  sum.ffn_other_s += l.ffn_other_s * scale;
  sum.ring_bytes += static_cast<uint64_t>(l.ring_bytes * scale);
  sum.dispatch_bytes += static_cast<uint64_t>(l.dispatch_bytes * scale);
  sum.combine_bytes += static_cast<uint64_t>(l.combine_bytes * scale);
}

absl::Status RunRank(int rank, int world, EpMode mode, const std::string& group, Report* report) {
  const int64_t prompt_len = absl::GetFlag(FLAGS_prompt_len);
  CpuWorkerPoolOptions pool_options;
  pool_options.num_nodes = 1;
  pool_options.threads_per_node = absl::GetFlag(FLAGS_threads);
  pool_options.pin_threads = false;
  HMOE_ASSIGN_OR_RETURN(std::unique_ptr<CpuWorkerPool> pool, CpuWorkerPool::Create(pool_options));
  CpuDeviceOptions device_options;
  device_options.pool = pool.get();
  std::unique_ptr<Device> device = NewCpuDevice(device_options);
  HMOE_ASSIGN_OR_RETURN(std::unique_ptr<Checkpoint> checkpoint,
                        Checkpoint::Open(absl::GetFlag(FLAGS_model)));
  const ModelConfig& config = checkpoint->config();
  HMOE_ASSIGN_OR_RETURN(std::unique_ptr<ResidentWeights> weights,
                        ResidentWeights::Create(config, *checkpoint, *device));
  EngineOptions engine_options;
  engine_options.max_step_tokens = prompt_len;
  engine_options.experts = ExpertPlacement::kDevice;
  HMOE_ASSIGN_OR_RETURN(std::unique_ptr<Engine> engine,
                        Engine::Create(config, *weights, *device, *pool, engine_options));
  HMOE_ASSIGN_OR_RETURN(
      std::unique_ptr<KvCache> cache,
      KvCache::Create(*device, KvCacheConfig::ForModel(config, prompt_len / 64 + 2, 64)));
  ShmCollectiveOptions comm_options;
  comm_options.group_name = group;
  comm_options.rank = rank;
  comm_options.world_size = world;
  comm_options.peer_timeout = absl::Seconds(30);
  HMOE_ASSIGN_OR_RETURN(std::unique_ptr<ShmCollective> comm, ShmCollective::Create(comm_options));
  DslpOptions options;
  options.ep_mode = mode;
  HMOE_ASSIGN_OR_RETURN(std::unique_ptr<DslpRank> dslp, DslpRank::Create(*engine, *comm, options));

  std::vector<int32_t> prompt(prompt_len);
  for (int64_t i = 0; i < prompt_len; ++i) {
    prompt[i] = static_cast<int32_t>((i * 7919 + 13) % config.vocab_size);
  }
  const int runs = absl::GetFlag(FLAGS_warmup) + absl::GetFlag(FLAGS_repeat);
  DslpStats best;
  for (int i = 0; i < runs; ++i) {
    KvSequence seq = cache->NewSequence();
    HMOE_RETURN_IF_ERROR(dslp->Prefill(prompt, seq).status());
    if (i < absl::GetFlag(FLAGS_warmup)) continue;
    if (best.layers.empty() || dslp->last_stats().total_s < best.total_s) {
      best = dslp->last_stats();
    }
  }
  report->local_tokens = best.local_tokens;
  report->total_s = best.total_s;
  for (int64_t l = 0; l < config.num_hidden_layers; ++l) {
    (config.is_moe_layer(l) ? report->moe_layers : report->dense_layers) += 1;
  }
  for (int64_t l = 0; l < config.num_hidden_layers; ++l) {
    const bool moe = config.is_moe_layer(l);
    Accumulate(moe ? report->moe_mean : report->dense_mean, best.layers[l],
               1.0 / (moe ? report->moe_layers : report->dense_layers));
  }
  for (int p = 0; p < world && p < 8; ++p) {
    report->ring_sent[p] = best.ring_sent[p];
    report->dispatch_sent[p] = best.dispatch_sent[p];
    report->combine_sent[p] = best.combine_sent[p];
    report->meta_sent[p] = best.meta_sent[p];
  }
  return absl::OkStatus();
}

double Ms(double s) { return s * 1e3; }

int Run(EpMode mode) {
  const int world = absl::GetFlag(FLAGS_world_size);
  if (world < 1 || world > 8) {
    std::fprintf(stderr, "--world_size must be 1..8\n");
    return 2;
  }
  const std::string group = absl::StrCat("dslp-bench-", ::getpid(), "-", EpModeName(mode));
  std::vector<pid_t> pids;
  std::vector<int> fds;
  for (int r = 0; r < world; ++r) {
    int pipe_fds[2];
    if (::pipe(pipe_fds) != 0) return 2;
    std::fflush(nullptr);
    const pid_t pid = ::fork();
    if (pid == 0) {
      ::prctl(PR_SET_PDEATHSIG, SIGKILL);
      ::close(pipe_fds[0]);
      Report report;
      report.rank = r;
      const absl::Status s = RunRank(r, world, mode, group, &report);
      report.ok = s.ok() ? 1 : 0;
      std::snprintf(report.error, sizeof(report.error), "%s", s.ToString().c_str());
      const ssize_t w = ::write(pipe_fds[1], &report, sizeof(report));
      ::_exit(w == sizeof(report) && s.ok() ? 0 : 1);
    }
    ::close(pipe_fds[1]);
    pids.push_back(pid);
    fds.push_back(pipe_fds[0]);
  }
  std::vector<Report> reports(world);
  bool ok = true;
  for (int r = 0; r < world; ++r) {
    size_t got = 0;
    auto* bytes = reinterpret_cast<char*>(&reports[r]);
    while (got < sizeof(Report)) {
      const ssize_t n = ::read(fds[r], bytes + got, sizeof(Report) - got);
      if (n <= 0) break;
      got += static_cast<size_t>(n);
    }
    ::close(fds[r]);
    int status = 0;
    ::waitpid(pids[r], &status, 0);
    if (got != sizeof(Report) || !reports[r].ok) {
      std::fprintf(stderr, "rank %d failed: %s\n", r,
                   got == sizeof(Report) ? reports[r].error : "no report");
      ok = false;
    }
  }
  if (!ok) return 1;

  // Mean over ranks of the per-MoE-layer means.
  DslpLayerStats moe, dense;
  double total = 0;
  for (const Report& r : reports) {
    Accumulate(moe, r.moe_mean, 1.0 / world);
    Accumulate(dense, r.dense_mean, 1.0 / world);
    total = std::max(total, r.total_s);
  }
  const int64_t n = absl::GetFlag(FLAGS_prompt_len);
  std::printf("\n## %s, S=%d, N=%lld tokens (%lld..%lld per rank), %d thread(s)/rank\n",
              EpModeName(mode), world, static_cast<long long>(n),
              static_cast<long long>(reports.back().local_tokens),
              static_cast<long long>(reports.front().local_tokens), absl::GetFlag(FLAGS_threads));
  std::printf("prefill wall (slowest rank): %.1f ms, %.0f tokens/s\n", Ms(total), n / total);
  std::printf("\nper-layer time, mean over ranks (ms)  | MoE layer | dense layer\n");
  std::printf("---|---|---\n");
  auto row = [&](const char* name, double a, double b) {
    std::printf("%s | %.2f | %.2f\n", name, Ms(a), Ms(b));
  };
  row("attention: norms/projections/RoPE/o_proj", moe.attention_other_s, dense.attention_other_s);
  row("attention phase 1 (local chunks)", moe.attention_local_s, dense.attention_local_s);
  row("attention phase 2: ring pass-KV", moe.ring_s, dense.ring_s);
  row("attention phase 2: remote chunks", moe.attention_remote_s, dense.attention_remote_s);
  row("attention: W_UV projection", moe.attention_project_s, dense.attention_project_s);
  row("gate + sort", moe.gate_sort_s, 0);
  row(mode == EpMode::kStandard ? "dispatch (all-to-all)" : "all-gather tokens", moe.dispatch_s, 0);
  row("local routed experts", moe.experts_s, 0);
  row("shared experts", moe.shared_s, 0);
  row(mode == EpMode::kStandard ? "combine (all-to-all)" : "partial sums all-to-all", moe.combine_s,
      0);
  row(mode == EpMode::kStandard ? "weighted sum" : "local reduction", moe.reduce_s, 0);
  row("dense MLP / residual", moe.ffn_other_s, dense.ffn_other_s);
  std::printf(
      "\nbytes sent over the whole prefill, rank -> peer: ring | dispatch/all-gather | "
      "combine/partial | meta\n");
  for (int r = 0; r < world; ++r) {
    for (int p = 0; p < world; ++p) {
      if (p == r) continue;
      std::printf("%d -> %d: %llu | %llu | %llu | %llu\n", r, p,
                  static_cast<unsigned long long>(reports[r].ring_sent[p]),
                  static_cast<unsigned long long>(reports[r].dispatch_sent[p]),
                  static_cast<unsigned long long>(reports[r].combine_sent[p]),
                  static_cast<unsigned long long>(reports[r].meta_sent[p]));
    }
  }
  uint64_t moe_bytes = 0;
  for (const Report& r : reports) {
    for (int p = 0; p < world; ++p) moe_bytes += r.dispatch_sent[p] + r.combine_sent[p];
  }
  std::printf("MoE bytes over all links: %llu\n", static_cast<unsigned long long>(moe_bytes));
  return 0;
}

int Main() {
  const std::string mode = absl::GetFlag(FLAGS_ep_mode);
  if (absl::GetFlag(FLAGS_model).empty()) {
    std::fprintf(stderr, "--model is required\n");
    return 2;
  }
  if (mode == "both") {
    // One mode at a time: both sets of ranks run on the same cores.
    const int a = Run(EpMode::kStandard);
    const int b = Run(EpMode::kSmallEp);
    return a != 0 ? a : b;
  }
  absl::StatusOr<EpMode> parsed = ParseEpMode(mode);
  if (!parsed.ok()) {
    std::fprintf(stderr, "%s\n", parsed.status().ToString().c_str());
    return 2;
  }
  return Run(*parsed);
}

}  // namespace
}  // namespace hmoe

int main(int argc, char** argv) {
  hmoe::SetUsage(
      "measures DSLP on the CPU device: hmoe-dslp-bench --model DIR --world_size 2 "
      "--prompt_len 1024 --ep_mode both");
  absl::ParseCommandLine(argc, argv);
  return hmoe::Main();
}
