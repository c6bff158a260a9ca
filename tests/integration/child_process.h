#pragma once

// A real child process (router, worker, weightd, a tool) for integration tests.
//
//   ChildOptions o;
//   o.argv = {kWeightdPath, "--model", dir, "--instance", name};
//   o.stderr_path = temp_dir + "/weightd.log";
//   absl::StatusOr<ChildProcess> weightd = ChildProcess::Start(std::move(o));
//   ...
//   EXPECT_EQ(weightd->Terminate(std::chrono::seconds(5)).value_or(-1), 0);
//
// The child gets PR_SET_PDEATHSIG=SIGKILL (it dies with the test process) and the destructor
// SIGKILLs and reaps a child that is still running, so a failing test never leaks processes.
// Between fork and exec the child only makes async-signal-safe calls (the test process may have
// gRPC threads). Thread-compatible: one owner thread per object. Header-only so every test target
// can use it without a library.

#include <fcntl.h>
#include <grp.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstring>
#include <fstream>
#include <optional>
#include <sstream>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"

extern char** environ;

namespace hmoe::testing {

struct ChildOptions {
  // argv[0] is the path of the executable (no PATH lookup).
  std::vector<std::string> argv;
  // Added to (or replacing in) this process's environment.
  std::vector<std::pair<std::string, std::string>> env;
  // Files that receive the child's stdout / stderr (created or truncated, 0600). Empty: inherit.
  std::string stdout_path;
  std::string stderr_path;
  // Run the child as this uid/gid (supplementary groups dropped). Needs root.
  std::optional<uid_t> uid;
  std::optional<gid_t> gid;
};

// How a child ended.
struct ExitInfo {
  bool exited = false;  // exited normally with `code`
  int code = 0;
  int signal = 0;  // killed by this signal when !exited

  std::string ToString() const {
    return exited ? absl::StrCat("exit code ", code)
                  : absl::StrCat("killed by signal ", signal, " (", ::strsignal(signal), ")");
  }
};

class ChildProcess {
 public:
  static absl::StatusOr<ChildProcess> Start(ChildOptions options) {
    if (options.argv.empty()) return absl::InvalidArgumentError("ChildProcess: empty argv");
    // Everything the child needs is prepared before fork().
    std::vector<std::string> env_strings;
    for (char** e = environ; e != nullptr && *e != nullptr; ++e) {
      std::string entry(*e);
      const std::string key = entry.substr(0, entry.find('='));
      bool replaced = false;
      for (const auto& [k, v] : options.env) replaced = replaced || k == key;
      if (!replaced) env_strings.push_back(std::move(entry));
    }
    for (const auto& [k, v] : options.env) env_strings.push_back(absl::StrCat(k, "=", v));
    std::vector<char*> args, envp;
    for (std::string& a : options.argv) args.push_back(a.data());
    args.push_back(nullptr);
    for (std::string& e : env_strings) envp.push_back(e.data());
    envp.push_back(nullptr);
    const pid_t parent = ::getpid();

    const pid_t pid = ::fork();
    if (pid < 0) return absl::InternalError(absl::StrCat("fork: ", std::strerror(errno)));
    if (pid == 0) {
      ::prctl(PR_SET_PDEATHSIG, SIGKILL);
      if (::getppid() != parent) ::_exit(126);  // The test died before prctl took effect.
      sigset_t none;
      sigemptyset(&none);
      ::sigprocmask(SIG_SETMASK, &none, nullptr);  // Do not inherit blocked signals.
      if (!RedirectInChild(options.stdout_path, STDOUT_FILENO) ||
          !RedirectInChild(options.stderr_path, STDERR_FILENO)) {
        ::_exit(125);
      }
      if (options.gid.has_value() &&
          (::setgroups(0, nullptr) != 0 || ::setgid(*options.gid) != 0)) {
        ::_exit(124);
      }
      if (options.uid.has_value() && ::setuid(*options.uid) != 0) ::_exit(124);
      ::execve(args[0], args.data(), envp.data());
      ::_exit(127);  // Only reached if exec failed.
    }
    return ChildProcess(pid, std::move(options.stdout_path), std::move(options.stderr_path));
  }

  static absl::StatusOr<ChildProcess> Start(std::vector<std::string> argv) {
    ChildOptions options;
    options.argv = std::move(argv);
    return Start(std::move(options));
  }

  ChildProcess(ChildProcess&& other) noexcept
      : pid_(std::exchange(other.pid_, -1)),
        exit_(std::move(other.exit_)),
        stdout_path_(std::move(other.stdout_path_)),
        stderr_path_(std::move(other.stderr_path_)) {}
  ChildProcess& operator=(ChildProcess&& other) noexcept {
    if (this != &other) {
      KillAndReap();
      pid_ = std::exchange(other.pid_, -1);
      exit_ = std::move(other.exit_);
      stdout_path_ = std::move(other.stdout_path_);
      stderr_path_ = std::move(other.stderr_path_);
    }
    return *this;
  }
  ChildProcess(const ChildProcess&) = delete;
  ChildProcess& operator=(const ChildProcess&) = delete;
  ~ChildProcess() { KillAndReap(); }

  pid_t pid() const { return pid_; }

  // True while the child has not exited (reaps it when it has).
  bool Running() {
    if (pid_ < 0 || exit_.has_value()) return false;
    int status = 0;
    const pid_t r = ::waitpid(pid_, &status, WNOHANG);
    if (r == pid_) {
      Record(status);
      return false;
    }
    return r == 0;
  }

