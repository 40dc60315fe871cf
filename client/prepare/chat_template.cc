// Chat rendering with trained spans: each template mirrors its Jinja source line by line
// (known_chat_template_texts.cc holds the sources; tests compare with transformers' output or
// Python Jinja2 in transformers' environment).
#include "client/prepare/chat_template.h"

#include <cstdint>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "client/prepare/known_chat_templates.h"
#include "common/status/status_macros.h"
#include "glog/logging.h"

namespace slidedp::prepare {
namespace {

using json = nlohmann::json;

constexpr char kQwenDefaultSystem[] = "You are Qwen, created by Alibaba Cloud. You are a helpful assistant.";

// Python's str.strip/lstrip/rstrip with one character.
std::string LStrip(const std::string& s, char c) {
  size_t b = s.find_first_not_of(c);
  return b == std::string::npos ? std::string() : s.substr(b);
}
std::string RStrip(const std::string& s, char c) {
  size_t e = s.find_last_not_of(c);
  return e == std::string::npos ? std::string() : s.substr(0, e + 1);
}
std::string Strip(const std::string& s, char c) { return LStrip(RStrip(s, c), c); }

// str.isspace(): bidirectional class WS, B or S, or category Zs.
bool IsPythonSpace(uint32_t cp) {
  return (cp >= 0x09 && cp <= 0x0D) || (cp >= 0x1C && cp <= 0x20) || cp == 0x85 || cp == 0xA0 || cp == 0x1680 ||
         (cp >= 0x2000 && cp <= 0x200A) || cp == 0x2028 || cp == 0x2029 || cp == 0x202F || cp == 0x205F || cp == 0x3000;
}

// The code point starting at s[i] and its length (valid UTF-8; a stray byte counts as itself).
uint32_t DecodeAt(std::string_view s, size_t i, size_t* len) {
  const auto b = static_cast<unsigned char>(s[i]);
  const size_t n = b < 0x80 ? 1 : b < 0xE0 ? 2 : b < 0xF0 ? 3 : 4;
  if (i + n > s.size()) {
    *len = 1;
    return b;
  }
  uint32_t cp = n == 1 ? b : n == 2 ? (b & 0x1F) : n == 3 ? (b & 0x0F) : (b & 0x07);
  for (size_t k = 1; k < n; ++k) cp = (cp << 6) | (static_cast<unsigned char>(s[i + k]) & 0x3F);
  *len = n;
  return cp;
}

bool IsLlama31Family(ChatTemplate t) { return t == ChatTemplate::kLlama3_1 || t == ChatTemplate::kLlama3_2; }

bool IsMistral(ChatTemplate t) {
  return t == ChatTemplate::kMistralV1 || t == ChatTemplate::kMistralV3 || t == ChatTemplate::kMistralV3Tekken ||
         t == ChatTemplate::kMistralV7;
}

// Templates that render no reasoning at all: a message's reasoning would be lost, so it is refused.
bool RendersNoReasoning(ChatTemplate t) { return t == ChatTemplate::kGemma3 || IsMistral(t); }

// Templates for which a "tool_calls" key counts as a call even when null: Llama 3.1 / 3.2 (`'tool_calls'
// in message`), GPT-OSS (`"tool_calls" in message`), Mistral Nemo's first copy (`message.tool_calls
// is defined`; the updated copy, which shares kMistralV3Tekken, tests for none too).
bool NullToolCallsIsACall(ChatTemplate t) {
  return IsLlama31Family(t) || t == ChatTemplate::kGptOss || t == ChatTemplate::kMistralV3Tekken;
}

bool IsNonNull(const json& m, const char* key) { return m.contains(key) && !m[key].is_null(); }

absl::StatusOr<ChatMessage> ParseChatMessage(const json& m, ChatTemplate tmpl, const std::string& where) {
  if (!m.is_object()) return absl::InvalidArgumentError(absl::StrCat("field ", where, ": must be an object"));
  if (!m.contains("role") || !m["role"].is_string()) {
    return absl::InvalidArgumentError(absl::StrCat("field ", where, ".role: missing or not a string"));
  }
  ChatMessage msg;
  msg.where = where;
  msg.role = m["role"].get<std::string>();
  const bool ipython = IsLlama31Family(tmpl) && msg.role == "ipython";  // the Llama 3.1 templates' tool role
  const bool developer = tmpl == ChatTemplate::kGptOss && msg.role == "developer";  // harmony's instructions
  if (msg.role != "system" && msg.role != "user" && msg.role != "assistant" && msg.role != "tool" && !ipython &&
      !developer) {
    return absl::InvalidArgumentError(absl::StrCat("field ", where, ".role: \"", msg.role,
                                                   "\" is not one of system, user, assistant, tool",
                                                   tmpl == ChatTemplate::kGptOss ? ", developer" : ""));
  }
  if (m.contains("tool_calls") && !m["tool_calls"].is_null()) {
    return absl::InvalidArgumentError(absl::StrCat("field ", where, ".tool_calls: tool calls are not supported yet"));
  }
  if (m.contains("tool_calls") && NullToolCallsIsACall(tmpl)) {
    // `'tool_calls' in message` is true for a null value too, and the template then fails on it.
    return absl::InvalidArgumentError(absl::StrCat("field ", where, ".tool_calls: present (null), which the ",
                                                   ChatTemplateName(tmpl),
                                                   " template treats as a tool call; remove the key"));
  }
  if (!m.contains("content")) return absl::InvalidArgumentError(absl::StrCat("field ", where, ".content: missing"));
  ASSIGN_OR_RETURN(msg.content, ContentText(m["content"], absl::StrCat(where, ".content")));
  if (m["content"].is_array()) {  // ContentText checked every part
    msg.text_parts.emplace();
    for (const json& part : m["content"]) msg.text_parts->push_back(part["text"].get<std::string>());
  }
  const char* name = ChatTemplateName(tmpl);
  if (tmpl == ChatTemplate::kGptOss) {
    // GPT-OSS's template reads "thinking" (on assistant messages) and nothing else.
    if (IsNonNull(m, "reasoning_content")) {
      return absl::InvalidArgumentError(absl::StrCat("field ", where,
                                                     ".reasoning_content: the gpt-oss template drops it (it renders "
                                                     "an assistant's \"thinking\"); name the field thinking"));
    }
    if (m.contains("thinking") && msg.role == "assistant") {
      if (!m["thinking"].is_string()) {
        // `"<|channel|>analysis<|message|>" in message.thinking` fails on anything but a string.
        return absl::InvalidArgumentError(
            absl::StrCat("field ", where, ".thinking: ", m["thinking"].is_null() ? "null" : m["thinking"].type_name(),
                         ", on which the gpt-oss template fails (a string, or no key)"));
      }
      msg.reasoning = m["thinking"].get<std::string>();
      msg.has_reasoning = true;
    } else if (IsNonNull(m, "thinking")) {
      return absl::InvalidArgumentError(absl::StrCat(
          "field ", where, ".thinking: the gpt-oss template drops it on a ", msg.role, " message (assistants only)"));
    }
    return msg;
  }
  if (IsNonNull(m, "reasoning_content")) {
    if (!m["reasoning_content"].is_string()) {
      return absl::InvalidArgumentError(absl::StrCat("field ", where, ".reasoning_content: not a string"));
    }
    msg.reasoning = m["reasoning_content"].get<std::string>();
    msg.has_reasoning = true;
  }
  if (RendersNoReasoning(tmpl)) {
    for (const char* key : {"reasoning_content", "thinking"}) {
      // An empty string loses nothing.
      if (IsNonNull(m, key) && !(m[key].is_string() && m[key].get_ref<const std::string&>().empty())) {
        return absl::InvalidArgumentError(absl::StrCat("field ", where, ".", key, ": the ", name,
                                                       " template renders no reasoning and drops it; remove it"));
      }
    }
  }
  return msg;
}

// Collects segments: context text (trained only with LossOn::kAll) and assistant replies.
class SegmentWriter {
 public:
  explicit SegmentWriter(LossOn loss_on) : all_(loss_on == LossOn::kAll) {}
  void Context(std::string text) { Emit(std::move(text), all_); }
  // An assistant reply: trained unless it is context (a TRL prompt's assistant turn).
  void Reply(std::string text, bool trained) { Emit(std::move(text), all_ || trained); }
  std::vector<Segment> Take() { return std::move(out_); }

