#include "common/comm/shm_collective.h"

#include <dirent.h>
#include <fcntl.h>
#include <linux/futex.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <climits>
#include <cstring>
#include <fstream>
#include <new>
#include <utility>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"

#include "common/base/logging.h"
#include "common/base/status_macros.h"

namespace hmoe {
namespace {

constexpr uint64_t kMagic = 0x314d4d4f43454f4dull;  // "MOECOMM1" in memory order
constexpr uint32_t kVersion = 2;  // 2: slots pass through kSlotClaimed before kSlotAttached
constexpr size_t kMessageHeaderBytes = 16;
constexpr size_t kMinChannelBytes = 4096;
constexpr size_t kMaxGroupNameBytes = 200;
constexpr int kMaxWorldSize = 1024;

// Why a group failed (ShmHeader::failure).
enum FailureReason : uint64_t {
  kNoFailure = 0,
  kDied = 1,       // the process is gone (or a zombie)
  kLeft = 2,       // destroyed its ShmCollective while others needed it
  kHung = 3,       // heartbeat older than peer_timeout
  kMismatch = 4,   // ranks called different collectives
  kTimeout = 5,    // op_timeout expired
  kJoin = 6,       // the group did not form
  kCancelled = 7,  // its caller cancelled (ShmCollectiveOptions::cancelled)
};

const char* ReasonText(uint64_t reason) {
  switch (reason) {
    case kDied:
      return "died";
    case kLeft:
      return "left the group";
    case kHung:
      return "stopped responding (heartbeat timeout)";
    case kMismatch:
      return "ran a mismatching collective";
    case kTimeout:
      return "timed out in a collective";
    case kJoin:
      return "did not join";
    case kCancelled:
      return "gave up (cancelled)";
    default:
      return "failed";
  }
}

// Slot states. A rank claims its slot (kSlotClaimed), writes its pid and first heartbeat, and
// only then publishes kSlotAttached (release), so a peer that sees kSlotAttached (acquire) also
// sees the pid: checking a pid not yet written would call a live rank dead.
constexpr int32_t kSlotFree = 0;
constexpr int32_t kSlotAttached = 1;
constexpr int32_t kSlotDeparted = 2;
constexpr int32_t kSlotClaimed = 3;

static_assert(std::atomic<uint64_t>::is_always_lock_free &&
                  std::atomic<int64_t>::is_always_lock_free &&
                  std::atomic<uint32_t>::is_always_lock_free &&
                  std::atomic<int32_t>::is_always_lock_free,
              "atomics in shared memory must be lock-free (address-free)");

// The first bytes of the object. Atomics in shared memory are lock-free, hence address-free:
// every process maps them at its own address.
struct alignas(64) ShmHeader {
  std::atomic<uint64_t> magic;  // stored last (release) by the creator
  uint32_t version;
  int32_t world_size;
  uint64_t channel_bytes;
  uint64_t total_bytes;
  int32_t creator_pid;
  uint32_t creator_uid;
  std::atomic<int32_t> attached;  // ranks that claimed their slot
  // 0, or reason | culprit << 8 | noticer << 24 (first failure wins).
  std::atomic<uint64_t> failure;
};

struct alignas(64) RankSlot {
  std::atomic<int32_t> state;
  std::atomic<int32_t> pid;
  std::atomic<int64_t> heartbeat_ns;  // CLOCK_MONOTONIC (one clock for the node)
  // The futex word the rank sleeps on; peers bump it (and wake it) when they change a channel
  // the rank may be waiting for.
  alignas(64) std::atomic<uint32_t> doorbell;
};

// One direction between two ranks: a single-producer single-consumer byte ring. head and tail are
// byte counts since creation (never wrap in practice: 2^64 bytes).
struct alignas(64) ChannelHeader {
  alignas(64) std::atomic<uint64_t> head;  // bytes written (producer)
  alignas(64) std::atomic<uint64_t> tail;  // bytes consumed (consumer)
};

size_t RoundUp(size_t x, size_t a) { return (x + a - 1) / a * a; }

struct Layout {
  size_t slots = 0;     // offset of RankSlot[world]
  size_t channels = 0;  // offset of ChannelHeader[world * world]
  size_t data = 0;      // offset of the first ring; ring (src, dst) at data + (src * w + dst) * cb
  size_t total = 0;

