// CudaMoeBlock (cuda_moe.h): the Qwen3-MoE and GPT-OSS blocks' forward and backward on one stream.
//
// Forward:  logits = xn·Wrᵀ -> softmax/top-k -> grouping -> [counts to the host] -> xg = xn[rows]
//           -> per expert gu = xg·[Wg;Wu]ᵀ -> act = SwiGLU(gu) -> per expert eo = act·Wdᵀ -> combine
// Backward: (routing and experts recomputed where not kept) -> d_eo, dw (combine backward)
//           -> dz (router backward) -> dxn = dz·Wr, dWr += dzᵀ·xn
//           -> per expert d_act = d_eo·Wd, dWd += d_eoᵀ·act -> d_gu = SwiGLU'(gu, d_act)
//           -> per expert dW[g;u] += d_guᵀ·xg, dxg = d_gu·[Wg;Wu], dxn[rows] += dxg (ascending experts)
// GPT-OSS: the same pipeline with its kernels (gpt_oss_moe.h): the router GEMM in FP32 and the bias
// in the router kernel, per expert gu = xg·Wgu -> clamped SwiGLU with the gate_up bias -> eo = act·Wd,
// the combine adding the down bias; backward adds the three bias gradients (column sums in fixed
// order) and runs each expert's down, SwiGLU and gate_up steps together (GptOssBackward).
//
// GEMM plans: every expert GEMM says which of its dimensions is the routed row count
// (GemmArgs::varies), so GemmRunner plans once per bucket of counts (GemmRowBucket: two per octave)
// and not once per distinct count, which the routing makes new in nearly every call (a cuBLASLt
// heuristic call each, on the host, between the GPU's GEMMs).
#include "worker/compute/cuda/cuda_moe.h"

#include <cuda_runtime.h>

#include <algorithm>
#include <numeric>
#include <type_traits>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/status/status_macros.h"
#include "worker/kernels/cuda_check.h"
#include "worker/kernels/reductions.h"
#include "worker/kernels/swiglu.h"

