// slidedp CLI commands over gRPC (one function per subcommand; main.cc only parses flags).
// Exit codes: 0 success; 1 the job failed; 2 bad usage or rejected input (INVALID_ARGUMENT,
// NOT_FOUND, ALREADY_EXISTS, ...); 3 hostd unreachable or unavailable; 4 the job was cancelled;
// 5 resources exhausted.
#pragma once

#include <iosfwd>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "common/auth/hostd_channel.h"
#include "common/status/grpc_status.h"
#include "grpcpp/grpcpp.h"
#include "slidedp/v1/slidedp.grpc.pb.h"

namespace slidedp::client {

struct ClientOptions {
  std::string address = "unix:/tmp/slidedp-hostd.sock";
  double timeout_s = 10;
  // TCP only: TLS roots, client certificate, bearer token (hostd_channel.h).
  auth::ClientCredentialsOptions credentials;
};

int ExitCodeFor(const absl::Status& s);

// --timeout: seconds per request, in (0, 1e6]. INVALID_ARGUMENT otherwise: inf, 1e300 or NaN
// make a deadline in the past, so every call would fail with DEADLINE_EXCEEDED.
inline constexpr double kMaxTimeoutS = 1e6;
absl::Status CheckTimeout(double timeout_s);

// --resume's value as hostd should get it. A checkpoint directory (the value has a '/' or names a
// directory here) is made absolute: hostd resolves a relative one against its own working
// directory. Anything else is a job id, sent as is.
std::string ResumeTarget(const std::string& resume);

class Client {
 public:
  // A credential file that cannot be used (missing, readable by others, ...) makes every call
  // return that error.
  explicit Client(const ClientOptions& options);
  absl::Status Health(std::string* status_out);
  absl::StatusOr<v1::NodeInfo> Node();
  absl::StatusOr<std::vector<v1::WorkerInfo>> Workers();
  absl::StatusOr<v1::SubmitJobResponse> Submit(const v1::SubmitJobRequest& req);
  absl::StatusOr<v1::PlanJobResponse> Plan(const v1::PlanJobRequest& req);
  absl::StatusOr<v1::Job> GetJob(const std::string& id);
  absl::StatusOr<std::vector<v1::Job>> ListJobs();
  absl::StatusOr<v1::Job> Cancel(const std::string& id);
  // Streams events to `out` as a live progress line (tty) or one line per step, ends with a
  // summary. Returns the job's final record.
  absl::StatusOr<v1::Job> Watch(const std::string& id, std::ostream& out, bool tty);
  // Waits until hostd answers health SERVING, up to timeout_s.
  absl::Status WaitReady(double timeout_s);

 private:
  std::unique_ptr<grpc::ClientContext> Context(bool with_deadline = true) const;
  ClientOptions options_;
  absl::Status channel_status_;
  std::shared_ptr<grpc::Channel> channel_;
  std::unique_ptr<v1::JobService::Stub> jobs_;
  std::unique_ptr<v1::NodeService::Stub> node_;
};

// Final exit code for a finished job record.
int ExitCodeForJob(const v1::Job& job);
std::string FormatJobLine(const v1::Job& job);
std::string FormatProgress(const v1::Job& job, const v1::StepMetrics& m);

}  // namespace slidedp::client
