// The CUDA backend object (ComputeBackend on one device and stream) and the device-side batch and
// saved-activation types it hands out. Its layer math is in cuda_layer_math.cc, batch upload,
// embedding and the factories in cuda_backend.cc. Internal to worker/compute/cuda.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/status/status_macros.h"
#include "glog/logging.h"
#include "worker/compute/backend.h"
#include "worker/compute/cpu/gemma4_math.h"
#include "worker/compute/cuda/cuda_backend.h"
#include "worker/compute/cuda/cuda_memory.h"
#include "worker/compute/cuda/cuda_moe.h"
#include "worker/kernels/attention.h"
#include "worker/kernels/cuda_check.h"
#include "worker/kernels/cudnn_attention.h"
#include "worker/kernels/gated_delta.h"
#include "worker/kernels/gemm.h"
#include "worker/kernels/qk_norm_rope.h"
#include "worker/kernels/rmsnorm.h"
#include "worker/kernels/swiglu.h"

namespace slidedp::cuda_backend_internal {

using kernels::bf16;

// gemma4: what one micro-batch's units share beyond the hidden state, on the device (the CPU
// backend's Gemma4BatchState, worker/compute/cpu/gemma4_math.h): the per-layer inputs and their
// gradient, the keys and values of the layers later ones attend with and their gradient. Made by
// the embedding's forward, filled by the layers' forward, drained by their backward
// (cuda_gemma4_layer.cc).
struct Gemma4DeviceState {
  PoolBlock ple_block;
  float* ple_token = nullptr;  // [T, layers x ple_dim] embed_tokens_per_layer rows x their scale
  float* ple = nullptr;        // [T, layers x ple_dim] the per-layer inputs (layer 0's forward)
  // dL/d ple, added to by every layer's backward; layer 0's backward, the last to add, scales it
  // in place into dL/d ple_token (ple_token_grad), which the embedding's backward reads.
  float* ple_grad = nullptr;
  bool ple_token_grad = false;
  struct SharedKv {
    PoolBlock block;
    bf16* k = nullptr;    // [T, kv_dim] the source layer's keys (normed, rotated)
    bf16* v = nullptr;    // [T, kv_dim] its values (normed)
    float* dk = nullptr;  // their gradient from the layers attending with them (zero until one adds)
    float* dv = nullptr;
  };
  std::map<int64_t, SharedKv> kv;  // by source layer
};

class CudaBatch final : public DeviceBatch {
 public:
  int64_t num_tokens() const override { return num_tokens_; }

  int64_t num_tokens_ = 0;
  int num_docs_ = 0;
  int max_seqlen_ = 0;
  int64_t num_unique_ = 0;
  PoolBlock block_;
  int32_t* tokens_ = nullptr;  // the embedding's ids (gemma4: a multimodal model's placeholders as pad)
  int32_t* labels_ = nullptr;
  int32_t* positions_ = nullptr;
  int32_t* cu_seqlens_ = nullptr;
  std::vector<int32_t> host_cu_seqlens_;  // the same on the host (cuDNN groups long calls by it)
  int32_t* uniq_tokens_ = nullptr;  // embedding backward grouping, built on the host at upload
  int32_t* seg_offsets_ = nullptr;
  int32_t* sorted_pos_ = nullptr;

  // Context parallelism (a share of a micro-batch split over a group; data::ContextAttentionOf):
  // attention runs this share's pieces against the group's gathered keys and values.
  int context_ranks_ = 1;            // 1: a micro-batch of its own (the fields below unset)
  int context_rank_ = 0;             // this share's rank in the group
  int64_t context_part_ = 0;         // a rank's padded share: rows per rank in the gathers
  int64_t context_tokens_ = 0;       // the whole micro-batch's tokens
  int max_keys_ = 0;                 // the longest piece's key range
  int32_t* kv_bounds_ = nullptr;     // device [2 * docs]: each piece's keys in the whole
  std::vector<int32_t> host_kv_bounds_;  // the same on the host (cuDNN's cross attention runs per piece)
  int32_t* gathered_row_ = nullptr;  // device [whole]: each whole token's row in the rank-major gather
  int32_t* gather_rows_ = nullptr;   // device [ranks * part]: the whole token of each gather row, -1 padding
  bool context() const { return context_ranks_ > 1; }

  // MoE models: the batch's routing record, written by each sparse layer's forward (the interface
  // passes the batch const; these are what its forward left). By sparse ordinal: C_e and S_e on
  // the device ([sparse layers, E]), C_e on the host; the aux loss's weight and, once RouterAuxLoss
  // set a non-zero weight, its gradient per probability (device [E]).
  mutable PoolBlock router_block_;
  mutable int32_t* router_counts_ = nullptr;
  mutable double* router_sums_ = nullptr;
  mutable double* aux_grad_ = nullptr;
  mutable std::vector<std::vector<int64_t>> host_counts_;
  mutable std::vector<std::vector<int32_t>> host_topk_;  // SetRecordRouting: each sparse layer's top-k
  mutable double aux_weight_ = 0;