  static Layout For(int world, size_t channel_bytes) {
    Layout l;
    l.slots = RoundUp(sizeof(ShmHeader), 64);
    l.channels = RoundUp(l.slots + sizeof(RankSlot) * world, 64);
    l.data = RoundUp(l.channels + sizeof(ChannelHeader) * world * world, 4096);
    // Rings of (r, r) are never touched: the object is sparse, they cost no memory.
    l.total = l.data + channel_bytes * world * world;
    return l;
  }
};

int64_t MonotonicNs() {
  timespec ts;
  ::clock_gettime(CLOCK_MONOTONIC, &ts);
  return static_cast<int64_t>(ts.tv_sec) * 1000000000 + ts.tv_nsec;
}

void FutexWait(std::atomic<uint32_t>* word, uint32_t expected, absl::Duration timeout) {
  const int64_t ns = std::max<int64_t>(absl::ToInt64Nanoseconds(timeout), 1000);
  timespec ts;
  ts.tv_sec = ns / 1000000000;
  ts.tv_nsec = ns % 1000000000;
  // Not FUTEX_PRIVATE_FLAG: the word is shared between processes. EAGAIN (the word changed),
  // EINTR and ETIMEDOUT all mean "look again".
  ::syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), FUTEX_WAIT, expected, &ts, nullptr, 0);
}

void FutexWakeAll(std::atomic<uint32_t>* word) {
  ::syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), FUTEX_WAKE, INT_MAX, nullptr, nullptr, 0);
}

// Whether `pid` names a live (not zombie) process.
bool ProcessAlive(int32_t pid) {
  if (pid <= 0) return false;
  if (::kill(pid, 0) != 0 && errno == ESRCH) return false;
  std::ifstream stat(absl::StrCat("/proc/", pid, "/stat"));
  std::string line;
  if (!stat.is_open() || !std::getline(stat, line)) return true;  // no /proc: trust kill()
  // "pid (comm) S ...": comm may hold spaces and parentheses; the state follows the last ')'.
  const size_t close = line.rfind(')');
  if (close == std::string::npos || close + 2 >= line.size()) return true;
  const char state = line[close + 2];
  return state != 'Z' && state != 'X';
}

std::string ErrnoText(const char* what, const std::string& name) {
  return absl::StrCat(what, " ", name, ": ", std::strerror(errno));
}

}  // namespace

// ---------------------------------------------------------------------------------- mapping

struct ShmCollective::Mapping {
  std::string name;  // shm_open name
  int fd = -1;
  std::byte* base = nullptr;
  size_t size = 0;
  Layout layout;
  bool unlinked = false;

  ~Mapping() {
    if (base != nullptr) ::munmap(base, size);
    if (fd >= 0) ::close(fd);
  }
  ShmHeader& header() const { return *reinterpret_cast<ShmHeader*>(base); }
  RankSlot& slot(int r) const { return reinterpret_cast<RankSlot*>(base + layout.slots)[r]; }
  ChannelHeader& channel(int src, int dst) const {
    return reinterpret_cast<ChannelHeader*>(base +
                                            layout.channels)[src * header().world_size + dst];
  }
  std::byte* ring(int src, int dst) const {
    return base + layout.data +
           (static_cast<size_t>(src) * header().world_size + dst) * header().channel_bytes;
  }
  void Unlink() {
    if (!unlinked) {
      ::shm_unlink(name.c_str());  // ENOENT: another rank did it
      unlinked = true;
    }
  }
};

absl::StatusOr<std::unique_ptr<ShmCollective::Mapping>> ShmCollective::MapFd(
    int fd, const std::string& name, size_t size) {
  auto m = std::make_unique<Mapping>();
  m->name = name;
  m->fd = fd;
  void* p = ::mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  if (p == MAP_FAILED) return absl::InternalError(ErrnoText("mmap", name));
  m->base = static_cast<std::byte*>(p);
  m->size = size;
  return m;
}

absl::Status ValidateShmGroupName(absl::string_view name) {
  if (name.empty() || name.size() > kMaxGroupNameBytes) {
    return absl::InvalidArgumentError(
        absl::StrCat("shm group name must have 1..", kMaxGroupNameBytes, " characters"));
  }
  for (char c : name) {
    const bool ok = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') ||
                    c == '_' || c == '.' || c == '-';
    if (!ok) {
      return absl::InvalidArgumentError(
          absl::StrCat("shm group name \"", name, "\" must match [A-Za-z0-9_.-]"));
    }
  }
  return absl::OkStatus();
}

std::string ShmGroupObjectName(absl::string_view group_name) {
  return absl::StrCat("/hmoe.comm.", group_name);
}

absl::StatusOr<bool> RemoveShmGroup(absl::string_view group_name) {
  HMOE_RETURN_IF_ERROR(ValidateShmGroupName(group_name));
  const std::string name = ShmGroupObjectName(group_name);
  if (::shm_unlink(name.c_str()) == 0) return true;
  if (errno == ENOENT) return false;
  return absl::InternalError(ErrnoText("shm_unlink", name));
}

