// gRPC services of slidedp-hostd: thin translations between slidedp.v1 messages and HostCore.
#pragma once

#include <map>
#include <memory>
#include <string>
#include <thread>

#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "common/status/grpc_status.h"
#include "grpcpp/grpcpp.h"
#include "hostd/core/host_core.h"
#include "slidedp/v1/slidedp.grpc.pb.h"

namespace slidedp::hostd {

class JobServiceImpl final : public v1::JobService::Service {
 public:
  explicit JobServiceImpl(HostCore* core) : core_(core) {}
  grpc::Status SubmitJob(grpc::ServerContext*, const v1::SubmitJobRequest*, v1::SubmitJobResponse*) override;
  grpc::Status PlanJob(grpc::ServerContext*, const v1::PlanJobRequest*, v1::PlanJobResponse*) override;
  grpc::Status GetJob(grpc::ServerContext*, const v1::GetJobRequest*, v1::Job*) override;
  grpc::Status ListJobs(grpc::ServerContext*, const v1::ListJobsRequest*, v1::ListJobsResponse*) override;
  grpc::Status CancelJob(grpc::ServerContext*, const v1::CancelJobRequest*, v1::Job*) override;
  grpc::Status WatchJob(grpc::ServerContext*, const v1::WatchJobRequest*, grpc::ServerWriter<v1::JobEvent>*) override;

 private:
  HostCore* core_;
};

class NodeServiceImpl final : public v1::NodeService::Service {
 public:
  explicit NodeServiceImpl(HostCore* core) : core_(core) {}
  grpc::Status GetNode(grpc::ServerContext*, const v1::GetNodeRequest*, v1::NodeInfo*) override;
  grpc::Status ListWorkers(grpc::ServerContext*, const v1::ListWorkersRequest*, v1::ListWorkersResponse*) override;

 private:
  HostCore* core_;
};

// Between hostds (a job over several nodes, hostd/mesh/node_mesh.h), and the workers' rendezvous
// store (their own hostd's, which forwards to the job's coordinator).
class PeerServiceImpl final : public v1::PeerService::Service {
 public:
  explicit PeerServiceImpl(HostCore* core, NodeMesh* mesh) : core_(core), mesh_(mesh) {}
  grpc::Status JoinJob(grpc::ServerContext*, const v1::JoinJobRequest*, v1::JoinJobResponse*) override;
  grpc::Status StoreSet(grpc::ServerContext*, const v1::StoreSetRequest*, v1::PeerAck*) override;
  grpc::Status StoreGet(grpc::ServerContext*, const v1::StoreGetRequest*, v1::StoreGetResponse*) override;
  grpc::Status ReportNodeStep(grpc::ServerContext*, const v1::NodeStep*, v1::PeerAck*) override;
  grpc::Status AbortJob(grpc::ServerContext*, const v1::AbortJobRequest*, v1::PeerAck*) override;
  // Counts what a peer streams (at most kMaxProbeBytes), for its bandwidth measurement.
  grpc::Status Probe(grpc::ServerContext*, grpc::ServerReader<v1::ProbeChunk>*, v1::ProbeResult*) override;

 private:
  HostCore* core_;
  NodeMesh* mesh_;  // null: jobs over nodes are off
};

// Worker sessions open at once (attached or saying hello), each holding a thread or two: a GPU
// server has at most a few dozen workers.
inline constexpr int kMaxWorkerSessions = 512;
// A session that sends no hello this long after it opened is cancelled (the worker sees
// CANCELLED), so silent streams do not hold threads.
inline constexpr absl::Duration kHelloTimeout = absl::Seconds(10);
// gRPC's synchronous server takes a thread per call in flight; past this many it answers new
// calls RESOURCE_EXHAUSTED instead of growing without end (sessions and watchers are capped
// below it: kMaxWorkerSessions, kMaxWatchers).
inline constexpr int kMaxServerThreads = 4096;

class WorkerServiceImpl final : public v1::WorkerService::Service {
 public:
  explicit WorkerServiceImpl(HostCore* core);
  ~WorkerServiceImpl() override;  // stops the hello watchdog
  grpc::Status Session(grpc::ServerContext*, grpc::ServerReaderWriter<v1::HostCommand, v1::WorkerReport>*) override;

 private:
  // Cancels the sessions whose hello is overdue (one thread for all of them).
  void HelloWatchdog();

  HostCore* core_;
  absl::Mutex mu_;
  std::map<grpc::ServerContext*, absl::Time> awaiting_hello_ ABSL_GUARDED_BY(mu_);
  int sessions_ ABSL_GUARDED_BY(mu_) = 0;
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  std::thread watchdog_;
};

// The whole server: services + health + reflection on a Unix socket (its mode and group are the
// access policy) or TCP (TLS, and client authentication: client_auth.h).
enum class TcpClientAuth { kRequired, kDangerouslyNone };

struct ServerOptions {
  std::string listen = "unix:/tmp/slidedp-hostd.sock";  // "unix:PATH" or "HOST:PORT"
  std::string tls_cert_file, tls_key_file;              // required for TCP listeners
  std::string tls_client_ca_file;                       // TCP: accept client certificates this CA signed
  std::string auth_token_file;                          // TCP: accept this bearer token (file mode 0600)
  // kRequired: a TCP listener without a client CA or a token is refused at Start.
  TcpClientAuth tcp_client_auth = TcpClientAuth::kRequired;
  std::string socket_group;     // Unix: chgrp the socket (empty: hostd's group)
  unsigned socket_mode = 0660;  // Unix: within 0660
  NodeMesh* mesh = nullptr;     // PeerService's (null: it refuses every call)
};

class HostServer {
 public:
  static absl::StatusOr<std::unique_ptr<HostServer>> Start(HostCore* core, const ServerOptions& options);
  ~HostServer();
  void SetServing(bool serving);  // grpc.health.v1 status of "" and "slidedp.v1.JobService"
  void Shutdown();
  void Wait();
  const std::string& address() const { return address_; }

 private:
  HostServer() = default;
  std::unique_ptr<JobServiceImpl> jobs_;
  std::unique_ptr<NodeServiceImpl> node_;
  std::unique_ptr<WorkerServiceImpl> workers_;
  std::unique_ptr<PeerServiceImpl> peers_;
  std::unique_ptr<grpc::Server> server_;
  std::string address_;
};

}  // namespace slidedp::hostd
