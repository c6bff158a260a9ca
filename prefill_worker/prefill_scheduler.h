#pragma once

// First-come-first-served prefill: gRPC handlers submit prompts and wait; one model thread (the
// owner of the prefill device, docs/style.md §6) runs them one at a time through the SlpRunner (a
// DSLP rank's prompt too: the thread joins the request's group, runs its share, and leaves) and
// hands each finished KV export to the ExportTable. The queue is bounded (ResourceExhausted
// beyond max_waiting); a queued or running prefill can be cancelled (Cancel RPC, or the caller
// going away); on shutdown queued prefills fail with Unavailable and the running one is
// cancelled between layers.

#include <atomic>
#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"

#include "common/engine/sampler.h"
#include "common/kv_handoff/kv_handoff.h"
#include "prefill_worker/dslp_group.h"
#include "prefill_worker/kv_exports.h"
#include "prefill_worker/slp_runner.h"

namespace hmoe::prefill {

struct PrefillJob {
  std::string id;  // unique among in-flight requests and outstanding exports
  std::vector<int32_t> prompt;
  SamplingParams sampling;
  // Set: this worker is one rank of a DSLP group (dslp_group.h) and runs SlpRunner::RunDslp.
  std::optional<DslpGroupSpec> dslp;
  // Set (SLP only): the KV of the prompt's first prefix->num_tokens tokens, a shared-memory
  // hand-off from the decode worker's prefix cache; only the rest of the prompt is prefilled.
  std::optional<KvHandleSpec> prefix;
};

// What a finished prefill returns (PrefillResponse).
struct PrefillOutcome {
  int32_t first_token = -1;
  KvHandleSpec handle;
  int64_t prompt_tokens = 0;
  int64_t prefix_tokens = 0;  // taken from PrefillJob::prefix, not computed
  int64_t queue_us = 0;
  int64_t prefill_us = 0;
  int64_t export_us = 0;
  int64_t bytes_streamed = 0;
  int64_t load_wait_us = 0;
  int64_t peak_device_bytes = 0;
  int64_t ring_slots = 0;
  double hidden_fraction = 0;  // of the copy time, behind compute
  // False for a DSLP rank > 0: no first token (-1) and no hand-off buffer.
  bool exported = true;
  // DSLP: this rank, the tokens it held, and the payload bytes it sent to its peers.
  int dslp_rank = -1;
  int64_t dslp_local_tokens = 0;
  int64_t dslp_bytes_sent = 0;
};

struct PrefillSchedulerOptions {
  // Prefills that may wait behind the running one; ResourceExhausted beyond.
  int max_waiting = 16;
  // Shared-memory exports are named <export_prefix><n> (n counts up from 1).
  std::string export_prefix = "hmoe-kv-prefill-";
  // How often a waiting handler checks whether its caller went away.
  absl::Duration poll_interval = absl::Milliseconds(50);
  // DSLP: joining a group, and the expert-parallel mode of a request that does not name one.
  DslpJoinOptions dslp_join;
  EpMode dslp_ep_mode = EpMode::kSmallEp;
};

struct PrefillSchedulerStats {
  bool draining = false;
  bool busy = false;
  int waiting = 0;
  int64_t prefills = 0;  // completed
  int64_t prompt_tokens = 0;
  int64_t failed = 0;
  int64_t cancelled = 0;
  int64_t last_peak_device_bytes = 0;
  int64_t last_ring_slots = 0;
  // DSLP prefills run as a rank (completed or failed), and the group of the last one ("" before
  // the first).
  int64_t dslp_prefills = 0;
  std::string last_dslp_group;
};

class PrefillScheduler {
 public:
  // Starts the model thread. `runner` and `exports` must outlive the scheduler.
  PrefillScheduler(SlpRunner* runner, ExportTable* exports, PrefillSchedulerOptions options);
  // Shutdown().
  ~PrefillScheduler();
  PrefillScheduler(const PrefillScheduler&) = delete;
  PrefillScheduler& operator=(const PrefillScheduler&) = delete;

  // Validates `job` (InvalidArgument naming the field: empty id or prompt, a token outside
  // [0, vocab), a prompt longer than the runner's maximum, bad sampling), queues it and waits for
  // its outcome; `caller_gone` is polled while waiting and cancels the prefill when true.
  // AlreadyExists when the id is in flight or holds an export; ResourceExhausted when the queue is
  // full; Unavailable while draining; Cancelled; the runner's errors.
  absl::StatusOr<PrefillOutcome> Prefill(PrefillJob job, const std::function<bool()>& caller_gone)
      ABSL_LOCKS_EXCLUDED(mu_);
  // Cancels a queued or running prefill (its Prefill call returns Cancelled). NotFound for an
  // unknown id.
  absl::Status Cancel(const std::string& id) ABSL_LOCKS_EXCLUDED(mu_);

  // Further Prefill calls fail with Unavailable.
  void StopAccepting() ABSL_LOCKS_EXCLUDED(mu_);
  // Waits until nothing is queued or running; false at `deadline`.
  bool WaitIdle(absl::Time deadline) ABSL_LOCKS_EXCLUDED(mu_);
  // Stops accepting, fails queued prefills (Unavailable), cancels the running one and joins the
  // model thread. Idempotent.
  void Shutdown() ABSL_LOCKS_EXCLUDED(mu_);

  PrefillSchedulerStats stats() const ABSL_LOCKS_EXCLUDED(mu_);
  const PrefillSchedulerOptions& options() const { return options_; }

 private:
  struct Job;
  void ModelLoop() ABSL_LOCKS_EXCLUDED(mu_);
  // One DSLP rank's prefill: joins the group, runs it, leaves; a failure removes what the group
  // may have left in shared memory and reports a broken group as Aborted (GroupFailureStatus).
  absl::StatusOr<SlpResult> RunDslpJob(Job& job, const std::string& export_name);
  // Opens and unlinks the job's prefix hand-off; nullptr (logged) when it cannot be used, so the
  // whole prompt is prefilled.
  std::unique_ptr<KvImportSource> OpenPrefix(const Job& job);
  // Completes `job` with `result` and forgets it. mu_ held.
  void FinishLocked(Job& job, absl::StatusOr<PrefillOutcome> result)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  bool HasWorkOrStop() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return stop_ || !queue_.empty(); }
  bool Idle() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return queue_.empty() && running_ == nullptr;
  }
  absl::Status Validate(const PrefillJob& job) const;

  SlpRunner* const runner_;
  ExportTable* const exports_;
  const PrefillSchedulerOptions options_;
  // Opens decode workers' prefix exports (shared memory); model thread only.
  const std::unique_ptr<KvImporter> importer_ = NewShmKvImporter();

  mutable absl::Mutex mu_;
  std::deque<std::shared_ptr<Job>> queue_ ABSL_GUARDED_BY(mu_);
  std::shared_ptr<Job> running_ ABSL_GUARDED_BY(mu_);
  std::map<std::string, std::shared_ptr<Job>> in_flight_ ABSL_GUARDED_BY(mu_);
  bool accepting_ ABSL_GUARDED_BY(mu_) = true;
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  uint64_t next_export_ ABSL_GUARDED_BY(mu_) = 1;
  PrefillSchedulerStats stats_ ABSL_GUARDED_BY(mu_);
  std::jthread thread_;  // last: starts after everything above exists
};

}  // namespace hmoe::prefill
