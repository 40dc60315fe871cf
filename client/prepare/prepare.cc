// Prepare: read inputs, render (chat template / prompt+completion / text), tokenize in parallel,
// split train/validation, write the datasets.
#include "client/prepare/prepare.h"

#include <sys/stat.h>

#include <atomic>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <memory>
#include <sstream>
#include <thread>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "common/io/json_depth.h"
#include "common/io/small_file.h"
#include "common/status/status_macros.h"
#include "common/tokenizer/tokenizer.h"
#include "glog/logging.h"

namespace slidedp::prepare {
namespace {

namespace fs = std::filesystem;
using json = nlohmann::json;

constexpr size_t kMaxSkipExamples = 10;
// Caps on the model directory's files, read whole: a path may name a FIFO or /dev/zero, or a file
// far larger than its kind. tokenizer.json runs to tens of MB for 200k-token vocabularies.
constexpr uint64_t kMaxTokenizerJsonBytes = 256ull << 20;
constexpr uint64_t kMaxTokenizerConfigBytes = 4ull << 20;
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
  bool saw_chat = false;
};

// Everything a worker thread needs, read-only.
struct Context {
  const PrepareOptions* options = nullptr;
  const tok::Tokenizer* tokenizer = nullptr;
  ChatFormat chat_format;            // tmpl kAuto when the model has none usable
  absl::Status chat_template_error;  // why chat data cannot be rendered, if so
  std::string eos_text;              // e.g. "<|im_end|>"; empty = none
};

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
  if (rec.whole_file) {
    if (rec.text.empty()) return fail(absl::InvalidArgumentError("file is empty"));
    segments.push_back({rec.text, true});
    if (o.text_eos == TextEos::kAppend && !ctx.eos_text.empty()) segments.push_back({ctx.eos_text, true});
  } else {
    json j = json::parse(rec.text, nullptr, /*allow_exceptions=*/false);
    if (j.is_discarded()) return fail(absl::InvalidArgumentError("not valid JSON"));
    if (!j.is_object()) return fail(absl::InvalidArgumentError("not a JSON object"));
    if (j.contains("messages")) {
      out.saw_chat = true;
      if (!ctx.chat_template_error.ok()) return fail(ctx.chat_template_error);
      auto r = RenderChat(j["messages"], ctx.chat_format, o.loss_on);
      if (!r.ok()) return fail(r.status());
      segments = std::move(*r);
    } else if (j.contains("prompt") || j.contains("completion")) {
      auto prompt = StringField(j, "prompt");
      if (!prompt.ok()) return fail(prompt.status());
      auto completion = StringField(j, "completion");
      if (!completion.ok()) return fail(completion.status());
      if (completion->empty()) return fail(absl::InvalidArgumentError("field completion: empty"));
      segments.push_back({*prompt, o.loss_on == LossOn::kAll});
      segments.push_back({*completion, true});
      if (o.text_eos == TextEos::kAppend && !ctx.eos_text.empty()) segments.push_back({ctx.eos_text, true});
    } else if (j.contains("text")) {
      auto text = StringField(j, "text");
      if (!text.ok()) return fail(text.status());
      if (text->empty()) return fail(absl::InvalidArgumentError("field text: empty"));
      segments.push_back({*text, true});
      if (o.text_eos == TextEos::kAppend && !ctx.eos_text.empty()) segments.push_back({ctx.eos_text, true});
    } else {
      return fail(absl::InvalidArgumentError("has none of the fields messages, prompt+completion, text"));
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
  bool any_trained = false;
  for (uint8_t m : out.doc.loss_mask) any_trained |= m != 0;
  // Position 0 is never a target (nothing precedes it), so a document needs a trained token after it.
  bool trainable = false;
  for (size_t i = 1; i < out.doc.loss_mask.size(); ++i) trainable |= out.doc.loss_mask[i] != 0;
  if (!any_trained || !trainable) return fail(absl::InvalidArgumentError("no trained token after the first position"));
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

// A JSON object file of the model directory (tokenizer_config.json): read bounded and
// non-blocking, its nesting checked before parsing (deep nesting overflows the stack when copied).
absl::StatusOr<json> ReadJsonObjectFile(const std::string& path, uint64_t max_bytes, absl::string_view what) {
  ASSIGN_OR_RETURN(std::string text, ReadSmallFile(path, max_bytes, what));
  RETURN_IF_ERROR(CheckJsonDepth(text, path));
  json j = json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded()) return absl::InvalidArgumentError(absl::StrCat(path, ": not valid JSON"));
  if (!j.is_object()) return absl::InvalidArgumentError(absl::StrCat(path, ": not a JSON object"));
  return j;
}

// tokenizer.json, read bounded and non-blocking (Tokenizer::FromFile reads whatever the path is).
absl::StatusOr<std::unique_ptr<tok::Tokenizer>> LoadTokenizer(const std::string& path) {
  ASSIGN_OR_RETURN(std::string text, ReadSmallFile(path, kMaxTokenizerJsonBytes, "tokenizer.json"));
  auto t = tok::Tokenizer::FromJson(text);
  if (!t.ok()) return Annotate(t.status(), path);
  return t;
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
          {"split_documents", s.split_documents},
          {"rows", s.rows}};
}

}  // namespace

