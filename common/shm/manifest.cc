#include "common/shm/manifest.h"

#include <algorithm>
#include <cstring>
#include <limits>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"

#include "common/base/status_macros.h"

namespace hmoe::shm {
namespace {

constexpr uint32_t kManifestMagic = 0x4d464d48;  // "HMFM"
constexpr uint8_t kMaxDType = static_cast<uint8_t>(DType::kQ6_K);

class Writer {
 public:
  void U8(uint8_t v) { out_.push_back(static_cast<char>(v)); }
  void U32(uint32_t v) { Raw(&v, 4); }
  void I32(int32_t v) { Raw(&v, 4); }
  void U64(uint64_t v) { Raw(&v, 8); }
  void I64(int64_t v) { Raw(&v, 8); }
  void Str(std::string_view s) {
    U64(s.size());
    out_.append(s.data(), s.size());
  }
  void Shape(const std::vector<int64_t>& shape) {
    U32(static_cast<uint32_t>(shape.size()));
    for (int64_t d : shape) I64(d);
  }
  std::string Take() { return std::move(out_); }

 private:
  void Raw(const void* p, size_t n) { out_.append(static_cast<const char*>(p), n); }  // LE host.
  std::string out_;
};

class Reader {
 public:
  explicit Reader(std::span<const std::byte> bytes) : bytes_(bytes) {}

  absl::Status U8(uint8_t& v, const char* what) { return Raw(&v, 1, what); }
  absl::Status U32(uint32_t& v, const char* what) { return Raw(&v, 4, what); }
  absl::Status I32(int32_t& v, const char* what) { return Raw(&v, 4, what); }
  absl::Status U64(uint64_t& v, const char* what) { return Raw(&v, 8, what); }
  absl::Status I64(int64_t& v, const char* what) { return Raw(&v, 8, what); }
  absl::Status Str(std::string& s, const char* what) {
    uint64_t n = 0;
    HMOE_RETURN_IF_ERROR(U64(n, what));
    if (n > remaining()) return Truncated(what);
    s.assign(reinterpret_cast<const char*>(bytes_.data() + pos_), n);
    pos_ += n;
    return absl::OkStatus();
  }
  absl::Status Shape(std::vector<int64_t>& shape, const char* what) {
    uint32_t rank = 0;
    HMOE_RETURN_IF_ERROR(U32(rank, what));
    if (rank > 8) return absl::DataLossError(absl::StrCat("manifest: ", what, " has rank ", rank));
    shape.resize(rank);
    for (int64_t& d : shape) {
      HMOE_RETURN_IF_ERROR(I64(d, what));
      if (d < 0) return absl::DataLossError(absl::StrCat("manifest: ", what, " is negative"));
    }
    return absl::OkStatus();
  }
  // A count of items of at least `min_item_bytes` each must fit the remaining bytes.
  absl::Status Count(uint32_t& n, size_t min_item_bytes, const char* what) {
    HMOE_RETURN_IF_ERROR(U32(n, what));
    if (static_cast<uint64_t>(n) * min_item_bytes > remaining()) return Truncated(what);
    return absl::OkStatus();
  }
  size_t remaining() const { return bytes_.size() - pos_; }

 private:
  absl::Status Raw(void* p, size_t n, const char* what) {
    if (n > remaining()) return Truncated(what);
    std::memcpy(p, bytes_.data() + pos_, n);
    pos_ += n;
    return absl::OkStatus();
  }
  absl::Status Truncated(const char* what) const {
    return absl::DataLossError(
        absl::StrCat("manifest: truncated at byte ", pos_, " while reading ", what));
  }

