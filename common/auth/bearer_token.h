// Bearer tokens for hostd's TCP listener (docs/operations.md, "Who may use hostd"). hostd
// (--auth-token-file), the CLI and the worker (--token-file, SLIDEDP_TOKEN_FILE) read one file
// format: the token on one line. A token grants what the hostd user may do, so its file must not
// be readable by anyone else, and comparing it must not leak how much of a guess was right.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace slidedp::auth {

inline constexpr uint64_t kMaxTokenFileBytes = 4096;
// Shorter tokens are refused: `openssl rand -hex 32` makes 64 characters.
inline constexpr size_t kMinTokenBytes = 16;

// The token in `path` (a regular file, read with ReadSmallFile), without its line end.
// PERMISSION_DENIED when group or others have any access to the file (chmod 600 fixes it);
// INVALID_ARGUMENT when the token is shorter than kMinTokenBytes or holds a byte outside
// printable ASCII (it travels as an HTTP/2 header value). Messages never quote the token.
absl::StatusOr<std::string> ReadTokenFile(const std::string& path);

// Whether `presented` equals `expected`. The time taken depends on expected.size() only, never on
// where the first difference lies.
bool TokenEquals(absl::string_view expected, absl::string_view presented);

}  // namespace slidedp::auth
