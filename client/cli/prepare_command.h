// `slidedp prepare`: the user's JSONL / text files -> the pre-tokenized training dataset
// (docs/dataset-format.md), run on this machine by the client/prepare library (no hostd needed).
//
//   slidedp prepare --model DIR --input F... --output OUT [--format F] [--show N] ...
//
// --show N prints the first N documents as they will be trained (rendered, tokenized, trained
// spans marked: green on a terminal, [[...]] otherwise); given without --output it only shows,
// with --output it shows and then writes.
#pragma once

#include <cstdint>
#include <ostream>
#include <string>

#include "absl/status/status.h"
#include "CLI/CLI.hpp"
#include "client/prepare/prepare.h"

namespace slidedp::client {

// What the flags say; AddPrepareCommand's parsing fills it (it must outlive the parse).
struct PrepareCommand {
  prepare::PrepareOptions options;  // the flags that map 1:1 (model, inputs, output, seq_len, ...)
  std::string packing = "packed";
  std::string loss_on = "assistant";
  std::string chat_template = "auto";
  std::string text_eos = "append";
  std::string format = "auto";
  bool skip_bad = false;
  bool overwrite = false;
  int64_t show = 0;  // --show N: documents to print; 0: none
};

// Adds the `prepare` subcommand to app.
CLI::App* AddPrepareCommand(CLI::App& app, PrepareCommand& command);

// The options Run uses: the string flags mapped to their enums (INVALID_ARGUMENT naming the flag),
// --output required unless --show is given. Exposed for tests.
absl::StatusOr<prepare::PrepareOptions> PrepareOptionsFromFlags(const PrepareCommand& command);

// Shows (--show) and/or writes the dataset: samples and the summary to `out`, the progress bar and
// warnings to `err` (a bar redrawn in place when stderr is a terminal). Trained spans are coloured
// when `out` is std::cout on a terminal and NO_COLOR is unset.
absl::Status RunPrepareCommand(const PrepareCommand& command, std::ostream& out, std::ostream& err);

}  // namespace slidedp::client
