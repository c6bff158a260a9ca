#pragma once

// Collectives between the ranks of a DSLP group (docs/architecture.md "Libraries", paper §3.2): the
// workers of a distributed stream-loading prefill exchange KV chunks (ring pass-KV), tokens
// (all-gather, all-to-all dispatch) and expert results (all-to-all combine) through this one
// interface. Implementations: ShmCollective (processes on one node, through POSIX shared memory;
// CPU-device prefill workers and the tests) and NcclCollective (GPUs; NCCL's transports).
//
// Semantics shared by every implementation:
// - SPMD: every rank of the group calls the same collectives in the same order with matching
//   sizes (a rank's send size to p equals p's receive size from that rank). A mismatch is a bug
//   of the caller; implementations that can detect it return Internal and fail the group.
// - Buffers are device pointers of the group's device (host memory for a CPU device), passed with
//   the Stream their producers and consumers run on: the collective runs after the work enqueued
//   on `stream` so far and work enqueued after the call sees its results. ShmCollective runs
//   synchronously on the host (like CpuDevice): the call returns when this rank's part is done.
// - Failure: when a peer dies, leaves, or stops responding, the current collective (and every
//   later one) fails with Unavailable naming the peer, within a bounded time (the implementation's
//   peer timeout), instead of hanging. A failed group is not repaired: its members create a new
//   group (a new rendezvous name / NCCL id) — "the group re-forms".
// - Byte counters: payload bytes this rank sent to / received from each peer, for the
//   communication-volume formulas of paper §3.2 (self copies are not counted).
//
// Thread-compatibility: a Collective is driven by one thread at a time.

#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "absl/status/status.h"

#include "common/device/device.h"

namespace hmoe {

// Payload bytes exchanged with each peer (index = peer rank; own index stays 0).
struct CommCounters {
  std::vector<uint64_t> bytes_sent;
  std::vector<uint64_t> bytes_received;
  uint64_t num_ops = 0;

  uint64_t total_sent() const;
  uint64_t total_received() const;
  // this - earlier, element-wise (both of the same group).
  CommCounters Minus(const CommCounters& earlier) const;
};

class Collective {
 public:
  virtual ~Collective() = default;

  virtual int rank() const = 0;
  virtual int world_size() const = 0;
  // "shm:<group>" or "nccl", for logs.
  virtual std::string description() const = 0;

  // All-gather with per-rank sizes: rank r contributes counts[r] bytes from `send`; afterwards
  // recv + offsets[p] holds rank p's counts[p] bytes for every p (this rank's own included).
  // counts/offsets have world_size() entries and are identical on every rank; the regions of
  // `recv` must not overlap each other or `send`.
  virtual absl::Status AllGatherV(Stream& stream, const void* send, void* recv,
                                  std::span<const size_t> counts,
                                  std::span<const size_t> offsets) = 0;

  // All-to-all with per-pair sizes: this rank sends send + send_offsets[p] (send_counts[p] bytes)
  // to every rank p (to itself: a local copy) and receives recv_counts[p] bytes from every p into
  // recv + recv_offsets[p]. send_counts[p] on rank r equals recv_counts[r] on rank p. Spans have
  // world_size() entries; receive regions must not overlap each other or the send buffer.
  virtual absl::Status AllToAllV(Stream& stream, const void* send,
                                 std::span<const size_t> send_counts,
                                 std::span<const size_t> send_offsets, void* recv,
                                 std::span<const size_t> recv_counts,
                                 std::span<const size_t> recv_offsets) = 0;

  // One step of a ring: sends send_bytes to rank (rank + 1) % S and receives recv_bytes from
  // rank (rank - 1 + S) % S, concurrently (no deadlock for any sizes). `send` and `recv` must not
  // overlap. With S == 1 the bytes are copied locally (send_bytes == recv_bytes).
  virtual absl::Status RingSendRecv(Stream& stream, const void* send, size_t send_bytes, void* recv,
                                    size_t recv_bytes) = 0;

  // Element-wise sum of `count` F32 values over all ranks; every rank receives the same bits.
  // `recv` may alias `send`.
  virtual absl::Status AllReduceSum(Stream& stream, const float* send, float* recv,
                                    size_t count) = 0;

  // Returns once every rank has entered the barrier (host synchronous).
  virtual absl::Status Barrier() = 0;

  virtual CommCounters counters() const = 0;
  virtual void ResetCounters() = 0;
};

// InvalidArgument unless the spans have world_size entries and every region [offsets[p],
// offsets[p] + counts[p]) is well-formed. Used by implementations.
absl::Status ValidateLayout(int world_size, std::span<const size_t> counts,
                            std::span<const size_t> offsets, const char* what);

}  // namespace hmoe
