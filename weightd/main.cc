// hmoe-weightd: loads a checkpoint once into hugepage-backed, NUMA-placed, read-only shared memory
// and keeps it there for every worker. See docs/weightd.md.
//
//   hmoe-weightd --model DIR [--instance NAME] [--numa auto|off|N] [--numa-slices N]
//                [--hugepages auto|1g|2m|thp|off] [--dense-policy interleave|replicate]
//                [--socket PATH] [--remove-on-exit] [--load-threads N]
//
// Exit codes: 0 after SIGTERM/SIGINT (also during loading), 1 on any error, 2 on bad flags.

#include <malloc.h>
#include <signal.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <string>
#include <thread>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/synchronization/notification.h"
#include "absl/time/time.h"
#include <grpcpp/grpcpp.h>
#include <grpcpp/health_check_service_interface.h>

#include "common/base/flags.h"
#include "common/base/logging.h"
#include "common/base/unix_socket.h"
#include "common/shm/shm_names.h"
#include "weightd/weight_daemon.h"
#include "weightd/weightd_service.h"

ABSL_FLAG(std::string, model, "", "checkpoint directory (config.json + safetensors)");
ABSL_FLAG(std::string, instance, "default", "instance name; names the shared memory and socket");
ABSL_FLAG(std::string, numa, "auto", "NUMA placement: auto, off, or a node number");
ABSL_FLAG(int, numa_slices, 0,
          "slices per routed expert (0 = one per NUMA node); >1 on one node is for testing");
ABSL_FLAG(std::string, hugepages, "auto", "page backing: auto, 1g, 2m, thp or off");
ABSL_FLAG(std::string, dense_policy, "interleave",
          "non-expert tensors: interleave (over the nodes) or replicate (one copy per node)");
ABSL_FLAG(std::string, socket, "",
          "unix socket of the gRPC service (default <runtime dir>/weightd.<instance>.sock)");
ABSL_FLAG(bool, remove_on_exit, false,
          "remove the shared-memory segments on exit (default: keep them for the next weightd)");
ABSL_FLAG(int, load_threads, 2, "reader threads while loading");

