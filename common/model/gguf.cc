#include "common/model/gguf.h"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <limits>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"

#include "common/base/status_macros.h"

namespace hmoe {
namespace {

constexpr int kMaxDims = 4;        // GGML_MAX_DIMS
constexpr int kMaxArrayDepth = 8;  // nested arrays
constexpr uint64_t kMaxStringBytes = uint64_t{1} << 30;
// Metadata values in a file, arrays' elements included (a real DeepSeek/Kimi file has ~0.5 M:
// tokens, token types and merges); bounds the memory a hostile file can make us allocate.
constexpr uint64_t kMaxMetadataValues = uint64_t{1} << 23;

absl::string_view Av(std::string_view s) { return absl::string_view(s.data(), s.size()); }

// Bounds-checked little-endian cursor over the file bytes.
class Cursor {
 public:
  Cursor(std::span<const std::byte> bytes, const std::string& name) : b_(bytes), name_(name) {}
  uint64_t pos() const { return pos_; }
  // Counts `n` more metadata values; false beyond kMaxMetadataValues.
  bool CountValues(uint64_t n) {
    values_ += n;
    return values_ <= kMaxMetadataValues;
  }
  uint64_t remaining() const { return b_.size() - pos_; }

  absl::Status Error(std::string_view what) const {
    return absl::InvalidArgumentError(
        absl::StrCat(name_, ": ", Av(what), " (at byte ", pos_, " of ", b_.size(), ")"));
  }
  template <typename T>
  absl::Status Read(T* v, std::string_view what) {
    if (remaining() < sizeof(T)) {
      return Error(absl::StrCat("truncated file: cannot read ", Av(what)));
    }
    std::memcpy(v, b_.data() + pos_, sizeof(T));
    pos_ += sizeof(T);
    return absl::OkStatus();
  }
  absl::Status ReadString(std::string* s, std::string_view what) {
    uint64_t n = 0;
    HMOE_RETURN_IF_ERROR(Read(&n, what));
    if (n > remaining() || n > kMaxStringBytes) {
      return Error(absl::StrCat("truncated file: ", Av(what), " claims ", n, " bytes"));
    }
    s->assign(reinterpret_cast<const char*>(b_.data() + pos_), n);
    pos_ += n;
    return absl::OkStatus();
  }

