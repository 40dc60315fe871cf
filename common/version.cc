// BuildId: see version.h.
#include "common/version.h"

#include <fcntl.h>
#include <unistd.h>

#include <cstdint>
#include <vector>

#include "absl/strings/str_cat.h"

namespace slidedp {

std::string BuildId() {
  static const std::string id = [] {
    const int fd = open("/proc/self/exe", O_RDONLY | O_CLOEXEC);
    if (fd < 0) return std::string(kVersion);
    uint64_t h = 0xcbf29ce484222325ull;
    std::vector<unsigned char> buf(1 << 20);
    int64_t total = 0;
    for (;;) {
      const ssize_t n = read(fd, buf.data(), buf.size());
      if (n < 0) {
        close(fd);
        return std::string(kVersion);
      }
      if (n == 0) break;
      for (ssize_t i = 0; i < n; ++i) h = (h ^ buf[static_cast<size_t>(i)]) * 0x100000001b3ull;
      total += n;
      if (total > (int64_t{4} << 30)) break;  // bounded: no executable is this large
    }
    close(fd);
    return absl::StrCat(kVersion, " ", absl::Hex(h, absl::kZeroPad16));
  }();
  return id;
}

}  // namespace slidedp