 private:
  void Emit(std::string text, bool trained) {
    if (text.empty()) return;
    if (!out_.empty() && out_.back().trained == trained) {
      out_.back().text += text;
    } else {
      out_.push_back({std::move(text), trained});
    }
  }
  bool all_;
  std::vector<Segment> out_;
};

// The tool message of the Qwen templates: consecutive tool messages share one user turn.
void QwenToolMessage(const std::vector<ChatMessage>& msgs, size_t i, SegmentWriter* w) {
  std::string text;
  if (i == 0 || msgs[i - 1].role != "tool") text += "<|im_start|>user";
  absl::StrAppend(&text, "\n<tool_response>\n", msgs[i].content, "\n</tool_response>");
  if (i + 1 == msgs.size() || msgs[i + 1].role != "tool") text += "<|im_end|>\n";
  w->Context(std::move(text));
}

void RenderChatML(const std::vector<ChatMessage>& msgs, SegmentWriter* w) {
  for (const ChatMessage& m : msgs) {
    w->Context(absl::StrCat("<|im_start|>", m.role, "\n"));
    if (m.role == "assistant") {
      w->Reply(absl::StrCat(m.content, "<|im_end|>"), m.trained);
    } else {
      w->Context(absl::StrCat(m.content, "<|im_end|>"));
    }
    w->Context("\n");
  }
}

void RenderQwen2_5(const std::vector<ChatMessage>& msgs, SegmentWriter* w) {
  if (msgs[0].role == "system") {
    w->Context(absl::StrCat("<|im_start|>system\n", msgs[0].content, "<|im_end|>\n"));
  } else {
    w->Context(absl::StrCat("<|im_start|>system\n", kQwenDefaultSystem, "<|im_end|>\n"));
  }
  for (size_t i = 0; i < msgs.size(); ++i) {
    const ChatMessage& m = msgs[i];
    if (m.role == "user" || (m.role == "system" && i != 0)) {
      w->Context(absl::StrCat("<|im_start|>", m.role, "\n", m.content, "<|im_end|>\n"));
    } else if (m.role == "assistant") {
      w->Context("<|im_start|>assistant\n");
      w->Reply(absl::StrCat(m.content, "<|im_end|>"), m.trained);
      w->Context("\n");
    } else if (m.role == "tool") {
      QwenToolMessage(msgs, i, w);
    }
  }
}

void RenderQwen3(const std::vector<ChatMessage>& msgs, SegmentWriter* w) {
  const int n = static_cast<int>(msgs.size());
  int last_query = n - 1;
  for (int i = n - 1; i >= 0; --i) {
    const ChatMessage& m = msgs[i];
    if (m.role == "user" &&
        !(absl::StartsWith(m.content, "<tool_response>") && absl::EndsWith(m.content, "</tool_response>"))) {
      last_query = i;
      break;
    }
  }
  if (msgs[0].role == "system") w->Context(absl::StrCat("<|im_start|>system\n", msgs[0].content, "<|im_end|>\n"));
  for (int i = 0; i < n; ++i) {
    const ChatMessage& m = msgs[i];
    if (m.role == "user" || (m.role == "system" && i != 0)) {
      w->Context(absl::StrCat("<|im_start|>", m.role, "\n", m.content, "<|im_end|>\n"));
    } else if (m.role == "assistant") {
      std::string content = m.content, reasoning;
      if (m.has_reasoning) {
        reasoning = m.reasoning;
      } else if (absl::StrContains(m.content, "</think>")) {
        content = LStrip(m.content.substr(m.content.rfind("</think>") + 8), '\n');
        std::string before = RStrip(m.content.substr(0, m.content.find("</think>")), '\n');
        const size_t open = before.rfind("<think>");
        reasoning = LStrip(open == std::string::npos ? before : before.substr(open + 7), '\n');
      }
      w->Context("<|im_start|>assistant\n");
      std::string body;
      if (i > last_query && (i == n - 1 || !reasoning.empty())) {
        body = absl::StrCat("<think>\n", Strip(reasoning, '\n'), "\n</think>\n\n", LStrip(content, '\n'));
      } else {
        body = content;
      }
      w->Reply(absl::StrCat(body, "<|im_end|>"), m.trained);
      w->Context("\n");
    } else if (m.role == "tool") {
      QwenToolMessage(msgs, i, w);
    }
  }
}

// Qwen3.5 (both copies): every message's content is rendered `|trim`med, so the checks below see
// the trimmed text too. The template raises on a late system message and on a conversation
// without a user query; both are refused here naming the field.
absl::Status RenderQwen3_5(const std::vector<ChatMessage>& msgs, absl::string_view field, SegmentWriter* w) {
  const int n = static_cast<int>(msgs.size());
  std::vector<std::string> content(n);
  for (int i = 0; i < n; ++i) content[i] = PythonStrip(msgs[i].content);
  auto is_tool_response = [](const std::string& c) {
    return absl::StartsWith(c, "<tool_response>") && absl::EndsWith(c, "</tool_response>");
  };
  int last_query = -1;
  for (int i = n - 1; i >= 0 && last_query < 0; --i) {
    if (msgs[i].role == "user" && !is_tool_response(content[i])) last_query = i;
  }
  if (last_query < 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "field ", field, ": no user query (a user message other than <tool_response>...</tool_response>), which the ",
        ChatTemplateName(ChatTemplate::kQwen3_5), " template requires (\"No user query found in messages.\")"));
  }
  for (int i = 1; i < n; ++i) {
    if (msgs[i].role == "system") {
      return absl::InvalidArgumentError(
          absl::StrCat("field ", msgs[i].where, ".role: a system message after the first, which the ",
                       ChatTemplateName(ChatTemplate::kQwen3_5),
                       " template refuses (\"System message must be at the beginning.\")"));
    }
  }
  if (msgs[0].role == "system") w->Context(absl::StrCat("<|im_start|>system\n", content[0], "<|im_end|>\n"));
  for (int i = 0; i < n; ++i) {
    const ChatMessage& m = msgs[i];
    if (m.role == "user") {
      w->Context(absl::StrCat("<|im_start|>user\n", content[i], "<|im_end|>\n"));
    } else if (m.role == "assistant") {
      std::string text = content[i], reasoning;
      if (m.has_reasoning) {
        reasoning = m.reasoning;
      } else if (absl::StrContains(text, "</think>")) {
        std::string before = RStrip(text.substr(0, text.find("</think>")), '\n');
        const size_t open = before.rfind("<think>");
        reasoning = LStrip(open == std::string::npos ? before : before.substr(open + 7), '\n');
        text = LStrip(text.substr(text.rfind("</think>") + 8), '\n');
      }
      w->Context("<|im_start|>assistant\n");
      std::string body =
          i > last_query ? absl::StrCat("<think>\n", PythonStrip(reasoning), "\n</think>\n\n", text) : std::move(text);
      w->Reply(absl::StrCat(body, "<|im_end|>"), m.trained);
      w->Context("\n");
    } else if (m.role == "tool") {
      // `loop.previtem` is undefined for the first message: a leading tool message gets no header.
      std::string turn;
      if (i > 0 && msgs[i - 1].role != "tool") turn = "<|im_start|>user";
      absl::StrAppend(&turn, "\n<tool_response>\n", content[i], "\n</tool_response>");
      if (i + 1 == n || msgs[i + 1].role != "tool") turn += "<|im_end|>\n";
      w->Context(std::move(turn));
    }
  }
  return absl::OkStatus();
}