 private:
  std::span<const std::byte> b_;
  const std::string& name_;
  uint64_t pos_ = 0;
  uint64_t values_ = 0;
};

bool ValidValueType(uint32_t t) { return t <= static_cast<uint32_t>(GgufValueType::kF64); }

// Smallest encoded size of one value of type `t` (arrays: type + count).
uint64_t MinValueBytes(GgufValueType t) {
  switch (t) {
    case GgufValueType::kU8:
    case GgufValueType::kI8:
    case GgufValueType::kBool:
      return 1;
    case GgufValueType::kU16:
    case GgufValueType::kI16:
      return 2;
    case GgufValueType::kU32:
    case GgufValueType::kI32:
    case GgufValueType::kF32:
      return 4;
    case GgufValueType::kString:
    case GgufValueType::kU64:
    case GgufValueType::kI64:
    case GgufValueType::kF64:
      return 8;
    case GgufValueType::kArray:
      return 12;
  }
  return 1;
}

absl::Status ReadValue(Cursor* c, GgufValueType type, const std::string& key, int depth,
                       GgufValue* v) {
  v->type = type;
  switch (type) {
    case GgufValueType::kU8: {
      uint8_t x = 0;
      HMOE_RETURN_IF_ERROR(c->Read(&x, key));
      v->u = x;
      break;
    }
    case GgufValueType::kI8: {
      int8_t x = 0;
      HMOE_RETURN_IF_ERROR(c->Read(&x, key));
      v->i = x;
      break;
    }
    case GgufValueType::kU16: {
      uint16_t x = 0;
      HMOE_RETURN_IF_ERROR(c->Read(&x, key));
      v->u = x;
      break;
    }
    case GgufValueType::kI16: {
      int16_t x = 0;
      HMOE_RETURN_IF_ERROR(c->Read(&x, key));
      v->i = x;
      break;
    }
    case GgufValueType::kU32: {
      uint32_t x = 0;
      HMOE_RETURN_IF_ERROR(c->Read(&x, key));
      v->u = x;
      break;
    }
    case GgufValueType::kI32: {
      int32_t x = 0;
      HMOE_RETURN_IF_ERROR(c->Read(&x, key));
      v->i = x;
      break;
    }
    case GgufValueType::kF32: {
      float x = 0;
      HMOE_RETURN_IF_ERROR(c->Read(&x, key));
      v->f = x;
      break;
    }
    case GgufValueType::kBool: {
      uint8_t x = 0;
      HMOE_RETURN_IF_ERROR(c->Read(&x, key));
      if (x > 1) return c->Error(absl::StrCat("key ", key, ": bool value ", x, " is not 0 or 1"));
      v->u = x;
      break;
    }
    case GgufValueType::kString:
      HMOE_RETURN_IF_ERROR(c->ReadString(&v->str, key));
      break;
    case GgufValueType::kU64:
      HMOE_RETURN_IF_ERROR(c->Read(&v->u, key));
      break;
    case GgufValueType::kI64:
      HMOE_RETURN_IF_ERROR(c->Read(&v->i, key));
      break;
    case GgufValueType::kF64:
      HMOE_RETURN_IF_ERROR(c->Read(&v->f, key));
      break;
    case GgufValueType::kArray: {
      if (depth >= kMaxArrayDepth) {
        return c->Error(absl::StrCat("key ", key, ": arrays nested deeper than ", kMaxArrayDepth));
      }
      uint32_t et = 0;
      uint64_t n = 0;
      HMOE_RETURN_IF_ERROR(c->Read(&et, key));
      if (!ValidValueType(et)) {
        return c->Error(absl::StrCat("key ", key, ": unknown array element type ", et));
      }
      HMOE_RETURN_IF_ERROR(c->Read(&n, key));
      v->array_type = static_cast<GgufValueType>(et);
      if (n > c->remaining() / MinValueBytes(v->array_type)) {
        return c->Error(
            absl::StrCat("truncated file: key ", key, ": array claims ", n, " elements"));
      }
      if (!c->CountValues(n)) {
        return c->Error(absl::StrCat("key ", key, ": more than ", kMaxMetadataValues,
                                     " metadata values in the file"));
      }
      v->array.resize(n);
      for (uint64_t k = 0; k < n; ++k) {
        HMOE_RETURN_IF_ERROR(ReadValue(c, v->array_type, key, depth + 1, &v->array[k]));
      }
      break;
    }
  }
  return absl::OkStatus();
}

}  // namespace

std::string_view GgufValueTypeName(GgufValueType t) {
  static constexpr std::string_view kNames[] = {"u8",  "i8",  "u16",  "i16",    "u32",
                                                "i32", "f32", "bool", "string", "array",
                                                "u64", "i64", "f64"};
  const auto i = static_cast<uint32_t>(t);
  return i < std::size(kNames) ? kNames[i] : "unknown";
}

GgufValue GgufValue::U16(uint16_t v) {
  GgufValue x;
  x.type = GgufValueType::kU16;
  x.u = v;
  return x;
}
GgufValue GgufValue::U32(uint32_t v) {
  GgufValue x;
  x.type = GgufValueType::kU32;
  x.u = v;
  return x;
}
GgufValue GgufValue::I32(int32_t v) {
  GgufValue x;
  x.type = GgufValueType::kI32;
  x.i = v;
  return x;
}
GgufValue GgufValue::U64(uint64_t v) {
  GgufValue x;
  x.type = GgufValueType::kU64;
  x.u = v;
  return x;
}
GgufValue GgufValue::F32(float v) {
  GgufValue x;
  x.type = GgufValueType::kF32;
  x.f = v;
  return x;
}
GgufValue GgufValue::Bool(bool v) {
  GgufValue x;
  x.type = GgufValueType::kBool;
  x.u = v ? 1 : 0;
  return x;
}
GgufValue GgufValue::String(std::string v) {
  GgufValue x;
  x.type = GgufValueType::kString;
  x.str = std::move(v);
  return x;
}
GgufValue GgufValue::Array(GgufValueType element_type, std::vector<GgufValue> elements) {
  GgufValue x;
  x.type = GgufValueType::kArray;
  x.array_type = element_type;
  x.array = std::move(elements);
  return x;
}

bool GgufValue::is_integer() const {
  switch (type) {
    case GgufValueType::kU8:
    case GgufValueType::kI8:
    case GgufValueType::kU16:
    case GgufValueType::kI16:
    case GgufValueType::kU32:
    case GgufValueType::kI32:
    case GgufValueType::kU64:
    case GgufValueType::kI64:
      return true;
    default:
      return false;
  }
}

std::optional<int64_t> GgufValue::AsInt() const {
  switch (type) {
    case GgufValueType::kU8:
    case GgufValueType::kU16:
    case GgufValueType::kU32:
    case GgufValueType::kU64:
      if (u > static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) return std::nullopt;
      return static_cast<int64_t>(u);
    case GgufValueType::kI8:
    case GgufValueType::kI16:
    case GgufValueType::kI32:
    case GgufValueType::kI64:
      return i;
    default:
      return std::nullopt;
  }
}

std::optional<double> GgufValue::AsDouble() const {
  if (is_float()) return f;
  if (std::optional<int64_t> v = AsInt()) return static_cast<double>(*v);
  return std::nullopt;
}

// ------------------------------------------------------------------------------------ GgufFile

absl::StatusOr<std::unique_ptr<GgufFile>> GgufFile::Open(const std::string& path) {
  HMOE_ASSIGN_OR_RETURN(MappedFile mapped, MappedFile::Open(path));
  const std::span<const std::byte> bytes = mapped.bytes();
  HMOE_ASSIGN_OR_RETURN(std::unique_ptr<GgufFile> file, Parse(bytes, path));
  file->mapping_.emplace(std::move(mapped));  // the mapping (and its addresses) move unchanged
  return file;
}

absl::StatusOr<std::unique_ptr<GgufFile>> GgufFile::Parse(std::span<const std::byte> bytes,
                                                          std::string name) {
  std::unique_ptr<GgufFile> f(new GgufFile());
  f->name_ = std::move(name);
  Cursor c(bytes, f->name_);
  uint32_t magic = 0;
  HMOE_RETURN_IF_ERROR(c.Read(&magic, "the magic"));
  if (magic != kGgufMagic) {
    return absl::InvalidArgumentError(
        absl::StrFormat("%s: not a GGUF file (magic 0x%08x, expected 0x%08x \"GGUF\")", f->name_,
                        magic, kGgufMagic));
  }
  HMOE_RETURN_IF_ERROR(c.Read(&f->version_, "the version"));
  if (f->version_ != kGgufVersion) {
    return absl::InvalidArgumentError(absl::StrCat(f->name_, ": GGUF version ", f->version_,
                                                   " is not supported (only version 3)"));
  }
  uint64_t tensor_count = 0, kv_count = 0;
  HMOE_RETURN_IF_ERROR(c.Read(&tensor_count, "the tensor count"));
  HMOE_RETURN_IF_ERROR(c.Read(&kv_count, "the metadata count"));
  // Each key/value takes at least 13 bytes, each tensor info at least 8 + 4 + 4 + 8.
  if (kv_count > c.remaining() / 13 || tensor_count > c.remaining() / 24) {
    return c.Error(absl::StrCat("truncated file: header claims ", kv_count,
                                " metadata entries and ", tensor_count, " tensors"));
  }
  f->metadata_.reserve(kv_count);
  for (uint64_t k = 0; k < kv_count; ++k) {
    std::string key;
    HMOE_RETURN_IF_ERROR(c.ReadString(&key, absl::StrCat("metadata key #", k)));
    uint32_t type = 0;
    HMOE_RETURN_IF_ERROR(c.Read(&type, key));
    if (!ValidValueType(type)) {
      return c.Error(absl::StrCat("key ", key, ": unknown value type ", type));
    }
    GgufValue value;
    HMOE_RETURN_IF_ERROR(ReadValue(&c, static_cast<GgufValueType>(type), key, 0, &value));
    if (!f->index_.emplace(key, f->metadata_.size()).second) {
      return c.Error(absl::StrCat("duplicate metadata key ", key));
    }
    f->metadata_.emplace_back(std::move(key), std::move(value));
  }
  if (const GgufValue* a = f->Find("general.alignment")) {
    if (a->type != GgufValueType::kU32 || a->u == 0 || (a->u & (a->u - 1)) != 0) {
      return absl::InvalidArgumentError(
          absl::StrCat(f->name_, ": general.alignment must be a u32 power of two"));
    }
    f->alignment_ = static_cast<uint32_t>(a->u);
  }
  std::map<std::string, size_t, std::less<>> tensor_index;
  f->tensors_.resize(tensor_count);
  for (uint64_t k = 0; k < tensor_count; ++k) {
    GgufTensorInfo& t = f->tensors_[k];
    HMOE_RETURN_IF_ERROR(c.ReadString(&t.name, absl::StrCat("tensor name #", k)));
    uint32_t n_dims = 0;
    HMOE_RETURN_IF_ERROR(c.Read(&n_dims, t.name));
    if (n_dims == 0 || n_dims > kMaxDims) {
      return c.Error(absl::StrCat("tensor ", t.name, " has ", n_dims, " dimensions (1..4)"));
    }
    t.ne.resize(n_dims);
    int64_t n = 1;
    for (uint32_t d = 0; d < n_dims; ++d) {
      uint64_t ne = 0;
      HMOE_RETURN_IF_ERROR(c.Read(&ne, t.name));
      if (ne == 0 || ne > (uint64_t{1} << 40) ||
          static_cast<uint64_t>(n) > (uint64_t{1} << 50) / ne) {
        return c.Error(absl::StrCat("tensor ", t.name, ": bad dimension ", d, " = ", ne));
      }
      t.ne[d] = static_cast<int64_t>(ne);
      n *= t.ne[d];
    }
    t.num_elements = n;
    HMOE_RETURN_IF_ERROR(c.Read(&t.type, t.name));
    const std::optional<GgmlTypeSize> ts = GgmlTypeSizeOf(t.type);
    if (!ts) {
      return c.Error(absl::StrCat("tensor ", t.name, " has unknown ggml type ", t.type));
    }
    if (t.ne[0] % ts->block_size != 0) {
      return c.Error(absl::StrCat("tensor ", t.name, ": row of ", t.ne[0], " elements is not a ",
                                  "whole number of ", GgmlTypeName(t.type), " blocks of ",
                                  ts->block_size));
    }
    t.size_bytes = static_cast<size_t>(n / ts->block_size) * static_cast<size_t>(ts->type_size);
    HMOE_RETURN_IF_ERROR(c.Read(&t.offset, t.name));
    if (t.offset % f->alignment_ != 0) {
      return c.Error(absl::StrCat("tensor ", t.name, ": offset ", t.offset,
                                  " is not a multiple of the alignment ", f->alignment_));
    }
    if (!tensor_index.emplace(t.name, k).second) {
      return c.Error(absl::StrCat("duplicate tensor ", t.name));
    }
  }
  const uint64_t align = f->alignment_;
  f->data_offset_ = (c.pos() + align - 1) / align * align;
  const uint64_t size = bytes.size();
  for (GgufTensorInfo& t : f->tensors_) {
    if (f->data_offset_ > size || t.offset > size - f->data_offset_ ||
        t.size_bytes > size - f->data_offset_ - t.offset) {
      return absl::InvalidArgumentError(
          absl::StrCat(f->name_, ": truncated file: tensor ", t.name, " (", t.size_bytes,
                       " bytes at data offset ", t.offset, ") ends beyond the end of the file (",
                       size, " bytes)"));
    }
    t.data = bytes.data() + f->data_offset_ + t.offset;
  }
  return f;
}

const GgufValue* GgufFile::Find(std::string_view key) const {
  const auto it = index_.find(key);
  return it == index_.end() ? nullptr : &metadata_[it->second].second;
}

// ------------------------------------------------------------------------------- split names

std::optional<GgufSplitName> ParseGgufSplitName(const std::string& path) {
  // <prefix>-NNNNN-of-NNNNN.gguf
  constexpr std::string_view kSuffix = ".gguf";
  constexpr size_t kTail = 1 + 5 + 4 + 5 + 5;  // "-00001-of-00003.gguf"
  if (path.size() <= kTail || !path.ends_with(kSuffix)) return std::nullopt;
  const std::string tail = path.substr(path.size() - kTail);
  auto digits = [&](size_t at, int* out) {
    int v = 0;
    for (size_t k = at; k < at + 5; ++k) {
      if (tail[k] < '0' || tail[k] > '9') return false;
      v = v * 10 + (tail[k] - '0');
    }
    *out = v;
    return true;
  };
  GgufSplitName s;
  if (tail[0] != '-' || tail.compare(6, 4, "-of-") != 0 || !digits(1, &s.part) ||
      !digits(10, &s.count) || s.part < 1 || s.count < 1 || s.part > s.count) {
    return std::nullopt;
  }
  s.prefix = path.substr(0, path.size() - kTail);
  return s;
}

std::string GgufSplitPath(const std::string& prefix, int part, int count) {
  return absl::StrFormat("%s-%05d-of-%05d.gguf", prefix, part, count);
}

// ----------------------------------------------------------------------------------- GgufModel

namespace {

absl::StatusOr<int64_t> SplitKey(const GgufFile& f, std::string_view key) {
  const GgufValue* v = f.Find(key);
  if (v == nullptr) {
    return absl::InvalidArgumentError(
        absl::StrCat(f.name(), ": split file lacks metadata key ", Av(key)));
  }
  std::optional<int64_t> i = v->AsInt();
  if (!i || *i < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat(f.name(), ": ", Av(key), " must be a non-negative integer"));
  }
  return *i;
}

}  // namespace

