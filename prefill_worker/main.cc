// hmoe-prefill-worker: stream-loading prefill (SLP, paper §3.1) of long prompts on a GPU or the
// CPU device, alone or as one rank of a DSLP group (paper §3.2), handing each prompt's KV cache
// to the decode worker. See docs/prefill_worker.md and docs/dslp.md.
//
//   hmoe-prefill-worker (--model DIR | --weightd-instance NAME) --socket PATH
//                       [--device cpu|cuda:N] [--threads N] [--device-memory-mb MB]
//                       [--copy-gbps G] [--stream-budget-mb MB] [--ring-slots N]
//                       [--ring-turning-point TOKENS] [--max-prompt-tokens N]
//                       [--max-step-tokens N] [--kv-export auto|shm|cuda-ipc]
//                       [--export-timeout-seconds S] [--router ADDR] [--worker-id ID]
//                       [--dslp-ep-mode small_ep|standard] [--dslp-join-timeout-seconds S]
//                       [--dslp-peer-timeout-seconds S]
//
// Exit codes: 0 after SIGTERM/SIGINT (drained), 1 on a start-up or runtime error, 2 on bad flags.

#include <unistd.h>

#include <memory>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"

#include "common/base/logging.h"
#include "common/base/status_macros.h"
#include "common/comm/shm_collective.h"
#include "common/device/cpu_device.h"
#include "common/device/cuda_host_register.h"
#include "common/device/device.h"
#include "common/device/device_flag.h"
#include "common/dslp/dslp.h"
#include "common/ops/cpu/cpu_worker_pool.h"
#include "common/process/daemon.h"
#include "common/process/socket_path.h"
#include "common/rpc/worker_server.h"
#include "common/shm/worker_weights.h"
#include "prefill_worker/kv_exports.h"
#include "prefill_worker/prefill_scheduler.h"
#include "prefill_worker/prefill_service.h"
#include "prefill_worker/slp_runner.h"

ABSL_FLAG(std::string, model, "", "checkpoint directory, opened directly (tests, CPU-only use)");
ABSL_FLAG(std::string, weightd_instance, "", "attach to this hmoe-weightd instance's weights");
ABSL_FLAG(std::string, socket, "", "unix socket to serve on (its directory must be 0700)");
ABSL_FLAG(std::string, device, "cpu", "prefill device: cpu or cuda:N");
ABSL_FLAG(int, threads, 0, "CPU threads for the CPU device's ops (0: all of NUMA node 0)");
ABSL_FLAG(bool, pin_threads, true, "pin CPU worker threads to cores");
ABSL_FLAG(int64_t, device_memory_mb, 0,
          "device memory budget in MiB (0: unlimited on cpu, the free memory on cuda)");
ABSL_FLAG(double, copy_gbps, 0,
          "cpu device: cap host-to-device copies at this many GB/s to model a PCIe link (0: off)");
ABSL_FLAG(int64_t, stream_budget_mb, 0,
          "device MiB for streamed non-expert modules (0: on cuda 1024 or the largest such "
          "module; on cpu 3 layers' worth, at most 1024, at least the largest module)");
ABSL_FLAG(int64_t, ring_slots, 0,
          "experts ring slots for short prompts (0: experts per layer, capped by device memory)");
ABSL_FLAG(int64_t, ring_turning_point, 0,
          "prompt tokens from which the experts ring shrinks to 2 slots (0: computed)");
ABSL_FLAG(double, device_tflops, 0,
          "device compute rate for the computed turning point (0: default)");
ABSL_FLAG(int64_t, max_prompt_tokens, 0,
          "longest prompt (0: min(max_position_embeddings, 32768)); the KV pool holds it");
ABSL_FLAG(int64_t, max_step_tokens, 0,
          "prompt tokens per engine pass (0: max-prompt-tokens, i.e. one pass per prompt)");
ABSL_FLAG(int, kv_block_tokens, 64, "tokens per KV block of the prefill's KV pool");
ABSL_FLAG(std::string, kv_export, "auto",
          "KV hand-off buffer: shm, cuda-ipc, or auto (cuda-ipc on a GPU, shm on the cpu)");
ABSL_FLAG(double, export_timeout_seconds, 60,
          "free a KV export nobody released after this many seconds");
ABSL_FLAG(int, max_waiting, 16, "prefills that may wait; RESOURCE_EXHAUSTED beyond");
ABSL_FLAG(std::string, router, "", "router registry address; empty: run without a router");
ABSL_FLAG(std::string, worker_id, "", "worker id for the router and logs (default prefill-<pid>)");
ABSL_FLAG(int, heartbeat_ms, 1000, "heartbeat period to the router");
ABSL_FLAG(double, drain_seconds, 30,
          "on SIGTERM, how long running prefills and unreleased exports may finish");
