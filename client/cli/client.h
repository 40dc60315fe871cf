// The slidedp CLI's gRPC client (one call per hostd request; the subcommands that use it are in
// node_commands.h, job_commands.h, plan_command.h, run_command.h), and the text they print: the
// live progress line, the summary, `jobs` and `status`.
// Exit codes: 0 success; 1 the job failed; 2 bad usage or rejected input (INVALID_ARGUMENT,
// NOT_FOUND, ALREADY_EXISTS, ...); 3 hostd unreachable or unavailable; 4 the job was cancelled;
// 5 resources exhausted; 128 + the signal (130 SIGINT, 143 SIGTERM) when a signal ended the
// command: `slidedp run` after it stopped its job at a step boundary, `submit` / `watch` after
// they stopped watching (the job goes on).
#pragma once

#include <iosfwd>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
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

// What a cancel does to a running job: stop at the next safe point, or first save a checkpoint
// at the step boundary where it stops (CancelJobRequest.save_checkpoint; `slidedp run`'s Ctrl-C).
enum class CancelCheckpoint { kNone, kSave };

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
  absl::StatusOr<v1::Job> Cancel(const std::string& id, CancelCheckpoint checkpoint = CancelCheckpoint::kNone);
  // Streams events to `out` as a live progress line fitted to the terminal's width (tty: stdout's
  // TIOCGWINSZ, else $COLUMNS, else 80) or one whole line per step, says why a queued job waits
  // when that changes, ends with a summary. Returns the job's final record. While the process
  // stops at once (StoppingAtOnce, embedded.h) it prints nothing more and blocks until the end.
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
// One line: id, state, step, loss, error (`cancel`'s answer).
std::string FormatJobLine(const v1::Job& job);

// A step's progress line. Fields that do not apply are left out (GPU memory, TFLOP/s and MFU on
// the CPU backend, zero values); with `width_columns` > 0 the line is fitted to it: fields are
// kept by priority (step, loss, ETA, validation loss, tokens/s, lr, the router's balance,
// TFLOP/s, the bar, grad norm, GPU and host memory) while they fit, the bar takes what room is
// left (10 to 24 cells), and a line that still does not fit is cut: it never wraps. 0: the whole
// line.
std::string FormatProgress(const v1::Job& job, const v1::StepMetrics& m, int width_columns = 0);

// The columns a live line may use on `fd`: its terminal's width (TIOCGWINSZ) less one, so that
// the cursor never wraps; else $COLUMNS less one; else 79.
int LiveLineColumns(int fd);

// "2.5 s", "3m05s", "2h07m": a duration for people; "?" when negative or not finite.
std::string FormatDuration(double seconds);

// The lines Watch ends with: the state, steps and wall time (end - start; a job that never
// started says so, with end - submit), the final loss, the run's mean tokens/s and MFU besides
// the last step's, the validation loss, the checkpoint; where the last step's time went; the
// error. The first line keeps the form "summary: STATE after N step(s) in T s, final loss L"
// that tools/gpu/suite_judge.py reads.
std::string FormatSummary(const v1::Job& job);

// After `slidedp run` stopped its job on a signal (the job CANCELLED): the checkpoint saved at the
// stop and the command that resumes it (`slidedp run SPEC --resume DIR`); or, when the job
// ended before a step boundary saved one, that it did, and the newest checkpoint there is
// instead (the one it resumed from, for a resumed job), or that there is none to resume. Empty
// for a job in another state.
std::string FormatStopReport(const v1::Job& job, const std::string& spec_path);

// `s` as one word for a POSIX shell: as is when it holds only safe characters, else in single
// quotes.
std::string ShellQuote(const std::string& s);

// `slidedp jobs`: a header and one row per job, or "no jobs".
std::string FormatJobsTable(const std::vector<v1::Job>& jobs);

// `slidedp status ID`: state, step and loss, its error, then its times in `tz` (ISO-like, with the
// offset), what it waits for, output directory, last checkpoint, validation loss, speed.
std::string FormatJobStatus(const v1::Job& job, absl::TimeZone tz);

// A message as protobuf's JSON mapping with the proto's field names (`--json`), one object
// ending in a newline.
absl::StatusOr<std::string> ToJson(const google::protobuf::Message& message);

}  // namespace slidedp::client
