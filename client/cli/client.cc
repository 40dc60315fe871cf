// slidedp CLI commands over gRPC.
#include "client/cli/client.h"

#include <chrono>
#include <filesystem>
#include <iomanip>
#include <iostream>
#include <sstream>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/time/clock.h"
#include "grpc/health/v1/health.grpc.pb.h"
#include "grpcpp/health_check_service_interface.h"
#include "slidedp/v1/job_state_name.h"

namespace slidedp::client {

int ExitCodeFor(const absl::Status& s) {
  switch (s.code()) {
    case absl::StatusCode::kOk: return 0;
    case absl::StatusCode::kUnavailable:
    case absl::StatusCode::kDeadlineExceeded: return 3;
    case absl::StatusCode::kCancelled: return 4;
    case absl::StatusCode::kResourceExhausted: return 5;
    case absl::StatusCode::kInvalidArgument:
    case absl::StatusCode::kNotFound:
    case absl::StatusCode::kAlreadyExists:
    case absl::StatusCode::kFailedPrecondition:
    case absl::StatusCode::kOutOfRange:
    case absl::StatusCode::kPermissionDenied:
    case absl::StatusCode::kUnimplemented: return 2;
    default: return 1;
  }
}

absl::Status CheckTimeout(double timeout_s) {
  if (!(timeout_s > 0 && timeout_s <= kMaxTimeoutS)) {  // NaN fails both
    return absl::InvalidArgumentError(
        absl::StrCat("--timeout ", timeout_s, ": seconds per request must be above 0 and at most ", kMaxTimeoutS));
  }
  return absl::OkStatus();
}

std::string ResumeTarget(const std::string& resume) {
  if (resume.empty()) return resume;
  std::error_code ec;
  const bool is_path = resume.find('/') != std::string::npos || std::filesystem::is_directory(resume, ec);
  if (!is_path) return resume;
  const std::filesystem::path absolute = std::filesystem::absolute(resume, ec);
  return ec ? resume : absolute.string();
}

int ExitCodeForJob(const v1::Job& job) {
  switch (job.state()) {
    case v1::JOB_STATE_SUCCEEDED: return 0;
    case v1::JOB_STATE_CANCELLED: return 4;
    case v1::JOB_STATE_FAILED:
      return job.error_code() == static_cast<int>(absl::StatusCode::kResourceExhausted) ? 5 : 1;
    default: return 1;
  }
}

static std::string FormatSeconds(double s) {
  if (!(s >= 0) || s > 1e9) return "?";
  int64_t t = static_cast<int64_t>(s + 0.5);
  if (t >= 3600) return absl::StrFormat("%dh%02dm", t / 3600, (t / 60) % 60);
  if (t >= 60) return absl::StrFormat("%dm%02ds", t / 60, t % 60);
  return absl::StrFormat("%ds", t);
}

std::string FormatJobLine(const v1::Job& job) {
  std::string line =
      absl::StrFormat("%-24s %-10s step %lld/%lld", job.job_id(), v1::JobStateName(job.state()),
                      static_cast<long long>(job.last().step()), static_cast<long long>(job.total_steps()));
  if (job.has_last()) absl::StrAppendFormat(&line, "  loss %.4f", job.last().loss());
  if (!job.error().empty()) absl::StrAppend(&line, "  error: ", job.error());
  return line;
}

std::string FormatProgress(const v1::Job& job, const v1::StepMetrics& m) {
  int64_t total = std::max<int64_t>(job.total_steps(), 1);
  int width = 24;
  int filled = static_cast<int>(width * std::min<int64_t>(m.step(), total) / total);
  std::string bar = std::string(filled, '#') + std::string(width - filled, '.');
  std::string line = absl::StrFormat("[%s] step %lld/%lld  loss %.4f  lr %.2e  gnorm %.3f  %.0f tok/s  %.1f TFLOP/s",
                                     bar, static_cast<long long>(m.step()), static_cast<long long>(total), m.loss(),
                                     m.learning_rate(), m.grad_norm(), m.tokens_per_s(), m.model_tflops());
  if (m.has_mfu()) absl::StrAppendFormat(&line, " (MFU %.0f%%)", 100 * m.mfu());
  if (m.has_eval_loss()) absl::StrAppendFormat(&line, "  val %.4f", m.eval_loss());
  if (m.has_router_aux_loss()) {  // a MoE model: the router's balance, what users debug
    absl::StrAppendFormat(&line, "  aux %.3f  experts max/mean %.2f (layer %d)", m.router_aux_loss(),
                          m.expert_imbalance(), m.expert_imbalance_layer());
    if (m.experts_unreached() > 0) absl::StrAppendFormat(&line, ", %lld unreached", m.experts_unreached());
  }
  if (m.gpu_peak_bytes() > 0) absl::StrAppendFormat(&line, "  GPU %.1f GiB", m.gpu_peak_bytes() / 1073741824.0);
  if (m.host_state_bytes() > 0) absl::StrAppendFormat(&line, "  host %.1f GiB", m.host_state_bytes() / 1073741824.0);
  absl::StrAppend(&line, "  ETA ", FormatSeconds(m.eta_s()));
  return line;
}

Client::Client(const ClientOptions& options) : options_(options) {
  grpc::ChannelArguments args;
  args.SetMaxReceiveMessageSize(64 << 20);
  auto channel = auth::CreateHostdChannel(options.address, options.credentials, args);
  if (!channel.ok()) {
    channel_status_ = channel.status();
    // Never used: every call returns channel_status_ first.
    channel = grpc::CreateCustomChannel(options.address, grpc::InsecureChannelCredentials(), args);
  }
  channel_ = *channel;
  jobs_ = v1::JobService::NewStub(channel_);
  node_ = v1::NodeService::NewStub(channel_);
}

std::unique_ptr<grpc::ClientContext> Client::Context(bool with_deadline) const {
  auto ctx = std::make_unique<grpc::ClientContext>();
  if (with_deadline) {
    ctx->set_deadline(std::chrono::system_clock::now() +
                      std::chrono::milliseconds(static_cast<int64_t>(options_.timeout_s * 1000)));
  }
  return ctx;
}

absl::Status Client::Health(std::string* status_out) {
  if (!channel_status_.ok()) return channel_status_;
  auto stub = grpc::health::v1::Health::NewStub(channel_);
  grpc::health::v1::HealthCheckRequest req;
  grpc::health::v1::HealthCheckResponse resp;
  auto ctx = Context();
  grpc::Status s = stub->Check(ctx.get(), req, &resp);
  if (!s.ok()) return FromGrpc(s);
  *status_out = grpc::health::v1::HealthCheckResponse_ServingStatus_Name(resp.status());
  if (resp.status() != grpc::health::v1::HealthCheckResponse::SERVING) {
    return absl::UnavailableError(absl::StrCat("hostd is ", *status_out));
  }
  return absl::OkStatus();
}

absl::Status Client::WaitReady(double timeout_s) {
  if (!channel_status_.ok()) return channel_status_;
  absl::Time deadline = absl::Now() + absl::Seconds(timeout_s);
  absl::Status last;
  while (absl::Now() < deadline) {
    std::string st;
    last = Health(&st);
    if (last.ok()) return last;
    absl::SleepFor(absl::Milliseconds(100));
  }
  return absl::UnavailableError(
      absl::StrCat("hostd at ", options_.address, " not ready after ", timeout_s, " s: ", last.message()));
}

absl::StatusOr<v1::NodeInfo> Client::Node() {
  if (!channel_status_.ok()) return channel_status_;
  v1::NodeInfo resp;
  auto ctx = Context();
  grpc::Status s = node_->GetNode(ctx.get(), v1::GetNodeRequest(), &resp);
  if (!s.ok()) return FromGrpc(s);
  return resp;
}

absl::StatusOr<std::vector<v1::WorkerInfo>> Client::Workers() {
  if (!channel_status_.ok()) return channel_status_;
  v1::ListWorkersResponse resp;
  auto ctx = Context();
  grpc::Status s = node_->ListWorkers(ctx.get(), v1::ListWorkersRequest(), &resp);
  if (!s.ok()) return FromGrpc(s);
  return std::vector<v1::WorkerInfo>(resp.workers().begin(), resp.workers().end());
}

absl::StatusOr<v1::SubmitJobResponse> Client::Submit(const v1::SubmitJobRequest& req) {
  if (!channel_status_.ok()) return channel_status_;
  v1::SubmitJobResponse resp;
  auto ctx = Context();
  grpc::Status s = jobs_->SubmitJob(ctx.get(), req, &resp);
  if (!s.ok()) return FromGrpc(s);
  return resp;
}

absl::StatusOr<v1::PlanJobResponse> Client::Plan(const v1::PlanJobRequest& req) {
  if (!channel_status_.ok()) return channel_status_;
  v1::PlanJobResponse resp;
  auto ctx = Context();
  grpc::Status s = jobs_->PlanJob(ctx.get(), req, &resp);
  if (!s.ok()) return FromGrpc(s);
  return resp;
}

absl::StatusOr<v1::Job> Client::GetJob(const std::string& id) {
  if (!channel_status_.ok()) return channel_status_;
  v1::GetJobRequest req;
  req.set_job_id(id);
  v1::Job resp;
  auto ctx = Context();
  grpc::Status s = jobs_->GetJob(ctx.get(), req, &resp);
  if (!s.ok()) return FromGrpc(s);
  return resp;
}

absl::StatusOr<std::vector<v1::Job>> Client::ListJobs() {
  if (!channel_status_.ok()) return channel_status_;
  v1::ListJobsResponse resp;
  auto ctx = Context();
  grpc::Status s = jobs_->ListJobs(ctx.get(), v1::ListJobsRequest(), &resp);
  if (!s.ok()) return FromGrpc(s);
  return std::vector<v1::Job>(resp.jobs().begin(), resp.jobs().end());
}

absl::StatusOr<v1::Job> Client::Cancel(const std::string& id) {
  if (!channel_status_.ok()) return channel_status_;
  v1::CancelJobRequest req;
  req.set_job_id(id);
  v1::Job resp;
  auto ctx = Context();
  grpc::Status s = jobs_->CancelJob(ctx.get(), req, &resp);
  if (!s.ok()) return FromGrpc(s);
  return resp;
}

absl::StatusOr<v1::Job> Client::Watch(const std::string& id, std::ostream& out, bool tty) {
  if (!channel_status_.ok()) return channel_status_;
  v1::WatchJobRequest req;
  req.set_job_id(id);
  auto ctx = Context(/*with_deadline=*/false);
  auto reader = jobs_->WatchJob(ctx.get(), req);
  v1::JobEvent ev;
  v1::Job job;
  bool open_line = false;
  auto end_line = [&] {
    if (open_line) out << "\n";
    open_line = false;
  };
  while (reader->Read(&ev)) {
    if (ev.has_state_change()) {
      v1::JobState prev = job.state();
      job = ev.state_change();
      if (job.state() != prev) {
        end_line();
        out << "job " << job.job_id() << ": " << v1::JobStateName(job.state()) << "\n";
      }
    } else if (ev.has_step()) {
      *job.mutable_last() = ev.step();
      if (tty) {
        out << "\r\033[K" << FormatProgress(job, ev.step()) << std::flush;
        open_line = true;
      } else {
        out << FormatProgress(job, ev.step()) << "\n";
      }
    } else if (ev.has_log()) {
      end_line();
      out << "  " << ev.log() << "\n";
    }
  }
  end_line();
  grpc::Status s = reader->Finish();
  if (!s.ok()) return FromGrpc(s);
  auto final_job = GetJob(id);
  if (!final_job.ok()) return final_job.status();
  const v1::Job& f = *final_job;
  double wall = (f.end_time_unix_ms() - f.start_time_unix_ms()) / 1000.0;
  out << "summary: " << v1::JobStateName(f.state()) << " after " << f.last().step() << " step(s) in "
      << absl::StrFormat("%.1f", wall) << " s";
  if (f.has_last())
    out << absl::StrFormat(", final loss %.4f, %.0f tokens/s", f.last().loss(), f.last().tokens_per_s());
  if (f.has_last() && f.last().has_eval_loss()) {
    out << absl::StrFormat(", validation loss %.4f (%lld tokens)", f.last().eval_loss(),
                           static_cast<long long>(f.last().eval_tokens()));
  }
  if (!f.last_checkpoint().empty()) out << ", checkpoint " << f.last_checkpoint();
  out << "\n";
  if (f.has_last() && f.last().step_time_s() > 0) {
    // Where the last step's time went (slowest worker), so users see what limits them.
    const v1::StepMetrics& m = f.last();
    auto bytes = [](int64_t b) {
      return b >= (int64_t{1} << 30) ? absl::StrFormat("%.2f GiB", b / 1073741824.0)
                                     : absl::StrFormat("%.1f MiB", b / 1048576.0);
    };
    out << absl::StrFormat(
        "last step: %.3f s, %.3g model TFLOP/s per GPU, GPU peak %s, host state %s; worker waits: gates %.3f s, "
        "ring slots %.3f s; copies: H2D %.3f s, D2H %.3f s; host: aggregate %.3f s, updates %.3f s (%.2f Gparam/s), "
        "update tail %.3f s\n",
        m.step_time_s(), m.model_tflops(), bytes(m.gpu_peak_bytes()), bytes(m.host_state_bytes()),
        m.worker_gate_wait_s(), m.worker_ring_wait_s(), m.worker_h2d_s(), m.worker_d2h_s(), m.host_aggregate_s(),
        m.host_update_s(), m.host_update_gparams_per_s(), m.host_update_tail_s());
  }
  if (!f.error().empty()) out << "error: " << f.error() << "\n";
  return final_job;
}

}  // namespace slidedp::client
