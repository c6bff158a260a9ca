#pragma once

// A WeightSource whose tensors live in process memory: the fixture for tests that need a model
// without files (engine, kernels, reference forward). Tensors are added as floats and stored as
// F32, BF16 or FP8 E4M3 with 128x128 block scales, exactly as a checkpoint would hold them.

#include <cstddef>
#include <cstdint>
#include <map>
#include <span>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

#include "common/model/dtype.h"
#include "common/model/tensor.h"

namespace hmoe {

class InMemoryWeightSource final : public WeightSource {
 public:
  InMemoryWeightSource() = default;
  InMemoryWeightSource(const InMemoryWeightSource&) = delete;
  InMemoryWeightSource& operator=(const InMemoryWeightSource&) = delete;

  // Adds `name` with raw little-endian bytes. AlreadyExists for a duplicate name,
  // InvalidArgument when bytes.size() != prod(shape) * DTypeSize(dtype).
  absl::Status AddTensor(const std::string& name, DType dtype, std::vector<int64_t> shape,
                         std::vector<std::byte> bytes);
  // Adds `values` (prod(shape) of them) stored as F32 (exact) or BF16 (round to nearest even).
  absl::Status AddF32(const std::string& name, std::vector<int64_t> shape,
                      std::span<const float> values);
  absl::Status AddBf16(const std::string& name, std::vector<int64_t> shape,
                       std::span<const float> values);
  // Quantizes `values` (a 1-D or 2-D tensor) to FP8 E4M3 with one F32 scale per 128x128 block
  // (scale = block amax / 448, 1 for an all-zero block; code = fp8(value / scale)) and adds the
  // weight plus its ScaleInvName(name) sibling, as DeepSeek's FP8 checkpoints store them.
  absl::Status AddFp8(const std::string& name, std::vector<int64_t> shape,
                      std::span<const float> values);

  // WeightSource. Views stay valid while this object lives (adding tensors does not move the
  // bytes of existing ones). Lookups are thread-safe while no tensor is being added.
  absl::StatusOr<TensorView> GetTensor(const std::string& name) const override;
  std::vector<std::string> TensorNames() const override;

 private:
  struct Entry {
    DType dtype;
    std::vector<int64_t> shape;
    std::vector<std::byte> bytes;
  };
  std::map<std::string, Entry> tensors_;
};

}  // namespace hmoe
