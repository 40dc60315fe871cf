// Tokenizer fingerprints: the same tokenizer written differently has one fingerprint; one merge,
// one added token or the EOS token changed gives another; Qwen3's and Llama 3's differ; hostile
// model directories (missing, FIFO, malformed) are errors, not hangs; a 10 MB tokenizer is cheap.
#include "common/tokenizer/identity.h"

#include <sys/stat.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <functional>
#include <iostream>
#include <iterator>
#include <set>

#include "common/tokenizer/tokenizer.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"

namespace slidedp::tok {
namespace {

namespace fs = std::filesystem;
using json = nlohmann::json;
using ::testing::HasSubstr;

std::string SourceDir() {
  const char* s = std::getenv("SLIDEDP_SOURCE_DIR");
  if (s != nullptr) return s;
  std::string here = __FILE__;
  return here.substr(0, here.rfind("/common/tokenizer/"));
}
std::string Qwen3Dir() { return SourceDir() + "/tests/data/tokenizer/qwen3"; }
std::string Llama3Dir() { return SourceDir() + "/tests/data/chat_templates/llama3"; }

std::string ReadText(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), {});
}

const std::string& Qwen3Json() {
  static const std::string* text = new std::string(ReadText(Qwen3Dir() + "/tokenizer.json"));
  return *text;
}
const std::string& Qwen3Config() {
  static const std::string* text = new std::string(ReadText(Qwen3Dir() + "/tokenizer_config.json"));
  return *text;
}

std::string FingerprintOf(const std::string& tokenizer, const std::string& config) {
  auto id = IdentifyTokenizerJson(tokenizer, config);
  EXPECT_TRUE(id.ok()) << id.status();
  return id.ok() ? id->fingerprint : std::string();
}

// A fresh directory in the test temp dir.
std::string FreshDir(const std::string& name) {
  const std::string dir = ::testing::TempDir() + "/identity_test_" + std::to_string(::getpid()) + "_" + name;
  fs::remove_all(dir);
  fs::create_directories(dir);
  return dir;
}

TEST(TokenizerIdentity, Qwen3HasAFingerprintAndTheLoadersVocabularySize) {
  auto id = IdentifyTokenizer(Qwen3Dir());
  ASSERT_TRUE(id.ok()) << id.status();
  EXPECT_THAT(id->fingerprint, ::testing::MatchesRegex("sha256:[0-9a-f]{64}"));
  auto loaded = Tokenizer::FromFile(Qwen3Dir() + "/tokenizer.json");
  ASSERT_TRUE(loaded.ok());
  EXPECT_EQ(id->vocab_size, (*loaded)->vocab_size());
  EXPECT_EQ(id->vocab_size, 151669);
  // The directory's files and their text give the same identity; it is stable across calls.
  EXPECT_EQ(id->fingerprint, FingerprintOf(Qwen3Json(), Qwen3Config()));
  EXPECT_EQ(IdentifyTokenizer(Qwen3Dir())->fingerprint, id->fingerprint);
}

TEST(TokenizerIdentity, ReformattedFilesKeepTheFingerprint) {
  const std::string want = FingerprintOf(Qwen3Json(), Qwen3Config());
  const json tok = json::parse(Qwen3Json());
  // Indented, keys sorted, non-ASCII written as \u escapes.
  EXPECT_EQ(FingerprintOf(tok.dump(2, ' ', /*ensure_ascii=*/true), json::parse(Qwen3Config()).dump(4)), want);
  // Top-level keys and the vocabulary in reverse order, merges as "a b" strings (tokenizers < 0.20).
  nlohmann::ordered_json reordered;
  for (auto it = tok.rbegin(); it != tok.rend(); ++it) {
    if (it.key() != "model") reordered[it.key()] = *it;
  }
  nlohmann::ordered_json model;
  for (auto it = tok["model"].rbegin(); it != tok["model"].rend(); ++it) {
    if (it.key() != "vocab" && it.key() != "merges") model[it.key()] = *it;
  }
  nlohmann::ordered_json vocab = nlohmann::ordered_json::object();
  for (auto it = tok["model"]["vocab"].rbegin(); it != tok["model"]["vocab"].rend(); ++it) vocab[it.key()] = *it;
  nlohmann::ordered_json merges = nlohmann::ordered_json::array();
  for (const json& m : tok["model"]["merges"]) {
    merges.push_back(m[0].get<std::string>() + " " + m[1].get<std::string>());
  }
  model["merges"] = merges;
  model["vocab"] = vocab;
  reordered["model"] = model;
  const std::string reordered_text = reordered.dump();
  ASSERT_NE(reordered_text.find("\"merges\":[\""), std::string::npos);
  EXPECT_EQ(FingerprintOf(reordered_text, Qwen3Config()), want);
  // What does not decide ids: the chat template, pad_token, the decoder.
  json config = json::parse(Qwen3Config());
  config["chat_template"] = "{{ messages }}";
  config["pad_token"] = "<|im_end|>";
  config["model_max_length"] = 4096;
  json t = tok;
  t["decoder"] = nullptr;
  EXPECT_EQ(FingerprintOf(t.dump(), config.dump()), want);
}

