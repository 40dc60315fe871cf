// The step record's TensorBoard scalars; see tensorboard_sink.h.
#include "hostd/metrics/tensorboard_sink.h"

#include <filesystem>

#include "absl/strings/str_cat.h"

namespace slidedp::metrics {

std::vector<tensorboard::Scalar> StepScalars(const google::protobuf::Message& record,
                                             absl::Span<const StepScalarField> table) {
  using google::protobuf::FieldDescriptor;
  const google::protobuf::Descriptor* type = record.GetDescriptor();
  const google::protobuf::Reflection* r = record.GetReflection();
  std::vector<tensorboard::Scalar> out;
  for (const StepScalarField& f : table) {
    const FieldDescriptor* fd = type->FindFieldByName(f.field);
    if (fd == nullptr || fd->is_repeated()) continue;
    if (fd->has_presence() && !r->HasField(record, fd)) continue;
    double v;
    switch (fd->cpp_type()) {
      case FieldDescriptor::CPPTYPE_DOUBLE: v = r->GetDouble(record, fd); break;
      case FieldDescriptor::CPPTYPE_FLOAT: v = r->GetFloat(record, fd); break;
      case FieldDescriptor::CPPTYPE_INT32: v = r->GetInt32(record, fd); break;
      case FieldDescriptor::CPPTYPE_INT64: v = static_cast<double>(r->GetInt64(record, fd)); break;
      case FieldDescriptor::CPPTYPE_UINT32: v = r->GetUInt32(record, fd); break;
      case FieldDescriptor::CPPTYPE_UINT64: v = static_cast<double>(r->GetUInt64(record, fd)); break;
      default: continue;  // bool, string, enum, message: not a curve
    }
    out.push_back({f.tag, static_cast<float>(v * f.scale)});
  }
  return out;
}

std::string TensorBoardDir(const std::string& output_dir, const std::string& job_id) {
  return (std::filesystem::path(output_dir) / "tensorboard" / job_id).string();
}

TensorBoardSink::TensorBoardSink(const std::string& output_dir, const std::string& job_id, absl::Time now, LogFn log)
    : log_(std::move(log)) {
  auto writer = tensorboard::EventFileWriter::Create(TensorBoardDir(output_dir, job_id), now);
  if (!writer.ok()) {
    Disable(writer.status());
    return;
  }
  writer_ = *std::move(writer);
  log_(absl::StrCat("TensorBoard events: ", writer_->path()));
}

void TensorBoardSink::Append(const v1::StepMetrics& record, absl::Time now) {
  if (writer_ == nullptr) return;
  absl::Status s = writer_->WriteScalars(record.step(), now, StepScalars(record, kStepScalarFields));
  if (!s.ok()) Disable(s);
}

void TensorBoardSink::Disable(const absl::Status& error) {
  writer_.reset();
  log_(absl::StrCat("TensorBoard events stopped (training goes on, the JSONL metrics too): ", error.message()));
}

}  // namespace slidedp::metrics
