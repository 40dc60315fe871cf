// What every `slidedp` subcommand does at its edges: the job spec it reads, the `--json` record it
// prints, and a failure as the message on stderr and the exit code (client.h) main returns.
#pragma once

#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "CLI/CLI.hpp"
#include "google/protobuf/message.h"

namespace slidedp::client {

// Prints "slidedp: CODE: message" on stderr; returns the exit code for `s` (ExitCodeFor).
int ReportFailure(const absl::Status& s);

// 0 when `s` is OK, else ReportFailure(s): the end of a command whose only outcome is a Status.
int ReportResult(const absl::Status& s);

// `--json`: `message` as protobuf JSON on stdout; 0, or ReportFailure when it cannot be written.
int PrintJson(const google::protobuf::Message& message);

// Adds `--json` (print the record as protobuf JSON) to `cmd`: workers, jobs, status.
void AddJsonFlag(CLI::App& cmd, bool& json);

// Adds the positional `spec` (an existing file) to `cmd`; the caller says whether it is required.
CLI::Option* AddJobSpecArgument(CLI::App& cmd, std::string& spec_path);

// A job spec: a regular file of at most kMaxSpecBytes (what hostd parses), refused here with that
// figure rather than by gRPC's message limit.
absl::StatusOr<std::string> ReadJobSpec(const std::string& spec_path);

// The directory the spec's relative paths are resolved against (SubmitJobRequest.base_dir): the
// spec's own, absolute.
std::string JobSpecDir(const std::string& spec_path);

}  // namespace slidedp::client
