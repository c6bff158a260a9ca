// hmoe-decode-worker: continuous-batching decode (and chunked prefill) with CPU experts and
// attention on the CPU or a GPU, served on a unix socket. See docs/decode_worker.md.
//
//   hmoe-decode-worker (--model DIR | --weightd-instance NAME) --socket PATH
//                      [--device cpu|cuda:N] [--threads N] [--batch-size 6] [--chunk-size 512]
//                      [--dual-batch on|off|auto] [--kv-blocks N | --kv-memory-mb MB]
//                      [--router ADDR] [--worker-id ID] [--drain-seconds S]
//
// Exit codes: 0 after SIGTERM/SIGINT (drained), 1 on a start-up or runtime error, 2 on bad flags.

#include <unistd.h>

#include <memory>
#include <string>

#include "absl/flags/flag.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"

#include "common/base/logging.h"
#include "common/base/status_macros.h"
#include "common/device/cpu_device.h"
#include "common/device/device.h"
#include "common/device/device_flag.h"
#include "common/kv_handoff/kv_handoff.h"
#include "common/ops/cpu/cpu_worker_pool.h"
#include "common/process/daemon.h"
#include "common/process/socket_path.h"
#include "common/rpc/worker_server.h"
#include "common/shm/worker_weights.h"
#include "decode_worker/decode_service.h"
#include "decode_worker/forward_pass_step_engine.h"
#include "decode_worker/scheduler.h"
#include "decode_worker/startup_settings.h"

ABSL_FLAG(std::string, model, "", "checkpoint directory, opened directly (tests, CPU-only use)");
ABSL_FLAG(std::string, weightd_instance, "", "attach to this hmoe-weightd instance's weights");
ABSL_FLAG(std::string, socket, "", "unix socket to serve on (its directory must be 0700)");
ABSL_FLAG(std::string, device, "cpu", "attention device: cpu or cuda:N");
ABSL_FLAG(int, threads, 0, "CPU threads per NUMA node for experts and CPU attention (0: all)");
ABSL_FLAG(bool, pin_threads, true, "pin CPU worker threads to cores");
ABSL_FLAG(int, batch_size, 6, "target running batch size Y");
ABSL_FLAG(int, chunk_size, 512, "prompt tokens per chunked-prefill step");
ABSL_FLAG(int, prefills_per_step, 6,
          "prefill chunks (of different requests) a step may carry, within --chunk-size tokens; "
          "1: one chunk per step");
ABSL_FLAG(std::string, prefill_packing, "auto",
          "whether a prefill chunk beyond a step's first joins it: auto (when the cost model "
          "fitted to this worker's steps says it lowers latency) or always (whenever it fits)");
ABSL_FLAG(std::string, dual_batch, "auto",
          "dual-batch attention/MoE overlap: on, off, or auto (on with a GPU attention device)");
ABSL_FLAG(int, max_waiting, 64, "admitted requests that may wait; RESOURCE_EXHAUSTED beyond");
ABSL_FLAG(int64_t, kv_blocks, 0, "KV cache blocks (exclusive with --kv-memory-mb)");
ABSL_FLAG(int64_t, kv_memory_mb, 0, "KV cache memory in MiB (default 1024 without --kv-blocks)");
ABSL_FLAG(int, kv_block_tokens, 64, "tokens per KV block");
ABSL_FLAG(std::string, router, "", "router registry address; empty: run without a router");
ABSL_FLAG(std::string, worker_id, "", "worker id for the router and logs (default decode-<pid>)");
ABSL_FLAG(int, heartbeat_ms, 1000, "heartbeat period to the router");
ABSL_FLAG(double, drain_seconds, 30, "on SIGTERM, how long in-flight requests may finish");

