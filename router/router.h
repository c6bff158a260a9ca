#pragma once

// The router's request logic, independent of gRPC serving (router_service.h translates): validates
// a Generate request, picks a path with the policy (policy.h) over the registry's live workers and
// runs it:
//   CHUNKED  the decode worker prefills the prompt itself and streams the tokens;
//   SLP      the request waits in the FCFS prefill queue (prefill_queue.h) for a free prefill
//   worker
//            among the policy's candidates, which prefills the prompt and returns the first token
//            and a KV handle; the router admits the request to the decode worker with both
//            (AdmitRequest.kv_handle, first_token_id) and, once the decode worker acknowledges the
//            import (KvImported), calls Release on the prefill worker; it streams the first token
//            at that acknowledgement, then the decode worker's tokens;
//   DSLP     the same, but every prefill worker of the decision runs the prompt together: each gets
//            the same PrefillRequest with its DslpGroup rank in a new group (dslp_group_prefix);
//            rank 0's response carries the first token and the handle. A group that answers
//            UNIMPLEMENTED (or INVALID_ARGUMENT, when DSLP was the policy's choice: a prompt the
//            workers cannot split) is retried as SLP. When the group breaks (a rank's call fails,
//            or a rank answers ABORTED: its peer died, left or hung), the ranks that are gone are
//            marked dead, the others cancelled, and the attempt ends UNAVAILABLE naming the
//            rank's worker; the retry (if any) forms a new group of the live workers.
// Whatever fails after a prefill, the hand-off buffer is released. Per-request timing (queue, TTFT,
// TPOT, path, workers, attempts) ends the stream.
//
// Bounds: requests in flight (RESOURCE_EXHAUSTED beyond max_inflight, or beyond the room the live
// decode workers advertise: the sum of their batch_size + max_waiting) and prompts waiting for a
// prefill worker (RESOURCE_EXHAUSTED beyond max_prefill_queue); nothing else queues in the router.
//
// Failures: a request that has streamed no token yet is dispatched again when a worker fails. A
// worker whose connection broke (UNAVAILABLE, or CANCELLED that the router did not cause) is
// marked dead in the registry and the retry waits up to retry_wait for a live decode worker; a
// worker that answered with an error (RESOURCE_EXHAUSTED, INTERNAL, ...) stays live and the retry
// goes to another decode worker, or the request ends with that worker's status when there is
// none. Cancellations and deadlines never mark a worker dead. A request that has streamed tokens
// ends with the worker's status (UNAVAILABLE when its connection broke), naming the worker. Client
// cancellation (GenerateSink::IsCancelled, polled by a watcher thread), the client's deadline and
// the Cancel RPC break the worker calls, which cancels the request on the workers. Thread-safe.

#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"

#include "proto/hmoe_v1.pb.h"
#include "router/clock.h"
#include "router/decode_client.h"
#include "router/policy.h"
#include "router/prefill_client.h"
#include "router/prefill_queue.h"
#include "router/validation.h"
#include "router/worker_registry.h"

namespace hmoe {
class Tokenizer;
}

