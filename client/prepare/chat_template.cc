// Chat rendering with trained spans: each template mirrors its Jinja source line by line
// (known_chat_templates.cc holds the sources; tests compare with transformers' output).
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

absl::StatusOr<ChatMessage> ParseChatMessage(const json& m, ChatTemplate tmpl, const std::string& where) {
  if (!m.is_object()) return absl::InvalidArgumentError(absl::StrCat("field ", where, ": must be an object"));
  if (!m.contains("role") || !m["role"].is_string()) {
    return absl::InvalidArgumentError(absl::StrCat("field ", where, ".role: missing or not a string"));
  }
  ChatMessage msg;
  msg.where = where;
  msg.role = m["role"].get<std::string>();
  const bool ipython = IsLlama31Family(tmpl) && msg.role == "ipython";  // the Llama 3.1 templates' tool role
  if (msg.role != "system" && msg.role != "user" && msg.role != "assistant" && msg.role != "tool" && !ipython) {
    return absl::InvalidArgumentError(
        absl::StrCat("field ", where, ".role: \"", msg.role, "\" is not one of system, user, assistant, tool"));
  }
  if (m.contains("tool_calls") && !m["tool_calls"].is_null()) {
    return absl::InvalidArgumentError(absl::StrCat("field ", where, ".tool_calls: tool calls are not supported yet"));
  }
  if (m.contains("tool_calls") && IsLlama31Family(tmpl)) {
    // `'tool_calls' in message` is true for a null value too, and the template then fails on it.
    return absl::InvalidArgumentError(absl::StrCat("field ", where, ".tool_calls: present (null), which the ",
                                                   ChatTemplateName(tmpl),
                                                   " template treats as a tool call; remove the key"));
  }
  if (!m.contains("content")) return absl::InvalidArgumentError(absl::StrCat("field ", where, ".content: missing"));
  ASSIGN_OR_RETURN(msg.content, ContentText(m["content"], absl::StrCat(where, ".content")));
  if (m.contains("reasoning_content") && !m["reasoning_content"].is_null()) {
    if (!m["reasoning_content"].is_string()) {
      return absl::InvalidArgumentError(absl::StrCat("field ", where, ".reasoning_content: not a string"));
    }
    msg.reasoning = m["reasoning_content"].get<std::string>();
    msg.has_reasoning = true;
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

std::string GenerationPromptText(ChatTemplate t) {
  switch (t) {
    case ChatTemplate::kLlama3:
    case ChatTemplate::kLlama3_1:
    case ChatTemplate::kLlama3_2: return "<|start_header_id|>assistant<|end_header_id|>\n\n";
    // Qwen3.5 without enable_thinking: the larger models' copy opens a think block, the small
    // models' copy closes an empty one.
    case ChatTemplate::kQwen3_5: return "<|im_start|>assistant\n<think>\n";
    case ChatTemplate::kQwen3_5NoThink: return "<|im_start|>assistant\n<think>\n\n</think>\n\n";
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
    case ChatTemplate::kChatML: return "chatml";
    case ChatTemplate::kAuto: break;
  }
  return "auto";
}

absl::StatusOr<ChatTemplate> ParseChatTemplateName(std::string_view name) {
  for (ChatTemplate t : {ChatTemplate::kAuto, ChatTemplate::kQwen3, ChatTemplate::kQwen3_5,
                         ChatTemplate::kQwen3_5NoThink, ChatTemplate::kQwen2_5, ChatTemplate::kLlama3,
                         ChatTemplate::kLlama3_1, ChatTemplate::kLlama3_2, ChatTemplate::kChatML}) {
    if (name == ChatTemplateName(t)) return t;
  }
  if (name == "llama3.3") return ChatTemplate::kLlama3_1;
  return absl::InvalidArgumentError(absl::StrCat(
      "chat template \"", std::string(name),
      "\" is not one of auto, qwen3, qwen3.5, qwen3.5-nothink, qwen2.5, llama3, llama3.1, llama3.2, llama3.3, chatml"));
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
  const bool llama = format.tmpl == ChatTemplate::kLlama3 || IsLlama31Family(format.tmpl);
  if (llama) {
    auto bos = SpecialTokenText(config, "bos_token");
    if (!bos.ok()) return bos.status();
    format.bos_token = *bos;
    if (format.bos_token.empty()) {
      return absl::FailedPreconditionError(absl::StrCat("tokenizer_config.json has no bos_token, which the ",
                                                        ChatTemplateName(format.tmpl), " template renders first"));
    }
  }
  if (IsLlama31Family(format.tmpl)) {
    format.date_string = date_string.empty() ? kLlamaDefaultDate : date_string;
  } else if (!date_string.empty()) {
    return absl::InvalidArgumentError(absl::StrCat("a chat date (\"", date_string,
                                                   "\") applies to the llama3.1 and llama3.2 templates only; the "
                                                   "model's template is ",
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
