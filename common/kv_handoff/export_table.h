#pragma once

// Owned KV hand-off buffers (kv_handoff.h) and the table of those a process still owns, for either
// direction of the hand-off: a prefill worker's export of a prompt's KV for the decode worker, and
// a decode worker's export of a cached prefix for a prefill worker (docs/architecture.md "A
// request's path").
//
// The exporter owns every export until someone releases it (the router calls the exporter's
// Release RPC once the consumer is done), and an export nobody releases within the export timeout
// is freed anyway — so a consumer (or router) that dies mid-import leaks nothing. Exports are also
// freed when the table is destroyed (shutdown), and RemoveStaleShmExports cleans up after a
// previous incarnation that crashed.

#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <string_view>
#include <thread>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"

#include "common/kv_handoff/kv_handoff.h"

namespace hmoe {

// One exported KV cache. Destroying it frees the buffer: a shared-memory export is unlinked (a
// consumer that mapped it keeps its mapping), a device export is freed.
class KvExport {
 public:
  virtual ~KvExport() = default;
  // What the consumer opens (the proto's KvHandle).
  virtual const KvHandleSpec& handle() const = 0;
  // Bytes of the buffer (header + payload).
  virtual size_t size_bytes() const = 0;
  // For logs: "shm:hmoe-kv-prefill-7-3", "cuda-ipc:cuda:0".
  virtual std::string description() const = 0;
};

// Takes ownership of the filled shared-memory `segment` (the handle names it): destroying the
// export unlinks it (a consumer that mapped it keeps its mapping).
std::unique_ptr<KvExport> NewShmExport(KvHandoffSegment segment, KvHandleSpec spec);
// The shared-memory segment the handle names (`size_bytes` in all), which this process has filled
// and no longer maps: destroying the export unlinks the name unless its consumer did already
// (a one-shot hand-off, such as a decode worker's prefix export, which the prefill worker unlinks
// once it has read it so the memory goes as soon as nobody maps it).
std::unique_ptr<KvExport> NewShmNameExport(KvHandleSpec spec, size_t size_bytes);

// Unlinks every /dev/shm/<prefix>* segment (a previous incarnation of this worker crashed with
// exports outstanding). Returns how many were removed. `prefix` must be a valid hand-off name
// prefix of at least 8 characters (InvalidArgument otherwise: a short prefix could match
// others' segments).
absl::StatusOr<int> RemoveStaleShmExports(std::string_view prefix);

// As RemoveStaleShmExports, for names "<prefix><pid>-..." that embed their creator's process id:
// removes only those whose process is gone (or that carry no pid), so two processes sharing a
// prefix (two stacks on one machine whose workers have the same id) never remove each other's
// live segments.
absl::StatusOr<int> RemoveShmExportsOfDeadProcesses(std::string_view prefix);

// The hand-off name prefix of the process `worker_id` with `tag` ("kv" for a prefill worker's
// exports, "kvp" for a decode worker's prefix exports): "hmoe-<tag>-<id>-", the id's characters
// outside [A-Za-z0-9_.-] replaced by '_' and cut to 150.
std::string KvExportNamePrefix(std::string_view tag, const std::string& worker_id);

// A process's outstanding exports by request id. Thread-safe. A reaper thread frees exports
// older than the timeout.
class ExportTable {
 public:
  // `timeout`: how long an export may wait for Release (> 0).
  explicit ExportTable(absl::Duration timeout);
  // Frees every export still held and stops the reaper.
  ~ExportTable();
  ExportTable(const ExportTable&) = delete;
  ExportTable& operator=(const ExportTable&) = delete;

  // Takes ownership of `kv` under `request_id`; its timeout starts now. AlreadyExists when the
  // id holds an export (then `kv` is freed).
  absl::Status Add(const std::string& request_id, std::unique_ptr<KvExport> kv)
      ABSL_LOCKS_EXCLUDED(mu_);
  // Frees the export of `request_id`. NotFound when there is none (never added, released
  // before, or freed by the timeout: the message says which of the last two, when known).
  absl::Status Release(const std::string& request_id) ABSL_LOCKS_EXCLUDED(mu_);
  bool Contains(const std::string& request_id) const ABSL_LOCKS_EXCLUDED(mu_);

  int64_t count() const ABSL_LOCKS_EXCLUDED(mu_);
  int64_t bytes() const ABSL_LOCKS_EXCLUDED(mu_);
  // Exports freed by the timeout since creation.
  int64_t expired() const ABSL_LOCKS_EXCLUDED(mu_);
  absl::Duration timeout() const { return timeout_; }

 private:
  struct Entry {
    std::unique_ptr<KvExport> kv;
    absl::Time deadline;
  };
  void ReaperLoop() ABSL_LOCKS_EXCLUDED(mu_);
  bool StopOrDue() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const absl::Duration timeout_;
  mutable absl::Mutex mu_;
  std::map<std::string, Entry> exports_ ABSL_GUARDED_BY(mu_);
  // Ids whose export the timeout freed (bounded), for a clearer NotFound on a late Release.
  std::map<std::string, absl::Time> expired_ids_ ABSL_GUARDED_BY(mu_);
  int64_t expired_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t bytes_ ABSL_GUARDED_BY(mu_) = 0;
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  std::jthread reaper_;  // last: starts after everything above exists
};

}  // namespace hmoe
