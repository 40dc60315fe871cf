// A group of processes on several nodes (issue 52, docs/multi-node.md) reducing host buffers over
// Gloo's TCP transport (Debian's libgloo-dev): the cross-node engine of CPU-backend workers, so that
// CI runs the same cross-node code on one machine as GPU workers run on NCCL.
//
// Rendezvous goes through a key-value store every rank reaches (KeyValueStore: the coordinating
// hostd's on a multi-node job), or a directory (Gloo's FileStore: tests), under a per-group prefix. Every collective is the ring
// algorithm, whose result is bitwise the same on every rank (each element's sum is formed once and
// copied around the ring): replicated host state stays bitwise equal across nodes.
//
// Gloo reports failures by exceptions; none leaves this class: each call returns a Status
// (DEADLINE_EXCEEDED for a peer that does not answer within the group's timeout, UNAVAILABLE for a
// lost connection, INVALID_ARGUMENT for bad sizes).
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "common/collective/key_value_store.h"
#include "common/collective/node_link.h"

namespace gloo {
class Context;
}  // namespace gloo

namespace slidedp {

struct GlooGroupOptions {
  int rank = 0;
  int size = 1;
  // The rendezvous: `store` when set, else the directory of a file store every rank can reach; and
  // the group's key prefix in it (one per group: a job id and a group name).
  std::shared_ptr<KeyValueStore> store;
  std::string store_dir;
  std::string prefix = "group";
  // The address this rank listens on (an interface's IP or a hostname resolving to one).
  std::string host = "127.0.0.1";
  absl::Duration timeout = absl::Seconds(60);
};

// As a NodeLink, rank = node.
class GlooGroup final : public NodeLink {
 public:
  // Connects the full mesh of `size` ranks (every rank calls it; returns once all are connected or
  // the timeout passed).
  static absl::StatusOr<std::unique_ptr<GlooGroup>> Connect(const GlooGroupOptions& options);
  ~GlooGroup() override;

  int rank() const { return rank_; }
  int size() const { return size_; }
  int node() const override { return rank_; }
  int nodes() const override { return size_; }

  // data[0, n) = the sum over the ranks of their data[0, n), the same bits on every rank.
  absl::Status AllReduceSum(float* data, int64_t n);
  // Every rank gets root's data[0, n).
  absl::Status Broadcast(float* data, int64_t n, int root) override;
  // Point to point (the chain of ChainReduce): the peer calls the matching Recv / Send.
  absl::Status Send(const float* data, int64_t n, int to) override;
  absl::Status Recv(float* data, int64_t n, int from) override;
  absl::Status AllGather(const float* mine, int64_t n, float* out) override;

 private:
  GlooGroup(std::shared_ptr<gloo::Context> context, int rank, int size, absl::Duration timeout);

  // Point-to-point slots live apart from the collectives' tags; the next collective moves them on,
  // so every node agrees on them as long as all call the same collectives (ChainReduce does).
  uint64_t PointSlot() const { return (uint64_t{1} << 32) | next_tag_; }

  std::shared_ptr<gloo::Context> context_;
  int rank_, size_;
  absl::Duration timeout_;
  uint32_t next_tag_ = 0;
};

}  // namespace slidedp
