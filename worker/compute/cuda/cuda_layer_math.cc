// The CUDA backend's layer math (CudaBackend, cuda_backend_impl.h): one decoder layer forward and
// backward and the fused head, on the backend's stream; GEMM helpers and the attention dispatch.
// Batch upload, the embedding and the factories are in cuda_backend.cc.
//
// Decoder forward (HF Qwen3DecoderLayer), T tokens, W row-major [out, in]:
//   xn1 = RMSNorm(x)            qkv = xn1·[Wq;Wk;Wv]ᵀ        qr,kr = RoPE(q_norm(q)), RoPE(k_norm(k))
// (qwen2: qkv = xn1·[Wq;Wk;Wv]ᵀ + [bq;bk;bv] in the GEMM's epilogue; qwen2, llama, mistral: qr,kr =
// RoPE(q), RoPE(k), with the model's scaled inverse frequencies where it has them)
//   o,lse = FlashAttn(qr,kr,v)  h1 = x + o·Woᵀ
//   xn2 = RMSNorm(h1)           gu = xn2·[Wg;Wu]ᵀ            act = silu(g)·u
//   y = h1 + act·Wdᵀ
// Backward walks this in reverse; weight gradients go straight into the FP32 gradient array
// (cuBLASLt beta = 1), norm-weight gradients through deterministic two-stage reductions.
// qwen3_5 / qwen3_5_moe layers (two token mixers, gated attention, (1 + w) norms) take their own
// path, cuda_qwen3_5_layer.cc, and gemma4's (per-layer sizes, v_norm, per-layer inputs, shared keys
// and values) cuda_gemma4_layer.cc; the helpers here serve all of them (the fused qkv rows' v column
// is VColumn(), past qwen3_5's output gates).
//
// Tiles (ComputeBackend::TileRows, runtime.tile_tokens): everything but attention works token by
// token, so a micro-batch longer than a tile runs it tile by tile and its scratch holds one tile:
//   forward   AttentionInputs (xn1, qkv, qr, kr per tile) -> attention (whole) -> MlpTile per tile
//   backward  AttentionInputs + attention where not kept -> per tile: MlpTile's recompute, MLP and
//             o_proj backward (dh1 written into dx's rows) -> attention backward (whole) -> per
//             tile: q/k norm + RoPE, bias and QKV backward, input norm backward (dx in place)
// Attention's intermediates (qkv, qr, kr, o, lse) and their gradients stay whole; kept pieces are
// whole too (TileOf offsets them to the tile). A batch of one tile runs exactly the untiled ops.
//
// Residual stream dtype (CudaBackendOptions::fp32_residual):
// - FP32 (default; HF autocast numerics): x, h1, y and dy, dh1, dx are FP32. RMSNorms read FP32 and
//   write the BF16 GEMM input; o·Woᵀ and act·Wdᵀ are BF16 GEMM outputs added to the residual in
//   FP32 (AddBf16ToF32). Backward: residual gradients are FP32; the GEMMs read a BF16 copy of them
//   (HF: the gradient of the BF16 branch output); the dgrads into the norm outputs (dxn) are FP32
//   GEMM outputs, and the norm backward adds into the FP32 residual gradient.
// - BF16: everything BF16, residual added in the GEMM epilogue (beta = 1, BF16 C).
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <memory>
#include <optional>
#include <type_traits>

#include "absl/strings/str_cat.h"
#include "common/status/status_macros.h"
#include "glog/logging.h"
#include "worker/compute/cuda/cuda_backend_impl.h"
#include "worker/compute/cuda/cuda_memory.h"
#include "worker/kernels/attention.h"
#include "worker/kernels/cross_entropy.h"
#include "worker/kernels/gemm.h"
#include "worker/kernels/moe.h"
#include "worker/kernels/qk_norm_rope.h"
#include "worker/kernels/reductions.h"
#include "worker/kernels/rmsnorm.h"
#include "worker/kernels/swiglu.h"

