// `slidedp prepare` as a process, on one small JSONL file of each record form with the Qwen3
// tokenizer and chat template (tests/data/tokenizer/qwen3): every document's text and trained
// spans are the ones docs/dataset-format.md ("Input formats") states; the chat forms' text is what
// @huggingface/jinja renders with the model's own template (tools/chat_template/render_records.mjs;
// skipped when node is absent); --show alone prints marked samples and writes nothing; a file
// whose records change form is refused naming its line.
#include <sys/wait.h>
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "client/cli/embedded.h"
#include "common/data/dataset.h"
#include "common/tokenizer/identity.h"
#include "common/tokenizer/tokenizer.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "tests/integration/node_harness.h"

namespace slidedp::testing {
namespace {

namespace fs = std::filesystem;
using json = nlohmann::json;

std::string SourceDir() {
  const char* s = std::getenv("SLIDEDP_SOURCE_DIR");
  return s != nullptr ? s : ".";
}
std::string Qwen3Dir() { return SourceDir() + "/tests/data/tokenizer/qwen3"; }

const tok::Tokenizer& Qwen3() {
  static const tok::Tokenizer* t = [] {
    auto r = tok::Tokenizer::FromFile(Qwen3Dir() + "/tokenizer.json");
    EXPECT_TRUE(r.ok()) << r.status();
    return r->release();
  }();
  return *t;
}

// Runs argv to its end; the exit status and its output (stdout and stderr together).
std::pair<int, std::string> RunCommand(const std::vector<std::string>& argv, const std::string& log,
                                       double timeout_s = 120) {
  auto pid = client::SpawnProcess(argv, log);
  EXPECT_TRUE(pid.ok()) << pid.status();
  if (!pid.ok()) return {-1, ""};
  const int rc = client::WaitExit(*pid, timeout_s);
  return {rc, ReadFile(log)};
}

// One small file per form, and what each document must be (docs/dataset-format.md).
struct FormCase {
  std::string format;
  std::vector<json> records;
  std::vector<std::string> texts;                 // each document's decoded text
  std::vector<std::vector<std::string>> trained;  // each document's trained runs
};

const std::string kAnswer = "<|im_start|>assistant\n<think>\n\n</think>\n\n";  // Qwen3's final turn

std::vector<FormCase> Cases() {
  return {
      {"messages",
       {json::parse(R"({"messages": [{"role": "system", "content": "You are terse."},
           {"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"},
           {"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"}]})"),
        json::parse(R"({"messages": [{"role": "user", "content": [{"type": "text", "text": "Hi "},
           {"type": "text", "text": "there"}]}, {"role": "assistant", "content": [{"type": "text", "text": "Yo"}]}]})")},
       {"<|im_start|>system\nYou are terse.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
        "Hello!<|im_end|>\n<|im_start|>user\n2+2?<|im_end|>\n" +
            kAnswer + "4<|im_end|>\n",
        "<|im_start|>user\nHi there<|im_end|>\n" + kAnswer + "Yo<|im_end|>\n"},
       {{"Hello!<|im_end|>", "<think>\n\n</think>\n\n4<|im_end|>"}, {"<think>\n\n</think>\n\nYo<|im_end|>"}}},
      {"sharegpt",
       {json::parse(R"({"system": "You are terse.", "conversations": [{"from": "human", "value": "Hi"},
           {"from": "gpt", "value": "Hello!"}]})"),
        json::parse(R"({"conversations": [{"from": "system", "value": "Count."}, {"from": "human", "value": "1?"},
           {"from": "gpt", "value": "2"}, {"from": "human", "value": "3?"}, {"from": "gpt", "value": "4"}]})")},
       {"<|im_start|>system\nYou are terse.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n" + kAnswer +
            "Hello!<|im_end|>\n",
        "<|im_start|>system\nCount.<|im_end|>\n<|im_start|>user\n1?<|im_end|>\n<|im_start|>assistant\n2<|im_end|>\n"
        "<|im_start|>user\n3?<|im_end|>\n" +
            kAnswer + "4<|im_end|>\n"},
       {{"<think>\n\n</think>\n\nHello!<|im_end|>"}, {"2<|im_end|>", "<think>\n\n</think>\n\n4<|im_end|>"}}},
      {"alpaca",
       {json::parse(R"({"instruction": "Translate to French.", "input": "cat", "output": "chat"})"),
        json::parse(R"({"instruction": "Say hi.", "input": "", "output": "hi", "system": "Be kind."})")},
       {"<|im_start|>user\nTranslate to French.\ncat<|im_end|>\n" + kAnswer + "chat<|im_end|>\n",
        "<|im_start|>system\nBe kind.<|im_end|>\n<|im_start|>user\nSay hi.<|im_end|>\n" + kAnswer + "hi<|im_end|>\n"},
       {{"<think>\n\n</think>\n\nchat<|im_end|>"}, {"<think>\n\n</think>\n\nhi<|im_end|>"}}},
      {"conversational_prompt_completion",
       {json::parse(R"({"prompt": [{"role": "user", "content": "1+1?"}, {"role": "assistant", "content": "2"},
           {"role": "user", "content": "2+2?"}], "completion": [{"role": "assistant", "content": "4"}]})")},
       {"<|im_start|>user\n1+1?<|im_end|>\n<|im_start|>assistant\n2<|im_end|>\n<|im_start|>user\n2+2?<|im_end|>\n" +
        kAnswer + "4<|im_end|>\n"},
       {{"<think>\n\n</think>\n\n4<|im_end|>"}}},
      {"prompt_completion",
       {json::parse(R"({"prompt": "Q: 2+2?\nA:", "completion": " 4"})")},
       {"Q: 2+2?\nA: 4<|im_end|>"},  // no chat template: the strings concatenated, then EOS
       {{" 4<|im_end|>"}}},
      {"text", {json::parse(R"({"text": "Plain words."})")}, {"Plain words.<|im_end|>"}, {{"Plain words.<|im_end|>"}}},
  };
}

