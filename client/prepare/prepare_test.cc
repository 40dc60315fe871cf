// prepare: chat masking, prompt/completion and text documents, packing boundaries, malformed
// inputs (file:line and field in the message, skip with a count), split determinism.
#include "client/prepare/prepare.h"

#include <sys/stat.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <fstream>

#include "common/data/dataset.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "client/prepare/prepare_test_util.h"

namespace slidedp::prepare {
namespace {
namespace fs = std::filesystem;
using ::testing::HasSubstr;
using json = nlohmann::json;

using test_data::Qwen3;
using test_data::SourceDir;
std::string ModelDir() { return test_data::Qwen3Dir(); }


std::string TempPath(const std::string& name) {
  return testing::TempDir() + "/prepare_test_" + std::to_string(::getpid()) + "_" + name;
}

std::string WriteFile(const std::string& name, const std::string& text) {
  const std::string p = TempPath(name);
  std::ofstream(p) << text;
  return p;
}

// Trained tokens' bytes, with a '|' between runs that are not adjacent.
std::string TrainedText(const TokenizedDocument& d) {
  std::string out;
  bool prev = false;
  for (size_t i = 0; i < d.tokens.size(); ++i) {
    if (d.loss_mask[i]) {
      if (!prev && !out.empty()) out += "|";
      out += Qwen3().TokenBytes(d.tokens[i]);
    }
    prev = d.loss_mask[i] != 0;
  }
  return out;
}

const json kChat = json::parse(R"([
  {"role": "system", "content": "You are terse."},
  {"role": "user", "content": "Hi"},
  {"role": "assistant", "content": "Hello!"},
  {"role": "user", "content": "2+2?"},
  {"role": "assistant", "content": "4"}])");

const ChatFormat kQwen3Format{ChatTemplate::kQwen3, "", "", ""};

TEST(ChatTemplate, ResolvesQwen3FromTheModelsConfig) {
  std::ifstream in(ModelDir() + "/tokenizer_config.json");
  json config = json::parse(in);
  EXPECT_EQ(ResolveChatFormat(config, ChatTemplate::kAuto, "")->tmpl, ChatTemplate::kQwen3);
  EXPECT_EQ(ResolveChatFormat(config, ChatTemplate::kChatML, "")->tmpl, ChatTemplate::kChatML);
  json llama = {{"chat_template", "{{ '<|begin_of_text|>' }}{% for m in messages %}<|start_header_id|>..."}};
  EXPECT_EQ(ResolveChatFormat(llama, ChatTemplate::kAuto, "").status().code(), absl::StatusCode::kUnimplemented);
  json chatml = {{"chat_template", "{% if messages[0]['role'] != 'system' %}<|im_start|>system\nYou are a bot..."}};
  auto r = ResolveChatFormat(chatml, ChatTemplate::kAuto, "");
  EXPECT_EQ(r.status().code(), absl::StatusCode::kUnimplemented);
  EXPECT_THAT(std::string(r.status().message()), HasSubstr("chatml"));
}

TEST(ChatTemplate, Qwen3RenderingAndAssistantOnlyMask) {
  auto segs = RenderChat(kChat, kQwen3Format, LossOn::kAssistant);
  ASSERT_TRUE(segs.ok()) << segs.status();
  TokenizedDocument d = TokenizeSegments(Qwen3(), *segs);
  // The exact text Qwen3's Jinja template renders (the final assistant turn gets an empty think block).
  EXPECT_EQ(Qwen3().Decode(d.tokens),
            "<|im_start|>system\nYou are terse.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
            "<|im_start|>assistant\nHello!<|im_end|>\n<|im_start|>user\n2+2?<|im_end|>\n"
            "<|im_start|>assistant\n<think>\n\n</think>\n\n4<|im_end|>\n");
  EXPECT_EQ(TrainedText(d), "Hello!<|im_end|>|<think>\n\n</think>\n\n4<|im_end|>");
  // EOS (<|im_end|>) of each assistant turn is trained; the "\n" after it is not.
  const uint32_t im_end = *Qwen3().TokenId("<|im_end|>");
  int trained_eos = 0;
  for (size_t i = 0; i < d.tokens.size(); ++i) trained_eos += d.tokens[i] == im_end && d.loss_mask[i];
  EXPECT_EQ(trained_eos, 2);
  EXPECT_EQ(d.loss_mask.back(), 0);
}

TEST(ChatTemplate, MatchesHfApplyChatTemplateOnCommittedSample) {
  // Oracle: tools/tokenizer/hf_chat_expected.py (transformers apply_chat_template + tokenizer).
  std::ifstream in(SourceDir() + "/tests/data/tokenizer/chat_sample.jsonl");
  std::ifstream expected(SourceDir() + "/tests/data/tokenizer/chat_sample.expected.jsonl");
  ASSERT_TRUE(in && expected);
  std::string line, want_line;
  int n = 0;
  while (std::getline(in, line) && std::getline(expected, want_line)) {
    json want = json::parse(want_line);
    auto segs = RenderChat(json::parse(line)["messages"], kQwen3Format, LossOn::kAssistant);
    ASSERT_TRUE(segs.ok()) << segs.status();
    std::string text;
    for (const Segment& s : *segs) text += s.text;
    EXPECT_EQ(text, want["text"].get<std::string>()) << "conversation " << n;
    EXPECT_EQ(TokenizeSegments(Qwen3(), *segs).tokens, want["ids"].get<std::vector<uint32_t>>())
        << "conversation " << n;
    ++n;
  }
  EXPECT_EQ(n, 8);
}

TEST(ChatTemplate, LossOnAllTrainsEverything) {
  auto segs = RenderChat(kChat, kQwen3Format, LossOn::kAll);
  ASSERT_TRUE(segs.ok());
  TokenizedDocument d = TokenizeSegments(Qwen3(), *segs);
  for (uint8_t m : d.loss_mask) EXPECT_EQ(m, 1);
}

TEST(ChatTemplate, ThinkContentIsSplitIntoReasoning) {
  json chat = json::parse(R"([{"role": "user", "content": "q"},
                              {"role": "assistant", "content": "<think>\nstep 1\n</think>\n\nanswer"}])");
  auto segs = RenderChat(chat, kQwen3Format, LossOn::kAssistant);
  ASSERT_TRUE(segs.ok());
  TokenizedDocument d = TokenizeSegments(Qwen3(), *segs);
  EXPECT_EQ(TrainedText(d), "<think>\nstep 1\n</think>\n\nanswer<|im_end|>");
  // An earlier turn (before the last user query) drops its reasoning, as the template does.
  json two = json::parse(R"([{"role": "user", "content": "q"},
                             {"role": "assistant", "content": "<think>r</think>a"},
                             {"role": "user", "content": "q2"}, {"role": "assistant", "content": "b"}])");
  auto s2 = RenderChat(two, kQwen3Format, LossOn::kAssistant);
  ASSERT_TRUE(s2.ok());
  EXPECT_EQ(TrainedText(TokenizeSegments(Qwen3(), *s2)), "a<|im_end|>|<think>\n\n</think>\n\nb<|im_end|>");
}

