#include "common/model/gguf_source.h"

#include <utility>

#include "absl/strings/str_cat.h"

#include "common/base/status_macros.h"
#include "common/model/gguf_model.h"
#include "common/model/tensor_map.h"

namespace hmoe {

bool IsGgufPath(std::string_view path) { return path.ends_with(".gguf"); }

absl::StatusOr<std::unique_ptr<GgufCheckpoint>> GgufCheckpoint::Open(const std::string& path) {
  std::unique_ptr<GgufCheckpoint> c(new GgufCheckpoint());
  c->path_ = path;
  HMOE_ASSIGN_OR_RETURN(c->model_, GgufModel::Open(path));
  const GgufModel& m = *c->model_;
  absl::StatusOr<ModelConfig> config = ModelConfigFromGguf(m);
  if (!config.ok()) return Annotate(config.status(), path);
  c->config_ = *std::move(config);
  c->config_json_ = c->config_.ToJson();
  if (absl::Status s = ValidateGgufTensors(c->config_, m); !s.ok()) return Annotate(s, path);
  HMOE_ASSIGN_OR_RETURN(const bool split_kv_b, GgufUsesSplitKvB(m));
  for (const ExpectedTensor& t : ExpectedTensors(c->config_)) {
    Entry e;
    e.view.name = t.name;
    e.view.shape = t.shape;
    if (t.name.ends_with(layer_tensor::kKvBProj)) {
      HMOE_ASSIGN_OR_RETURN(std::vector<float> values, DequantizeHfTensor(c->config_, m, t.name));
      e.view.dtype = DType::kF32;
      e.view.data = reinterpret_cast<const std::byte*>(values.data());
      e.view.size_bytes = values.size() * sizeof(float);
      e.location.memory = e.view.data;
      c->owned_.push_back(std::move(values));
      c->entries_.emplace(t.name, std::move(e));
      continue;
    }
    HMOE_ASSIGN_OR_RETURN(const GgufTensorRef ref, GgufNameForHf(t.name, split_kv_b));
    const GgufTensorInfo* info = m.FindTensor(ref.gguf_name);
    if (info == nullptr) {
      return absl::InvalidArgumentError(
          absl::StrCat(path, ": missing tensor ", ref.gguf_name, " (", t.name, ")"));
    }
    absl::StatusOr<DType> dtype = DTypeOfGgmlTypeId(info->type);
    if (!dtype.ok()) {
      return absl::InvalidArgumentError(
          absl::StrCat(path, ": tensor ", info->name, ": ", dtype.status().message()));
    }
    e.view.dtype = *dtype;
    uint64_t bytes = 0;
    if (!TensorBytes(e.view.dtype, t.shape, &bytes)) {
      return absl::InvalidArgumentError(absl::StrCat(path, ": tensor ", info->name,
                                                     " has rows that are not whole blocks of ",
                                                     GgmlTypeName(info->type)));
    }
    uint64_t offset = 0;
    if (ref.expert >= 0) {
      if (info->ne.size() != 3 || ref.expert >= info->ne[2]) {
        return absl::InvalidArgumentError(
            absl::StrCat(path, ": tensor ", info->name, " has no expert ", ref.expert));
      }
      offset = bytes * static_cast<uint64_t>(ref.expert);
    }
    if (offset + bytes > info->size_bytes) {
      return absl::InvalidArgumentError(absl::StrCat(path, ": tensor ", info->name, " has ",
                                                     info->size_bytes, " bytes, ", t.name,
                                                     " needs ", offset + bytes));
    }
    e.view.data = info->data + offset;
    e.view.size_bytes = bytes;
    e.location.file = info->file_index;
    e.location.file_offset = m.file(info->file_index).data_offset() + info->offset + offset;
    c->entries_.emplace(t.name, std::move(e));
  }
  return c;
}

absl::StatusOr<TensorView> GgufCheckpoint::GetTensor(const std::string& name) const {
  auto it = entries_.find(name);
  if (it == entries_.end()) {
    return absl::NotFoundError(absl::StrCat("GGUF model ", path_, " has no tensor \"", name, "\""));
  }
  return it->second.view;
}

std::vector<std::string> GgufCheckpoint::TensorNames() const {
  std::vector<std::string> names;
  names.reserve(entries_.size());
  for (const auto& [name, e] : entries_) names.push_back(name);
  return names;
}

size_t GgufCheckpoint::total_tensor_bytes() const {
  size_t total = 0;
  for (const auto& [name, e] : entries_) total += e.view.size_bytes;
  return total;
}

absl::StatusOr<GgufCheckpoint::Location> GgufCheckpoint::Locate(const std::string& name) const {
  auto it = entries_.find(name);
  if (it == entries_.end()) {
    return absl::NotFoundError(absl::StrCat("GGUF model ", path_, " has no tensor \"", name, "\""));
  }
  return it->second.location;
}

}  // namespace hmoe