std::string PrepareSummary::ToJson() const {
  json j = {{"train", SplitJson(train)},      {"validation", SplitJson(validation)},
            {"skipped_lines", skipped_lines}, {"skipped_examples", skipped_examples},
            {"chat_template", chat_template}, {"vocab_size", vocab_size}};
  return j.dump(2);
}

absl::StatusOr<PrepareSummary> Prepare(const PrepareOptions& o) {
  if (o.inputs.empty()) return absl::InvalidArgumentError("prepare: no input files");
  if (o.output_dir.empty()) return absl::InvalidArgumentError("prepare: no output directory");
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

  // Tokenizer and config.
  ASSIGN_OR_RETURN(std::unique_ptr<tok::Tokenizer> tokenizer,
                   LoadTokenizer(absl::StrCat(o.model_dir, "/tokenizer.json")));
  const std::string config_path = absl::StrCat(o.model_dir, "/tokenizer_config.json");
  json config = json::object();
  {
    auto c = ReadJsonObjectFile(config_path, kMaxTokenizerConfigBytes, "tokenizer_config.json");
    if (c.ok()) {
      config = std::move(*c);
    } else if (c.status().code() != absl::StatusCode::kNotFound) {
      return c.status();
    }
  }
  Context ctx;
  ctx.options = &o;
  ctx.tokenizer = tokenizer.get();
  {
    // Both are checked here, whether or not the data needs them: a wrongly typed one is a broken
    // config, not a model without the token.
    auto eos = SpecialTokenText(config, "eos_token");
    if (!eos.ok()) return Annotate(eos.status(), absl::StrCat("prepare: ", o.model_dir));
    ctx.eos_text = *eos;
    auto bos = SpecialTokenText(config, "bos_token");
    if (!bos.ok()) return Annotate(bos.status(), absl::StrCat("prepare: ", o.model_dir));
  }
  if (!ctx.eos_text.empty() && !tokenizer->TokenId(ctx.eos_text).ok()) {
    return absl::InvalidArgumentError(
        absl::StrCat("tokenizer_config.json eos_token \"", ctx.eos_text, "\" is not a token of tokenizer.json"));
  }
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
  auto resolved = ResolveChatFormat(config, o.chat_template, o.chat_date);
  if (resolved.ok() && !resolved->bos_token.empty() && !tokenizer->TokenId(resolved->bos_token).ok()) {
    resolved = absl::InvalidArgumentError(
        absl::StrCat("tokenizer_config.json bos_token \"", resolved->bos_token, "\" is not a token of tokenizer.json"));
  }
  if (resolved.ok()) {
    ctx.chat_format = *resolved;
  } else {
    ctx.chat_template_error = resolved.status();
  }

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
  if (ctx.chat_template_error.ok()) {
    metadata["chat_template"] = ChatTemplateName(ctx.chat_format.tmpl);
    if (!ctx.chat_format.date_string.empty()) metadata["chat_date"] = ctx.chat_format.date_string;
  }
  auto make_writer = [&](const std::string& dir, const char* split) {
    data::WriterOptions wo;
    wo.vocab_size = tokenizer->vocab_size();
    wo.seq_len = o.seq_len;
    wo.packing = o.packing;
    wo.overwrite = data::Overwrite::kYes;
    wo.metadata = metadata;
    wo.metadata["split"] = split;
    return data::DatasetWriter::Create(dir, wo);
  };
  std::unique_ptr<data::DatasetWriter> train, validation;

  PrepareSummary summary;
  summary.vocab_size = tokenizer->vocab_size();
  PrepareProgress progress;
  progress.bytes_total = bytes_total;
  bool saw_chat = false;
  const int threads = o.threads > 0 ? o.threads : static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));

  std::vector<Record> batch;
  int64_t batch_bytes = 0;  // of the records' text
  std::vector<Rendered> results;
  // A record that cannot be a document: the error (file:line: reason), or counted and skipped.
  auto skip_or_fail = [&](const Record& rec, const absl::Status& why) -> absl::Status {
    const std::string where = rec.whole_file ? o.inputs[rec.input] : absl::StrCat(o.inputs[rec.input], ":", rec.line);
    const std::string msg = absl::StrCat(where, ": ", why.message());
    if (o.bad_lines == BadLines::kFail) return absl::Status(why.code(), msg);
    ++summary.skipped_lines;
    if (summary.skipped_examples.size() < kMaxSkipExamples) summary.skipped_examples.push_back(msg);
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
    for (size_t i = 0; i < batch.size(); ++i) {
      const Record& rec = batch[i];
      Rendered& r = results[i];
      saw_chat |= r.saw_chat;
      if (!r.status.ok()) {
        RETURN_IF_ERROR(skip_or_fail(rec, r.status));
        continue;
      }
      std::unique_ptr<data::DatasetWriter>* w = &train;
      const char* split = "train";
      const std::string* dir = &train_dir;
      if (IsValidation(o.seed, rec, o.validation_fraction)) {
        w = &validation;
        split = "validation";
        dir = &val_dir;
      }
      if (*w == nullptr) {
        auto created = make_writer(*dir, split);
        if (!created.ok()) return created.status();
        *w = std::move(*created);
      }
      RETURN_IF_ERROR((*w)->AddDocument(r.doc.tokens, r.doc.loss_mask));
      ++progress.documents;
      progress.tokens += static_cast<int64_t>(r.doc.tokens.size());
    }
    batch.clear();
    results.clear();  // the batch's tokens: memory stays one batch
    batch_bytes = 0;
    if (o.progress) o.progress(progress);
    return absl::OkStatus();
  };
  auto add = [&](Record rec) -> absl::Status {
    batch_bytes += static_cast<int64_t>(rec.text.size());
    batch.push_back(std::move(rec));
    if (static_cast<int64_t>(batch.size()) >= o.batch_documents || batch_bytes >= o.batch_bytes) return flush();
    return absl::OkStatus();
  };

  for (int input = 0; input < static_cast<int>(o.inputs.size()); ++input) {
    const std::string& path = o.inputs[input];
    std::ifstream in(path, std::ios::binary);
    if (!in) return absl::NotFoundError(absl::StrCat("prepare: cannot open ", path));
    if (absl::EndsWith(path, ".txt")) {
      // One document, refused by its size before it is read when it is too long to tokenize.
      const uintmax_t size = fs::file_size(path, ec);
      if (!ec && size > static_cast<uintmax_t>(kMaxDocumentBytes)) {
        progress.bytes_done += static_cast<int64_t>(size);
        RETURN_IF_ERROR(skip_or_fail(
            {input, 0, "", true}, absl::InvalidArgumentError(absl::StrCat(
                                      size, " bytes, more than the ", kMaxDocumentBytes, " one document may have"))));
        continue;
      }
      std::stringstream ss;
      ss << in.rdbuf();
      progress.bytes_done += static_cast<int64_t>(ss.view().size());
      RETURN_IF_ERROR(add({input, 0, ss.str(), true}));
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
        progress.bytes_done += std::max<int64_t>(0, static_cast<int64_t>(in.tellg()));  // leading whitespace
        int64_t element = 0;
        absl::Status added;  // the first error of a batch flushed from inside the array
        absl::Status s = ForEachJsonArrayElement(in, [&](std::string text, int64_t bytes) {
          progress.bytes_done += bytes;
          added = add({input, ++element, std::move(text), false});
          return added;
        });
        RETURN_IF_ERROR(added);
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
      progress.bytes_done += static_cast<int64_t>(line.size()) + 1;
      if (line.find_first_not_of(" \t\r") == std::string::npos) continue;  // blank lines are not documents
      RETURN_IF_ERROR(add({input, line_no, std::move(line), false}));
      line.clear();
    }
  }
  if (!batch.empty()) RETURN_IF_ERROR(flush());
  if (saw_chat) summary.chat_template = ChatTemplateName(ctx.chat_format.tmpl);

  if (train == nullptr) {
    return absl::InvalidArgumentError(absl::StrCat(
        "prepare: no usable training documents in the inputs (", summary.skipped_lines, " lines skipped",
        summary.skipped_examples.empty() ? std::string() : absl::StrCat("; first: ", summary.skipped_examples[0]),
        ")"));
  }
  ASSIGN_OR_RETURN(data::Manifest tm, train->Finish());
  FillSplit(tm, train_dir, &summary.train);
  if (validation != nullptr) {
    ASSIGN_OR_RETURN(data::Manifest vm, validation->Finish());
    FillSplit(vm, val_dir, &summary.validation);
  }
  std::ofstream(summary_path) << summary.ToJson() << "\n";
  LOG(INFO) << "prepare: " << summary.train.documents << " train documents, " << summary.train.tokens << " tokens, "
            << summary.train.rows << " rows; " << summary.validation.documents << " validation documents; "
            << summary.skipped_lines << " lines skipped";
  return summary;
}

}  // namespace slidedp::prepare