TEST(ChatTemplate, MalformedMessagesNameTheField) {
  auto bad_role = RenderChat(json::parse(R"([{"role": "robot", "content": "x"}])"), kQwen3Format, LossOn::kAssistant);
  EXPECT_THAT(std::string(bad_role.status().message()), HasSubstr("messages[0].role"));
  auto no_content = RenderChat(json::parse(R"([{"role": "user", "content": "x"}, {"role": "assistant"}])"),
                               kQwen3Format, LossOn::kAssistant);
  EXPECT_THAT(std::string(no_content.status().message()), HasSubstr("messages[1].content"));
  auto no_assistant =
      RenderChat(json::parse(R"([{"role": "user", "content": "x"}])"), kQwen3Format, LossOn::kAssistant);
  EXPECT_THAT(std::string(no_assistant.status().message()), HasSubstr("no assistant turn"));
  auto tools = RenderChat(json::parse(R"([{"role": "assistant", "content": "", "tool_calls": [{}]}])"), kQwen3Format,
                          LossOn::kAssistant);
  EXPECT_THAT(std::string(tools.status().message()), HasSubstr("tool_calls"));
}

PrepareOptions BaseOptions(const std::string& name, std::vector<std::string> inputs) {
  PrepareOptions o;
  o.model_dir = ModelDir();
  o.inputs = std::move(inputs);
  o.output_dir = TempPath(name);
  fs::remove_all(o.output_dir);
  o.seq_len = 64;
  o.threads = 2;
  return o;
}

