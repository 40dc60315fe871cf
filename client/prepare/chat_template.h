// Renders chat documents as text segments, each marked trained or not, before tokenization: the
// exact text HF `tokenizer.apply_chat_template(messages)` renders with the model's own Jinja
// template (docs/dataset-format.md, "Chat templates"). Each template is reproduced in C++ line by
// line; which one a model has is recognised by comparing its template text with the known ones
// (known_chat_templates.h), and anything else is refused: a silently wrong template is a classic
// fine-tuning bug.
//
//   kQwen3    Qwen3: "<|im_start|>{role}\n{content}<|im_end|>\n"; an assistant turn after the last
//             user query gets "<think>\n{reasoning}\n</think>\n\n" (empty reasoning included for the
//             final turn); reasoning from "reasoning_content" or a "<think>...</think>" prefix.
//   kQwen3_5  Qwen3.5 (and kQwen3_5NoThink, its small models' copy, which differs only in the
//             generation prompt): ChatML with every content (system, user, assistant, tool) trimmed
//             (Python's str.strip()); an assistant turn after the last user query always gets
//             "<think>\n{reasoning|trim}\n</think>\n\n" (empty reasoning included), earlier ones lose
//             their reasoning; reasoning from "reasoning_content" (a string) or a "<think>...</think>"
//             prefix. A system message after the first, or no user query at all (only
//             "<tool_response>...</tool_response>" users), is INVALID_ARGUMENT, as the template raises.
//             Generation prompt: "<|im_start|>assistant\n<think>\n" (kQwen3_5NoThink: an empty
//             think block after it), enable_thinking left undefined.
//   kQwen2_5  Qwen2.5 Instruct: ChatML; without a leading system message the template's default
//             one, "You are Qwen, created by Alibaba Cloud. You are a helpful assistant.".
//   kLlama3   Llama 3 Instruct: bos + "<|start_header_id|>{role}<|end_header_id|>\n\n{content|trim}<|eot_id|>".
//   kLlama3_1 Llama 3.1 / 3.3 Instruct and kLlama3_2 Llama 3.2 Instruct: as kLlama3, after a system
//             header that always holds "Cutting Knowledge Date: December 2023\nToday Date: {date}\n\n"
//             and the (trimmed) system message; tool messages become "ipython" turns whose content
//             is JSON-quoted (the template's `tojson`, since a string "is iterable").
//   kGemma3   Gemma 3 (google/gemma-3-*-it): bos + "<start_of_turn>{user|model}\n{content|trim}<end_of_turn>\n";
//             the system message (untrimmed) + "\n\n" opens the first user turn; roles must
//             alternate user/model after it (else INVALID_ARGUMENT quoting the template); a list
//             content renders each text part trimmed (the template's own loop). Generation prompt
//             "<start_of_turn>model\n".
//   kGptOss   GPT-OSS (openai/gpt-oss-*, harmony): "<|start|>system<|message|>" with the model
//             identity, "Knowledge cutoff: 2024-06", "Current date: {date}" (strftime_now in the
//             template; ChatFormat::date_string here, default kGptOssDefaultDate), "Reasoning:
//             medium" and the channel line; a first system or developer message becomes the
//             developer message ("# Instructions\n\n{content}\n\n"); assistant turns render
//             "<|start|>assistant<|channel|>final<|message|>{content}<|end|>", the last one (without
//             a generation prompt) with <|return|> and, when it has "thinking", after
//             "<|start|>assistant<|channel|>analysis<|message|>{thinking}<|end|>"; earlier turns'
//             thinking is dropped, as harmony prescribes. Generation prompt "<|start|>assistant".
//   kMistralV1         Mistral 7B Instruct v0.1 / v0.2, Mixtral 8x7B Instruct (the 2024 template):
//                      bos + " [INST] {system\n\n}{user} [/INST]" + " {assistant}" + eos.
//   kMistralV3         Mistral 7B Instruct v0.3, Mixtral 8x22B Instruct: bos + "[INST] {user}[/INST]"
//                      + " {assistant|trim}" + eos; the system message goes into the last message
//                      when that is a user message.
//   kMistralV3Tekken   Mistral Nemo Instruct 2407: as kMistralV3 without the spaces and the trim.
//   kMistralV7         Mistral Large Instruct 2411: bos, then per message "[SYSTEM_PROMPT] {system}
//                      [/SYSTEM_PROMPT]", "[INST] {user}[/INST]", " {assistant}" + eos.
//                      The Mistral templates have no generation prompt.
//   kChatML   plain ChatML (no default system prompt, no think handling), only when asked for.
// Where a template would silently drop part of a conversation, prepare refuses it (INVALID_ARGUMENT
// naming the field and saying the template drops it): GPT-OSS's system/developer messages after the
// first, Mistral v3's system message when the conversation ends with an answer, Gemma 3's system
// parts after the first, and reasoning ("reasoning_content", "thinking") that a template does not
// render (GPT-OSS reads "thinking" only).
// Tool messages (role "tool") render as each template does (refused for GPT-OSS and Mistral v3,
// whose templates need a preceding tool call); tool definitions and assistant tool_calls are
// refused with a message naming the field.
//
// Content is a string, or OpenAI's list of parts ([{"type": "text", "text": ...}, ...]) whose text
// parts are joined with nothing between them (what the multimodal HF templates, Qwen2-VL's and
// Llama 3.2 Vision's, render; the text-only templates above fail on a list in Jinja or print its
// repr), so a list renders as the string it joins to, except for Gemma 3, whose template renders
// lists itself (above); any other part (image_url, input_audio, ...) is refused naming it:
// prepare trains text only.
//
// Trained spans (LossOn::kAssistant): each assistant turn's content as rendered (after its
// "<|im_start|>assistant\n", "<|start_header_id|>assistant<|end_header_id|>\n\n" or
// "<start_of_turn>model\n" header) through its end-of-turn token (<|im_end|>, <|eot_id|>,
// <end_of_turn>); the "\n" after it is not trained. Mistral: the reply as rendered after "[/INST]"
// (its leading space included, which starts its first token) through eos. GPT-OSS: everything the
// model writes after "<|start|>assistant": "<|channel|>final<|message|>{content}<|end|>" (or
// <|return|>), and for the last turn its analysis message before that (the model writes it first).
// LossOn::kAll trains everything.
#pragma once

