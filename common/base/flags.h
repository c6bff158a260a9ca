#pragma once

// Command-line helpers shared by every binary of the tree.

#include <string>
#include <vector>

namespace hmoe {

// absl flags are spelled with underscores; every hmoe binary documents and accepts the dashed
// spelling too. Returns argv with the flag names of "--batch-size" / "--batch-size=6" style
// arguments turned into "--batch_size" (values, argv[0], arguments not starting with "--", and
// everything after a lone "--" untouched), for absl::ParseCommandLine. `storage` owns the strings
// the returned pointers point into; it must outlive them.
std::vector<char*> NormalizeFlagNames(int argc, char** argv, std::vector<std::string>& storage);

}  // namespace hmoe