TEST(Prepare, InputsOfEachFormPackedWithBoundariesAndSummary) {
  std::string long_text;
  for (int i = 0; i < 100; ++i) long_text += " word" + std::to_string(i * 7919);
  // One form per file (a file whose records change form is refused: FormatsTest).
  const std::string chat = WriteFile("mixed_chat.jsonl", json({{"messages", kChat}}).dump() + "\n");
  const std::string pc =
      WriteFile("mixed_pc.jsonl", json({{"prompt", "Translate: cat"}, {"completion", " chat"}}).dump() + "\n\n");
  const std::string text = WriteFile("mixed_text.jsonl", json({{"text", long_text}}).dump() + "\n");
  const std::string txt = WriteFile("plain.txt", "A plain text file.\nSecond line.\n");
  PrepareOptions o = BaseOptions("mixed_out", {chat, pc, text, txt});
  std::vector<PrepareProgress> progress;
  o.progress = [&](const PrepareProgress& p) { progress.push_back(p); };
  auto s = Prepare(o);
  ASSERT_TRUE(s.ok()) << s.status();
  EXPECT_EQ(s->train.documents, 4);
  EXPECT_EQ(s->chat_template, "qwen3");
  EXPECT_EQ(s->skipped_lines, 0);
  EXPECT_EQ(s->input_formats, (std::vector<std::string>{"messages", "prompt_completion", "text", "text"}));
  EXPECT_EQ(s->train.split_documents, 1);  // the 100-word text is longer than seq_len 64
  ASSERT_FALSE(progress.empty());
  EXPECT_EQ(progress.back().bytes_done, progress.back().bytes_total);
  EXPECT_TRUE(fs::exists(o.output_dir + "/prepare_summary.json"));

  auto r = data::DatasetReader::Open(s->train.dir, {.model_vocab_size = 151936});
  ASSERT_TRUE(r.ok()) << r.status();
  const auto& ds = **r;
  EXPECT_EQ(ds.manifest().num_documents, 4);
  for (int64_t row = 0; row < ds.num_rows(); ++row) {
    auto b = ds.Row(row);
    EXPECT_LE(b.end - b.begin, 64);
  }
  std::vector<uint32_t> tokens(ds.num_tokens());
  std::vector<uint8_t> mask(ds.num_tokens());
  ASSERT_TRUE(ds.ReadTokens(0, ds.num_tokens(), tokens.data(), mask.data()).ok());
  // Document 1 is prompt/completion: " chat" + EOS trained, the prompt not.
  const auto off = ds.doc_offsets();
  std::string trained;
  for (uint64_t t = off[1]; t < off[2]; ++t) {
    if (mask[t]) trained += Qwen3().TokenBytes(tokens[t]);
  }
  EXPECT_EQ(trained, " chat<|im_end|>");
  // The .txt file is one fully trained document ending in EOS.
  EXPECT_EQ(tokens[off[4] - 1], *Qwen3().TokenId("<|im_end|>"));
  for (uint64_t t = off[3]; t < off[4]; ++t) EXPECT_EQ(mask[t], 1);
}

