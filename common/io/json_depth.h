// Nesting limits for JSON read from files (config.json, manifests, trainer_state.json,
// tokenizer.json, safetensors headers). The JSON library parses iteratively but dumps, copies and
// compares recursively: a file of a million '[' parses, then overflows the stack wherever it is
// printed or copied. Checked on the text, before parsing.
#pragma once

#include "absl/status/status.h"
#include "absl/strings/string_view.h"

namespace slidedp {

// Every JSON file this project reads nests a few levels; HF's tokenizer.json about six.
inline constexpr int kMaxJsonFileDepth = 64;

// The deepest nesting of {} / [] outside strings (escapes honoured), counting stops once it
// exceeds stop_above; -1 for unbalanced brackets.
int JsonNestingDepth(absl::string_view text, int stop_above = kMaxJsonFileDepth);

// INVALID_ARGUMENT naming `what` when the text nests deeper than max_depth; OK otherwise
// (unbalanced text is left to the parser's own error).
absl::Status CheckJsonDepth(absl::string_view text, absl::string_view what, int max_depth = kMaxJsonFileDepth);

}  // namespace slidedp
