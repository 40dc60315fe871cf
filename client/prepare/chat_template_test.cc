// Chat templates against HF: every committed template renders every case of
// tests/data/chat_templates/conversations.jsonl byte for byte as transformers' apply_chat_template
// did (expected/<name>.jsonl, tools/chat_template/hf_render.py), tokenizes to HF's ids, and marks
// exactly the assistant replies with their end-of-turn token; recognition of the model's template
// (whitespace Jinja does not render is ignored, anything else is refused with the difference), the
// Llama date, Python's strip and tojson, and prepare end to end on the Llama 3 tokenizer.
#include <unistd.h>

#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <memory>

#include "absl/strings/match.h"
#include "absl/strings/str_replace.h"
#include "client/prepare/chat_template.h"
#include "client/prepare/known_chat_templates.h"
#include "client/prepare/prepare.h"
#include "common/data/dataset.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "client/prepare/prepare_test_util.h"

namespace slidedp::prepare {
namespace {
namespace fs = std::filesystem;
using ::testing::HasSubstr;
using json = nlohmann::json;

using test_data::SourceDir;
std::string DataDir() { return SourceDir() + "/tests/data/chat_templates"; }
using test_data::Qwen3Dir;
std::string Llama3Dir() { return DataDir() + "/llama3"; }

json ReadJson(const std::string& path) {
  std::ifstream in(path);
  EXPECT_TRUE(in) << path;
  return json::parse(in);
}

std::vector<json> ReadJsonLines(const std::string& path) {
  std::ifstream in(path);
  EXPECT_TRUE(in) << path;
  std::vector<json> out;
  for (std::string line; std::getline(in, line);) {
    if (!line.empty()) out.push_back(json::parse(line));
  }
  return out;
}

const tok::Tokenizer& LoadTokenizer(const std::string& dir) {
  static auto* cache = new std::map<std::string, std::unique_ptr<tok::Tokenizer>>;
  auto& t = (*cache)[dir];
  if (t == nullptr) {
    auto r = tok::Tokenizer::FromFile(dir + "/tokenizer.json");
    EXPECT_TRUE(r.ok()) << r.status();
    t = std::move(*r);
  }
  return *t;
}

// Each committed template: its tokenizer_config.json, the tokenizer its oracle used, what it is.
struct TemplateCase {
  const char* name;  // expected/<name>.jsonl
  std::string config;
  std::string tokenizer_dir;
  ChatTemplate tmpl;
  const char* header;  // what precedes an assistant reply
  const char* end;     // the reply's end-of-turn token
};

std::vector<TemplateCase> Templates() {
  return {
      {"qwen3", Qwen3Dir() + "/tokenizer_config.json", Qwen3Dir(), ChatTemplate::kQwen3, "<|im_start|>assistant\n",
       "<|im_end|>"},
      {"qwen2.5", DataDir() + "/qwen2.5-instruct.tokenizer_config.json", Qwen3Dir(), ChatTemplate::kQwen2_5,
       "<|im_start|>assistant\n", "<|im_end|>"},
      {"llama3", Llama3Dir() + "/tokenizer_config.json", Llama3Dir(), ChatTemplate::kLlama3,
       "<|start_header_id|>assistant<|end_header_id|>\n\n", "<|eot_id|>"},
      {"llama3.1", DataDir() + "/llama3.1-instruct.tokenizer_config.json", Llama3Dir(), ChatTemplate::kLlama3_1,
       "<|start_header_id|>assistant<|end_header_id|>\n\n", "<|eot_id|>"},
      {"llama3.2", DataDir() + "/llama3.2-instruct.tokenizer_config.json", Llama3Dir(), ChatTemplate::kLlama3_2,
       "<|start_header_id|>assistant<|end_header_id|>\n\n", "<|eot_id|>"},
  };
}

std::string TemplateText(const std::string& config_path) { return ReadJson(config_path)["chat_template"]; }

TEST(KnownChatTemplates, AreTheCommittedTemplatesVerbatim) {
  std::map<std::string, std::string> files = {
      {"qwen3", Qwen3Dir() + "/tokenizer_config.json"},
      {"llama3", Llama3Dir() + "/tokenizer_config.json"},
      {"llama3.1", DataDir() + "/llama3.1-instruct.tokenizer_config.json"},
      {"llama3.2", DataDir() + "/llama3.2-instruct.tokenizer_config.json"},
  };
  int qwen25 = 0;
  for (const KnownChatTemplate& k : KnownChatTemplates()) {
    const std::string name = ChatTemplateName(k.tmpl);
    if (k.tmpl == ChatTemplate::kQwen2_5) {
      const char* file = qwen25++ == 0 ? "/qwen2.5-instruct.tokenizer_config.json"
                                       : "/qwen2.5-instruct-toolbraces.tokenizer_config.json";
      EXPECT_EQ(k.text, TemplateText(DataDir() + file)) << file;
    } else {
      ASSERT_TRUE(files.count(name)) << name;
      EXPECT_EQ(k.text, TemplateText(files[name])) << name;
    }
  }
  EXPECT_EQ(qwen25, 2);
}

TEST(KnownChatTemplates, EachCommittedConfigIsRecognised) {
  for (const TemplateCase& t : Templates()) {
    auto f = ResolveChatFormat(ReadJson(t.config), ChatTemplate::kAuto, "");
    ASSERT_TRUE(f.ok()) << t.name << ": " << f.status();
    EXPECT_EQ(f->tmpl, t.tmpl) << t.name;
    const bool llama = std::string(t.name).rfind("llama", 0) == 0;
    EXPECT_EQ(f->bos_token, llama ? "<|begin_of_text|>" : "") << t.name;
    const bool dated = t.tmpl == ChatTemplate::kLlama3_1 || t.tmpl == ChatTemplate::kLlama3_2;
    EXPECT_EQ(f->date_string, dated ? "26 Jul 2024" : "") << t.name;
  }
  auto braces = ResolveChatFormat(ReadJson(DataDir() + "/qwen2.5-instruct-toolbraces.tokenizer_config.json"),
                                  ChatTemplate::kAuto, "");
  ASSERT_TRUE(braces.ok()) << braces.status();
  EXPECT_EQ(braces->tmpl, ChatTemplate::kQwen2_5);
}

// The oracle: text, ids and the trained replies of every case under every template.
TEST(ChatTemplate, MatchesHfApplyChatTemplateOnEveryCase) {
  const std::vector<json> cases = ReadJsonLines(DataDir() + "/conversations.jsonl");
  ASSERT_EQ(cases.size(), 13u);
  for (const TemplateCase& t : Templates()) {
    const std::vector<json> expected = ReadJsonLines(DataDir() + "/expected/" + t.name + ".jsonl");
    ASSERT_EQ(expected.size(), cases.size()) << t.name;
    const tok::Tokenizer& tokenizer = LoadTokenizer(t.tokenizer_dir);
    const json config = ReadJson(t.config);
    const bool dated = t.tmpl == ChatTemplate::kLlama3_1 || t.tmpl == ChatTemplate::kLlama3_2;
    for (size_t i = 0; i < cases.size(); ++i) {
      const json& c = cases[i];
      const std::string where = std::string(t.name) + " case " + std::to_string(i);
      auto format = ResolveChatFormat(config, ChatTemplate::kAuto, dated ? c.value("date_string", "") : "");
      ASSERT_TRUE(format.ok()) << where << ": " << format.status();
      const GenerationPrompt gen =
          c.value("add_generation_prompt", false) ? GenerationPrompt::kAppend : GenerationPrompt::kNone;
      auto segs = RenderChat(c["messages"], *format, LossOn::kAssistant, gen);
      ASSERT_TRUE(segs.ok()) << where << ": " << segs.status();
      std::string text;
      std::vector<std::string> replies;
      for (const Segment& s : *segs) {
        if (s.trained) {
          // Every trained run is one whole reply: right after the assistant header, through the
          // end-of-turn token, which it holds only at its end.
          EXPECT_TRUE(absl::EndsWith(text, t.header)) << where;
          EXPECT_TRUE(absl::EndsWith(s.text, t.end)) << where;
          EXPECT_EQ(s.text.find(t.end), s.text.size() - strlen(t.end)) << where;
          replies.push_back(s.text);
        }
        text += s.text;
      }
      EXPECT_EQ(text, expected[i]["text"].get<std::string>()) << where;
      int assistants = 0;
      for (const json& m : c["messages"]) {
        if (m["role"] != "assistant") continue;
        // The reply as each template writes it (Qwen3's think handling is checked by the text).
        const std::string content = m["content"];
        if (t.tmpl == ChatTemplate::kQwen2_5) {
          EXPECT_EQ(replies.at(assistants), content + "<|im_end|>") << where;
        } else if (t.tmpl != ChatTemplate::kQwen3) {
          EXPECT_EQ(replies.at(assistants), PythonStrip(content) + "<|eot_id|>") << where;
        }
        ++assistants;
      }
      EXPECT_EQ(static_cast<int>(replies.size()), assistants) << where;

      TokenizedDocument d = TokenizeSegments(tokenizer, *segs);
      EXPECT_EQ(d.tokens, expected[i]["ids"].get<std::vector<uint32_t>>()) << where;
      // Token level: each reply's end token is trained, and nothing after it until the next reply.
      const uint32_t end_id = *tokenizer.TokenId(t.end);
      int trained_ends = 0;
      for (size_t k = 0; k < d.tokens.size(); ++k) {
        if (d.tokens[k] == end_id && d.loss_mask[k]) {
          ++trained_ends;
          if (k + 1 < d.tokens.size()) {
            EXPECT_EQ(d.loss_mask[k + 1], 0) << where;
          }
        }
      }
      EXPECT_EQ(trained_ends, assistants) << where;
    }
  }
}

TEST(ChatTemplate, LlamaDateIsTheTemplatesDefaultOrTheGivenOne) {
  const json config = ReadJson(DataDir() + "/llama3.2-instruct.tokenizer_config.json");
  const json chat = json::parse(R"([{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hey"}])");
  auto text = [&](const std::string& date) {
    auto f = ResolveChatFormat(config, ChatTemplate::kAuto, date);
    EXPECT_TRUE(f.ok()) << f.status();
    auto segs = RenderChat(chat, *f, LossOn::kAssistant);
    EXPECT_TRUE(segs.ok()) << segs.status();
    std::string s;
    for (const Segment& seg : *segs) s += seg.text;
    return s;
  };
  EXPECT_THAT(text(""), HasSubstr("Cutting Knowledge Date: December 2023\nToday Date: 26 Jul 2024\n\n<|eot_id|>"));
  EXPECT_THAT(text("05 Dec 2026"), HasSubstr("Today Date: 05 Dec 2026\n\n<|eot_id|>"));
  // A date where the template has none is a mistake, not something to ignore.
  auto qwen = ResolveChatFormat(ReadJson(Qwen3Dir() + "/tokenizer_config.json"), ChatTemplate::kAuto, "05 Dec 2026");
  EXPECT_EQ(qwen.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(qwen.status().message()), HasSubstr("llama3.1 and llama3.2"));
}

