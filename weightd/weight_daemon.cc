#include "weightd/weight_daemon.h"

#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <filesystem>
#include <utility>

#include "absl/cleanup/cleanup.h"
#include "absl/status/status.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"

#include "common/base/logging.h"
#include "common/base/status_macros.h"
#include "common/model/tensor_map.h"
#include "common/shm/numa_placement.h"
#include "common/shm/shm_names.h"
#include "weightd/progress.h"

namespace hmoe::weightd {
namespace {

using shm::ControlHeader;
using shm::ControlSegment;
using shm::DataSegment;
using shm::Manifest;
using shm::SegmentSlot;
using shm::StoreState;

int64_t ToUnixNs(absl::Time t) { return absl::ToUnixNanos(t); }

uint64_t LayoutKey(const shm::LayoutOptions& o) {
  shm::Fnv1a128 h;
  h.UpdateString("hmoe-layout-v1");
  h.UpdateU64(Manifest::kFormatVersion);
  h.UpdateU64(o.num_slices);
  for (int n : o.slice_nodes) h.UpdateU64(static_cast<uint64_t>(static_cast<int64_t>(n)));
  h.UpdateU64(static_cast<uint64_t>(o.dense_policy));
  h.UpdateU64(static_cast<uint64_t>(static_cast<int64_t>(o.dense_node)));
  for (int n : o.replica_nodes) h.UpdateU64(static_cast<uint64_t>(static_cast<int64_t>(n)));
  h.UpdateU64(static_cast<uint64_t>(o.slice_block));
  return h.lo();
}

// Data segment files of this instance that no control segment records (a weightd died between
// creating a file and recording it). We hold the instance lock and the old store is gone, so every
// such file that is ours is an orphan.
void RemoveOrphanedFiles(const std::string& instance) {
  const std::string prefix = absl::StrCat("hmoe.", instance, ".g");
  std::error_code ec;
  for (const auto& entry : std::filesystem::directory_iterator("/dev/shm", ec)) {
    const std::string name = entry.path().filename().string();
    if (name.rfind(prefix, 0) != 0) continue;
    struct stat st {};
    if (::lstat(entry.path().c_str(), &st) != 0 || st.st_uid != ::geteuid()) continue;
    HMOE_LOG(WARNING) << "removing orphaned segment " << entry.path().string();
    ::unlink(entry.path().c_str());
  }
}

std::string DescribeLayout(const shm::LayoutOptions& o) {
  return absl::StrCat(o.num_slices, " expert slice(s) on node(s) [",
                      absl::StrJoin(o.slice_nodes, ","), "], dense ",
                      shm::DensePolicyName(o.dense_policy));
}

}  // namespace

struct WeightDaemon::ModelFiles {
  struct Located {
    uint32_t shard = 0;
    uint64_t offset = 0;
    const std::byte* memory = nullptr;  // bytes from memory instead of a file (GGUF kv_b)
    shm::TensorIndexEntry entry;
  };
  std::unique_ptr<Checkpoint> checkpoint;
  std::unique_ptr<GgufCheckpoint> gguf;
  std::string config_json;
  uint64_t total_bytes = 0;
  std::vector<std::string> shard_paths;
  std::vector<Located> tensors;  // in file order