TEST(Prepare, PaddedModeTruncatesAndCounts) {
  const std::string in = WriteFile("long.jsonl", json({{"text", std::string(3000, 'x') + " y z"}}).dump() + "\n" +
                                                     json({{"text", "short one"}}).dump() + "\n");
  PrepareOptions o = BaseOptions("padded_out", {in});
  o.packing = data::Packing::kPadded;
  o.seq_len = 16;
  auto s = Prepare(o);
  ASSERT_TRUE(s.ok()) << s.status();
  EXPECT_EQ(s->train.rows, 2);
  EXPECT_EQ(s->train.truncated_documents, 1);
}

TEST(Prepare, MalformedLinesFailWithFileLineAndField) {
  const std::string text = json({{"text", "fine"}}).dump();
  const std::string pc = json({{"prompt", "p"}, {"completion", "c"}}).dump();
  const std::string chat = json({{"messages", kChat}}).dump();
  struct Case {
    std::string good, line, expect;  // a good first line of the bad line's form (a file holds one form)
  };
  std::vector<Case> cases = {
      {text, "{not json", "not valid JSON"},
      {pc, R"({"prompt": "p"})", "field completion: missing"},
      {chat, R"({"messages": [{"role": "wizard", "content": "x"}]})", "messages[0].role"},
      {text, R"({"text": 5})", "field text: not a string"},
      {text, R"({"foo": 1})", "none of the fields"},
  };
  for (size_t k = 0; k < cases.size(); ++k) {
    const std::string in = WriteFile("bad" + std::to_string(k) + ".jsonl", cases[k].good + "\n" + cases[k].line + "\n");
    auto s = Prepare(BaseOptions("bad_out" + std::to_string(k), {in}));
    EXPECT_EQ(s.status().code(), absl::StatusCode::kInvalidArgument) << cases[k].line;
    EXPECT_THAT(std::string(s.status().message()), HasSubstr(in + ":2: ")) << cases[k].line;
    EXPECT_THAT(std::string(s.status().message()), HasSubstr(cases[k].expect));
  }
}

TEST(Prepare, SkipBadLinesCountsThem) {
  const std::string in =
      WriteFile("skip.jsonl", std::string("{oops\n") + json({{"text", "ok"}}).dump() + "\n{\"text\": 1}\n");
  PrepareOptions o = BaseOptions("skip_out", {in});
  o.bad_lines = BadLines::kSkip;
  auto s = Prepare(o);
  ASSERT_TRUE(s.ok()) << s.status();
  EXPECT_EQ(s->train.documents, 1);
  EXPECT_EQ(s->skipped_lines, 2);
  ASSERT_EQ(s->skipped_examples.size(), 2u);
  EXPECT_THAT(s->skipped_examples[0], HasSubstr(":1: not valid JSON"));
  EXPECT_THAT(s->skipped_examples[1], HasSubstr(":3: field text: not a string"));
}

TEST(Prepare, SplitIsDeterministicAndIndependentOfThreads) {
  std::string jsonl;
  for (int i = 0; i < 200; ++i) jsonl += json({{"text", "document number " + std::to_string(i)}}).dump() + "\n";
  const std::string in = WriteFile("split.jsonl", jsonl);
  auto run = [&](const std::string& name, int threads, uint64_t seed) {
    PrepareOptions o = BaseOptions(name, {in});
    o.validation_fraction = 0.25;
    o.seed = seed;
    o.threads = threads;
    o.batch_documents = 7;  // many batches
    auto s = Prepare(o);
    EXPECT_TRUE(s.ok()) << s.status();
    auto r = data::DatasetReader::Open(s->validation.dir);
    EXPECT_TRUE(r.ok());
    return std::make_pair(*s, (*r)->manifest().files[0].crc32);
  };
  auto [a, crc_a] = run("split_a", 1, 42);
  auto [b, crc_b] = run("split_b", 3, 42);
  auto [c, crc_c] = run("split_c", 2, 43);
  EXPECT_EQ(a.train.documents + a.validation.documents, 200);
  EXPECT_GT(a.validation.documents, 25);
  EXPECT_LT(a.validation.documents, 80);
  EXPECT_EQ(a.validation.documents, b.validation.documents);
  EXPECT_EQ(crc_a, crc_b);
  EXPECT_NE(crc_a, crc_c);
}