TEST(ChatTemplate, RecognitionIgnoresOnlyWhatJinjaDoesNotRender) {
  const std::string llama31 = TemplateText(DataDir() + "/llama3.1-instruct.tokenizer_config.json");
  json config = {{"bos_token", "<|begin_of_text|>"}};
  auto identify = [&](const std::string& text) { return IdentifyChatTemplate(text); };
  // Whitespace a `-` strips, whitespace inside tags, comment text, the trailing newline: the same.
  std::string same =
      absl::StrReplaceAll(llama31, {{"\n    {%- set tools = custom_tools %}", "{%- set  tools =\n custom_tools %}"},
                                    {"This block extracts the system message", "Comment reworded"},
                                    {"{{- bos_token }}", "{{-   bos_token\n}}"}});
  ASSERT_NE(same, llama31);
  auto same_id = identify(same);
  ASSERT_TRUE(same_id.ok()) << same_id.status();
  EXPECT_EQ(*same_id, ChatTemplate::kLlama3_1);
  // Jinja drops one trailing newline (Llama 3's template has none).
  auto newline_id = identify(TemplateText(Llama3Dir() + "/tokenizer_config.json") + "\n");
  ASSERT_TRUE(newline_id.ok()) << newline_id.status();
  EXPECT_EQ(*newline_id, ChatTemplate::kLlama3);
  // A different literal, a lost `-` (the newline after it would render), an extra statement: refused.
  std::string date = absl::StrReplaceAll(llama31, {{"26 Jul 2024", "01 Jan 2025"}});
  auto r = identify(date);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kUnimplemented);
  EXPECT_THAT(std::string(r.status().message()), HasSubstr("Llama 3.1 / 3.3 Instruct"));
  EXPECT_THAT(std::string(r.status().message()), HasSubstr("01 Jan 2025"));
  EXPECT_THAT(std::string(r.status().message()),
              HasSubstr("at byte " + std::to_string(date.find("{%- set date_string = \"01 Jan 2025\"")) + " "));
  EXPECT_FALSE(identify(absl::StrReplaceAll(llama31, {{"{{- bos_token }}", "{{ bos_token }}"}})).ok());
  EXPECT_FALSE(identify(llama31 + "{{- eos_token }}").ok());
  EXPECT_FALSE(identify(absl::StrReplaceAll(llama31, {{"message['content'] | trim", "message['content']"}})).ok());
  // Families are named; unknown ones and unclosed tags are refused with what is supported.
  auto qwen = identify(absl::StrReplaceAll(TemplateText(DataDir() + "/qwen2.5-instruct.tokenizer_config.json"),
                                           {{"helpful assistant.", "helpful, harmless assistant."}}));
  EXPECT_THAT(std::string(qwen.status().message()), HasSubstr("looks like Qwen2.5 Instruct's"));
  auto mistral = identify("{{ bos_token }}{% for m in messages %}[INST] {{ m['content'] }} [/INST]{% endfor %}");
  EXPECT_EQ(mistral.status().code(), absl::StatusCode::kUnimplemented);
  EXPECT_THAT(std::string(mistral.status().message()), HasSubstr("qwen3, qwen2.5, llama3, llama3.1, llama3.2"));
  EXPECT_EQ(identify("{{ messages").status().code(), absl::StatusCode::kInvalidArgument);
}

