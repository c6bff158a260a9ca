#include "common/kv_handoff/export_table.h"

#include <dirent.h>
#include <signal.h>
#include <sys/types.h>

#include <algorithm>
#include <cerrno>
#include <functional>
#include <limits>
#include <utility>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"

#include "common/base/logging.h"
#include "common/base/status_macros.h"

namespace hmoe {
namespace {

// Late Release calls of expired exports get a precise NotFound for this many ids.
constexpr size_t kExpiredIdsKept = 1024;

class ShmExport final : public KvExport {
 public:
  ShmExport(KvHandoffSegment segment, KvHandleSpec spec)
      : segment_(std::move(segment)), spec_(std::move(spec)) {}
  ~ShmExport() override {
    // Unlink the name; a consumer that mapped the segment keeps its mapping. Our own mapping goes
    // with segment_.
    if (absl::Status s = KvHandoffSegment::Remove(spec_.shm_name); !s.ok()) {
      HMOE_LOG(WARNING) << "remove kv hand-off segment " << spec_.shm_name << ": " << s;
    }
  }
  const KvHandleSpec& handle() const override { return spec_; }
  size_t size_bytes() const override {
    return segment_.header().header_bytes + segment_.header().payload_bytes;
  }
  std::string description() const override { return absl::StrCat("shm:", spec_.shm_name); }

 private:
  KvHandoffSegment segment_;
  KvHandleSpec spec_;
};

// A filled segment this process no longer maps: its consumer may unlink it once read (a one-shot
// hand-off), so a missing name is no error here.
class ShmNameExport final : public KvExport {
 public:
  ShmNameExport(KvHandleSpec spec, size_t size_bytes)
      : spec_(std::move(spec)), size_bytes_(size_bytes) {}
  ~ShmNameExport() override {
    if (absl::Status s = KvHandoffSegment::Remove(spec_.shm_name);
        !s.ok() && !absl::IsNotFound(s)) {
      HMOE_LOG(WARNING) << "remove kv hand-off segment " << spec_.shm_name << ": " << s;
    }
  }
  const KvHandleSpec& handle() const override { return spec_; }
  size_t size_bytes() const override { return size_bytes_; }
  std::string description() const override { return absl::StrCat("shm:", spec_.shm_name); }

