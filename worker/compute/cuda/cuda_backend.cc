// CUDA ComputeBackend: one decoder layer, the embedding and the fused head on one stream.
//
// Decoder forward (HF Qwen3DecoderLayer), T tokens, W row-major [out, in]:
//   xn1 = RMSNorm(x)            qkv = xn1·[Wq;Wk;Wv]ᵀ        qr,kr = RoPE(q_norm(q)), RoPE(k_norm(k))
//   o,lse = FlashAttn(qr,kr,v)  h1 = x + o·Woᵀ
//   xn2 = RMSNorm(h1)           gu = xn2·[Wg;Wu]ᵀ            act = silu(g)·u
//   y = h1 + act·Wdᵀ
// Backward walks this in reverse; weight gradients go straight into the FP32 gradient array
// (cuBLASLt beta = 1), norm-weight gradients through deterministic two-stage reductions.
//
// Residual stream dtype (CudaBackendOptions::fp32_residual):
// - FP32 (default; HF autocast numerics): x, h1, y and dy, dh1, dx are FP32. RMSNorms read FP32 and
//   write the BF16 GEMM input; o·Woᵀ and act·Wdᵀ are BF16 GEMM outputs added to the residual in
//   FP32 (AddBf16ToF32). Backward: residual gradients are FP32; the GEMMs read a BF16 copy of them
//   (HF: the gradient of the BF16 branch output); the dgrads into the norm outputs (dxn) are FP32
//   GEMM outputs, and the norm backward adds into the FP32 residual gradient.
// - BF16: everything BF16, residual added in the GEMM epilogue (beta = 1, BF16 C).
#include "worker/compute/cuda/cuda_backend.h"

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <limits>
#include <numeric>
#include <optional>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/status/status_macros.h"
#include "glog/logging.h"
#include "worker/kernels/attention.h"
#include "worker/kernels/cross_entropy.h"
#include "worker/kernels/cuda_check.h"
#include "worker/kernels/cudnn_attention.h"
#include "worker/kernels/embedding.h"
#include "worker/kernels/gemm.h"
#include "worker/kernels/qk_norm_rope.h"
#include "worker/kernels/reductions.h"
#include "worker/kernels/rmsnorm.h"
#include "worker/kernels/swiglu.h"

namespace slidedp {
namespace {

using kernels::bf16;

int64_t Align256(int64_t b) { return (b + 255) / 256 * 256; }

// A stream-ordered allocation on the compute stream (cudaMallocAsync from the device pool, which
// keeps freed memory cached): neither allocating nor freeing synchronizes the device, so the
// pipeline's copy and communication streams keep running while buffers come and go. Only the
// compute stream may use it (it is freed in that stream's order).
class CudaBuffer final : public DeviceBuffer {
 public:
  CudaBuffer(void* p, int64_t bytes, cudaStream_t stream) : p_(p), bytes_(bytes), stream_(stream) {}
  ~CudaBuffer() override {
    if (p_ != nullptr) cudaFreeAsync(p_, stream_);
  }
  void* data() override { return p_; }
  int64_t bytes() const override { return bytes_; }

 private:
  void* p_;
  int64_t bytes_;
  cudaStream_t stream_;
};

// A stream-ordered allocation from the device pool, freed (stream-ordered) when destroyed.
class PoolBlock {
 public:
  PoolBlock() = default;
  PoolBlock(const PoolBlock&) = delete;
  PoolBlock& operator=(const PoolBlock&) = delete;
  ~PoolBlock() { Release(); }
  absl::Status Alloc(int64_t bytes, cudaStream_t stream) {
    Release();
    stream_ = stream;
    bytes_ = bytes;
    if (bytes == 0) return absl::OkStatus();
    cudaError_t e = cudaMallocAsync(&p_, static_cast<size_t>(bytes), stream);
    if (e == cudaErrorMemoryAllocation) {
      // The error users meet when a batch or activation policy does not fit: give the numbers.
      cudaGetLastError();
      size_t free_bytes = 0, total_bytes = 0;
      cudaMemGetInfo(&free_bytes, &total_bytes);
      p_ = nullptr;
      return absl::ResourceExhaustedError(absl::StrFormat(
          "GPU memory exhausted: needed %.2f GiB more, %.2f GiB free of %.2f GiB; "
          "lower the tokens per step per worker (train.global_batch), raise runtime.offload_ratio, or use runtime.act_policy: recompute or a smaller train.micro_batch",
          bytes / 1073741824.0, free_bytes / 1073741824.0, total_bytes / 1073741824.0));
    }
    SLIDEDP_CUDA_RETURN_IF_ERROR(e);
    return absl::OkStatus();
  }
  void Release() {
    if (p_ != nullptr) cudaFreeAsync(p_, stream_);
    p_ = nullptr;
  }
  char* get() const { return static_cast<char*>(p_); }
  int64_t bytes() const { return bytes_; }

 private:
  void* p_ = nullptr;
  cudaStream_t stream_ = nullptr;
  int64_t bytes_ = 0;
};

// Carves 256-byte aligned pieces out of one PoolBlock: first Reserve() every piece, then Alloc().
class Carver {
 public:
  template <typename T>
  void Reserve(T** slot, int64_t numel) {
    pieces_.push_back({reinterpret_cast<void**>(slot), offset_});
    offset_ += Align256(numel * static_cast<int64_t>(sizeof(T)));
  }
  // An untyped piece (activations whose dtype depends on the residual mode).
  void ReserveBytes(void** slot, int64_t bytes) {
    pieces_.push_back({slot, offset_});
    offset_ += Align256(bytes);
  }
  absl::Status Alloc(PoolBlock& block, cudaStream_t stream) {
    RETURN_IF_ERROR(block.Alloc(offset_, stream));
    for (auto& p : pieces_) *p.slot = block.get() + p.offset;
    return absl::OkStatus();
  }
  int64_t bytes() const { return offset_; }

 private:
  struct Piece {
    void** slot;
    int64_t offset;
  };
  std::vector<Piece> pieces_;
  int64_t offset_ = 0;
};

class CudaBatch final : public DeviceBatch {
 public:
  int64_t num_tokens() const override { return num_tokens_; }

