// NodeMesh: this hostd's part in jobs over several nodes (runtime.nodes; docs/multi-node.md).
//
// The hostd a job is submitted to coordinates: it finds itself among the job's nodes (by instance
// id), asks every other node to join (each checks the spec and admits the job on its own workers
// before any starts), keeps the rendezvous store of the job's cross-node groups, collects every
// node's step (losses, the digest of its replicated state) and fails the job on every node when one
// node's job ends in error. The peers' hostds are reached over their gRPC PeerService with this
// node's peer credentials (TLS, client certificate or token, as any client of a TCP hostd).
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "common/auth/hostd_channel.h"
#include "slidedp/v1/slidedp.grpc.pb.h"

namespace slidedp::hostd {

struct NodeMeshOptions {
  std::string instance_id;  // random per hostd start (NodeInfo.instance_id)
  auth::ClientCredentialsOptions peer_credentials;
  // Where this node's workers listen for the other nodes' (Gloo's TCP): an address of this host the
  // other nodes reach.
  std::string node_address = "127.0.0.1";
  absl::Duration call_timeout = absl::Seconds(30);
};

// A job's nodes as one node sees them.
struct JobNodes {
  std::vector<std::string> nodes;  // runtime.nodes
  int self = 0;
  int coordinator = 0;
  bool coordinating() const { return self == coordinator; }
  int count() const { return static_cast<int>(nodes.size()); }
};

// Store values and keys a worker may set (addresses); a job's store holds at most this many keys.
inline constexpr size_t kMaxStoreValueBytes = 64 << 10;
inline constexpr size_t kMaxStoreKeyBytes = 512;
inline constexpr size_t kMaxStoreKeys = 4096;
inline constexpr absl::Duration kMaxStoreWait = absl::Minutes(10);
// A bandwidth probe streams at most this much.
inline constexpr int64_t kMaxProbeBytes = int64_t{256} << 20;

class NodeMesh {
 public:
  explicit NodeMesh(NodeMeshOptions options) : options_(std::move(options)) {}

  const std::string& instance_id() const { return options_.instance_id; }
  const std::string& node_address() const { return options_.node_address; }

  // This hostd's index in `nodes`: every node's GetNode, compared by instance id. NOT_FOUND when none
  // is this hostd; UNAVAILABLE names a node that does not answer.
  absl::StatusOr<int> FindSelf(const std::vector<std::string>& nodes);
  // Asks the hostd at `address` to join the job (JoinJob); its refusal comes back naming it.
  absl::StatusOr<v1::JoinJobResponse> Join(const std::string& address, const v1::JoinJobRequest& request);

  void Register(const std::string& job_id, JobNodes nodes);
  void Unregister(const std::string& job_id);
  std::optional<JobNodes> Find(const std::string& job_id) const;

  // The job's rendezvous store: kept here on the coordinator, forwarded to it from the other nodes.
  absl::Status StoreSet(const std::string& job_id, const std::string& key, const std::string& value);
  absl::StatusOr<std::string> StoreGet(const std::string& job_id, const std::string& key, absl::Duration timeout);

  // A node's step: kept here on the coordinator (from a peer's ReportNodeStep), sent to it otherwise.
  absl::Status ReportNodeStep(const v1::NodeStep& step);
  // The coordinator: every node's report of `step` but its own, in node order, waiting up to `timeout`
  // (DEADLINE_EXCEEDED names the nodes missing). Reports of earlier steps are dropped.
  absl::StatusOr<std::vector<v1::NodeStep>> WaitNodeSteps(const std::string& job_id, int64_t step,
                                                          absl::Duration timeout);

  // Bytes per second from this hostd to the one at `address`: `bytes` streamed over its PeerService
  // (gRPC, with TLS where it listens on TCP), timed to the answer; the best of `tries`.
  absl::StatusOr<double> MeasureBandwidth(const std::string& address, int64_t bytes, int tries = 2);

  // This node's job ended with `why`: the other nodes stop theirs (best effort, bounded calls).
  void AbortOthers(const std::string& job_id, const absl::Status& why);

 private:
  struct Job {
    JobNodes nodes;
    std::map<std::string, std::string> store;
    std::map<int64_t, std::map<int, v1::NodeStep>> steps;  // coordinator: by step, by node
  };
  absl::StatusOr<v1::PeerService::Stub*> Stub(const std::string& address);
  absl::StatusOr<std::string> CoordinatorOf(const std::string& job_id) const;

  const NodeMeshOptions options_;
  mutable absl::Mutex mu_;
  std::map<std::string, Job> jobs_ ABSL_GUARDED_BY(mu_);
  std::map<std::string, std::unique_ptr<v1::PeerService::Stub>> stubs_ ABSL_GUARDED_BY(mu_);
};

}  // namespace slidedp::hostd
