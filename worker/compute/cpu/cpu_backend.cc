// CpuBackend: ComputeBackend over host memory, running dense_reference_math in FP32.
#include "worker/compute/cpu/cpu_backend.h"

#include <algorithm>
#include <atomic>
#include <cstring>
#include <limits>
#include <new>
#include <thread>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/data/context_parallel.h"
#include "common/policy/layer_policy.h"
#include "common/status/status_macros.h"
#include "worker/compute/cpu/cpu_worker_pool.h"
#include "worker/compute/cpu/gemma4_math.h"

namespace slidedp {
namespace {

// Host memory standing in for device memory; 64-byte aligned.
// Live and peak bytes of a backend's buffers (buffers may outlive nothing but the backend).
struct MemoryCounter {
  std::atomic<int64_t> live{0};
  std::atomic<int64_t> peak{0};
};

class CpuBuffer final : public DeviceBuffer {
 public:
  CpuBuffer(void* data, int64_t bytes, std::shared_ptr<MemoryCounter> counter)
      : data_(data), bytes_(bytes), counter_(std::move(counter)) {}
  ~CpuBuffer() override {
    ::operator delete(data_, std::align_val_t(64));
    counter_->live.fetch_sub(bytes_);
  }
  void* data() override { return data_; }
  int64_t bytes() const override { return bytes_; }

 private:
  void* data_;
  int64_t bytes_;
  std::shared_ptr<MemoryCounter> counter_;
};

// A validated micro-batch with its RoPE tables.
class CpuDeviceBatch final : public DeviceBatch {
 public:
  // group: the backend's context group, for a micro-batch that is a context-parallel share.
  CpuDeviceBatch(MicroBatch batch, const ModelConfig& c, ContextGroup* group)
      : batch_(std::move(batch)), rope_(BuildRopeTables(batch_.positions, c)) {
    const MicroBatchContext& m = batch_.context;
    if (m.ranks > 1) {
      context_.group = group;
      context_.ranks = m.ranks;
      context_.rank = m.rank;
      context_.full_tokens = static_cast<int64_t>(m.gathered_position.size());
      context_.full_docs = static_cast<int64_t>(m.full_cu_seqlens.size()) - 1;
      context_.full_cu_seqlens = m.full_cu_seqlens.data();
      context_.global_index = m.global_index.data();
      context_.part = m.part;
      context_.gathered_position = m.gathered_position.data();
    }
  }
  int64_t num_tokens() const override { return batch_.num_tokens(); }
  const MicroBatch& batch() const { return batch_; }
  TokenGeometry geometry() const {
    TokenGeometry g = MakeTokenGeometry(batch_, rope_);
    if (batch_.context.ranks > 1) g.context = &context_;
    return g;
  }

  // MoE models: each sparse layer's router statistics from its last forward over this batch (by
  // sparse ordinal), and the auxiliary loss's weight once RouterAuxLoss has set it. Written by
  // the forward of a batch the interface passes const: they are the batch's routing record.
  mutable std::vector<MoeRouterStats> router;
  // A context-parallel share's: the router statistics of the whole micro-batch (the group's shares
  // summed in rank order), which its aux loss and the loss's gradient are formed from.
  mutable std::vector<MoeRouterStats> router_whole;
  mutable double aux_weight = 0;
  // gemma4: what its units share about this batch beyond the hidden state (per-layer inputs, shared
  // keys and values, their gradients), from its embedding forward on.
  mutable std::unique_ptr<Gemma4BatchState<float>> gemma4;
  const RopeTables& rope() const { return rope_; }
  mutable std::vector<std::vector<int32_t>> routed;  // SetRecordRouting: each sparse layer's top-k

