#include "decode_worker/flags.h"

#include "absl/flags/flag.h"
#include "absl/strings/str_cat.h"
#include "absl/time/time.h"

#include "common/base/status_macros.h"
#include "common/process/daemon.h"
#include "decode_worker/startup_settings.h"

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
ABSL_FLAG(int64_t, prefix_cache_mb, -1,
          "prefix cache: MiB of the KV pool that finished requests' KV may keep for reuse by "
          "later prompts with the same prefix (-1: the whole pool; 0: off). Cached blocks give "
          "way to new requests whenever the pool runs short");
ABSL_FLAG(double, prefix_export_timeout_seconds, 60,
          "a prefix exported to a prefill worker (ExportPrefix) that nobody releases within this "
          "many seconds is freed");

namespace hmoe::decode {

using process::FlagError;

absl::Status ReadFlags(WorkerFlags& f) {
  SchedulerOptions& sched = f.scheduler;
  HMOE_RETURN_IF_ERROR(
      worker::ReadCommonFlags(rpc::WorkerKind::kDecode, "hmoe.decode.v1.DecodeService", f.common));
  absl::StatusOr<bool> dual =
      ResolveDualBatch(absl::GetFlag(FLAGS_dual_batch), f.common.device.kind);
  HMOE_RETURN_IF_ERROR(FlagError(dual.status()));
  absl::StatusOr<PackingPolicy> packing = ParsePackingPolicy(absl::GetFlag(FLAGS_prefill_packing));
  HMOE_RETURN_IF_ERROR(FlagError(Annotate(packing.status(), "--prefill-packing")));
  sched.batch_size = absl::GetFlag(FLAGS_batch_size);
  sched.chunk_size = absl::GetFlag(FLAGS_chunk_size);
  sched.prefills_per_step = absl::GetFlag(FLAGS_prefills_per_step);
  sched.packing = *packing;
  sched.max_waiting = absl::GetFlag(FLAGS_max_waiting);
  sched.dual_batch = *dual;
  f.block_tokens = absl::GetFlag(FLAGS_kv_block_tokens);
  if (sched.batch_size < 1 || sched.chunk_size < 1 || sched.prefills_per_step < 1 ||
      sched.max_waiting < 0 || f.block_tokens < 1) {
    return FlagError(
        "--batch-size, --chunk-size, --prefills-per-step and --kv-block-tokens must be >= 1; "
        "--max-waiting >= 0");
  }
  f.kv_memory_mb = absl::GetFlag(FLAGS_kv_memory_mb);
  f.kv_blocks = absl::GetFlag(FLAGS_kv_blocks);
  f.prefix_cache_mb = absl::GetFlag(FLAGS_prefix_cache_mb);
  if (f.kv_blocks == 0 && f.kv_memory_mb == 0) f.kv_memory_mb = 1024;
  f.prefix_export_timeout_seconds = absl::GetFlag(FLAGS_prefix_export_timeout_seconds);
  if (!(f.prefix_export_timeout_seconds > 0)) {
    return FlagError("--prefix-export-timeout-seconds must be > 0");
  }
  return worker::PrepareSocket(f.common);
}

}  // namespace hmoe::decode