  int64_t num_tokens_ = 0;
  int num_docs_ = 0;
  int max_seqlen_ = 0;
  int64_t num_unique_ = 0;
  PoolBlock block_;
  int32_t* tokens_ = nullptr;
  int32_t* labels_ = nullptr;
  int32_t* positions_ = nullptr;
  int32_t* cu_seqlens_ = nullptr;
  int32_t* uniq_tokens_ = nullptr;  // embedding backward grouping, built on the host at upload
  int32_t* seg_offsets_ = nullptr;
  int32_t* sorted_pos_ = nullptr;
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
  void* h1 = nullptr;  // residual stream: FP32 or BF16 (CudaBackendOptions::fp32_residual)
  bf16* xn2 = nullptr;
  float* rstd2 = nullptr;
  bf16* gu = nullptr;
  bf16* act = nullptr;
};

class CudaSaved final : public SavedActivations {
 public:
  int64_t bytes() const override { return block_.bytes(); }
  ActPolicy policy_ = ActPolicy::kKeepAll;
  int64_t num_tokens_ = 0;
  PoolBlock block_;
  LayerActs acts_;
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
  CudaBackend(const Qwen3Config& config, int device, const CudaBackendOptions& options)
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
    if (options_.attention != CudaBackendOptions::Attention::kOwn) {
      auto cudnn = kernels::CudnnAttention::Create(device_);
      if (cudnn.ok()) {
        cudnn_ = std::move(*cudnn);
      } else if (options_.attention == CudaBackendOptions::Attention::kCudnn) {
        return absl::Status(cudnn.status().code(), absl::StrCat("attention: cudnn: ", cudnn.status().message()));
      } else {
        LOG(INFO) << "CUDA backend: cuDNN attention unavailable (" << cudnn.status().message()
                  << "); using the own attention kernels";
      }
    }
    H_ = config_.hidden_size;
    I_ = config_.intermediate_size;
    nq_ = static_cast<int>(config_.num_attention_heads);
    nkv_ = static_cast<int>(config_.num_key_value_heads);
    hd_ = static_cast<int>(config_.head_dim);
    qd_ = config_.q_dim();
    kvd_ = config_.kv_dim();
    qkv_ = qd_ + 2 * kvd_;
    if (config_.num_hidden_layers > 0) {
      ModelLayout layout = ModelLayout::Build(config_);
      const UnitLayout& unit = layout.units.at(1);
      if (unit.kind != UnitKind::kDecoder || unit.tensors.size() != kNumDecoderTensors) {
        return absl::InternalError("model layout: unit 1 is not a decoder layer with 11 tensors");
      }
      for (int i = 0; i < kNumDecoderTensors; ++i) {
        off_[i] = unit.tensors[i].offset_numel;
        fp32_off_[i] = unit.tensors[i].fp32_offset;
      }
    }
    qkv_w_ = Stack({{off_[kQProj], qd_}, {off_[kKProj], kvd_}, {off_[kVProj], kvd_}});
    gu_w_ = Stack({{off_[kGateProj], I_}, {off_[kUpProj], I_}});
    return absl::OkStatus();
  }

  std::string name() const override { return "cuda"; }
  // "cudnn <version>" or "own" (what the next attention call will try first).
  std::string attention_impl() const {
    return cudnn_ != nullptr ? absl::StrCat("cudnn ", cudnn_->version()) : std::string("own");
  }
  DType activation_dtype() const override { return options_.fp32_residual ? DType::kF32 : DType::kBF16; }

