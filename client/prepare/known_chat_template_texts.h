// The chat templates known_chat_templates.cc recognises, verbatim as the models'
// tokenizer_config.json files hold them (the texts are data: known_chat_templates_test checks them
// against the committed files).
#pragma once

namespace slidedp::prepare::template_texts {

extern const char kQwen3Template[];
extern const char kQwen35Template[];
extern const char kQwen35NoThinkTemplate[];
extern const char kQwen25Template[];
extern const char kQwen25ToolBracesTemplate[];
extern const char kLlama3Template[];
extern const char kLlama31Template[];
extern const char kLlama32Template[];
extern const char kGemma3Template[];
extern const char kGptOssTemplate[];
extern const char kMistralV1Template[];
extern const char kMistralV3Template[];
extern const char kMistralV3TekkenTemplate[];
extern const char kMistralV3TekkenFirstTemplate[];
extern const char kMistralV7Template[];

}  // namespace slidedp::prepare::template_texts