absl::StatusOr<std::unique_ptr<GgufModel>> GgufModel::Open(const std::string& path) {
  std::vector<std::unique_ptr<GgufFile>> files;
  const std::optional<GgufSplitName> split = ParseGgufSplitName(path);
  if (!split) {
    HMOE_ASSIGN_OR_RETURN(std::unique_ptr<GgufFile> f, GgufFile::Open(path));
    files.push_back(std::move(f));
  } else {
    for (int k = 1; k <= split->count; ++k) {
      const std::string part = GgufSplitPath(split->prefix, k, split->count);
      std::error_code ec;
      if (!std::filesystem::exists(part, ec)) {
        return absl::NotFoundError(
            absl::StrCat("split GGUF part ", k, " of ", split->count, " is missing: ", part));
      }
      HMOE_ASSIGN_OR_RETURN(std::unique_ptr<GgufFile> f, GgufFile::Open(part));
      files.push_back(std::move(f));
    }
  }
  return FromFiles(std::move(files));
}

absl::StatusOr<std::unique_ptr<GgufModel>> GgufModel::FromFiles(
    std::vector<std::unique_ptr<GgufFile>> files) {
  if (files.empty()) return absl::InvalidArgumentError("no GGUF files");
  std::unique_ptr<GgufModel> m(new GgufModel());
  const bool split = files.size() > 1 || files.front()->Find("split.count") != nullptr;
  if (split) {
    int64_t total_tensors = 0;
    for (size_t k = 0; k < files.size(); ++k) {
      const GgufFile& f = *files[k];
      HMOE_ASSIGN_OR_RETURN(const int64_t no, SplitKey(f, "split.no"));
      HMOE_ASSIGN_OR_RETURN(const int64_t count, SplitKey(f, "split.count"));
      HMOE_ASSIGN_OR_RETURN(const int64_t tensors, SplitKey(f, "split.tensors.count"));
      if (no != static_cast<int64_t>(k) || count != static_cast<int64_t>(files.size())) {
        return absl::InvalidArgumentError(
            absl::StrCat(f.name(), ": split.no ", no, " / split.count ", count, " but it is part ",
                         k + 1, " of ", files.size(), " (split.no counts from 0)"));
      }
      if (k == 0) total_tensors = tensors;
      if (tensors != total_tensors) {
        return absl::InvalidArgumentError(absl::StrCat(f.name(), ": split.tensors.count ", tensors,
                                                       " differs from the first part's ",
                                                       total_tensors));
      }
    }
    int64_t found = 0;
    for (const auto& f : files) found += static_cast<int64_t>(f->tensors().size());
    if (found != total_tensors) {
      return absl::InvalidArgumentError(
          absl::StrCat(files.front()->name(), ": split.tensors.count is ", total_tensors,
                       " but the ", files.size(), " parts hold ", found, " tensors"));
    }
  }
  m->files_ = std::move(files);
  for (size_t k = 0; k < m->files_.size(); ++k) {
    for (GgufTensorInfo& t : m->files_[k]->tensors_) t.file_index = static_cast<int>(k);
  }
  for (size_t k = 0; k < m->files_.size(); ++k) {
    for (const GgufTensorInfo& t : m->files_[k]->tensors()) {
      if (!m->tensors_.emplace(t.name, &t).second) {
        return absl::InvalidArgumentError(
            absl::StrCat(m->files_[k]->name(), ": tensor ", t.name, " also is in another part"));
      }
    }
  }
  return m;
}