  absl::StatusOr<std::unique_ptr<DeviceBuffer>> Allocate(int64_t bytes) override {
    void* p = nullptr;
    if (bytes > 0) {
      cudaError_t e = cudaMallocAsync(&p, static_cast<size_t>(bytes), stream_);
      if (e == cudaErrorMemoryAllocation) {
        cudaGetLastError();
        size_t free_bytes = 0, total_bytes = 0;
        cudaMemGetInfo(&free_bytes, &total_bytes);
        return absl::ResourceExhaustedError(absl::StrFormat(
            "GPU memory exhausted: a %.2f GiB buffer does not fit (%.2f GiB free of %.2f GiB); lower the tokens per "
            "step per worker (train.global_batch), raise runtime.offload_ratio, use runtime.act_policy: recompute or a "
            "smaller train.micro_batch",
            bytes / 1073741824.0, free_bytes / 1073741824.0, total_bytes / 1073741824.0));
      }
      SLIDEDP_CUDA_RETURN_IF_ERROR(e);
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
  int64_t peak_memory_bytes() const override {
    cudaMemPool_t pool;
    uint64_t peak = 0;
    if (cudaDeviceGetDefaultMemPool(&pool, device_) == cudaSuccess) {
      cudaMemPoolGetAttribute(pool, cudaMemPoolAttrReservedMemHigh, &peak);
    }
    return static_cast<int64_t>(peak);
  }
  void ResetPeakMemory() override {
    cudaMemPool_t pool;
    uint64_t zero = 0;  // the high watermark can only be reset to zero (it restarts from now)
    if (cudaDeviceGetDefaultMemPool(&pool, device_) == cudaSuccess) {
      cudaMemPoolSetAttribute(pool, cudaMemPoolAttrReservedMemHigh, &zero);
    }
  }

  absl::Status Synchronize() override {
    SLIDEDP_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(stream_));
    return absl::OkStatus();
  }

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
  int64_t SavedBytesPerToken(ActPolicy policy) const override;

 private:
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

  // Y[:, 0:rows] (+)= X · Wsᵀ  for a stacked weight; out_ld is Y's row stride.
  absl::Status StackedForward(const bf16_t* params, const StackedWeight& sw, const bf16* x, int64_t T, int64_t K,
                              bf16* y, int64_t out_ld);
  // dX = dY · Ws (dY [T, rows] with stride dy_ld) and dWs += dYᵀ · X.
  // dx is BF16 or FP32 per dx_type.
  absl::Status StackedBackward(const bf16_t* params, float* dparams, const StackedWeight& sw, const bf16* dy,
                               int64_t dy_ld, const bf16* x, int64_t T, int64_t K, void* dx, GemmOutType dx_type);
  absl::Status Wgrad(const bf16* dy, int64_t dy_ld, const bf16* x, int64_t x_ld, int64_t T, int64_t out_rows,
                     int64_t in_cols, float* dw);

  kernels::AttnArgs Attn(const CudaBatch& b) const {
    kernels::AttnArgs a;
    a.tokens = b.num_tokens_;
    a.num_docs = b.num_docs_;
    a.max_seqlen = std::max(1, b.max_seqlen_);
    a.num_q_heads = nq_;
    a.num_kv_heads = nkv_;
    a.head_dim = hd_;
    a.softmax_scale = 1.0f / std::sqrt(static_cast<float>(hd_));
    a.cu_seqlens = b.cu_seqlens_;
    a.ordered_dq = options_.deterministic;
    return a;
  }
  kernels::RopeArgs Rope(int64_t T) const {
    kernels::RopeArgs r;
    r.tokens = T;
    r.num_q_heads = nq_;
    r.num_kv_heads = nkv_;
    r.head_dim = hd_;
    r.eps = static_cast<float>(config_.rms_norm_eps);
    r.theta = static_cast<float>(config_.rope_theta);
    return r;
  }

  bool f32() const { return options_.fp32_residual; }
  int64_t act_bytes() const { return f32() ? 4 : 2; }
  GemmOutType act_gemm_type() const { return f32() ? GemmOutType::kF32 : GemmOutType::kBF16; }

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
    if (f32()) return kernels::RmsNormForward(static_cast<const float*>(x), w, T, H_, eps, y, rstd, stream_);
    return kernels::RmsNormForward(static_cast<const bf16*>(x), w, T, H_, eps, y, rstd, stream_);
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
                                      static_cast<const float*>(dres), T, H_, static_cast<float*>(dx), dw, ws, stream_);
    }
    return kernels::RmsNormBackward(static_cast<const bf16*>(dy), static_cast<const bf16*>(x), w, rstd,
                                    static_cast<const bf16*>(dres), T, H_, static_cast<bf16*>(dx), dw, ws, stream_);
  }
  // q/k norm + RoPE, forward and backward, with the weights' FP32 values when present.
  absl::Status QkForward(const UnitParams& p, const CudaBatch& b, const LayerActs& a) {
    const NormW q = Norm(p, kQNorm), k = Norm(p, kKNorm);
    const kernels::RopeArgs rope = Rope(b.num_tokens_);
    if (q.f != nullptr) {
      return kernels::QkNormRopeForward(rope, a.qkv, qkv_, q.f, k.f, b.positions_, a.qr, a.kr, stream_);
    }
    return kernels::QkNormRopeForward(rope, a.qkv, qkv_, q.b, k.b, b.positions_, a.qr, a.kr, stream_);
  }
  // out = res + a · Wᵀ  (a [T, k] BF16, W [H, k]); res/out in the residual dtype. FP32 mode rounds
  // the GEMM output to BF16 in `branch` ([T, H] BF16 scratch) and adds in FP32, as HF autocast.
  absl::Status ResidualGemm(const bf16* a, int64_t k, const bf16* w, const void* res, void* out, bf16* branch,
                            int64_t T);

  void ReserveActs(Carver& c, LayerActs& a, int64_t T, bool attention_part, bool rest) const {
    if (rest) {
      c.Reserve(&a.xn1, T * H_);
      c.Reserve(&a.rstd1, T);
      c.Reserve(&a.qkv, T * qkv_);
      c.Reserve(&a.qr, T * qd_);
      c.Reserve(&a.kr, T * kvd_);
      c.ReserveBytes(&a.h1, T * H_ * act_bytes());
      c.Reserve(&a.xn2, T * H_);
      c.Reserve(&a.rstd2, T);
      c.Reserve(&a.gu, T * 2 * I_);
      c.Reserve(&a.act, T * I_);
    }
    if (attention_part) {
      c.Reserve(&a.o, T * qd_);
      c.Reserve(&a.lse, T * nq_);
    }
  }

  // Runs the layer forward into `a`. With run_attention false, a.o / a.lse are inputs (selective
  // recompute). y may be null (recompute: the output is not needed).
  absl::Status LayerForward(const UnitParams& params, const CudaBatch& b, const void* x, const LayerActs& a,
                            bool run_attention, void* y);

  // Attention through cuDNN when it is loaded and accepts the shape, else the own kernels. The
  // two keep the same contract (o, natural-log LSE [nq, T]), so a forward of one and a backward
  // of the other compose.
  enum class AttnDir { kForward, kBackward };
  kernels::AttnRowStrides AttnStrides() const {
    return {.q = qd_, .k = kvd_, .v = qkv_, .o = qd_, .dout = qd_, .dq = qd_, .dk = kvd_, .dv = qkv_};
  }
  // cuDNN's workspace for this call, or nullopt when the own kernels run it (no cuDNN, or its
  // engines reject the shape: logged once per direction). Other cuDNN errors are returned.
  absl::StatusOr<std::optional<int64_t>> CudnnWorkspace(AttnDir dir,
                                                        const kernels::AttnArgs& a);
  absl::Status AttentionForward(const CudaBatch& b, const LayerActs& a);
  // cudnn_ws: CudnnWorkspace(kBackward)'s answer for this call (ws holds that many bytes, or the
  // own kernels' workspace when it is empty).
  absl::Status AttentionBackward(const kernels::AttnArgs& a, const std::optional<int64_t>& cudnn_ws,
                                 const LayerActs& acts, bf16* d_o, bf16* dq, bf16* dk,
                                 bf16* dv, char* ws);

  int device_;
  CudaBackendOptions options_;
  bool deterministic_default_ = false;  // options.deterministic at construction
  cudaStream_t stream_ = nullptr;
  GemmRunner gemm_;
  std::unique_ptr<kernels::CudnnAttention> cudnn_;
  bool cudnn_rejected_logged_[2] = {false, false};
  int64_t H_ = 0, I_ = 0, qd_ = 0, kvd_ = 0, qkv_ = 0;
  int nq_ = 0, nkv_ = 0, hd_ = 0;
  int64_t off_[kNumDecoderTensors] = {};
  int64_t fp32_off_[kNumDecoderTensors] = {};  // in the FP32 side copy (norm weights only)
  StackedWeight qkv_w_, gu_w_;
};

