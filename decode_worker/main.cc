// hmoe-decode-worker: continuous-batching decode (and chunked prefill) with CPU experts and
// attention on the CPU or a GPU, served on a unix socket. See docs/decode_worker.md.
//
//   hmoe-decode-worker (--model DIR | --weightd-instance NAME) --socket PATH
//                      [--device cpu|cuda:N] [--threads N] [--batch-size 6] [--chunk-size 512]
//                      [--dual-batch on|off|auto] [--kv-blocks N | --kv-memory-mb MB]
//                      [--prefix-cache-mb MB]
//                      [--router ADDR] [--worker-id ID] [--drain-seconds S]
//
// Exit codes: 0 after SIGTERM/SIGINT (drained), 1 on a start-up or runtime error, 2 on bad flags.

#include <unistd.h>

#include <memory>
#include <string>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"

#include "common/base/logging.h"
#include "common/base/status_macros.h"
#include "common/device/cpu_device.h"
#include "common/device/device.h"
#include "common/device/device_flag.h"
#include "common/kv_handoff/export_table.h"
#include "common/kv_handoff/kv_handoff.h"
#include "common/ops/cpu/cpu_worker_pool.h"
#include "common/process/daemon.h"
#include "common/process/socket_path.h"
#include "common/rpc/worker_server.h"
#include "common/shm/worker_weights.h"
#include "decode_worker/decode_service.h"
#include "decode_worker/flags.h"
#include "decode_worker/forward_pass_step_engine.h"
#include "decode_worker/scheduler.h"
#include "decode_worker/startup_settings.h"

namespace hmoe::decode {
namespace {

using process::FlagError;

absl::Status Run(process::StopSignalWatcher& signals) {
  const absl::Time start = absl::Now();
  WorkerFlags flags;
  HMOE_RETURN_IF_ERROR(ReadFlags(flags));
  const SchedulerOptions& sched_options = flags.scheduler;

  // --- weights, device, engine, scheduler
  HMOE_ASSIGN_OR_RETURN(worker::Resources res, worker::OpenResources(flags.common, {}, 0));
  const shm::WeightSourceHolder* weights = &res.weights;
  Device* device = res.device.get();
  CpuWorkerPool* pool = res.pool.get();
  absl::StatusOr<int64_t> kv_blocks = ResolveKvBlocks(
      flags.kv_blocks, flags.kv_memory_mb, KvBlockBytes(weights->config, flags.block_tokens));
  HMOE_RETURN_IF_ERROR(FlagError(kv_blocks.status()));
  ForwardPassStepEngineOptions engine_options;
  engine_options.max_step_tokens = sched_options.chunk_size + sched_options.batch_size;
  engine_options.max_step_sequences = sched_options.batch_size;
  engine_options.kv_blocks = *kv_blocks;
  engine_options.kv_block_tokens = flags.block_tokens;
  absl::StatusOr<int64_t> prefix_blocks = ResolvePrefixCacheBlocks(
      flags.prefix_cache_mb, *kv_blocks, KvBlockBytes(weights->config, flags.block_tokens));
  HMOE_RETURN_IF_ERROR(FlagError(prefix_blocks.status()));
  engine_options.prefix_cache_blocks = *prefix_blocks;
  absl::StatusOr<std::unique_ptr<ForwardPassStepEngine>> engine = ForwardPassStepEngine::Create(
      weights->config, weights->source(), *device, *pool, engine_options);
  if (!engine.ok()) return Annotate(engine.status(), "engine");
  absl::StatusOr<std::unique_ptr<Scheduler>> scheduler = Scheduler::Create(**engine, sched_options);
  if (!scheduler.ok()) {
    absl::Status s = Annotate(scheduler.status(), "scheduler");
    return absl::IsInvalidArgument(s) ? FlagError(s) : s;
  }
  // Shared-memory hand-offs, and CUDA IPC ones (into the attention GPU's pool, or through host
  // memory when attention runs on the CPU).
  KvImportTarget import_target;
  if (flags.common.device.kind == DeviceKind::kCuda)
    import_target.cuda_device = flags.common.device.ordinal;
  std::unique_ptr<KvImporter> importer = NewKvImporter(import_target);
  if (signals.StopRequested()) {
    HMOE_LOG(INFO) << "stopped while starting";
    return absl::OkStatus();
  }

  // Prefixes exported to prefill workers (ExportPrefix), named <prefix><pid>-<n>; those of a
  // process that is gone (a previous incarnation that crashed) are stale.
  const std::string export_base = KvExportNamePrefix("kvp", flags.common.server.worker_id);
  const std::string prefix_export_prefix = absl::StrCat(export_base, ::getpid(), "-");
  if (absl::StatusOr<int> stale = RemoveShmExportsOfDeadProcesses(export_base); !stale.ok()) {
    HMOE_LOG(WARNING) << "removing stale prefix exports: " << stale.status();
  } else if (*stale > 0) {
    HMOE_LOG(INFO) << "removed " << *stale << " stale prefix export(s) of a previous run";
  }
  std::unique_ptr<ExportTable> prefix_exports;
  if (*prefix_blocks > 0) {
    prefix_exports =
        std::make_unique<ExportTable>(absl::Seconds(flags.prefix_export_timeout_seconds));
  }

  // --- serve, register
  DecodeServiceImpl service(
      scheduler->get(), engine->get(), importer.get(),
      DecodeServiceInfo{flags.common.server.worker_id, (*engine)->device_name(),
                        prefix_export_prefix, prefix_exports.get()});
  Scheduler* sched = scheduler->get();
  flags.common.server.device = (*engine)->device_name();
  flags.common.server.model = weights->description;
  flags.common.server.start = start;
  HMOE_ASSIGN_OR_RETURN(std::unique_ptr<rpc::WorkerServer> server,
                        rpc::WorkerServer::Start(flags.common.server, &service,
                                                 [sched] { return SchedulerLoadReport(*sched); }));
  HMOE_LOG(INFO) << "SERVING on unix:" << flags.common.server.socket_path << " as "
                 << flags.common.server.worker_id << ": " << weights->description << ", device "
                 << (*engine)->device_name() << ", " << pool->num_threads()
                 << " cpu threads, batch " << sched_options.batch_size << ", chunk "
                 << sched_options.chunk_size << " (" << sched_options.prefills_per_step
                 << " prefill(s) per step, packing " << PackingPolicyName(sched_options.packing)
                 << "), dual batch " << (sched_options.dual_batch ? "on" : "off") << ", kv "
                 << *kv_blocks << " blocks of " << flags.block_tokens << " tokens (prefix cache "
                 << *prefix_blocks << " of them), ready in "
                 << absl::ToDoubleSeconds(absl::Now() - start) << " s";

  // --- drain on SIGTERM
  signals.WaitForStop();
  server->StopServing();
  sched->StopAccepting();
  if (!sched->WaitIdle(absl::Now() + absl::Seconds(flags.common.drain_seconds))) {
    HMOE_LOG(WARNING) << "drain time of " << flags.common.drain_seconds
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
                "[--dual-batch on|off|auto] [--kv-blocks N | --kv-memory-mb MB] [--prefix-cache-mb "
                "MB] [--router ADDR] "
                "[--worker-id ID] [--drain-seconds S]"},
      hmoe::decode::Run);
}
