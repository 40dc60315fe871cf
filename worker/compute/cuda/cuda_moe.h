// The sparse MoE block of Qwen3-MoE and of GPT-OSS (MoeDims::gpt_oss) on the CUDA backend's stream,
// forward and backward, over the T post-attention-norm tokens of one sparse decoder layer: router,
// experts grouped by expert, weighted combine. The math and its CPU reference are
// worker/compute/cpu/moe_reference_math.h and, for GPT-OSS, gpt_oss_math.h (MoeDims and MoeOffsets
// come from there: the unit's flat parameter layout, MoeOffsets::InUnit); the kernels are
// worker/kernels/moe.h and gpt_oss_moe.h. Internal to worker/compute/cuda.
//
// Numerics: HF transformers 5.x Qwen3MoeSparseMoeBlock under torch.autocast(bf16) with FP32 master
// weights and its eager experts loop, in the dense layers' conventions (cuda_layer_math.cc):
//   logits = xn · Wrᵀ                BF16 GEMM output (F.linear under autocast)
//   p      = softmax(logits)         FP32 (dtype=torch.float); top-k largest first, ties to the lower
//                                    expert; w renormalised in FP32 if norm_topk_prob; w stays FP32
//   gu     = xg · [Wg;Wu]ᵀ           BF16, per expert over its rows (xg: xn's rows, grouped)
//   act    = silu(g) · u             BF16 (SwiGluForward: FP32 math, one rounding)
//   eo     = act · Wdᵀ               BF16
//   out[t] = Σ float(eo) · w         FP32, the token's experts ascending, each product rounded before
//                                    the add (HF: eo * w in FP32, index_add_ into FP32 zeros)
// Backward follows autograd through the same casts: d_eo = bf16(dout · w), dw = dout · eo (FP32),
// d_act = d_eo · Wd (BF16), d_gu by SwiGluBackward (BF16), dxg = d_gu · [Wg;Wu] (FP32 GEMM output, as
// the dense path's dxn), the router's dz in BF16; weight gradients are FP32 GEMM outputs ADDED into
// dparams (beta = 1), like the dense layers' (HF rounds them through the BF16 weight copy first).
// This is HF's eager experts loop (experts_implementation "eager"), which the reference follows.
// transformers 5.x defaults to "grouped_mm" where it can dispatch it: that path casts the input to
// the weights' dtype (FP32 master weights: FP32 expert GEMMs, no BF16 rounding of gu, act, eo) and
// sums a token's k terms in slot order; a parity run against HF should ask for "eager".
//
// GPT-OSS (HF 5.17 GptOssMLP: GptOssTopKRouter + GptOssExperts' eager loop), same conventions; its
// unit holds biases (MoeOffsets' router_bias, gate_up_bias_at, down_bias_at), the fused gate_up at
// gate_at(e) is [H, 2I] used as x @ W with gate in the even columns and up in the odd ones, and
// down_at(e) is [I, H] used as act @ W:
//   z      = bf16(xn · Wrᵀ + br)     the FP32 GEMM accumulator plus the bias, rounded once (F.linear's
//                                    BF16 output, the bias in cuBLASLt's epilogue)
//   p      = softmax(z)              FP32, only for the aux loss (S_e, and its gradient's path)
//   top-k of z (largest first, ties to the lower expert); w = bf16(softmax of the k selected z), FP32
//                                    math rounded once (softmax(top_v, dtype=top_v.dtype))
//   gu     = xg · Wgu                BF16, without the bias
//   act    = bf16((clamp(u, ±L) + 1) · g σ(α g)), g = min(gate, L), [gate, up] = float(gu) + bgu in
//                                    FP32 (HF: BF16 GEMM output + FP32 parameter is FP32), the GLU in
//                                    FP32, rounded where autocast casts it for the down GEMM (L 7, α 1.702)
//   eo     = act · Wd                BF16, without the bias
//   out[t] = Σ ((float(eo) + bd) · w) FP32, the token's experts ascending, each operation rounded
// The biases are the unit's BF16 copies; HF adds the FP32 master values, which we do not have here.
// Backward, through the same casts: d_eo = bf16(dout · w), dw = dout · (float(eo) + bd) (FP32, then
// rounded to BF16 as the BF16 weights' gradient g); dz = bf16(w (g - Σ g w)) at the selected experts
// (the BF16 k-softmax's backward) plus, with an aux gradient, bf16(p (aux - p·aux)) at every expert
// (the full FP32 softmax's), the two summed and rounded (the BF16 logits' two gradients); d_act =
// d_eo · Wdᵀ (BF16); d(gate_up) in FP32 through the GLU and the clamps (which pass the gradient with
// their ends included, as torch.clamp), rounded to BF16 for the GEMMs; dxg = d_gu · Wguᵀ and dxn's
// router term in FP32, as above. Bias gradients, FP32 and added into dparams in fixed orders: br the
// column sums of dz (BF16), bgu[e] those of expert e's FP32 d(gate_up) rows, bd[e] those of its FP32
// dout · w rows (HF's gradients of the FP32 biases, from the unrounded FP32 values).
//
// GEMMs: GemmRunner (cuBLASLt), one per expert that has rows, per matrix (gate and up as one GEMM
// of 2I outputs when the layout puts up_proj right after gate_proj, as ModelLayout does). CUDA 13's
// cublas_api.h does declare cublasGemmGroupedBatchedEx, but it is not used: it needs a cuBLAS (not
// Lt) handle and device pointer arrays built per call, offers no BF16-in / FP32-accumulate-into-C
// (beta = 1) guarantee we could check here without a GPU, and would give the experts' GEMMs other
// kernels than the dense layers' (one numerics, one tuning path). The expert GEMMs are planned per
// bucket of row counts (GemmArgs::varies; see cuda_moe.cc). GPT-OSS's [in, out] weights take the same
// GEMMs with W's roles swapped (MatMul*), its gate_up always as one GEMM of 2I outputs; its router
// GEMM writes FP32 (the bias is added in the router kernel, so the bias needs no epilogue alignment).
//
// Host synchronization (the one exception to "never synchronize"): the experts' GEMM sizes are the
// per-expert row counts, which the router makes on the device. Forward copies them to the host and
// waits for the stream once; Backward does the same only when it has to recompute the routing
// (MoeKeep::kNothing, or no saved state). Nothing else synchronizes.
//
// Memory: scratch is stream-ordered pool memory (PoolBlock, cuda_memory.h) taken per call and freed in
// stream order when the call returns: up to T·k·(4H + 6I) bytes forward (less what `saved` keeps) and
// T·k·(6H + 12I) backward, plus small [T, E] pieces (GPT-OSS: the router's [T, E] output in FP32, and
// 128·max(2I, H) + min(T, 128)·E floats of bias-sum workspace in backward). What Forward keeps for
// Backward lives in memory the caller owns (ReserveSaved); its layout is the same for both families.
// The block runs on all T tokens at once (no TileRows tiling).
//
// Determinism: bitwise repeatable run to run (the kernels' fixed orders, integer atomics only, and
// the same cuBLASLt plans per shape); dxn gets the router term first and then each expert's rows in
// ascending expert order, as the reference.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "common/numeric/bf16.h"
#include "worker/compute/cpu/moe_reference_math.h"
#include "worker/compute/cuda/cuda_memory.h"
#include "worker/kernels/gemm.h"
#include "worker/kernels/gpt_oss_moe.h"
#include "worker/kernels/moe.h"

