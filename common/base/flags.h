#pragma once

// Command-line helpers shared by every binary of the tree.

#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"

namespace hmoe {

// absl flags are spelled with underscores; every hmoe binary documents and accepts the dashed
// spelling too. Returns argv with the flag names of "--batch-size" / "--batch-size=6" style
// arguments turned into "--batch_size" (values, argv[0], arguments not starting with "--", and
// everything after a lone "--" untouched), for absl::ParseCommandLine. `storage` owns the strings
// the returned pointers point into; it must outlive them.
std::vector<char*> NormalizeFlagNames(int argc, char** argv, std::vector<std::string>& storage);

// Sets the binary's usage message (absl::SetProgramUsageMessage) and makes --help and
// --helpshort list the binary's own flags: every flag defined outside abseil's sources. (absl's
// default lists only the flags of a file named after the binary, which none of ours is, and
// prints "No flags matched.") Call once, before absl::ParseCommandLine.
void SetUsage(std::string_view usage);

// "on"/"off" (also true/false, 1/0) for the flag `flag`. InvalidArgument naming `flag` otherwise.
absl::StatusOr<bool> ParseOnOff(const std::string& flag, const std::string& value);

// Whether --help lists a flag defined in `file` (SetUsage): not one of abseil's own.
bool IsOwnFlagFile(std::string_view file);

}  // namespace hmoe
