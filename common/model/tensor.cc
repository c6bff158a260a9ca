#include "common/model/tensor.h"

#include <algorithm>
#include <cstring>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

#include "common/base/status_macros.h"

namespace hmoe {
namespace {

// DTypeName() as an absl::string_view (not the same type as std::string_view in this abseil).
absl::string_view DTypeStr(DType t) {
  const std::string_view s = DTypeName(t);
  return absl::string_view(s.data(), s.size());
}

int64_t CeilDiv(int64_t a, int64_t b) { return (a + b - 1) / b; }

std::string ShapeString(const std::vector<int64_t>& shape) {
  return absl::StrCat("[", absl::StrJoin(shape, ", "), "]");
}

// The tensor's byte count must match its shape and dtype, and its data must be present.
absl::Status CheckViewSize(const TensorView& t) {
  for (int64_t d : t.shape) {
    if (d < 0) {
      return absl::InvalidArgumentError(absl::StrCat(
          "tensor \"", t.name, "\": negative dimension in shape ", ShapeString(t.shape)));
    }
  }
  uint64_t expected = 0;
  if (!TensorBytes(t.dtype, t.shape, &expected)) {
    return absl::InvalidArgumentError(
        absl::StrCat("tensor \"", t.name, "\": shape ", ShapeString(t.shape), " of dtype ",
                     DTypeStr(t.dtype), " is not whole blocks (or overflows)"));
  }
  if (t.size_bytes != expected) {
    return absl::InvalidArgumentError(
        absl::StrCat("tensor \"", t.name, "\": ", t.size_bytes, " bytes, but shape ",
                     ShapeString(t.shape), " of dtype ", DTypeStr(t.dtype), " needs ", expected));
  }
  if (expected > 0 && t.data == nullptr) {
    return absl::InvalidArgumentError(absl::StrCat("tensor \"", t.name, "\": no data"));
  }
  return absl::OkStatus();
}

// Checks that `scale` is a valid F32 block-scale tensor for FP8 weight `w`.
absl::Status CheckScale(const TensorView& w, const TensorView& scale) {
  if (w.shape.empty() || w.shape.size() > 2) {
    return absl::InvalidArgumentError(absl::StrCat("FP8 weight \"", w.name, "\" has shape ",
                                                   ShapeString(w.shape),
                                                   "; block scaling needs a 1-D or 2-D tensor"));
  }
  if (scale.dtype != DType::kF32) {
    return absl::InvalidArgumentError(absl::StrCat("scale tensor \"", scale.name, "\" of \"",
                                                   w.name, "\" has dtype ", DTypeStr(scale.dtype),
                                                   ", expected F32"));
  }
  const std::vector<int64_t> expected = ScaleInvShape(w.shape);
  if (scale.shape != expected) {
    return absl::InvalidArgumentError(absl::StrCat(
        "scale tensor \"", scale.name, "\" has shape ", ShapeString(scale.shape), ", expected ",
        ShapeString(expected), " for weight \"", w.name, "\" of shape ", ShapeString(w.shape)));
  }
  return CheckViewSize(scale);
}

}  // namespace

std::string ScaleInvName(const std::string& weight_name) {
  return absl::StrCat(weight_name, "_scale_inv");
}

std::vector<int64_t> ScaleInvShape(const std::vector<int64_t>& weight_shape) {
  const int64_t rows = weight_shape.size() >= 2 ? weight_shape[0] : 1;
  const int64_t cols = weight_shape.empty() ? 1 : weight_shape.back();
  return {CeilDiv(rows, kFp8BlockSize), CeilDiv(cols, kFp8BlockSize)};
}

absl::StatusOr<Weight> WeightSource::GetWeight(const std::string& name) const {
  Weight w;
  HMOE_ASSIGN_OR_RETURN(w.tensor, GetTensor(name));
  if (w.tensor.dtype != DType::kF8E4M3) return w;
  const std::string scale_name = ScaleInvName(name);
  absl::StatusOr<TensorView> scale = GetTensor(scale_name);
  if (!scale.ok()) {
    if (absl::IsNotFound(scale.status())) {
      return absl::FailedPreconditionError(
          absl::StrCat("FP8 weight \"", name, "\" has no scale tensor \"", scale_name, "\""));
    }
    return scale.status();
  }
  HMOE_RETURN_IF_ERROR(CheckScale(w.tensor, *scale));
  w.has_scale = true;
  w.scale_inv = *std::move(scale);
  return w;
}

absl::StatusOr<std::vector<float>> DequantizeToFloat(const Weight& w) {
  const TensorView& t = w.tensor;
  HMOE_RETURN_IF_ERROR(CheckViewSize(t));
  const size_t n = static_cast<size_t>(t.num_elements());
  std::vector<float> out(n);
  if (!(t.dtype == DType::kF8E4M3 && w.has_scale)) {
    HMOE_RETURN_IF_ERROR(Annotate(ConvertToFloat(t.dtype, t.data, n, out.data()),
                                  absl::StrCat("tensor \"", t.name, "\"")));
    return out;
  }
  HMOE_RETURN_IF_ERROR(CheckScale(t, w.scale_inv));
  const int64_t rows = t.shape.size() == 2 ? t.shape[0] : 1;
  const int64_t cols = t.shape.back();
  const int64_t scale_cols = CeilDiv(cols, kFp8BlockSize);
  const float* table = Fp8E4M3Table();
  const auto* codes = reinterpret_cast<const uint8_t*>(t.data);
  for (int64_t i = 0; i < rows; ++i) {
    const std::byte* scale_row =
        w.scale_inv.data + static_cast<size_t>((i / kFp8BlockSize) * scale_cols) * sizeof(float);
    for (int64_t jb = 0; jb < scale_cols; ++jb) {
      float s;
      std::memcpy(&s, scale_row + jb * sizeof(float), sizeof(float));  // may be unaligned
      const int64_t j_end = std::min(cols, (jb + 1) * kFp8BlockSize);
      for (int64_t j = jb * kFp8BlockSize; j < j_end; ++j) {
        out[i * cols + j] = table[codes[i * cols + j]] * s;
      }
    }
  }
  return out;
}

}  // namespace hmoe