namespace slidedp::cuda_backend_internal {
namespace {

const bf16* AsBf16(const bf16_t* p) { return reinterpret_cast<const bf16*>(p); }

int64_t MaxCount(const std::vector<int64_t>& counts) {
  return counts.empty() ? 0 : *std::max_element(counts.begin(), counts.end());
}

}  // namespace

void MoeSaved::Rebase(const char* from, char* to) {
  auto move = [&](auto*& p) {
    using T = std::remove_pointer_t<std::remove_reference_t<decltype(p)>>;
    if (p != nullptr) p = reinterpret_cast<T*>(to + (reinterpret_cast<const char*>(p) - from));
  };
  move(probs), move(topk_expert), move(topk_weight), move(token_index), move(slot_index), move(row_of_slot);
  move(gu), move(expert_out);
}

absl::StatusOr<CudaMoeBlock> CudaMoeBlock::Create(const MoeDims& dims, const MoeOffsets& offs, GemmRunner* gemm) {
  if (gemm == nullptr) return absl::InvalidArgumentError("CudaMoeBlock: no GemmRunner");
  if (dims.hidden < 1 || dims.intermediate < 1 || dims.num_experts < 1 || dims.num_experts > kernels::kMoeMaxExperts ||
      dims.top_k < 1 || dims.top_k > dims.num_experts) {
    return absl::InvalidArgumentError(absl::StrCat("CudaMoeBlock: hidden ", dims.hidden, ", moe_intermediate ",
                                                   dims.intermediate, ", experts ", dims.num_experts, " (at most ",
                                                   kernels::kMoeMaxExperts, "), top_k ", dims.top_k));
  }
  if (dims.gpt_oss) {  // its kernels take any intermediate size
    if (offs.router_bias < 0 || offs.gate_up_bias < 0 || offs.down_bias < 0) {
      return absl::InvalidArgumentError(
          "CudaMoeBlock: a gpt_oss block needs the router, gate_up and down biases in its layout (MoeOffsets)");
    }
  } else if (dims.intermediate % 8 != 0) {  // the SwiGLU kernels' 8-wide vectors
    return absl::InvalidArgumentError(
        absl::StrCat("CudaMoeBlock: moe_intermediate_size ", dims.intermediate, " is not a multiple of 8"));
  }
  return CudaMoeBlock(dims, offs, gemm);
}

CudaMoeBlock::CudaMoeBlock(const MoeDims& dims, const MoeOffsets& offs, GemmRunner* gemm)
    : dims_(dims),
      offs_(offs),
      gemm_(gemm),
      norm_(dims.norm_topk_prob ? kernels::MoeTopKNorm::kRenormalized : kernels::MoeTopKNorm::kProbabilities),
      logits_ld_((dims.num_experts + 7) / 8 * 8),
      gate_up_contiguous_(offs.up == offs.gate + dims.intermediate * dims.hidden),
      glu_{static_cast<float>(dims.swiglu_alpha), static_cast<float>(dims.swiglu_limit)} {}

// ---- GEMMs (W row-major [out, in], as gemm.h's three uses).

absl::Status CudaMoeBlock::Linear(const bf16* x, int64_t ldx, const bf16* w, int64_t rows, int64_t in, int64_t out,
                                  bf16* y, int64_t ldy, cudaStream_t stream) const {
  GemmArgs g;
  g.op_a = GemmOp::kN;
  g.op_b = GemmOp::kT;
  g.m = rows;
  g.n = out;
  g.k = in;
  g.a = x;
  g.lda = ldx;
  g.b = w;
  g.ldb = in;
  g.d = y;
  g.ldd = ldy;
  g.varies = GemmArgs::Varies::kM;  // rows: an expert's (or the micro-batch's) token count
  return gemm_->Run(g, stream);
}

absl::Status CudaMoeBlock::LinearDgrad(const bf16* dy, int64_t lddy, const bf16* w, int64_t rows, int64_t in,
                                       int64_t out, void* dx, int64_t lddx, Dtype dx_type, float beta,
                                       cudaStream_t stream) const {
  GemmArgs g;
  g.op_a = GemmOp::kN;
  g.op_b = GemmOp::kN;
  g.m = rows;
  g.n = in;
  g.k = out;
  g.a = dy;
  g.lda = lddy;
  g.b = w;
  g.ldb = in;
  g.c = dx;
  g.ldc = lddx;
  g.d = dx;
  g.ldd = lddx;
  g.out_type = dx_type;
  g.beta = beta;
  g.varies = GemmArgs::Varies::kM;
  return gemm_->Run(g, stream);
}

absl::Status CudaMoeBlock::LinearWgrad(const bf16* dy, int64_t lddy, const bf16* x, int64_t ldx, int64_t rows,
                                       int64_t in, int64_t out, float* dw, cudaStream_t stream) const {
  GemmArgs g;
  g.op_a = GemmOp::kT;
  g.op_b = GemmOp::kN;
  g.m = out;
  g.n = in;
  g.k = rows;
  g.a = dy;
  g.lda = lddy;
  g.b = x;
  g.ldb = ldx;
  g.c = dw;
  g.ldc = in;
  g.d = dw;
  g.ldd = in;
  g.out_type = Dtype::kF32;
  g.beta = 1.0f;
  g.varies = GemmArgs::Varies::kK;
  return gemm_->Run(g, stream);
}

// gpt_oss's [in, out] weights: the same three GEMMs with W's roles swapped.

absl::Status CudaMoeBlock::MatMul(const bf16* x, int64_t ldx, const bf16* w, int64_t rows, int64_t in, int64_t out,
                                  bf16* y, int64_t ldy, cudaStream_t stream) const {
  GemmArgs g;
  g.op_a = GemmOp::kN;
  g.op_b = GemmOp::kN;
  g.m = rows;
  g.n = out;
  g.k = in;
  g.a = x;
  g.lda = ldx;
  g.b = w;
  g.ldb = out;
  g.d = y;
  g.ldd = ldy;
  g.varies = GemmArgs::Varies::kM;
  return gemm_->Run(g, stream);
}

absl::Status CudaMoeBlock::MatMulDgrad(const bf16* dy, int64_t lddy, const bf16* w, int64_t rows, int64_t in,
                                       int64_t out, void* dx, int64_t lddx, Dtype dx_type, cudaStream_t stream) const {
  GemmArgs g;
  g.op_a = GemmOp::kN;
  g.op_b = GemmOp::kT;
  g.m = rows;
  g.n = in;
  g.k = out;
  g.a = dy;
  g.lda = lddy;
  g.b = w;
  g.ldb = out;
  g.d = dx;
  g.ldd = lddx;
  g.out_type = dx_type;
  g.varies = GemmArgs::Varies::kM;
  return gemm_->Run(g, stream);
}

absl::Status CudaMoeBlock::MatMulWgrad(const bf16* x, int64_t ldx, const bf16* dy, int64_t lddy, int64_t rows,
                                       int64_t in, int64_t out, float* dw, cudaStream_t stream) const {
  GemmArgs g;
  g.op_a = GemmOp::kT;
  g.op_b = GemmOp::kN;
  g.m = in;
  g.n = out;
  g.k = rows;
  g.a = x;
  g.lda = ldx;
  g.b = dy;
  g.ldb = lddy;
  g.c = dw;
  g.ldc = out;
  g.d = dw;
  g.ldd = out;
  g.out_type = Dtype::kF32;
  g.beta = 1.0f;
  g.varies = GemmArgs::Varies::kK;
  return gemm_->Run(g, stream);
}

absl::Status CudaMoeBlock::RouterLogitsF32(const bf16* wr, const bf16* xn, int64_t T, float* acc,
                                           cudaStream_t stream) const {
  GemmArgs g;
  g.op_a = GemmOp::kN;
  g.op_b = GemmOp::kT;
  g.m = T;
  g.n = dims_.num_experts;
  g.k = dims_.hidden;
  g.a = xn;
  g.lda = dims_.hidden;
  g.b = wr;
  g.ldb = dims_.hidden;
  g.d = acc;
  g.ldd = logits_ld_;
  g.out_type = Dtype::kF32;
  g.varies = GemmArgs::Varies::kM;
  return gemm_->Run(g, stream);
}

// ---- Layout of saved state and scratch.

void CudaMoeBlock::ReserveRouting(int64_t T, Carver& c, MoeSaved* r) const {
  const int64_t E = dims_.num_experts, k = dims_.top_k;
  c.Reserve(&r->probs, T * E);
  c.Reserve(&r->topk_expert, T * k);
  c.Reserve(&r->topk_weight, T * k);
  c.Reserve(&r->token_index, T * k);
  c.Reserve(&r->slot_index, T * k);
  c.Reserve(&r->row_of_slot, T * k);
}

void CudaMoeBlock::ReserveExperts(int64_t T, Carver& c, MoeSaved* r) const {
  const int64_t rows = T * dims_.top_k;
  c.Reserve(&r->gu, rows * 2 * dims_.intermediate);
  c.Reserve(&r->expert_out, rows * dims_.hidden);
}

void CudaMoeBlock::ReserveRouteScratch(int64_t T, Carver& c, RouteScratch* s) const {
  const int64_t E = dims_.num_experts;
  if (dims_.gpt_oss) {
    c.Reserve(&s->logits_acc, T * logits_ld_);
  } else {
    c.Reserve(&s->logits, T * logits_ld_);
  }
  c.Reserve(&s->counts, E);
  c.Reserve(&s->offsets, E + 1);
  c.Reserve(&s->perm_ws, kernels::MoePermutationWorkspaceNumel(T, E));
}

void CudaMoeBlock::ReserveSaved(int64_t T, MoeKeep keep, Carver& carver, MoeSaved* saved) const {
  *saved = MoeSaved();
  saved->num_tokens = T;
  saved->keep = keep;
  if (keep != MoeKeep::kNothing) ReserveRouting(T, carver, saved);
  if (keep == MoeKeep::kAll) ReserveExperts(T, carver, saved);
}

absl::Status CudaMoeBlock::AllocateSaved(int64_t T, MoeKeep keep, PoolBlock& block, MoeSaved* saved,
                                         cudaStream_t stream) const {
  Carver c;
  ReserveSaved(T, keep, c, saved);
  return c.Alloc(block, stream);
}

// ---- Pieces.

absl::Status CudaMoeBlock::Route(const bf16* w, const bf16* xn, int64_t T, const MoeSaved& r, const RouteScratch& s,
                                 cudaStream_t stream) const {
  const int64_t E = dims_.num_experts, k = dims_.top_k, H = dims_.hidden;
  if (dims_.gpt_oss) {  // logits = bf16(xn · Wrᵀ + br), rounded once in the router kernel
    RETURN_IF_ERROR(RouterLogitsF32(w + offs_.router, xn, T, s.logits_acc, stream));
    RETURN_IF_ERROR(kernels::GptOssRouteTopK(s.logits_acc, logits_ld_, w + offs_.router_bias, T, E, k, r.probs,
                                             r.topk_expert, r.topk_weight, stream));
  } else {
    RETURN_IF_ERROR(Linear(xn, H, w + offs_.router, T, H, E, s.logits, logits_ld_, stream));
    RETURN_IF_ERROR(
        kernels::MoeRouteTopK(s.logits, logits_ld_, T, E, k, norm_, r.probs, r.topk_expert, r.topk_weight, stream));
  }
  return kernels::MoeBuildPermutation(r.topk_expert, T, k, E, s.perm_ws, s.counts, s.offsets, r.token_index,
                                      r.slot_index, r.row_of_slot, stream);
}

absl::Status CudaMoeBlock::DownloadCounts(const int32_t* counts, int64_t T, std::vector<int64_t>* host,
                                          cudaStream_t stream) const {
  const int64_t E = dims_.num_experts;
  std::vector<int32_t> h(E);
  SLIDEDP_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(h.data(), counts, E * sizeof(int32_t), cudaMemcpyDeviceToHost, stream));
  // The block's one synchronization: the experts' GEMM sizes are these counts.
  SLIDEDP_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(stream));
  host->assign(h.begin(), h.end());
  const int64_t total = std::accumulate(host->begin(), host->end(), int64_t{0});
  if (total != T * dims_.top_k) {
    return absl::InternalError(absl::StrCat("MoE routing: expert row counts add up to ", total, ", expected ", T,
                                            " tokens x top-", dims_.top_k));
  }
  return absl::OkStatus();
}

