#include "common/collective/node_link.h"

#include "absl/strings/str_cat.h"

namespace slidedp {
namespace {

// The chain's pass through this node: the earlier nodes' partial sum of data[0, n) in (node 0: none),
// this node's ranks added (local_sum), the result on to the next node (the last keeps it).
absl::Status ChainPass(NodeLink& link, float* data, int64_t n, float* scratch,
                       const std::function<absl::Status(const float* partial)>& local_sum) {
  const int node = link.node();
  const float* partial = nullptr;
  if (node > 0) {
    if (absl::Status s = link.Recv(scratch, n, node - 1); !s.ok()) {
      return absl::Status(s.code(), absl::StrCat("from node ", node - 1, ": ", s.message()));
    }
    partial = scratch;
  }
  if (absl::Status s = local_sum(partial); !s.ok()) return s;
  if (node + 1 < link.nodes()) {
    if (absl::Status s = link.Send(data, n, node + 1); !s.ok()) {
      return absl::Status(s.code(), absl::StrCat("to node ", node + 1, ": ", s.message()));
    }
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status ChainReduce(NodeLink& link, float* part, int64_t n, float* scratch,
                         const std::function<absl::Status(const float* partial)>& local_sum) {
  if (absl::Status s = ChainPass(link, part, n, scratch, local_sum); !s.ok()) return s;
  const int last = link.nodes() - 1;
  if (last == 0) return absl::OkStatus();
  return link.Broadcast(part, n, last);
}

absl::Status ChainReduceScatter(NodeLink& link, float* packed, int64_t n, float* scratch,
                                const std::function<absl::Status(const float* partial)>& local_sum) {
  const int node = link.node();
  const int last = link.nodes() - 1;
  if (absl::Status s = ChainPass(link, packed, n * link.nodes(), scratch, local_sum); !s.ok()) return s;
  if (node < last) {
    if (absl::Status s = link.Recv(packed + node * n, n, last); !s.ok()) {
      return absl::Status(s.code(), absl::StrCat("own piece from node ", last, ": ", s.message()));
    }
    return absl::OkStatus();
  }
  for (int m = 0; m < last; ++m) {  // the last node holds every total: each node gets its own
    if (absl::Status s = link.Send(packed + m * n, n, m); !s.ok()) {
      return absl::Status(s.code(), absl::StrCat("piece to node ", m, ": ", s.message()));
    }
  }
  return absl::OkStatus();
}

}  // namespace slidedp
