#include "tools/bench/workload.h"

#include <algorithm>
#include <cmath>
#include <numbers>

#include "absl/status/status.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"

namespace hmoe::bench {
namespace {

absl::Status Bad(const std::string& flag, const std::string& spec, const std::string& why) {
  return absl::InvalidArgumentError(absl::StrCat(
      flag, ": \"", spec, "\": ", why, " (want N, uniform:A:B, lognormal:MEDIAN:SIGMA or chat)"));
}

}  // namespace

absl::StatusOr<LengthSpec> ParseLengthSpec(const std::string& spec, bool for_output,
                                           const std::string& flag) {
  LengthSpec s;
  s.text = spec;
  if (spec == "chat") {
    s.kind = LengthSpec::Kind::kLogNormal;
    s.a = for_output ? 120 : 160;
    s.sigma = for_output ? 0.8 : 1.0;
    return s;
  }
  const std::vector<std::string> parts = absl::StrSplit(spec, ':');
  if (parts.size() == 1) {
    if (!absl::SimpleAtoi(parts[0], &s.a) || s.a < 1) return Bad(flag, spec, "not a count >= 1");
    return s;
  }
  if (parts[0] == "uniform" && parts.size() == 3) {
    s.kind = LengthSpec::Kind::kUniform;
    if (!absl::SimpleAtoi(parts[1], &s.a) || !absl::SimpleAtoi(parts[2], &s.b) || s.a < 1 ||
        s.b < s.a) {
      return Bad(flag, spec, "uniform needs integers 1 <= A <= B");
    }
    return s;
  }
  if (parts[0] == "lognormal" && parts.size() == 3) {
    s.kind = LengthSpec::Kind::kLogNormal;
    if (!absl::SimpleAtoi(parts[1], &s.a) || !absl::SimpleAtod(parts[2], &s.sigma) || s.a < 1 ||
        !(s.sigma >= 0) || !std::isfinite(s.sigma)) {
      return Bad(flag, spec, "lognormal needs an integer median >= 1 and a finite sigma >= 0");
    }
    return s;
  }
  return Bad(flag, spec, "unknown form");
}

double Uniform01(std::mt19937_64& rng) { return static_cast<double>(rng() >> 11) * 0x1.0p-53; }

double StandardNormal(std::mt19937_64& rng) {
  const double u1 = 1.0 - Uniform01(rng);  // (0, 1]
  const double u2 = Uniform01(rng);
  return std::sqrt(-2.0 * std::log(u1)) * std::cos(2.0 * std::numbers::pi * u2);
}

int64_t SampleLength(const LengthSpec& spec, int64_t cap, std::mt19937_64& rng) {
  cap = std::max<int64_t>(cap, 1);
  int64_t n = spec.a;
  switch (spec.kind) {
    case LengthSpec::Kind::kFixed:
      break;
    case LengthSpec::Kind::kUniform:
      n = spec.a + static_cast<int64_t>(Uniform01(rng) * static_cast<double>(spec.b - spec.a + 1));
      break;
    case LengthSpec::Kind::kLogNormal: {
      const double x = static_cast<double>(spec.a) * std::exp(spec.sigma * StandardNormal(rng));
      n = x >= static_cast<double>(cap) ? cap : static_cast<int64_t>(std::llround(x));
      break;
    }
  }
  return std::clamp<int64_t>(n, 1, cap);
}

absl::StatusOr<ArrivalSpec::Kind> ParseArrivalKind(const std::string& name) {
  if (name == "poisson") return ArrivalSpec::Kind::kPoisson;
  if (name == "burst") return ArrivalSpec::Kind::kBurst;
  if (name == "closed") return ArrivalSpec::Kind::kClosed;
  return absl::InvalidArgumentError(
      absl::StrCat("--arrival: \"", name, "\": want poisson, burst or closed"));
}

const char* ArrivalKindName(ArrivalSpec::Kind kind) {
  switch (kind) {
    case ArrivalSpec::Kind::kPoisson:
      return "poisson";
    case ArrivalSpec::Kind::kBurst:
      return "burst";
    case ArrivalSpec::Kind::kClosed:
      return "closed";
  }
  return "?";
}

std::vector<double> ArrivalTimes(const ArrivalSpec& spec, int n, std::mt19937_64& rng) {
  std::vector<double> t;
  if (spec.kind == ArrivalSpec::Kind::kClosed) return t;
  double now = 0;
  for (int i = 0; i < n; ++i) {
    if (spec.kind == ArrivalSpec::Kind::kPoisson) {
      if (i > 0) now += -std::log(1.0 - Uniform01(rng)) / spec.rate;
    } else {
      const int size = std::max(spec.burst_size, 1);
      now = static_cast<double>(i / size) * static_cast<double>(size) / spec.rate;
    }
    t.push_back(now);
  }
  return t;
}

std::vector<PlannedRequest> PlanRequests(int n, const LengthSpec& prompt, const LengthSpec& output,
                                         int64_t vocab_size, int64_t context_length,
                                         std::mt19937_64& rng) {
  std::vector<PlannedRequest> plan(n);
  const int64_t lo = std::min<int64_t>(10, vocab_size - 1);
  for (PlannedRequest& r : plan) {
    r.max_new_tokens = SampleLength(output, std::max<int64_t>(context_length / 2, 1), rng);
    const int64_t len = SampleLength(prompt, context_length - r.max_new_tokens, rng);
    r.prompt.resize(len);
    for (int32_t& id : r.prompt) {
      id = static_cast<int32_t>(
          lo + static_cast<int64_t>(Uniform01(rng) * static_cast<double>(vocab_size - lo)));
    }
  }
  return plan;
}

}  // namespace hmoe::bench
