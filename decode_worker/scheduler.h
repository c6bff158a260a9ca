#pragma once

// The decode worker's scheduler: continuous batching with chunked prefill on one engine thread
// (docs/style.md §6: callers only push to it and wait for events; the engine thread alone
// drives the engine). Policy (docs/decode_worker.md):
//
// - Admission. Submit validates a request (InvalidArgument naming the field), rejects it when the
//   KV pool could never hold prompt + max_new_tokens (ResourceExhausted), when the waiting queue
//   is full (ResourceExhausted), while draining (Unavailable) or for a duplicate id
//   (AlreadyExists), and queues it otherwise.
// - Running batch. Between steps, waiting requests join the running batch in FIFO order while it
//   has fewer than batch_size requests and the pool can reserve KV blocks for the request's whole
//   life (prompt + max_new_tokens; so a running request never runs out of KV). The first request
//   that does not fit blocks the queue (no overtaking: FIFO fairness). A KV hand-off is imported
//   when its request joins (then KvImported is sent and the source unmapped: the ack).
// - Steps. Every step carries one decode token of every running request past its prompt, plus
//   the next chunk (chunk_size prompt tokens, or the rest) of the oldest running request still
//   prefilling. Up to prefills_per_step - 1 younger prefilling requests may add their next
//   chunks in FIFO order while the step's prompt tokens stay within chunk_size — each only if
//   the packing policy takes it (kAuto: when the step-cost model fitted to this worker's own
//   steps says it lowers the requests' summed latency, see step_cost_model.h; kAlways: whenever
//   it fits). The first chunk not taken ends the packing (no overtaking). A request's chunks never
//   depend on what shares its step, so a prompt of P tokens takes ceil(P / chunk_size) chunks,
//   and the running requests keep decoding one token per step behind at most chunk_size prompt
//   tokens. Logits are computed for a prefill chunk only when it is the prompt's last; the first
//   token is sampled from them.
// - Dual batch. With dual_batch on and >= 2 inputs in a step, the inputs are split into two
//   micro-batches of balanced token counts that overlap attention and MoE (StepRunner).
// - Stops. EOS (unless ignore_eos), a stop token id (neither is streamed) or max_new_tokens.
// - Cancellation. Cancel (and a broken stream) marks the request; it is removed and its KV
//   blocks are freed at the next step boundary, with FinishReason::kCancelled.
// - Errors. A failed step fails the requests of the failed micro-batch (kError) and frees them;
//   the others continue.
// - Drain. StopAccepting makes Submit Unavailable; WaitIdle waits for in-flight requests;
//   Shutdown cancels what is left and joins the engine thread.

#include <cstdint>
#include <deque>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"

#include "decode_worker/request.h"
#include "decode_worker/step_cost_model.h"
#include "decode_worker/step_engine.h"
#include "decode_worker/step_runner.h"

namespace hmoe::decode {

// Whether a prefill chunk beyond a step's first joins it (SchedulerOptions::packing).
enum class PackingPolicy {
  kAuto,    // when the step-cost model says it pays (StepCost::WorthPacking)
  kAlways,  // whenever it fits
};
// "auto" / "always"; InvalidArgument otherwise.
absl::StatusOr<PackingPolicy> ParsePackingPolicy(const std::string& value);
const char* PackingPolicyName(PackingPolicy p);

struct SchedulerOptions {
  // Target running batch size Y (paper §3.3.2): requests decoding (or prefilling) together.
  int batch_size = 6;
  // Prompt tokens per prefill chunk, and per step.
  int64_t chunk_size = 512;
  // Prefill chunks a step may carry (of different requests, within chunk_size tokens in all);
  // chunks beyond the first only as `packing` decides.
  int prefills_per_step = 6;
  PackingPolicy packing = PackingPolicy::kAuto;
  // kAuto: the step cost to decide with, instead of the one fitted to the steps (tests).
  std::optional<StepCost> fixed_step_cost;
  // Admitted requests waiting for a slot or KV blocks; beyond it Submit is ResourceExhausted.
  int max_waiting = 64;
  // Dual-batch attention–MoE overlap.
  bool dual_batch = true;
};

// A snapshot for GetStatus and heartbeats.
struct SchedulerStats {
  bool draining = false;
  int running = 0;
  int waiting = 0;
  int64_t kv_blocks_free = 0;
  int64_t kv_blocks_total = 0;
  int64_t steps = 0;
  int64_t dual_steps = 0;  // steps run as two micro-batches
  int64_t tokens_generated = 0;
  int64_t prompt_tokens_prefilled = 0;
  int64_t kv_tokens_imported = 0;
  double tokens_per_second = 0;   // over the last few seconds of stepping
  int64_t requests_finished = 0;  // for any cause
  int64_t requests_cancelled = 0;
  int64_t requests_failed = 0;
  int max_running_seen = 0;           // largest running batch so far
  int64_t packed_prefills = 0;        // prefill chunks that shared a step with an older one
  std::optional<StepCost> step_cost;  // the fit the packing policy uses (nullopt: not yet)
  PrefixCacheStats prefix_cache;      // the engine's (all zero without a prefix cache)
};

class Scheduler {
 public:
  // Checks the options against the engine (InvalidArgument: batch_size < 1 or above the engine's
  // max_step_sequences, chunk_size < 1 or chunk_size + batch_size above max_step_tokens,
  // prefills_per_step < 1, max_waiting < 0), creates the step driver(s) and starts the engine
  // thread. `engine` must outlive the scheduler.
  static absl::StatusOr<std::unique_ptr<Scheduler>> Create(StepEngine& engine,
                                                           const SchedulerOptions& options);
  // Shutdown().
  ~Scheduler();
  Scheduler(const Scheduler&) = delete;
  Scheduler& operator=(const Scheduler&) = delete;

