// Token batch JSON -> MicroBatches.
#include "tools/verify/token_batch.h"

#include <algorithm>
#include <fstream>
#include <sstream>

#include "absl/strings/str_cat.h"
#include "common/status/status_macros.h"
#include "nlohmann/json.hpp"

namespace slidedp::verify {
namespace {

// Appends one row's documents to mb.
void AppendRow(const std::vector<int32_t>& row, const std::vector<int64_t>& doc_lens, MicroBatch& mb) {
  if (mb.cu_seqlens.empty()) mb.cu_seqlens.push_back(0);
  std::vector<int64_t> lens = doc_lens;
  if (lens.empty()) lens.push_back(static_cast<int64_t>(row.size()));
  int64_t begin = 0;
  for (int64_t len : lens) {
    const int64_t end = begin + len;
    for (int64_t t = begin; t < end; ++t) {
      mb.tokens.push_back(row[t]);
      mb.positions.push_back(static_cast<int32_t>(t - begin));
      mb.labels.push_back(t + 1 < end ? row[t + 1] : kIgnoreIndex);
    }
    mb.cu_seqlens.push_back(static_cast<int32_t>(mb.tokens.size()));
    mb.max_seqlen = std::max<int32_t>(mb.max_seqlen, static_cast<int32_t>(len));
    begin = end;
  }
}

}  // namespace

absl::StatusOr<TokenBatch> ParseTokenBatch(absl::string_view json_text, const std::string& where) {
  nlohmann::json j = nlohmann::json::parse(json_text.begin(), json_text.end(), nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded() || !j.is_object()) {
    return absl::InvalidArgumentError(absl::StrCat(where, ": not a JSON object"));
  }
  if (!j.contains("rows") || !j["rows"].is_array() || j["rows"].empty()) {
    return absl::InvalidArgumentError(absl::StrCat(where, ": \"rows\" must be a non-empty list of token lists"));
  }
  TokenBatch batch;
  const nlohmann::json& rows = j["rows"];
  for (size_t r = 0; r < rows.size(); ++r) {
    if (!rows[r].is_array() || rows[r].empty()) {
      return absl::InvalidArgumentError(absl::StrCat(where, ": rows[", r, "] must be a non-empty list of token ids"));
    }
    std::vector<int32_t> row;
    row.reserve(rows[r].size());
    for (size_t t = 0; t < rows[r].size(); ++t) {
      const nlohmann::json& v = rows[r][t];
      if (!v.is_number_integer() || v.get<int64_t>() < 0 || v.get<int64_t>() > INT32_MAX) {
        return absl::InvalidArgumentError(
            absl::StrCat(where, ": rows[", r, "][", t, "] = ", v.dump(), " is not a token id"));
      }
      row.push_back(static_cast<int32_t>(v.get<int64_t>()));
    }
    batch.rows.push_back(std::move(row));
  }
  batch.doc_lens.assign(batch.rows.size(), {});
  if (j.contains("doc_lens") && !j["doc_lens"].is_null()) {
    const nlohmann::json& dl = j["doc_lens"];
    if (!dl.is_array() || dl.size() != rows.size()) {
      return absl::InvalidArgumentError(
          absl::StrCat(where, ": \"doc_lens\" must be a list with one entry per row (", rows.size(), ")"));
    }
    for (size_t r = 0; r < dl.size(); ++r) {
      if (!dl[r].is_array()) {
        return absl::InvalidArgumentError(absl::StrCat(where, ": doc_lens[", r, "] must be a list"));
      }
      int64_t sum = 0;
      for (size_t d = 0; d < dl[r].size(); ++d) {
        const nlohmann::json& v = dl[r][d];
        if (!v.is_number_integer() || v.get<int64_t>() <= 0) {
          return absl::InvalidArgumentError(
              absl::StrCat(where, ": doc_lens[", r, "][", d, "] = ", v.dump(), " must be a positive length"));
        }
        batch.doc_lens[r].push_back(v.get<int64_t>());
        sum += v.get<int64_t>();
      }
      if (!dl[r].empty() && sum != static_cast<int64_t>(batch.rows[r].size())) {
        return absl::InvalidArgumentError(absl::StrCat(where, ": doc_lens[", r, "] sums to ", sum, " but row ", r,
                                                       " has ", batch.rows[r].size(), " tokens"));
      }
    }
  }
  return batch;
}

absl::StatusOr<TokenBatch> ReadTokenBatchFile(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return absl::NotFoundError(absl::StrCat("cannot open token batch file ", path));
  std::ostringstream text;
  text << in.rdbuf();
  return ParseTokenBatch(text.str(), path);
}

std::vector<MicroBatch> BuildMicroBatches(const TokenBatch& batch, Grouping grouping) {
  std::vector<MicroBatch> out;
  for (size_t r = 0; r < batch.rows.size(); ++r) {
    if (grouping == Grouping::kPerRow || out.empty()) out.emplace_back();
    AppendRow(batch.rows[r], batch.doc_lens[r], out.back());
  }
  return out;
}

}  // namespace slidedp::verify
