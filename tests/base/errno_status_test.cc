// ErrnoStatus (common/base/errno_status.h): the message and the code of a failed system call.

#include "common/base/errno_status.h"

#include <cerrno>
#include <cstring>
#include <string>

#include <gtest/gtest.h>

namespace hmoe {
namespace {

TEST(ErrnoStatusTest, MessageNamesTheCallAndTheError) {
  const absl::Status s = ErrnoStatus(ENOENT, "open /x");
  EXPECT_EQ(s.message(), std::string("open /x: ") + std::strerror(ENOENT));
}

TEST(ErrnoStatusTest, CodesSayWhatTheCallerCanDo) {
  EXPECT_EQ(ErrnoStatus(ENOENT, "a").code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(ErrnoStatus(EIDRM, "a").code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(ErrnoStatus(EEXIST, "a").code(), absl::StatusCode::kAlreadyExists);
  EXPECT_EQ(ErrnoStatus(EACCES, "a").code(), absl::StatusCode::kPermissionDenied);
  EXPECT_EQ(ErrnoStatus(EPERM, "a").code(), absl::StatusCode::kPermissionDenied);
  EXPECT_EQ(ErrnoStatus(ENOMEM, "a").code(), absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(ErrnoStatus(ENOSPC, "a").code(), absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(ErrnoStatus(EINVAL, "a").code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(ErrnoStatus(EIO, "a").code(), absl::StatusCode::kInternal);
}

}  // namespace
}  // namespace hmoe