namespace slidedp::cuda_backend_internal {

absl::Status CudaBackend::StackedForward(const bf16_t* params, const StackedWeight& sw, const bf16* x, int64_t T,
                                         int64_t K, bf16* y, int64_t out_ld, const bf16* bias) {
  int64_t col = 0;
  for (size_t i = 0; i < sw.parts.size(); ++i) {
    const int64_t rows = sw.contiguous ? sw.rows : sw.parts[i].second;
    GemmArgs g;
    g.bias = bias != nullptr ? bias + col : nullptr;
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

absl::StatusOr<const bf16*> CudaBackend::StackQkvBias(const UnitParams& params, PoolBlock& block) {
  if (!config_.has_qkv_bias()) return nullptr;
  RETURN_IF_ERROR(block.Alloc(Align256(qkv_ * 2), stream_));
  bf16* stacked = reinterpret_cast<bf16*>(block.get());
  const std::pair<int, int64_t> parts[] = {{kQBias, qd_}, {kKBias, kvd_}, {kVBias, kvd_}};
  int64_t col = 0;
  for (const auto& [t, n] : parts) {  // three small device copies: the tensors sit 256-element aligned apart
    SLIDEDP_CUDA_RETURN_IF_ERROR(
        cudaMemcpyAsync(stacked + col, W(params.bf16, t), n * 2, cudaMemcpyDeviceToDevice, stream_));
    col += n;
  }
  return stacked;
}

absl::Status CudaBackend::QkvBiasBackward(const bf16* dqkv, int64_t T, float* dparams, float* ws) {
  if (!config_.has_qkv_bias()) return absl::OkStatus();
  const std::pair<int, int64_t> parts[] = {{kQBias, qd_}, {kKBias, kvd_}, {kVBias, kvd_}};
  int64_t col = 0;
  for (const auto& [t, n] : parts) {
    RETURN_IF_ERROR(kernels::ColumnSumsInto(dqkv + col, T, n, qkv_, ws, dparams + off_[t], stream_));
    col += n;
  }
  return absl::OkStatus();
}

absl::Status CudaBackend::Wgrad(const bf16* dy, int64_t dy_ld, const bf16* x, int64_t x_ld, int64_t T, int64_t out_rows,
                                int64_t in_cols, float* dw) {
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
  g.out_type = Dtype::kF32;
  g.beta = 1.0f;
  return gemm_.Run(g, stream_);
}

absl::Status CudaBackend::StackedBackward(const bf16_t* params, float* dparams, const StackedWeight& sw, const bf16* dy,
                                          int64_t dy_ld, const bf16* x, int64_t T, int64_t K, void* dx, Dtype dx_type) {
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

GemmArgs CudaBackend::BranchGemm(const bf16* a, int64_t k, const bf16* w, int64_t T, const bf16* bias) const {
  GemmArgs g;  // [T, H] = a · Wᵀ (+ bias); the caller sets the output
  g.bias = bias;
  g.m = T;
  g.n = H_;
  g.k = k;
  g.a = a;
  g.lda = k;
  g.b = w;
  g.ldb = k;
  g.ldd = H_;
  return g;
}

absl::Status CudaBackend::ResidualGemm(const bf16* a, int64_t k, const bf16* w, const void* res, void* out,
                                       bf16* branch, int64_t T, const bf16* bias) {
  // out = res + a · Wᵀ (+ bias)   (FP32 mode: branch = bf16(a · Wᵀ + bias), then out = res + branch in FP32)
  GemmArgs g = BranchGemm(a, k, w, T, bias);
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

absl::Status CudaBackend::ResidualBranchBackward(const void* dres, int64_t T, const bf16* w, int64_t k, const bf16* a,
                                                 bf16* da, float* dw, bf16* dres_b, float* dbias, float* ws) {
  // The GEMM operand: dres itself (BF16 mode) or its BF16 rounding (FP32 mode; HF autocast's
  // gradient of the BF16 branch output).
  const bf16* g = static_cast<const bf16*>(dres);
  if (f32()) {
    RETURN_IF_ERROR(kernels::CastF32ToBf16(static_cast<const float*>(dres), T * H_, 1.0f, dres_b, stream_));
    g = dres_b;
  }
  if (dbias != nullptr) RETURN_IF_ERROR(kernels::ColumnSumsInto(g, T, H_, H_, ws, dbias, stream_));
  return BranchGemmBackward(g, T, w, k, a, da, dw);
}

absl::StatusOr<const float*> CudaBackend::Sinks(const UnitParams& p, PoolBlock& block) {
  if (!config_.has_attention_sinks()) return nullptr;
  const NormW s = Norm(p, kSinks);
  if (s.f != nullptr) return s.f;
  RETURN_IF_ERROR(block.Alloc(Align256(nq_ * static_cast<int64_t>(sizeof(float))), stream_));
  float* f = reinterpret_cast<float*>(block.get());
  RETURN_IF_ERROR(kernels::WidenBf16ToF32(s.b, nq_, f, stream_));
  return f;
}

absl::StatusOr<kernels::AttnArgs> CudaBackend::LayerAttn(const UnitParams& p, const CudaBatch& b, PoolBlock& block,
                                                         float* dparams) {
  kernels::AttnArgs a = Attn(b, p.decoder_layer);
  ASSIGN_OR_RETURN(a.sinks, Sinks(p, block));
  if (a.sinks != nullptr && dparams != nullptr) a.dsinks = dparams + off_[kSinks];
  return a;
}

absl::Status CudaBackend::BranchGemmBackward(const bf16* g, int64_t T, const bf16* w, int64_t k, const bf16* a,
                                             bf16* da, float* dw) {
  GemmArgs d;  // da = g · W
  d.op_b = GemmOp::kN;
  d.m = T;
  d.n = k;
  d.k = H_;
  d.a = g;
  d.lda = H_;
  d.b = w;
  d.ldb = k;
  d.d = da;
  d.ldd = k;
  RETURN_IF_ERROR(gemm_.Run(d, stream_));
  return Wgrad(g, H_, a, k, T, H_, k, dw);  // dW += gᵀ · a
}

absl::Status CudaBackend::SandwichForward(const bf16* a, int64_t k, const bf16* w, const UnitParams& p, int norm,
                                          const void* res, void* out, bf16* pre, float* rstd, bf16* normed, int64_t T) {
  GemmArgs g = BranchGemm(a, k, w, T);  // pre = a · Wᵀ (BF16, as HF's autocast linear)
  g.d = pre;
  RETURN_IF_ERROR(gemm_.Run(g, stream_));
  // HF Gemma3RMSNorm on a BF16 input: FP32 math, (1 + w), the output cast back to BF16.
  const NormW nw = Norm(p, norm);
  const float eps = static_cast<float>(config_.rms_norm_eps);
  if (nw.f != nullptr) {
    RETURN_IF_ERROR(kernels::RmsNormForward(pre, nw.f, T, H_, eps, normed, rstd, stream_, NormMode()));
  } else {
    RETURN_IF_ERROR(kernels::RmsNormForward(pre, nw.b, T, H_, eps, normed, rstd, stream_, NormMode()));
  }
  if (out == nullptr) return absl::OkStatus();
  return kernels::AddBf16ToF32(static_cast<const float*>(res), normed, T * H_, static_cast<float*>(out), stream_);
}

absl::Status CudaBackend::SandwichBackward(const void* dres, int64_t T, const bf16* w, int64_t k, const bf16* a,
                                           const UnitParams& p, int norm, const bf16* pre, const float* rstd, bf16* da,
                                           float* dw, float* dparams, bf16* dres_b, bf16* dpre, float* ws) {
  // The normed branch is BF16 in HF: its gradient is dres rounded to BF16, and the norm's input
  // gradient is BF16 too.
  RETURN_IF_ERROR(kernels::CastF32ToBf16(static_cast<const float*>(dres), T * H_, 1.0f, dres_b, stream_));
  const NormW nw = Norm(p, norm);
  float* dnorm = dparams + off_[norm];
  if (nw.f != nullptr) {
    RETURN_IF_ERROR(kernels::RmsNormBackward(dres_b, pre, nw.f, rstd, nullptr, T, H_, dpre, dnorm, ws, stream_,
                                             NormMode()));
  } else {
    RETURN_IF_ERROR(kernels::RmsNormBackward(dres_b, pre, nw.b, rstd, nullptr, T, H_, dpre, dnorm, ws, stream_,
                                             NormMode()));
  }
  return BranchGemmBackward(dpre, T, w, k, a, da, dw);
}

absl::StatusOr<std::optional<int64_t>> CudaBackend::CudnnWorkspace(AttnDir dir, const kernels::AttnArgs& a) {
  kernels::AttnRowStrides ld = AttnStrides();
  if (a.cross()) ld.k = ld.v = 2 * kvd_;  // the gathered keys | values rows (GatherContextKv)
  return CudnnWorkspace(dir, a, ld);
}

absl::StatusOr<std::optional<int64_t>> CudaBackend::CudnnWorkspace(AttnDir dir, const kernels::AttnArgs& a,
                                                                   const kernels::AttnRowStrides& ld) {
  const bool fwd = dir == AttnDir::kForward;
  // Cross attention (a context-parallel share) runs on cuDNN only where CudaBackendOptions asks;
  // attention sinks and a window shorter than the longest row on the own kernels (but self
  // attention's window on cuDNN's left-bound mask where CudaBackendOptions::cudnn_window_mask asks).
  const bool banded = a.window > 0 && a.window < (a.cross() ? a.max_seqlen_kv : a.max_seqlen);
  if (cudnn_ == nullptr || (!fwd && options_.deterministic) || (a.cross() && !options_.cudnn_cross_attention) ||
      (banded && (a.cross() || !options_.cudnn_window_mask)) || a.sinks != nullptr) {
    return std::optional<int64_t>();
  }
  absl::StatusOr<int64_t> ws = fwd ? cudnn_->ForwardWorkspaceBytes(a, ld) : cudnn_->BackwardWorkspaceBytes(a, ld);
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

absl::Status CudaBackend::AttentionForward(const UnitParams& p, const CudaBatch& b, const LayerActs& a,
                                           const bf16* kv) {
  PoolBlock sinks;
  ASSIGN_OR_RETURN(kernels::AttnArgs attn, LayerAttn(p, b, sinks));
  attn.o_lo = a.o_lo;
  ASSIGN_OR_RETURN(std::optional<int64_t> ws, CudnnWorkspace(AttnDir::kForward, attn));
  if (b.context()) {
    PoolBlock kv_block;
    if (kv == nullptr) RETURN_IF_ERROR(GatherContextKv(b, a, kv_block, &kv));
    const kernels::AttnTensor keys{kv, 2 * kvd_}, values{kv + kvd_, 2 * kvd_};
    if (!ws.has_value()) return kernels::FlashAttentionForward(attn, {a.qr, qd_}, keys, values, {a.o, qd_}, a.lse, stream_);
    PoolBlock block;
    RETURN_IF_ERROR(block.Alloc(Align256(*ws), stream_));
    return cudnn_->Forward(attn, {a.qr, qd_}, keys, values, {a.o, qd_}, a.lse, block.get(), stream_);
  }
  if (!ws.has_value()) {
    return kernels::FlashAttentionForward(attn, {a.qr, qd_}, {a.kr, kvd_}, {a.qkv + VColumn(), qkv_}, {a.o, qd_},
                                          a.lse, stream_);
  }
  PoolBlock block;
  RETURN_IF_ERROR(block.Alloc(Align256(*ws), stream_));
  return cudnn_->Forward(attn, {a.qr, qd_}, {a.kr, kvd_}, {a.qkv + VColumn(), qkv_}, {a.o, qd_}, a.lse, block.get(),
                         stream_);
}

absl::Status CudaBackend::AttentionBackward(const CudaBatch& b, const kernels::AttnArgs& args,
                                            const std::optional<int64_t>& cudnn_ws, const LayerActs& acts, bf16* d_o,
                                            bf16* dq, bf16* dk, bf16* dv, char* ws, const bf16* kv) {
  kernels::AttnArgs a = args;
  a.o_lo = acts.o_lo;
  if (b.context()) {
    if (kv == nullptr) return absl::InternalError("context-parallel attention backward without the gathered keys");
    // The group's key/value gradients: every rank adds its queries' share over the whole's keys
    // (FP32), the rows are put rank-major, and the reduce-scatter leaves each rank the sum over
    // the group of its own rows.
    const int64_t whole = b.context_tokens_, part = b.context_part_, ranks = b.context_ranks_;
    const int64_t ld = 2 * kvd_;
    PoolBlock block;
    Carver c;
    float *dkv_whole, *dkv_ranked;
    c.Reserve(&dkv_whole, whole * ld);
    c.Reserve(&dkv_ranked, ranks * part * ld);
    RETURN_IF_ERROR(c.Alloc(block, stream_));
    SLIDEDP_CUDA_RETURN_IF_ERROR(cudaMemsetAsync(dkv_whole, 0, whole * ld * sizeof(float), stream_));
    RETURN_IF_ERROR(cudnn_ws.has_value()
                        ? cudnn_->BackwardCross(a, {acts.qr, qd_}, {kv, ld}, {kv + kvd_, ld}, {acts.o, qd_}, acts.lse,
                                                {d_o, qd_}, {dq, qd_}, dkv_whole, dkv_whole + kvd_, ld, ws, stream_)
                        : kernels::FlashAttentionBackwardCross(a, {acts.qr, qd_}, {kv, ld}, {kv + kvd_, ld},
                                                               {acts.o, qd_}, acts.lse, {d_o, qd_}, {dq, qd_},
                                                               dkv_whole, dkv_whole + kvd_, ld, ws, stream_));
    RETURN_IF_ERROR(kernels::GatherRowsF32(dkv_whole, ld, b.gather_rows_, ranks * part, ld, dkv_ranked, ld, stream_));
    RETURN_IF_ERROR(ContextReduceScatter(dkv_ranked, part * ld, b.context_rank_));
    const float* mine = dkv_ranked + part * ld * b.context_rank_;
    const int64_t T = b.num_tokens_;
    RETURN_IF_ERROR(kernels::CastRowsF32ToBf16(mine, ld, T, kvd_, dk, kvd_, stream_));
    return kernels::CastRowsF32ToBf16(mine + kvd_, ld, T, kvd_, dv, qkv_, stream_);
  }
  if (!cudnn_ws.has_value()) {
    return kernels::FlashAttentionBackward(a, {acts.qr, qd_}, {acts.kr, kvd_}, {acts.qkv + VColumn(), qkv_},
                                           {acts.o, qd_}, acts.lse, {d_o, qd_}, {dq, qd_}, {dk, kvd_}, {dv, qkv_}, ws,
                                           stream_);
  }
  return cudnn_->Backward(a, {acts.qr, qd_}, {acts.kr, kvd_}, {acts.qkv + VColumn(), qkv_}, {acts.o, qd_}, acts.lse,
                          {d_o, qd_}, {dq, qd_}, {dk, kvd_}, {dv, qkv_}, ws, stream_);
}

absl::Status CudaBackend::GatherContextKv(const CudaBatch& b, const LayerActs& a, PoolBlock& block, const bf16** kv) {
  *kv = nullptr;
  if (!b.context()) return absl::OkStatus();
  const int64_t T = b.num_tokens_, whole = b.context_tokens_, part = b.context_part_, ranks = b.context_ranks_;
  const int64_t ld = 2 * kvd_;
  bf16 *mine, *ranked, *ordered;
  PoolBlock tmp;  // freed in stream order after the reorder
  Carver c;
  c.Reserve(&mine, part * ld);
  c.Reserve(&ranked, ranks * part * ld);
  RETURN_IF_ERROR(c.Alloc(tmp, stream_));
  RETURN_IF_ERROR(block.Alloc(whole * ld * static_cast<int64_t>(sizeof(bf16)), stream_));
  ordered = reinterpret_cast<bf16*>(block.get());
  // This share's rows, keys | values (the copies fill rows [0, T) whole; padding rows [T, part)
  // zero), then every rank's, then whole-token order.
  if (part > T) SLIDEDP_CUDA_RETURN_IF_ERROR(cudaMemsetAsync(mine + T * ld, 0, (part - T) * ld * sizeof(bf16), stream_));
  SLIDEDP_CUDA_RETURN_IF_ERROR(cudaMemcpy2DAsync(mine, ld * sizeof(bf16), a.kr, kvd_ * sizeof(bf16),
                                                 kvd_ * sizeof(bf16), T, cudaMemcpyDeviceToDevice, stream_));
  SLIDEDP_CUDA_RETURN_IF_ERROR(cudaMemcpy2DAsync(mine + kvd_, ld * sizeof(bf16), a.qkv + VColumn(),
                                                 qkv_ * sizeof(bf16), kvd_ * sizeof(bf16), T, cudaMemcpyDeviceToDevice,
                                                 stream_));
  RETURN_IF_ERROR(ContextAllGather(mine, part * ld * static_cast<int64_t>(sizeof(bf16)), ranked));
  RETURN_IF_ERROR(kernels::MoeGatherRows(ranked, b.gathered_row_, whole, ld, ordered, stream_));
  *kv = ordered;
  return absl::OkStatus();
}

absl::StatusOr<char*> CudaBackend::ContextStaging(int64_t bytes) {
  if (bytes > context_staging_bytes_) {
    if (context_staging_ != nullptr) {
      SLIDEDP_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(stream_));
      SLIDEDP_CUDA_RETURN_IF_ERROR(cudaFreeHost(context_staging_));
      context_staging_ = nullptr;
      context_staging_bytes_ = 0;
    }
    void* p = nullptr;
    SLIDEDP_CUDA_RETURN_IF_ERROR(cudaHostAlloc(&p, bytes, cudaHostAllocDefault));
    context_staging_ = static_cast<char*>(p);
    context_staging_bytes_ = bytes;
  }
  return context_staging_;
}

absl::Status CudaBackend::ContextAllGather(const void* local, int64_t bytes, void* out) {
  if (context_group_ == nullptr) return absl::FailedPreconditionError("context-parallel attention without a group");
  const int64_t ranks = context_group_->ranks();
  if (context_group_->device_collectives()) return context_group_->AllGatherDevice(local, bytes, out, stream_);
  if (bytes % sizeof(float) != 0) {
    return absl::InvalidArgumentError(absl::StrCat("context all-gather of ", bytes, " bytes (whole words only)"));
  }
  // Staged: this rank's part down, the host collective, every part up.
  ASSIGN_OR_RETURN(char* host, ContextStaging((ranks + 1) * bytes));
  char* host_all = host + bytes;
  SLIDEDP_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(host, local, bytes, cudaMemcpyDeviceToHost, stream_));
  SLIDEDP_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(stream_));
  RETURN_IF_ERROR(
      context_group_->AllGather(reinterpret_cast<const float*>(host), bytes / 4, reinterpret_cast<float*>(host_all)));
  SLIDEDP_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(out, host_all, ranks * bytes, cudaMemcpyHostToDevice, stream_));
  // The staging buffer is reused by the next collective: the copy must be done with it first.
  SLIDEDP_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(stream_));
  return absl::OkStatus();
}

absl::Status CudaBackend::ContextReduceScatter(float* buf, int64_t shard_numel, int rank) {
  if (context_group_ == nullptr) return absl::FailedPreconditionError("context-parallel attention without a group");
  if (context_group_->device_collectives()) return context_group_->ReduceScatterDeviceF32(buf, shard_numel, stream_);
  const int64_t ranks = context_group_->ranks();
  const int64_t bytes = ranks * shard_numel * static_cast<int64_t>(sizeof(float));
  ASSIGN_OR_RETURN(char* host, ContextStaging(bytes));
  float* h = reinterpret_cast<float*>(host);
  SLIDEDP_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(h, buf, bytes, cudaMemcpyDeviceToHost, stream_));
  SLIDEDP_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(stream_));
  RETURN_IF_ERROR(context_group_->ReduceScatter(h, shard_numel));
  // Only this rank's shard is the sum; the caller reads only it.
  SLIDEDP_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(buf + rank * shard_numel, h + rank * shard_numel,
                                               shard_numel * sizeof(float), cudaMemcpyHostToDevice, stream_));
  SLIDEDP_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(stream_));
  return absl::OkStatus();
}