  // Validates and queues `request`; its events arrive on the returned channel. Errors above.
  // Thread-safe.
  absl::StatusOr<std::shared_ptr<RequestChannel>> Submit(GenerationRequest request)
      ABSL_LOCKS_EXCLUDED(mu_);
  // Cancels an in-flight request at the next step boundary (`reason` goes to its FinishEvent).
  // NotFound when no such request is in flight. Thread-safe.
  absl::Status Cancel(const std::string& request_id, const std::string& reason)
      ABSL_LOCKS_EXCLUDED(mu_);

  // Drain: new Submits fail with Unavailable from now on. Thread-safe.
  void StopAccepting() ABSL_LOCKS_EXCLUDED(mu_);
  // Waits until no request is in flight; false at `deadline`. Thread-safe.
  bool WaitIdle(absl::Time deadline) ABSL_LOCKS_EXCLUDED(mu_);
  // Stops admitting, cancels every in-flight request (kCancelled, "worker shutting down") and
  // joins the engine thread. Idempotent. Thread-safe.
  void Shutdown() ABSL_LOCKS_EXCLUDED(mu_);

  SchedulerStats stats() const ABSL_LOCKS_EXCLUDED(mu_);
  const SchedulerOptions& options() const { return options_; }

  // The checks Submit makes that depend only on the request and the engine (not on the queue).
  static absl::Status ValidateRequest(const GenerationRequest& request, const StepEngine& engine);

 private:
  struct Active;

  Scheduler(StepEngine& engine, const SchedulerOptions& options,
            std::unique_ptr<StepRunner> runner);

  void EngineLoop();
  // Moves new submissions and cancel marks into the engine thread's lists; false when stopping.
  bool TakeInbox(bool block) ABSL_LOCKS_EXCLUDED(mu_);
  void ApplyCancels();
  void AdmitWaiting();
  // Builds and runs one step; false when there was nothing to run.
  bool RunOneStep();
  void Finish(Active& a, FinishReason reason, absl::Status error, int32_t stop_token);
  // Samples from `logits` for a request past its prompt; finishes it when a stop condition hits.
  void SampleAndEmit(Active& a, const std::vector<float>& logits, int64_t step_us);
  // Offers `a`'s KV (prompt and the generated tokens fed so far) to the engine's prefix cache.
  void OfferPrefix(Active& a, bool finished);
  void RemoveFinished();
  void PublishStats() ABSL_LOCKS_EXCLUDED(mu_);
  bool HasInboxWork() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return stopping_ || !inbox_.empty() || !cancels_.empty();
  }
  bool Idle() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return in_flight_.empty(); }

  StepEngine& engine_;
  const SchedulerOptions options_;
  std::unique_ptr<StepRunner> runner_;

  mutable absl::Mutex mu_;
  std::deque<std::unique_ptr<Active>> inbox_ ABSL_GUARDED_BY(mu_);
  std::vector<std::pair<std::string, std::string>> cancels_ ABSL_GUARDED_BY(mu_);
  std::set<std::string> in_flight_ ABSL_GUARDED_BY(mu_);
  int num_waiting_ ABSL_GUARDED_BY(mu_) = 0;  // submitted, not yet running or finished
  bool draining_ ABSL_GUARDED_BY(mu_) = false;
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  SchedulerStats stats_ ABSL_GUARDED_BY(mu_);
  absl::Time last_step_time_ ABSL_GUARDED_BY(mu_);

  // Engine thread only.
  std::deque<std::unique_ptr<Active>> waiting_;
  std::vector<std::unique_ptr<Active>> running_;
  SchedulerStats local_;
  StepCostModel step_cost_;
  absl::Time last_cost_log_ = absl::InfinitePast();
  std::vector<std::pair<std::string, std::string>> pending_cancels_;
  std::deque<std::pair<absl::Time, int64_t>> rate_window_;  // (step end, tokens sampled)
  std::deque<double> rate_steps_;                           // step seconds, parallel to the above
  int64_t rate_tokens_ = 0;
  double rate_seconds_ = 0;

  std::jthread engine_thread_;  // last: started in Create after everything else exists
};

}  // namespace hmoe::decode