absl::StatusOr<int> RemoveStaleShmGroups() {
  constexpr char kDir[] = "/dev/shm";
  constexpr absl::string_view kPrefix = "hmoe.comm.";
  // An object whose creator never published the header (it died between creating and
  // initializing it) is stale once it is this old.
  constexpr int64_t kUninitializedGraceSeconds = 60;
  DIR* dir = ::opendir(kDir);
  if (dir == nullptr) return absl::InternalError(ErrnoText("opendir", kDir));
  int removed = 0;
  while (const dirent* entry = ::readdir(dir)) {
    const absl::string_view file = entry->d_name;
    if (!absl::StartsWith(file, kPrefix)) continue;
    const std::string name = absl::StrCat("/", file);
    const int fd = ::shm_open(name.c_str(), O_RDONLY | O_CLOEXEC | O_NOFOLLOW, 0);
    if (fd < 0) continue;  // gone meanwhile, or not ours to open
    struct stat st;
    bool stale = false;
    if (::fstat(fd, &st) == 0 && st.st_uid == ::geteuid()) {
      if (static_cast<size_t>(st.st_size) >= sizeof(ShmHeader)) {
        void* p = ::mmap(nullptr, sizeof(ShmHeader), PROT_READ, MAP_SHARED, fd, 0);
        if (p != MAP_FAILED) {
          const auto* h = static_cast<const ShmHeader*>(p);
          if (h->magic.load(std::memory_order_acquire) == kMagic) {
            stale = !ProcessAlive(h->creator_pid);
          } else {
            stale = ::time(nullptr) - st.st_mtime > kUninitializedGraceSeconds;
          }
          ::munmap(p, sizeof(ShmHeader));
        }
      } else {
        stale = ::time(nullptr) - st.st_mtime > kUninitializedGraceSeconds;
      }
    }
    ::close(fd);
    if (stale && ::shm_unlink(name.c_str()) == 0) {
      HMOE_LOG(INFO) << "removed the stale shm group object /dev/shm/" << file;
      ++removed;
    }
  }
  ::closedir(dir);
  return removed;
}

// ---------------------------------------------------------------------------------- transfers

// One message of a collective to or from `peer`: a 16-byte header then `bytes` of payload.
struct ShmCollective::Transfer {
  int peer = 0;
  std::byte* data = nullptr;  // payload (read for sends, written for receives)
  uint64_t bytes = 0;
  uint64_t moved = 0;  // bytes of header + payload moved so far
  std::byte header[kMessageHeaderBytes];

  uint64_t total() const { return kMessageHeaderBytes + bytes; }
  bool done() const { return moved == total(); }
};

ShmCollective::ShmCollective(const ShmCollectiveOptions& options, std::unique_ptr<Mapping> mapping)
    : options_(options),
      rank_(options.rank),
      world_size_(options.world_size),
      mapping_(std::move(mapping)) {
  counters_.bytes_sent.assign(world_size_, 0);
  counters_.bytes_received.assign(world_size_, 0);
}