absl::Status CudaMoeBlock::ExpertsForward(const bf16* w, const bf16* xn, int64_t T, const MoeSaved& r,
                                          const std::vector<int64_t>& counts, bf16* xg, bf16* gu, bf16* act, bf16* eo,
                                          cudaStream_t stream) const {
  if (dims_.gpt_oss) return GptOssExpertsForward(w, xn, T, r, counts, xg, gu, act, eo, stream);
  const int64_t E = dims_.num_experts, H = dims_.hidden, I = dims_.intermediate, R = T * dims_.top_k;
  RETURN_IF_ERROR(kernels::MoeGatherRows(xn, r.token_index, R, H, xg, stream));
  int64_t r0 = 0;
  for (int64_t e = 0; e < E; r0 += counts[e], ++e) {  // gu = xg · [Wg;Wu]ᵀ over the expert's rows
    const int64_t n = counts[e];
    if (n == 0) continue;
    const bf16* x = xg + r0 * H;
    bf16* y = gu + r0 * 2 * I;
    if (gate_up_contiguous_) {
      RETURN_IF_ERROR(Linear(x, H, w + offs_.gate_at(e), n, H, 2 * I, y, 2 * I, stream));
    } else {
      RETURN_IF_ERROR(Linear(x, H, w + offs_.gate_at(e), n, H, I, y, 2 * I, stream));
      RETURN_IF_ERROR(Linear(x, H, w + offs_.up_at(e), n, H, I, y + I, 2 * I, stream));
    }
  }
  RETURN_IF_ERROR(kernels::SwiGluForward(gu, R, I, act, stream));
  r0 = 0;
  for (int64_t e = 0; e < E; r0 += counts[e], ++e) {  // eo = act · Wdᵀ
    const int64_t n = counts[e];
    if (n == 0) continue;
    RETURN_IF_ERROR(Linear(act + r0 * I, I, w + offs_.down_at(e), n, I, H, eo + r0 * H, H, stream));
  }
  return absl::OkStatus();
}