namespace hmoe::weightd {
namespace {

constexpr char kServiceName[] = "hmoe.weightd.v1.WeightdService";

int Run(absl::Time process_start) {
  DaemonOptions options;
  options.process_start = process_start;
  options.model_dir = absl::GetFlag(FLAGS_model);
  options.instance = absl::GetFlag(FLAGS_instance);
  options.numa_slices = absl::GetFlag(FLAGS_numa_slices);
  options.load_threads = absl::GetFlag(FLAGS_load_threads);
  options.progress_tty = ::isatty(STDERR_FILENO) == 1;
  {
    absl::StatusOr<NumaSetting> numa = ParseNumaSetting(absl::GetFlag(FLAGS_numa));
    absl::StatusOr<shm::HugePageMode> huge = shm::ParseHugePageMode(absl::GetFlag(FLAGS_hugepages));
    absl::StatusOr<shm::DensePolicy> dense =
        shm::ParseDensePolicy(absl::GetFlag(FLAGS_dense_policy));
    for (const absl::Status& s : {numa.status(), huge.status(), dense.status()}) {
      if (!s.ok()) {
        HMOE_LOG(ERROR) << s.message();
        return 2;
      }
    }
    options.numa = *numa;
    options.hugepages = *huge;
    options.dense_policy = *dense;
  }
  if (options.model_dir.empty()) {
    HMOE_LOG(ERROR) << "--model DIR is required";
    return 2;
  }
  std::string socket_path = absl::GetFlag(FLAGS_socket);
  if (socket_path.empty()) socket_path = shm::DefaultSocketPath(options.instance);
  if (socket_path.size() >= shm::kMaxUnixSocketPathBytes) {
    HMOE_LOG(ERROR) << "socket path " << socket_path << " is " << socket_path.size()
                    << " bytes; unix sockets allow at most " << shm::kMaxUnixSocketPathBytes - 1;
    return 2;
  }

  // Signals are taken by one thread with sigtimedwait; every other thread has them blocked.
  sigset_t signals;
  sigemptyset(&signals);
  sigaddset(&signals, SIGTERM);
  sigaddset(&signals, SIGINT);
  sigaddset(&signals, SIGHUP);
  pthread_sigmask(SIG_BLOCK, &signals, nullptr);
  ::signal(SIGPIPE, SIG_IGN);
  // A segment beyond RLIMIT_FSIZE fails with EFBIG (a clear error, and the partial store is
  // removed) instead of killing weightd with SIGXFSZ mid-creation.
  ::signal(SIGXFSZ, SIG_IGN);
  std::atomic<bool> stop{false};
  absl::Notification stop_requested;
  std::jthread signal_thread([&](std::stop_token token) {
    const timespec tick{0, 100'000'000};
    while (!token.stop_requested()) {
      const int sig = ::sigtimedwait(&signals, nullptr, &tick);
      if (sig > 0) {
        HMOE_LOG(INFO) << "received signal " << sig << " (" << strsignal(sig) << "), stopping";
        // Relaxed: the loader only polls it; the Notification orders everything else.
        stop.store(true, std::memory_order_relaxed);
        if (!stop_requested.HasBeenNotified()) stop_requested.Notify();
      }
    }
  });

  const bool remove_on_exit = absl::GetFlag(FLAGS_remove_on_exit);
  absl::StatusOr<std::unique_ptr<WeightDaemon>> daemon = WeightDaemon::Create(options);
  if (!daemon.ok()) {
    HMOE_LOG(ERROR) << daemon.status().message();
    return 1;
  }

  // We hold the instance lock, so a socket file left at this path is stale unless another
  // instance's weightd was given the same --socket: that one is refused, not taken over.
  if (absl::Status s = hmoe::ClaimUnixSocketPath(socket_path, "--socket"); !s.ok()) {
    HMOE_LOG(ERROR) << s.message();
    return 1;
  }
  grpc::EnableDefaultHealthCheckService(true);
  WeightdServiceImpl service(daemon->get());
  grpc::ServerBuilder builder;
  builder.AddListeningPort("unix:" + socket_path, grpc::InsecureServerCredentials());
  builder.RegisterService(&service);
  builder.SetMaxSendMessageSize(512 << 20);  // Manifests of 1T-parameter models exceed 4 MB.
  std::unique_ptr<grpc::Server> server = builder.BuildAndStart();
  if (server == nullptr) {
    HMOE_LOG(ERROR) << "cannot serve gRPC on unix:" << socket_path;
    return 1;
  }
  ::chmod(socket_path.c_str(), 0600);
  grpc::HealthCheckServiceInterface* health = server->GetHealthCheckService();
  health->SetServingStatus(false);
  health->SetServingStatus(kServiceName, false);
  HMOE_LOG(INFO) << "serving status on unix:" << socket_path << " (NOT_SERVING until ready)";

  auto stop_server = [&]() {
    health->SetServingStatus(false);
    health->SetServingStatus(kServiceName, false);
    server->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(2));
    ::unlink(socket_path.c_str());
  };

  absl::Status loaded = (*daemon)->LoadOrAdopt(&stop);
  if (!loaded.ok()) {
    stop_server();
    if (absl::IsCancelled(loaded)) {
      HMOE_LOG(INFO) << "stopped while loading; partial segments removed";
      return 0;
    }
    HMOE_LOG(ERROR) << loaded.message();
    return 1;
  }
  // The load's buffers (checkpoint index, the loader threads' read buffers and malloc arenas)
  // are freed by now: hand their pages back, so the long-running daemon holds just its service
  // (weightd plus its workers should cost one copy of the weights, docs/weightd.md).
  ::malloc_trim(0);
  health->SetServingStatus(true);
  health->SetServingStatus(kServiceName, true);
  HMOE_LOG(INFO) << "SERVING instance " << options.instance;

  stop_requested.WaitForNotification();
  stop_server();
  absl::Status shutdown = (*daemon)->Shutdown(remove_on_exit);
  if (!shutdown.ok()) {
    HMOE_LOG(ERROR) << "shutdown: " << shutdown.message();
    return 1;
  }
  HMOE_LOG(INFO) << "stopped" << (remove_on_exit ? " (segments removed)" : " (segments kept)");
  return 0;
}

}  // namespace
}  // namespace hmoe::weightd

int main(int argc, char** argv) {
  const absl::Time process_start = absl::Now();
  std::vector<std::string> storage;
  std::vector<char*> args = hmoe::NormalizeFlagNames(argc, argv, storage);
  hmoe::SetUsage(
      "hmoe-weightd --model DIR [--instance NAME] [--numa auto|off|N] [--numa-slices N] "
      "[--hugepages auto|1g|2m|thp|off] [--dense-policy interleave|replicate] [--socket PATH] "
      "[--remove-on-exit]");
  absl::ParseCommandLine(static_cast<int>(args.size()), args.data());
  return hmoe::weightd::Run(process_start);
}
