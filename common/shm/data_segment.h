#pragma once

// One data segment of weightd: named shared memory that outlives every process.
//
// The segments must survive weightd (kill -9 included) and be found again, by name, by a restarted
// weightd and by workers, with no process keeping them open. That rules out memfd (MFD_HUGETLB or
// not): it dies with its last fd, so it could only be adopted if a worker passed it back. Two kinds
// remain, chosen by the page backing:
//  - kShmFile: a POSIX shm file /dev/shm/<name> (shmem, 4 KiB pages, MADV_HUGEPAGE advice where the
//    kernel's shmem_enabled honours it). weightd fills it with write(2)/sendfile(2) like `cp` does,
//    which skips a page fault and a page clear per 4 KiB (mapped stores pay both; docs/weightd.md).
//  - kSysvHugetlb: a System V segment created with SHM_HUGETLB (2 MiB or 1 GiB pages). Explicit
//    hugepages need hugetlbfs; SysV reaches the kernel's internal hugetlbfs mount, so no mounted
//    hugetlbfs is required (this host has none). The pool is reserved at shmget time, so a short
//    pool fails at creation (ENOMEM) rather than with SIGBUS later. Persists by id until IPC_RMID.
// Both carry an owner and a mode (0600 while loading, 0400 once sealed); removal (unlink,
// IPC_RMID) leaves existing mappings valid.
//
// Thread-compatible. The mapping lives as long as the object; moving keeps it.

#include <sys/types.h>

#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "absl/status/statusor.h"

#include "common/shm/hugepages.h"
#include "common/shm/numa_placement.h"

namespace hmoe::shm {

enum class SegmentKind : uint32_t { kShmFile = 0, kSysvHugetlb = 1 };

// How to find a segment again.
struct SegmentHandle {
  SegmentKind kind = SegmentKind::kShmFile;
  std::string file_name;  // kShmFile: POSIX shm name, the file /dev/shm/<file_name>
  int shm_id = -1;        // kSysvHugetlb
  // "/dev/shm/<name>" or "sysv:<id>".
  std::string ToString() const;
};

// Where the segments of a store can go: the free bytes of /dev/shm and of the hugetlb pools.
struct SharedMemoryRoom {
  uint64_t shm_free_bytes = 0;  // statvfs(/dev/shm): f_bavail * f_frsize
  uint64_t hugetlb_2m_free_bytes =
      0;  // available 2 MiB pages (free - reserved) x 2 MiB; 0: no pool
  uint64_t hugetlb_1g_free_bytes = 0;
};
// Reads it from the machine (a missing hugetlb pool counts as 0 bytes). Unavailable when /dev/shm
// cannot be stat'ed.
absl::StatusOr<SharedMemoryRoom> ReadSharedMemoryRoom();
// Bytes the segments of `segment_bytes` take in /dev/shm when they all fall back to shmem (each
// rounded up as DataSegment::Create rounds it under `mode`).
uint64_t ShmemBytesFor(const std::vector<uint64_t>& segment_bytes, HugePageMode mode);
// Whether `room` can hold segments of `segment_bytes` under `mode` (the hugetlb pools count
// only for the modes that may use them: auto, 1g, 2m). ResourceExhausted naming the size needed,
// the room available and what to do about it otherwise: a store that cannot fit is refused before
// any segment is created, instead of failing part-way with a partial store.
absl::Status CheckRoomForSegments(const std::vector<uint64_t>& segment_bytes, HugePageMode mode,
                                  const SharedMemoryRoom& room);

class DataSegment {
 public:
  // Creates a segment of at least `size_bytes` (rounded up to the backing's page size), mode 0600,
  // mapped read-write, with `numa` applied before any page is allocated. The backing follows
  // `mode` and falls back (1G -> 2M -> shmem with THP advice -> shmem) when a pool is short or the
  // kernel refuses; `why` (optional) receives one line explaining the choice. Shmem segments are
  // the file /dev/shm/<file_name>; ResourceExhausted when /dev/shm has no room for it,
  // AlreadyExists when the file exists.
  static absl::StatusOr<DataSegment> Create(uint64_t size_bytes, HugePageMode mode,
                                            const NumaBinding& numa, const std::string& file_name,
                                            std::string* why = nullptr);

  // Maps an existing segment read-only. NotFound when it no longer exists, PermissionDenied when
  // we may not read it, DataLoss when its size is not `expected_size_bytes`.
  static absl::StatusOr<DataSegment> AttachReadOnly(const SegmentHandle& handle,
                                                    uint64_t expected_size_bytes,
                                                    PageBacking backing);

  // Unlinks / IPC_RMIDs; mappings stay valid until unmapped. NotFound if already gone.
  static absl::Status Remove(const SegmentHandle& handle);

  struct Stat {
    uint64_t size_bytes = 0;
    uint32_t mode = 0;  // permission bits
    uid_t uid = 0;
    // Tells our segment from a recycled id or name: the creator pid (SysV) or inode (file).
    uint64_t instance_id = 0;
    int64_t num_attached = -1;  // SysV only
  };
  static absl::StatusOr<Stat> StatSegment(const SegmentHandle& handle);

  DataSegment(DataSegment&& other) noexcept;
  DataSegment& operator=(DataSegment&& other) noexcept;
  DataSegment(const DataSegment&) = delete;
  DataSegment& operator=(const DataSegment&) = delete;
  ~DataSegment();  // Unmaps and closes; never removes the segment.

  // Makes the segment read-only for good: the mapping becomes PROT_READ, the fd is closed and the
  // segment's mode becomes 0400, so later attaches can only be read-only.
  absl::Status Seal();

  const SegmentHandle& handle() const { return handle_; }
  PageBacking backing() const { return backing_; }
  uint64_t size_bytes() const { return size_; }
  // The value StatSegment reports as instance_id for this segment.
  uint64_t instance_id() const { return instance_id_; }
  bool writable() const { return writable_; }
  std::span<const std::byte> bytes() const { return {data_, size_}; }
  // Empty unless created by this process and not sealed.
  std::span<std::byte> mutable_bytes() {
    return writable_ ? std::span(data_, size_) : std::span<std::byte>();
  }
  // kShmFile and writable: an fd to fill the file with write(2); else -1.
  int write_fd() const { return writable_ ? fd_ : -1; }

 private:
  DataSegment(SegmentHandle handle, std::byte* data, uint64_t size, PageBacking backing,
              bool writable, int fd, uint64_t instance_id)
      : handle_(std::move(handle)),
        data_(data),
        size_(size),
        backing_(backing),
        writable_(writable),
        fd_(fd),
        instance_id_(instance_id) {}
  void Release();

  SegmentHandle handle_;
  std::byte* data_ = nullptr;
  uint64_t size_ = 0;
  PageBacking backing_ = PageBacking::kShmem;
  bool writable_ = false;
  int fd_ = -1;
  uint64_t instance_id_ = 0;
};

}  // namespace hmoe::shm
