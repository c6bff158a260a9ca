#include "common/base/logging.h"

#include <sys/syscall.h>
#include <sys/time.h>
#include <unistd.h>

#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <ctime>
#include <string>

namespace hmoe::logging {
namespace {

int EnvInt(const char* name, int fallback) {
  const char* v = std::getenv(name);
  if (v == nullptr || *v == '\0') return fallback;
  char* end = nullptr;
  const long parsed = std::strtol(v, &end, 10);
  if (end == v || *end != '\0') return fallback;
  return static_cast<int>(parsed);
}

// Relaxed: these are configuration knobs; a racing reader sees either value, both valid.
std::atomic<int> g_min_severity{EnvInt("HMOE_MIN_LOG_LEVEL", 0)};
std::atomic<int> g_verbosity{EnvInt("HMOE_VLOG_LEVEL", 0)};

const char* Basename(const char* path) {
  const char* base = path;
  for (const char* p = path; *p != '\0'; ++p) {
    if (*p == '/') base = p + 1;
  }
  return base;
}

}  // namespace

void SetMinSeverity(Severity s) {
  g_min_severity.store(static_cast<int>(s), std::memory_order_relaxed);
}
Severity MinSeverity() {
  return static_cast<Severity>(g_min_severity.load(std::memory_order_relaxed));
}
void SetVerbosity(int level) { g_verbosity.store(level, std::memory_order_relaxed); }
int Verbosity() { return g_verbosity.load(std::memory_order_relaxed); }

LogMessage::LogMessage(const char* file, int line, Severity severity)
    : file_(file), line_(line), severity_(severity) {}

LogMessage::~LogMessage() {
  static constexpr char kLetters[] = {'I', 'W', 'E', 'F'};
  timeval tv{};
  ::gettimeofday(&tv, nullptr);
  tm local{};
  ::localtime_r(&tv.tv_sec, &local);
  char prefix[96];
  std::snprintf(prefix, sizeof(prefix), "%c%04d%02d%02d %02d:%02d:%02d.%06ld %d %ld %s:%d] ",
                kLetters[static_cast<int>(severity_)], local.tm_year + 1900, local.tm_mon + 1,
                local.tm_mday, local.tm_hour, local.tm_min, local.tm_sec,
                static_cast<long>(tv.tv_usec), static_cast<int>(::getpid()),
                static_cast<long>(::syscall(SYS_gettid)), Basename(file_), line_);
  std::string record = prefix;
  record += stream_.str();
  record += '\n';
  // One write(2) keeps records from different threads and processes whole.
  size_t done = 0;
  while (done < record.size()) {
    const ssize_t n = ::write(STDERR_FILENO, record.data() + done, record.size() - done);
    if (n <= 0) break;
    done += static_cast<size_t>(n);
  }
  if (severity_ == Severity::kFatal) std::abort();
}

}  // namespace hmoe::logging
