// The rendezvous store of a job over several nodes, as a worker reaches it: its own hostd's
// PeerService (StoreSet / StoreGet), which keeps it on the job's coordinating node or forwards
// there (hostd/mesh/node_mesh.h). The worker's cross-node group (GlooGroup) connects through it.
#pragma once

#include <memory>
#include <string>

#include "common/auth/hostd_channel.h"
#include "common/collective/key_value_store.h"

namespace slidedp::worker {

// A store of `job_id`'s keys at the hostd at `address` (the worker's own, with its credentials).
absl::StatusOr<std::shared_ptr<KeyValueStore>> HostdStore(const std::string& address,
                                                          const auth::ClientCredentialsOptions& credentials,
                                                          const std::string& job_id);

}  // namespace slidedp::worker
