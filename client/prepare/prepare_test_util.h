// Shared by the prepare tests: where the source tree's test data is, the Qwen3 test tokenizer, and
// the readers and token checks of the chat-template tests.
#pragma once

#include <cstdint>
#include <cstdlib>
#include <fstream>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "client/prepare/prepare.h"
#include "common/tokenizer/tokenizer.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"

namespace slidedp::prepare::test_data {

// The source tree: SLIDEDP_SOURCE_DIR, else the one this file was compiled from.
inline std::string SourceDir() {
  const char* s = std::getenv("SLIDEDP_SOURCE_DIR");
  if (s != nullptr) return s;
  std::string here = __FILE__;
  return here.substr(0, here.rfind("/client/prepare/"));
}

// tests/data/tokenizer/qwen3: Qwen3's tokenizer files.
inline std::string Qwen3Dir() { return SourceDir() + "/tests/data/tokenizer/qwen3"; }

// Qwen3's tokenizer, loaded once.
inline const tok::Tokenizer& Qwen3() {
  static const tok::Tokenizer* t = [] {
    auto r = tok::Tokenizer::FromFile(Qwen3Dir() + "/tokenizer.json");
    EXPECT_TRUE(r.ok()) << r.status();
    return r->release();
  }();
  return *t;
}

inline nlohmann::json ReadJson(const std::string& path) {
  std::ifstream in(path);
  EXPECT_TRUE(in) << path;
  return nlohmann::json::parse(in);
}

inline std::vector<nlohmann::json> ReadJsonLines(const std::string& path) {
  std::ifstream in(path);
  EXPECT_TRUE(in) << path;
  std::vector<nlohmann::json> out;
  for (std::string line; std::getline(in, line);) {
    if (!line.empty()) out.push_back(nlohmann::json::parse(line));
  }
  return out;
}

// The tokenizer.json of `dir`, loaded once per directory.
inline const tok::Tokenizer& LoadTokenizer(const std::string& dir) {
  static auto* cache = new std::map<std::string, std::unique_ptr<tok::Tokenizer>>;
  auto& t = (*cache)[dir];
  if (t == nullptr) {
    auto r = tok::Tokenizer::FromFile(dir + "/tokenizer.json");
    EXPECT_TRUE(r.ok()) << r.status();
    t = std::move(*r);
  }
  return *t;
}

// How many of d's `end_id` tokens are trained; none is followed by a trained token (nothing after a
// reply's end is trained until the next reply).
inline int TrainedEnds(const TokenizedDocument& d, uint32_t end_id, const std::string& where) {
  int trained_ends = 0;
  for (size_t k = 0; k < d.tokens.size(); ++k) {
    if (d.tokens[k] == end_id && d.loss_mask[k]) {
      ++trained_ends;
      if (k + 1 < d.tokens.size()) {
        EXPECT_EQ(d.loss_mask[k + 1], 0) << where;
      }
    }
  }
  return trained_ends;
}

}  // namespace slidedp::prepare::test_data
