// The subcommands' shared edges (command_io.h).
#include "client/cli/command_io.h"

#include <filesystem>
#include <iostream>

#include "client/cli/client.h"
#include "common/io/small_file.h"
#include "common/jobspec/job_spec.h"

namespace slidedp::client {

int ReportFailure(const absl::Status& s) {
  std::cerr << "slidedp: " << absl::StatusCodeToString(s.code()) << ": " << s.message() << "\n";
  return ExitCodeFor(s);
}

int ReportResult(const absl::Status& s) { return s.ok() ? 0 : ReportFailure(s); }

int PrintJson(const google::protobuf::Message& message) {
  auto json = ToJson(message);
  if (!json.ok()) return ReportFailure(json.status());
  std::cout << *json;
  return 0;
}

void AddJsonFlag(CLI::App& cmd, bool& json) {
  cmd.add_flag("--json", json, "print the record as protobuf JSON (the proto's field names), for scripts");
}

CLI::Option* AddJobSpecArgument(CLI::App& cmd, std::string& spec_path) {
  return cmd.add_option("spec", spec_path, "job spec (YAML)")->check(CLI::ExistingFile);
}

absl::StatusOr<std::string> ReadJobSpec(const std::string& spec_path) {
  return ReadSmallFile(spec_path, kMaxSpecBytes, "job spec");
}

std::string JobSpecDir(const std::string& spec_path) {
  return std::filesystem::absolute(spec_path).parent_path().string();
}

}  // namespace slidedp::client
