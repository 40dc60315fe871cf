// The compute interface a worker runs one streamed unit with: embedding, decoder layer, head.
//
// Two implementations: the CPU reference backend (plain FP32 C++, the oracle for the kernels and
// the engine of CI's end-to-end tests) and the CUDA backend (BF16 storage, FP32 accumulation,
// cuBLASLt GEMMs). The pipeline (worker/pipeline) is written against this interface only.
//
// Conventions
// - "Device memory" is GPU memory for CUDA and plain host memory for the CPU backend; buffers
//   come from Allocate(). All ops are asynchronous on the backend's compute stream (the CPU
//   backend runs them inline); Synchronize() waits.
// - Unit parameters are one flat BF16 array laid out as common/model/model_config.h's
//   UnitLayout (tensor i at tensors[i].offset_numel). Gradients are one flat FP32 array of the
//   same layout; backward ops ADD into it (accumulation across micro-batches).
// - Activations are [num_tokens, hidden] row-major in activation_dtype(): FP32 on the CPU
//   backend; on CUDA FP32 with the FP32 residual stream (the default, as HF autocast keeps it) or
//   BF16 (CudaBackendOptions::fp32_residual = false).
// - A micro-batch is num_tokens tokens flattened from rows of packed documents; attention is
//   causal inside each document only (cu_seqlens), RoPE positions restart per document.
#pragma once

#include <algorithm>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "common/data/batch.h"
#include "common/model/model_config.h"
#include "common/numeric/bf16.h"
#include "common/numeric/dtype.h"
#include "common/policy/context_memory.h"
#include "common/policy/layer_pieces.h"

namespace slidedp {

// What a decoder layer keeps from forward for backward: a set of its forward's pieces
// (common/policy/layer_pieces.h); backward recomputes the others from the layer input (the
// checkpoint, which the pipeline keeps and is not counted here) and the kept pieces.
struct ActPolicy {
  uint32_t pieces = 0;

  static const ActPolicy kKeepAll;         // every piece: no recompute
  static const ActPolicy kRecomputeLayer;  // none: backward recomputes the whole layer
  static const ActPolicy kSelective;       // the attention output and its LSE
  // A segment checkpoint: any subset of the expensive pieces (qkv, attention, o_proj, gate_up).
  static constexpr ActPolicy Segment(uint32_t expensive) { return ActPolicy{expensive & kExpensivePieces}; }