namespace slidedp::cuda_backend_internal {

using kernels::bf16;

// What Forward keeps for Backward.
enum class MoeKeep {
  kNothing,  // Backward recomputes the routing (one more host synchronization) and the experts
  kRouting,  // probabilities, top-k and the grouping ([T, E] + O(T k)); Backward recomputes the experts
  kAll,      // and the experts' gate/up and down outputs (T k (2I + H) BF16): Backward recomputes
             // only the row gather and the SwiGLU
};

// A block's forward state, device tensors in memory the caller owns (ReserveSaved lays them out in
// the caller's Carver, so they can sit in the layer's saved block and travel with it). Pointers of
// pieces `keep` leaves out are null.
struct MoeSaved {
  int64_t num_tokens = 0;
  MoeKeep keep = MoeKeep::kNothing;
  // kRouting and kAll
  float* probs = nullptr;              // [T, E] softmax of the router logits
  int32_t* topk_expert = nullptr;      // [T, k] largest probability (logit) first
  float* topk_weight = nullptr;        // [T, k] routing weights (gpt_oss: BF16 values)
  int32_t* token_index = nullptr;      // [T k] grouped layout (worker/kernels/moe.h)
  int32_t* slot_index = nullptr;       // [T k]
  int32_t* row_of_slot = nullptr;      // [T k]
  std::vector<int64_t> expert_counts;  // [E] host: rows per expert (the GEMM sizes); Forward fills it
  // kAll
  bf16* gu = nullptr;          // [T k, 2I] gate | up outputs, grouped (gpt_oss: interleaved, before the bias)
  bf16* expert_out = nullptr;  // [T k, H] down_proj outputs before the routing weight (and gpt_oss's bias)

