// Known chat templates (verbatim; known_chat_templates_test checks them against the committed
// tokenizer_config.json files) and the source comparison that recognises them.
#include "client/prepare/known_chat_templates.h"
#include "client/prepare/known_chat_template_texts.h"

#include <algorithm>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "glog/logging.h"

namespace slidedp::prepare {
namespace {

using namespace template_texts;

bool IsAsciiSpace(char c) { return c == ' ' || c == '\t' || c == '\n' || c == '\r' || c == '\f' || c == '\v'; }

// Collapses whitespace runs outside string literals to one space and trims the ends. Jinja's
// expression lexer ignores whitespace between tokens, so this never merges two tokens into one.
std::string NormaliseTagBody(std::string_view body) {
  std::string out;
  bool pending_space = false;
  for (size_t i = 0; i < body.size(); ++i) {
    const char c = body[i];
    if (c == '\'' || c == '"') {
      if (pending_space && !out.empty()) out += ' ';
      pending_space = false;
      size_t j = i + 1;
      while (j < body.size() && body[j] != c) j += body[j] == '\\' ? 2 : 1;
      const size_t end = std::min(j + 1, body.size());
      out.append(body.substr(i, end - i));
      i = end - 1;
    } else if (IsAsciiSpace(c)) {
      pending_space = true;
    } else {
      if (pending_space && !out.empty()) out += ' ';
      pending_space = false;
      out += c;
    }
  }
  return out;
}

// The end of the tag that opens at `open` ("{{" or "{%"): the index of its closing "}}" / "%}",
// skipping string literals; npos when it is not closed.
size_t TagEnd(std::string_view s, size_t open, char close_first) {
  for (size_t i = open + 2; i + 1 < s.size(); ++i) {
    const char c = s[i];
    if (c == '\'' || c == '"') {
      size_t j = i + 1;
      while (j < s.size() && s[j] != c) j += s[j] == '\\' ? 2 : 1;
      if (j >= s.size()) return std::string_view::npos;
      i = j;
    } else if (c == close_first && s[i + 1] == '}') {
      return i;
    }
  }
  return std::string_view::npos;
}

struct KnownPieces {
  const KnownChatTemplate* known;
  std::vector<TemplatePiece> pieces;
};

const std::vector<KnownPieces>& KnownTemplatePieces() {
  static const std::vector<KnownPieces>* all = [] {
    auto* v = new std::vector<KnownPieces>;
    for (const KnownChatTemplate& k : KnownChatTemplates()) {
      auto pieces = TemplatePieces(k.text);
      CHECK(pieces.ok()) << "known chat template " << k.model << ": " << pieces.status();
      v->push_back({&k, std::move(*pieces)});
    }
    return v;
  }();
  return *all;
}

// Index of the first piece where a and b differ (a.size() or b.size() when one is a prefix).
size_t FirstDifference(const std::vector<TemplatePiece>& a, const std::vector<TemplatePiece>& b) {
  size_t i = 0;
  while (i < a.size() && i < b.size() && a[i].tag == b[i].tag && a[i].text == b[i].text) ++i;
  return i;
}

std::string Excerpt(const std::vector<TemplatePiece>& p, size_t i) {
  if (i >= p.size()) return "the end of the template";
  std::string t = p[i].text.size() > 60 ? absl::StrCat(p[i].text.substr(0, 60), "...") : p[i].text;
  std::string quoted;
  for (char c : t) {
    if (c == '\n') {
      quoted += "\\n";
    } else {
      quoted += c;
    }
  }
  return absl::StrCat("\"", quoted, "\"");
}

// Families by distinctive markers, most specific first: only used to say what a template resembles.
struct Family {
  const char* marker;
  const char* also;  // a second marker the template must hold too
  const char* name;
  std::vector<ChatTemplate> candidates;
};

const std::vector<Family>& Families() {
  static const std::vector<Family>* f = new std::vector<Family>{
      {"strftime_now", "<|start_header_id|>", "Llama 3.2 Instruct", {ChatTemplate::kLlama3_2, ChatTemplate::kLlama3_1}},
      {"Cutting Knowledge Date",
       "<|start_header_id|>",
       "Llama 3.1 / 3.3 Instruct",
       {ChatTemplate::kLlama3_1, ChatTemplate::kLlama3_2}},
      {"<|start_header_id|>", "<|eot_id|>", "Llama 3 Instruct", {ChatTemplate::kLlama3}},
      {"No user query found in messages",
       "<|im_start|>",
       "Qwen3.5",
       {ChatTemplate::kQwen3_5, ChatTemplate::kQwen3_5NoThink}},
      {"last_query_index", "<|im_start|>", "Qwen3", {ChatTemplate::kQwen3}},
      {"You are Qwen, created by Alibaba Cloud", "<|im_start|>", "Qwen2.5 Instruct", {ChatTemplate::kQwen2_5}},
      {"first_user_prefix", "<start_of_turn>", "Gemma 3", {ChatTemplate::kGemma3}},
      // Gemma 4's own turn tokens; not reproduced yet.
      {"<|turn>", "<turn|>", "Gemma 4", {ChatTemplate::kGemma3}},
      // Gemma 1 / 2 (no system message) and Gemma 3's first copy (a list-only system message).
      {"<start_of_turn>", "<end_of_turn>", "Gemma", {ChatTemplate::kGemma3}},
      {"<|channel|>", "<|start|>", "GPT-OSS (harmony)", {ChatTemplate::kGptOss}},
      {"[SYSTEM_PROMPT]",
       "[INST]",
       "Mistral v7 (Mistral Large 2411, Mistral Small 3.x)",
       {ChatTemplate::kMistralV7}},
      {"[INST]",
       "[/INST]",
       "Mistral Instruct",
       {ChatTemplate::kMistralV1, ChatTemplate::kMistralV3, ChatTemplate::kMistralV3Tekken, ChatTemplate::kMistralV7}},
  };
  return *f;
}

}  // namespace

const std::vector<KnownChatTemplate>& KnownChatTemplates() {
  static const std::vector<KnownChatTemplate>* known = new std::vector<KnownChatTemplate>{
      {ChatTemplate::kQwen3, "Qwen3", kQwen3Template},
      {ChatTemplate::kQwen3_5, "Qwen3.5 (thinking by default)", kQwen35Template},
      {ChatTemplate::kQwen3_5NoThink, "Qwen3.5 (non-thinking by default)", kQwen35NoThinkTemplate},
      {ChatTemplate::kQwen2_5, "Qwen2.5 Instruct", kQwen25Template},
      {ChatTemplate::kQwen2_5, "Qwen2.5 Instruct", kQwen25ToolBracesTemplate},
      {ChatTemplate::kLlama3, "Llama 3 Instruct", kLlama3Template},
      {ChatTemplate::kLlama3_1, "Llama 3.1 / 3.3 Instruct", kLlama31Template},
      {ChatTemplate::kLlama3_2, "Llama 3.2 Instruct", kLlama32Template},
      {ChatTemplate::kGemma3, "Gemma 3 Instruct", kGemma3Template},
      {ChatTemplate::kGptOss, "GPT-OSS", kGptOssTemplate},
      {ChatTemplate::kMistralV1, "Mistral v1 (Mistral 7B Instruct v0.1 / v0.2, Mixtral 8x7B)", kMistralV1Template},
      {ChatTemplate::kMistralV3, "Mistral v3 (Mistral 7B Instruct v0.3, Mixtral 8x22B)", kMistralV3Template},
      {ChatTemplate::kMistralV3Tekken, "Mistral v3-tekken (Mistral Nemo Instruct 2407)", kMistralV3TekkenTemplate},
      {ChatTemplate::kMistralV3Tekken, "Mistral v3-tekken (Mistral Nemo Instruct 2407, first copy)",
       kMistralV3TekkenFirstTemplate},
      {ChatTemplate::kMistralV7, "Mistral v7 (Mistral Large Instruct 2411)", kMistralV7Template},
  };
  return *known;
}

absl::StatusOr<std::vector<TemplatePiece>> TemplatePieces(std::string_view text) {
  // Jinja drops one trailing newline of the source (keep_trailing_newline=False).
  if (!text.empty() && text.back() == '\n') text.remove_suffix(1);
  std::vector<TemplatePiece> pieces;
  char prev_right = 0;  // the right modifier of the tag before the current data run
  size_t pos = 0;
  auto add_data = [&](size_t begin, size_t end, char next_left) {
    std::string_view d = text.substr(begin, end - begin);
    size_t b = 0, e = d.size();
    if (prev_right == '-') {
      while (b < e && IsAsciiSpace(d[b])) ++b;
    }
    if (next_left == '-') {
      while (e > b && IsAsciiSpace(d[e - 1])) --e;
    }
    if (e > b) pieces.push_back({std::string(d.substr(b, e - b)), begin + b, false});
  };
  while (pos < text.size()) {
    size_t open = text.find('{', pos);
    while (open != std::string_view::npos && open + 1 < text.size() && text[open + 1] != '{' && text[open + 1] != '%' &&
           text[open + 1] != '#') {
      open = text.find('{', open + 1);
    }
    if (open == std::string_view::npos || open + 1 >= text.size()) {
      add_data(pos, text.size(), 0);
      break;
    }
    const char kind = text[open + 1];
    const char left = open + 2 < text.size() && (text[open + 2] == '-' || text[open + 2] == '+') ? text[open + 2] : 0;
    add_data(pos, open, left);
    size_t close;
    if (kind == '#') {
      close = text.find("#}", open + 2);
    } else {
      close = TagEnd(text, open, kind == '{' ? '}' : '%');
    }
    if (close == std::string_view::npos) {
      return absl::InvalidArgumentError(absl::StrCat("chat template: the tag at byte ", open, " is not closed"));
    }
    const size_t body_begin = open + 2 + (left ? 1 : 0);
    char right = 0;
    size_t body_end = close;
    if (close > body_begin && (text[close - 1] == '-' || text[close - 1] == '+')) {
      right = text[close - 1];
      body_end = close - 1;
    }
    std::string tag(1, '{');
    tag += kind;
    if (left) tag += left;
    if (kind != '#') {
      const std::string body = NormaliseTagBody(text.substr(body_begin, body_end - body_begin));
      absl::StrAppend(&tag, " ", body, " ");
    }
    if (right) tag += right;
    tag += kind == '{' ? '}' : kind;
    tag += '}';
    pieces.push_back({std::move(tag), open, true});
    prev_right = right;
    pos = close + 2;
  }
  return pieces;
}

absl::StatusOr<ChatTemplate> IdentifyChatTemplate(std::string_view text) {
  auto pieces = TemplatePieces(text);
  if (!pieces.ok()) return pieces.status();
  for (const KnownPieces& k : KnownTemplatePieces()) {
    if (FirstDifference(*pieces, k.pieces) == std::max(pieces->size(), k.pieces.size())) return k.known->tmpl;
  }
  std::vector<std::string> names;
  for (ChatTemplate t :
       {ChatTemplate::kQwen3, ChatTemplate::kQwen3_5, ChatTemplate::kQwen3_5NoThink, ChatTemplate::kQwen2_5,
        ChatTemplate::kLlama3, ChatTemplate::kLlama3_1, ChatTemplate::kLlama3_2, ChatTemplate::kGemma3,
        ChatTemplate::kGptOss, ChatTemplate::kMistralV1, ChatTemplate::kMistralV3, ChatTemplate::kMistralV3Tekken,
        ChatTemplate::kMistralV7}) {
    names.push_back(ChatTemplateName(t));
  }
  const std::string supported = absl::StrCat("supported: ", absl::StrJoin(names, ", "),
                                             "; --chat-template NAME renders NAME's template regardless");
  for (const Family& f : Families()) {
    if (text.find(f.marker) == std::string_view::npos || text.find(f.also) == std::string_view::npos) continue;
    // The closest known text of the family: the one that agrees longest.
    const KnownPieces* best = nullptr;
    size_t best_diff = 0;
    for (const KnownPieces& k : KnownTemplatePieces()) {
      if (std::find(f.candidates.begin(), f.candidates.end(), k.known->tmpl) == f.candidates.end()) continue;
      const size_t d = FirstDifference(*pieces, k.pieces);
      if (best == nullptr || d > best_diff) {
        best = &k;
        best_diff = d;
      }
    }
    const size_t at = best_diff < pieces->size() ? (*pieces)[best_diff].offset : text.size();
    return absl::UnimplementedError(
        absl::StrCat("the model's chat template looks like ", f.name, "'s but is not the ", best->known->model,
                     " template prepare reproduces: at byte ", at, " it has ", Excerpt(*pieces, best_diff),
                     " where the known one has ", Excerpt(best->pieces, best_diff),
                     " (a template that is not reproduced exactly is refused; ", supported, ")"));
  }
  if (text.find("<|im_start|>") != std::string_view::npos) {
    return absl::UnimplementedError(absl::StrCat(
        "the model's chat template uses ChatML (<|im_start|>) but is none of the known ones; choose --chat-template "
        "chatml if plain ChatML is what you want (",
        supported, ")"));
  }
  return absl::UnimplementedError(absl::StrCat("the model's chat template is not supported (", supported,
                                               "); or use prompt/completion or text data"));
}

}  // namespace slidedp::prepare