absl::Status CudaBackend::AttentionInputs(const UnitParams& params, const CudaBatch& b, const void* x,
                                          const LayerActs& a, uint32_t given, uint32_t whole) {
  const bool cheap = !(given & kPieceCheap), qkv = !(given & kPieceQkv);
  if (!cheap && !qkv) return absl::OkStatus();
  const int64_t T = b.num_tokens_, tile = TileRows(T);
  PoolBlock bias_block;
  const bf16* bias = nullptr;
  if (qkv) {
    ASSIGN_OR_RETURN(bias, StackQkvBias(params, bias_block));
  }
  for (int64_t t0 = 0; t0 < T; t0 += tile) {
    const int64_t rows = std::min(tile, T - t0);
    const LayerActs at = TileOf(a, t0, whole);
    if (cheap) RETURN_IF_ERROR(NormForward(ResidualRow(x, t0), Norm(params, kInputNorm), rows, at.xn1, at.rstd1));
    if (qkv) RETURN_IF_ERROR(StackedForward(params.bf16, qkv_w_, at.xn1, rows, H_, at.qkv, qkv_, bias));
    if (cheap) RETURN_IF_ERROR(QkForward(params, b.positions_ + t0, rows, at));
  }
  return absl::OkStatus();
}

absl::Status CudaBackend::MlpTile(const UnitParams& params, const void* x, const LayerActs& at, int64_t rows,
                                  uint32_t given, void* y, bf16* branch) {
  const bool cheap = !(given & kPieceCheap);
  const bool sandwich = config_.has_sandwich_norms();
  // h1 = x + o · Woᵀ (gemma3: x + RMSNorm_pa(o · Woᵀ))
  if (!(given & kPieceOProj)) {
    if (sandwich) {
      RETURN_IF_ERROR(
          SandwichForward(at.o, qd_, W(params.bf16, kOProj), params, kPostNorm, x, at.h1, at.ob, at.rstd_o, branch, rows));
    } else {
      RETURN_IF_ERROR(ResidualGemm(at.o, qd_, W(params.bf16, kOProj), x, at.h1, branch, rows, OBias(params)));
    }
  }
  if (cheap) RETURN_IF_ERROR(NormForward(at.h1, Norm(params, MlpInputNorm()), rows, at.xn2, at.rstd2));
  if (!(given & kPieceGateUp)) RETURN_IF_ERROR(StackedForward(params.bf16, gu_w_, at.xn2, rows, H_, at.gu, 2 * I_));
  if (cheap) RETURN_IF_ERROR(kernels::SwiGluForward(at.gu, rows, I_, at.act, stream_, Glu()));
  if (sandwich) {  // y = h1 + RMSNorm_pf(act · Wdᵀ); without y (backward) its pre-norm output and rsqrt
    if (y != nullptr || !(given & kPieceGateUp)) {
      RETURN_IF_ERROR(SandwichForward(at.act, I_, W(params.bf16, kDownProj), params, kPostFfnNorm, at.h1, y, at.down,
                                      at.rstd_d, branch, rows));
    }
  } else if (y != nullptr) {  // y = h1 + act · Wdᵀ
    RETURN_IF_ERROR(ResidualGemm(at.act, I_, W(params.bf16, kDownProj), at.h1, y, branch, rows));
  }
  return absl::OkStatus();
}

