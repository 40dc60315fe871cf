// The output-path policy: resolve output.dir, then check it against the roots; see output_policy.h.
#include "hostd/core/output_policy.h"

#include <sys/stat.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <memory>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace slidedp::hostd {
namespace {

namespace fs = std::filesystem;

// A path from a spec, fit to quote in a message: unprintable bytes become '?'.
std::string Printable(const std::string& s) {
  std::string out = s;
  for (char& c : out) {
    const auto u = static_cast<unsigned char>(c);
    if (u < 0x20 || u == 0x7f) c = '?';
  }
  return out;
}

// realpath(3) of `p`, or the errno it failed with.
absl::StatusOr<fs::path> RealPath(const fs::path& p, int* err) {
  std::unique_ptr<char, decltype(&std::free)> real(::realpath(p.c_str(), nullptr), &std::free);
  if (!real) {
    *err = errno;
    return absl::UnknownError(std::strerror(*err));
  }
  return fs::path(real.get());
}

// Whether `p` is `root` or below it, component by component ("/a/bc" is not below "/a/b").
bool IsWithin(const fs::path& p, const fs::path& root) {
  auto [r, q] = std::mismatch(root.begin(), root.end(), p.begin(), p.end());
  return r == root.end();
}

absl::Status LookupError(const std::string& output_dir, const fs::path& at, int err) {
  const std::string why = absl::StrCat("output.dir ", Printable(output_dir), ": cannot look up ",
                                       Printable(at.string()), " (", std::strerror(err), ")");
  return err == EACCES ? absl::PermissionDeniedError(why) : absl::FailedPreconditionError(why);
}

}  // namespace

absl::StatusOr<OutputPolicy> OutputPolicy::Create(const std::string& root, const std::vector<std::string>& extra_roots,
                                                  OutputAnywhere anywhere) {
  OutputPolicy p;
  p.anywhere = anywhere;
  if (root.empty()) return absl::FailedPreconditionError("no output root: give --output-root DIR or --state-dir DIR");
  std::error_code ec;
  const fs::path absolute_root = fs::absolute(root, ec);
  if (!ec) fs::create_directories(absolute_root, ec);
  if (ec)
    return absl::FailedPreconditionError(absl::StrCat("cannot create the output root ", root, ": ", ec.message()));
  int err = 0;
  auto real_root = RealPath(absolute_root, &err);
  if (!real_root.ok()) return LookupError(root, absolute_root, err);
  p.root = real_root->string();
  for (const std::string& extra : extra_roots) {
    const fs::path absolute_extra = fs::absolute(extra, ec);
    auto real = ec ? absl::StatusOr<fs::path>(absl::UnknownError(ec.message())) : RealPath(absolute_extra, &err);
    if (!real.ok()) {
      return absl::FailedPreconditionError(
          absl::StrCat("extra output root ", extra, ": ", ec ? ec.message() : std::strerror(err)));
    }
    p.extra_roots.push_back(real->string());
  }
  return p;
}

absl::StatusOr<std::string> ResolveOutputDir(const OutputPolicy& policy, const std::string& output_dir) {
  if (policy.root.empty()) return absl::FailedPreconditionError("hostd has no output root (--output-root)");
  if (output_dir.empty()) return absl::InvalidArgumentError("output.dir is empty");
  if (output_dir.find('\0') != std::string::npos) {
    return absl::InvalidArgumentError(absl::StrCat("output.dir ", Printable(output_dir), " holds a NUL byte"));
  }
  // Lexically first: `..` and `.` go, a relative path lands below the root. The path the job
  // uses is the one resolved here, so what the kernel would make of the text as written no
  // longer matters.
  fs::path p(output_dir);
  if (p.is_relative()) p = fs::path(policy.root) / p;
  p = p.lexically_normal();
  if (!p.has_filename() && p != p.root_path()) p = p.parent_path();  // "a/b/" -> "a/b"

  // The longest part that exists (lstat: a dangling symbolic link exists), then its real path.
  // What lies below it does not exist yet, so it holds no symbolic link to resolve.
  fs::path existing = p;
  std::vector<fs::path> missing;  // innermost first
  struct stat st;
  while (::lstat(existing.c_str(), &st) != 0) {
    const int err = errno;
    // ENOTDIR: a part is a file; the directory check at submit (CheckOutputDir) names it.
    if (err != ENOENT && err != ENOTDIR) return LookupError(output_dir, existing, err);
    missing.push_back(existing.filename());
    existing = existing.parent_path();
  }
  int err = 0;
  auto real = RealPath(existing, &err);
  if (!real.ok()) {
    if (err == ENOENT || err == ENOTDIR) {
      return absl::PermissionDeniedError(
          absl::StrCat("output.dir ", Printable(output_dir), ": ", Printable(existing.string()),
                       " is a symbolic link to a path that does not exist, so whether it stays inside the output root ",
                       policy.root, " cannot be checked"));
    }
    return LookupError(output_dir, existing, err);
  }
  fs::path resolved = *real;
  for (auto it = missing.rbegin(); it != missing.rend(); ++it) resolved /= *it;

  if (policy.anywhere == OutputAnywhere::kYes) return resolved.string();
  if (IsWithin(resolved, policy.root)) return resolved.string();
  for (const std::string& extra : policy.extra_roots) {
    if (IsWithin(resolved, extra)) return resolved.string();
  }
  std::string where = absl::StrCat("the output root ", policy.root);
  if (!policy.extra_roots.empty()) absl::StrAppend(&where, " (or below ", absl::StrJoin(policy.extra_roots, ", "), ")");
  std::string how = " is";
  if (resolved != p) {
    how = absl::StrCat(" resolves through a symbolic link to ", Printable(resolved.string()), ",");
  } else if (resolved.string() != output_dir) {
    how = absl::StrCat(" (", Printable(resolved.string()), ") is");
  }
  return absl::PermissionDeniedError(
      absl::StrCat("output.dir ", Printable(output_dir), how, " outside ", where,
                   ": give a relative path (it resolves inside the root) or one below it"));
}

}  // namespace slidedp::hostd
