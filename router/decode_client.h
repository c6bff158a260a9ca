#pragma once

// How the router talks to decode workers (proto/decode.proto): an interface, so the router's logic
// is tested against fakes, and a gRPC implementation over the worker's unix socket.

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"

#include "proto/decode.pb.h"

namespace hmoe::router {

// One admitted request's response stream. Read() is called by one thread; Cancel() may be called
// from any thread, at any time, and makes a pending Read() return false soon.
class DecodeStream {
 public:
  virtual ~DecodeStream() = default;
  // Next message; false at the end of the stream (then call Finish()).
  virtual bool Read(hmoe::decode::v1::AdmitResponse* response) = 0;
  // The call status once Read() returned false.
  virtual absl::Status Finish() = 0;
  // Breaks the stream; the worker cancels the request.
  virtual void Cancel() = 0;
};

// A connection to one decode worker. Thread-safe.
class DecodeClient {
 public:
  virtual ~DecodeClient() = default;
  // Starts Admit; errors (including validation errors of the worker) come from the stream's
  // Finish(). The call ends at `deadline` with DEADLINE_EXCEEDED.
  virtual std::unique_ptr<DecodeStream> Admit(const hmoe::decode::v1::AdmitRequest& request,
                                              absl::Time deadline) = 0;
  // Leading tokens of `prompt` the worker's prefix cache holds (MatchPrefix RPC). A worker
  // without the RPC (or a fake) holds none.
  virtual absl::StatusOr<int64_t> MatchPrefix(const std::vector<int32_t>& prompt,
                                              absl::Time deadline) {
    (void)prompt;
    (void)deadline;
    return 0;
  }
  // Copies the worker's longest cached prefix of `prompt` (at most max_tokens) into a hand-off
  // buffer for a prefill worker (ExportPrefix RPC): the handle, or one with num_tokens 0 when
  // nothing is cached. A worker without the RPC (or a fake) exports nothing.
  virtual absl::StatusOr<hmoe::decode::v1::KvHandle> ExportPrefix(
      const std::string& export_id, const std::vector<int32_t>& prompt, int64_t max_tokens,
      absl::Time deadline) {
    (void)export_id;
    (void)prompt;
    (void)max_tokens;
    (void)deadline;
    return hmoe::decode::v1::KvHandle();
  }
  // Frees an ExportPrefix buffer (ReleasePrefixExport RPC).
  virtual absl::Status ReleasePrefixExport(const std::string& export_id, absl::Time deadline) {
    (void)export_id;
    (void)deadline;
    return absl::OkStatus();
  }
};

// Makes (and may cache) clients by worker endpoint. Thread-safe.
class DecodeClientFactory {
 public:
  virtual ~DecodeClientFactory() = default;
  // `endpoint` is a gRPC target such as "unix:/run/hmoe/worker.sock"; `incarnation` the worker's
  // registration count (WorkerView::incarnation): a new one gets a new connection. Never null.
  virtual std::shared_ptr<DecodeClient> ForEndpoint(const std::string& endpoint,
                                                    int64_t incarnation) = 0;
};

// gRPC clients; one channel per endpoint and incarnation (the latest is kept).
std::unique_ptr<DecodeClientFactory> NewGrpcDecodeClientFactory();

}  // namespace hmoe::router