absl::Status CudaBackend::DecoderForward(const UnitParams& params, const DeviceBatch& batch, const void* x, void* y,
                                         ActPolicy policy, std::unique_ptr<SavedActivations>* saved) {
  const auto& b = static_cast<const CudaBatch&>(batch);
  if (config_.is_qwen3_5()) return HybridDecoderForward(params, b, x, y, policy, saved);
  if (config_.is_gemma4()) return Gemma4DecoderForward(params, b, x, y, saved);  // keeps nothing, whatever the policy
  ASSIGN_OR_RETURN(const int sparse, SparseOrdinal(params));
  if (sparse >= 0) return SparseDecoderForward(params, b, x, y, policy, saved, sparse);
  const int64_t T = b.num_tokens_, tile = TileRows(T);
  if (LayersKeepNothing()) policy = ActPolicy::kRecomputeLayer;  // what it keeps: nothing
  LayerActs acts;
  PoolBlock scratch, branch_block;
  std::unique_ptr<CudaSaved> keep;
  const uint32_t kept_pieces = saved != nullptr ? policy.pieces : 0;
  bf16* branch = nullptr;  // FP32 mode: BF16 scratch for a tile's o_proj / down_proj outputs
  {
    Carver kept, tmp;
    if (saved != nullptr) {
      keep = std::make_unique<CudaSaved>();
      keep->policy_ = policy;
      keep->num_tokens_ = T;
      ReserveActs(kept, keep->acts_, T, kept_pieces, T);
    }
    ReserveActs(tmp, acts, T, kAllPieces & ~kept_pieces, tile);
    if (f32()) tmp.Reserve(&branch, tile * H_);
    if (keep) {
      RETURN_IF_ERROR(keep->Allocate(kept, stream_));
      TakePieces(keep->acts_, kept_pieces, &acts);
    }
    // Pieces not owned by `keep` point into the scratch block.
    RETURN_IF_ERROR(tmp.Alloc(scratch, stream_));
  }
  RETURN_IF_ERROR(AttentionInputs(params, b, x, acts, 0, kept_pieces));
  RETURN_IF_ERROR(AttentionForward(params, b, acts));
  for (int64_t t0 = 0; t0 < T; t0 += tile) {  // y may alias x: each tile reads its own rows first
    RETURN_IF_ERROR(MlpTile(params, ResidualRow(x, t0), TileOf(acts, t0, kept_pieces), std::min(tile, T - t0), 0,
                            ResidualRow(y, t0), branch));
  }
  if (saved != nullptr) *saved = std::move(keep);
  return absl::OkStatus();
}

