#pragma once

// The GGUF container (version 3, little-endian; MODEL-SPEC 5.1, docs/gguf.md): metadata key/value
// pairs of every type (arrays included), tensor infos, alignment (general.alignment, default 32),
// the data section, and split files ("<name>-0000k-of-0000n.gguf" with split.no, split.count and
// split.tensors.count). GgufFile reads one file, GgufModel a whole (possibly split) model,
// GgufWriter writes one file. Every malformed input is an InvalidArgument (or NotFound for a
// missing file) naming the file and the problem; nothing is trusted before it is bounds-checked.

#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

#include "common/base/mapped_file.h"
#include "common/model/gguf_quants.h"

namespace hmoe {

inline constexpr uint32_t kGgufMagic = 0x46554747;  // "GGUF"
inline constexpr uint32_t kGgufVersion = 3;
inline constexpr uint32_t kGgufDefaultAlignment = 32;

enum class GgufValueType : uint32_t {
  kU8 = 0,
  kI8 = 1,
  kU16 = 2,
  kI16 = 3,
  kU32 = 4,
  kI32 = 5,
  kF32 = 6,
  kBool = 7,
  kString = 8,
  kArray = 9,
  kU64 = 10,
  kI64 = 11,
  kF64 = 12,
};
// "u32", "string", "array", ...
std::string_view GgufValueTypeName(GgufValueType t);

// One metadata value. Integers are held in `u` (unsigned types, bool) or `i` (signed types),
// floats in `f`, strings in `str`; an array holds its element type and elements.
struct GgufValue {
  GgufValueType type = GgufValueType::kU32;
  uint64_t u = 0;
  int64_t i = 0;
  double f = 0.0;
  std::string str;
  GgufValueType array_type = GgufValueType::kU32;
  std::vector<GgufValue> array;

  static GgufValue U16(uint16_t v);
  static GgufValue U32(uint32_t v);
  static GgufValue I32(int32_t v);
  static GgufValue U64(uint64_t v);
  static GgufValue F32(float v);
  static GgufValue Bool(bool v);
  static GgufValue String(std::string v);
  static GgufValue Array(GgufValueType element_type, std::vector<GgufValue> elements);

  bool is_integer() const;
  bool is_float() const { return type == GgufValueType::kF32 || type == GgufValueType::kF64; }
  // The integer value of an integer type (U64 above INT64_MAX: nullopt).
  std::optional<int64_t> AsInt() const;
  // A float or integer type as double.
  std::optional<double> AsDouble() const;
};

struct GgufTensorInfo {
  std::string name;
  std::vector<int64_t> ne;  // ggml order: ne[0] is the contiguous dimension
  uint32_t type = 0;        // GgmlType id
  uint64_t offset = 0;      // relative to the data section
  int64_t num_elements = 0;
  size_t size_bytes = 0;
  const std::byte* data = nullptr;  // into the file's mapping
  int file_index = 0;               // which split file (GgufModel)

  // The PyTorch-order shape (ne reversed), e.g. ne [in, out] -> [out, in].
  std::vector<int64_t> torch_shape() const { return {ne.rbegin(), ne.rend()}; }
};

// One GGUF file, parsed. The bytes must outlive the object (Open keeps its own mapping).
class GgufFile {
 public:
  // Maps and parses `path`. NotFound when it does not exist.
  static absl::StatusOr<std::unique_ptr<GgufFile>> Open(const std::string& path);
  // Parses `bytes` (which must stay valid); `name` is used in error messages.
  static absl::StatusOr<std::unique_ptr<GgufFile>> Parse(std::span<const std::byte> bytes,
                                                         std::string name);

  const std::string& name() const { return name_; }
  uint32_t version() const { return version_; }
  uint32_t alignment() const { return alignment_; }
  uint64_t data_offset() const { return data_offset_; }
  // Metadata in file order.
  const std::vector<std::pair<std::string, GgufValue>>& metadata() const { return metadata_; }
  const GgufValue* Find(std::string_view key) const;
  const std::vector<GgufTensorInfo>& tensors() const { return tensors_; }

