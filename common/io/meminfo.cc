// ReadMemInfo: see meminfo.h.
#include "common/io/meminfo.h"

#include <fstream>
#include <sstream>

#include "absl/strings/str_cat.h"

namespace slidedp {

absl::StatusOr<MemInfo> ReadMemInfo(const std::string& path) {
  std::ifstream in(path);
  if (!in) return absl::NotFoundError(absl::StrCat("cannot read ", path));
  MemInfo info;
  bool have_available = false, have_total = false;
  std::string line;
  while (std::getline(in, line)) {
    std::istringstream ls(line);
    std::string key, unit;
    uint64_t value = 0;
    if (!(ls >> key >> value)) continue;
    ls >> unit;
    const uint64_t bytes = unit == "kB" ? value * 1024 : value;
    if (key == "MemAvailable:") {
      info.available_bytes = bytes;
      have_available = true;
    } else if (key == "MemTotal:") {
      info.total_bytes = bytes;
      have_total = true;
    }
  }
  if (!have_available || !have_total)
    return absl::DataLossError(absl::StrCat(path, " has no MemTotal/MemAvailable line"));
  return info;
}

}  // namespace slidedp
