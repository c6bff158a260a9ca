#pragma once

namespace hmoe::bench {

// Registers the whole-MoE-layer benchmarks (moe_layer_bench.cc).
void RegisterMoeLayerBenchmarks();

}  // namespace hmoe::bench
