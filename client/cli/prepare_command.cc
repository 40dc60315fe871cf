// `slidedp prepare` (prepare_command.h).
#include "client/cli/prepare_command.h"

#include <unistd.h>

#include <cstdlib>
#include <iostream>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/status/status_macros.h"

namespace slidedp::client {

namespace pp = slidedp::prepare;

CLI::App* AddPrepareCommand(CLI::App& app, PrepareCommand& c) {
  auto* cmd =
      app.add_subcommand("prepare", "tokenize JSONL/text into the training dataset format; runs here, no hostd needed");
  pp::PrepareOptions& o = c.options;
  cmd->add_option("--model", o.model_dir, "HF model dir with tokenizer.json and tokenizer_config.json")
      ->required()
      ->check(CLI::ExistingDirectory);
  cmd->add_option("--input", o.inputs,
                  "input files: .jsonl / .json (messages, sharegpt, alpaca, prompt/completion, text records) or .txt")
      ->required()
      ->check(CLI::ExistingFile);
  cmd->add_option("--output", o.output_dir, "output directory (optional with --show: then nothing is written)");
  cmd->add_option("--format", c.format,
                  "the records' form: auto (per file, from its first record) | messages | sharegpt | alpaca | "
                  "conversational_prompt_completion | prompt_completion (no chat template) | text")
      ->check(CLI::IsMember(
          {"auto", "messages", "sharegpt", "alpaca", "conversational_prompt_completion", "prompt_completion", "text"}));
  cmd->add_option("--show", c.show,
                  "print the first N documents as they will be trained (trained spans marked); without --output "
                  "only show")
      ->check(CLI::Range(int64_t{1}, int64_t{1} << 20));
  cmd->add_option("--seq-len", o.seq_len, "row length in tokens")->check(CLI::Range(int64_t{2}, pp::kMaxSeqLen));
  cmd->add_option("--packing", c.packing, "packed (documents concatenated into rows) | padded (one per row)")
      ->check(CLI::IsMember({"packed", "padded"}));
  cmd->add_flag(
      "--pack", [&c](int64_t) { c.packing = "packed"; }, "same as --packing packed");
  cmd->add_option("--validation-fraction", o.validation_fraction,
                  "documents held out (a seeded hash per document); none held out is an error")
      ->check(CLI::Range(0.0, 0.99));
  cmd->add_option("--seed", o.seed, "seed of the train/validation split");
  cmd->add_option("--loss-on", c.loss_on, "assistant (chat: the answers only) | all")
      ->check(CLI::IsMember({"assistant", "all"}));
  cmd->add_option("--chat-template", c.chat_template,
                  "auto (the model's own, when supported) | qwen3 | qwen3.5 | qwen3.5-nothink | qwen2.5 | llama3 | "
                  "llama3.1 | llama3.2 | llama3.3 | gemma3 | gpt-oss | mistral-v1 | mistral-v3 | mistral-v3-tekken | "
                  "mistral-nemo | mistral-v7 | chatml")
      ->check(CLI::IsMember({"auto", "qwen3", "qwen3.5", "qwen3.5-nothink", "qwen2.5", "llama3", "llama3.1", "llama3.2",
                             "llama3.3", "gemma3", "gpt-oss", "mistral-v1", "mistral-v3", "mistral-v3-tekken",
                             "mistral-nemo", "mistral-v7", "chatml"}));
  cmd->add_option("--chat-date", o.chat_date,
                  "the date the templates render: Llama 3.1-3.3's \"Today Date\" (default 26 Jul 2024, the "
                  "templates' own default; HF's Llama 3.2 would render today's date), GPT-OSS's \"Current date\" "
                  "(YYYY-MM-DD, default 2025-08-05; HF renders today's)");
  cmd->add_option("--text-eos", c.text_eos, "append | none")->check(CLI::IsMember({"append", "none"}));
  cmd->add_flag("--skip-bad", c.skip_bad, "skip malformed lines (counted) instead of failing");
  cmd->add_option("--threads", o.threads, "tokenizer threads (0: all cores)");
  cmd->add_flag("--overwrite", c.overwrite, "replace an existing output directory");
  return cmd;
}

absl::StatusOr<pp::PrepareOptions> PrepareOptionsFromFlags(const PrepareCommand& c) {
  pp::PrepareOptions o = c.options;
  if (o.output_dir.empty() && c.show == 0) {
    return absl::InvalidArgumentError("prepare: --output is required (or --show N to only look at documents)");
  }
  ASSIGN_OR_RETURN(o.packing, data::ParsePacking(c.packing));
  if (c.loss_on != "assistant" && c.loss_on != "all") {
    return absl::InvalidArgumentError(absl::StrCat("prepare: --loss-on \"", c.loss_on, "\" is not assistant or all"));
  }
  o.loss_on = c.loss_on == "all" ? pp::LossOn::kAll : pp::LossOn::kAssistant;
  ASSIGN_OR_RETURN(o.chat_template, pp::ParseChatTemplateName(c.chat_template));
  ASSIGN_OR_RETURN(o.format, pp::ParseInputFormatName(c.format));
  if (c.text_eos != "append" && c.text_eos != "none") {
    return absl::InvalidArgumentError(absl::StrCat("prepare: --text-eos \"", c.text_eos, "\" is not append or none"));
  }
  o.text_eos = c.text_eos == "none" ? pp::TextEos::kNone : pp::TextEos::kAppend;
  o.bad_lines = c.skip_bad ? pp::BadLines::kSkip : pp::BadLines::kFail;
  o.overwrite = c.overwrite ? data::Overwrite::kYes : data::Overwrite::kNo;
  return o;
}

absl::Status RunPrepareCommand(const PrepareCommand& c, std::ostream& out, std::ostream& err) {
  ASSIGN_OR_RETURN(pp::PrepareOptions o, PrepareOptionsFromFlags(c));
  if (c.show > 0) {
    ASSIGN_OR_RETURN(const std::vector<pp::DocumentPreview> previews, pp::PreviewDocuments(o, c.show));
    const bool color = &out == &std::cout && isatty(STDOUT_FILENO) && std::getenv("NO_COLOR") == nullptr;
    for (size_t i = 0; i < previews.size(); ++i) {
      out << pp::FormatPreview(previews[i], static_cast<int64_t>(i) + 1,
                               color ? pp::SpanMarks::kColor : pp::SpanMarks::kBrackets);
    }
    if (static_cast<int64_t>(previews.size()) < c.show) {
      out << "(" << previews.size() << " documents in the inputs)\n";
    }
    if (o.output_dir.empty()) return absl::OkStatus();
    out << "\n";
  }

  const bool tty = &err == &std::cerr && isatty(STDERR_FILENO);
  o.progress = [tty, &err](const pp::PrepareProgress& p) {
    const double frac = p.bytes_total > 0 ? static_cast<double>(p.bytes_done) / static_cast<double>(p.bytes_total) : 0;
    const std::string line =
        absl::StrFormat("[%-24s] %5.1f%%  %lld documents, %lld tokens", std::string(static_cast<int>(frac * 24), '#'),
                        frac * 100, static_cast<long long>(p.documents), static_cast<long long>(p.tokens));
    if (tty) {
      err << "\r\033[K" << line << std::flush;
    } else {
      err << line << "\n";
    }
  };
  auto summary = pp::Prepare(o);
  if (tty) err << "\n";
  if (!summary.ok()) return summary.status();

  for (size_t i = 0; i < o.inputs.size() && i < summary->input_formats.size(); ++i) {
    out << "input      " << o.inputs[i] << " (" << summary->input_formats[i] << ")\n";
  }
  auto print = [&out](const char* name, const pp::SplitSummary& s) {
    if (s.dir.empty()) return;
    out << absl::StrFormat("%-10s %lld documents, %lld tokens (%lld trained), %lld rows, %lld truncated, %lld split",
                           name, static_cast<long long>(s.documents), static_cast<long long>(s.tokens),
                           static_cast<long long>(s.trained_tokens), static_cast<long long>(s.rows),
                           static_cast<long long>(s.truncated_documents), static_cast<long long>(s.split_documents));
    if (s.dropped_documents > 0) out << ", " << s.dropped_documents << " dropped";
    out << " -> " << s.dir << "\n";
  };
  print("train", summary->train);
  print("validation", summary->validation);
  const data::DatasetSource& src = summary->source;
  out << "tokenizer  " << src.tokenizer_fingerprint << " (" << src.tokenizer_vocab_size << " ids), chat template "
      << src.chat_template << "\n";
  if (summary->skipped_lines > 0) {
    out << "skipped " << summary->skipped_lines << " bad line(s), e.g.:\n";
    for (const auto& e : summary->skipped_examples) out << "  " << e << "\n";
  }
  for (const std::string& w : summary->warnings) err << "warning: " << w << "\n";
  return absl::OkStatus();
}

}  // namespace slidedp::client
