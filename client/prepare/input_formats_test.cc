// The record forms prepare reads (input_formats.h) on the Qwen3 tokenizer and template: detection,
// each form's rendering and trained spans, list-of-parts content, refusals naming file:line and
// field, a file that changes form, --format forcing, --show previews, the validation-split
// decision, padded truncation and dropped documents, and the manifest's "source".
#include "client/prepare/input_formats.h"

#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <iterator>

#include "absl/strings/str_cat.h"
#include "client/prepare/prepare.h"
#include "client/prepare/prepare_test_util.h"
#include "common/data/dataset.h"
#include "common/tokenizer/identity.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace slidedp::prepare {
namespace {

namespace fs = std::filesystem;
using json = nlohmann::json;
using test_data::Qwen3;
using ::testing::HasSubstr;

const ChatFormat kQwen3Format{ChatTemplate::kQwen3, "", "", ""};

std::string TempPath(const std::string& name) {
  return ::testing::TempDir() + "/input_formats_test_" + std::to_string(::getpid()) + "_" + name;
}

std::string WriteFile(const std::string& name, const std::string& text) {
  const std::string p = TempPath(name);
  std::ofstream(p) << text;
  return p;
}

std::string Lines(const std::vector<json>& records) {
  std::string out;
  for (const json& r : records) out += r.dump() + "\n";
  return out;
}

struct Rendering {
  std::string text;     // the whole rendered document
  std::string trained;  // the trained tokens' bytes, runs separated by '|'
};

Rendering Render(const std::vector<Segment>& segments) {
  TokenizedDocument d = TokenizeSegments(Qwen3(), segments);
  Rendering r;
  r.text = Qwen3().Decode(d.tokens);
  bool prev = false;
  for (size_t i = 0; i < d.tokens.size(); ++i) {
    if (d.loss_mask[i]) {
      if (!prev && !r.trained.empty()) r.trained += "|";
      r.trained += Qwen3().TokenBytes(d.tokens[i]);
    }
    prev = d.loss_mask[i] != 0;
  }
  return r;
}

// A record of a chat form rendered with Qwen3's template (assistant-only loss).
absl::StatusOr<Rendering> RenderRecord(const json& record, InputFormat format = InputFormat::kAuto) {
  if (format == InputFormat::kAuto) {
    auto detected = DetectInputFormat(record);
    if (!detected.ok()) return detected.status();
    format = *detected;
  }
  auto c = RecordConversation(record, format, ChatTemplate::kQwen3);
  if (!c.ok()) return c.status();
  auto segments =
      RenderChatMessages(c->messages, kQwen3Format, LossOn::kAssistant, GenerationPrompt::kNone, c->trained_field);
  if (!segments.ok()) return segments.status();
  return Render(*segments);
}

// The same conversation as plain messages.
Rendering RenderMessages(const json& messages) {
  auto segments = RenderChat(messages, kQwen3Format, LossOn::kAssistant);
  EXPECT_TRUE(segments.ok()) << segments.status();
  return segments.ok() ? Render(*segments) : Rendering{};
}

PrepareOptions Options(const std::string& name, std::vector<std::string> inputs) {
  PrepareOptions o;
  o.model_dir = test_data::Qwen3Dir();
  o.inputs = std::move(inputs);
  o.output_dir = TempPath(name);
  fs::remove_all(o.output_dir);
  o.seq_len = 256;
  o.threads = 2;
  return o;
}

std::string ErrorOf(const absl::StatusOr<PrepareSummary>& s) { return std::string(s.status().message()); }

TEST(InputFormats, NamesRoundTripAndDetectionPicksTheForm) {
  for (InputFormat f :
       {InputFormat::kAuto, InputFormat::kMessages, InputFormat::kShareGpt, InputFormat::kAlpaca,
        InputFormat::kConversationalPromptCompletion, InputFormat::kPromptCompletion, InputFormat::kText}) {
    EXPECT_EQ(*ParseInputFormatName(InputFormatName(f)), f);
  }
  EXPECT_THAT(std::string(ParseInputFormatName("openai").status().message()), HasSubstr("sharegpt"));
  struct Case {
    std::string record;
    InputFormat format;
  };
  for (const Case& c : std::vector<Case>{
           {R"({"messages": []})", InputFormat::kMessages},
           {R"({"conversations": [], "system": "s"})", InputFormat::kShareGpt},
           {R"({"instruction": "i", "output": "o"})", InputFormat::kAlpaca},
           {R"({"prompt": [], "completion": []})", InputFormat::kConversationalPromptCompletion},
           {R"({"prompt": "p", "completion": [{"role": "assistant", "content": "c"}]})",
            InputFormat::kConversationalPromptCompletion},
           {R"({"prompt": "p", "completion": "c"})", InputFormat::kPromptCompletion},
           {R"({"completion": "c"})", InputFormat::kPromptCompletion},
           {R"({"text": "t", "id": 3})", InputFormat::kText},
       }) {
    auto f = DetectInputFormat(json::parse(c.record));
    ASSERT_TRUE(f.ok()) << c.record;
    EXPECT_EQ(*f, c.format) << c.record;
  }
  EXPECT_THAT(std::string(DetectInputFormat(json::parse(R"({"question": "q"})")).status().message()),
              HasSubstr("has none of the fields messages, conversations"));
}

TEST(InputFormats, ListOfTextPartsRendersAsTheJoinedString) {
  const json parts = json::parse(R"({"messages": [
      {"role": "system", "content": [{"type": "text", "text": "Be "}, {"type": "text", "text": "brief."}]},
      {"role": "user", "content": [{"type": "text", "text": "Hi"}]},
      {"role": "assistant", "content": [{"type": "text", "text": "Hello"}, {"type": "text", "text": " there"}]}]})");
  const json strings = json::parse(R"([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
                                       {"role": "assistant", "content": "Hello there"}])");
  auto r = RenderRecord(parts);
  ASSERT_TRUE(r.ok()) << r.status();
  const Rendering want = RenderMessages(strings);
  EXPECT_EQ(r->text, want.text);
  EXPECT_EQ(r->trained, want.trained);
  EXPECT_EQ(r->trained, "<think>\n\n</think>\n\nHello there<|im_end|>");
  // An empty list is empty content, as "" is.
  EXPECT_TRUE(RenderRecord(json::parse(R"({"messages": [{"role": "user", "content": []},
                                                         {"role": "assistant", "content": "x"}]})"))
                  .ok());

  struct Case {
    std::string content, expect;
  };
  for (const Case& c : std::vector<Case>{
           {R"([{"type": "text", "text": "a"}, {"type": "image_url", "image_url": {"url": "x.png"}}])",
            "messages[0].content[1].type: \"image_url\" parts are not supported: prepare trains text only"},
           {R"([{"type": "input_audio", "input_audio": {}}])", "messages[0].content[0].type: \"input_audio\""},
           {R"([{"text": "no type"}])", "messages[0].content[0]: not a part"},
           {R"([{"type": "text", "text": 5}])", "messages[0].content[0].text: missing or not a string"},
           {R"(7)", "messages[0].content: a number, neither a string nor a list of parts"},
           {R"(null)", "messages[0].content: null, neither"},
       }) {
    const json record = {
        {"messages",
         {{{"role", "user"}, {"content", json::parse(c.content)}}, {{"role", "assistant"}, {"content", "ok"}}}}};
    auto bad = RenderRecord(record);
    EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument) << c.content;
    EXPECT_THAT(std::string(bad.status().message()), HasSubstr(c.expect));
  }
}

