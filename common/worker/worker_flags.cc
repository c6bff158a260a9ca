#include "common/worker/worker_flags.h"

#include <unistd.h>

#include <utility>

#include "absl/flags/flag.h"
#include "absl/strings/str_cat.h"
#include "absl/time/time.h"

#include "common/base/logging.h"
#include "common/base/status_macros.h"
#include "common/process/daemon.h"
#include "common/process/socket_path.h"

ABSL_FLAG(std::string, model, "",
          "checkpoint directory or GGUF file (*.gguf), opened directly (tests, CPU-only use)");
ABSL_FLAG(std::string, weightd_instance, "", "attach to this hmoe-weightd instance's weights");
ABSL_FLAG(std::string, socket, "", "unix socket to serve on (its directory must be 0700)");
ABSL_FLAG(std::string, device, "cpu",
          "compute device (the decode worker's attention, the prefill worker's passes): cpu or "
          "cuda:N");
ABSL_FLAG(int, threads, 0,
          "CPU threads per NUMA node for the CPU ops: experts and CPU attention (0: all of the "
          "node)");
ABSL_FLAG(bool, pin_threads, true, "pin CPU worker threads to cores");
ABSL_FLAG(std::string, router, "", "router registry address; empty: run without a router");
ABSL_FLAG(std::string, worker_id, "",
          "worker id for the router and logs (default decode-<pid> or prefill-<pid>)");
ABSL_FLAG(int, heartbeat_ms, 1000, "heartbeat period to the router");
ABSL_FLAG(double, drain_seconds, 30,
          "on SIGTERM, how long in-flight requests (and, in a prefill worker, unreleased KV "
          "exports) may finish");

namespace hmoe::worker {

using process::FlagError;

absl::Status ReadCommonFlags(rpc::WorkerKind kind, const std::string& service_name,
                             CommonFlags& f) {
  f.model_dir = absl::GetFlag(FLAGS_model);
  f.instance = absl::GetFlag(FLAGS_weightd_instance);
  HMOE_RETURN_IF_ERROR(FlagError(shm::CheckWeightSourceFlags(f.model_dir, f.instance)));
  absl::StatusOr<DeviceSpec> device = ParseDeviceFlag(absl::GetFlag(FLAGS_device));
  HMOE_RETURN_IF_ERROR(FlagError(device.status()));
  f.device = *device;
  f.threads = absl::GetFlag(FLAGS_threads);
  f.pin_threads = absl::GetFlag(FLAGS_pin_threads);
  f.drain_seconds = absl::GetFlag(FLAGS_drain_seconds);
  const int heartbeat_ms = absl::GetFlag(FLAGS_heartbeat_ms);
  if (f.threads < 0 || f.drain_seconds < 0 || heartbeat_ms < 1) {
    return FlagError("--threads and --drain-seconds must be >= 0, --heartbeat-ms >= 1");
  }
  f.server.service_name = service_name;
  f.server.socket_path = absl::GetFlag(FLAGS_socket);
  f.server.kind = kind;
  f.server.router = absl::GetFlag(FLAGS_router);
  f.server.worker_id = absl::GetFlag(FLAGS_worker_id);
  if (f.server.worker_id.empty()) {
    f.server.worker_id =
        absl::StrCat(kind == rpc::WorkerKind::kDecode ? "decode-" : "prefill-", ::getpid());
  }
  f.server.heartbeat_interval = absl::Milliseconds(heartbeat_ms);
  return absl::OkStatus();
}

absl::Status PrepareSocket(const CommonFlags& f) {
  return process::PrepareSocketPath("--socket", f.server.socket_path);
}

absl::StatusOr<Resources> OpenResources(const CommonFlags& f, CpuDeviceOptions cpu,
                                        size_t cuda_budget_bytes) {
  Resources r;
  absl::StatusOr<shm::WeightSourceHolder> weights = shm::OpenWeights(f.model_dir, f.instance);
  if (!weights.ok()) return Annotate(weights.status(), "open weights");
  r.weights = *std::move(weights);
  CpuWorkerPoolOptions pool_options;
  pool_options.threads_per_node = f.threads;
  pool_options.pin_threads = f.pin_threads;
  absl::StatusOr<std::unique_ptr<CpuWorkerPool>> pool = CpuWorkerPool::Create(pool_options);
  if (!pool.ok()) return Annotate(pool.status(), "cpu worker pool");
  r.pool = *std::move(pool);
  cpu.pool = r.pool.get();
  HMOE_ASSIGN_OR_RETURN(r.device, NewDeviceFromSpec(f.device, cpu, cuda_budget_bytes));
  return r;
}

std::vector<ScopedHostRegister> PageLockWeights(const shm::WeightSourceHolder& weights) {
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

}  // namespace hmoe::worker
