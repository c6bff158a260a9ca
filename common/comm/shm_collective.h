#pragma once

// ShmCollective: the Collective of processes on one node, through one POSIX shared-memory object
// per group (/dev/shm/hmoe.comm.<group>), used by CPU-device DSLP ranks and the tests.
//
// Layout (created by rank 0, 0600, owner-only; ranks > 0 refuse an object owned by another user
// or accessible to group/others): a header, one slot per rank (pid, state, heartbeat, a futex
// "doorbell"), and one single-producer single-consumer byte ring ("channel") per ordered pair of
// ranks. Every message is a 16-byte header (collective sequence number, payload bytes) followed
// by its payload; a receiver checks both against what it expects (Internal on a mismatch: the
// ranks called different collectives). A rank that writes to or drains a channel rings the peer's
// doorbell (futex wake); a rank that cannot progress sleeps on its own doorbell for at most
// `poll_interval` and then checks its peers.
//
// Group formation: rank 0 creates the object (removing a stale object of the same name left by a
// crashed group) and initializes it; ranks > 0 wait for it to appear (until `join_timeout`), check
// its owner, size and world size, and claim their slot; everyone then waits for all ranks to
// attach. Once all have attached the name is unlinked (the mappings stay), so a later crash leaks
// nothing. Group names are per incarnation: a re-formed group uses a new name.
//
// Failure detection: a peer is dead when its process is gone (kill(pid, 0) fails, or it is a
// zombie), when it left the group (its ShmCollective was destroyed) while this rank still needs
// it, or when its heartbeat (refreshed every peer_timeout / 4 by a thread of each rank) is older
// than `peer_timeout`. The rank that notices marks the whole group failed and wakes everyone: the
// current collective of every rank returns Unavailable naming the peer, and so does every later
// call. `op_timeout` (default: none) bounds one collective (DeadlineExceeded, group failed).
//
// Buffers are host memory (a CPU device's memory); collectives run synchronously in the calling
// thread (the Stream arguments are not used: CpuDevice work is complete when enqueued).

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <stop_token>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"

#include "common/comm/collective.h"

namespace hmoe {

struct ShmCollectiveOptions {
  // [A-Za-z0-9_.-]{1,200}; the object is /dev/shm/hmoe.comm.<group_name>.
  std::string group_name;
  int rank = 0;
  int world_size = 1;
  // Capacity of each channel's byte ring (world_size * (world_size - 1) of them). Messages of any
  // size stream through it; larger rings mean fewer wake-ups. At least 4096.
  size_t channel_bytes = 4u << 20;
  // How long Create waits for the group to form (the object to appear, all ranks to attach).
  absl::Duration join_timeout = absl::Seconds(30);
  // A peer whose heartbeat is older than this is dead.
  absl::Duration peer_timeout = absl::Seconds(5);
  // Longest sleep of a waiting rank before it checks its peers.
  absl::Duration poll_interval = absl::Milliseconds(20);
  // Bound of one collective; infinite: none (dead peers are still detected).
  absl::Duration op_timeout = absl::InfiniteDuration();
  // When set, polled while Create waits for the group to form and while a collective waits for
  // its peers (at least every poll_interval): once it returns true, Create returns Cancelled, and
  // so does the collective, which fails the group (the peers' collectives return Unavailable:
  // "rank r gave up (cancelled)"). For a request the caller cancels while its peers still run.
  std::function<bool()> cancelled;
};

// InvalidArgument unless `name` matches [A-Za-z0-9_.-]{1,200}.
absl::Status ValidateShmGroupName(absl::string_view name);
// "/hmoe.comm.<group_name>" (the shm_open name).
std::string ShmGroupObjectName(absl::string_view group_name);

// Removes the shared-memory object of group `group_name` if it still exists (a group that never
// formed: a rank that died before every rank attached leaves it behind). Harmless for a group
// that formed (its name is already gone); breaks a group still forming (the ranks that have not
// attached yet time out), so call it only for a group that failed. Returns whether an object was
// removed; InvalidArgument for a bad name, Internal for other errors than "not there".
absl::StatusOr<bool> RemoveShmGroup(absl::string_view group_name);

// Removes every /dev/shm/hmoe.comm.* object of this user whose creator (rank 0) is dead: left by
// groups whose ranks all died before the group formed. Objects of other users, of live creators
// and objects still being initialized are kept. Returns how many were removed.
absl::StatusOr<int> RemoveStaleShmGroups();

class ShmCollective final : public Collective {
 public:
  // Joins (rank 0: creates) the group; returns once every rank has attached. Errors:
  // InvalidArgument (bad name, rank or sizes; world size or channel size differing from the
  // creator's), PermissionDenied (object of another user or with group/other access),
  // AlreadyExists (the rank's slot is taken by a live process), DeadlineExceeded (the group did
  // not form within join_timeout), Unavailable (a rank died while forming), Internal (system
  // calls).
  static absl::StatusOr<std::unique_ptr<ShmCollective>> Create(const ShmCollectiveOptions& options);