absl::StatusOr<std::unique_ptr<DeviceBatch>> CudaBackend::UploadBatch(const MicroBatch& mb) {
  const int64_t T = mb.num_tokens();
  if (mb.labels.size() != mb.tokens.size() || mb.positions.size() != mb.tokens.size()) {
    return absl::InvalidArgumentError(absl::StrCat("micro-batch: ", mb.tokens.size(), " tokens but ",
                                                   mb.labels.size(), " labels and ", mb.positions.size(),
                                                   " positions"));
  }
  if (mb.cu_seqlens.size() < 2 || mb.cu_seqlens.front() != 0 || mb.cu_seqlens.back() != T) {
    return absl::InvalidArgumentError(absl::StrCat("micro-batch: cu_seqlens must run from 0 to ", T));
  }
  int max_len = 0;
  for (size_t i = 1; i < mb.cu_seqlens.size(); ++i) {
    const int len = mb.cu_seqlens[i] - mb.cu_seqlens[i - 1];
    if (len < 0) return absl::InvalidArgumentError(absl::StrCat("micro-batch: cu_seqlens decreases at ", i));
    max_len = std::max(max_len, len);
  }
  if (mb.max_seqlen < max_len) {
    return absl::InvalidArgumentError(
        absl::StrCat("micro-batch: max_seqlen ", mb.max_seqlen, " < longest document ", max_len));
  }
  const int64_t V = config_.vocab_size;
  for (int64_t t = 0; t < T; ++t) {
    if (mb.tokens[t] < 0 || mb.tokens[t] >= V) {
      return absl::InvalidArgumentError(absl::StrCat("micro-batch: token ", mb.tokens[t], " at ", t, " outside [0, ", V, ")"));
    }
    if (mb.labels[t] != kIgnoreIndex && (mb.labels[t] < 0 || mb.labels[t] >= V)) {
      return absl::InvalidArgumentError(absl::StrCat("micro-batch: label ", mb.labels[t], " at ", t, " outside [0, ", V, ")"));
    }
    if (mb.positions[t] < 0) return absl::InvalidArgumentError(absl::StrCat("micro-batch: negative position at ", t));
  }
  // Group positions by token id (stable) for the atomic-free embedding backward.
  std::vector<int32_t> order(T);
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](int32_t a, int32_t b) { return mb.tokens[a] < mb.tokens[b]; });
  std::vector<int32_t> uniq, seg;
  for (int64_t i = 0; i < T; ++i) {
    if (i == 0 || mb.tokens[order[i]] != mb.tokens[order[i - 1]]) {
      uniq.push_back(mb.tokens[order[i]]);
      seg.push_back(static_cast<int32_t>(i));
    }
  }
  seg.push_back(static_cast<int32_t>(T));

  auto b = std::make_unique<CudaBatch>();
  b->num_tokens_ = T;
  b->num_docs_ = static_cast<int>(mb.cu_seqlens.size()) - 1;
  b->max_seqlen_ = max_len;
  b->num_unique_ = static_cast<int64_t>(uniq.size());
  Carver c;
  c.Reserve(&b->tokens_, T);
  c.Reserve(&b->labels_, T);
  c.Reserve(&b->positions_, T);
  c.Reserve(&b->cu_seqlens_, static_cast<int64_t>(mb.cu_seqlens.size()));
  c.Reserve(&b->uniq_tokens_, static_cast<int64_t>(uniq.size()));
  c.Reserve(&b->seg_offsets_, static_cast<int64_t>(seg.size()));
  c.Reserve(&b->sorted_pos_, T);
  RETURN_IF_ERROR(c.Alloc(b->block_, stream_));
  auto up = [&](int32_t* dst, const std::vector<int32_t>& src) -> absl::Status {
    if (src.empty()) return absl::OkStatus();
    SLIDEDP_CUDA_RETURN_IF_ERROR(
        cudaMemcpyAsync(dst, src.data(), src.size() * sizeof(int32_t), cudaMemcpyHostToDevice, stream_));
    return absl::OkStatus();
  };
  RETURN_IF_ERROR(up(b->tokens_, mb.tokens));
  RETURN_IF_ERROR(up(b->labels_, mb.labels));
  RETURN_IF_ERROR(up(b->positions_, mb.positions));
  RETURN_IF_ERROR(up(b->cu_seqlens_, mb.cu_seqlens));
  RETURN_IF_ERROR(up(b->uniq_tokens_, uniq));
  RETURN_IF_ERROR(up(b->seg_offsets_, seg));
  RETURN_IF_ERROR(up(b->sorted_pos_, order));
  // Host vectors die at return: wait for the (pageable) copies.
  SLIDEDP_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(stream_));
  return std::unique_ptr<DeviceBatch>(std::move(b));
}

absl::Status CudaBackend::EmbeddingForward(const UnitParams& embed, const DeviceBatch& batch, void* out) {
  const auto& b = static_cast<const CudaBatch&>(batch);
  auto lookup = [&](const auto* table) {
    return f32() ? kernels::EmbeddingForward(table, b.tokens_, b.num_tokens_, H_, static_cast<float*>(out), stream_)
                 : kernels::EmbeddingForward(table, b.tokens_, b.num_tokens_, H_, static_cast<bf16*>(out), stream_);
  };
  if (embed.fp32 != nullptr) return lookup(embed.fp32);
  return lookup(reinterpret_cast<const bf16*>(embed.bf16));
}