 private:
  MicroBatch batch_;
  RopeTables rope_;
  ContextGeometry context_;  // points into batch_.context
};

// What a forward keeps counts against the backend's memory like a buffer (charged once filled).
class CpuSavedActivations final : public SavedActivations {
 public:
  CpuSavedActivations(ActPolicy policy, int64_t num_tokens) : policy_(policy), num_tokens_(num_tokens) {}
  ~CpuSavedActivations() override {
    if (counter_) counter_->live.fetch_sub(charged_);
  }
  void Charged(std::shared_ptr<MemoryCounter> counter, int64_t bytes) {
    counter_ = std::move(counter);
    charged_ = bytes;
  }
  int64_t bytes() const override {
    return detached_ ? detached_bytes_ : acts.num_elements() * static_cast<int64_t>(sizeof(float));
  }
  // The kept vectors, back to back in one buffer that carries their charge.
  std::unique_ptr<DeviceBuffer> Detach() override {
    if (detached_ || counter_ == nullptr || acts.num_elements() == 0) return nullptr;
    const int64_t n = bytes();
    void* p = ::operator new(static_cast<size_t>(n), std::align_val_t(64), std::nothrow);
    if (p == nullptr) return nullptr;  // stays here: the store then keeps nothing of it
    char* at = static_cast<char*>(p);
    sizes_.clear();
    for (std::vector<float>* v : Fields()) {
      std::memcpy(at, v->data(), v->size() * sizeof(float));
      at += v->size() * sizeof(float);
      sizes_.push_back(v->size());
      std::vector<float>().swap(*v);
    }
    charged_ = 0;  // the buffer's from here
    detached_ = true;
    detached_bytes_ = n;
    return std::unique_ptr<DeviceBuffer>(new CpuBuffer(p, n, counter_));
  }
  absl::Status Attach(std::unique_ptr<DeviceBuffer> block) override {
    if (!detached_) return absl::FailedPreconditionError("saved activations: Attach without Detach");
    if (block == nullptr || block->bytes() != detached_bytes_) {
      return absl::InvalidArgumentError(absl::StrCat("saved activations: a block of ", block ? block->bytes() : 0,
                                                     " bytes given back for ", detached_bytes_));
    }
    const char* at = static_cast<const char*>(block->data());
    std::vector<std::vector<float>*> fields = Fields();
    for (size_t i = 0; i < fields.size(); ++i) {
      fields[i]->resize(sizes_[i]);
      std::memcpy(fields[i]->data(), at, sizes_[i] * sizeof(float));
      at += sizes_[i] * sizeof(float);
    }
    // The vectors take the block's charge as it goes.
    counter_->live.fetch_add(detached_bytes_);
    charged_ = detached_bytes_;
    detached_ = false;
    return absl::OkStatus();
  }
  bool detached() const { return detached_; }
  ActPolicy policy() const { return policy_; }
  int64_t num_tokens() const { return num_tokens_; }
  DecoderActs<float> acts;

 private:
  std::vector<std::vector<float>*> Fields() {
    DecoderActs<float>& a = acts;
    return {&a.rstd1, &a.xn,   &a.q_raw, &a.k_raw, &a.q_rstd, &a.k_rstd, &a.q_rot, &a.k_rot,
            &a.v,     &a.attn, &a.lse,   &a.h1,    &a.rstd2,  &a.hn,     &a.gate,  &a.up};
  }

  ActPolicy policy_;
  int64_t num_tokens_;
  std::shared_ptr<MemoryCounter> counter_;
  int64_t charged_ = 0;
  bool detached_ = false;
  int64_t detached_bytes_ = 0;
  std::vector<size_t> sizes_;
};

// The expensive pieces `policy` names from `from` into `to` (the cheap ones are kept only whole, by
// keep-all): moved out of a forward's own activations, copied out of saved ones.
template <typename Acts>
void KeepPieces(ActPolicy policy, Acts&& from, DecoderActs<float>* to) {
  if (policy.keeps(kPieceQkv)) {
    to->q_raw = std::forward<Acts>(from).q_raw;
    to->k_raw = std::forward<Acts>(from).k_raw;
    to->v = std::forward<Acts>(from).v;
  }
  if (policy.keeps(kPieceAttention)) {
    to->attn = std::forward<Acts>(from).attn;
    to->lse = std::forward<Acts>(from).lse;
  }
  if (policy.keeps(kPieceOProj)) to->h1 = std::forward<Acts>(from).h1;
  if (policy.keeps(kPieceGateUp)) {
    to->gate = std::forward<Acts>(from).gate;
    to->up = std::forward<Acts>(from).up;
  }
}

std::vector<float> UpcastBf16(const bf16_t* src, int64_t n) {
  std::vector<float> out(n);
  for (int64_t i = 0; i < n; ++i) out[i] = Bf16ToFloat(src[i]);
  return out;
}

class CpuBackend final : public ComputeBackend {
 public:
  CpuBackend(const ModelConfig& config, const CpuBackendOptions& options, int num_threads)
      : ComputeBackend(config), options_(options), dims_(DecoderDims::From(config)), pool_(num_threads) {
    const ModelLayout layout = ModelLayout::Build(config);
    embed_unit_ = layout.embedding();
    for (int u = 1; u + 1 < layout.num_units(); ++u) {
      const UnitLayout& unit = layout.units[u];
      const Gemma4LayerDims gemma4 =
          config.is_gemma4() ? Gemma4LayerDims::Of(config, unit.decoder_layer) : Gemma4LayerDims{};
      layers_.push_back(Layer{unit, DecoderOffsets::Of(unit), unit.sparse() ? num_sparse_++ : -1, gemma4});
    }
  }

  std::string name() const override { return absl::StrCat("cpu(threads=", pool_.num_threads(), ")"); }
  Dtype activation_dtype() const override { return Dtype::kF32; }

