// Tokenizer tests on the real Qwen3 tokenizer.json: HF-produced expected ids for the committed
// sample (tests/data/tokenizer/sample.jsonl, ids from tools/tokenizer/hf_expected_ids.py),
// special tokens, offsets, decode round trip, invalid UTF-8 repair as Python/Rust do it; on a
// tokenizer.json of Qwen3.5's structure; and on SentencePiece-style tokenizer.json files of
// Mistral's, transformers' Metaspace and Gemma 3's structure and variants of them (those ids,
// offsets and decodes from HF tokenizers through its npm package).
#include "common/tokenizer/tokenizer.h"

#include <algorithm>
#include <cstdlib>
#include <fstream>

#include "absl/container/flat_hash_set.h"
#include "absl/strings/str_cat.h"
#include "common/tokenizer/corpus.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"

namespace slidedp::tok {
namespace {

std::string SourceDir() {
  const char* s = std::getenv("SLIDEDP_SOURCE_DIR");
  if (s != nullptr) return s;
  std::string here = __FILE__;  // .../common/tokenizer/tokenizer_test.cc
  return here.substr(0, here.rfind("/common/tokenizer/"));
}
std::string DataDir() { return SourceDir() + "/tests/data/tokenizer"; }

const Tokenizer& Qwen3() {
  static const Tokenizer* tok = [] {
    auto t = Tokenizer::FromFile(DataDir() + "/qwen3/tokenizer.json");
    EXPECT_TRUE(t.ok()) << t.status();
    return t.ok() ? t->release() : nullptr;
  }();
  return *tok;
}

TEST(Tokenizer, LoadsQwen3) {
  const Tokenizer& t = Qwen3();
  EXPECT_EQ(t.vocab_size(), 151669);
  EXPECT_TRUE(t.normalizes_nfc());
  EXPECT_EQ(t.added_tokens().size(), 26u);
  EXPECT_EQ(*t.TokenId("<|im_end|>"), 151645u);
  EXPECT_EQ(*t.TokenId(" "), 220u);
  EXPECT_EQ(t.TokenId("<|not_a_token|>").status().code(), absl::StatusCode::kNotFound);
}

TEST(Tokenizer, MatchesHfExpectedIdsOnCommittedSample) {
  auto docs = ReadCorpusJsonl(DataDir() + "/sample.jsonl");
  ASSERT_TRUE(docs.ok()) << docs.status();
  std::ifstream in(DataDir() + "/sample.expected.jsonl");
  ASSERT_TRUE(in) << "missing sample.expected.jsonl (tools/tokenizer/hf_expected_ids.py writes it)";
  std::string line;
  size_t i = 0;
  while (std::getline(in, line)) {
    ASSERT_LT(i, docs->size());
    auto expected = nlohmann::json::parse(line)["ids"].get<std::vector<uint32_t>>();
    EXPECT_EQ(Qwen3().Encode((*docs)[i]), expected) << "document " << i << ": " << (*docs)[i].substr(0, 80);
    ++i;
  }
  EXPECT_EQ(i, docs->size());
  // The batch path gives the same ids in the same order.
  auto batch = Qwen3().EncodeBatch(*docs, 3);
  for (size_t k = 0; k < docs->size(); ++k) EXPECT_EQ(batch[k], Qwen3().Encode((*docs)[k])) << k;
}

TEST(Tokenizer, SpecialTokensRecognizedOrTokenizedAsText) {
  const Tokenizer& t = Qwen3();
  auto ids = t.Encode("<|im_start|>user\nhi<|im_end|>");
  ASSERT_GE(ids.size(), 4u);
  EXPECT_EQ(ids.front(), 151644u);
  EXPECT_EQ(ids.back(), 151645u);
  auto as_text = t.Encode("<|im_start|>user", SpecialTokens::kAsText);
  EXPECT_THAT(as_text, ::testing::Not(::testing::Contains(151644u)));
  EXPECT_GT(as_text.size(), 3u);
  // Non-special added tokens still match (HF split_special_tokens semantics).
  EXPECT_THAT(t.Encode("<think>", SpecialTokens::kAsText), ::testing::ElementsAre(151667u));
}

TEST(Tokenizer, StartsPointAtEachTokensBytes) {
  const Tokenizer& t = Qwen3();
  const std::string text = "<|im_start|>assistant\n你好, world!<|im_end|>\n  x";
  std::vector<uint32_t> starts;
  auto ids = t.Encode(text, SpecialTokens::kRecognize, Normalized::kNo, &starts);
  ASSERT_EQ(starts.size(), ids.size());
  for (size_t k = 0; k < ids.size(); ++k) {
    const std::string& b = t.TokenBytes(ids[k]);
    EXPECT_EQ(text.substr(starts[k], b.size()), b) << k;
  }
}

TEST(Tokenizer, DecodeInvertsEncodeUpToNfc) {
  const Tokenizer& t = Qwen3();
  auto docs = ReadCorpusJsonl(DataDir() + "/sample.jsonl");
  ASSERT_TRUE(docs.ok());
  for (const std::string& d : *docs) {
    const std::string fixed = Tokenizer::NfcNormalize(Tokenizer::RepairUtf8(d));
    EXPECT_EQ(t.Decode(t.Encode(d)), fixed);
  }
  EXPECT_EQ(t.Decode(t.Encode("<|im_start|>hi<|im_end|>"), SkipSpecial::kYes), "hi");
}

TEST(Tokenizer, RepairsInvalidUtf8LikePython) {
  // Python: b'a\xc3\x28b\xc0\xafc\xed\xa0\x80d\xe2\x82'.decode('utf-8', 'replace')
  const std::string bad = "a\xc3\x28" "b\xc0\xaf" "c\xed\xa0\x80" "d\xe2\x82";
  const std::string want = "a\xEF\xBF\xBD(b\xEF\xBF\xBD\xEF\xBF\xBD" "c\xEF\xBF\xBD\xEF\xBF\xBD\xEF\xBF\xBD" "d\xEF\xBF\xBD";
  EXPECT_EQ(Tokenizer::RepairUtf8(bad), want);
  EXPECT_FALSE(Tokenizer::IsValidUtf8(bad));
  EXPECT_TRUE(Tokenizer::IsValidUtf8(want));
  EXPECT_EQ(Qwen3().Encode(bad), Qwen3().Encode(want));
}

TEST(Tokenizer, NfcComposes) {
  EXPECT_EQ(Tokenizer::NfcNormalize("e\xCC\x81"), "\xC3\xA9");  // e + combining acute -> é
  EXPECT_EQ(Tokenizer::NfcNormalize("plain"), "plain");
  EXPECT_EQ(Qwen3().Encode("caf" "e\xCC\x81"), Qwen3().Encode("caf\xC3\xA9"));
}

TEST(Tokenizer, MongolianVowelSeparatorIsNotWhitespace) {
  // U+180E is not White_Space (Unicode >= 6.3; Oniguruma, which HF uses, agrees) but PCRE2 10.42's
  // UCP \\s still includes it. Text and the HF ids of its first 6 tokens come from the fuzz corpus
  // run recorded in docs/tokenizer.md (document 221).
  const std::string text = "\u3000 \u180e\uff0d\uff6b\uff09\uff51\uff13\uff6b\uff42\uff08\uff5d\uff65\uff41\uff17\uff36\uff65\uff0e\uff59\u0365\u0366\u034a\u036a\u035d\u030f\u0959\u0950\u0947\u095c\u0938\u0902\u097c\u0962\u097e\u0130\u1e9e\u017f\u0131\u0130\u017f\u00df\u00df\u00ad\u202e\u200b\u202e\u0e10\u0e5a\u0e3b\u0e54\u0e09\u0e39\u0e54\u0e04\u0e39\u0e22\u0e36\u0e18\u0e04\u0e16\u0e0d\u0e18\u3097\u304f\u30b5\u308f\u305f\u30b5\u3079\u30d8\u3043\u30a9\u30f7\u3085\u30ff\u3093\u30e3\u3093\u30ea\u3080\u3099\u30a3\u306a\u30ad\u3062\u30aa\uff02\uff46\uff2b\uff29\uff1f\uff07\uff3f\uff00\uff45\uff08\uff28\uff51\uff01\uff04\uff00\uff4b\uff52\uff6f\uff4f\uff33\uff59\uff33\uff07\u11ef\u1176\u11f2\u11f0\u1112\u1195\u11b2\u113e\u1192\u1137\u11d4\u0e0c\u0e5f\u0e13\u0e15\u0e18\u0e01\u0e59\u115b\u116c\u11d3\u1127\u1116\u1127\u1169\u11be\u11b9\u1169";
  auto ids = Qwen3().Encode(text);
  ASSERT_GE(ids.size(), 6u);
  EXPECT_EQ(std::vector<uint32_t>(ids.begin(), ids.begin() + 6),
            (std::vector<uint32_t>{22441, 86089, 254, 236, 89481, 145380}));
}

// Ids that are negative, past 2^31 or far past the vocabulary are refused by name (a negative
// one wrapped to 2^32 - 1 and sized the id tables past memory); so is JSON nested without end.
TEST(Tokenizer, HostileIdsAndNestingAreRefused) {
  std::ifstream f(DataDir() + "/qwen3/tokenizer.json");
  const nlohmann::json base = nlohmann::json::parse(f);
  ASSERT_TRUE(base.contains("added_tokens") && !base["added_tokens"].empty());
  for (const nlohmann::json& id : {nlohmann::json(-1), nlohmann::json(4294967295u), nlohmann::json(3000000000u),
                                  nlohmann::json(200000000), nlohmann::json("7")}) {
    nlohmann::json added = base;
    added["added_tokens"][0]["id"] = id;
    auto a = Tokenizer::FromJson(added.dump());
    EXPECT_EQ(a.status().code(), absl::StatusCode::kInvalidArgument) << id.dump() << ": " << a.status();
    nlohmann::json vocab = base;
    vocab["model"]["vocab"].begin().value() = id;
    auto v = Tokenizer::FromJson(vocab.dump());
    EXPECT_EQ(v.status().code(), absl::StatusCode::kInvalidArgument) << id.dump() << ": " << v.status();
  }
  const std::string deep = std::string(100000, '[') + std::string(100000, ']');
  auto d = Tokenizer::FromJson(R"({"x": )" + deep + "}");
  EXPECT_EQ(d.status().code(), absl::StatusCode::kInvalidArgument) << d.status();
}

// The tokenizer's ids of each document of <corpus>.jsonl against HF's in <expected>.expected.jsonl
// (paths below the test data directory).
void ExpectHfIds(const Tokenizer& t, const std::string& corpus, const std::string& expected) {
  auto docs = ReadCorpusJsonl(DataDir() + "/" + corpus + ".jsonl");
  ASSERT_TRUE(docs.ok()) << docs.status();
  const std::string expected_path = DataDir() + "/" + expected + ".expected.jsonl";
  std::ifstream in(expected_path);
  ASSERT_TRUE(in) << expected_path;
  size_t i = 0;
  for (std::string line; std::getline(in, line); ++i) {
    ASSERT_LT(i, docs->size()) << corpus;
    EXPECT_EQ(t.Encode((*docs)[i]), nlohmann::json::parse(line)["ids"].get<std::vector<uint32_t>>())
        << expected << " document " << i << ": " << (*docs)[i].substr(0, 80);
  }
  EXPECT_EQ(i, docs->size()) << corpus;
}

// Qwen3.5's tokenizer.json structure (NFC; Split on its regex, whose letter runs take marks too;
// byte-level BPE) over a small generated vocabulary with Qwen3.5's 33 added tokens
// (qwen3.5-synthetic/, tools/tokenizer/npm_tokenizers_check.mjs make-qwen3.5); the expected ids
// are HF tokenizers 0.23.2's (the npm package) for the shared sample and for text heavy in marks.
const Tokenizer& Qwen3_5Synthetic() {
  static const Tokenizer* tok = [] {
    auto t = Tokenizer::FromFile(DataDir() + "/qwen3.5-synthetic/tokenizer.json");
    EXPECT_TRUE(t.ok()) << t.status();
    return t.ok() ? t->release() : nullptr;
  }();
  return *tok;
}

TEST(Tokenizer, Qwen3_5StructureMatchesHfExpectedIds) {
  const Tokenizer& t = Qwen3_5Synthetic();
  EXPECT_TRUE(t.normalizes_nfc());
  EXPECT_EQ(t.added_tokens().size(), 33u);
  EXPECT_EQ(t.vocab_size(), 1322 + 33);
  EXPECT_EQ(*t.TokenId("<|im_start|>"), 1322u + 1);
  EXPECT_EQ(*t.TokenId("</think>"), 1322u + 25);
  EXPECT_EQ(*t.TokenId("<|audio_pad|>"), 1322u + 32);
  ExpectHfIds(t, "sample", "qwen3.5-synthetic/sample");
  ExpectHfIds(t, "qwen3.5-synthetic/marks", "qwen3.5-synthetic/marks");
}

// GPT-OSS's tokenizer.json structure (o200k_harmony: no normalizer; Split on o200k's regex, which
// runs letters by case with \p{Lu}/\p{Ll}/\p{Lm}/\p{Lo}/\p{Lt} and marks; byte-level BPE) over a
// small generated vocabulary with harmony's added tokens (o200k-synthetic/, npm_tokenizers_check.mjs
// make-o200k); expected ids are HF tokenizers 0.23.2's (the npm package).
TEST(Tokenizer, O200kStructureMatchesHfExpectedIds) {
  auto loaded = Tokenizer::FromFile(DataDir() + "/o200k-synthetic/tokenizer.json");
  ASSERT_TRUE(loaded.ok()) << loaded.status();
  const Tokenizer& t = **loaded;
  EXPECT_FALSE(t.normalizes_nfc());
  EXPECT_EQ(t.added_tokens().size(), 15u);
  EXPECT_EQ(*t.TokenId("<|start|>"), 1336u + 8);
  EXPECT_EQ(*t.TokenId("<|return|>"), 1336u + 4);
  ExpectHfIds(t, "sample", "o200k-synthetic/sample");
  ExpectHfIds(t, "qwen3.5-synthetic/marks", "o200k-synthetic/marks");
  // Case runs (HF's pieces, probed through the npm package): a word starts at an uppercase letter
  // after lowercase ones ("helloWorld", "XMLHttpRequest"), an uppercase run keeps the lowercase run
  // after it, contractions ride along case-insensitively, and Unicode 16's U+1C89 (Cyrillic capital
  // TJE) is uppercase there (HF's Unicode; PCRE2's tables predate it).
  EXPECT_THAT(t.PreTokenize("helloWorld"), ::testing::ElementsAre("hello", "World"));
  EXPECT_THAT(t.PreTokenize("XMLHttpRequest"), ::testing::ElementsAre("XMLHttp", "Request"));
  EXPECT_THAT(t.PreTokenize("DON'T stop"), ::testing::ElementsAre("DON'T", " stop"));
  EXPECT_THAT(t.PreTokenize("a\u1C89\u1C8Ab"), ::testing::ElementsAre("a", "\u1C89\u1C8Ab"));
  EXPECT_THAT(t.PreTokenize("path/to/x\n"), ::testing::ElementsAre("path", "/to", "/x", "\n"));
}

TEST(Tokenizer, Qwen3_5LetterRunsTakeMarks) {
  // Devanagari vowel signs and the virama are marks: Qwen3's \p{L}+ cuts the word at each,
  // Qwen3.5's [\p{L}\p{M}]+ keeps it whole (a mark after a space starts a run with it).
  const std::string word = "\u0928\u092e\u0938\u094d\u0924\u0947";  // namaste
  EXPECT_THAT(Qwen3_5Synthetic().PreTokenize(" " + word + " \u0301a"), ::testing::ElementsAre(" " + word, " \u0301a"));
  EXPECT_GT(Qwen3().PreTokenize(" " + word).size(), 1u);
}

// HF's Oniguruma classifies by Unicode 16: U+1C89 (a Cyrillic letter new in 16.0) is a letter and
// U+11F50 (a Kawi digit, 15.0) a number there, which PCRE2 10.42 (Unicode 14) does not know.
TEST(Tokenizer, ClassesFollowHfUnicodeVersion) {
  for (const Tokenizer* t : {&Qwen3(), &Qwen3_5Synthetic()}) {
    EXPECT_THAT(t->PreTokenize("\u1C89's"), ::testing::ElementsAre("\u1C89", "'s"));
    EXPECT_THAT(t->PreTokenize("x\U00011F50\U00011F51"), ::testing::ElementsAre("x", "\U00011F50", "\U00011F51"));
  }
}

// HF's NFC has Unicode 9.0's tables: a mark assigned later (U+1AC0, Unicode 14) is an unknown code
// point there, which blocks composition across it; older marks reorder and compose as usual.
TEST(Tokenizer, NfcIsUnicode9LikeHf) {
  EXPECT_EQ(Tokenizer::NfcNormalize("a\u1AC0\u0301"), "a\u1AC0\u0301");
  EXPECT_EQ(Tokenizer::NfcNormalize("a\u0316\u0301"), "\u00E1\u0316");
  EXPECT_EQ(Tokenizer::NfcNormalize("a\u0301\u0316"), "\u00E1\u0316");
}

TEST(Tokenizer, RejectsUnsupportedModels) {
  EXPECT_EQ(Tokenizer::FromJson(R"({"model": {"type": "WordPiece", "vocab": {}}})").status().code(),
            absl::StatusCode::kUnimplemented);
  EXPECT_FALSE(Tokenizer::FromJson("not json").ok());
}

// ---------------------------------------------------------------------------------------------
// SentencePiece-style BPE (tests/data/tokenizer/sentencepiece/, made and checked by
// tools/tokenizer/npm_tokenizers_check.mjs make-sentencepiece / expected / variants).

std::string SentencePieceDir() { return DataDir() + "/sentencepiece"; }

std::vector<nlohmann::json> ReadJsonLines(const std::string& path) {
  std::ifstream in(path);
  EXPECT_TRUE(in) << path;
  std::vector<nlohmann::json> lines;
  for (std::string line; std::getline(in, line);) lines.push_back(nlohmann::json::parse(line));
  return lines;
}

nlohmann::json ReadJsonFile(const std::string& path) {
  std::ifstream in(path);
  EXPECT_TRUE(in) << path;
  return nlohmann::json::parse(in);
}

// Byte offsets into `text` (valid UTF-8) as code point indexes, as HF's npm offsets count.
std::vector<uint32_t> CodePointOffsets(const std::string& text, const std::vector<uint32_t>& byte_offsets) {
  std::vector<uint32_t> index(text.size() + 1);
  uint32_t chars = 0;
  for (size_t i = 0; i < text.size(); ++i) {
    if ((static_cast<unsigned char>(text[i]) & 0xC0) != 0x80) ++chars;  // a lead byte
    index[i] = chars - 1;
  }
  index[text.size()] = chars;
  std::vector<uint32_t> out;
  for (uint32_t o : byte_offsets) out.push_back(index[o]);
  return out;
}

class SentencePieceStyle : public ::testing::TestWithParam<const char*> {};

// Every line of the shared sample and of the byte-fallback corpus: HF's ids, token start offsets,
// decode of the ids, and the post-processor's special tokens.
TEST_P(SentencePieceStyle, MatchesHfIdsOffsetsAndDecode) {
  const std::string dir = SentencePieceDir() + "/" + GetParam();
  auto t = Tokenizer::FromFile(dir + "/tokenizer.json");
  ASSERT_TRUE(t.ok()) << t.status();
  EXPECT_FALSE((*t)->normalizes_nfc());
  absl::flat_hash_set<uint32_t> added_ids;
  for (const AddedToken& a : (*t)->added_tokens()) added_ids.insert(a.id);
  int round_trips = 0;
  for (const auto& [corpus, expected] : {std::pair<std::string, std::string>{DataDir() + "/sample.jsonl", "sample"},
                                        {SentencePieceDir() + "/bytes.jsonl", "bytes"}}) {
    auto docs = ReadCorpusJsonl(corpus);
    ASSERT_TRUE(docs.ok()) << docs.status();
    const std::vector<nlohmann::json> want = ReadJsonLines(dir + "/" + expected + ".expected.jsonl");
    ASSERT_EQ(want.size(), docs->size()) << expected;
    for (size_t i = 0; i < docs->size(); ++i) {
      const std::string& doc = (*docs)[i];
      const std::string where = absl::StrCat(GetParam(), " ", expected, " document ", i, ": ", doc.substr(0, 60));
      std::vector<uint32_t> starts;
      const std::vector<uint32_t> ids = (*t)->Encode(doc, SpecialTokens::kRecognize, Normalized::kNo, &starts);
      const auto want_ids = want[i]["ids"].get<std::vector<uint32_t>>();
      EXPECT_EQ(ids, want_ids) << where;
      EXPECT_EQ(CodePointOffsets(Tokenizer::RepairUtf8(doc), starts), want[i]["starts"].get<std::vector<uint32_t>>())
          << where;
      EXPECT_EQ((*t)->Decode(want_ids), want[i]["decoded"].get<std::string>()) << where;
      // Round trip where the decoders allow one: no added token (Prepend's ▁ after it decodes as
      // a space), no raw ▁ (decodes as a space), no leading space (Metaspace "first" keeps it in
      // the first ▁, which Strip then removes).
      const std::string fixed = Tokenizer::RepairUtf8(doc);
      if (std::none_of(ids.begin(), ids.end(), [&](uint32_t id) { return added_ids.contains(id); }) &&
          fixed.find("\u2581") == std::string::npos && (fixed.empty() || fixed[0] != ' ')) {
        EXPECT_EQ((*t)->Decode(ids), fixed) << where;
        ++round_trips;
      }
      std::vector<uint32_t> with_special = want[i]["before"].get<std::vector<uint32_t>>();
      with_special.insert(with_special.end(), want_ids.begin(), want_ids.end());
      for (uint32_t id : want[i]["after"]) with_special.push_back(id);
      auto added = (*t)->AddSpecialTokens(ids);
      ASSERT_TRUE(added.ok()) << added.status();
      EXPECT_EQ(*added, with_special) << where;
      // The tokens' bytes are the normalized text, a <0xNN> token standing for its byte.
      std::string bytes;
      for (uint32_t id : ids) bytes += (*t)->TokenBytes(id);
      if (doc.find_first_of("<[\n\t") == std::string::npos && !doc.empty()) {
        std::string pieces;
        for (const std::string& p : (*t)->PreTokenize(doc)) pieces += p;
        EXPECT_EQ(bytes, pieces) << where;
      }
    }
  }
  EXPECT_GE(round_trips, 40) << GetParam();
}

INSTANTIATE_TEST_SUITE_P(Styles, SentencePieceStyle, ::testing::Values("mistral", "metaspace", "gemma3"));

TEST(SentencePieceBpe, LoadsEachStructure) {
  auto mistral = Tokenizer::FromFile(SentencePieceDir() + "/mistral/tokenizer.json");
  ASSERT_TRUE(mistral.ok()) << mistral.status();
  EXPECT_EQ(*(*mistral)->TokenId("<0x0A>"), *(*mistral)->TokenId("<0x00>") + 10);
  EXPECT_EQ((*mistral)->TokenBytes(*(*mistral)->TokenId("<0xE4>")), "\xE4");
  EXPECT_EQ(*(*mistral)->TokenId("[INST]"), 3u);
  EXPECT_THAT((*mistral)->PreTokenize("a b"), ::testing::ElementsAre("\u2581a\u2581b"));
  auto gemma = Tokenizer::FromFile(SentencePieceDir() + "/gemma3/tokenizer.json");
  ASSERT_TRUE(gemma.ok()) << gemma.status();
  // <image_soft_token> is an added token one past the vocabulary, as in Gemma 3.
  EXPECT_EQ(*(*gemma)->TokenId("<image_soft_token>"), static_cast<uint32_t>((*gemma)->vocab_size() - 1));
  // Newlines are added tokens matched before normalization; a run of them is one token.
  EXPECT_THAT((*gemma)->Encode("\n\n"), ::testing::ElementsAre(*(*gemma)->TokenId("\n\n")));
  EXPECT_EQ((*gemma)->Decode((*gemma)->Encode("<bos>hi there"), SkipSpecial::kYes), "hi there");
}

// Variants of the Metaspace-style file (other prepend schemes, split, Split behaviours, unk in
// place of byte fallback, ignore_merges, other decoders), each against HF on the byte corpus.
TEST(SentencePieceBpe, VariantsMatchHf) {
  const nlohmann::json base = ReadJsonFile(SentencePieceDir() + "/metaspace/tokenizer.json");
  auto docs = ReadCorpusJsonl(SentencePieceDir() + "/bytes.jsonl");
  ASSERT_TRUE(docs.ok()) << docs.status();
  const std::vector<nlohmann::json> variants = ReadJsonLines(SentencePieceDir() + "/metaspace/variants.expected.jsonl");
  EXPECT_GE(variants.size(), 14u);
  for (const nlohmann::json& v : variants) {
    nlohmann::json j = base;
    for (const auto& [key, value] : v["patch"].items()) {
      if (key == "model") {
        for (const auto& [field, x] : value.items()) j["model"][field] = x;
      } else {
        j[key] = value;
      }
    }
    auto t = Tokenizer::FromJson(j.dump());
    ASSERT_TRUE(t.ok()) << v["name"] << ": " << t.status();
    ASSERT_EQ(v["docs"].size(), docs->size());
    for (size_t i = 0; i < docs->size(); ++i) {
      const auto want = v["docs"][i]["ids"].get<std::vector<uint32_t>>();
      EXPECT_EQ((*t)->Encode((*docs)[i]), want) << v["name"] << " document " << i;
      EXPECT_EQ((*t)->Decode(want), v["docs"][i]["decoded"].get<std::string>()) << v["name"] << " document " << i;
    }
  }
}

// Where tokenizer.json lists a pair twice, HF keeps the later rank (its merges are collected
// into a map): "abc" then merges b+c first (checked with tokenizers 0.23.2).
TEST(SentencePieceBpe, DuplicateMergeKeepsLaterRank) {
  const char* json = R"({"normalizer": null, "pre_tokenizer": null, "decoder": null, "added_tokens": [],
    "model": {"type": "BPE", "unk_token": null, "byte_fallback": false,
              "vocab": {"a": 0, "b": 1, "c": 2, "ab": 3, "bc": 4}, "merges": [["a", "b"], ["b", "c"], ["a", "b"]]}})";
  auto t = Tokenizer::FromJson(json);
  ASSERT_TRUE(t.ok()) << t.status();
  EXPECT_THAT((*t)->Encode("abc"), ::testing::ElementsAre(0u, 4u));
  EXPECT_THAT((*t)->Encode("abcd"), ::testing::ElementsAre(0u, 4u));  // no unk: "d" is dropped, as in HF
  EXPECT_EQ((*t)->Decode({3, 2}), "ab c");                            // no decoder: HF joins with spaces
}