// One "<|start_header_id|>{role}<|end_header_id|>\n\n{content|trim}<|eot_id|>" turn.
void LlamaTurn(const ChatMessage& m, SegmentWriter* w) {
  w->Context(absl::StrCat("<|start_header_id|>", m.role, "<|end_header_id|>\n\n"));
  if (m.role == "assistant") {
    w->Reply(absl::StrCat(PythonStrip(m.content), "<|eot_id|>"), m.trained);
  } else {
    w->Context(absl::StrCat(PythonStrip(m.content), "<|eot_id|>"));
  }
}

void RenderLlama3(const std::vector<ChatMessage>& msgs, const ChatFormat& f, SegmentWriter* w) {
  w->Context(f.bos_token);
  for (const ChatMessage& m : msgs) LlamaTurn(m, w);
}

// Llama 3.1 / 3.3 and 3.2 without tools, builtin_tools or custom_tools: the same text.
void RenderLlama3_1(const std::vector<ChatMessage>& msgs, const ChatFormat& f, SegmentWriter* w) {
  size_t first = 0;
  std::string system_message;
  if (msgs[0].role == "system") {
    system_message = PythonStrip(msgs[0].content);
    first = 1;
  }
  w->Context(absl::StrCat(f.bos_token, "<|start_header_id|>system<|end_header_id|>\n\n",
                          "Cutting Knowledge Date: December 2023\n", "Today Date: ", f.date_string, "\n\n",
                          system_message, "<|eot_id|>"));
  for (size_t i = first; i < msgs.size(); ++i) {
    const ChatMessage& m = msgs[i];
    if (m.role == "tool" || m.role == "ipython") {
      // `message.content is mapping or message.content is iterable` holds for a string: tojson.
      w->Context(
          absl::StrCat("<|start_header_id|>ipython<|end_header_id|>\n\n", PythonJsonString(m.content), "<|eot_id|>"));
    } else {
      LlamaTurn(m, w);
    }
  }
}

