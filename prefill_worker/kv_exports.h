#pragma once

// The prefill worker's side of the KV hand-off (common/kv_handoff/kv_handoff.h): a prompt's KV
// cache copied into an exportable buffer (shared memory or a CUDA IPC buffer). The worker's
// ExportTable (common/kv_handoff/export_table.h) owns every export until the router releases it
// (once the decode worker has acknowledged the import, hmoe.decode.v1.KvImported) or the export
// timeout frees it, so a decode worker (or router) that dies mid-import leaks nothing; at start-up
// RemoveShmExportsOfDeadProcesses cleans up after a previous incarnation that crashed.

#include <memory>
#include <string>

#include "absl/status/statusor.h"

#include "common/device/device.h"
#include "common/engine/kv_cache.h"
#include "common/kv_handoff/export_table.h"
#include "common/kv_handoff/kv_handoff.h"

namespace hmoe::prefill {

using ::hmoe::ExportTable;
using ::hmoe::KvExport;
using ::hmoe::RemoveShmExportsOfDeadProcesses;
using ::hmoe::RemoveStaleShmExports;

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

// The hand-off name prefix of the worker `worker_id`: "hmoe-kv-<id>-", the id's characters outside
// [A-Za-z0-9_.-] replaced by '_' and cut to 150.
std::string ExportPrefix(const std::string& worker_id);

}  // namespace hmoe::prefill
