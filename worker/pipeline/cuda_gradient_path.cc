// CudaGradientPath: pooled gradient buffers, optional reduce-scatter, asynchronous D2H into the
// gradient ring through a poster thread.
#include "worker/pipeline/cuda_gradient_path.h"

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <map>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "common/collective/node_link.h"
#include "common/model/shard.h"
#include "common/status/status_macros.h"
#include "glog/logging.h"
#include "worker/kernels/cuda_check.h"
#include "worker/kernels/reductions.h"

namespace slidedp {
namespace {

struct GradBuffer {
  float* data = nullptr;
  int64_t bytes = 0;
  cudaEvent_t done = nullptr;  // recorded after the last copy out of it
  bool open = false;           // between Begin and the poster's last copy
};

struct PostJob {
  int unit = 0;
  int64_t step = 0;
  GradBuffer* buffer = nullptr;  // released after the copies (null: the device staging buffer)
  cudaEvent_t ready = nullptr;   // gradient final (after compute, or after the reduce-scatter); may be null
  ShardRange part;
  const float* data = nullptr;  // element part.offset of the unit
  bool sum_squares = false;     // instead of a part: post the rank's squared norm `squares`
  double squares = 0;
  // Speculative clipping: instead of a part, wait for hostd's verdict on `step` and post the parts
  // of `after_verdict` it asks for (every one with post_all, else those not `speculated`).
  bool verdict = false;
  struct Later {
    int unit;
    ShardRange part;
    const float* data;
    bool speculated;
  };
  std::vector<Later> after_verdict;
};

class CudaGradientPath final : public GradientPath {
 public:
  CudaGradientPath(const ModelLayout& layout, shm::GradRing* ring, cudaStream_t compute,
                   const CudaGradientPathOptions& options)
      : layout_(layout), ring_(ring), compute_(compute), options_(options) {}

  ~CudaGradientPath() override {
    {
      absl::MutexLock l(&mu_);
      stopping_ = true;
    }
    if (poster_.joinable()) poster_.join();
    cudaStreamSynchronize(compute_);
    if (d2h_) cudaStreamSynchronize(d2h_);
    for (auto& b : buffers_) {
      if (b->data) cudaFree(b->data);
      if (b->done) cudaEventDestroy(b->done);
    }
    for (cudaEvent_t e : ready_events_) cudaEventDestroy(e);
    if (chunk_event_) cudaEventDestroy(chunk_event_);
    if (staged_event_) cudaEventDestroy(staged_event_);
    if (stage_) cudaFree(stage_);
    if (unit_squares_) cudaFree(unit_squares_);
    if (partials_) cudaFree(partials_);
    if (bf16_chunk_) cudaFree(bf16_chunk_);
    if (chain_scratch_) cudaFree(chain_scratch_);
    if (squares_device_) cudaFree(squares_device_);
    if (d2h_) cudaStreamDestroy(d2h_);
  }

  absl::Status Init() {
    SLIDEDP_CUDA_RETURN_IF_ERROR(cudaSetDevice(options_.device));
    SLIDEDP_CUDA_RETURN_IF_ERROR(cudaStreamCreateWithFlags(&d2h_, cudaStreamNonBlocking));
    SLIDEDP_CUDA_RETURN_IF_ERROR(cudaEventCreateWithFlags(&chunk_event_, cudaEventDisableTiming));
    const bool reduce = options_.base.route == GradRoute::kGpu && options_.base.world > 1;
    if (reduce && options_.comm == nullptr) return absl::FailedPreconditionError("gpu gradient route without NCCL");
    if (options_.base.stage_until_norm) RETURN_IF_ERROR(AllocateStage(reduce));
    if (options_.base.dtype == Dtype::kBF16) {  // each chunk is cast here on d2h_, then copied
      SLIDEDP_CUDA_RETURN_IF_ERROR(cudaMalloc(&bf16_chunk_, ring_->config().slot_bytes));
    }
    poster_ = std::thread(&CudaGradientPath::PosterLoop, this);
    return absl::OkStatus();
  }