absl::Status CudaBackend::EmbeddingBackward(const void* dout, const DeviceBatch& batch, float* dembed) {
  const auto& b = static_cast<const CudaBatch&>(batch);
  if (f32()) {
    return kernels::EmbeddingBackward(static_cast<const float*>(dout), b.uniq_tokens_, b.seg_offsets_, b.sorted_pos_,
                                      b.num_unique_, H_, dembed, stream_);
  }
  return kernels::EmbeddingBackward(static_cast<const bf16*>(dout), b.uniq_tokens_, b.seg_offsets_, b.sorted_pos_,
                                    b.num_unique_, H_, dembed, stream_);
}

absl::Status CudaBackend::StackedForward(const bf16_t* params, const StackedWeight& sw, const bf16* x, int64_t T,
                                         int64_t K, bf16* y, int64_t out_ld) {
  int64_t col = 0;
  for (size_t i = 0; i < sw.parts.size(); ++i) {
    const int64_t rows = sw.contiguous ? sw.rows : sw.parts[i].second;
    GemmArgs g;
    g.op_a = GemmOp::kN;
    g.op_b = GemmOp::kT;
    g.m = T;
    g.n = rows;
    g.k = K;
    g.a = x;
    g.lda = K;
    g.b = reinterpret_cast<const bf16*>(params) + sw.parts[i].first;
    g.ldb = K;
    g.d = y + col;
    g.ldd = out_ld;
    RETURN_IF_ERROR(gemm_.Run(g, stream_));
    if (sw.contiguous) break;
    col += rows;
  }
  return absl::OkStatus();
}

absl::Status CudaBackend::Wgrad(const bf16* dy, int64_t dy_ld, const bf16* x, int64_t x_ld, int64_t T,
                                int64_t out_rows, int64_t in_cols, float* dw) {
  GemmArgs g;
  g.op_a = GemmOp::kT;
  g.op_b = GemmOp::kN;
  g.m = out_rows;
  g.n = in_cols;
  g.k = T;
  g.a = dy;
  g.lda = dy_ld;
  g.b = x;
  g.ldb = x_ld;
  g.c = dw;
  g.ldc = in_cols;
  g.d = dw;
  g.ldd = in_cols;
  g.out_type = GemmOutType::kF32;
  g.beta = 1.0f;
  return gemm_.Run(g, stream_);
}

absl::Status CudaBackend::StackedBackward(const bf16_t* params, float* dparams, const StackedWeight& sw,
                                          const bf16* dy, int64_t dy_ld, const bf16* x, int64_t T, int64_t K,
                                          void* dx, GemmOutType dx_type) {
  int64_t col = 0;
  for (size_t i = 0; i < sw.parts.size(); ++i) {
    const int64_t rows = sw.contiguous ? sw.rows : sw.parts[i].second;
    GemmArgs g;  // dX (+)= dY[:, col:col+rows] · W_part
    g.op_a = GemmOp::kN;
    g.op_b = GemmOp::kN;
    g.m = T;
    g.n = K;
    g.k = rows;
    g.a = dy + col;
    g.lda = dy_ld;
    g.b = reinterpret_cast<const bf16*>(params) + sw.parts[i].first;
    g.ldb = K;
    g.c = dx;
    g.ldc = K;
    g.d = dx;
    g.ldd = K;
    g.out_type = dx_type;
    g.beta = i == 0 ? 0.0f : 1.0f;
    RETURN_IF_ERROR(gemm_.Run(g, stream_));
    RETURN_IF_ERROR(Wgrad(dy + col, dy_ld, x, K, T, rows, K, dparams + sw.parts[i].first));
    if (sw.contiguous) break;
    col += rows;
  }
  return absl::OkStatus();
}

absl::Status CudaBackend::ResidualGemm(const bf16* a, int64_t k, const bf16* w, const void* res, void* out,
                                       bf16* branch, int64_t T) {
  GemmArgs g;  // out = res + a · Wᵀ   (FP32 mode: branch = bf16(a · Wᵀ), then out = res + branch in FP32)
  g.m = T;
  g.n = H_;
  g.k = k;
  g.a = a;
  g.lda = k;
  g.b = w;
  g.ldb = k;
  g.ldd = H_;
  if (f32()) {
    g.d = branch;
    RETURN_IF_ERROR(gemm_.Run(g, stream_));
    return kernels::AddBf16ToF32(static_cast<const float*>(res), branch, T * H_, static_cast<float*>(out), stream_);
  }
  g.c = res;
  g.ldc = H_;
  g.d = out;
  g.beta = 1.0f;
  return gemm_.Run(g, stream_);
}

absl::StatusOr<std::optional<int64_t>> CudaBackend::CudnnWorkspace(AttnDir dir,
                                                                  const kernels::AttnArgs& a) {
  const bool fwd = dir == AttnDir::kForward;
  if (cudnn_ == nullptr || (!fwd && options_.deterministic)) return std::optional<int64_t>();
  absl::StatusOr<int64_t> ws =
      fwd ? cudnn_->ForwardWorkspaceBytes(a, AttnStrides()) : cudnn_->BackwardWorkspaceBytes(a, AttnStrides());
  if (ws.ok()) return std::optional<int64_t>(*ws);
  if (!absl::IsUnimplemented(ws.status())) return ws.status();
  if (!cudnn_rejected_logged_[fwd ? 0 : 1]) {
    cudnn_rejected_logged_[fwd ? 0 : 1] = true;
    LOG(WARNING) << "cuDNN attention " << (fwd ? "forward" : "backward") << " rejected " << a.num_docs
                 << " documents of up to " << a.max_seqlen << " tokens (" << ws.status().message()
                 << "); the own kernels run such calls";
  }
  return std::optional<int64_t>();
}

absl::Status CudaBackend::AttentionForward(const CudaBatch& b, const LayerActs& a) {
  const kernels::AttnArgs attn = Attn(b);
  ASSIGN_OR_RETURN(std::optional<int64_t> ws, CudnnWorkspace(AttnDir::kForward, attn));
  if (!ws.has_value()) {
    return kernels::FlashAttentionForward(attn, {a.qr, qd_}, {a.kr, kvd_}, {a.qkv + qd_ + kvd_, qkv_}, {a.o, qd_},
                                          a.lse, stream_);
  }
  PoolBlock block;
  RETURN_IF_ERROR(block.Alloc(Align256(*ws), stream_));
  return cudnn_->Forward(attn, {a.qr, qd_}, {a.kr, kvd_}, {a.qkv + qd_ + kvd_, qkv_}, {a.o, qd_}, a.lse, block.get(),
                         stream_);
}