TEST(TokenizerIdentity, OneMergeOrAddedTokenOrSpecialTokenChangedGivesAnother) {
  const std::string base = FingerprintOf(Qwen3Json(), Qwen3Config());
  const json tok = json::parse(Qwen3Json());
  const json config = json::parse(Qwen3Config());
  auto with_tok = [&](const std::function<void(json&)>& edit) {
    json t = tok;
    edit(t);
    return FingerprintOf(t.dump(), Qwen3Config());
  };
  auto with_config = [&](const std::function<void(json&)>& edit) {
    json c = config;
    edit(c);
    return FingerprintOf(Qwen3Json(), c.dump());
  };
  std::set<std::string> seen = {base};
  auto expect_new = [&](const std::string& fp, const char* what) {
    EXPECT_TRUE(seen.insert(fp).second) << what << " did not change the fingerprint";
  };
  expect_new(with_tok([](json& t) { std::swap(t["model"]["merges"][1000], t["model"]["merges"][1001]); }),
             "two merges' ranks swapped");
  expect_new(with_tok([](json& t) { t["model"]["merges"].erase(t["model"]["merges"].size() - 1); }),
             "last merge removed");
  expect_new(with_tok([](json& t) { t["model"]["vocab"]["hello"] = 7; }), "a vocabulary id");
  expect_new(with_tok([](json& t) { t["added_tokens"][3]["content"] = "<|im_begin|>"; }), "an added token's content");
  expect_new(with_tok([](json& t) { t["added_tokens"][3]["special"] = false; }), "an added token's special flag");
  expect_new(with_tok([](json& t) { t["added_tokens"][3]["id"] = 160000; }), "an added token's id");
  expect_new(with_tok([](json& t) { t["normalizer"] = nullptr; }), "the normalizer");
  expect_new(with_tok([](json& t) { t["pre_tokenizer"]["pretokenizers"][0]["pattern"]["Regex"] = "\\s+"; }),
             "the split regex");
  expect_new(with_tok([](json& t) { t["model"]["ignore_merges"] = true; }), "a model option");
  expect_new(with_config([](json& c) { c["eos_token"] = "<|endoftext|>"; }), "eos_token");
  expect_new(with_config([](json& c) { c["added_tokens_decoder"]["151665"]["content"] = "<tool_x>"; }),
             "added_tokens_decoder");
  expect_new(FingerprintOf(Qwen3Json(), ""), "no tokenizer_config.json");
  // An added token whose id is beyond the vocabulary raises the vocabulary size.
  json t = tok;
  t["added_tokens"].push_back({{"id", 151935}, {"content", "<|extra|>"}, {"special", true}});
  EXPECT_EQ(IdentifyTokenizerJson(t.dump(), Qwen3Config())->vocab_size, 151936);
}

TEST(TokenizerIdentity, Qwen3AndLlama3Differ) {
  auto qwen = IdentifyTokenizer(Qwen3Dir());
  auto llama = IdentifyTokenizer(Llama3Dir());
  ASSERT_TRUE(qwen.ok() && llama.ok()) << qwen.status() << llama.status();
  EXPECT_NE(qwen->fingerprint, llama->fingerprint);
  EXPECT_EQ(llama->vocab_size, 128256);
}

