#pragma once

// The POD at offset 0 of an instance's control segment (/dev/shm/hmoe.<instance>.control), shared
// by weightd (writer) and every worker (read-only). The serialized manifest follows at
// manifest_offset. Fields change only while state != kReady, except the owner fields (owner_pid,
// owner_since_unix_ns, adopt_count), which a restarted weightd updates when it adopts the store.
// `state` and `owner_pid` are accessed through std::atomic_ref; a reader that sees kReady (acquire)
// sees everything written before it.

#include <cstdint>
#include <type_traits>

namespace hmoe::shm {

inline constexpr uint64_t kControlMagic = 0x31445457454f4d48ULL;  // "HMOEWTD1"
inline constexpr uint32_t kControlLayoutVersion = 1;
inline constexpr int kMaxSegments = 64;

enum class StoreState : uint32_t {
  kEmpty = 0,    // created, nothing recorded yet
  kLoading = 1,  // segments exist and are being filled; not usable
  kReady = 2,    // sealed and complete
  kFailed = 3,   // loading failed; the next weightd removes the leftovers
};

struct SegmentSlot {
  uint32_t kind = 0;  // SegmentKind: 0 a file in /dev/shm, 1 a SysV hugetlb segment
  int32_t shm_id = -1;
  uint32_t backing = 0;  // PageBacking
  int32_t numa_node = -1;
  uint64_t size_bytes = 0;   // size of the segment (rounded to its page size)
  uint64_t instance_id = 0;  // creator pid (SysV) or inode (file): tells ours from a recycled one
  char file_name[96] = {};   // NUL-terminated POSIX shm name, "hmoe.<instance>.g<gen>.s<index>"
};

struct ControlHeader {
  uint64_t magic;
  uint32_t layout_version;
  uint32_t header_bytes;  // sizeof(ControlHeader)
  uint32_t state;         // StoreState
  uint32_t num_segments;
  uint64_t generation;
  uint64_t identity_hi;
  uint64_t identity_lo;
  uint64_t layout_key;  // hash of the layout options; adoption requires the same
  int32_t owner_pid;    // the weightd serving this store now; 0 after a clean exit
  int32_t creator_pid;  // the weightd that loaded it
  int64_t created_unix_ns;
  int64_t ready_unix_ns;
  int64_t owner_since_unix_ns;
  uint32_t adopt_count;  // how many times a restarted weightd adopted this store
  uint32_t reserved0;
  uint64_t manifest_offset;
  uint64_t manifest_bytes;
  uint64_t manifest_checksum;  // Checksum64 of the manifest bytes
  uint64_t total_tensor_bytes;
  SegmentSlot segments[kMaxSegments];
};

static_assert(std::is_trivially_copyable_v<ControlHeader>);
static_assert(std::is_standard_layout_v<ControlHeader>);

inline const char* StoreStateName(uint32_t s) {
  switch (static_cast<StoreState>(s)) {
    case StoreState::kEmpty:
      return "empty";
    case StoreState::kLoading:
      return "loading";
    case StoreState::kReady:
      return "ready";
    case StoreState::kFailed:
      return "failed";
  }
  return "corrupt";
}

}  // namespace hmoe::shm
