// slidedp-hostd configuration: command-line flags over an optional YAML config file
// (/etc/slidedp/hostd.yaml under systemd). The parser is a library so it has tests.
#pragma once

#include <string>
#include <vector>

#include "absl/status/statusor.h"

namespace slidedp::hostd {

struct HostdConfig {
  std::string listen = "unix:/tmp/slidedp-hostd.sock";
  std::string node_name = "local";
  // AutoPolicy's layouts (runtime.policy: auto, hostd/engine/policy_cache.h); empty: <state_dir>/policies,
  // or none without a state dir.
  std::string policy_cache;
  std::string state_dir;                       // job records survive restarts here (systemd: /var/lib/slidedp); empty: memory only
  std::string tls_cert, tls_key;               // required for TCP listen addresses
  int update_threads = 0;                      // 0: from the topology
  int worker_wait_s = 300;                     // how long a queued job waits for workers
  std::string drain_mode = "checkpoint";       // on SIGTERM: "checkpoint" the running job, "finish" it, or "cancel"
  int metrics_port = 0;                        // Prometheus text on 127.0.0.1:PORT; 0 = off
  bool reclaim_stale = true;                   // unlink dead hostds' shm segments at start
  bool pool_host_state = true;                 // keep a finished job's state segment for the next job of the same model
  bool resume_interrupted = true;              // at start, resume jobs a dead hostd left: from shm, else a checkpoint
  // TCP client authentication (docs/operations.md, "Who may use hostd"): a TCP listener needs at
  // least one of these, or the loudly named opt-out.
  std::string tls_client_ca;    // PEM CA: clients presenting a certificate it signed may call
  std::string auth_token_file;  // clients presenting `authorization: Bearer <token>` may call
  bool dangerously_allow_unauthenticated_tcp = false;
  // The Unix socket's access policy: its group (empty: hostd's) and mode (0660 or 0600).
  std::string socket_group;
  std::string socket_mode = "0660";
  // Where jobs may write (hostd/core/output_policy.h). Empty output_root: <state_dir>/outputs.
  std::string output_root;
  std::vector<std::string> extra_output_root;  // absolute output.dir values may also lie below these
  bool allow_output_anywhere = false;          // any directory hostd can write (slidedp run's private hostd)
  // Jobs over several nodes (runtime.nodes; docs/multi-node.md): how this hostd calls the other
  // nodes' hostds (their CA, and this node's client certificate and key or token), and the address
  // of this host its workers listen on for the other nodes' (empty: 127.0.0.1, one machine).
  std::string peer_tls_ca, peer_tls_cert, peer_tls_key, peer_token_file;
  std::string node_address;
  std::string config_file;

  // Where this node's workers listen for the other nodes' (jobs over nodes): --node-address, else the
  // TCP --listen address's host when it names one, else (a wildcard or a Unix socket) `hostname` as
  // given, resolved by the workers' link (127.0.0.1 for a Unix socket: hostds on one machine).
  std::string NodeAddress(const std::string& hostname) const;

  // Parses argv (CLI11); a --config file's keys are the long flag names with '_' or '-'.
  // Flags given on the command line win over the file (extra_output_root: they add to its list).
  static absl::StatusOr<HostdConfig> Parse(int argc, const char* const* argv);
  std::string ToString() const;
  // socket_mode as a number (Parse has checked it).
  unsigned socket_mode_bits() const;
};

}  // namespace slidedp::hostd