const GgufTensorInfo* GgufModel::FindTensor(std::string_view name) const {
  const auto it = tensors_.find(name);
  return it == tensors_.end() ? nullptr : it->second;
}

std::vector<const GgufTensorInfo*> GgufModel::Tensors() const {
  std::vector<const GgufTensorInfo*> out;
  out.reserve(tensors_.size());
  for (const auto& [name, t] : tensors_) out.push_back(t);
  return out;
}

absl::StatusOr<std::vector<float>> GgufModel::Dequantize(std::string_view name) const {
  const GgufTensorInfo* t = FindTensor(name);
  if (t == nullptr) return absl::NotFoundError(absl::StrCat("GGUF has no tensor ", Av(name)));
  if (!GgmlTypeDequantizable(t->type)) {
    return absl::InvalidArgumentError(
        absl::StrCat("tensor ", t->name, " has type ", GgmlTypeName(t->type),
                     ", which is not supported (supported: F32, F16, BF16, Q8_0, Q5_0, Q4_K, "
                     "Q5_K, Q6_K)"));
  }
  std::vector<float> out(static_cast<size_t>(t->num_elements));
  HMOE_RETURN_IF_ERROR(DequantizeGgml(t->type, t->data, t->num_elements, out.data()));
  return out;
}

// ---------------------------------------------------------------------------------- GgufWriter