 private:
  friend class GgufModel;  // sets GgufTensorInfo::file_index
  GgufFile() = default;
  std::optional<MappedFile> mapping_;
  std::string name_;
  uint32_t version_ = 0;
  uint32_t alignment_ = kGgufDefaultAlignment;
  uint64_t data_offset_ = 0;
  std::vector<std::pair<std::string, GgufValue>> metadata_;
  std::map<std::string, size_t, std::less<>> index_;
  std::vector<GgufTensorInfo> tensors_;
};

// "<prefix>-00001-of-00003.gguf" parts: returns (prefix, k, n) when `path` names a split part.
struct GgufSplitName {
  std::string prefix;
  int part = 0;  // 1-based
  int count = 0;
};
std::optional<GgufSplitName> ParseGgufSplitName(const std::string& path);
// "<prefix>-%05d-of-%05d.gguf".
std::string GgufSplitPath(const std::string& prefix, int part, int count);

// A whole model: one file, or every part of a split model (any part's path may be given). The
// metadata is the first part's; tensors of all parts are merged (a name twice is an error).
class GgufModel {
 public:
  // NotFound when a file (or a split part) is missing; InvalidArgument for malformed files and
  // inconsistent split metadata (split.no / split.count / split.tensors.count).
  static absl::StatusOr<std::unique_ptr<GgufModel>> Open(const std::string& path);
  // From already parsed files (part order); checks the split keys like Open.
  static absl::StatusOr<std::unique_ptr<GgufModel>> FromFiles(
      std::vector<std::unique_ptr<GgufFile>> files);

  const GgufValue* Find(std::string_view key) const { return files_.front()->Find(key); }
  const GgufFile& file(int i) const { return *files_[static_cast<size_t>(i)]; }
  int num_files() const { return static_cast<int>(files_.size()); }
  // nullptr when absent.
  const GgufTensorInfo* FindTensor(std::string_view name) const;
  // All tensors, sorted by name.
  std::vector<const GgufTensorInfo*> Tensors() const;
  // The tensor's values as float (row-major in ggml order: ne[0] fastest). InvalidArgument
  // naming the tensor and its type when the type is not supported; NotFound when absent.
  absl::StatusOr<std::vector<float>> Dequantize(std::string_view name) const;

 private:
  GgufModel() = default;
  std::vector<std::unique_ptr<GgufFile>> files_;
  std::map<std::string, const GgufTensorInfo*, std::less<>> tensors_;
};

// Writes one GGUF v3 file: metadata and tensor infos first, then tensor data in order, each
// tensor at an offset aligned to `alignment` (general.alignment is written when it is not 32 and
// the caller did not add the key with AddMetadata). Metadata is written as added, duplicates
// included (the reader's tests need damaged files).
class GgufWriter {
 public:
  explicit GgufWriter(std::string path, uint32_t alignment = kGgufDefaultAlignment)
      : path_(std::move(path)), alignment_(alignment) {}
  void AddMetadata(std::string key, GgufValue value);
  // Declares a tensor of `type` with `ne` (ggml order). InvalidArgument for an unknown type or a
  // row that is not a whole number of blocks.
  absl::Status AddTensor(std::string name, std::vector<int64_t> ne, uint32_t type);
  // Writes the header and opens the file for data. After it, WriteTensorData for each tensor in
  // AddTensor order, each called with consecutive chunks whose sizes add up to the tensor's bytes.
  absl::Status Begin();
  absl::Status WriteTensorData(std::string_view name, std::span<const std::byte> bytes);
  // Checks every tensor was written completely, closes the file (written to "<path>.tmp", then
  // renamed).
  absl::Status Finish();
  ~GgufWriter();

 private:
  struct Tensor {
    std::string name;
    std::vector<int64_t> ne;
    uint32_t type;
    uint64_t offset;
    size_t bytes;
  };
  absl::Status Write(const void* data, size_t n);
  std::string path_;
  uint32_t alignment_;
  std::vector<std::pair<std::string, GgufValue>> metadata_;
  std::vector<Tensor> tensors_;
  size_t current_ = 0;          // tensor being written
  size_t current_written_ = 0;  // its bytes so far
  uint64_t position_ = 0;
  uint64_t data_start_ = 0;
  int fd_ = -1;
};

}  // namespace hmoe
