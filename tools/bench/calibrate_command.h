#pragma once

// `hmoe calibrate` (docs/bench.md "Calibration"): measures the node behind a router and writes
// the router's thresholds, with the measurements, to a calibration file that `hmoe deploy
// --calibration FILE` passes to hmoe-router. Its flags live in calibrate_command.cc, compiled into
// the hmoe binary only (it reads flags hmoe_cli.cc and bench_command.cc define: --addr, --seed,
// --timeout-s, --calibration, --repeats, --decode-prompt-tokens, --label).

#include <string>
#include <vector>

namespace hmoe::bench {

// Runs the command after absl::ParseCommandLine; `argv` is recorded in the file. Exit code: 0 the
// file was written, 1 the router cannot be reached, has no prefill worker, a measurement failed
// or the file cannot be written, 2 bad flags (or lengths that do not fit the model's context).
int RunCalibrateCommand(const std::vector<std::string>& argv);

}  // namespace hmoe::bench
