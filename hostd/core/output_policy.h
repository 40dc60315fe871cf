// Where jobs may write: hostd's output-path policy (docs/operations.md, "Output paths"). hostd
// writes checkpoints as its own user (under systemd: the service user, in a sandbox that leaves
// /var/lib/slidedp writable), so a spec's output.dir must not name any directory that user can
// write. A relative output.dir resolves inside the output root; an absolute one must lie below
// the root or an extra root once `..` and the symbolic links of its existing part are resolved,
// unless the operator lets jobs write anywhere hostd can.
//
// The check is made at submit. It cannot stop a local user who can write inside a root from
// replacing a directory with a symbolic link later: keep the roots writable by hostd only.
#pragma once

#include <string>
#include <vector>

#include "absl/status/statusor.h"

namespace slidedp::hostd {

enum class OutputAnywhere { kNo, kYes };

struct OutputPolicy {
  std::string root;                      // absolute, no symbolic links: relative output.dir values resolve here
  std::vector<std::string> extra_roots;  // same form: absolute output.dir values may also lie below these
  OutputAnywhere anywhere = OutputAnywhere::kNo;

  // The policy with `root` created if missing and every root made absolute (relative to hostd's
  // working directory) and free of symbolic links. FAILED_PRECONDITION names a root that cannot
  // be created or an extra root that does not exist.
  static absl::StatusOr<OutputPolicy> Create(const std::string& root, const std::vector<std::string>& extra_roots,
                                             OutputAnywhere anywhere);
};

// The directory a job whose spec says `output_dir` (as written: relative or absolute) writes to:
// absolute, without `..`, with the symbolic links of its existing part resolved. That path is
// what the job uses and what its record shows.
//   PERMISSION_DENIED: it lies outside every root (the message names the root), or passes through
//     a symbolic link whose target does not exist (where it leads cannot be checked);
//   INVALID_ARGUMENT: it is empty or holds a NUL byte;
//   FAILED_PRECONDITION: the policy has no root, or a part cannot be looked up (too long, a loop
//     of symbolic links; PERMISSION_DENIED when hostd may not search a directory).
absl::StatusOr<std::string> ResolveOutputDir(const OutputPolicy& policy, const std::string& output_dir);

}  // namespace slidedp::hostd