absl::StatusOr<std::unique_ptr<ShmCollective>> ShmCollective::Create(
    const ShmCollectiveOptions& options) {
  HMOE_RETURN_IF_ERROR(ValidateShmGroupName(options.group_name));
  if (options.world_size < 1 || options.world_size > kMaxWorldSize || options.rank < 0 ||
      options.rank >= options.world_size) {
    return absl::InvalidArgumentError(absl::StrCat("shm group ", options.group_name, ": rank ",
                                                   options.rank, " of world size ",
                                                   options.world_size));
  }
  if (options.channel_bytes < kMinChannelBytes) {
    return absl::InvalidArgumentError(absl::StrCat("shm group ", options.group_name,
                                                   ": channel_bytes ", options.channel_bytes,
                                                   " below ", kMinChannelBytes));
  }
  if (options.peer_timeout <= absl::ZeroDuration() ||
      options.poll_interval <= absl::ZeroDuration()) {
    return absl::InvalidArgumentError("shm group: peer_timeout and poll_interval must be > 0");
  }
  ShmCollectiveOptions o = options;
  o.channel_bytes = RoundUp(options.channel_bytes, 64);
  const std::string name = ShmGroupObjectName(o.group_name);
  const Layout layout = Layout::For(o.world_size, o.channel_bytes);
  const absl::Time deadline = absl::Now() + o.join_timeout;
  std::unique_ptr<Mapping> mapping;

  if (o.rank == 0) {
    int fd = ::shm_open(name.c_str(), O_CREAT | O_EXCL | O_RDWR | O_CLOEXEC, 0600);
    if (fd < 0 && errno == EEXIST) {
      // Names are per incarnation: an existing object is left over from a crashed group.
      HMOE_LOG(WARNING) << "shm group " << o.group_name << ": removing a stale object " << name;
      ::shm_unlink(name.c_str());
      fd = ::shm_open(name.c_str(), O_CREAT | O_EXCL | O_RDWR | O_CLOEXEC, 0600);
    }
    if (fd < 0) return absl::InternalError(ErrnoText("shm_open", name));
    if (::fchmod(fd, 0600) != 0 || ::ftruncate(fd, static_cast<off_t>(layout.total)) != 0) {
      const absl::Status s = absl::InternalError(ErrnoText("size", name));
      ::close(fd);
      ::shm_unlink(name.c_str());
      return s;
    }
    auto mapped = MapFd(fd, name, layout.total);
    if (!mapped.ok()) {
      ::close(fd);
      ::shm_unlink(name.c_str());
      return mapped.status();
    }
    mapping = *std::move(mapped);
    mapping->layout = layout;
    // The object is zero-filled; construct the header fields, then publish with the magic.
    ShmHeader* h = new (mapping->base) ShmHeader();
    h->version = kVersion;
    h->world_size = o.world_size;
    h->channel_bytes = o.channel_bytes;
    h->total_bytes = layout.total;
    h->creator_pid = static_cast<int32_t>(::getpid());
    h->creator_uid = ::geteuid();
    h->attached.store(0, std::memory_order_relaxed);
    h->failure.store(0, std::memory_order_relaxed);
    for (int r = 0; r < o.world_size; ++r) new (&mapping->slot(r)) RankSlot();
    for (int s = 0; s < o.world_size; ++s) {
      for (int d = 0; d < o.world_size; ++d) new (&mapping->channel(s, d)) ChannelHeader();
    }
    // Release: a rank that reads the magic (acquire) sees the initialized header.
    h->magic.store(kMagic, std::memory_order_release);
  } else {
    while (true) {
      if (o.cancelled && o.cancelled()) {
        return absl::CancelledError(
            absl::StrCat("shm group ", o.group_name, ": cancelled while joining"));
      }
      if (absl::Now() > deadline) {
        return absl::DeadlineExceededError(
            absl::StrCat("shm group ", o.group_name, ": rank 0 did not create ", name, " within ",
                         absl::FormatDuration(o.join_timeout)));
      }
      const int fd = ::shm_open(name.c_str(), O_RDWR | O_CLOEXEC, 0);
      if (fd < 0) {
        if (errno != ENOENT) return absl::InternalError(ErrnoText("shm_open", name));
        absl::SleepFor(absl::Milliseconds(5));
        continue;
      }
      struct stat st;
      if (::fstat(fd, &st) != 0) {
        ::close(fd);
        return absl::InternalError(ErrnoText("fstat", name));
      }
      if (st.st_uid != ::geteuid() || (st.st_mode & 077) != 0) {
        ::close(fd);
        return absl::PermissionDeniedError(
            absl::StrCat("shm group ", o.group_name, ": ", name, " is owned by uid ", st.st_uid,
                         " with mode ", st.st_mode & 0777, " (expected ours, 0600)"));
      }
      if (static_cast<size_t>(st.st_size) < sizeof(ShmHeader)) {  // rank 0 is still sizing it
        ::close(fd);
        absl::SleepFor(absl::Milliseconds(5));
        continue;
      }
      auto mapped = MapFd(fd, name, static_cast<size_t>(st.st_size));
      if (!mapped.ok()) {
        ::close(fd);
        return mapped.status();
      }
      std::unique_ptr<Mapping> m = *std::move(mapped);
      const ShmHeader& h = m->header();
      // Rank 0 publishes the magic right after sizing the object. An object that stays without
      // it is stale garbage that rank 0 is replacing: open the name again.
      const absl::Time magic_deadline = std::min(deadline, absl::Now() + absl::Milliseconds(100));
      while (h.magic.load(std::memory_order_acquire) != kMagic && absl::Now() < magic_deadline) {
        absl::SleepFor(absl::Milliseconds(2));
      }
      if (h.magic.load(std::memory_order_acquire) != kMagic) continue;
      if (h.version != kVersion || h.world_size != o.world_size ||
          h.channel_bytes != o.channel_bytes || h.total_bytes != layout.total ||
          static_cast<size_t>(st.st_size) != layout.total) {
        return absl::InvalidArgumentError(absl::StrCat(
            "shm group ", o.group_name, ": created for world size ", h.world_size,
            " and channel_bytes ", h.channel_bytes, " (version ", h.version, "), this rank has ",
            o.world_size, " and ", o.channel_bytes, " (version ", kVersion, ")"));
      }
      if (!ProcessAlive(h.creator_pid)) {
        // A stale object of a crashed group: rank 0 of this incarnation will replace it.
        absl::SleepFor(absl::Milliseconds(5));
        continue;
      }
      m->layout = layout;
      mapping = std::move(m);
      break;
    }
  }

  // Claim this rank's slot.
  RankSlot& slot = mapping->slot(o.rank);
  int32_t expected = kSlotFree;
  if (!slot.state.compare_exchange_strong(expected, kSlotClaimed, std::memory_order_acq_rel)) {
    return absl::AlreadyExistsError(absl::StrCat("shm group ", o.group_name, ": rank ", o.rank,
                                                 " is already taken (pid ",
                                                 slot.pid.load(std::memory_order_relaxed), ")"));
  }
  slot.pid.store(static_cast<int32_t>(::getpid()), std::memory_order_relaxed);
  slot.heartbeat_ns.store(MonotonicNs(), std::memory_order_relaxed);
  slot.state.store(kSlotAttached, std::memory_order_release);
  mapping->header().attached.fetch_add(1, std::memory_order_acq_rel);

  std::unique_ptr<ShmCollective> c(new ShmCollective(o, std::move(mapping)));
  c->heartbeat_ =
      std::jthread([self = c.get()](std::stop_token stop) { self->HeartbeatLoop(stop); });
  for (int r = 0; r < o.world_size; ++r) c->Ring(r);
  HMOE_RETURN_IF_ERROR(c->Join(deadline));
  return c;
}

