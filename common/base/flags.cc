#include "common/base/flags.h"

#include <algorithm>

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

}  // namespace hmoe
