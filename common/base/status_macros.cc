#include "common/base/status_macros.h"

#include "absl/strings/str_cat.h"

namespace hmoe {

absl::Status Annotate(const absl::Status& s, std::string_view context) {
  if (s.ok()) return s;
  return absl::Status(
      s.code(), absl::StrCat(absl::string_view(context.data(), context.size()), ": ", s.message()));
}

}  // namespace hmoe
