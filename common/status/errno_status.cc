// Maps errno values to the absl/gRPC status code that fits.
#include <cerrno>
#include <cstring>

#include "common/status/status_macros.h"

namespace slidedp {

absl::Status ErrnoStatus(absl::string_view what, int err) {
  std::string msg = absl::StrCat(what, ": ", std::strerror(err));
  switch (err) {
    case ENOENT:
      return absl::NotFoundError(msg);
    case EEXIST:
      return absl::AlreadyExistsError(msg);
    case EACCES:
    case EPERM:
      return absl::PermissionDeniedError(msg);
    case ENOSPC:
    case ENOMEM:
    case EMFILE:
    case ENFILE:
    case EDQUOT:
      return absl::ResourceExhaustedError(msg);
    case EINVAL:
    case ENAMETOOLONG:
      return absl::InvalidArgumentError(msg);
    // The file system's state, not a bug: a read-only mount, a path through a file, a loop of
    // links, a rename across file systems, a busy or non-empty directory.
    case EROFS:
    case ENOTDIR:
    case EISDIR:
    case ELOOP:
    case EXDEV:
    case EBUSY:
    case ENOTEMPTY:
    case ETXTBSY:
      return absl::FailedPreconditionError(msg);
    case ETIMEDOUT:
      return absl::DeadlineExceededError(msg);
    case EINTR:
    case EAGAIN:
      return absl::UnavailableError(msg);
    default:
      return absl::InternalError(msg);
  }
}

}  // namespace slidedp
