// glog's start for slidedp's programs; see program_logging.h.
#include "common/log/program_logging.h"

#include "common/version.h"
#include "glog/logging.h"

namespace slidedp {

void InitProgramLogging(const char* argv0, ProgramKind kind) {
  FLAGS_logtostderr = true;
  google::InitGoogleLogging(argv0);
  SetLogVerbosity(kind, LogVerbosity::kNormal);
}

void SetLogVerbosity(ProgramKind kind, LogVerbosity verbosity) {
  switch (verbosity) {
    case LogVerbosity::kQuiet: FLAGS_minloglevel = google::GLOG_ERROR; break;
    case LogVerbosity::kVerbose: FLAGS_minloglevel = google::GLOG_INFO; break;
    case LogVerbosity::kNormal:
      FLAGS_minloglevel = kind == ProgramKind::kDaemon ? google::GLOG_INFO : google::GLOG_WARNING;
      break;
  }
}


}  // namespace slidedp
