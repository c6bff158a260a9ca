#pragma once

// The supervisord configuration of one node (deploy/README.md), written by `hmoe deploy`:
//   weightd        priority 10: loads the checkpoint into shared memory once;
//   prefill-<i>    priority 20: one prefill worker per GPU (or --prefill-workers on the CPU);
//                  two or more of them run long prompts together as a DSLP group (docs/dslp.md);
//   decode         priority 30: the decode worker;
//   router         priority 40: the public API.
// supervisord starts programs in priority order but does not wait for readiness, so each worker's
// command first waits (`hmoe health --wait-s`) until weightd reports SERVING, then execs the
// worker; workers register with the router themselves (and retry while it is down). Every program
// restarts on exit (autorestart), stops with SIGTERM and gets longer than its drain time to exit
// (docs/style.md §12), and logs to <log dir>/<program>.log with rotation. Each program can be
// stopped, started or restarted alone with `supervisorctl -c <out>/supervisord.conf ...`.
//
// Sockets (the router's registry, the workers' services, supervisord's control socket) live in
// the run directory, created 0700.

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace hmoe::deploy {

// Absolute paths of the executables the configuration runs. `prefill_worker` may be empty (no
// prefill workers).
struct Binaries {
  std::string weightd;
  std::string decode_worker;
  std::string prefill_worker;
  std::string router;
  std::string hmoe;  // the CLI, for the readiness waits
};

struct DeployOptions {
  // Checkpoint directory (config.json, safetensors, tokenizer).
  std::string model_dir;
  // Where supervisord.conf goes; run/ and logs/ default to subdirectories.
  std::string out_dir;
  std::string run_dir;  // default <out_dir>/run (sockets; created 0700)
  std::string log_dir;  // default <out_dir>/logs
  // GPUs of the node: the decode worker's attention runs on cuda:0, prefill worker i on cuda:i.
  // 0: everything on the CPU.
  int gpus = 0;
  // Prefill workers. -1: one per GPU; with no GPU, one CPU prefill worker when the binary exists.
  // Two or more form DSLP groups (the router's policy, when decode is idle).
  int prefill_workers = -1;
  // DSLP expert parallelism the router asks for: "" (the workers' default, small_ep), "standard"
  // or "small_ep" (hmoe-router --dslp-ep-mode).
  std::string dslp_ep_mode;
  // CPU cores of the node for the CPU prefill workers (0: std::thread::hardware_concurrency()).
  // Two or more CPU prefill workers run a DSLP group's ranks at the same time, so each gets
  // --threads cpus / N, unpinned (their pools would otherwise pin to the same cores).
  int cpus = 0;
  // weightd instance name (shared-memory names).
  std::string instance = "hmoe";
  // The router's public address.
  std::string listen = "127.0.0.1:50051";
  // The router's OpenAI-compatible HTTP address (--http-listen); empty: no HTTP.
  std::string http_listen = "127.0.0.1:8000";
  // How long each process may drain on SIGTERM; supervisord waits 15 s longer before SIGKILL.
  int drain_seconds = 30;
  // How long a worker waits for weightd to finish loading before it gives up (and supervisord
  // restarts it).
  int weightd_wait_seconds = 3600;
  // The router's thresholds from a calibration file (`hmoe calibrate`, `hmoe deploy
  // --calibration`):
  // --chunk-threshold when > 0 and --decode-idle-window-s when >= 0; otherwise the router's
  // defaults. router_args come after them (and win).
  int64_t chunk_threshold = 0;
  int64_t decode_idle_window_s = -1;
  // Extra flags per program, appended to the rendered ones (e.g. "--threads 4").
  std::vector<std::string> weightd_args;
  std::vector<std::string> prefill_args;
  std::vector<std::string> decode_args;
  std::vector<std::string> router_args;
  Binaries bin;
};

// The resolved number of prefill workers (see DeployOptions::prefill_workers).
int NumPrefillWorkers(const DeployOptions& options);

// Fills the defaults (run/log dirs) and checks the options: absolute paths without characters
// supervisord or the shell would interpret (whitespace, quotes, '%', '$', '\'), socket paths that
// fit sockaddr_un, binaries present for every program. InvalidArgument / FailedPrecondition naming
// the problem.
absl::StatusOr<DeployOptions> Resolve(DeployOptions options);

// The supervisord.conf text for resolved options.
std::string RenderSupervisordConf(const DeployOptions& options);

// Resolves, creates out_dir, run_dir (0700) and log_dir, and writes <out_dir>/supervisord.conf.
// Returns the resolved options.
absl::StatusOr<DeployOptions> WriteDeployment(const DeployOptions& options);

// Finds the executables: each `name` is looked up as <dir>/<name>, <dir>/<subdir>/<name> and
// <dir>/../<subdir>/<name> for every dir of `search_dirs` (a bin directory or a CMake build tree;
// the CLI passes its own directory). Missing ones stay empty.
Binaries FindBinaries(const std::vector<std::string>& search_dirs);

}  // namespace hmoe::deploy
