#include "common/shm/numa_placement.h"

#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include <numa.h>
#include <numaif.h>

namespace hmoe::shm {

NumaTopology ProbeNumaTopology() {
  NumaTopology t;
  if (numa_available() < 0) {
    t.nodes = {0};
    return t;
  }
  t.available = true;
  struct bitmask* mems = numa_get_mems_allowed();
  for (int n = 0; n <= numa_max_node(); ++n) {
    if (numa_bitmask_isbitset(mems, static_cast<unsigned>(n))) t.nodes.push_back(n);
  }
  numa_bitmask_free(mems);
  if (t.nodes.empty()) t.nodes = {0};
  return t;
}

absl::Status ApplyNumaBinding(void* data, size_t size_bytes, const NumaBinding& binding) {
  if (binding.kind == NumaBindKind::kNone || size_bytes == 0) return absl::OkStatus();
  if (numa_available() < 0) return absl::UnavailableError("NUMA is not available in this kernel");
  std::vector<int> nodes =
      binding.kind == NumaBindKind::kNode ? std::vector<int>{binding.node} : binding.nodes;
  const int max_node = numa_max_node();
  // One bit per node; maxnode counts bits and the kernel wants one more than the highest.
  std::vector<unsigned long> mask((static_cast<size_t>(max_node) + 1 + 63) / 64 + 1, 0);
  for (int n : nodes) {
    if (n < 0 || n > max_node) {
      return absl::InvalidArgumentError(
          absl::StrCat("NUMA node ", n, " does not exist (max ", max_node, ")"));
    }
    mask[static_cast<size_t>(n) / 64] |= 1UL << (n % 64);
  }
  const int mode = binding.kind == NumaBindKind::kNode ? MPOL_BIND : MPOL_INTERLEAVE;
  if (mbind(data, size_bytes, mode, mask.data(), mask.size() * 64, 0) != 0) {
    return absl::InternalError(absl::StrCat("mbind(", mode == MPOL_BIND ? "bind" : "interleave",
                                            " nodes ", absl::StrJoin(nodes, ","),
                                            "): ", std::strerror(errno)));
  }
  return absl::OkStatus();
}

std::map<int, uint64_t> BytesPerNode(std::span<const std::byte> mem, uint64_t stride_bytes) {
  std::map<int, uint64_t> out;
  if (mem.empty()) return out;
  const uint64_t page = static_cast<uint64_t>(::sysconf(_SC_PAGESIZE));
  if (stride_bytes < page) stride_bytes = page;
  std::vector<void*> pages;
  volatile uint8_t sink = 0;
  for (uint64_t off = 0; off < mem.size(); off += stride_bytes) {
    sink = sink + static_cast<uint8_t>(mem[off]);  // Map the page in this process.
    pages.push_back(const_cast<std::byte*>(mem.data() + off));
  }
  std::vector<int> status(pages.size(), -1);
  const bool ok = numa_available() >= 0 &&
                  numa_move_pages(0, pages.size(), pages.data(), nullptr, status.data(), 0) == 0;
  const uint64_t step = stride_bytes;
  for (size_t i = 0; i < pages.size(); ++i) {
    const uint64_t bytes = std::min<uint64_t>(step, mem.size() - i * step);
    out[ok && status[i] >= 0 ? status[i] : -1] += bytes;
  }
  return out;
}

}  // namespace hmoe::shm