TEST(Prepare, JsonArrayFileAndErrorsByElement) {
  const std::string in =
      WriteFile("array.json", R"([{"text": "one"}, {"text": "two"}, {"text": 3}])");
  PrepareOptions o = BaseOptions("array_out", {in});
  auto s = Prepare(o);
  EXPECT_THAT(std::string(s.status().message()), HasSubstr(in + ":3: field text: not a string"));
  o.bad_lines = BadLines::kSkip;
  s = Prepare(o);
  ASSERT_TRUE(s.ok()) << s.status();
  EXPECT_EQ(s->train.documents, 2);
  EXPECT_EQ(s->skipped_lines, 1);
}

TEST(Prepare, JsonArrayIsStreamedByElement) {
  // The array is split without a DOM of the file: commas, brackets, braces and escaped quotes
  // inside strings and nested values do not end an element; a broken element is its own error.
  const std::string in = WriteFile("stream.json",
                                   " \n[ "
                                   R"json({"text": "a, ] } \" [ {", "extra": [1, {"x": [2]}]} ,
{"text": "two"}, {"text": 3}, {"text": nope} ]

)json");
  PrepareOptions o = BaseOptions("stream_out", {in});
  o.bad_lines = BadLines::kSkip;
  std::vector<PrepareProgress> progress;
  o.progress = [&](const PrepareProgress& p) { progress.push_back(p); };
  auto s = Prepare(o);
  ASSERT_TRUE(s.ok()) << s.status();
  EXPECT_EQ(s->train.documents, 2);
  ASSERT_EQ(s->skipped_examples.size(), 2u);
  EXPECT_THAT(s->skipped_examples[0], HasSubstr(in + ":3: field text: not a string"));
  EXPECT_THAT(s->skipped_examples[1], HasSubstr(in + ":4: not valid JSON"));
  ASSERT_FALSE(progress.empty());
  EXPECT_EQ(progress.back().bytes_done, progress.back().bytes_total);
  auto r = data::DatasetReader::Open(s->train.dir);
  ASSERT_TRUE(r.ok()) << r.status();
  std::vector<uint32_t> tokens((*r)->doc_offsets()[1]);
  ASSERT_TRUE((*r)->ReadTokens(0, static_cast<int64_t>(tokens.size()), tokens.data(), nullptr).ok());
  EXPECT_EQ(Qwen3().Decode(tokens), "a, ] } \" [ {<|im_end|>");

  struct Case {
    std::string text, expect;
  };
  for (const Case& c : std::vector<Case>{{"[]", "no usable training documents"},
                                         {"[{\"text\": \"x\"}", "unterminated JSON array"},
                                         {"[{\"text\": \"x ]\"}, ", "unterminated JSON array"},
                                         {"[{\"text\": \"x\"}] {}", "text after the JSON array's closing bracket"}}) {
    const std::string bad = WriteFile("stream_bad.json", c.text);
    auto b = Prepare(BaseOptions("stream_bad_out", {bad}));
    EXPECT_EQ(b.status().code(), absl::StatusCode::kInvalidArgument) << c.text;
    EXPECT_THAT(std::string(b.status().message()), HasSubstr(c.expect)) << c.text;
  }
}

// A model directory in the temp dir: Qwen3's tokenizer.json (a symlink) and the given
// tokenizer_config.json text (none when empty).
std::string FakeModelDir(const std::string& name, const std::string& config_text) {
  const std::string dir = TempPath(name);
  fs::remove_all(dir);
  fs::create_directories(dir);
  fs::create_symlink(ModelDir() + "/tokenizer.json", dir + "/tokenizer.json");
  if (!config_text.empty()) std::ofstream(dir + "/tokenizer_config.json") << config_text;
  return dir;
}