TEST(InputFormats, ShareGptMapsSpeakersToRolesAndTrainsTheAnswers) {
  const json sharegpt = json::parse(R"({"conversations": [
      {"from": "system", "value": "Be brief."}, {"from": "human", "value": "Hi"}, {"from": "gpt", "value": "Hello!"},
      {"from": "user", "value": "2+2?"}, {"from": "assistant", "value": "4"}]})");
  const json messages = json::parse(R"([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
      {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "2+2?"},
      {"role": "assistant", "content": "4"}])");
  auto r = RenderRecord(sharegpt);
  ASSERT_TRUE(r.ok()) << r.status();
  const Rendering want = RenderMessages(messages);
  EXPECT_EQ(r->text, want.text);
  EXPECT_EQ(r->trained, "Hello!<|im_end|>|<think>\n\n</think>\n\n4<|im_end|>");
  EXPECT_EQ(r->trained, want.trained);
  // A top-level "system" (LLaMA-Factory's column) is the leading system turn; {"role", "content"}
  // turns are read as well; observation/tool turns are tool messages.
  auto top = RenderRecord(json::parse(R"({"system": "Be brief.", "conversations": [
      {"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"},
      {"from": "human", "value": "2+2?"}, {"from": "gpt", "value": "4"}]})"));
  ASSERT_TRUE(top.ok()) << top.status();
  EXPECT_EQ(top->text, want.text);
  auto tool = RenderRecord(json::parse(R"({"conversations": [{"from": "human", "value": "q"},
      {"from": "gpt", "value": "calling"}, {"from": "observation", "value": "42"}, {"from": "gpt", "value": "42!"}]})"));
  ASSERT_TRUE(tool.ok()) << tool.status();
  EXPECT_THAT(tool->text, HasSubstr("<|im_start|>user\n<tool_response>\n42\n</tool_response><|im_end|>"));

  struct Case {
    std::string record, expect;
  };
  for (const Case& c : std::vector<Case>{
           {R"({"conversations": [{"from": "human", "value": "q"}, {"from": "bot", "value": "a"}]})",
            "conversations[1].from: \"bot\" is not one of human, user, gpt, assistant, system, tool, observation"},
           {R"({"conversations": [{"from": "human", "value": "q"}, {"from": "function_call", "value": "{}"}]})",
            "conversations[1].from: \"function_call\" turns (tool calls) are not supported yet"},
           {R"({"conversations": [{"from": "human"}]})", "conversations[0].value: missing"},
           {R"({"conversations": [{"value": "q"}]})", "conversations[0].role: missing or not a string"},
           {R"({"conversations": "hi"})", "field conversations: must be an array"},
           {R"({"conversations": []})", "field conversations: is empty"},
           {R"({"system": "a", "conversations": [{"from": "system", "value": "b"}, {"from": "gpt", "value": "c"}]})",
            "conversations[0]: a system turn as well as a top-level \"system\""},
           {R"({"conversations": [{"from": "human", "value": "q"}]})",
            "field conversations: no assistant turn, so nothing would be trained"},
       }) {
    auto bad = RenderRecord(json::parse(c.record));
    EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument) << c.record;
    EXPECT_THAT(std::string(bad.status().message()), HasSubstr(c.expect)) << c.record;
  }
}

