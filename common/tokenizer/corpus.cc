// JSONL corpus reader for tok_bench and tests.
#include "common/tokenizer/corpus.h"
#include "common/io/json_depth.h"
#include "common/status/status_macros.h"

#include <fstream>

#include "absl/strings/str_cat.h"
#include "nlohmann/json.hpp"

namespace slidedp::tok {

absl::StatusOr<std::vector<std::string>> ReadCorpusJsonl(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return absl::NotFoundError(absl::StrCat("cannot open corpus ", path));
  std::vector<std::string> docs;
  std::string line;
  int64_t line_no = 0;
  while (std::getline(in, line)) {
    ++line_no;
    if (line.empty()) continue;
    RETURN_IF_ERROR(CheckJsonDepth(line, absl::StrCat(path, ":", line_no)));
    auto j = nlohmann::json::parse(line, nullptr, false);
    if (j.is_discarded() || !j.is_object()) {
      return absl::InvalidArgumentError(absl::StrCat(path, ":", line_no, ": not a JSON object"));
    }
    if (j.contains("text") && j["text"].is_string()) {
      docs.push_back(j["text"].get<std::string>());
    } else if (j.contains("hex") && j["hex"].is_string()) {
      const std::string h = j["hex"].get<std::string>();
      if (h.size() % 2 != 0) return absl::InvalidArgumentError(absl::StrCat(path, ":", line_no, ": odd-length hex"));
      std::string bytes;
      for (size_t i = 0; i < h.size(); i += 2) bytes.push_back(static_cast<char>(std::stoi(h.substr(i, 2), nullptr, 16)));
      docs.push_back(std::move(bytes));
    } else {
      return absl::InvalidArgumentError(absl::StrCat(path, ":", line_no, ": needs a \"text\" or \"hex\" string"));
    }
  }
  return docs;
}

}  // namespace slidedp::tok