class PrepareFormats : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = ::testing::TempDir() + "/prepare-formats-" + std::to_string(getpid());
    fs::remove_all(dir_);
    fs::create_directories(dir_);
    for (const FormCase& c : Cases()) {
      std::ofstream out(Input(c.format));
      for (const json& r : c.records) out << r.dump() << "\n";
    }
  }
  void TearDown() override {
    if (!HasFailure()) fs::remove_all(dir_);
  }
  std::string Input(const std::string& format) const { return dir_ + "/" + format + ".jsonl"; }

  std::string dir_;
};

TEST_F(PrepareFormats, EachFormTrainsWhatTheDocsSay) {
  std::vector<std::string> argv = {BuildDir() + "/bin/slidedp",
                                   "prepare",
                                   "--model",
                                   Qwen3Dir(),
                                   "--output",
                                   dir_ + "/ds",
                                   "--seq-len",
                                   "512",
                                   "--show",
                                   "3"};
  for (const FormCase& c : Cases()) {
    argv.push_back("--input");
    argv.push_back(Input(c.format));
  }
  const auto [rc, out] = RunCommand(argv, dir_ + "/prepare.log");
  ASSERT_EQ(rc, 0) << out;
  // --show with --output: the samples, then the dataset.
  EXPECT_TRUE(absl::StrContains(out, "--- 1: " + Input("messages") + ":1 (messages, qwen3 template): ")) << out;
  EXPECT_TRUE(absl::StrContains(out, "[[Hello!<|im_end|>]]\n<|im_start|>user\n2+2?")) << out;
  EXPECT_TRUE(absl::StrContains(out, "input      " + Input("sharegpt") + " (sharegpt)")) << out;
  EXPECT_TRUE(absl::StrContains(out, "chat template qwen3")) << out;

  auto reader = data::DatasetReader::Open(dir_ + "/ds/train");
  ASSERT_TRUE(reader.ok()) << reader.status();
  const data::DatasetReader& ds = **reader;
  std::vector<uint32_t> tokens(ds.num_tokens());
  std::vector<uint8_t> mask(tokens.size());
  ASSERT_TRUE(ds.ReadTokens(0, ds.num_tokens(), tokens.data(), mask.data()).ok());
  const auto off = ds.doc_offsets();
  size_t doc = 0;
  for (const FormCase& c : Cases()) {
    for (size_t k = 0; k < c.records.size(); ++k, ++doc) {
      ASSERT_LT(doc + 1, off.size());
      const std::vector<uint32_t> ids(tokens.begin() + off[doc], tokens.begin() + off[doc + 1]);
      EXPECT_EQ(Qwen3().Decode(ids), c.texts[k]) << c.format << " record " << k;
      std::vector<std::string> runs;
      for (uint64_t t = off[doc]; t < off[doc + 1]; ++t) {
        if (!mask[t]) continue;
        if (t == off[doc] || !mask[t - 1]) runs.emplace_back();
        runs.back() += Qwen3().TokenBytes(tokens[t]);
      }
      EXPECT_EQ(runs, c.trained[k]) << c.format << " record " << k;
    }
  }
  EXPECT_EQ(doc + 1, off.size());

  // The manifest names the tokenizer the way hostd will identify the model directory's.
  const json manifest = json::parse(ReadFile(dir_ + "/ds/train/manifest.json"));
  auto identity = tok::IdentifyTokenizer(Qwen3Dir());
  ASSERT_TRUE(identity.ok());
  EXPECT_EQ(manifest["source"]["tokenizer_fingerprint"], identity->fingerprint);
  EXPECT_EQ(manifest["source"]["tokenizer_vocab_size"], identity->vocab_size);
  EXPECT_EQ(manifest["source"]["chat_template"], "qwen3");
  const json summary = json::parse(ReadFile(dir_ + "/ds/prepare_summary.json"));
  EXPECT_EQ(summary["input_formats"],
            json({"messages", "sharegpt", "alpaca", "conversational_prompt_completion", "prompt_completion", "text"}));
}

