#pragma once

// `hmoe bench` (docs/bench.md): its flags live in bench_command.cc, which is compiled into the
// hmoe binary only (it reads flags hmoe_cli.cc defines: --addr, --seed, --hint, --timeout-s,
// --concurrency, --burst-size).

#include <string>
#include <vector>

namespace hmoe::bench {

// Runs the command after absl::ParseCommandLine; `argv` is recorded in the JSON. Exit code: 0
// done (failed requests are counted, not fatal), 1 the router cannot be reached or a scenario's
// set-up request failed, 2 bad flags.
int RunBenchCommand(const std::vector<std::string>& argv);

}  // namespace hmoe::bench
