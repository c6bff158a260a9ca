#pragma once

// NcclCollective: the Collective of GPU ranks (one CUDA device per rank), on NCCL. Built with the
// CUDA option; without it (nccl_collective_stub.cc) every function returns Unavailable, so callers
// need no #ifdef. Portable header: no CUDA or NCCL includes.
//
// Rendezvous: one party (the router, or rank 0) calls NewNcclUniqueId() and hands the bytes to
// every rank (DslpGroup.nccl_unique_id); each rank then calls NewNcclCollective with its rank.
//
// Collectives are enqueued on the caller's stream (a CudaDevice stream of the rank's device):
// all-gather-v and all-to-all-v are grouped ncclSend/ncclRecv, the ring step one grouped
// send/recv pair, the all-reduce ncclAllReduce. The communicator is non-blocking (NCCL config
// blocking = 0): initialization and every call poll ncclCommGetAsyncError, and with
// `synchronous` (the default) each collective also waits for its stream, so a peer that died or
// hung turns into Unavailable after `peer_timeout` (the communicator is aborted: the group must
// re-form) instead of a hang.

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "absl/time/time.h"

#include "common/comm/collective.h"

namespace hmoe {

struct NcclCollectiveOptions {
  int rank = 0;
  int world_size = 1;
  // The raw bytes of an ncclUniqueId (128 bytes) from NewNcclUniqueId, identical on every rank.
  std::string unique_id;
  // The CUDA device of this rank.
  int cuda_ordinal = 0;
  // Bound of communicator initialization and of each collective (with `synchronous`).
  absl::Duration peer_timeout = absl::Seconds(60);
  // Wait for each collective to finish before returning (bounded, detects dead peers).
  bool synchronous = true;
};

// A fresh rendezvous id (raw bytes). Unavailable without CUDA/NCCL.
absl::StatusOr<std::string> NewNcclUniqueId();

// Joins the communicator. InvalidArgument for bad rank/size/id, Unavailable without CUDA or when
// the group does not form within peer_timeout, Internal for other NCCL/CUDA errors.
absl::StatusOr<std::unique_ptr<Collective>> NewNcclCollective(const NcclCollectiveOptions& options);

}  // namespace hmoe