  // gemma4: the state its units share, from the embedding's forward on (written by the forward and
  // backward of a batch the interface passes const).
  mutable std::unique_ptr<Gemma4DeviceState> gemma4_;
};

// The intermediates of one decoder layer (pointers; owners vary by policy).
struct LayerActs {
  bf16* xn1 = nullptr;
  float* rstd1 = nullptr;
  bf16* qkv = nullptr;
  bf16* qr = nullptr;
  bf16* kr = nullptr;
  bf16* o = nullptr;
  float* lse = nullptr;
  // What o's BF16 rounding lost (kernels::AttnArgs::o_lo), with o where the layer has attention
  // sinks (the own kernels run it): backward's row dots from the FP32 output. Whole, as lse.
  bf16* o_lo = nullptr;
  void* h1 = nullptr;  // residual stream: FP32 or BF16 (CudaBackendOptions::fp32_residual)
  bf16* xn2 = nullptr;
  float* rstd2 = nullptr;
  bf16* gu = nullptr;
  bf16* act = nullptr;
  // gemma3's sandwich norms (ModelConfig::has_sandwich_norms): o_proj's BF16 output before
  // post_attention_layernorm and its rsqrt (with kPieceOProj), down_proj's before
  // post_feedforward_layernorm and its rsqrt (with kPieceGateUp).
  bf16* ob = nullptr;
  float* rstd_o = nullptr;
  bf16* down = nullptr;
  float* rstd_d = nullptr;
};

// A qwen3_5 layer's intermediates (cuda_qwen3_5_layer.cc), all of the batch's T tokens, in one
// scratch block: what LayerActs names for the shared parts (norms, h1, the attention mixer's q/k/v,
// output and LSE, the dense MLP's gu/act) and the rest below. Only the layer's own mixer and MLP
// kind are reserved (the other pointers stay null).
struct HybridActs {
  LayerActs l;
  bf16* branch = nullptr;  // FP32 residual: the BF16 mixer / down_proj output before the FP32 add
  // Gated attention: o · σ(gate), o_proj's input [T, qd].
  bf16* og = nullptr;
  // Gated DeltaNet: proj = xn1 · [Wqkv; Wz; Wb; Wa]ᵀ [T, P] (mixed | z | b | a), the conv + SiLU
  // output of q|k [T, 2 kd] and of v [T, vd] (the core's v), q and k after their L2 norms [T, kd],
  // g and beta [T, nv] FP32, the core's output [T, vd] and the gated norm's [T, vd].
  bf16* proj = nullptr;
  bf16* qk_conv = nullptr;
  bf16* v_conv = nullptr;
  bf16* qn = nullptr;
  bf16* kn = nullptr;
  float* g = nullptr;
  float* beta = nullptr;
  bf16* core = nullptr;
  bf16* gated = nullptr;
  // qwen3_5_moe: the routed experts' FP32 sum (plus the gated shared expert), the shared expert's
  // gate|up [T, 2 S], SwiGLU [T, S] and down_proj output [T, H], and its gate logit [T].
  float* moe_out = nullptr;
  bf16* shared_gu = nullptr;
  bf16* shared_act = nullptr;
  bf16* shared_out = nullptr;
  float* shared_logit = nullptr;
};

// A gemma4 layer's intermediates (cuda_gemma4_layer.cc), all of the batch's T tokens, in one scratch
// block (the keys and values of a layer others attend with live in the batch's Gemma4DeviceState).
// Residual-stream values are FP32 (gemma4 runs on the FP32 stream only).
struct Gemma4Acts {
  // Layer 0: its input in BF16, the per-layer projection (scaled) [T, layers x ple_dim], its norm's
  // rsqrt [T x layers] and output.
  bf16* x0 = nullptr;
  bf16* model_proj = nullptr;
  float* model_rstd = nullptr;
  bf16* model_normed = nullptr;
  bf16* xn1 = nullptr;
  float* rstd1 = nullptr;
  // q_proj | k_proj | v_proj outputs [T, qkv_] (SelectGemma4Layer): q and k alone under k_eq_v (the
  // values are k_proj's), q alone in a kv-shared layer.
  bf16* qkv = nullptr;
  bf16* qr = nullptr;  // q normed and rotated [T, qd]
  bf16* kr = nullptr;  // k normed and rotated [T, kvd] (a layer with its own keys)
  bf16* v = nullptr;   // v normed [T, kvd]
  float* v_rstd = nullptr;
  bf16* o = nullptr;
  float* lse = nullptr;
  bf16* ob = nullptr;  // o_proj output (before post_attention_layernorm) and the norm's rsqrt
  float* rstd_o = nullptr;
  float* h1 = nullptr;
  bf16* xn2 = nullptr;  // pre_feedforward_layernorm's output
  float* rstd2 = nullptr;
  bf16* gu = nullptr;
  bf16* act = nullptr;
  bf16* down = nullptr;  // down_proj output (before post_feedforward_layernorm) and the norm's rsqrt
  float* rstd_d = nullptr;
  float* h2 = nullptr;
  // The per-layer input branch: h2 in BF16, per_layer_input_gate's output [T, ple_dim] (FP32), the
  // gated inputs, per_layer_projection's output (before post_per_layer_input_norm) and its rsqrt.
  bf16* h2b = nullptr;
  float* ple_gate = nullptr;
  bf16* gated = nullptr;
  bf16* ple_proj = nullptr;
  float* ple_rstd = nullptr;
  bf16* normed = nullptr;  // [T, H] the sandwich norms' outputs (scratch)
};

class CudaSaved final : public SavedActivations {
 public:
  int64_t bytes() const override { return bytes_; }
  // The allocation moves out whole; acts_ keeps its offsets and is re-pointed by Attach.
  std::unique_ptr<DeviceBuffer> Detach() override;
  absl::Status Attach(std::unique_ptr<DeviceBuffer> block) override;
  // Allocates the block `carver` lays acts_ out in (the forward's kept pieces).
  absl::Status Allocate(Carver& carver, cudaStream_t stream);
  bool detached() const { return detached_; }

  ActPolicy policy_ = ActPolicy::kKeepAll;
  int64_t num_tokens_ = 0;
  LayerActs acts_;
  // A sparse layer's MoE block: what its forward kept (pointers into the same block).
  MoeSaved moe_;

 private:
  PoolBlock block_;                         // the forward's allocation,
  std::unique_ptr<DeviceBuffer> attached_;  // or the one an activation store gave back
  char* base_ = nullptr;                    // where acts_ points into
  int64_t bytes_ = 0;
  bool detached_ = false;
};

// A group of row-stacked weight tensors used as one GEMM operand ([Wq;Wk;Wv], [Wg;Wu]); split
// into per-tensor GEMMs only when the layout does not place them back to back.
struct StackedWeight {
  std::vector<std::pair<int64_t, int64_t>> parts;  // (offset_numel, rows), in stacking order
  int64_t rows = 0;
  bool contiguous = true;
};

class CudaBackend final : public ComputeBackend {
 public:
  CudaBackend(const ModelConfig& config, int device, const CudaBackendOptions& options)
      : ComputeBackend(config), device_(device), options_(options), deterministic_default_(options.deterministic) {}

  // A job's runtime.deterministic adds to the construction-time setting (SLIDEDP_DETERMINISTIC).
  void SetDeterministic(bool on) override {
    const bool want = on || deterministic_default_;
    if (want != options_.deterministic) {
      LOG(INFO) << "CUDA backend on GPU " << device_ << ": deterministic " << (want ? "on" : "off")
                << (want ? " (attention backward: own kernels, ordered dQ)" : "");
    }
    options_.deterministic = want;
  }

  ~CudaBackend() override {
    if (stream_ != nullptr) {
      cudaStreamSynchronize(stream_);
      cudaStreamDestroy(stream_);
    }
    if (rope_inv_freq_ != nullptr) cudaFree(rope_inv_freq_);
    if (rope_inv_freq_sliding_ != nullptr) cudaFree(rope_inv_freq_sliding_);
    if (context_staging_ != nullptr) cudaFreeHost(context_staging_);
    if (limited_pool_ != nullptr) {
      cudaMemPool_t def = nullptr;
      if (cudaDeviceGetDefaultMemPool(&def, device_) == cudaSuccess) cudaDeviceSetMemPool(device_, def);
      cudaMemPoolDestroy(limited_pool_);
    }
  }