  // Leaves the group: marks this rank departed (peers still waiting for it fail with
  // Unavailable), stops the heartbeat, unmaps.
  ~ShmCollective() override;
  ShmCollective(const ShmCollective&) = delete;
  ShmCollective& operator=(const ShmCollective&) = delete;

  int rank() const override { return rank_; }
  int world_size() const override { return world_size_; }
  std::string description() const override;

  absl::Status AllGatherV(Stream& stream, const void* send, void* recv,
                          std::span<const size_t> counts, std::span<const size_t> offsets) override;
  absl::Status AllToAllV(Stream& stream, const void* send, std::span<const size_t> send_counts,
                         std::span<const size_t> send_offsets, void* recv,
                         std::span<const size_t> recv_counts,
                         std::span<const size_t> recv_offsets) override;
  absl::Status RingSendRecv(Stream& stream, const void* send, size_t send_bytes, void* recv,
                            size_t recv_bytes) override;
  absl::Status AllReduceSum(Stream& stream, const float* send, float* recv, size_t count) override;
  absl::Status Barrier() override;

  CommCounters counters() const override { return counters_; }
  void ResetCounters() override;

  // Host-memory variants (the Stream-taking methods forward to these).
  absl::Status AllGatherV(const void* send, void* recv, std::span<const size_t> counts,
                          std::span<const size_t> offsets);
  absl::Status AllToAllV(const void* send, std::span<const size_t> send_counts,
                         std::span<const size_t> send_offsets, void* recv,
                         std::span<const size_t> recv_counts, std::span<const size_t> recv_offsets);
  absl::Status RingSendRecv(const void* send, size_t send_bytes, void* recv, size_t recv_bytes);
  absl::Status AllReduceSum(const float* send, float* recv, size_t count);

  // Whether the group has failed (a peer died or left mid-collective, a mismatch, a timeout).
  bool failed() const;

 private:
  struct Mapping;
  struct Transfer;

  ShmCollective(const ShmCollectiveOptions& options, std::unique_ptr<Mapping> mapping);
  static absl::StatusOr<std::unique_ptr<Mapping>> MapFd(int fd, const std::string& name,
                                                        size_t size);
  absl::Status Join(absl::Time deadline);
  void HeartbeatLoop(std::stop_token stop);
  // Runs the sends and receives of one collective to completion (or failure).
  absl::Status Exchange(std::vector<Transfer>& sends, std::vector<Transfer>& recvs);
  // The first peer of `peers` that died, left or stopped responding, and why; {-1, 0} if none.
  std::pair<int, int> FindFailedPeer(const std::vector<int>& peers) const;
  absl::Status GroupFailure() const;
  void FailGroup(int culprit, int reason);
  void Ring(int peer);

  const ShmCollectiveOptions options_;
  const int rank_;
  const int world_size_;
  std::unique_ptr<Mapping> mapping_;
  uint64_t op_seq_ = 0;
  CommCounters counters_;
  std::jthread heartbeat_;
};

}  // namespace hmoe
