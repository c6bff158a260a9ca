#pragma once

// Registers a worker (prefill or decode) with the router's WorkerRegistry
// (proto/worker_registry.proto) and heartbeats its load. The router is optional and may come and
// go: every failure is retried with exponential backoff; a failed heartbeat (router restarted:
// NOT_FOUND, or unreachable) sends the client back to registering. Runs on its own thread; never
// blocks the caller.

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <thread>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"

namespace hmoe::rpc {

enum class WorkerKind { kPrefill, kDecode };

struct RegistryClientOptions {
  // What kind of worker registers.
  WorkerKind kind = WorkerKind::kDecode;
  // gRPC target of the router's registry ("unix:/run/hmoe/router.sock", "localhost:50051").
  std::string router_target;
  // What Register announces.
  std::string worker_id;
  std::string endpoint;  // where this worker serves ("unix:/...")
  std::string device;
  std::string model;
  int64_t pid = 0;
  int64_t start_unix_ms = 0;
  // Heartbeat period (the router's RegisterResponse may override it).
  absl::Duration heartbeat_interval = absl::Seconds(1);
  absl::Duration initial_backoff = absl::Milliseconds(100);
  absl::Duration max_backoff = absl::Seconds(5);
  // Deadline of each RPC.
  absl::Duration rpc_timeout = absl::Seconds(2);
};

// The load a heartbeat reports (a prefill worker: running = 1 while it prefills, waiting = its
// queue, batch_size = 1, kv_blocks_* = its KV pool).
struct WorkerLoadReport {
  bool draining = false;
  int running = 0;
  int waiting = 0;
  int batch_size = 0;
  // Requests that may wait beyond the batch (decode worker: --max-waiting).
  int max_waiting = 0;
  int64_t kv_blocks_free = 0;
  int64_t kv_blocks_total = 0;
  double tokens_per_second = 0;
  // Decode workers' prefix cache (proto/worker_registry.proto WorkerLoad).
  int64_t prefix_cache_tokens = 0;
  int64_t prefix_cache_hit_tokens = 0;
  int64_t prefix_cache_hits = 0;
  int64_t prefix_cache_evicted_blocks = 0;
};

class RegistryClient {
 public:
  // Starts the client thread. `load` is called on that thread before each heartbeat and must be
  // thread-safe with respect to the rest of the worker.
  RegistryClient(RegistryClientOptions options, std::function<WorkerLoadReport()> load);
  // Stop().
  ~RegistryClient();
  RegistryClient(const RegistryClient&) = delete;
  RegistryClient& operator=(const RegistryClient&) = delete;

  // Stops and joins the thread (an RPC in flight finishes within rpc_timeout). Idempotent.
  void Stop() ABSL_LOCKS_EXCLUDED(mu_);

  bool registered() const ABSL_LOCKS_EXCLUDED(mu_);
  int64_t register_attempts() const ABSL_LOCKS_EXCLUDED(mu_);
  int64_t registrations() const ABSL_LOCKS_EXCLUDED(mu_);
  int64_t heartbeats_sent() const ABSL_LOCKS_EXCLUDED(mu_);

 private:
  struct Rpc;
  void Loop();
  // Sleeps `d` or until Stop; false when stopping.
  bool SleepFor(absl::Duration d) ABSL_LOCKS_EXCLUDED(mu_);
  bool Stopping() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return stop_; }

  const RegistryClientOptions options_;
  const std::function<WorkerLoadReport()> load_;
  std::unique_ptr<Rpc> rpc_;  // gRPC stub; used by the client thread only

  mutable absl::Mutex mu_;
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  bool registered_ ABSL_GUARDED_BY(mu_) = false;
  int64_t register_attempts_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t registrations_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t heartbeats_ ABSL_GUARDED_BY(mu_) = 0;
  std::jthread thread_;  // last: starts after everything above exists
};

}  // namespace hmoe::rpc
