#pragma once

// Fills weightd's data segments from the checkpoint's shard files, following the manifest. Jobs of
// up to `chunk_bytes` are sorted by shard and file offset and taken in order by `num_threads`
// threads, so the shards are read sequentially. Every checkpoint byte is read once.
//  - File-backed segments (shmem in /dev/shm) are written with pread + pwrite through a small
//    per-thread buffer, as `cp` does: write(2) allocates shmem pages without the page fault and
//    page clear that a store through a mapping costs per 4 KiB page.
//  - Mapped-only segments (SysV hugetlb) are filled by pread straight into the mapping (one fault
//    per 2 MiB or 1 GiB page).
// Column slices of down_proj (and their scales) are read by rows into the buffer and scattered
// (pwritev / memcpy) into each slice; replicas are written from the same buffer.

#include <atomic>
#include <cstdint>
#include <map>
#include <span>
#include <string>
#include <vector>

#include "absl/status/status.h"

#include "common/shm/manifest.h"

namespace hmoe::weightd {

// Where a tensor's bytes are in the checkpoint.
struct TensorSource {
  uint32_t shard = 0;  // index into LoadPlan::shard_paths
  uint64_t file_offset = 0;
  uint64_t size_bytes = 0;
  // Not null: the bytes are here in memory, not in a shard (a GGUF's kv_b_proj, dequantized at
  // open); such a tensor is copied, not read, and must not be column-split.
  const std::byte* memory = nullptr;
};

// Where a segment's bytes go: its writable mapping, and for file-backed segments an fd to write.
struct SegmentTarget {
  std::span<std::byte> map;
  int fd = -1;
};

struct LoadPlan {
  const shm::Manifest* manifest = nullptr;
  std::vector<std::string> shard_paths;
  std::map<std::string, TensorSource> sources;  // every manifest tensor
  std::vector<SegmentTarget> segments;          // by segment index
};

struct LoadOptions {
  int num_threads = 2;
  uint64_t chunk_bytes = uint64_t{16} << 20;
  const std::atomic<bool>* cancel = nullptr;  // polled between chunks
};

// Progress and accounting, updated while loading (relaxed atomics: monotone counters read by the
// progress reporter; the final values are published by thread joins).
struct LoadCounters {
  std::atomic<uint64_t> bytes_done{0};  // checkpoint bytes placed (each tensor counted once)
  std::atomic<uint64_t> bytes_read{0};  // bytes read from the shard files
};

// DataLoss naming the shard, tensor and offsets when a shard is shorter than its header claims;
// NotFound/PermissionDenied when a shard cannot be opened; Cancelled when `cancel` became true;
// Internal when the plan is inconsistent (a tensor without a source, a part outside its segment).
absl::Status LoadSegments(const LoadPlan& plan, const LoadOptions& options, LoadCounters& counters);

}  // namespace hmoe::weightd
