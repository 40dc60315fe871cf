// Chat templates against HF: every committed template renders every case of
// tests/data/chat_templates/conversations.jsonl byte for byte as transformers' apply_chat_template
// did (expected/<name>.jsonl, tools/chat_template/hf_render.py), tokenizes to HF's ids, and marks
// exactly the assistant replies with their end-of-turn token; recognition of the model's template
// (whitespace Jinja does not render is ignored, anything else is refused with the difference), the
// Llama date, Python's strip and tojson, and prepare end to end on the Llama 3 tokenizer. Qwen3.5
// has its own cases (qwen3.5-conversations.jsonl) against Python Jinja2 and a tokenizer of its
// structure.
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

using test_data::LoadTokenizer;
using test_data::ReadJson;
using test_data::ReadJsonLines;
using test_data::SourceDir;
using test_data::TrainedEnds;
std::string DataDir() { return SourceDir() + "/tests/data/chat_templates"; }
using test_data::Qwen3Dir;
std::string Llama3Dir() { return DataDir() + "/llama3"; }

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
      {"qwen3.5", DataDir() + "/qwen3.5.tokenizer_config.json"},
      {"qwen3.5-nothink", DataDir() + "/qwen3.5-nothink.tokenizer_config.json"},
      {"llama3", Llama3Dir() + "/tokenizer_config.json"},
      {"llama3.1", DataDir() + "/llama3.1-instruct.tokenizer_config.json"},
      {"llama3.2", DataDir() + "/llama3.2-instruct.tokenizer_config.json"},
  };
  for (const char* name : {"gemma3", "gpt-oss", "mistral-v1", "mistral-v3", "mistral-v7"}) {
    files[name] = DataDir() + "/" + name + ".tokenizer_config.json";
  }
  int qwen25 = 0, tekken = 0;
  for (const KnownChatTemplate& k : KnownChatTemplates()) {
    const std::string name = ChatTemplateName(k.tmpl);
    if (k.tmpl == ChatTemplate::kQwen2_5) {
      const char* file = qwen25++ == 0 ? "/qwen2.5-instruct.tokenizer_config.json"
                                       : "/qwen2.5-instruct-toolbraces.tokenizer_config.json";
      EXPECT_EQ(k.text, TemplateText(DataDir() + file)) << file;
    } else if (k.tmpl == ChatTemplate::kMistralV3Tekken) {  // Mistral Nemo's updated and first copies
      const char* file = tekken++ == 0 ? "/mistral-v3-tekken.tokenizer_config.json"
                                       : "/mistral-v3-tekken-first.tokenizer_config.json";
      EXPECT_EQ(k.text, TemplateText(DataDir() + file)) << file;
    } else {
      ASSERT_TRUE(files.count(name)) << name;
      EXPECT_EQ(k.text, TemplateText(files[name])) << name;
    }
  }
  EXPECT_EQ(qwen25, 2);
  EXPECT_EQ(tekken, 2);
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
      EXPECT_EQ(TrainedEnds(d, end_id, where), assistants) << where;
    }
  }
}

// Qwen3.5: its own cases (tests/data/chat_templates/qwen3.5-conversations.jsonl: thinking
// blocks from reasoning_content or <think> tags, before and after the last user query, trimming,
// tool messages and tool-response users, the template's errors, the generation prompt) against
// Python Jinja2 rendering the real templates as transformers does (expected/qwen3.5*.jsonl,
// tools/chat_template/jinja2_render.py), with ids from HF tokenizers on a tokenizer.json of
// Qwen3.5's structure.
std::string Qwen3_5TokenizerDir() { return SourceDir() + "/tests/data/tokenizer/qwen3.5-synthetic"; }

