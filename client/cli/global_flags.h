// `slidedp`'s flags before the subcommand: --version, log verbosity, and how to reach hostd
// (address, timeout, TLS and token for a TCP address), whose defaults come from the environment.
#pragma once

#include "absl/status/status.h"
#include "CLI/CLI.hpp"
#include "client/cli/client.h"

namespace slidedp::client {

struct GlobalFlags {
  bool verbose = false;  // -v: log everything (info)
  bool quiet = false;    // -q: log errors only
  ClientOptions client;  // --hostd, --timeout, --tls-*, --token-file
};

// Adds the global flags to `app` (parsing fills `flags`, which must outlive it). The environment
// (SLIDEDP_HOSTD, SLIDEDP_TLS_*, SLIDEDP_TOKEN_FILE) is read here, so that a flag overrides it.
void AddGlobalFlags(CLI::App& app, GlobalFlags& flags);

// After parsing: INVALID_ARGUMENT for a --timeout out of range (CheckTimeout); else sets the
// command line's log verbosity when -v or -q was given.
absl::Status ApplyGlobalFlags(const GlobalFlags& flags);

}  // namespace slidedp::client
