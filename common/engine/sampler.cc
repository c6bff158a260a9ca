#include "common/engine/sampler.h"

#include <algorithm>
#include <cassert>
#include <cmath>
#include <limits>
#include <numeric>

namespace hmoe {
namespace {

uint64_t SplitMix64(uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

void InsertSorted(std::vector<int32_t>* v, int32_t token) {
  auto it = std::lower_bound(v->begin(), v->end(), token);
  if (it == v->end() || *it != token) v->insert(it, token);
}

int32_t ArgMax(std::span<const float> v) {
  int64_t best = 0;
  for (int64_t i = 1; i < static_cast<int64_t>(v.size()); ++i) {
    if (v[i] > v[best]) best = i;
  }
  return static_cast<int32_t>(best);
}

}  // namespace

double CounterUniform(uint64_t seed, uint64_t step) {
  const uint64_t bits = SplitMix64(SplitMix64(seed) ^ (step * 0xd1b54a32d192ed03ull + 1));
  return static_cast<double>(bits >> 11) * 0x1.0p-53;
}

Sampler::Sampler(const SamplingParams& params, std::span<const int32_t> prompt,
                 std::vector<int32_t> eos_token_ids)
    : params_(params), eos_(std::move(eos_token_ids)) {
  for (int32_t t : prompt) InsertSorted(&seen_all_, t);
}

Sampler Sampler::Create(const SamplingParams& params, std::span<const int32_t> prompt,
                        std::vector<int32_t> eos_token_ids) {
  assert(ValidateSamplingParams(params).ok());
  return Sampler(params, prompt, std::move(eos_token_ids));
}

std::vector<float> Sampler::Penalized(std::span<const float> logits) const {
  std::vector<float> l(logits.begin(), logits.end());
  const int64_t vocab = static_cast<int64_t>(l.size());
  if (params_.repetition_penalty != 1.0f) {
    for (int32_t t : seen_all_) {
      if (t < 0 || t >= vocab) continue;
      l[t] = l[t] > 0 ? l[t] / params_.repetition_penalty : l[t] * params_.repetition_penalty;
    }
  }
  if (params_.presence_penalty != 0.0f) {
    for (int32_t t : seen_output_) {
      if (t >= 0 && t < vocab) l[t] -= params_.presence_penalty;
    }
  }
  return l;
}

std::vector<double> Sampler::Distribution(std::span<const float> logits) const {
  const int64_t vocab = static_cast<int64_t>(logits.size());
  std::vector<double> p(vocab, 0.0);
  if (vocab == 0) return p;
  std::vector<float> l = Penalized(logits);
  if (params_.temperature == 0.0f) {
    p[ArgMax(l)] = 1.0;
    return p;
  }
  const double inv_t = 1.0 / params_.temperature;
  const double neg_inf = -std::numeric_limits<double>::infinity();
  std::vector<double> z(vocab);
  for (int64_t i = 0; i < vocab; ++i) z[i] = l[i] * inv_t;

  // Top-k: keep values >= the k-th largest.
  if (params_.top_k > 0 && params_.top_k < vocab) {
    std::vector<double> sorted = z;
    std::nth_element(sorted.begin(), sorted.begin() + (params_.top_k - 1), sorted.end(),
                     std::greater<double>());
    const double threshold = sorted[params_.top_k - 1];
    for (double& v : z) {
      if (v < threshold) v = neg_inf;
    }
  }
  auto softmax = [&](const std::vector<double>& in) {
    double max_value = neg_inf;
    for (double v : in) max_value = std::max(max_value, v);
    std::vector<double> out(vocab, 0.0);
    double sum = 0.0;
    for (int64_t i = 0; i < vocab; ++i) {
      if (in[i] == neg_inf) continue;
      out[i] = std::exp(in[i] - max_value);
      sum += out[i];
    }
    for (double& v : out) v /= sum;
    return out;
  };
  std::vector<double> probs = softmax(z);

  // Top-p: the smallest most-likely prefix (ties by lower id) reaching top_p.
  if (params_.top_p < 1.0f) {
    std::vector<int32_t> order(vocab);
    std::iota(order.begin(), order.end(), 0);
    std::stable_sort(order.begin(), order.end(),
                     [&](int32_t a, int32_t b) { return probs[a] > probs[b]; });
    double cumulative = 0.0;
    int64_t keep = 0;
    while (keep < vocab) {
      cumulative += probs[order[keep]];
      ++keep;
      if (cumulative >= params_.top_p) break;
    }
    for (int64_t i = keep; i < vocab; ++i) z[order[i]] = neg_inf;
    probs = softmax(z);
  }
  // Min-p relative to the most likely token.
  if (params_.min_p > 0.0f) {
    const double max_prob = *std::max_element(probs.begin(), probs.end());
    for (int64_t i = 0; i < vocab; ++i) {
      if (probs[i] < params_.min_p * max_prob) z[i] = neg_inf;
    }
    probs = softmax(z);
  }
  return probs;
}

absl::StatusOr<int32_t> Sampler::Sample(std::span<const float> logits) const {
  if (logits.empty()) return absl::InvalidArgumentError("sample: empty logits");
  if (params_.temperature == 0.0f) return ArgMax(Penalized(logits));
  const std::vector<double> probs = Distribution(logits);
  const double u = CounterUniform(params_.seed, generated_.size());
  double cumulative = 0.0;
  int32_t last = 0;
  for (int64_t i = 0; i < static_cast<int64_t>(probs.size()); ++i) {
    if (probs[i] <= 0.0) continue;
    cumulative += probs[i];
    last = static_cast<int32_t>(i);
    if (u < cumulative) return last;
  }
  return last;  // rounding left u above the total: the last kept token
}

FinishReason Sampler::Accept(int32_t token) {
  generated_.push_back(token);
  InsertSorted(&seen_all_, token);
  InsertSorted(&seen_output_, token);
  if (!params_.ignore_eos && std::find(eos_.begin(), eos_.end(), token) != eos_.end()) {
    return FinishReason::kEos;
  }
  if (std::find(params_.stop_token_ids.begin(), params_.stop_token_ids.end(), token) !=
      params_.stop_token_ids.end()) {
    return FinishReason::kStop;
  }
  if (static_cast<int64_t>(generated_.size()) >= params_.max_new_tokens) {
    return FinishReason::kLength;
  }
  return FinishReason::kNone;
}

}  // namespace hmoe