  absl::StatusOr<std::unique_ptr<DeviceBuffer>> Allocate(int64_t bytes) override {
    if (bytes < 0) return absl::InvalidArgumentError(absl::StrCat("Allocate: negative size ", bytes));
    RETURN_IF_ERROR(Charge(bytes));
    void* p = ::operator new(static_cast<size_t>(std::max<int64_t>(bytes, 1)), std::align_val_t(64), std::nothrow);
    if (p == nullptr) {
      memory_->live.fetch_sub(bytes);
      return absl::ResourceExhaustedError(absl::StrCat("Allocate: out of host memory for ", bytes, " bytes"));
    }
    return std::unique_ptr<DeviceBuffer>(new CpuBuffer(p, bytes, memory_));
  }
  // Counts `bytes` as live device memory (the caller gives them back), or RESOURCE_EXHAUSTED over
  // the capacity.
  absl::Status Charge(int64_t bytes) {
    const int64_t live = memory_->live.fetch_add(bytes) + bytes;
    const int64_t limit = limit_.load();
    const bool limited = limit > 0 && (options_.device_memory_bytes <= 0 || limit < options_.device_memory_bytes);
    const int64_t capacity = limited ? limit : options_.device_memory_bytes;
    if (capacity > 0 && live > capacity) {
      memory_->live.fetch_sub(bytes);
      constexpr double kGiB = 1073741824.0;
      return absl::ResourceExhaustedError(
          absl::StrFormat("device memory exhausted: a %.3f GiB buffer does not fit (%.3f GiB free of %.3f GiB%s); "
                          "lower the tokens per step per worker (train.global_batch), raise runtime.offload_ratio, or "
                          "use runtime.act_policy: recompute or a smaller train.micro_batch",
                          bytes / kGiB, (capacity - (live - bytes)) / kGiB, capacity / kGiB,
                          limited ? " that runtime.gpu_memory_limit leaves the backend" : ""));
    }
    int64_t peak = memory_->peak.load();
    while (live > peak && !memory_->peak.compare_exchange_weak(peak, live)) {
    }
    return absl::OkStatus();
  }
  absl::Status Memset(DeviceBuffer& buf, int value) override {
    std::memset(buf.data(), value, static_cast<size_t>(buf.bytes()));
    return absl::OkStatus();
  }
  absl::Status CopyToDevice(const void* host, void* device, int64_t bytes) override {
    return Copy(host, device, bytes);
  }
  absl::Status CopyToHost(const void* device, void* host, int64_t bytes) override { return Copy(device, host, bytes); }
  absl::Status Synchronize() override { return absl::OkStatus(); }
  absl::Status ConvertActivations(const void* src, Dtype from, void* dst, Dtype to, int64_t n) override {
    if (n < 0) return absl::InvalidArgumentError(absl::StrCat("ConvertActivations: negative count ", n));
    if (n == 0) return absl::OkStatus();
    if (src == nullptr || dst == nullptr) return absl::InvalidArgumentError("ConvertActivations: null pointer");
    if (from == to) return Copy(src, dst, n * DtypeBytes(from));
    if (from == Dtype::kF32) {
      const float* in = static_cast<const float*>(src);
      bf16_t* out = static_cast<bf16_t*>(dst);
      for (int64_t i = 0; i < n; ++i) out[i] = FloatToBf16(in[i]);
    } else {
      const bf16_t* in = static_cast<const bf16_t*>(src);
      float* out = static_cast<float*>(dst);
      for (int64_t i = 0; i < n; ++i) out[i] = Bf16ToFloat(in[i]);
    }
    return absl::OkStatus();
  }
  int64_t peak_memory_bytes() const override { return memory_->peak.load(); }
  void ResetPeakMemory() override { memory_->peak.store(memory_->live.load()); }
  absl::Status SetMemoryLimit(int64_t bytes) override {
    if (bytes < 0) return absl::InvalidArgumentError(absl::StrCat("SetMemoryLimit: negative limit ", bytes));
    limit_.store(bytes);
    return absl::OkStatus();
  }

  absl::StatusOr<std::unique_ptr<DeviceBatch>> UploadBatch(const MicroBatch& batch) override {
    RETURN_IF_ERROR(ValidateBatch(batch));
    return std::unique_ptr<DeviceBatch>(new CpuDeviceBatch(batch, config_, context_group_));
  }

  absl::Status SetContextGroup(ContextGroup* group) override {
    context_group_ = group;
    return absl::OkStatus();
  }