namespace {

void AppendRaw(std::string* out, const void* p, size_t n) {
  out->append(static_cast<const char*>(p), n);
}
template <typename T>
void AppendPod(std::string* out, T v) {
  AppendRaw(out, &v, sizeof(T));
}
void AppendString(std::string* out, std::string_view s) {
  AppendPod<uint64_t>(out, s.size());
  out->append(s);
}

void AppendValue(std::string* out, const GgufValue& v) {
  switch (v.type) {
    case GgufValueType::kU8:
      AppendPod<uint8_t>(out, static_cast<uint8_t>(v.u));
      break;
    case GgufValueType::kI8:
      AppendPod<int8_t>(out, static_cast<int8_t>(v.i));
      break;
    case GgufValueType::kU16:
      AppendPod<uint16_t>(out, static_cast<uint16_t>(v.u));
      break;
    case GgufValueType::kI16:
      AppendPod<int16_t>(out, static_cast<int16_t>(v.i));
      break;
    case GgufValueType::kU32:
      AppendPod<uint32_t>(out, static_cast<uint32_t>(v.u));
      break;
    case GgufValueType::kI32:
      AppendPod<int32_t>(out, static_cast<int32_t>(v.i));
      break;
    case GgufValueType::kF32:
      AppendPod<float>(out, static_cast<float>(v.f));
      break;
    case GgufValueType::kBool:
      AppendPod<uint8_t>(out, v.u != 0 ? 1 : 0);
      break;
    case GgufValueType::kString:
      AppendString(out, v.str);
      break;
    case GgufValueType::kU64:
      AppendPod<uint64_t>(out, v.u);
      break;
    case GgufValueType::kI64:
      AppendPod<int64_t>(out, v.i);
      break;
    case GgufValueType::kF64:
      AppendPod<double>(out, v.f);
      break;
    case GgufValueType::kArray:
      AppendPod<uint32_t>(out, static_cast<uint32_t>(v.array_type));
      AppendPod<uint64_t>(out, v.array.size());
      for (const GgufValue& e : v.array) AppendValue(out, e);
      break;
  }
}

}  // namespace

