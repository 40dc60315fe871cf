// libFuzzer target: the tokenizer's Encode on arbitrary bytes, with the real Qwen3 tokenizer.json
// (tests/data/tokenizer/qwen3; another file via SLIDEDP_TOKENIZER_JSON). Any input must encode
// without a crash to ids below vocab_size(), and decode back to the text the tokenizer actually
// saw: invalid UTF-8 repaired to U+FFFD, then NFC (special tokens are recognized and decode to
// their own text).
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <string>

#include "common/tokenizer/tokenizer.h"

#ifndef SLIDEDP_SOURCE_DIR
#define SLIDEDP_SOURCE_DIR "."
#endif

namespace {
std::unique_ptr<slidedp::tok::Tokenizer> g_tokenizer;
}

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  const char* env = getenv("SLIDEDP_TOKENIZER_JSON");
  const std::string path = env ? env : SLIDEDP_SOURCE_DIR "/tests/data/tokenizer/qwen3/tokenizer.json";
  auto t = slidedp::tok::Tokenizer::FromFile(path);
  if (!t.ok()) {
    fprintf(stderr, "cannot load %s: %s\n", path.c_str(), t.status().ToString().c_str());
    abort();
  }
  g_tokenizer = std::move(*t);
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using slidedp::tok::Tokenizer;
  absl::string_view text(reinterpret_cast<const char*>(data), size);
  std::vector<uint32_t> ids = g_tokenizer->Encode(text);
  for (uint32_t id : ids) {
    if (id >= g_tokenizer->vocab_size()) {
      fprintf(stderr, "id %u >= vocab_size %lld\n", id, (long long)g_tokenizer->vocab_size());
      abort();
    }
  }
  if (size > 0 && ids.empty()) abort();
  std::string seen = Tokenizer::RepairUtf8(text);
  if (g_tokenizer->normalizes_nfc()) seen = Tokenizer::NfcNormalize(seen);
  const std::string decoded = g_tokenizer->Decode(ids);
  if (decoded != seen) {
    fprintf(stderr, "Decode(Encode(x)) != normalized x: %zu ids, %zu vs %zu bytes\n", ids.size(), decoded.size(), seen.size());
    abort();
  }
  return 0;
}
