#pragma once

// The prefill worker's side of the KV hand-off (common/kv_handoff/kv_handoff.h): a prompt's KV
// cache copied into an exportable buffer, and the table of the buffers the worker still owns.
//
// The worker owns every export until someone releases it: the router calls Release once the
// decode worker has acknowledged the import (hmoe.decode.v1.KvImported), and an export nobody
// releases within the export timeout is freed anyway — so a decode worker (or router) that dies
// mid-import leaks nothing. Exports are also freed when the table is destroyed (worker
// shutdown), and RemoveStaleShmExports cleans up after a previous incarnation that crashed.

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

#include "common/device/device.h"
#include "common/engine/kv_cache.h"
#include "common/kv_handoff/kv_handoff.h"

namespace hmoe::prefill {

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

// The KV hand-off shape of `config` (F32, layout kKvHandoffLayoutVersion).
KvHandoffShape HandoffShapeOf(const KvCacheConfig& config);

// Writes all tokens of `seq` (of `cache`) with a hand-off header into a new shared-memory segment
// /dev/shm/<name> (0600), through `stream` (synchronized before returning). The cache may be on
// any device (a GPU's cache is copied to host memory). Errors of KvHandoffSegment::Create
// (AlreadyExists, InvalidArgument for a bad name or an empty sequence) and of the copy.
absl::StatusOr<std::unique_ptr<KvExport>> ExportToShm(KvCache& cache, const KvSequence& seq,
                                                      Stream& stream, const std::string& name);

// Writes `seq` with a hand-off header into a new allocation of the cache's device and returns its
// CUDA IPC memory handle and the PCI bus id of the device (the decode worker's side:
// common/kv_handoff/cuda_ipc_import.h). Unavailable on a build or device without CUDA (a CpuDevice
// cannot export this way); the device's ResourceExhausted when the buffer does not fit.
absl::StatusOr<std::unique_ptr<KvExport>> ExportToCudaIpc(KvCache& cache, const KvSequence& seq,
                                                          Stream& stream);

// Unlinks every /dev/shm/<prefix>* segment (a previous incarnation of this worker crashed with
// exports outstanding). Returns how many were removed. `prefix` must be a valid hand-off name
// prefix of at least 8 characters (InvalidArgument otherwise: a short prefix could match
// others' segments).
absl::StatusOr<int> RemoveStaleShmExports(std::string_view prefix);

// The hand-off name prefix of the worker `worker_id`: "hmoe-kv-<id>-", the id's characters outside
// [A-Za-z0-9_.-] replaced by '_' and cut to 150.
std::string ExportPrefix(const std::string& worker_id);

// The worker's outstanding exports by request id. Thread-safe. A reaper thread frees exports
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

}  // namespace hmoe::prefill
