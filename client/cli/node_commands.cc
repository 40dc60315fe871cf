// `slidedp health`, `node` and `workers` (node_commands.h).
#include "client/cli/node_commands.h"

#include <iostream>

#include "absl/strings/str_format.h"
#include "client/cli/command_io.h"

namespace slidedp::client {

CLI::App* AddHealthCommand(CLI::App& app) { return app.add_subcommand("health", "is hostd serving?"); }

int RunHealthCommand(const ClientOptions& client_options) {
  Client client(client_options);
  std::string st;
  absl::Status s = client.Health(&st);
  std::cout << (st.empty() ? "UNREACHABLE" : st) << "\n";
  return ReportResult(s);
}

CLI::App* AddNodeCommand(CLI::App& app) {
  return app.add_subcommand("node", "node information: devices, memory, workers");
}

int RunNodeCommand(const ClientOptions& client_options) {
  Client client(client_options);
  auto n = client.Node();
  if (!n.ok()) return ReportFailure(n.status());
  constexpr double kGiB = 1073741824.0;
  std::cout << absl::StrFormat(
      "node %s (%s)%s\n  cpu cores %d on %d NUMA node(s), %d LayerAdam threads\n"
      "  host memory %.1f GiB (%.1f available), /dev/shm free %.1f GiB\n",
      n->node_name(), n->version(), n->draining() ? " DRAINING" : "", n->cpu_cores(), n->numa_nodes(),
      n->update_threads(), n->host_memory_bytes() / kGiB, n->host_memory_available_bytes() / kGiB,
      n->shm_free_bytes() / kGiB);
  for (const auto& w : n->workers()) {
    std::cout << absl::StrFormat("  worker %s pid %d: %s %s %.1f GiB numa %d %s\n", w.worker_id(), w.pid(),
                                 w.device().kind(), w.device().name(), w.device().memory_bytes() / kGiB,
                                 w.device().numa_node(), w.state());
  }
  return 0;
}

CLI::App* AddWorkersCommand(CLI::App& app, WorkersCommand& command) {
  auto* cmd = app.add_subcommand("workers", "attached workers");
  AddJsonFlag(*cmd, command.json);
  return cmd;
}

int RunWorkersCommand(const WorkersCommand& command, const ClientOptions& client_options) {
  Client client(client_options);
  auto ws = client.Workers();
  if (!ws.ok()) return ReportFailure(ws.status());
  if (command.json) {
    v1::ListWorkersResponse all;
    for (const auto& w : *ws) *all.add_workers() = w;
    return PrintJson(all);
  }
  if (ws->empty()) std::cout << "no workers attached\n";
  for (const auto& w : *ws) {
    std::cout << absl::StrFormat("%-20s pid %-7d %-5s %-24s %s %s\n", w.worker_id(), w.pid(), w.device().kind(),
                                 w.device().name(), w.state(), w.job_id());
  }
  return 0;
}

}  // namespace slidedp::client