  absl::Status EmbeddingForward(const UnitParams& embed, const DeviceBatch& batch, void* out) override {
    ASSIGN_OR_RETURN(const CpuDeviceBatch* b, AsCpu(batch));
    if (embed.bf16 == nullptr || out == nullptr) return absl::InvalidArgumentError("EmbeddingForward: null pointer");
    if (config_.is_gemma4()) {  // both tables (gemma4_math.h)
      const std::vector<int32_t> ids = Gemma4EmbeddingTokens(config_, b->batch().tokens.data(), b->num_tokens());
      b->gemma4 = std::make_unique<Gemma4BatchState<float>>();
      if (embed.fp32 != nullptr) {
        Gemma4EmbeddingForward(config_, embed_unit_, embed.fp32, ids.data(), b->num_tokens(), static_cast<float*>(out),
                               b->gemma4.get(), &pool_);
      } else {
        Gemma4EmbeddingForward(config_, embed_unit_, embed.bf16, ids.data(), b->num_tokens(), static_cast<float*>(out),
                               b->gemma4.get(), &pool_);
      }
      return absl::OkStatus();
    }
    if (embed.fp32 != nullptr) {
      EmbeddingLookup(embed.fp32, b->batch().tokens.data(), b->num_tokens(), dims_.hidden, static_cast<float*>(out),
                      &pool_, dims_.embed_scale);
    } else {
      EmbeddingLookup(embed.bf16, b->batch().tokens.data(), b->num_tokens(), dims_.hidden, static_cast<float*>(out),
                      &pool_, dims_.embed_scale);
    }
    return absl::OkStatus();
  }
  absl::Status EmbeddingBackward(const void* dout, const DeviceBatch& batch, float* dembed) override {
    ASSIGN_OR_RETURN(const CpuDeviceBatch* b, AsCpu(batch));
    if (dout == nullptr || dembed == nullptr) return absl::InvalidArgumentError("EmbeddingBackward: null pointer");
    if (config_.is_gemma4()) {
      if (b->gemma4 == nullptr) return absl::FailedPreconditionError("EmbeddingBackward: the batch had no forward");
      const std::vector<int32_t> ids = Gemma4EmbeddingTokens(config_, b->batch().tokens.data(), b->num_tokens());
      Gemma4EmbeddingBackward(config_, embed_unit_, static_cast<const float*>(dout), ids.data(), b->num_tokens(),
                              *b->gemma4, dembed);
      return absl::OkStatus();
    }
    EmbeddingScatterAdd(static_cast<const float*>(dout), b->batch().tokens.data(), b->num_tokens(), dims_.hidden,
                        dembed, dims_.embed_scale, dims_.pad_token);
    return absl::OkStatus();
  }

  absl::Status DecoderForward(const UnitParams& params, const DeviceBatch& batch, const void* x, void* y,
                              ActPolicy policy, std::unique_ptr<SavedActivations>* saved) override {
    ASSIGN_OR_RETURN(const CpuDeviceBatch* b, AsCpu(batch));
    if (params.bf16 == nullptr || x == nullptr || y == nullptr) {
      return absl::InvalidArgumentError("DecoderForward: null pointer");
    }
    ASSIGN_OR_RETURN(const Layer* layer, LayerOf(params, "DecoderForward"));
    const DecoderOffsets& offs = layer->offs;
    const std::vector<float> w = DecoderWeights(params, *layer);
    const TokenGeometry geom = b->geometry();
    DecoderActs<float> acts;
    const int64_t T = b->num_tokens();
    // Tiled when the batch is longer than a tile and nothing is kept (a kept piece holds every
    // row: the untiled forward, which gives the same outputs bit for bit, fills it). A sparse
    // layer runs whole: its router statistics are the whole batch's.
    // qwen3_5's, gemma3's and gemma4's layers keep nothing: backward recomputes them from the layer
    // input (their activations are not the pieces a policy names: the Gated DeltaNet's, the sandwich
    // norms', the per-layer inputs').
    if (LayersKeepNothing()) policy = ActPolicy::kRecomputeLayer;
    if (config_.is_gemma4()) {  // untiled; its batch state carries what crosses units
      if (b->gemma4 == nullptr) return absl::FailedPreconditionError("DecoderForward: the batch had no embedding");
      Gemma4LayerForward(layer->gemma4, offs, w.data(), Gemma4Geometry(*b, *layer), static_cast<const float*>(x),
                         b->gemma4.get(), static_cast<float*>(y), &pool_);
    } else if (TileRows(T) < T && (saved == nullptr || policy.keeps_nothing()) && !offs.sparse()) {
      DecoderForwardTiled(dims_, offs, w.data(), geom, static_cast<const float*>(x), static_cast<float*>(y),
                          TileRows(T), &pool_);
    } else {
      DecoderForwardAll(dims_, offs, w.data(), geom, static_cast<const float*>(x), static_cast<float*>(y), &acts,
                        &pool_);
    }
    if (offs.sparse()) {
      if (b->router.size() != static_cast<size_t>(num_sparse_)) b->router.resize(num_sparse_);
      b->router[layer->sparse_ordinal] = std::move(acts.moe.stats);
      if (record_routing_) {
        b->routed.resize(num_sparse_);
        b->routed[layer->sparse_ordinal] = std::move(acts.moe.topk_expert);
      }
      // The MoE block's activations are not kept: backward recomputes them from hn, bit for bit.
      acts.moe = {};
      acts.moe_y = {};
    }
    RETURN_IF_ERROR(ContextStatus("DecoderForward"));
    if (saved == nullptr) return absl::OkStatus();
    auto s = std::make_unique<CpuSavedActivations>(policy, T);
    if (policy.keeps_all()) {
      s->acts = std::move(acts);
    } else if (!policy.keeps_nothing()) {
      KeepPieces(policy, std::move(acts), &s->acts);
    }
    RETURN_IF_ERROR(Charge(s->bytes()));
    s->Charged(memory_, s->bytes());
    *saved = std::move(s);
    return absl::OkStatus();
  }

