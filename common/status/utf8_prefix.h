// The cut that keeps a message valid UTF-8: used where a status message or a job's error is
// bounded (grpc_status.h, common/jobspec BoundedLine). Header-only: grpc_status.h is too.
#pragma once

#include <cstddef>

#include "absl/strings/string_view.h"

namespace slidedp {

// The longest prefix of `text` of at most max_bytes bytes that does not end inside a UTF-8
// character (text assumed UTF-8): the cut backs off the continuation bytes (10xxxxxx) of a
// character it would split.
inline absl::string_view Utf8Prefix(absl::string_view text, size_t max_bytes) {
  if (text.size() <= max_bytes) return text;
  size_t cut = max_bytes;
  while (cut > 0 && (static_cast<unsigned char>(text[cut]) & 0xC0) == 0x80) --cut;
  return text.substr(0, cut);
}

}  // namespace slidedp
