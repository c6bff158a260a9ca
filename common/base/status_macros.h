#pragma once

#include <string_view>
#include <utility>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

// Debian 12's abseil (20220623) has no ABSL_RETURN_IF_ERROR / ABSL_ASSIGN_OR_RETURN.
// Same shape as the upstream macros, so the switch is a rename.
#define HMOE_RETURN_IF_ERROR(expr)                                \
  do {                                                            \
    if (absl::Status hmoe_status_ = (expr); !hmoe_status_.ok()) { \
      return hmoe_status_;                                        \
    }                                                             \
  } while (false)

#define HMOE_ASSIGN_OR_RETURN(lhs, rexpr) \
  HMOE_ASSIGN_OR_RETURN_IMPL_(HMOE_CONCAT_(hmoe_statusor_, __LINE__), lhs, rexpr)

#define HMOE_ASSIGN_OR_RETURN_IMPL_(statusor, lhs, rexpr)  \
  auto statusor = (rexpr);                                 \
  if (!statusor.ok()) return std::move(statusor).status(); \
  lhs = *std::move(statusor)

#define HMOE_CONCAT_(a, b) HMOE_CONCAT_INNER_(a, b)
#define HMOE_CONCAT_INNER_(a, b) a##b

namespace hmoe {

// Prefixes `s`'s message with `context` ("context: message"), keeping the code. OK stays OK.
absl::Status Annotate(const absl::Status& s, std::string_view context);

}  // namespace hmoe
