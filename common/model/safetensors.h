#pragma once

// The safetensors file format: 8-byte little-endian header length N, N bytes of JSON header
// ({name: {dtype, shape, data_offsets: [begin, end]}, "__metadata__": {...}}), then the data
// buffer; offsets are relative to its start. The header is untrusted input: every inconsistency is
// a specific InvalidArgument naming the file and tensor, never a crash or out-of-bounds read.

#include <map>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"

#include "common/base/mapped_file.h"
#include "common/model/dtype.h"
#include "common/model/tensor.h"

namespace hmoe {

class SafetensorsFile {
 public:
  struct Entry {
    TensorView view;         // data points into the mapping
    size_t file_offset = 0;  // absolute byte offset of the tensor data in the file
  };

  // Maps `path` and validates its header: length (>= 2, within the file, <= 100 MB), JSON, known
  // dtypes, shapes (non-negative, product * dtype size == end - begin, no overflow), offsets in
  // range, no two tensors overlapping.
  static absl::StatusOr<std::unique_ptr<SafetensorsFile>> Open(const std::string& path);
  // Same checks on an in-memory image (used by tests and fuzzing); `bytes` must outlive the object.
  static absl::StatusOr<std::unique_ptr<SafetensorsFile>> FromBytes(
      std::string name, std::span<const std::byte> bytes);

  const std::string& path() const { return path_; }
  const std::map<std::string, Entry>& entries() const { return entries_; }
  const std::map<std::string, std::string>& metadata() const { return metadata_; }
  const Entry* Find(const std::string& name) const;
  // Size of the whole file, and offset where the data buffer starts.
  size_t file_size() const { return bytes_.size(); }
  size_t data_start() const { return data_start_; }

 private:
  SafetensorsFile() = default;
  absl::Status Parse();

  std::string path_;
  std::unique_ptr<MappedFile> file_;  // null for FromBytes
  std::span<const std::byte> bytes_;
  size_t data_start_ = 0;
  std::map<std::string, Entry> entries_;
  std::map<std::string, std::string> metadata_;
};

// One tensor to write.
struct TensorToWrite {
  std::string name;
  DType dtype = DType::kF32;
  std::vector<int64_t> shape;
  std::string data;  // raw little-endian bytes, prod(shape) * DTypeSize(dtype)
};

// Writes a safetensors file (tensors in the given order, header padded with spaces to 8 bytes,
// metadata {"format": "pt"}), atomically. InvalidArgument when a tensor's data size is wrong.
absl::Status WriteSafetensors(const std::string& path, const std::vector<TensorToWrite>& tensors);

// Name, dtype and shape of one tensor of a streamed file.
struct TensorSpec {
  std::string name;
  DType dtype = DType::kF32;
  std::vector<int64_t> shape;
};

// Writes a safetensors file without holding its data in memory (checkpoints of many GB): the
// header is computed from `specs` up front, then tensor data is appended in spec order, in one or
// more pieces per tensor, to "<path>.tmp.<pid>", which Finish() fsyncs and renames to `path`.
// Destroying an unfinished writer removes the temp file. Same file layout as WriteSafetensors.
// Not thread-safe.
class SafetensorsWriter {
 public:
  // InvalidArgument for an empty, duplicate or "__metadata__" name or a negative dimension;
  // errno-based errors when the temp file cannot be created.
  static absl::StatusOr<std::unique_ptr<SafetensorsWriter>> Create(std::string path,
                                                                   std::vector<TensorSpec> specs);
  SafetensorsWriter(const SafetensorsWriter&) = delete;
  SafetensorsWriter& operator=(const SafetensorsWriter&) = delete;
  ~SafetensorsWriter();

  // Appends `bytes` to tensor `name`, which must be the first tensor not yet complete (spec
  // order); `bytes` must not run past its end. FailedPrecondition on an out-of-order name or
  // after Finish(), InvalidArgument on too many bytes.
  absl::Status WriteTensorData(std::string_view name, std::span<const std::byte> bytes);
  absl::Status WriteTensorData(std::string_view name, std::string_view bytes) {
    return WriteTensorData(
        name,
        std::span<const std::byte>(reinterpret_cast<const std::byte*>(bytes.data()), bytes.size()));
  }
  // FailedPrecondition unless every tensor is complete; then makes the file durable and visible.
  absl::Status Finish();

  const std::string& path() const { return path_; }
  // Name of the tensor the next WriteTensorData must target ("" when all are complete).
  std::string_view next_tensor() const;

 private:
  SafetensorsWriter() = default;
  absl::Status WriteAll(const void* data, size_t size);

  std::string path_;
  std::string tmp_path_;
  UniqueFd fd_;
  std::vector<TensorSpec> specs_;
  std::vector<size_t> sizes_;  // bytes per tensor
  size_t current_ = 0;         // index of the tensor being written
  size_t written_ = 0;         // bytes of specs_[current_] written so far
  bool finished_ = false;
};

// The header of a safetensors file for `specs` (laid out back to back in order), including the
// 8-byte length prefix and padding. InvalidArgument as for SafetensorsWriter::Create.
absl::StatusOr<std::string> SafetensorsHeader(const std::vector<TensorSpec>& specs);

}  // namespace hmoe