// Gemma 3: the template's alternation check counts from the first message after the system one.
absl::Status RenderGemma3(const std::vector<ChatMessage>& msgs, const ChatFormat& f, SegmentWriter* w) {
  w->Context(f.bos_token);
  size_t first = 0;
  std::string prefix;  // first_user_prefix: the system message, untrimmed, and "\n\n"
  if (msgs[0].role == "system") {
    const ChatMessage& s = msgs[0];
    if (s.text_parts.has_value()) {
      // `messages[0]['content'][0]['text']`: the first part only.
      if (s.text_parts->empty()) {
        return absl::InvalidArgumentError(
            absl::StrCat("field ", s.where, ".content: an empty list, on which the gemma3 template fails"));
      }
      if (s.text_parts->size() > 1) {
        return absl::InvalidArgumentError(
            absl::StrCat("field ", s.where, ".content: ", s.text_parts->size(),
                         " text parts; the gemma3 template renders a system message's first part only and drops "
                         "the others (join them into one)"));
      }
      prefix = (*s.text_parts)[0] + "\n\n";
    } else {
      prefix = s.content + "\n\n";
    }
    first = 1;
  }
  for (size_t i = first; i < msgs.size(); ++i) {
    const ChatMessage& m = msgs[i];
    const size_t k = i - first;
    if ((m.role == "user") != (k % 2 == 0)) {
      return absl::InvalidArgumentError(absl::StrCat(
          "field ", m.where, ".role: ", m.role, " where the gemma3 template raises \"Conversation roles must "
          "alternate user/assistant/user/assistant/...\" (after an optional system message)"));
    }
    std::string body;
    if (m.text_parts.has_value()) {
      for (const std::string& part : *m.text_parts) body += PythonStrip(part);  // each part `| trim`
    } else {
      body = PythonStrip(m.content);
    }
    const std::string header =
        absl::StrCat("<start_of_turn>", m.role == "assistant" ? "model" : m.role, "\n", k == 0 ? prefix : "");
    if (m.role == "assistant") {
      w->Context(header);
      w->Reply(absl::StrCat(body, "<end_of_turn>"), m.trained);
      w->Context("\n");
    } else {
      w->Context(absl::StrCat(header, body, "<end_of_turn>\n"));
    }
  }
  return absl::OkStatus();
}

// GPT-OSS: the template's system message with its defaults (no model_identity, reasoning_effort,
// builtin_tools or tools are passed), "Current date" from format.date_string.
std::string GptOssSystemMessage(const std::string& date) {
  return absl::StrCat(
      "<|start|>system<|message|>You are ChatGPT, a large language model trained by OpenAI.\n",
      "Knowledge cutoff: 2024-06\n", "Current date: ", date, "\n\n", "Reasoning: medium\n\n",
      "# Valid channels: analysis, commentary, final. Channel must be included for every message.<|end|>");
}

absl::Status GptOssNoChannelTags(const ChatMessage& m, const std::string& text, const char* field) {
  if (absl::StrContains(text, "<|channel|>analysis<|message|>") ||
      absl::StrContains(text, "<|channel|>final<|message|>")) {
    return absl::InvalidArgumentError(absl::StrCat(
        "field ", m.where, ".", field, ": holds <|channel|> tags, where the gpt-oss template raises \"You have "
        "passed a message containing <|channel|> tags in the ", field,
        " field. Instead of doing this, you should pass analysis messages (the string between '<|message|>' and "
        "'<|end|>') in the 'thinking' field, and final messages (the string between '<|message|>' and '<|end|>') in "
        "the 'content' field.\""));
  }
  return absl::OkStatus();
}

