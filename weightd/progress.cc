#include "weightd/progress.h"

#include <unistd.h>

#include <algorithm>
#include <system_error>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"

#include "common/base/logging.h"

namespace hmoe::weightd {

std::string FormatBytes(uint64_t bytes) {
  const double b = static_cast<double>(bytes);
  if (bytes >= (uint64_t{1} << 30)) return absl::StrFormat("%.2f GiB", b / (1 << 30));
  if (bytes >= (uint64_t{1} << 20)) return absl::StrFormat("%.1f MiB", b / (1 << 20));
  if (bytes >= (uint64_t{1} << 10)) return absl::StrFormat("%.1f KiB", b / (1 << 10));
  return absl::StrCat(bytes, " B");
}

std::string FormatProgress(uint64_t done, uint64_t total, double seconds) {
  const double frac = total == 0 ? 1.0 : static_cast<double>(done) / static_cast<double>(total);
  const double rate = seconds > 0 ? static_cast<double>(done) / seconds : 0.0;
  std::string eta = "?";
  if (done >= total) {
    eta = "0 s";
  } else if (rate > 0) {
    eta = absl::StrFormat("%.1f s", static_cast<double>(total - done) / rate);
  }
  return absl::StrFormat("%3.0f%% %s / %s, %s/s, ETA %s", 100.0 * frac, FormatBytes(done),
                         FormatBytes(total), FormatBytes(static_cast<uint64_t>(rate)), eta);
}

ProgressReporter::ProgressReporter(const std::atomic<uint64_t>* done, uint64_t total, bool tty,
                                   absl::Duration log_interval)
    : done_(done), total_(total), tty_(tty), log_interval_(log_interval), start_(absl::Now()) {}

ProgressReporter::~ProgressReporter() { Stop(); }

void ProgressReporter::Start() {
  start_ = absl::Now();
  try {
    thread_ = std::jthread([this] { Loop(); });
  } catch (const std::system_error& e) {
    HMOE_LOG(WARNING) << "no progress reporting: " << e.what();
  }
}

void ProgressReporter::Stop() {
  if (!thread_.joinable()) return;
  stop_.Notify();
  thread_.join();
  Report(/*final=*/true);
}

void ProgressReporter::Loop() {
  const absl::Duration tick = tty_ ? absl::Milliseconds(200) : absl::Milliseconds(100);
  absl::Time last_log = absl::Now();
  while (!stop_.WaitForNotificationWithTimeout(tick)) {
    if (tty_) {
      Report(false);
    } else if (absl::Now() - last_log >= log_interval_) {
      Report(false);
      last_log = absl::Now();
    }
  }
}

void ProgressReporter::Report(bool final) {
  // Relaxed: a monotone statistics counter.
  const uint64_t done = std::min(done_->load(std::memory_order_relaxed), total_);
  const double seconds = absl::ToDoubleSeconds(absl::Now() - start_);
  const std::string text = FormatProgress(done, total_, seconds);
  if (tty_) {
    constexpr int kWidth = 30;
    const int filled =
        total_ == 0
            ? kWidth
            : static_cast<int>(kWidth * static_cast<double>(done) / static_cast<double>(total_));
    std::string bar = absl::StrCat("\r[", std::string(filled, '='),
                                   std::string(kWidth - filled, ' '), "] ", text, "   ");
    if (final) bar += "\n";
    ssize_t unused = ::write(STDERR_FILENO, bar.data(), bar.size());
    (void)unused;
  } else {
    HMOE_LOG(INFO) << "loading: " << text;
  }
}

}  // namespace hmoe::weightd