std::string Qwen3ConfigText() {
  std::ifstream in(ModelDir() + "/tokenizer_config.json");
  return std::string(std::istreambuf_iterator<char>(in), {});
}

// A FIFO or a device in the model directory is refused at once: a plain read blocks forever on
// a FIFO without a writer and grows memory without end on /dev/zero.
TEST(Prepare, ModelFilesThatAreNotRegularFilesAreRefused) {
  const std::string in = WriteFile("fifo.jsonl", json({{"text", "x y"}}).dump() + "\n");
  for (const std::string file : {"tokenizer.json", "tokenizer_config.json", "chat_template.jinja"}) {
    for (const bool fifo : {true, false}) {
      const std::string dir = FakeModelDir("fifo_model", Qwen3ConfigText());
      fs::remove(dir + "/" + file);
      if (fifo) {
        ASSERT_EQ(mkfifo((dir + "/" + file).c_str(), 0600), 0) << file;
      } else {
        fs::create_symlink("/dev/zero", dir + "/" + file);
      }
      PrepareOptions o = BaseOptions("fifo_out", {in});
      o.model_dir = dir;
      const auto start = std::chrono::steady_clock::now();
      auto s = Prepare(o);
      EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(30)) << file;
      EXPECT_EQ(s.status().code(), absl::StatusCode::kInvalidArgument) << file << " fifo " << fifo;
      EXPECT_THAT(std::string(s.status().message()), HasSubstr("is not a regular file")) << file;
      EXPECT_THAT(std::string(s.status().message()), HasSubstr(dir + "/" + file)) << file;
    }
  }
}

// eos_token / bos_token of the wrong type are errors, not silently "no token" (no EOS appended).
TEST(Prepare, WronglyTypedSpecialTokensAreErrors) {
  const std::string in = WriteFile("eos.jsonl", json({{"text", "x y"}}).dump() + "\n");
  for (const std::string key : {"eos_token", "bos_token"}) {
    for (const json& value : {json({{"content", 5}}), json(5), json::array({"<|im_end|>"})}) {
      json config = json::parse(Qwen3ConfigText());
      config[key] = value;
      PrepareOptions o = BaseOptions("eos_out", {in});
      o.model_dir = FakeModelDir("eos_model", config.dump());
      auto s = Prepare(o);
      EXPECT_EQ(s.status().code(), absl::StatusCode::kInvalidArgument) << key << " " << value.dump();
      EXPECT_THAT(std::string(s.status().message()), HasSubstr(key)) << value.dump();
      EXPECT_THAT(std::string(s.status().message()), HasSubstr("tokenizer_config.json")) << value.dump();
    }
  }
}

// tokenizer_config.json must be one JSON object nesting a few levels: a deeply nested one is
// refused before it is parsed (copying or printing it would overflow the stack), and a list of
// named templates with a wrongly typed name is an error naming the key, not an abort.
TEST(Prepare, MalformedTokenizerConfigIsAnErrorNamingTheFile) {
  const std::string text_in = WriteFile("cfg.jsonl", json({{"text", "x y"}}).dump() + "\n");
  const std::string chat_in = WriteFile("cfg_chat.jsonl", json({{"messages", kChat}}).dump() + "\n");
  const std::string deep = "{\"x\": " + std::string(1000000, '[') + std::string(1000000, ']') + "}";
  struct Case {
    std::string config, input, expect;
  };
  for (const Case& c : std::vector<Case>{
           {deep, text_in, "nested deeper than"},
           {"[1, 2]", text_in, "not a JSON object"},
           {R"({"chat_template": [{"name": 5, "template": "x"}]})", chat_in, "chat_template[0].name"}}) {
    PrepareOptions o = BaseOptions("cfg_out", {c.input});
    o.model_dir = FakeModelDir("cfg_model", c.config);
    absl::StatusOr<PrepareSummary> s = absl::UnknownError("not run");
    EXPECT_NO_THROW(s = Prepare(o)) << c.expect;
    EXPECT_EQ(s.status().code(), absl::StatusCode::kInvalidArgument) << c.expect;
    EXPECT_THAT(std::string(s.status().message()), HasSubstr(c.expect));
    EXPECT_THAT(std::string(s.status().message()), HasSubstr("tokenizer_config.json"));
  }
  // The same list of templates does not stop text data, which needs no template.
  PrepareOptions o = BaseOptions("cfg_text_out", {text_in});
  o.model_dir = FakeModelDir("cfg_model", R"({"chat_template": [{"name": 5, "template": "x"}]})");
  auto s = Prepare(o);
  EXPECT_TRUE(s.ok()) << s.status();
}

