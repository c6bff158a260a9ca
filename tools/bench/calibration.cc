#include "tools/bench/calibration.h"

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <sstream>

#include "absl/status/status.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"

namespace hmoe::bench {
namespace {

constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();

// An integer field of `obj` within [lo, hi].
absl::StatusOr<int64_t> IntField(const nlohmann::json& obj, const char* key, int64_t lo, int64_t hi,
                                 const std::string& source) {
  const auto it = obj.find(key);
  if (it == obj.end()) {
    return absl::InvalidArgumentError(
        absl::StrCat(source, ": \"router\" has no \"", key, "\" (want an integer)"));
  }
  if (!it->is_number_integer()) {
    return absl::InvalidArgumentError(
        absl::StrCat(source, ": \"router\".\"", key, "\" must be an integer, got ", it->dump()));
  }
  const int64_t v = it->get<int64_t>();
  if (v < lo || v > hi) {
    return absl::InvalidArgumentError(absl::StrCat(source, ": \"router\".\"", key, "\" = ", v,
                                                   " is outside [", lo, ", ", hi, "]"));
  }
  return v;
}

}  // namespace

double Median(std::span<const double> values) {
  if (values.empty()) return kNaN;
  std::vector<double> v(values.begin(), values.end());
  for (double x : v) {
    if (std::isnan(x)) return kNaN;
  }
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n % 2 == 1 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

const char* CrossingOutcomeName(CrossingOutcome outcome) {
  switch (outcome) {
    case CrossingOutcome::kCrossing:
      return "crossing";
    case CrossingOutcome::kSlpAlwaysWins:
      return "slp_always_wins";
    case CrossingOutcome::kSlpNeverWins:
      return "slp_never_wins";
  }
  return "?";
}

absl::StatusOr<Crossing> FindCrossing(std::span<const PathTtft> rungs, int64_t never_threshold) {
  if (rungs.empty()) return absl::InvalidArgumentError("no prompt lengths were measured");
  if (never_threshold < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("the no-crossing threshold must be >= 1, got ", never_threshold));
  }
  for (size_t i = 0; i < rungs.size(); ++i) {
    const PathTtft& r = rungs[i];
    if (r.prompt_tokens < 1 || (i > 0 && r.prompt_tokens <= rungs[i - 1].prompt_tokens)) {
      return absl::InvalidArgumentError(
          absl::StrCat("prompt lengths must be >= 1 and strictly increasing; rung ", i, " has ",
                       r.prompt_tokens, " tokens"));
    }
    if (!(r.chunked_s >= 0) || !(r.slp_s >= 0) || std::isinf(r.chunked_s) || std::isinf(r.slp_s)) {
      return absl::InvalidArgumentError(absl::StrCat(
          "the TTFTs at ", r.prompt_tokens, " tokens are not finite non-negative numbers"));
    }
  }
  auto wins = [](const PathTtft& r) { return r.slp_s < r.chunked_s; };
  Crossing c;
  c.crossing_tokens = kNaN;
  if (!wins(rungs.back())) {
    c.outcome = CrossingOutcome::kSlpNeverWins;
    c.threshold_tokens = never_threshold;
    return c;
  }
  // The last rung where SLP does not win; every rung after it is a win.
  size_t last_loss = rungs.size();
  for (size_t i = rungs.size(); i-- > 0;) {
    if (!wins(rungs[i])) {
      last_loss = i;
      break;
    }
  }
  if (last_loss == rungs.size()) {
    c.outcome = CrossingOutcome::kSlpAlwaysWins;
    c.threshold_tokens = rungs.front().prompt_tokens;
    return c;
  }
  const PathTtft& a = rungs[last_loss];
  const PathTtft& b = rungs[last_loss + 1];
  const double da = a.slp_s - a.chunked_s;  // >= 0
  const double db = b.slp_s - b.chunked_s;  // < 0
  const auto la = static_cast<double>(a.prompt_tokens);
  const auto lb = static_cast<double>(b.prompt_tokens);
  c.outcome = CrossingOutcome::kCrossing;
  c.crossing_tokens = la + (lb - la) * da / (da - db);
  c.below_tokens = a.prompt_tokens;
  c.above_tokens = b.prompt_tokens;
  // A tie at `a` is no win, so the threshold is past `a`; it is at most `b` (db < 0).
  c.threshold_tokens = std::clamp<int64_t>(static_cast<int64_t>(std::ceil(c.crossing_tokens)),
                                           a.prompt_tokens + 1, b.prompt_tokens);
  return c;
}

absl::StatusOr<RouterThresholds> ThresholdsFromJson(const nlohmann::json& doc,
                                                    const std::string& source) {
  if (!doc.is_object()) {
    return absl::InvalidArgumentError(
        absl::StrCat(source,
                     ": not a calibration file (want a JSON object written by `hmoe "
                     "calibrate`)"));
  }
  const auto schema = doc.find("schema");
  if (schema == doc.end() || !schema->is_string() || *schema != kCalibrationSchema) {
    return absl::InvalidArgumentError(
        absl::StrCat(source, ": \"schema\" is ", schema == doc.end() ? "missing" : schema->dump(),
                     ", want \"", kCalibrationSchema, "\" (a file written by `hmoe calibrate`)"));
  }
  const auto router = doc.find("router");
  if (router == doc.end() || !router->is_object()) {
    return absl::InvalidArgumentError(
        absl::StrCat(source, ": no \"router\" object with the thresholds"));
  }
  constexpr int64_t kIntMax = std::numeric_limits<int32_t>::max();
  RouterThresholds t;
  absl::StatusOr<int64_t> v = IntField(*router, "chunk_threshold", 1, kIntMax, source);
  if (!v.ok()) return v.status();
  t.chunk_threshold_tokens = *v;
  v = IntField(*router, "decode_idle_window_s", 0, kIntMax, source);
  if (!v.ok()) return v.status();
  t.decode_idle_window_s = *v;
  return t;
}

absl::StatusOr<RouterThresholds> ParseCalibration(const std::string& text,
                                                  const std::string& source) {
  const nlohmann::json doc = nlohmann::json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (doc.is_discarded()) {
    return absl::InvalidArgumentError(absl::StrCat(source, ": not valid JSON"));
  }
  return ThresholdsFromJson(doc, source);
}

absl::StatusOr<RouterThresholds> ReadCalibrationFile(const std::string& path) {
  std::error_code ec;
  if (std::filesystem::is_directory(path, ec)) {
    return absl::InvalidArgumentError(
        absl::StrCat("calibration file ", path, " is a directory, want a JSON file"));
  }
  std::ifstream f(path);
  if (!f) {
    const int err = errno;
    const std::string what =
        absl::StrCat("cannot read calibration file ", path, ": ", std::strerror(err));
    if (err == ENOENT) return absl::NotFoundError(what);
    if (err == EACCES) return absl::PermissionDeniedError(what);
    return absl::UnavailableError(what);
  }
  std::stringstream text;
  text << f.rdbuf();
  if (f.bad()) return absl::UnavailableError(absl::StrCat("reading ", path, " failed"));
  return ParseCalibration(text.str(), path);
}

absl::StatusOr<std::vector<int64_t>> ParseIntList(const std::string& text, const std::string& flag,
                                                  int64_t min) {
  std::vector<int64_t> out;
  for (absl::string_view item : absl::StrSplit(text, ',', absl::SkipWhitespace())) {
    int64_t v = 0;
    if (!absl::SimpleAtoi(item, &v) || v < min) {
      return absl::InvalidArgumentError(absl::StrCat(
          flag, ": \"", item, "\" is not an integer >= ", min, " (want a comma-separated list)"));
    }
    out.push_back(v);
  }
  if (out.empty()) return absl::InvalidArgumentError(absl::StrCat(flag, ": empty list"));
  std::sort(out.begin(), out.end());
  out.erase(std::unique(out.begin(), out.end()), out.end());
  return out;
}

nlohmann::json ThresholdsJson(const RouterThresholds& t) {
  return {{"chunk_threshold", t.chunk_threshold_tokens},
          {"decode_idle_window_s", t.decode_idle_window_s}};
}

}  // namespace hmoe::bench
