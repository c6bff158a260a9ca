#pragma once

// How the router talks to prefill workers (proto/prefill.proto, hmoe.prefill.v1.PrefillService):
// an interface, so the router's logic is tested against fakes, and a gRPC implementation over the
// worker's unix socket.

#include <cstdint>
#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"

#include "proto/prefill.pb.h"

namespace hmoe::router {

// One Prefill call in flight. Wait() is called by one thread, at most once; Cancel() may be called
// from any thread at any time (before, during or after Wait) and makes a pending Wait() return
// soon (CANCELLED unless the worker had already answered).
class PrefillCall {
 public:
  virtual ~PrefillCall() = default;
  // Blocks until the worker answers, the call's deadline passes (DEADLINE_EXCEEDED) or Cancel().
  virtual absl::StatusOr<hmoe::prefill::v1::PrefillResponse> Wait() = 0;
  virtual void Cancel() = 0;
};

// A connection to one prefill worker. Thread-safe.
class PrefillClient {
 public:
  virtual ~PrefillClient() = default;
  // Starts Prefill without blocking; the result comes from the call's Wait(). Never null.
  virtual std::unique_ptr<PrefillCall> Prefill(const hmoe::prefill::v1::PrefillRequest& request,
                                               absl::Time deadline) = 0;
  // Frees the hand-off buffer of `request_id` (blocks; bounded by `deadline`). NOT_FOUND when the
  // worker no longer holds it (e.g. its export timeout freed it, or it restarted).
  virtual absl::Status Release(const std::string& request_id, absl::Time deadline) = 0;
};

// Makes (and may cache) clients by worker endpoint. Thread-safe.
class PrefillClientFactory {
 public:
  virtual ~PrefillClientFactory() = default;
  // `endpoint` is a gRPC target such as "unix:/run/hmoe/worker.sock"; `incarnation` the worker's
  // registration count (WorkerView::incarnation): a new one gets a new connection. Never null.
  virtual std::shared_ptr<PrefillClient> ForEndpoint(const std::string& endpoint,
                                                     int64_t incarnation) = 0;
};

// gRPC clients; one channel per endpoint and incarnation (the latest is kept).
std::unique_ptr<PrefillClientFactory> NewGrpcPrefillClientFactory();

}  // namespace hmoe::router