  absl::Status DecoderBackward(const UnitParams& params, const DeviceBatch& batch, const void* x,
                               SavedActivations* saved, const void* dy, void* dx, float* dparams) override {
    ASSIGN_OR_RETURN(const CpuDeviceBatch* b, AsCpu(batch));
    if (params.bf16 == nullptr || x == nullptr || dy == nullptr || dx == nullptr || dparams == nullptr) {
      return absl::InvalidArgumentError("DecoderBackward: null pointer");
    }
    const CpuSavedActivations* s = nullptr;
    if (saved != nullptr) {
      s = dynamic_cast<const CpuSavedActivations*>(saved);
      if (s == nullptr)
        return absl::InvalidArgumentError("DecoderBackward: saved activations are not the CPU backend's");
      if (s->detached()) {
        return absl::FailedPreconditionError("DecoderBackward: the saved activations are with an activation store");
      }
      if (s->num_tokens() != b->num_tokens()) {
        return absl::InvalidArgumentError(absl::StrCat("DecoderBackward: saved activations hold ", s->num_tokens(),
                                                       " tokens, the batch has ", b->num_tokens()));
      }
    }
    ASSIGN_OR_RETURN(const Layer* layer, LayerOf(params, "DecoderBackward"));
    if (config_.is_gemma4()) {  // recomputed from x, untiled
      if (b->gemma4 == nullptr) return absl::FailedPreconditionError("DecoderBackward: the batch had no forward");
      const std::vector<float> w = DecoderWeights(params, *layer);
      Gemma4LayerBackward(layer->gemma4, layer->offs, w.data(), Gemma4Geometry(*b, *layer),
                          static_cast<const float*>(x), static_cast<const float*>(dy), static_cast<float*>(dx), dparams,
                          b->gemma4.get(), &pool_);
      return ContextStatus("DecoderBackward");
    }
    const DecoderOffsets& offs = layer->offs;
    const std::vector<float> w = DecoderWeights(params, *layer);
    const TokenGeometry geom = b->geometry();
    const float* xf = static_cast<const float*>(x);
    const int64_t T = b->num_tokens();
    if (TileRows(T) < T && !offs.sparse()) {
      // Tile by tile, recomputing as it goes: what a policy kept equals the recomputed values bit
      // for bit on this backend, so the gradients are those of any policy.
      DecoderBackwardTiled(dims_, offs, w.data(), geom, xf, static_cast<const float*>(dy), static_cast<float*>(dx),
                           dparams, TileRows(T), &pool_);
      return ContextStatus("DecoderBackward");
    }
    const ActPolicy policy = s == nullptr || LayersKeepNothing() ? ActPolicy::kRecomputeLayer : s->policy();
    DecoderActs<float> local;
    const DecoderActs<float>* acts = &local;
    if (policy.keeps_all() && !offs.sparse()) {
      acts = &s->acts;
    } else if (policy.keeps_all()) {
      local = s->acts;  // and the MoE block, which is never kept, from hn
      local.moe_y.resize(T * dims_.hidden);
      MoeBlockForward(dims_.moe, offs.moe, w.data(), local.hn.data(), T, local.moe_y.data(), &local.moe, &pool_);
    } else if (policy.keeps_nothing()) {
      std::vector<float> y(b->num_tokens() * dims_.hidden);
      DecoderForwardAll(dims_, offs, w.data(), geom, xf, y.data(), &local, &pool_);
    } else {
      // Recompute the phases around the kept pieces, then read the kept pieces themselves (the
      // reference math runs a phase whole; the values it recomputes are the kept ones, bit for bit).
      DecoderAttentionInputs(dims_, offs, w.data(), geom, xf, &local, &pool_);
      KeepPieces(ActPolicy{policy.pieces & kPieceQkv}, s->acts, &local);
      if (policy.keeps(kPieceAttention)) {
        KeepPieces(ActPolicy::kSelective, s->acts, &local);
      } else {
        DecoderAttention(dims_, offs, geom, &local, &pool_);
      }
      DecoderMlpInputs(dims_, offs, w.data(), geom, xf, &local, &pool_);
      KeepPieces(ActPolicy{policy.pieces & (kPieceOProj | kPieceGateUp)}, s->acts, &local);
    }
    // The auxiliary loss's gradient reaches a sparse layer's router through every probability.
    std::vector<double> aux_grad;
    if (offs.sparse() && b->aux_weight != 0) {
      if (b->router.size() != static_cast<size_t>(num_sparse_)) {
        return absl::FailedPreconditionError("DecoderBackward: the batch has no router statistics for its aux loss");
      }
      aux_grad = LoadBalancingProbGrad(b->batch().context.ranks > 1 ? b->router_whole : b->router, b->aux_weight);
    }
    // The math reads dy fully into its own buffers before writing dx, so dx may alias dy.
    slidedp::DecoderBackward(dims_, offs, w.data(), geom, xf, *acts, static_cast<const float*>(dy),
                             static_cast<float*>(dx), dparams, &pool_, aux_grad.empty() ? nullptr : aux_grad.data());
    return ContextStatus("DecoderBackward");
  }

