// TensorBoardSink: a job's step records as TensorBoard scalars (job spec `output.tensorboard`),
// written next to the JSONL metrics at every step the JSONL gets a record, into
// `<output.dir>/tensorboard/<job-id>/events.out.tfevents.*` (common/tensorboard/event_writer.h).
//
// Which fields become which tags is one table (kStepScalarFields), looked up by field name in the
// record's message type: a field added to v1::StepMetrics later (a validation loss, MFU) is
// written as soon as the table names it, and a field the table names but the record type lacks is
// skipped. Like the JSONL file, the sink never fails training: an events file that cannot be
// created or written is logged once and the sink stops writing.
#pragma once

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/time/time.h"
#include "absl/types/span.h"
#include "common/tensorboard/event_writer.h"
#include "google/protobuf/message.h"
#include "slidedp/v1/slidedp.pb.h"

namespace slidedp::metrics {

// A numeric field of the step record and the tag it is written as, value x scale.
struct StepScalarField {
  const char* field;
  const char* tag;
  double scale = 1.0;
};

inline constexpr double kBytesPerGiB = 1024.0 * 1024.0 * 1024.0;

// loss, validation loss, lr, grad norm, tokens/s, model TFLOP/s, MFU, step time, host/GPU memory.
// Field names are v1::StepMetrics'. `eval_loss` is written on the steps that carry one (an
// `optional` field: only steps a validation pass followed); `mfu` (optional too) on GPUs whose
// peak hostd knows.
// tools/gpu/tensorboard_check.py mirrors the table (tag -> JSONL key) to compare a file with the JSONL.
inline constexpr StepScalarField kStepScalarFields[] = {
    {"loss", "train/loss"},
    {"eval_loss", "eval/loss"},
    {"learning_rate", "train/lr"},
    {"grad_norm", "train/grad_norm"},
    {"tokens_per_s", "perf/tokens_per_s"},
    {"model_tflops", "perf/model_tflops"},
    {"mfu", "perf/mfu"},
    {"step_time_s", "perf/step_time_s"},
    {"host_state_bytes", "memory/host_gib", 1.0 / kBytesPerGiB},
    {"gpu_peak_bytes", "memory/gpu_peak_gib", 1.0 / kBytesPerGiB},
    // MoE models only (optional fields: absent for a dense model).
    {"router_aux_loss", "moe/router_aux_loss"},
    {"expert_tokens_min", "moe/expert_tokens_min"},
    {"expert_tokens_max", "moe/expert_tokens_max"},
    {"expert_tokens_mean", "moe/expert_tokens_mean"},
};

// The scalars of `record` by `table`, in table order: fields the record's type lacks, repeated
// and non-numeric fields are skipped; fields with presence (`optional`, as a value only some
// steps carry should be declared) only when set.
std::vector<tensorboard::Scalar> StepScalars(const google::protobuf::Message& record,
                                             absl::Span<const StepScalarField> table);

// `<output_dir>/tensorboard/<job_id>`: `tensorboard --logdir <output_dir>/tensorboard` shows each
// job of an output directory as one run.
std::string TensorBoardDir(const std::string& output_dir, const std::string& job_id);

class TensorBoardSink {
 public:
  // Where the sink says what it does: the job's log (the file it writes, or why it stopped).
  using LogFn = std::function<void(const std::string&)>;

  // Creates a new events file in TensorBoardDir (a resumed or restarted job adds a file;
  // TensorBoard reads a run's files in order and drops points of steps run again).
  TensorBoardSink(const std::string& output_dir, const std::string& job_id, absl::Time now, LogFn log);

  // One event of kStepScalarFields' scalars at the record's step, in the file when this returns.
  void Append(const v1::StepMetrics& record, absl::Time now);

  bool writing() const { return writer_ != nullptr; }
  std::string path() const { return writer_ ? writer_->path() : std::string(); }

 private:
  void Disable(const absl::Status& error);

  LogFn log_;
  std::unique_ptr<tensorboard::EventFileWriter> writer_;
};

}  // namespace slidedp::metrics
