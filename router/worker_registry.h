#pragma once

// The router's view of its workers (ARCHITECTURE.md "Failure model"). Workers Register when
// ready and Heartbeat periodically (proto/worker_registry.proto); a worker whose last heartbeat is
// older than the timeout is dead until it registers again. Registering again (a restart) bumps the
// worker's incarnation, so a request that was running on the old process can tell. State is
// computed from the clock on every query, so there is no background thread. Thread-safe.

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"

#include "router/clock.h"

namespace hmoe::router {

enum class WorkerKind { kPrefill, kDecode };
enum class WorkerState { kLive, kDraining, kDead };

// What a worker reports about itself (RegisterRequest).
struct WorkerIdentity {
  std::string worker_id;
  WorkerKind kind = WorkerKind::kDecode;
  // gRPC target, e.g. "unix:/run/hmoe/decode.sock".
  std::string endpoint;
  // "cpu" or "cuda:N"; workers with equal strings share a device.
  std::string device;
  int64_t pid = 0;
  std::string model;
  int64_t start_unix_ms = 0;
};

// The load a worker reports in each heartbeat.
struct WorkerLoad {
  bool draining = false;
  int32_t running = 0;
  int32_t waiting = 0;
  int32_t batch_size = 0;
  // Admitted requests that may wait for a batch slot (0: not reported).
  int32_t max_waiting = 0;
  int64_t kv_blocks_free = 0;
  int64_t kv_blocks_total = 0;
  double tokens_per_second = 0;
  // Decode workers' prefix cache: tokens held; since start: tokens reused, hits, evicted blocks.
  int64_t prefix_cache_tokens = 0;
  int64_t prefix_cache_hit_tokens = 0;
  int64_t prefix_cache_hits = 0;
  int64_t prefix_cache_evicted_blocks = 0;
};

// A snapshot of one worker.
struct WorkerView {
  WorkerIdentity identity;
  WorkerLoad load;
  WorkerState state = WorkerState::kLive;
  // 1 for the first registration of this worker id, +1 on each re-registration.
  int64_t incarnation = 0;
  absl::Time last_heartbeat;
};

class WorkerRegistry {
 public:
  struct Options {
    // A worker is dead when its last heartbeat (or registration) is older than this.
    absl::Duration heartbeat_timeout = absl::Seconds(3);
    // Period suggested to workers in RegisterResponse.
    absl::Duration heartbeat_interval = absl::Seconds(1);
  };

  // `clock` must outlive the registry.
  WorkerRegistry(const Clock* clock, Options options) : clock_(clock), options_(options) {}

  // Adds or replaces the worker `identity.worker_id`; returns its incarnation. InvalidArgument
  // for an empty worker_id or endpoint.
  absl::StatusOr<int64_t> Register(const WorkerIdentity& identity) ABSL_LOCKS_EXCLUDED(mu_);
  // Records a heartbeat. NotFound for an unknown worker (it must register again); a dead worker
  // heartbeating again (e.g. after a pause) becomes live.
  absl::Status Heartbeat(const std::string& worker_id, const WorkerLoad& load)
      ABSL_LOCKS_EXCLUDED(mu_);
  // Marks a worker dead now (a stream to it broke), unless it has re-registered since
  // `incarnation`. It becomes live again on its next heartbeat or registration.
  void MarkDead(const std::string& worker_id, int64_t incarnation) ABSL_LOCKS_EXCLUDED(mu_);

  // All known workers, sorted by worker_id.
  std::vector<WorkerView> Snapshot() const ABSL_LOCKS_EXCLUDED(mu_);
  // Live (not dead, not draining) workers of `kind`, sorted by worker_id.
  std::vector<WorkerView> Live(WorkerKind kind) const ABSL_LOCKS_EXCLUDED(mu_);
  std::optional<WorkerView> Find(const std::string& worker_id) const ABSL_LOCKS_EXCLUDED(mu_);

  const Options& options() const { return options_; }
  const Clock* clock() const { return clock_; }

 private:
  struct Entry {
    WorkerView view;
    // Set by MarkDead: dead regardless of heartbeat age until the next heartbeat.
    bool marked_dead = false;
  };
  WorkerView ViewLocked(const Entry& e, absl::Time now) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const Clock* clock_;
  const Options options_;
  mutable absl::Mutex mu_;
  absl::flat_hash_map<std::string, Entry> workers_ ABSL_GUARDED_BY(mu_);
};

}  // namespace hmoe::router