  absl::Status RouterAuxLoss(const DeviceBatch& batch, float weight, float share, float* loss_sum,
                             float* aux_sum) override {
    ASSIGN_OR_RETURN(const CpuDeviceBatch* b, AsCpu(batch));
    if (num_sparse_ == 0) return absl::OkStatus();
    if (loss_sum == nullptr || aux_sum == nullptr) return absl::InvalidArgumentError("RouterAuxLoss: null pointer");
    if (b->router.size() != static_cast<size_t>(num_sparse_)) {
      return absl::FailedPreconditionError("RouterAuxLoss: the batch has not been through the sparse layers' forward");
    }
    const MicroBatchContext& ctx = b->batch().context;
    if (ctx.ranks > 1) {  // the whole micro-batch's statistics; its loss counted once, by the group's rank 0
      ASSIGN_OR_RETURN(b->router_whole, GroupRouterStats(b->router));
    }
    const double aux = LoadBalancingLoss(ctx.ranks > 1 ? b->router_whole : b->router);
    if (ctx.rank == 0) {
      *loss_sum += static_cast<float>(weight * aux);
      *aux_sum += static_cast<float>(share * aux);
    }
    b->aux_weight = weight;
    return absl::OkStatus();
  }

  absl::Status RoutedExperts(const DeviceBatch& batch, int ordinal, std::vector<int32_t>* topk) const override {
    ASSIGN_OR_RETURN(const CpuDeviceBatch* b, AsCpu(batch));
    if (ordinal < 0 || ordinal >= static_cast<int>(b->routed.size()) || b->routed[ordinal].empty()) {
      return absl::FailedPreconditionError(
          absl::StrCat("RoutedExperts: no routing recorded for sparse layer ", ordinal));
    }
    *topk = b->routed[ordinal];
    return absl::OkStatus();
  }

  absl::Status AddExpertTokenCounts(const DeviceBatch& batch, int64_t* counts) override {
    ASSIGN_OR_RETURN(const CpuDeviceBatch* b, AsCpu(batch));
    if (num_sparse_ == 0) return absl::OkStatus();
    if (counts == nullptr) return absl::InvalidArgumentError("AddExpertTokenCounts: null pointer");
    if (b->router.size() != static_cast<size_t>(num_sparse_)) {
      return absl::FailedPreconditionError("AddExpertTokenCounts: the batch has not been through the sparse layers");
    }
    const int64_t E = dims_.moe.num_experts;
    for (int l = 0; l < num_sparse_; ++l) {
      for (int64_t e = 0; e < E; ++e) counts[l * E + e] += b->router[l].expert_counts[e];
    }
    return absl::OkStatus();
  }

  absl::Status HeadForwardBackward(const UnitParams& norm_w, const bf16_t* lm_head_w, const DeviceBatch& batch,
                                   const void* x, float loss_scale, void* dx, float* dnorm, float* dlm_head,
                                   float* loss_sum) override {
    ASSIGN_OR_RETURN(const CpuDeviceBatch* b, AsCpu(batch));
    if (norm_w.bf16 == nullptr || lm_head_w == nullptr || x == nullptr || dx == nullptr || dnorm == nullptr ||
        dlm_head == nullptr || loss_sum == nullptr) {
      return absl::InvalidArgumentError("HeadForwardBackward: null pointer");
    }
    const std::vector<float> norm = HeadNorm(norm_w);
    const double loss = HeadLossAndGrad(dims_, norm.data(), lm_head_w, b->batch().labels.data(), b->num_tokens(),
                                        static_cast<const float*>(x), loss_scale, static_cast<float*>(dx), dnorm,
                                        dlm_head, options_.head_chunking, &pool_);
    *loss_sum += static_cast<float>(loss);
    return absl::OkStatus();
  }

  absl::Status HeadLoss(const UnitParams& norm_w, const bf16_t* lm_head_w, const DeviceBatch& batch, const void* x,
                        float loss_scale, float* loss_sum) override {
    ASSIGN_OR_RETURN(const CpuDeviceBatch* b, AsCpu(batch));
    if (norm_w.bf16 == nullptr || lm_head_w == nullptr || x == nullptr || loss_sum == nullptr) {
      return absl::InvalidArgumentError("HeadLoss: null pointer");
    }
    const std::vector<float> norm = HeadNorm(norm_w);
    const double loss = HeadLossAndGrad<float, bf16_t>(dims_, norm.data(), lm_head_w, b->batch().labels.data(),
                                                       b->num_tokens(), static_cast<const float*>(x), loss_scale,
                                                       nullptr, nullptr, nullptr, options_.head_chunking, &pool_);
    *loss_sum += static_cast<float>(loss);
    return absl::OkStatus();
  }

  int64_t SavedBytesPerToken(ActPolicy policy) const override {
    // DecoderActs keep each piece in FP32, which is what admission's count assumes.
    return KeptElementsPerToken(ModelShape::Of(config()), policy.pieces) * static_cast<int64_t>(sizeof(float));
  }

 private:
  static absl::Status Copy(const void* src, void* dst, int64_t bytes) {
    if (bytes < 0) return absl::InvalidArgumentError(absl::StrCat("copy: negative size ", bytes));
    if (bytes > 0 && (src == nullptr || dst == nullptr)) return absl::InvalidArgumentError("copy: null pointer");
    if (bytes > 0) std::memmove(dst, src, static_cast<size_t>(bytes));
    return absl::OkStatus();
  }

