// runtime.nodes from the command line (`slidedp submit --nodes`): a comma list of hostd addresses, a
// file of them (one per line, '#' comments), or Slurm's SLURM_JOB_NODELIST (its hostlist syntax:
// "gpu[01-04,07],login-a", several bracket groups a name) with one port for every node.
#pragma once

#include <string>
#include <vector>

#include "absl/status/statusor.h"

namespace slidedp {

// Slurm's hostlist expanded in order: "n[1-3]" -> n1 n2 n3, "n[08-10]" -> n08 n09 n10 (the width of
// the range's first bound kept), "r[1-2]-n[1-2]" -> r1-n1 r1-n2 r2-n1 r2-n2. INVALID_ARGUMENT for a
// malformed list, or one of more than kMaxJobNodes names.
absl::StatusOr<std::vector<std::string>> ExpandHostlist(const std::string& hostlist);

// What `--nodes` names: "slurm" (SLURM_JOB_NODELIST, `slurm_nodelist`, with `port`), "@FILE"
// (addresses one per line), or a comma list. Each address is checked as runtime.nodes checks it; a
// name without a port gets `port` (0: required in the name).
absl::StatusOr<std::vector<std::string>> NodesFromArgument(const std::string& argument, int port,
                                                           const char* slurm_nodelist);

// The spec's text with runtime.nodes set to `nodes` (replacing any list it gives). INVALID_ARGUMENT
// when the text is not a YAML map (whose runtime, if any, is a map). Comments are not kept.
absl::StatusOr<std::string> SpecWithNodes(const std::string& spec_yaml, const std::vector<std::string>& nodes);

}  // namespace slidedp