void GgufWriter::AddMetadata(std::string key, GgufValue value) {
  metadata_.emplace_back(std::move(key), std::move(value));
}

absl::Status GgufWriter::AddTensor(std::string name, std::vector<int64_t> ne, uint32_t type) {
  int64_t n = 1;
  for (int64_t d : ne) n *= d;
  if (ne.empty() || ne.size() > kMaxDims) {
    return absl::InvalidArgumentError(absl::StrCat("tensor ", name, ": 1 to 4 dimensions"));
  }
  const std::optional<GgmlTypeSize> ts = GgmlTypeSizeOf(type);
  if (!ts) return absl::InvalidArgumentError(absl::StrCat("unknown ggml type ", type));
  if (ne[0] % ts->block_size != 0) {
    return absl::InvalidArgumentError(absl::StrCat("tensor ", name, ": row of ", ne[0],
                                                   " is not a whole number of ", GgmlTypeName(type),
                                                   " blocks"));
  }
  size_t bytes = 0;
  HMOE_RETURN_IF_ERROR(GgmlBytes(type, n, &bytes));
  uint64_t offset = 0;
  if (!tensors_.empty()) {
    const Tensor& last = tensors_.back();
    offset = (last.offset + last.bytes + alignment_ - 1) / alignment_ * alignment_;
  }
  tensors_.push_back({std::move(name), std::move(ne), type, offset, bytes});
  return absl::OkStatus();
}