  std::vector<shm::TensorIndexEntry> Index() const {
    std::vector<shm::TensorIndexEntry> index;
    for (const Located& l : tensors) index.push_back(l.entry);
    return index;
  }
};

namespace {

// Opens `path`: a safetensors checkpoint directory (checked against its config.json) or a GGUF
// file (GgufCheckpoint: config from its metadata, tensors checked, big weights in their GGUF
// encoding), and lists where every tensor's bytes are.
absl::StatusOr<std::unique_ptr<WeightDaemon::ModelFiles>> OpenModelFiles(const std::string& path) {
  auto m = std::make_unique<WeightDaemon::ModelFiles>();
  using Located = WeightDaemon::ModelFiles::Located;
  if (IsGgufPath(path)) {
    HMOE_ASSIGN_OR_RETURN(m->gguf, GgufCheckpoint::Open(path));
    const GgufCheckpoint& g = *m->gguf;
    m->config_json = g.config_json();
    m->total_bytes = g.total_tensor_bytes();
    for (int i = 0; i < g.model().num_files(); ++i)
      m->shard_paths.push_back(g.model().file(i).name());
    for (const std::string& name : g.TensorNames()) {
      HMOE_ASSIGN_OR_RETURN(const TensorView view, g.GetTensor(name));
      HMOE_ASSIGN_OR_RETURN(const GgufCheckpoint::Location loc, g.Locate(name));
      m->tensors.push_back(Located{
          loc.memory != nullptr ? 0u : static_cast<uint32_t>(loc.file), loc.file_offset, loc.memory,
          shm::TensorIndexEntry{name, view.dtype, view.shape, view.size_bytes}});
    }
  } else {
    HMOE_ASSIGN_OR_RETURN(m->checkpoint, Checkpoint::Open(path));  // Its message names the dir.
    const Checkpoint& checkpoint = *m->checkpoint;
    if (absl::Status v = ValidateTensors(checkpoint.config(), checkpoint); !v.ok()) {
      return absl::InvalidArgumentError(
          absl::StrCat("checkpoint ", path, " does not match its config.json: ", v.message()));
    }
    m->config_json = checkpoint.config_json();
    m->total_bytes = checkpoint.total_tensor_bytes();
    for (uint32_t s = 0; s < checkpoint.shards().size(); ++s) {
      const SafetensorsFile& shard = *checkpoint.shards()[s];
      m->shard_paths.push_back(shard.path());
      for (const auto& [name, entry] : shard.entries()) {
        absl::StatusOr<TensorView> view = checkpoint.GetTensor(name);
        if (!view.ok() || view->data != entry.view.data) continue;  // Served from another shard.
        m->tensors.push_back(Located{s, entry.file_offset, nullptr,
                                     shm::TensorIndexEntry{name, entry.view.dtype, entry.view.shape,
                                                           entry.view.size_bytes}});
      }
    }
  }
  std::sort(m->tensors.begin(), m->tensors.end(), [](const Located& a, const Located& b) {
    return a.shard != b.shard ? a.shard < b.shard : a.offset < b.offset;
  });
  return m;
}

}  // namespace

absl::StatusOr<NumaSetting> ParseNumaSetting(std::string_view s) {
  NumaSetting n;
  if (s == "auto") return n;
  if (s == "off") {
    n.mode = NumaSetting::Mode::kOff;
    return n;
  }
  int node = -1;
  if (absl::SimpleAtoi(absl::string_view(s.data(), s.size()), &node) && node >= 0) {
    n.mode = NumaSetting::Mode::kNode;
    n.node = node;
    return n;
  }
  return absl::InvalidArgumentError(
      absl::StrCat("numa \"", std::string(s), "\": expected auto, off or a node number"));
}

const char* DaemonStateName(DaemonState s) {
  switch (s) {
    case DaemonState::kStarting:
      return "starting";
    case DaemonState::kLoading:
      return "loading";
    case DaemonState::kReady:
      return "ready";
    case DaemonState::kFailed:
      return "failed";
    case DaemonState::kStopping:
      return "stopping";
  }
  return "?";
}

absl::StatusOr<std::unique_ptr<WeightDaemon>> WeightDaemon::Create(DaemonOptions options) {
  if (options.model_dir.empty()) return absl::InvalidArgumentError("--model is required");
  HMOE_RETURN_IF_ERROR(shm::ValidateInstanceName(options.instance));
  if (options.numa_slices < 0 || options.numa_slices > 16) {
    return absl::InvalidArgumentError(
        absl::StrCat("numa slices ", options.numa_slices, ": expected 0 (auto) to 16"));
  }
  if (options.load_threads < 1 || options.load_threads > 64) {
    return absl::InvalidArgumentError(
        absl::StrCat("load threads ", options.load_threads, ": expected 1 to 64"));
  }

  // The NUMA nodes in use, then slices and dense placement over them.
  const shm::NumaTopology topology = shm::ProbeNumaTopology();
  bool numa_enabled = topology.available && options.numa.mode != NumaSetting::Mode::kOff;
  std::vector<int> nodes = topology.nodes;
  if (options.numa.mode == NumaSetting::Mode::kNode) {
    if (!topology.available ||
        std::find(nodes.begin(), nodes.end(), options.numa.node) == nodes.end()) {
      return absl::InvalidArgumentError(
          absl::StrCat("numa node ", options.numa.node,
                       " is not available; nodes: ", absl::StrJoin(topology.nodes, ",")));
    }
    nodes = {options.numa.node};
  }
  if (!numa_enabled) nodes = {-1};
  shm::LayoutOptions layout;
  layout.num_slices = options.numa_slices > 0 ? static_cast<uint32_t>(options.numa_slices)
                                              : static_cast<uint32_t>(nodes.size());
  layout.slice_nodes.clear();
  for (uint32_t k = 0; k < layout.num_slices; ++k) {
    layout.slice_nodes.push_back(nodes[k % nodes.size()]);
  }
  layout.dense_policy = options.dense_policy;
  // Dense tensors: one segment interleaved over several nodes, or bound to the only one.
  layout.dense_node = nodes.size() == 1 ? nodes[0] : -1;
  // One replica per slice (= per node on a real machine; several on one node when forced).
  layout.replica_nodes = layout.slice_nodes;

  HMOE_ASSIGN_OR_RETURN(InstanceLock lock, InstanceLock::Acquire(options.instance));
  return std::unique_ptr<WeightDaemon>(new WeightDaemon(
      std::move(options), std::move(lock), std::move(layout), std::move(nodes), numa_enabled));
}

WeightDaemon::WeightDaemon(DaemonOptions options, InstanceLock lock, shm::LayoutOptions layout,
                           std::vector<int> numa_nodes, bool numa_enabled)
    : options_(std::move(options)),
      lock_(std::move(lock)),
      layout_(std::move(layout)),
      layout_key_(LayoutKey(layout_)),
      numa_nodes_(std::move(numa_nodes)),
      numa_enabled_(numa_enabled) {
  absl::MutexLock l(&mu_);
  status_.instance = options_.instance;
  status_.model_dir = options_.model_dir;
  status_.pid = ::getpid();
  status_.process_start = options_.process_start;
  status_.num_slices = layout_.num_slices;
  status_.dense_policy = layout_.dense_policy;
}

WeightDaemon::~WeightDaemon() = default;

void WeightDaemon::SetState(DaemonState state, std::string error) {
  absl::MutexLock l(&mu_);
  status_.state = state;
  if (!error.empty()) status_.error = std::move(error);
}

DaemonStatus WeightDaemon::status() const {
  absl::MutexLock l(&mu_);
  DaemonStatus s = status_;
  if (s.state == DaemonState::kLoading) {
    // Relaxed: progress statistics.
    s.bytes_loaded = counters_.bytes_done.load(std::memory_order_relaxed);
    s.bytes_read_from_checkpoint = counters_.bytes_read.load(std::memory_order_relaxed);
    const double seconds = absl::ToDoubleSeconds(absl::Now() - load_start_);
    s.load_seconds = seconds;
    s.load_rate_bytes_per_second =
        seconds > 0 ? static_cast<double>(s.bytes_loaded) / seconds : 0.0;
    s.eta_seconds = s.load_rate_bytes_per_second > 0
                        ? static_cast<double>(s.total_tensor_bytes -
                                              std::min(s.bytes_loaded, s.total_tensor_bytes)) /
                              s.load_rate_bytes_per_second
                        : 0.0;
  }
  return s;
}

std::shared_ptr<const Manifest> WeightDaemon::manifest() const {
  absl::MutexLock l(&mu_);
  return manifest_;
}

absl::Status WeightDaemon::LoadOrAdopt(const std::atomic<bool>* cancel) {
  absl::Status s = LoadOrAdoptImpl(cancel);
  if (!s.ok()) SetState(DaemonState::kFailed, s.ToString());
  return s;
}

absl::Status WeightDaemon::LoadOrAdoptImpl(const std::atomic<bool>* cancel) {
  HMOE_LOG(INFO) << "instance " << options_.instance << ": model " << options_.model_dir << ", "
                 << DescribeLayout(layout_) << ", hugepages "
                 << shm::HugePageModeName(options_.hugepages) << ", NUMA "
                 << (numa_enabled_ ? absl::StrCat("nodes ", absl::StrJoin(numa_nodes_, ","))
                                   : std::string("off"));
  HMOE_ASSIGN_OR_RETURN(std::unique_ptr<ModelFiles> model, OpenModelFiles(options_.model_dir));
  const shm::ModelIdentity identity = shm::ComputeModelIdentity(model->config_json, model->Index());
  {
    absl::MutexLock l(&mu_);
    status_.identity = identity;
    status_.total_tensor_bytes = model->total_bytes;
    status_.num_tensors = static_cast<uint32_t>(model->tensors.size());
  }
  HMOE_LOG(INFO) << "model identity " << identity.ToString() << ": " << model->tensors.size()
                 << " tensors, " << FormatBytes(model->total_bytes)
                 << (model->gguf != nullptr ? " (GGUF, tensors in their GGUF encoding)" : "");

  uint64_t previous_generation = 0;
  absl::StatusOr<ControlSegment> existing = ControlSegment::OpenReadWrite(options_.instance);
  if (existing.ok()) {
    std::string why_not;
    if (CanAdopt(*existing, identity, why_not)) return Adopt(*std::move(existing));
    previous_generation = existing->header().generation;
    HMOE_LOG(INFO) << "instance " << options_.instance << " holds a store we cannot adopt ("
                   << why_not << "); removing it and loading";
    existing = absl::NotFoundError("released");  // Unmaps before removal.
    if (absl::Status s = shm::RemoveInstance(options_.instance); !s.ok() && !absl::IsNotFound(s)) {
      return Annotate(s, absl::StrCat("remove the old store of instance ", options_.instance));
    }
  } else if (absl::IsDataLoss(existing.status()) || absl::IsUnavailable(existing.status())) {
    // A control segment we own but cannot read (a weightd died while creating it, or a foreign
    // layout version): its data segments are unknown, so only the name can be reclaimed.
    HMOE_LOG(WARNING) << "replacing unusable control segment: " << existing.status().message();
    if (absl::Status s = ControlSegment::Remove(options_.instance);
        !s.ok() && !absl::IsNotFound(s)) {
      return s;
    }
  } else if (!absl::IsNotFound(existing.status())) {
    return Annotate(existing.status(), absl::StrCat("instance ", options_.instance));
  }
  return Load(*model, identity, previous_generation + 1, cancel);
}

bool WeightDaemon::CanAdopt(const ControlSegment& control, const shm::ModelIdentity& identity,
                            std::string& why_not) const {
  const ControlHeader& h = control.header();
  if (control.LoadState() != StoreState::kReady) {
    why_not =
        absl::StrCat("state ", shm::StoreStateName(static_cast<uint32_t>(control.LoadState())));
    return false;
  }
  const shm::ModelIdentity held{h.identity_hi, h.identity_lo};
  if (held != identity) {
    why_not = absl::StrCat("model ", held.ToString(), ", we serve ", identity.ToString());
    return false;
  }
  if (h.layout_key != layout_key_) {
    why_not = "a different NUMA layout (--numa, --numa-slices or --dense-policy changed)";
    return false;
  }
  for (uint32_t i = 0; i < h.num_segments; ++i) {
    const SegmentSlot& slot = h.segments[i];
    const shm::SegmentHandle handle = shm::HandleOf(slot);
    absl::StatusOr<DataSegment::Stat> st = DataSegment::StatSegment(handle);
    if (!st.ok()) {
      why_not = absl::StrCat("segment ", i, ": ", st.status().message());
      return false;
    }
    if (st->uid != ::geteuid() || st->mode != 0400 || st->instance_id != slot.instance_id ||
        st->size_bytes != slot.size_bytes) {
      why_not = absl::StrCat("segment ", i, " (", handle.ToString(),
                             ") is not the sealed segment the control segment records");
      return false;
    }
  }
  absl::StatusOr<Manifest> manifest = control.ReadManifest();
  if (!manifest.ok()) {
    why_not = std::string(manifest.status().message());
    return false;
  }
  return true;
}

absl::Status WeightDaemon::Adopt(ControlSegment control) {
  const absl::Time start = absl::Now();
  HMOE_ASSIGN_OR_RETURN(Manifest manifest, control.ReadManifest());
  ControlHeader& h = control.mutable_header();
  std::vector<SegmentReport> reports;
  for (uint32_t i = 0; i < h.num_segments; ++i) {
    const SegmentSlot& slot = h.segments[i];
    // Keep our own read-only attachment: the store stays attached while weightd runs.
    HMOE_ASSIGN_OR_RETURN(DataSegment seg,
                          DataSegment::AttachReadOnly(shm::HandleOf(slot), slot.size_bytes,
                                                      static_cast<shm::PageBacking>(slot.backing)));
    reports.push_back(
        SegmentReport{manifest.segments[i], seg.handle(), seg.backing(), seg.size_bytes(), ""});
    segments_.push_back(std::move(seg));
  }
  const int32_t previous_owner = control.LoadOwnerPid();
  h.adopt_count += 1;
  h.owner_since_unix_ns = ToUnixNs(absl::Now());
  control.StoreOwnerPid(::getpid());
  const absl::Time now = absl::Now();
  {
    absl::MutexLock l(&mu_);
    status_.generation = manifest.generation;
    status_.adopted = true;
    status_.adopt_count = h.adopt_count;
    status_.segments = reports;
    status_.total_tensor_bytes = manifest.total_tensor_bytes;
    status_.bytes_loaded = manifest.total_tensor_bytes;
    status_.ready_time = now;
    status_.startup_seconds = absl::ToDoubleSeconds(now - options_.process_start);
    manifest_ = std::make_shared<const Manifest>(std::move(manifest));
    status_.state = DaemonState::kReady;
  }
  control_.emplace(std::move(control));
  HMOE_LOG(INFO) << "adopted generation " << status().generation << " of instance "
                 << options_.instance << " (" << reports.size() << " segments, "
                 << FormatBytes(status().total_tensor_bytes) << ", loaded by pid " << h.creator_pid
                 << ", previous owner pid " << previous_owner
                 << "): 0 bytes read from the checkpoint, adopted in "
                 << absl::FormatDuration(absl::Now() - start) << ", ready "
                 << absl::FormatDuration(now - options_.process_start) << " after start";
  return absl::OkStatus();
}

shm::NumaBinding WeightDaemon::BindingFor(const shm::SegmentLayout& segment) const {
  shm::NumaBinding b;
  if (!numa_enabled_) return b;
  if (segment.numa_node >= 0) {
    b.kind = shm::NumaBindKind::kNode;
    b.node = segment.numa_node;
  } else if (numa_nodes_.size() > 1) {
    b.kind = shm::NumaBindKind::kInterleave;
    b.nodes = numa_nodes_;
  }
  return b;
}

absl::Status WeightDaemon::Load(const ModelFiles& model, const shm::ModelIdentity& identity,
                                uint64_t generation, const std::atomic<bool>* cancel) {
  SetState(DaemonState::kLoading);
  // The tensor index in file order (sequential writes), and where each tensor's bytes are.
  LoadPlan plan;
  plan.shard_paths = model.shard_paths;
  std::vector<shm::TensorIndexEntry> index;
  for (const ModelFiles::Located& l : model.tensors) {
    index.push_back(l.entry);
    plan.sources[l.entry.name] = TensorSource{l.shard, l.offset, l.entry.size_bytes, l.memory};
  }

  HMOE_ASSIGN_OR_RETURN(Manifest manifest, shm::PlanLayout(index, layout_));
  manifest.identity = identity;
  manifest.generation = generation;
  std::error_code ec;
  const std::filesystem::path abs = std::filesystem::absolute(options_.model_dir, ec);
  manifest.model_dir = ec ? options_.model_dir : abs.lexically_normal().string();
  manifest.config_json = model.config_json;
  const std::string manifest_bytes = manifest.Serialize();

  RemoveOrphanedFiles(options_.instance);
  // A store that cannot fit is refused before anything is created (no partial store to clean up),
  // with the size needed and the room there is. The per-segment check in DataSegment::Create
  // remains for room taken by others while we load.
  {
    std::vector<uint64_t> sizes;
    for (const shm::SegmentLayout& layout : manifest.segments) sizes.push_back(layout.used_bytes);
    absl::StatusOr<shm::SharedMemoryRoom> room = options_.shared_memory_room.has_value()
                                                     ? *options_.shared_memory_room
                                                     : shm::ReadSharedMemoryRoom();
    if (room.ok()) {
      HMOE_RETURN_IF_ERROR(shm::CheckRoomForSegments(sizes, options_.hugepages, *room));
    } else {
      HMOE_LOG(WARNING) << "cannot check the room for the store: " << room.status().message();
    }
  }
  HMOE_ASSIGN_OR_RETURN(ControlSegment control,
                        ControlSegment::Create(options_.instance, manifest_bytes.size()));
  // From here on, a failure removes what was created (a crash leaves it to the next weightd,
  // which finds the segments recorded below).
  auto cleanup = absl::MakeCleanup([this, &control] {
    control.StoreStateRelease(StoreState::kFailed);
    segments_.clear();
    if (absl::Status s = shm::RemoveInstance(options_.instance); !s.ok()) {
      HMOE_LOG(WARNING) << "cleaning up after a failed load: " << s.message();
    }
  });
  ControlHeader& h = control.mutable_header();
  h.generation = generation;
  h.identity_hi = identity.hi;
  h.identity_lo = identity.lo;
  h.layout_key = layout_key_;
  h.total_tensor_bytes = manifest.total_tensor_bytes;
  h.owner_since_unix_ns = ToUnixNs(absl::Now());
  control.StoreOwnerPid(::getpid());
  control.StoreStateRelease(StoreState::kLoading);

  if (manifest.segments.size() > static_cast<size_t>(shm::kMaxSegments)) {
    return absl::InvalidArgumentError(absl::StrCat(
        manifest.segments.size(), " segments exceed the limit of ", shm::kMaxSegments));
  }
  const absl::Time load_start = absl::Now();  // Segment creation allocates: part of the load.
  {
    absl::MutexLock l(&mu_);
    load_start_ = load_start;
  }
  std::vector<SegmentReport> reports;
  for (const shm::SegmentLayout& layout : manifest.segments) {
    std::string why;
    absl::StatusOr<DataSegment> seg = DataSegment::Create(
        layout.used_bytes, options_.hugepages, BindingFor(layout),
        shm::DataSegmentFileName(options_.instance, generation, layout.index), &why);
    if (!seg.ok()) {
      return Annotate(seg.status(), absl::StrCat("create data segment ", layout.index, " (",
                                                 FormatBytes(layout.used_bytes), ")"));
    }
    SegmentSlot& slot = h.segments[layout.index];
    shm::SetHandle(seg->handle(), slot);
    slot.backing = static_cast<uint32_t>(seg->backing());
    slot.size_bytes = seg->size_bytes();
    slot.instance_id = seg->instance_id();
    slot.numa_node = layout.numa_node;
    h.num_segments = layout.index + 1;
    HMOE_LOG(INFO) << "segment " << layout.index << " (" << shm::SegmentRoleName(layout.role)
                   << (layout.slice >= 0 ? absl::StrCat(" ", layout.slice) : std::string())
                   << ", node " << layout.numa_node << "): " << seg->handle().ToString() << ", "
                   << FormatBytes(seg->size_bytes()) << ", " << shm::PageBackingName(seg->backing())
                   << " -- " << why;
    reports.push_back(SegmentReport{layout, seg->handle(), seg->backing(), seg->size_bytes(), why});
    plan.segments.push_back(SegmentTarget{seg->mutable_bytes(), seg->write_fd()});
    segments_.push_back(*std::move(seg));
  }
  HMOE_RETURN_IF_ERROR(control.WriteManifest(manifest_bytes));
  {
    absl::MutexLock l(&mu_);
    status_.generation = generation;
    status_.segments = reports;
    status_.total_tensor_bytes = manifest.total_tensor_bytes;
  }

  plan.manifest = &manifest;
  LoadOptions load_options;
  load_options.num_threads = options_.load_threads;
  load_options.chunk_bytes = options_.load_chunk_bytes;
  load_options.cancel = cancel;
  ProgressReporter progress(&counters_.bytes_done, manifest.total_tensor_bytes,
                            options_.progress_tty);
  progress.Start();
  absl::Status loaded = LoadSegments(plan, load_options, counters_);
  progress.Stop();
  HMOE_RETURN_IF_ERROR(loaded);
  const double load_seconds = absl::ToDoubleSeconds(absl::Now() - load_start);

  for (DataSegment& seg : segments_) HMOE_RETURN_IF_ERROR(seg.Seal());
  h.ready_unix_ns = ToUnixNs(absl::Now());
  control.StoreStateRelease(StoreState::kReady);
  std::move(cleanup).Cancel();

  const absl::Time now = absl::Now();
  {
    absl::MutexLock l(&mu_);
    // Relaxed: the loader threads have been joined.
    status_.bytes_loaded = counters_.bytes_done.load(std::memory_order_relaxed);
    status_.bytes_read_from_checkpoint = counters_.bytes_read.load(std::memory_order_relaxed);
    status_.load_seconds = load_seconds;
    status_.load_rate_bytes_per_second =
        load_seconds > 0 ? static_cast<double>(status_.bytes_loaded) / load_seconds : 0.0;
    status_.eta_seconds = 0;
    status_.ready_time = now;
    status_.startup_seconds = absl::ToDoubleSeconds(now - options_.process_start);
    manifest_ = std::make_shared<const Manifest>(std::move(manifest));
    status_.state = DaemonState::kReady;
  }
  control_.emplace(std::move(control));
  const DaemonStatus s = status();
  HMOE_LOG(INFO) << "loaded generation " << generation << ": " << s.num_tensors << " tensors, "
                 << FormatBytes(s.bytes_loaded) << " in " << absl::StrFormat("%.3f", load_seconds)
                 << " s (" << FormatBytes(static_cast<uint64_t>(s.load_rate_bytes_per_second))
                 << "/s), sealed read-only; ready " << absl::StrFormat("%.3f", s.startup_seconds)
                 << " s after start";
  return absl::OkStatus();
}

absl::Status WeightDaemon::Shutdown(bool remove_segments) {
  SetState(DaemonState::kStopping);
  if (control_.has_value() && control_->LoadOwnerPid() == ::getpid()) control_->StoreOwnerPid(0);
  if (!remove_segments) return absl::OkStatus();
  control_.reset();
  segments_.clear();
  absl::Status s = shm::RemoveInstance(options_.instance);
  if (absl::IsNotFound(s)) return absl::OkStatus();
  if (s.ok()) HMOE_LOG(INFO) << "removed the segments of instance " << options_.instance;
  return s;
}

}  // namespace hmoe::weightd