absl::Status CudaSaved::Allocate(Carver& carver, cudaStream_t stream) {
  RETURN_IF_ERROR(carver.Alloc(block_, stream));
  base_ = block_.get();
  bytes_ = block_.bytes();
  return absl::OkStatus();
}

std::unique_ptr<DeviceBuffer> CudaSaved::Detach() {
  if (detached_ || bytes_ == 0) return nullptr;
  detached_ = true;
  if (attached_) return std::move(attached_);
  return block_.TakeBuffer();
}

absl::Status CudaSaved::Attach(std::unique_ptr<DeviceBuffer> block) {
  if (!detached_) return absl::FailedPreconditionError("saved activations: Attach without Detach");
  if (block == nullptr || block->bytes() != bytes_) {
    return absl::InvalidArgumentError(
        absl::StrCat("saved activations: a block of ", block ? block->bytes() : 0, " bytes given back for ", bytes_));
  }
  char* to = static_cast<char*>(block->data());
  auto rebase = [&](auto*& p) {
    using T = std::remove_pointer_t<std::remove_reference_t<decltype(p)>>;
    if (p != nullptr) p = reinterpret_cast<T*>(to + (reinterpret_cast<char*>(p) - base_));
  };
  LayerActs& a = acts_;
  rebase(a.xn1), rebase(a.rstd1), rebase(a.qkv), rebase(a.qr), rebase(a.kr), rebase(a.o), rebase(a.lse);
  rebase(a.h1), rebase(a.xn2), rebase(a.rstd2), rebase(a.gu), rebase(a.act);
  rebase(a.ob), rebase(a.rstd_o), rebase(a.down), rebase(a.rstd_d);
  moe_.Rebase(base_, to);
  base_ = to;
  attached_ = std::move(block);
  detached_ = false;
  return absl::OkStatus();
}

