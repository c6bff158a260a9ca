#include "common/kernels/cuda/cuda_backend.h"

#include <gtest/gtest.h>

namespace hmoe::cuda {
namespace {

TEST(CudaBackendTest, LibraryVersionsMatchBuildOption) {
  absl::StatusOr<std::string> versions = LibraryVersions();
  if (BuiltWithCuda()) {
    ASSERT_TRUE(versions.ok()) << versions.status();
    EXPECT_NE(versions->find("cudart"), std::string::npos) << *versions;
    EXPECT_NE(versions->find("nccl"), std::string::npos) << *versions;
  } else {
    EXPECT_EQ(versions.status().code(), absl::StatusCode::kUnavailable);
    EXPECT_EQ(DeviceCount(), 0);
  }
}

TEST(CudaBackendTest, NoDeviceReasonIsExplainedWhenNoDevice) {
  if (DeviceCount() == 0) {
    EXPECT_FALSE(NoDeviceReason().empty());
  } else {
    EXPECT_TRUE(NoDeviceReason().empty());
  }
}

}  // namespace
}  // namespace hmoe::cuda
