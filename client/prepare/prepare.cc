// Prepare: read inputs, render (chat template / prompt+completion / text), tokenize in parallel,
// split train/validation, write the datasets with their source; or preview the first documents.
#include "client/prepare/prepare.h"

#include <sys/stat.h>

#include <atomic>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <memory>
#include <sstream>
#include <thread>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/io/json_depth.h"
#include "common/io/small_file.h"
#include "common/status/status_macros.h"
#include "common/tokenizer/identity.h"
#include "common/tokenizer/tokenizer.h"
#include "glog/logging.h"

namespace slidedp::prepare {
namespace {

namespace fs = std::filesystem;
using json = nlohmann::json;

constexpr size_t kMaxSkipExamples = 10;
// chat_template.jinja is read whole, like the tokenizer files (tok::kMaxTokenizer*Bytes).
constexpr uint64_t kMaxChatTemplateBytes = 4ull << 20;

// One unit of work: a raw input record and where it came from.
struct Record {
  int input = 0;     // index into options.inputs
  int64_t line = 0;  // 1-based; 0 for a whole .txt file
  std::string text;  // the JSON line, or the file's contents
  bool whole_file = false;
};

struct Rendered {
  absl::Status status;
  TokenizedDocument doc;
  InputFormat format = InputFormat::kAuto;  // the record's form, once known (also when it then failed)
  bool chat = false;                        // rendered through the chat template
};

// Everything a worker thread needs, read-only once loaded.
struct Context {
  const PrepareOptions* options = nullptr;
  std::unique_ptr<tok::Tokenizer> tokenizer;
  tok::TokenizerIdentity identity;
  ChatFormat chat_format;            // tmpl kAuto when the model has none usable
  absl::Status chat_template_error;  // why chat data cannot be rendered, if so
  std::string chat_template_sha256;  // of the model's template text; empty when it has none
  std::string eos_text;              // e.g. "<|im_end|>"; empty = none
  int64_t model_vocab_size = 0;      // config.json's vocab_size; 0 when absent
};

enum class ReadMore { kYes, kNo };

}  // namespace

TokenizedDocument TokenizeSegments(const tok::Tokenizer& tokenizer, const std::vector<Segment>& segments) {
  std::string text;
  std::vector<std::pair<uint32_t, bool>> bounds;  // segment end offset, trained
  int64_t segment_bytes = 0;
  for (const Segment& s : segments) segment_bytes += static_cast<int64_t>(s.text.size());
  CHECK_LE(segment_bytes, kMaxDocumentBytes) << "callers refuse longer documents (uint32 byte offsets below)";
  for (const Segment& s : segments) {
    std::string piece = tok::Tokenizer::RepairUtf8(s.text);
    if (tokenizer.normalizes_nfc()) piece = tok::Tokenizer::NfcNormalize(piece);
    text += piece;
    bounds.push_back({static_cast<uint32_t>(text.size()), s.trained});
  }
  TokenizedDocument doc;
  std::vector<uint32_t> starts;
  doc.tokens = tokenizer.Encode(text, tok::SpecialTokens::kRecognize, tok::Normalized::kAlready, &starts);
  doc.loss_mask.resize(doc.tokens.size());
  size_t seg = 0;
  for (size_t i = 0; i < doc.tokens.size(); ++i) {
    while (seg + 1 < bounds.size() && starts[i] >= bounds[seg].first) ++seg;
    doc.loss_mask[i] = bounds[seg].second ? 1 : 0;
  }
  return doc;
}

namespace {

absl::StatusOr<std::string> StringField(const json& j, const char* name) {
  if (!j.contains(name)) return absl::InvalidArgumentError(absl::StrCat("field ", name, ": missing"));
  if (!j[name].is_string()) return absl::InvalidArgumentError(absl::StrCat("field ", name, ": not a string"));
  return j[name].get<std::string>();
}

Rendered RenderRecord(const Context& ctx, const Record& rec) {
  Rendered out;
  const PrepareOptions& o = *ctx.options;
  std::vector<Segment> segments;
  auto fail = [&](const absl::Status& s) {
    out.status = s;
    return out;
  };
  const bool append_eos = o.text_eos == TextEos::kAppend && !ctx.eos_text.empty();
  if (rec.whole_file) {
    out.format = InputFormat::kText;
    if (rec.text.empty()) return fail(absl::InvalidArgumentError("file is empty"));
    segments.push_back({rec.text, true});
    if (append_eos) segments.push_back({ctx.eos_text, true});
  } else {
    json j = json::parse(rec.text, nullptr, /*allow_exceptions=*/false);
    if (j.is_discarded()) return fail(absl::InvalidArgumentError("not valid JSON"));
    if (!j.is_object()) return fail(absl::InvalidArgumentError("not a JSON object"));
    InputFormat format = o.format;
    if (format == InputFormat::kAuto) {
      auto detected = DetectInputFormat(j);
      if (!detected.ok()) return fail(detected.status());
      format = *detected;
    }
    out.format = format;
    if (RendersWithChatTemplate(format)) {
      out.chat = true;
      if (!ctx.chat_template_error.ok()) return fail(ctx.chat_template_error);
      auto conversation = RecordConversation(j, format, ctx.chat_format.tmpl);
      if (!conversation.ok()) return fail(conversation.status());
      auto r = RenderChatMessages(conversation->messages, ctx.chat_format, o.loss_on, GenerationPrompt::kNone,
                                  conversation->trained_field);
      if (!r.ok()) return fail(r.status());
      segments = std::move(*r);
    } else if (format == InputFormat::kPromptCompletion) {
      // Raw concatenation, no chat template: for base models and pre-formatted prompts.
      auto prompt = StringField(j, "prompt");
      if (!prompt.ok()) return fail(prompt.status());
      auto completion = StringField(j, "completion");
      if (!completion.ok()) return fail(completion.status());
      if (completion->empty()) return fail(absl::InvalidArgumentError("field completion: empty"));
      segments.push_back({*prompt, o.loss_on == LossOn::kAll});
      segments.push_back({*completion, true});
      if (append_eos) segments.push_back({ctx.eos_text, true});
    } else {
      auto text = StringField(j, "text");
      if (!text.ok()) return fail(text.status());
      if (text->empty()) return fail(absl::InvalidArgumentError("field text: empty"));
      segments.push_back({*text, true});
      if (append_eos) segments.push_back({ctx.eos_text, true});
    }
  }
  int64_t bytes = 0;
  for (const Segment& s : segments) bytes += static_cast<int64_t>(s.text.size());
  if (bytes > kMaxDocumentBytes) {
    return fail(absl::InvalidArgumentError(
        absl::StrCat("renders to ", bytes, " bytes, more than the ", kMaxDocumentBytes, " one document may have")));
  }
  out.doc = TokenizeSegments(*ctx.tokenizer, segments);
  if (out.doc.tokens.empty()) return fail(absl::InvalidArgumentError("renders to no tokens"));
  // Position 0 is never a target (nothing precedes it), so a document needs a trained token after it.
  bool trainable = false;
  for (size_t i = 1; i < out.doc.loss_mask.size(); ++i) trainable |= out.doc.loss_mask[i] != 0;
  if (!trainable) return fail(absl::InvalidArgumentError("no trained token after the first position"));
  return out;
}

// Seeded per-record split: validation iff hash(seed, input, line) / 2^64 < fraction.
bool IsValidation(uint64_t seed, const Record& rec, double fraction) {
  if (fraction <= 0) return false;
  uint64_t z = seed ^ (0x9E3779B97F4A7C15ull * (static_cast<uint64_t>(rec.input) + 1)) ^
               (0xC2B2AE3D27D4EB4Full * static_cast<uint64_t>(rec.line + 1));
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  z ^= z >> 31;
  return static_cast<double>(z >> 11) * 0x1.0p-53 < fraction;
}

// A JSON object file's text (tokenizer_config.json, config.json), its nesting checked before
// parsing (deep nesting overflows the stack when copied).
absl::StatusOr<json> ParseJsonObject(const std::string& text, const std::string& path) {
  RETURN_IF_ERROR(CheckJsonDepth(text, path));
  json j = json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded()) return absl::InvalidArgumentError(absl::StrCat(path, ": not valid JSON"));
  if (!j.is_object()) return absl::InvalidArgumentError(absl::StrCat(path, ": not a JSON object"));
  return j;
}

// A model directory file that may be absent: its text, or "" when there is none.
absl::StatusOr<std::string> ReadOptionalFile(const std::string& path, uint64_t max_bytes, absl::string_view what) {
  auto text = ReadSmallFile(path, max_bytes, what);
  if (text.ok()) return text;
  if (text.status().code() == absl::StatusCode::kNotFound) return std::string();
  return text.status();
}

// The model's config.json vocab_size (text_config.vocab_size for the multimodal layouts), 0 when
// there is no config.json or it says none: prepare also runs on tokenizer-only directories.
absl::StatusOr<int64_t> ModelVocabSize(const std::string& model_dir) {
  const std::string path = absl::StrCat(model_dir, "/config.json");
  ASSIGN_OR_RETURN(const std::string text, ReadOptionalFile(path, kMaxConfigFileBytes, "config.json"));
  if (text.empty()) return 0;
  ASSIGN_OR_RETURN(const json config, ParseJsonObject(text, path));
  const json* holder = &config;
  if (!config.contains("vocab_size") && config.contains("text_config") && config["text_config"].is_object()) {
    holder = &config["text_config"];
  }
  if (!holder->contains("vocab_size") || (*holder)["vocab_size"].is_null()) return 0;
  const json& v = (*holder)["vocab_size"];
  if (!v.is_number_integer() || v.get<int64_t>() < 1 || v.get<int64_t>() > (int64_t{1} << 32)) {
    return absl::InvalidArgumentError(
        absl::StrCat(path, ": vocab_size ", v.dump().substr(0, 40), " is not an integer in [1, 2^32]"));
  }
  return v.get<int64_t>();
}

// Tokenizer, its identity, the special tokens and the chat template of o.model_dir.
absl::StatusOr<std::unique_ptr<Context>> LoadContext(const PrepareOptions& o) {
  auto ctx = std::make_unique<Context>();
  ctx->options = &o;
  const std::string tokenizer_path = absl::StrCat(o.model_dir, "/tokenizer.json");
  ASSIGN_OR_RETURN(const std::string tokenizer_text,
                   ReadSmallFile(tokenizer_path, tok::kMaxTokenizerJsonBytes, "tokenizer.json"));
  {
    auto t = tok::Tokenizer::FromJson(tokenizer_text);
    if (!t.ok()) return Annotate(t.status(), tokenizer_path);
    ctx->tokenizer = std::move(*t);
  }
  const std::string config_path = absl::StrCat(o.model_dir, "/tokenizer_config.json");
  ASSIGN_OR_RETURN(const std::string config_text,
                   ReadOptionalFile(config_path, tok::kMaxTokenizerConfigBytes, "tokenizer_config.json"));
  json config = json::object();
  if (!config_text.empty()) {
    ASSIGN_OR_RETURN(config, ParseJsonObject(config_text, config_path));
  }
  {
    // Both are checked here, whether or not the data needs them: a wrongly typed one is a broken
    // config, not a model without the token.
    auto eos = SpecialTokenText(config, "eos_token");
    if (!eos.ok()) return Annotate(eos.status(), absl::StrCat("prepare: ", o.model_dir));
    ctx->eos_text = *eos;
    auto bos = SpecialTokenText(config, "bos_token");
    if (!bos.ok()) return Annotate(bos.status(), absl::StrCat("prepare: ", o.model_dir));
  }
  if (!ctx->eos_text.empty() && !ctx->tokenizer->TokenId(ctx->eos_text).ok()) {
    return absl::InvalidArgumentError(
        absl::StrCat("tokenizer_config.json eos_token \"", ctx->eos_text, "\" is not a token of tokenizer.json"));
  }
  {
    auto identity = tok::IdentifyTokenizerJson(tokenizer_text, config_text);
    if (!identity.ok()) return Annotate(identity.status(), o.model_dir);
    ctx->identity = std::move(*identity);
  }
  ASSIGN_OR_RETURN(ctx->model_vocab_size, ModelVocabSize(o.model_dir));
  {
    // transformers loads chat_template.jinja over tokenizer_config.json's chat_template.
    const std::string jinja_path = absl::StrCat(o.model_dir, "/chat_template.jinja");
    auto jinja = ReadSmallFile(jinja_path, kMaxChatTemplateBytes, "chat template");
    if (jinja.ok()) {
      config["chat_template"] = std::move(*jinja);
    } else if (jinja.status().code() != absl::StatusCode::kNotFound) {
      return jinja.status();
    }
  }
  if (auto text = ChatTemplateText(config); text.ok() && !text->empty()) {
    ctx->chat_template_sha256 = tok::Sha256Hex(*text);
  }
  auto resolved = ResolveChatFormat(config, o.chat_template, o.chat_date);
  if (resolved.ok() && !resolved->bos_token.empty() && !ctx->tokenizer->TokenId(resolved->bos_token).ok()) {
    resolved = absl::InvalidArgumentError(
        absl::StrCat("tokenizer_config.json bos_token \"", resolved->bos_token, "\" is not a token of tokenizer.json"));
  }
  if (resolved.ok()) {
    ctx->chat_format = *resolved;
  } else {
    ctx->chat_template_error = resolved.status();
  }
  return ctx;
}

absl::Status CheckOptions(const PrepareOptions& o) {
  if (o.inputs.empty()) return absl::InvalidArgumentError("prepare: no input files");
  if (o.seq_len < 2) {
    return absl::InvalidArgumentError(
        absl::StrCat("prepare: --seq-len ", o.seq_len, " is below 2 (a row needs a token and its target)"));
  }
  if (o.seq_len > kMaxSeqLen) {
    return absl::InvalidArgumentError(absl::StrCat("prepare: --seq-len ", o.seq_len, " is above ", kMaxSeqLen,
                                                   ", the longest row the trainer takes (its micro-batches "
                                                   "index tokens with int32)"));
  }
  if (o.batch_documents < 1 || o.batch_bytes < 1) {
    return absl::InvalidArgumentError(absl::StrCat("prepare: batch_documents ", o.batch_documents, " and batch_bytes ",
                                                   o.batch_bytes, " must be positive"));
  }
  if (!(o.validation_fraction >= 0 && o.validation_fraction < 1)) {
    return absl::InvalidArgumentError(
        absl::StrCat("prepare: validation fraction ", o.validation_fraction, " is not in [0, 1)"));
  }
  return absl::OkStatus();
}

bool IsJsonSpace(int c) { return c == ' ' || c == '\t' || c == '\n' || c == '\r'; }

// Calls on_element(text, bytes) for each element of the JSON array that `in` holds, in order,
// with the element's text (outer whitespace trimmed) and the input bytes consumed since the last
// call (what follows the closing bracket counts with the last element). Only strings and nesting
// are tracked, so a large array costs one element of memory, not a DOM of the file; each element
// is parsed, and its errors reported, on its own. INVALID_ARGUMENT when the input is not one
// array (unterminated, or text after its closing bracket).
absl::Status ForEachJsonArrayElement(std::istream& in,
                                     const std::function<absl::Status(std::string, int64_t)>& on_element) {
  std::streambuf* buf = in.rdbuf();
  int64_t bytes = 0, reported = 0;
  auto next = [&] {
    const int c = buf->sbumpc();
    if (c != EOF) ++bytes;
    return c;
  };
  int c = next();
  while (c != EOF && IsJsonSpace(c)) c = next();
  if (c != '[') return absl::InvalidArgumentError("not a JSON array");
  std::string element;
  int64_t depth = 0, elements = 0;
  bool in_string = false, escaped = false, closed = false;
  while (!closed && (c = next()) != EOF) {
    if (in_string) {
      element.push_back(static_cast<char>(c));
      if (escaped) {
        escaped = false;
      } else if (c == '\\') {
        escaped = true;
      } else if (c == '"') {
        in_string = false;
      }
      continue;
    }
    if (element.empty() && IsJsonSpace(c)) continue;  // before the element
    if (depth == 0 && (c == ',' || c == ']')) {
      closed = c == ']';
      // What follows the closing bracket is counted with the last element; it must be whitespace.
      while (closed && (c = next()) != EOF) {
        if (!IsJsonSpace(c)) {
          return absl::InvalidArgumentError("text after the JSON array's closing bracket");
        }
      }
      while (!element.empty() && IsJsonSpace(element.back())) element.pop_back();
      if (closed && element.empty() && elements == 0) break;  // []
      ++elements;
      RETURN_IF_ERROR(on_element(std::move(element), bytes - reported));
      reported = bytes;
      element.clear();
      continue;
    }
    if (c == '"') in_string = true;
    if (c == '[' || c == '{') ++depth;
    if ((c == ']' || c == '}') && depth > 0) --depth;  // an unbalanced '}' is the element's parse error
    element.push_back(static_cast<char>(c));
  }
  if (!closed) return absl::InvalidArgumentError("unterminated JSON array: the file ends inside it");
  return absl::OkStatus();
}

// Every input's records in order, handed to `add`; stops when it returns ReadMore::kNo. A .txt
// file too long to be one document goes to `skip_or_fail` without being read.
absl::Status ReadRecords(const PrepareOptions& o, PrepareProgress* progress,
                         const std::function<absl::StatusOr<ReadMore>(Record)>& add,
                         const std::function<absl::Status(const Record&, const absl::Status&)>& skip_or_fail) {
  std::error_code ec;
  for (int input = 0; input < static_cast<int>(o.inputs.size()); ++input) {
    const std::string& path = o.inputs[input];
    std::ifstream in(path, std::ios::binary);
    if (!in) return absl::NotFoundError(absl::StrCat("prepare: cannot open ", path));
    if (absl::EndsWith(path, ".txt")) {
      // One document, refused by its size before it is read when it is too long to tokenize.
      const uintmax_t size = fs::file_size(path, ec);
      if (!ec && size > static_cast<uintmax_t>(kMaxDocumentBytes)) {
        progress->bytes_done += static_cast<int64_t>(size);
        RETURN_IF_ERROR(skip_or_fail(
            {input, 0, "", true}, absl::InvalidArgumentError(absl::StrCat(
                                      size, " bytes, more than the ", kMaxDocumentBytes, " one document may have"))));
        continue;
      }
      std::stringstream ss;
      ss << in.rdbuf();
      progress->bytes_done += static_cast<int64_t>(ss.view().size());
      ASSIGN_OR_RETURN(const ReadMore more, add({input, 0, ss.str(), true}));
      if (more == ReadMore::kNo) return absl::OkStatus();
      continue;
    }
    if (!absl::EndsWith(path, ".jsonl") && !absl::EndsWith(path, ".json")) {
      return absl::InvalidArgumentError(absl::StrCat("prepare: ", path, ": unsupported input (.jsonl, .json or .txt)"));
    }
    if (absl::EndsWith(path, ".json")) {
      // A .json file may hold one JSON array of records instead of JSON lines; then "line" in
      // messages is the 1-based element number.
      const int first = (in >> std::ws).peek();
      if (first == '[') {
        progress->bytes_done += std::max<int64_t>(0, static_cast<int64_t>(in.tellg()));  // leading whitespace
        int64_t element = 0;
        absl::Status added;  // the first error of a batch flushed from inside the array
        bool stop = false;
        absl::Status s = ForEachJsonArrayElement(in, [&](std::string text, int64_t bytes) {
          progress->bytes_done += bytes;
          absl::StatusOr<ReadMore> more = add({input, ++element, std::move(text), false});
          added = more.status();
          if (added.ok() && *more == ReadMore::kNo) {
            stop = true;
            return absl::CancelledError("enough records");  // ends the array walk; not an error
          }
          return added;
        });
        RETURN_IF_ERROR(added);
        if (stop) return absl::OkStatus();
        if (!s.ok()) return absl::Status(s.code(), absl::StrCat("prepare: ", path, ": ", s.message()));
        continue;
      }
      in.clear();
      in.seekg(0);
    }
    std::string line;
    int64_t line_no = 0;
    while (std::getline(in, line)) {
      ++line_no;
      progress->bytes_done += static_cast<int64_t>(line.size()) + 1;
      if (line.find_first_not_of(" \t\r") == std::string::npos) continue;  // blank lines are not documents
      ASSIGN_OR_RETURN(const ReadMore more, add({input, line_no, std::move(line), false}));
      if (more == ReadMore::kNo) return absl::OkStatus();
      line.clear();
    }
  }
  return absl::OkStatus();
}

std::string WhereOf(const PrepareOptions& o, const Record& rec) {
  return rec.whole_file ? o.inputs[rec.input] : absl::StrCat(o.inputs[rec.input], ":", rec.line);
}

// Reads, renders and tokenizes the inputs' records in parallel batches of at most
// batch_documents records (or o.batch_bytes) and hands each document to `consume` in input
// order, until it returns ReadMore::kNo. A bad record fails, or is counted into
// summary->skipped_*; a record whose form differs from its file's first one fails (whatever
// bad_lines says). Fills summary->input_formats and summary->chat_template.
absl::Status ForEachDocument(const Context& ctx, int64_t batch_documents, PrepareSummary* summary,
                             PrepareProgress* progress,
                             const std::function<absl::StatusOr<ReadMore>(const Record&, Rendered&)>& consume) {
  const PrepareOptions& o = *ctx.options;
  const int threads = o.threads > 0 ? o.threads : static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  struct FileForm {
    InputFormat format = InputFormat::kAuto;
    int64_t line = 0;  // of the record that set it
  };
  std::vector<FileForm> forms(o.inputs.size());
  std::vector<Record> batch;
  int64_t batch_bytes = 0;  // of the records' text
  std::vector<Rendered> results;
  bool saw_chat = false, stop = false;

  // A record that cannot be a document: the error (file:line: reason), or counted and skipped.
  auto skip_or_fail = [&](const Record& rec, const absl::Status& why) -> absl::Status {
    const std::string msg = absl::StrCat(WhereOf(o, rec), ": ", why.message());
    if (o.bad_lines == BadLines::kFail) return absl::Status(why.code(), msg);
    ++summary->skipped_lines;
    if (summary->skipped_examples.size() < kMaxSkipExamples) summary->skipped_examples.push_back(msg);
    return absl::OkStatus();
  };
  auto flush = [&]() -> absl::Status {
    results.assign(batch.size(), Rendered());
    std::atomic<size_t> next{0};
    auto work = [&] {
      for (size_t i = next.fetch_add(1); i < batch.size(); i = next.fetch_add(1))
        results[i] = RenderRecord(ctx, batch[i]);
    };
    const int n = static_cast<int>(std::min<size_t>(threads, batch.size()));
    std::vector<std::thread> pool;
    for (int k = 1; k < n; ++k) pool.emplace_back(work);
    work();
    for (auto& t : pool) t.join();
    for (size_t i = 0; i < batch.size() && !stop; ++i) {
      const Record& rec = batch[i];
      Rendered& r = results[i];
      if (r.format != InputFormat::kAuto) {
        FileForm& form = forms[rec.input];
        if (form.format == InputFormat::kAuto) {
          form = {r.format, rec.line};
        } else if (form.format != r.format) {
          // Mixed forms in one file are almost always two datasets concatenated by mistake, and
          // the masking rule would change silently from line to line.
          return absl::InvalidArgumentError(absl::StrCat(
              WhereOf(o, rec), ": the record is ", InputFormatName(r.format), ", but the file's first record (line ",
              form.line, ") is ", InputFormatName(form.format),
              ": a file holds one format (split it into one file per format, or force one with --format)"));
        }
      }
      if (!r.status.ok()) {
        RETURN_IF_ERROR(skip_or_fail(rec, r.status));
        continue;
      }
      saw_chat |= r.chat;
      ASSIGN_OR_RETURN(const ReadMore more, consume(rec, r));
      stop = more == ReadMore::kNo;
    }
    batch.clear();
    results.clear();  // the batch's tokens: memory stays one batch
    batch_bytes = 0;
    if (o.progress) o.progress(*progress);
    return absl::OkStatus();
  };
  auto add = [&](Record rec) -> absl::StatusOr<ReadMore> {
    batch_bytes += static_cast<int64_t>(rec.text.size());
    batch.push_back(std::move(rec));
    if (static_cast<int64_t>(batch.size()) >= batch_documents || batch_bytes >= o.batch_bytes) {
      RETURN_IF_ERROR(flush());
    }
    return stop ? ReadMore::kNo : ReadMore::kYes;
  };
  RETURN_IF_ERROR(ReadRecords(o, progress, add, skip_or_fail));
  if (!batch.empty() && !stop) RETURN_IF_ERROR(flush());
  summary->input_formats.clear();
  for (const FileForm& f : forms) {
    summary->input_formats.push_back(f.format == InputFormat::kAuto ? "none" : InputFormatName(f.format));
  }
  if (saw_chat) summary->chat_template = ChatTemplateName(ctx.chat_format.tmpl);
  return absl::OkStatus();
}

void FillSplit(const data::Manifest& m, const std::string& dir, SplitSummary* s) {
  s->dir = dir;
  s->documents = m.num_documents;
  s->tokens = m.num_tokens;
  s->trained_tokens = m.num_trained_tokens;
  s->truncated_documents = m.truncated_documents;
  s->split_documents = m.split_documents;
  s->rows = m.num_rows;
}

json SplitJson(const SplitSummary& s) {
  return {{"dir", s.dir},
          {"documents", s.documents},
          {"tokens", s.tokens},
          {"trained_tokens", s.trained_tokens},
          {"truncated_documents", s.truncated_documents},
          {"truncated_trained_tokens", s.truncated_trained_tokens},
          {"dropped_documents", s.dropped_documents},
          {"split_documents", s.split_documents},
          {"rows", s.rows}};
}

// A validation fraction that holds about kFewValidationDocuments of `documents` out, rounded up to
// a hundredth; 0 when that would be half of them or more (too few to hold any out).
double UsefulValidationFraction(int64_t documents) {
  if (documents <= 0) return 0;
  const double f = std::ceil(100.0 * kFewValidationDocuments / static_cast<double>(documents)) / 100.0;
  return f >= 0.5 ? 0 : f;
}

std::string ValidationHint(int64_t documents) {
  const double f = UsefulValidationFraction(documents);
  if (f == 0) return absl::StrCat(documents, " documents are too few to hold some out: use --validation-fraction 0");
  return absl::StrFormat("--validation-fraction %.2f would hold about %d out, or use 0 to hold none out", f,
                         kFewValidationDocuments);
}

}  // namespace

