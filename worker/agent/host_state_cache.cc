#include "worker/agent/host_state_cache.h"

#include <pthread.h>

#include "absl/time/clock.h"
#include "common/status/status_macros.h"
#include "glog/logging.h"

namespace slidedp::worker {

HostStateCache::HostStateCache(PipelineFactory& factory) : factory_(factory) {
  watcher_ = std::thread(&HostStateCache::Watch, this);
}

HostStateCache::~HostStateCache() {
  stop_ = true;
  if (watcher_.joinable()) watcher_.join();
  Drop("the worker stops");
}

absl::StatusOr<std::unique_ptr<HostState>> HostStateCache::Take(const std::string& segment) {
  ASSIGN_OR_RETURN(std::unique_ptr<shm::JobState> fresh, shm::JobState::Attach(segment, shm::Access::kReadWrite));
  {
    absl::MutexLock l(&mu_);
    if (cached_) {
      // hostd renamed the pooled file for this job and laid it out again in place: the mapping
      // (and the pages CUDA pinned through it) stay valid; re-read the layout through it.
      auto kept = cached_->js->segment().Identity(), now = fresh->segment().Identity();
      if (kept.ok() && now.ok() && kept->SameFile(*now) && cached_->js->bytes() == fresh->bytes()) {
        absl::Status s = cached_->js->Rebind();
        if (s.ok()) {
          LOG(INFO) << "state " << segment << ": the previous job's segment, still mapped and registered";
          return std::move(cached_);
        }
        LOG(WARNING) << "state " << segment << ": cannot re-read the kept mapping (" << s << "); mapping it again";
      }
    }
  }
  Drop("the job uses another state segment");
  auto hs = std::make_unique<HostState>();
  hs->js = std::move(fresh);
  hs->registry = factory_.NewHostRegistry();
  return hs;
}

void HostStateCache::Keep(std::unique_ptr<HostState> hs) {
  auto id = hs->js->segment().Identity();
  if (!id.ok() || id->links == 0) return;  // already removed by hostd: let it go now
  std::unique_ptr<HostState> old;
  absl::MutexLock l(&mu_);
  old = std::move(cached_);
  cached_ = std::move(hs);
}

void HostStateCache::Drop(const char* why) {
  std::unique_ptr<HostState> old;
  {
    absl::MutexLock l(&mu_);
    old = std::move(cached_);
  }
  if (!old) return;
  const std::string name = old->js->segment_name();
  factory_.UseDevice();  // the registering context
  old.reset();
  LOG(INFO) << "dropped the kept mapping of " << name << " (" << why << ")";
}

void HostStateCache::Watch() {
  pthread_setname_np(pthread_self(), "state-watch");
  int tick = 0;
  while (!stop_) {
    absl::SleepFor(absl::Milliseconds(100));
    if (++tick % 10 != 0) continue;
    bool unlinked = false;
    {
      absl::MutexLock l(&mu_);
      if (cached_) {
        auto id = cached_->js->segment().Identity();
        unlinked = !id.ok() || id->links == 0;
      }
    }
    if (unlinked) Drop("its file was removed");
  }
}

}  // namespace slidedp::worker