absl::Status CudaMoeBlock::GptOssExpertsForward(const bf16* w, const bf16* xn, int64_t T, const MoeSaved& r,
                                                const std::vector<int64_t>& counts, bf16* xg, bf16* gu, bf16* act,
                                                bf16* eo, cudaStream_t stream) const {
  const int64_t E = dims_.num_experts, H = dims_.hidden, I = dims_.intermediate, R = T * dims_.top_k;
  RETURN_IF_ERROR(kernels::MoeGatherRows(xn, r.token_index, R, H, xg, stream));
  int64_t r0 = 0;
  for (int64_t e = 0; e < E; r0 += counts[e], ++e) {  // gu = xg · Wgu, its bias not yet added
    const int64_t n = counts[e];
    if (n == 0) continue;
    RETURN_IF_ERROR(MatMul(xg + r0 * H, H, w + offs_.gate_at(e), n, H, 2 * I, gu + r0 * 2 * I, 2 * I, stream));
  }
  RETURN_IF_ERROR(GptOssActivations(w, gu, counts, act, stream));
  r0 = 0;
  for (int64_t e = 0; e < E; r0 += counts[e], ++e) {  // eo = act · Wd, its bias not yet added
    const int64_t n = counts[e];
    if (n == 0) continue;
    RETURN_IF_ERROR(MatMul(act + r0 * I, I, w + offs_.down_at(e), n, I, H, eo + r0 * H, H, stream));
  }
  return absl::OkStatus();
}