TEST(InputFormats, AlpacaIsAUserTurnAndTrainsOnlyTheOutput) {
  auto r = RenderRecord(json::parse(
      R"({"instruction": "Translate to French.", "input": "cat", "output": "chat", "system": "You translate."})"));
  ASSERT_TRUE(r.ok()) << r.status();
  const Rendering want = RenderMessages(json::parse(R"([{"role": "system", "content": "You translate."},
      {"role": "user", "content": "Translate to French.\ncat"}, {"role": "assistant", "content": "chat"}])"));
  EXPECT_EQ(r->text, want.text);
  EXPECT_EQ(r->trained, "<think>\n\n</think>\n\nchat<|im_end|>");
  // No input (or an empty or null one): the instruction alone; no system: none rendered.
  for (const char* record : {R"({"instruction": "Say hi.", "output": "hi"})",
                             R"({"instruction": "Say hi.", "input": "", "output": "hi", "system": null})",
                             R"({"instruction": "Say hi.", "input": null, "output": "hi", "history": []})"}) {
    auto plain = RenderRecord(json::parse(record));
    ASSERT_TRUE(plain.ok()) << plain.status();
    EXPECT_EQ(plain->text,
              "<|im_start|>user\nSay hi.<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\nhi<|im_end|>\n")
        << record;
  }
  struct Case {
    std::string record, expect;
  };
  for (const Case& c : std::vector<Case>{
           {R"({"instruction": "i"})", "field output: missing, which alpaca records have"},
           {R"({"instruction": "i", "output": ""})", "field output: empty"},
           {R"({"instruction": "", "output": "o"})", "field instruction: empty, and no input"},
           {R"({"instruction": 3, "output": "o"})", "field instruction: a number, not a string"},
           {R"({"instruction": "i", "input": ["x"], "output": "o"})", "field input: an array, not a string"},
           {R"({"instruction": "i", "output": "o", "history": [["q", "a"]]})",
            "field history: multi-turn Alpaca records are not supported"},
       }) {
    auto bad = RenderRecord(json::parse(c.record));
    EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument) << c.record;
    EXPECT_THAT(std::string(bad.status().message()), HasSubstr(c.expect)) << c.record;
  }
}

