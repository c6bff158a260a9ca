#include "common/comm/collective.h"

#include <algorithm>
#include <limits>

#include "absl/strings/str_cat.h"

namespace hmoe {

uint64_t CommCounters::total_sent() const {
  uint64_t total = 0;
  for (uint64_t b : bytes_sent) total += b;
  return total;
}

uint64_t CommCounters::total_received() const {
  uint64_t total = 0;
  for (uint64_t b : bytes_received) total += b;
  return total;
}

CommCounters CommCounters::Minus(const CommCounters& earlier) const {
  CommCounters d = *this;
  for (size_t p = 0; p < d.bytes_sent.size() && p < earlier.bytes_sent.size(); ++p) {
    d.bytes_sent[p] -= earlier.bytes_sent[p];
  }
  for (size_t p = 0; p < d.bytes_received.size() && p < earlier.bytes_received.size(); ++p) {
    d.bytes_received[p] -= earlier.bytes_received[p];
  }
  d.num_ops -= earlier.num_ops;
  return d;
}

absl::Status ValidateLayout(int world_size, std::span<const size_t> counts,
                            std::span<const size_t> offsets, const char* what) {
  if (static_cast<int>(counts.size()) != world_size ||
      static_cast<int>(offsets.size()) != world_size) {
    return absl::InvalidArgumentError(absl::StrCat(what, ": ", counts.size(), " counts and ",
                                                   offsets.size(), " offsets for ", world_size,
                                                   " ranks"));
  }
  for (int p = 0; p < world_size; ++p) {
    if (offsets[p] > std::numeric_limits<size_t>::max() - counts[p]) {
      return absl::InvalidArgumentError(absl::StrCat(what, ": region of rank ", p, " overflows"));
    }
  }
  return absl::OkStatus();
}

}  // namespace hmoe