absl::Status RenderGptOss(const std::vector<ChatMessage>& msgs, const ChatFormat& f, GenerationPrompt gen,
                          SegmentWriter* w) {
  w->Context(GptOssSystemMessage(f.date_string));
  size_t first = 0;
  if (msgs[0].role == "developer" || msgs[0].role == "system") {
    // `{%- if developer_message or tools %}`: an empty one renders nothing.
    if (!msgs[0].content.empty()) {
      w->Context(absl::StrCat("<|start|>developer<|message|># Instructions\n\n", msgs[0].content, "\n\n<|end|>"));
    }
    first = 1;
  }
  for (size_t i = first; i < msgs.size(); ++i) {
    const ChatMessage& m = msgs[i];
    if (m.role == "assistant") {
      RETURN_IF_ERROR(GptOssNoChannelTags(m, m.content, "content"));
      if (m.has_reasoning) RETURN_IF_ERROR(GptOssNoChannelTags(m, m.reasoning, "thinking"));
      w->Context("<|start|>assistant");
      std::string reply;
      if (i + 1 == msgs.size() && gen == GenerationPrompt::kNone) {
        // The final turn of training data: its analysis, then the answer ending in <|return|>.
        if (m.has_reasoning) {
          reply = absl::StrCat("<|channel|>analysis<|message|>", m.reasoning, "<|end|><|start|>assistant");
        }
        absl::StrAppend(&reply, "<|channel|>final<|message|>", m.content, "<|return|>");
      } else {
        // Earlier turns lose their analysis ("CoT is dropped during all previous turns").
        reply = absl::StrCat("<|channel|>final<|message|>", m.content, "<|end|>");
      }
      w->Reply(std::move(reply), m.trained);
    } else if (m.role == "user") {
      w->Context(absl::StrCat("<|start|>user<|message|>", m.content, "<|end|>"));
    } else if (m.role == "tool") {
      return absl::InvalidArgumentError(absl::StrCat(
          "field ", m.where, ".role: tool, where the gpt-oss template raises \"Message has tool role, but there was "
          "no previous assistant message with a tool call!\" (tool calls are not supported yet)"));
    } else {
      // The template skips any other role after the first message.
      return absl::InvalidArgumentError(absl::StrCat("field ", m.where, ".role: a ", m.role,
                                                     " message after the first, which the gpt-oss template drops"));
    }
  }
  return absl::OkStatus();
}

constexpr char kMistralAlternate[] =
    "After the optional system message, conversation roles must alternate user/assistant/user/assistant/...";
constexpr char kMistralRoles[] =
    "Only user and assistant roles are supported, with the exception of an initial optional system message!";

absl::Status MistralRoleError(const ChatMessage& m, ChatTemplate t, const char* quote) {
  return absl::InvalidArgumentError(
      absl::StrCat("field ", m.where, ".role: ", m.role, " where the ", ChatTemplateName(t), " template raises \"",
                   quote, "\""));
}

// Mistral v1: the system message opens the first user turn.
absl::Status RenderMistralV1(const std::vector<ChatMessage>& msgs, const ChatFormat& f, SegmentWriter* w) {
  const bool has_system = msgs[0].role == "system";
  const size_t first = has_system ? 1 : 0;
  w->Context(f.bos_token);
  for (size_t i = first; i < msgs.size(); ++i) {
    const ChatMessage& m = msgs[i];
    const size_t k = i - first;
    if ((m.role == "user") != (k % 2 == 0)) return MistralRoleError(m, ChatTemplate::kMistralV1, kMistralAlternate);
    if (m.role == "user") {
      w->Context(absl::StrCat(" [INST] ", k == 0 && has_system ? absl::StrCat(msgs[0].content, "\n\n") : "",
                              m.content, " [/INST]"));
    } else if (m.role == "assistant") {
      w->Reply(absl::StrCat(" ", m.content, f.eos_token), m.trained);
    } else {
      return MistralRoleError(m, ChatTemplate::kMistralV1, kMistralRoles);
    }
  }
  return absl::OkStatus();
}

// Mistral v3 and v3-tekken (kMistralV3Tekken: no spaces around [INST], no trim): the system
// message goes into the last message of the conversation when that is a user message, so a
// conversation ending with an answer would lose it; that is refused.
absl::Status RenderMistralV3(const std::vector<ChatMessage>& msgs, const ChatFormat& f, ChatTemplate t,
                             SegmentWriter* w) {
  const bool tekken = t == ChatTemplate::kMistralV3Tekken;
  const bool has_system = msgs[0].role == "system";
  const size_t first = has_system ? 1 : 0;
  // The template checks the alternation first, over every message but tool results.
  size_t index = 0;
  for (size_t i = first; i < msgs.size(); ++i) {
    if (msgs[i].role == "tool") continue;
    if ((msgs[i].role == "user") != (index % 2 == 0)) return MistralRoleError(msgs[i], t, kMistralAlternate);
    ++index;
  }
  const char* inst = tekken ? "[INST]" : "[INST] ";
  w->Context(f.bos_token);
  for (size_t i = first; i < msgs.size(); ++i) {
    const ChatMessage& m = msgs[i];
    const bool last = i + 1 == msgs.size();
    if (m.role == "user") {
      w->Context(absl::StrCat(inst, last && has_system ? absl::StrCat(msgs[0].content, "\n\n") : "", m.content,
                              "[/INST]"));
    } else if (m.role == "assistant") {
      w->Reply(tekken ? absl::StrCat(m.content, f.eos_token) : absl::StrCat(" ", PythonStrip(m.content), f.eos_token),
               m.trained);
    } else if (m.role == "tool") {
      return absl::InvalidArgumentError(absl::StrCat(
          "field ", m.where, ".role: tool messages are not supported with the ", ChatTemplateName(t),
          " template yet (it renders one only as the result of a tool call, with a 9-character tool_call_id; "
          "without one it raises \"Tool call IDs should be alphanumeric strings with length 9!\")"));
    } else {
      return MistralRoleError(m, t, kMistralRoles);
    }
  }
  if (has_system && msgs.back().role != "user") {
    return absl::InvalidArgumentError(
        absl::StrCat("field ", msgs[0].where, ".role: a system message, which the ", ChatTemplateName(t),
                     " template renders only into the conversation's last message when that is a user message, "
                     "and drops here (the last message is ",
                     msgs.size() == 1 ? "the system message itself" : absl::StrCat("an ", msgs.back().role, " one"),
                     "); remove it, or put its text into the user messages"));
  }
  return absl::OkStatus();
}