#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "nlohmann/json.hpp"

namespace slidedp::prepare {

enum class ChatTemplate {
  kAuto,
  kQwen3,
  kQwen3_5,
  kQwen3_5NoThink,
  kQwen2_5,
  kLlama3,
  kLlama3_1,
  kLlama3_2,
  kGemma3,
  kGptOss,
  kMistralV1,
  kMistralV3,
  kMistralV3Tekken,
  kMistralV7,
  kChatML,
};
enum class LossOn { kAssistant, kAll };          // chat: assistant turns; prompt/completion: completion only
enum class GenerationPrompt { kNone, kAppend };  // HF's add_generation_prompt (never for training data)

// "qwen3", "qwen3.5", "qwen3.5-nothink", "qwen2.5", "llama3", "llama3.1", "llama3.2", "gemma3",
// "gpt-oss", "mistral-v1", "mistral-v3", "mistral-v3-tekken", "mistral-v7", "chatml", "auto".
const char* ChatTemplateName(ChatTemplate t);
// The inverse, for flags; "llama3.3" is accepted for kLlama3_1 (the same template) and
// "mistral-nemo" for kMistralV3Tekken.
absl::StatusOr<ChatTemplate> ParseChatTemplateName(std::string_view name);

// The date Llama 3.1's template renders when apply_chat_template gets no date_string (Llama 3.2's
// asks strftime_now for today's date first; prepare uses this one for both unless told otherwise).
inline constexpr char kLlamaDefaultDate[] = "26 Jul 2024";
// The "Current date" GPT-OSS's template renders from strftime_now("%Y-%m-%d"), today's date in HF;
// prepare renders this fixed one (gpt-oss's release date) unless told otherwise, so that a dataset
// does not depend on the day it was prepared.
inline constexpr char kGptOssDefaultDate[] = "2025-08-05";

// A resolved template and the values it renders with.
struct ChatFormat {
  ChatTemplate tmpl = ChatTemplate::kAuto;
  std::string bos_token;    // Llama 3.x, Gemma 3, Mistral: tokenizer_config.json's bos_token, rendered first
  std::string date_string;  // Llama 3.1 / 3.2: the "Today Date: " value; GPT-OSS: "Current date: "
  std::string eos_token;    // Mistral: tokenizer_config.json's eos_token, which ends each answer
};

// One piece of rendered text. Consecutive segments are concatenated.
struct Segment {
  std::string text;
  bool trained = false;
};

// One message of a conversation, checked (ParseChatMessages) or built by an input format
// (input_formats.h: ShareGPT turns, Alpaca fields, TRL prompt/completion).
struct ChatMessage {
  std::string where;  // the input field it came from, for errors: "messages[2]", "conversations[0]"
  std::string role;   // system, user, assistant, tool (ipython for Llama 3.1 / 3.2, developer for GPT-OSS)
  std::string content;  // a list of text parts joined
  // The text parts when "content" was a list (Gemma 3's template renders each part on its own).
  std::optional<std::vector<std::string>> text_parts;
  std::string reasoning;  // reasoning_content (Qwen3, Qwen3.5); thinking (GPT-OSS)
  bool has_reasoning = false;
  // An assistant turn's reply is trained under LossOn::kAssistant only when this is set: the
  // assistant turns of a TRL prompt (few-shot examples) are context.
  bool trained = true;
};

// tokenizer_config.json's `key` (eos_token, bos_token): a string, or an AddedToken object whose
// "content" is the string. Empty when absent or null; INVALID_ARGUMENT naming the key when it has
// another type (a token silently dropped would train without end-of-sequence tokens).
absl::StatusOr<std::string> SpecialTokenText(const nlohmann::json& tokenizer_config, const char* key);

// The template text of tokenizer_config.json's "chat_template": a string, or a list of
// {name, template} of which "default" is HF's choice. Empty when there is none. INVALID_ARGUMENT
// naming the key for anything else (a name or template that is not a string included).
absl::StatusOr<std::string> ChatTemplateText(const nlohmann::json& tokenizer_config);

// Picks the template. kAuto: the model's template must be one of the known texts
// (IdentifyChatTemplate), else UNIMPLEMENTED naming the closest one and the first difference.
// Another name: the model's template, when it is a known one, must be that one (INVALID_ARGUMENT
// otherwise); a model with no template or an unknown one renders with the named template, which is
// then the user's decision. kChatML is honoured on any template that uses <|im_start|>.
// `date_string` applies to Llama 3.1 / 3.2 (empty: kLlamaDefaultDate; any string, as HF's
// date_string=) and GPT-OSS (empty: kGptOssDefaultDate; YYYY-MM-DD, what strftime_now("%Y-%m-%d")
// gives), INVALID_ARGUMENT for the others. Gemma 3 and Mistral need a bos_token, Mistral an
// eos_token (FAILED_PRECONDITION without).
absl::StatusOr<ChatFormat> ResolveChatFormat(const nlohmann::json& tokenizer_config, ChatTemplate requested,
                                             const std::string& date_string);

// `messages` is the JSON array; errors are INVALID_ARGUMENT naming the field (messages[2].role).
absl::StatusOr<std::vector<Segment>> RenderChat(const nlohmann::json& messages, const ChatFormat& format,
                                                LossOn loss_on,
                                                GenerationPrompt generation_prompt = GenerationPrompt::kNone);

// The checks of RenderChat, on a JSON array of messages found at `field` ("messages", "prompt").
// Roles: system, user, assistant, tool (and ipython for the Llama 3.1 / 3.2 templates, developer
// for GPT-OSS); content a string or a list of text parts (joined); no tool_calls; reasoning as the
// template reads it (reasoning_content, or GPT-OSS's thinking), refused where it would be dropped.
absl::StatusOr<std::vector<ChatMessage>> ParseChatMessages(const nlohmann::json& messages, ChatTemplate tmpl,
                                                           absl::string_view field = "messages");

// The text of a message's "content" at `where` ("messages[1].content"): a string, or a list of
// parts whose "text" parts are joined; INVALID_ARGUMENT naming the part for any other type.
absl::StatusOr<std::string> ContentText(const nlohmann::json& content, const std::string& where);

// Renders checked messages. Under LossOn::kAssistant, a conversation without a trained assistant
// turn is INVALID_ARGUMENT naming `field` (nothing would train).
absl::StatusOr<std::vector<Segment>> RenderChatMessages(const std::vector<ChatMessage>& messages,
                                                        const ChatFormat& format, LossOn loss_on,
                                                        GenerationPrompt generation_prompt, absl::string_view field);

// Python's str.strip() with no argument (Jinja's `trim` in transformers): Unicode whitespace as
// str.isspace() defines it, on valid UTF-8. Exposed for tests.
std::string PythonStrip(std::string_view s);
// Python's json.dumps(s, ensure_ascii=False) of a string (transformers' `tojson`). Exposed for tests.
std::string PythonJsonString(std::string_view s);

}  // namespace slidedp::prepare