absl::Status CudaBackend::AttentionBackward(const kernels::AttnArgs& a, const std::optional<int64_t>& cudnn_ws,
                                            const LayerActs& acts, bf16* d_o, bf16* dq, bf16* dk, bf16* dv, char* ws) {
  if (!cudnn_ws.has_value()) {
    return kernels::FlashAttentionBackward(a, {acts.qr, qd_}, {acts.kr, kvd_}, {acts.qkv + qd_ + kvd_, qkv_},
                                           {acts.o, qd_}, acts.lse, {d_o, qd_}, {dq, qd_}, {dk, kvd_}, {dv, qkv_}, ws,
                                           stream_);
  }
  return cudnn_->Backward(a, {acts.qr, qd_}, {acts.kr, kvd_}, {acts.qkv + qd_ + kvd_, qkv_}, {acts.o, qd_}, acts.lse,
                          {d_o, qd_}, {dq, qd_}, {dk, kvd_}, {dv, qkv_}, ws, stream_);
}

absl::Status CudaBackend::LayerForward(const UnitParams& params, const CudaBatch& b, const void* x, const LayerActs& a,
                                       bool run_attention, void* y) {
  const int64_t T = b.num_tokens_;
  // FP32 mode: BF16 scratch for the o_proj / down_proj outputs before their FP32 residual adds.
  PoolBlock branch_block;
  bf16* branch = nullptr;
  if (f32()) {
    RETURN_IF_ERROR(branch_block.Alloc(Align256(T * H_ * 2), stream_));
    branch = reinterpret_cast<bf16*>(branch_block.get());
  }
  RETURN_IF_ERROR(NormForward(x, Norm(params, kInputNorm), T, a.xn1, a.rstd1));
  RETURN_IF_ERROR(StackedForward(params.bf16, qkv_w_, a.xn1, T, H_, a.qkv, qkv_));
  RETURN_IF_ERROR(QkForward(params, b, a));
  if (run_attention) {
    RETURN_IF_ERROR(AttentionForward(b, a));
  }
  // h1 = x + o · Woᵀ
  RETURN_IF_ERROR(ResidualGemm(a.o, qd_, W(params.bf16, kOProj), x, a.h1, branch, T));
  RETURN_IF_ERROR(NormForward(a.h1, Norm(params, kPostNorm), T, a.xn2, a.rstd2));
  RETURN_IF_ERROR(StackedForward(params.bf16, gu_w_, a.xn2, T, H_, a.gu, 2 * I_));
  RETURN_IF_ERROR(kernels::SwiGluForward(a.gu, T, I_, a.act, stream_));
  if (y != nullptr) {  // y = h1 + act · Wdᵀ
    RETURN_IF_ERROR(ResidualGemm(a.act, I_, W(params.bf16, kDownProj), a.h1, y, branch, T));
  }
  return absl::OkStatus();
}

absl::Status CudaBackend::DecoderForward(const UnitParams& params, const DeviceBatch& batch, const void* x, void* y,
                                         ActPolicy policy, std::unique_ptr<SavedActivations>* saved) {
  const auto& b = static_cast<const CudaBatch&>(batch);
  const int64_t T = b.num_tokens_;
  LayerActs acts;
  PoolBlock scratch;
  std::unique_ptr<CudaSaved> keep;
  const bool keep_all = saved != nullptr && policy == ActPolicy::kKeepAll;
  const bool keep_attn = saved != nullptr && policy != ActPolicy::kRecomputeLayer;
  {
    Carver kept, tmp;
    if (saved != nullptr) {
      keep = std::make_unique<CudaSaved>();
      keep->policy_ = policy;
      keep->num_tokens_ = T;
      ReserveActs(kept, keep->acts_, T, keep_attn, keep_all);
    }
    if (!keep_all) ReserveActs(tmp, acts, T, false, true);
    if (!keep_attn) ReserveActs(tmp, acts, T, true, false);
    if (keep) {
      RETURN_IF_ERROR(kept.Alloc(keep->block_, stream_));
      if (keep_all) acts = keep->acts_;
      if (keep_attn) {
        acts.o = keep->acts_.o;
        acts.lse = keep->acts_.lse;
      }
    }
    // Pieces not owned by `keep` point into the scratch block.
    RETURN_IF_ERROR(tmp.Alloc(scratch, stream_));
  }
  RETURN_IF_ERROR(LayerForward(params, b, x, acts, true, y));
  if (saved != nullptr) *saved = std::move(keep);
  return absl::OkStatus();
}