ABSL_FLAG(std::string, dslp_ep_mode, "small_ep",
          "DSLP expert parallelism when the request does not name it: small_ep or standard");
ABSL_FLAG(double, dslp_join_timeout_seconds, 30,
          "DSLP: how long a rank waits for the rest of its group to join");
ABSL_FLAG(double, dslp_peer_timeout_seconds, 5,
          "DSLP: a peer rank silent this long (no heartbeat) is dead and fails the group");

namespace hmoe::prefill {
namespace {

using process::FlagError;

// The flags that are not the runner's or the scheduler's, checked.
struct Flags {
  DeviceSpec device;
  int threads = 0;
  size_t budget_bytes = 0;
  double copy_gbps = 0;
  double export_timeout = 0;
  double drain_seconds = 0;
  rpc::WorkerServerOptions server;  // all but device, model and start
};

absl::Status ReadFlags(Flags& f, SlpRunnerOptions& ro, PrefillSchedulerOptions& so) {
  HMOE_RETURN_IF_ERROR(FlagError(shm::CheckWeightSourceFlags(
      absl::GetFlag(FLAGS_model), absl::GetFlag(FLAGS_weightd_instance))));
  absl::StatusOr<DeviceSpec> device = ParseDeviceFlag(absl::GetFlag(FLAGS_device));
  HMOE_RETURN_IF_ERROR(FlagError(device.status()));
  f.device = *device;
  const bool cuda = f.device.kind == DeviceKind::kCuda;
  const std::string kv_export = absl::GetFlag(FLAGS_kv_export);
  ro.export_kind = KvExportKind::kShm;
  if (kv_export == "cuda-ipc" || (kv_export == "auto" && cuda)) {
    ro.export_kind = KvExportKind::kCudaIpc;
  } else if (kv_export != "shm" && kv_export != "auto") {
    return FlagError(absl::StrCat("--kv-export: \"", kv_export, "\" is not auto, shm or cuda-ipc"));
  }
  if (ro.export_kind == KvExportKind::kCudaIpc && !cuda) {
    return FlagError("--kv-export cuda-ipc needs --device cuda:N");
  }
  absl::StatusOr<EpMode> ep_mode = ParseEpMode(absl::GetFlag(FLAGS_dslp_ep_mode));
  HMOE_RETURN_IF_ERROR(FlagError(Annotate(ep_mode.status(), "--dslp-ep-mode")));
  const double join_timeout = absl::GetFlag(FLAGS_dslp_join_timeout_seconds);
  const double peer_timeout = absl::GetFlag(FLAGS_dslp_peer_timeout_seconds);
  if (join_timeout <= 0 || peer_timeout <= 0) {
    return FlagError("--dslp-join-timeout-seconds and --dslp-peer-timeout-seconds must be > 0");
  }
  f.threads = absl::GetFlag(FLAGS_threads);
  const int64_t device_memory_mb = absl::GetFlag(FLAGS_device_memory_mb);
  f.copy_gbps = absl::GetFlag(FLAGS_copy_gbps);
  const int64_t stream_budget_mb = absl::GetFlag(FLAGS_stream_budget_mb);
  f.export_timeout = absl::GetFlag(FLAGS_export_timeout_seconds);
  f.drain_seconds = absl::GetFlag(FLAGS_drain_seconds);
  const int heartbeat_ms = absl::GetFlag(FLAGS_heartbeat_ms);
  so.max_waiting = absl::GetFlag(FLAGS_max_waiting);
  ro.max_prompt_tokens = absl::GetFlag(FLAGS_max_prompt_tokens);
  ro.max_step_tokens = absl::GetFlag(FLAGS_max_step_tokens);
  ro.kv_block_tokens = absl::GetFlag(FLAGS_kv_block_tokens);
  ro.stream_budget_bytes = static_cast<size_t>(stream_budget_mb) << 20;
  ro.ring_slots_short = absl::GetFlag(FLAGS_ring_slots);
  ro.turning_point_tokens = absl::GetFlag(FLAGS_ring_turning_point);
  ro.device_flops = absl::GetFlag(FLAGS_device_tflops) * 1e12;
  ro.copy_bytes_per_second = cuda ? 0 : f.copy_gbps * 1e9;
  if (f.threads < 0 || device_memory_mb < 0 || f.copy_gbps < 0 || stream_budget_mb < 0 ||
      ro.ring_slots_short < 0 || ro.turning_point_tokens < 0 || ro.device_flops < 0 ||
      ro.max_prompt_tokens < 0 || ro.max_step_tokens < 0 || ro.kv_block_tokens < 1 ||
      f.export_timeout <= 0 || f.drain_seconds < 0 || heartbeat_ms < 1 || so.max_waiting < 0) {
    return FlagError(
        "numeric flags must not be negative; --kv-block-tokens, --heartbeat-ms and "
        "--export-timeout-seconds must be > 0");
  }
  f.budget_bytes = static_cast<size_t>(device_memory_mb) << 20;
  f.server.service_name = "hmoe.prefill.v1.PrefillService";
  f.server.socket_path = absl::GetFlag(FLAGS_socket);
  f.server.kind = rpc::WorkerKind::kPrefill;
  f.server.router = absl::GetFlag(FLAGS_router);
  f.server.worker_id = absl::GetFlag(FLAGS_worker_id);
  f.server.heartbeat_interval = absl::Milliseconds(heartbeat_ms);
  if (f.server.worker_id.empty()) f.server.worker_id = absl::StrCat("prefill-", ::getpid());
  so.export_prefix = ExportPrefix(f.server.worker_id);
  so.dslp_ep_mode = *ep_mode;
  so.dslp_join.join_timeout = absl::Seconds(join_timeout);
  so.dslp_join.peer_timeout = absl::Seconds(peer_timeout);
  so.dslp_join.cuda_ordinal = cuda ? f.device.ordinal : 0;
  return process::PrepareSocketPath("--socket", f.server.socket_path);
}

// H2D copies read weightd's mapping directly: page-lock it read-only once, so every copy is an
// asynchronous DMA at full PCIe speed with no staging copy.
std::vector<ScopedHostRegister> RegisterWeights(const shm::WeightSourceHolder& weights) {
  std::vector<ScopedHostRegister> registered;
  if (weights.store == nullptr) {
    HMOE_LOG(WARNING) << "--model on a GPU: weight copies read pageable memory (staged); "
                         "serve from hmoe-weightd for full-speed streaming";
    return registered;
  }
  for (const shm::WeightStore::Segment& segment : weights.store->segments()) {
    absl::StatusOr<ScopedHostRegister> r =
        ScopedHostRegister::Create(segment.bytes.data(), segment.bytes.size(), true);
    if (!r.ok()) {
      HMOE_LOG(WARNING) << "cudaHostRegister of a weightd segment (" << segment.bytes.size()
                        << " bytes): " << r.status() << "; its copies will be staged";
      continue;
    }
    registered.push_back(*std::move(r));
  }
  return registered;
}

absl::Status Run(process::StopSignalWatcher& signals) {
  const absl::Time start = absl::Now();
  Flags flags;
  SlpRunnerOptions ro;
  PrefillSchedulerOptions so;
  HMOE_RETURN_IF_ERROR(ReadFlags(flags, ro, so));

  // --- exports left by a previous incarnation with this worker id, and shared-memory DSLP groups
  // whose ranks all died before the group formed
  if (absl::StatusOr<int> stale = RemoveStaleShmExports(so.export_prefix); !stale.ok()) {
    HMOE_LOG(WARNING) << "stale kv exports: " << stale.status();
  } else if (*stale > 0) {
    HMOE_LOG(INFO) << "removed " << *stale << " stale kv export(s) " << so.export_prefix << "*";
  }
  if (absl::StatusOr<int> stale = RemoveStaleShmGroups(); !stale.ok()) {
    HMOE_LOG(WARNING) << "stale dslp groups: " << stale.status();
  }

  // --- weights, device, runner, scheduler
  absl::StatusOr<shm::WeightSourceHolder> weights =
      shm::OpenWeights(absl::GetFlag(FLAGS_model), absl::GetFlag(FLAGS_weightd_instance));
  if (!weights.ok()) return Annotate(weights.status(), "open weights");
  absl::StatusOr<std::unique_ptr<CpuWorkerPool>> pool = CpuWorkerPool::Create(
      {.threads_per_node = flags.threads, .pin_threads = absl::GetFlag(FLAGS_pin_threads)});
  if (!pool.ok()) return Annotate(pool.status(), "cpu worker pool");
  HMOE_ASSIGN_OR_RETURN(std::unique_ptr<Device> device,
                        NewDeviceFromSpec(flags.device,
                                          {.budget_bytes = flags.budget_bytes,
                                           .copy_bytes_per_second = flags.copy_gbps * 1e9,
                                           .pool = pool->get()},
                                          flags.budget_bytes));
  std::vector<ScopedHostRegister> registered;
  if (flags.device.kind == DeviceKind::kCuda) registered = RegisterWeights(*weights);
  absl::StatusOr<std::unique_ptr<SlpRunner>> runner =
      SlpRunner::Create(weights->config, weights->source(), *device, **pool, ro);
  if (!runner.ok()) {
    absl::Status s = Annotate(runner.status(), "prefill engine");
    return absl::IsInvalidArgument(s) ? FlagError(s) : s;
  }
  auto exports = std::make_unique<ExportTable>(absl::Seconds(flags.export_timeout));
  auto scheduler = std::make_unique<PrefillScheduler>(runner->get(), exports.get(), so);
  if (signals.StopRequested()) {
    HMOE_LOG(INFO) << "stopped while starting";
    return absl::OkStatus();
  }

  // --- serve, register
  PrefillServiceImpl service(scheduler.get(), exports.get(), runner->get(),
                             PrefillServiceInfo{flags.server.worker_id, device->name()});
  const SlpRunner& r = **runner;
  PrefillScheduler* sched = scheduler.get();
  flags.server.device = device->name();
  flags.server.model = weights->description;
  flags.server.start = start;
  HMOE_ASSIGN_OR_RETURN(std::unique_ptr<rpc::WorkerServer> server,
                        rpc::WorkerServer::Start(flags.server, &service, [sched, &r] {
                          return PrefillLoadReport(*sched, r);
                        }));
  HMOE_LOG(INFO) << "SERVING on unix:" << flags.server.socket_path << " as "
                 << flags.server.worker_id << ": " << weights->description << ", device "
                 << device->name() << " (in use " << (device->bytes_in_use() >> 20)
                 << " MiB: kv pool, scratch, streaming budget "
                 << (r.weights().budget_bytes() >> 20) << " MiB, ring), experts ring "
                 << r.ring_slots_short() << " slots of " << r.weights().ring_slot_bytes()
                 << " bytes below " << r.turning_point_tokens() << " prompt tokens, 2 from there"
                 << ", prompts up to " << r.max_prompt_tokens() << " tokens in passes of "
                 << r.max_step_tokens() << ", kv export "
                 << (ro.export_kind == KvExportKind::kCudaIpc ? "cuda-ipc" : "shm") << " (timeout "
                 << flags.export_timeout << " s), ready in "
                 << absl::ToDoubleSeconds(absl::Now() - start) << " s";

  // --- drain on SIGTERM: finish what runs and is queued, give the router time to release the
  // exports, then free whatever is left.
  signals.WaitForStop();
  server->StopServing();
  scheduler->StopAccepting();
  const absl::Time drain_deadline = absl::Now() + absl::Seconds(flags.drain_seconds);
  if (!scheduler->WaitIdle(drain_deadline)) {
    HMOE_LOG(WARNING) << "drain time of " << flags.drain_seconds
                      << " s exceeded; cancelling prefills";
  }
  process::WaitUntil(drain_deadline, [&exports] { return exports->count() == 0; });
  scheduler->Shutdown();
  server->Shutdown();
  const PrefillSchedulerStats stats = scheduler->stats();
  const int64_t left = exports->count();
  exports.reset();  // frees exports nobody released
  HMOE_LOG(INFO) << "stopped: " << stats.prefills << " prefills (" << stats.prompt_tokens
                 << " prompt tokens, " << stats.cancelled << " cancelled, " << stats.failed
                 << " failed), " << left << " unreleased kv export(s) freed";
  return absl::OkStatus();
}

}  // namespace
}  // namespace hmoe::prefill

int main(int argc, char** argv) {
  return hmoe::process::RunDaemon(
      argc, argv,
      {.usage = "hmoe-prefill-worker (--model DIR | --weightd-instance NAME) --socket PATH "
                "[--device cpu|cuda:N] [--threads N] [--device-memory-mb MB] [--copy-gbps G] "
                "[--stream-budget-mb MB] [--ring-slots N] [--ring-turning-point TOKENS] "
                "[--max-prompt-tokens N] [--max-step-tokens N] [--kv-export auto|shm|cuda-ipc] "
                "[--export-timeout-seconds S] [--router ADDR] [--worker-id ID] "
                "[--dslp-ep-mode small_ep|standard] [--dslp-join-timeout-seconds S] "
                "[--dslp-peer-timeout-seconds S]"},
      hmoe::prefill::Run);
}
