// Linked instead of nccl_collective.cc when the build has no CUDA (HMOE_WITH_CUDA off), so
// callers and headers never need an #ifdef.

#include "common/comm/nccl_collective.h"

namespace hmoe {

absl::StatusOr<std::string> NewNcclUniqueId() {
  return absl::UnavailableError("nccl: built without CUDA (HMOE_CUDA=OFF or no nvcc)");
}

absl::StatusOr<std::unique_ptr<Collective>> NewNcclCollective(
    const NcclCollectiveOptions& /*options*/) {
  return absl::UnavailableError("nccl: built without CUDA (HMOE_CUDA=OFF or no nvcc)");
}

}  // namespace hmoe
