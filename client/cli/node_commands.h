// The commands about the node hostd runs: `slidedp health` (is it serving?), `node` (devices,
// memory, workers) and `workers` (the attached workers; --json for scripts).
#pragma once

#include "CLI/CLI.hpp"
#include "client/cli/client.h"

namespace slidedp::client {

// Adds `health` to app. Run: prints hostd's serving status (UNREACHABLE when none answers).
CLI::App* AddHealthCommand(CLI::App& app);
int RunHealthCommand(const ClientOptions& client);

// Adds `node` to app. Run: the node's name, version, CPU, memory and one line per worker.
CLI::App* AddNodeCommand(CLI::App& app);
int RunNodeCommand(const ClientOptions& client);

struct WorkersCommand {
  bool json = false;  // --json: ListWorkersResponse as protobuf JSON
};

// Adds `workers` to app (parsing fills `command`). Run: one line per attached worker.
CLI::App* AddWorkersCommand(CLI::App& app, WorkersCommand& command);
int RunWorkersCommand(const WorkersCommand& command, const ClientOptions& client);

}  // namespace slidedp::client