absl::Status ShmCollective::Join(absl::Time deadline) {
  ShmHeader& h = mapping_->header();
  RankSlot& self = mapping_->slot(rank_);
  std::vector<int> peers;
  for (int r = 0; r < world_size_; ++r) {
    if (r != rank_) peers.push_back(r);
  }
  while (h.attached.load(std::memory_order_acquire) < world_size_) {
    const uint32_t bell = self.doorbell.load(std::memory_order_acquire);
    if (h.attached.load(std::memory_order_acquire) >= world_size_) break;
    HMOE_RETURN_IF_ERROR(GroupFailure());
    // Peers that attached and then died or left.
    for (int p : peers) {
      const int32_t state = mapping_->slot(p).state.load(std::memory_order_acquire);
      if (state == kSlotDeparted ||
          (state == kSlotAttached &&
           !ProcessAlive(mapping_->slot(p).pid.load(std::memory_order_relaxed)))) {
        FailGroup(p, state == kSlotDeparted ? kLeft : kDied);
        return GroupFailure();
      }
    }
    if (options_.cancelled && options_.cancelled()) {
      FailGroup(rank_, kCancelled);
      return absl::CancelledError(
          absl::StrCat("shm group ", options_.group_name, ": cancelled while joining"));
    }
    if (absl::Now() > deadline) {
      std::string missing;
      for (int p : peers) {
        if (mapping_->slot(p).state.load(std::memory_order_acquire) != kSlotAttached) {
          absl::StrAppend(&missing, missing.empty() ? "" : ",", p);
        }
      }
      FailGroup(rank_, kJoin);
      return absl::DeadlineExceededError(
          absl::StrCat("shm group ", options_.group_name, ": ranks {", missing,
                       "} did not join within ", absl::FormatDuration(options_.join_timeout)));
    }
    FutexWait(&self.doorbell, bell, options_.poll_interval);
  }
  // Everyone is attached: the name is no longer needed (the mappings stay valid).
  mapping_->Unlink();
  return absl::OkStatus();
}

ShmCollective::~ShmCollective() {
  heartbeat_.request_stop();
  if (heartbeat_.joinable()) heartbeat_.join();
  if (mapping_ == nullptr) return;
  mapping_->slot(rank_).state.store(kSlotDeparted, std::memory_order_release);
  for (int r = 0; r < world_size_; ++r) {
    if (r != rank_) Ring(r);
  }
  if (mapping_->header().attached.load(std::memory_order_acquire) < world_size_) {
    mapping_->Unlink();  // the group never formed: do not leave the name behind
  }
}

std::string ShmCollective::description() const { return absl::StrCat("shm:", options_.group_name); }

void ShmCollective::HeartbeatLoop(std::stop_token stop) {
  const absl::Duration interval = options_.peer_timeout / 4;
  absl::Mutex mu;
  absl::CondVar cv;
  std::stop_callback wake(stop, [&] {
    absl::MutexLock lock(&mu);
    cv.SignalAll();
  });
  RankSlot& self = mapping_->slot(rank_);
  while (!stop.stop_requested()) {
    self.heartbeat_ns.store(MonotonicNs(), std::memory_order_relaxed);
    absl::MutexLock lock(&mu);
    if (stop.stop_requested()) break;
    cv.WaitWithTimeout(&mu, interval);
  }
}

