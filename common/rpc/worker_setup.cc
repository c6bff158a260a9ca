#include "common/rpc/worker_setup.h"

#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include <grpcpp/grpcpp.h>
#include <grpcpp/health_check_service_interface.h>

#include "common/base/logging.h"
#include "common/base/unix_socket.h"

namespace hmoe::rpc {
namespace {

// sockaddr_un.sun_path holds 108 bytes including the terminating NUL.
constexpr size_t kMaxSocketPathBytes = 107;

}  // namespace

absl::StatusOr<DeviceSpec> ParseDeviceFlag(const std::string& value) {
  if (value == "cpu") return DeviceSpec{DeviceKind::kCpu, 0};
  int ordinal = -1;
  if (absl::StartsWith(value, "cuda:") && absl::SimpleAtoi(value.substr(5), &ordinal) &&
      ordinal >= 0) {
    return DeviceSpec{DeviceKind::kCuda, ordinal};
  }
  return absl::InvalidArgumentError(absl::StrCat("--device: \"", value, "\" is not cpu or cuda:N"));
}

absl::StatusOr<WorkerSourceFlags> CheckWorkerSourceFlags(const std::string& model_dir,
                                                         const std::string& instance,
                                                         const std::string& socket_path,
                                                         const std::string& device_flag) {
  if (model_dir.empty() == instance.empty()) {
    return absl::InvalidArgumentError(
        "give exactly one of --model DIR and --weightd-instance NAME");
  }
  if (socket_path.empty()) return absl::InvalidArgumentError("--socket PATH is required");
  absl::StatusOr<DeviceSpec> device = ParseDeviceFlag(device_flag);
  if (!device.ok()) return device.status();
  return WorkerSourceFlags{model_dir, instance, socket_path, *device};
}

absl::StatusOr<std::unique_ptr<Device>> NewWorkerDevice(const DeviceSpec& spec,
                                                        const CpuDeviceOptions& cpu,
                                                        size_t cuda_budget_bytes) {
  if (spec.kind == DeviceKind::kCpu) return NewCpuDevice(cpu);
  absl::StatusOr<std::unique_ptr<Device>> cuda = NewCudaDevice(spec.ordinal, cuda_budget_bytes);
  if (!cuda.ok()) {
    return absl::Status(cuda.status().code(),
                        absl::StrCat("--device cuda:", spec.ordinal, ": ", cuda.status().message(),
                                     " (use --device cpu on a machine without a usable GPU)"));
  }
  return cuda;
}

absl::StatusOr<std::unique_ptr<grpc::Server>> ServeOnUnixSocket(const std::string& socket_path,
                                                                grpc::Service* service,
                                                                const std::string& service_name) {
  grpc::EnableDefaultHealthCheckService(true);
  grpc::ServerBuilder builder;
  builder.AddListeningPort("unix:" + socket_path, grpc::InsecureServerCredentials());
  builder.RegisterService(service);
  std::unique_ptr<grpc::Server> server = builder.BuildAndStart();
  if (server == nullptr) {
    return absl::UnavailableError(absl::StrCat("cannot serve gRPC on unix:", socket_path));
  }
  if (::chmod(socket_path.c_str(), 0600) != 0) {
    HMOE_LOG(WARNING) << "chmod 0600 " << socket_path << ": " << std::strerror(errno);
  }
  SetServing(*server, service_name, true);
  return server;
}

void SetServing(grpc::Server& server, const std::string& service_name, bool serving) {
  grpc::HealthCheckServiceInterface* health = server.GetHealthCheckService();
  if (health == nullptr) return;
  health->SetServingStatus(serving);
  health->SetServingStatus(service_name, serving);
}

absl::StatusOr<bool> ParseOnOff(const std::string& flag, const std::string& value) {
  if (value == "on" || value == "true" || value == "1") return true;
  if (value == "off" || value == "false" || value == "0") return false;
  return absl::InvalidArgumentError(absl::StrCat("--", flag, ": \"", value, "\" is not on or off"));
}

absl::Status PrepareSocketPath(const std::string& path) {
  if (path.empty() || path[0] != '/') {
    return absl::InvalidArgumentError(
        absl::StrCat("--socket: \"", path, "\" must be an absolute path"));
  }
  if (path.size() > kMaxSocketPathBytes) {
    return absl::InvalidArgumentError(absl::StrCat("--socket: ", path, " is ", path.size(),
                                                   " bytes; unix sockets allow at most ",
                                                   kMaxSocketPathBytes));
  }
  const size_t slash = path.rfind('/');
  const std::string dir = slash == 0 ? "/" : path.substr(0, slash);
  if (slash + 1 == path.size()) {
    return absl::InvalidArgumentError(absl::StrCat("--socket: ", path, " names a directory"));
  }
  if (::mkdir(dir.c_str(), 0700) != 0 && errno != EEXIST) {
    return absl::PermissionDeniedError(
        absl::StrCat("create socket directory ", dir, ": ", std::strerror(errno)));
  }
  struct stat st {};
  if (::stat(dir.c_str(), &st) != 0) {
    return absl::PermissionDeniedError(
        absl::StrCat("stat socket directory ", dir, ": ", std::strerror(errno)));
  }
  if (!S_ISDIR(st.st_mode)) {
    return absl::InvalidArgumentError(
        absl::StrCat("socket directory ", dir, " is not a directory"));
  }
  if (st.st_uid != ::geteuid() || (st.st_mode & 077) != 0) {
    return absl::PermissionDeniedError(
        absl::StrCat("socket directory ", dir, " must be owned by uid ", ::geteuid(),
                     " with mode 0700 (it is uid ", st.st_uid, ", mode ",
                     absl::StrFormat("%04o", st.st_mode & 0777), ")"));
  }
  // A stale socket (a previous worker that did not clean up) is removed; one a running server
  // accepts on is refused (FailedPrecondition), so a second worker cannot take the path over.
  return ClaimUnixSocketPath(path, "--socket");
}

StopSignalWatcher::StopSignalWatcher() {
  sigemptyset(&signals_);
  sigaddset(&signals_, SIGTERM);
  sigaddset(&signals_, SIGINT);
  pthread_sigmask(SIG_BLOCK, &signals_, nullptr);
  ::signal(SIGPIPE, SIG_IGN);
  thread_ = std::jthread([this](std::stop_token token) {
    const timespec tick{0, 100'000'000};
    while (!token.stop_requested()) {
      const int sig = ::sigtimedwait(&signals_, nullptr, &tick);
      if (sig > 0) {
        HMOE_LOG(INFO) << "received signal " << sig << " (" << strsignal(sig) << "), draining";
        if (!stop_.HasBeenNotified()) stop_.Notify();
      }
    }
  });
}

StopSignalWatcher::~StopSignalWatcher() {
  thread_.request_stop();
  if (thread_.joinable()) thread_.join();
}

}  // namespace hmoe::rpc
