#pragma once

// What kind of pages back a data segment, and what this machine offers. Explicit hugepages come
// from the hugetlb pools (/proc/sys/vm/nr_hugepages and /sys/kernel/mm/hugepages/*); transparent
// hugepages on shared memory depend on /sys/kernel/mm/transparent_hugepage/shmem_enabled.

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"

namespace hmoe::shm {

// --hugepages: auto (the best available: 1G when the segment is large and the pool has room, else
// 2M, else shmem with THP advice, else normal pages), or a preference (1g, 2m, thp) that still
// falls back when unavailable, or off (normal pages, no advice).
enum class HugePageMode { kAuto, k1G, k2M, kThp, kOff };
absl::StatusOr<HugePageMode> ParseHugePageMode(std::string_view s);
const char* HugePageModeName(HugePageMode m);

// What a data segment actually got. Stored in the control segment per segment.
enum class PageBacking : uint32_t {
  kShmem = 0,      // shmem, base pages (THP not requested, or shmem THP disabled by the kernel)
  kShmemThp = 1,   // shmem + MADV_HUGEPAGE with shmem_enabled allowing it (huge when possible)
  kHugetlb2M = 2,  // SysV SHM_HUGETLB, 2 MiB pages (Shared_Hugetlb in smaps)
  kHugetlb1G = 3,  // SysV SHM_HUGETLB, 1 GiB pages
};
const char* PageBackingName(PageBacking b);
// Granularity the segment size is rounded to: 1 GiB, 2 MiB (hugetlb and THP), or 4 KiB.
uint64_t PageBackingRoundBytes(PageBacking b);

struct HugePagePool {
  uint64_t page_size_bytes = 0;
  int64_t total = 0;
  int64_t free = 0;
  int64_t reserved = 0;  // promised to existing mappings, not yet faulted
  int64_t available() const { return free - reserved; }
};
// Reads /sys/kernel/mm/hugepages/hugepages-<kB>kB/. NotFound when the kernel has no such pool.
absl::StatusOr<HugePagePool> ReadHugePagePool(uint64_t page_size_bytes);

// The selected value of shmem_enabled ("never", "advise", ...), or "" when it cannot be read.
std::string ShmemThpSetting();
// True when MADV_HUGEPAGE on shmem can get huge pages under `setting`.
bool ShmemThpAdviceEffective(std::string_view setting);

inline constexpr uint64_t k2MiB = uint64_t{2} << 20;
inline constexpr uint64_t k1GiB = uint64_t{1} << 30;

}  // namespace hmoe::shm
