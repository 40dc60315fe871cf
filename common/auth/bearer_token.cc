// Token files and constant-time comparison; see bearer_token.h.
#include "common/auth/bearer_token.h"

#include <sys/stat.h>

#include <cerrno>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/io/small_file.h"
#include "common/status/status_macros.h"

namespace slidedp::auth {

absl::StatusOr<std::string> ReadTokenFile(const std::string& path) {
  // The mode is checked on the path before reading it. Swapping the file in between needs write
  // access to its directory, which only the token's owner should have anyway.
  struct stat st;
  if (::stat(path.c_str(), &st) != 0) return ErrnoStatus(absl::StrCat("token file ", path), errno);
  if ((st.st_mode & 0077) != 0) {
    return absl::PermissionDeniedError(
        absl::StrFormat("token file %s is mode %04o: group or others may read or change it; chmod 600 %s", path,
                        st.st_mode & 07777, path));
  }
  ASSIGN_OR_RETURN(std::string token, ReadSmallFile(path, kMaxTokenFileBytes, "token file"));
  while (!token.empty() && (token.back() == '\n' || token.back() == '\r')) token.pop_back();
  for (size_t i = 0; i < token.size(); ++i) {
    const auto c = static_cast<unsigned char>(token[i]);
    if (c < 0x21 || c > 0x7e) {
      return absl::InvalidArgumentError(absl::StrCat("token file ", path, ": byte ", i,
                                                     " is not printable ASCII (the token is one line of "
                                                     "printable characters without spaces)"));
    }
  }
  if (token.size() < kMinTokenBytes) {
    return absl::InvalidArgumentError(absl::StrCat("token file ", path, " holds ", token.size(),
                                                   " characters; a token needs at least ", kMinTokenBytes,
                                                   " (make one with: openssl rand -hex 32)"));
  }
  return token;
}

bool TokenEquals(absl::string_view expected, absl::string_view presented) {
  // Every byte of `expected` is compared, whatever `presented` holds; a length mismatch is one
  // more difference bit, not an early return. The accumulator is volatile so that the compiler
  // cannot turn the loop into a comparison that stops at the first difference.
  volatile unsigned char diff = expected.size() == presented.size() ? 0 : 1;
  for (size_t i = 0; i < expected.size(); ++i) {
    const unsigned char p = i < presented.size() ? static_cast<unsigned char>(presented[i]) : 0;
    diff = diff | (static_cast<unsigned char>(expected[i]) ^ p);
  }
  return diff == 0;
}

}  // namespace slidedp::auth