  constexpr bool keeps(uint32_t piece) const { return (pieces & piece) == piece; }
  constexpr bool keeps_nothing() const { return pieces == 0; }
  constexpr bool keeps_all() const { return pieces == kAllPieces; }
  constexpr bool operator==(const ActPolicy& o) const { return pieces == o.pieces; }
  constexpr bool operator!=(const ActPolicy& o) const { return pieces != o.pieces; }
};
inline constexpr ActPolicy ActPolicy::kKeepAll{kAllPieces};
inline constexpr ActPolicy ActPolicy::kRecomputeLayer{0};
inline constexpr ActPolicy ActPolicy::kSelective{kPieceAttention};

// MicroBatch (the host-side micro-batch) and kIgnoreIndex: common/data/batch.h.

// A micro-batch resident in device memory (backend-specific).
class DeviceBatch {
 public:
  virtual ~DeviceBatch() = default;
  virtual int64_t num_tokens() const = 0;
};

// Opaque state a decoder forward leaves for its backward (per policy). What it keeps lies in one
// device allocation, which an activation store may move to host memory between the passes:
// Detach hands that allocation over (nullptr when nothing is kept) and leaves the object unusable
// until Attach gives back a buffer of the same size holding the same bytes (any address).
class DeviceBuffer;
class SavedActivations {
 public:
  virtual ~SavedActivations() = default;
  virtual int64_t bytes() const = 0;
  virtual std::unique_ptr<DeviceBuffer> Detach() = 0;
  virtual absl::Status Attach(std::unique_ptr<DeviceBuffer> block) = 0;
};

// A unit's parameters on the device: the BF16 array (UnitLayout) and, when fp32 is set, the
// FP32 values the compute reads instead of BF16 ones, as HF autocast keeps them in FP32:
// - a decoder layer or the head: the FP32 side copy of its norm weights (TensorSlot::fp32_offset);
// - the embedding: its whole FP32 table [vocab, hidden] (the master itself, device-readable; the
//   lookup reads only the batch's rows). The tied LM head still multiplies by the BF16 table.
// Implicit from a BF16 pointer: no FP32 values.
// A decoder unit also says which layer it is (decoder_layer, HF's index): the layers of a MoE
// model differ (ModelConfig::IsSparseLayer). -1 (unknown) is accepted for a dense model only.
struct UnitParams {
  UnitParams(const bf16_t* bf16_params, const float* fp32_norms = nullptr) : bf16(bf16_params), fp32(fp32_norms) {}
  // One tensor of the unit: its BF16 values and, for a norm weight with a side copy, its FP32 ones.
  UnitParams Tensor(const TensorSlot& t) const {
    return UnitParams(bf16 + t.offset_numel, fp32 != nullptr && t.fp32_offset >= 0 ? fp32 + t.fp32_offset : nullptr);
  }
  UnitParams OfLayer(int layer) const {
    UnitParams p = *this;
    p.decoder_layer = layer;
    return p;
  }
  const bf16_t* bf16;
  const float* fp32;
  int decoder_layer = -1;
};

// A device allocation. Freed by its destructor.
class DeviceBuffer {
 public:
  virtual ~DeviceBuffer() = default;
  virtual void* data() = 0;
  virtual int64_t bytes() const = 0;
  template <typename T>
  T* as() {
    return static_cast<T*>(data());
  }
};

// Context parallelism's group (runtime.context_parallel): the collectives attention needs when a
// micro-batch is one rank's share of a bigger one (MicroBatchContext). The reference math's ops
// return nothing, so a failed collective is recorded here (the first failure sticks, later calls
// do nothing and outputs are NaN) and the backend returns it after the op.
class ContextGroup {
 public:
  virtual ~ContextGroup() = default;
  virtual int ranks() const = 0;
  // out[r * numel, +numel) = rank r's `local`, every rank.
  virtual absl::Status AllGather(const float* local, int64_t numel, float* out) = 0;
  // In place over buf[0, ranks * shard_numel): this rank's shard summed over the ranks in rank order.
  virtual absl::Status ReduceScatter(float* buf, int64_t shard_numel) = 0;
  // The same two over device memory, queued on the CUDA stream `stream` and complete (or failed)
  // when they return, for a group that has them (NCCL between GPUs: device_collectives()). Without,
  // a CUDA backend stages its buffers through host memory and the two above.
  //   AllGatherDevice: out[r * bytes, +bytes) = rank r's `local`, bytes of any type.
  //   ReduceScatterDeviceF32: as ReduceScatter, buf[rank * shard_numel, +shard_numel) the sum.
  virtual bool device_collectives() const { return false; }
  virtual absl::Status AllGatherDevice(const void* local, int64_t bytes, void* out, void* stream) {
    return absl::UnimplementedError("this context group has no device collectives");
  }
  virtual absl::Status ReduceScatterDeviceF32(float* buf, int64_t shard_numel, void* stream) {
    return absl::UnimplementedError("this context group has no device collectives");
  }
  absl::Status status() const { return status_; }
  void Fail(absl::Status s) { status_.Update(std::move(s)); }  // the first failure stays

 private:
  absl::Status status_;
};

class ComputeBackend {
 public:
  virtual ~ComputeBackend() = default;

  virtual std::string name() const = 0;
  virtual Dtype activation_dtype() const = 0;
  const ModelConfig& config() const { return config_; }

  // Context parallelism (runtime.context_parallel): the group whose ranks hold the other shares of
  // micro-batches whose MicroBatchContext says so; the backend does not own it. UNIMPLEMENTED where
  // the backend has no context-parallel attention.
  virtual absl::Status SetContextGroup(ContextGroup* group) {
    return group == nullptr ? absl::OkStatus()
                            : absl::UnimplementedError(
                                  "runtime.context_parallel: this backend has no "
                                  "context-parallel attention");
  }

  // Bitwise-repeatable backward from now on (runtime.deterministic), or the backend's default.
  // The CPU backend always is; the CUDA backend then adds attention's dQ in a fixed order.
  virtual void SetDeterministic(bool on) {}

