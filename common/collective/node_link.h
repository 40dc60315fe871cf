// The cross-node half of a multi-node job's gradient reduction (issue 52, docs/multi-node.md): the
// ranks of one local index, one per node, joined by an engine that moves buffers between nodes —
// Gloo over TCP for CPU-backend workers (GlooGroup), NCCL for GPU workers (worker/comm). Both run
// the same chain below; only the link differs.
//
// The chain: node 0 reduces its own ranks' part and sends it to node 1; node n receives the partial
// sum of every rank before it, lets its own ranks add to it in rank order, and sends it on; the last
// node holds the total and broadcasts it. Every element is then summed in global rank order — the
// bits a single node with all the ranks gets from its rank-order reduction (shm/shm_collective.h) —
// and every node holds the same bits, so replicated host states stay bitwise equal. Each node's link
// carries the part about twice (in, out, and the broadcast), as a ring all-reduce's 2(N-1)/N does.
#pragma once

#include <cstdint>
#include <functional>

#include "absl/status/status.h"

namespace slidedp {

class NodeLink {
 public:
  virtual ~NodeLink() = default;
  virtual int node() const = 0;   // this rank's node, 0-based
  virtual int nodes() const = 0;  // the job's node count
  // Point to point between two nodes' ranks of this local index; n floats.
  virtual absl::Status Send(const float* data, int64_t n, int to_node) = 0;
  virtual absl::Status Recv(float* data, int64_t n, int from_node) = 0;
  // Every node gets root's data[0, n).
  virtual absl::Status Broadcast(float* data, int64_t n, int root) = 0;
  // out[m * n, +n) = node m's mine[0, n) for every node m (out holds nodes() * n floats; mine may
  // alias this node's slice of it). Bytes of any type travel as floats, bit for bit.
  virtual absl::Status AllGather(const float* mine, int64_t n, float* out) = 0;
};

// Sums `part` (n floats) over every rank of the job, in global rank order, into `part` on every node.
// `local_sum(partial)` must leave in `part` the sum, in rank order, of this node's ranks' part added to
// `partial` (n floats, the sum of every earlier node's ranks), or with partial null (node 0) just that
// sum; `scratch` holds n floats. With one node it is local_sum(nullptr).
absl::Status ChainReduce(NodeLink& link, float* part, int64_t n, float* scratch,
                         const std::function<absl::Status(const float* partial)>& local_sum);

// The sharded state's reduce-scatter over nodes (runtime.node_state sharded, common/model/node_shard.h):
// `packed` holds nodes() pieces of n floats, piece m the part of this rank's local index in node m's
// range. The same chain as ChainReduce carries all pieces (`local_sum(partial)` must leave in packed
// this node's ranks' sum of every piece added to partial's, in rank order), and the last node sends
// each node only its own piece: afterwards packed[node() * n, +n) holds the sum over every rank of the
// job, in global rank order; the other pieces hold partial sums. `scratch` holds nodes() * n floats.
absl::Status ChainReduceScatter(NodeLink& link, float* packed, int64_t n, float* scratch,
                                const std::function<absl::Status(const float* partial)>& local_sum);

}  // namespace slidedp
