// HostMirrorStreamer: in-place reads of the shared-memory mirror for the CPU backend, or casts
// of the master where the segment keeps no mirror.
#include "worker/pipeline/unit_streamer.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "common/model/shard.h"
#include "common/status/status_macros.h"

namespace slidedp {

HostMirrorStreamer::HostMirrorStreamer(shm::JobState* state, const ModelLayout& layout, absl::Duration gate_timeout,
                                       Dtype norms, Dtype embedding, UploadSource source, int cast_threads)
    : state_(state),
      publisher_(state->owner()),
      layout_(layout),
      gate_timeout_(gate_timeout),
      norms_(norms),
      embedding_(embedding),
      source_(source) {
  side_.resize(layout.num_units());
  if (source == UploadSource::kMaster) {
    casts_.resize(layout.num_units());
    cast_pool_ = std::make_unique<CastPool>(std::max(1, cast_threads));
  }
  for (int u = 0; u < layout.num_units(); ++u) side_[u].resize(layout.units[u].fp32_numel);
}

absl::StatusOr<UnitParams> HostMirrorStreamer::Acquire(int unit, uint32_t min_version) {
  absl::Time t0 = absl::Now();
  absl::Status s = state_->version(unit).WaitAtLeast(min_version, gate_timeout_, state_->abort(), publisher_);
  gate_wait_s_ += absl::ToDoubleSeconds(absl::Now() - t0);
  if (!s.ok()) return absl::Status(s.code(), absl::StrCat("version gate of unit ", unit, ": ", s.message()));
  const bf16_t* values = state_->mirror(unit);
  if (ShardedUnit(unit)) {  // every node's range, gathered into a buffer held like a cast's
    if (casts_.empty()) casts_.resize(layout_.num_units());
    Cast& c = casts_[unit];
    if (c.users == 0 || c.gate != min_version) {
      if (c.values.empty() && !spare_.empty()) {
        c.values = std::move(spare_.back());
        spare_.pop_back();
      }
      RETURN_IF_ERROR(GatherUnit(unit, c.values, side_[unit]));
      c.gate = min_version;
    }
    c.users++;
    const bool side = norms_ == Dtype::kF32 && !side_[unit].empty();
    return UnitParams(c.values.data(), side ? side_[unit].data() : nullptr);
  }
  if (source_ == UploadSource::kMaster) {
    // Read after the gate, as the mirror would be: the unit's next update needs this step's
    // gradients, so it cannot start before the compute that reads these values.
    Cast& c = casts_[unit];
    if (c.users == 0 || c.gate != min_version) {
      if (c.values.empty() && !spare_.empty()) {
        c.values = std::move(spare_.back());
        spare_.pop_back();
      }
      const int64_t n = layout_.units[unit].numel;
      c.values.resize(n);
      const absl::Time c0 = absl::Now();
      const float* master = state_->master(unit);
      cast_pool_->Cast(master, c.values.data(), n);
      cast_s_ += absl::ToDoubleSeconds(absl::Now() - c0);
      c.gate = min_version;
    }
    c.users++;
    values = c.values.data();
  } else if (values == nullptr) {
    return absl::FailedPreconditionError("the job segment keeps no BF16 mirror (runtime.param_source)");
  }
  if (layout_.units[unit].kind == UnitKind::kEmbedding) {
    return UnitParams(values, embedding_ == Dtype::kF32 ? state_->master(unit) : nullptr);
  }
  std::vector<float>& side = side_[unit];
  if (norms_ != Dtype::kF32 || side.empty()) return UnitParams(values);
  // Read after the gate: the unit's next update needs this step's gradients, so it cannot start
  // before the compute that reads these values.
  CopyNormsFromMaster(layout_.units[unit], state_->master(unit), side.data());
  return UnitParams(values, side.data());
}

void HostMirrorStreamer::Release(int unit) {
  if ((source_ != UploadSource::kMaster && !ShardedUnit(unit)) || unit < 0 ||
      unit >= static_cast<int>(casts_.size())) {
    return;
  }
  Cast& c = casts_[unit];
  if (c.users == 0 || --c.users > 0) return;
  spare_.push_back(std::move(c.values));
  c.values = {};
}

void HostMirrorStreamer::ShardOverNodes(const NodeSharding* sharding, NodeLink* link, shm::ShmCollective* collective,
                                        int rank, int world) {
  sharding_ = sharding;
  link_ = link;
  collective_ = collective;
  rank_ = rank;
  world_ = world;
}

absl::Status HostMirrorStreamer::GatherUnit(int unit, std::vector<bf16_t>& values, std::vector<float>& side) {
  const NodeSharding& sh = *sharding_;
  if (link_ == nullptr || link_->nodes() != sh.nodes) {
    return absl::FailedPreconditionError("runtime.node_state sharded without the link to the other nodes");
  }
  if (world_ > 1 && collective_ == nullptr) return absl::FailedPreconditionError("sharded nodes without a collective");
  const UnitLayout& ul = layout_.units[unit];
  const int64_t numel = ul.numel;
  const int nodes = sh.nodes;
  const int64_t piece = ShardNumel(numel, nodes * world_);  // BF16 elements, a multiple of 256
  const ShardRange own = NodeRangeOf(numel, nodes, world_, sh.node);
  const ShardRange mine = ShardOf(own.numel, world_, rank_);  // inside the node's range
  // This rank's local shard of the node's range, as the node's hostd published it.
  contribution_.assign(piece, bf16_t{});
  if (source_ == UploadSource::kMaster) {
    const absl::Time c0 = absl::Now();
    cast_pool_->Cast(state_->master(unit) + mine.offset, contribution_.data(), mine.numel);
    cast_s_ += absl::ToDoubleSeconds(absl::Now() - c0);
  } else {
    if (state_->mirror(unit) == nullptr) {
      return absl::FailedPreconditionError("the job segment keeps no BF16 mirror (runtime.param_source)");
    }
    std::copy_n(state_->mirror(unit) + mine.offset, mine.numel, contribution_.data());
  }
  gathered_.resize(static_cast<size_t>(nodes * piece));
  RETURN_IF_ERROR(link_->AllGather(reinterpret_cast<const float*>(contribution_.data()), piece / 2,
                                   reinterpret_cast<float*>(gathered_.data())));
  values.assign(static_cast<size_t>(PaddedNumel(numel, nodes * world_)), bf16_t{});
  for (int m = 0; m < nodes; ++m) {
    const ShardRange range = NodeRangeOf(numel, nodes, world_, m);
    const int64_t local = ShardNumel(range.numel, world_);
    bf16_t* chunk = values.data() + range.offset;
    const bf16_t* part = gathered_.data() + m * piece;
    if (world_ > 1) {
      RETURN_IF_ERROR(collective_->AllGatherF32(reinterpret_cast<const float*>(part), local / 2,
                                                reinterpret_cast<float*>(chunk), gate_timeout_));
    } else {
      std::copy_n(part, local, chunk);
    }
  }
  // The FP32 side copy of the norm weights: each node fills the elements in its range from its master,
  // every node's copy comes over the link, and each element is taken from its owner's.
  if (norms_ != Dtype::kF32 || ul.fp32_numel == 0) return absl::OkStatus();
  side_mine_.assign(static_cast<size_t>(ul.fp32_numel), 0.0f);
  const float* master = state_->master(unit);
  ForEachSidePart(ul, own, [&](int64_t at, int64_t element, int64_t n) {
    std::copy_n(master + (element - own.offset), n, side_mine_.data() + at);
  });
  side_all_.resize(static_cast<size_t>(nodes * ul.fp32_numel));
  RETURN_IF_ERROR(link_->AllGather(side_mine_.data(), ul.fp32_numel, side_all_.data()));
  side.resize(static_cast<size_t>(ul.fp32_numel));
  for (int m = 0; m < nodes; ++m) {
    const float* theirs = side_all_.data() + m * ul.fp32_numel;
    ForEachSidePart(ul, NodeRangeOf(numel, nodes, world_, m),
                    [&](int64_t at, int64_t, int64_t n) { std::copy_n(theirs + at, n, side.data() + at); });
  }
  return absl::OkStatus();
}

}  // namespace slidedp