TEST(ChatTemplate, ConfigFormsAndRequestedTemplates) {
  const std::string llama31 = TemplateText(DataDir() + "/llama3.1-instruct.tokenizer_config.json");
  json listed = {
      {"bos_token", "<|begin_of_text|>"},
      {"chat_template", {{{"name", "tool_use"}, {"template", "x"}}, {{"name", "default"}, {"template", llama31}}}}};
  EXPECT_EQ(ResolveChatFormat(listed, ChatTemplate::kAuto, "")->tmpl, ChatTemplate::kLlama3_1);
  json no_default = {{"chat_template", {{{"name", "tool_use"}, {"template", llama31}}}}};
  EXPECT_EQ(ResolveChatFormat(no_default, ChatTemplate::kAuto, "").status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(ResolveChatFormat(json::object(), ChatTemplate::kAuto, "").status().code(),
            absl::StatusCode::kFailedPrecondition);
  // A named template must be the model's when the model's is known ...
  auto wrong = ResolveChatFormat(ReadJson(Qwen3Dir() + "/tokenizer_config.json"), ChatTemplate::kLlama3_1, "");
  EXPECT_EQ(wrong.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(wrong.status().message()), HasSubstr("model's template is qwen3's"));
  // ... and is the user's choice when the model has none; Llama needs the bos token then too.
  EXPECT_EQ(ResolveChatFormat({{"bos_token", "<s>"}}, ChatTemplate::kLlama3_2, "")->bos_token, "<s>");
  EXPECT_EQ(ResolveChatFormat(json::object(), ChatTemplate::kLlama3, "").status().code(),
            absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(*ParseChatTemplateName("llama3.3"), ChatTemplate::kLlama3_1);
  EXPECT_EQ(*ParseChatTemplateName("qwen2.5"), ChatTemplate::kQwen2_5);
  EXPECT_EQ(ParseChatTemplateName("mistral").status().code(), absl::StatusCode::kInvalidArgument);
}

// A wrongly typed field of tokenizer_config.json is INVALID_ARGUMENT naming the key, never an
// exception out of the JSON library (which aborts prepare).
TEST(ChatTemplate, WronglyTypedConfigFieldsAreErrorsNamingTheKey) {
  struct Case {
    json config;
    std::string expect;
  };
  for (const Case& c : std::vector<Case>{
           {{{"chat_template", {{{"name", 5}, {"template", "x"}}}}}, "chat_template[0].name"},
           {{{"chat_template", {{{"name", "default"}, {"template", 5}}}}}, "chat_template[0].template"},
           {{{"chat_template", {{{"name", "a"}, {"template", "x"}}, 7}}}, "chat_template[1]"},
           {{{"chat_template", 5}}, "chat_template"}}) {
    absl::StatusOr<ChatFormat> r = absl::UnknownError("not run");
    EXPECT_NO_THROW(r = ResolveChatFormat(c.config, ChatTemplate::kAuto, "")) << c.config.dump();
    EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument) << c.config.dump();
    EXPECT_THAT(std::string(r.status().message()), HasSubstr(c.expect)) << c.config.dump();
    EXPECT_THAT(std::string(r.status().message()), HasSubstr("tokenizer_config.json")) << c.config.dump();
  }
  // A Llama template's bos_token of the wrong type is an error, not "no bos token".
  for (const json& bos : {json(5), json({{"content", 5}}), json::array({"<s>"})}) {
    absl::StatusOr<ChatFormat> r = absl::UnknownError("not run");
    EXPECT_NO_THROW(r = ResolveChatFormat({{"bos_token", bos}}, ChatTemplate::kLlama3, "")) << bos.dump();
    EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument) << bos.dump();
    EXPECT_THAT(std::string(r.status().message()), HasSubstr("bos_token")) << bos.dump();
  }
  EXPECT_EQ(*SpecialTokenText({{"eos_token", {{"content", "<e>"}, {"special", true}}}}, "eos_token"), "<e>");
  EXPECT_EQ(*SpecialTokenText({{"eos_token", nullptr}}, "eos_token"), "");
  EXPECT_EQ(*SpecialTokenText(json::object(), "eos_token"), "");
  EXPECT_EQ(SpecialTokenText({{"eos_token", {{"content", 5}}}}, "eos_token").status().code(),
            absl::StatusCode::kInvalidArgument);
}

