#pragma once

// hmoe-prefill-worker's flags (defined in flags.cc), read and checked, so that main.cc reads as the
// worker's life: start, serve, drain.

#include <cstddef>
#include <string>

#include "absl/status/status.h"

#include "common/worker/worker_flags.h"
#include "prefill_worker/prefill_scheduler.h"
#include "prefill_worker/slp_runner.h"

namespace hmoe::prefill {

struct WorkerFlags {
  worker::CommonFlags common;
  size_t budget_bytes = 0;
  double copy_gbps = 0;
  double export_timeout = 0;
  SlpRunnerOptions runner;
  PrefillSchedulerOptions scheduler;
};

// Reads and checks every flag (a process::FlagError names the bad one) and prepares the socket's
// folder (process::PrepareSocketPath).
absl::Status ReadFlags(WorkerFlags& f);

}  // namespace hmoe::prefill