  // Tokens per tile of a decoder layer's token-local work (RMSNorms, projections, RoPE, the MLP)
  // and of the head's norm (runtime.tile_tokens): a micro-batch of more tokens runs that work tile
  // by tile, so its working set is bounded by the tile while attention sees the whole sequence
  // (the intermediates attention reads and writes, q/k/v, its output and their gradients, stay
  // whole). 0 restores kDefaultTileTokens (common/policy/context_memory.h). A micro-batch of at most one tile runs
  // untiled.
  void SetTileTokens(int64_t tokens) { tile_tokens_ = tokens > 0 ? tokens : kDefaultTileTokens; }
  int64_t tile_tokens() const { return tile_tokens_; }
  // The rows of each tile for a micro-batch of `num_tokens` (the whole batch when it fits one).
  int64_t TileRows(int64_t num_tokens) const { return std::min(num_tokens, tile_tokens_); }

  virtual absl::StatusOr<std::unique_ptr<DeviceBuffer>> Allocate(int64_t bytes) = 0;
  virtual absl::Status Memset(DeviceBuffer& buf, int value) = 0;
  // Synchronous copies between host memory and a device buffer (tests, small metadata).
  virtual absl::Status CopyToDevice(const void* host, void* device, int64_t bytes) = 0;
  virtual absl::Status CopyToHost(const void* device, void* host, int64_t bytes) = 0;
  virtual absl::Status Synchronize() = 0;
  // dst[i] = src[i] converted from one activation dtype to another, n elements, on the compute
  // stream: FP32 -> BF16 rounds to nearest even (common/numeric/bf16.h FloatToBf16 bit for bit, a
  // NaN stays a NaN, infinities stay), BF16 -> FP32 is exact, a dtype to itself copies. src and dst
  // are device memory and must not overlap. (runtime.checkpoint_dtype: a layer input waits in BF16.)
  virtual absl::Status ConvertActivations(const void* src, Dtype from, void* dst, Dtype to, int64_t n) = 0;

  // Validates (token ids in range, cu_seqlens consistent) and uploads a micro-batch.
  virtual absl::StatusOr<std::unique_ptr<DeviceBatch>> UploadBatch(const MicroBatch& batch) = 0;

  // out[t] = embed[tokens[t]]: the embedding unit's [vocab, hidden] table, its FP32 rows when
  // embed.fp32 is set (runtime.embedding_rows: fp32), else the BF16 ones.
  virtual absl::Status EmbeddingForward(const UnitParams& embed, const DeviceBatch& batch, void* out) = 0;
  // dembed[tokens[t]] += dout[t]  (FP32 accumulation, duplicates summed).
  virtual absl::Status EmbeddingBackward(const void* dout, const DeviceBatch& batch, float* dembed) = 0;

  // y = DecoderLayer(x). params: the decoder unit. If saved is non-null, fills it per policy.
  virtual absl::Status DecoderForward(const UnitParams& params, const DeviceBatch& batch, const void* x, void* y,
                                      ActPolicy policy, std::unique_ptr<SavedActivations>* saved) = 0;
  // dx = dL/dx; dparams += dL/dparams. saved may be null (whole-layer recompute from x).
  // dx may alias dy.
  virtual absl::Status DecoderBackward(const UnitParams& params, const DeviceBatch& batch, const void* x,
                                       SavedActivations* saved, const void* dy, void* dx, float* dparams) = 0;

  // Final RMSNorm + LM head + cross entropy, forward and backward in one pass, chunked so the
  // full [T, vocab] logits never exist. loss_scale multiplies every token's loss (the caller
  // passes 1 / trained tokens of the global batch). Adds sum_t loss_scale * CE_t to *loss_sum
  // (a device float), writes dx, and adds to dnorm ([hidden] FP32) and dlm_head ([vocab, hidden]
  // FP32; with tied embeddings the caller passes the embedding gradient here). norm_w: the final
  // norm's BF16 weights and, in norm_w.fp32, optionally its FP32 ones.
  virtual absl::Status HeadForwardBackward(const UnitParams& norm_w, const bf16_t* lm_head_w, const DeviceBatch& batch,
                                           const void* x, float loss_scale, void* dx, float* dnorm, float* dlm_head,
                                           float* loss_sum) = 0;

  // The same head forward without any gradient (evaluation): adds sum_t loss_scale * CE_t over the
  // batch's trained tokens to *loss_sum (a device float).
  virtual absl::Status HeadLoss(const UnitParams& norm_w, const bf16_t* lm_head_w, const DeviceBatch& batch,
                                const void* x, float loss_scale, float* loss_sum) = 0;