TEST_F(PrepareFormats, ShowAloneWritesNothingAndMixedFilesAreRefused) {
  const auto [rc, out] = RunCommand(
      {BuildDir() + "/bin/slidedp", "prepare", "--model", Qwen3Dir(), "--input", Input("alpaca"), "--show", "1"},
      dir_ + "/show.log");
  ASSERT_EQ(rc, 0) << out;
  EXPECT_TRUE(absl::StrContains(out, "--- 1: " + Input("alpaca") + ":1 (alpaca, qwen3 template): ")) << out;
  EXPECT_TRUE(absl::StrContains(out,
                                "<|im_start|>user\nTranslate to French.\ncat<|im_end|>\n<|im_start|>assistant\n"
                                "[[<think>\n\n</think>\n\nchat<|im_end|>]]\n"))
      << out;
  EXPECT_FALSE(absl::StrContains(out, "Say hi.")) << "one sample asked for";
  EXPECT_FALSE(absl::StrContains(out, "train ")) << "nothing written without --output";

  const std::string mixed = dir_ + "/mixed.jsonl";
  std::ofstream(mixed) << ReadFile(Input("messages")) << ReadFile(Input("alpaca"));
  const auto [bad_rc, bad] = RunCommand(
      {BuildDir() + "/bin/slidedp", "prepare", "--model", Qwen3Dir(), "--input", mixed, "--output", dir_ + "/mixed"},
      dir_ + "/mixed.log");
  EXPECT_NE(bad_rc, 0) << bad;
  EXPECT_TRUE(absl::StrContains(
      bad, "INVALID_ARGUMENT: " + mixed + ":3: the record is alpaca, but the file's first record (line 1) is messages"))
      << bad;
  EXPECT_FALSE(fs::exists(dir_ + "/mixed/train"));
}

// The absolute path of `name` on PATH, or "" when it is not there.
std::string FindOnPath(const std::string& name) {
  const char* path = std::getenv("PATH");
  for (const auto& d : absl::StrSplit(path != nullptr ? path : "/usr/bin:/bin", ':', absl::SkipEmpty())) {
    const std::string candidate = absl::StrCat(d, "/", name);
    if (access(candidate.c_str(), X_OK) == 0) return candidate;
  }
  return "";
}

// A node_modules directory holding @huggingface/jinja: $NODE_PATH, /tmp/jinja-ref (the README's
// place), or one installed into the build directory with npm (CI has the registry); "" if none.
std::string JinjaNodeModules(const std::string& log_dir) {
  std::vector<std::string> candidates;
  if (const char* p = std::getenv("NODE_PATH")) candidates.push_back(p);
  candidates.push_back("/tmp/jinja-ref/node_modules");
  const std::string cache = BuildDir() + "/jinja-ref";
  candidates.push_back(cache + "/node_modules");
  for (const std::string& c : candidates) {
    if (fs::exists(c + "/@huggingface/jinja/package.json")) return c;
  }
  const std::string npm = FindOnPath("npm");
  if (npm.empty()) return "";
  fs::create_directories(cache);
  const auto [rc, out] =
      RunCommand({npm, "install", "--prefix", cache, "--no-audit", "--no-fund", "@huggingface/jinja@0.5.11"},
                 log_dir + "/npm.log", 300);
  if (rc != 0) {
    std::cerr << "npm install @huggingface/jinja failed (" << rc << "): " << out << "\n";
    return "";
  }
  return fs::exists(cache + "/node_modules/@huggingface/jinja/package.json") ? cache + "/node_modules" : "";
}

TEST_F(PrepareFormats, ChatFormsRenderAsHuggingFaceJinjaDoes) {
  const std::string node = FindOnPath("node");
  if (node.empty()) GTEST_SKIP() << "node is not installed: the @huggingface/jinja comparison is skipped";
  const std::string modules = JinjaNodeModules(dir_);
  if (modules.empty()) GTEST_SKIP() << "@huggingface/jinja is not available (set NODE_PATH, or give npm the registry)";
  setenv("NODE_PATH", modules.c_str(), 1);
  int compared = 0;
  for (const FormCase& c : Cases()) {
    if (c.format == "prompt_completion" || c.format == "text") continue;  // no chat template
    const auto [rc, out] = RunCommand({node, SourceDir() + "/tools/chat_template/render_records.mjs",
                                       Qwen3Dir() + "/tokenizer_config.json", c.format, Input(c.format)},
                                      dir_ + "/jinja-" + c.format + ".log");
    ASSERT_EQ(rc, 0) << out;
    std::vector<json> rendered;
    for (const auto& line : absl::StrSplit(out, '\n', absl::SkipEmpty())) {
      if (absl::StartsWith(line, "{")) rendered.push_back(json::parse(line));
    }
    ASSERT_EQ(rendered.size(), c.records.size()) << out;
    for (size_t k = 0; k < rendered.size(); ++k) {
      ASSERT_TRUE(rendered[k].contains("text")) << c.format << " " << k << ": " << rendered[k].dump();
      EXPECT_EQ(rendered[k]["text"].get<std::string>(), c.texts[k]) << c.format << " record " << k;
      ++compared;
    }
  }
  EXPECT_EQ(compared, 7);
}

}  // namespace
}  // namespace slidedp::testing
