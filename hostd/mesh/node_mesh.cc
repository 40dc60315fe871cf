#include "hostd/mesh/node_mesh.h"

#include <algorithm>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/time/clock.h"
#include "common/status/grpc_status.h"
#include "common/status/status_macros.h"

namespace slidedp::hostd {
namespace {

std::unique_ptr<grpc::ClientContext> CallContext(absl::Duration timeout) {
  auto ctx = std::make_unique<grpc::ClientContext>();
  ctx->set_deadline(std::chrono::system_clock::now() + std::chrono::milliseconds(absl::ToInt64Milliseconds(timeout)));
  return ctx;
}

absl::Status Named(const absl::Status& s, const std::string& what) {
  return s.ok() ? s : absl::Status(s.code(), absl::StrCat(what, ": ", s.message()));
}

}  // namespace

absl::StatusOr<v1::PeerService::Stub*> NodeMesh::Stub(const std::string& address) {
  absl::MutexLock l(&mu_);
  auto it = stubs_.find(address);
  if (it != stubs_.end()) return it->second.get();
  ASSIGN_OR_RETURN(std::shared_ptr<grpc::Channel> channel,
                   auth::CreateHostdChannel(address, options_.peer_credentials));
  auto stub = v1::PeerService::NewStub(channel);
  v1::PeerService::Stub* raw = stub.get();
  stubs_[address] = std::move(stub);
  return raw;
}

absl::StatusOr<int> NodeMesh::FindSelf(const std::vector<std::string>& nodes) {
  for (size_t i = 0; i < nodes.size(); ++i) {
    ASSIGN_OR_RETURN(std::shared_ptr<grpc::Channel> channel,
                     auth::CreateHostdChannel(nodes[i], options_.peer_credentials));
    auto stub = v1::NodeService::NewStub(channel);
    auto ctx = CallContext(options_.call_timeout);
    v1::NodeInfo info;
    absl::Status s = FromGrpc(stub->GetNode(ctx.get(), v1::GetNodeRequest(), &info));
    if (!s.ok()) return absl::Status(s.code(), absl::StrCat("runtime.nodes[", i, "] ", nodes[i], ": ", s.message()));
    if (info.instance_id() == options_.instance_id) return static_cast<int>(i);
  }
  return absl::InvalidArgumentError(
      absl::StrCat("runtime.nodes does not list the hostd the job was submitted to (", nodes.size(),
                   " nodes asked; submit the job to one of them)"));
}

absl::StatusOr<v1::JoinJobResponse> NodeMesh::Join(const std::string& address, const v1::JoinJobRequest& request) {
  ASSIGN_OR_RETURN(v1::PeerService::Stub * stub, Stub(address));
  auto ctx = CallContext(options_.call_timeout);
  v1::JoinJobResponse resp;
  RETURN_IF_ERROR(
      Named(FromGrpc(stub->JoinJob(ctx.get(), request, &resp)), absl::StrCat("node ", request.node(), " (", address, ")")));
  return resp;
}

void NodeMesh::Register(const std::string& job_id, JobNodes nodes) {
  absl::MutexLock l(&mu_);
  jobs_[job_id] = Job{std::move(nodes), {}, {}};
}

void NodeMesh::Unregister(const std::string& job_id) {
  absl::MutexLock l(&mu_);
  jobs_.erase(job_id);
}

std::optional<JobNodes> NodeMesh::Find(const std::string& job_id) const {
  absl::MutexLock l(&mu_);
  auto it = jobs_.find(job_id);
  if (it == jobs_.end()) return std::nullopt;
  return it->second.nodes;
}

absl::StatusOr<std::string> NodeMesh::CoordinatorOf(const std::string& job_id) const {
  absl::MutexLock l(&mu_);
  auto it = jobs_.find(job_id);
  if (it == jobs_.end()) return absl::NotFoundError(absl::StrCat("no job '", job_id, "' over nodes here"));
  if (it->second.nodes.coordinating()) return std::string();
  return it->second.nodes.nodes[it->second.nodes.coordinator];
}

absl::Status NodeMesh::StoreSet(const std::string& job_id, const std::string& key, const std::string& value) {
  if (key.empty() || key.size() > kMaxStoreKeyBytes || value.size() > kMaxStoreValueBytes) {
    return absl::InvalidArgumentError(absl::StrCat("store: a key of 1-", kMaxStoreKeyBytes, " bytes and a value of at most ",
                                                   kMaxStoreValueBytes, " bytes"));
  }
  ASSIGN_OR_RETURN(std::string coordinator, CoordinatorOf(job_id));
  if (!coordinator.empty()) {
    ASSIGN_OR_RETURN(v1::PeerService::Stub * stub, Stub(coordinator));
    v1::StoreSetRequest req;
    req.set_job_id(job_id);
    req.set_key(key);
    req.set_value(value);
    v1::PeerAck ack;
    auto ctx = CallContext(options_.call_timeout);
    return Named(FromGrpc(stub->StoreSet(ctx.get(), req, &ack)), "the coordinating node's store");
  }
  absl::MutexLock l(&mu_);
  auto it = jobs_.find(job_id);
  if (it == jobs_.end()) return absl::NotFoundError(absl::StrCat("no job '", job_id, "' over nodes here"));
  if (it->second.store.size() >= kMaxStoreKeys && !it->second.store.count(key)) {
    return absl::ResourceExhaustedError(absl::StrCat("store: the job's ", kMaxStoreKeys, " keys are set"));
  }
  it->second.store[key] = value;
  return absl::OkStatus();
}

absl::StatusOr<std::string> NodeMesh::StoreGet(const std::string& job_id, const std::string& key,
                                               absl::Duration timeout) {
  timeout = std::clamp(timeout, absl::ZeroDuration(), kMaxStoreWait);
  ASSIGN_OR_RETURN(std::string coordinator, CoordinatorOf(job_id));
  if (!coordinator.empty()) {
    ASSIGN_OR_RETURN(v1::PeerService::Stub * stub, Stub(coordinator));
    v1::StoreGetRequest req;
    req.set_job_id(job_id);
    req.set_key(key);
    req.set_timeout_ms(absl::ToInt64Milliseconds(timeout));
    v1::StoreGetResponse resp;
    auto ctx = CallContext(timeout + options_.call_timeout);
    RETURN_IF_ERROR(Named(FromGrpc(stub->StoreGet(ctx.get(), req, &resp)), "the coordinating node's store"));
    return resp.value();
  }
  absl::MutexLock l(&mu_);
  auto ready = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    auto it = jobs_.find(job_id);
    return it == jobs_.end() || it->second.store.count(key) > 0;
  };
  mu_.AwaitWithTimeout(absl::Condition(&ready), timeout);
  auto it = jobs_.find(job_id);
  if (it == jobs_.end()) return absl::AbortedError(absl::StrCat("job '", job_id, "' ended"));
  auto v = it->second.store.find(key);
  if (v == it->second.store.end()) {
    return absl::DeadlineExceededError(absl::StrCat("store: key '", key, "' not set within ", absl::FormatDuration(timeout)));
  }
  return v->second;
}

