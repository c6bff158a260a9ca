#pragma once

// Planning where every tensor goes (a pure function, no memory is touched): which segment, which
// offset, and how routed-expert matrices are sliced across NUMA nodes. See manifest.h for the
// vocabulary.

#include <cstdint>
#include <string_view>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"

#include "common/shm/manifest.h"
#include "common/shm/model_identity.h"

namespace hmoe::shm {

struct LayoutOptions {
  // Number of slices of each routed expert (>= 1) and the physical NUMA node of each slice (-1:
  // unbound). slice_nodes.size() == num_slices.
  uint32_t num_slices = 1;
  std::vector<int> slice_nodes = {-1};
  DensePolicy dense_policy = DensePolicy::kInterleave;
  // kInterleave: the node the dense segment is bound to, or -1 = interleaved over all nodes (or
  // unbound when NUMA is off). kReplicate: one replica per entry of `replica_nodes`.
  int dense_node = -1;
  std::vector<int> replica_nodes = {-1};
  // Slice boundaries are multiples of this many elements (the FP8 block), so block scales split
  // with their weight.
  int64_t slice_block = 128;
};

// Which routed-expert matrix a tensor name is:
//   model.layers.<L>.mlp.experts.<E>.{gate_proj,up_proj,down_proj}.{weight,weight_scale_inv}
// Shared experts ("mlp.shared_experts.") and the router ("mlp.gate.") are not routed experts.
enum class ExpertMatrix { kNone, kGateUp, kDown };
ExpertMatrix ClassifyExpertTensor(std::string_view name);

// The [begin, end) element range of slice `k` of a dimension of `n` elements cut into
// `num_slices` at multiples of `block`: the ceil(n / block) blocks are dealt out as evenly as
// possible (slice k gets blocks [k*nb/S, (k+1)*nb/S)). A slice may be empty when nb < S.
std::pair<int64_t, int64_t> SliceRange(int64_t n, int64_t block, uint32_t num_slices, uint32_t k);

// Byte alignment of a tensor or part of `size_bytes` in its segment: 64 (a cache line, enough for
// every kernel). Nothing needs page alignment: NUMA binding, hugepages and cudaHostRegister work
// per segment, and 4 KiB alignment wasted ~0.7 % of a small model's memory in padding.
uint64_t PlacementAlignment(uint64_t size_bytes);

// Plans segments and tensor placement. Offsets are assigned in the order of `index` (weightd passes
// checkpoint file order, so the writes are sequential); Manifest::tensors come out sorted by name.
// identity, generation, model_dir and config_json are left for the caller. InvalidArgument when a
// routed expert's scale tensor does not have ceil(n/128) blocks along the split dimension, or the
// options are inconsistent.
absl::StatusOr<Manifest> PlanLayout(const std::vector<TensorIndexEntry>& index,
                                    const LayoutOptions& options);

}  // namespace hmoe::shm