std::string PrepareSummary::ToJson() const {
  json formats = json::array();
  for (const std::string& f : input_formats) formats.push_back(f);
  json j = {{"train", SplitJson(train)},
            {"validation", SplitJson(validation)},
            {"skipped_lines", skipped_lines},
            {"skipped_examples", skipped_examples},
            {"dropped_documents", train.dropped_documents + validation.dropped_documents},
            {"truncated_documents", train.truncated_documents + validation.truncated_documents},
            {"input_formats", formats},
            {"chat_template", chat_template},
            {"vocab_size", vocab_size},
            {"source", source.ToJson()},
            {"warnings", warnings}};
  return j.dump(2);
}

absl::StatusOr<PrepareSummary> Prepare(const PrepareOptions& o) {
  RETURN_IF_ERROR(CheckOptions(o));
  if (o.output_dir.empty()) return absl::InvalidArgumentError("prepare: no output directory");
  std::error_code ec;
  if (fs::exists(o.output_dir, ec) && !fs::is_empty(o.output_dir, ec) && o.overwrite == data::Overwrite::kNo) {
    return absl::AlreadyExistsError(absl::StrCat("prepare: output ", o.output_dir, " exists and is not empty"));
  }
  int64_t bytes_total = 0;
  for (const std::string& in : o.inputs) {
    auto size = fs::file_size(in, ec);
    if (ec) return absl::NotFoundError(absl::StrCat("prepare: input ", in, ": ", ec.message()));
    bytes_total += static_cast<int64_t>(size);
  }
  ASSIGN_OR_RETURN(std::unique_ptr<Context> ctx, LoadContext(o));
  const tok::Tokenizer& tokenizer = *ctx->tokenizer;

  // Output: overwriting removes only what prepare itself writes there, never the directory.
  fs::create_directories(o.output_dir, ec);
  if (ec) return absl::PermissionDeniedError(absl::StrCat("prepare: creating ", o.output_dir, ": ", ec.message()));
  const std::string train_dir = absl::StrCat(o.output_dir, "/train"),
                    val_dir = absl::StrCat(o.output_dir, "/validation");
  const std::string summary_path = absl::StrCat(o.output_dir, "/prepare_summary.json");
  if (o.overwrite == data::Overwrite::kYes) {
    for (const std::string& p : {train_dir, val_dir, summary_path}) fs::remove_all(p, ec);
  }
  json metadata = {{"tokenizer", absl::StrCat(o.model_dir, "/tokenizer.json")},
                   {"inputs", o.inputs},
                   {"loss_on", o.loss_on == LossOn::kAll ? "all" : "assistant"},
                   {"seed", o.seed},
                   {"validation_fraction", o.validation_fraction}};
  if (o.format != InputFormat::kAuto) metadata["format"] = InputFormatName(o.format);
  if (ctx->chat_template_error.ok()) {
    metadata["chat_template"] = ChatTemplateName(ctx->chat_format.tmpl);
    if (!ctx->chat_format.date_string.empty()) metadata["chat_date"] = ctx->chat_format.date_string;
  }
  auto make_writer = [&](const std::string& dir, const char* split) {
    data::WriterOptions wo;
    wo.vocab_size = tokenizer.vocab_size();
    wo.seq_len = o.seq_len;
    wo.packing = o.packing;
    wo.overwrite = data::Overwrite::kYes;
    wo.metadata = metadata;
    wo.metadata["split"] = split;
    return data::DatasetWriter::Create(dir, wo);
  };
  std::unique_ptr<data::DatasetWriter> train, validation;

  PrepareSummary summary;
  summary.vocab_size = tokenizer.vocab_size();
  PrepareProgress progress;
  progress.bytes_total = bytes_total;
  uint32_t max_id = 0;
  const bool padded = o.packing == data::Packing::kPadded;
  auto consume = [&](const Record& rec, Rendered& r) -> absl::StatusOr<ReadMore> {
    const bool to_validation = IsValidation(o.seed, rec, o.validation_fraction);
    SplitSummary& split = to_validation ? summary.validation : summary.train;
    const TokenizedDocument& doc = r.doc;
    const int64_t n = static_cast<int64_t>(doc.tokens.size());
    if (padded && n > o.seq_len) {
      // The writer keeps the first seq_len tokens. A document whose trained tokens all lie past
      // them would only add a row that trains nothing: dropped, and counted.
      bool trained_within = false;
      for (int64_t i = 1; i < o.seq_len && !trained_within; ++i) trained_within = doc.loss_mask[i] != 0;
      if (!trained_within) {
        ++split.dropped_documents;
        return ReadMore::kYes;
      }
      for (int64_t i = o.seq_len; i < n; ++i) split.truncated_trained_tokens += doc.loss_mask[i] != 0;
    }
    std::unique_ptr<data::DatasetWriter>& w = to_validation ? validation : train;
    if (w == nullptr) {
      ASSIGN_OR_RETURN(w, make_writer(to_validation ? val_dir : train_dir, to_validation ? "validation" : "train"));
    }
    RETURN_IF_ERROR(w->AddDocument(doc.tokens, doc.loss_mask));
    for (uint32_t id : doc.tokens) max_id = std::max(max_id, id);
    ++progress.documents;
    progress.tokens += n;
    return ReadMore::kYes;
  };
  RETURN_IF_ERROR(ForEachDocument(*ctx, o.batch_documents, &summary, &progress, consume));

  const int64_t dropped = summary.train.dropped_documents + summary.validation.dropped_documents;
  if (train == nullptr) {
    return absl::InvalidArgumentError(absl::StrCat(
        "prepare: no usable training documents in the inputs (", summary.skipped_lines, " lines skipped",
        summary.skipped_examples.empty() ? std::string() : absl::StrCat("; first: ", summary.skipped_examples[0]),
        dropped > 0 ? absl::StrCat("; ", dropped, " documents dropped: nothing trained within --seq-len ", o.seq_len)
                    : std::string(),
        ")"));
  }
  const int64_t train_documents = train->num_documents();
  const int64_t validation_documents = validation == nullptr ? 0 : validation->num_documents();
  const int64_t documents = train_documents + validation_documents;
  if (o.validation_fraction > 0 && validation_documents == 0) {
    // Nothing is written: a job told to evaluate on this split would find none. The split is a
    // seeded hash per document (stable when inputs grow), so small inputs can leave it empty.
    return absl::FailedPreconditionError(absl::StrFormat(
        "prepare: --validation-fraction %g put none of the %d documents in the validation split (%.1f expected); %s",
        o.validation_fraction, documents, o.validation_fraction * static_cast<double>(documents),
        ValidationHint(documents)));
  }
  if (o.validation_fraction > 0 && validation_documents < kFewValidationDocuments) {
    summary.warnings.push_back(absl::StrFormat(
        "the validation split holds only %d of the %d documents (--validation-fraction %g): its loss will be noise; %s",
        validation_documents, documents, o.validation_fraction, ValidationHint(documents)));
  }

  summary.source.tokenizer_fingerprint = ctx->identity.fingerprint;
  summary.source.tokenizer_vocab_size = ctx->identity.vocab_size;
  summary.source.model_vocab_size = ctx->model_vocab_size;
  summary.source.chat_template = summary.chat_template.empty() ? "none" : summary.chat_template;
  if (!summary.chat_template.empty()) summary.source.chat_template_sha256 = ctx->chat_template_sha256;
  summary.source.model = fs::absolute(o.model_dir, ec).lexically_normal().string();
  if (ec || summary.source.model.empty()) summary.source.model = o.model_dir;
  while (summary.source.model.size() > 1 && summary.source.model.back() == '/') summary.source.model.pop_back();

  train->set_source(summary.source);
  ASSIGN_OR_RETURN(data::Manifest tm, train->Finish());
  FillSplit(tm, train_dir, &summary.train);
  if (validation != nullptr) {
    validation->set_source(summary.source);
    ASSIGN_OR_RETURN(data::Manifest vm, validation->Finish());
    FillSplit(vm, val_dir, &summary.validation);
  }

  const int64_t truncated = summary.train.truncated_documents + summary.validation.truncated_documents;
  if (truncated > 0 || dropped > 0) {
    summary.warnings.push_back(
        absl::StrCat(truncated, " documents longer than --seq-len ", o.seq_len, " were truncated (--packing padded): ",
                     summary.train.truncated_trained_tokens + summary.validation.truncated_trained_tokens,
                     " trained tokens past it are not trained",
                     dropped > 0 ? absl::StrCat("; ", dropped, " more had no trained token within it and were dropped")
                                 : std::string(),
                     ". Raise --seq-len, or use --packing packed (a long document continues in the next row)"));
  }
  if (ctx->model_vocab_size > 0 && int64_t{max_id} >= ctx->model_vocab_size) {
    summary.warnings.push_back(
        absl::StrCat("token id ", max_id, " is not below the model's config.json vocab_size ", ctx->model_vocab_size,
                     ": a job on this model will refuse the dataset (is --model the model you will train?)"));
  }
  std::ofstream(summary_path) << summary.ToJson() << "\n";
  LOG(INFO) << "prepare: " << summary.train.documents << " train documents, " << summary.train.tokens << " tokens, "
            << summary.train.rows << " rows; " << summary.validation.documents << " validation documents; "
            << summary.skipped_lines << " lines skipped";
  return summary;
}