  bool LayersKeepNothing() const { return config_.is_qwen3_5() || config_.is_gemma3() || config_.is_gemma4(); }

  // One decoder layer: its unit's layout and offsets, and its place among the sparse layers.
  struct Layer {
    UnitLayout unit;
    DecoderOffsets offs;
    int sparse_ordinal = -1;  // -1: a dense layer
    Gemma4LayerDims gemma4;   // gemma4: its sizes and its part in the batch state
  };
  // A gemma4 layer's geometry: the batch's with its type's RoPE table.
  static TokenGeometry Gemma4Geometry(const CpuDeviceBatch& b, const Layer& layer) {
    return Gemma4LayerGeometry(b.geometry(), b.rope(), layer.gemma4.sliding);
  }
  // The layer a decoder unit's params are: UnitParams::decoder_layer, which a MoE model needs.
  absl::StatusOr<const Layer*> LayerOf(const UnitParams& params, const char* op) const {
    if (layers_.empty()) return absl::FailedPreconditionError(absl::StrCat(op, ": the model has no decoder layers"));
    const int l = params.decoder_layer;
    // A dense model's layers are alike, but for qwen3_5's two mixers and sliding layers beside full ones.
    const int64_t sliding = config_.NumSlidingLayers();
    const bool alike =
        !config_.is_qwen3_5() && !config_.is_gemma4() && (sliding == 0 || sliding == config_.num_hidden_layers);
    if (l < 0 && num_sparse_ == 0 && alike) return &layers_[0];
    if (l < 0 || l >= static_cast<int>(layers_.size())) {
      return absl::InvalidArgumentError(absl::StrCat(op, ": decoder layer ", l, " is not one of the model's ",
                                                     layers_.size(), " (a MoE model's units must say which)"));
    }
    return &layers_[l];
  }

  // The decoder unit in FP32: the BF16 array upcast, its norm weights from the FP32 side copy
  // when there is one.
  // qwen3_5's and gemma3's (1 + w) norms carry the 1 here (AddNormWeightOffsets), so the math sees plain ones.
  std::vector<float> DecoderWeights(const UnitParams& params, const Layer& layer) const {
    std::vector<float> w = UpcastBf16(params.bf16, layer.offs.unit_numel);
    if (params.fp32 != nullptr) {
      for (const TensorSlot& t : layer.unit.tensors) {
        if (t.fp32_offset >= 0) std::copy_n(params.fp32 + t.fp32_offset, t.numel, w.begin() + t.offset_numel);
      }
    }
    AddNormWeightOffsets(config_, layer.unit, w.data());
    return w;
  }
  // The head's final norm in FP32 (its side copy, or upcast), with qwen3_5's and gemma3's 1 added.
  std::vector<float> HeadNorm(const UnitParams& norm_w) const {
    std::vector<float> norm = norm_w.fp32 != nullptr ? std::vector<float>(norm_w.fp32, norm_w.fp32 + dims_.hidden)
                                                     : UpcastBf16(norm_w.bf16, dims_.hidden);
    if (config_.norms_add_one()) {
      for (float& v : norm) v += 1.0f;
    }
    return norm;
  }

  static absl::StatusOr<const CpuDeviceBatch*> AsCpu(const DeviceBatch& batch) {
    const auto* b = dynamic_cast<const CpuDeviceBatch*>(&batch);
    if (b == nullptr) return absl::InvalidArgumentError("batch was not uploaded by the CPU backend");
    return b;
  }

  // Every rank's router statistics of its share, summed in rank order: the whole micro-batch's. The
  // int64 counts and double sums travel bit for bit through the FP32 gather (two floats each).
  absl::StatusOr<std::vector<MoeRouterStats>> GroupRouterStats(const std::vector<MoeRouterStats>& mine) {
    if (context_group_ == nullptr) return absl::FailedPreconditionError("MoE router statistics: no context group");
    return SumRouterStatsOverGroup(
        mine, dims_.moe.num_experts, context_group_->ranks(), [this](const uint64_t* local, int64_t words, uint64_t* all) {
          return context_group_->AllGather(reinterpret_cast<const float*>(local), 2 * words,
                                           reinterpret_cast<float*>(all));
        });
  }

  // A failed collective of context-parallel attention (the group's sticky status), named.
  absl::Status ContextStatus(const char* op) const {
    if (context_group_ == nullptr || context_group_->status().ok()) return absl::OkStatus();
    const absl::Status s = context_group_->status();
    return absl::Status(s.code(), absl::StrCat(op, ": context-parallel attention: ", s.message()));
  }

  // A context-parallel share's arrays (MicroBatchContext), against its tokens and the whole's.
  absl::Status ValidateContext(const MicroBatch& mb) const {
    const MicroBatchContext& c = mb.context;
    if (c.ranks == 1) return absl::OkStatus();
    if (c.ranks < 1 || c.rank < 0 || c.rank >= c.ranks) {
      return absl::InvalidArgumentError(absl::StrCat("micro-batch context: rank ", c.rank, " of ", c.ranks));
    }
    if (context_group_ == nullptr) {
      return absl::FailedPreconditionError(
          "micro-batch is a context-parallel share, and the backend has no context group");
    }
    if (context_group_->ranks() != c.ranks) {
      return absl::InvalidArgumentError(
          absl::StrCat("micro-batch context: ", c.ranks, " ranks, the backend's group has ", context_group_->ranks()));
    }
    return data::ValidateContextShare(mb);
  }

