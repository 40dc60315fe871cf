// ReadSmallFile: regular files only, size-capped, never blocking on open; see small_file.h.
#include "common/io/small_file.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>

#include "absl/cleanup/cleanup.h"
#include "absl/strings/str_cat.h"
#include "common/status/status_macros.h"

namespace slidedp {

absl::StatusOr<std::string> ReadSmallFile(const std::string& path, uint64_t max_bytes, absl::string_view what) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_NONBLOCK | O_CLOEXEC | O_NOCTTY);
  if (fd < 0) return ErrnoStatus(absl::StrCat("open ", what, " ", path), errno);
  absl::Cleanup close_fd = [fd] { ::close(fd); };
  struct stat st;
  if (::fstat(fd, &st) != 0) return ErrnoStatus(absl::StrCat("stat ", path), errno);
  if (!S_ISREG(st.st_mode)) {
    return absl::InvalidArgumentError(absl::StrCat(what, " ", path, " is not a regular file"));
  }
  if (static_cast<uint64_t>(st.st_size) > max_bytes) {
    return absl::InvalidArgumentError(
        absl::StrCat(what, " ", path, " is ", st.st_size, " bytes, more than the ", max_bytes, " one may have"));
  }
  std::string out(static_cast<size_t>(st.st_size), '\0');
  size_t got = 0;
  while (got < out.size()) {
    const ssize_t n = ::pread(fd, out.data() + got, out.size() - got, static_cast<off_t>(got));
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) return ErrnoStatus(absl::StrCat("read ", path), errno);
    if (n == 0) break;  // shrank while we read: what is there
    got += static_cast<size_t>(n);
  }
  out.resize(got);
  return out;
}

}  // namespace slidedp