absl::StatusOr<std::vector<DocumentPreview>> PreviewDocuments(const PrepareOptions& o, int64_t count) {
  RETURN_IF_ERROR(CheckOptions(o));
  if (count < 1) return absl::InvalidArgumentError(absl::StrCat("prepare: --show ", count, " is not positive"));
  ASSIGN_OR_RETURN(std::unique_ptr<Context> ctx, LoadContext(o));
  std::vector<DocumentPreview> out;
  PrepareSummary summary;
  PrepareProgress progress;
  auto consume = [&](const Record& rec, Rendered& r) -> absl::StatusOr<ReadMore> {
    DocumentPreview p;
    p.where = WhereOf(o, rec);
    p.format = r.format;
    if (r.chat) p.chat_template = ChatTemplateName(ctx->chat_format.tmpl);
    p.tokens = static_cast<int64_t>(r.doc.tokens.size());
    p.seq_len = o.seq_len;
    for (size_t i = 0; i < r.doc.tokens.size(); ++i) {
      const bool trained = i > 0 && r.doc.loss_mask[i] != 0;  // the first token is no target
      p.trained_tokens += trained;
      if (p.spans.empty() || p.spans.back().trained != trained) p.spans.push_back({"", trained});
      p.spans.back().text += ctx->tokenizer->TokenBytes(r.doc.tokens[i]);
    }
    // A run may end inside a character that byte-level BPE split over two tokens.
    for (Segment& s : p.spans) s.text = tok::Tokenizer::RepairUtf8(s.text);
    out.push_back(std::move(p));
    return static_cast<int64_t>(out.size()) >= count ? ReadMore::kNo : ReadMore::kYes;
  };
  RETURN_IF_ERROR(ForEachDocument(*ctx, std::min(count, o.batch_documents), &summary, &progress, consume));
  return out;
}

std::string FormatPreview(const DocumentPreview& p, int64_t number, SpanMarks marks) {
  std::string out =
      absl::StrCat("--- ", number, ": ", p.where, " (", InputFormatName(p.format),
                   p.chat_template.empty() ? std::string() : absl::StrCat(", ", p.chat_template, " template"),
                   "): ", p.tokens, " tokens, ", p.trained_tokens, " trained");
  if (p.seq_len > 0 && p.tokens > p.seq_len) absl::StrAppend(&out, "; longer than --seq-len ", p.seq_len);
  absl::StrAppend(&out, " ---\n");
  for (const Segment& s : p.spans) {
    if (!s.trained) {
      out += s.text;
    } else if (marks == SpanMarks::kBrackets) {
      absl::StrAppend(&out, "[[", s.text, "]]");
    } else {
      absl::StrAppend(&out, "\033[1;32m", s.text, "\033[0m");
    }
  }
  if (out.back() != '\n') out += '\n';
  return out;
}

}  // namespace slidedp::prepare
