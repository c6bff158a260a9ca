#include "decode_worker/request.h"

#include <utility>

namespace hmoe::decode {

void RequestChannel::Push(RequestEvent event) {
  absl::MutexLock lock(&mu_);
  if (std::holds_alternative<FinishEvent>(event)) finished_ = true;
  events_.push_back(std::move(event));
}

std::optional<RequestEvent> RequestChannel::Pop(absl::Time deadline) {
  absl::MutexLock lock(&mu_);
  mu_.AwaitWithDeadline(absl::Condition(this, &RequestChannel::HasEvents), deadline);
  if (events_.empty()) return std::nullopt;
  RequestEvent e = std::move(events_.front());
  events_.pop_front();
  return e;
}

std::vector<RequestEvent> RequestChannel::Drain() {
  absl::MutexLock lock(&mu_);
  std::vector<RequestEvent> out(std::make_move_iterator(events_.begin()),
                                std::make_move_iterator(events_.end()));
  events_.clear();
  return out;
}

bool RequestChannel::finished() const {
  absl::MutexLock lock(&mu_);
  return finished_;
}

}  // namespace hmoe::decode