namespace hmoe::router {

struct RouterOptions {
  ModelLimits limits;
  // Reported by GetModelInfo.
  std::string model_name;
  int32_t bos_token_id = -1;
  int32_t eos_token_id = -1;
  // Every EOS id of the model (config.json): a prefill worker's first token that is one of them
  // (without ignore_eos) ends the request and is not streamed, as the decode worker does.
  std::vector<int32_t> eos_token_ids;
  int32_t max_request_bytes = 0;
  PolicyOptions policy;
  // Requests admitted and not finished; RESOURCE_EXHAUSTED beyond.
  int32_t max_inflight = 256;
  // Long prompts waiting for a prefill worker; RESOURCE_EXHAUSTED beyond (less when the live
  // prefill workers advertise less waiting room: Router::PrefillQueueLimit).
  int32_t max_prefill_queue = 64;
  // DSLP groups: every DSLP dispatch forms a new group named "<dslp_group_prefix>-<n>" (its
  // DslpGroup.group_id and shm_group; n counts this router's groups), so a group whose member
  // died is never joined again. hmoe-router makes the prefix unique per instance and
  // unpredictable ("hmoe-dslp-<pid>-<random>"), so no other router or user can take the name.
  std::string dslp_group_prefix = "hmoe-dslp";
  // DslpGroup.ep_mode sent to the ranks (EP_MODE_UNSPECIFIED: the workers' default).
  int32_t dslp_ep_mode = 0;
  // When a DSLP rank reports a broken group (ABORTED: a peer died, left or hung), how long the
  // other ranks may take to report too before they are cancelled (the rank that is gone shows up
  // as a failed call, which identifies it); any other failure cancels them at once.
  absl::Duration dslp_failure_grace = absl::Seconds(2);
  // Deadline of a Release call to a prefill worker.
  absl::Duration release_timeout = absl::Seconds(5);
  // Dispatches of one request (the first plus retries while no token was streamed).
  int32_t max_dispatch_attempts = 3;
  // How long a retry waits for a live decode worker (bounded by the request's deadline); also a new
  // request while every decode worker the router knows is dead (being restarted).
  absl::Duration retry_wait = absl::Seconds(5);
  // How often client cancellation is polled (a sink that knows at once that its client left calls
  // CheckCancellations instead of waiting for the poll).
  absl::Duration cancel_poll = absl::Milliseconds(20);
  // Whether KV handed over by prefill workers may join the decode worker's prefix cache: false
  // (--prefix-cache-imports=exact) only where it is bit-identical to the decode worker's own
  // chunked prefill (SLP on CPU prefill workers next to a CPU decode worker), so a prompt reusing
  // it gets exactly the tokens of recomputing it; true (all) also DSLP and GPU prefills.
  bool prefix_cache_all_imports = false;
  // Deadline of the MatchPrefix calls that ask the decode workers' prefix caches before routing.
  absl::Duration prefix_match_timeout = absl::Milliseconds(200);
  // Deadline of the ExportPrefix call that copies a cached prefix's KV for a prefill worker.
  absl::Duration prefix_export_timeout = absl::Seconds(30);
};

// Where a Generate call's responses go (the gRPC stream). Write() is called by the Generate thread
// only; IsCancelled() also by the router's watcher thread.
class GenerateSink {
 public:
  virtual ~GenerateSink() = default;
  // False when the client is gone.
  virtual bool Write(const hmoe::v1::GenerateResponse& response) = 0;
  // The client cancelled, disconnected or passed its deadline.
  virtual bool IsCancelled() = 0;
};

class Router {
 public:
  // `registry`, `decode_clients`, `prefill_clients` (may be null: no SLP/DSLP), `clock` and
  // `tokenizer` (may be null: token ids only) must outlive the router. `clock` drives the policy's
  // decode-idle window and the registry; deadlines are absl::Now() times.
  Router(RouterOptions options, WorkerRegistry* registry, DecodeClientFactory* decode_clients,
         PrefillClientFactory* prefill_clients, const Tokenizer* tokenizer, const Clock* clock);
  ~Router();
  Router(const Router&) = delete;
  Router& operator=(const Router&) = delete;

  // Serves one request until it ends; blocks. Errors before the first response: InvalidArgument,
  // FailedPrecondition, ResourceExhausted, AlreadyExists, Unavailable. After: the worker's error
  // (Unavailable when it died), DeadlineExceeded, or Cancelled when the client went away. A
  // request cancelled by the Cancel RPC ends OK with FINISH_REASON_CANCELLED. `deadline` is an
  // absl::Now() time (InfiniteFuture: none); it is passed on to the workers.
  absl::Status Generate(const hmoe::v1::GenerateRequest& request, absl::Time deadline,
                        GenerateSink* sink) ABSL_LOCKS_EXCLUDED(mu_);
  // NotFound when no request with this id is in flight.
  absl::Status Cancel(const std::string& request_id) ABSL_LOCKS_EXCLUDED(mu_);
  hmoe::v1::RouterStatus GetStatus() const ABSL_LOCKS_EXCLUDED(mu_);
  hmoe::v1::ModelInfo GetModelInfo() const;
  // New requests get UNAVAILABLE from now on; running ones continue.
  void StartDraining() ABSL_LOCKS_EXCLUDED(mu_);
  // What the health service reports: not draining, and a decode worker is live (so a request can
  // be served).
  bool Serving() const ABSL_LOCKS_EXCLUDED(mu_);
  int32_t inflight() const ABSL_LOCKS_EXCLUDED(mu_);
  // Wakes the cancellation watcher now: every request whose sink IsCancelled() has its worker
  // calls broken without waiting for the next poll or token. Cheap; any thread (the HTTP server
  // calls it from its I/O threads when a client goes away).
  void CheckCancellations() ABSL_LOCKS_EXCLUDED(mu_);

