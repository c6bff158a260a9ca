#include "tools/deploy_config.h"

#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <system_error>
#include <thread>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

#include "common/base/status_macros.h"

namespace hmoe::deploy {
namespace {

// sockaddr_un.sun_path holds 108 bytes including the terminating NUL.
constexpr size_t kMaxSocketPathBytes = 107;

// Path characters that would need quoting in supervisord's command line (shlex) or in the
// `sh -c` wrapper, or that supervisord expands ('%').
absl::Status CheckPath(const std::string& what, const std::string& path) {
  if (path.empty()) return absl::InvalidArgumentError(absl::StrCat(what, ": empty path"));
  if (path[0] != '/') {
    return absl::InvalidArgumentError(absl::StrCat(what, ": ", path, " is not absolute"));
  }
  for (char c : path) {
    if (c == ' ' || c == '\t' || c == '\n' || c == '\'' || c == '"' || c == '%' || c == '$' ||
        c == '\\' || c == '`' || c == ';') {
      return absl::InvalidArgumentError(
          absl::StrCat(what, ": ", path, " contains a character supervisord would interpret ('",
                       std::string(1, c), "')"));
    }
  }
  return absl::OkStatus();
}

absl::Status CheckArgs(const std::string& what, const std::vector<std::string>& args) {
  for (const std::string& a : args) {
    for (char c : a) {
      if (c == '\'' || c == '"' || c == '%' || c == '$' || c == '\\' || c == '`' || c == ';' ||
          c == ' ' || c == '\n') {
        return absl::InvalidArgumentError(
            absl::StrCat(what, ": argument \"", a, "\" needs quoting; not supported"));
      }
    }
  }
  return absl::OkStatus();
}

absl::Status CheckExecutable(const std::string& what, const std::string& path) {
  if (path.empty()) {
    return absl::FailedPreconditionError(absl::StrCat(what, ": executable not found"));
  }
  HMOE_RETURN_IF_ERROR(CheckPath(what, path));
  if (::access(path.c_str(), X_OK) != 0) {
    return absl::FailedPreconditionError(
        absl::StrCat(what, ": ", path, " is not executable: ", std::strerror(errno)));
  }
  return absl::OkStatus();
}

std::string Absolute(const std::string& path) {
  if (path.empty()) return path;
  std::error_code ec;
  std::filesystem::path p = std::filesystem::absolute(path, ec);
  if (ec) return path;
  return p.lexically_normal().string();
}

std::string Socket(const DeployOptions& o, const std::string& name) {
  return absl::StrCat(o.run_dir, "/", name, ".sock");
}

std::string Join(const std::vector<std::string>& parts) { return absl::StrJoin(parts, " "); }

// One [program:x] section.
void AppendProgram(std::string* out, const DeployOptions& o, const std::string& name, int priority,
                   const std::string& command, const std::string& environment) {
  absl::StrAppend(out, "\n[program:", name, "]\n");
  absl::StrAppend(out, "command=", command, "\n");
  if (!environment.empty()) absl::StrAppend(out, "environment=", environment, "\n");
  absl::StrAppend(out, "priority=", priority, "\n");
  absl::StrAppend(out, "autostart=true\n");
  absl::StrAppend(out, "autorestart=true\n");
  // RUNNING after 1 s; a worker that exits sooner is retried with a growing backoff.
  absl::StrAppend(out, "startsecs=1\n");
  absl::StrAppend(out, "startretries=10\n");
  absl::StrAppend(out, "stopsignal=TERM\n");
  absl::StrAppend(out, "stopwaitsecs=", o.drain_seconds + 15, "\n");
  // The readiness wait runs under `sh -c`: signal the whole process group.
  absl::StrAppend(out, "stopasgroup=true\n");
  absl::StrAppend(out, "killasgroup=true\n");
  absl::StrAppend(out, "redirect_stderr=true\n");
  absl::StrAppend(out, "stdout_logfile=", o.log_dir, "/", name, ".log\n");
  absl::StrAppend(out, "stdout_logfile_maxbytes=50MB\n");
  absl::StrAppend(out, "stdout_logfile_backups=5\n");
}

// `sh -c` that waits for weightd to serve, then becomes the worker.
std::string AfterWeightd(const DeployOptions& o, const std::vector<std::string>& worker) {
  return absl::StrCat("/bin/sh -c '", o.bin.hmoe, " health --addr unix:", Socket(o, "weightd"),
                      " --wait-s ", o.weightd_wait_seconds, " >/dev/null && exec ", Join(worker),
                      "'");
}

std::string DeviceOfPrefill(const DeployOptions& o, int i) {
  return o.gpus > 0 ? absl::StrCat("cuda:", i % o.gpus) : "cpu";
}

}  // namespace

int NumPrefillWorkers(const DeployOptions& o) {
  if (o.prefill_workers >= 0) return o.prefill_workers;
  if (o.gpus > 0) return o.gpus;
  return o.bin.prefill_worker.empty() ? 0 : 1;
}

absl::StatusOr<DeployOptions> Resolve(DeployOptions o) {
  if (o.gpus < 0) return absl::InvalidArgumentError("--gpus: must be >= 0");
  if (o.prefill_workers < -1) return absl::InvalidArgumentError("--prefill-workers: must be >= 0");
  if (o.drain_seconds < 0) return absl::InvalidArgumentError("--drain-seconds: must be >= 0");
  if (o.instance.empty()) return absl::InvalidArgumentError("--instance: empty");
  for (char c : o.instance) {
    if (!std::isalnum(static_cast<unsigned char>(c)) && c != '-' && c != '_') {
      return absl::InvalidArgumentError("--instance: only [A-Za-z0-9_-] allowed");
    }
  }
  if (o.listen.empty()) return absl::InvalidArgumentError("--listen: empty");
  if (!o.dslp_ep_mode.empty() && o.dslp_ep_mode != "standard" && o.dslp_ep_mode != "small_ep") {
    return absl::InvalidArgumentError(
        absl::StrCat("--dslp-ep-mode: \"", o.dslp_ep_mode, "\" is not standard or small_ep"));
  }
  if (o.cpus < 0) return absl::InvalidArgumentError("--cpus: must be >= 0");
  if (o.cpus == 0) o.cpus = std::max(1, static_cast<int>(std::thread::hardware_concurrency()));
  HMOE_RETURN_IF_ERROR(CheckArgs("--listen", {o.listen}));
  HMOE_RETURN_IF_ERROR(CheckArgs("--http-listen", {o.http_listen}));
  o.model_dir = Absolute(o.model_dir);
  o.out_dir = Absolute(o.out_dir);
  if (o.run_dir.empty()) o.run_dir = o.out_dir + "/run";
  if (o.log_dir.empty()) o.log_dir = o.out_dir + "/logs";
  o.run_dir = Absolute(o.run_dir);
  o.log_dir = Absolute(o.log_dir);
  HMOE_RETURN_IF_ERROR(CheckPath("--model", o.model_dir));
  HMOE_RETURN_IF_ERROR(CheckPath("--out", o.out_dir));
  HMOE_RETURN_IF_ERROR(CheckPath("--run-dir", o.run_dir));
  HMOE_RETURN_IF_ERROR(CheckPath("--log-dir", o.log_dir));
  if (o.model_dir.ends_with(".gguf")) {
    // A GGUF model (any part of a split one): weightd, the workers and the router read it.
    if (!std::filesystem::is_regular_file(o.model_dir)) {
      return absl::FailedPreconditionError(
          absl::StrCat("--model: ", o.model_dir, " is not a GGUF file"));
    }
    if (o.gpus > 0) {
      return absl::FailedPreconditionError(
          absl::StrCat("--model: ", o.model_dir,
                       " is a GGUF, which runs on the CPU backend only for now (the CUDA device "
                       "does not compute with GGML block types): pass --gpus 0"));
    }
  } else if (!std::filesystem::exists(o.model_dir + "/config.json")) {
    return absl::FailedPreconditionError(absl::StrCat(
        "--model: ", o.model_dir, " has no config.json (give a checkpoint directory or a .gguf)"));
  }
  // The longest socket name is supervisor.sock / prefill-NN.sock.
  const std::string longest = Socket(o, "supervisor");
  if (longest.size() > kMaxSocketPathBytes - 4) {
    return absl::InvalidArgumentError(
        absl::StrCat("--run-dir: ", o.run_dir, " is too long for unix socket paths (",
                     longest.size(), " bytes for ", longest, "; at most ", kMaxSocketPathBytes - 4,
                     "); give a shorter --run-dir"));
  }
  constexpr int64_t kIntMax = std::numeric_limits<int32_t>::max();
  if (o.chunk_threshold < 0 || o.chunk_threshold > kIntMax || o.decode_idle_window_s < -1 ||
      o.decode_idle_window_s > kIntMax) {
    return absl::InvalidArgumentError(
        absl::StrCat("router thresholds out of range: chunk threshold ", o.chunk_threshold,
                     " (want 1 to 2^31-1, or 0 for the default), DSLP idle window ",
                     o.decode_idle_window_s, " s (want 0 to 2^31-1, or -1 for the default)"));
  }
  HMOE_RETURN_IF_ERROR(CheckArgs("--weightd-args", o.weightd_args));
  HMOE_RETURN_IF_ERROR(CheckArgs("--prefill-args", o.prefill_args));
  HMOE_RETURN_IF_ERROR(CheckArgs("--decode-args", o.decode_args));
  HMOE_RETURN_IF_ERROR(CheckArgs("--router-args", o.router_args));
  HMOE_RETURN_IF_ERROR(CheckExecutable("hmoe-weightd", o.bin.weightd));
  HMOE_RETURN_IF_ERROR(CheckExecutable("hmoe-decode-worker", o.bin.decode_worker));
  HMOE_RETURN_IF_ERROR(CheckExecutable("hmoe-router", o.bin.router));
  HMOE_RETURN_IF_ERROR(CheckExecutable("hmoe", o.bin.hmoe));
  o.prefill_workers = NumPrefillWorkers(o);
  if (o.prefill_workers > 0) {
    HMOE_RETURN_IF_ERROR(CheckExecutable("hmoe-prefill-worker", o.bin.prefill_worker));
  }
  return o;
}

std::string RenderSupervisordConf(const DeployOptions& o) {
  std::string out = absl::StrCat(
      "; hybridmoe node: written by `hmoe deploy` (tools/deploy_config.cc); see deploy/README.md.\n"
      "; Start:   supervisord -c ",
      o.out_dir,
      "/supervisord.conf\n"
      "; Status:  supervisorctl -c ",
      o.out_dir,
      "/supervisord.conf status\n"
      "; Restart one program:  supervisorctl -c ... restart decode   (or prefill-0, router, ...)\n"
      "; Stop everything:      supervisorctl -c ... shutdown\n"
      "; gpus=",
      o.gpus, " prefill_workers=", o.prefill_workers, " instance=", o.instance,
      " model=", o.model_dir, "\n");
  absl::StrAppend(&out, "\n[unix_http_server]\nfile=", Socket(o, "supervisor"), "\nchmod=0700\n");
  absl::StrAppend(&out, "\n[supervisord]\nlogfile=", o.log_dir, "/supervisord.log\n",
                  "logfile_maxbytes=50MB\nlogfile_backups=5\n", "pidfile=", o.run_dir,
                  "/supervisord.pid\n", "childlogdir=", o.log_dir, "\n", "identifier=hmoe-",
                  o.instance, "\n");
  absl::StrAppend(
      &out,
      "\n[rpcinterface:supervisor]\n"
      "supervisor.rpcinterface_factory = supervisor.rpcinterface:make_main_rpcinterface\n");
  absl::StrAppend(&out, "\n[supervisorctl]\nserverurl=unix://", Socket(o, "supervisor"), "\n");

  const std::string router_registry = absl::StrCat("unix:", Socket(o, "router"));
  const std::string drain = absl::StrCat(o.drain_seconds);

  // weightd: owns the weights; outlives worker restarts.
  std::vector<std::string> weightd = {o.bin.weightd, "--model",  o.model_dir,         "--instance",
                                      o.instance,    "--socket", Socket(o, "weightd")};
  weightd.insert(weightd.end(), o.weightd_args.begin(), o.weightd_args.end());
  AppendProgram(&out, o, "weightd", 10, Join(weightd),
                absl::StrCat("HMOE_RUNTIME_DIR=\"", o.run_dir, "\""));

  for (int i = 0; i < o.prefill_workers; ++i) {
    const std::string id = absl::StrCat("prefill-", i);
    std::vector<std::string> prefill = {o.bin.prefill_worker,
                                        "--weightd-instance",
                                        o.instance,
                                        "--socket",
                                        Socket(o, id),
                                        "--device",
                                        DeviceOfPrefill(o, i),
                                        "--router",
                                        router_registry,
                                        "--worker-id",
                                        id,
                                        "--drain-seconds",
                                        drain};
    if (o.gpus == 0 && o.prefill_workers >= 2) {
      // The ranks of a DSLP group compute at the same time: share the cores, do not pin.
      prefill.push_back(absl::StrCat("--threads=", std::max(1, o.cpus / o.prefill_workers)));
      prefill.push_back("--pin-threads=false");
    }
    prefill.insert(prefill.end(), o.prefill_args.begin(), o.prefill_args.end());
    AppendProgram(&out, o, id, 20, AfterWeightd(o, prefill), "");
  }

  std::vector<std::string> decode = {o.bin.decode_worker,
                                     "--weightd-instance",
                                     o.instance,
                                     "--socket",
                                     Socket(o, "decode"),
                                     "--device",
                                     o.gpus > 0 ? "cuda:0" : "cpu",
                                     "--router",
                                     router_registry,
                                     "--worker-id",
                                     "decode-0",
                                     "--drain-seconds",
                                     drain};
  decode.insert(decode.end(), o.decode_args.begin(), o.decode_args.end());
  AppendProgram(&out, o, "decode", 30, AfterWeightd(o, decode), "");

  std::vector<std::string> router = {o.bin.router,        "--listen",        o.listen,
                                     "--model",           o.model_dir,       "--registry-socket",
                                     Socket(o, "router"), "--drain-seconds", drain};
  if (!o.dslp_ep_mode.empty()) router.push_back("--dslp-ep-mode=" + o.dslp_ep_mode);
  if (!o.http_listen.empty()) router.push_back("--http-listen=" + o.http_listen);
  if (o.chunk_threshold > 0)
    router.push_back(absl::StrCat("--chunk-threshold=", o.chunk_threshold));
  if (o.decode_idle_window_s >= 0) {
    router.push_back(absl::StrCat("--decode-idle-window-s=", o.decode_idle_window_s));
  }
  router.insert(router.end(), o.router_args.begin(), o.router_args.end());
  AppendProgram(&out, o, "router", 40, Join(router), "");
  return out;
}

absl::StatusOr<DeployOptions> WriteDeployment(const DeployOptions& options) {
  HMOE_ASSIGN_OR_RETURN(DeployOptions o, Resolve(options));
  std::error_code ec;
  for (const std::string& dir : {o.out_dir, o.log_dir}) {
    std::filesystem::create_directories(dir, ec);
    if (ec) return absl::InternalError(absl::StrCat("mkdir ", dir, ": ", ec.message()));
  }
  std::filesystem::create_directories(o.run_dir, ec);
  if (ec) return absl::InternalError(absl::StrCat("mkdir ", o.run_dir, ": ", ec.message()));
  // Sockets: owner only (the router refuses a looser registry directory).
  if (::chmod(o.run_dir.c_str(), 0700) != 0) {
    return absl::InternalError(absl::StrCat("chmod 0700 ", o.run_dir, ": ", std::strerror(errno)));
  }
  const std::string path = o.out_dir + "/supervisord.conf";
  std::ofstream f(path, std::ios::trunc);
  f << RenderSupervisordConf(o);
  f.close();
  if (!f) return absl::InternalError(absl::StrCat("write ", path, " failed"));
  return o;
}

Binaries FindBinaries(const std::vector<std::string>& search_dirs) {
  auto find = [&](const std::string& subdir, const std::string& name) -> std::string {
    for (const std::string& dir : search_dirs) {
      for (const std::string& candidate :
           {absl::StrCat(dir, "/", name), absl::StrCat(dir, "/", subdir, "/", name),
            absl::StrCat(dir, "/../", subdir, "/", name)}) {
        if (::access(candidate.c_str(), X_OK) == 0) return Absolute(candidate);
      }
    }
    return "";
  };
  Binaries b;
  b.weightd = find("weightd", "hmoe-weightd");
  b.decode_worker = find("decode_worker", "hmoe-decode-worker");
  b.prefill_worker = find("prefill_worker", "hmoe-prefill-worker");
  b.router = find("router", "hmoe-router");
  b.hmoe = find("tools", "hmoe");
  return b;
}

}  // namespace hmoe::deploy
