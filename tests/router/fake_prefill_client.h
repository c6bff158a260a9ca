#pragma once

// Fake prefill workers for router tests: a PrefillClientFactory whose clients follow a
// PrefillScript and log what they were asked to do (Prefill requests, Release calls, cancels).
// Thread-safe.

#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"

#include "proto/prefill.pb.h"
#include "router/prefill_client.h"
#include "tests/router/fake_decode_client.h"

namespace hmoe::router::testing {

namespace pv1 = hmoe::prefill::v1;

// Opens once; Prefill calls of a gated script block until then (or until cancelled).
class Gate {
 public:
  void Open() ABSL_LOCKS_EXCLUDED(mu_) {
    absl::MutexLock lock(&mu_);
    open_ = true;
  }
  // True when opened, false when `cancelled` turned true or `deadline` passed first.
  bool Wait(const bool* cancelled, absl::Mutex* cancel_mu, absl::Time deadline) {
    while (true) {
      {
        absl::MutexLock lock(&mu_);
        if (mu_.AwaitWithTimeout(absl::Condition(&open_), absl::Milliseconds(2))) return true;
      }
      absl::MutexLock lock(cancel_mu);
      if (*cancelled || absl::Now() >= deadline) return false;
    }
  }

 private:
  absl::Mutex mu_;
  bool open_ ABSL_GUARDED_BY(mu_) = false;
};

// What a fake prefill worker does with a Prefill call.
struct PrefillScript {
  int32_t first_token = 7;
  // Non-OK: the call fails with it.
  absl::Status status = absl::OkStatus();
  // The same, for DSLP requests only (e.g. UNIMPLEMENTED from a worker without DSLP).
  absl::Status dslp_status = absl::OkStatus();
  // Block until cancelled or the deadline passes (then CANCELLED / DEADLINE_EXCEEDED); for every
  // request, or for DSLP requests only.
  bool hang = false;
  bool hang_in_dslp = false;
  // Block until the gate opens (nullptr: no gate). Must outlive the factory.
  Gate* gate = nullptr;
  // Answer without a kv_handle (a broken worker; a non-zero DSLP rank may legitimately do so).
  bool no_handle = false;
  // DSLP: only rank 0 returns a handle unless this is set.
  bool every_rank_returns_a_handle = false;
};

struct PrefillLog {
  absl::Mutex mu;
  std::vector<pv1::PrefillRequest> prefills ABSL_GUARDED_BY(mu);
  std::vector<std::string> released ABSL_GUARDED_BY(mu);
  int cancelled ABSL_GUARDED_BY(mu) = 0;
};

class FakePrefillCall : public PrefillCall {
 public:
  FakePrefillCall(PrefillScript script, pv1::PrefillRequest request, std::string worker_id,
                  absl::Time deadline, PrefillLog* log)
      : script_(std::move(script)),
        request_(std::move(request)),
        worker_id_(std::move(worker_id)),
        deadline_(deadline),
        log_(log) {}

  absl::StatusOr<pv1::PrefillResponse> Wait() override {
    const bool dslp = request_.has_dslp();
    if (script_.hang || (dslp && script_.hang_in_dslp)) {
      absl::MutexLock lock(&mu_);
      mu_.AwaitWithDeadline(absl::Condition(&cancelled_), deadline_);
      if (cancelled_) return absl::CancelledError("prefill cancelled");
      return absl::DeadlineExceededError("prefill deadline exceeded");
    }
    if (script_.gate != nullptr && !script_.gate->Wait(&cancelled_, &mu_, deadline_)) {
      absl::MutexLock lock(&mu_);
      if (cancelled_) return absl::CancelledError("prefill cancelled");
      return absl::DeadlineExceededError("prefill deadline exceeded");
    }
    {
      absl::MutexLock lock(&mu_);
      if (cancelled_) return absl::CancelledError("prefill cancelled");
    }
    if (!script_.status.ok()) return script_.status;
    if (dslp && !script_.dslp_status.ok()) return script_.dslp_status;
    pv1::PrefillResponse r;
    const int rank = dslp ? request_.dslp().rank() : 0;
    r.set_worker_id(worker_id_);
    r.set_prompt_tokens(request_.prompt_token_ids_size());
    if (rank == 0) r.set_first_token_id(script_.first_token);
    if (!script_.no_handle && (rank == 0 || script_.every_rank_returns_a_handle)) {
      r.mutable_kv_handle()->set_shm_name(
          absl::StrCat("kv-", worker_id_, "-", request_.request_id()));
      r.mutable_kv_handle()->set_num_tokens(request_.prompt_token_ids_size());
      r.mutable_kv_handle()->set_layout_version(1);
    }
    return r;
  }

  void Cancel() override {
    absl::MutexLock lock(&mu_);
    if (!cancelled_) {
      absl::MutexLock log_lock(&log_->mu);
      ++log_->cancelled;
    }
    cancelled_ = true;
  }

 private:
  const PrefillScript script_;
  const pv1::PrefillRequest request_;
  const std::string worker_id_;
  const absl::Time deadline_;
  PrefillLog* const log_;
  absl::Mutex mu_;
  bool cancelled_ ABSL_GUARDED_BY(mu_) = false;
};

class FakePrefillClient : public PrefillClient {
 public:
  FakePrefillClient(PrefillScript script, std::string worker_id, PrefillLog* log, EventLog* events)
      : script_(std::move(script)), worker_id_(std::move(worker_id)), log_(log), events_(events) {}

  std::unique_ptr<PrefillCall> Prefill(const pv1::PrefillRequest& request,
                                       absl::Time deadline) override {
    {
      absl::MutexLock lock(&log_->mu);
      log_->prefills.push_back(request);
    }
    if (events_ != nullptr) events_->Add("prefill:" + request.request_id());
    return std::make_unique<FakePrefillCall>(script_, request, worker_id_, deadline, log_);
  }

  absl::Status Release(const std::string& request_id, absl::Time) override {
    {
      absl::MutexLock lock(&log_->mu);
      log_->released.push_back(request_id);
    }
    if (events_ != nullptr) events_->Add("release:" + request_id);
    return absl::OkStatus();
  }

 private:
  const PrefillScript script_;
  const std::string worker_id_;
  PrefillLog* const log_;
  EventLog* const events_;
};

class FakePrefillFactory : public PrefillClientFactory {
 public:
  // `events` (optional) must outlive the factory.
  explicit FakePrefillFactory(EventLog* events = nullptr) : events_(events) {}
  void Set(const std::string& endpoint, const std::string& worker_id, PrefillScript script) {
    absl::MutexLock lock(&mu_);
    clients_[endpoint] = std::make_shared<FakePrefillClient>(std::move(script), worker_id,
                                                             &logs_[endpoint], events_);
  }
  PrefillLog& log(const std::string& endpoint) {
    absl::MutexLock lock(&mu_);
    return logs_[endpoint];
  }
  std::shared_ptr<PrefillClient> ForEndpoint(const std::string& endpoint, int64_t) override {
    absl::MutexLock lock(&mu_);
    return clients_.at(endpoint);
  }

 private:
  EventLog* const events_;
  absl::Mutex mu_;
  absl::flat_hash_map<std::string, std::shared_ptr<PrefillClient>> clients_ ABSL_GUARDED_BY(mu_);
  // std::map: clients hold pointers to their logs, which must not move.
  std::map<std::string, PrefillLog> logs_ ABSL_GUARDED_BY(mu_);
};

}  // namespace hmoe::router::testing