TEST(Prepare, RefusesNonEmptyOutputWithoutOverwrite) {
  const std::string in = WriteFile("ow.jsonl", json({{"text", "x y"}}).dump() + "\n");
  PrepareOptions o = BaseOptions("ow_out", {in});
  ASSERT_TRUE(Prepare(o).ok());
  EXPECT_EQ(Prepare(o).status().code(), absl::StatusCode::kAlreadyExists);
  o.overwrite = data::Overwrite::kYes;
  EXPECT_TRUE(Prepare(o).ok());
}

// A SentencePiece-style tokenizer (Mistral's structure: Prepend + Replace normalizer, byte
// fallback; tests/data/tokenizer/sentencepiece/mistral) prepares text and prompt/completion
// records: the ids are the tokenizer's own, and the loss mask splits at the completion although
// its leading space became part of a `▁` token.
TEST(Prepare, SentencePieceStyleTokenizer) {
  const std::string dir = TempPath("sp_model");
  fs::remove_all(dir);
  fs::create_directories(dir);
  fs::create_symlink(SourceDir() + "/tests/data/tokenizer/sentencepiece/mistral/tokenizer.json", dir + "/tokenizer.json");
  std::ofstream(dir + "/tokenizer_config.json") << R"({"bos_token": "<s>", "eos_token": "</s>"})";
  auto tok = tok::Tokenizer::FromFile(dir + "/tokenizer.json");
  ASSERT_TRUE(tok.ok()) << tok.status();
  const std::string text = "Emoji \U0001F600 and \u4e2d\u6587 fall back to bytes.";
  const std::string text_in = WriteFile("sp_text.jsonl", json({{"text", text}}).dump() + "\n");
  const std::string pc_in =
      WriteFile("sp_pc.jsonl", json({{"prompt", "Translate: cat"}, {"completion", " chat"}}).dump() + "\n");
  PrepareOptions o = BaseOptions("sp_out", {text_in, pc_in});
  o.model_dir = dir;
  auto s = Prepare(o);
  ASSERT_TRUE(s.ok()) << s.status();
  EXPECT_EQ(s->train.documents, 2);
  auto r = data::DatasetReader::Open(s->train.dir, {.model_vocab_size = (*tok)->vocab_size()});
  ASSERT_TRUE(r.ok()) << r.status();
  const auto& ds = **r;
  std::vector<uint32_t> tokens(ds.num_tokens());
  std::vector<uint8_t> mask(ds.num_tokens());
  ASSERT_TRUE(ds.ReadTokens(0, ds.num_tokens(), tokens.data(), mask.data()).ok());
  const auto off = ds.doc_offsets();
  std::vector<uint32_t> want = (*tok)->Encode(text + "</s>");
  EXPECT_EQ(std::vector<uint32_t>(tokens.begin() + off[0], tokens.begin() + off[1]), want);
  EXPECT_EQ((*tok)->Decode(want), text + "</s>");
  std::string trained;
  for (uint64_t t = off[1]; t < off[2]; ++t) {
    if (mask[t]) trained += (*tok)->TokenBytes(tokens[t]);
  }
  EXPECT_EQ(trained, "\u2581chat</s>");
}

}  // namespace
}  // namespace slidedp::prepare
