// ClaimUnixSocketPath: a stale socket is taken over, a live one is refused (issue #16: a second
// server on a unix socket path in use must refuse to start, not unlink the first one's socket).

#include "common/base/unix_socket.h"

#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <cstdlib>
#include <cstring>
#include <fstream>
#include <string>

#include "absl/strings/str_cat.h"
#include <gmock/gmock.h>
#include <gtest/gtest.h>

namespace hmoe {
namespace {

// A listening (or, with listen = false, bound but not listening) unix socket at `path`.
int BindAt(const std::string& path, bool listen) {
  const int fd = ::socket(AF_UNIX, SOCK_STREAM, 0);
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  std::strncpy(addr.sun_path, path.c_str(), sizeof(addr.sun_path) - 1);
  EXPECT_EQ(::bind(fd, reinterpret_cast<const sockaddr*>(&addr), sizeof(addr)), 0)
      << std::strerror(errno);
  if (listen) {
    EXPECT_EQ(::listen(fd, 4), 0);
  }
  return fd;
}

bool Exists(const std::string& path) {
  struct stat st {};
  return ::lstat(path.c_str(), &st) == 0;
}

class ClaimUnixSocketPathTest : public ::testing::Test {
 protected:
  void SetUp() override {
    char tmpl[] = "/tmp/hmoe_sock.XXXXXX";
    ASSERT_NE(::mkdtemp(tmpl), nullptr);
    dir_ = tmpl;
    path_ = dir_ + "/s.sock";
  }
  void TearDown() override {
    ::unlink(path_.c_str());
    ::unlink((dir_ + "/file").c_str());
    ::rmdir(dir_.c_str());
  }
  std::string dir_, path_;
};

TEST_F(ClaimUnixSocketPathTest, NothingThereIsOk) {
  EXPECT_TRUE(ClaimUnixSocketPath(path_, "--socket").ok());
}

TEST_F(ClaimUnixSocketPathTest, ASocketAServerAcceptsOnIsRefusedAndKept) {
  const int fd = BindAt(path_, /*listen=*/true);
  const absl::Status s = ClaimUnixSocketPath(path_, "--socket");
  EXPECT_TRUE(absl::IsFailedPrecondition(s)) << s;
  EXPECT_THAT(std::string(s.message()), ::testing::HasSubstr(path_ + " is in use"));
  EXPECT_THAT(std::string(s.message()), ::testing::HasSubstr("--socket"));
  EXPECT_TRUE(Exists(path_)) << "the running server's socket was removed";
  ::close(fd);
}

TEST_F(ClaimUnixSocketPathTest, AStaleSocketIsRemoved) {
  ::close(BindAt(path_, /*listen=*/true));  // The file stays; nothing accepts any more.
  ASSERT_TRUE(Exists(path_));
  EXPECT_TRUE(ClaimUnixSocketPath(path_, "--socket").ok());
  EXPECT_FALSE(Exists(path_));
  // Bound but never listening (a server that died between bind and listen) is stale too.
  const int fd = BindAt(path_, /*listen=*/false);
  EXPECT_TRUE(ClaimUnixSocketPath(path_, "--socket").ok());
  EXPECT_FALSE(Exists(path_));
  ::close(fd);
}

TEST_F(ClaimUnixSocketPathTest, AFileThatIsNotASocketIsInvalidArgumentAndKept) {
  const std::string file = dir_ + "/file";
  std::ofstream(file) << "x";
  const absl::Status s = ClaimUnixSocketPath(file, "--registry-socket");
  EXPECT_TRUE(absl::IsInvalidArgument(s)) << s;
  EXPECT_THAT(std::string(s.message()), ::testing::HasSubstr("--registry-socket: " + file));
  EXPECT_TRUE(Exists(file));
}

}  // namespace
}  // namespace hmoe