absl::Status CudaMoeBlock::GptOssActivations(const bf16* w, const bf16* gu, const std::vector<int64_t>& counts,
                                             bf16* act, cudaStream_t stream) const {
  const int64_t I = dims_.intermediate;
  int64_t r0 = 0;
  for (int64_t e = 0; e < dims_.num_experts; r0 += counts[e], ++e) {
    if (counts[e] == 0) continue;
    RETURN_IF_ERROR(kernels::GptOssGluForward(gu + r0 * 2 * I, w + offs_.gate_up_bias_at(e), counts[e], I, glu_,
                                              act + r0 * I, stream));
  }
  return absl::OkStatus();
}

// ---- Forward and backward.

absl::Status CudaMoeBlock::Forward(const bf16_t* params, const bf16* xn, int64_t T, float* out, MoeSaved* saved,
                                   const MoeRouterStatsOut& stats, std::vector<int64_t>* expert_counts,
                                   cudaStream_t stream) const {
  const int64_t E = dims_.num_experts, k = dims_.top_k, H = dims_.hidden, I = dims_.intermediate, R = T * k;
  if (T < 0) return absl::InvalidArgumentError(absl::StrCat("MoE forward: ", T, " tokens"));
  if (saved != nullptr && saved->num_tokens != T) {
    return absl::InvalidArgumentError(
        absl::StrCat("MoE forward: saved state laid out for ", saved->num_tokens, " tokens, forward has ", T));
  }
  const MoeKeep keep = saved != nullptr ? saved->keep : MoeKeep::kNothing;
  if (T == 0) {
    if (stats.expert_counts != nullptr) {
      SLIDEDP_CUDA_RETURN_IF_ERROR(cudaMemsetAsync(stats.expert_counts, 0, E * sizeof(int32_t), stream));
    }
    if (stats.prob_sums != nullptr) {
      SLIDEDP_CUDA_RETURN_IF_ERROR(cudaMemsetAsync(stats.prob_sums, 0, E * sizeof(double), stream));
    }
    if (saved != nullptr) saved->expert_counts.assign(E, 0);
    if (expert_counts != nullptr) expert_counts->assign(E, 0);
    return absl::OkStatus();
  }

  // The pieces `saved` keeps are written in place; the others, and the passes' scratch, go to `block`.
  MoeSaved v = saved != nullptr ? *saved : MoeSaved();
  Carver c;
  PoolBlock block;
  if (keep == MoeKeep::kNothing) ReserveRouting(T, c, &v);
  if (keep != MoeKeep::kAll) ReserveExperts(T, c, &v);
  RouteScratch rs;
  ReserveRouteScratch(T, c, &rs);
  double* prob_sums_ws = nullptr;
  if (stats.prob_sums != nullptr) c.Reserve(&prob_sums_ws, kernels::MoeProbSumsWorkspaceNumel(T, E));
  bf16 *xg, *act;
  c.Reserve(&xg, R * H);
  c.Reserve(&act, R * I);
  RETURN_IF_ERROR(c.Alloc(block, stream));

  const bf16* w = AsBf16(params);
  RETURN_IF_ERROR(Route(w, xn, T, v, rs, stream));
  if (stats.prob_sums != nullptr) {
    RETURN_IF_ERROR(kernels::MoeProbSums(v.probs, T, E, prob_sums_ws, stats.prob_sums, stream));
  }
  if (stats.expert_counts != nullptr) {
    SLIDEDP_CUDA_RETURN_IF_ERROR(
        cudaMemcpyAsync(stats.expert_counts, rs.counts, E * sizeof(int32_t), cudaMemcpyDeviceToDevice, stream));
  }
  std::vector<int64_t> counts;
  RETURN_IF_ERROR(DownloadCounts(rs.counts, T, &counts, stream));
  RETURN_IF_ERROR(ExpertsForward(w, xn, T, v, counts, xg, v.gu, act, v.expert_out, stream));
  if (dims_.gpt_oss) {
    RETURN_IF_ERROR(kernels::GptOssCombine(v.expert_out, v.row_of_slot, v.topk_expert, v.topk_weight,
                                           w + offs_.down_bias, offs_.down_expert_stride, T, k, H, out, stream));
  } else {
    RETURN_IF_ERROR(kernels::MoeCombine(v.expert_out, v.row_of_slot, v.topk_weight, T, k, H, out, stream));
  }
  if (saved != nullptr) saved->expert_counts = counts;
  if (expert_counts != nullptr) *expert_counts = std::move(counts);
  return absl::OkStatus();
}