  absl::Status Init() {
    RETURN_IF_ERROR(config_.Validate());
    SLIDEDP_CUDA_RETURN_IF_ERROR(cudaSetDevice(device_));
    SLIDEDP_CUDA_RETURN_IF_ERROR(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));
    cudaMemPool_t pool;
    SLIDEDP_CUDA_RETURN_IF_ERROR(cudaDeviceGetDefaultMemPool(&pool, device_));
    uint64_t threshold = std::numeric_limits<uint64_t>::max();
    SLIDEDP_CUDA_RETURN_IF_ERROR(cudaMemPoolSetAttribute(pool, cudaMemPoolAttrReleaseThreshold, &threshold));
    RETURN_IF_ERROR(gemm_.Init());
    gemm_.set_row_buckets(options_.gemm_row_buckets);
    if (options_.attention != CudaBackendOptions::Attention::kOwn) {
      auto cudnn = kernels::CudnnAttention::Create(device_);
      if (cudnn.ok()) {
        cudnn_ = std::move(*cudnn);
        kernels::CudnnAttentionOptions cudnn_options;
        cudnn_options.cross = options_.cudnn_cross_attention;
        cudnn_options.window_mask = options_.cudnn_window_mask;
        cudnn_->set_options(cudnn_options);
      } else if (options_.attention == CudaBackendOptions::Attention::kCudnn) {
        return absl::Status(cudnn.status().code(), absl::StrCat("attention: cudnn: ", cudnn.status().message()));
      } else {
        LOG(INFO) << "CUDA backend: cuDNN attention unavailable (" << cudnn.status().message()
                  << "); using the own attention kernels";
      }
    }
    // gemma3's and gemma4's sandwich norms (SandwichForward) add their BF16 branch to an FP32 stream.
    if ((config_.has_sandwich_norms() || config_.is_gemma4()) && !options_.fp32_residual) {
      return absl::UnimplementedError(absl::StrCat(ModelTypeName(config_.family),
                                                   ": the CUDA backend runs its sandwich norms on the FP32 residual "
                                                   "stream only (unset SLIDEDP_CUDA_FP32_RESIDUAL=0)"));
    }
    H_ = config_.hidden_size;
    I_ = config_.intermediate_size;
    embed_scale_ = static_cast<float>(config_.EmbeddingScale());
    nq_ = static_cast<int>(config_.num_attention_heads);
    nkv_ = static_cast<int>(config_.num_key_value_heads);
    hd_ = static_cast<int>(config_.head_dim);
    qd_ = config_.q_dim();
    kvd_ = config_.kv_dim();
    // qwen3_5's q_proj rows hold [query | gate] per head: q_cols_ = 2 qd of the fused rows.
    q_cols_ = config_.has_attention_output_gate() ? 2 * qd_ : qd_;
    qkv_ = q_cols_ + 2 * kvd_;
    if (config_.num_hidden_layers > 0) {
      ModelLayout layout = ModelLayout::Build(config_);
      // The offsets of a dense layer's tensors; a sparse layer (qwen3_moe) has its attention and
      // norms at the same ones, its router and experts where MoeOffsets::InUnit says.
      const UnitLayout* dense = nullptr;
      const UnitLayout* sparse = nullptr;
      for (int u = 1; u + 1 < layout.num_units(); ++u) {
        const UnitLayout& unit = layout.units[u];
        if (unit.kind != UnitKind::kDecoder) return absl::InternalError("model layout: a decoder unit is not one");
        sparse_ordinal_.push_back(unit.sparse() ? num_sparse_++ : -1);
        const UnitLayout*& first = unit.sparse() ? sparse : dense;
        if (first == nullptr) first = &unit;
      }
      const UnitLayout& unit = dense != nullptr ? *dense : *sparse;
      for (int i = 0; i < kNumDecoderTensors; ++i) {  // -1: the family has no such tensor
        const TensorSlot* t = unit.Find(static_cast<DecoderTensor>(i));
        off_[i] = t != nullptr ? t->offset_numel : -1;
        fp32_off_[i] = t != nullptr ? t->fp32_offset : -1;
      }
      if (sparse != nullptr) {
        if (!options_.fp32_residual) {
          return absl::UnimplementedError(
              "qwen3_moe: the CUDA backend runs MoE layers on the FP32 residual stream only");
        }
        ASSIGN_OR_RETURN(CudaMoeBlock block,
                         CudaMoeBlock::Create(MoeDims::Of(config_), MoeOffsets::InUnit(*sparse), &gemm_));
        moe_blocks_.push_back(std::make_unique<CudaMoeBlock>(std::move(block)));
        moe_ = moe_blocks_.back().get();
      }
      if (config_.is_qwen3_5()) RETURN_IF_ERROR(InitQwen3_5(layout));
      if (config_.is_gemma4()) RETURN_IF_ERROR(InitGemma4(layout));
    }
    qkv_w_ = Stack({{off_[kQProj], q_cols_}, {off_[kKProj], kvd_}, {off_[kVProj], kvd_}});
    gu_w_ = Stack({{off_[kGateProj], I_}, {off_[kUpProj], I_}});
    // A scaled RoPE (linear, dynamic, llama3, yarn), or a partial one (qwen3_5: its rotary_dim / 2
    // frequencies as HF computes them): the frequencies as a table.
    // gemma3's sliding layers: their own frequencies, always as a table (so are the full layers').
    if (config_.rope_scaling.type != RopeScaling::Type::kNone || config_.rotary_dim() != config_.head_dim ||
        config_.has_sliding_rope()) {
      RETURN_IF_ERROR(UploadRopeTable(AttentionSpan::kFull, &rope_inv_freq_));
    }
    if (config_.has_sliding_rope()) RETURN_IF_ERROR(UploadRopeTable(AttentionSpan::kSliding, &rope_inv_freq_sliding_));
    return absl::OkStatus();
  }
  absl::Status UploadRopeTable(AttentionSpan span, float** table) {
    const std::vector<float> inv = config_.RopeInverseFrequencies(span);
    SLIDEDP_CUDA_RETURN_IF_ERROR(cudaMalloc(table, inv.size() * sizeof(float)));
    SLIDEDP_CUDA_RETURN_IF_ERROR(cudaMemcpy(*table, inv.data(), inv.size() * sizeof(float), cudaMemcpyHostToDevice));
    return absl::OkStatus();
  }

  std::string name() const override { return "cuda"; }
  // "cudnn <version>" or "own" (what the next attention call will try first).
  std::string attention_impl() const {
    return cudnn_ != nullptr ? absl::StrCat("cudnn ", cudnn_->version()) : std::string("own");
  }
  Dtype activation_dtype() const override { return options_.fp32_residual ? Dtype::kF32 : Dtype::kBF16; }

