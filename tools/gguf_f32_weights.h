#pragma once

// A GGUF model's weights dequantized to F32 host memory, for the FP32 reference forward
// (hmoe-generate --model FILE.gguf and tests). Holds the whole model in F32: small models only.

#include <memory>

#include "absl/status/statusor.h"

#include "common/model/gguf_model.h"
#include "common/model/model_config.h"
#include "tools/in_memory_weights.h"

namespace hmoe {

// Every ExpectedTensors(config) tensor dequantized to F32 under its Hugging Face name and shape:
// a WeightSource the FP32 reference forward (and hmoe-generate --model FILE.gguf) runs on.
// Errors from ValidateGgufTensors first.
absl::StatusOr<std::unique_ptr<InMemoryWeightSource>> LoadGgufAsF32Weights(
    const ModelConfig& config, const GgufModel& model);

}  // namespace hmoe