  // Moves the device pointers from a block at `from` to the same offsets in one at `to` (an activation
  // store gave the block back elsewhere: CudaSaved::Attach).
  void Rebase(const char* from, char* to);
};

// Where Forward writes the layer's auxiliary-loss statistics (MoeRouterStats on the device); either may
// be null.
struct MoeRouterStatsOut {
  int32_t* expert_counts = nullptr;  // [E] C_e: tokens whose top-k holds e
  double* prob_sums = nullptr;       // [E] S_e: sum over tokens of p[t, e] (fixed order)
};

class CudaMoeBlock {
 public:
  // dims: MoeDims::Of(config); offs: MoeOffsets::InUnit(unit), into the unit's flat BF16 parameters
  // and its FP32 gradient (same layout). gemm: the backend's runner, used on the calls' stream only.
  // INVALID_ARGUMENT for sizes the kernels do not take (qwen3_moe's moe_intermediate_size not a
  // multiple of 8, more than kernels::kMoeMaxExperts experts) and for a gpt_oss block whose offsets
  // lack its biases.
  static absl::StatusOr<CudaMoeBlock> Create(const MoeDims& dims, const MoeOffsets& offs, GemmRunner* gemm);

  const MoeDims& dims() const { return dims_; }

  // Lays out `saved`'s device tensors for T tokens under `keep` in `carver`; they point into the block
  // the caller then allocates with it (and keeps as long as `saved`).
  void ReserveSaved(int64_t num_tokens, MoeKeep keep, Carver& carver, MoeSaved* saved) const;
  // The same in a block of its own.
  absl::Status AllocateSaved(int64_t num_tokens, MoeKeep keep, PoolBlock& block, MoeSaved* saved,
                             cudaStream_t stream) const;

  // out [T, H] FP32 = the block's output (overwritten; the caller adds it to the FP32 residual) for
  // xn [T, H] BF16 (post_attention_layernorm's output, the GEMM input). saved (may be null) must come
  // from ReserveSaved for T tokens; it gets what its keep names. stats gets C_e and S_e;
  // expert_counts (may be null) the host copy of the rows per expert. Synchronizes once (see above).
  absl::Status Forward(const bf16_t* params, const bf16* xn, int64_t num_tokens, float* out, MoeSaved* saved,
                       const MoeRouterStatsOut& stats, std::vector<int64_t>* expert_counts, cudaStream_t stream) const;

  // dxn [T, H] FP32 = dL/dxn (overwritten; may alias dout), dparams += dL/dparams for dL/dout = dout
  // [T, H] FP32: the router and every expert that has rows (an expert without rows is not touched).
  // aux_prob_grad (device [E], from LoadBalancingProbGrad; may be null) is added to dL/dp of every
  // token. saved: Forward's state for these T tokens and the same params and xn, or null (all
  // recomputed from xn).
  absl::Status Backward(const bf16_t* params, const bf16* xn, int64_t num_tokens, const MoeSaved* saved,
                        const float* dout, const double* aux_prob_grad, float* dxn, float* dparams,
                        cudaStream_t stream) const;

 private:
  // Scratch of one routing pass (router GEMM output, counts, offsets, permutation workspace).
  struct RouteScratch {
    bf16* logits = nullptr;       // [T, logits_ld_] (qwen3_moe)
    float* logits_acc = nullptr;  // [T, logits_ld_] gpt_oss: the GEMM's FP32 output, before the bias
    int32_t* counts = nullptr;
    int32_t* offsets = nullptr;
    int32_t* perm_ws = nullptr;
  };
  // gpt_oss's backward scratch (Backward lays it out).
  struct GptOssBackwardScratch {
    bf16* xg = nullptr;               // [T k, H] xn's grouped rows
    bf16* act = nullptr;              // [T k, I] the clamped SwiGLU's output, the down GEMM's input
    bf16* d_eo = nullptr;             // [T k, H] the down GEMM output's gradient
    float* dw = nullptr;              // [T k] dL/d(routing weight), FP32 before its BF16 rounding
    bf16* dlogits = nullptr;          // [T, logits_ld_]
    bf16* dact = nullptr;             // [T k, I]
    bf16* dgu = nullptr;              // [T k, 2I] interleaved as gu
    float* bias_ws = nullptr;         // kernels::GptOssBiasWorkspaceNumel(T k, max(2I, H))
    float* router_bias_ws = nullptr;  // kernels::ColumnSumsWorkspaceNumel(T, E)
  };

  CudaMoeBlock(const MoeDims& dims, const MoeOffsets& offs, GemmRunner* gemm);