void ShmCollective::Ring(int peer) {
  RankSlot& slot = mapping_->slot(peer);
  // Release: the peer's acquire load of the doorbell (before it re-checks its channels) sees the
  // channel updates made before this bump.
  slot.doorbell.fetch_add(1, std::memory_order_release);
  FutexWakeAll(&slot.doorbell);
}

bool ShmCollective::failed() const {
  return mapping_->header().failure.load(std::memory_order_acquire) != 0;
}

void ShmCollective::FailGroup(int culprit, int reason) {
  const uint64_t packed = static_cast<uint64_t>(reason) | (static_cast<uint64_t>(culprit) << 8) |
                          (static_cast<uint64_t>(rank_) << 24);
  uint64_t expected = 0;
  mapping_->header().failure.compare_exchange_strong(expected, packed, std::memory_order_acq_rel);
  for (int r = 0; r < world_size_; ++r) {
    if (r != rank_) Ring(r);
  }
}

absl::Status ShmCollective::GroupFailure() const {
  const uint64_t f = mapping_->header().failure.load(std::memory_order_acquire);
  if (f == 0) return absl::OkStatus();
  const uint64_t reason = f & 0xff;
  const int culprit = static_cast<int>((f >> 8) & 0xffff);
  const int noticer = static_cast<int>((f >> 24) & 0xffff);
  return absl::UnavailableError(absl::StrCat("shm group ", options_.group_name, ": rank ", culprit,
                                             " ", ReasonText(reason), " (noticed by rank ", noticer,
                                             "); the group must re-form"));
}

std::pair<int, int> ShmCollective::FindFailedPeer(const std::vector<int>& peers) const {
  const int64_t now = MonotonicNs();
  const int64_t timeout_ns = absl::ToInt64Nanoseconds(options_.peer_timeout);
  for (int p : peers) {
    const RankSlot& slot = mapping_->slot(p);
    // Acquire: pairs with the departing rank's release store, after its last channel writes.
    const int32_t state = slot.state.load(std::memory_order_acquire);
    if (state == kSlotDeparted) return {p, kLeft};
    if (!ProcessAlive(slot.pid.load(std::memory_order_relaxed))) return {p, kDied};
    if (now - slot.heartbeat_ns.load(std::memory_order_relaxed) > timeout_ns) return {p, kHung};
  }
  return {-1, kNoFailure};
}

void ShmCollective::ResetCounters() {
  counters_ = CommCounters();
  counters_.bytes_sent.assign(world_size_, 0);
  counters_.bytes_received.assign(world_size_, 0);
}