// Each component this build does not implement is refused at load, by name.
TEST(SentencePieceBpe, RefusesUnsupportedComponentsByName) {
  const nlohmann::json base = ReadJsonFile(SentencePieceDir() + "/mistral/tokenizer.json");
  struct Case {
    const char* key;
    nlohmann::json value;
    const char* named;
  };
  const std::vector<Case> cases = {
      {"normalizer", {{"type", "NFKC"}}, "normalizer"},
      {"normalizer", {{"type", "Replace"}, {"pattern", {{"Regex", " +"}}}, {"content", "x"}}, "String pattern"},
      {"pre_tokenizer", {{"type", "Whitespace"}}, "pre-tokenizer"},
      {"decoder", {{"type", "WordPiece"}, {"prefix", "##"}}, "decoder"},
      {"post_processor", {{"type", "BertProcessing"}}, "post_processor"},
      {"truncation", {{"max_length", 8}}, "truncation"},
  };
  for (const Case& c : cases) {
    nlohmann::json j = base;
    j[c.key] = c.value;
    auto t = Tokenizer::FromJson(j.dump());
    EXPECT_EQ(t.status().code(), absl::StatusCode::kUnimplemented) << c.key << ": " << t.status();
    EXPECT_THAT(std::string(t.status().message()), ::testing::HasSubstr(c.named)) << c.key;
  }
  nlohmann::json dropout = base;
  dropout["model"]["dropout"] = 0.1;
  EXPECT_EQ(Tokenizer::FromJson(dropout.dump()).status().code(), absl::StatusCode::kUnimplemented);
  nlohmann::json normalized = base;
  normalized["added_tokens"][3]["normalized"] = true;
  auto n = Tokenizer::FromJson(normalized.dump());
  EXPECT_EQ(n.status().code(), absl::StatusCode::kUnimplemented) << n.status();
  EXPECT_THAT(std::string(n.status().message()), ::testing::HasSubstr("[INST]"));
  // byte_fallback belongs to SentencePiece-style files: with a ByteLevel pre-tokenizer it is refused.
  std::ifstream f(DataDir() + "/qwen3.5-synthetic/tokenizer.json");
  nlohmann::json byte_level = nlohmann::json::parse(f);
  byte_level["model"]["byte_fallback"] = true;
  auto b = Tokenizer::FromJson(byte_level.dump());
  EXPECT_EQ(b.status().code(), absl::StatusCode::kUnimplemented) << b.status();
  EXPECT_THAT(std::string(b.status().message()), ::testing::HasSubstr("byte_fallback"));
}

// Byte-level tokenizers read their post-processor too: Qwen's ByteLevel adds nothing.
TEST(Tokenizer, ByteLevelPostProcessorAddsNothing) {
  auto ids = Qwen3().AddSpecialTokens({1, 2, 3});
  ASSERT_TRUE(ids.ok()) << ids.status();
  EXPECT_THAT(*ids, ::testing::ElementsAre(1u, 2u, 3u));
}

}  // namespace
}  // namespace slidedp::tok
