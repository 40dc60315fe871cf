// `slidedp export` (export_model.h).
#include "client/cli/export_model.h"

#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "checkpoint/checkpoint.h"

namespace slidedp::client {

CLI::App* AddExportCommand(CLI::App& app, ExportOptions& options) {
  auto* cmd = app.add_subcommand(
      "export",
      "write a checkpoint's model directory (config.json, weights, tokenizer files, generation_config.json; no "
      "optimizer state) that transformers' from_pretrained loads; runs here, no hostd needed");
  cmd->add_option("checkpoint", options.checkpoint,
                  "a checkpoint-<step> directory, or a job's output directory (the newest complete checkpoint of "
                  "its run, or of --job's)")
      ->required();
  cmd->add_option("--to", options.to,
                  "the model directory to write (must not exist, or be empty; its parent directory must exist)")
      ->required();
  cmd->add_option("--job", options.job,
                  "a job id or run id: export that job's (run's) newest checkpoint from a directory holding the "
                  "checkpoints of several runs (refused without it); with a checkpoint-<step>, check it is theirs");
  cmd->add_option("--dtype", options.dtype,
                  "the weights' dtype: bf16 (round to nearest even of the FP32 master) or fp32 (the master "
                  "exactly); default: the checkpoint's")
      ->check(CLI::IsMember({"bf16", "fp32"}));
  cmd->add_option("--max-shard-size", options.max_shard_bytes,
                  "weights above this are split into model-0000i-of-0000n.safetensors with an index (e.g. 5GB, "
                  "500MB; default 5GB, HF's)")
      ->transform(CLI::AsSizeValue(/*kb_is_1000=*/true));
  cmd->add_flag("--force", options.force,
                "replace --to when it is an existing model directory (one holding config.json); the old one is "
                "removed only after the new one is complete");
  cmd->add_option("--threads", options.threads, "writer threads per file")->check(CLI::Range(1, 256));
  return cmd;
}

absl::Status RunExport(const ExportOptions& options, std::ostream& out) {
  checkpoint::ExportRequest req;
  req.checkpoint = options.checkpoint;
  req.out_dir = options.to;
  req.run = options.job;
  if (options.dtype == "bf16") req.dtype = Dtype::kBF16;
  if (options.dtype == "fp32") req.dtype = Dtype::kF32;
  if (options.max_shard_bytes > 0) req.shard_max_bytes = options.max_shard_bytes;
  req.existing =
      options.force ? checkpoint::ExportRequest::Existing::kReplace : checkpoint::ExportRequest::Existing::kRefuse;
  req.io_threads = options.threads;
  absl::StatusOr<checkpoint::ExportResult> r = checkpoint::ExportModel(req);
  if (!r.ok()) return r.status();
  out << absl::StrFormat("exported %s (step %d) to %s%s: %.3f GB of %s weights\n  %s\n", r->checkpoint, r->step, r->dir,
                         r->replaced ? " (replaced)" : "", r->bytes_written / 1e9,
                         r->dtype == Dtype::kBF16 ? "bf16" : "fp32", absl::StrJoin(r->files, " "));
  bool tokenizer = false;
  for (const std::string& f : r->files) tokenizer |= f == "tokenizer.json" || f == "tokenizer.model";
  if (!tokenizer) {
    out << "  no tokenizer files: the job's model had none (a model.preset); copy them from the source model "
           "directory for AutoTokenizer\n";
  }
  return absl::OkStatus();
}

}  // namespace slidedp::client