  std::span<const std::byte> bytes_;
  size_t pos_ = 0;
};

// The bytes of `shape` in `dtype` (whole blocks for a block type); false on overflow.
bool ShapeBytes(const std::vector<int64_t>& shape, DType dtype, uint64_t& out) {
  return TensorBytes(dtype, shape, &out);
}

absl::Status CheckRange(const Manifest& m, uint32_t segment, uint64_t offset, uint64_t size,
                        const std::string& what) {
  if (segment >= m.segments.size()) {
    return absl::DataLossError(absl::StrCat("manifest: ", what, " refers to segment ", segment,
                                            " of ", m.segments.size()));
  }
  const uint64_t used = m.segments[segment].used_bytes;
  if (offset > used || size > used - offset) {
    return absl::DataLossError(absl::StrCat("manifest: ", what, " [", offset, ", +", size,
                                            ") exceeds segment ", segment, " (", used, " bytes)"));
  }
  return absl::OkStatus();
}

absl::Status Validate(const Manifest& m) {
  for (size_t i = 0; i < m.segments.size(); ++i) {
    if (m.segments[i].index != i) {
      return absl::DataLossError(
          absl::StrCat("manifest: segment ", i, " has index ", m.segments[i].index));
    }
  }
  for (size_t i = 0; i < m.tensors.size(); ++i) {
    const TensorEntry& t = m.tensors[i];
    if (i > 0 && !(m.tensors[i - 1].name < t.name)) {
      return absl::DataLossError(
          absl::StrCat("manifest: tensor names not sorted and unique at \"", t.name, "\""));
    }
    uint64_t bytes = 0;
    if (!ShapeBytes(t.shape, t.dtype, bytes) || bytes != t.size_bytes) {
      return absl::DataLossError(absl::StrCat("manifest: tensor \"", t.name, "\" size ",
                                              t.size_bytes, " does not match its shape"));
    }
    if (t.contiguous)
      HMOE_RETURN_IF_ERROR(CheckRange(m, t.segment, t.offset, t.size_bytes, t.name));
    if (t.parts.empty()) {
      return absl::DataLossError(absl::StrCat("manifest: tensor \"", t.name, "\" has no parts"));
    }
    for (const TensorPart& p : t.parts) {
      const std::string what = absl::StrCat(t.name, " part ", p.slice);
      uint64_t part_bytes = 0;
      if (!ShapeBytes(p.shape, t.dtype, part_bytes) || part_bytes != p.size_bytes ||
          p.shape.size() != t.shape.size()) {
        return absl::DataLossError(absl::StrCat("manifest: ", what, " shape does not match size"));
      }
      if (p.split_dim >= static_cast<int32_t>(t.shape.size()) || p.split_dim < -1 ||
          (p.split_dim >= 0 && (p.begin < 0 || p.begin > p.end || p.end > t.shape[p.split_dim] ||
                                p.shape[p.split_dim] != p.end - p.begin))) {
        return absl::DataLossError(absl::StrCat("manifest: ", what, " has a bad split range"));
      }
      HMOE_RETURN_IF_ERROR(CheckRange(m, p.segment, p.offset, p.size_bytes, what));
    }
  }
  return absl::OkStatus();
}

}  // namespace

const char* DensePolicyName(DensePolicy p) {
  return p == DensePolicy::kReplicate ? "replicate" : "interleave";
}

absl::StatusOr<DensePolicy> ParseDensePolicy(std::string_view s) {
  if (s == "interleave") return DensePolicy::kInterleave;
  if (s == "replicate") return DensePolicy::kReplicate;
  return absl::InvalidArgumentError(
      absl::StrCat("dense policy \"", std::string(s), "\": expected interleave or replicate"));
}

const char* SegmentRoleName(SegmentRole r) {
  switch (r) {
    case SegmentRole::kDense:
      return "dense";
    case SegmentRole::kDenseReplica:
      return "dense-replica";
    case SegmentRole::kExpertSlice:
      return "expert-slice";
  }
  return "unknown";
}

const char* PlacementName(Placement p) {
  switch (p) {
    case Placement::kDense:
      return "dense";
    case Placement::kReplicated:
      return "replicated";
    case Placement::kSliced:
      return "sliced";
  }
  return "unknown";
}

std::string Manifest::Serialize() const {
  Writer w;
  w.U32(kManifestMagic);
  w.U32(kFormatVersion);
  w.U64(identity.hi);
  w.U64(identity.lo);
  w.U64(generation);
  w.Str(model_dir);
  w.Str(config_json);
  w.U32(num_slices);
  w.U8(static_cast<uint8_t>(dense_policy));
  w.U64(total_tensor_bytes);
  w.U32(static_cast<uint32_t>(segments.size()));
  for (const SegmentLayout& s : segments) {
    w.U32(s.index);
    w.U8(static_cast<uint8_t>(s.role));
    w.I32(s.slice);
    w.I32(s.numa_node);
    w.U64(s.used_bytes);
  }
  w.U32(static_cast<uint32_t>(tensors.size()));
  for (const TensorEntry& t : tensors) {
    w.Str(t.name);
    w.U8(static_cast<uint8_t>(t.dtype));
    w.Shape(t.shape);
    w.U64(t.size_bytes);
    w.U8(static_cast<uint8_t>(t.placement));
    w.U8(t.contiguous ? 1 : 0);
    w.U32(t.segment);
    w.U64(t.offset);
    w.Str(t.scale_name);
    w.U32(static_cast<uint32_t>(t.parts.size()));
    for (const TensorPart& p : t.parts) {
      w.U32(p.slice);
      w.I32(p.numa_node);
      w.U32(p.segment);
      w.U64(p.offset);
      w.U64(p.size_bytes);
      w.Shape(p.shape);
      w.I32(p.split_dim);
      w.I64(p.begin);
      w.I64(p.end);
    }
  }
  return w.Take();
}

absl::StatusOr<Manifest> Manifest::Parse(std::span<const std::byte> bytes) {
  Reader r(bytes);
  Manifest m;
  uint32_t magic = 0, version = 0;
  HMOE_RETURN_IF_ERROR(r.U32(magic, "magic"));
  if (magic != kManifestMagic) return absl::DataLossError("manifest: bad magic");
  HMOE_RETURN_IF_ERROR(r.U32(version, "version"));
  if (version != kFormatVersion) {
    return absl::DataLossError(
        absl::StrCat("manifest: format version ", version, ", this build reads ", kFormatVersion));
  }
  HMOE_RETURN_IF_ERROR(r.U64(m.identity.hi, "identity"));
  HMOE_RETURN_IF_ERROR(r.U64(m.identity.lo, "identity"));
  HMOE_RETURN_IF_ERROR(r.U64(m.generation, "generation"));
  HMOE_RETURN_IF_ERROR(r.Str(m.model_dir, "model_dir"));
  HMOE_RETURN_IF_ERROR(r.Str(m.config_json, "config_json"));
  HMOE_RETURN_IF_ERROR(r.U32(m.num_slices, "num_slices"));
  uint8_t u8 = 0;
  HMOE_RETURN_IF_ERROR(r.U8(u8, "dense_policy"));
  if (u8 > 1) return absl::DataLossError("manifest: bad dense_policy");
  m.dense_policy = static_cast<DensePolicy>(u8);
  HMOE_RETURN_IF_ERROR(r.U64(m.total_tensor_bytes, "total_tensor_bytes"));
  uint32_t n = 0;
  HMOE_RETURN_IF_ERROR(r.Count(n, 21, "segment count"));
  m.segments.resize(n);
  for (SegmentLayout& s : m.segments) {
    HMOE_RETURN_IF_ERROR(r.U32(s.index, "segment index"));
    HMOE_RETURN_IF_ERROR(r.U8(u8, "segment role"));
    if (u8 > 2) return absl::DataLossError("manifest: bad segment role");
    s.role = static_cast<SegmentRole>(u8);
    HMOE_RETURN_IF_ERROR(r.I32(s.slice, "segment slice"));
    HMOE_RETURN_IF_ERROR(r.I32(s.numa_node, "segment node"));
    HMOE_RETURN_IF_ERROR(r.U64(s.used_bytes, "segment size"));
  }
  HMOE_RETURN_IF_ERROR(r.Count(n, 40, "tensor count"));
  m.tensors.resize(n);
  for (TensorEntry& t : m.tensors) {
    HMOE_RETURN_IF_ERROR(r.Str(t.name, "tensor name"));
    HMOE_RETURN_IF_ERROR(r.U8(u8, "tensor dtype"));
    if (u8 > kMaxDType) return absl::DataLossError("manifest: bad dtype of " + t.name);
    t.dtype = static_cast<DType>(u8);
    HMOE_RETURN_IF_ERROR(r.Shape(t.shape, "tensor shape"));
    HMOE_RETURN_IF_ERROR(r.U64(t.size_bytes, "tensor size"));
    HMOE_RETURN_IF_ERROR(r.U8(u8, "tensor placement"));
    if (u8 > 2) return absl::DataLossError("manifest: bad placement of " + t.name);
    t.placement = static_cast<Placement>(u8);
    HMOE_RETURN_IF_ERROR(r.U8(u8, "tensor contiguous"));
    t.contiguous = u8 != 0;
    HMOE_RETURN_IF_ERROR(r.U32(t.segment, "tensor segment"));
    HMOE_RETURN_IF_ERROR(r.U64(t.offset, "tensor offset"));
    HMOE_RETURN_IF_ERROR(r.Str(t.scale_name, "tensor scale name"));
    uint32_t num_parts = 0;
    HMOE_RETURN_IF_ERROR(r.Count(num_parts, 48, "part count"));
    t.parts.resize(num_parts);
    for (TensorPart& p : t.parts) {
      HMOE_RETURN_IF_ERROR(r.U32(p.slice, "part slice"));
      HMOE_RETURN_IF_ERROR(r.I32(p.numa_node, "part node"));
      HMOE_RETURN_IF_ERROR(r.U32(p.segment, "part segment"));
      HMOE_RETURN_IF_ERROR(r.U64(p.offset, "part offset"));
      HMOE_RETURN_IF_ERROR(r.U64(p.size_bytes, "part size"));
      HMOE_RETURN_IF_ERROR(r.Shape(p.shape, "part shape"));
      HMOE_RETURN_IF_ERROR(r.I32(p.split_dim, "part split_dim"));
      HMOE_RETURN_IF_ERROR(r.I64(p.begin, "part begin"));
      HMOE_RETURN_IF_ERROR(r.I64(p.end, "part end"));
    }
  }
  if (r.remaining() != 0) {
    return absl::DataLossError(absl::StrCat("manifest: ", r.remaining(), " trailing bytes"));
  }
  HMOE_RETURN_IF_ERROR(Validate(m));
  return m;
}

const TensorEntry* Manifest::Find(std::string_view name) const {
  auto it = std::lower_bound(tensors.begin(), tensors.end(), name,
                             [](const TensorEntry& t, std::string_view n) { return t.name < n; });
  if (it == tensors.end() || it->name != name) return nullptr;
  return &*it;
}

}  // namespace hmoe::shm