  // ", the backend's limit X GiB (runtime.gpu_memory_limit)" under a limit, for out-of-memory errors.
  std::string LimitNote() const {
    return limit_ > 0 ? absl::StrFormat("; runtime.gpu_memory_limit leaves the backend %.2f GiB", limit_ / 1073741824.0)
                      : std::string();
  }
  absl::StatusOr<std::unique_ptr<DeviceBuffer>> Allocate(int64_t bytes) override {
    void* p = nullptr;
    if (bytes > 0) {
      cudaError_t e = MallocAsyncOrTrim(&p, bytes, stream_);
      if (e == cudaErrorMemoryAllocation) {
        size_t free_bytes = 0, total_bytes = 0;
        cudaMemGetInfo(&free_bytes, &total_bytes);
        return absl::ResourceExhaustedError(absl::StrFormat(
            "GPU memory exhausted: a %.2f GiB buffer does not fit (%.2f GiB free of %.2f GiB%s); lower the tokens per "
            "step per worker (train.global_batch), raise runtime.offload_ratio, use runtime.act_policy: recompute or a "
            "smaller train.micro_batch",
            bytes / 1073741824.0, free_bytes / 1073741824.0, total_bytes / 1073741824.0, LimitNote() + LedgerNote()));
      }
      SLIDEDP_CUDA_RETURN_IF_ERROR(e);
      if (MemoryLedger* ledger = MemoryLedger::Get()) ledger->Add(p, bytes, std::source_location::current());
    }
    return std::unique_ptr<DeviceBuffer>(new CudaBuffer(p, bytes, stream_));
  }
  absl::Status Memset(DeviceBuffer& buf, int value) override {
    SLIDEDP_CUDA_RETURN_IF_ERROR(cudaMemsetAsync(buf.data(), value, buf.bytes(), stream_));
    return absl::OkStatus();
  }
  absl::Status CopyToDevice(const void* host, void* device, int64_t bytes) override {
    SLIDEDP_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(device, host, bytes, cudaMemcpyHostToDevice, stream_));
    SLIDEDP_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(stream_));
    return absl::OkStatus();
  }
  absl::Status CopyToHost(const void* device, void* host, int64_t bytes) override {
    SLIDEDP_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(host, device, bytes, cudaMemcpyDeviceToHost, stream_));
    SLIDEDP_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(stream_));
    return absl::OkStatus();
  }
  void* native_stream() const override { return stream_; }
  absl::Status SetContextGroup(ContextGroup* group) override {
    context_group_ = group;
    return absl::OkStatus();
  }
  // Of the device's current pool: the default one, or the limited one of SetMemoryLimit.
  int64_t peak_memory_bytes() const override { return PoolHighWater(cudaMemPoolAttrReservedMemHigh); }
  int64_t peak_used_memory_bytes() const override { return PoolHighWater(cudaMemPoolAttrUsedMemHigh); }
  std::string MemoryReport() override {
    MemoryLedger* ledger = MemoryLedger::Get();
    return ledger != nullptr ? ledger->TakePeakReport() : std::string();
  }
  void ResetPeakMemory() override {
    cudaMemPool_t pool;
    uint64_t zero = 0;  // the high watermarks can only be reset to zero (they restart from now)
    if (cudaDeviceGetMemPool(&pool, device_) == cudaSuccess) {
      cudaMemPoolSetAttribute(pool, cudaMemPoolAttrReservedMemHigh, &zero);
      cudaMemPoolSetAttribute(pool, cudaMemPoolAttrUsedMemHigh, &zero);
    }
  }
  // A limit makes a pool of at most `bytes` (cudaMemPoolProps::maxSize) the device's current one,
  // which every cudaMallocAsync of the backend draws from; 0 goes back to the default pool. The
  // previous limited pool is destroyed (its memory returns once its last buffers are freed).
  absl::Status SetMemoryLimit(int64_t bytes) override {
    if (bytes < 0) return absl::InvalidArgumentError(absl::StrCat("SetMemoryLimit: negative limit ", bytes));
    if (bytes == limit_) return absl::OkStatus();
    SLIDEDP_CUDA_RETURN_IF_ERROR(cudaSetDevice(device_));
    SLIDEDP_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(stream_));
    cudaMemPool_t next = nullptr;
    if (bytes > 0) {
      cudaMemPoolProps props = {};
      props.allocType = cudaMemAllocationTypePinned;
      props.location.type = cudaMemLocationTypeDevice;
      props.location.id = device_;
      props.maxSize = static_cast<size_t>(bytes);
      SLIDEDP_CUDA_RETURN_IF_ERROR(cudaMemPoolCreate(&next, &props));
      uint64_t threshold = std::numeric_limits<uint64_t>::max();  // keep freed memory cached, as the default
      SLIDEDP_CUDA_RETURN_IF_ERROR(cudaMemPoolSetAttribute(next, cudaMemPoolAttrReleaseThreshold, &threshold));
    } else {
      SLIDEDP_CUDA_RETURN_IF_ERROR(cudaDeviceGetDefaultMemPool(&next, device_));
    }
    SLIDEDP_CUDA_RETURN_IF_ERROR(cudaDeviceSetMemPool(device_, next));
    if (limited_pool_ != nullptr) cudaMemPoolDestroy(limited_pool_);
    limited_pool_ = bytes > 0 ? next : nullptr;
    limit_ = bytes;
    return absl::OkStatus();
  }

  absl::Status Synchronize() override {
    SLIDEDP_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(stream_));
    return absl::OkStatus();
  }

  absl::Status ConvertActivations(const void* src, Dtype from, void* dst, Dtype to, int64_t n) override;
  absl::StatusOr<std::unique_ptr<DeviceBatch>> UploadBatch(const MicroBatch& mb) override;
  absl::Status EmbeddingForward(const UnitParams& embed, const DeviceBatch& batch, void* out) override;
  absl::Status EmbeddingBackward(const void* dout, const DeviceBatch& batch, float* dembed) override;
  absl::Status DecoderForward(const UnitParams& params, const DeviceBatch& batch, const void* x, void* y,
                              ActPolicy policy, std::unique_ptr<SavedActivations>* saved) override;
  absl::Status DecoderBackward(const UnitParams& params, const DeviceBatch& batch, const void* x,
                               SavedActivations* saved, const void* dy, void* dx, float* dparams) override;
  absl::Status HeadForwardBackward(const UnitParams& norm_w, const bf16_t* lm_head_w, const DeviceBatch& batch,
                                   const void* x, float loss_scale, void* dx, float* dnorm, float* dlm_head,
                                   float* loss_sum) override;
  absl::Status HeadLoss(const UnitParams& norm_w, const bf16_t* lm_head_w, const DeviceBatch& batch, const void* x,
                        float loss_scale, float* loss_sum) override;
  int64_t SavedBytesPerToken(ActPolicy policy) const override;
  absl::Status RouterAuxLoss(const DeviceBatch& batch, float weight, float share, float* loss_sum,
                             float* aux_sum) override;
  absl::Status AddExpertTokenCounts(const DeviceBatch& batch, int64_t* counts) override;
  absl::Status RoutedExperts(const DeviceBatch& batch, int ordinal, std::vector<int32_t>* topk) const override;

 private:
  // A sparse layer's ordinal among the model's sparse layers, -1 for a dense layer; the layer is
  // params.decoder_layer, which a MoE model's units must carry.
  absl::StatusOr<int> SparseOrdinal(const UnitParams& params) const {
    if (num_sparse_ == 0) return -1;
    const int l = params.decoder_layer;
    if (l < 0 || l >= static_cast<int>(sparse_ordinal_.size())) {
      return absl::InvalidArgumentError(absl::StrCat("decoder layer ", l, " is not one of the model's ",
                                                     sparse_ordinal_.size(), " (a MoE model's units must say which)"));
    }
    return sparse_ordinal_[l];
  }
  // A sparse layer (qwen3_moe): attention as a dense layer's, the MoE block (moe_) in place of
  // the MLP. Untiled (TileRows does not apply); FP32 residual stream only.
  absl::Status SparseDecoderForward(const UnitParams& params, const CudaBatch& b, const void* x, void* y,
                                    ActPolicy policy, std::unique_ptr<SavedActivations>* saved, int ordinal);
  absl::Status SparseDecoderBackward(const UnitParams& params, const CudaBatch& b, const void* x, CudaSaved* saved,
                                     const void* dy, void* dx, float* dparams);
  // The layer backward's last part, shared by dense and sparse layers: q/k norm + RoPE, the QKV
  // projections and the input norm, tile by tile (dx holds dh1 and becomes dx in place).
  absl::Status QkvBackward(const UnitParams& params, const CudaBatch& b, const void* x, const LayerActs& acts,
                           uint32_t kept, int64_t tile, bf16* dqr, bf16* dkr, bf16* dqkv, void* dxn, float* ws_f,
                           void* dx, float* dparams);
  // The batch's routing record for `ordinal`: where the forward writes C_e and S_e.
  absl::StatusOr<MoeRouterStatsOut> RouterRecord(const CudaBatch& b, int ordinal);

  // ---- qwen3_5 / qwen3_5_moe (cuda_qwen3_5_layer.cc) ----
  // Its layers differ by mixer (and a unit's tensors lie where its own layout puts them), so each
  // decoder layer's offsets are kept, and SelectLayer makes the layer's the current ones (off_,
  // fp32_off_, the stacked weights, moe_) before any of the layer's math. Checks the shapes the
  // kernels take (Init).
  struct LayerShape {
    int64_t off[kNumDecoderTensors];
    int64_t fp32_off[kNumDecoderTensors];
    CudaMoeBlock* moe = nullptr;  // a sparse layer's block (its router and experts' offsets)
  };
  absl::Status InitQwen3_5(const ModelLayout& layout);
  absl::Status SelectLayer(const UnitParams& params);
  // One layer, untiled, keeping nothing: backward recomputes the forward from x.
  absl::Status HybridDecoderForward(const UnitParams& params, const CudaBatch& b, const void* x, void* y,
                                    ActPolicy policy, std::unique_ptr<SavedActivations>* saved);
  absl::Status HybridDecoderBackward(const UnitParams& params, const CudaBatch& b, const void* x, const void* dy,
                                     void* dx, float* dparams);
  // Reserves the layer's intermediates (HybridActs) in `c`.
  void ReserveHybrid(Carver& c, HybridActs& a, int64_t T, bool linear, int sparse) const;
  // The layer forward: h1 = x + mixer(RMSNorm(x)) (MixerForward), y = h1 + mlp(RMSNorm(h1))
  // (MlpForward; y null: everything up to the MLP's output, as backward needs it).
  absl::Status MixerForward(const UnitParams& params, const CudaBatch& b, const void* x, bool linear,
                            const HybridActs& a);
  absl::Status MlpForward(const UnitParams& params, const CudaBatch& b, int sparse, const HybridActs& a, void* y);
  // The Gated DeltaNet from xn1 to its gated norm's output (a.gated).
  absl::Status GdnForward(const UnitParams& params, const CudaBatch& b, const HybridActs& a);
  // Its backward from dgated = dL/d(gated norm output) [T, vd] BF16 to dproj [T, P] BF16 (the four
  // projections' output gradients), parameter gradients added.
  absl::Status GdnBackward(const UnitParams& params, const CudaBatch& b, const HybridActs& a, const bf16* dgated,
                           bf16* dproj, float* dparams);
  // qwen3_5_moe's shared expert: forward computes its output and gate logit (MlpForward adds
  // σ(logit)·output to the routed experts' sum); backward adds its part of dxn2 (FP32) for dy,
  // weight gradients added.
  absl::Status SharedExpertForward(const UnitParams& params, const HybridActs& a, int64_t T);
  absl::Status SharedExpertBackward(const UnitParams& params, const HybridActs& a, int64_t T, const float* dy,
                                    float* dxn, float* dparams);
  kernels::GatedDeltaArgs DeltaArgs(int64_t tokens, int num_docs, const int32_t* cu_seqlens) const {
    kernels::GatedDeltaArgs d;
    d.tokens = tokens;
    d.num_docs = num_docs;
    d.cu_seqlens = cu_seqlens;
    d.num_k_heads = static_cast<int>(config_.linear.num_key_heads);
    d.num_v_heads = static_cast<int>(config_.linear.num_value_heads);
    d.k_dim = static_cast<int>(config_.linear.key_head_dim);
    d.v_dim = static_cast<int>(config_.linear.value_head_dim);
    d.scale = 1.0f / std::sqrt(static_cast<float>(config_.linear.key_head_dim));
    return d;
  }
  // The chunked kernels (worker/kernels/gated_delta.h) where they take the head dims, else the
  // recurrent fallback (qwen3_5_kernels.h).
  bool ChunkedDelta() const { return kernels::GatedDeltaForwardWorkspaceBytes(DeltaArgs(1, 1, nullptr)) > 0; }
  // Column of v in the fused qkv rows: after q (and qwen3_5's gates) and k.
  int64_t VColumn() const { return q_cols_ + kvd_; }

  // ---- gemma4 (cuda_gemma4_layer.cc) ----
  // Its layers differ in sizes (full layers' head_dim and kv heads, double-wide MLPs) and tensors
  // (k_eq_v, kv-shared layers, layer 0's per-layer input projection), so each decoder layer's
  // offsets and sizes are kept, and SelectGemma4Layer makes the layer's the current ones (off_,
  // fp32_off_, I_, nkv_, hd_, qd_, kvd_, qkv_) before any of its math. Checks the sizes the kernels
  // take (Init).
  struct Gemma4Layer {
    int64_t off[kNumDecoderTensors];
    int64_t fp32_off[kNumDecoderTensors];
    Gemma4LayerDims dims;  // the CPU backend's (gemma4_math.h): sizes, k_eq_v, kv source, ple_dim
  };
  absl::Status InitGemma4(const ModelLayout& layout);
  absl::StatusOr<const Gemma4LayerDims*> SelectGemma4Layer(const UnitParams& params, const CudaBatch& b);
  // The embedding unit's second table: state->ple_token (forward), its gradient (backward).
  absl::Status Gemma4EmbeddingForward(const UnitParams& embed, const CudaBatch& b);
  absl::Status Gemma4EmbeddingBackward(const CudaBatch& b, float* dembed);
  // One layer, untiled, keeping nothing: backward recomputes the forward from x.
  absl::Status Gemma4DecoderForward(const UnitParams& params, const CudaBatch& b, const void* x, void* y,
                                    std::unique_ptr<SavedActivations>* saved);
  absl::Status Gemma4DecoderBackward(const UnitParams& params, const CudaBatch& b, const void* x, const void* dy,
                                     void* dx, float* dparams);
  // Reserves the layer's intermediates in `c` (a kv-stored layer's keys and values are the batch
  // state's: not reserved; Gemma4StoredKv points a at them).
  void ReserveGemma4(Carver& c, Gemma4Acts& a, int64_t T, const Gemma4LayerDims& d) const;
  // A kv-stored layer's keys and values in the batch state, made (their gradients zero) by the
  // batch's first forward of the layer; a.kr and a.v point at them.
  absl::Status Gemma4StoredKv(const CudaBatch& b, int layer, Gemma4Acts* a);
  // The layer forward into a, writing the batch state's per-layer inputs (layer 0) and the keys and
  // values later layers share; y = the layer output (null: everything up to it, as backward needs).
  absl::Status Gemma4Forward(const UnitParams& params, const CudaBatch& b, const Gemma4LayerDims& d, const void* x,
                             const Gemma4Acts& a, void* y);
  // Layer 0's per-layer inputs from its input x0 (forward: state ple), and their backward from the
  // whole ple_grad (its projection's and norm's gradients, dx += x0's share, ple_token_grad).
  absl::Status Gemma4PleInputsForward(const UnitParams& params, const CudaBatch& b, const Gemma4LayerDims& d,
                                      const void* x, const Gemma4Acts& a);
  absl::Status Gemma4PleInputsBackward(const UnitParams& params, const CudaBatch& b, const Gemma4LayerDims& d,
                                       const Gemma4Acts& a, bf16* dnormed, bf16* dproj, float* ws, void* dx,
                                       float* dparams);
  // The q | k | v projections a layer runs forward (its fused rows, qkv_ wide), and those its
  // backward runs from dqkv rows of Gemma4DqkvCols: q, k and v, k_proj's twice under k_eq_v (its
  // output is both the keys' and the values' projection).
  StackedWeight Gemma4QkvForwardWeight(const Gemma4LayerDims& d) const;
  StackedWeight Gemma4QkvBackwardWeight(const Gemma4LayerDims& d) const;
  int64_t Gemma4DqkvCols(const Gemma4LayerDims& d) const { return d.kv_source < 0 ? qd_ + 2 * kvd_ : qd_; }
  // q [T, qd], k and v [T, kvd], each in a buffer of its own.
  kernels::AttnRowStrides Gemma4AttnStrides() const {
    return {.q = qd_, .k = kvd_, .v = kvd_, .o = qd_, .dout = qd_, .dq = qd_, .dk = kvd_, .dv = kvd_};
  }
  // y = x · layer_scalar (its FP32 side copy where the unit came with one), n elements; y may alias x.
  absl::Status ScaleByLayerScalar(const UnitParams& params, const float* x, int64_t n, float* y);

  StackedWeight Stack(std::vector<std::pair<int64_t, int64_t>> parts) const {
    StackedWeight s;
    s.parts = std::move(parts);
    for (size_t i = 0; i < s.parts.size(); ++i) {
      s.rows += s.parts[i].second;
      if (i > 0 && s.parts[i].first != s.parts[i - 1].first + s.parts[i - 1].second * H_) s.contiguous = false;
    }
    return s;
  }

  const bf16* W(const bf16_t* params, int t) const { return reinterpret_cast<const bf16*>(params) + off_[t]; }

  // Y[:, 0:rows] (+)= X · Wsᵀ  for a stacked weight; out_ld is Y's row stride. With `bias` (the
  // parts' BF16 biases stacked the same way, [rows]) the GEMM epilogue adds it.
  absl::Status StackedForward(const bf16_t* params, const StackedWeight& sw, const bf16* x, int64_t T, int64_t K,
                              bf16* y, int64_t out_ld, const bf16* bias = nullptr);
  // qwen2: the q/k/v biases stacked into `block` ([qkv_] BF16) for the fused QKV GEMM's epilogue;
  // nullptr for a family without them.
  absl::StatusOr<const bf16*> StackQkvBias(const UnitParams& params, PoolBlock& block);
  // qwen2: the q/k/v bias gradients, the column sums of dqkv [T, qkv_], added to dparams.
  absl::Status QkvBiasBackward(const bf16* dqkv, int64_t T, float* dparams, float* ws);
  // dX = dY · Ws (dY [T, rows] with stride dy_ld) and dWs += dYᵀ · X.
  // dx is BF16 or FP32 per dx_type.
  absl::Status StackedBackward(const bf16_t* params, float* dparams, const StackedWeight& sw, const bf16* dy,
                               int64_t dy_ld, const bf16* x, int64_t T, int64_t K, void* dx, Dtype dx_type);
  absl::Status Wgrad(const bf16* dy, int64_t dy_ld, const bf16* x, int64_t x_ld, int64_t T, int64_t out_rows,
                     int64_t in_cols, float* dw);

  // Attention's arguments for decoder layer `layer` of this batch (its sliding window, if any).
  kernels::AttnArgs Attn(const CudaBatch& b, int layer) const {
    kernels::AttnArgs a;
    a.window = layer >= 0 ? static_cast<int>(config_.AttentionWindow(layer)) : 0;
    a.tokens = b.num_tokens_;
    a.num_docs = b.num_docs_;
    a.max_seqlen = std::max(1, b.max_seqlen_);
    a.num_q_heads = nq_;
    a.num_kv_heads = nkv_;
    a.head_dim = hd_;
    a.softmax_scale = static_cast<float>(config_.AttentionScale());  // gemma3: query_pre_attn_scalar^-0.5
    a.cu_seqlens = b.cu_seqlens_;
    a.cu_seqlens_host = b.host_cu_seqlens_.data();
    a.ordered_dq = options_.deterministic;
    if (b.context()) {  // this share's pieces against the whole's keys (cross attention)
      a.kv_bounds = b.kv_bounds_;
      a.kv_bounds_host = b.host_kv_bounds_.data();
      a.kv_tokens = b.context_tokens_;
      a.max_seqlen_kv = std::max(a.max_seqlen, b.max_keys_);
    }
    return a;
  }
  // RoPE over T tokens of decoder layer `layer` (gemma3's sliding layers rotate with their own
  // frequencies; -1: the full layers', as for sizes).
  kernels::RopeArgs Rope(int64_t T, int layer = -1) const {
    const bool sliding = config_.UsesSlidingRope(layer);
    kernels::RopeArgs r;
    r.tokens = T;
    r.num_q_heads = nq_;
    r.num_kv_heads = nkv_;
    r.head_dim = hd_;
    r.eps = static_cast<float>(config_.rms_norm_eps);
    r.theta = static_cast<float>(sliding ? config_.sliding_rope_theta : config_.rope_theta);
    r.inv_freq = sliding ? rope_inv_freq_sliding_ : rope_inv_freq_;
    r.attention_scaling =
        static_cast<float>(config_.RopeAttentionScaling(sliding ? AttentionSpan::kSliding : AttentionSpan::kFull));
    r.norm_weight = NormMode();
    // qwen3_5: RoPE on the first rotary_dim dims only; q heads every 2 hd in the fused rows (the
    // gates between them), k right after them (RopeArgs::k_column's default).
    if (config_.rotary_dim() != config_.head_dim) r.rotary_dim = static_cast<int>(config_.rotary_dim());
    if (config_.has_attention_output_gate()) r.q_head_stride = 2 * hd_;
    return r;
  }
  // How the RMSNorm weights act: qwen3_5's as 1 + w (every norm but the gated one of its Gated
  // DeltaNet, which takes its weight separately), the other families' as w.
  kernels::NormWeight NormMode() const {
    return config_.norms_add_one() ? kernels::NormWeight::kOnePlus : kernels::NormWeight::kPlain;
  }

  bool f32() const { return options_.fp32_residual; }
  // A high-water attribute (bytes) of the device's current pool; 0 where it cannot be read.
  int64_t PoolHighWater(cudaMemPoolAttr attr) const {
    cudaMemPool_t pool;
    uint64_t peak = 0;
    if (cudaDeviceGetMemPool(&pool, device_) == cudaSuccess) cudaMemPoolGetAttribute(pool, attr, &peak);
    return static_cast<int64_t>(peak);
  }
  int64_t act_bytes() const { return f32() ? 4 : 2; }
  Dtype act_gemm_type() const { return f32() ? Dtype::kF32 : Dtype::kBF16; }

  // A norm weight: its FP32 values when the unit came with the FP32 side copy, else BF16.
  struct NormW {
    const bf16* b = nullptr;
    const float* f = nullptr;
  };
  NormW Norm(const UnitParams& p, int t) const {
    return {W(p.bf16, t), p.fp32 != nullptr ? p.fp32 + fp32_off_[t] : nullptr};
  }
  // RMSNorm over the residual stream x (FP32 or BF16 per mode) into the BF16 GEMM input y.
  absl::Status NormForward(const void* x, NormW w, int64_t T, bf16* y, float* rstd) {
    if (w.f != nullptr) return NormForwardAs(x, w.f, T, y, rstd);
    return NormForwardAs(x, w.b, T, y, rstd);
  }
  template <typename WT>
  absl::Status NormForwardAs(const void* x, const WT* w, int64_t T, bf16* y, float* rstd) {
    const float eps = static_cast<float>(config_.rms_norm_eps);
    if (f32()) return kernels::RmsNormForward(static_cast<const float*>(x), w, T, H_, eps, y, rstd, stream_, NormMode());
    return kernels::RmsNormForward(static_cast<const bf16*>(x), w, T, H_, eps, y, rstd, stream_, NormMode());
  }
  // dx = RMSNormᵀ(dy) (+ dres); dy, x, dres, dx all in the residual dtype. dres may be null.
  absl::Status NormBackward(const void* dy, const void* x, NormW w, const float* rstd, const void* dres, int64_t T,
                            void* dx, float* dw, float* ws) {
    if (w.f != nullptr) return NormBackwardAs(dy, x, w.f, rstd, dres, T, dx, dw, ws);
    return NormBackwardAs(dy, x, w.b, rstd, dres, T, dx, dw, ws);
  }
  template <typename WT>
  absl::Status NormBackwardAs(const void* dy, const void* x, const WT* w, const float* rstd, const void* dres,
                              int64_t T, void* dx, float* dw, float* ws) {
    if (f32()) {
      return kernels::RmsNormBackward(static_cast<const float*>(dy), static_cast<const float*>(x), w, rstd,
                                      static_cast<const float*>(dres), T, H_, static_cast<float*>(dx), dw, ws, stream_,
                                      NormMode());
    }
    return kernels::RmsNormBackward(static_cast<const bf16*>(dy), static_cast<const bf16*>(x), w, rstd,
                                    static_cast<const bf16*>(dres), T, H_, static_cast<bf16*>(dx), dw, ws, stream_,
                                    NormMode());
  }
  // q/k norm + RoPE over T tokens (a tile: a's pointers and `positions` at its first row), with
  // the weights' FP32 values when present.
  absl::Status QkForward(const UnitParams& p, const int32_t* positions, int64_t T, const LayerActs& a) {
    const kernels::RopeArgs rope = Rope(T, p.decoder_layer);
    if (!config_.has_qk_norm()) return kernels::RopeForward(rope, a.qkv, qkv_, positions, a.qr, a.kr, stream_);
    const NormW q = Norm(p, kQNorm), k = Norm(p, kKNorm);
    if (q.f != nullptr) {
      return kernels::QkNormRopeForward(rope, a.qkv, qkv_, q.f, k.f, positions, a.qr, a.kr, stream_);
    }
    return kernels::QkNormRopeForward(rope, a.qkv, qkv_, q.b, k.b, positions, a.qr, a.kr, stream_);
  }
  // out = res + a · Wᵀ  (a [T, k] BF16, W [H, k]); res/out in the residual dtype. FP32 mode rounds
  // the GEMM output to BF16 in `branch` ([T, H] BF16 scratch) and adds in FP32, as HF autocast.
  absl::Status ResidualGemm(const bf16* a, int64_t k, const bf16* w, const void* res, void* out, bf16* branch,
                            int64_t T, const bf16* bias = nullptr);
  // The branch GEMM's arguments without an output: [T, H] = a · Wᵀ (+ bias).
  GemmArgs BranchGemm(const bf16* a, int64_t k, const bf16* w, int64_t T, const bf16* bias = nullptr) const;
  // Its backward for the branch: da = dres · W and dW += dresᵀ · a, with dres (T rows of the
  // residual stream's gradient) rounded to BF16 in dres_b ([T, H] scratch) in FP32 mode.
  // With dbias (gpt_oss's o_proj bias), the column sums of that gradient are added to it (ws:
  // ColumnSumsWorkspaceNumel(T, H) floats).
  absl::Status ResidualBranchBackward(const void* dres, int64_t T, const bf16* w, int64_t k, const bf16* a, bf16* da,
                                      float* dw, bf16* dres_b, float* dbias = nullptr, float* ws = nullptr);
  // Its GEMMs alone, from the branch's BF16 output gradient g [T, H].
  absl::Status BranchGemmBackward(const bf16* g, int64_t T, const bf16* w, int64_t k, const bf16* a, bf16* da,
                                  float* dw);
  // gpt_oss: o_proj's BF16 bias (the GEMM epilogue's), nullptr for the other families; and where its
  // gradient goes.
  const bf16* OBias(const UnitParams& p) const { return config_.has_o_bias() ? W(p.bf16, kOBias) : nullptr; }
  float* OBiasGrad(float* dparams) const { return config_.has_o_bias() ? dparams + off_[kOBias] : nullptr; }
  // gpt_oss: the layer's sink logits in FP32 (its side copy, or its BF16 values widened into
  // `block`), nullptr for the other families.
  absl::StatusOr<const float*> Sinks(const UnitParams& p, PoolBlock& block);
  // Attention's arguments for the layer of `p`: Attn's, with the layer's sinks (and, given dparams,
  // where their gradient goes); `block` holds a widened copy of them.
  absl::StatusOr<kernels::AttnArgs> LayerAttn(const UnitParams& p, const CudaBatch& b, PoolBlock& block,
                                               float* dparams = nullptr);
  // gemma3's sandwich branches (FP32 residual only): out = res + RMSNorm_t(a · Wᵀ), keeping the
  // GEMM's BF16 output in `pre` and the norm's rsqrt in `rstd` (out null: those alone); `normed`
  // is [T, H] BF16 scratch. Backward: dres (FP32) rounded to BF16 (dres_b) through the norm
  // (dnorm_w += its weight gradient) into dpre ([T, H] BF16 scratch), then BranchGemmBackward.
  absl::Status SandwichForward(const bf16* a, int64_t k, const bf16* w, const UnitParams& p, int norm, const void* res,
                               void* out, bf16* pre, float* rstd, bf16* normed, int64_t T);
  absl::Status SandwichBackward(const void* dres, int64_t T, const bf16* w, int64_t k, const bf16* a,
                                const UnitParams& p, int norm, const bf16* pre, const float* rstd, bf16* da, float* dw,
                                float* dparams, bf16* dres_b, bf16* dpre, float* ws);
  // The norm of the MLP's input: post_attention_layernorm, or gemma3's pre_feedforward_layernorm.
  int MlpInputNorm() const { return config_.has_sandwich_norms() ? kPreFfnNorm : kPostNorm; }
  kernels::GluActivation Glu() const {
    return config_.mlp_activation() == MlpActivation::kGeluTanh ? kernels::GluActivation::kGeluTanh
                                                                 : kernels::GluActivation::kSilu;
  }
  // gemma3's and gemma4's layers keep nothing (as on the CPU backend): backward recomputes each from
  // its input.
  bool LayersKeepNothing() const { return config_.is_gemma3() || config_.is_gemma4(); }
  // Whether attention keeps its output's low half (LayerActs::o_lo): the layers with sinks, which
  // the own kernels run (GPT-OSS: its v bias dominates the output, docs/kernels.md "The row dots").
  bool KeepsOutputLowHalf() const { return config_.has_attention_sinks(); }

  // Reserves the activations of the pieces in `pieces` (common/policy/layer_pieces.h): those
  // attention reads or writes (qkv, qr, kr, o, lse) for all T tokens, the token-local ones (the
  // norms' outputs, h1, gu, act) for `local_rows` (T for kept pieces, a tile for scratch).
  // A sparse layer has no dense MLP: `inter` 0 reserves no gu/act (default: the dense I_).
  void ReserveActs(Carver& c, LayerActs& a, int64_t T, uint32_t pieces, int64_t local_rows, int64_t inter = -1) const {
    const int64_t I = inter < 0 ? I_ : inter;
    if (pieces & kPieceCheap) {
      c.Reserve(&a.xn1, local_rows * H_);
      c.Reserve(&a.rstd1, local_rows);
      c.Reserve(&a.qr, T * qd_);
      c.Reserve(&a.kr, T * kvd_);
      c.Reserve(&a.xn2, local_rows * H_);
      c.Reserve(&a.rstd2, local_rows);
      c.Reserve(&a.act, local_rows * I);
    }
    if (pieces & kPieceQkv) c.Reserve(&a.qkv, T * qkv_);
    if (pieces & kPieceOProj) c.ReserveBytes(&a.h1, local_rows * H_ * act_bytes());
    if (pieces & kPieceGateUp) c.Reserve(&a.gu, local_rows * 2 * I);
    if (config_.has_sandwich_norms()) {
      if (pieces & kPieceOProj) c.Reserve(&a.ob, local_rows * H_), c.Reserve(&a.rstd_o, local_rows);
      if ((pieces & kPieceGateUp) && I > 0) c.Reserve(&a.down, local_rows * H_), c.Reserve(&a.rstd_d, local_rows);
    }
    if (pieces & kPieceAttention) {
      c.Reserve(&a.o, T * qd_);
      c.Reserve(&a.lse, T * nq_);
      if (KeepsOutputLowHalf()) c.Reserve(&a.o_lo, T * qd_);
    }
  }
  // The view of a tile starting at row t0: the whole-sequence intermediates (attention's, and the
  // token-local ones of the pieces in `whole`) offset to the tile's rows, the token-local scratch
  // of the other pieces as it is (one tile's worth, reused by every tile). lse ([nq, T]) is left
  // whole: only attention reads it.
  LayerActs TileOf(const LayerActs& a, int64_t t0, uint32_t whole) const {
    LayerActs t = a;
    auto at = [t0](auto* p, int64_t width) { return p != nullptr ? p + t0 * width : p; };
    t.qkv = at(a.qkv, qkv_);
    t.qr = at(a.qr, qd_);
    t.kr = at(a.kr, kvd_);
    t.o = at(a.o, qd_);
    if (whole & kPieceCheap) {
      t.xn1 = at(a.xn1, H_), t.rstd1 = at(a.rstd1, 1), t.xn2 = at(a.xn2, H_);
      t.rstd2 = at(a.rstd2, 1), t.act = at(a.act, I_);
    }
    if ((whole & kPieceOProj) && a.h1 != nullptr) t.h1 = static_cast<char*>(a.h1) + t0 * H_ * act_bytes();
    if (whole & kPieceGateUp) t.gu = at(a.gu, 2 * I_);
    if (whole & kPieceOProj) t.ob = at(a.ob, H_), t.rstd_o = at(a.rstd_o, 1);
    if (whole & kPieceGateUp) t.down = at(a.down, H_), t.rstd_d = at(a.rstd_d, 1);
    return t;
  }
  // Row t0 of a residual-stream tensor (FP32 or BF16 per mode).
  const void* ResidualRow(const void* p, int64_t t0) const {
    return static_cast<const char*>(p) + t0 * H_ * act_bytes();
  }
  void* ResidualRow(void* p, int64_t t0) const { return static_cast<char*>(p) + t0 * H_ * act_bytes(); }
  // Points the pieces `pieces` of `to` at those of `from`.
  static void TakePieces(const LayerActs& from, uint32_t pieces, LayerActs* to) {
    if (pieces & kPieceCheap) {
      to->xn1 = from.xn1, to->rstd1 = from.rstd1, to->qr = from.qr, to->kr = from.kr;
      to->xn2 = from.xn2, to->rstd2 = from.rstd2, to->act = from.act;
    }
    if (pieces & kPieceQkv) to->qkv = from.qkv;
    if (pieces & kPieceOProj) to->h1 = from.h1, to->ob = from.ob, to->rstd_o = from.rstd_o;
    if (pieces & kPieceGateUp) to->gu = from.gu, to->down = from.down, to->rstd_d = from.rstd_d;
    if (pieces & kPieceAttention) to->o = from.o, to->lse = from.lse, to->o_lo = from.o_lo;
  }

  // The head: loss and (dx non-null) its gradients; HeadForwardBackward and HeadLoss.
  absl::Status Head(const UnitParams& norm_params, const bf16_t* lm_head_w, const DeviceBatch& batch, const void* x,
                    float loss_scale, void* dx, float* dnorm, float* dlm_head, float* loss_sum);

  // The layer forward in three parts, each skipping the pieces in `given` (already in `a`: a
  // segment's kept pieces, when backward recomputes around them); `whole` names the pieces whose
  // token-local intermediates in `a` hold every row (TileOf).
  // 1. Attention's inputs (xn1, qkv, qr, kr), tile by tile over the whole batch.
  absl::Status AttentionInputs(const UnitParams& params, const CudaBatch& b, const void* x, const LayerActs& a,
                               uint32_t given, uint32_t whole);
  // 2. AttentionForward (o, lse) over the whole batch.
  // 3. One tile's rest (h1, xn2, gu, act and, when y is not null, the output rows y): `at` is the
  // tile's view, x and y point at its first row, branch is FP32 mode's BF16 scratch of the tile.
  absl::Status MlpTile(const UnitParams& params, const void* x, const LayerActs& at, int64_t rows, uint32_t given,
                       void* y, bf16* branch);

  // Attention through cuDNN when it is loaded and accepts the shape, else the own kernels. The
  // two keep the same contract (o, natural-log LSE [nq, T]), so a forward of one and a backward
  // of the other compose.
  enum class AttnDir { kForward, kBackward };
  kernels::AttnRowStrides AttnStrides() const {
    return {.q = qd_, .k = kvd_, .v = qkv_, .o = qd_, .dout = qd_, .dq = qd_, .dk = kvd_, .dv = qkv_};
  }
  // cuDNN's workspace for this call, or nullopt when the own kernels run it (no cuDNN, or its
  // engines reject the shape: logged once per direction). Other cuDNN errors are returned.
  absl::StatusOr<std::optional<int64_t>> CudnnWorkspace(AttnDir dir, const kernels::AttnArgs& a);
  // The same for a call of these row strides (gemma4's q, k and v in buffers of their own).
  absl::StatusOr<std::optional<int64_t>> CudnnWorkspace(AttnDir dir, const kernels::AttnArgs& a,
                                                        const kernels::AttnRowStrides& ld);
  // A context-parallel share (b.context()) attends the group's keys and values, [whole, 2 kvd]
  // BF16 (keys | values per row, GatherContextKv); kv null: gathered here.
  absl::Status AttentionForward(const UnitParams& p, const CudaBatch& b, const LayerActs& a, const bf16* kv = nullptr);
  // cudnn_ws: CudnnWorkspace(kBackward)'s answer for this call (ws holds that many bytes, or the
  // own kernels' workspace when it is empty). A share: kv as above (required); dk and dv get this
  // rank's rows of the group's summed key/value gradients.
  absl::Status AttentionBackward(const CudaBatch& b, const kernels::AttnArgs& a, const std::optional<int64_t>& cudnn_ws,
                                 const LayerActs& acts, bf16* d_o, bf16* dq, bf16* dk, bf16* dv, char* ws,
                                 const bf16* kv = nullptr);

  // Context parallelism: the group's keys and values of this layer in the whole's token order,
  // [whole, 2 kvd] BF16 in `block` (this share's kr and v packed, all-gathered rank-major, then
  // reordered); nullptr into *kv for a micro-batch of its own.
  absl::Status GatherContextKv(const CudaBatch& b, const LayerActs& a, PoolBlock& block, const bf16** kv);
  // The group's collectives over device buffers: the group's own (NCCL) or staged through pinned
  // host memory and its host collectives (the shm segment).
  absl::Status ContextAllGather(const void* local, int64_t bytes, void* out);
  absl::Status ContextReduceScatter(float* buf, int64_t shard_numel, int rank);  // rank: this one's in the group
  absl::StatusOr<char*> ContextStaging(int64_t bytes);

  int device_;
  CudaBackendOptions options_;
  bool deterministic_default_ = false;     // options.deterministic at construction
  ContextGroup* context_group_ = nullptr;  // SetContextGroup (not owned)
  char* context_staging_ = nullptr;        // pinned host memory for a group without device collectives
  int64_t context_staging_bytes_ = 0;
  cudaStream_t stream_ = nullptr;
  int64_t limit_ = 0;                     // SetMemoryLimit; 0: the default pool
  cudaMemPool_t limited_pool_ = nullptr;  // the device's current pool while limited
  GemmRunner gemm_;
  std::unique_ptr<kernels::CudnnAttention> cudnn_;
  bool cudnn_rejected_logged_[2] = {false, false};
  int64_t H_ = 0, I_ = 0, qd_ = 0, kvd_ = 0, qkv_ = 0;
  int64_t q_cols_ = 0;  // q's columns in the fused qkv rows: qd_, or 2 qd_ with qwen3_5's gates
  int nq_ = 0, nkv_ = 0, hd_ = 0;
  int64_t off_[kNumDecoderTensors] = {};       // -1: not in this family's layer
  int64_t fp32_off_[kNumDecoderTensors] = {};  // in the FP32 side copy (norm weights only)
  float* rope_inv_freq_ = nullptr;             // device [rotary_dim / 2] for a scaled or partial RoPE, else null
  float* rope_inv_freq_sliding_ = nullptr;     // gemma3's sliding layers' (has_sliding_rope), else null
  float embed_scale_ = 1.0f;                   // gemma3: the embedding's sqrt(hidden) (EmbeddingScale)
  StackedWeight qkv_w_, gu_w_;
  // qwen3_5: the Gated DeltaNet's four input projections [Wqkv; Wz; Wb; Wa] and the shared expert's
  // [gate; up] (of the current layer: SelectLayer), and every decoder layer's shape.
  StackedWeight lin_w_, shared_gu_w_;
  std::vector<LayerShape> layer_shapes_;
  // gemma4: every decoder layer's shape, and embed_tokens_per_layer's offset in the embedding unit.
  std::vector<Gemma4Layer> gemma4_layers_;
  int64_t ple_table_offset_ = 0;
  // MoE models: the sparse layers' block (of the current layer for qwen3_5: SelectLayer), the
  // blocks (one, or one per qwen3_5 sparse layer, whose units differ by mixer), and each decoder
  // layer's sparse ordinal (-1: dense).
  CudaMoeBlock* moe_ = nullptr;
  std::vector<std::unique_ptr<CudaMoeBlock>> moe_blocks_;
  std::vector<int> sparse_ordinal_;
  int num_sparse_ = 0;
};

}  // namespace slidedp::cuda_backend_internal
