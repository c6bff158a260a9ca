#pragma once

// Non-owning views of checkpoint tensors, and the interface every weight consumer reads through.

#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "absl/status/statusor.h"

#include "common/model/dtype.h"

namespace hmoe {

// A tensor's bytes somewhere in memory (an mmapped shard, weightd's shared mapping, a device
// buffer mirrored on the host). Row-major (C order), little-endian; `data` may be unaligned.
// Does not own the memory: valid while its source lives.
struct TensorView {
  std::string name;
  DType dtype = DType::kF32;
  std::vector<int64_t> shape;
  const std::byte* data = nullptr;
  size_t size_bytes = 0;

  int64_t num_elements() const {
    int64_t n = 1;
    for (int64_t d : shape) n *= d;
    return n;
  }
  int64_t rows() const { return shape.empty() ? 1 : shape[0]; }
  int64_t cols() const { return shape.size() < 2 ? 1 : shape[1]; }
};

// A weight as the forward pass consumes it: the tensor plus, for an FP8 block-quantized weight,
// its `weight_scale_inv` tensor (F32, [ceil(rows/128), ceil(cols/128)]; multiply to dequantize).
struct Weight {
  TensorView tensor;
  bool has_scale = false;
  TensorView scale_inv;  // valid iff has_scale
};

// Where weights come from: a checkpoint on disk, weightd's shared memory, a test fixture.
// Implementations are thread-safe for concurrent lookups.
class WeightSource {
 public:
  virtual ~WeightSource() = default;
  // NotFound naming `name` when absent.
  virtual absl::StatusOr<TensorView> GetTensor(const std::string& name) const = 0;
  // The weight `name` plus its "<name minus .weight>.weight_scale_inv" sibling when the weight is
  // FP8. FailedPrecondition when an FP8 weight has no scale tensor; InvalidArgument when the scale
  // is not F32 of shape ScaleInvShape(weight shape) or the weight is not 1-D/2-D.
  virtual absl::StatusOr<Weight> GetWeight(const std::string& name) const;
  // All tensor names, sorted.
  virtual std::vector<std::string> TensorNames() const = 0;
};

// Side of the square blocks of FP8 block quantization (quantization_config.weight_block_size).
inline constexpr int64_t kFp8BlockSize = 128;

// Name of the block-scale sibling of an FP8 weight: "x.weight" -> "x.weight_scale_inv".
std::string ScaleInvName(const std::string& weight_name);

// Shape of the scale tensor of a 2-D FP8 weight of shape [rows, cols]:
// [ceil(rows/128), ceil(cols/128)]. A 1-D shape [n] is treated as [1, n].
std::vector<int64_t> ScaleInvShape(const std::vector<int64_t>& weight_shape);

// Dequantizes `w` to a dense float matrix (row-major, rows x cols of the tensor; 1-D tensors are
// one row). FP8 uses the 128x128 block scales (partial edge blocks use their block's scale).
// InvalidArgument when shapes of tensor and scale disagree.
absl::StatusOr<std::vector<float>> DequantizeToFloat(const Weight& w);

}  // namespace hmoe
