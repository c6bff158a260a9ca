#pragma once

// Fake decode workers for router tests: a DecodeClientFactory whose clients follow a Script and log
// what they were asked to do. A request with a kv_handle gets KvImported first, as the real worker
// sends it. Thread-safe.

#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"

#include "proto/decode.pb.h"
#include "router/decode_client.h"

namespace hmoe::router::testing {

namespace dv1 = hmoe::decode::v1;

// Events of fake workers in the order they happened ("admit:<id>", "kv_imported:<id>",
// "prefill:<id>", "release:<id>"), shared by fake decode and prefill workers. Thread-safe.
class EventLog {
 public:
  void Add(std::string event) ABSL_LOCKS_EXCLUDED(mu_) {
    absl::MutexLock lock(&mu_);
    events_.push_back(std::move(event));
  }
  std::vector<std::string> events() const ABSL_LOCKS_EXCLUDED(mu_) {
    absl::MutexLock lock(&mu_);
    return events_;
  }
  // Index of the first event equal to `event`, or -1.
  int IndexOf(const std::string& event) const ABSL_LOCKS_EXCLUDED(mu_) {
    absl::MutexLock lock(&mu_);
    for (size_t i = 0; i < events_.size(); ++i) {
      if (events_[i] == event) return static_cast<int>(i);
    }
    return -1;
  }

 private:
  mutable absl::Mutex mu_;
  std::vector<std::string> events_ ABSL_GUARDED_BY(mu_);
};

// What a fake worker does with an admitted request.
struct Script {
  std::vector<int32_t> tokens;
  // After the tokens: end with this status (OK: a Finished message with `reason`).
  absl::Status end = absl::OkStatus();
  dv1::FinishReason reason = dv1::FINISH_REASON_LENGTH;
  // Block after the tokens until cancelled or the deadline passes.
  bool hang = false;
  // With a kv_handle: end with this status instead of importing it (OK: import).
  absl::Status import_error = absl::OkStatus();
};

// Shared between a fake worker and the test: what happened to its requests.
struct WorkerLog {
  absl::Mutex mu;
  std::vector<dv1::AdmitRequest> admitted ABSL_GUARDED_BY(mu);
  int cancelled ABSL_GUARDED_BY(mu) = 0;
  std::vector<absl::Time> deadlines ABSL_GUARDED_BY(mu);
};

class FakeStream : public DecodeStream {
 public:
  FakeStream(Script script, const dv1::AdmitRequest& request, absl::Time deadline, WorkerLog* log,
             EventLog* events)
      : script_(std::move(script)),
        request_id_(request.request_id()),
        kv_pending_(request.has_kv_handle()),
        deadline_(deadline),
        log_(log),
        events_(events) {}
  bool Read(dv1::AdmitResponse* r) override {
    if (kv_pending_) {
      kv_pending_ = false;
      if (!script_.import_error.ok()) return End(script_.import_error);
      if (events_ != nullptr) events_->Add("kv_imported:" + request_id_);
      r->mutable_kv_imported()->set_num_tokens(1);
      return true;
    }
    if (next_ < script_.tokens.size()) {
      absl::MutexLock lock(&mu_);
      if (cancelled_) return End(absl::CancelledError("cancelled"));
      r->mutable_token()->set_token_id(script_.tokens[next_]);
      r->mutable_token()->set_index(static_cast<int32_t>(next_));
      ++next_;
      return true;
    }
    if (done_) return false;
    if (script_.hang) {
      absl::MutexLock lock(&mu_);
      mu_.AwaitWithDeadline(absl::Condition(&cancelled_), deadline_);
      return End(cancelled_ ? absl::CancelledError("cancelled")
                            : absl::DeadlineExceededError("deadline exceeded"));
    }
    if (!script_.end.ok()) return End(script_.end);
    done_ = true;
    dv1::Finished* f = r->mutable_finished();
    f->set_reason(script_.reason);
    f->set_stop_token_id(-1);
    f->mutable_usage()->set_completion_tokens(static_cast<int32_t>(script_.tokens.size()));
    return true;
  }
  absl::Status Finish() override { return status_; }
  void Cancel() override {
    absl::MutexLock lock(&mu_);
    if (!cancelled_) {
      absl::MutexLock log_lock(&log_->mu);
      ++log_->cancelled;
    }
    cancelled_ = true;
  }

 private:
  bool End(absl::Status s) {
    done_ = true;
    status_ = std::move(s);
    return false;
  }

  const Script script_;
  const std::string request_id_;
  bool kv_pending_;
  const absl::Time deadline_;
  WorkerLog* const log_;
  EventLog* const events_;
  size_t next_ = 0;
  bool done_ = false;
  absl::Status status_;
  absl::Mutex mu_;
  bool cancelled_ ABSL_GUARDED_BY(mu_) = false;
};

class FakeClient : public DecodeClient {
 public:
  FakeClient(Script script, WorkerLog* log, EventLog* events)
      : script_(std::move(script)), log_(log), events_(events) {}
  std::unique_ptr<DecodeStream> Admit(const dv1::AdmitRequest& request,
                                      absl::Time deadline) override {
    {
      absl::MutexLock lock(&log_->mu);
      log_->admitted.push_back(request);
      log_->deadlines.push_back(deadline);
    }
    if (events_ != nullptr) events_->Add("admit:" + request.request_id());
    return std::make_unique<FakeStream>(script_, request, deadline, log_, events_);
  }

 private:
  const Script script_;
  WorkerLog* const log_;
  EventLog* const events_;
};

class FakeFactory : public DecodeClientFactory {
 public:
  // `events` (optional) must outlive the factory.
  explicit FakeFactory(EventLog* events = nullptr) : events_(events) {}
  void Set(const std::string& endpoint, Script script) {
    absl::MutexLock lock(&mu_);
    clients_[endpoint] = std::make_shared<FakeClient>(std::move(script), &logs_[endpoint], events_);
  }
  WorkerLog& log(const std::string& endpoint) {
    absl::MutexLock lock(&mu_);
    return logs_[endpoint];
  }
  std::shared_ptr<DecodeClient> ForEndpoint(const std::string& endpoint, int64_t) override {
    absl::MutexLock lock(&mu_);
    return clients_.at(endpoint);
  }

 private:
  EventLog* const events_;
  absl::Mutex mu_;
  absl::flat_hash_map<std::string, std::shared_ptr<DecodeClient>> clients_ ABSL_GUARDED_BY(mu_);
  // std::map: clients hold pointers to their logs, which must not move.
  std::map<std::string, WorkerLog> logs_ ABSL_GUARDED_BY(mu_);
};

}  // namespace hmoe::router::testing