 private:
  KvHandleSpec spec_;
  size_t size_bytes_;
};

}  // namespace

std::unique_ptr<KvExport> NewShmNameExport(KvHandleSpec spec, size_t size_bytes) {
  return std::make_unique<ShmNameExport>(std::move(spec), size_bytes);
}

std::unique_ptr<KvExport> NewShmExport(KvHandoffSegment segment, KvHandleSpec spec) {
  return std::make_unique<ShmExport>(std::move(segment), std::move(spec));
}

std::string KvExportNamePrefix(std::string_view tag, const std::string& worker_id) {
  std::string id = worker_id;
  for (char& c : id) {
    const bool ok = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') ||
                    c == '_' || c == '-' || c == '.';
    if (!ok) c = '_';
  }
  return absl::StrCat("hmoe-", std::string(tag), "-", id.substr(0, 150), "-");
}

namespace {

// Unlinks every /dev/shm/<prefix>* segment `stale` says is stale.
absl::StatusOr<int> RemoveShmExportsIf(std::string_view prefix,
                                       const std::function<bool(std::string_view)>& stale) {
  HMOE_RETURN_IF_ERROR(ValidateKvHandoffName(prefix));
  if (prefix.size() < 8) {
    return absl::InvalidArgumentError(absl::StrCat("stale kv export prefix \"", std::string(prefix),
                                                   "\" is shorter than 8 characters"));
  }
  DIR* dir = ::opendir("/dev/shm");
  if (dir == nullptr) return 0;  // no POSIX shared memory mounted: nothing can be stale
  std::vector<std::string> names;
  while (const dirent* e = ::readdir(dir)) {
    const std::string_view name(e->d_name);
    if (name.starts_with(prefix) && stale(name.substr(prefix.size()))) names.emplace_back(name);
  }
  ::closedir(dir);
  int removed = 0;
  for (const std::string& name : names) {
    if (absl::Status s = KvHandoffSegment::Remove(name); s.ok()) {
      ++removed;
    } else if (!absl::IsNotFound(s)) {
      HMOE_LOG(WARNING) << "remove stale kv export " << name << ": " << s;
    }
  }
  return removed;
}

}  // namespace

absl::StatusOr<int> RemoveStaleShmExports(std::string_view prefix) {
  return RemoveShmExportsIf(prefix, [](std::string_view) { return true; });
}

absl::StatusOr<int> RemoveShmExportsOfDeadProcesses(std::string_view prefix) {
  return RemoveShmExportsIf(prefix, [](std::string_view rest) {
    int64_t pid = 0;
    const size_t dash = rest.find('-');
    if (dash == std::string_view::npos || dash == 0 ||
        !absl::SimpleAtoi(absl::string_view(rest.data(), dash), &pid) || pid <= 0 ||
        pid > std::numeric_limits<pid_t>::max()) {
      return true;  // not one of ours as named today
    }
    // ESRCH: no such process. EPERM means one exists (another user's: not ours to judge).
    return ::kill(static_cast<pid_t>(pid), 0) != 0 && errno == ESRCH;
  });
}

// ---------------------------------------------------------------------------------- ExportTable

ExportTable::ExportTable(absl::Duration timeout)
    : timeout_(timeout), reaper_([this] { ReaperLoop(); }) {}

ExportTable::~ExportTable() {
  {
    absl::MutexLock lock(&mu_);
    stop_ = true;
  }
  if (reaper_.joinable()) reaper_.join();
  std::map<std::string, Entry> left;
  {
    absl::MutexLock lock(&mu_);
    left.swap(exports_);
  }
  if (!left.empty()) {
    HMOE_LOG(INFO) << "freeing " << left.size() << " kv export(s) not released";
  }
}

absl::Status ExportTable::Add(const std::string& request_id, std::unique_ptr<KvExport> kv) {
  absl::MutexLock lock(&mu_);
  if (exports_.contains(request_id)) {
    return absl::AlreadyExistsError(
        absl::StrCat("request ", request_id, " already holds a kv export"));
  }
  bytes_ += static_cast<int64_t>(kv->size_bytes());
  exports_[request_id] = Entry{std::move(kv), absl::Now() + timeout_};
  expired_ids_.erase(request_id);
  return absl::OkStatus();
}

absl::Status ExportTable::Release(const std::string& request_id) {
  std::unique_ptr<KvExport> freed;  // destroyed (unlinked) after the lock is dropped
  {
    absl::MutexLock lock(&mu_);
    auto it = exports_.find(request_id);
    if (it == exports_.end()) {
      if (expired_ids_.contains(request_id)) {
        return absl::NotFoundError(absl::StrCat("request ", request_id,
                                                ": its kv export was freed by the timeout of ",
                                                absl::FormatDuration(timeout_)));
      }
      return absl::NotFoundError(absl::StrCat("request ", request_id, " holds no kv export"));
    }
    freed = std::move(it->second.kv);
    bytes_ -= static_cast<int64_t>(freed->size_bytes());
    exports_.erase(it);
  }
  HMOE_VLOG(1) << "req=" << request_id << " released " << freed->description();
  return absl::OkStatus();
}

bool ExportTable::Contains(const std::string& request_id) const {
  absl::MutexLock lock(&mu_);
  return exports_.contains(request_id);
}

int64_t ExportTable::count() const {
  absl::MutexLock lock(&mu_);
  return static_cast<int64_t>(exports_.size());
}

int64_t ExportTable::bytes() const {
  absl::MutexLock lock(&mu_);
  return bytes_;
}

int64_t ExportTable::expired() const {
  absl::MutexLock lock(&mu_);
  return expired_;
}

bool ExportTable::StopOrDue() const {
  if (stop_) return true;
  const absl::Time now = absl::Now();
  for (const auto& [id, e] : exports_) {
    if (e.deadline <= now) return true;
  }
  return false;
}

void ExportTable::ReaperLoop() {
  // Exports expire within about a tenth of the timeout of their deadline.
  const absl::Duration poll =
      std::clamp(timeout_ / 10, absl::Milliseconds(5), absl::Milliseconds(500));
  while (true) {
    std::vector<std::pair<std::string, std::unique_ptr<KvExport>>> due;
    {
      absl::MutexLock lock(&mu_);
      mu_.AwaitWithTimeout(absl::Condition(this, &ExportTable::StopOrDue), poll);
      if (stop_) return;
      const absl::Time now = absl::Now();
      for (auto it = exports_.begin(); it != exports_.end();) {
        if (it->second.deadline > now) {
          ++it;
          continue;
        }
        bytes_ -= static_cast<int64_t>(it->second.kv->size_bytes());
        ++expired_;
        if (expired_ids_.size() >= kExpiredIdsKept) expired_ids_.erase(expired_ids_.begin());
        expired_ids_[it->first] = now;
        due.emplace_back(it->first, std::move(it->second.kv));
        it = exports_.erase(it);
      }
    }
    for (auto& [id, kv] : due) {
      HMOE_LOG(WARNING) << "req=" << id << " kv export " << kv->description()
                        << " not released within " << absl::FormatDuration(timeout_)
                        << "; freeing it";
      kv.reset();
    }
  }
}

}  // namespace hmoe
