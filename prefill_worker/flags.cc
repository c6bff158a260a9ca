#include "prefill_worker/flags.h"

#include <unistd.h>

#include "absl/flags/flag.h"
#include "absl/strings/str_cat.h"
#include "absl/time/time.h"

#include "common/base/status_macros.h"
#include "common/process/daemon.h"

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
ABSL_FLAG(std::string, dslp_ep_mode, "small_ep",
          "DSLP expert parallelism when the request does not name it: small_ep or standard");
ABSL_FLAG(double, dslp_join_timeout_seconds, 30,
          "DSLP: how long a rank waits for the rest of its group to join");
ABSL_FLAG(double, dslp_peer_timeout_seconds, 5,
          "DSLP: a peer rank silent this long (no heartbeat) is dead and fails the group");

namespace hmoe::prefill {

using process::FlagError;

absl::Status ReadFlags(WorkerFlags& f) {
  SlpRunnerOptions& ro = f.runner;
  PrefillSchedulerOptions& so = f.scheduler;
  HMOE_RETURN_IF_ERROR(worker::ReadCommonFlags(rpc::WorkerKind::kPrefill,
                                               "hmoe.prefill.v1.PrefillService", f.common));
  const bool cuda = f.common.device.kind == DeviceKind::kCuda;
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
  const int64_t device_memory_mb = absl::GetFlag(FLAGS_device_memory_mb);
  f.copy_gbps = absl::GetFlag(FLAGS_copy_gbps);
  const int64_t stream_budget_mb = absl::GetFlag(FLAGS_stream_budget_mb);
  f.export_timeout = absl::GetFlag(FLAGS_export_timeout_seconds);
  so.max_waiting = absl::GetFlag(FLAGS_max_waiting);
  ro.max_prompt_tokens = absl::GetFlag(FLAGS_max_prompt_tokens);
  ro.max_step_tokens = absl::GetFlag(FLAGS_max_step_tokens);
  ro.kv_block_tokens = absl::GetFlag(FLAGS_kv_block_tokens);
  ro.stream_budget_bytes = static_cast<size_t>(stream_budget_mb) << 20;
  ro.ring_slots_short = absl::GetFlag(FLAGS_ring_slots);
  ro.turning_point_tokens = absl::GetFlag(FLAGS_ring_turning_point);
  ro.device_flops = absl::GetFlag(FLAGS_device_tflops) * 1e12;
  ro.copy_bytes_per_second = cuda ? 0 : f.copy_gbps * 1e9;
  if (device_memory_mb < 0 || f.copy_gbps < 0 || stream_budget_mb < 0 || ro.ring_slots_short < 0 ||
      ro.turning_point_tokens < 0 || ro.device_flops < 0 || ro.max_prompt_tokens < 0 ||
      ro.max_step_tokens < 0 || ro.kv_block_tokens < 1 || f.export_timeout <= 0 ||
      so.max_waiting < 0) {
    return FlagError(
        "numeric flags must not be negative; --kv-block-tokens and "
        "--export-timeout-seconds must be > 0");
  }
  f.budget_bytes = static_cast<size_t>(device_memory_mb) << 20;
  // <hmoe-kv-<id>-><pid>-<n>: the pid tells a dead incarnation's segments from those of a live
  // process with the same worker id (another stack on this machine).
  so.export_prefix = absl::StrCat(ExportPrefix(f.common.server.worker_id), ::getpid(), "-");
  so.dslp_ep_mode = *ep_mode;
  so.dslp_join.join_timeout = absl::Seconds(join_timeout);
  so.dslp_join.peer_timeout = absl::Seconds(peer_timeout);
  so.dslp_join.cuda_ordinal = cuda ? f.common.device.ordinal : 0;
  return worker::PrepareSocket(f.common);
}

}  // namespace hmoe::prefill