absl::Status ShmCollective::Exchange(std::vector<Transfer>& sends, std::vector<Transfer>& recvs) {
  HMOE_RETURN_IF_ERROR(GroupFailure());
  const uint64_t seq = ++op_seq_;
  const uint64_t cap = mapping_->header().channel_bytes;
  for (Transfer& t : sends) {
    std::memcpy(t.header, &seq, 8);
    std::memcpy(t.header + 8, &t.bytes, 8);
  }
  const absl::Time deadline = options_.op_timeout == absl::InfiniteDuration()
                                  ? absl::InfiniteFuture()
                                  : absl::Now() + options_.op_timeout;
  RankSlot& self = mapping_->slot(rank_);
  bool rechecked = false;

  // Copies message bytes [t.moved, t.moved + n) to or from the ring at byte position `pos`.
  auto copy = [&](Transfer& t, std::byte* ring, uint64_t pos, uint64_t n, bool to_ring) {
    while (n > 0) {
      const uint64_t off = pos % cap;
      uint64_t run = std::min(n, cap - off);
      std::byte* r = ring + off;
      // The run may straddle the message header and the payload.
      if (t.moved < kMessageHeaderBytes) run = std::min(run, kMessageHeaderBytes - t.moved);
      std::byte* m = t.moved < kMessageHeaderBytes ? t.header + t.moved
                                                   : t.data + (t.moved - kMessageHeaderBytes);
      if (to_ring) {
        std::memcpy(r, m, run);
      } else {
        std::memcpy(m, r, run);
      }
      t.moved += run;
      pos += run;
      n -= run;
    }
  };

  while (true) {
    // Acquire, and read before looking at the channels: a bump after this load means new state,
    // and the futex wait below then returns at once.
    const uint32_t bell = self.doorbell.load(std::memory_order_acquire);
    bool progress = false;
    bool all_done = true;
    for (Transfer& t : sends) {
      if (t.done()) continue;
      ChannelHeader& ch = mapping_->channel(rank_, t.peer);
      const uint64_t head = ch.head.load(std::memory_order_relaxed);  // ours
      const uint64_t tail = ch.tail.load(std::memory_order_acquire);
      const uint64_t n = std::min(cap - (head - tail), t.total() - t.moved);
      if (n > 0) {
        copy(t, mapping_->ring(rank_, t.peer), head, n, /*to_ring=*/true);
        ch.head.store(head + n, std::memory_order_release);
        Ring(t.peer);
        progress = true;
      }
      all_done = all_done && t.done();
    }
    for (Transfer& t : recvs) {
      if (t.done()) continue;
      ChannelHeader& ch = mapping_->channel(t.peer, rank_);
      const uint64_t tail = ch.tail.load(std::memory_order_relaxed);  // ours
      const uint64_t head = ch.head.load(std::memory_order_acquire);
      uint64_t n = std::min(head - tail, t.total() - t.moved);
      if (n > 0) {
        const bool had_header = t.moved >= kMessageHeaderBytes;
        // Read the header on its own first, so the payload size is checked before any payload
        // byte is written to the caller's buffer.
        if (!had_header) n = std::min<uint64_t>(n, kMessageHeaderBytes - t.moved);
        copy(t, mapping_->ring(t.peer, rank_), tail, n, /*to_ring=*/false);
        ch.tail.store(tail + n, std::memory_order_release);
        Ring(t.peer);
        progress = true;
        if (!had_header && t.moved == kMessageHeaderBytes) {
          uint64_t their_seq = 0, their_bytes = 0;
          std::memcpy(&their_seq, t.header, 8);
          std::memcpy(&their_bytes, t.header + 8, 8);
          if (their_seq != seq || their_bytes != t.bytes) {
            FailGroup(t.peer, kMismatch);
            return absl::InternalError(
                absl::StrCat("shm group ", options_.group_name, ": collective mismatch: rank ",
                             t.peer, " sent ", their_bytes, " bytes in its collective #", their_seq,
                             ", rank ", rank_, " expected ", t.bytes, " bytes in #", seq));
          }
        }
      }
      all_done = all_done && t.done();
    }
    if (all_done) break;
    if (progress) {
      rechecked = false;
      continue;
    }
    HMOE_RETURN_IF_ERROR(GroupFailure());
    // Only peers this rank still waits for matter: one that finished its part and left is fine.
    std::vector<int> pending;
    for (const auto* list : {&sends, &recvs}) {
      for (const Transfer& t : *list) {
        if (!t.done() && std::find(pending.begin(), pending.end(), t.peer) == pending.end()) {
          pending.push_back(t.peer);
        }
      }
    }
    if (const auto [peer, reason] = FindFailedPeer(pending); peer >= 0) {
      // A peer may write its last bytes and then leave between this rank's look at the channels
      // and at the peer: look at the channels once more (everything it wrote before leaving is
      // visible now) before declaring the collective failed.
      if (!rechecked) {
        rechecked = true;
        continue;
      }
      FailGroup(peer, reason);
      return GroupFailure();
    }
    rechecked = false;
    if (options_.cancelled && options_.cancelled()) {
      FailGroup(rank_, kCancelled);
      return absl::CancelledError(
          absl::StrCat("shm group ", options_.group_name, ": collective #", seq, " cancelled"));
    }
    if (absl::Now() > deadline) {
      FailGroup(rank_, kTimeout);
      return absl::DeadlineExceededError(
          absl::StrCat("shm group ", options_.group_name, ": collective #", seq,
                       " did not finish within ", absl::FormatDuration(options_.op_timeout)));
    }
    FutexWait(&self.doorbell, bell, options_.poll_interval);
  }
  for (const Transfer& t : sends) counters_.bytes_sent[t.peer] += t.bytes;
  for (const Transfer& t : recvs) counters_.bytes_received[t.peer] += t.bytes;
  ++counters_.num_ops;
  return absl::OkStatus();
}

// ---------------------------------------------------------------------------------- collectives

absl::Status ShmCollective::AllGatherV(const void* send, void* recv, std::span<const size_t> counts,
                                       std::span<const size_t> offsets) {
  HMOE_RETURN_IF_ERROR(ValidateLayout(world_size_, counts, offsets, "all-gather"));
  auto* out = static_cast<std::byte*>(recv);
  std::vector<Transfer> sends, recvs;
  for (int p = 0; p < world_size_; ++p) {
    if (p == rank_) continue;
    Transfer s;
    s.peer = p;
    s.data = const_cast<std::byte*>(static_cast<const std::byte*>(send));
    s.bytes = counts[rank_];
    sends.push_back(s);
    Transfer r;
    r.peer = p;
    r.data = out + offsets[p];
    r.bytes = counts[p];
    recvs.push_back(r);
  }
  if (counts[rank_] > 0 && out + offsets[rank_] != send) {
    std::memcpy(out + offsets[rank_], send, counts[rank_]);
  }
  return Exchange(sends, recvs);
}