absl::Status CudaBackend::DecoderBackward(const UnitParams& params, const DeviceBatch& batch, const void* x,
                                          SavedActivations* saved_base, const void* dy, void* dx, float* dparams) {
  const auto& b = static_cast<const CudaBatch&>(batch);
  const int64_t T = b.num_tokens_, tile = TileRows(T), last = T - (T - 1) / tile * tile;
  auto* saved = static_cast<CudaSaved*>(saved_base);
  ASSIGN_OR_RETURN(const int sparse, SparseOrdinal(params));
  ActPolicy policy = saved == nullptr ? ActPolicy::kRecomputeLayer : saved->policy_;
  if (saved != nullptr && saved->num_tokens_ != T) {
    return absl::InvalidArgumentError(
        absl::StrCat("saved activations hold ", saved->num_tokens_, " tokens, batch has ", T));
  }
  if (saved != nullptr && saved->detached()) {
    return absl::FailedPreconditionError("saved activations are in host memory (an activation store has them)");
  }
  // qwen3_5's and gemma4's layers keep nothing (their forward left an empty CudaSaved): recomputed from x.
  if (config_.is_qwen3_5()) return HybridDecoderBackward(params, b, x, dy, dx, dparams);
  if (config_.is_gemma4()) return Gemma4DecoderBackward(params, b, x, dy, dx, dparams);
  if (sparse >= 0) return SparseDecoderBackward(params, b, x, saved, dy, dx, dparams);
  const uint32_t kept = policy.pieces;
  PoolBlock sinks;
  ASSIGN_OR_RETURN(const kernels::AttnArgs attn, LayerAttn(params, b, sinks, dparams));

  // Scratch: what the policy did not keep (attention's intermediates whole, the token-local ones
  // one tile's worth), one tile's MLP gradients, and attention's gradients whole. dx holds dh1 (the
  // gradient after the MLP block) between the two tile loops: each tile reads its rows of dy
  // before writing them (dx may alias dy).
  Carver c;
  PoolBlock block;
  LayerActs acts;
  ReserveActs(c, acts, T, kAllPieces & ~kept, tile);
  const bool sandwich = config_.has_sandwich_norms();
  bf16 *dact, *dgu, *dattn_o, *dqr, *dkr, *dqkv, *branch = nullptr;
  bf16* dres_b = nullptr;  // FP32 mode: a tile's BF16 copy of dy, then of dh1 (the GEMMs' operand)
  bf16* dpre = nullptr;    // gemma3: a sandwich branch's pre-norm gradient (one tile)
  void* dxn;               // residual dtype
  float* ws_f;
  char* ws_attn;
  c.Reserve(&dact, tile * I_);
  c.Reserve(&dgu, tile * 2 * I_);
  c.ReserveBytes(&dxn, tile * H_ * act_bytes());
  if (f32()) {
    c.Reserve(&dres_b, tile * H_);
    if (!policy.keeps(kPieceOProj) || sandwich) c.Reserve(&branch, tile * H_);
  }
  if (sandwich) c.Reserve(&dpre, tile * H_);
  c.Reserve(&dattn_o, T * qd_);
  c.Reserve(&dqr, T * qd_);
  c.Reserve(&dkr, T * kvd_);
  c.Reserve(&dqkv, T * qkv_);
  int64_t ws_numel = 0;
  for (const int64_t rows : {tile, last}) {
    ws_numel = std::max({ws_numel, kernels::RmsNormBackwardWorkspaceNumel(rows, H_),
                         kernels::QkNormRopeBackwardWorkspaceNumel(Rope(rows)),
                         config_.has_qkv_bias() ? kernels::ColumnSumsWorkspaceNumel(rows, qd_) : int64_t{0},
                         config_.has_o_bias() ? kernels::ColumnSumsWorkspaceNumel(rows, H_) : int64_t{0}});
  }
  c.Reserve(&ws_f, ws_numel);
  ASSIGN_OR_RETURN(const std::optional<int64_t> cudnn_ws, CudnnWorkspace(AttnDir::kBackward, attn));
  c.Reserve(&ws_attn, cudnn_ws.has_value() ? *cudnn_ws : kernels::FlashAttentionBackwardWorkspaceBytes(attn));
  RETURN_IF_ERROR(c.Alloc(block, stream_));
  if (saved != nullptr) TakePieces(saved->acts_, kept, &acts);

  // Attention's inputs and output, recomputed where the policy did not keep them.
  RETURN_IF_ERROR(AttentionInputs(params, b, x, acts, kept, kept));
  PoolBlock kv_block;  // a context-parallel share: the group's keys and values, once for both
  const bf16* kv = nullptr;
  RETURN_IF_ERROR(GatherContextKv(b, acts, kv_block, &kv));
  if (!policy.keeps(kPieceAttention)) RETURN_IF_ERROR(AttentionForward(params, b, acts, kv));

  // The MLP and o_proj blocks, tile by tile, each tile's MLP inputs recomputed around the kept pieces.
  for (int64_t t0 = 0; t0 < T; t0 += tile) {
    const int64_t rows = std::min(tile, T - t0);
    const LayerActs at = TileOf(acts, t0, kept);
    RETURN_IF_ERROR(MlpTile(params, ResidualRow(x, t0), at, rows, kept, nullptr, branch));
    const void* dy_t = ResidualRow(dy, t0);
    void* dh1_t = ResidualRow(dx, t0);
    // y = h1 + act · Wdᵀ (gemma3: h1 + RMSNorm_pf(act · Wdᵀ))
    if (sandwich) {
      RETURN_IF_ERROR(SandwichBackward(dy_t, rows, W(params.bf16, kDownProj), I_, at.act, params, kPostFfnNorm, at.down,
                                       at.rstd_d, dact, dparams + off_[kDownProj], dparams, dres_b, dpre, ws_f));
    } else {
      RETURN_IF_ERROR(ResidualBranchBackward(dy_t, rows, W(params.bf16, kDownProj), I_, at.act, dact,
                                             dparams + off_[kDownProj], dres_b));
    }
    RETURN_IF_ERROR(kernels::SwiGluBackward(at.gu, dact, rows, I_, dgu, stream_, Glu()));
    RETURN_IF_ERROR(StackedBackward(params.bf16, dparams, gu_w_, dgu, 2 * I_, at.xn2, rows, H_, dxn, act_gemm_type()));
    // dh1 = dy + RMSNorm2ᵀ(dxn), into dx's rows (dy's rows were last read above)
    RETURN_IF_ERROR(NormBackward(dxn, at.h1, Norm(params, MlpInputNorm()), at.rstd2, dy_t, rows, dh1_t,
                                 dparams + off_[MlpInputNorm()], ws_f));
    // h1 = x + o · Woᵀ (dres_b's previous content, bf16 dy, was last read by the down_proj GEMMs;
    // gemma3: x + RMSNorm_pa(o · Woᵀ))
    if (sandwich) {
      RETURN_IF_ERROR(SandwichBackward(dh1_t, rows, W(params.bf16, kOProj), qd_, at.o, params, kPostNorm, at.ob,
                                       at.rstd_o, dattn_o + t0 * qd_, dparams + off_[kOProj], dparams, dres_b, dpre,
                                       ws_f));
    } else {
      RETURN_IF_ERROR(ResidualBranchBackward(dh1_t, rows, W(params.bf16, kOProj), qd_, at.o, dattn_o + t0 * qd_,
                                             dparams + off_[kOProj], dres_b, OBiasGrad(dparams), ws_f));
    }
  }
  RETURN_IF_ERROR(AttentionBackward(b, attn, cudnn_ws, acts, dattn_o, dqr, dkr, dqkv + VColumn(), ws_attn, kv));
  kv_block.Release();

  // q/k norm + RoPE and the QKV projections, tile by tile.
  return QkvBackward(params, b, x, acts, kept, tile, dqr, dkr, dqkv, dxn, ws_f, dx, dparams);
}