void CheckQwen3_5Cases(const std::string& case_set, const std::string& cases_file, int want_errors) {
  const std::vector<json> cases = ReadJsonLines(DataDir() + "/" + cases_file);
  ASSERT_FALSE(cases.empty()) << cases_file;
  const tok::Tokenizer& tokenizer = LoadTokenizer(Qwen3_5TokenizerDir());
  const uint32_t end_id = *tokenizer.TokenId("<|im_end|>");
  for (const auto& [name, tmpl] : std::vector<std::pair<std::string, ChatTemplate>>{
           {"qwen3.5", ChatTemplate::kQwen3_5}, {"qwen3.5-nothink", ChatTemplate::kQwen3_5NoThink}}) {
    const std::vector<json> expected = ReadJsonLines(DataDir() + "/expected/" + name + case_set + ".jsonl");
    ASSERT_EQ(expected.size(), cases.size()) << name << case_set;
    auto format =
        ResolveChatFormat(ReadJson(DataDir() + "/" + name + ".tokenizer_config.json"), ChatTemplate::kAuto, "");
    ASSERT_TRUE(format.ok()) << name << ": " << format.status();
    EXPECT_EQ(format->tmpl, tmpl) << name;
    EXPECT_EQ(ChatTemplateName(tmpl), name);
    int errors = 0;
    for (size_t i = 0; i < cases.size(); ++i) {
      const json& c = cases[i];
      const std::string where = name + case_set + " case " + std::to_string(i);
      const GenerationPrompt gen =
          c.value("add_generation_prompt", false) ? GenerationPrompt::kAppend : GenerationPrompt::kNone;
      int assistants = 0;
      for (const json& m : c["messages"]) assistants += m["role"] == "assistant";
      // A prompt without an answer trains nothing under kAssistant (refused); its text still counts.
      const LossOn loss = assistants > 0 ? LossOn::kAssistant : LossOn::kAll;
      auto segs = RenderChat(c["messages"], *format, loss, gen);
      if (expected[i].contains("error")) {
        // The template raises: refused, quoting the template's own message.
        ++errors;
        EXPECT_EQ(segs.status().code(), absl::StatusCode::kInvalidArgument) << where;
        EXPECT_THAT(std::string(segs.status().message()), HasSubstr(expected[i]["error"].get<std::string>())) << where;
        continue;
      }
      ASSERT_TRUE(segs.ok()) << where << ": " << segs.status();
      std::string text;
      int replies = 0;
      for (const Segment& s : *segs) {
        if (s.trained && loss == LossOn::kAssistant) {
          EXPECT_TRUE(absl::EndsWith(text, "<|im_start|>assistant\n")) << where;
          EXPECT_EQ(s.text.find("<|im_end|>"), s.text.size() - strlen("<|im_end|>")) << where;
          ++replies;
        }
        text += s.text;
      }
      EXPECT_EQ(text, expected[i]["text"].get<std::string>()) << where;
      EXPECT_EQ(replies, assistants) << where;
      TokenizedDocument d = TokenizeSegments(tokenizer, *segs);
      EXPECT_EQ(d.tokens, expected[i]["ids"].get<std::vector<uint32_t>>()) << where;
      if (loss == LossOn::kAll) continue;
      EXPECT_EQ(TrainedEnds(d, end_id, where), assistants) << where;
    }
    if (want_errors >= 0) {
      EXPECT_EQ(errors, want_errors) << name;
    }
  }
}

TEST(ChatTemplate, Qwen3_5MatchesJinja2OnEveryCase) {
  ASSERT_EQ(ReadJsonLines(DataDir() + "/qwen3.5-conversations.jsonl").size(), 39u);
  CheckQwen3_5Cases("", "qwen3.5-conversations.jsonl", 2);
  CheckQwen3_5Cases(".random", "qwen3.5-random-conversations.jsonl", -1);
}

TEST(ChatTemplate, Qwen3_5ThinkBlocksAreTrainedAfterTheLastQueryOnly) {
  const ChatFormat f{ChatTemplate::kQwen3_5, "", "", ""};
  const json chat = json::parse(R"([{"role": "user", "content": "Q1"},
      {"role": "assistant", "content": "A1", "reasoning_content": "R1"},
      {"role": "user", "content": "Q2"},
      {"role": "assistant", "content": " A2 ", "reasoning_content": "R2"}])");
  auto segs = RenderChat(chat, f, LossOn::kAssistant);
  ASSERT_TRUE(segs.ok()) << segs.status();
  std::vector<std::string> trained;
  for (const Segment& s : *segs) {
    if (s.trained) trained.push_back(s.text);
  }
  EXPECT_THAT(trained, ::testing::ElementsAre("A1<|im_end|>", "<think>\nR2\n</think>\n\nA2<|im_end|>"));
  // The template's errors name the field.
  auto late = RenderChat(json::parse(R"([{"role": "user", "content": "Q"}, {"role": "system", "content": "S"},
                                        {"role": "assistant", "content": "A"}])"),
                         f, LossOn::kAssistant);
  EXPECT_THAT(std::string(late.status().message()), HasSubstr("messages[1].role"));
  auto no_query = RenderChat(json::parse(R"([{"role": "assistant", "content": "A"}])"), f, LossOn::kAssistant);
  EXPECT_THAT(std::string(no_query.status().message()), HasSubstr("No user query found in messages."));
  // A generation prompt opens the think block (the small models' copy closes an empty one).
  auto prompt = [](ChatTemplate t) {
    auto s = RenderChat(json::parse(R"([{"role": "user", "content": "Q"}])"), {t, "", "", ""}, LossOn::kAll,
                        GenerationPrompt::kAppend);
    EXPECT_TRUE(s.ok()) << s.status();
    return s->back().text;
  };
  EXPECT_TRUE(absl::EndsWith(prompt(ChatTemplate::kQwen3_5), "<|im_start|>assistant\n<think>\n"));
  EXPECT_TRUE(absl::EndsWith(prompt(ChatTemplate::kQwen3_5NoThink), "<|im_start|>assistant\n<think>\n\n</think>\n\n"));
}