absl::Status NodeMesh::ReportNodeStep(const v1::NodeStep& step) {
  ASSIGN_OR_RETURN(std::string coordinator, CoordinatorOf(step.job_id()));
  if (!coordinator.empty()) {
    ASSIGN_OR_RETURN(v1::PeerService::Stub * stub, Stub(coordinator));
    v1::PeerAck ack;
    auto ctx = CallContext(options_.call_timeout);
    return Named(FromGrpc(stub->ReportNodeStep(ctx.get(), step, &ack)), "reporting the step to the coordinating node");
  }
  absl::MutexLock l(&mu_);
  auto it = jobs_.find(step.job_id());
  if (it == jobs_.end()) return absl::NotFoundError(absl::StrCat("no job '", step.job_id(), "' over nodes here"));
  Job& job = it->second;
  if (step.node() < 0 || step.node() >= job.nodes.count() || step.node() == job.nodes.self) {
    return absl::InvalidArgumentError(absl::StrCat("a step report from node ", step.node(), " of ", job.nodes.count()));
  }
  if (step.step() < 0 || step.loss_sums_size() > 4096) return absl::InvalidArgumentError("a malformed step report");
  // Reports run at most a step ahead of the coordinator's own (the gradients' chain keeps the nodes
  // in step); anything further is a confused peer, not memory to hold.
  if (job.steps.size() > 8 && !job.steps.count(step.step())) {
    return absl::ResourceExhaustedError("step reports of more than 8 steps are waiting");
  }
  job.steps[step.step()][step.node()] = step;
  return absl::OkStatus();
}

