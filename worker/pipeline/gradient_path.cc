// Host (CPU backend) and discarding gradient paths.
#include "worker/pipeline/gradient_path.h"

#include <algorithm>
#include <cstring>
#include <map>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "common/model/shard.h"
#include "common/numeric/bf16.h"
#include "common/status/status_macros.h"
#include "worker/compute/backend.h"

namespace slidedp {
namespace {

class HostGradientPath final : public GradientPath {
 public:
  HostGradientPath(const ModelLayout& layout, shm::GradRing* ring, shm::ShmCollective* collective,
                   const GradientPathOptions& options)
      : layout_(layout), ring_(ring), collective_(collective), options_(options) {}

  absl::StatusOr<float*> Begin(int unit) override {
    std::vector<float>& buf = open_[unit];
    const int64_t numel = layout_.units[unit].numel;
    int64_t padded = PaddedNumel(numel, options_.world);
    if (ShardedUnit(unit)) padded = std::max(padded, PaddedNumel(numel, options_.sharding->nodes * options_.world));
    buf.assign(padded, 0.0f);
    return buf.data();
  }

  absl::Status Finish(int unit, int64_t step) override {
    auto it = open_.find(unit);
    if (it == open_.end()) return absl::InternalError(absl::StrCat("gradient of unit ", unit, " finished twice"));
    std::vector<float> buf = std::move(it->second);
    open_.erase(it);
    if (ShardedUnit(unit)) {
      ShardRange part;
      ASSIGN_OR_RETURN(float* data, ReduceOverNodeRanges(unit, buf.data(), part));
      return Finished(unit, step, data, part);
    }
    const int64_t numel = layout_.units[unit].numel;
    ShardRange part{0, numel};
    const bool scatter = options_.route == GradRoute::kGpu && options_.world > 1;
    if (scatter && collective_ == nullptr) return absl::FailedPreconditionError("gpu gradient route without a collective");
    const int64_t shard_numel = scatter ? ShardNumel(numel, options_.world) : numel;
    float* mine = buf.data() + (scatter ? options_.rank * shard_numel : 0);
    // The node's ranks' sum of this rank's part, added to the earlier nodes' partial sum (if any).
    auto local_sum = [&](const float* partial) -> absl::Status {
      if (scatter) return collective_->ReduceScatterF32(buf.data(), shard_numel, options_.ring_timeout, partial);
      if (partial != nullptr) {
        for (int64_t i = 0; i < shard_numel; ++i) mine[i] = partial[i] + mine[i];
      }
      return absl::OkStatus();
    };
    if (options_.nodes != nullptr && options_.nodes->nodes() > 1) {
      chain_scratch_.resize(static_cast<size_t>(shard_numel));
      RETURN_IF_ERROR(ChainReduce(*options_.nodes, mine, shard_numel, chain_scratch_.data(), local_sum));
    } else {
      RETURN_IF_ERROR(local_sum(nullptr));
    }
    if (scatter) part = ShardOf(numel, options_.world, options_.rank);
    return Finished(unit, step, buf.data() + part.offset, part);
  }

  // The rank's final part of `unit` (data[0, part.numel), element part.offset of the unit as the
  // node's hostd holds it): rounded to the posted type, staged or posted.
  absl::Status Finished(int unit, int64_t step, float* data, ShardRange part) {
    if (options_.dtype == Dtype::kBF16) {  // what is posted, so what the norm sees
      for (int64_t i = 0; i < part.numel; ++i) data[i] = Bf16ToFloat(FloatToBf16(data[i]));
    }
    if (options_.stage_until_norm) {  // kept until Flush (the rank's part only)
      Staged& st = staged_[unit] = Staged{part, std::vector<float>(data, data + part.numel)};
      // A unit every node keeps whole is in every node's ranks' norms: node 0's count it.
      st.in_norm = !options_.sharding || !options_.sharding->sharded() || ShardedUnit(unit) ||
                   options_.sharding->node == 0;
      staged_step_ = step;
      // Speculative clipping: posted now, while backward goes on (and kept, in case the norm clips).
      if (unit >= options_.speculate_from_unit && options_.job_state != nullptr &&
          options_.job_state->SpeculatesUnit(step, unit)) {
        st.posted = true;
        return PostPart(unit, step, st.data.data(), st.part);
      }
      return absl::OkStatus();
    }
    return PostPart(unit, step, data, part);
  }

  absl::StatusOr<double> SumOverNodes(double mine) {
    if (options_.nodes == nullptr) return absl::FailedPreconditionError("sharded nodes without their link");
    const int nodes = options_.nodes->nodes();
    static_assert(sizeof(double) == 2 * sizeof(float));
    float bits[2];
    std::memcpy(bits, &mine, sizeof(double));
    std::vector<float> all(static_cast<size_t>(2 * nodes));
    RETURN_IF_ERROR(options_.nodes->AllGather(bits, 2, all.data()));
    double sum = 0;
    for (int m = 0; m < nodes; ++m) {
      double theirs;
      std::memcpy(&theirs, all.data() + 2 * m, sizeof(double));
      sum += theirs;
    }
    return sum;
  }

