// common/process without a daemon: the exit codes RunDaemon gives for what Run returns, the drain
// helper, and the owner-only socket directory.

#include <signal.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <string>

#include "absl/status/status.h"
#include "absl/time/clock.h"
#include <gtest/gtest.h>

#include "common/process/daemon.h"
#include "common/process/socket_path.h"

namespace hmoe::process {
namespace {

class TempDir {
 public:
  TempDir() {
    std::string pattern = ::testing::TempDir() + "/hmoe_process_XXXXXX";
    const char* made = ::mkdtemp(pattern.data());
    EXPECT_NE(made, nullptr);
    path_ = pattern;
  }
  ~TempDir() { std::system(("rm -rf '" + path_ + "'").c_str()); }
  const std::string& path() const { return path_; }
  std::string File(const std::string& name) const { return path_ + "/" + name; }

 private:
  std::string path_;
};

TEST(ProcessTest, ExitCodesFollowTheStatus) {
  EXPECT_EQ(ExitCode(absl::OkStatus()), kExitOk);
  EXPECT_EQ(ExitCode(absl::NotFoundError("no model")), kExitError);
  // An InvalidArgument that is not about the flags (a bad checkpoint) is a start-up error.
  EXPECT_EQ(ExitCode(absl::InvalidArgumentError("bad config.json")), kExitError);
  const absl::Status flag = FlagError("--threads must be >= 0");
  EXPECT_TRUE(absl::IsInvalidArgument(flag));
  EXPECT_EQ(flag.message(), "--threads must be >= 0");
  EXPECT_EQ(ExitCode(flag), kExitBadFlags);
  // Marking keeps the code and the message.
  const absl::Status marked = FlagError(absl::PermissionDeniedError("socket directory"));
  EXPECT_TRUE(absl::IsPermissionDenied(marked));
  EXPECT_EQ(ExitCode(marked), kExitBadFlags);
  EXPECT_FALSE(IsFlagError(FlagError(absl::OkStatus())));
}

TEST(ProcessTest, RunDaemonRejectsPositionalArguments) {
  char name[] = "daemon";
  char extra[] = "stray";
  char* argv[] = {name, extra};
  bool ran = false;
  EXPECT_EQ(RunDaemon(2, argv, {.usage = "daemon"},
                      [&ran](StopSignalWatcher&) {
                        ran = true;
                        return absl::OkStatus();
                      }),
            kExitBadFlags);
  EXPECT_FALSE(ran);
}

TEST(ProcessTest, RunWithStopSignalsMapsRunsStatus) {
  EXPECT_EQ(RunWithStopSignals(false, [](StopSignalWatcher&) { return FlagError("--x is bad"); }),
            kExitBadFlags);
  EXPECT_EQ(RunWithStopSignals(true,
                               [](StopSignalWatcher& s) {
                                 EXPECT_FALSE(s.StopRequested());
                                 EXPECT_FALSE(s.stop_flag()->load());
                                 return absl::UnavailableError("port in use");
                               }),
            kExitError);
  EXPECT_EQ(RunWithStopSignals(false, [](StopSignalWatcher&) { return absl::OkStatus(); }),
            kExitOk);
}

TEST(ProcessTest, SigtermRequestsTheStop) {
  EXPECT_EQ(RunWithStopSignals(false,
                               [](StopSignalWatcher& s) {
                                 ::kill(::getpid(), SIGTERM);  // blocked: taken by the watcher
                                 s.WaitForStop();
                                 EXPECT_TRUE(s.stop_flag()->load());
                                 return absl::OkStatus();
                               }),
            kExitOk);
}

TEST(ProcessTest, WaitUntilReturnsWhetherTheDrainFinished) {
  int calls = 0;
  EXPECT_TRUE(WaitUntil(absl::InfiniteFuture(), [&calls] { return ++calls == 3; }));
  EXPECT_EQ(calls, 3);
  // A deadline in the past: `done` is asked once, then the drain gives up.
  calls = 0;
  EXPECT_FALSE(WaitUntil(absl::InfinitePast(), [&calls] {
    ++calls;
    return false;
  }));
  EXPECT_EQ(calls, 1);
}

TEST(ProcessTest, SocketDirectoryMustBeOwnerOnly) {
  TempDir dir;
  // Created 0700 when missing.
  const std::string fresh = dir.File("fresh/w.sock");
  ASSERT_TRUE(PrepareSocketPath("--socket", fresh).ok());
  struct stat st {};
  ASSERT_EQ(::stat(dir.File("fresh").c_str(), &st), 0);
  EXPECT_EQ(st.st_mode & 0777, 0700u);
  // An existing directory open to others is refused.
  const std::string open_dir = dir.File("open");
  ASSERT_EQ(::mkdir(open_dir.c_str(), 0755), 0);
  ASSERT_EQ(::chmod(open_dir.c_str(), 0755), 0);
  absl::Status s = PrepareSocketPath("--socket", open_dir + "/w.sock");
  EXPECT_TRUE(absl::IsPermissionDenied(s)) << s;
  // Bad paths, named by their flag.
  s = PrepareSocketPath("--registry-socket", "relative.sock");
  EXPECT_TRUE(absl::IsInvalidArgument(s));
  EXPECT_NE(s.message().find("--registry-socket"), std::string::npos) << s;
  s = PrepareSocketPath("--socket", "");
  EXPECT_TRUE(absl::IsInvalidArgument(s));
  EXPECT_EQ(s.message(), "--socket PATH is required");
  EXPECT_TRUE(absl::IsInvalidArgument(PrepareSocketPath("--socket", "/" + std::string(200, 'a'))));
  EXPECT_TRUE(absl::IsInvalidArgument(PrepareSocketPath("--socket", dir.path() + "/")));
  // A regular file where the socket should be is not removed.
  const std::string file = dir.File("fresh/file.sock");
  {
    std::FILE* f = std::fopen(file.c_str(), "w");
    ASSERT_NE(f, nullptr);
    std::fclose(f);
  }
  EXPECT_TRUE(absl::IsInvalidArgument(PrepareSocketPath("--socket", file)));
  EXPECT_EQ(::access(file.c_str(), F_OK), 0);
}

}  // namespace
}  // namespace hmoe::process