TEST(TokenizerIdentity, HostileDirectoriesAreErrorsNotHangs) {
  // No tokenizer.json: NOT_FOUND, which callers read as "no fingerprint".
  const std::string empty = FreshDir("empty");
  EXPECT_EQ(IdentifyTokenizer(empty).status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(IdentifyTokenizer(empty + "/nope").status().code(), absl::StatusCode::kNotFound);
  // A FIFO or /dev/zero in place of either file: refused at once.
  for (const std::string file : {"tokenizer.json", "tokenizer_config.json"}) {
    for (const bool fifo : {true, false}) {
      const std::string dir = FreshDir("special");
      fs::create_symlink(Qwen3Dir() + "/tokenizer.json", dir + "/tokenizer.json");
      fs::remove(dir + "/" + file);
      if (fifo) {
        ASSERT_EQ(mkfifo((dir + "/" + file).c_str(), 0600), 0);
      } else {
        fs::create_symlink("/dev/zero", dir + "/" + file);
      }
      const auto start = std::chrono::steady_clock::now();
      auto id = IdentifyTokenizer(dir);
      EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(30));
      EXPECT_EQ(id.status().code(), absl::StatusCode::kInvalidArgument) << file << " fifo " << fifo;
      EXPECT_THAT(std::string(id.status().message()), HasSubstr("is not a regular file")) << file;
    }
  }
  // Malformed content: INVALID_ARGUMENT naming the file and the field.
  struct Case {
    std::string tokenizer, config, expect;
  };
  const json tok = json::parse(Qwen3Json());
  json bad_merge = tok, bad_id = tok, bad_added = tok;
  bad_merge["model"]["merges"][5] = 42;
  bad_id["model"]["vocab"]["hello"] = -1;
  bad_added["added_tokens"][0]["content"] = 3;
  for (const Case& c : std::vector<Case>{
           {"[1, 2]", "", "tokenizer.json: not a JSON object"},
           {"{not json", "", "tokenizer.json: not valid JSON"},
           {std::string(100000, '['), "", "nested deeper"},
           {R"({"model": {"vocab": []}})", "", "model.vocab"},
           {bad_merge.dump(), "", "model.merges[5]"},
           {bad_id.dump(), "", "model.vocab[\"hello\"]: id -1"},
           {bad_added.dump(), "", "added_tokens[0].content"},
           {Qwen3Json(), R"({"eos_token": 5})", "tokenizer_config.json eos_token"},
           {Qwen3Json(), R"({"added_tokens_decoder": {"x": {"content": "a"}}})", "added_tokens_decoder[\"x\"]"},
           {Qwen3Json(), "[]", "tokenizer_config.json: not a JSON object"},
       }) {
    auto id = IdentifyTokenizerJson(c.tokenizer, c.config);
    EXPECT_EQ(id.status().code(), absl::StatusCode::kInvalidArgument) << c.expect;
    EXPECT_THAT(std::string(id.status().message()), HasSubstr(c.expect));
  }
  const std::string dir = FreshDir("malformed");
  std::ofstream(dir + "/tokenizer.json") << bad_merge.dump();
  auto id = IdentifyTokenizer(dir);
  EXPECT_THAT(std::string(id.status().message()), HasSubstr(dir + ": tokenizer.json model.merges[5]"));
}

// Cheap enough for a gRPC handler: one parse and one hash of an 11 MB tokenizer.json.
TEST(TokenizerIdentity, IsCheapOnALargeTokenizer) {
  ASSERT_GT(Qwen3Json().size(), 10u << 20);
  const auto start = std::chrono::steady_clock::now();
  auto id = IdentifyTokenizer(Qwen3Dir());
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  ASSERT_TRUE(id.ok());
  std::cout << "IdentifyTokenizer(qwen3, " << (Qwen3Json().size() >> 20) << " MB): " << s << " s\n";
  EXPECT_LT(s, 2.0) << "measured 0.3 s on the 2-core development VM";
}

TEST(TokenizerIdentity, Sha256HexMatchesTheStandardVectors) {
  EXPECT_EQ(Sha256Hex(""), "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855");
  EXPECT_EQ(Sha256Hex("abc"), "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad");
}

}  // namespace
}  // namespace slidedp::tok