TEST(ChatTemplate, ToolCallsAreRefusedWhereTheTemplateWouldRenderThem) {
  const json with_null = json::parse(R"([{"role": "user", "content": "q"},
                                         {"role": "assistant", "content": "a", "tool_calls": null}])");
  auto llama = RenderChat(with_null, {ChatTemplate::kLlama3_1, "<|begin_of_text|>", "26 Jul 2024"}, LossOn::kAssistant);
  EXPECT_EQ(llama.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(llama.status().message()), HasSubstr("messages[1].tool_calls"));
  EXPECT_TRUE(RenderChat(with_null, {ChatTemplate::kQwen2_5, "", ""}, LossOn::kAssistant).ok());
  const json with_call = json::parse(R"([{"role": "user", "content": "q"},
                                         {"role": "assistant", "content": "", "tool_calls": [{"function": {}}]}])");
  auto qwen = RenderChat(with_call, {ChatTemplate::kQwen2_5, "", ""}, LossOn::kAssistant);
  EXPECT_THAT(std::string(qwen.status().message()), HasSubstr("messages[1].tool_calls"));
}

TEST(ChatTemplate, PythonStripAndJson) {
  EXPECT_EQ(PythonStrip(" \t\n x y \r\f\v"), "x y");
  EXPECT_EQ(PythonStrip("\u3000\u00a0\u2028\x1c\u0085a\u2003"), "a");
  EXPECT_EQ(PythonStrip("\ufeffa\u200b"), "\ufeffa\u200b");  // BOM and ZWSP are not spaces in Python
  EXPECT_EQ(PythonStrip("  "), "");
  EXPECT_EQ(PythonJsonString("a\"b\\c\n\t\x01\x7f é"), "\"a\\\"b\\\\c\\n\\t\\u0001\x7f é\"");
}

