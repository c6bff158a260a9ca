#include "tools/in_memory_weights.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <utility>

#include "absl/strings/str_cat.h"

#include "common/base/status_macros.h"

namespace hmoe {
namespace {

int64_t NumElements(const std::vector<int64_t>& shape) {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

absl::Status CheckCount(const std::string& name, const std::vector<int64_t>& shape, size_t count) {
  for (int64_t d : shape) {
    if (d < 0) return absl::InvalidArgumentError(absl::StrCat("tensor ", name, ": negative dim"));
  }
  if (static_cast<int64_t>(count) != NumElements(shape)) {
    return absl::InvalidArgumentError(absl::StrCat("tensor ", name, ": ", count, " values for ",
                                                   NumElements(shape), " elements"));
  }
  return absl::OkStatus();
}

template <typename T>
std::vector<std::byte> ToBytes(const std::vector<T>& v) {
  std::vector<std::byte> bytes(v.size() * sizeof(T));
  if (!v.empty()) std::memcpy(bytes.data(), v.data(), bytes.size());
  return bytes;
}

}  // namespace

absl::Status InMemoryWeightSource::AddTensor(const std::string& name, DType dtype,
                                             std::vector<int64_t> shape,
                                             std::vector<std::byte> bytes) {
  if (tensors_.count(name) != 0) {
    return absl::AlreadyExistsError(absl::StrCat("tensor ", name, " already added"));
  }
  for (int64_t d : shape) {
    if (d < 0) return absl::InvalidArgumentError(absl::StrCat("tensor ", name, ": negative dim"));
  }
  if (bytes.size() != static_cast<size_t>(NumElements(shape)) * DTypeSize(dtype)) {
    return absl::InvalidArgumentError(
        absl::StrCat("tensor ", name, ": ", bytes.size(), " bytes do not match its shape"));
  }
  tensors_.emplace(name, Entry{dtype, std::move(shape), std::move(bytes)});
  return absl::OkStatus();
}

absl::Status InMemoryWeightSource::AddF32(const std::string& name, std::vector<int64_t> shape,
                                          std::span<const float> values) {
  HMOE_RETURN_IF_ERROR(CheckCount(name, shape, values.size()));
  return AddTensor(name, DType::kF32, std::move(shape),
                   ToBytes(std::vector<float>(values.begin(), values.end())));
}

absl::Status InMemoryWeightSource::AddBf16(const std::string& name, std::vector<int64_t> shape,
                                           std::span<const float> values) {
  HMOE_RETURN_IF_ERROR(CheckCount(name, shape, values.size()));
  std::vector<uint16_t> bits(values.size());
  for (size_t i = 0; i < values.size(); ++i) bits[i] = FloatToBf16(values[i]);
  return AddTensor(name, DType::kBF16, std::move(shape), ToBytes(bits));
}

absl::Status InMemoryWeightSource::AddFp8(const std::string& name, std::vector<int64_t> shape,
                                          std::span<const float> values) {
  HMOE_RETURN_IF_ERROR(CheckCount(name, shape, values.size()));
  if (shape.empty() || shape.size() > 2) {
    return absl::InvalidArgumentError(
        absl::StrCat("tensor ", name, ": FP8 block quantization needs a 1-D or 2-D shape"));
  }
  const int64_t rows = shape.size() == 2 ? shape[0] : 1;
  const int64_t cols = shape.back();
  const std::vector<int64_t> scale_shape = ScaleInvShape(shape);
  std::vector<float> scales(scale_shape[0] * scale_shape[1]);
  std::vector<uint8_t> codes(values.size());
  for (int64_t rb = 0; rb < scale_shape[0]; ++rb) {
    for (int64_t cb = 0; cb < scale_shape[1]; ++cb) {
      const int64_t r_end = std::min(rows, (rb + 1) * kFp8BlockSize);
      const int64_t c_end = std::min(cols, (cb + 1) * kFp8BlockSize);
      float amax = 0.0f;
      for (int64_t r = rb * kFp8BlockSize; r < r_end; ++r) {
        for (int64_t c = cb * kFp8BlockSize; c < c_end; ++c) {
          amax = std::max(amax, std::fabs(values[r * cols + c]));
        }
      }
      const float scale = amax > 0.0f ? amax / 448.0f : 1.0f;
      scales[rb * scale_shape[1] + cb] = scale;
      for (int64_t r = rb * kFp8BlockSize; r < r_end; ++r) {
        for (int64_t c = cb * kFp8BlockSize; c < c_end; ++c) {
          codes[r * cols + c] = FloatToFp8E4M3(values[r * cols + c] / scale);
        }
      }
    }
  }
  HMOE_RETURN_IF_ERROR(AddTensor(name, DType::kF8E4M3, std::move(shape), ToBytes(codes)));
  return AddTensor(ScaleInvName(name), DType::kF32, scale_shape, ToBytes(scales));
}

absl::StatusOr<TensorView> InMemoryWeightSource::GetTensor(const std::string& name) const {
  auto it = tensors_.find(name);
  if (it == tensors_.end()) {
    return absl::NotFoundError(absl::StrCat("tensor ", name, " not found"));
  }
  TensorView view;
  view.name = name;
  view.dtype = it->second.dtype;
  view.shape = it->second.shape;
  view.data = it->second.bytes.data();
  view.size_bytes = it->second.bytes.size();
  return view;
}

std::vector<std::string> InMemoryWeightSource::TensorNames() const {
  std::vector<std::string> names;
  names.reserve(tensors_.size());
  for (const auto& [name, entry] : tensors_) names.push_back(name);
  return names;
}

}  // namespace hmoe