  absl::Status ValidateBatch(const MicroBatch& mb) const {
    RETURN_IF_ERROR(ValidateContext(mb));
    const int64_t T = mb.num_tokens();
    if (T == 0) return absl::InvalidArgumentError("micro-batch has no tokens");
    if (static_cast<int64_t>(mb.labels.size()) != T || static_cast<int64_t>(mb.positions.size()) != T) {
      return absl::InvalidArgumentError(absl::StrCat("micro-batch sizes disagree: ", T, " tokens, ", mb.labels.size(),
                                                     " labels, ", mb.positions.size(), " positions"));
    }
    if (T > std::numeric_limits<int32_t>::max()) {
      return absl::InvalidArgumentError(absl::StrCat("micro-batch has ", T, " tokens; cu_seqlens are int32"));
    }
    const int64_t V = config_.vocab_size;
    for (int64_t t = 0; t < T; ++t) {
      const int32_t tok = mb.tokens[t];
      if (tok < 0 || tok >= V) {
        return absl::InvalidArgumentError(
            absl::StrCat("micro-batch token ", t, " has id ", tok, ", outside the vocabulary [0, ", V, ")"));
      }
      const int32_t label = mb.labels[t];
      if (label != kIgnoreIndex && (label < 0 || label >= V)) {
        return absl::InvalidArgumentError(absl::StrCat("micro-batch label ", t, " is ", label, ": neither in [0, ", V,
                                                       ") nor kIgnoreIndex (", kIgnoreIndex, ")"));
      }
      const int32_t pos = mb.positions[t];
      if (pos < 0 || pos >= config_.max_position_embeddings) {
        return absl::InvalidArgumentError(absl::StrCat("micro-batch position ", t, " is ", pos, ", outside [0, ",
                                                       config_.max_position_embeddings, ")"));
      }
    }
    const auto& cu = mb.cu_seqlens;
    if (cu.size() < 2) {
      return absl::InvalidArgumentError(
          absl::StrCat("micro-batch cu_seqlens has ", cu.size(), " entries; needs at least 2 (0 and T)"));
    }
    if (cu.front() != 0 || cu.back() != T) {
      return absl::InvalidArgumentError(
          absl::StrCat("micro-batch cu_seqlens must run from 0 to T=", T, ", got ", cu.front(), " .. ", cu.back()));
    }
    int64_t longest = 0;
    for (size_t i = 1; i < cu.size(); ++i) {
      if (cu[i] < cu[i - 1]) {
        return absl::InvalidArgumentError(
            absl::StrCat("micro-batch cu_seqlens decreases at entry ", i, ": ", cu[i - 1], " then ", cu[i]));
      }
      longest = std::max<int64_t>(longest, cu[i] - cu[i - 1]);
    }
    if (mb.max_seqlen < longest) {
      return absl::InvalidArgumentError(absl::StrCat("micro-batch max_seqlen ", mb.max_seqlen,
                                                     " is less than the longest document (", longest, " tokens)"));
    }
    return absl::OkStatus();
  }

  CpuBackendOptions options_;
  std::shared_ptr<MemoryCounter> memory_ = std::make_shared<MemoryCounter>();
  std::atomic<int64_t> limit_{0};  // SetMemoryLimit; 0: none
  DecoderDims dims_;
  std::vector<Layer> layers_;  // by decoder layer
  UnitLayout embed_unit_;      // the embedding unit (gemma4's holds two tables)
  int num_sparse_ = 0;
  ContextGroup* context_group_ = nullptr;  // SetContextGroup (not owned)
  CpuWorkerPool pool_;
};

}  // namespace

absl::StatusOr<std::unique_ptr<ComputeBackend>> MakeCpuBackend(const ModelConfig& config,
                                                               const CpuBackendOptions& options) {
  RETURN_IF_ERROR(config.Validate());
  if (options.num_threads < 0) {
    return absl::InvalidArgumentError(absl::StrCat("cpu backend: num_threads ", options.num_threads, " < 0"));
  }
  if (options.head_chunking.token_chunk <= 0 || options.head_chunking.vocab_chunk <= 0) {
    return absl::InvalidArgumentError("cpu backend: head chunk sizes must be > 0");
  }
  int threads = options.num_threads;
  if (threads == 0) threads = static_cast<int>(std::clamp<unsigned>(std::thread::hardware_concurrency(), 1u, 4u));
  return std::unique_ptr<ComputeBackend>(new CpuBackend(config, options, threads));
}

absl::StatusOr<std::unique_ptr<ComputeBackend>> MakeCpuBackend(const ModelConfig& config) {
  return MakeCpuBackend(config, CpuBackendOptions{});
}

}  // namespace slidedp
