#include "weightd/loader.h"

#include <fcntl.h>
#include <limits.h>
#include <sys/uio.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <system_error>
#include <thread>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"

#include "common/base/mapped_file.h"
#include "common/base/status_macros.h"
#include "common/model/dtype.h"

namespace hmoe::weightd {
namespace {

using shm::Placement;
using shm::TensorEntry;
using shm::TensorPart;

// One unit of work: read [src_offset, src_offset + length) of a shard and place it.
struct Job {
  uint32_t shard = 0;
  uint64_t src_offset = 0;
  uint64_t length = 0;
  const std::byte* memory = nullptr;  // TensorSource::memory + the job's offset, or null
  const TensorEntry* tensor = nullptr;
  enum Kind { kDirect, kColumns } kind = kDirect;
  // kDirect: the bytes go to dst (contiguous); then to each of `replicas` at the same offset.
  // `targets` are the same destinations as (segment, byte offset) for the write(2) path.
  std::byte* dst = nullptr;
  std::vector<std::byte*> replicas;
  std::vector<std::pair<uint32_t, uint64_t>> targets;
  // kColumns: full rows [row_begin, row_end) of a column-split tensor.
  int64_t row_begin = 0;
  int64_t row_end = 0;
};

absl::Status ReadFully(int fd, const std::string& path, const TensorEntry& t, uint64_t offset,
                       std::byte* dst, uint64_t length, LoadCounters& counters) {
  uint64_t done = 0;
  while (done < length) {
    const size_t want = static_cast<size_t>(std::min<uint64_t>(length - done, uint64_t{1} << 30));
    const ssize_t n = ::pread(fd, dst + done, want, static_cast<off_t>(offset + done));
    if (n < 0) {
      if (errno == EINTR) continue;
      return absl::DataLossError(absl::StrCat("read shard ", path, " at ", offset + done,
                                              " for tensor \"", t.name,
                                              "\": ", std::strerror(errno)));
    }
    if (n == 0) {
      return absl::DataLossError(absl::StrCat("shard ", path, " is truncated: tensor \"", t.name,
                                              "\" needs bytes up to ", offset + length,
                                              " but the file ends at ", offset + done));
    }
    done += static_cast<uint64_t>(n);
    // Relaxed: a statistics counter.
    counters.bytes_read.fetch_add(static_cast<uint64_t>(n), std::memory_order_relaxed);
  }
  return absl::OkStatus();
}

absl::StatusOr<std::byte*> PartDestination(const LoadPlan& plan, const TensorEntry& t,
                                           const TensorPart& p) {
  if (p.segment >= plan.segments.size() || p.offset > plan.segments[p.segment].map.size() ||
      p.size_bytes > plan.segments[p.segment].map.size() - p.offset) {
    return absl::InternalError(absl::StrCat("load plan: part ", p.slice, " of \"", t.name,
                                            "\" lies outside segment ", p.segment));
  }
  return plan.segments[p.segment].map.data() + p.offset;
}

absl::StatusOr<std::vector<Job>> MakeJobs(const LoadPlan& plan, uint64_t chunk) {
  std::vector<Job> jobs;
  for (const TensorEntry& t : plan.manifest->tensors) {
    auto src_it = plan.sources.find(t.name);
    if (src_it == plan.sources.end()) {
      return absl::InternalError(absl::StrCat("load plan: no source for \"", t.name, "\""));
    }
    const TensorSource& src = src_it->second;
    if (src.size_bytes != t.size_bytes) {
      return absl::InternalError(absl::StrCat("load plan: \"", t.name, "\" has ", src.size_bytes,
                                              " bytes in the checkpoint, ", t.size_bytes,
                                              " in the manifest"));
    }
    const bool columns =
        t.placement == Placement::kSliced && t.parts.size() > 1 && t.parts[0].split_dim == 1;
    if (src.memory != nullptr && t.placement == Placement::kSliced && t.parts.size() > 1) {
      return absl::InternalError(
          absl::StrCat("load plan: \"", t.name, "\" comes from memory and cannot be split"));
    }
    if (columns) {
      const uint64_t row_bytes = static_cast<uint64_t>(t.shape[1]) * DTypeSize(t.dtype);
      const int64_t rows = t.shape[0];
      const int64_t rows_per_job =
          std::max<int64_t>(1, static_cast<int64_t>(chunk / std::max<uint64_t>(row_bytes, 1)));
      for (const TensorPart& p : t.parts)
        HMOE_RETURN_IF_ERROR(PartDestination(plan, t, p).status());
      for (int64_t r = 0; r < rows; r += rows_per_job) {
        Job j;
        j.shard = src.shard;
        j.tensor = &t;
        j.kind = Job::kColumns;
        j.row_begin = r;
        j.row_end = std::min(rows, r + rows_per_job);
        j.src_offset = src.file_offset + static_cast<uint64_t>(r) * row_bytes;
        j.length = static_cast<uint64_t>(j.row_end - j.row_begin) * row_bytes;
        jobs.push_back(std::move(j));
      }
      continue;
    }
    // Contiguous destinations: the whole tensor (dense, replicated, one slice) or row slices.
    const bool row_slices = t.placement == Placement::kSliced && t.parts.size() > 1;
    std::vector<const TensorPart*> targets;
    if (row_slices) {
      for (const TensorPart& p : t.parts) targets.push_back(&p);
    } else {
      targets.push_back(&t.parts[0]);
    }
    for (const TensorPart* p : targets) {
      HMOE_ASSIGN_OR_RETURN(std::byte * dst, PartDestination(plan, t, *p));
      std::vector<std::byte*> replicas;
      if (!row_slices) {
        for (size_t i = 1; i < t.parts.size(); ++i) {
          HMOE_ASSIGN_OR_RETURN(std::byte * r, PartDestination(plan, t, t.parts[i]));
          replicas.push_back(r);
        }
      }
      const uint64_t row_bytes =
          row_slices ? static_cast<uint64_t>(t.shape[1]) * DTypeSize(t.dtype) : 0;
      const uint64_t base = src.file_offset + (row_slices ? p->begin * row_bytes : 0);
      for (uint64_t off = 0; off < p->size_bytes; off += chunk) {
        Job j;
        j.shard = src.shard;
        j.tensor = &t;
        j.kind = Job::kDirect;
        j.src_offset = base + off;
        j.length = std::min(chunk, p->size_bytes - off);
        if (src.memory != nullptr) j.memory = src.memory + off;
        j.dst = dst + off;
        for (std::byte* r : replicas) j.replicas.push_back(r + off);
        j.targets.push_back({p->segment, p->offset + off});
        if (!row_slices) {
          for (size_t i = 1; i < t.parts.size(); ++i) {
            j.targets.push_back({t.parts[i].segment, t.parts[i].offset + off});
          }
        }
        jobs.push_back(std::move(j));
      }
    }
  }
  std::sort(jobs.begin(), jobs.end(), [](const Job& a, const Job& b) {
    return a.shard != b.shard ? a.shard < b.shard : a.src_offset < b.src_offset;
  });
  return jobs;
}

absl::Status WriteFully(int fd, const std::string& what, const struct iovec* iov, int iovcnt,
                        uint64_t offset) {
  std::vector<struct iovec> rest(iov, iov + iovcnt);
  size_t first = 0;
  while (first < rest.size()) {
    const int n_iov = static_cast<int>(std::min<size_t>(rest.size() - first, IOV_MAX));
    const ssize_t n = ::pwritev(fd, rest.data() + first, n_iov, static_cast<off_t>(offset));
    if (n < 0) {
      if (errno == EINTR) continue;
      const std::string message = absl::StrCat("write ", what, ": ", std::strerror(errno));
      return errno == ENOSPC || errno == ENOMEM ? absl::ResourceExhaustedError(message)
                                                : absl::InternalError(message);
    }
    offset += static_cast<uint64_t>(n);
    size_t left = static_cast<size_t>(n);
    while (left > 0 && first < rest.size()) {
      if (left >= rest[first].iov_len) {
        left -= rest[first].iov_len;
        ++first;
      } else {
        rest[first].iov_base = static_cast<char*>(rest[first].iov_base) + left;
        rest[first].iov_len -= left;
        left = 0;
      }
    }
  }
  return absl::OkStatus();
}

absl::Status WriteAt(const LoadPlan& plan, uint32_t segment, uint64_t offset, const std::byte* src,
                     uint64_t length) {
  struct iovec iov {
    const_cast<std::byte*>(src), static_cast<size_t>(length)
  };
  return WriteFully(plan.segments[segment].fd, absl::StrCat("segment ", segment), &iov, 1, offset);
}

// Small enough to stay in L2 between the read and the write.
constexpr uint64_t kBouncePiece = uint64_t{1} << 20;

absl::Status RunJob(const LoadPlan& plan, const Job& j, const std::vector<UniqueFd>& fds,
                    std::vector<std::byte>& bounce, LoadCounters& counters) {
  const std::string& path = plan.shard_paths[j.shard];
  const int fd = fds[j.shard].get();
  const TensorEntry& t = *j.tensor;
  if (j.kind == Job::kDirect && j.memory != nullptr) {
    for (const auto& [segment, offset] : j.targets) {
      if (plan.segments[segment].fd >= 0) {
        HMOE_RETURN_IF_ERROR(WriteAt(plan, segment, offset, j.memory, j.length));
      } else {
        std::memcpy(plan.segments[segment].map.data() + offset, j.memory, j.length);
      }
    }
  } else if (j.kind == Job::kDirect) {
    if (plan.segments[j.targets[0].first].fd < 0) {
      // Mapped segment: read straight into it, then copy replicas.
      HMOE_RETURN_IF_ERROR(ReadFully(fd, path, t, j.src_offset, j.dst, j.length, counters));
      for (std::byte* r : j.replicas) std::memcpy(r, j.dst, j.length);
    } else {
      if (bounce.size() < kBouncePiece) bounce.resize(kBouncePiece);
      for (uint64_t off = 0; off < j.length; off += kBouncePiece) {
        const uint64_t n = std::min(kBouncePiece, j.length - off);
        HMOE_RETURN_IF_ERROR(
            ReadFully(fd, path, t, j.src_offset + off, bounce.data(), n, counters));
        for (const auto& [segment, offset] : j.targets) {
          if (plan.segments[segment].fd >= 0) {
            HMOE_RETURN_IF_ERROR(WriteAt(plan, segment, offset + off, bounce.data(), n));
          } else {
            std::memcpy(plan.segments[segment].map.data() + offset + off, bounce.data(), n);
          }
        }
      }
    }
  } else {
    if (bounce.size() < j.length) bounce.resize(j.length);
    HMOE_RETURN_IF_ERROR(ReadFully(fd, path, t, j.src_offset, bounce.data(), j.length, counters));
    const size_t esize = DTypeSize(t.dtype);
    const size_t row_bytes = static_cast<size_t>(t.shape[1]) * esize;
    std::vector<struct iovec> iov;
    for (const TensorPart& p : t.parts) {
      const size_t width = static_cast<size_t>(p.end - p.begin) * esize;
      if (width == 0) continue;
      const SegmentTarget& target = plan.segments[p.segment];
      iov.clear();
      for (int64_t r = j.row_begin; r < j.row_end; ++r) {
        std::byte* src = bounce.data() + static_cast<size_t>(r - j.row_begin) * row_bytes +
                         static_cast<size_t>(p.begin) * esize;
        if (target.fd >= 0) {
          iov.push_back(iovec{src, width});
        } else {
          std::memcpy(target.map.data() + p.offset + static_cast<size_t>(r) * width, src, width);
        }
      }
      if (target.fd >= 0) {
        HMOE_RETURN_IF_ERROR(WriteFully(target.fd, absl::StrCat("segment ", p.segment), iov.data(),
                                        static_cast<int>(iov.size()),
                                        p.offset + static_cast<uint64_t>(j.row_begin) * width));
      }
    }
  }
  // Relaxed: progress statistics.
  counters.bytes_done.fetch_add(j.length, std::memory_order_relaxed);
  return absl::OkStatus();
}

}  // namespace

absl::Status LoadSegments(const LoadPlan& plan, const LoadOptions& options,
                          LoadCounters& counters) {
  if (plan.manifest == nullptr) return absl::InternalError("load plan without a manifest");
  HMOE_ASSIGN_OR_RETURN(std::vector<Job> jobs,
                        MakeJobs(plan, std::max<uint64_t>(options.chunk_bytes, 4096)));

  std::vector<UniqueFd> fds;
  for (const std::string& path : plan.shard_paths) {
    UniqueFd fd(::open(path.c_str(), O_RDONLY | O_CLOEXEC));
    if (!fd.valid()) {
      const int err = errno;
      const std::string message = absl::StrCat("open shard ", path, ": ", std::strerror(err));
      if (err == ENOENT) return absl::NotFoundError(message);
      if (err == EACCES || err == EPERM) return absl::PermissionDeniedError(message);
      return absl::InternalError(message);
    }
    ::posix_fadvise(fd.get(), 0, 0, POSIX_FADV_SEQUENTIAL);
    fds.push_back(std::move(fd));
  }

  std::atomic<size_t> next{0};
  std::atomic<bool> failed{false};
  absl::Mutex mu;
  absl::Status first_error;
  auto worker = [&]() {
    std::vector<std::byte> bounce;
    while (true) {
      // Relaxed: the flags only stop the loop early; results are published by the thread join.
      if (failed.load(std::memory_order_relaxed)) return;
      if (options.cancel != nullptr && options.cancel->load(std::memory_order_relaxed)) {
        absl::MutexLock lock(&mu);
        if (first_error.ok()) first_error = absl::CancelledError("loading cancelled");
        failed.store(true, std::memory_order_relaxed);
        return;
      }
      const size_t i = next.fetch_add(1, std::memory_order_relaxed);
      if (i >= jobs.size()) return;
      absl::Status s = RunJob(plan, jobs[i], fds, bounce, counters);
      if (!s.ok()) {
        absl::MutexLock lock(&mu);
        if (first_error.ok()) first_error = std::move(s);
        failed.store(true, std::memory_order_relaxed);
        return;
      }
    }
  };
  {
    std::vector<std::jthread> threads;
    const int n = std::max(1, options.num_threads);
    for (int i = 1; i < n; ++i) {
      try {
        threads.emplace_back(worker);
      } catch (const std::system_error& e) {
        // Fewer threads is slower, not wrong: the calling thread still drains the queue.
        break;
      }
    }
    worker();
  }  // Joins.
  absl::MutexLock lock(&mu);
  return first_error;
}

}  // namespace hmoe::weightd