absl::StatusOr<std::vector<v1::NodeStep>> NodeMesh::WaitNodeSteps(const std::string& job_id, int64_t step,
                                                                 absl::Duration timeout) {
  absl::MutexLock l(&mu_);
  auto complete = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    auto it = jobs_.find(job_id);
    if (it == jobs_.end()) return true;
    auto s = it->second.steps.find(step);
    return s != it->second.steps.end() && static_cast<int>(s->second.size()) == it->second.nodes.count() - 1;
  };
  mu_.AwaitWithTimeout(absl::Condition(&complete), timeout);
  auto it = jobs_.find(job_id);
  if (it == jobs_.end()) return absl::AbortedError(absl::StrCat("job '", job_id, "' ended"));
  Job& job = it->second;
  std::map<int, v1::NodeStep>& got = job.steps[step];
  std::vector<std::string> missing;
  for (int n = 0; n < job.nodes.count(); ++n) {
    if (n != job.nodes.self && !got.count(n)) missing.push_back(absl::StrCat("node ", n, " (", job.nodes.nodes[n], ")"));
  }
  if (!missing.empty()) {
    return absl::DeadlineExceededError(absl::StrCat("step ", step + 1, ": no report from ", absl::StrJoin(missing, ", "),
                                                    " within ", absl::FormatDuration(timeout),
                                                    ": its hostd or the network to it is gone"));
  }
  std::vector<v1::NodeStep> out;
  for (auto& [n, s] : got) out.push_back(std::move(s));
  job.steps.erase(job.steps.begin(), job.steps.upper_bound(step));
  return out;
}

absl::StatusOr<double> NodeMesh::MeasureBandwidth(const std::string& address, int64_t bytes, int tries) {
  bytes = std::clamp<int64_t>(bytes, 1 << 20, kMaxProbeBytes);
  ASSIGN_OR_RETURN(v1::PeerService::Stub * stub, Stub(address));
  v1::ProbeChunk chunk;
  chunk.set_data(std::string(1 << 20, '\x5a'));
  double best = 0;
  for (int t = 0; t < tries; ++t) {
    auto ctx = CallContext(options_.call_timeout);
    v1::ProbeResult result;
    const absl::Time t0 = absl::Now();
    std::unique_ptr<grpc::ClientWriter<v1::ProbeChunk>> writer = stub->Probe(ctx.get(), &result);
    for (int64_t sent = 0; sent < bytes; sent += chunk.data().size()) {
      if (!writer->Write(chunk)) break;
    }
    writer->WritesDone();
    RETURN_IF_ERROR(Named(FromGrpc(writer->Finish()), absl::StrCat("bandwidth probe of ", address)));
    const double s = absl::ToDoubleSeconds(absl::Now() - t0);
    if (s > 0) best = std::max(best, static_cast<double>(result.bytes()) / s);
  }
  return best;
}

void NodeMesh::AbortOthers(const std::string& job_id, const absl::Status& why) {
  std::optional<JobNodes> nodes = Find(job_id);
  if (!nodes) return;
  for (int n = 0; n < nodes->count(); ++n) {
    if (n == nodes->self) continue;
    absl::StatusOr<v1::PeerService::Stub*> stub = Stub(nodes->nodes[n]);
    if (!stub.ok()) continue;
    v1::AbortJobRequest req;
    req.set_job_id(job_id);
    req.set_node(nodes->self);
    req.set_code(static_cast<int>(why.code()));
    req.set_message(std::string(why.message().substr(0, 4096)));
    v1::PeerAck ack;
    auto ctx = CallContext(absl::Seconds(5));
    (*stub)->AbortJob(ctx.get(), req, &ack);  // best effort: a node that is gone times out on its own
  }
}

}  // namespace slidedp::hostd