  absl::StatusOr<float*> Begin(int unit) override {
    int64_t padded = PaddedNumel(layout_.units[unit].numel, options_.base.world);
    if (ShardedUnit(unit)) {
      padded = std::max(padded, PaddedNumel(layout_.units[unit].numel, options_.base.sharding->nodes * options_.base.world));
    }
    const int64_t bytes = padded * static_cast<int64_t>(sizeof(float));
    GradBuffer* pick = nullptr;
    {
      absl::MutexLock l(&mu_);
      // The smallest idle buffer that fits and whose copies are finished.
      for (auto& b : buffers_) {
        if (b->open || b->bytes < bytes) continue;
        if (cudaEventQuery(b->done) != cudaSuccess) continue;
        if (!pick || b->bytes < pick->bytes) pick = b.get();
      }
      if (pick) pick->open = true;
    }
    if (!pick && static_cast<int>(buffers_.size()) < options_.max_buffers) {
      auto b = std::make_unique<GradBuffer>();
      cudaError_t e = cudaMalloc(&b->data, bytes);
      if (e != cudaSuccess) {
        cudaGetLastError();
        return absl::ResourceExhaustedError(
            absl::StrCat("gradient buffer: cudaMalloc of ", bytes, " bytes failed: ", cudaGetErrorString(e)));
      }
      b->bytes = bytes;
      SLIDEDP_CUDA_RETURN_IF_ERROR(cudaEventCreateWithFlags(&b->done, cudaEventDisableTiming));
      b->open = true;
      pick = b.get();
      absl::MutexLock l(&mu_);
      buffers_.push_back(std::move(b));
    }
    if (!pick) {
      // At the cap: wait (on the host) for an idle buffer that fits to finish its copies.
      absl::MutexLock l(&mu_);
      auto idle_fit = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
        for (auto& b : buffers_) {
          if (!b->open && b->bytes >= bytes) return true;
        }
        return !first_error_.ok();
      };
      mu_.Await(absl::Condition(&idle_fit));
      RETURN_IF_ERROR(first_error_);
      for (auto& b : buffers_) {
        if (!b->open && b->bytes >= bytes) {
          pick = b.get();
          break;
        }
      }
      pick->open = true;
      SLIDEDP_CUDA_RETURN_IF_ERROR(cudaStreamWaitEvent(compute_, pick->done, 0));
    }
    SLIDEDP_CUDA_RETURN_IF_ERROR(cudaMemsetAsync(pick->data, 0, bytes, compute_));
    open_[unit] = pick;
    return pick->data;
  }

  absl::Status Finish(int unit, int64_t step) override {
    auto it = open_.find(unit);
    if (it == open_.end()) return absl::InternalError(absl::StrCat("gradient of unit ", unit, " finished twice"));
    PostJob job;
    job.unit = unit;
    job.step = step;
    job.buffer = it->second;
    open_.erase(it);
    const int64_t numel = layout_.units[unit].numel;
    job.part = ShardRange{0, numel};
    ASSIGN_OR_RETURN(job.ready, ReadyEvent());
    SLIDEDP_CUDA_RETURN_IF_ERROR(cudaEventRecord(job.ready, compute_));
    const bool reduce = options_.base.route == GradRoute::kGpu && options_.base.world > 1;
    const bool over_nodes = options_.nodes != nullptr && options_.nodes->nodes() > 1;
    // Where the part becomes final: the reduce-scatter's stream, the cross-node link's, or compute.
    cudaStream_t on = reduce ? options_.comm->stream() : over_nodes ? options_.nodes->own_stream() : compute_;
    if (ShardedUnit(unit)) {
      if (!over_nodes) return absl::FailedPreconditionError("runtime.node_state sharded without the link to the other nodes");
      if (!reduce) SLIDEDP_CUDA_RETURN_IF_ERROR(cudaStreamWaitEvent(on, job.ready, 0));
      RETURN_IF_ERROR(ReduceOverNodeRanges(job, reduce, on));
      SLIDEDP_CUDA_RETURN_IF_ERROR(cudaEventRecord(job.ready, on));
      if (options_.base.stage_until_norm) return Stage(job, on);
      absl::MutexLock l(&mu_);
      RETURN_IF_ERROR(first_error_);
      queue_.push_back(job);
      return absl::OkStatus();
    }
    const int64_t shard = reduce ? ShardNumel(numel, options_.base.world) : numel;
    auto local_sum = [&](const float* partial) -> absl::Status {
      if (reduce) RETURN_IF_ERROR(options_.comm->ReduceScatterF32(job.buffer->data, shard, job.ready));
      if (partial == nullptr) return absl::OkStatus();
      float* mine = job.buffer->data + (reduce ? options_.base.rank * shard : 0);
      return kernels::AddF32(mine, partial, shard, mine, on);
    };
    if (over_nodes) {
      // The node's ranks' sum of this rank's part, chained through the nodes (ChainReduce), all
      // queued on `on` after the backward's event.
      if (!reduce) SLIDEDP_CUDA_RETURN_IF_ERROR(cudaStreamWaitEvent(on, job.ready, 0));
      RETURN_IF_ERROR(ChainScratch(shard));
      options_.nodes->set_stream(on);
      RETURN_IF_ERROR(ChainReduce(*options_.nodes, job.buffer->data + (reduce ? options_.base.rank * shard : 0),
                                  shard, chain_scratch_, local_sum));
    } else if (reduce) {
      RETURN_IF_ERROR(local_sum(nullptr));
    }
    if (reduce || over_nodes) SLIDEDP_CUDA_RETURN_IF_ERROR(cudaEventRecord(job.ready, on));
    if (reduce) job.part = ShardOf(numel, options_.base.world, options_.base.rank);
    job.data = job.buffer->data + job.part.offset;
    if (options_.base.stage_until_norm) return Stage(job, on);
    absl::MutexLock l(&mu_);
    RETURN_IF_ERROR(first_error_);
    queue_.push_back(job);
    return absl::OkStatus();
  }