TEST(InputFormats, ConversationalPromptCompletionTrainsOnlyTheCompletion) {
  const json record = json::parse(R"({
      "prompt": [{"role": "system", "content": "Answer with a number."}, {"role": "user", "content": "1+1?"},
                 {"role": "assistant", "content": "2"}, {"role": "user", "content": "2+2?"}],
      "completion": [{"role": "assistant", "content": "4"}]})");
  auto r = RenderRecord(record);
  ASSERT_TRUE(r.ok()) << r.status();
  json all = record["prompt"];
  all.push_back(record["completion"][0]);
  EXPECT_EQ(r->text, RenderMessages(all).text);                 // rendered as one conversation, as TRL does
  EXPECT_EQ(r->trained, "<think>\n\n</think>\n\n4<|im_end|>");  // the few-shot answer "2" is context
  struct Case {
    std::string record, expect;
  };
  for (const Case& c : std::vector<Case>{
           {R"({"prompt": "1+1?", "completion": [{"role": "assistant", "content": "2"}]})",
            "field prompt: a string, not a list of messages; prompt and completion are both strings"},
           {R"({"prompt": [{"role": "user", "content": "q"}]})", "field completion: missing"},
           {R"({"prompt": [{"role": "user", "content": "q"}], "completion": [{"role": "user", "content": "q"}]})",
            "field completion: no assistant turn, so nothing would be trained"},
           {R"({"prompt": [{"role": "user", "content": "q"}], "completion": [{"role": "bot", "content": "a"}]})",
            "field completion[0].role: \"bot\""},
           {R"({"prompt": [], "completion": [{"role": "assistant", "content": "a"}]})", "field prompt: is empty"},
       }) {
    auto bad = RenderRecord(json::parse(c.record));
    EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument) << c.record;
    EXPECT_THAT(std::string(bad.status().message()), HasSubstr(c.expect)) << c.record;
  }
}