// Prepare end to end with the Llama 3 tokenizer and, through a model dir of links, each template.
std::string TempPath(const std::string& name) {
  return testing::TempDir() + "/chat_template_test_" + std::to_string(::getpid()) + "_" + name;
}

// `jsonl` and, when given, `second_jsonl` are one input file each (a file holds one record form).
PrepareSummary RunPrepare(const std::string& model_dir, const std::string& name, const std::string& jsonl,
                          const std::string& chat_date, std::vector<uint32_t>* tokens, std::vector<uint8_t>* mask,
                          const std::string& second_jsonl = "") {
  const std::string in = TempPath(name + ".jsonl");
  std::ofstream(in) << jsonl;
  PrepareOptions o;
  o.model_dir = model_dir;
  o.inputs = {in};
  if (!second_jsonl.empty()) {
    o.inputs.push_back(TempPath(name + "_2.jsonl"));
    std::ofstream(o.inputs.back()) << second_jsonl;
  }
  o.output_dir = TempPath(name + "_out");
  fs::remove_all(o.output_dir);
  o.seq_len = 512;
  o.threads = 2;
  o.chat_date = chat_date;
  auto s = Prepare(o);
  EXPECT_TRUE(s.ok()) << s.status();
  if (!s.ok()) return {};
  auto r = data::DatasetReader::Open(s->train.dir);
  EXPECT_TRUE(r.ok()) << r.status();
  const auto& ds = **r;
  tokens->resize(ds.num_tokens());
  mask->resize(ds.num_tokens());
  EXPECT_TRUE(ds.ReadTokens(0, ds.num_tokens(), tokens->data(), mask->data()).ok());
  EXPECT_EQ(ds.manifest().metadata["chat_template"], s->chat_template);
  return *s;
}