absl::Status CudaBackend::QkvBackward(const UnitParams& params, const CudaBatch& b, const void* x,
                                      const LayerActs& acts, uint32_t kept, int64_t tile, bf16* dqr, bf16* dkr,
                                      bf16* dqkv, void* dxn, float* ws_f, void* dx, float* dparams) {
  const int64_t T = b.num_tokens_;
  const bool tiled = tile < T;
  const ActPolicy policy{kept};
  const NormW qn = Norm(params, kQNorm), kn = Norm(params, kKNorm);
  for (int64_t t0 = 0; t0 < T; t0 += tile) {
    const int64_t rows = std::min(tile, T - t0);
    const LayerActs at = TileOf(acts, t0, kept);
    const kernels::RopeArgs rope = Rope(rows, params.decoder_layer);
    const int32_t* pos = b.positions_ + t0;
    bf16* dqkv_t = dqkv + t0 * qkv_;
    if (config_.has_qk_norm()) {
      float* dqn = dparams + off_[kQNorm];
      float* dkn = dparams + off_[kKNorm];
      RETURN_IF_ERROR(qn.f != nullptr
                          ? kernels::QkNormRopeBackward(rope, dqr + t0 * qd_, dkr + t0 * kvd_, at.qkv, qkv_, qn.f, kn.f,
                                                        pos, dqkv_t, qkv_, dqn, dkn, ws_f, stream_)
                          : kernels::QkNormRopeBackward(rope, dqr + t0 * qd_, dkr + t0 * kvd_, at.qkv, qkv_, qn.b, kn.b,
                                                        pos, dqkv_t, qkv_, dqn, dkn, ws_f, stream_));
    } else {
      RETURN_IF_ERROR(kernels::RopeBackward(rope, dqr + t0 * qd_, dkr + t0 * kvd_, pos, dqkv_t, qkv_, stream_));
    }
    RETURN_IF_ERROR(QkvBiasBackward(dqkv_t, rows, dparams, ws_f));
    // The tile's input norm: kept, left by AttentionInputs (one tile), or recomputed.
    if (tiled && !policy.keeps(kPieceCheap)) {
      RETURN_IF_ERROR(NormForward(ResidualRow(x, t0), Norm(params, kInputNorm), rows, at.xn1, at.rstd1));
    }
    RETURN_IF_ERROR(
        StackedBackward(params.bf16, dparams, qkv_w_, dqkv_t, qkv_, at.xn1, rows, H_, dxn, act_gemm_type()));
    // dx = dh1 + RMSNorm1ᵀ(dxn), in place over dh1's rows
    void* dx_t = ResidualRow(dx, t0);
    RETURN_IF_ERROR(NormBackward(dxn, ResidualRow(x, t0), Norm(params, kInputNorm), at.rstd1, dx_t, rows, dx_t,
                                 dparams + off_[kInputNorm], ws_f));
  }
  return absl::OkStatus();
}

