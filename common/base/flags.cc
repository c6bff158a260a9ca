#include "common/base/flags.h"

#include <algorithm>

#include "absl/flags/usage.h"
#include "absl/flags/usage_config.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"

namespace hmoe {

std::vector<char*> NormalizeFlagNames(int argc, char** argv, std::vector<std::string>& storage) {
  storage.assign(argv, argv + argc);
  for (size_t i = 1; i < storage.size(); ++i) {
    std::string& a = storage[i];
    if (a == "--") break;
    if (a.size() < 3 || a.rfind("--", 0) != 0) continue;
    const size_t end = std::min(a.find('='), a.size());
    for (size_t j = 2; j < end; ++j) {
      if (a[j] == '-') a[j] = '_';
    }
  }
  std::vector<char*> out;
  out.reserve(storage.size());
  for (std::string& s : storage) out.push_back(s.data());
  return out;
}

bool IsOwnFlagFile(std::string_view file) { return file.find("absl/") == std::string_view::npos; }

void SetUsage(std::string_view usage) {
  absl::SetProgramUsageMessage(absl::string_view(usage.data(), usage.size()));
  absl::FlagsUsageConfig config;
  const auto own = [](absl::string_view file) {
    return IsOwnFlagFile(std::string_view(file.data(), file.size()));
  };
  config.contains_help_flags = own;
  config.contains_helpshort_flags = own;
  absl::SetFlagsUsageConfig(config);
}

absl::StatusOr<bool> ParseOnOff(const std::string& flag, const std::string& value) {
  if (value == "on" || value == "true" || value == "1") return true;
  if (value == "off" || value == "false" || value == "0") return false;
  return absl::InvalidArgumentError(absl::StrCat("--", flag, ": \"", value, "\" is not on or off"));
}

}  // namespace hmoe
