#pragma once

// Runs the ranks of a collective group as forked child processes of a test.
//
//   std::vector<RankExit> exits = ForkRanks(3, [&](int rank) -> int { ...; return 0; });
//
// The body runs in a fresh child (fork, no exec) and its return value is the child's exit code;
// the child ends with _exit, so no test-framework teardown runs there. Children get
// PR_SET_PDEATHSIG (they die with the test) and are SIGKILLed when they outlive `timeout`. Fork
// only from a single-threaded test process (the gtest main thread, before any pool or other
// thread exists): the child inherits no threads.

#include <signal.h>
#include <sys/prctl.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <functional>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"

namespace hmoe::testing {

struct RankExit {
  bool exited = false;
  int code = -1;
  int signal = 0;
  bool timed_out = false;

  bool ok() const { return exited && code == 0; }
  std::string ToString() const {
    if (timed_out) return "timed out";
    return exited ? absl::StrCat("exit ", code) : absl::StrCat("signal ", signal);
  }
};

// A running child: pid plus wait helpers.
class ForkedChild {
 public:
  static ForkedChild Start(const std::function<int()>& body) {
    std::fflush(nullptr);
    const pid_t parent = ::getpid();
    const pid_t pid = ::fork();
    if (pid == 0) {
      ::prctl(PR_SET_PDEATHSIG, SIGKILL);
      if (::getppid() != parent) ::_exit(126);
      int code = body();
      std::fflush(nullptr);
      ::_exit(code);
    }
    return ForkedChild(pid);
  }

  pid_t pid() const { return pid_; }

  // Waits until the child ends or `timeout` passes (then SIGKILL).
  RankExit Wait(std::chrono::milliseconds timeout) {
    RankExit e;
    if (pid_ <= 0) return e;
    const auto deadline = std::chrono::steady_clock::now() + timeout;
    int status = 0;
    while (true) {
      const pid_t r = ::waitpid(pid_, &status, WNOHANG);
      if (r == pid_) break;
      if (std::chrono::steady_clock::now() > deadline) {
        ::kill(pid_, SIGKILL);
        ::waitpid(pid_, &status, 0);
        e.timed_out = true;
        break;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(2));
    }
    pid_ = -1;
    if (WIFEXITED(status)) {
      e.exited = true;
      e.code = WEXITSTATUS(status);
    } else if (WIFSIGNALED(status)) {
      e.signal = WTERMSIG(status);
    }
    return e;
  }

  ~ForkedChild() {
    if (pid_ > 0) {
      ::kill(pid_, SIGKILL);
      int status = 0;
      ::waitpid(pid_, &status, 0);
    }
  }
  ForkedChild(ForkedChild&& o) noexcept : pid_(o.pid_) { o.pid_ = -1; }
  ForkedChild& operator=(ForkedChild&& o) = delete;
  ForkedChild(const ForkedChild&) = delete;

 private:
  explicit ForkedChild(pid_t pid) : pid_(pid) {}
  pid_t pid_ = -1;
};

inline std::vector<RankExit> ForkRanks(
    int world, const std::function<int(int rank)>& body,
    std::chrono::milliseconds timeout = std::chrono::seconds(60)) {
  std::vector<ForkedChild> children;
  for (int r = 0; r < world; ++r)
    children.push_back(ForkedChild::Start([&, r] { return body(r); }));
  std::vector<RankExit> exits;
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  for (ForkedChild& c : children) {
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
        deadline - std::chrono::steady_clock::now());
    exits.push_back(c.Wait(std::max(left, std::chrono::milliseconds(1))));
  }
  return exits;
}

}  // namespace hmoe::testing
