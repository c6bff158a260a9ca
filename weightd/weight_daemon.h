#pragma once

// The logic of hmoe-weightd, without flags, signals or gRPC (main.cc and weightd_service.h wire
// those): take the instance lock, open and validate the checkpoint, then either ADOPT the store a
// previous weightd of this instance left in shared memory (same model identity, same layout,
// sealed and intact: nothing is read from the checkpoint) or LOAD it (plan the layout, create the
// control and data segments, fill them, seal them, publish the manifest). See docs/weightd.md.

#include <atomic>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"

#include "common/model/checkpoint.h"
#include "common/model/gguf_source.h"
#include "common/shm/control_segment.h"
#include "common/shm/data_segment.h"
#include "common/shm/hugepages.h"
#include "common/shm/layout.h"
#include "common/shm/manifest.h"
#include "common/shm/model_identity.h"
#include "weightd/instance_lock.h"
#include "weightd/loader.h"

namespace hmoe::weightd {

// --numa: auto (every node this process may use), off (no binding, one slice), or a node number
// (everything bound to that node).
struct NumaSetting {
  enum class Mode { kAuto, kOff, kNode } mode = Mode::kAuto;
  int node = -1;
};
absl::StatusOr<NumaSetting> ParseNumaSetting(std::string_view s);

struct DaemonOptions {
  std::string model_dir;  // a checkpoint directory, or a GGUF file (*.gguf; any split part)
  std::string instance = "default";
  NumaSetting numa;
  // Slices per routed expert; 0 = one per NUMA node in use. N > nodes puts several slices on a
  // node (round robin), which is how the NUMA split is tested on a one-node machine.
  int numa_slices = 0;
  shm::HugePageMode hugepages = shm::HugePageMode::kAuto;
  shm::DensePolicy dense_policy = shm::DensePolicy::kInterleave;
  int load_threads = 2;
  uint64_t load_chunk_bytes = uint64_t{16} << 20;
  bool progress_tty = false;  // draw a progress bar (stderr is a terminal) instead of log lines
  absl::Time process_start = absl::Now();
  // The room for the store's segments; unset: read from the machine (shm::ReadSharedMemoryRoom).
  // Set by tests to play a /dev/shm too small for the weights (tmpfs sizes need root to change).
  std::optional<shm::SharedMemoryRoom> shared_memory_room;
};

enum class DaemonState { kStarting, kLoading, kReady, kFailed, kStopping };
const char* DaemonStateName(DaemonState s);

struct SegmentReport {
  shm::SegmentLayout layout;
  shm::SegmentHandle handle;
  shm::PageBacking backing = shm::PageBacking::kShmem;
  uint64_t size_bytes = 0;
  std::string backing_reason;  // empty when adopted
};

struct DaemonStatus {
  DaemonState state = DaemonState::kStarting;
  std::string instance;
  std::string model_dir;
  shm::ModelIdentity identity;
  uint64_t generation = 0;
  bool adopted = false;
  uint32_t adopt_count = 0;
  int pid = 0;
  absl::Time process_start;
  absl::Time ready_time;
  double startup_seconds = 0;
  double load_seconds = 0;
  uint64_t total_tensor_bytes = 0;
  uint64_t bytes_loaded = 0;
  uint64_t bytes_read_from_checkpoint = 0;
  double load_rate_bytes_per_second = 0;
  double eta_seconds = 0;
  uint32_t num_tensors = 0;
  uint32_t num_slices = 0;
  shm::DensePolicy dense_policy = shm::DensePolicy::kInterleave;
  std::vector<SegmentReport> segments;
  std::string error;
};

// Thread-safe: status() and manifest() may be called from gRPC threads while LoadOrAdopt runs.
class WeightDaemon {
 public:
  // Validates the options and takes the instance lock. InvalidArgument for bad options,
  // FailedPrecondition when another weightd serves the instance, PermissionDenied when the
  // runtime dir or lock file is not ours.
  static absl::StatusOr<std::unique_ptr<WeightDaemon>> Create(DaemonOptions options);

  WeightDaemon(const WeightDaemon&) = delete;
  WeightDaemon& operator=(const WeightDaemon&) = delete;
  ~WeightDaemon();  // Never removes segments (that is Shutdown(true)).

  // Call once. Blocks until the store is ready. Errors: NotFound / InvalidArgument / DataLoss for
  // a missing, malformed or truncated checkpoint or one that does not match its config.json;
  // PermissionDenied for an instance owned by another user; ResourceExhausted when shared memory
  // runs out; Cancelled when *cancel became true (partial segments are removed).
  absl::Status LoadOrAdopt(const std::atomic<bool>* cancel = nullptr);

  DaemonStatus status() const;
  // The opened model (a safetensors checkpoint or a GGUF) with where each tensor's bytes are
  // (weight_daemon.cc).
  struct ModelFiles;
  // The manifest once ready, else nullptr.
  std::shared_ptr<const shm::Manifest> manifest() const;
  // The layout this daemon uses (derived from the options and the NUMA topology).
  const shm::LayoutOptions& layout_options() const { return layout_; }

  // Stops serving: marks the control segment as having no owner; with `remove_segments`, also
  // removes the control and data segments (attached workers keep valid mappings).
  absl::Status Shutdown(bool remove_segments);

 private:
  WeightDaemon(DaemonOptions options, InstanceLock lock, shm::LayoutOptions layout,
               std::vector<int> numa_nodes, bool numa_enabled);

  absl::Status LoadOrAdoptImpl(const std::atomic<bool>* cancel);
  // Whether `control` holds our model, sealed and intact; `why_not` explains a refusal.
  bool CanAdopt(const shm::ControlSegment& control, const shm::ModelIdentity& identity,
                std::string& why_not) const;
  absl::Status Adopt(shm::ControlSegment control);
  absl::Status Load(const ModelFiles& model, const shm::ModelIdentity& identity,
                    uint64_t generation, const std::atomic<bool>* cancel);
  shm::NumaBinding BindingFor(const shm::SegmentLayout& segment) const;
  void SetState(DaemonState state, std::string error = "");

  const DaemonOptions options_;
  InstanceLock lock_;
  const shm::LayoutOptions layout_;
  const uint64_t layout_key_;
  const std::vector<int> numa_nodes_;
  const bool numa_enabled_;
  LoadCounters counters_;

  mutable absl::Mutex mu_;
  DaemonStatus status_ ABSL_GUARDED_BY(mu_);
  absl::Time load_start_ ABSL_GUARDED_BY(mu_);
  std::shared_ptr<const shm::Manifest> manifest_ ABSL_GUARDED_BY(mu_);
  // Owned by LoadOrAdopt / Shutdown, which callers do not run concurrently.
  std::optional<shm::ControlSegment> control_;
  std::vector<shm::DataSegment> segments_;
};

}  // namespace hmoe::weightd
