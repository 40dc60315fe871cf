// How each slidedp program starts its logging (glog), before anything can log: the daemons
// (slidedp-hostd, slidedp-worker) log everything to stderr (journald keeps it); the `slidedp`
// command line shows warnings and errors unless asked (-v: everything, --quiet: errors only).
// Also the one `--version` text of the three binaries.
#pragma once

#include <string>

namespace slidedp {

enum class LogVerbosity { kQuiet, kNormal, kVerbose };
enum class ProgramKind { kDaemon, kCommandLine };

// Call first thing in main; SetLogVerbosity may change the level once the flags are parsed.
void InitProgramLogging(const char* argv0, ProgramKind kind);
void SetLogVerbosity(ProgramKind kind, LogVerbosity verbosity);

}  // namespace slidedp
