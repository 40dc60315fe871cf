// `slidedp export CHECKPOINT --to DIR`: a checkpoint's HF model directory (config.json, weights,
// tokenizer files, generation_config.json) without its optimizer state, written on this machine
// (no hostd needed) by checkpoint::ExportModel.
#pragma once

#include <cstdint>
#include <ostream>
#include <string>

#include "absl/status/status.h"
#include "CLI/CLI.hpp"

namespace slidedp::client {

struct ExportOptions {
  std::string checkpoint;  // checkpoint-<N>, or an output directory holding checkpoints (its newest)
  std::string to;
  std::string job;               // a job or run id: that one's checkpoints in a directory of several runs'
  std::string dtype;             // "bf16" | "fp32" | "" (the checkpoint's own)
  uint64_t max_shard_bytes = 0;  // 0: HF's default (5 GB)
  bool force = false;            // replace an existing model directory at `to`
  int threads = 8;
};

// Adds the `export` subcommand to app; parsing fills `options`.
CLI::App* AddExportCommand(CLI::App& app, ExportOptions& options);

// Runs it and prints what was written to `out`.
absl::Status RunExport(const ExportOptions& options, std::ostream& out);

}  // namespace slidedp::client
