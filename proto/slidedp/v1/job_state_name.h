// Lower-case names of slidedp.v1 job states ("running", "succeeded", ...), shared by hostd
// (logs, metrics labels) and the CLI.
#pragma once

#include "slidedp/v1/slidedp.pb.h"

namespace slidedp::v1 {

inline const char* JobStateName(JobState s) {
  switch (s) {
    case JOB_STATE_QUEUED: return "queued";
    case JOB_STATE_STARTING: return "starting";
    case JOB_STATE_RUNNING: return "running";
    case JOB_STATE_SAVING: return "saving";
    case JOB_STATE_SUCCEEDED: return "succeeded";
    case JOB_STATE_FAILED: return "failed";
    case JOB_STATE_CANCELLED: return "cancelled";
    default: return "unspecified";
  }
}

}  // namespace slidedp::v1