absl::Status CudaBackend::DecoderBackward(const UnitParams& params, const DeviceBatch& batch, const void* x,
                                          SavedActivations* saved_base, const void* dy, void* dx, float* dparams) {
  const auto& b = static_cast<const CudaBatch&>(batch);
  const int64_t T = b.num_tokens_;
  auto* saved = static_cast<CudaSaved*>(saved_base);
  ActPolicy policy = saved == nullptr ? ActPolicy::kRecomputeLayer : saved->policy_;
  if (saved != nullptr && saved->num_tokens_ != T) {
    return absl::InvalidArgumentError(
        absl::StrCat("saved activations hold ", saved->num_tokens_, " tokens, batch has ", T));
  }
  LayerActs acts;
  if (saved != nullptr) acts = saved->acts_;
  const kernels::AttnArgs attn = Attn(b);
  const kernels::RopeArgs rope = Rope(T);

  // Scratch: recomputed activations (per policy) and the gradients.
  Carver c;
  PoolBlock block;
  LayerActs re;
  if (policy != ActPolicy::kKeepAll) ReserveActs(c, re, T, policy == ActPolicy::kRecomputeLayer, true);
  bf16 *dact, *dgu, *dattn_o, *dqr, *dkr, *dqkv;
  bf16* dres_b = nullptr;  // FP32 mode: BF16 copy of dy, then of dh1 (the GEMMs' operand)
  void *dxn, *dh1;         // residual dtype
  float* ws_f;
  char* ws_attn;
  c.Reserve(&dact, T * I_);
  c.Reserve(&dgu, T * 2 * I_);
  c.ReserveBytes(&dxn, T * H_ * act_bytes());
  c.ReserveBytes(&dh1, T * H_ * act_bytes());
  if (f32()) c.Reserve(&dres_b, T * H_);
  c.Reserve(&dattn_o, T * qd_);
  c.Reserve(&dqr, T * qd_);
  c.Reserve(&dkr, T * kvd_);
  c.Reserve(&dqkv, T * qkv_);
  c.Reserve(&ws_f, std::max(kernels::RmsNormBackwardWorkspaceNumel(T, H_), kernels::QkNormRopeBackwardWorkspaceNumel(rope)));
  ASSIGN_OR_RETURN(const std::optional<int64_t> cudnn_ws, CudnnWorkspace(AttnDir::kBackward, attn));
  c.Reserve(&ws_attn, cudnn_ws.has_value() ? *cudnn_ws : kernels::FlashAttentionBackwardWorkspaceBytes(attn));
  RETURN_IF_ERROR(c.Alloc(block, stream_));
  if (policy == ActPolicy::kRecomputeLayer) {
    acts = re;
    RETURN_IF_ERROR(LayerForward(params, b, x, acts, true, nullptr));
  } else if (policy == ActPolicy::kSelective) {
    re.o = acts.o;
    re.lse = acts.lse;
    acts = re;
    RETURN_IF_ERROR(LayerForward(params, b, x, acts, false, nullptr));
  }

  // MLP: y = h1 + act · Wdᵀ
  {
    // The GEMM operand: dy itself (BF16 mode) or its BF16 rounding (FP32 mode; HF autocast's
    // gradient of the BF16 down_proj output).
    const bf16* dy_g = static_cast<const bf16*>(dy);
    if (f32()) {
      RETURN_IF_ERROR(kernels::CastF32ToBf16(static_cast<const float*>(dy), T * H_, 1.0f, dres_b, stream_));
      dy_g = dres_b;
    }
    GemmArgs g;  // dact = dy · Wd
    g.op_b = GemmOp::kN;
    g.m = T;
    g.n = I_;
    g.k = H_;
    g.a = dy_g;
    g.lda = H_;
    g.b = W(params.bf16, kDownProj);
    g.ldb = I_;
    g.d = dact;
    g.ldd = I_;
    RETURN_IF_ERROR(gemm_.Run(g, stream_));
    RETURN_IF_ERROR(Wgrad(dy_g, H_, acts.act, I_, T, H_, I_, dparams + off_[kDownProj]));
  }
  RETURN_IF_ERROR(kernels::SwiGluBackward(acts.gu, dact, T, I_, dgu, stream_));
  RETURN_IF_ERROR(StackedBackward(params.bf16, dparams, gu_w_, dgu, 2 * I_, acts.xn2, T, H_, dxn, act_gemm_type()));
  // dh1 = dy + RMSNorm2ᵀ(dxn)
  RETURN_IF_ERROR(NormBackward(dxn, acts.h1, Norm(params, kPostNorm), acts.rstd2, dy, T, dh1, dparams + off_[kPostNorm],
                               ws_f));
  // Attention block: h1 = x + o · Woᵀ
  {
    const bf16* dh1_g = static_cast<const bf16*>(dh1);
    if (f32()) {  // dres_b's previous content (bf16 dy) was last read by the down_proj GEMMs above
      RETURN_IF_ERROR(kernels::CastF32ToBf16(static_cast<const float*>(dh1), T * H_, 1.0f, dres_b, stream_));
      dh1_g = dres_b;
    }
    GemmArgs g;  // do = dh1 · Wo
    g.op_b = GemmOp::kN;
    g.m = T;
    g.n = qd_;
    g.k = H_;
    g.a = dh1_g;
    g.lda = H_;
    g.b = W(params.bf16, kOProj);
    g.ldb = qd_;
    g.d = dattn_o;
    g.ldd = qd_;
    RETURN_IF_ERROR(gemm_.Run(g, stream_));
    RETURN_IF_ERROR(Wgrad(dh1_g, H_, acts.o, qd_, T, H_, qd_, dparams + off_[kOProj]));
  }
  RETURN_IF_ERROR(AttentionBackward(attn, cudnn_ws, acts, dattn_o, dqr, dkr, dqkv + qd_ + kvd_, ws_attn));
  {
    const NormW qn = Norm(params, kQNorm), kn = Norm(params, kKNorm);
    float* dqn = dparams + off_[kQNorm];
    float* dkn = dparams + off_[kKNorm];
    RETURN_IF_ERROR(qn.f != nullptr ? kernels::QkNormRopeBackward(rope, dqr, dkr, acts.qkv, qkv_, qn.f, kn.f, b.positions_,
                                                                  dqkv, qkv_, dqn, dkn, ws_f, stream_)
                                    : kernels::QkNormRopeBackward(rope, dqr, dkr, acts.qkv, qkv_, qn.b, kn.b, b.positions_,
                                                                  dqkv, qkv_, dqn, dkn, ws_f, stream_));
  }
  RETURN_IF_ERROR(StackedBackward(params.bf16, dparams, qkv_w_, dqkv, qkv_, acts.xn1, T, H_, dxn, act_gemm_type()));
  // dx = dh1 + RMSNorm1ᵀ(dxn)   (dx may alias dy: dy is no longer read)
  RETURN_IF_ERROR(NormBackward(dxn, x, Norm(params, kInputNorm), acts.rstd1, dh1, T, dx, dparams + off_[kInputNorm],
                               ws_f));
  return absl::OkStatus();
}