// Mistral v7: every message in order, system ones as [SYSTEM_PROMPT].
absl::Status RenderMistralV7(const std::vector<ChatMessage>& msgs, const ChatFormat& f, SegmentWriter* w) {
  w->Context(f.bos_token);
  for (const ChatMessage& m : msgs) {
    if (m.role == "user") {
      w->Context(absl::StrCat("[INST] ", m.content, "[/INST]"));
    } else if (m.role == "system") {
      w->Context(absl::StrCat("[SYSTEM_PROMPT] ", m.content, "[/SYSTEM_PROMPT]"));
    } else if (m.role == "assistant") {
      w->Reply(absl::StrCat(" ", m.content, f.eos_token), m.trained);
    } else {
      return MistralRoleError(m, ChatTemplate::kMistralV7, "Only user, system and assistant roles are supported!");
    }
  }
  return absl::OkStatus();
}

std::string GenerationPromptText(ChatTemplate t) {
  switch (t) {
    case ChatTemplate::kLlama3:
    case ChatTemplate::kLlama3_1:
    case ChatTemplate::kLlama3_2: return "<|start_header_id|>assistant<|end_header_id|>\n\n";
    // Qwen3.5 without enable_thinking: the larger models' copy opens a think block, the small
    // models' copy closes an empty one.
    case ChatTemplate::kQwen3_5: return "<|im_start|>assistant\n<think>\n";
    case ChatTemplate::kQwen3_5NoThink: return "<|im_start|>assistant\n<think>\n\n</think>\n\n";
    case ChatTemplate::kGemma3: return "<start_of_turn>model\n";
    case ChatTemplate::kGptOss: return "<|start|>assistant";
    // Mistral's templates have no generation prompt: the prompt ends with [/INST].
    case ChatTemplate::kMistralV1:
    case ChatTemplate::kMistralV3:
    case ChatTemplate::kMistralV3Tekken:
    case ChatTemplate::kMistralV7: return "";
    default: return "<|im_start|>assistant\n";
  }
}

}  // namespace

const char* ChatTemplateName(ChatTemplate t) {
  switch (t) {
    case ChatTemplate::kQwen3: return "qwen3";
    case ChatTemplate::kQwen3_5: return "qwen3.5";
    case ChatTemplate::kQwen3_5NoThink: return "qwen3.5-nothink";
    case ChatTemplate::kQwen2_5: return "qwen2.5";
    case ChatTemplate::kLlama3: return "llama3";
    case ChatTemplate::kLlama3_1: return "llama3.1";
    case ChatTemplate::kLlama3_2: return "llama3.2";
    case ChatTemplate::kGemma3: return "gemma3";
    case ChatTemplate::kGptOss: return "gpt-oss";
    case ChatTemplate::kMistralV1: return "mistral-v1";
    case ChatTemplate::kMistralV3: return "mistral-v3";
    case ChatTemplate::kMistralV3Tekken: return "mistral-v3-tekken";
    case ChatTemplate::kMistralV7: return "mistral-v7";
    case ChatTemplate::kChatML: return "chatml";
    case ChatTemplate::kAuto: break;
  }
  return "auto";
}

absl::StatusOr<ChatTemplate> ParseChatTemplateName(std::string_view name) {
  for (ChatTemplate t :
       {ChatTemplate::kAuto, ChatTemplate::kQwen3, ChatTemplate::kQwen3_5, ChatTemplate::kQwen3_5NoThink,
        ChatTemplate::kQwen2_5, ChatTemplate::kLlama3, ChatTemplate::kLlama3_1, ChatTemplate::kLlama3_2,
        ChatTemplate::kGemma3, ChatTemplate::kGptOss, ChatTemplate::kMistralV1, ChatTemplate::kMistralV3,
        ChatTemplate::kMistralV3Tekken, ChatTemplate::kMistralV7, ChatTemplate::kChatML}) {
    if (name == ChatTemplateName(t)) return t;
  }
  if (name == "llama3.3") return ChatTemplate::kLlama3_1;
  if (name == "mistral-nemo") return ChatTemplate::kMistralV3Tekken;
  return absl::InvalidArgumentError(
      absl::StrCat("chat template \"", std::string(name),
                   "\" is not one of auto, qwen3, qwen3.5, qwen3.5-nothink, qwen2.5, llama3, llama3.1, llama3.2, "
                   "llama3.3, gemma3, gpt-oss, mistral-v1, mistral-v3, mistral-v3-tekken (mistral-nemo), mistral-v7, "
                   "chatml"));
}

std::string PythonStrip(std::string_view s) {
  size_t b = 0;
  while (b < s.size()) {
    size_t len;
    if (!IsPythonSpace(DecodeAt(s, b, &len))) break;
    b += len;
  }
  size_t e = s.size();
  while (e > b) {
    size_t start = e - 1;  // back to the lead byte of the last code point
    while (start > b && (static_cast<unsigned char>(s[start]) & 0xC0) == 0x80) --start;
    size_t len;
    if (!IsPythonSpace(DecodeAt(s, start, &len)) || start + len != e) break;
    e = start;
  }
  return std::string(s.substr(b, e - b));
}

std::string PythonJsonString(std::string_view s) {
  std::string out = "\"";
  for (char c : s) {
    switch (c) {
      case '"': out += "\\\""; break;
      case '\\': out += "\\\\"; break;
      case '\n': out += "\\n"; break;
      case '\r': out += "\\r"; break;
      case '\t': out += "\\t"; break;
      case '\b': out += "\\b"; break;
      case '\f': out += "\\f"; break;
      default:
        if (static_cast<unsigned char>(c) < 0x20) {
          out += absl::StrFormat("\\u%04x", static_cast<unsigned char>(c));
        } else {
          out += c;  // ensure_ascii=False: everything else as is
        }
    }
  }
  out += '"';
  return out;
}

