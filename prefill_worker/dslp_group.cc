#include "prefill_worker/dslp_group.h"

#include <algorithm>
#include <cstring>
#include <utility>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"

#include "common/base/logging.h"
#include "common/base/status_macros.h"
#include "common/comm/nccl_collective.h"
#include "common/comm/shm_collective.h"

namespace hmoe::prefill {
namespace {

constexpr size_t kMaxGroupIdBytes = 200;
constexpr size_t kNcclUniqueIdBytes = 128;

char KindByte(DeviceKind kind) { return kind == DeviceKind::kCuda ? 'g' : 'c'; }

// Every rank's device kind, all-gathered: FailedPrecondition when they differ.
absl::Status CheckSameDeviceKind(ShmCollective& shm, DeviceKind kind, const DslpGroupSpec& g) {
  const int world = shm.world_size();
  const char mine = KindByte(kind);
  std::vector<char> all(world, 0);
  std::vector<size_t> counts(world, 1), offsets(world);
  for (int p = 0; p < world; ++p) offsets[p] = p;
  HMOE_RETURN_IF_ERROR(shm.AllGatherV(&mine, all.data(), counts, offsets));
  for (int p = 0; p < world; ++p) {
    if (all[p] != mine) {
      return absl::FailedPreconditionError(absl::StrCat(
          "dslp group ", g.group_id, ": rank ", p, " runs on a ", all[p] == 'g' ? "cuda" : "cpu",
          " device and rank ", shm.rank(), " on a ", mine == 'g' ? "cuda" : "cpu",
          " device; the ranks of a group must share the device kind"));
    }
  }
  return absl::OkStatus();
}

// Joining failures caused by other ranks become Aborted (see GroupFailureStatus).
absl::Status JoinFailure(const absl::Status& s, const DslpGroupSpec& g) {
  if (absl::IsDeadlineExceeded(s) || absl::IsUnavailable(s)) {
    return absl::AbortedError(
        absl::StrCat("dslp group ", g.group_id, " did not form: ", s.message()));
  }
  return s;
}

}  // namespace

absl::Status ValidateDslpGroup(const DslpGroupSpec& g, DeviceKind device) {
  if (g.group_id.empty() || g.group_id.size() > kMaxGroupIdBytes) {
    return absl::InvalidArgumentError(
        absl::StrCat("dslp.group_id: must have 1..", kMaxGroupIdBytes, " characters"));
  }
  for (char c : g.group_id) {
    const bool ok = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') ||
                    c == '_' || c == '.' || c == '-' || c == ':';
    if (!ok) {
      return absl::InvalidArgumentError(
          absl::StrCat("dslp.group_id: \"", g.group_id, "\" must match [A-Za-z0-9_.:-]"));
    }
  }
  if (g.world_size < 1 || g.world_size > kMaxDslpWorldSize) {
    return absl::InvalidArgumentError(
        absl::StrCat("dslp.world_size: ", g.world_size, " outside [1, ", kMaxDslpWorldSize, "]"));
  }
  if (g.rank < 0 || g.rank >= g.world_size) {
    return absl::InvalidArgumentError(
        absl::StrCat("dslp.rank: ", g.rank, " outside [0, ", g.world_size, ")"));
  }
  if (!g.nccl_unique_id.empty()) {
    if (device != DeviceKind::kCuda) {
      return absl::InvalidArgumentError(
          "dslp.nccl_unique_id: given to a worker on a cpu device (CPU ranks meet in shared "
          "memory: dslp.shm_group)");
    }
    if (g.nccl_unique_id.size() != kNcclUniqueIdBytes) {
      return absl::InvalidArgumentError(
          absl::StrCat("dslp.nccl_unique_id: ", g.nccl_unique_id.size(), " bytes, expected ",
                       kNcclUniqueIdBytes));
    }
    return absl::OkStatus();
  }
  if (absl::Status s = ValidateShmGroupName(g.shm_group); !s.ok()) {
    return absl::InvalidArgumentError(absl::StrCat("dslp.shm_group: ", s.message()));
  }
  return absl::OkStatus();
}

absl::StatusOr<std::unique_ptr<Collective>> JoinDslpGroup(const DslpGroupSpec& g, DeviceKind device,
                                                          const DslpJoinOptions& options,
                                                          const std::atomic<bool>& cancelled) {
  HMOE_RETURN_IF_ERROR(ValidateDslpGroup(g, device));
  std::string nccl_id = g.nccl_unique_id;
  if (nccl_id.empty()) {
    ShmCollectiveOptions o;
    o.group_name = g.shm_group;
    o.rank = g.rank;
    o.world_size = g.world_size;
    o.channel_bytes = options.channel_bytes;
    o.join_timeout = options.join_timeout;
    o.peer_timeout = options.peer_timeout;
    // Relaxed: a flag polled while waiting; a late sighting only delays the cancel.
    o.cancelled = [&cancelled] { return cancelled.load(std::memory_order_relaxed); };
    absl::StatusOr<std::unique_ptr<ShmCollective>> shm = ShmCollective::Create(o);
    if (!shm.ok()) return JoinFailure(shm.status(), g);
    if (absl::Status s = CheckSameDeviceKind(**shm, device, g); !s.ok()) {
      return JoinFailure(s, g);
    }
    if (device != DeviceKind::kCuda) return std::unique_ptr<Collective>(*std::move(shm));
    // CUDA: rank 0 makes the NCCL id and all-gathers it; then the shared-memory group is left.
    std::string mine;
    if (g.rank == 0) {
      absl::StatusOr<std::string> id = NewNcclUniqueId();
      // Every rank must take part in the all-gather; rank 0 sends an empty id on failure.
      if (id.ok()) mine = *std::move(id);
      if (!id.ok()) HMOE_LOG(ERROR) << "dslp group " << g.group_id << ": " << id.status();
    }
    std::vector<size_t> counts(g.world_size, 0), offsets(g.world_size, 0);
    counts[0] = kNcclUniqueIdBytes;
    std::string all(kNcclUniqueIdBytes, '\0');
    std::string send = g.rank == 0 ? mine : std::string();
    send.resize(g.rank == 0 ? kNcclUniqueIdBytes : 0);
    const bool valid = g.rank != 0 || mine.size() == kNcclUniqueIdBytes;
    if (absl::Status s = (*shm)->AllGatherV(send.data(), all.data(), counts, offsets); !s.ok()) {
      return JoinFailure(s, g);
    }
    if (!valid || all == std::string(kNcclUniqueIdBytes, '\0')) {
      return absl::UnavailableError(absl::StrCat(
          "dslp group ", g.group_id, ": rank 0 could not create an NCCL id (built without NCCL?)"));
    }
    nccl_id = std::move(all);
  }
  NcclCollectiveOptions n;
  n.rank = g.rank;
  n.world_size = g.world_size;
  n.unique_id = std::move(nccl_id);
  n.cuda_ordinal = options.cuda_ordinal;
  n.peer_timeout = std::max(options.join_timeout, options.peer_timeout);
  absl::StatusOr<std::unique_ptr<Collective>> nccl = NewNcclCollective(n);
  if (!nccl.ok() && absl::IsUnavailable(nccl.status()) &&
      absl::StrContains(nccl.status().message(), "without")) {
    return nccl.status();  // not built in: not a group failure
  }
  if (!nccl.ok()) return JoinFailure(nccl.status(), g);
  return nccl;
}

absl::Status GroupFailureStatus(const absl::Status& status, const DslpGroupSpec& g) {
  if (!absl::IsUnavailable(status)) return status;
  return absl::AbortedError(absl::StrCat("dslp group ", g.group_id, " (rank ", g.rank, " of ",
                                         g.world_size, ") failed: ", status.message()));
}

}  // namespace hmoe::prefill
