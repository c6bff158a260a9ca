#pragma once

// The manifest: where every tensor of the model lives in weightd's shared memory. weightd plans it
// (layout.h), stores it serialized in the control segment (control_segment.h) and serves it over
// gRPC; WeightStore parses it on attach. The binary format is ours (little-endian, length-prefixed,
// versioned) so that the client library needs no protobuf; Parse() treats the bytes as untrusted.
//
// Layout vocabulary:
//  - A *segment* is one shared-memory region (a SysV shm id recorded in the control segment).
//    Segment 0.. hold dense tensors (one segment, interleaved over the NUMA nodes; or one replica
//    per node), then one segment per NUMA *slice* holds that slice of every routed expert.
//  - Every tensor has >= 1 *part*. A dense tensor has one part (the whole tensor); a replicated one
//    has one full part per node; a routed-expert matrix (and its block scales) has one part per
//    slice: gate_proj/up_proj are split by rows (split_dim 0), down_proj by columns (split_dim 1),
//    always at multiples of the 128 FP8 block, so each slice's scale blocks are its own. Every part
//    is stored contiguously, row-major, with its own `shape`.
//  - `contiguous` says whether the whole tensor exists contiguously at (segment, offset): true for
//    everything except routed experts split into more than one slice.

#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "absl/status/statusor.h"

#include "common/model/dtype.h"
#include "common/shm/model_identity.h"

namespace hmoe::shm {

enum class DensePolicy : uint8_t { kInterleave = 0, kReplicate = 1 };
const char* DensePolicyName(DensePolicy p);
absl::StatusOr<DensePolicy> ParseDensePolicy(std::string_view s);

enum class SegmentRole : uint8_t {
  kDense = 0,         // all non-expert tensors, interleaved over the nodes (or on one node)
  kDenseReplica = 1,  // a full copy of the dense tensors bound to `numa_node`
  kExpertSlice = 2,   // slice `slice` of every routed expert, bound to `numa_node`
};
const char* SegmentRoleName(SegmentRole r);

enum class Placement : uint8_t { kDense = 0, kReplicated = 1, kSliced = 2 };
const char* PlacementName(Placement p);

struct SegmentLayout {
  uint32_t index = 0;
  SegmentRole role = SegmentRole::kDense;
  int32_t slice = -1;       // kExpertSlice: the slice; else -1
  int32_t numa_node = -1;   // physical node the pages are bound to; -1: interleaved / unbound
  uint64_t used_bytes = 0;  // bytes covered by tensors (the shm segment may be rounded up)

  bool operator==(const SegmentLayout&) const = default;
};

struct TensorPart {
  uint32_t slice = 0;      // slice index (replica index for kReplicated)
  int32_t numa_node = -1;  // physical node; -1 interleaved / unbound
  uint32_t segment = 0;
  uint64_t offset = 0;  // byte offset in the segment
  uint64_t size_bytes = 0;
  std::vector<int64_t> shape;  // of this part
  int32_t split_dim = -1;      // -1: the whole tensor; 0 rows; 1 columns
  int64_t begin = 0;           // [begin, end) along split_dim of the full tensor
  int64_t end = 0;

  bool operator==(const TensorPart&) const = default;
};

struct TensorEntry {
  std::string name;
  DType dtype = DType::kF32;
  std::vector<int64_t> shape;
  uint64_t size_bytes = 0;
  Placement placement = Placement::kDense;
  bool contiguous = true;  // the whole tensor is at (segment, offset)
  uint32_t segment = 0;
  uint64_t offset = 0;
  std::string scale_name;  // the FP8 block-scale tensor ("<name>_scale_inv"), or empty
  std::vector<TensorPart> parts;

  bool operator==(const TensorEntry&) const = default;
};

struct Manifest {
  static constexpr uint32_t kFormatVersion = 1;

  ModelIdentity identity;
  uint64_t generation = 0;
  std::string model_dir;
  std::string config_json;
  uint32_t num_slices = 1;
  DensePolicy dense_policy = DensePolicy::kInterleave;
  uint64_t total_tensor_bytes = 0;  // sum of size_bytes over tensors (one copy)
  std::vector<SegmentLayout> segments;
  std::vector<TensorEntry> tensors;  // sorted by name

  bool operator==(const Manifest&) const = default;

  // Binary image; Parse(Serialize(m)) == m.
  std::string Serialize() const;
  // DataLoss naming the field on truncated or inconsistent bytes (bad magic/version, counts that
  // exceed the buffer, parts outside their segment, unsorted names).
  static absl::StatusOr<Manifest> Parse(std::span<const std::byte> bytes);

  // Index into `tensors` by binary search; nullptr when absent.
  const TensorEntry* Find(std::string_view name) const;
};

}  // namespace hmoe::shm