// Prepare on one file of each form: every document trains exactly what the docs say.
TEST(InputFormats, PrepareWritesEachFormWithItsMask) {
  struct Case {
    json record;
    std::string text, trained;
  };
  const std::string qwen_answer = "<|im_start|>assistant\n<think>\n\n</think>\n\n";
  for (const Case& c : std::vector<Case>{
           {{{"prompt", "Q: 2+2?\nA:"}, {"completion", " 4"}}, "Q: 2+2?\nA: 4<|im_end|>", " 4<|im_end|>"},
           {{{"text", "Plain words."}}, "Plain words.<|im_end|>", "Plain words.<|im_end|>"},
           {{{"instruction", "Say hi."}, {"output", "hi"}},
            "<|im_start|>user\nSay hi.<|im_end|>\n" + qwen_answer + "hi<|im_end|>\n",
            "<think>\n\n</think>\n\nhi<|im_end|>"},
           {{{"conversations", {{{"from", "human"}, {"value", "Hi"}}, {{"from", "gpt"}, {"value", "Yo"}}}}},
            "<|im_start|>user\nHi<|im_end|>\n" + qwen_answer + "Yo<|im_end|>\n",
            "<think>\n\n</think>\n\nYo<|im_end|>"},
       }) {
    const std::string in = WriteFile("each.jsonl", Lines({c.record}));
    auto s = Prepare(Options("each_out", {in}));
    ASSERT_TRUE(s.ok()) << s.status();
    auto r = data::DatasetReader::Open(s->train.dir);
    ASSERT_TRUE(r.ok()) << r.status();
    std::vector<uint32_t> tokens((*r)->num_tokens());
    std::vector<uint8_t> mask(tokens.size());
    ASSERT_TRUE((*r)->ReadTokens(0, (*r)->num_tokens(), tokens.data(), mask.data()).ok());
    EXPECT_EQ(Qwen3().Decode(tokens), c.text) << c.record.dump();
    std::string trained;
    for (size_t i = 0; i < tokens.size(); ++i) {
      if (mask[i]) trained += Qwen3().TokenBytes(tokens[i]);
    }
    EXPECT_EQ(trained, c.trained) << c.record.dump();
  }
}

