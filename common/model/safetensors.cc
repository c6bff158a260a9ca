#include "common/model/safetensors.h"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <optional>
#include <set>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

#include "common/base/json.h"
#include "common/base/logging.h"
#include "common/base/status_macros.h"

namespace hmoe {
namespace {

// DTypeName() as an absl::string_view (not the same type as std::string_view in this abseil).
absl::string_view DTypeStr(DType t) {
  const std::string_view s = DTypeName(t);
  return absl::string_view(s.data(), s.size());
}

constexpr size_t kMaxHeaderBytes = 100u * 1000u * 1000u;  // as the reference implementation
constexpr size_t kHeaderAlignment = 8;

std::string ShapeString(const std::vector<int64_t>& shape) {
  return absl::StrCat("[", absl::StrJoin(shape, ", "), "]");
}

uint64_t ReadLe64(const std::byte* p) {
  uint64_t v = 0;
  for (int i = 7; i >= 0; --i) v = (v << 8) | static_cast<uint64_t>(p[i]);
  return v;
}

void AppendLe64(uint64_t v, std::string* out) {
  for (int i = 0; i < 8; ++i) out->push_back(static_cast<char>((v >> (8 * i)) & 0xff));
}

// prod(shape) * element_size, or nullopt on a negative dimension or overflow of size_t.
std::optional<size_t> ByteCount(const std::vector<int64_t>& shape, size_t element_size) {
  size_t n = element_size;
  for (int64_t d : shape) {
    if (d < 0) return std::nullopt;
    if (__builtin_mul_overflow(n, static_cast<size_t>(d), &n)) return std::nullopt;
  }
  return n;
}

absl::Status ErrnoError(std::string_view what, const std::string& path) {
  const int err = errno;
  const std::string msg = absl::StrCat(absl::string_view(what.data(), what.size()), " ", path, ": ",
                                       std::strerror(err));
  if (err == ENOENT) return absl::NotFoundError(msg);
  if (err == EACCES || err == EPERM) return absl::PermissionDeniedError(msg);
  if (err == ENOSPC || err == EDQUOT) return absl::ResourceExhaustedError(msg);
  return absl::InternalError(msg);
}

}  // namespace

// ------------------------------------------------------------------------------------ reader

absl::StatusOr<std::unique_ptr<SafetensorsFile>> SafetensorsFile::Open(const std::string& path) {
  HMOE_ASSIGN_OR_RETURN(MappedFile mapped, MappedFile::Open(path));
  std::unique_ptr<SafetensorsFile> f(new SafetensorsFile());
  f->path_ = path;
  f->file_ = std::make_unique<MappedFile>(std::move(mapped));
  f->bytes_ = f->file_->bytes();
  HMOE_RETURN_IF_ERROR(f->Parse());
  return f;
}

absl::StatusOr<std::unique_ptr<SafetensorsFile>> SafetensorsFile::FromBytes(
    std::string name, std::span<const std::byte> bytes) {
  std::unique_ptr<SafetensorsFile> f(new SafetensorsFile());
  f->path_ = std::move(name);
  f->bytes_ = bytes;
  HMOE_RETURN_IF_ERROR(f->Parse());
  return f;
}

const SafetensorsFile::Entry* SafetensorsFile::Find(const std::string& name) const {
  const auto it = entries_.find(name);
  return it == entries_.end() ? nullptr : &it->second;
}

absl::Status SafetensorsFile::Parse() {
  auto error = [&](absl::string_view problem) {
    return absl::InvalidArgumentError(absl::StrCat(path_, ": ", problem));
  };
  auto tensor_error = [&](const std::string& name, absl::string_view problem) {
    return absl::InvalidArgumentError(absl::StrCat(path_, ": tensor \"", name, "\": ", problem));
  };

  if (bytes_.size() < 8) {
    return error(
        absl::StrCat("file of ", bytes_.size(), " bytes is too small for a safetensors header"));
  }
  const uint64_t header_len = ReadLe64(bytes_.data());
  if (header_len < 2) {
    return error(absl::StrCat("header length ", header_len, " is too small (< 2)"));
  }
  if (header_len > kMaxHeaderBytes) {
    return error(absl::StrCat("header length ", header_len, " exceeds the limit of ",
                              kMaxHeaderBytes, " bytes"));
  }
  if (header_len > bytes_.size() - 8) {
    return error(
        absl::StrCat("header length ", header_len, " exceeds the file size ", bytes_.size()));
  }
  data_start_ = 8 + static_cast<size_t>(header_len);
  const size_t data_size = bytes_.size() - data_start_;
  const std::string_view header_text(reinterpret_cast<const char*>(bytes_.data()) + 8,
                                     static_cast<size_t>(header_len));

  json::ParseOptions options;
  options.max_depth = 8;
  options.max_bytes = kMaxHeaderBytes;
  absl::StatusOr<json::Value> header = json::Parse(header_text, options);
  if (!header.ok()) return error(absl::StrCat("bad header: ", header.status().message()));
  if (!header->is_object()) {
    return error(
        absl::StrCat("header is a JSON ", json::TypeName(header->type()), ", not an object"));
  }

  std::vector<std::pair<size_t, size_t>> ranges;  // [begin, end) of non-empty tensors
  std::vector<const std::string*> range_names;
  for (const auto& [name, value] : header->members()) {
    if (name == "__metadata__") {
      if (!value.is_object()) {
        return error(absl::StrCat("\"__metadata__\" is a ", json::TypeName(value.type()),
                                  ", not an object"));
      }
      for (const auto& [key, v] : value.members()) {
        if (!v.is_string()) {
          return error(absl::StrCat("\"__metadata__\" value of \"", key, "\" is a ",
                                    json::TypeName(v.type()), ", not a string"));
        }
        metadata_[key] = v.as_string();
      }
      continue;
    }
    if (!value.is_object()) {
      return tensor_error(
          name, absl::StrCat("entry is a ", json::TypeName(value.type()), ", not an object"));
    }
    const json::Value* dtype_value = value.Find("dtype");
    const json::Value* shape_value = value.Find("shape");
    const json::Value* offsets_value = value.Find("data_offsets");
    if (dtype_value == nullptr || !dtype_value->is_string()) {
      return tensor_error(name, "missing or non-string \"dtype\"");
    }
    absl::StatusOr<DType> dtype = ParseDType(dtype_value->as_string());
    if (!dtype.ok()) return tensor_error(name, dtype.status().message());
    if (shape_value == nullptr || !shape_value->is_array()) {
      return tensor_error(name, "missing or non-array \"shape\"");
    }
    std::vector<int64_t> shape;
    for (const json::Value& d : shape_value->items()) {
      if (d.is_number() && d.as_double() < 0) {
        return tensor_error(name, absl::StrCat("negative dimension ", d.as_double(), " in shape"));
      }
      if (!d.is_integer()) {
        return tensor_error(name, "shape has a dimension that is not a non-negative integer");
      }
      shape.push_back(d.as_int());
    }
    if (offsets_value == nullptr || !offsets_value->is_array() ||
        offsets_value->items().size() != 2 || !offsets_value->items()[0].is_integer() ||
        !offsets_value->items()[1].is_integer()) {
      return tensor_error(name, "\"data_offsets\" is not an array of two integers");
    }
    const int64_t begin_i = offsets_value->items()[0].as_int();
    const int64_t end_i = offsets_value->items()[1].as_int();
    if (begin_i < 0 || end_i < 0) {
      return tensor_error(name, absl::StrCat("negative data_offsets [", begin_i, ", ", end_i, "]"));
    }
    const auto begin = static_cast<size_t>(begin_i);
    const auto end = static_cast<size_t>(end_i);
    if (begin > end) {
      return tensor_error(name, absl::StrCat("data_offsets begin ", begin, " > end ", end));
    }
    if (end > data_size) {
      return tensor_error(
          name, absl::StrCat("data_offsets [", begin, ", ", end,
                             "] out of range: the data buffer has ", data_size, " bytes"));
    }
    const std::optional<size_t> nbytes = ByteCount(shape, DTypeSize(*dtype));
    if (!nbytes.has_value()) {
      return tensor_error(name, absl::StrCat("size of shape ", ShapeString(shape), " of dtype ",
                                             DTypeStr(*dtype), " overflows"));
    }
    if (*nbytes != end - begin) {
      return tensor_error(
          name, absl::StrCat("shape ", ShapeString(shape), " of dtype ", DTypeStr(*dtype),
                             " needs ", *nbytes, " bytes, but data_offsets [", begin, ", ", end,
                             "] span ", end - begin));
    }
    Entry entry;
    entry.view.name = name;
    entry.view.dtype = *dtype;
    entry.view.shape = std::move(shape);
    entry.view.data = bytes_.data() + data_start_ + begin;
    entry.view.size_bytes = end - begin;
    entry.file_offset = data_start_ + begin;
    const auto [it, inserted] = entries_.emplace(name, std::move(entry));
    HMOE_CHECK(inserted);  // the JSON parser rejects duplicate keys
    if (end > begin) {
      ranges.emplace_back(begin, end);
      range_names.push_back(&it->first);
    }
  }

  // No two tensors may share bytes (zero-size tensors own no bytes).
  std::vector<size_t> order(ranges.size());
  for (size_t i = 0; i < order.size(); ++i) order[i] = i;
  std::sort(order.begin(), order.end(), [&](size_t a, size_t b) { return ranges[a] < ranges[b]; });
  for (size_t k = 1; k < order.size(); ++k) {
    const auto& prev = ranges[order[k - 1]];
    const auto& cur = ranges[order[k]];
    if (cur.first < prev.second) {
      return tensor_error(
          *range_names[order[k]],
          absl::StrCat("data_offsets [", cur.first, ", ", cur.second, "] overlap tensor \"",
                       *range_names[order[k - 1]], "\" [", prev.first, ", ", prev.second, "]"));
    }
  }
  return absl::OkStatus();
}

// ------------------------------------------------------------------------------------ writer

absl::StatusOr<std::string> SafetensorsHeader(const std::vector<TensorSpec>& specs) {
  // Members are collected directly: Value::Set() scans earlier members (quadratic), and the
  // names are already checked for duplicates here.
  std::vector<std::pair<std::string, json::Value>> members;
  members.reserve(specs.size() + 1);
  members.emplace_back("__metadata__",
                       json::Value::Object({{"format", json::Value::String("pt")}}));
  std::set<std::string_view> names;
  size_t offset = 0;
  for (const TensorSpec& spec : specs) {
    if (spec.name.empty() || spec.name == "__metadata__") {
      return absl::InvalidArgumentError(absl::StrCat("invalid tensor name \"", spec.name, "\""));
    }
    if (!names.insert(spec.name).second) {
      return absl::InvalidArgumentError(absl::StrCat("duplicate tensor \"", spec.name, "\""));
    }
    const std::optional<size_t> nbytes = ByteCount(spec.shape, DTypeSize(spec.dtype));
    if (!nbytes.has_value()) {
      return absl::InvalidArgumentError(
          absl::StrCat("tensor \"", spec.name, "\": invalid shape ", ShapeString(spec.shape)));
    }
    json::Value shape = json::Value::Array();
    for (int64_t d : spec.shape) shape.Append(json::Value::Integer(d));
    json::Value entry = json::Value::Object();
    entry.Set("dtype", json::Value::String(std::string(DTypeStr(spec.dtype))));
    entry.Set("shape", std::move(shape));
    entry.Set("data_offsets",
              json::Value::Array({json::Value::Integer(static_cast<int64_t>(offset)),
                                  json::Value::Integer(static_cast<int64_t>(offset + *nbytes))}));
    members.emplace_back(spec.name, std::move(entry));
    offset += *nbytes;
  }
  std::string text = json::Serialize(json::Value::Object(std::move(members)));
  // Pad with spaces so that the data buffer (at 8 + N) starts 8-byte aligned.
  text.append((kHeaderAlignment - text.size() % kHeaderAlignment) % kHeaderAlignment, ' ');
  std::string out;
  out.reserve(8 + text.size());
  AppendLe64(text.size(), &out);
  out.append(text);
  return out;
}

absl::Status WriteSafetensors(const std::string& path, const std::vector<TensorToWrite>& tensors) {
  std::vector<TensorSpec> specs;
  specs.reserve(tensors.size());
  size_t total = 0;
  for (const TensorToWrite& t : tensors) {
    specs.push_back({t.name, t.dtype, t.shape});
    const std::optional<size_t> nbytes = ByteCount(t.shape, DTypeSize(t.dtype));
    if (nbytes.has_value() && *nbytes != t.data.size()) {
      return absl::InvalidArgumentError(
          absl::StrCat("tensor \"", t.name, "\": ", t.data.size(), " bytes of data, but shape ",
                       ShapeString(t.shape), " of dtype ", DTypeStr(t.dtype), " needs ", *nbytes));
    }
    total += t.data.size();
  }
  HMOE_ASSIGN_OR_RETURN(std::string contents, SafetensorsHeader(specs));
  contents.reserve(contents.size() + total);
  for (const TensorToWrite& t : tensors) contents.append(t.data);
  return WriteFileAtomically(path, contents);
}

absl::StatusOr<std::unique_ptr<SafetensorsWriter>> SafetensorsWriter::Create(
    std::string path, std::vector<TensorSpec> specs) {
  HMOE_ASSIGN_OR_RETURN(const std::string header, SafetensorsHeader(specs));
  std::unique_ptr<SafetensorsWriter> w(new SafetensorsWriter());
  w->path_ = std::move(path);
  w->tmp_path_ = absl::StrCat(w->path_, ".tmp.", ::getpid());
  w->specs_ = std::move(specs);
  for (const TensorSpec& spec : w->specs_) {
    w->sizes_.push_back(*ByteCount(spec.shape, DTypeSize(spec.dtype)));
  }
  w->fd_.reset(::open(w->tmp_path_.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644));
  if (!w->fd_.valid()) return ErrnoError("create", w->tmp_path_);
  HMOE_RETURN_IF_ERROR(w->WriteAll(header.data(), header.size()));
  // Zero-size tensors at the front are complete already.
  while (w->current_ < w->specs_.size() && w->sizes_[w->current_] == 0) ++w->current_;
  return w;
}

SafetensorsWriter::~SafetensorsWriter() {
  if (!finished_ && !tmp_path_.empty()) {
    fd_.reset();
    ::unlink(tmp_path_.c_str());
  }
}

std::string_view SafetensorsWriter::next_tensor() const {
  return current_ < specs_.size() ? std::string_view(specs_[current_].name) : std::string_view();
}

absl::Status SafetensorsWriter::WriteAll(const void* data, size_t size) {
  const auto* p = static_cast<const char*>(data);
  while (size > 0) {
    const ssize_t n = ::write(fd_.get(), p, size);
    if (n < 0) {
      if (errno == EINTR) continue;
      return ErrnoError("write", tmp_path_);
    }
    p += n;
    size -= static_cast<size_t>(n);
  }
  return absl::OkStatus();
}

absl::Status SafetensorsWriter::WriteTensorData(std::string_view name,
                                                std::span<const std::byte> bytes) {
  const absl::string_view aname(name.data(), name.size());
  if (finished_) {
    return absl::FailedPreconditionError(
        absl::StrCat(path_, ": write of tensor \"", aname, "\" after Finish"));
  }
  if (current_ >= specs_.size()) {
    return absl::FailedPreconditionError(
        absl::StrCat(path_, ": tensor \"", aname, "\": all tensors are already written"));
  }
  const TensorSpec& spec = specs_[current_];
  if (spec.name != name) {
    return absl::FailedPreconditionError(absl::StrCat(
        path_, ": tensor \"", aname, "\" written out of order; expected \"", spec.name, "\""));
  }
  if (bytes.size() > sizes_[current_] - written_) {
    return absl::InvalidArgumentError(absl::StrCat(
        path_, ": tensor \"", aname, "\": ", written_ + bytes.size(), " bytes written, but shape ",
        ShapeString(spec.shape), " of dtype ", DTypeStr(spec.dtype), " needs ", sizes_[current_]));
  }
  HMOE_RETURN_IF_ERROR(WriteAll(bytes.data(), bytes.size()));
  written_ += bytes.size();
  if (written_ == sizes_[current_]) {
    written_ = 0;
    ++current_;
    while (current_ < specs_.size() && sizes_[current_] == 0) ++current_;
  }
  return absl::OkStatus();
}

absl::Status SafetensorsWriter::Finish() {
  if (finished_) return absl::FailedPreconditionError(absl::StrCat(path_, ": already finished"));
  if (current_ < specs_.size()) {
    return absl::FailedPreconditionError(absl::StrCat(
        path_, ": tensor \"", specs_[current_].name, "\" has ", written_, " of ", sizes_[current_],
        " bytes; ", specs_.size() - current_, " tensor(s) incomplete"));
  }
  if (::fsync(fd_.get()) != 0) return ErrnoError("fsync", tmp_path_);
  if (::close(fd_.release()) != 0) return ErrnoError("close", tmp_path_);
  if (::rename(tmp_path_.c_str(), path_.c_str()) != 0) {
    return ErrnoError(absl::StrCat("rename to ", path_), tmp_path_);
  }
  finished_ = true;
  return absl::OkStatus();
}

}  // namespace hmoe
