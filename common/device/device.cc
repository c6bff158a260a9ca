#include "common/device/device.h"

#include <condition_variable>
#include <mutex>
#include <utility>

#include "absl/strings/str_cat.h"

#include "common/base/status_macros.h"
#include "common/device/sync_internal.h"

namespace hmoe {

const char* DeviceKindName(DeviceKind kind) {
  switch (kind) {
    case DeviceKind::kCpu:
      return "cpu";
    case DeviceKind::kCuda:
      return "cuda";
  }
  return "?";
}

DeviceBuffer& DeviceBuffer::operator=(DeviceBuffer&& other) noexcept {
  if (this != &other) {
    Reset();
    data_ = std::exchange(other.data_, nullptr);
    size_bytes_ = std::exchange(other.size_bytes_, 0);
    deleter_ = std::exchange(other.deleter_, nullptr);
    context_ = std::exchange(other.context_, nullptr);
  }
  return *this;
}

void DeviceBuffer::Reset() {
  if (data_ != nullptr && deleter_ != nullptr) deleter_(context_, data_, size_bytes_);
  data_ = nullptr;
  size_bytes_ = 0;
  deleter_ = nullptr;
  context_ = nullptr;
}

// ---------------------------------------------------------------------------------- HostEvent

// std::mutex, not absl::Mutex: see common/device/sync_internal.h.
struct HostEvent::State {
  mutable std::mutex mu;
  std::condition_variable cv;
  bool set = false;  // guarded by mu
};

HostEvent::HostEvent() : state_(std::make_unique<State>()) {}
HostEvent::~HostEvent() = default;

void HostEvent::Set() {
  {
    std::lock_guard<std::mutex> lock(state_->mu);
    state_->set = true;
  }
  state_->cv.notify_all();
}

void HostEvent::Reset() {
  std::lock_guard<std::mutex> lock(state_->mu);
  state_->set = false;
}

bool HostEvent::IsSet() const {
  std::lock_guard<std::mutex> lock(state_->mu);
  return state_->set;
}

absl::Status HostEvent::Wait(absl::Time deadline, const char* what) {
  State& s = *state_;
  std::unique_lock<std::mutex> lock(s.mu);
  if (!internal::WaitUntil(s.cv, lock, deadline, [&s] { return s.set; })) {
    return absl::DeadlineExceededError(
        absl::StrCat("wait for host event", what != nullptr ? " " : "", what != nullptr ? what : "",
                     ": deadline exceeded"));
  }
  return absl::OkStatus();
}

// ---------------------------------------------------------------------------------- EventTuple

EventTuple::EventTuple(std::unique_ptr<Event> device) : device_(std::move(device)) {}
EventTuple::~EventTuple() = default;

absl::StatusOr<std::unique_ptr<EventTuple>> EventTuple::Create(Device& device) {
  HMOE_ASSIGN_OR_RETURN(std::unique_ptr<Event> event, device.CreateEvent());
  return std::unique_ptr<EventTuple>(new EventTuple(std::move(event)));
}

absl::Status EventTuple::Signal(Stream& stream) {
  HMOE_RETURN_IF_ERROR(device_->Record(stream));
  host_.Set();
  return absl::OkStatus();
}

absl::Status EventTuple::Wait(Stream& stream, absl::Time deadline) {
  HMOE_RETURN_IF_ERROR(host_.Wait(deadline, "of event tuple"));
  return stream.WaitEvent(*device_);
}

absl::Status EventTuple::WaitHost(absl::Time deadline) {
  HMOE_RETURN_IF_ERROR(host_.Wait(deadline, "of event tuple"));
  return device_->Synchronize();
}

void EventTuple::Reset() { host_.Reset(); }

bool EventTuple::IsSet() const { return host_.IsSet(); }

}  // namespace hmoe
