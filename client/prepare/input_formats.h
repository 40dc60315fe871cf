// The forms a training record takes in the JSONL files people have, and how each becomes a chat
// conversation for the model's template (docs/dataset-format.md, "Input formats", has an example
// line and the masking rule of each):
//
//   messages                          {"messages": [{"role", "content"}, ...]} (OpenAI / HF chat);
//                                     content a string or a list of text parts
//   sharegpt                          {"conversations": [{"from", "value"}, ...], "system"?}
//   alpaca                            {"instruction", "input"?, "output", "system"?}
//   conversational_prompt_completion  {"prompt": [messages], "completion": [messages]} (TRL)
//   prompt_completion                 {"prompt": "...", "completion": "..."}: no chat template
//   text                              {"text": "..."}: no chat template
//
// The first four render through the chat template (chat_template.h); their trained spans are the
// assistant replies that the record's own answer holds (all of messages' and sharegpt's, Alpaca's
// output, the completion's). prepare picks the form per file from its first record (kAuto) or
// takes the one forced with --format; a file whose records change form is refused.
#pragma once

#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"
#include "client/prepare/chat_template.h"
#include "nlohmann/json.hpp"

namespace slidedp::prepare {

enum class InputFormat {
  kAuto,
  kMessages,
  kShareGpt,
  kAlpaca,
  kConversationalPromptCompletion,
  kPromptCompletion,
  kText,
};

// "auto", "messages", "sharegpt", "alpaca", "conversational_prompt_completion",
// "prompt_completion", "text".
const char* InputFormatName(InputFormat f);
// The inverse, for --format; INVALID_ARGUMENT listing the names.
absl::StatusOr<InputFormat> ParseInputFormatName(std::string_view name);
// Whether records of this form render through the model's chat template.
bool RendersWithChatTemplate(InputFormat f);

// The form a record's fields say, by the first of: "messages"; "conversations"; "instruction";
// "prompt" or "completion" (conversational when either is a list); "text". INVALID_ARGUMENT when
// it has none of them.
absl::StatusOr<InputFormat> DetectInputFormat(const nlohmann::json& record);

// A record of a chat form as checked messages, and the field that holds what is trained (named
// when nothing would be).
struct Conversation {
  std::vector<ChatMessage> messages;
  std::string trained_field;  // "messages", "conversations", "output", "completion"
};

// `format` is one of the chat forms (RendersWithChatTemplate). Errors are INVALID_ARGUMENT naming
// the field ("conversations[2].from", "completion[0].content[1].type").
//   sharegpt: from human|user -> user, gpt|assistant -> assistant, system -> system,
//             tool|observation -> tool; function_call (a tool call) and anything else refused.
//             A top-level "system" string is a leading system turn. ({"role", "content"} turns
//             are read too, as some exports write them.)
//   alpaca:   user = instruction and input joined with "\n" (the non-empty ones, as LLaMA-Factory
//             does), assistant = output (non-empty); "system" a leading system turn; a non-empty
//             "history" is refused (write multi-turn data as messages).
//   conversational_prompt_completion: prompt's messages are context (their assistant turns too),
//             completion's assistant turns are trained.
absl::StatusOr<Conversation> RecordConversation(const nlohmann::json& record, InputFormat format, ChatTemplate tmpl);

}  // namespace slidedp::prepare
