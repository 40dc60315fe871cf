// HostStatePool: one pooled state segment between jobs; see host_state_pool.h.
#include "hostd/engine/host_state_pool.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "glog/logging.h"
#include "shm/shm_segment.h"

namespace slidedp::hostd {

HostStatePool::HostStatePool(std::string node_name, bool enabled)
    : node_name_(std::move(node_name)), enabled_(enabled) {}

HostStatePool::~HostStatePool() {
  if (!pooled_) return;
  (void)shm::UnlinkSegment(pooled_name_);
  for (const auto& w : pooled_holders_) {  // no wait: hostd is stopping, their sessions end too
    v1::HostCommand c;
    c.mutable_release_host_state()->set_segment(pooled_name_);
    w->commands().Push(c);
  }
}

void HostStatePool::ReleaseWorkerMappings(const Holders& holders, const std::string& segment) {
  const absl::Time t0 = absl::Now();
  Holders waiting;
  for (const auto& w : holders) {
    v1::HostCommand c;
    c.mutable_release_host_state()->set_segment(segment);
    if (w->commands().Push(c)) waiting.push_back(w);
  }
  const absl::Time deadline = t0 + absl::Seconds(5);
  for (const auto& w : waiting) {
    // Between jobs a worker reports nothing else that matters: earlier reports are stale.
    while (!w->gone()) {
      const absl::Duration left = deadline - absl::Now();
      if (left <= absl::ZeroDuration()) {
        LOG(WARNING) << "worker " << w->id() << " did not confirm releasing " << segment << " within 5 s";
        break;
      }
      auto rep = w->reports().Pop(std::min(left, absl::Milliseconds(100)));
      if (rep && rep->has_host_state_released()) break;
    }
  }
  if (!waiting.empty()) {
    LOG(INFO) << waiting.size() << " worker(s) released " << segment << " in "
              << absl::ToDoubleSeconds(absl::Now() - t0) << " s";
  }
}

std::unique_ptr<shm::JobState> HostStatePool::Take(const ModelLayout& layout, const shm::StateFormat& format) {
  if (!pooled_) return nullptr;
  std::unique_ptr<shm::JobState> js = std::move(pooled_);
  const uint64_t needed = shm::JobState::SegmentBytes(layout, format);
  if (needed == js->bytes()) {
    // Its holders find it mapped (and registered) again through its new name.
    taken_holders_ = std::move(pooled_holders_);
    pooled_holders_.clear();
    return js;
  }
  if (needed < js->bytes() && needed >= js->bytes() / 2) {
    // Laid out again in Adopt and shrunk: kept mappings would cover a shorter file.
    ReleaseWorkerMappings(pooled_holders_, pooled_name_);
    pooled_holders_.clear();
    return js;
  }
  LOG(INFO) << "freeing the pooled host state (" << js->bytes() / 1e9 << " GB): the next job needs " << needed / 1e9
            << " GB";
  (void)shm::UnlinkSegment(pooled_name_);
  js.reset();
  ReleaseWorkerMappings(pooled_holders_, pooled_name_);  // their mappings hold the pages too
  pooled_holders_.clear();
  return nullptr;
}

void HostStatePool::PutBack(std::unique_ptr<shm::JobState> js) {
  if (!js || pooled_) return;
  pooled_ = std::move(js);  // its file still has the pool's name
  pooled_holders_ = std::move(taken_holders_);
  taken_holders_.clear();
}

absl::StatusOr<std::unique_ptr<shm::JobState>> HostStatePool::Adopt(std::unique_ptr<shm::JobState> pooled,
                                                                    const std::string& job_id,
                                                                    const ModelLayout& layout,
                                                                    const shm::StateFormat& format,
                                                                    int prefault_threads) {
  const std::string pool_name = pooled_name_;
  absl::StatusOr<std::string> name = shm::MakeSegmentName(node_name_, job_id, "state");
  absl::Status renamed = name.ok() ? shm::RenameSegment(pool_name, *name) : name.status();
  if (!renamed.ok()) {
    (void)shm::UnlinkSegment(pool_name);
    return renamed;
  }
  if (shm::JobState::SegmentBytes(layout, format) == pooled->bytes()) {
    // The same size: re-lay it out through the mapping kept in the pool (no remap, no prefault).
    shm::JobStateOptions o;
    o.format = format;
    auto relaid = shm::JobState::Relayout(std::move(pooled), *name, job_id, layout, o);
    if (!relaid.ok()) (void)shm::UnlinkSegment(*name);
    return relaid;
  }
  pooled.reset();  // this mapping goes; the pages stay in the (renamed) file
  // A smaller layout: shm/ lays the file out again in place (header, region table, a fresh
  // control block with every gate at version 0), keeping its pages.
  shm::JobStateOptions o;
  o.format = format;
  o.prefault_threads = prefault_threads;
  auto reformatted = shm::JobState::Reformat(*name, job_id, layout, o);
  if (!reformatted.ok()) (void)shm::UnlinkSegment(*name);
  return reformatted;
}

void HostStatePool::Finish(std::unique_ptr<shm::JobState> js, bool poolable, const Holders& workers) {
  Holders holders = workers;
  for (auto& w : taken_holders_) {
    if (std::find(holders.begin(), holders.end(), w) == holders.end()) holders.push_back(w);
  }
  taken_holders_.clear();
  if (poolable && enabled_) {
    ReturnToPool(std::move(js), std::move(holders));
  } else {
    Discard(std::move(js), holders);  // workers keep a job's mapping after they finished it: tell them
  }
}

void HostStatePool::Discard(std::unique_ptr<shm::JobState> js, const Holders& holders) {
  const std::string name = js->segment_name();
  (void)js->Unlink();
  js.reset();
  ReleaseWorkerMappings(holders, name);
}

void HostStatePool::ReturnToPool(std::unique_ptr<shm::JobState> js, Holders holders) {
  if (pooled_) {  // at most one pooled segment
    (void)shm::UnlinkSegment(pooled_name_);
    pooled_.reset();
    ReleaseWorkerMappings(pooled_holders_, pooled_name_);
    pooled_holders_.clear();
  }
  absl::StatusOr<std::string> pool_name = shm::MakeSegmentName(node_name_, "pool", "pooled");
  absl::Status s = pool_name.ok() ? shm::RenameSegment(js->segment_name(), *pool_name) : pool_name.status();
  if (!s.ok()) {
    LOG(WARNING) << "cannot pool " << js->segment_name() << ": " << s;
    Discard(std::move(js), holders);
    return;
  }
  pooled_name_ = *pool_name;
  pooled_ = std::move(js);
  pooled_holders_ = std::move(holders);
}

}  // namespace slidedp::hostd