absl::StatusOr<std::string> SpecialTokenText(const json& config, const char* key) {
  if (!config.is_object() || !config.contains(key)) return std::string();
  const json& t = config[key];
  if (t.is_null()) return std::string();
  if (t.is_string()) return t.get<std::string>();
  if (t.is_object() && t.contains("content") && t["content"].is_string()) return t["content"].get<std::string>();
  return absl::InvalidArgumentError(absl::StrCat("tokenizer_config.json ", key, ": ", t.type_name(),
                                                 ", neither a string nor an object with a string \"content\""));
}

absl::StatusOr<std::string> ChatTemplateText(const json& config) {
  if (!config.is_object() || !config.contains("chat_template") || config["chat_template"].is_null()) {
    return std::string();
  }
  const json& ct = config["chat_template"];
  if (ct.is_string()) return ct.get<std::string>();
  if (ct.is_array()) {
    for (size_t i = 0; i < ct.size(); ++i) {
      const json& e = ct[i];
      const std::string where = absl::StrCat("tokenizer_config.json chat_template[", i, "]");
      if (!e.is_object()) return absl::InvalidArgumentError(absl::StrCat(where, ": not an object {name, template}"));
      if (!e.contains("name") || !e["name"].is_string()) {
        return absl::InvalidArgumentError(absl::StrCat(where, ".name: missing or not a string"));
      }
      if (!e.contains("template") || !e["template"].is_string()) {
        return absl::InvalidArgumentError(absl::StrCat(where, ".template: missing or not a string"));
      }
      if (e["name"].get<std::string>() == "default") return e["template"].get<std::string>();
    }
    return absl::InvalidArgumentError(
        "tokenizer_config.json chat_template: a list of named templates without one named \"default\"");
  }
  return absl::InvalidArgumentError(
      "tokenizer_config.json chat_template: neither a string nor a list of {name, template}");
}

namespace {

absl::StatusOr<ChatFormat> ResolveChatFormatUnguarded(const json& config, ChatTemplate requested,
                                                      const std::string& date_string) {
  auto text = ChatTemplateText(config);
  if (!text.ok()) return text.status();
  ChatFormat format;
  if (requested == ChatTemplate::kAuto) {
    if (text->empty()) {
      return absl::FailedPreconditionError(
          "tokenizer_config.json has no chat_template; chat data needs one (or --chat-template NAME)");
    }
    auto known = IdentifyChatTemplate(*text);
    if (!known.ok()) return known.status();
    format.tmpl = *known;
  } else if (requested == ChatTemplate::kChatML) {
    if (!text->empty() && !absl::StrContains(*text, "<|im_start|>")) {
      return absl::InvalidArgumentError(
          "chat template chatml requested, but the model's template does not use <|im_start|>");
    }
    format.tmpl = requested;
  } else {
    auto known = text->empty() ? absl::StatusOr<ChatTemplate>(absl::NotFoundError("")) : IdentifyChatTemplate(*text);
    if (known.ok() && *known != requested) {
      return absl::InvalidArgumentError(absl::StrCat("chat template ", ChatTemplateName(requested),
                                                     " requested, but the model's template is ",
                                                     ChatTemplateName(*known), "'s"));
    }
    if (!known.ok()) {
      LOG(WARNING) << "prepare: rendering chat data with the " << ChatTemplateName(requested)
                   << " template as asked; the model's own template is "
                   << (text->empty() ? "absent" : "not a known one");
    }
    format.tmpl = requested;
  }
  const bool renders_bos = format.tmpl == ChatTemplate::kLlama3 || IsLlama31Family(format.tmpl) ||
                           format.tmpl == ChatTemplate::kGemma3 || IsMistral(format.tmpl);
  if (renders_bos) {
    auto bos = SpecialTokenText(config, "bos_token");
    if (!bos.ok()) return bos.status();
    format.bos_token = *bos;
    if (format.bos_token.empty()) {
      return absl::FailedPreconditionError(absl::StrCat("tokenizer_config.json has no bos_token, which the ",
                                                        ChatTemplateName(format.tmpl), " template renders first"));
    }
  }
  if (IsMistral(format.tmpl)) {
    auto eos = SpecialTokenText(config, "eos_token");
    if (!eos.ok()) return eos.status();
    format.eos_token = *eos;
    if (format.eos_token.empty()) {
      return absl::FailedPreconditionError(absl::StrCat("tokenizer_config.json has no eos_token, which the ",
                                                        ChatTemplateName(format.tmpl), " template ends answers with"));
    }
  }
  if (IsLlama31Family(format.tmpl)) {
    format.date_string = date_string.empty() ? kLlamaDefaultDate : date_string;
  } else if (format.tmpl == ChatTemplate::kGptOss) {
    format.date_string = date_string.empty() ? kGptOssDefaultDate : date_string;
    // strftime_now("%Y-%m-%d") always gives this shape; another (Llama's "26 Jul 2024") is a mistake.
    const std::string& d = format.date_string;
    bool iso = d.size() == 10 && d[4] == '-' && d[7] == '-';
    for (size_t i = 0; iso && i < d.size(); ++i) iso = i == 4 || i == 7 || (d[i] >= '0' && d[i] <= '9');
    if (!iso) {
      return absl::InvalidArgumentError(absl::StrCat("chat date \"", d,
                                                     "\": the gpt-oss template renders strftime_now(\"%Y-%m-%d\"), "
                                                     "so give the date as YYYY-MM-DD"));
    }
  } else if (!date_string.empty()) {
    return absl::InvalidArgumentError(absl::StrCat("a chat date (\"", date_string,
                                                   "\") applies to the llama3.1, llama3.2 and gpt-oss templates "
                                                   "only; the model's template is ",
                                                   ChatTemplateName(format.tmpl)));
  }
  return format;
}

}  // namespace

