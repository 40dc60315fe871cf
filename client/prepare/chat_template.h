// Renders training documents as text segments, each marked trained or not, before tokenization.
//
// Supported chat templates (chosen from tokenizer_config.json's chat_template, or forced):
//   kQwen3  : Qwen3's template, reproduced exactly for system/user/assistant/tool messages without
//             tools or tool_calls: "<|im_start|>{role}\n{content}<|im_end|>\n"; an assistant turn
//             after the last user query gets "<think>\n{reasoning}\n</think>\n\n" (empty reasoning
//             included, as the template does for the final turn); reasoning comes from
//             "reasoning_content" or from a "<think>...</think>" prefix of the content; tool
//             messages are wrapped in <tool_response> inside a user turn.
//   kChatML : plain ChatML (no default system prompt, no think handling), only when asked for.
// Everything else (Llama-3, Mistral, tools, tool_calls, non-string content) is refused with a
// message naming the field: a silently wrong template is a classic fine-tuning bug.
//
// Trained spans (LossOn::kAssistant): an assistant turn's text after "<|im_start|>assistant\n"
// through its "<|im_end|>" (EOS trainable); the "\n" after it is not. LossOn::kAll trains all.
#pragma once

#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "nlohmann/json.hpp"

namespace slidedp::prepare {

enum class ChatTemplate { kAuto, kQwen3, kChatML };
enum class LossOn { kAssistant, kAll };  // chat: assistant turns; prompt/completion: completion only

const char* ChatTemplateName(ChatTemplate t);

// One piece of rendered text. Consecutive segments are concatenated.
struct Segment {
  std::string text;
  bool trained = false;
};

// Picks the template from tokenizer_config.json's "chat_template" (a string, or a list of
// {name, template} where "default" is used). `requested` other than kAuto is honoured when the
// model's template is ChatML-like (contains <|im_start|>). UNIMPLEMENTED / INVALID_ARGUMENT with
// a message that says what is supported.
absl::StatusOr<ChatTemplate> ResolveChatTemplate(const nlohmann::json& tokenizer_config, ChatTemplate requested);

// `messages` is the JSON array; errors are INVALID_ARGUMENT naming the field (messages[2].role).
absl::StatusOr<std::vector<Segment>> RenderChat(const nlohmann::json& messages, ChatTemplate tmpl, LossOn loss_on);

}  // namespace slidedp::prepare