absl::Status GgufWriter::Write(const void* data, size_t n) {
  const char* p = static_cast<const char*>(data);
  while (n > 0) {
    const ssize_t w = ::write(fd_, p, n);
    if (w < 0) {
      if (errno == EINTR) continue;
      return absl::InternalError(absl::StrCat("write ", path_, ".tmp: ", std::strerror(errno)));
    }
    p += w;
    n -= static_cast<size_t>(w);
    position_ += static_cast<uint64_t>(w);
  }
  return absl::OkStatus();
}

absl::Status GgufWriter::Begin() {
  std::string header;
  AppendPod<uint32_t>(&header, kGgufMagic);
  AppendPod<uint32_t>(&header, kGgufVersion);
  AppendPod<uint64_t>(&header, tensors_.size());
  // general.alignment is written when it is not the default, unless the caller added the key
  // itself (its value is then written as given: tests write inconsistent files on purpose).
  const bool caller_alignment = std::any_of(metadata_.begin(), metadata_.end(), [](const auto& kv) {
    return kv.first == "general.alignment";
  });
  const bool write_alignment = alignment_ != kGgufDefaultAlignment && !caller_alignment;
  AppendPod<uint64_t>(&header, metadata_.size() + (write_alignment ? 1 : 0));
  for (const auto& [key, value] : metadata_) {
    AppendString(&header, key);
    AppendPod<uint32_t>(&header, static_cast<uint32_t>(value.type));
    AppendValue(&header, value);
  }
  if (write_alignment) {
    AppendString(&header, "general.alignment");
    AppendPod<uint32_t>(&header, static_cast<uint32_t>(GgufValueType::kU32));
    AppendPod<uint32_t>(&header, alignment_);
  }
  for (const Tensor& t : tensors_) {
    AppendString(&header, t.name);
    AppendPod<uint32_t>(&header, static_cast<uint32_t>(t.ne.size()));
    for (int64_t d : t.ne) AppendPod<uint64_t>(&header, static_cast<uint64_t>(d));
    AppendPod<uint32_t>(&header, t.type);
    AppendPod<uint64_t>(&header, t.offset);
  }
  header.resize((header.size() + alignment_ - 1) / alignment_ * alignment_, '\0');
  data_start_ = header.size();
  const std::string tmp = path_ + ".tmp";
  fd_ = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd_ < 0) return absl::InternalError(absl::StrCat("open ", tmp, ": ", std::strerror(errno)));
  position_ = 0;
  return Write(header.data(), header.size());
}

