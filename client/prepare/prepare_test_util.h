// Shared by the prepare tests: where the source tree's test data is, and the Qwen3 test tokenizer.
#pragma once

#include <cstdlib>
#include <string>

#include "common/tokenizer/tokenizer.h"
#include "gtest/gtest.h"

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

}  // namespace slidedp::prepare::test_data