  // Reserves the routing pieces of r (probs .. row_of_slot) and the experts' (gu, expert_out).
  void ReserveRouting(int64_t T, Carver& c, MoeSaved* r) const;
  void ReserveExperts(int64_t T, Carver& c, MoeSaved* r) const;
  void ReserveRouteScratch(int64_t T, Carver& c, RouteScratch* s) const;
  // Router GEMM, softmax + top-k and the grouping, on the device.
  absl::Status Route(const bf16* w, const bf16* xn, int64_t T, const MoeSaved& r, const RouteScratch& s,
                     cudaStream_t stream) const;
  // The device counts to the host (the one synchronization), checked to add up to T k.
  absl::Status DownloadCounts(const int32_t* counts, int64_t T, std::vector<int64_t>* host, cudaStream_t stream) const;
  // xg = xn's grouped rows; gu, act and eo of every expert that has rows.
  absl::Status ExpertsForward(const bf16* w, const bf16* xn, int64_t T, const MoeSaved& r,
                              const std::vector<int64_t>& counts, bf16* xg, bf16* gu, bf16* act, bf16* eo,
                              cudaStream_t stream) const;
  // gpt_oss: the same, and act alone from gu (plus the expert's gate_up bias, the clamped SwiGLU).
  absl::Status GptOssExpertsForward(const bf16* w, const bf16* xn, int64_t T, const MoeSaved& r,
                                    const std::vector<int64_t>& counts, bf16* xg, bf16* gu, bf16* act, bf16* eo,
                                    cudaStream_t stream) const;
  absl::Status GptOssActivations(const bf16* w, const bf16* gu, const std::vector<int64_t>& counts, bf16* act,
                                 cudaStream_t stream) const;
  // gpt_oss's backward once the routing (v) and the experts' forward (s.xg, s.act, v.gu, v.expert_out)
  // are in place; Backward's contract.
  absl::Status GptOssBackward(const bf16* w, const bf16* xn, int64_t T, const MoeSaved& v,
                              const std::vector<int64_t>& counts, const float* dout, const double* aux_prob_grad,
                              const GptOssBackwardScratch& s, float* dxn, float* dparams, cudaStream_t stream) const;

  // Y[rows, out] = X[rows, in] · W[out, in]ᵀ, BF16.
  absl::Status Linear(const bf16* x, int64_t ldx, const bf16* w, int64_t rows, int64_t in, int64_t out, bf16* y,
                      int64_t ldy, cudaStream_t stream) const;
  // dX[rows, in] = dY[rows, out] · W[out, in] (+ dX when beta is 1), BF16 or FP32 dX.
  absl::Status LinearDgrad(const bf16* dy, int64_t lddy, const bf16* w, int64_t rows, int64_t in, int64_t out, void* dx,
                           int64_t lddx, Dtype dx_type, float beta, cudaStream_t stream) const;
  // dW[out, in] += dY[rows, out]ᵀ · X[rows, in], FP32.
  absl::Status LinearWgrad(const bf16* dy, int64_t lddy, const bf16* x, int64_t ldx, int64_t rows, int64_t in,
                           int64_t out, float* dw, cudaStream_t stream) const;
  // gpt_oss's expert weights, stored [in, out] (transformers' GptOssExperts computes x @ W):
  // Y[rows, out] = X[rows, in] · W[in, out], BF16;
  absl::Status MatMul(const bf16* x, int64_t ldx, const bf16* w, int64_t rows, int64_t in, int64_t out, bf16* y,
                      int64_t ldy, cudaStream_t stream) const;
  // dX[rows, in] = dY[rows, out] · W[in, out]ᵀ (overwritten), BF16 or FP32 dX;
  absl::Status MatMulDgrad(const bf16* dy, int64_t lddy, const bf16* w, int64_t rows, int64_t in, int64_t out, void* dx,
                           int64_t lddx, Dtype dx_type, cudaStream_t stream) const;
  // dW[in, out] += X[rows, in]ᵀ · dY[rows, out], FP32.
  absl::Status MatMulWgrad(const bf16* x, int64_t ldx, const bf16* dy, int64_t lddy, int64_t rows, int64_t in,
                           int64_t out, float* dw, cudaStream_t stream) const;
  // gpt_oss's router GEMM without its bias: acc[T, logits_ld_] = xn · Wrᵀ, FP32 (GptOssRouteTopK adds
  // the bias and rounds once, as cuBLASLt's bias epilogue would).
  absl::Status RouterLogitsF32(const bf16* wr, const bf16* xn, int64_t T, float* acc, cudaStream_t stream) const;

  MoeDims dims_;
  MoeOffsets offs_;
  GemmRunner* gemm_;
  kernels::MoeTopKNorm norm_;
  int64_t logits_ld_;        // the router GEMM's output row stride: E rounded up to 8 (16-byte rows)
  bool gate_up_contiguous_;  // up_proj directly after gate_proj: one GEMM of 2I outputs

  kernels::GptOssGluParams glu_;  // gpt_oss's SwiGLU constants (MoeDims::swiglu_alpha, swiglu_limit)
};

}  // namespace slidedp::cuda_backend_internal
