#include "common/shm/weight_store.h"

#include <unistd.h>

#include <cstring>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"

#include "common/base/status_macros.h"

namespace hmoe::shm {

absl::Status AssembleFromParts(const TensorEntry& entry, const std::vector<TensorPartView>& parts,
                               std::span<std::byte> out) {
  if (out.size() != entry.size_bytes) {
    return absl::InvalidArgumentError(absl::StrCat("assemble ", entry.name, ": output has ",
                                                   out.size(), " bytes, need ", entry.size_bytes));
  }
  if (parts.empty()) return absl::InvalidArgumentError("assemble " + entry.name + ": no parts");
  if (parts[0].part.split_dim < 0) {
    if (parts[0].view.size_bytes != out.size()) {
      return absl::InvalidArgumentError("assemble " + entry.name + ": part size mismatch");
    }
    if (!out.empty()) std::memcpy(out.data(), parts[0].view.data, out.size());
    return absl::OkStatus();
  }
  const size_t esize = DTypeSize(entry.dtype);
  const int dim = parts[0].part.split_dim;
  if (entry.shape.size() != 2 || dim > 1) {
    return absl::InvalidArgumentError("assemble " + entry.name + ": only 2-D splits are supported");
  }
  const int64_t rows = entry.shape[0];
  const int64_t cols = entry.shape[1];
  int64_t covered = 0;
  for (const TensorPartView& pv : parts) {
    const TensorPart& p = pv.part;
    if (p.split_dim != dim || p.begin != covered || p.end < p.begin ||
        pv.view.size_bytes != p.size_bytes) {
      return absl::InvalidArgumentError(absl::StrCat("assemble ", entry.name, ": part ", p.slice,
                                                     " does not continue at ", covered));
    }
    const int64_t width = p.end - p.begin;
    if (dim == 0) {
      if (p.size_bytes != static_cast<uint64_t>(width * cols) * esize) {
        return absl::InvalidArgumentError("assemble " + entry.name + ": row part size mismatch");
      }
      if (p.size_bytes > 0) {
        std::memcpy(out.data() + static_cast<size_t>(p.begin * cols) * esize, pv.view.data,
                    p.size_bytes);
      }
    } else {
      if (p.size_bytes != static_cast<uint64_t>(width * rows) * esize) {
        return absl::InvalidArgumentError("assemble " + entry.name + ": column part size mismatch");
      }
      const size_t piece = static_cast<size_t>(width) * esize;
      for (int64_t r = 0; r < rows && piece > 0; ++r) {
        std::memcpy(out.data() + (static_cast<size_t>(r * cols + p.begin)) * esize,
                    pv.view.data + static_cast<size_t>(r) * piece, piece);
      }
    }
    covered = p.end;
  }
  if (covered != entry.shape[dim]) {
    return absl::InvalidArgumentError(
        absl::StrCat("assemble ", entry.name, ": parts cover ", covered, " of ", entry.shape[dim]));
  }
  return absl::OkStatus();
}

WeightStore::WeightStore(std::string instance, ControlSegment control, Manifest manifest,
                         std::vector<DataSegment> mappings)
    : instance_(std::move(instance)),
      control_(std::move(control)),
      manifest_(std::move(manifest)),
      mappings_(std::move(mappings)) {
  const ControlHeader& h = control_.header();
  for (size_t i = 0; i < mappings_.size(); ++i) {
    Segment s;
    s.layout = manifest_.segments[i];
    s.handle = HandleOf(h.segments[i]);
    s.backing = static_cast<PageBacking>(h.segments[i].backing);
    s.bytes = mappings_[i].bytes();
    segments_.push_back(s);
  }
}

WeightStore::~WeightStore() = default;

absl::StatusOr<std::unique_ptr<WeightStore>> WeightStore::Attach(std::string_view instance,
                                                                 const AttachOptions& options) {
  HMOE_ASSIGN_OR_RETURN(ControlSegment control, ControlSegment::OpenReadOnly(instance));
  HMOE_ASSIGN_OR_RETURN(Manifest manifest, control.ReadManifest());
  const ControlHeader& h = control.header();
  if (options.expected_identity.has_value() && *options.expected_identity != manifest.identity) {
    return absl::FailedPreconditionError(absl::StrCat(
        "weight store \"", std::string(instance), "\" holds model ", manifest.identity.ToString(),
        ", expected ", options.expected_identity->ToString()));
  }
  if (h.num_segments != manifest.segments.size()) {
    return absl::DataLossError(
        absl::StrCat("weight store \"", std::string(instance), "\": ", h.num_segments,
                     " segments recorded, manifest has ", manifest.segments.size()));
  }
  std::vector<DataSegment> mappings;
  for (uint32_t i = 0; i < h.num_segments; ++i) {
    const SegmentSlot& slot = h.segments[i];
    const SegmentHandle handle = HandleOf(slot);
    const std::string what = absl::StrCat("weight store \"", std::string(instance), "\" segment ",
                                          i, " (", handle.ToString(), ")");
    absl::StatusOr<DataSegment::Stat> st = DataSegment::StatSegment(handle);
    if (!st.ok()) return Annotate(st.status(), what);
    if (st->uid != ::geteuid()) {
      return absl::PermissionDeniedError(
          absl::StrCat(what, " belongs to uid ", st->uid, ", not to us (uid ", ::geteuid(), ")"));
    }
    if (st->mode != 0400) {
      return absl::FailedPreconditionError(
          absl::StrFormat("%s has mode %04o: not sealed (expected 0400)", what, st->mode));
    }
    if (st->instance_id != slot.instance_id) {
      return absl::DataLossError(
          absl::StrCat(what, " is not the segment the control segment records (it was replaced)"));
    }
    if (manifest.segments[i].used_bytes > slot.size_bytes) {
      return absl::DataLossError(absl::StrCat(what, " is smaller than its manifest layout"));
    }
    absl::StatusOr<DataSegment> seg = DataSegment::AttachReadOnly(
        handle, slot.size_bytes, static_cast<PageBacking>(slot.backing));
    if (!seg.ok()) return Annotate(seg.status(), what);
    // The mapped object must be the one we checked (a rename race would show a new inode).
    if (seg->instance_id() != slot.instance_id) {
      return absl::DataLossError(absl::StrCat(what, " was replaced while attaching"));
    }
    mappings.push_back(*std::move(seg));
  }
  return std::unique_ptr<WeightStore>(new WeightStore(std::string(instance), std::move(control),
                                                      std::move(manifest), std::move(mappings)));
}

TensorView WeightStore::ViewAt(const TensorEntry& t, uint32_t segment, uint64_t offset,
                               const std::vector<int64_t>& shape, uint64_t size_bytes) const {
  TensorView v;
  v.name = t.name;
  v.dtype = t.dtype;
  v.shape = shape;
  v.data = segments_[segment].bytes.data() + offset;
  v.size_bytes = size_bytes;
  return v;
}

absl::StatusOr<TensorView> WeightStore::GetTensor(const std::string& name) const {
  const TensorEntry* t = manifest_.Find(name);
  if (t == nullptr) {
    return absl::NotFoundError(
        absl::StrCat("tensor \"", name, "\" not in weight store \"", instance_, "\""));
  }
  if (t->contiguous) return ViewAt(*t, t->segment, t->offset, t->shape, t->size_bytes);

  absl::MutexLock lock(&assembled_mu_);
  auto it = assembled_.find(name);
  if (it == assembled_.end()) {
    HMOE_ASSIGN_OR_RETURN(std::vector<TensorPartView> parts, GetParts(name));
    auto buffer = std::make_unique<std::vector<std::byte>>(t->size_bytes);
    HMOE_RETURN_IF_ERROR(AssembleFromParts(*t, parts, *buffer));
    it = assembled_.emplace(name, std::move(buffer)).first;
  }
  TensorView v;
  v.name = t->name;
  v.dtype = t->dtype;
  v.shape = t->shape;
  v.data = it->second->data();
  v.size_bytes = t->size_bytes;
  return v;
}

std::vector<std::string> WeightStore::TensorNames() const {
  std::vector<std::string> names;
  names.reserve(manifest_.tensors.size());
  for (const TensorEntry& t : manifest_.tensors) names.push_back(t.name);
  return names;
}

absl::StatusOr<std::vector<TensorPartView>> WeightStore::GetParts(const std::string& name) const {
  const TensorEntry* t = manifest_.Find(name);
  if (t == nullptr) {
    return absl::NotFoundError(
        absl::StrCat("tensor \"", name, "\" not in weight store \"", instance_, "\""));
  }
  std::vector<TensorPartView> parts;
  parts.reserve(t->parts.size());
  for (const TensorPart& p : t->parts) {
    parts.push_back(TensorPartView{p, ViewAt(*t, p.segment, p.offset, p.shape, p.size_bytes)});
  }
  return parts;
}

}  // namespace hmoe::shm