absl::Status CudaMoeBlock::Backward(const bf16_t* params, const bf16* xn, int64_t T, const MoeSaved* saved,
                                    const float* dout, const double* aux_prob_grad, float* dxn, float* dparams,
                                    cudaStream_t stream) const {
  const int64_t E = dims_.num_experts, k = dims_.top_k, H = dims_.hidden, I = dims_.intermediate, R = T * k;
  if (T < 0) return absl::InvalidArgumentError(absl::StrCat("MoE backward: ", T, " tokens"));
  if (saved != nullptr && saved->num_tokens != T) {
    return absl::InvalidArgumentError(
        absl::StrCat("MoE backward: saved state holds ", saved->num_tokens, " tokens, backward has ", T));
  }
  const MoeKeep keep = saved != nullptr ? saved->keep : MoeKeep::kNothing;
  if (keep != MoeKeep::kNothing && static_cast<int64_t>(saved->expert_counts.size()) != E) {
    return absl::FailedPreconditionError("MoE backward: the saved state has no expert counts (no Forward into it)");
  }
  if (T == 0) return absl::OkStatus();

  MoeSaved v = saved != nullptr ? *saved : MoeSaved();
  Carver c;
  PoolBlock block;
  RouteScratch rs;
  if (keep == MoeKeep::kNothing) {
    ReserveRouting(T, c, &v);
    ReserveRouteScratch(T, c, &rs);
  }
  if (keep != MoeKeep::kAll) ReserveExperts(T, c, &v);
  bf16 *xg, *act, *d_eo, *dlogits, *dact, *dgu;
  float* dw;
  c.Reserve(&xg, R * H);
  c.Reserve(&act, R * I);
  c.Reserve(&d_eo, R * H);
  c.Reserve(&dw, R);
  c.Reserve(&dlogits, T * logits_ld_);
  c.Reserve(&dact, R * I);
  c.Reserve(&dgu, R * 2 * I);
  float *bias_ws = nullptr, *router_bias_ws = nullptr;
  if (dims_.gpt_oss) {
    c.Reserve(&bias_ws, kernels::GptOssBiasWorkspaceNumel(R, std::max(2 * I, H)));
    c.Reserve(&router_bias_ws, kernels::ColumnSumsWorkspaceNumel(T, E));
  }
  RETURN_IF_ERROR(c.Alloc(block, stream));

  const bf16* w = AsBf16(params);
  std::vector<int64_t> counts;
  if (keep == MoeKeep::kNothing) {
    RETURN_IF_ERROR(Route(w, xn, T, v, rs, stream));
    RETURN_IF_ERROR(DownloadCounts(rs.counts, T, &counts, stream));
  } else {
    counts = saved->expert_counts;
  }
  if (keep != MoeKeep::kAll) {
    RETURN_IF_ERROR(ExpertsForward(w, xn, T, v, counts, xg, v.gu, act, v.expert_out, stream));
  } else {  // the wgrads' operands: xn's grouped rows and the SwiGLU output, bit for bit the forward's
    RETURN_IF_ERROR(kernels::MoeGatherRows(xn, v.token_index, R, H, xg, stream));
    if (dims_.gpt_oss) {
      RETURN_IF_ERROR(GptOssActivations(w, v.gu, counts, act, stream));
    } else {
      RETURN_IF_ERROR(kernels::SwiGluForward(v.gu, R, I, act, stream));
    }
  }
  if (dims_.gpt_oss) {
    const GptOssBackwardScratch s{xg, act, d_eo, dw, dlogits, dact, dgu, bias_ws, router_bias_ws};
    return GptOssBackward(w, xn, T, v, counts, dout, aux_prob_grad, s, dxn, dparams, stream);
  }

  // Combine and router. dout is last read by the combine backward, so dxn may alias it.
  RETURN_IF_ERROR(kernels::MoeCombineBackward(dout, v.expert_out, v.token_index, v.slot_index, v.topk_weight, R, k, H,
                                              d_eo, dw, stream));
  RETURN_IF_ERROR(kernels::MoeRouterBackward(v.probs, v.topk_expert, v.topk_weight, dw, aux_prob_grad, T, E, k, norm_,
                                             dlogits, logits_ld_, stream));
  const bf16* wr = w + offs_.router;
  RETURN_IF_ERROR(LinearDgrad(dlogits, logits_ld_, wr, T, H, E, dxn, H, Dtype::kF32, 0.0f, stream));
  RETURN_IF_ERROR(LinearWgrad(dlogits, logits_ld_, xn, H, T, H, E, dparams + offs_.router, stream));

  // down_proj: d_act = d_eo · Wd, dWd += d_eoᵀ · act.
  int64_t r0 = 0;
  for (int64_t e = 0; e < E; r0 += counts[e], ++e) {
    const int64_t n = counts[e];
    if (n == 0) continue;
    const bf16* wd = w + offs_.down_at(e);
    RETURN_IF_ERROR(LinearDgrad(d_eo + r0 * H, H, wd, n, I, H, dact + r0 * I, I, Dtype::kBF16, 0.0f, stream));
    RETURN_IF_ERROR(LinearWgrad(d_eo + r0 * H, H, act + r0 * I, I, n, I, H, dparams + offs_.down_at(e), stream));
  }
  RETURN_IF_ERROR(kernels::SwiGluBackward(v.gu, dact, R, I, dgu, stream));

  // gate_proj / up_proj, expert by expert: dW[g;u] += d_guᵀ · xg, dxg = d_gu · [Wg;Wu] (FP32, one
  // expert's rows at a time), added into dxn's rows (distinct tokens within an expert) in ascending
  // expert order after the router's term, as the reference accumulates.
  PoolBlock dxg_block;
  RETURN_IF_ERROR(dxg_block.Alloc(Align256(MaxCount(counts) * H * static_cast<int64_t>(sizeof(float))), stream));
  float* dxg = reinterpret_cast<float*>(dxg_block.get());
  r0 = 0;
  for (int64_t e = 0; e < E; r0 += counts[e], ++e) {
    const int64_t n = counts[e];
    if (n == 0) continue;
    const bf16* dg = dgu + r0 * 2 * I;
    const bf16* x = xg + r0 * H;
    if (gate_up_contiguous_) {
      RETURN_IF_ERROR(LinearWgrad(dg, 2 * I, x, H, n, H, 2 * I, dparams + offs_.gate_at(e), stream));
      RETURN_IF_ERROR(LinearDgrad(dg, 2 * I, w + offs_.gate_at(e), n, H, 2 * I, dxg, H, Dtype::kF32, 0.0f, stream));
    } else {
      RETURN_IF_ERROR(LinearWgrad(dg, 2 * I, x, H, n, H, I, dparams + offs_.gate_at(e), stream));
      RETURN_IF_ERROR(LinearWgrad(dg + I, 2 * I, x, H, n, H, I, dparams + offs_.up_at(e), stream));
      RETURN_IF_ERROR(LinearDgrad(dg, 2 * I, w + offs_.gate_at(e), n, H, I, dxg, H, Dtype::kF32, 0.0f, stream));
      RETURN_IF_ERROR(LinearDgrad(dg + I, 2 * I, w + offs_.up_at(e), n, H, I, dxg, H, Dtype::kF32, 1.0f, stream));
    }
    RETURN_IF_ERROR(kernels::MoeScatterAddRows(dxg, v.token_index + r0, n, H, dxn, stream));
  }
  return absl::OkStatus();
}

