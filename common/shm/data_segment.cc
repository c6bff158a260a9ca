#include "common/shm/data_segment.h"

#include <fcntl.h>
#include <sys/ipc.h>
#include <sys/mman.h>
#include <sys/shm.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"

#include "common/base/errno_status.h"
#include "common/base/logging.h"

#ifndef SHM_HUGE_SHIFT
#define SHM_HUGE_SHIFT 26
#endif
#ifndef SHM_HUGE_2MB
#define SHM_HUGE_2MB (21 << SHM_HUGE_SHIFT)
#endif
#ifndef SHM_HUGE_1GB
#define SHM_HUGE_1GB (30 << SHM_HUGE_SHIFT)
#endif

namespace hmoe::shm {
namespace {

uint64_t RoundUp(uint64_t v, uint64_t a) { return (v + a - 1) / a * a; }

std::string ShmPath(const std::string& name) { return "/dev/shm/" + name; }

// Whether the hugetlb pool of `page` bytes can hold `size` bytes; explains when not.
bool PoolHasRoom(uint64_t page, uint64_t size, std::string& reason) {
  absl::StatusOr<HugePagePool> pool = ReadHugePagePool(page);
  if (!pool.ok()) {
    reason = absl::StrCat("no ", page >> 20, " MiB hugepage pool (", pool.status().message(), ")");
    return false;
  }
  const int64_t need = static_cast<int64_t>(RoundUp(size, page) / page);
  if (pool->available() < need) {
    reason = absl::StrCat(page >> 20, " MiB pool has ", pool->available(), " free pages (total ",
                          pool->total, "), need ", need);
    return false;
  }
  return true;
}

}  // namespace

absl::StatusOr<SharedMemoryRoom> ReadSharedMemoryRoom() {
  SharedMemoryRoom room;
  struct statvfs vfs {};
  if (::statvfs("/dev/shm", &vfs) != 0) return ErrnoStatus(errno, "statvfs /dev/shm");
  room.shm_free_bytes = static_cast<uint64_t>(vfs.f_bavail) * vfs.f_frsize;
  for (const uint64_t page : {k2MiB, k1GiB}) {
    absl::StatusOr<HugePagePool> pool = ReadHugePagePool(page);
    const uint64_t free =
        pool.ok() && pool->available() > 0 ? static_cast<uint64_t>(pool->available()) * page : 0;
    (page == k2MiB ? room.hugetlb_2m_free_bytes : room.hugetlb_1g_free_bytes) = free;
  }
  return room;
}

uint64_t ShmemBytesFor(const std::vector<uint64_t>& segment_bytes, HugePageMode mode) {
  uint64_t total = 0;
  for (const uint64_t b : segment_bytes) {
    total += RoundUp(std::max<uint64_t>(b, 1), mode == HugePageMode::kOff ? 4096 : k2MiB);
  }
  return total;
}

absl::Status CheckRoomForSegments(const std::vector<uint64_t>& segment_bytes, HugePageMode mode,
                                  const SharedMemoryRoom& room) {
  const uint64_t need = ShmemBytesFor(segment_bytes, mode);
  const bool hugetlb =
      mode == HugePageMode::kAuto || mode == HugePageMode::k1G || mode == HugePageMode::k2M;
  const uint64_t huge = hugetlb ? room.hugetlb_2m_free_bytes + room.hugetlb_1g_free_bytes : 0;
  if (need <= room.shm_free_bytes + huge) return absl::OkStatus();
  auto mib = [](uint64_t b) {
    return absl::StrFormat("%.1f MiB", static_cast<double>(b) / (1 << 20));
  };
  return absl::ResourceExhaustedError(absl::StrCat(
      "not enough shared memory for the weights: the store needs ", mib(need), " (", need,
      " bytes in ", segment_bytes.size(), " segment(s)); /dev/shm has ", mib(room.shm_free_bytes),
      " free",
      hugetlb ? absl::StrCat(", the hugetlb pools ", mib(room.hugetlb_2m_free_bytes),
                             " (2 MiB pages) + ", mib(room.hugetlb_1g_free_bytes),
                             " (1 GiB pages) free")
              : std::string(" (hugetlb pools not used with --hugepages ") + HugePageModeName(mode) +
                    ")",
      ". Enlarge /dev/shm (mount -o remount,size=... /dev/shm; in a container --shm-size), reserve "
      "hugepages (vm.nr_hugepages), or free shared memory (stale stores: hmoe-weightd-inspect)"));
}

std::string SegmentHandle::ToString() const {
  return kind == SegmentKind::kShmFile ? ShmPath(file_name) : absl::StrCat("sysv:", shm_id);
}

absl::StatusOr<DataSegment> DataSegment::Create(uint64_t size_bytes, HugePageMode mode,
                                                const NumaBinding& numa,
                                                const std::string& file_name, std::string* why) {
  if (size_bytes == 0) size_bytes = 1;
  std::string story;
  auto note = [&story](const std::string& s) {
    if (!story.empty()) story += "; ";
    story += s;
  };

  // Explicit hugepages: SysV SHM_HUGETLB, tried in order of preference.
  std::vector<PageBacking> hugetlb;
  const bool big_enough = RoundUp(size_bytes, k1GiB) - size_bytes <= size_bytes / 32;
  if (mode == HugePageMode::k1G || (mode == HugePageMode::kAuto && big_enough)) {
    hugetlb.push_back(PageBacking::kHugetlb1G);
  } else if (mode == HugePageMode::kAuto) {
    note("not hugetlb-1g: segment too small for 1 GiB pages");
  }
  if (mode == HugePageMode::kAuto || mode == HugePageMode::k1G || mode == HugePageMode::k2M) {
    hugetlb.push_back(PageBacking::kHugetlb2M);
  }
  for (PageBacking b : hugetlb) {
    const uint64_t page = PageBackingRoundBytes(b);
    std::string reason;
    if (!PoolHasRoom(page, size_bytes, reason)) {
      note(absl::StrCat("not ", PageBackingName(b), ": ", reason));
      continue;
    }
    const uint64_t size = RoundUp(size_bytes, page);
    const int flags = IPC_CREAT | IPC_EXCL | 0600 | SHM_HUGETLB |
                      (b == PageBacking::kHugetlb1G ? SHM_HUGE_1GB : SHM_HUGE_2MB);
    const int id = ::shmget(IPC_PRIVATE, size, flags);
    if (id < 0) {
      note(absl::StrCat("not ", PageBackingName(b), ": shmget: ", std::strerror(errno)));
      continue;
    }
    void* p = ::shmat(id, nullptr, 0);
    if (p == reinterpret_cast<void*>(-1)) {
      const int err = errno;
      ::shmctl(id, IPC_RMID, nullptr);
      return ErrnoStatus(err, absl::StrCat("shmat sysv:", id));
    }
    struct shmid_ds ds {};
    ::shmctl(id, IPC_STAT, &ds);
    DataSegment segment(SegmentHandle{SegmentKind::kSysvHugetlb, "", id},
                        static_cast<std::byte*>(p), size, b, /*writable=*/true, /*fd=*/-1,
                        static_cast<uint64_t>(ds.shm_cpid));
    if (absl::Status s = ApplyNumaBinding(p, size, numa); !s.ok()) {
      // Placement is an optimization: a refused mbind must not stop the weights from loading.
      HMOE_LOG(WARNING) << "segment sysv:" << id << ": NUMA placement not applied: " << s.message();
    }
    note(absl::StrCat("using ", PageBackingName(b)));
    if (why != nullptr) *why = story;
    return segment;
  }

  // Shmem: a file in /dev/shm.
  PageBacking backing = PageBacking::kShmem;
  const bool advise = mode != HugePageMode::kOff;
  if (!advise) {
    note("hugepages off: normal shmem pages");
  } else {
    const std::string setting = ShmemThpSetting();
    if (ShmemThpAdviceEffective(setting)) {
      backing = PageBacking::kShmemThp;
      note(absl::StrCat("shmem with MADV_HUGEPAGE (shmem_enabled=", setting, ")"));
    } else {
      note(
          absl::StrCat("shmem with MADV_HUGEPAGE advice, but the kernel ignores it (shmem_enabled=",
                       setting.empty() ? "unknown" : setting, "): normal pages"));
    }
  }
  const uint64_t size = RoundUp(size_bytes, advise ? k2MiB : 4096);
  const std::string path = ShmPath(file_name);
  const int fd = ::shm_open(file_name.c_str(), O_RDWR | O_CREAT | O_EXCL | O_CLOEXEC, 0600);
  if (fd < 0) return ErrnoStatus(errno, absl::StrCat("create ", path));
  auto fail = [&](int err, const std::string& what) {
    ::close(fd);
    ::shm_unlink(file_name.c_str());
    return ErrnoStatus(err, absl::StrCat(what, " ", path));
  };
  if (::fchmod(fd, 0600) != 0) return fail(errno, "chmod");  // Regardless of the umask.
  if (::ftruncate(fd, static_cast<off_t>(size)) != 0) return fail(errno, "truncate");
  void* p = ::mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  if (p == MAP_FAILED) return fail(errno, "mmap");
  struct stat st {};
  ::fstat(fd, &st);
  DataSegment segment(SegmentHandle{SegmentKind::kShmFile, file_name, -1},
                      static_cast<std::byte*>(p), size, backing, /*writable=*/true, fd,
                      static_cast<uint64_t>(st.st_ino));
  if (advise && ::madvise(p, size, MADV_HUGEPAGE) != 0) {
    note(absl::StrCat("madvise(MADV_HUGEPAGE) failed: ", std::strerror(errno)));
  }
  // The policy of a shmem mapping is the file's shared policy: it also places the pages write(2)
  // allocates. Set before fallocate allocates them.
  if (absl::Status s = ApplyNumaBinding(p, size, numa); !s.ok()) {
    HMOE_LOG(WARNING) << "segment " << path << ": NUMA placement not applied: " << s.message();
  }
  // Pages are allocated by the writes that fill the file (in parallel, by the loader threads). A
  // /dev/shm without room fails here, before a long load; should it fill up later, write(2)
  // reports ENOSPC (nothing stores through the mapping, so there is no SIGBUS).
  struct statvfs vfs {};
  if (::fstatvfs(fd, &vfs) == 0 && static_cast<uint64_t>(vfs.f_bavail) * vfs.f_frsize < size) {
    ::shm_unlink(file_name.c_str());
    return absl::ResourceExhaustedError(
        absl::StrCat("/dev/shm has ", static_cast<uint64_t>(vfs.f_bavail) * vfs.f_frsize,
                     " bytes free, segment ", path, " needs ", size));
  }
  if (why != nullptr) *why = story;
  return segment;
}

absl::StatusOr<DataSegment> DataSegment::AttachReadOnly(const SegmentHandle& handle,
                                                        uint64_t expected_size_bytes,
                                                        PageBacking backing) {
  if (handle.kind == SegmentKind::kSysvHugetlb) {
    struct shmid_ds ds {};
    if (::shmctl(handle.shm_id, IPC_STAT, &ds) != 0) {
      return ErrnoStatus(errno, absl::StrCat("stat ", handle.ToString()));
    }
    if (ds.shm_perm.mode & SHM_DEST) {
      return absl::NotFoundError(absl::StrCat(handle.ToString(), " has been removed"));
    }
    if (ds.shm_segsz != expected_size_bytes) {
      return absl::DataLossError(absl::StrCat(handle.ToString(), " has ", ds.shm_segsz,
                                              " bytes, the control segment says ",
                                              expected_size_bytes));
    }
    void* p = ::shmat(handle.shm_id, nullptr, SHM_RDONLY);
    if (p == reinterpret_cast<void*>(-1)) {
      return ErrnoStatus(errno, absl::StrCat("attach ", handle.ToString(), " read-only"));
    }
    return DataSegment(handle, static_cast<std::byte*>(p), expected_size_bytes, backing,
                       /*writable=*/false, /*fd=*/-1, static_cast<uint64_t>(ds.shm_cpid));
  }
  const int fd = ::shm_open(handle.file_name.c_str(), O_RDONLY | O_CLOEXEC, 0);
  if (fd < 0) return ErrnoStatus(errno, absl::StrCat("open ", handle.ToString()));
  struct stat st {};
  if (::fstat(fd, &st) != 0) {
    const int err = errno;
    ::close(fd);
    return ErrnoStatus(err, absl::StrCat("stat ", handle.ToString()));
  }
  if (static_cast<uint64_t>(st.st_size) != expected_size_bytes) {
    ::close(fd);
    return absl::DataLossError(absl::StrCat(handle.ToString(), " has ", st.st_size,
                                            " bytes, the control segment says ",
                                            expected_size_bytes));
  }
  void* p = ::mmap(nullptr, expected_size_bytes, PROT_READ, MAP_SHARED, fd, 0);
  const int err = errno;
  ::close(fd);  // The mapping keeps the file.
  if (p == MAP_FAILED) return ErrnoStatus(err, absl::StrCat("map ", handle.ToString()));
  if (backing == PageBacking::kShmemThp) ::madvise(p, expected_size_bytes, MADV_HUGEPAGE);
  return DataSegment(handle, static_cast<std::byte*>(p), expected_size_bytes, backing,
                     /*writable=*/false, /*fd=*/-1, static_cast<uint64_t>(st.st_ino));
}

absl::Status DataSegment::Remove(const SegmentHandle& handle) {
  if (handle.kind == SegmentKind::kSysvHugetlb) {
    if (::shmctl(handle.shm_id, IPC_RMID, nullptr) != 0) {
      return ErrnoStatus(errno, absl::StrCat("remove ", handle.ToString()));
    }
    return absl::OkStatus();
  }
  if (::shm_unlink(handle.file_name.c_str()) != 0) {
    return ErrnoStatus(errno, absl::StrCat("remove ", handle.ToString()));
  }
  return absl::OkStatus();
}

absl::StatusOr<DataSegment::Stat> DataSegment::StatSegment(const SegmentHandle& handle) {
  Stat st;
  if (handle.kind == SegmentKind::kSysvHugetlb) {
    struct shmid_ds ds {};
    if (::shmctl(handle.shm_id, IPC_STAT, &ds) != 0) {
      return ErrnoStatus(errno, absl::StrCat("stat ", handle.ToString()));
    }
    st.size_bytes = ds.shm_segsz;
    st.mode = ds.shm_perm.mode & 0777;
    st.uid = ds.shm_perm.uid;
    st.instance_id = static_cast<uint64_t>(ds.shm_cpid);
    st.num_attached = static_cast<int64_t>(ds.shm_nattch);
    return st;
  }
  struct stat s {};
  if (::lstat(ShmPath(handle.file_name).c_str(), &s) != 0) {
    return ErrnoStatus(errno, absl::StrCat("stat ", handle.ToString()));
  }
  if (!S_ISREG(s.st_mode)) {
    return absl::PermissionDeniedError(absl::StrCat(handle.ToString(), " is not a regular file"));
  }
  st.size_bytes = static_cast<uint64_t>(s.st_size);
  st.mode = s.st_mode & 0777;
  st.uid = s.st_uid;
  st.instance_id = static_cast<uint64_t>(s.st_ino);
  return st;
}

DataSegment::DataSegment(DataSegment&& other) noexcept
    : handle_(std::move(other.handle_)),
      data_(std::exchange(other.data_, nullptr)),
      size_(std::exchange(other.size_, 0)),
      backing_(other.backing_),
      writable_(std::exchange(other.writable_, false)),
      fd_(std::exchange(other.fd_, -1)),
      instance_id_(other.instance_id_) {}

DataSegment& DataSegment::operator=(DataSegment&& other) noexcept {
  if (this != &other) {
    Release();
    handle_ = std::move(other.handle_);
    data_ = std::exchange(other.data_, nullptr);
    size_ = std::exchange(other.size_, 0);
    backing_ = other.backing_;
    writable_ = std::exchange(other.writable_, false);
    fd_ = std::exchange(other.fd_, -1);
    instance_id_ = other.instance_id_;
  }
  return *this;
}

DataSegment::~DataSegment() { Release(); }

void DataSegment::Release() {
  if (data_ != nullptr) {
    const int rc =
        handle_.kind == SegmentKind::kSysvHugetlb ? ::shmdt(data_) : ::munmap(data_, size_);
    if (rc != 0)
      HMOE_LOG(WARNING) << "unmap " << handle_.ToString() << ": " << std::strerror(errno);
  }
  data_ = nullptr;
  if (fd_ >= 0) ::close(fd_);
  fd_ = -1;
}

absl::Status DataSegment::Seal() {
  if (data_ == nullptr) return absl::FailedPreconditionError("seal: segment not mapped");
  if (::mprotect(data_, size_, PROT_READ) != 0) {
    return ErrnoStatus(errno, absl::StrCat("mprotect ", handle_.ToString(), " read-only"));
  }
  writable_ = false;
  if (handle_.kind == SegmentKind::kSysvHugetlb) {
    struct shmid_ds ds {};
    if (::shmctl(handle_.shm_id, IPC_STAT, &ds) != 0) {
      return ErrnoStatus(errno, absl::StrCat("stat ", handle_.ToString()));
    }
    ds.shm_perm.mode = 0400;
    if (::shmctl(handle_.shm_id, IPC_SET, &ds) != 0) {
      return ErrnoStatus(errno, absl::StrCat("chmod ", handle_.ToString(), " 0400"));
    }
    return absl::OkStatus();
  }
  if (::fchmod(fd_, 0400) != 0) {
    return ErrnoStatus(errno, absl::StrCat("chmod ", handle_.ToString(), " 0400"));
  }
  ::close(fd_);
  fd_ = -1;
  return absl::OkStatus();
}

}  // namespace hmoe::shm
