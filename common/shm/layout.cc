#include "common/shm/layout.h"

#include <algorithm>
#include <map>

#include "absl/status/status.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"

namespace hmoe::shm {
namespace {

constexpr std::string_view kScaleSuffix = "_scale_inv";

absl::string_view AbslView(std::string_view s) { return absl::string_view(s.data(), s.size()); }

bool EndsWith(std::string_view s, std::string_view suffix) {
  return s.size() >= suffix.size() && s.substr(s.size() - suffix.size()) == suffix;
}

bool IsNumber(absl::string_view s) {
  if (s.empty()) return false;
  for (char c : s) {
    if (c < '0' || c > '9') return false;
  }
  return true;
}

uint64_t AlignUp(uint64_t v, uint64_t a) { return (v + a - 1) / a * a; }

// Bump allocator of one segment.
struct SegmentCursor {
  uint64_t used = 0;
  uint64_t Place(uint64_t size_bytes) {
    const uint64_t offset = AlignUp(used, PlacementAlignment(size_bytes));
    used = offset + size_bytes;
    return offset;
  }
};

}  // namespace

ExpertMatrix ClassifyExpertTensor(std::string_view name) {
  // model.layers.<L>.mlp.experts.<E>.<proj>.<weight|weight_scale_inv>
  std::vector<absl::string_view> p = absl::StrSplit(AbslView(name), '.');
  if (p.size() != 8 || p[0] != "model" || p[1] != "layers" || !IsNumber(p[2]) || p[3] != "mlp" ||
      p[4] != "experts" || !IsNumber(p[5])) {
    return ExpertMatrix::kNone;
  }
  if (p[7] != "weight" && p[7] != "weight_scale_inv") return ExpertMatrix::kNone;
  if (p[6] == "gate_proj" || p[6] == "up_proj") return ExpertMatrix::kGateUp;
  if (p[6] == "down_proj") return ExpertMatrix::kDown;
  return ExpertMatrix::kNone;
}

std::pair<int64_t, int64_t> SliceRange(int64_t n, int64_t block, uint32_t num_slices, uint32_t k) {
  const int64_t nb = (n + block - 1) / block;
  const int64_t b0 = static_cast<int64_t>(k) * nb / num_slices;
  const int64_t b1 = static_cast<int64_t>(k + 1) * nb / num_slices;
  return {std::min(b0 * block, n), std::min(b1 * block, n)};
}

uint64_t PlacementAlignment(uint64_t /*size_bytes*/) { return 64; }

absl::StatusOr<Manifest> PlanLayout(const std::vector<TensorIndexEntry>& index,
                                    const LayoutOptions& options) {
  if (options.num_slices < 1 || options.slice_nodes.size() != options.num_slices) {
    return absl::InvalidArgumentError(absl::StrCat("layout: ", options.num_slices, " slices but ",
                                                   options.slice_nodes.size(), " slice nodes"));
  }
  if (options.dense_policy == DensePolicy::kReplicate && options.replica_nodes.empty()) {
    return absl::InvalidArgumentError("layout: replicate policy without replica nodes");
  }
  if (options.slice_block < 1) return absl::InvalidArgumentError("layout: slice_block < 1");

  Manifest m;
  m.num_slices = options.num_slices;
  m.dense_policy = options.dense_policy;

  // Segments: dense (or one replica per node), then one per expert slice.
  const uint32_t num_dense = options.dense_policy == DensePolicy::kReplicate
                                 ? static_cast<uint32_t>(options.replica_nodes.size())
                                 : 1;
  for (uint32_t i = 0; i < num_dense; ++i) {
    SegmentLayout s;
    s.index = i;
    if (options.dense_policy == DensePolicy::kReplicate) {
      s.role = SegmentRole::kDenseReplica;
      s.slice = static_cast<int32_t>(i);
      s.numa_node = options.replica_nodes[i];
    } else {
      s.role = SegmentRole::kDense;
      s.numa_node = options.dense_node;
    }
    m.segments.push_back(s);
  }
  for (uint32_t k = 0; k < options.num_slices; ++k) {
    SegmentLayout s;
    s.index = num_dense + k;
    s.role = SegmentRole::kExpertSlice;
    s.slice = static_cast<int32_t>(k);
    s.numa_node = options.slice_nodes[k];
    m.segments.push_back(s);
  }
  std::vector<SegmentCursor> cursors(m.segments.size());

  std::map<std::string_view, const TensorIndexEntry*> by_name;
  for (const TensorIndexEntry& e : index) {
    if (!by_name.emplace(e.name, &e).second) {
      return absl::InvalidArgumentError(absl::StrCat("layout: duplicate tensor \"", e.name, "\""));
    }
  }

  for (const TensorIndexEntry& e : index) {
    TensorEntry t;
    t.name = e.name;
    t.dtype = e.dtype;
    t.shape = e.shape;
    t.size_bytes = e.size_bytes;
    m.total_tensor_bytes += e.size_bytes;
    if (EndsWith(e.name, ".weight") && by_name.count(e.name + std::string(kScaleSuffix))) {
      t.scale_name = e.name + std::string(kScaleSuffix);
    }
    const ExpertMatrix kind = ClassifyExpertTensor(e.name);
    if (kind != ExpertMatrix::kNone && IsBlockDType(e.dtype)) {
      // GGML block-quantized experts (GGUF) are not split (a column slice of down_proj would cut
      // blocks): expert x lies whole in the segment of slice x mod num_slices, so the experts
      // still spread evenly over the nodes.
      std::vector<absl::string_view> p = absl::StrSplit(AbslView(e.name), '.');
      int64_t expert = 0;
      if (p.size() > 5 && !absl::SimpleAtoi(p[5], &expert)) expert = 0;
      const uint32_t k = static_cast<uint32_t>(expert % options.num_slices);
      TensorPart part;
      part.slice = k;
      part.numa_node = options.slice_nodes[k];
      part.segment = num_dense + k;
      part.size_bytes = e.size_bytes;
      part.shape = e.shape;
      part.offset = cursors[part.segment].Place(e.size_bytes);
      t.placement = Placement::kSliced;
      t.parts.push_back(std::move(part));
      t.contiguous = true;
      t.segment = t.parts[0].segment;
      t.offset = t.parts[0].offset;
    } else if (kind != ExpertMatrix::kNone && e.shape.size() == 2) {
      const bool is_scale = EndsWith(e.name, kScaleSuffix);
      const int split_dim = kind == ExpertMatrix::kGateUp ? 0 : 1;
      const int64_t block = is_scale ? 1 : options.slice_block;
      if (is_scale) {
        // The weight's split dimension, in blocks, must be this tensor's split dimension.
        const std::string weight_name(e.name.substr(0, e.name.size() - kScaleSuffix.size()));
        auto w = by_name.find(weight_name);
        if (w != by_name.end() && w->second->shape.size() == 2) {
          const int64_t want =
              (w->second->shape[split_dim] + options.slice_block - 1) / options.slice_block;
          if (e.shape[split_dim] != want) {
            return absl::InvalidArgumentError(
                absl::StrCat("layout: scale tensor \"", e.name, "\" has ", e.shape[split_dim],
                             " blocks along dim ", split_dim, ", but weight \"", weight_name,
                             "\" needs ", want, " (", options.slice_block, "-element blocks)"));
          }
        }
      }
      const uint64_t esize = DTypeSize(e.dtype);
      t.placement = Placement::kSliced;
      for (uint32_t k = 0; k < options.num_slices; ++k) {
        const auto [begin, end] = SliceRange(e.shape[split_dim], block, options.num_slices, k);
        TensorPart p;
        p.slice = k;
        p.numa_node = options.slice_nodes[k];
        p.segment = num_dense + k;
        p.shape = e.shape;
        p.shape[split_dim] = end - begin;
        p.size_bytes = static_cast<uint64_t>(p.shape[0] * p.shape[1]) * esize;
        p.split_dim = split_dim;
        p.begin = begin;
        p.end = end;
        p.offset = cursors[p.segment].Place(p.size_bytes);
        t.parts.push_back(std::move(p));
      }
      t.contiguous = options.num_slices == 1;
      t.segment = t.parts[0].segment;
      t.offset = t.parts[0].offset;
    } else {
      t.placement = options.dense_policy == DensePolicy::kReplicate ? Placement::kReplicated
                                                                    : Placement::kDense;
      for (uint32_t i = 0; i < num_dense; ++i) {
        TensorPart p;
        p.slice = i;
        p.numa_node = m.segments[i].numa_node;
        p.segment = i;
        p.size_bytes = e.size_bytes;
        p.shape = e.shape;
        p.offset = cursors[i].Place(e.size_bytes);
        t.parts.push_back(std::move(p));
      }
      t.contiguous = true;
      t.segment = t.parts[0].segment;
      t.offset = t.parts[0].offset;
    }
    m.tensors.push_back(std::move(t));
  }
  for (size_t i = 0; i < m.segments.size(); ++i) m.segments[i].used_bytes = cursors[i].used;
  std::sort(m.tensors.begin(), m.tensors.end(),
            [](const TensorEntry& a, const TensorEntry& b) { return a.name < b.name; });
  return m;
}

}  // namespace hmoe::shm