absl::Status CudaMoeBlock::GptOssBackward(const bf16* w, const bf16* xn, int64_t T, const MoeSaved& v,
                                          const std::vector<int64_t>& counts, const float* dout,
                                          const double* aux_prob_grad, const GptOssBackwardScratch& s, float* dxn,
                                          float* dparams, cudaStream_t stream) const {
  const int64_t E = dims_.num_experts, k = dims_.top_k, H = dims_.hidden, I = dims_.intermediate, R = T * k;

  // Combine: d_eo, dw, and each expert's down bias gradient (the column sums of its FP32 dout * w
  // rows). These are the last reads of dout, so dxn may alias it.
  RETURN_IF_ERROR(kernels::GptOssCombineBackward(dout, v.expert_out, v.token_index, v.slot_index, v.topk_expert,
                                                 v.topk_weight, w + offs_.down_bias, offs_.down_expert_stride, R, k, H,
                                                 s.d_eo, s.dw, stream));
  int64_t r0 = 0;
  for (int64_t e = 0; e < E; r0 += counts[e], ++e) {
    if (counts[e] == 0) continue;
    RETURN_IF_ERROR(kernels::GptOssDownBiasBackward(dout, v.token_index + r0, v.slot_index + r0, v.topk_weight,
                                                    counts[e], k, H, s.bias_ws, dparams + offs_.down_bias_at(e),
                                                    stream));
  }

  // Router: dz (BF16), dxn = dz · Wr (FP32, the first term), dWr += dzᵀ · xn, dbr += column sums of dz.
  RETURN_IF_ERROR(kernels::GptOssRouterBackward(v.probs, v.topk_expert, v.topk_weight, s.dw, aux_prob_grad, T, E, k,
                                                s.dlogits, logits_ld_, stream));
  const bf16* wr = w + offs_.router;
  RETURN_IF_ERROR(LinearDgrad(s.dlogits, logits_ld_, wr, T, H, E, dxn, H, Dtype::kF32, 0.0f, stream));
  RETURN_IF_ERROR(LinearWgrad(s.dlogits, logits_ld_, xn, H, T, H, E, dparams + offs_.router, stream));
  RETURN_IF_ERROR(
      kernels::ColumnSumsInto(s.dlogits, T, E, logits_ld_, s.router_bias_ws, dparams + offs_.router_bias, stream));

  // Experts, one at a time: down_proj (d_act = d_eo · Wdᵀ, dWd += actᵀ · d_eo), the clamped SwiGLU's
  // backward with the gate_up bias gradient, gate_up_proj (dWgu += xgᵀ · d_gu, dxg = d_gu · Wguᵀ in
  // FP32) and dxg into dxn's rows (distinct tokens within an expert) in ascending expert order.
  PoolBlock dxg_block;
  RETURN_IF_ERROR(dxg_block.Alloc(Align256(MaxCount(counts) * H * static_cast<int64_t>(sizeof(float))), stream));
  float* dxg = reinterpret_cast<float*>(dxg_block.get());
  r0 = 0;
  for (int64_t e = 0; e < E; r0 += counts[e], ++e) {
    const int64_t n = counts[e];
    if (n == 0) continue;
    const bf16* d_eo = s.d_eo + r0 * H;
    bf16* dact = s.dact + r0 * I;
    bf16* dgu = s.dgu + r0 * 2 * I;
    RETURN_IF_ERROR(MatMulDgrad(d_eo, H, w + offs_.down_at(e), n, I, H, dact, I, Dtype::kBF16, stream));
    RETURN_IF_ERROR(MatMulWgrad(s.act + r0 * I, I, d_eo, H, n, I, H, dparams + offs_.down_at(e), stream));
    RETURN_IF_ERROR(kernels::GptOssGluBackward(v.gu + r0 * 2 * I, w + offs_.gate_up_bias_at(e), dact, n, I, glu_, dgu,
                                               s.bias_ws, dparams + offs_.gate_up_bias_at(e), stream));
    RETURN_IF_ERROR(MatMulWgrad(s.xg + r0 * H, H, dgu, 2 * I, n, H, 2 * I, dparams + offs_.gate_at(e), stream));
    RETURN_IF_ERROR(MatMulDgrad(dgu, 2 * I, w + offs_.gate_at(e), n, H, 2 * I, dxg, H, Dtype::kF32, stream));
    RETURN_IF_ERROR(kernels::MoeScatterAddRows(dxg, v.token_index + r0, n, H, dxn, stream));
  }
  return absl::OkStatus();
}

}  // namespace slidedp::cuda_backend_internal
