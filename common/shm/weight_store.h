#pragma once

// WeightStore: a worker's read-only view of the weights a weightd instance holds in shared memory.
//
//   absl::StatusOr<std::unique_ptr<shm::WeightStore>> store = shm::WeightStore::Attach("default");
//   absl::StatusOr<Weight> w = (*store)->GetWeight("model.layers.3.mlp.experts.7.up_proj.weight");
//
// Attach maps every data segment PROT_READ (SHM_RDONLY) and parses the manifest; it touches no
// weight pages, so it takes milliseconds regardless of model size. It does not need weightd to be
// alive (the segments persist), but the store must be sealed and ready. The mappings stay valid for
// the object's lifetime even if weightd dies or removes the segments. A write through a returned
// pointer faults (SIGSEGV).
//
// WeightStore implements WeightSource, so the engine reads weights through it unchanged. Tensors
// that weightd split into several NUMA slices (routed experts with --numa-slices > 1) have no
// contiguous copy: GetTensor assembles them once into process-private memory (slow, for reference
// paths and tests); NUMA-aware code reads GetParts() instead. Thread-safe.

#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"

#include "common/model/tensor.h"
#include "common/shm/control_segment.h"
#include "common/shm/data_segment.h"
#include "common/shm/hugepages.h"
#include "common/shm/manifest.h"
#include "common/shm/model_identity.h"

namespace hmoe::shm {

struct AttachOptions {
  // When set, Attach fails with FailedPrecondition unless the store holds this model.
  std::optional<ModelIdentity> expected_identity;
};

// One NUMA part of a tensor: its placement and a view of its bytes (shape = the part's shape).
struct TensorPartView {
  TensorPart part;
  TensorView view;
};

// Copies the parts of `entry` into `out` (entry.size_bytes, row-major full tensor): row slices
// go to their rows, column slices to their columns of every row. InvalidArgument when the parts
// do not tile the tensor exactly.
absl::Status AssembleFromParts(const TensorEntry& entry, const std::vector<TensorPartView>& parts,
                               std::span<std::byte> out);

class WeightStore final : public WeightSource {
 public:
  // NotFound: no such instance (weightd never ran or removed it). FailedPrecondition: the store is
  // still loading or failed, or holds another model than expected. PermissionDenied: segments of
  // another user or not owner-only. DataLoss: a corrupt control segment or a data segment that is
  // not what the control segment records.
  static absl::StatusOr<std::unique_ptr<WeightStore>> Attach(std::string_view instance,
                                                             const AttachOptions& options = {});

  ~WeightStore() override;

  // WeightSource.
  absl::StatusOr<TensorView> GetTensor(const std::string& name) const override;
  std::vector<std::string> TensorNames() const override;

  // Every NUMA part of `name` (one for dense tensors, one per replica or slice otherwise).
  absl::StatusOr<std::vector<TensorPartView>> GetParts(const std::string& name) const;

  const Manifest& manifest() const { return manifest_; }
  const ModelIdentity& identity() const { return manifest_.identity; }
  uint64_t generation() const { return manifest_.generation; }
  const std::string& instance() const { return instance_; }
  // The live control header (owner pid, adopt count change when weightd restarts).
  const ControlHeader& control_header() const { return control_.header(); }

  struct Segment {
    SegmentLayout layout;
    SegmentHandle handle;
    PageBacking backing = PageBacking::kShmem;
    std::span<const std::byte> bytes;  // the whole mapping (size rounded to the page size)
  };
  const std::vector<Segment>& segments() const { return segments_; }

 private:
  WeightStore(std::string instance, ControlSegment control, Manifest manifest,
              std::vector<DataSegment> mappings);
  TensorView ViewAt(const TensorEntry& t, uint32_t segment, uint64_t offset,
                    const std::vector<int64_t>& shape, uint64_t size_bytes) const;

  std::string instance_;
  ControlSegment control_;
  Manifest manifest_;
  std::vector<DataSegment> mappings_;
  std::vector<Segment> segments_;

  mutable absl::Mutex assembled_mu_;
  mutable std::map<std::string, std::unique_ptr<std::vector<std::byte>>> assembled_
      ABSL_GUARDED_BY(assembled_mu_);
};

}  // namespace hmoe::shm
