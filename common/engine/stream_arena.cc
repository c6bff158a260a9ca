#include "common/engine/stream_arena.h"

#include <algorithm>
#include <utility>

#include "absl/strings/str_cat.h"

#include "common/base/status_macros.h"
#include "common/device/sync_internal.h"

namespace hmoe {
namespace {

size_t RoundUp(size_t bytes) {
  return (bytes + StreamArena::kAlignment - 1) / StreamArena::kAlignment * StreamArena::kAlignment;
}

}  // namespace

StreamArena::StreamArena(DeviceBuffer memory, size_t capacity)
    : memory_(std::move(memory)), capacity_(capacity) {}

absl::StatusOr<std::unique_ptr<StreamArena>> StreamArena::Create(Device& device,
                                                                 size_t capacity_bytes) {
  if (capacity_bytes == 0) return absl::InvalidArgumentError("stream arena: capacity of 0 bytes");
  const size_t capacity = RoundUp(capacity_bytes);
  HMOE_ASSIGN_OR_RETURN(DeviceBuffer memory, device.Allocate(capacity));
  return std::unique_ptr<StreamArena>(new StreamArena(std::move(memory), capacity));
}

size_t StreamArena::PlaceLocked(size_t size) const {
  if (live_.empty()) return size <= capacity_ ? 0 : SIZE_MAX;
  const Live& oldest = live_.front();
  const Live& newest = live_.back();
  const size_t tail = oldest.offset;                // first byte still in use
  const size_t head = newest.offset + newest.size;  // first byte after the newest block
  if (newest.offset >= oldest.offset) {
    // Live bytes are [tail, head): room at the end, else wrap to the start.
    if (size <= capacity_ - head) return head;
    if (size <= tail) return 0;
    return SIZE_MAX;
  }
  // Wrapped: live bytes are [tail, capacity) and [0, head); free is [head, tail).
  return size <= tail - head ? head : SIZE_MAX;
}

absl::StatusOr<StreamArena::Block> StreamArena::Allocate(size_t size_bytes, absl::Time deadline) {
  if (size_bytes == 0) return absl::InvalidArgumentError("stream arena: allocate 0 bytes");
  const size_t size = RoundUp(size_bytes);
  if (size > capacity_) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "stream arena: ", size_bytes, " bytes exceed the whole budget of ", capacity_, " bytes"));
  }
  std::unique_lock<std::mutex> lock(mu_);
  size_t offset = SIZE_MAX;
  auto fits = [&] {
    offset = PlaceLocked(size);
    return offset != SIZE_MAX;
  };
  if (!internal::WaitUntil(cv_, lock, deadline, fits)) {
    return absl::DeadlineExceededError(absl::StrCat("stream arena: ", size_bytes,
                                                    " bytes did not fit before the deadline (",
                                                    in_use_, " of ", capacity_, " bytes in use)"));
  }
  Block block;
  block.id = next_id_++;
  block.offset = offset;
  block.size_bytes = size;
  block.data = static_cast<std::byte*>(memory_.data()) + offset;
  live_.push_back(Live{block.id, offset, size, false});
  in_use_ += size;
  peak_ = std::max(peak_, in_use_);
  return block;
}

absl::Status StreamArena::Free(const Block& block) {
  {
    std::unique_lock<std::mutex> lock(mu_);
    auto it = std::find_if(live_.begin(), live_.end(),
                           [&](const Live& l) { return l.id == block.id && !l.freed; });
    if (it == live_.end()) {
      return absl::FailedPreconditionError(
          absl::StrCat("stream arena: free of block ", block.id, " which is not live"));
    }
    it->freed = true;
    in_use_ -= it->size;
    while (!live_.empty() && live_.front().freed) live_.pop_front();
  }
  cv_.notify_all();
  return absl::OkStatus();
}

void StreamArena::Reset() {
  {
    std::unique_lock<std::mutex> lock(mu_);
    live_.clear();
    in_use_ = 0;
  }
  cv_.notify_all();
}

size_t StreamArena::bytes_in_use() const {
  std::unique_lock<std::mutex> lock(mu_);
  return in_use_;
}

size_t StreamArena::peak_bytes_in_use() const {
  std::unique_lock<std::mutex> lock(mu_);
  return peak_;
}

void StreamArena::ResetPeak() {
  std::unique_lock<std::mutex> lock(mu_);
  peak_ = in_use_;
}

int64_t StreamArena::num_live_blocks() const {
  std::unique_lock<std::mutex> lock(mu_);
  int64_t n = 0;
  for (const Live& l : live_) n += l.freed ? 0 : 1;
  return n;
}

}  // namespace hmoe