absl::Status CudaBackend::HeadForwardBackward(const UnitParams& norm_params, const bf16_t* lm_head_w,
                                              const DeviceBatch& batch, const void* x, float loss_scale,
                                              void* dx, float* dnorm, float* dlm_head, float* loss_sum) {
  const auto& b = static_cast<const CudaBatch&>(batch);
  const int64_t T = b.num_tokens_, V = config_.vocab_size;
  if (T == 0) return absl::OkStatus();
  const NormW norm_w{reinterpret_cast<const bf16*>(norm_params.bf16), norm_params.fp32};
  const bf16* wl = reinterpret_cast<const bf16*>(lm_head_w);
  int64_t chunk = std::max<int64_t>(1, options_.head_logits_budget_bytes / (V * 2));
  if (chunk >= 128) chunk = chunk / 128 * 128;
  chunk = std::min(chunk, T);
  Carver c;
  PoolBlock block;
  bf16 *xn, *logits;
  char* dxn;  // residual dtype (FP32 mode: the dgrad GEMM writes FP32)
  float *rstd, *row_loss, *ws;
  c.Reserve(&xn, T * H_);
  c.Reserve(&dxn, T * H_ * act_bytes());
  c.Reserve(&rstd, T);
  c.Reserve(&row_loss, T);
  c.Reserve(&ws, kernels::RmsNormBackwardWorkspaceNumel(T, H_));
  c.Reserve(&logits, chunk * V);
  RETURN_IF_ERROR(c.Alloc(block, stream_));
  RETURN_IF_ERROR(NormForward(x, norm_w, T, xn, rstd));
  for (int64_t t0 = 0; t0 < T; t0 += chunk) {
    const int64_t tc = std::min(chunk, T - t0);
    GemmArgs g;  // logits = xn_c · Wᵀ
    g.m = tc;
    g.n = V;
    g.k = H_;
    g.a = xn + t0 * H_;
    g.lda = H_;
    g.b = wl;
    g.ldb = H_;
    g.d = logits;
    g.ldd = V;
    RETURN_IF_ERROR(gemm_.Run(g, stream_));
    RETURN_IF_ERROR(kernels::CrossEntropyInPlace(logits, tc, V, V, b.labels_ + t0, kIgnoreIndex, loss_scale,
                                                 row_loss + t0, stream_));
    GemmArgs d;  // dxn_c = dlogits · W
    d.op_b = GemmOp::kN;
    d.m = tc;
    d.n = H_;
    d.k = V;
    d.a = logits;
    d.lda = V;
    d.b = wl;
    d.ldb = H_;
    d.d = dxn + t0 * H_ * act_bytes();
    d.ldd = H_;
    d.out_type = act_gemm_type();
    RETURN_IF_ERROR(gemm_.Run(d, stream_));
    RETURN_IF_ERROR(Wgrad(logits, V, xn + t0 * H_, H_, tc, V, H_, dlm_head));
  }
  RETURN_IF_ERROR(kernels::SumInto(row_loss, T, loss_sum, stream_));
  RETURN_IF_ERROR(NormBackward(dxn, x, norm_w, rstd, nullptr, T, dx, dnorm, ws));
  return absl::OkStatus();
}

int64_t CudaBackend::SavedBytesPerToken(ActPolicy policy) const {
  switch (policy) {
    case ActPolicy::kKeepAll:
      // xn1, qkv, qr, kr, o, xn2, gu, act (BF16); h1 (residual dtype); rstd1, lse, rstd2 (FP32).
      return 2 * (H_ + qkv_ + qd_ + kvd_ + qd_ + H_ + 2 * I_ + I_) + act_bytes() * H_ + 4 * (1 + nq_ + 1);
    case ActPolicy::kSelective:
      return 2 * qd_ + 4 * nq_;
    case ActPolicy::kRecomputeLayer:
      return 0;
  }
  return 0;
}

}  // namespace

absl::StatusOr<std::unique_ptr<ComputeBackend>> MakeCudaBackendWithOptions(const Qwen3Config& config, int device,
                                                                          const CudaBackendOptions& options) {
  auto backend = std::make_unique<CudaBackend>(config, device, options);
  RETURN_IF_ERROR(backend->Init());
  return std::unique_ptr<ComputeBackend>(std::move(backend));
}

absl::StatusOr<std::unique_ptr<ComputeBackend>> MakeCudaBackend(const Qwen3Config& config, int device) {
  CudaBackendOptions options;
  // Debug/comparison switch: SLIDEDP_CUDA_FP32_RESIDUAL=0 selects the BF16 residual stream.
  if (const char* e = std::getenv("SLIDEDP_CUDA_FP32_RESIDUAL"); e != nullptr && std::string(e) == "0") {
    options.fp32_residual = false;
  }
  if (const char* e = std::getenv("SLIDEDP_ATTENTION"); e != nullptr && *e != '\0') {
    ASSIGN_OR_RETURN(options.attention, ParseAttentionImpl(e));
  }
  if (const char* e = std::getenv("SLIDEDP_DETERMINISTIC"); e != nullptr && std::string(e) == "1") {
    options.deterministic = true;
  }
  auto backend = std::make_unique<CudaBackend>(config, device, options);
  RETURN_IF_ERROR(backend->Init());
  LOG(INFO) << "CUDA backend on GPU " << device << ": " << (options.fp32_residual ? "FP32" : "BF16")
            << " residual stream, attention " << backend->attention_impl()
            << (options.deterministic ? ", deterministic (attention backward: own kernels, ordered dQ)" : "");
  return std::unique_ptr<ComputeBackend>(std::move(backend));
}

absl::StatusOr<CudaBackendOptions::Attention> ParseAttentionImpl(absl::string_view name) {
  if (name == "auto") return CudaBackendOptions::Attention::kAuto;
  if (name == "cudnn") return CudaBackendOptions::Attention::kCudnn;
  if (name == "own") return CudaBackendOptions::Attention::kOwn;
  return absl::InvalidArgumentError(absl::StrCat("SLIDEDP_ATTENTION: '", name, "' is not one of auto, cudnn, own"));
}

}  // namespace slidedp