  absl::Status Flush() override {
    if (!options_.base.stage_until_norm) return Drain();
    if (staged_.empty()) return FirstError();
    // Every staged part and its squared norm are final once the staging stream reaches here.
    SLIDEDP_CUDA_RETURN_IF_ERROR(cudaEventRecord(staged_event_, stage_stream_));
    RETURN_IF_ERROR(WaitEvent(staged_event_, options_.base.ring_timeout, [this] { return StopStatus(); }));
    std::vector<double> unit_squares(layout_.num_units());
    SLIDEDP_CUDA_RETURN_IF_ERROR(
        cudaMemcpy(unit_squares.data(), unit_squares_, unit_squares.size() * sizeof(double), cudaMemcpyDeviceToHost));
    PostJob norm;
    norm.step = staged_step_;
    norm.sum_squares = true;
    const NodeSharding* sh = options_.base.sharding;
    for (const auto& [unit, part] : staged_) {  // unit order
      // Sharded nodes: a unit every node holds whole is in every node's norms; node 0's count it.
      if (sh != nullptr && sh->sharded() && sh->IsReplicated(unit) && sh->node != 0) continue;
      norm.squares += unit_squares[unit];
    }
    // Sharded nodes: the ranks of this local index add every node's squares (in node order), so hostd's
    // sum over its ranks is the job's norm on every node.
    if (sh != nullptr && sh->sharded()) {
      ASSIGN_OR_RETURN(norm.squares, SumOverNodes(norm.squares));
    }
    if (options_.log_unit_norms) {  // for finding where two runs part (every digit of each unit's sum)
      for (const auto& [unit, part] : staged_) {
        LOG(INFO) << absl::StrFormat("unit norms: step %d unit %d squares %.17g", staged_step_ + 1, unit,
                                     unit_squares[unit]);
      }
    }
    absl::MutexLock l(&mu_);
    RETURN_IF_ERROR(first_error_);
    queue_.push_back(norm);
    if (!speculated_.empty()) {  // the rest after hostd's verdict (the poster waits for it)
      PostJob verdict;
      verdict.step = staged_step_;
      verdict.verdict = true;
      for (const auto& [unit, part] : staged_) {  // forward order
        verdict.after_verdict.push_back({unit, part, stage_ + stage_offset_[unit], speculated_.count(unit) > 0});
      }
      queue_.push_back(std::move(verdict));
    } else {
      for (const auto& [unit, part] : staged_) {  // forward order
        PostJob job;
        job.unit = unit;
        job.step = staged_step_;
        job.part = part;
        job.data = stage_ + stage_offset_[unit];
        queue_.push_back(job);
      }
    }
    staged_.clear();
    speculated_.clear();
    return absl::OkStatus();
  }

