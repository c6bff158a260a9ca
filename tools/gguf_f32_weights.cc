#include "tools/gguf_f32_weights.h"

#include <utility>
#include <vector>

#include "common/base/status_macros.h"
#include "common/model/tensor_map.h"

namespace hmoe {

absl::StatusOr<std::unique_ptr<InMemoryWeightSource>> LoadGgufAsF32Weights(
    const ModelConfig& config, const GgufModel& model) {
  HMOE_RETURN_IF_ERROR(ValidateGgufTensors(config, model));
  auto weights = std::make_unique<InMemoryWeightSource>();
  for (const ExpectedTensor& t : ExpectedTensors(config)) {
    HMOE_ASSIGN_OR_RETURN(const std::vector<float> values,
                          DequantizeHfTensor(config, model, t.name));
    HMOE_RETURN_IF_ERROR(weights->AddF32(t.name, t.shape, values));
  }
  return weights;
}

std::set<std::string> BlockQuantizedTensorNames(const WeightSource& source) {
  std::set<std::string> names;
  for (const std::string& name : source.TensorNames()) {
    absl::StatusOr<TensorView> t = source.GetTensor(name);
    if (t.ok() && IsBlockDType(t->dtype)) names.insert(name);
  }
  return names;
}

}  // namespace hmoe