absl::Status ShmCollective::AllToAllV(const void* send, std::span<const size_t> send_counts,
                                      std::span<const size_t> send_offsets, void* recv,
                                      std::span<const size_t> recv_counts,
                                      std::span<const size_t> recv_offsets) {
  HMOE_RETURN_IF_ERROR(ValidateLayout(world_size_, send_counts, send_offsets, "all-to-all send"));
  HMOE_RETURN_IF_ERROR(ValidateLayout(world_size_, recv_counts, recv_offsets, "all-to-all recv"));
  if (send_counts[rank_] != recv_counts[rank_]) {
    return absl::InvalidArgumentError(absl::StrCat("all-to-all: rank ", rank_, " sends itself ",
                                                   send_counts[rank_], " bytes but expects ",
                                                   recv_counts[rank_]));
  }
  const auto* in = static_cast<const std::byte*>(send);
  auto* out = static_cast<std::byte*>(recv);
  std::vector<Transfer> sends, recvs;
  for (int p = 0; p < world_size_; ++p) {
    if (p == rank_) continue;
    Transfer s;
    s.peer = p;
    s.data = const_cast<std::byte*>(in + send_offsets[p]);
    s.bytes = send_counts[p];
    sends.push_back(s);
    Transfer r;
    r.peer = p;
    r.data = out + recv_offsets[p];
    r.bytes = recv_counts[p];
    recvs.push_back(r);
  }
  if (send_counts[rank_] > 0) {
    std::memmove(out + recv_offsets[rank_], in + send_offsets[rank_], send_counts[rank_]);
  }
  return Exchange(sends, recvs);
}

absl::Status ShmCollective::RingSendRecv(const void* send, size_t send_bytes, void* recv,
                                         size_t recv_bytes) {
  if (world_size_ == 1) {
    if (send_bytes != recv_bytes) {
      return absl::InvalidArgumentError("ring send/recv of one rank: sizes differ");
    }
    if (send_bytes > 0) std::memmove(recv, send, send_bytes);
    return absl::OkStatus();
  }
  std::vector<Transfer> sends(1), recvs(1);
  sends[0].peer = (rank_ + 1) % world_size_;
  sends[0].data = const_cast<std::byte*>(static_cast<const std::byte*>(send));
  sends[0].bytes = send_bytes;
  recvs[0].peer = (rank_ - 1 + world_size_) % world_size_;
  recvs[0].data = static_cast<std::byte*>(recv);
  recvs[0].bytes = recv_bytes;
  return Exchange(sends, recvs);
}

absl::Status ShmCollective::AllReduceSum(const float* send, float* recv, size_t count) {
  // Gather every contribution, then sum in rank order: every rank computes the same bits.
  std::vector<float> all(count * world_size_);
  std::vector<size_t> counts(world_size_, count * sizeof(float)), offsets(world_size_);
  for (int p = 0; p < world_size_; ++p) offsets[p] = p * count * sizeof(float);
  HMOE_RETURN_IF_ERROR(AllGatherV(send, all.data(), counts, offsets));
  for (size_t i = 0; i < count; ++i) {
    float sum = all[i];
    for (int p = 1; p < world_size_; ++p) sum += all[p * count + i];
    recv[i] = sum;
  }
  return absl::OkStatus();
}

absl::Status ShmCollective::Barrier() {
  std::vector<Transfer> sends, recvs;
  for (int p = 0; p < world_size_; ++p) {
    if (p == rank_) continue;
    Transfer t;
    t.peer = p;
    sends.push_back(t);
    recvs.push_back(t);
  }
  return Exchange(sends, recvs);
}

absl::Status ShmCollective::AllGatherV(Stream& /*stream*/, const void* send, void* recv,
                                       std::span<const size_t> counts,
                                       std::span<const size_t> offsets) {
  return AllGatherV(send, recv, counts, offsets);
}

absl::Status ShmCollective::AllToAllV(Stream& /*stream*/, const void* send,
                                      std::span<const size_t> send_counts,
                                      std::span<const size_t> send_offsets, void* recv,
                                      std::span<const size_t> recv_counts,
                                      std::span<const size_t> recv_offsets) {
  return AllToAllV(send, send_counts, send_offsets, recv, recv_counts, recv_offsets);
}

absl::Status ShmCollective::RingSendRecv(Stream& /*stream*/, const void* send, size_t send_bytes,
                                         void* recv, size_t recv_bytes) {
  return RingSendRecv(send, send_bytes, recv, recv_bytes);
}

absl::Status ShmCollective::AllReduceSum(Stream& /*stream*/, const float* send, float* recv,
                                         size_t count) {
  return AllReduceSum(send, recv, count);
}

}  // namespace hmoe
