#include "hostd/core/output_ownership.h"

#include <algorithm>
#include <filesystem>
#include <map>
#include <system_error>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/status/status_macros.h"

namespace slidedp::hostd {
namespace fs = std::filesystem;

bool SavesCheckpoints(const JobSpec& spec) {
  return !spec.train.measure_only && (spec.output.save_final || spec.output.save_every > 0);
}

absl::StatusOr<std::vector<checkpoint::CheckpointEntry>> OtherRunsCheckpoints(const std::string& output_dir,
                                                                              const std::string& own_run) {
  std::error_code ec;
  if (!fs::is_directory(output_dir, ec)) return std::vector<checkpoint::CheckpointEntry>{};
  absl::StatusOr<std::vector<checkpoint::CheckpointEntry>> all = checkpoint::ListCheckpoints(output_dir);
  if (absl::IsNotFound(all.status())) return std::vector<checkpoint::CheckpointEntry>{};  // nothing written yet
  if (!all.ok()) return all.status();
  std::vector<checkpoint::CheckpointEntry> others;
  for (checkpoint::CheckpointEntry& e : *all) {
    if (!e.complete) continue;  // a save that never finished belongs to nobody's results
    if (own_run.empty() || e.run_id != own_run) others.push_back(std::move(e));
  }
  std::sort(others.begin(), others.end(), [](const auto& a, const auto& b) { return a.step > b.step; });
  return others;
}

absl::Status RefuseOtherRuns(const std::string& output_dir, const std::vector<checkpoint::CheckpointEntry>& others) {
  if (others.empty()) return absl::OkStatus();
  // Per run: its newest checkpoint (others is newest first) and how many it has.
  std::map<std::string, std::pair<std::string, int>> runs;
  std::vector<std::string> order;
  for (const checkpoint::CheckpointEntry& e : others) {
    const std::string run = e.run_id.empty() ? std::string("(unknown)") : e.run_id;
    auto [it, fresh] = runs.try_emplace(run, fs::path(e.dir).filename().string(), 0);
    if (fresh) order.push_back(run);
    it->second.second++;
  }
  std::vector<std::string> named;
  for (size_t i = 0; i < order.size() && i < 4; ++i) {
    const auto& [newest, count] = runs[order[i]];
    named.push_back(absl::StrCat("job ", order[i], " (", newest, count > 1 ? absl::StrCat(", ", count, " checkpoints") : "",
                                 ")"));
  }
  if (order.size() > 4) named.push_back(absl::StrCat("and ", order.size() - 4, " more run(s)"));
  const std::string& first = order.front();
  return absl::FailedPreconditionError(absl::StrCat(
      "output.dir ", output_dir, " holds the checkpoints of another run: ", absl::StrJoin(named, ", "),
      ". To continue that run, resume it (`slidedp run JOB.yaml --resume latest`, or `slidedp submit --resume ", first,
      "` on the node that ran it); to keep both, give this job another output.dir; to start over there, set "
      "output.overwrite: true, which moves them aside into ",
      output_dir, "/superseded-<time>-<job>/ (nothing is deleted)"));
}

absl::StatusOr<std::string> MoveOtherRunsAside(const std::string& output_dir,
                                               const std::vector<checkpoint::CheckpointEntry>& others,
                                               const std::string& job_id) {
  if (others.empty()) return std::string();
  std::vector<std::string> dirs;
  for (const checkpoint::CheckpointEntry& e : others) dirs.push_back(e.dir);
  ASSIGN_OR_RETURN(checkpoint::MovedAside moved, checkpoint::MoveCheckpointsAside(output_dir, dirs, job_id));
  return absl::StrCat("output.overwrite: moved ", moved.moved.size(), " checkpoint(s) of another run (newest ",
                      fs::path(others.front().dir).filename().string(), " of job ", others.front().job_id, ") to ",
                      moved.dir, "; nothing was deleted");
}

absl::StatusOr<std::string> RunOfCheckpoint(const std::string& resume_from) {
  std::error_code ec;
  std::string dir = resume_from;
  if (!fs::exists(fs::path(resume_from) / "COMPLETE", ec)) {
    ASSIGN_OR_RETURN(dir, checkpoint::FindLatestCheckpoint(resume_from));
  }
  return checkpoint::CheckpointRunId(dir);
}

bool JobIdUsedIn(const std::string& output_dir, const std::string& id) {
  std::error_code ec;
  return fs::exists(fs::path(output_dir) / absl::StrCat("metrics-", id, ".jsonl"), ec) ||
         fs::exists(fs::path(output_dir) / "tensorboard" / id, ec);
}

}  // namespace slidedp::hostd
