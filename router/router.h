#pragma once

// The router's request logic, independent of gRPC serving (router_service.h translates): validates
// a Generate request, picks a path with the policy (policy.h) over the registry's live workers,
// forwards it to a decode worker (decode_client.h) and relays the token stream, with per-request
// timing. In-flight requests are bounded (RESOURCE_EXHAUSTED beyond max_inflight). A request whose
// worker fails before streaming a token is retried on a live decode worker (waiting up to
// retry_wait for one to register); after that the failure ends it with UNAVAILABLE. Client
// cancellation (GenerateSink::IsCancelled, polled by a watcher thread) and the Cancel RPC break the
// worker stream, which cancels the request on the worker. Thread-safe.
//
// Not yet implemented (the prefill worker does not exist yet): SLP/DSLP forwarding and its FCFS
// prefill queue. Until then the policy sees no prefill workers, so AUTO routes everything CHUNKED
// and an SLP/DSLP hint gets FAILED_PRECONDITION.

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <thread>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"

#include "proto/hmoe_v1.pb.h"
#include "router/clock.h"
#include "router/decode_client.h"
#include "router/policy.h"
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
  int32_t max_request_bytes = 0;
  PolicyOptions policy;
  // Requests admitted and not finished; RESOURCE_EXHAUSTED beyond.
  int32_t max_inflight = 256;
  // Dispatches of one request (the first plus retries while no token was streamed).
  int32_t max_dispatch_attempts = 3;
  // How long a retry waits for a live decode worker (bounded by the request's deadline).
  absl::Duration retry_wait = absl::Seconds(5);
  // How often client cancellation is polled.
  absl::Duration cancel_poll = absl::Milliseconds(20);
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
  // `registry`, `decode_clients`, `clock` and `tokenizer` (may be null: token ids only) must
  // outlive the router.
  Router(RouterOptions options, WorkerRegistry* registry, DecodeClientFactory* decode_clients,
         const Tokenizer* tokenizer, const Clock* clock);
  ~Router();
  Router(const Router&) = delete;
  Router& operator=(const Router&) = delete;

  // Serves one request until it ends; blocks. Errors before the first response: InvalidArgument,
  // FailedPrecondition, ResourceExhausted, AlreadyExists, Unavailable. After: the worker's error
  // (Unavailable when it died), DeadlineExceeded, or Cancelled when the client went away. A
  // request cancelled by the Cancel RPC ends OK with FINISH_REASON_CANCELLED.
  absl::Status Generate(const hmoe::v1::GenerateRequest& request, absl::Time deadline,
                        GenerateSink* sink) ABSL_LOCKS_EXCLUDED(mu_);
  // NotFound when no request with this id is in flight.
  absl::Status Cancel(const std::string& request_id) ABSL_LOCKS_EXCLUDED(mu_);
  hmoe::v1::RouterStatus GetStatus() const ABSL_LOCKS_EXCLUDED(mu_);
  hmoe::v1::ModelInfo GetModelInfo() const;
  // New requests get UNAVAILABLE from now on; running ones continue.
  void StartDraining() ABSL_LOCKS_EXCLUDED(mu_);
  int32_t inflight() const ABSL_LOCKS_EXCLUDED(mu_);

 private:
  struct Inflight;

  absl::Status Admit(const std::string& request_id, GenerateSink* sink,
                     std::shared_ptr<Inflight>* out) ABSL_LOCKS_EXCLUDED(mu_);
  void Release(const std::shared_ptr<Inflight>& inflight) ABSL_LOCKS_EXCLUDED(mu_);
  absl::StatusOr<RouteDecision> Route(int64_t prompt_tokens, PathHintKind hint, int attempt,
                                      absl::Time deadline) ABSL_LOCKS_EXCLUDED(mu_);
  void WatchCancellations() ABSL_LOCKS_EXCLUDED(mu_);

  const RouterOptions options_;
  WorkerRegistry* const registry_;
  DecodeClientFactory* const decode_clients_;
  const Tokenizer* const tokenizer_;
  const Clock* const clock_;

  mutable absl::Mutex mu_;
  absl::flat_hash_map<std::string, std::shared_ptr<Inflight>> inflight_ ABSL_GUARDED_BY(mu_);
  absl::flat_hash_map<std::string, int32_t> worker_inflight_ ABSL_GUARDED_BY(mu_);
  int32_t decode_active_ ABSL_GUARDED_BY(mu_) = 0;
  std::optional<absl::Time> last_decode_active_ ABSL_GUARDED_BY(mu_);
  int64_t next_request_number_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t requests_total_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t requests_rejected_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t requests_failed_ ABSL_GUARDED_BY(mu_) = 0;
  bool draining_ ABSL_GUARDED_BY(mu_) = false;
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  // Last member: started after everything it reads, joined first.
  std::jthread watcher_;
};

}  // namespace hmoe::router