absl::Status CudaBackend::HeadForwardBackward(const UnitParams& norm_params, const bf16_t* lm_head_w,
                                              const DeviceBatch& batch, const void* x, float loss_scale, void* dx,
                                              float* dnorm, float* dlm_head, float* loss_sum) {
  if (dx == nullptr || dnorm == nullptr || dlm_head == nullptr) {
    return absl::InvalidArgumentError("HeadForwardBackward: null gradient pointer (HeadLoss computes the loss alone)");
  }
  return Head(norm_params, lm_head_w, batch, x, loss_scale, dx, dnorm, dlm_head, loss_sum);
}

absl::Status CudaBackend::HeadLoss(const UnitParams& norm_params, const bf16_t* lm_head_w, const DeviceBatch& batch,
                                   const void* x, float loss_scale, float* loss_sum) {
  return Head(norm_params, lm_head_w, batch, x, loss_scale, nullptr, nullptr, nullptr, loss_sum);
}

absl::Status CudaBackend::Head(const UnitParams& norm_params, const bf16_t* lm_head_w, const DeviceBatch& batch,
                               const void* x, float loss_scale, void* dx, float* dnorm, float* dlm_head,
                               float* loss_sum) {
  const auto& b = static_cast<const CudaBatch&>(batch);
  const int64_t T = b.num_tokens_, V = config_.vocab_size;
  if (T == 0) return absl::OkStatus();
  const bool grads = dx != nullptr;  // else the loss alone: no dgrad, wgrad or norm backward
  const NormW norm_w{reinterpret_cast<const bf16*>(norm_params.bf16), norm_params.fp32};
  const bf16* wl = reinterpret_cast<const bf16*>(lm_head_w);
  // The norm runs tile by tile (TileRows), the logits in chunks of a tile.
  const int64_t tile = TileRows(T);
  int64_t chunk = std::max<int64_t>(1, options_.head_logits_budget_bytes / (V * 2));
  if (chunk >= 128) chunk = chunk / 128 * 128;
  chunk = std::min(chunk, tile);
  Carver c;
  PoolBlock block;
  bf16 *xn, *logits;
  char* dxn = nullptr;  // residual dtype (FP32 mode: the dgrad GEMM writes FP32)
  float *rstd, *row_loss, *ws = nullptr;
  c.Reserve(&xn, tile * H_);
  if (grads) c.Reserve(&dxn, tile * H_ * act_bytes());
  c.Reserve(&rstd, tile);
  c.Reserve(&row_loss, T);
  if (grads) c.Reserve(&ws, kernels::RmsNormBackwardWorkspaceNumel(tile, H_));
  c.Reserve(&logits, chunk * V);
  RETURN_IF_ERROR(c.Alloc(block, stream_));
  for (int64_t s0 = 0; s0 < T; s0 += tile) {
    const int64_t rows = std::min(tile, T - s0);
    RETURN_IF_ERROR(NormForward(ResidualRow(x, s0), norm_w, rows, xn, rstd));
    for (int64_t t0 = 0; t0 < rows; t0 += chunk) {
      const int64_t tc = std::min(chunk, rows - t0);
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
      RETURN_IF_ERROR(kernels::CrossEntropyInPlace(logits, tc, V, V, b.labels_ + s0 + t0, kIgnoreIndex, loss_scale,
                                                   row_loss + s0 + t0, stream_,
                                                   static_cast<float>(config_.final_logit_softcapping)));
      if (!grads) continue;
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
    if (grads) {
      RETURN_IF_ERROR(
          NormBackward(dxn, ResidualRow(x, s0), norm_w, rstd, nullptr, rows, ResidualRow(dx, s0), dnorm, ws));
    }
  }
  RETURN_IF_ERROR(kernels::SumInto(row_loss, T, loss_sum, stream_));
  return absl::OkStatus();
}

}  // namespace slidedp::cuda_backend_internal