  bool ShardedUnit(int unit) const { return SplitsUnit(options_.sharding, unit); }

  // runtime.node_state sharded: buf (the rank's whole gradient of `unit`, PaddedNumel over every rank
  // of the job) is reduce-scattered per node range: this node's ranks sum each range's local shards,
  // the nodes chain them (ChainReduceScatter). Returns the rank's global sum of its local shard of its
  // own node's range, and that shard's place in the range (`part`).
  absl::StatusOr<float*> ReduceOverNodeRanges(int unit, float* buf, ShardRange& part) {
    const NodeSharding& sh = *options_.sharding;
    const int64_t numel = layout_.units[unit].numel;
    const int world = options_.world, nodes = sh.nodes;
    const int64_t span = ShardNumel(numel, nodes * world) * world;  // a full node's range
    const int64_t piece = span / world;                             // the largest local shard
    if (world > 1 && collective_ == nullptr) return absl::FailedPreconditionError("sharded nodes without a collective");
    if (options_.nodes == nullptr || options_.nodes->nodes() != nodes) {
      return absl::FailedPreconditionError("runtime.node_state sharded without the link to the other nodes");
    }
    packed_.assign(static_cast<size_t>(nodes * piece), 0.0f);
    chain_scratch_.resize(static_cast<size_t>(nodes * piece));
    auto local_sum = [&](const float* partial) -> absl::Status {
      for (int m = 0; m < nodes; ++m) {
        const ShardRange range = NodeRangeOf(numel, nodes, world, m);
        const int64_t local = ShardNumel(range.numel, world);
        float* chunk = buf + range.offset;
        float* mine = chunk + options_.rank * local;
        const float* init = partial != nullptr ? partial + m * piece : nullptr;
        if (world > 1) {
          RETURN_IF_ERROR(collective_->ReduceScatterF32(chunk, local, options_.ring_timeout, init));
        } else if (init != nullptr) {
          for (int64_t i = 0; i < local; ++i) mine[i] = init[i] + mine[i];
        }
        std::copy_n(mine, local, packed_.data() + m * piece);
      }
      return absl::OkStatus();
    };
    RETURN_IF_ERROR(ChainReduceScatter(*options_.nodes, packed_.data(), piece, chain_scratch_.data(), local_sum));
    const ShardRange own = NodeRangeOf(numel, nodes, world, sh.node);
    part = ShardOf(own.numel, world, options_.rank);
    return packed_.data() + sh.node * piece;
  }

  absl::Status Flush() override {
    if (!options_.stage_until_norm || staged_.empty()) return absl::OkStatus();
    // The rank's squared norm, summed per unit in unit order, goes first; then the parts in
    // forward (unit) order, which is how hostd's updates and the next forward want them.
    double squares = 0;
    for (const auto& [unit, st] : staged_) {
      if (!st.in_norm) continue;
      double sq = 0;
      for (float g : st.data) sq += static_cast<double>(g) * g;
      squares += sq;
    }
    // Sharded nodes: each node's hostd holds only its parts, so the ranks of this local index add
    // every node's squares (in node order: the same bits on every node); hostd's sum over its ranks is
    // then the job's norm on every node. A non-finite part anywhere makes every node's non-finite.
    if (options_.sharding != nullptr && options_.sharding->sharded()) {
      ASSIGN_OR_RETURN(squares, SumOverNodes(squares));
    }
    {
      ASSIGN_OR_RETURN(uint32_t slot, ring_->AcquireSlot(options_.ring_timeout));
      std::memcpy(ring_->slot_data(slot), &squares, sizeof(double));
      shm::GradChunkDesc desc;
      desc.unit = -1;
      desc.slot = slot;
      desc.numel = 1;
      desc.step = static_cast<uint32_t>(staged_step_);
      desc.kind = shm::ChunkKind::kSumSquares;
      RETURN_IF_ERROR(ring_->Post(desc));
    }
    bool speculated = false;
    for (const auto& [unit, st] : staged_) speculated = speculated || st.posted;
    shm::StepVerdict verdict;  // post_all: nothing was posted speculatively
    if (speculated) {
      ASSIGN_OR_RETURN(verdict, options_.job_state->WaitVerdict(staged_step_, options_.ring_timeout, options_.hostd));
    }
    for (const auto& [unit, st] : staged_) {
      if (st.posted && !verdict.post_all) continue;
      RETURN_IF_ERROR(PostPart(unit, staged_step_, st.data.data(), st.part));
    }
    staged_.clear();
    return absl::OkStatus();
  }
  double ring_wait_s() const override { return ring_wait_s_; }
  double d2h_s() const override { return d2h_s_; }
  int64_t device_bytes() const override {  // the CPU backend's "device" is this process
    int64_t b = 0;
    for (const auto& [unit, buf] : open_) b += static_cast<int64_t>(buf.size() * sizeof(float));
    for (const auto& [unit, st] : staged_) b += static_cast<int64_t>(st.data.size() * sizeof(float));
    return b;
  }

