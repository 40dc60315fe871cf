// The version strings and the binary's digest: see version.h.
#include "common/version.h"

#include <fcntl.h>
#include <unistd.h>

#include <cstdint>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/git_commit.h"  // generated in the build tree: SLIDEDP_GIT_COMMIT

namespace slidedp {

const char* GitCommit() { return SLIDEDP_GIT_COMMIT; }

std::string VersionString() { return absl::StrCat(kVersion, " (commit ", GitCommit(), ")"); }

std::string VersionReport() {
  const std::string digest = BinaryDigest();
  return digest.empty() ? VersionString() : absl::StrCat(VersionString(), "\nbuild digest ", digest);
}

std::string BinaryDigest() {
  static const std::string digest = [] {
    const int fd = open("/proc/self/exe", O_RDONLY | O_CLOEXEC);
    if (fd < 0) return std::string();
    uint64_t h = 0xcbf29ce484222325ull;
    std::vector<unsigned char> buf(1 << 20);
    int64_t total = 0;
    for (;;) {
      const ssize_t n = read(fd, buf.data(), buf.size());
      if (n < 0) {
        close(fd);
        return std::string();
      }
      if (n == 0) break;
      for (ssize_t i = 0; i < n; ++i) h = (h ^ buf[static_cast<size_t>(i)]) * 0x100000001b3ull;
      total += n;
      if (total > (int64_t{4} << 30)) break;  // bounded: no executable is this large
    }
    close(fd);
    return absl::StrCat(absl::Hex(h, absl::kZeroPad16));
  }();
  return digest;
}

std::string BuildId() {
  const std::string digest = BinaryDigest();
  return digest.empty() ? std::string(kVersion) : absl::StrCat(kVersion, " ", digest);
}

}  // namespace slidedp