 private:
  struct Inflight;
  struct Request;
  struct Prefilled;
  // How one dispatch attempt ended: done (the status is the call's), or retry elsewhere.
  struct Outcome {
    Outcome(bool retry, absl::Status status, std::string exclude_worker = "")
        : retry(retry), status(std::move(status)), exclude_worker(std::move(exclude_worker)) {}
    bool retry = false;
    absl::Status status;
    // With retry: a live worker that answered with an error (e.g. RESOURCE_EXHAUSTED); the
    // retries of this request go to other decode workers.
    std::string exclude_worker;
  };

  absl::Status Admit(const std::string& request_id, GenerateSink* sink,
                     std::shared_ptr<Inflight>* out) ABSL_LOCKS_EXCLUDED(mu_);
  void Release(const std::shared_ptr<Inflight>& inflight) ABSL_LOCKS_EXCLUDED(mu_);
  // The policy's decision; waits (polling) for workers to come back where router.h says so.
  // `excluded`: decode workers not to use (they refused this request).
  // `prompt`: asked of every live decode worker's prefix cache when the answer can change the
  // decision (use_prefix_cache, and several decode workers or a prompt long enough for a prefill
  // worker).
  absl::StatusOr<RouteDecision> Route(const std::vector<int32_t>& prompt, bool use_prefix_cache,
                                      PathHintKind hint, bool dslp_allowed, int attempt,
                                      absl::Time deadline, Inflight& inflight,
                                      const std::vector<std::string>& excluded)
      ABSL_LOCKS_EXCLUDED(mu_);
  // Leading tokens of `prompt` each of `workers` holds in its prefix cache (workers without a hit,
  // or that do not answer within prefix_match_timeout, are absent).
  std::map<std::string, int64_t> CachedPrefixes(const std::vector<int32_t>& prompt,
                                                const std::vector<WorkerView>& workers);
  // The admission limit: max_inflight, or less when the live decode workers advertise less room
  // (batch_size + max_waiting each, from their heartbeats).
  int32_t AdmissionLimit() const;
  // Long prompts that may wait for a prefill worker: the sum of the --max-waiting the live prefill
  // workers advertise, at most max_prefill_queue (which applies alone while a live prefill worker
  // has not reported it).
  int32_t PrefillQueueLimit() const;
  // One dispatch: prefill (SLP/DSLP) when the route says so, then the decode worker's stream.
  Outcome RunAttempt(Request& request, const RouteDecision& route, int attempt)
      ABSL_LOCKS_EXCLUDED(mu_);
  // Waits for prefill workers (FCFS) and runs the prefill; the caller releases the hand-off.
  absl::StatusOr<Prefilled> RunPrefill(Request& request, const RouteDecision& route, int attempt)
      ABSL_LOCKS_EXCLUDED(mu_);
  // Frees a prefill worker's hand-off buffer (best effort: failures are logged).
  void ReleaseHandoff(Prefilled& prefilled, const std::string& request_id);
  // How a request cancelled by the Cancel RPC (Finished CANCELLED, OK) or by its client
  // (CANCELLED) ends.
  Outcome CancelledOutcome(Request& request);
  // Writes the Finished message ending a request.
  absl::Status Finish(Request& request, hmoe::v1::Finished finished);
  void CountWorker(const std::string& worker_id, int delta) ABSL_LOCKS_EXCLUDED(mu_);
  void WatchCancellations() ABSL_LOCKS_EXCLUDED(mu_);
  bool WatcherWakes() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return stopping_ || check_cancellations_;
  }

  const RouterOptions options_;
  WorkerRegistry* const registry_;
  DecodeClientFactory* const decode_clients_;
  PrefillClientFactory* const prefill_clients_;
  const Tokenizer* const tokenizer_;
  const Clock* const clock_;
  PrefillQueue prefill_queue_;

  mutable absl::Mutex mu_;
  absl::flat_hash_map<std::string, std::shared_ptr<Inflight>> inflight_ ABSL_GUARDED_BY(mu_);
  absl::flat_hash_map<std::string, int32_t> worker_inflight_ ABSL_GUARDED_BY(mu_);
  int32_t decode_active_ ABSL_GUARDED_BY(mu_) = 0;
  std::optional<absl::Time> last_decode_active_ ABSL_GUARDED_BY(mu_);
  int64_t next_request_number_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t next_dslp_group_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t requests_total_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t requests_rejected_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t requests_failed_ ABSL_GUARDED_BY(mu_) = 0;
  bool draining_ ABSL_GUARDED_BY(mu_) = false;
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  // CheckCancellations was called since the watcher's last pass.
  bool check_cancellations_ ABSL_GUARDED_BY(mu_) = false;
  // Last member: started after everything it reads, joined first.
  std::jthread watcher_;
};

}  // namespace hmoe::router
