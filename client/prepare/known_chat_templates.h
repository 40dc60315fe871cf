// The chat templates prepare reproduces, verbatim as the models ship them, and the comparison that
// recognises one in a model's tokenizer_config.json.
//
// Two templates are the same here when they render the same for every input *because their
// source is the same* up to what Jinja never renders: whitespace that a `-` modifier strips,
// whitespace inside a tag outside string literals, comments' text, and the one trailing newline
// Jinja drops. Nothing else is normalised (not trim_blocks / lstrip_blocks, not quotes), so a
// difference found may be harmless, but two templates called equal never render differently.
#pragma once

#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"
#include "client/prepare/chat_template.h"

namespace slidedp::prepare {

struct KnownChatTemplate {
  ChatTemplate tmpl;
  const char* model;  // e.g. "Llama 3.1 / 3.3 Instruct"
  const char* text;   // the template exactly as the model's tokenizer_config.json holds it
};

// Every known text (a template may have several: Qwen2.5's copies differ in the tool prompt).
const std::vector<KnownChatTemplate>& KnownChatTemplates();

// Which known template `text` is; UNIMPLEMENTED naming the model family it resembles (by markers
// such as "<|start_header_id|>"), the closest known text and the first difference, or saying that
// no family is recognised. INVALID_ARGUMENT when a tag is not closed.
absl::StatusOr<ChatTemplate> IdentifyChatTemplate(std::string_view text);

// One piece of a template as far as its rendering goes: a data run ("text") or a tag with its
// modifiers and normalised body ("{%- if x %}"). Exposed for tests.
struct TemplatePiece {
  std::string text;
  size_t offset = 0;  // in the template source
  bool tag = false;
};
absl::StatusOr<std::vector<TemplatePiece>> TemplatePieces(std::string_view text);

}  // namespace slidedp::prepare