  // ---- MoE models (qwen3_moe; docs/moe.md) ----
  // A batch remembers, from each sparse layer's last forward over it, the router's statistics.
  // After the batch's last decoder forward: its load-balancing loss `aux` (HF's
  // load_balancing_loss_func over the batch's sparse layers, as one HF forward computes it) is
  // formed; weight * aux is added to *loss_sum and share * aux to *aux_sum (device floats), and
  // the sparse layers' backward over this batch from then on adds weight * aux's gradient. Until
  // it is called, a batch's backward has no auxiliary gradient. A dense model: nothing to do.
  virtual absl::Status RouterAuxLoss(const DeviceBatch& batch, float weight, float share, float* loss_sum,
                                     float* aux_sum) {
    return config_.is_moe() ? absl::UnimplementedError(name() + ": no MoE layers") : absl::OkStatus();
  }
  // Adds to counts ([sparse layers in order, num_experts], host memory) the tokens each expert of
  // each sparse layer was routed by the batch's last forward (a token counts once per expert of
  // its top-k).
  virtual absl::Status AddExpertTokenCounts(const DeviceBatch& batch, int64_t* counts) {
    return config_.is_moe() ? absl::UnimplementedError(name() + ": no MoE layers") : absl::OkStatus();
  }

  // Verification (tools/verify/model_grads): with SetRecordRouting(true), each sparse layer's
  // forward also keeps on the host the experts it routed each token to; RoutedExperts gives the
  // batch's last forward of sparse layer `ordinal` (the ordinal among the model's sparse layers):
  // [num_tokens, num_experts_per_tok], largest probability first. Off by default (it costs a copy).
  void SetRecordRouting(bool on) { record_routing_ = on; }
  virtual absl::Status RoutedExperts(const DeviceBatch& batch, int ordinal, std::vector<int32_t>* topk) const {
    return absl::UnimplementedError(name() + ": no routing recorded");
  }

  // Bytes per token a decoder layer's SavedActivations hold under a policy (excluding the
  // layer input, which the pipeline keeps as the checkpoint).
  virtual int64_t SavedBytesPerToken(ActPolicy policy) const = 0;

  // The backend's compute stream (a cudaStream_t for CUDA; nullptr for the CPU backend), so the
  // pipeline can order its copy streams against compute with events.
  virtual void* native_stream() const { return nullptr; }
  // Peak device memory allocated since the last ResetPeakMemory (or creation), in bytes (0
  // where not tracked). The worker resets it at the start of each job: backends stay warm.
  virtual int64_t peak_memory_bytes() const { return 0; }
  // Of it, the most the backend's buffers held at once (a caching pool keeps freed blocks reserved:
  // the difference is its slack); backends without a pool report peak_memory_bytes().
  virtual int64_t peak_used_memory_bytes() const { return peak_memory_bytes(); }
  virtual void ResetPeakMemory() {}
  // Where the peak of the backend's buffers went, by allocating site, when the backend keeps such
  // a ledger (the CUDA backend under SLIDEDP_GPU_MEMORY_LEDGER=1), else empty; the ledger's peak
  // restarts from what is live now.
  virtual std::string MemoryReport() { return std::string(); }
  // The most device memory the backend's own buffers (Allocate, activations, scratch) may hold
  // from now on: runtime.gpu_memory_limit less what the pipeline allocates itself; 0: no limit.
  // An allocation over it fails with RESOURCE_EXHAUSTED naming the limit. Set between jobs, with
  // no buffer of the backend alive.
  virtual absl::Status SetMemoryLimit(int64_t bytes) = 0;

 protected:
  explicit ComputeBackend(const ModelConfig& config) : config_(config) {}
  ModelConfig config_;
  int64_t tile_tokens_ = kDefaultTileTokens;
  bool record_routing_ = false;
};

// Factories. The CUDA one exists only in builds with SLIDEDP_CUDA.
absl::StatusOr<std::unique_ptr<ComputeBackend>> MakeCpuBackend(const ModelConfig& config);
absl::StatusOr<std::unique_ptr<ComputeBackend>> MakeCudaBackend(const ModelConfig& config, int device);

}  // namespace slidedp