  // How the child ended, once it has (nullopt while running).
  const std::optional<ExitInfo>& exit_info() const { return exit_; }

  absl::Status Signal(int sig) {
    if (pid_ < 0 || exit_.has_value()) return absl::FailedPreconditionError("child already reaped");
    if (::kill(pid_, sig) != 0)
      return absl::InternalError(absl::StrCat("kill: ", std::strerror(errno)));
    return absl::OkStatus();
  }

  // Waits for the child to end by itself. DeadlineExceeded after `timeout` (it keeps running).
  absl::StatusOr<ExitInfo> Wait(std::chrono::milliseconds timeout) {
    if (exit_.has_value()) return *exit_;
    const auto deadline = std::chrono::steady_clock::now() + timeout;
    while (Running()) {
      if (std::chrono::steady_clock::now() > deadline) {
        return absl::DeadlineExceededError(
            absl::StrCat("pid ", pid_, " still running after ", timeout.count(), " ms"));
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
    }
    if (!exit_.has_value()) return absl::InternalError("waitpid failed");
    return *exit_;
  }

  // Waits for a normal exit and returns its code; Internal when killed by a signal.
  absl::StatusOr<int> WaitForExit(std::chrono::milliseconds timeout) {
    absl::StatusOr<ExitInfo> info = Wait(timeout);
    if (!info.ok()) return info.status();
    if (!info->exited) return absl::InternalError(absl::StrCat("child ", info->ToString()));
    return info->code;
  }

  // Sends SIGTERM (what supervisord sends) and returns the exit code. DeadlineExceeded if the
  // child ignores it for `timeout` (it is then SIGKILLed); Internal if it dies from a signal.
  absl::StatusOr<int> Terminate(std::chrono::milliseconds timeout) {
    if (Running()) {
      (void)Signal(SIGTERM);
    }
    absl::StatusOr<int> code = WaitForExit(timeout);
    if (absl::IsDeadlineExceeded(code.status())) {
      (void)Kill();
      return absl::DeadlineExceededError(
          absl::StrCat("pid ", pid_, " ignored SIGTERM for ", timeout.count(), " ms"));
    }
    return code;
  }

  // SIGKILL, then reap.
  absl::Status Kill() {
    if (!Running()) return absl::OkStatus();
    (void)Signal(SIGKILL);
    absl::StatusOr<ExitInfo> info = Wait(std::chrono::seconds(10));
    return info.status();
  }

  // What the child wrote so far to the redirected stdout / stderr files.
  std::string ReadStdout() const { return ReadFile(stdout_path_); }
  std::string ReadStderr() const { return ReadFile(stderr_path_); }
  const std::string& stdout_path() const { return stdout_path_; }
  const std::string& stderr_path() const { return stderr_path_; }

  // Polls the redirected stdout (or stderr) until it contains `text`. FailedPrecondition when the
  // child exits first, DeadlineExceeded after `timeout`.
  absl::Status WaitForOutput(const std::string& text, std::chrono::milliseconds timeout,
                             bool from_stderr = false) {
    const auto deadline = std::chrono::steady_clock::now() + timeout;
    while (true) {
      const std::string out = from_stderr ? ReadStderr() : ReadStdout();
      if (out.find(text) != std::string::npos) return absl::OkStatus();
      if (!Running()) {
        return absl::FailedPreconditionError(
            absl::StrCat("child exited (", exit_.has_value() ? exit_->ToString() : "?",
                         ") before printing \"", text, "\""));
      }
      if (std::chrono::steady_clock::now() > deadline) {
        return absl::DeadlineExceededError(
            absl::StrCat("no \"", text, "\" after ", timeout.count(), " ms"));
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
  }

 private:
  ChildProcess(pid_t pid, std::string stdout_path, std::string stderr_path)
      : pid_(pid), stdout_path_(std::move(stdout_path)), stderr_path_(std::move(stderr_path)) {}

  static bool RedirectInChild(const std::string& path, int target_fd) {
    if (path.empty()) return true;
    const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_APPEND, 0600);
    if (fd < 0) return false;
    if (::dup2(fd, target_fd) < 0) return false;
    ::close(fd);
    return true;
  }

  static std::string ReadFile(const std::string& path) {
    if (path.empty()) return "";
    std::ifstream in(path);
    std::stringstream ss;
    ss << in.rdbuf();
    return ss.str();
  }

  void Record(int status) {
    ExitInfo info;
    if (WIFEXITED(status)) {
      info.exited = true;
      info.code = WEXITSTATUS(status);
    } else if (WIFSIGNALED(status)) {
      info.signal = WTERMSIG(status);
    }
    exit_ = info;
  }

  void KillAndReap() {
    if (pid_ < 0 || exit_.has_value()) return;
    ::kill(pid_, SIGKILL);
    int status = 0;
    // Bounded: SIGKILL cannot be ignored; only an uninterruptible sleep in the kernel delays it.
    while (::waitpid(pid_, &status, 0) < 0 && errno == EINTR) {
    }
    Record(status);
  }

  pid_t pid_ = -1;
  std::optional<ExitInfo> exit_;
  std::string stdout_path_;
  std::string stderr_path_;
};

}  // namespace hmoe::testing
