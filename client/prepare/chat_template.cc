// Qwen3 / ChatML rendering with trained spans (mirrors the Jinja template line by line).
#include "client/prepare/chat_template.h"

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"

namespace slidedp::prepare {
namespace {

using json = nlohmann::json;

// Python's str.strip/lstrip/rstrip with a character set.
std::string LStrip(const std::string& s, char c) {
  size_t b = s.find_first_not_of(c);
  return b == std::string::npos ? std::string() : s.substr(b);
}
std::string RStrip(const std::string& s, char c) {
  size_t e = s.find_last_not_of(c);
  return e == std::string::npos ? std::string() : s.substr(0, e + 1);
}
std::string Strip(const std::string& s, char c) { return LStrip(RStrip(s, c), c); }

struct Message {
  std::string role;
  std::string content;
  std::string reasoning;
  bool has_reasoning = false;
};

absl::StatusOr<std::vector<Message>> ParseMessages(const json& messages) {
  if (!messages.is_array()) return absl::InvalidArgumentError("field messages: must be an array");
  if (messages.empty()) return absl::InvalidArgumentError("field messages: is empty");
  std::vector<Message> out;
  for (size_t i = 0; i < messages.size(); ++i) {
    const json& m = messages[i];
    const std::string where = absl::StrCat("field messages[", i, "]");
    if (!m.is_object()) return absl::InvalidArgumentError(absl::StrCat(where, ": must be an object"));
    if (!m.contains("role") || !m["role"].is_string()) {
      return absl::InvalidArgumentError(absl::StrCat(where, ".role: missing or not a string"));
    }
    Message msg;
    msg.role = m["role"].get<std::string>();
    if (msg.role != "system" && msg.role != "user" && msg.role != "assistant" && msg.role != "tool") {
      return absl::InvalidArgumentError(
          absl::StrCat(where, ".role: \"", msg.role, "\" is not one of system, user, assistant, tool"));
    }
    if (m.contains("tool_calls") && !m["tool_calls"].is_null()) {
      return absl::InvalidArgumentError(absl::StrCat(where, ".tool_calls: tool calls are not supported yet"));
    }
    if (!m.contains("content") || !m["content"].is_string()) {
      return absl::InvalidArgumentError(absl::StrCat(where, ".content: missing or not a string"));
    }
    msg.content = m["content"].get<std::string>();
    if (m.contains("reasoning_content") && !m["reasoning_content"].is_null()) {
      if (!m["reasoning_content"].is_string()) {
        return absl::InvalidArgumentError(absl::StrCat(where, ".reasoning_content: not a string"));
      }
      msg.reasoning = m["reasoning_content"].get<std::string>();
      msg.has_reasoning = true;
    }
    out.push_back(std::move(msg));
  }
  return out;
}

}  // namespace

const char* ChatTemplateName(ChatTemplate t) {
  switch (t) {
    case ChatTemplate::kQwen3:
      return "qwen3";
    case ChatTemplate::kChatML:
      return "chatml";
    default:
      return "auto";
  }
}

absl::StatusOr<ChatTemplate> ResolveChatTemplate(const json& config, ChatTemplate requested) {
  std::string tmpl;
  if (config.contains("chat_template")) {
    const json& ct = config["chat_template"];
    if (ct.is_string()) {
      tmpl = ct.get<std::string>();
    } else if (ct.is_array()) {
      for (const json& e : ct) {
        if (e.is_object() && e.value("name", std::string()) == "default" && e.contains("template") &&
            e["template"].is_string()) {
          tmpl = e["template"].get<std::string>();
        }
      }
    }
  }
  const bool chatml_like = absl::StrContains(tmpl, "<|im_start|>");
  const bool qwen3 = chatml_like && absl::StrContains(tmpl, "last_query_index") &&
                     absl::StrContains(tmpl, "reasoning_content");
  if (requested == ChatTemplate::kAuto) {
    if (qwen3) return ChatTemplate::kQwen3;
    if (tmpl.empty()) {
      return absl::FailedPreconditionError(
          "tokenizer_config.json has no chat_template; chat data needs one (supported: qwen3, chatml)");
    }
    if (chatml_like) {
      return absl::UnimplementedError(
          "the model's chat template is ChatML-like but not Qwen3's (e.g. Qwen2.5 adds a default system "
          "prompt); choose the template explicitly (chatml) if plain ChatML is what you want");
    }
    return absl::UnimplementedError(
        "the model's chat template is not supported (supported: qwen3, chatml); use prompt/completion or text data");
  }
  if (!tmpl.empty() && !chatml_like) {
    return absl::InvalidArgumentError(absl::StrCat("chat template ", ChatTemplateName(requested),
                                                   " requested, but the model's template does not use <|im_start|>"));
  }
  return requested;
}

absl::StatusOr<std::vector<Segment>> RenderChat(const json& messages, ChatTemplate tmpl, LossOn loss_on) {
  auto parsed = ParseMessages(messages);
  if (!parsed.ok()) return parsed.status();
  const std::vector<Message>& msgs = *parsed;
  const bool all = loss_on == LossOn::kAll;
  std::vector<Segment> out;
  auto emit = [&](std::string text, bool trained) {
    if (text.empty()) return;
    if (!out.empty() && out.back().trained == trained) {
      out.back().text += text;
    } else {
      out.push_back({std::move(text), trained});
    }
  };
  bool any_assistant = false;
  if (tmpl == ChatTemplate::kChatML) {
    for (const Message& m : msgs) {
      if (m.role == "tool") return absl::InvalidArgumentError("field messages: role tool needs the qwen3 template");
      const bool trained = all || m.role == "assistant";
      any_assistant |= m.role == "assistant";
      emit(absl::StrCat("<|im_start|>", m.role, "\n"), all);
      emit(absl::StrCat(m.content, "<|im_end|>"), trained);
      emit("\n", all);
    }
  } else if (tmpl == ChatTemplate::kQwen3) {
    const int n = static_cast<int>(msgs.size());
    int last_query = n - 1;
    for (int i = n - 1; i >= 0; --i) {
      const Message& m = msgs[i];
      if (m.role == "user" &&
          !(absl::StartsWith(m.content, "<tool_response>") && absl::EndsWith(m.content, "</tool_response>"))) {
        last_query = i;
        break;
      }
    }
    if (msgs[0].role == "system") emit(absl::StrCat("<|im_start|>system\n", msgs[0].content, "<|im_end|>\n"), all);
    for (int i = 0; i < n; ++i) {
      const Message& m = msgs[i];
      if (m.role == "user" || (m.role == "system" && i != 0)) {
        emit(absl::StrCat("<|im_start|>", m.role, "\n", m.content, "<|im_end|>\n"), all);
      } else if (m.role == "assistant") {
        any_assistant = true;
        std::string content = m.content, reasoning;
        if (m.has_reasoning) {
          reasoning = m.reasoning;
        } else if (absl::StrContains(m.content, "</think>")) {
          content = LStrip(m.content.substr(m.content.rfind("</think>") + 8), '\n');
          std::string before = RStrip(m.content.substr(0, m.content.find("</think>")), '\n');
          const size_t open = before.rfind("<think>");
          reasoning = LStrip(open == std::string::npos ? before : before.substr(open + 7), '\n');
        }
        emit("<|im_start|>assistant\n", all);
        std::string body;
        if (i > last_query && (i == n - 1 || !reasoning.empty())) {
          body = absl::StrCat("<think>\n", Strip(reasoning, '\n'), "\n</think>\n\n", LStrip(content, '\n'));
        } else {
          body = content;
        }
        emit(absl::StrCat(body, "<|im_end|>"), true);
        emit("\n", all);
      } else if (m.role == "tool") {
        std::string text;
        if (i == 0 || msgs[i - 1].role != "tool") text += "<|im_start|>user";
        absl::StrAppend(&text, "\n<tool_response>\n", m.content, "\n</tool_response>");
        if (i == n - 1 || msgs[i + 1].role != "tool") text += "<|im_end|>\n";
        emit(text, all);
      }
    }
  } else {
    return absl::InvalidArgumentError("RenderChat needs a resolved template (qwen3 or chatml)");
  }
  if (!any_assistant && !all) {
    return absl::InvalidArgumentError("field messages: no assistant turn, so nothing would be trained");
  }
  return out;
}

}  // namespace slidedp::prepare
