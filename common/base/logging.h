#pragma once

// Minimal logging with the shapes of absl's LOG/CHECK/VLOG (this abseil has no absl/log), so a
// later switch changes this file, not the call sites. Each record is one line on stderr:
//   I20261122 03:04:05.123456 pid tid file.cc:42] message
// Thread-safe: a record is formatted in full and written with one write(2).

#include <cstdint>
#include <sstream>
#include <string_view>

namespace hmoe::logging {

enum class Severity : int { kInfo = 0, kWarning = 1, kError = 2, kFatal = 3 };

// Records below this severity are dropped. Default kInfo; HMOE_MIN_LOG_LEVEL (0..3) overrides.
void SetMinSeverity(Severity s);
Severity MinSeverity();
// Verbose level for HMOE_VLOG(n); default 0, HMOE_VLOG_LEVEL env overrides.
void SetVerbosity(int level);
int Verbosity();

class LogMessage {
 public:
  LogMessage(const char* file, int line, Severity severity);
  LogMessage(const LogMessage&) = delete;
  LogMessage& operator=(const LogMessage&) = delete;
  // Writes the record; aborts the process for kFatal.
  ~LogMessage();
  std::ostream& stream() { return stream_; }

 private:
  const char* file_;
  int line_;
  Severity severity_;
  std::ostringstream stream_;
};

// Swallows the stream expression when a record is disabled.
struct Voidify {
  void operator&(std::ostream&) {}
};

}  // namespace hmoe::logging

#define HMOE_LOG_SEVERITY_INFO ::hmoe::logging::Severity::kInfo
#define HMOE_LOG_SEVERITY_WARNING ::hmoe::logging::Severity::kWarning
#define HMOE_LOG_SEVERITY_ERROR ::hmoe::logging::Severity::kError
#define HMOE_LOG_SEVERITY_FATAL ::hmoe::logging::Severity::kFatal

#define HMOE_LOG(severity)                                            \
  (HMOE_LOG_SEVERITY_##severity < ::hmoe::logging::MinSeverity() &&   \
   HMOE_LOG_SEVERITY_##severity != ::hmoe::logging::Severity::kFatal) \
      ? (void)0                                                       \
      : ::hmoe::logging::Voidify() &                                  \
            ::hmoe::logging::LogMessage(__FILE__, __LINE__, HMOE_LOG_SEVERITY_##severity).stream()

#define HMOE_VLOG(level)                                                                      \
  ((level) > ::hmoe::logging::Verbosity())                                                    \
      ? (void)0                                                                               \
      : ::hmoe::logging::Voidify() &                                                          \
            ::hmoe::logging::LogMessage(__FILE__, __LINE__, ::hmoe::logging::Severity::kInfo) \
                .stream()

// An invariant of our own code (never input validation): logs and aborts when false.
#define HMOE_CHECK(cond)                                                                          \
  (cond) ? (void)0                                                                                \
         : ::hmoe::logging::Voidify() &                                                           \
               ::hmoe::logging::LogMessage(__FILE__, __LINE__, ::hmoe::logging::Severity::kFatal) \
                       .stream()                                                                  \
                   << "check failed: " #cond " "

#define HMOE_CHECK_OK(expr)                                                     \
  do {                                                                          \
    const ::absl::Status hmoe_check_status_ = (expr);                           \
    HMOE_CHECK(hmoe_check_status_.ok()) << #expr << ": " << hmoe_check_status_; \
  } while (false)