 private:
  struct Staged {
    ShardRange part;
    std::vector<float> data;  // the part's elements
    bool posted = false;      // posted speculatively this step
    bool in_norm = true;      // counted in the rank's squared norm
  };

  // Posts elements [part.offset, part.offset + part.numel) of `unit`; data[0] is element part.offset.
  absl::Status PostPart(int unit, int64_t step, const float* data, ShardRange part) {
    const bool bf16 = options_.dtype == Dtype::kBF16;
    const int64_t chunk = GradChunkNumel(*ring_, options_.dtype);
    for (int64_t off = part.offset; off < part.offset + part.numel; off += chunk) {
      const int64_t n = std::min(chunk, part.offset + part.numel - off);
      InjectDelay();
      const absl::Time t0 = absl::Now();
      ASSIGN_OR_RETURN(uint32_t slot, ring_->AcquireSlot(options_.ring_timeout));
      const absl::Time t1 = absl::Now();
      ring_wait_s_ += absl::ToDoubleSeconds(t1 - t0);
      const float* src = data + (off - part.offset);
      if (bf16) {  // (already rounded: exact)
        bf16_t* dst = static_cast<bf16_t*>(ring_->slot_data(slot));
        for (int64_t i = 0; i < n; ++i) dst[i] = FloatToBf16(src[i]);
      } else {
        std::memcpy(ring_->slot_data(slot), src, n * sizeof(float));
      }
      d2h_s_ += absl::ToDoubleSeconds(absl::Now() - t1);
      shm::GradChunkDesc desc;
      desc.unit = unit;
      desc.slot = slot;
      desc.offset_numel = off;
      desc.numel = n;
      desc.step = static_cast<uint32_t>(step);
      desc.kind = shm::GradChunkKind(options_.dtype);
      RETURN_IF_ERROR(ring_->Post(desc));
    }
    return absl::OkStatus();
  }

  void InjectDelay() {
    if (options_.inject_max_delay <= absl::ZeroDuration()) return;
    rng_ ^= rng_ << 13;
    rng_ ^= rng_ >> 7;
    rng_ ^= rng_ << 17;
    absl::SleepFor(options_.inject_max_delay * static_cast<double>(rng_ % 1000) / 1000.0);
  }

  const ModelLayout& layout_;
  shm::GradRing* ring_;
  shm::ShmCollective* collective_;
  GradientPathOptions options_;
  std::map<int, std::vector<float>> open_;
  std::map<int, Staged> staged_;  // device staging: each unit's final part until Flush
  std::vector<float> chain_scratch_;  // a multi-node job: the earlier nodes' partial sum
  std::vector<float> packed_;         // sharded nodes: this rank's piece of every node's range
  int64_t staged_step_ = 0;
  double ring_wait_s_ = 0;
  double d2h_s_ = 0;
  uint64_t rng_ = 0x2545f4914f6cdd1dull;
};

// Keeps one buffer per unit kind size; Finish drops nothing (all work stays on the compute
// stream, so reusing a buffer for the next unit is ordered after its last reader).
class DiscardGradientPath final : public GradientPath {
 public:
  DiscardGradientPath(const ModelLayout& layout, ComputeBackend* backend) : layout_(layout), backend_(backend) {}

  absl::StatusOr<float*> Begin(int unit) override {
    const int64_t bytes = layout_.units[unit].numel * static_cast<int64_t>(sizeof(float));
    std::unique_ptr<DeviceBuffer>& buf = buffers_[unit == 0 ? 0 : (unit == layout_.num_units() - 1 ? 2 : 1)];
    if (!buf || buf->bytes() < bytes) {
      ASSIGN_OR_RETURN(buf, backend_->Allocate(bytes));
    }
    RETURN_IF_ERROR(backend_->Memset(*buf, 0));
    return buf->as<float>();
  }
  absl::Status Finish(int unit, int64_t step) override { return absl::OkStatus(); }
  absl::Status Flush() override { return absl::OkStatus(); }
  double ring_wait_s() const override { return 0; }
  double d2h_s() const override { return 0; }
  int64_t device_bytes() const override {
    int64_t b = 0;
    for (const auto& buf : buffers_) b += buf ? buf->bytes() : 0;
    return b;
  }

 private:
  const ModelLayout& layout_;
  ComputeBackend* backend_;
  std::unique_ptr<DeviceBuffer> buffers_[3];  // embedding, decoder layers, head
};

}  // namespace

int64_t GradChunkNumel(const shm::GradRing& ring, Dtype dtype) {
  return static_cast<int64_t>(ring.config().slot_bytes / DtypeBytes(dtype));
}

std::unique_ptr<GradientPath> MakeHostGradientPath(const ModelLayout& layout, shm::GradRing* ring,
                                                   shm::ShmCollective* collective, const GradientPathOptions& options) {
  return std::make_unique<HostGradientPath>(layout, ring, collective, options);
}

std::unique_ptr<GradientPath> MakeDiscardGradientPath(const ModelLayout& layout, ComputeBackend* backend) {
  return std::make_unique<DiscardGradientPath>(layout, backend);
}

}  // namespace slidedp