absl::StatusOr<ChatFormat> ResolveChatFormat(const json& config, ChatTemplate requested,
                                             const std::string& date_string) {
  // Every field is type-checked before it is read; this keeps a missed one an error, not an abort.
  try {
    return ResolveChatFormatUnguarded(config, requested, date_string);
  } catch (const json::exception& e) {
    return absl::InvalidArgumentError(absl::StrCat("tokenizer_config.json: ", e.what()));
  }
}

absl::StatusOr<std::string> ContentText(const json& content, const std::string& where) {
  if (content.is_string()) return content.get<std::string>();
  if (!content.is_array()) {
    const std::string type = content.is_null() ? "null" : absl::StrCat("a ", content.type_name());
    return absl::InvalidArgumentError(
        absl::StrCat("field ", where, ": ", type, ", neither a string nor a list of parts"));
  }
  std::string text;
  for (size_t k = 0; k < content.size(); ++k) {
    const json& part = content[k];
    const std::string at = absl::StrCat(where, "[", k, "]");
    if (!part.is_object() || !part.contains("type") || !part["type"].is_string()) {
      return absl::InvalidArgumentError(absl::StrCat("field ", at, ": not a part {\"type\": ..., ...}"));
    }
    const std::string& type = part["type"].get_ref<const std::string&>();
    if (type != "text") {
      return absl::InvalidArgumentError(
          absl::StrCat("field ", at, ".type: \"", type,
                       "\" parts are not supported: prepare trains text only (only \"text\" parts)"));
    }
    if (!part.contains("text") || !part["text"].is_string()) {
      return absl::InvalidArgumentError(absl::StrCat("field ", at, ".text: missing or not a string"));
    }
    text += part["text"].get_ref<const std::string&>();
  }
  return text;
}

absl::StatusOr<std::vector<ChatMessage>> ParseChatMessages(const json& messages, ChatTemplate tmpl,
                                                           absl::string_view field) {
  if (!messages.is_array()) return absl::InvalidArgumentError(absl::StrCat("field ", field, ": must be an array"));
  if (messages.empty()) return absl::InvalidArgumentError(absl::StrCat("field ", field, ": is empty"));
  std::vector<ChatMessage> out;
  out.reserve(messages.size());
  for (size_t i = 0; i < messages.size(); ++i) {
    ASSIGN_OR_RETURN(ChatMessage m, ParseChatMessage(messages[i], tmpl, absl::StrCat(field, "[", i, "]")));
    out.push_back(std::move(m));
  }
  return out;
}

absl::StatusOr<std::vector<Segment>> RenderChat(const json& messages, const ChatFormat& format, LossOn loss_on,
                                                GenerationPrompt generation_prompt) {
  ASSIGN_OR_RETURN(std::vector<ChatMessage> msgs, ParseChatMessages(messages, format.tmpl, "messages"));
  return RenderChatMessages(msgs, format, loss_on, generation_prompt, "messages");
}

absl::StatusOr<std::vector<Segment>> RenderChatMessages(const std::vector<ChatMessage>& msgs, const ChatFormat& format,
                                                        LossOn loss_on, GenerationPrompt generation_prompt,
                                                        absl::string_view field) {
  if (msgs.empty()) return absl::InvalidArgumentError(absl::StrCat("field ", field, ": no messages"));
  SegmentWriter w(loss_on);
  switch (format.tmpl) {
    case ChatTemplate::kChatML:
      for (const ChatMessage& m : msgs) {
        if (m.role == "tool") {
          return absl::InvalidArgumentError(absl::StrCat("field ", m.where, ".role: tool is not part of plain ChatML"));
        }
      }
      RenderChatML(msgs, &w);
      break;
    case ChatTemplate::kQwen3: RenderQwen3(msgs, &w); break;
    case ChatTemplate::kQwen3_5:
    case ChatTemplate::kQwen3_5NoThink: RETURN_IF_ERROR(RenderQwen3_5(msgs, field, &w)); break;
    case ChatTemplate::kQwen2_5: RenderQwen2_5(msgs, &w); break;
    case ChatTemplate::kLlama3: RenderLlama3(msgs, format, &w); break;
    case ChatTemplate::kLlama3_1:
    case ChatTemplate::kLlama3_2: RenderLlama3_1(msgs, format, &w); break;
    case ChatTemplate::kGemma3: RETURN_IF_ERROR(RenderGemma3(msgs, format, &w)); break;
    case ChatTemplate::kGptOss: RETURN_IF_ERROR(RenderGptOss(msgs, format, generation_prompt, &w)); break;
    case ChatTemplate::kMistralV1: RETURN_IF_ERROR(RenderMistralV1(msgs, format, &w)); break;
    case ChatTemplate::kMistralV3:
    case ChatTemplate::kMistralV3Tekken: RETURN_IF_ERROR(RenderMistralV3(msgs, format, format.tmpl, &w)); break;
    case ChatTemplate::kMistralV7: RETURN_IF_ERROR(RenderMistralV7(msgs, format, &w)); break;
    case ChatTemplate::kAuto:
      return absl::InvalidArgumentError("RenderChat needs a resolved template (ResolveChatFormat)");
  }
  if (generation_prompt == GenerationPrompt::kAppend) w.Context(GenerationPromptText(format.tmpl));
  bool any_trained = false;
  for (const ChatMessage& m : msgs) any_trained |= m.role == "assistant" && m.trained;
  if (!any_trained && loss_on == LossOn::kAssistant) {
    return absl::InvalidArgumentError(
        absl::StrCat("field ", field, ": no assistant turn, so nothing would be trained"));
  }
  return w.Take();
}

}  // namespace slidedp::prepare
