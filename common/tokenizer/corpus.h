// Reads the tokenizer test/benchmark corpus: JSONL, one document per line, either
// {"text": "..."} or {"hex": "..."} (raw bytes, for invalid UTF-8 the JSON cannot carry).
// Shared by tok_bench and the tokenizer tests; tools/tokenizer/*.py read the same format.
#pragma once

#include <string>
#include <vector>

#include "absl/status/statusor.h"

namespace slidedp::tok {

absl::StatusOr<std::vector<std::string>> ReadCorpusJsonl(const std::string& path);

}  // namespace slidedp::tok