TEST(InputFormats, AFileWhoseRecordsChangeFormIsRefusedNamingTheLine) {
  const std::string in = WriteFile(
      "mixed.jsonl",
      Lines({{{"messages", {{{"role", "user"}, {"content", "q"}}, {{"role", "assistant"}, {"content", "a"}}}}},
             {{"messages", {{{"role", "user"}, {"content", "q"}}, {{"role", "assistant"}, {"content", "b"}}}}}}) +
          "\n" + Lines({{{"instruction", "i"}, {"output", "o"}}}));
  for (BadLines bad_lines : {BadLines::kFail, BadLines::kSkip}) {
    PrepareOptions o = Options("mixed_out", {in});
    o.bad_lines = bad_lines;
    auto s = Prepare(o);
    EXPECT_EQ(s.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(ErrorOf(s),
                HasSubstr(in + ":4: the record is alpaca, but the file's first record (line 1) is messages"));
    EXPECT_THAT(ErrorOf(s), HasSubstr("force one with --format"));
    EXPECT_FALSE(fs::exists(o.output_dir + "/train"));
  }
  // A first line that is not JSON does not decide the file's form (with --skip-bad it is skipped).
  const std::string late =
      WriteFile("late.jsonl", "{oops\n" + Lines({{{"text", "a b"}}, {{"prompt", "p"}, {"completion", "c"}}}));
  PrepareOptions o = Options("late_out", {late});
  o.bad_lines = BadLines::kSkip;
  EXPECT_THAT(ErrorOf(Prepare(o)),
              HasSubstr(late + ":3: the record is prompt_completion, but the file's first record (line 2) is text"));
  // Different files may hold different forms.
  const std::string a = WriteFile("form_a.jsonl", Lines({{{"instruction", "i"}, {"output", "o"}}}));
  const std::string b = WriteFile("form_b.jsonl", Lines({{{"text", "t u"}}}));
  auto both = Prepare(Options("forms_out", {a, b}));
  ASSERT_TRUE(both.ok()) << both.status();
  EXPECT_EQ(both->input_formats, (std::vector<std::string>{"alpaca", "text"}));
}

TEST(InputFormats, ForcedFormatReadsEveryRecordAsIt) {
  // Records with both a "messages" and a "text" field: auto reads messages, --format text the text.
  const json record = {{"messages", {{{"role", "user"}, {"content", "q"}}, {{"role", "assistant"}, {"content", "a"}}}},
                       {"text", "just the text"}};
  const std::string in = WriteFile("forced.jsonl", Lines({record, record}));
  PrepareOptions o = Options("forced_out", {in});
  o.format = InputFormat::kText;
  auto s = Prepare(o);
  ASSERT_TRUE(s.ok()) << s.status();
  EXPECT_EQ(s->input_formats, std::vector<std::string>{"text"});
  EXPECT_EQ(s->chat_template, "");
  auto r = data::DatasetReader::Open(s->train.dir);
  ASSERT_TRUE(r.ok());
  std::vector<uint32_t> tokens((*r)->doc_offsets()[1]);
  ASSERT_TRUE((*r)->ReadTokens(0, static_cast<int64_t>(tokens.size()), tokens.data(), nullptr).ok());
  EXPECT_EQ(Qwen3().Decode(tokens), "just the text<|im_end|>");
  // A forced form whose field a record lacks: refused naming file:line and the field.
  o.format = InputFormat::kShareGpt;
  o.output_dir = TempPath("forced_out2");
  auto bad = Prepare(o);
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(ErrorOf(bad), HasSubstr(in + ":1: field conversations: missing, which sharegpt records have"));
}

TEST(InputFormats, RefusalsNameFileLineAndField) {
  const json good = {{"conversations", {{{"from", "human"}, {"value", "q"}}, {{"from", "gpt"}, {"value", "a"}}}}};
  const json bad = {{"conversations", {{{"from", "human"}, {"value", "q"}}, {{"from", "bot"}, {"value", "a"}}}}};
  const std::string in = WriteFile("refusal.jsonl", Lines({good, bad}));
  auto s = Prepare(Options("refusal_out", {in}));
  EXPECT_EQ(s.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(ErrorOf(s), HasSubstr(in + ":2: field conversations[1].from: \"bot\" is not one of"));
  const json image = {{"messages",
                       {{{"role", "user"},
                         {"content",
                          {{{"type", "text"}, {"text", "what is this?"}},
                           {{"type", "image_url"}, {"image_url", {{"url", "cat.png"}}}}}}},
                        {{"role", "assistant"}, {"content", "a cat"}}}}};
  const std::string img = WriteFile("image.jsonl", Lines({image}));
  auto i = Prepare(Options("image_out", {img}));
  EXPECT_THAT(ErrorOf(i),
              HasSubstr(img + ":1: field messages[0].content[1].type: \"image_url\" parts are not supported"));
}

TEST(InputFormats, PreviewShowsTheDocumentsAsTrainedAndWritesNothing) {
  const std::string in =
      WriteFile("preview.jsonl", "\n" + Lines({{{"instruction", "Say hi."}, {"output", "hi"}},
                                               {{"instruction", "Say bye."}, {"input", "politely"}, {"output", "bye"}},
                                               {{"instruction", "Third."}, {"output", "3"}}}));
  PrepareOptions o = Options("preview_out", {in});
  o.output_dir.clear();
  auto p = PreviewDocuments(o, 2);
  ASSERT_TRUE(p.ok()) << p.status();
  ASSERT_EQ(p->size(), 2u);
  const DocumentPreview& second = (*p)[1];
  EXPECT_EQ(second.where, in + ":3");
  EXPECT_EQ(second.format, InputFormat::kAlpaca);
  EXPECT_EQ(second.chat_template, "qwen3");
  EXPECT_GT(second.trained_tokens, 0);
  EXPECT_LT(second.trained_tokens, second.tokens);
  EXPECT_EQ(FormatPreview(second, 2, SpanMarks::kBrackets),
            "--- 2: " + in + ":3 (alpaca, qwen3 template): " + std::to_string(second.tokens) + " tokens, " +
                std::to_string(second.trained_tokens) +
                " trained ---\n<|im_start|>user\nSay bye.\npolitely<|im_end|>\n<|im_start|>assistant\n"
                "[[<think>\n\n</think>\n\nbye<|im_end|>]]\n");
  EXPECT_THAT(FormatPreview(second, 2, SpanMarks::kColor),
              HasSubstr("\033[1;32m<think>\n\n</think>\n\nbye<|im_end|>\033[0m"));
  // More than there are: all of them. A text document's first token is no target.
  auto all = PreviewDocuments(o, 10);
  ASSERT_TRUE(all.ok());
  EXPECT_EQ(all->size(), 3u);
  const std::string text = WriteFile("preview_text.jsonl", Lines({{{"text", "Hello world"}}}));
  auto t = PreviewDocuments(Options("preview_text_out", {text}), 1);
  ASSERT_TRUE(t.ok()) << t.status();
  EXPECT_EQ(FormatPreview((*t)[0], 1, SpanMarks::kBrackets)
                .substr(FormatPreview((*t)[0], 1, SpanMarks::kBrackets).find('\n') + 1),
            "Hello[[ world<|im_end|>]]\n");
  // Bad records fail the preview as they would fail prepare.
  const std::string bad = WriteFile("preview_bad.jsonl", Lines({{{"instruction", "i"}}}));
  EXPECT_THAT(std::string(PreviewDocuments(Options("preview_bad_out", {bad}), 1).status().message()),
              HasSubstr(bad + ":1: field output: missing"));
}

TEST(InputFormats, AValidationFractionThatHoldsNothingOutIsRefusedAndASmallOneWarned) {
  std::vector<json> records;
  for (int i = 0; i < 6; ++i) records.push_back({{"text", "document " + std::to_string(i)}});
  const std::string few = WriteFile("val_few.jsonl", Lines(records));
  PrepareOptions o = Options("val_few_out", {few});
  o.validation_fraction = 0.01;
  auto s = Prepare(o);
  EXPECT_EQ(s.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(ErrorOf(s), HasSubstr("--validation-fraction 0.01 put none of the 6 documents in the validation split"));
  EXPECT_THAT(ErrorOf(s), HasSubstr("6 documents are too few to hold some out: use --validation-fraction 0"));
  EXPECT_FALSE(fs::exists(o.output_dir + "/train"));

  records.clear();
  for (int i = 0; i < 300; ++i) records.push_back({{"text", "document " + std::to_string(i)}});
  const std::string many = WriteFile("val_many.jsonl", Lines(records));
  // A fraction this small holds a few documents out (the seeded hash decides which: 1 with seed 0).
  PrepareOptions m = Options("val_many_out", {many});
  m.validation_fraction = 0.01;
  auto small = Prepare(m);
  ASSERT_TRUE(small.ok()) << small.status();
  EXPECT_EQ(small->validation.documents, 1);
  ASSERT_EQ(small->warnings.size(), 1u);
  EXPECT_THAT(small->warnings[0], HasSubstr("the validation split holds only 1 of the 300 documents "
                                            "(--validation-fraction 0.01): its loss will be noise; "
                                            "--validation-fraction 0.04 would hold about 10 out"));
  m.validation_fraction = 0.2;
  m.output_dir = TempPath("val_many_out2");
  auto enough = Prepare(m);
  ASSERT_TRUE(enough.ok()) << enough.status();
  EXPECT_TRUE(enough->warnings.empty());
}

TEST(InputFormats, PaddedTruncationAndDroppedDocumentsAreCountedAndWarned) {
  std::string long_prompt;
  for (int i = 0; i < 40; ++i) long_prompt += " context" + std::to_string(i);
  const std::string in =
      WriteFile("trunc.jsonl",
                Lines({{{"prompt", "Q:"}, {"completion", long_prompt}},  // truncated: its tail's trained tokens lost
                       {{"prompt", long_prompt}, {"completion", " answer"}},  // dropped: nothing trained within 16
                       {{"prompt", "Q:"}, {"completion", " short"}}}));
  PrepareOptions o = Options("trunc_out", {in});
  o.packing = data::Packing::kPadded;
  o.seq_len = 16;
  auto s = Prepare(o);
  ASSERT_TRUE(s.ok()) << s.status();
  EXPECT_EQ(s->train.documents, 2);
  EXPECT_EQ(s->train.truncated_documents, 1);
  EXPECT_EQ(s->train.dropped_documents, 1);
  EXPECT_GT(s->train.truncated_trained_tokens, 40);
  ASSERT_EQ(s->warnings.size(), 1u);
  EXPECT_THAT(s->warnings[0], HasSubstr("1 documents longer than --seq-len 16 were truncated (--packing padded): "));
  EXPECT_THAT(s->warnings[0], HasSubstr("1 more had no trained token within it and were dropped"));
  std::ifstream summary_file(o.output_dir + "/prepare_summary.json");
  const json summary = json::parse(summary_file);
  EXPECT_EQ(summary["dropped_documents"], 1);
  EXPECT_EQ(summary["truncated_documents"], 1);
  EXPECT_EQ(summary["train"]["truncated_trained_tokens"], s->train.truncated_trained_tokens);
  EXPECT_EQ(summary["warnings"].size(), 1u);
}

std::string ReadText(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), {});
}

TEST(InputFormats, ManifestsRecordTheSource) {
  const std::string chat = WriteFile("source_chat.jsonl", Lines({{{"instruction", "i"}, {"output", "o"}}}));
  auto s = Prepare(Options("source_out", {chat}));
  ASSERT_TRUE(s.ok()) << s.status();
  auto identity = tok::IdentifyTokenizer(test_data::Qwen3Dir());
  ASSERT_TRUE(identity.ok());
  auto r = data::DatasetReader::Open(s->train.dir);
  ASSERT_TRUE(r.ok()) << r.status();
  ASSERT_TRUE((*r)->manifest().source.has_value());
  const data::DatasetSource& src = *(*r)->manifest().source;
  EXPECT_EQ(src.tokenizer_fingerprint, identity->fingerprint);
  EXPECT_EQ(src.tokenizer_vocab_size, 151669);
  EXPECT_EQ(src.model_vocab_size, 0);  // the test directory has no config.json
  EXPECT_EQ(src.chat_template, "qwen3");
  const json config = json::parse(ReadText(test_data::Qwen3Dir() + "/tokenizer_config.json"));
  EXPECT_EQ(src.chat_template_sha256, tok::Sha256Hex(config["chat_template"].get<std::string>()));
  EXPECT_EQ(src.model, fs::absolute(test_data::Qwen3Dir()).lexically_normal().string());
  EXPECT_EQ(json::parse(ReadText(s->train.dir + "/manifest.json"))["source"]["chat_template"], "qwen3");

  // Text only: no template. A model directory with config.json: its vocab_size, and a warning when
  // the tokens do not fit it.
  const std::string dir = TempPath("source_model");
  fs::remove_all(dir);
  fs::create_directories(dir);
  for (const char* f : {"tokenizer.json", "tokenizer_config.json"}) {
    fs::create_symlink(test_data::Qwen3Dir() + "/" + f, dir + "/" + f);
  }
  const std::string text = WriteFile("source_text.jsonl", Lines({{{"text", "Hello there"}}}));
  for (const int64_t vocab : {151936, 1000}) {
    std::ofstream(dir + "/config.json") << json({{"vocab_size", vocab}}).dump();
    PrepareOptions o = Options("source_text_out", {text});
    o.model_dir = dir;
    auto t = Prepare(o);
    ASSERT_TRUE(t.ok()) << t.status();
    EXPECT_EQ(t->source.chat_template, "none");
    EXPECT_EQ(t->source.chat_template_sha256, "");
    EXPECT_EQ(t->source.model_vocab_size, vocab);
    EXPECT_EQ(t->source.tokenizer_fingerprint, identity->fingerprint);  // same files, another directory
    if (vocab == 1000) {
      ASSERT_EQ(t->warnings.size(), 1u);
      EXPECT_THAT(t->warnings[0], HasSubstr("is not below the model's config.json vocab_size 1000"));
    } else {
      EXPECT_TRUE(t->warnings.empty());
    }
  }
  std::ofstream(dir + "/config.json") << R"({"vocab_size": "many"})";
  PrepareOptions o = Options("source_bad_out", {text});
  o.model_dir = dir;
  auto bad = Prepare(o);
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(ErrorOf(bad), HasSubstr(dir + "/config.json: vocab_size \"many\" is not an integer"));
}

}  // namespace
}  // namespace slidedp::prepare
