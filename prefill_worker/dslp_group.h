#pragma once

// A prefill worker as one rank of a DSLP group (paper §3.2, docs/dslp.md): the group a Prefill
// request names (proto/prefill.proto DslpGroup), its validation, and joining it.
//
// Groups are formed by the router: every rank of a group receives the same request with its own
// rank, the group's world size and its rendezvous, and a group incarnation serves one request
// (the router names a new one for every DSLP request, so a group whose member died is never
// reused: "the group re-forms"). The collective depends on the device:
//   - CPU device: a ShmCollective named `shm_group` (/dev/shm/hmoe.comm.<shm_group>, 0600,
//     owner-only; see common/comm/shm_collective.h);
//   - CUDA device: an NcclCollective. Its rendezvous is `nccl_unique_id` when the request carries
//     one; otherwise the ranks meet in the ShmCollective `shm_group` first, rank 0 creates the
//     NCCL id and all-gathers it, and the shared-memory group is left (one node).
// Either way the ranks first all-gather their device kind over shared memory, so a group mixing
// CPU and CUDA ranks fails with FailedPrecondition instead of a collective mismatch.
//
// A failed group leaves nothing behind: the shared-memory object is unlinked once every rank has
// attached, a rank that gives up unlinks the name of its group (RemoveShmGroup), and the worker
// removes objects of dead creators at start-up (RemoveStaleShmGroups).

#include <atomic>
#include <cstdint>
#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"

#include "common/comm/collective.h"
#include "common/device/device.h"
#include "common/dslp/dslp.h"

namespace hmoe::prefill {

// The DslpGroup of a PrefillRequest.
struct DslpGroupSpec {
  std::string group_id;
  int rank = 0;
  int world_size = 1;
  std::string shm_group;
  std::string nccl_unique_id;  // raw bytes; empty: bootstrap over shm_group
  // Unset: the worker's default (--dslp-ep-mode).
  bool ep_mode_set = false;
  EpMode ep_mode = EpMode::kSmallEp;
};

// Largest DSLP group a worker accepts.
inline constexpr int kMaxDslpWorldSize = 64;

// InvalidArgument naming the field ("dslp.rank", "dslp.shm_group", ...) unless: group_id is
// 1..200 characters of [A-Za-z0-9_.:-]; 1 <= world_size <= kMaxDslpWorldSize; 0 <= rank <
// world_size; shm_group is a valid shared-memory group name (required unless a CUDA device gets
// an nccl_unique_id); nccl_unique_id is empty or 128 bytes (and only for a CUDA device).
absl::Status ValidateDslpGroup(const DslpGroupSpec& group, DeviceKind device);

struct DslpJoinOptions {
  // How long a rank waits for the whole group to form.
  absl::Duration join_timeout = absl::Seconds(30);
  // A peer silent this long is dead (ShmCollectiveOptions::peer_timeout; NCCL's timeout).
  absl::Duration peer_timeout = absl::Seconds(5);
  // Byte ring per ordered pair of ranks of a ShmCollective.
  size_t channel_bytes = 4u << 20;
  // CUDA device ordinal of this rank (NCCL).
  int cuda_ordinal = 0;
};

// Joins `group` (validated) as the collective of a rank on `device`'s kind. `cancelled` is polled
// while waiting for peers (also later, inside the ShmCollective's collectives) and must outlive
// the collective. Errors: Cancelled; Aborted when the group did not form (a peer did not join in
// time or died while joining: the message names it); FailedPrecondition for a group mixing device
// kinds; Unavailable when NCCL is not built in; PermissionDenied for a shared-memory object of
// another user; Internal.
absl::StatusOr<std::unique_ptr<Collective>> JoinDslpGroup(const DslpGroupSpec& group,
                                                          DeviceKind device,
                                                          const DslpJoinOptions& options,
                                                          const std::atomic<bool>& cancelled);

// The status a rank answers for a DSLP prefill that failed with `status`: the collective's
// Unavailable (a peer died, left, gave up or stopped responding: the group is broken) becomes
// Aborted ("dslp group <id>: ..."), so the router can tell a live rank reporting a broken group
// from a rank that is gone itself (whose call fails with the transport's UNAVAILABLE). Anything
// else is returned unchanged.
absl::Status GroupFailureStatus(const absl::Status& status, const DslpGroupSpec& group);

}  // namespace hmoe::prefill
