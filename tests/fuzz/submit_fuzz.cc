// libFuzzer target: JobService.SubmitJob as hostd sees it. The request's fields (job id, spec
// bytes, base_dir, resume_from, dry_run) go through HostCore::Submit with a real HostCore and
// the real TrainingExecutor::Validate: the spec parser, the job-id and name rules, --resume
// lookups, output.dir probing, the model config, the dataset's manifest, sizes, token ids and
// loss mask, the schedule. A fixture directory holds a small valid dataset and HF model config so
// inputs can get past the parser; paths the input names are only probed and read (bounded,
// non-blocking), never created. Every outcome must be a Status with a canonical code, never a
// crash, a leak or an escaped exception; an accepted job's id must be a valid one. Two requests
// per input (the second may reuse the first's id, or resume it), on a fresh HostCore each input.
//
// Input: byte 0 flags (bit 0: base_dir is the fixture, bit 1: dry_run, bit 2: a second request
// with the same id, bit 3: the second resumes the first), then u8-length-prefixed job_id,
// base_dir (unless bit 0) and resume_from, then the spec bytes.
#include <unistd.h>

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <memory>
#include <string>

#include "common/data/synthetic.h"
#include "common/model/model_config.h"
#include "glog/logging.h"
#include "hostd/core/host_core.h"
#include "hostd/engine/training_executor.h"

namespace {

std::string g_fixture;

class Reader {
 public:
  Reader(const uint8_t* data, size_t size) : p_(data), end_(data + size) {}
  uint8_t U8() { return p_ < end_ ? *p_++ : 0; }
  std::string Field() {
    const size_t n = std::min<size_t>(U8(), end_ - p_);
    std::string s(reinterpret_cast<const char*>(p_), n);
    p_ += n;
    return s;
  }
  std::string Rest() {
    std::string s(reinterpret_cast<const char*>(p_), end_ - p_);
    p_ = end_;
    return s;
  }

 private:
  const uint8_t* p_;
  const uint8_t* end_;
};

void CheckStatus(const absl::Status& s, const char* what) {
  const int code = static_cast<int>(s.code());
  if (code < 0 || code > 16) {
    fprintf(stderr, "%s: status code %d is not canonical: %s\n", what, code, s.ToString().c_str());
    abort();
  }
  if (!s.ok() && s.message().empty()) {
    fprintf(stderr, "%s: error without a message (code %d)\n", what, code);
    abort();
  }
}

bool ValidId(const std::string& id) {
  if (id.empty() || id.size() > 64) return false;
  for (char c : id) {
    if (!(isalnum(static_cast<unsigned char>(c)) || c == '_' || c == '-')) return false;
  }
  return true;
}

}  // namespace

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  FLAGS_minloglevel = 3;  // HostCore logs every queued job
  FLAGS_logtostderr = true;
  g_fixture = std::filesystem::temp_directory_path() / ("slidedp-submit-fuzz-" + std::to_string(getpid()));
  std::filesystem::create_directories(g_fixture + "/model");
  slidedp::data::SyntheticOptions o;
  o.vocab_size = 512;
  o.num_documents = 16;
  o.min_doc_tokens = 4;
  o.max_doc_tokens = 24;
  o.seq_len = 16;
  o.overwrite = slidedp::data::Overwrite::kYes;
  if (!slidedp::data::WriteSyntheticDataset(g_fixture + "/data", o).ok()) abort();
  std::ofstream(g_fixture + "/model/config.json") << slidedp::ModelConfig::Preset("tiny")->ToJson();
  std::atexit([] { std::filesystem::remove_all(g_fixture); });
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  Reader in(data, size);
  const uint8_t flags = in.U8();
  slidedp::v1::SubmitJobRequest req;
  req.set_job_id(in.Field());
  req.set_base_dir(flags & 1 ? g_fixture : in.Field());
  req.set_resume_from(in.Field());
  req.set_dry_run(flags & 2);
  req.set_spec_yaml(in.Rest());

  slidedp::hostd::HostCoreOptions options;
  options.node_name = "fuzz";
  slidedp::hostd::TrainingExecutorOptions eo;
  eo.node_name = "fuzz";
  slidedp::hostd::HostCore core(options, std::make_unique<slidedp::hostd::TrainingExecutor>(eo));
  auto first = core.Submit(req);
  CheckStatus(first.status(), "first submit");
  if (first.ok() && !ValidId(first->job().job_id())) {
    fprintf(stderr, "accepted job has the invalid id '%s'\n", first->job().job_id().c_str());
    abort();
  }
  if (flags & 4) {
    slidedp::v1::SubmitJobRequest again = req;
    if (first.ok()) again.set_job_id(first->job().job_id());
    if (flags & 8) {
      again.set_resume_from(again.job_id());
      again.set_job_id("");
    }
    auto second = core.Submit(again);
    CheckStatus(second.status(), "second submit");
    if (second.ok() && !ValidId(second->job().job_id())) abort();
  }
  return 0;
}