namespace hmoe::decode {
namespace {

using process::FlagError;

// The flags that are not the scheduler's, checked.
struct Flags {
  DeviceSpec device;
  int threads = 0;
  int block_tokens = 0;
  int64_t kv_blocks = 0;
  int64_t kv_memory_mb = 0;
  double drain_seconds = 0;
  rpc::WorkerServerOptions server;  // all but device, model and start
};

absl::Status ReadFlags(Flags& f, SchedulerOptions& sched) {
  HMOE_RETURN_IF_ERROR(FlagError(shm::CheckWeightSourceFlags(
      absl::GetFlag(FLAGS_model), absl::GetFlag(FLAGS_weightd_instance))));
  absl::StatusOr<DeviceSpec> device = ParseDeviceFlag(absl::GetFlag(FLAGS_device));
  HMOE_RETURN_IF_ERROR(FlagError(device.status()));
  f.device = *device;
  absl::StatusOr<bool> dual = ResolveDualBatch(absl::GetFlag(FLAGS_dual_batch), f.device.kind);
  HMOE_RETURN_IF_ERROR(FlagError(dual.status()));
  absl::StatusOr<PackingPolicy> packing = ParsePackingPolicy(absl::GetFlag(FLAGS_prefill_packing));
  HMOE_RETURN_IF_ERROR(FlagError(Annotate(packing.status(), "--prefill-packing")));
  sched.batch_size = absl::GetFlag(FLAGS_batch_size);
  sched.chunk_size = absl::GetFlag(FLAGS_chunk_size);
  sched.prefills_per_step = absl::GetFlag(FLAGS_prefills_per_step);
  sched.packing = *packing;
  sched.max_waiting = absl::GetFlag(FLAGS_max_waiting);
  sched.dual_batch = *dual;
  f.threads = absl::GetFlag(FLAGS_threads);
  f.block_tokens = absl::GetFlag(FLAGS_kv_block_tokens);
  f.drain_seconds = absl::GetFlag(FLAGS_drain_seconds);
  const int heartbeat_ms = absl::GetFlag(FLAGS_heartbeat_ms);
  if (sched.batch_size < 1 || sched.chunk_size < 1 || sched.prefills_per_step < 1 ||
      sched.max_waiting < 0 || f.threads < 0 || f.block_tokens < 1 || f.drain_seconds < 0 ||
      heartbeat_ms < 1) {
    return FlagError(
        "--batch-size, --chunk-size, --prefills-per-step, --kv-block-tokens and --heartbeat-ms "
        "must be >= 1; --max-waiting, --threads and --drain-seconds >= 0");
  }
  f.kv_memory_mb = absl::GetFlag(FLAGS_kv_memory_mb);
  f.kv_blocks = absl::GetFlag(FLAGS_kv_blocks);
  if (f.kv_blocks == 0 && f.kv_memory_mb == 0) f.kv_memory_mb = 1024;
  f.server.service_name = "hmoe.decode.v1.DecodeService";
  f.server.socket_path = absl::GetFlag(FLAGS_socket);
  f.server.kind = rpc::WorkerKind::kDecode;
  f.server.router = absl::GetFlag(FLAGS_router);
  f.server.worker_id = absl::GetFlag(FLAGS_worker_id);
  f.server.heartbeat_interval = absl::Milliseconds(heartbeat_ms);
  if (f.server.worker_id.empty()) f.server.worker_id = absl::StrCat("decode-", ::getpid());
  return process::PrepareSocketPath("--socket", f.server.socket_path);
}

absl::Status Run(process::StopSignalWatcher& signals) {
  const absl::Time start = absl::Now();
  Flags flags;
  SchedulerOptions sched_options;
  HMOE_RETURN_IF_ERROR(ReadFlags(flags, sched_options));

  // --- weights, device, engine, scheduler
  absl::StatusOr<shm::WeightSourceHolder> weights =
      shm::OpenWeights(absl::GetFlag(FLAGS_model), absl::GetFlag(FLAGS_weightd_instance));
  if (!weights.ok()) return Annotate(weights.status(), "open weights");
  absl::StatusOr<std::unique_ptr<CpuWorkerPool>> pool = CpuWorkerPool::Create(
      {.threads_per_node = flags.threads, .pin_threads = absl::GetFlag(FLAGS_pin_threads)});
  if (!pool.ok()) return Annotate(pool.status(), "cpu worker pool");
  HMOE_ASSIGN_OR_RETURN(std::unique_ptr<Device> device,
                        NewDeviceFromSpec(flags.device, {.pool = pool->get()}, 0));
  absl::StatusOr<int64_t> kv_blocks = ResolveKvBlocks(
      flags.kv_blocks, flags.kv_memory_mb, KvBlockBytes(weights->config, flags.block_tokens));
  HMOE_RETURN_IF_ERROR(FlagError(kv_blocks.status()));
  ForwardPassStepEngineOptions engine_options;
  engine_options.max_step_tokens = sched_options.chunk_size + sched_options.batch_size;
  engine_options.max_step_sequences = sched_options.batch_size;
  engine_options.kv_blocks = *kv_blocks;
  engine_options.kv_block_tokens = flags.block_tokens;
  absl::StatusOr<std::unique_ptr<ForwardPassStepEngine>> engine = ForwardPassStepEngine::Create(
      weights->config, weights->source(), *device, **pool, engine_options);
  if (!engine.ok()) return Annotate(engine.status(), "engine");
  absl::StatusOr<std::unique_ptr<Scheduler>> scheduler = Scheduler::Create(**engine, sched_options);
  if (!scheduler.ok()) {
    absl::Status s = Annotate(scheduler.status(), "scheduler");
    return absl::IsInvalidArgument(s) ? FlagError(s) : s;
  }
  // Shared-memory hand-offs, and CUDA IPC ones (into the attention GPU's pool, or through host
  // memory when attention runs on the CPU).
  KvImportTarget import_target;
  if (flags.device.kind == DeviceKind::kCuda) import_target.cuda_device = flags.device.ordinal;
  std::unique_ptr<KvImporter> importer = NewKvImporter(import_target);
  if (signals.StopRequested()) {
    HMOE_LOG(INFO) << "stopped while starting";
    return absl::OkStatus();
  }

  // --- serve, register
  DecodeServiceImpl service(scheduler->get(), engine->get(), importer.get(),
                            DecodeServiceInfo{flags.server.worker_id, (*engine)->device_name()});
  Scheduler* sched = scheduler->get();
  flags.server.device = (*engine)->device_name();
  flags.server.model = weights->description;
  flags.server.start = start;
  HMOE_ASSIGN_OR_RETURN(std::unique_ptr<rpc::WorkerServer> server,
                        rpc::WorkerServer::Start(flags.server, &service,
                                                 [sched] { return SchedulerLoadReport(*sched); }));
  HMOE_LOG(INFO) << "SERVING on unix:" << flags.server.socket_path << " as "
                 << flags.server.worker_id << ": " << weights->description << ", device "
                 << (*engine)->device_name() << ", " << (*pool)->num_threads()
                 << " cpu threads, batch " << sched_options.batch_size << ", chunk "
                 << sched_options.chunk_size << " (" << sched_options.prefills_per_step
                 << " prefill(s) per step, packing " << PackingPolicyName(sched_options.packing)
                 << "), dual batch " << (sched_options.dual_batch ? "on" : "off") << ", kv "
                 << *kv_blocks << " blocks of " << flags.block_tokens << " tokens, ready in "
                 << absl::ToDoubleSeconds(absl::Now() - start) << " s";

  // --- drain on SIGTERM
  signals.WaitForStop();
  server->StopServing();
  sched->StopAccepting();
  if (!sched->WaitIdle(absl::Now() + absl::Seconds(flags.drain_seconds))) {
    HMOE_LOG(WARNING) << "drain time of " << flags.drain_seconds
                      << " s exceeded; cancelling in-flight requests";
  }
  sched->Shutdown();  // Cancels what is left; handlers then send their last message.
  server->Shutdown();
  const SchedulerStats stats = sched->stats();
  HMOE_LOG(INFO) << "stopped: " << stats.requests_finished << " requests ("
                 << stats.requests_cancelled << " cancelled, " << stats.requests_failed
                 << " failed), " << stats.tokens_generated << " tokens in " << stats.steps
                 << " steps";
  return absl::OkStatus();
}

}  // namespace
}  // namespace hmoe::decode

int main(int argc, char** argv) {
  return hmoe::process::RunDaemon(
      argc, argv,
      {.usage = "hmoe-decode-worker (--model DIR | --weightd-instance NAME) --socket PATH "
                "[--device cpu|cuda:N] [--threads N] [--batch-size 6] [--chunk-size 512] "
                "[--prefills-per-step 6] [--prefill-packing auto|always] "
                "[--dual-batch on|off|auto] [--kv-blocks N | --kv-memory-mb MB] [--router ADDR] "
                "[--worker-id ID] [--drain-seconds S]"},
      hmoe::decode::Run);
}
