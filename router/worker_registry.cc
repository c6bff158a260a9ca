#include "router/worker_registry.h"

#include <algorithm>

#include "absl/strings/str_cat.h"

#include "common/base/logging.h"

namespace hmoe::router {

absl::StatusOr<int64_t> WorkerRegistry::Register(const WorkerIdentity& identity) {
  if (identity.worker_id.empty()) return absl::InvalidArgumentError("worker_id: empty");
  if (identity.endpoint.empty()) {
    return absl::InvalidArgumentError(absl::StrCat("endpoint: empty for ", identity.worker_id));
  }
  const absl::Time now = clock_->Now();
  absl::MutexLock lock(&mu_);
  Entry& e = workers_[identity.worker_id];
  const int64_t incarnation = e.view.incarnation + 1;
  e.view = WorkerView{};
  e.view.identity = identity;
  e.view.incarnation = incarnation;
  e.view.last_heartbeat = now;
  e.marked_dead = false;
  HMOE_LOG(INFO) << "registered worker " << identity.worker_id << " ("
                 << (identity.kind == WorkerKind::kDecode ? "decode" : "prefill") << ", "
                 << identity.device << ", " << identity.endpoint << ", pid " << identity.pid
                 << ") incarnation " << incarnation;
  return incarnation;
}

absl::Status WorkerRegistry::Heartbeat(const std::string& worker_id, const WorkerLoad& load) {
  const absl::Time now = clock_->Now();
  absl::MutexLock lock(&mu_);
  auto it = workers_.find(worker_id);
  if (it == workers_.end()) {
    return absl::NotFoundError(absl::StrCat("worker ", worker_id, " is not registered"));
  }
  it->second.view.load = load;
  it->second.view.last_heartbeat = now;
  it->second.marked_dead = false;
  return absl::OkStatus();
}

void WorkerRegistry::MarkDead(const std::string& worker_id, int64_t incarnation) {
  absl::MutexLock lock(&mu_);
  auto it = workers_.find(worker_id);
  if (it == workers_.end() || it->second.view.incarnation != incarnation) return;
  if (!it->second.marked_dead) HMOE_LOG(WARNING) << "worker " << worker_id << " marked dead";
  it->second.marked_dead = true;
}

WorkerView WorkerRegistry::ViewLocked(const Entry& e, absl::Time now) const {
  WorkerView v = e.view;
  if (e.marked_dead || now - v.last_heartbeat > options_.heartbeat_timeout) {
    v.state = WorkerState::kDead;
  } else if (v.load.draining) {
    v.state = WorkerState::kDraining;
  } else {
    v.state = WorkerState::kLive;
  }
  return v;
}

std::vector<WorkerView> WorkerRegistry::Snapshot() const {
  const absl::Time now = clock_->Now();
  std::vector<WorkerView> out;
  {
    absl::MutexLock lock(&mu_);
    out.reserve(workers_.size());
    for (const auto& [id, e] : workers_) out.push_back(ViewLocked(e, now));
  }
  std::sort(out.begin(), out.end(), [](const WorkerView& a, const WorkerView& b) {
    return a.identity.worker_id < b.identity.worker_id;
  });
  return out;
}

std::vector<WorkerView> WorkerRegistry::Live(WorkerKind kind) const {
  std::vector<WorkerView> all = Snapshot();
  std::vector<WorkerView> out;
  for (WorkerView& v : all) {
    if (v.identity.kind == kind && v.state == WorkerState::kLive) out.push_back(std::move(v));
  }
  return out;
}

std::optional<WorkerView> WorkerRegistry::Find(const std::string& worker_id) const {
  const absl::Time now = clock_->Now();
  absl::MutexLock lock(&mu_);
  auto it = workers_.find(worker_id);
  if (it == workers_.end()) return std::nullopt;
  return ViewLocked(it->second, now);
}

}  // namespace hmoe::router
