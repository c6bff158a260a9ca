#pragma once

// Start-up helpers shared by the worker processes (hmoe-prefill-worker, hmoe-decode-worker):
// the flags every worker has (--model/--weightd-instance, --socket, --device), on/off flags, the
// owner-only unix socket directory, the worker's device, its gRPC server with the health
// service, and the SIGTERM/SIGINT watcher.

#include <signal.h>

#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/notification.h"

#include "common/device/cpu_device.h"
#include "common/device/device.h"

namespace grpc {
class Server;
class Service;
}  // namespace grpc

namespace hmoe::rpc {

struct DeviceSpec {
  DeviceKind kind = DeviceKind::kCpu;
  int ordinal = 0;  // kCuda
};

// "cpu" or "cuda:N" (N >= 0). InvalidArgument naming the flag otherwise.
absl::StatusOr<DeviceSpec> ParseDeviceFlag(const std::string& value);

// The flags every worker shares, checked: exactly one of --model DIR and --weightd-instance
// NAME, a --socket PATH, and --device (ParseDeviceFlag). InvalidArgument naming the flag.
struct WorkerSourceFlags {
  std::string model_dir;
  std::string instance;
  std::string socket_path;
  DeviceSpec device;
};
absl::StatusOr<WorkerSourceFlags> CheckWorkerSourceFlags(const std::string& model_dir,
                                                         const std::string& instance,
                                                         const std::string& socket_path,
                                                         const std::string& device_flag);

// The worker's compute device: a CpuDevice with `cpu` options, or the CUDA device `spec` names
// with a budget of `cuda_budget_bytes` (0: none). The CUDA error names the --device flag and
// suggests --device cpu.
absl::StatusOr<std::unique_ptr<Device>> NewWorkerDevice(const DeviceSpec& spec,
                                                        const CpuDeviceOptions& cpu,
                                                        size_t cuda_budget_bytes);

// Serves `service` on unix:`socket_path` (made 0600; PrepareSocketPath first) with gRPC's
// standard health service reporting SERVING for the server ("") and for `service_name`.
// Unavailable when the server cannot be started.
absl::StatusOr<std::unique_ptr<grpc::Server>> ServeOnUnixSocket(const std::string& socket_path,
                                                                grpc::Service* service,
                                                                const std::string& service_name);
// Sets the health status of the server ("") and of `service_name` (NOT_SERVING while draining).
void SetServing(grpc::Server& server, const std::string& service_name, bool serving);

// "on"/"off" (also true/false, 1/0). InvalidArgument naming `flag` otherwise.
absl::StatusOr<bool> ParseOnOff(const std::string& flag, const std::string& value);

// Makes sure the unix socket `path` can be served safely: absolute, short enough for
// sockaddr_un, its parent directory created 0700 when missing and otherwise owned by this user
// and not accessible to group/others (PermissionDenied: another user could swap the socket).
// Removes a stale socket file at `path`; FailedPrecondition when a running server accepts
// connections on it (ClaimUnixSocketPath). InvalidArgument for a bad path.
absl::Status PrepareSocketPath(const std::string& path);

// Takes SIGTERM and SIGINT for the process: the constructor blocks them in the calling thread
// (and so in every thread started from it afterwards: create it in main before any other thread)
// and ignores SIGPIPE; its own thread waits for them with sigtimedwait, logs "received signal
// ..., draining" and requests the stop. The destructor stops that thread (within 100 ms).
// Thread-safe.
class StopSignalWatcher {
 public:
  StopSignalWatcher();
  ~StopSignalWatcher();
  StopSignalWatcher(const StopSignalWatcher&) = delete;
  StopSignalWatcher& operator=(const StopSignalWatcher&) = delete;

  // Whether SIGTERM or SIGINT arrived.
  bool StopRequested() const { return stop_.HasBeenNotified(); }
  // Blocks until SIGTERM or SIGINT arrives.
  void WaitForStop() const { stop_.WaitForNotification(); }

 private:
  sigset_t signals_;
  absl::Notification stop_;
  std::jthread thread_;  // last: starts after everything above exists
};

}  // namespace hmoe::rpc
