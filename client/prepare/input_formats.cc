// Record forms -> chat conversations (input_formats.h).
#include "client/prepare/input_formats.h"

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/status/status_macros.h"

namespace slidedp::prepare {
namespace {

using json = nlohmann::json;

constexpr InputFormat kAllFormats[] = {InputFormat::kAuto,
                                       InputFormat::kMessages,
                                       InputFormat::kShareGpt,
                                       InputFormat::kAlpaca,
                                       InputFormat::kConversationalPromptCompletion,
                                       InputFormat::kPromptCompletion,
                                       InputFormat::kText};

// "an array", "an object", "a string", "null", ...: a JSON value's type for messages.
std::string TypeWithArticle(const nlohmann::json& v) {
  if (v.is_null()) return "null";
  const std::string name = v.type_name();
  return (name[0] == 'a' || name[0] == 'o' ? "an " : "a ") + name;
}

absl::Status Missing(const char* field, InputFormat format) {
  return absl::InvalidArgumentError(
      absl::StrCat("field ", field, ": missing, which ", InputFormatName(format), " records have"));
}

// An optional string field: absent or null -> "".
absl::StatusOr<std::string> OptionalString(const json& record, const char* field) {
  if (!record.contains(field) || record[field].is_null()) return std::string();
  if (!record[field].is_string()) {
    return absl::InvalidArgumentError(
        absl::StrCat("field ", field, ": ", TypeWithArticle(record[field]), ", not a string"));
  }
  return record[field].get<std::string>();
}

absl::StatusOr<std::string> RequiredString(const json& record, const char* field, InputFormat format) {
  if (!record.contains(field)) return Missing(field, format);
  if (!record[field].is_string()) {
    return absl::InvalidArgumentError(
        absl::StrCat("field ", field, ": ", TypeWithArticle(record[field]), ", not a string"));
  }
  return record[field].get<std::string>();
}

ChatMessage Message(std::string where, std::string role, std::string content) {
  ChatMessage m;
  m.where = std::move(where);
  m.role = std::move(role);
  m.content = std::move(content);
  return m;
}

// ShareGPT's speaker tags (LLaMA-Factory's defaults and the plain role names).
absl::StatusOr<std::string> ShareGptRole(const std::string& from, const std::string& where) {
  if (from == "human" || from == "user") return std::string("user");
  if (from == "gpt" || from == "assistant") return std::string("assistant");
  if (from == "system") return std::string("system");
  if (from == "tool" || from == "observation") return std::string("tool");
  if (from == "function_call") {
    return absl::InvalidArgumentError(
        absl::StrCat("field ", where, ": \"function_call\" turns (tool calls) are not supported yet"));
  }
  return absl::InvalidArgumentError(absl::StrCat(
      "field ", where, ": \"", from, "\" is not one of human, user, gpt, assistant, system, tool, observation"));
}

absl::StatusOr<Conversation> ShareGpt(const json& record) {
  if (!record.contains("conversations")) return Missing("conversations", InputFormat::kShareGpt);
  const json& turns = record["conversations"];
  if (!turns.is_array()) return absl::InvalidArgumentError("field conversations: must be an array");
  if (turns.empty()) return absl::InvalidArgumentError("field conversations: is empty");
  Conversation c;
  c.trained_field = "conversations";
  ASSIGN_OR_RETURN(std::string system, OptionalString(record, "system"));
  if (!system.empty()) c.messages.push_back(Message("system", "system", std::move(system)));
  for (size_t i = 0; i < turns.size(); ++i) {
    const std::string where = absl::StrCat("conversations[", i, "]");
    const json& t = turns[i];
    if (!t.is_object()) return absl::InvalidArgumentError(absl::StrCat("field ", where, ": must be an object"));
    const bool sharegpt_keys = t.contains("from");
    const char* role_key = sharegpt_keys ? "from" : "role";
    const char* value_key = sharegpt_keys ? "value" : "content";
    if (!t.contains(role_key) || !t[role_key].is_string()) {
      return absl::InvalidArgumentError(absl::StrCat("field ", where, ".", role_key, ": missing or not a string"));
    }
    ASSIGN_OR_RETURN(std::string role,
                     ShareGptRole(t[role_key].get<std::string>(), absl::StrCat(where, ".", role_key)));
    if (role == "system" && !c.messages.empty() && c.messages[0].where == "system") {
      return absl::InvalidArgumentError(
          absl::StrCat("field ", where, ": a system turn as well as a top-level \"system\"; keep one"));
    }
    if (!t.contains(value_key)) {
      return absl::InvalidArgumentError(absl::StrCat("field ", where, ".", value_key, ": missing"));
    }
    ASSIGN_OR_RETURN(std::string content, ContentText(t[value_key], absl::StrCat(where, ".", value_key)));
    c.messages.push_back(Message(where, std::move(role), std::move(content)));
  }
  return c;
}

absl::StatusOr<Conversation> Alpaca(const json& record) {
  ASSIGN_OR_RETURN(const std::string instruction, RequiredString(record, "instruction", InputFormat::kAlpaca));
  ASSIGN_OR_RETURN(const std::string input, OptionalString(record, "input"));
  ASSIGN_OR_RETURN(std::string output, RequiredString(record, "output", InputFormat::kAlpaca));
  ASSIGN_OR_RETURN(std::string system, OptionalString(record, "system"));
  if (record.contains("history") && !record["history"].is_null() &&
      !(record["history"].is_array() && record["history"].empty())) {
    return absl::InvalidArgumentError(
        "field history: multi-turn Alpaca records are not supported; write the conversation as messages");
  }
  if (output.empty()) return absl::InvalidArgumentError("field output: empty, so nothing would be trained");
  std::vector<std::string> query;
  if (!instruction.empty()) query.push_back(instruction);
  if (!input.empty()) query.push_back(input);
  if (query.empty()) return absl::InvalidArgumentError("field instruction: empty, and no input");
  Conversation c;
  c.trained_field = "output";
  if (!system.empty()) c.messages.push_back(Message("system", "system", std::move(system)));
  c.messages.push_back(
      Message(input.empty() ? "instruction" : "instruction+input", "user", absl::StrJoin(query, "\n")));
  c.messages.push_back(Message("output", "assistant", std::move(output)));
  return c;
}

absl::StatusOr<Conversation> ConversationalPromptCompletion(const json& record, ChatTemplate tmpl) {
  for (const char* field : {"prompt", "completion"}) {
    if (!record.contains(field)) return Missing(field, InputFormat::kConversationalPromptCompletion);
    if (!record[field].is_array()) {
      return absl::InvalidArgumentError(absl::StrCat(
          "field ", field, ": ", TypeWithArticle(record[field]),
          ", not a list of messages; prompt and completion are both strings (prompt_completion) or both lists of "
          "messages (conversational_prompt_completion)"));
    }
  }
  ASSIGN_OR_RETURN(std::vector<ChatMessage> prompt, ParseChatMessages(record["prompt"], tmpl, "prompt"));
  ASSIGN_OR_RETURN(std::vector<ChatMessage> completion, ParseChatMessages(record["completion"], tmpl, "completion"));
  Conversation c;
  c.trained_field = "completion";
  for (ChatMessage& m : prompt) {
    m.trained = false;
    c.messages.push_back(std::move(m));
  }
  for (ChatMessage& m : completion) c.messages.push_back(std::move(m));
  return c;
}

}  // namespace

const char* InputFormatName(InputFormat f) {
  switch (f) {
    case InputFormat::kAuto: return "auto";
    case InputFormat::kMessages: return "messages";
    case InputFormat::kShareGpt: return "sharegpt";
    case InputFormat::kAlpaca: return "alpaca";
    case InputFormat::kConversationalPromptCompletion: return "conversational_prompt_completion";
    case InputFormat::kPromptCompletion: return "prompt_completion";
    case InputFormat::kText: return "text";
  }
  return "auto";
}

absl::StatusOr<InputFormat> ParseInputFormatName(std::string_view name) {
  std::vector<std::string> names;
  for (InputFormat f : kAllFormats) {
    if (name == InputFormatName(f)) return f;
    names.push_back(InputFormatName(f));
  }
  return absl::InvalidArgumentError(
      absl::StrCat("input format \"", std::string(name), "\" is not one of ", absl::StrJoin(names, ", ")));
}

bool RendersWithChatTemplate(InputFormat f) {
  return f == InputFormat::kMessages || f == InputFormat::kShareGpt || f == InputFormat::kAlpaca ||
         f == InputFormat::kConversationalPromptCompletion;
}

absl::StatusOr<InputFormat> DetectInputFormat(const json& record) {
  if (!record.is_object()) return absl::InvalidArgumentError("not a JSON object");
  if (record.contains("messages")) return InputFormat::kMessages;
  if (record.contains("conversations")) return InputFormat::kShareGpt;
  if (record.contains("instruction")) return InputFormat::kAlpaca;
  if (record.contains("prompt") || record.contains("completion")) {
    const bool list = (record.contains("prompt") && record["prompt"].is_array()) ||
                      (record.contains("completion") && record["completion"].is_array());
    return list ? InputFormat::kConversationalPromptCompletion : InputFormat::kPromptCompletion;
  }
  if (record.contains("text")) return InputFormat::kText;
  return absl::InvalidArgumentError(
      "has none of the fields messages, conversations (ShareGPT), instruction (Alpaca), prompt+completion, text");
}

absl::StatusOr<Conversation> RecordConversation(const json& record, InputFormat format, ChatTemplate tmpl) {
  switch (format) {
    case InputFormat::kMessages: {
      if (!record.contains("messages")) return Missing("messages", format);
      ASSIGN_OR_RETURN(std::vector<ChatMessage> messages, ParseChatMessages(record["messages"], tmpl, "messages"));
      return Conversation{std::move(messages), "messages"};
    }
    case InputFormat::kShareGpt: return ShareGpt(record);
    case InputFormat::kAlpaca: return Alpaca(record);
    case InputFormat::kConversationalPromptCompletion: return ConversationalPromptCompletion(record, tmpl);
    default: break;
  }
  return absl::InvalidArgumentError(
      absl::StrCat("a ", InputFormatName(format), " record does not render through a chat template"));
}

}  // namespace slidedp::prepare
