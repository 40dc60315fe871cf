// RETURN_IF_ERROR / ASSIGN_OR_RETURN for absl::Status(Or): abseil 20220623 does not ship them.
#pragma once

#include <utility>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"

#define SLIDEDP_CONCAT_INNER_(a, b) a##b
#define SLIDEDP_CONCAT_(a, b) SLIDEDP_CONCAT_INNER_(a, b)

#define RETURN_IF_ERROR(expr)                                   \
  do {                                                          \
    ::absl::Status slidedp_status_ = (expr);                    \
    if (!slidedp_status_.ok()) return slidedp_status_;          \
  } while (0)

#define ASSIGN_OR_RETURN(lhs, rexpr) \
  SLIDEDP_ASSIGN_OR_RETURN_IMPL_(SLIDEDP_CONCAT_(slidedp_statusor_, __LINE__), lhs, rexpr)

#define SLIDEDP_ASSIGN_OR_RETURN_IMPL_(statusor, lhs, rexpr) \
  auto statusor = (rexpr);                                   \
  if (!statusor.ok()) return std::move(statusor).status();   \
  lhs = std::move(statusor).value()

namespace slidedp {

// Prefixes a status message with context, keeping the code: "loading shard x: <original>".
inline absl::Status Annotate(const absl::Status& s, absl::string_view context) {
  if (s.ok()) return s;
  return absl::Status(s.code(), absl::StrCat(context, ": ", s.message()));
}

// errno -> Status with the call that failed, e.g. ErrnoStatus("fallocate /slidedp.x", errno).
absl::Status ErrnoStatus(absl::string_view what, int err);

}  // namespace slidedp
