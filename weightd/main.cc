// hmoe-weightd: loads a checkpoint once into hugepage-backed, NUMA-placed, read-only shared memory
// and keeps it there for every worker. See docs/weightd.md.
//
//   hmoe-weightd --model DIR [--instance NAME] [--numa auto|off|N] [--numa-slices N]
//                [--hugepages auto|1g|2m|thp|off] [--dense-policy interleave|replicate]
//                [--socket PATH] [--remove-on-exit] [--load-threads N]
//
// Exit codes: 0 after SIGTERM/SIGINT (also during loading), 1 on any error, 2 on bad flags.

#include <malloc.h>
#include <sys/stat.h>
#include <unistd.h>

#include <chrono>
#include <csignal>
#include <string>

#include "absl/flags/flag.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include <grpcpp/grpcpp.h>
#include <grpcpp/health_check_service_interface.h>

#include "common/base/logging.h"
#include "common/base/status_macros.h"
#include "common/base/unix_socket.h"
#include "common/process/daemon.h"
#include "common/process/socket_path.h"
#include "common/shm/shm_names.h"
#include "weightd/weight_daemon.h"
#include "weightd/weightd_service.h"

ABSL_FLAG(std::string, model, "",
          "checkpoint directory (config.json + safetensors) or GGUF file (*.gguf, any split part)");
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

using process::FlagError;

absl::StatusOr<DaemonOptions> ReadFlags(absl::Time process_start) {
  DaemonOptions options;
  options.process_start = process_start;
  options.model_dir = absl::GetFlag(FLAGS_model);
  options.instance = absl::GetFlag(FLAGS_instance);
  options.numa_slices = absl::GetFlag(FLAGS_numa_slices);
  options.load_threads = absl::GetFlag(FLAGS_load_threads);
  options.progress_tty = ::isatty(STDERR_FILENO) == 1;
  absl::StatusOr<NumaSetting> numa = ParseNumaSetting(absl::GetFlag(FLAGS_numa));
  absl::StatusOr<shm::HugePageMode> huge = shm::ParseHugePageMode(absl::GetFlag(FLAGS_hugepages));
  absl::StatusOr<shm::DensePolicy> dense = shm::ParseDensePolicy(absl::GetFlag(FLAGS_dense_policy));
  for (const absl::Status& s : {numa.status(), huge.status(), dense.status()}) {
    HMOE_RETURN_IF_ERROR(FlagError(s));
  }
  options.numa = *numa;
  options.hugepages = *huge;
  options.dense_policy = *dense;
  if (options.model_dir.empty()) return FlagError("--model DIR is required");
  return options;
}

absl::Status Run(absl::Time process_start, process::StopSignalWatcher& signals) {
  HMOE_ASSIGN_OR_RETURN(const DaemonOptions options, ReadFlags(process_start));
  // A segment beyond RLIMIT_FSIZE fails with EFBIG (a clear error, and the partial store is
  // removed) instead of killing weightd with SIGXFSZ mid-creation.
  ::signal(SIGXFSZ, SIG_IGN);
  std::string socket_path = absl::GetFlag(FLAGS_socket);
  if (socket_path.empty()) socket_path = shm::DefaultSocketPath(options.instance);
  HMOE_RETURN_IF_ERROR(process::CheckSocketPath("--socket", socket_path));
  const bool remove_on_exit = absl::GetFlag(FLAGS_remove_on_exit);
  HMOE_ASSIGN_OR_RETURN(std::unique_ptr<WeightDaemon> daemon, WeightDaemon::Create(options));

  // We hold the instance lock, so a socket file left at this path is stale unless another
  // instance's weightd was given the same --socket: that one is refused, not taken over.
  HMOE_RETURN_IF_ERROR(ClaimUnixSocketPath(socket_path, "--socket"));
  grpc::EnableDefaultHealthCheckService(true);
  WeightdServiceImpl service(daemon.get());
  grpc::ServerBuilder builder;
  builder.AddListeningPort("unix:" + socket_path, grpc::InsecureServerCredentials());
  builder.RegisterService(&service);
  builder.SetMaxSendMessageSize(512 << 20);  // Manifests of 1T-parameter models exceed 4 MB.
  std::unique_ptr<grpc::Server> server = builder.BuildAndStart();
  if (server == nullptr) {
    return absl::UnavailableError(absl::StrCat("cannot serve gRPC on unix:", socket_path));
  }
  ::chmod(socket_path.c_str(), 0600);
  grpc::HealthCheckServiceInterface* health = server->GetHealthCheckService();
  const auto set_serving = [health](bool serving) {
    health->SetServingStatus(serving);
    health->SetServingStatus(kServiceName, serving);
  };
  set_serving(false);
  HMOE_LOG(INFO) << "serving status on unix:" << socket_path << " (NOT_SERVING until ready)";
  const auto stop_server = [&]() {
    set_serving(false);
    server->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(2));
    ::unlink(socket_path.c_str());
  };

  absl::Status loaded = daemon->LoadOrAdopt(signals.stop_flag());
  if (!loaded.ok()) {
    stop_server();
    if (absl::IsCancelled(loaded)) {
      HMOE_LOG(INFO) << "stopped while loading; partial segments removed";
      return absl::OkStatus();
    }
    return loaded;
  }
  // The load's buffers (checkpoint index, the loader threads' read buffers and malloc arenas)
  // are freed by now: hand their pages back, so the long-running daemon holds just its service
  // (weightd plus its workers should cost one copy of the weights, docs/weightd.md).
  ::malloc_trim(0);
  set_serving(true);
  HMOE_LOG(INFO) << "SERVING instance " << options.instance;

  signals.WaitForStop();
  stop_server();
  HMOE_RETURN_IF_ERROR(Annotate(daemon->Shutdown(remove_on_exit), "shutdown"));
  HMOE_LOG(INFO) << "stopped" << (remove_on_exit ? " (segments removed)" : " (segments kept)");
  return absl::OkStatus();
}

}  // namespace
}  // namespace hmoe::weightd

int main(int argc, char** argv) {
  const absl::Time process_start = absl::Now();
  return hmoe::process::RunDaemon(
      argc, argv,
      {.usage = "hmoe-weightd --model DIR [--instance NAME] [--numa auto|off|N] [--numa-slices N] "
                "[--hugepages auto|1g|2m|thp|off] [--dense-policy interleave|replicate] "
                "[--socket PATH] [--remove-on-exit]",
       .stop_on_sighup = true},
      [process_start](hmoe::process::StopSignalWatcher& signals) {
        return hmoe::weightd::Run(process_start, signals);
      });
}
