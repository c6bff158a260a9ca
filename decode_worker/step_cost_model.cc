#include "decode_worker/step_cost_model.h"

#include <algorithm>

namespace hmoe::decode {

StepCostModel::StepCostModel(double decay, int min_samples)
    : decay_(std::clamp(decay, 1e-6, 1.0)), min_samples_(std::max(min_samples, 2)) {}

void StepCostModel::Add(int64_t tokens, double micros) {
  if (tokens < 1 || !(micros >= 0)) return;  // also drops NaN
  const double x = static_cast<double>(tokens);
  w_ = w_ * decay_ + 1;
  x_ = x_ * decay_ + x;
  y_ = y_ * decay_ + micros;
  xx_ = xx_ * decay_ + x * x;
  xy_ = xy_ * decay_ + x * micros;
  ++samples_;
}

std::optional<StepCost> StepCostModel::Estimate() const {
  if (samples_ < min_samples_ || w_ <= 0) return std::nullopt;
  const double mx = x_ / w_;
  const double my = y_ / w_;
  const double var = xx_ / w_ - mx * mx;
  if (var < 0.25) return std::nullopt;
  const double cov = xy_ / w_ - mx * my;
  StepCost c;
  c.per_token_us = std::max(0.0, cov / var);
  c.fixed_us = std::max(0.0, my - c.per_token_us * mx);
  return c;
}

}  // namespace hmoe::decode
