#pragma once

// What both worker processes share above the RPC: the flags every worker has, defined once
// (--model, --weightd-instance, --socket, --device, --threads, --pin-threads, --router,
// --worker-id, --heartbeat-ms, --drain-seconds), read and checked; and the weights, the CPU
// worker pool and the device every worker opens from them.

#include <cstddef>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

#include "common/device/cpu_device.h"
#include "common/device/cuda_host_register.h"
#include "common/device/device.h"
#include "common/device/device_flag.h"
#include "common/ops/cpu/cpu_worker_pool.h"
#include "common/rpc/worker_server.h"
#include "common/shm/worker_weights.h"

namespace hmoe::worker {

struct CommonFlags {
  std::string model_dir;  // --model, or
  std::string instance;   // --weightd-instance
  DeviceSpec device;
  int threads = 0;
  bool pin_threads = true;
  double drain_seconds = 0;
  rpc::WorkerServerOptions server;  // all but device, model and start
};

// Reads and checks the common flags (a process::FlagError names the bad one). `kind` and
// `service_name` go to `server`; the worker id defaults to "decode-<pid>" / "prefill-<pid>".
absl::Status ReadCommonFlags(rpc::WorkerKind kind, const std::string& service_name, CommonFlags& f);
// Prepares the socket's folder (process::PrepareSocketPath): after the worker's own flag checks.
absl::Status PrepareSocket(const CommonFlags& f);

// What a worker computes with.
struct Resources {
  shm::WeightSourceHolder weights;
  std::unique_ptr<CpuWorkerPool> pool;
  std::unique_ptr<Device> device;
};
// Opens the weights (--model or --weightd-instance), the CPU worker pool (--threads,
// --pin-threads) and the device (--device: a CpuDevice with `cpu` options over the pool, or the
// GPU with `cuda_budget_bytes`). Errors name what failed ("open weights: ...").
absl::StatusOr<Resources> OpenResources(const CommonFlags& f, CpuDeviceOptions cpu,
                                        size_t cuda_budget_bytes);

// H2D copies read weightd's mapping directly: page-locks each of its segments read-only once, so
// every copy is an asynchronous DMA at full PCIe speed with no staging copy. A segment that cannot
// be registered (or weights read from --model) only logs a warning: its copies are staged.
std::vector<ScopedHostRegister> PageLockWeights(const shm::WeightSourceHolder& weights);

}  // namespace hmoe::worker
