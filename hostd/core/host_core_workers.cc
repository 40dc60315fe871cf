// Worker sessions (WorkerSession) and HostCore's side of them: attach, detach, the node's workers and
// NodeInfo (see host_core.h).
#include <unistd.h>

#include <algorithm>
#include <filesystem>
#include <fstream>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "checkpoint/checkpoint.h"
#include "common/io/small_file.h"
#include "common/status/status_macros.h"
#include "common/version.h"
#include "glog/logging.h"
#include "google/protobuf/util/json_util.h"
#include "hostd/admission/admission.h"
#include "hostd/core/host_core.h"
#include "hostd/core/host_core_internal.h"
#include "shm/process_liveness.h"

namespace slidedp::hostd {

WorkerSession::WorkerSession(v1::WorkerHello hello, int64_t serial)
    : hello_(std::move(hello)),
      serial_(serial),
      connected_unix_ms_(NowMs()),
      reports_(4096, kMaxQueuedReportBytes),
      process_(shm::IdentityOf(hello_.pid())) {}

bool WorkerSession::process_alive() const {
  // Only for workers on this host (pid known and visible); others are judged by their session.
  return process_.pid <= 0 || process_.start_ticks == 0 || shm::IsProcessAlive(process_);
}

void WorkerSession::SetAssignedJob(const std::string& job_id) {
  absl::MutexLock l(&assigned_mu_);
  assigned_job_ = job_id;
}

bool WorkerSession::QueueReport(v1::WorkerReport report) {
  if (!report.has_host_state_released()) {
    const std::string* job = nullptr;
    switch (report.report_case()) {
      case v1::WorkerReport::kStepDone: job = &report.step_done().job_id(); break;
      case v1::WorkerReport::kJobFinished: job = &report.job_finished().job_id(); break;
      case v1::WorkerReport::kCommId: job = &report.comm_id().job_id(); break;
      case v1::WorkerReport::kStepLoss: job = &report.step_loss().job_id(); break;
      case v1::WorkerReport::kPolicyChosen: job = &report.policy_chosen().job_id(); break;
      case v1::WorkerReport::kEvalDone: job = &report.eval_done().job_id(); break;
      default: return false;  // a second hello, a report of a kind this hostd does not know
    }
    absl::MutexLock l(&assigned_mu_);
    if (assigned_job_.empty() || *job != assigned_job_) return false;
  }
  const size_t bytes = report.ByteSizeLong();
  return reports_.Push(std::move(report), bytes);
}

void WorkerSession::MarkGone() {
  commands_.Close();
  reports_.Close();
}

absl::StatusOr<std::shared_ptr<WorkerSession>> HostCore::AttachWorker(const v1::WorkerHello& hello) {
  // A worker's name shows in logs, metrics and error messages: 1-64 letters, digits, '.', '-', '_'.
  const std::string& id = hello.worker_id();
  if (id.empty()) return absl::InvalidArgumentError("worker hello without worker_id");
  if (id.size() > kMaxWorkerIdChars || !std::all_of(id.begin(), id.end(), [](unsigned char c) {
        return std::isalnum(c) || c == '.' || c == '-' || c == '_';
      })) {
    return absl::InvalidArgumentError(
        absl::StrCat("worker hello: worker_id of ", id.size(), " bytes: 1-64 letters, digits, '.', '-' or '_'"));
  }
  // The rest of the hello's names show in logs, plans and messages too: bounded, printable; and a
  // device kind hostd knows (the backends' "cpu" and "cuda").
  const v1::DeviceInfo& d = hello.device();
  if (d.kind() != "cpu" && d.kind() != "cuda") {
    return absl::InvalidArgumentError("worker hello: device kind must be \"cpu\" or \"cuda\"");
  }
  for (const auto& [field, value] : {std::pair<const char*, const std::string*>{"build", &hello.build()},
                                     {"device name", &d.name()},
                                     {"device uuid", &d.uuid()},
                                     {"device pci_bus_id", &d.pci_bus_id()}}) {
    if (value->size() > kMaxHelloStringChars ||
        !std::all_of(value->begin(), value->end(), [](unsigned char c) { return c >= 0x20 && c < 0x7f; })) {
      return absl::InvalidArgumentError(absl::StrCat("worker hello: ", field, " of ", value->size(), " bytes: at most ",
                                                     kMaxHelloStringChars, " printable ASCII characters"));
    }
  }
  absl::MutexLock l(&mu_);
  auto it = workers_.find(hello.worker_id());
  if (it != workers_.end() && !it->second->gone()) {
    return absl::AlreadyExistsError(
        absl::StrCat("worker '", hello.worker_id(), "' is already attached (pid ", it->second->hello().pid(), ")"));
  }
  auto w = std::make_shared<WorkerSession>(hello, next_session_serial_++);
  workers_[hello.worker_id()] = w;
  LOG(INFO) << "worker " << hello.worker_id() << " attached (pid " << hello.pid() << ", " << hello.device().kind()
            << " " << hello.device().name() << ")";
  return w;
}

void HostCore::DetachWorker(const std::shared_ptr<WorkerSession>& w) {
  w->MarkGone();
  absl::MutexLock l(&mu_);
  auto it = workers_.find(w->id());
  if (it != workers_.end() && it->second == w) workers_.erase(it);
  LOG(INFO) << "worker " << w->id() << " detached";
}

std::vector<v1::WorkerInfo> HostCore::ListWorkers() const {
  absl::MutexLock l(&mu_);
  std::vector<v1::WorkerInfo> out;
  for (const auto& [id, w] : workers_) {
    v1::WorkerInfo info;
    info.set_worker_id(id);
    info.set_pid(w->hello().pid());
    *info.mutable_device() = w->hello().device();
    info.set_connected_unix_ms(w->connected_unix_ms());
    auto j = worker_job_.find(id);
    info.set_state(j == worker_job_.end() ? "idle" : "running");
    if (j != worker_job_.end()) info.set_job_id(j->second);
    out.push_back(std::move(info));
  }
  return out;
}

v1::NodeInfo HostCore::GetNode() const {
  v1::NodeInfo n;
  n.set_node_name(options_.node_name);
  n.set_version(VersionString());
  if (options_.mesh != nullptr) n.set_instance_id(options_.mesh->instance_id());
  n.set_numa_nodes(options_.numa_nodes);
  n.set_update_threads(options_.update_threads);
  n.set_cpu_cores(static_cast<int>(sysconf(_SC_NPROCESSORS_ONLN)));
  if (auto mem = hostd::ReadHostMemoryInfo(); mem.ok()) {
    n.set_host_memory_bytes(static_cast<int64_t>(mem->mem_total_bytes));
    n.set_host_memory_available_bytes(static_cast<int64_t>(mem->mem_available_bytes));
    n.set_shm_free_bytes(static_cast<int64_t>(mem->shm_free_bytes));
  }
  for (auto& w : ListWorkers()) *n.add_workers() = std::move(w);
  absl::MutexLock l(&mu_);
  n.set_draining(draining_);
  return n;
}

}  // namespace slidedp::hostd