absl::Status GgufWriter::WriteTensorData(std::string_view name, std::span<const std::byte> bytes) {
  if (fd_ < 0) return absl::FailedPreconditionError("GgufWriter: Begin() was not called");
  while (current_ < tensors_.size() && current_written_ == tensors_[current_].bytes) {
    ++current_;
    current_written_ = 0;
  }
  if (current_ >= tensors_.size() || tensors_[current_].name != name) {
    return absl::FailedPreconditionError(
        absl::StrCat("GgufWriter: unexpected data for tensor ", Av(name)));
  }
  const Tensor& t = tensors_[current_];
  if (current_written_ + bytes.size() > t.bytes) {
    return absl::InvalidArgumentError(
        absl::StrCat("GgufWriter: too much data for tensor ", t.name));
  }
  if (current_written_ == 0) {  // pad up to the tensor's aligned offset
    const uint64_t target = data_start_ + t.offset;
    const std::string pad(target - position_, '\0');
    HMOE_RETURN_IF_ERROR(Write(pad.data(), pad.size()));
  }
  HMOE_RETURN_IF_ERROR(Write(bytes.data(), bytes.size()));
  current_written_ += bytes.size();
  return absl::OkStatus();
}

absl::Status GgufWriter::Finish() {
  if (fd_ < 0) return absl::FailedPreconditionError("GgufWriter: Begin() was not called");
  while (current_ < tensors_.size() && current_written_ == tensors_[current_].bytes) {
    ++current_;
    current_written_ = 0;
  }
  if (current_ < tensors_.size()) {
    return absl::FailedPreconditionError(
        absl::StrCat("GgufWriter: tensor ", tensors_[current_].name, " was not written"));
  }
  if (::fsync(fd_) != 0 || ::close(fd_) != 0) {
    fd_ = -1;
    return absl::InternalError(absl::StrCat("close ", path_, ".tmp: ", std::strerror(errno)));
  }
  fd_ = -1;
  if (::rename((path_ + ".tmp").c_str(), path_.c_str()) != 0) {
    return absl::InternalError(absl::StrCat("rename to ", path_, ": ", std::strerror(errno)));
  }
  return absl::OkStatus();
}

GgufWriter::~GgufWriter() {
  if (fd_ >= 0) {
    ::close(fd_);
    ::unlink((path_ + ".tmp").c_str());
  }
}

}  // namespace hmoe
