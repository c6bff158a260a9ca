#pragma once

// hmoe-decode-worker's flags (defined in flags.cc), read and checked, so that main.cc reads as the
// worker's life: start, serve, drain.

#include <cstdint>
#include <string>

#include "absl/status/status.h"

#include "common/worker/worker_flags.h"
#include "decode_worker/scheduler.h"

namespace hmoe::decode {

struct WorkerFlags {
  worker::CommonFlags common;
  int block_tokens = 0;
  int64_t kv_blocks = 0;
  int64_t kv_memory_mb = 0;
  int64_t prefix_cache_mb = -1;
  double prefix_export_timeout_seconds = 60;
  SchedulerOptions scheduler;
};

// Reads and checks every flag (a process::FlagError names the bad one) and prepares the socket's
// folder (process::PrepareSocketPath).
absl::Status ReadFlags(WorkerFlags& f);

}  // namespace hmoe::decode
