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

#include <sys/stat.h>
#include <unistd.h>

#include <chrono>
#include <memory>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include <grpcpp/grpcpp.h>
#include <grpcpp/health_check_service_interface.h>

#include "common/base/flags.h"
#include "common/base/logging.h"
#include "common/comm/shm_collective.h"
#include "common/device/cpu_device.h"
#include "common/device/cuda_host_register.h"
#include "common/device/device.h"
#include "common/dslp/dslp.h"
#include "common/model/model_config.h"
#include "common/ops/cpu/cpu_worker_pool.h"
#include "common/rpc/registry_client.h"
#include "common/rpc/worker_setup.h"
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

constexpr char kServiceName[] = "hmoe.prefill.v1.PrefillService";
constexpr int kExitError = 1;
constexpr int kExitBadFlags = 2;

// A hand-off name prefix from the worker id: [A-Za-z0-9_.-] kept, anything else '_'.
std::string ExportPrefix(const std::string& worker_id) {
  std::string id = worker_id;
  for (char& c : id) {
    const bool ok = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') ||
                    c == '_' || c == '-' || c == '.';
    if (!ok) c = '_';
  }
  return absl::StrCat("hmoe-kv-", id.substr(0, 150), "-");
}

int Run() {
  const absl::Time start = absl::Now();
  // --- flags
  absl::StatusOr<rpc::WorkerSourceFlags> source =
      rpc::CheckWorkerSourceFlags(absl::GetFlag(FLAGS_model), absl::GetFlag(FLAGS_weightd_instance),
                                  absl::GetFlag(FLAGS_socket), absl::GetFlag(FLAGS_device));
  if (!source.ok()) {
    HMOE_LOG(ERROR) << source.status().message();
    return kExitBadFlags;
  }
  const std::string& socket_path = source->socket_path;
  const rpc::DeviceSpec device_spec = source->device;
  const bool cuda = device_spec.kind == DeviceKind::kCuda;
  const std::string kv_export = absl::GetFlag(FLAGS_kv_export);
  KvExportKind export_kind = KvExportKind::kShm;
  if (kv_export == "cuda-ipc" || (kv_export == "auto" && cuda)) {
    export_kind = KvExportKind::kCudaIpc;
  } else if (kv_export != "shm" && kv_export != "auto") {
    HMOE_LOG(ERROR) << "--kv-export: \"" << kv_export << "\" is not auto, shm or cuda-ipc";
    return kExitBadFlags;
  }
  if (export_kind == KvExportKind::kCudaIpc && !cuda) {
    HMOE_LOG(ERROR) << "--kv-export cuda-ipc needs --device cuda:N";
    return kExitBadFlags;
  }
  const int threads = absl::GetFlag(FLAGS_threads);
  const int64_t device_memory_mb = absl::GetFlag(FLAGS_device_memory_mb);
  const double copy_gbps = absl::GetFlag(FLAGS_copy_gbps);
  const int64_t stream_budget_mb = absl::GetFlag(FLAGS_stream_budget_mb);
  const double export_timeout = absl::GetFlag(FLAGS_export_timeout_seconds);
  const double drain_seconds = absl::GetFlag(FLAGS_drain_seconds);
  const int heartbeat_ms = absl::GetFlag(FLAGS_heartbeat_ms);
  const int max_waiting = absl::GetFlag(FLAGS_max_waiting);
  absl::StatusOr<EpMode> ep_mode = ParseEpMode(absl::GetFlag(FLAGS_dslp_ep_mode));
  if (!ep_mode.ok()) {
    HMOE_LOG(ERROR) << "--dslp-ep-mode: " << ep_mode.status().message();
    return kExitBadFlags;
  }
  const double dslp_join_timeout = absl::GetFlag(FLAGS_dslp_join_timeout_seconds);
  const double dslp_peer_timeout = absl::GetFlag(FLAGS_dslp_peer_timeout_seconds);
  if (dslp_join_timeout <= 0 || dslp_peer_timeout <= 0) {
    HMOE_LOG(ERROR) << "--dslp-join-timeout-seconds and --dslp-peer-timeout-seconds must be > 0";
    return kExitBadFlags;
  }
  SlpRunnerOptions ro;
  ro.max_prompt_tokens = absl::GetFlag(FLAGS_max_prompt_tokens);
  ro.max_step_tokens = absl::GetFlag(FLAGS_max_step_tokens);
  ro.kv_block_tokens = absl::GetFlag(FLAGS_kv_block_tokens);
  ro.stream_budget_bytes = static_cast<size_t>(stream_budget_mb) << 20;
  ro.ring_slots_short = absl::GetFlag(FLAGS_ring_slots);
  ro.turning_point_tokens = absl::GetFlag(FLAGS_ring_turning_point);
  ro.device_flops = absl::GetFlag(FLAGS_device_tflops) * 1e12;
  ro.copy_bytes_per_second = cuda ? 0 : copy_gbps * 1e9;
  ro.export_kind = export_kind;
  if (threads < 0 || device_memory_mb < 0 || copy_gbps < 0 || stream_budget_mb < 0 ||
      ro.ring_slots_short < 0 || ro.turning_point_tokens < 0 || ro.device_flops < 0 ||
      ro.max_prompt_tokens < 0 || ro.max_step_tokens < 0 || ro.kv_block_tokens < 1 ||
      export_timeout <= 0 || drain_seconds < 0 || heartbeat_ms < 1 || max_waiting < 0) {
    HMOE_LOG(ERROR) << "numeric flags must not be negative; --kv-block-tokens, --heartbeat-ms "
                       "and --export-timeout-seconds must be > 0";
    return kExitBadFlags;
  }
  if (absl::Status s = rpc::PrepareSocketPath(socket_path); !s.ok()) {
    HMOE_LOG(ERROR) << s.message();
    return absl::IsInvalidArgument(s) ? kExitBadFlags : kExitError;
  }
  std::string worker_id = absl::GetFlag(FLAGS_worker_id);
  if (worker_id.empty()) worker_id = absl::StrCat("prefill-", ::getpid());

  // --- signals: taken by one thread with sigtimedwait; every other thread has them blocked.
  rpc::StopSignalWatcher signals;

  // --- exports left by a previous incarnation with this worker id
  const std::string export_prefix = ExportPrefix(worker_id);
  if (absl::StatusOr<int> stale = RemoveStaleShmExports(export_prefix); !stale.ok()) {
    HMOE_LOG(WARNING) << "stale kv exports: " << stale.status();
  } else if (*stale > 0) {
    HMOE_LOG(INFO) << "removed " << *stale << " stale kv export(s) " << export_prefix << "*";
  }

  // --- shared-memory DSLP groups whose ranks all died before the group formed
  if (absl::StatusOr<int> stale = RemoveStaleShmGroups(); !stale.ok()) {
    HMOE_LOG(WARNING) << "stale dslp groups: " << stale.status();
  }

  // --- weights, device, runner
  absl::StatusOr<shm::WeightSourceHolder> weights =
      shm::OpenWeights(source->model_dir, source->instance);
  if (!weights.ok()) {
    HMOE_LOG(ERROR) << "open weights: " << weights.status().message();
    return kExitError;
  }
  CpuWorkerPoolOptions pool_options;
  pool_options.threads_per_node = threads;
  pool_options.pin_threads = absl::GetFlag(FLAGS_pin_threads);
  absl::StatusOr<std::unique_ptr<CpuWorkerPool>> pool = CpuWorkerPool::Create(pool_options);
  if (!pool.ok()) {
    HMOE_LOG(ERROR) << "cpu worker pool: " << pool.status().message();
    return kExitError;
  }
  const size_t budget = static_cast<size_t>(device_memory_mb) << 20;
  CpuDeviceOptions cpu_options;
  cpu_options.pool = pool->get();
  cpu_options.budget_bytes = budget;
  cpu_options.copy_bytes_per_second = copy_gbps * 1e9;
  absl::StatusOr<std::unique_ptr<Device>> new_device =
      rpc::NewWorkerDevice(device_spec, cpu_options, budget);
  if (!new_device.ok()) {
    HMOE_LOG(ERROR) << new_device.status().message();
    return kExitError;
  }
  std::unique_ptr<Device> device = *std::move(new_device);
  std::vector<ScopedHostRegister> registered;
  if (cuda) {
    // H2D copies read weightd's mapping directly: page-lock it read-only once, so every copy is
    // an asynchronous DMA at full PCIe speed with no staging copy.
    if (weights->store != nullptr) {
      for (const shm::WeightStore::Segment& segment : weights->store->segments()) {
        absl::StatusOr<ScopedHostRegister> r =
            ScopedHostRegister::Create(segment.bytes.data(), segment.bytes.size(), true);
        if (!r.ok()) {
          HMOE_LOG(WARNING) << "cudaHostRegister of a weightd segment (" << segment.bytes.size()
                            << " bytes): " << r.status() << "; its copies will be staged";
          continue;
        }
        registered.push_back(*std::move(r));
      }
    } else {
      HMOE_LOG(WARNING) << "--model on a GPU: weight copies read pageable memory (staged); "
                           "serve from hmoe-weightd for full-speed streaming";
    }
  }
  absl::StatusOr<std::unique_ptr<SlpRunner>> runner =
      SlpRunner::Create(weights->config, weights->source(), *device, **pool, ro);
  if (!runner.ok()) {
    HMOE_LOG(ERROR) << "prefill engine: " << runner.status().message();
    return absl::IsInvalidArgument(runner.status()) ? kExitBadFlags : kExitError;
  }
  auto exports = std::make_unique<ExportTable>(absl::Seconds(export_timeout));
  PrefillSchedulerOptions so;
  so.max_waiting = max_waiting;
  so.export_prefix = export_prefix;
  so.dslp_ep_mode = *ep_mode;
  so.dslp_join.join_timeout = absl::Seconds(dslp_join_timeout);
  so.dslp_join.peer_timeout = absl::Seconds(dslp_peer_timeout);
  so.dslp_join.cuda_ordinal = cuda ? device_spec.ordinal : 0;
  auto scheduler = std::make_unique<PrefillScheduler>(runner->get(), exports.get(), so);
  if (signals.StopRequested()) {
    HMOE_LOG(INFO) << "stopped while starting";
    return 0;
  }

  // --- gRPC
  PrefillServiceImpl service(scheduler.get(), exports.get(), runner->get(),
                             PrefillServiceInfo{worker_id, device->name()});
  absl::StatusOr<std::unique_ptr<grpc::Server>> serving =
      rpc::ServeOnUnixSocket(socket_path, &service, kServiceName);
  if (!serving.ok()) {
    HMOE_LOG(ERROR) << serving.status().message();
    return kExitError;
  }
  grpc::Server* server = serving->get();
  const SlpRunner& r = **runner;
  HMOE_LOG(INFO) << "SERVING on unix:" << socket_path << " as " << worker_id << ": "
                 << weights->description << ", device " << device->name() << " (in use "
                 << (device->bytes_in_use() >> 20) << " MiB: kv pool, scratch, streaming budget "
                 << (r.weights().budget_bytes() >> 20) << " MiB, ring), experts ring "
                 << r.ring_slots_short() << " slots of " << r.weights().ring_slot_bytes()
                 << " bytes below " << r.turning_point_tokens() << " prompt tokens, 2 from there"
                 << ", prompts up to " << r.max_prompt_tokens() << " tokens in passes of "
                 << r.max_step_tokens() << ", kv export "
                 << (export_kind == KvExportKind::kCudaIpc ? "cuda-ipc" : "shm") << " (timeout "
                 << export_timeout << " s), ready in " << absl::ToDoubleSeconds(absl::Now() - start)
                 << " s";

  std::unique_ptr<rpc::RegistryClient> registry;
  const std::string router = absl::GetFlag(FLAGS_router);
  if (!router.empty()) {
    rpc::RegistryClientOptions reg;
    reg.kind = rpc::WorkerKind::kPrefill;
    reg.router_target = router;
    reg.worker_id = worker_id;
    reg.endpoint = "unix:" + socket_path;
    reg.device = device->name();
    reg.model = weights->description;
    reg.pid = ::getpid();
    reg.start_unix_ms = absl::ToUnixMillis(start);
    reg.heartbeat_interval = absl::Milliseconds(heartbeat_ms);
    PrefillScheduler* sched = scheduler.get();
    const SlpRunner* run = runner->get();
    registry = std::make_unique<rpc::RegistryClient>(reg, [sched, run, max_waiting] {
      const PrefillSchedulerStats s = sched->stats();
      rpc::WorkerLoadReport load;
      load.draining = s.draining;
      load.running = s.busy ? 1 : 0;
      load.waiting = s.waiting;
      load.batch_size = 1;
      load.max_waiting = max_waiting;  // The router's prefill queue follows it.
      load.kv_blocks_free = run->kv_blocks_free();
      load.kv_blocks_total = run->kv_blocks_total();
      return load;
    });
  } else {
    HMOE_LOG(INFO) << "no --router: not registering with a router";
  }

  // --- drain on SIGTERM: finish what runs and is queued, give the router time to release the
  // exports, then free whatever is left.
  signals.WaitForStop();
  rpc::SetServing(*server, kServiceName, false);
  scheduler->StopAccepting();
  const absl::Time drain_deadline = absl::Now() + absl::Seconds(drain_seconds);
  if (!scheduler->WaitIdle(drain_deadline)) {
    HMOE_LOG(WARNING) << "drain time of " << drain_seconds << " s exceeded; cancelling prefills";
  }
  while (exports->count() > 0 && absl::Now() < drain_deadline) {
    absl::SleepFor(absl::Milliseconds(20));
  }
  scheduler->Shutdown();
  server->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(5));
  if (registry != nullptr) registry->Stop();
  ::unlink(socket_path.c_str());
  const PrefillSchedulerStats stats = scheduler->stats();
  const int64_t left = exports->count();
  exports.reset();  // frees exports nobody released
  HMOE_LOG(INFO) << "stopped: " << stats.prefills << " prefills (" << stats.prompt_tokens
                 << " prompt tokens, " << stats.cancelled << " cancelled, " << stats.failed
                 << " failed), " << left << " unreleased kv export(s) freed";
  return 0;
}

}  // namespace
}  // namespace hmoe::prefill

int main(int argc, char** argv) {
  std::vector<std::string> storage;
  std::vector<char*> args = hmoe::NormalizeFlagNames(argc, argv, storage);
  hmoe::SetUsage(
      "hmoe-prefill-worker (--model DIR | --weightd-instance NAME) --socket PATH [--device "
      "cpu|cuda:N] [--threads N] [--device-memory-mb MB] [--copy-gbps G] [--stream-budget-mb MB] "
      "[--ring-slots N] [--ring-turning-point TOKENS] [--max-prompt-tokens N] "
      "[--max-step-tokens N] [--kv-export auto|shm|cuda-ipc] [--export-timeout-seconds S] "
      "[--router ADDR] [--worker-id ID] [--dslp-ep-mode small_ep|standard] "
      "[--dslp-join-timeout-seconds S] [--dslp-peer-timeout-seconds S]");
  std::vector<char*> positional =
      absl::ParseCommandLine(static_cast<int>(args.size()), args.data());
  if (positional.size() > 1) {
    HMOE_LOG(ERROR) << "unexpected argument \"" << positional[1] << "\"";
    return 2;
  }
  return hmoe::prefill::Run();
}
