#pragma once

// NUMA placement of shared-memory pages with libnuma: which memory nodes this process may use,
// binding a range to one node or interleaving it, and where pages ended up.

#include <cstddef>
#include <cstdint>
#include <map>
#include <span>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace hmoe::shm {

// The memory nodes this process may allocate on (numa_get_mems_allowed), ascending. {0} when the
// kernel has no NUMA support (numa_available() < 0): the caller treats that as one unbound node.
struct NumaTopology {
  bool available = false;
  std::vector<int> nodes;
};
NumaTopology ProbeNumaTopology();

enum class NumaBindKind { kNone, kNode, kInterleave };
struct NumaBinding {
  NumaBindKind kind = NumaBindKind::kNone;
  int node = -1;           // kNode
  std::vector<int> nodes;  // kInterleave: over these nodes
};

// Sets the memory policy of [data, data + size) (page aligned) before its pages are touched:
// mbind(MPOL_BIND) to one node, or mbind(MPOL_INTERLEAVE) over `nodes`. kNone is a no-op.
// Internal with errno text when the kernel refuses.
absl::Status ApplyNumaBinding(void* data, size_t size_bytes, const NumaBinding& binding);

// Bytes of `mem` per NUMA node, estimated by querying one page every `stride_bytes` (the pages
// are read first, so they are mapped in this process). Node -1 counts pages the kernel could not
// place (not present / error).
std::map<int, uint64_t> BytesPerNode(std::span<const std::byte> mem, uint64_t stride_bytes);

}  // namespace hmoe::shm