  absl::Status Drain() override {
    absl::MutexLock l(&mu_);
    auto drained = [this]()
                       ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return (queue_.empty() && !busy_) || !first_error_.ok(); };
    mu_.Await(absl::Condition(&drained));
    return first_error_;
  }

  double ring_wait_s() const override {
    absl::MutexLock l(&mu_);
    return ring_wait_s_;
  }
  double d2h_s() const override {
    absl::MutexLock l(&mu_);
    return d2h_s_;
  }
  int64_t device_bytes() const override {
    absl::MutexLock l(&mu_);
    int64_t b = stage_bytes_ + chain_scratch_numel_ * static_cast<int64_t>(sizeof(float));
    for (const auto& buf : buffers_) b += buf->bytes;
    return b;
  }

 private:
  bool ShardedUnit(int unit) const { return SplitsUnit(options_.base.sharding, unit); }

  // runtime.node_state sharded (gradient_path.h): every node range's local shards reduce-scattered by
  // this node's ranks (NCCL, in place in the unit's buffer) and chained over the nodes, the last node
  // sending each its own piece (ChainReduceScatter); all queued on `on`. The rank's total then goes back
  // into the unit's buffer, where job.data points (the buffer lives until the poster's copies).
  absl::Status ReduceOverNodeRanges(PostJob& job, bool reduce, cudaStream_t on) {
    const NodeSharding& sh = *options_.base.sharding;
    const int world = options_.base.world, rank = options_.base.rank, nodes = sh.nodes;
    const int64_t numel = layout_.units[job.unit].numel;
    const int64_t piece = ShardNumel(numel, nodes * world);
    RETURN_IF_ERROR(ChainScratch(2 * nodes * piece));  // the packed pieces, then the partial sums
    float* packed = chain_scratch_;
    float* partials = chain_scratch_ + nodes * piece;
    SLIDEDP_CUDA_RETURN_IF_ERROR(cudaMemsetAsync(packed, 0, nodes * piece * sizeof(float), on));
    float* buf = job.buffer->data;
    auto local_sum = [&](const float* partial) -> absl::Status {
      for (int m = 0; m < nodes; ++m) {
        const ShardRange range = NodeRangeOf(numel, nodes, world, m);
        const int64_t local = ShardNumel(range.numel, world);
        float* mine = buf + range.offset + (reduce ? rank * local : 0);
        if (reduce) RETURN_IF_ERROR(options_.comm->ReduceScatterF32(buf + range.offset, local, job.ready));
        if (partial != nullptr) RETURN_IF_ERROR(kernels::AddF32(mine, partial + m * piece, local, mine, on));
        SLIDEDP_CUDA_RETURN_IF_ERROR(
            cudaMemcpyAsync(packed + m * piece, mine, local * sizeof(float), cudaMemcpyDeviceToDevice, on));
      }
      return absl::OkStatus();
    };
    options_.nodes->set_stream(on);
    RETURN_IF_ERROR(ChainReduceScatter(*options_.nodes, packed, piece, partials, local_sum));
    const ShardRange own = NodeRangeOf(numel, nodes, world, sh.node);
    job.part = ShardOf(own.numel, world, rank);  // in the node's range: hostd's node layout
    float* dst = buf + own.offset + job.part.offset;
    SLIDEDP_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(dst, packed + sh.node * piece, job.part.numel * sizeof(float),
                                                 cudaMemcpyDeviceToDevice, on));
    job.data = dst;
    return absl::OkStatus();
  }

  // Every node's `mine` of this local index added in node order (the same bits on every node).
  absl::StatusOr<double> SumOverNodes(double mine) {
    const int nodes = options_.nodes->nodes();
    if (squares_device_ == nullptr) {
      SLIDEDP_CUDA_RETURN_IF_ERROR(cudaMalloc(&squares_device_, (nodes + 1) * sizeof(double)));
    }
    cudaStream_t on = options_.nodes->own_stream();
    SLIDEDP_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(squares_device_, &mine, sizeof(double), cudaMemcpyHostToDevice, on));
    options_.nodes->set_stream(on);
    float* d = reinterpret_cast<float*>(squares_device_);
    RETURN_IF_ERROR(options_.nodes->AllGather(d, 2, d + 2));
    std::vector<double> all(nodes);
    SLIDEDP_CUDA_RETURN_IF_ERROR(
        cudaMemcpyAsync(all.data(), squares_device_ + 1, nodes * sizeof(double), cudaMemcpyDeviceToHost, on));
    SLIDEDP_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(on));
    double sum = 0;
    for (double x : all) sum += x;
    return sum;
  }

  // A job over nodes: device room for the earlier nodes' partial sum of a part of n floats (the
  // largest part so far; parts are final on one stream, in order, so one buffer serves them all).
  absl::Status ChainScratch(int64_t n) {
    if (n <= chain_scratch_numel_) return absl::OkStatus();
    SLIDEDP_CUDA_RETURN_IF_ERROR(cudaDeviceSynchronize());  // the old buffer may be in use
    if (chain_scratch_ != nullptr) cudaFree(chain_scratch_);
    chain_scratch_ = nullptr;
    SLIDEDP_CUDA_RETURN_IF_ERROR(cudaMalloc(&chain_scratch_, n * sizeof(float)));
    absl::MutexLock l(&mu_);
    chain_scratch_numel_ = n;
    return absl::OkStatus();
  }

  // One event per queued job; recycled once the poster has consumed it.
  absl::StatusOr<cudaEvent_t> ReadyEvent() {
    absl::MutexLock l(&mu_);
    if (!free_ready_.empty()) {
      cudaEvent_t e = free_ready_.back();
      free_ready_.pop_back();
      return e;
    }
    cudaEvent_t e;
    SLIDEDP_CUDA_RETURN_IF_ERROR(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
    ready_events_.push_back(e);
    return e;
  }

  absl::Status FirstError() {
    absl::MutexLock l(&mu_);
    return first_error_;
  }

  // One persistent FP32 buffer holding this rank's final part of every unit (16-byte aligned
  // slices), and the per-unit squared norms.
  absl::Status AllocateStage(bool reduce) {
    int64_t total = 0;
    stage_offset_.resize(layout_.num_units());
    for (int u = 0; u < layout_.num_units(); ++u) {
      const int64_t numel = layout_.units[u].numel;
      int64_t part = reduce ? ShardOf(numel, options_.base.world, options_.base.rank).numel : numel;
      if (ShardedUnit(u)) {  // its shard of this node's range
        const NodeSharding& sh = *options_.base.sharding;
        part = ShardOf(NodeRangeOf(numel, sh.nodes, options_.base.world, sh.node).numel, options_.base.world,
                       options_.base.rank).numel;
      }
      stage_offset_[u] = total;
      total += (part + 3) / 4 * 4;
    }
    const int64_t bytes = total * static_cast<int64_t>(sizeof(float));
    cudaError_t e = cudaMalloc(&stage_, bytes);
    if (e != cudaSuccess) {
      cudaGetLastError();
      stage_ = nullptr;
      return absl::ResourceExhaustedError(absl::StrFormat(
          "device gradient staging for exact clipping needs %.2f GiB of GPU memory on rank %d (%s); set "
          "runtime.grad_staging: host to stage the step's gradients in host memory instead",
          bytes / double(1ull << 30), options_.base.rank, cudaGetErrorString(e)));
    }
    {
      absl::MutexLock l(&mu_);
      stage_bytes_ = bytes;
    }
    SLIDEDP_CUDA_RETURN_IF_ERROR(cudaMalloc(&unit_squares_, layout_.num_units() * sizeof(double)));
    SLIDEDP_CUDA_RETURN_IF_ERROR(cudaMalloc(&partials_, kernels::kSumSquaresBlocks * sizeof(double)));
    SLIDEDP_CUDA_RETURN_IF_ERROR(cudaEventCreateWithFlags(&staged_event_, cudaEventDisableTiming));
    return absl::OkStatus();
  }

  // Device staging: copies the unit's final part into its stage slice and takes its squared norm
  // on `stream` (after the reduce-scatter, or the backward), then frees the accumulation buffer.
  absl::Status Stage(const PostJob& job, cudaStream_t stream) {
    stage_stream_ = stream;
    staged_step_ = job.step;
    float* dst = stage_ + stage_offset_[job.unit];
    SLIDEDP_CUDA_RETURN_IF_ERROR(
        cudaMemcpyAsync(dst, job.data, job.part.numel * sizeof(float), cudaMemcpyDeviceToDevice, stream));
    // BF16 gradients: the norm is the posted (rounded) values' norm.
    if (options_.base.dtype == Dtype::kBF16) {
      RETURN_IF_ERROR(kernels::RoundToBf16InPlace(dst, job.part.numel, stream));
    }
    RETURN_IF_ERROR(kernels::SumSquaresF32(dst, job.part.numel, partials_, unit_squares_ + job.unit, stream));
    SLIDEDP_CUDA_RETURN_IF_ERROR(cudaEventRecord(job.buffer->done, stream));
    staged_[job.unit] = job.part;
    // Speculative clipping: the staged part goes down now, while backward goes on.
    const bool speculate = job.unit >= options_.base.speculate_from_unit && options_.base.job_state != nullptr &&
                           options_.base.job_state->SpeculatesUnit(job.step, job.unit);
    PostJob post;
    if (speculate) {
      ASSIGN_OR_RETURN(post.ready, ReadyEvent());
      SLIDEDP_CUDA_RETURN_IF_ERROR(cudaEventRecord(post.ready, stream));
      post.unit = job.unit;
      post.step = job.step;
      post.part = job.part;
      post.data = dst;
      speculated_.insert(job.unit);
    }
    absl::MutexLock l(&mu_);
    job.buffer->open = false;
    free_ready_.push_back(job.ready);
    if (speculate && first_error_.ok()) queue_.push_back(post);
    return first_error_;
  }

  absl::Status StopStatus() const {
    if (options_.abort != nullptr && options_.abort->raised()) return options_.abort->ToStatus();
    return absl::OkStatus();
  }

  absl::Status Post(const PostJob& job) {
    if (job.verdict) {
      ASSIGN_OR_RETURN(shm::StepVerdict v,
                       options_.base.job_state->WaitVerdict(job.step, options_.base.ring_timeout, options_.base.hostd));
      for (const PostJob::Later& later : job.after_verdict) {
        if (later.speculated && !v.post_all) continue;
        PostJob part;
        part.unit = later.unit;
        part.step = job.step;
        part.part = later.part;
        part.data = later.data;
        RETURN_IF_ERROR(Post(part));
      }
      return absl::OkStatus();
    }
    if (job.sum_squares) {
      ASSIGN_OR_RETURN(uint32_t slot, ring_->AcquireSlot(options_.base.ring_timeout));
      std::memcpy(ring_->slot_data(slot), &job.squares, sizeof(double));
      shm::GradChunkDesc desc;
      desc.unit = -1;
      desc.slot = slot;
      desc.numel = 1;
      desc.step = static_cast<uint32_t>(job.step);
      desc.kind = shm::ChunkKind::kSumSquares;
      return ring_->Post(desc);
    }
    // Wait (on the host) for the gradient to be final, so d2h_s counts copies, not backward.
    if (job.ready != nullptr) {
      RETURN_IF_ERROR(WaitEvent(job.ready, options_.base.ring_timeout, [this] { return StopStatus(); }));
    }
    const bool bf16 = options_.base.dtype == Dtype::kBF16;
    const int64_t chunk = GradChunkNumel(*ring_, options_.base.dtype);
    const int64_t end = job.part.offset + job.part.numel;
    for (int64_t off = job.part.offset; off < end; off += chunk) {
      const int64_t n = std::min(chunk, end - off);
      const absl::Time t0 = absl::Now();
      ASSIGN_OR_RETURN(uint32_t slot, ring_->AcquireSlot(options_.base.ring_timeout));
      const absl::Time t1 = absl::Now();
      const float* src = job.data + (off - job.part.offset);
      if (bf16) {  // rounded to nearest even on the GPU (exact where staging rounded it already)
        RETURN_IF_ERROR(kernels::CastF32ToBf16(src, n, 1.0f, bf16_chunk_, d2h_));
        SLIDEDP_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(ring_->slot_data(slot), bf16_chunk_, n * sizeof(kernels::bf16),
                                                     cudaMemcpyDeviceToHost, d2h_));
      } else {
        SLIDEDP_CUDA_RETURN_IF_ERROR(
            cudaMemcpyAsync(ring_->slot_data(slot), src, n * sizeof(float), cudaMemcpyDeviceToHost, d2h_));
      }
      SLIDEDP_CUDA_RETURN_IF_ERROR(cudaEventRecord(chunk_event_, d2h_));
      RETURN_IF_ERROR(WaitEvent(chunk_event_, options_.base.ring_timeout, [this] { return StopStatus(); }));
      {
        absl::MutexLock l(&mu_);
        ring_wait_s_ += absl::ToDoubleSeconds(t1 - t0);
        d2h_s_ += absl::ToDoubleSeconds(absl::Now() - t1);
      }
      shm::GradChunkDesc desc;
      desc.unit = job.unit;
      desc.slot = slot;
      desc.offset_numel = off;
      desc.numel = n;
      desc.step = static_cast<uint32_t>(job.step);
      desc.kind = shm::GradChunkKind(options_.base.dtype);
      RETURN_IF_ERROR(ring_->Post(desc));
    }
    return absl::OkStatus();
  }

  void PosterLoop() {
    pthread_setname_np(pthread_self(), "grad-poster");
    cudaSetDevice(options_.device);
    while (true) {
      PostJob job;
      {
        absl::MutexLock l(&mu_);
        auto ready = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return !queue_.empty() || stopping_; };
        mu_.Await(absl::Condition(&ready));
        if (queue_.empty()) return;
        job = queue_.front();
        queue_.pop_front();
        busy_ = true;
      }
      absl::Status s = first_error_ok() ? Post(job) : absl::OkStatus();
      // The buffer is free for Begin once everything queued on d2h so far (its copies) is done.
      if (job.buffer != nullptr) cudaEventRecord(job.buffer->done, d2h_);
      absl::MutexLock l(&mu_);
      if (!s.ok() && first_error_.ok()) first_error_ = s;
      if (job.buffer != nullptr) job.buffer->open = false;
      if (job.ready != nullptr) free_ready_.push_back(job.ready);
      busy_ = false;
    }
  }

  bool first_error_ok() {
    absl::MutexLock l(&mu_);
    return first_error_.ok();
  }

  const ModelLayout& layout_;
  shm::GradRing* ring_;
  cudaStream_t compute_;
  CudaGradientPathOptions options_;
  cudaStream_t d2h_ = nullptr;
  cudaEvent_t chunk_event_ = nullptr;
  std::thread poster_;
  std::map<int, GradBuffer*> open_;  // job thread only
  // Device staging (job thread, except the buffer the poster reads after Flush queued it).
  float* stage_ = nullptr;
  std::vector<int64_t> stage_offset_;
  double* unit_squares_ = nullptr;
  double* partials_ = nullptr;
  kernels::bf16* bf16_chunk_ = nullptr;  // BF16 gradients: one chunk, cast before its copy
  cudaEvent_t staged_event_ = nullptr;
  cudaStream_t stage_stream_ = nullptr;
  std::map<int, ShardRange> staged_;  // units staged this step, with their parts
  std::set<int> speculated_;          // of those, posted speculatively
  int64_t staged_step_ = 0;

  mutable absl::Mutex mu_;
  std::vector<std::unique_ptr<GradBuffer>> buffers_ ABSL_GUARDED_BY(mu_);
  std::deque<PostJob> queue_ ABSL_GUARDED_BY(mu_);
  std::vector<cudaEvent_t> ready_events_;  // all, for destruction
  std::vector<cudaEvent_t> free_ready_ ABSL_GUARDED_BY(mu_);
  bool busy_ ABSL_GUARDED_BY(mu_) = false;
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  absl::Status first_error_ ABSL_GUARDED_BY(mu_);
  double ring_wait_s_ ABSL_GUARDED_BY(mu_) = 0;
  double d2h_s_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t stage_bytes_ ABSL_GUARDED_BY(mu_) = 0;
  float* chain_scratch_ = nullptr;  // job thread
  double* squares_device_ = nullptr;  // sharded nodes: the rank's squared norm, then every node's
  int64_t chain_scratch_numel_ ABSL_GUARDED_BY(mu_) = 0;
};

}  // namespace

absl::StatusOr<std::unique_ptr<GradientPath>> MakeCudaGradientPath(const ModelLayout& layout, shm::GradRing* ring,
                                                                   cudaStream_t compute,
                                                                   const CudaGradientPathOptions& options) {
  auto path = std::make_unique<CudaGradientPath>(layout, ring, compute, options);
  RETURN_IF_ERROR(path->Init());
  return std::unique_ptr<GradientPath>(std::move(path));
}

}  // namespace slidedp