TEST(PrepareChat, Llama3TokenizerEndToEnd) {
  const std::vector<json> cases = ReadJsonLines(DataDir() + "/conversations.jsonl");
  const std::vector<json> want = ReadJsonLines(DataDir() + "/expected/llama3.jsonl");
  const tok::Tokenizer& tokenizer = LoadTokenizer(Llama3Dir());
  std::vector<uint32_t> tokens;
  std::vector<uint8_t> mask;
  PrepareSummary s = RunPrepare(Llama3Dir(), "llama3", json({{"messages", cases[1]["messages"]}}).dump() + "\n", "",
                                &tokens, &mask, json({{"text", "plain"}}).dump() + "\n");
  EXPECT_EQ(s.chat_template, "llama3");
  EXPECT_EQ(s.vocab_size, 128256);
  const auto ids = want[1]["ids"].get<std::vector<uint32_t>>();
  ASSERT_GT(tokens.size(), ids.size());
  EXPECT_EQ(std::vector<uint32_t>(tokens.begin(), tokens.begin() + ids.size()), ids);
  std::string trained;
  for (size_t k = 0; k < ids.size(); ++k) {
    if (mask[k]) trained += tokenizer.TokenBytes(tokens[k]);
  }
  EXPECT_EQ(trained, "4<|eot_id|>6, since 3+3=6.<|eot_id|>");
  // The text document ends with tokenizer_config.json's eos_token, <|eot_id|> for Llama 3 Instruct.
  EXPECT_EQ(tokens.back(), *tokenizer.TokenId("<|eot_id|>"));

  // Llama 3.2's template over the same tokenizer, with a chat date; then chat_template.jinja wins.
  const std::string dir = TempPath("llama32_model");
  fs::remove_all(dir);
  fs::create_directories(dir);
  fs::create_symlink(fs::absolute(Llama3Dir() + "/tokenizer.json"), dir + "/tokenizer.json");
  fs::copy_file(DataDir() + "/llama3.2-instruct.tokenizer_config.json", dir + "/tokenizer_config.json");
  const std::vector<json> want32 = ReadJsonLines(DataDir() + "/expected/llama3.2.jsonl");
  ASSERT_EQ(cases[10]["date_string"], "05 Dec 2026");
  s = RunPrepare(dir, "llama32", json({{"messages", cases[10]["messages"]}}).dump() + "\n", "05 Dec 2026", &tokens,
                 &mask);
  EXPECT_EQ(s.chat_template, "llama3.2");
  EXPECT_EQ(tokens, want32[10]["ids"].get<std::vector<uint32_t>>());
  std::ofstream(dir + "/chat_template.jinja") << TemplateText(DataDir() + "/llama3.1-instruct.tokenizer_config.json");
  s = RunPrepare(dir, "llama31", json({{"messages", cases[0]["messages"]}}).dump() + "\n", "", &tokens, &mask);
  EXPECT_EQ(s.chat_template, "llama3.1");
  EXPECT_EQ(tokens, ReadJsonLines(DataDir() + "/expected/llama3.1.jsonl")[0]["ids"].get<std::vector<uint32_t>>());
}

}  // namespace
}  // namespace slidedp::prepare
