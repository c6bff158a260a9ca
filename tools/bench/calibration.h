#pragma once

// `hmoe calibrate` (docs/bench.md "Calibration"): the router's thresholds from measurements of
// this node, and the calibration file (schema "hmoe-calibration/1") that carries them, with the
// measurements, to `hmoe deploy --calibration FILE`. Pure functions (no I/O but the file
// helpers, no clock), unit-tested in tests/tools/calibration_test.cc.

#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "absl/status/statusor.h"

#include <nlohmann/json.hpp>

namespace hmoe::bench {

inline constexpr char kCalibrationSchema[] = "hmoe-calibration/1";

// The median of `values` (the mean of the two middle ones for an even count; NaN when empty or
// when any value is NaN: a failed measurement makes the point unusable).
double Median(std::span<const double> values);

// One rung of the prompt-length ladder: the TTFT of each path at that length (e.g. medians).
struct PathTtft {
  int64_t prompt_tokens = 0;
  double chunked_s = 0;
  double slp_s = 0;
};

// Where SLP starts to beat chunked prefill, from rungs sorted by prompt length.
//   kCrossing:        SLP is strictly faster at the longest rung and at every rung after the last
//                     one where it is not (a noisy, non-monotone ladder is decided by its tail:
//                     the router sends every longer prompt to SLP, so the threshold must sit
//                     after the last loss). The crossing is interpolated linearly in the prompt
//                     length between that last loss (a, diff_a = slp - chunked >= 0) and the next
//                     rung (b, diff_b < 0): a + (b - a) * diff_a / (diff_a - diff_b).
//   kSlpAlwaysWins:   SLP is faster at every rung: the crossing is below the ladder; the
//                     threshold is the shortest rung (the shortest length known to favour SLP).
//   kSlpNeverWins:    SLP is not faster at the longest rung: the threshold is `never_threshold`
//                     (the caller passes the context length: every prompt stays chunked).
// A tie (equal TTFTs) is not a win: SLP costs a prefill worker and a KV hand-off for nothing.
enum class CrossingOutcome { kCrossing, kSlpAlwaysWins, kSlpNeverWins };
const char* CrossingOutcomeName(CrossingOutcome outcome);

struct Crossing {
  CrossingOutcome outcome = CrossingOutcome::kSlpNeverWins;
  // The router's --chunk-threshold: prompts with fewer tokens take chunked prefill. kCrossing:
  // the interpolated crossing rounded up.
  int64_t threshold_tokens = 0;
  // kCrossing: the interpolated length (NaN otherwise) and the two rungs around it.
  double crossing_tokens = 0;
  int64_t below_tokens = 0;  // the last rung where SLP did not win
  int64_t above_tokens = 0;  // the rung after it
};

// InvalidArgument for no rungs, a rung with a NaN or negative time, lengths < 1 or not strictly
// increasing, or never_threshold < 1.
absl::StatusOr<Crossing> FindCrossing(std::span<const PathTtft> rungs, int64_t never_threshold);

// The thresholds the calibration file hands to hmoe-router (--chunk-threshold,
// --decode-idle-window-s).
struct RouterThresholds {
  int64_t chunk_threshold_tokens = 0;
  int64_t decode_idle_window_s = 0;
};

// Reads the "router" object of a calibration document: {"chunk_threshold": N >= 1,
// "decode_idle_window_s": S >= 0}, both integers that fit the router's int flags, after checking
// "schema". `source` names the file in messages. InvalidArgument naming the field otherwise.
absl::StatusOr<RouterThresholds> ThresholdsFromJson(const nlohmann::json& doc,
                                                    const std::string& source);
// Parses `text` as JSON first (InvalidArgument naming `source` and the parse error).
absl::StatusOr<RouterThresholds> ParseCalibration(const std::string& text,
                                                  const std::string& source);
// Reads the file: NotFound when it does not exist, PermissionDenied/Unavailable when it cannot be
// read, then ParseCalibration.
absl::StatusOr<RouterThresholds> ReadCalibrationFile(const std::string& path);

// A comma-separated list of integers >= `min` ("32,64,128"), sorted and without duplicates;
// InvalidArgument naming `flag` otherwise (also for an empty list).
absl::StatusOr<std::vector<int64_t>> ParseIntList(const std::string& text, const std::string& flag,
                                                  int64_t min);

// The "router" object for `t`.
nlohmann::json ThresholdsJson(const RouterThresholds& t);

}  // namespace hmoe::bench