TEST(ChatTemplate, Qwen3_5RecognitionAndLookalikes) {
  const std::string think = TemplateText(DataDir() + "/qwen3.5.tokenizer_config.json");
  const std::string nothink = TemplateText(DataDir() + "/qwen3.5-nothink.tokenizer_config.json");
  EXPECT_EQ(*IdentifyChatTemplate(think), ChatTemplate::kQwen3_5);
  EXPECT_EQ(*IdentifyChatTemplate(nothink), ChatTemplate::kQwen3_5NoThink);
  EXPECT_EQ(*IdentifyChatTemplate(think + "\n"), ChatTemplate::kQwen3_5);  // chat_template.jinja with a newline
  // A changed copy (Qwen3.6-like: another thinking rule) is refused as a Qwen3.5 lookalike.
  auto changed = IdentifyChatTemplate(absl::StrReplaceAll(
      think, {{"{%- if loop.index0 > ns.last_query_index %}", "{%- if loop.index0 >= ns.last_query_index %}"}}));
  EXPECT_EQ(changed.status().code(), absl::StatusCode::kUnimplemented);
  EXPECT_THAT(std::string(changed.status().message()), HasSubstr("looks like Qwen3.5's"));
  // Forcing the other copy's name on a known template is refused; the names parse.
  auto forced =
      ResolveChatFormat(ReadJson(DataDir() + "/qwen3.5.tokenizer_config.json"), ChatTemplate::kQwen3_5NoThink, "");
  EXPECT_EQ(forced.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(*ParseChatTemplateName("qwen3.5"), ChatTemplate::kQwen3_5);
  EXPECT_EQ(*ParseChatTemplateName("qwen3.5-nothink"), ChatTemplate::kQwen3_5NoThink);
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
  EXPECT_THAT(std::string(qwen.status().message()), HasSubstr("llama3.1, llama3.2 and gpt-oss"));
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
  EXPECT_THAT(std::string(mistral.status().message()),
              HasSubstr("qwen3, qwen3.5, qwen3.5-nothink, qwen2.5, llama3, llama3.1, llama3.2"));
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
  auto llama = RenderChat(with_null, {ChatTemplate::kLlama3_1, "<|begin_of_text|>", "26 Jul 2024", ""}, LossOn::kAssistant);
  EXPECT_EQ(llama.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(llama.status().message()), HasSubstr("messages[1].tool_calls"));
  EXPECT_TRUE(RenderChat(with_null, {ChatTemplate::kQwen2_5, "", "", ""}, LossOn::kAssistant).ok());
  const json with_call = json::parse(R"([{"role": "user", "content": "q"},
                                         {"role": "assistant", "content": "", "tool_calls": [{"function": {}}]}])");
  auto qwen = RenderChat(with_call, {ChatTemplate::kQwen2_5, "", "", ""}, LossOn::kAssistant);
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

// auto resolves a model directory carrying Qwen3.5's template (tokenizer_config.json's, then
// chat_template.jinja's, which wins) and prepare writes the oracle's ids and trained replies.
TEST(PrepareChat, Qwen3_5ModelDirEndToEnd) {
  const std::vector<json> cases = ReadJsonLines(DataDir() + "/qwen3.5-conversations.jsonl");
  const std::string dir = TempPath("qwen35_model");
  fs::remove_all(dir);
  fs::create_directories(dir);
  fs::create_symlink(fs::absolute(Qwen3_5TokenizerDir() + "/tokenizer.json"), dir + "/tokenizer.json");
  fs::copy_file(DataDir() + "/qwen3.5.tokenizer_config.json", dir + "/tokenizer_config.json");
  const tok::Tokenizer& tokenizer = LoadTokenizer(Qwen3_5TokenizerDir());
  std::vector<uint32_t> tokens;
  std::vector<uint8_t> mask;
  PrepareSummary s =
      RunPrepare(dir, "qwen35", json({{"messages", cases[11]["messages"]}}).dump() + "\n", "", &tokens, &mask);
  EXPECT_EQ(s.chat_template, "qwen3.5");
  EXPECT_EQ(tokens, ReadJsonLines(DataDir() + "/expected/qwen3.5.jsonl")[11]["ids"].get<std::vector<uint32_t>>());
  std::string trained;
  for (size_t k = 0; k < tokens.size(); ++k) {
    if (mask[k]) trained += tokenizer.TokenBytes(tokens[k]);
  }
  EXPECT_EQ(trained, "A1<|im_end|><think>\nR2\n</think>\n\nA2<|im_end|>");
  std::ofstream(dir + "/chat_template.jinja") << TemplateText(DataDir() + "/qwen3.5-nothink.tokenizer_config.json");
  s = RunPrepare(dir, "qwen35_nothink", json({{"messages", cases[29]["messages"]}}).dump() + "\n", "", &tokens, &mask);
  EXPECT_EQ(s.chat_template, "qwen3.5-nothink");
  EXPECT_EQ(tokens,
            ReadJsonLines(DataDir() + "/expected/qwen3.5-nothink.jsonl")[29]["ids"].get<std::vector<uint32_t>>());
}

}  // namespace
}  // namespace slidedp::prepare
