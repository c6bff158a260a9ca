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

#include "absl/time/clock.h"
#include "absl/time/time.h"

#include "common/base/logging.h"
#include "common/base/status_macros.h"
#include "common/comm/shm_collective.h"
#include "common/device/cpu_device.h"
#include "common/device/device.h"
#include "common/device/device_flag.h"
#include "common/dslp/dslp.h"
#include "common/ops/cpu/cpu_worker_pool.h"
#include "common/process/daemon.h"
#include "common/process/socket_path.h"
#include "common/rpc/worker_server.h"
#include "common/shm/worker_weights.h"
#include "common/worker/worker_flags.h"
#include "prefill_worker/flags.h"
#include "prefill_worker/kv_exports.h"
#include "prefill_worker/prefill_scheduler.h"
#include "prefill_worker/prefill_service.h"
#include "prefill_worker/slp_runner.h"

namespace hmoe::prefill {
namespace {

using process::FlagError;

absl::Status Run(process::StopSignalWatcher& signals) {
  const absl::Time start = absl::Now();
  WorkerFlags flags;
  HMOE_RETURN_IF_ERROR(ReadFlags(flags));
  const SlpRunnerOptions& ro = flags.runner;
  const PrefillSchedulerOptions& so = flags.scheduler;

  // --- exports left by a previous incarnation with this worker id (its process is gone), and
  // shared-memory DSLP groups whose ranks all died before the group formed
  const std::string stale_prefix = ExportPrefix(flags.common.server.worker_id);
  if (absl::StatusOr<int> stale = RemoveShmExportsOfDeadProcesses(stale_prefix); !stale.ok()) {
    HMOE_LOG(WARNING) << "stale kv exports: " << stale.status();
  } else if (*stale > 0) {
    HMOE_LOG(INFO) << "removed " << *stale << " stale kv export(s) " << stale_prefix << "*";
  }
  if (absl::StatusOr<int> stale = RemoveStaleShmGroups(); !stale.ok()) {
    HMOE_LOG(WARNING) << "stale dslp groups: " << stale.status();
  }

  // --- weights, device, runner, scheduler
  CpuDeviceOptions cpu_options;
  cpu_options.budget_bytes = flags.budget_bytes;
  cpu_options.copy_bytes_per_second = flags.copy_gbps * 1e9;
  HMOE_ASSIGN_OR_RETURN(worker::Resources res,
                        worker::OpenResources(flags.common, cpu_options, flags.budget_bytes));
  const shm::WeightSourceHolder* weights = &res.weights;
  Device* device = res.device.get();
  std::vector<ScopedHostRegister> registered;
  if (flags.common.device.kind == DeviceKind::kCuda) registered = worker::PageLockWeights(*weights);
  absl::StatusOr<std::unique_ptr<SlpRunner>> runner =
      SlpRunner::Create(weights->config, weights->source(), *device, *res.pool, ro);
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
                             PrefillServiceInfo{flags.common.server.worker_id, device->name()});
  const SlpRunner& r = **runner;
  PrefillScheduler* sched = scheduler.get();
  flags.common.server.device = device->name();
  flags.common.server.model = weights->description;
  flags.common.server.start = start;
  HMOE_ASSIGN_OR_RETURN(std::unique_ptr<rpc::WorkerServer> server,
                        rpc::WorkerServer::Start(flags.common.server, &service, [sched, &r] {
                          return PrefillLoadReport(*sched, r);
                        }));
  HMOE_LOG(INFO) << "SERVING on unix:" << flags.common.server.socket_path << " as "
                 << flags.common.server.worker_id << ": " << weights->description << ", device "
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
  const absl::Time drain_deadline = absl::Now() + absl::Seconds(flags.common.drain_seconds);
  if (!scheduler->WaitIdle(drain_deadline)) {
    HMOE_LOG(WARNING) << "drain time of " << flags.common.drain_seconds
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
