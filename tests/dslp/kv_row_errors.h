#pragma once

// The KV-cache comparison of the DSLP tests (tests/dslp/dslp_test.cc with rank processes,
// tests/prefill_worker/prefill_worker_dslp_test.cc with the worker binaries): caches in the
// hand-off layout (layer-major, then token-major rows of latent + rope key, F32).

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

#include "absl/strings/str_format.h"

namespace hmoe::dslp_test {

// errors[l][t] = max over token t's row of layer l of |got - want|, divided by the RMS of want's
// layer l. Both caches hold `layers` layers of `tokens` tokens (same size).
inline std::vector<std::vector<double>> KvRowErrors(const std::vector<float>& got,
                                                    const std::vector<float>& want, int64_t layers,
                                                    int64_t tokens) {
  const size_t per_layer = want.size() / layers;
  const size_t row = per_layer / tokens;
  std::vector<std::vector<double>> errors(layers, std::vector<double>(tokens, 0.0));
  for (int64_t l = 0; l < layers; ++l) {
    double sq = 0;
    for (size_t i = l * per_layer; i < (l + 1) * per_layer; ++i) {
      sq += static_cast<double>(want[i]) * want[i];
    }
    const double rms = std::max(1e-12, std::sqrt(sq / per_layer));
    for (int64_t t = 0; t < tokens; ++t) {
      double err = 0;
      for (size_t i = 0; i < row; ++i) {
        const size_t k = l * per_layer + t * row + i;
        err = std::max(err, std::abs(static_cast<double>(got[k]) - want[k]) / rms);
      }
      errors[l][t] = err;
    }
  }
  return errors;
}

// The rows of KvRowErrors against a tolerance.
struct KvRowSummary {
  struct Beyond {
    int64_t token = 0;
    int64_t layer = 0;  // the first layer where the token's row exceeds the tolerance
    double error = 0;   // its error there
  };
  std::vector<double> layer_max;  // per layer, the largest row error
  double worst_within = 0;        // the largest error of the rows within the tolerance
  std::vector<Beyond> beyond;     // every token with a row beyond it (by layer, then token)

  // " L0=0.0e+00 L1=3.4e-03 ...".
  std::string LayerMaxima() const {
    std::string out;
    for (size_t l = 0; l < layer_max.size(); ++l) {
      absl::StrAppendFormat(&out, " L%d=%.1e", l, layer_max[l]);
    }
    return out;
  }
};

inline KvRowSummary SummarizeKvRows(const std::vector<float>& got, const std::vector<float>& want,
                                    int64_t layers, int64_t tokens, double tolerance) {
  const std::vector<std::vector<double>> errors = KvRowErrors(got, want, layers, tokens);
  KvRowSummary s;
  std::vector<bool> beyond(tokens, false);
  for (int64_t l = 0; l < layers; ++l) {
    double layer_max = 0;
    for (int64_t t = 0; t < tokens; ++t) {
      const double err = errors[l][t];
      layer_max = std::max(layer_max, err);
      if (err <= tolerance) {
        s.worst_within = std::max(s.worst_within, err);
      } else if (!beyond[t]) {
        beyond[t] = true;
        s.beyond.push_back({t, l, err});
      }
    }
    s.layer_max.push_back(layer_max);
  }
  return s;
}

}  // namespace hmoe::dslp_test
