#include "common/shm/hugepages.h"

#include <fstream>

#include "absl/status/status.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/strip.h"

#include "common/base/mapped_file.h"
#include "common/base/status_macros.h"

namespace hmoe::shm {
namespace {

absl::StatusOr<int64_t> ReadInt(const std::string& path) {
  std::ifstream in(path);
  if (!in) return absl::NotFoundError(absl::StrCat("read ", path));
  int64_t v = 0;
  if (!(in >> v)) return absl::InternalError(absl::StrCat("parse ", path));
  return v;
}

}  // namespace

absl::StatusOr<HugePageMode> ParseHugePageMode(std::string_view s) {
  if (s == "auto") return HugePageMode::kAuto;
  if (s == "1g" || s == "1G") return HugePageMode::k1G;
  if (s == "2m" || s == "2M") return HugePageMode::k2M;
  if (s == "thp") return HugePageMode::kThp;
  if (s == "off") return HugePageMode::kOff;
  return absl::InvalidArgumentError(
      absl::StrCat("hugepages \"", std::string(s), "\": expected auto, 1g, 2m, thp or off"));
}

const char* HugePageModeName(HugePageMode m) {
  switch (m) {
    case HugePageMode::kAuto:
      return "auto";
    case HugePageMode::k1G:
      return "1g";
    case HugePageMode::k2M:
      return "2m";
    case HugePageMode::kThp:
      return "thp";
    case HugePageMode::kOff:
      return "off";
  }
  return "?";
}

const char* PageBackingName(PageBacking b) {
  switch (b) {
    case PageBacking::kShmem:
      return "shmem-4k";
    case PageBacking::kShmemThp:
      return "shmem-thp";
    case PageBacking::kHugetlb2M:
      return "hugetlb-2m";
    case PageBacking::kHugetlb1G:
      return "hugetlb-1g";
  }
  return "unknown";
}

uint64_t PageBackingRoundBytes(PageBacking b) {
  switch (b) {
    case PageBacking::kHugetlb1G:
      return k1GiB;
    case PageBacking::kHugetlb2M:
    case PageBacking::kShmemThp:
      return k2MiB;
    case PageBacking::kShmem:
      return 4096;
  }
  return 4096;
}

absl::StatusOr<HugePagePool> ReadHugePagePool(uint64_t page_size_bytes) {
  const std::string dir =
      absl::StrCat("/sys/kernel/mm/hugepages/hugepages-", page_size_bytes >> 10, "kB/");
  HugePagePool pool;
  pool.page_size_bytes = page_size_bytes;
  HMOE_ASSIGN_OR_RETURN(pool.total, ReadInt(dir + "nr_hugepages"));
  HMOE_ASSIGN_OR_RETURN(pool.free, ReadInt(dir + "free_hugepages"));
  HMOE_ASSIGN_OR_RETURN(pool.reserved, ReadInt(dir + "resv_hugepages"));
  return pool;
}

std::string ShmemThpSetting() {
  absl::StatusOr<std::string> text =
      ReadFileToString("/sys/kernel/mm/transparent_hugepage/shmem_enabled");
  if (!text.ok()) return "";
  // "always within_size advise [never] deny force"
  const size_t open = text->find('[');
  const size_t close = text->find(']', open);
  if (open == std::string::npos || close == std::string::npos) return "";
  return text->substr(open + 1, close - open - 1);
}

bool ShmemThpAdviceEffective(std::string_view setting) {
  return setting == "advise" || setting == "always" || setting == "within_size" ||
         setting == "force";
}

}  // namespace hmoe::shm
