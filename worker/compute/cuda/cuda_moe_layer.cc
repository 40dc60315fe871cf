// The CUDA backend's sparse decoder layer (qwen3_moe): attention as a dense layer's, the MoE block
// (CudaMoeBlock, cuda_moe.h) in place of the MLP, and the batch's routing record that the
// load-balancing loss and the expert token counts are formed from (docs/moe.md).
//
//   forward   AttentionInputs -> attention -> h1 = x + o·Woᵀ -> xn2 = RMSNorm(h1) -> out = MoE(xn2)
//             -> y = h1 + out (FP32)
//   backward  recompute what the policy did not keep -> MoE backward (dxn2, router and experts'
//             gradients, the aux loss's gradient through every probability) -> dh1 = dy +
//             RMSNorm2ᵀ(dxn2) -> o_proj backward -> attention backward -> QkvBackward (the dense
//             layer's)
//
// Kept pieces (ActPolicy): attention's and the cheap ones as a dense layer's; kPieceGateUp keeps
// the MoE block's routing and its experts' outputs (MoeKeep::kAll), any other policy recomputes
// the block from xn2 in backward (its routing again too, bit for bit: the same xn2). The layer runs
// untiled (runtime.tile_tokens does not apply to it), on the FP32 residual stream only (Init).
#include <cuda_runtime.h>

#include <algorithm>
#include <memory>
#include <optional>

#include "absl/strings/str_cat.h"
#include "common/status/status_macros.h"
#include "worker/compute/cpu/moe_reference_math.h"
#include "worker/compute/cuda/cuda_backend_impl.h"
#include "worker/compute/cuda/cuda_memory.h"
#include "worker/kernels/reductions.h"
#include "worker/kernels/rmsnorm.h"

namespace slidedp::cuda_backend_internal {

absl::StatusOr<MoeRouterStatsOut> CudaBackend::RouterRecord(const CudaBatch& b, int ordinal) {
  const int64_t E = config_.num_experts;
  if (b.router_counts_ == nullptr) {
    Carver c;
    c.Reserve(&b.router_counts_, num_sparse_ * E);
    c.Reserve(&b.router_sums_, num_sparse_ * E);
    c.Reserve(&b.aux_grad_, E);
    RETURN_IF_ERROR(c.Alloc(b.router_block_, stream_));
    b.host_counts_.assign(num_sparse_, std::vector<int64_t>());
  }
  return MoeRouterStatsOut{b.router_counts_ + ordinal * E, b.router_sums_ + ordinal * E};
}

absl::Status CudaBackend::SparseDecoderForward(const UnitParams& params, const CudaBatch& b, const void* x, void* y,
                                               ActPolicy policy, std::unique_ptr<SavedActivations>* saved,
                                               int ordinal) {
  const int64_t T = b.num_tokens_;
  const uint32_t kept_pieces = saved != nullptr ? policy.pieces : 0;
  const MoeKeep moe_keep = (kept_pieces & kPieceGateUp) ? MoeKeep::kAll : MoeKeep::kNothing;
  LayerActs acts;
  PoolBlock scratch;
  std::unique_ptr<CudaSaved> keep;
  bf16* branch = nullptr;  // o_proj's BF16 output before the FP32 residual add
  float* moe_out = nullptr;
  MoeSaved routing;  // SetRecordRouting without a kept routing: the block's top-k, in scratch
  {
    Carver kept, tmp;
    if (saved != nullptr) {
      keep = std::make_unique<CudaSaved>();
      keep->policy_ = policy;
      keep->num_tokens_ = T;
      ReserveActs(kept, keep->acts_, T, kept_pieces, T, /*inter=*/0);
      if (moe_keep != MoeKeep::kNothing) moe_->ReserveSaved(T, moe_keep, kept, &keep->moe_);
    }
    ReserveActs(tmp, acts, T, kAllPieces & ~kept_pieces, T, /*inter=*/0);
    tmp.Reserve(&branch, T * H_);
    tmp.Reserve(&moe_out, T * H_);
    if (record_routing_ && moe_keep == MoeKeep::kNothing) moe_->ReserveSaved(T, MoeKeep::kRouting, tmp, &routing);
    if (keep) {
      RETURN_IF_ERROR(keep->Allocate(kept, stream_));
      TakePieces(keep->acts_, kept_pieces, &acts);
    }
    RETURN_IF_ERROR(tmp.Alloc(scratch, stream_));
  }
  ASSIGN_OR_RETURN(const MoeRouterStatsOut record, RouterRecord(b, ordinal));
  RETURN_IF_ERROR(AttentionInputs(params, b, x, acts, 0, kept_pieces));
  RETURN_IF_ERROR(AttentionForward(params, b, acts));
  RETURN_IF_ERROR(ResidualGemm(acts.o, qd_, W(params.bf16, kOProj), x, acts.h1, branch, T, OBias(params)));  // h1 = x + o·Woᵀ
  RETURN_IF_ERROR(NormForward(acts.h1, Norm(params, kPostNorm), T, acts.xn2, acts.rstd2));
  MoeSaved* moe_state = moe_keep != MoeKeep::kNothing ? &keep->moe_ : record_routing_ ? &routing : nullptr;
  RETURN_IF_ERROR(
      moe_->Forward(params.bf16, acts.xn2, T, moe_out, moe_state, record, &b.host_counts_[ordinal], stream_));
  if (record_routing_) {
    b.host_topk_.resize(num_sparse_);
    b.host_topk_[ordinal].resize(T * config_.num_experts_per_tok);
    RETURN_IF_ERROR(CopyToHost(moe_state->topk_expert, b.host_topk_[ordinal].data(),
                               b.host_topk_[ordinal].size() * sizeof(int32_t)));
  }
  RETURN_IF_ERROR(
      kernels::AddF32(static_cast<const float*>(acts.h1), moe_out, T * H_, static_cast<float*>(y), stream_));
  if (saved != nullptr) *saved = std::move(keep);
  return absl::OkStatus();
}

absl::Status CudaBackend::SparseDecoderBackward(const UnitParams& params, const CudaBatch& b, const void* x,
                                                CudaSaved* saved, const void* dy, void* dx, float* dparams) {
  const int64_t T = b.num_tokens_;
  const ActPolicy policy = saved == nullptr ? ActPolicy::kRecomputeLayer : saved->policy_;
  const uint32_t kept = policy.pieces;
  PoolBlock sinks;
  ASSIGN_OR_RETURN(const kernels::AttnArgs attn, LayerAttn(params, b, sinks, dparams));

  Carver c;
  PoolBlock block;
  LayerActs acts;
  ReserveActs(c, acts, T, kAllPieces & ~kept, T, /*inter=*/0);
  bf16 *dattn_o, *dqr, *dkr, *dqkv, *branch, *dres_b;
  float *dxn, *ws_f;
  char* ws_attn;
  c.Reserve(&branch, T * H_);
  c.Reserve(&dres_b, T * H_);
  c.Reserve(&dxn, T * H_);
  c.Reserve(&dattn_o, T * qd_);
  c.Reserve(&dqr, T * qd_);
  c.Reserve(&dkr, T * kvd_);
  c.Reserve(&dqkv, T * qkv_);
  c.Reserve(&ws_f,
            std::max({kernels::RmsNormBackwardWorkspaceNumel(T, H_), kernels::QkNormRopeBackwardWorkspaceNumel(Rope(T)),
                      config_.has_qkv_bias() ? kernels::ColumnSumsWorkspaceNumel(T, qd_) : int64_t{0},
                      config_.has_o_bias() ? kernels::ColumnSumsWorkspaceNumel(T, H_) : int64_t{0}}));
  ASSIGN_OR_RETURN(const std::optional<int64_t> cudnn_ws, CudnnWorkspace(AttnDir::kBackward, attn));
  c.Reserve(&ws_attn, cudnn_ws.has_value() ? *cudnn_ws : kernels::FlashAttentionBackwardWorkspaceBytes(attn));
  RETURN_IF_ERROR(c.Alloc(block, stream_));
  if (saved != nullptr) TakePieces(saved->acts_, kept, &acts);

  // What the policy did not keep, recomputed: attention's inputs and output, h1, xn2.
  RETURN_IF_ERROR(AttentionInputs(params, b, x, acts, kept, kept));
  PoolBlock kv_block;  // a context-parallel share: the group's keys and values, once for both
  const bf16* kv = nullptr;
  RETURN_IF_ERROR(GatherContextKv(b, acts, kv_block, &kv));
  if (!policy.keeps(kPieceAttention)) RETURN_IF_ERROR(AttentionForward(params, b, acts, kv));
  if (!policy.keeps(kPieceOProj)) {
    RETURN_IF_ERROR(ResidualGemm(acts.o, qd_, W(params.bf16, kOProj), x, acts.h1, branch, T, OBias(params)));
  }
  if (!policy.keeps(kPieceCheap))
    RETURN_IF_ERROR(NormForward(acts.h1, Norm(params, kPostNorm), T, acts.xn2, acts.rstd2));

  // y = h1 + MoE(xn2): the block's backward (with the aux loss's gradient once RouterAuxLoss set it).
  const MoeSaved* moe_saved = saved != nullptr && saved->moe_.keep != MoeKeep::kNothing ? &saved->moe_ : nullptr;
  const double* aux_grad = b.aux_weight_ != 0 ? b.aux_grad_ : nullptr;
  RETURN_IF_ERROR(moe_->Backward(params.bf16, acts.xn2, T, moe_saved, static_cast<const float*>(dy), aux_grad, dxn,
                                 dparams, stream_));
  // dh1 = dy + RMSNorm2ᵀ(dxn), into dx (dy was last read above; dx may alias it).
  RETURN_IF_ERROR(
      NormBackward(dxn, acts.h1, Norm(params, kPostNorm), acts.rstd2, dy, T, dx, dparams + off_[kPostNorm], ws_f));
  // h1 = x + o·Woᵀ
  RETURN_IF_ERROR(ResidualBranchBackward(dx, T, W(params.bf16, kOProj), qd_, acts.o, dattn_o, dparams + off_[kOProj],
                                         dres_b, OBiasGrad(dparams), ws_f));
  RETURN_IF_ERROR(AttentionBackward(b, attn, cudnn_ws, acts, dattn_o, dqr, dkr, dqkv + VColumn(), ws_attn, kv));
  kv_block.Release();
  return QkvBackward(params, b, x, acts, kept, T, dqr, dkr, dqkv, dxn, ws_f, dx, dparams);
}

absl::Status CudaBackend::RouterAuxLoss(const DeviceBatch& batch, float weight, float share, float* loss_sum,
                                        float* aux_sum) {
  if (num_sparse_ == 0) return absl::OkStatus();
  const auto& b = static_cast<const CudaBatch&>(batch);
  if (loss_sum == nullptr || aux_sum == nullptr) return absl::InvalidArgumentError("RouterAuxLoss: null pointer");
  if (b.router_counts_ == nullptr ||
      std::any_of(b.host_counts_.begin(), b.host_counts_.end(), [](const auto& v) { return v.empty(); })) {
    return absl::FailedPreconditionError("RouterAuxLoss: the batch has not been through every sparse layer's forward");
  }
  // Small ([sparse layers, E]) and once per micro-batch: formed on the host in double, as the
  // reference does, and added to the device sums through the host.
  const int64_t E = config_.num_experts;
  std::vector<double> sums(num_sparse_ * E);
  RETURN_IF_ERROR(CopyToHost(b.router_sums_, sums.data(), sums.size() * sizeof(double)));
  std::vector<MoeRouterStats> layers(num_sparse_);
  for (int l = 0; l < num_sparse_; ++l) {
    layers[l].num_tokens = b.num_tokens_;
    layers[l].expert_counts = b.host_counts_[l];
    layers[l].prob_sums.assign(sums.begin() + l * E, sums.begin() + (l + 1) * E);
  }
  // A context-parallel share: the whole micro-batch's statistics (HF's one forward), summed over
  // the group in rank order; the loss counted once, by the group's rank 0, its gradient on every
  // rank's own tokens.
  if (b.context()) {
    const int ranks = b.context_ranks_;
    ASSIGN_OR_RETURN(layers, SumRouterStatsOverGroup(
                                 layers, E, ranks, [&](const uint64_t* local, int64_t words, uint64_t* all) {
                                   const int64_t bytes = words * static_cast<int64_t>(sizeof(uint64_t));
                                   if (!context_group_->device_collectives()) {
                                     return context_group_->AllGather(reinterpret_cast<const float*>(local), 2 * words,
                                                                      reinterpret_cast<float*>(all));
                                   }
                                   PoolBlock block;
                                   RETURN_IF_ERROR(block.Alloc(Align256(bytes) * (1 + ranks), stream_));
                                   char* on_device = block.get();
                                   RETURN_IF_ERROR(CopyToDevice(local, on_device, bytes));
                                   RETURN_IF_ERROR(ContextAllGather(on_device, bytes, on_device + Align256(bytes)));
                                   return CopyToHost(on_device + Align256(bytes), all, ranks * bytes);
                                 }));
  }
  const double aux = LoadBalancingLoss(layers);
  for (auto [sum, add] : {std::pair{loss_sum, weight * aux}, std::pair{aux_sum, share * aux}}) {
    if (b.context() && b.context_rank_ != 0) break;
    float v = 0;
    RETURN_IF_ERROR(CopyToHost(sum, &v, sizeof(float)));
    v += static_cast<float>(add);
    RETURN_IF_ERROR(CopyToDevice(&v, sum, sizeof(float)));
  }
  b.aux_weight_ = weight;
  if (weight != 0) {
    const std::vector<double> grad = LoadBalancingProbGrad(layers, weight);
    RETURN_IF_ERROR(CopyToDevice(grad.data(), b.aux_grad_, E * sizeof(double)));
  }
  return absl::OkStatus();
}

absl::Status CudaBackend::RoutedExperts(const DeviceBatch& batch, int ordinal, std::vector<int32_t>* topk) const {
  const auto& b = static_cast<const CudaBatch&>(batch);
  if (ordinal < 0 || ordinal >= static_cast<int>(b.host_topk_.size()) || b.host_topk_[ordinal].empty()) {
    return absl::FailedPreconditionError(absl::StrCat("RoutedExperts: no routing recorded for sparse layer ", ordinal));
  }
  *topk = b.host_topk_[ordinal];
  return absl::OkStatus();
}

absl::Status CudaBackend::AddExpertTokenCounts(const DeviceBatch& batch, int64_t* counts) {
  if (num_sparse_ == 0) return absl::OkStatus();
  const auto& b = static_cast<const CudaBatch&>(batch);
  if (counts == nullptr) return absl::InvalidArgumentError("AddExpertTokenCounts: null pointer");
  const int64_t E = config_.num_experts;
  for (int l = 0; l < num_sparse_; ++l) {
    if (l >= static_cast<int>(b.host_counts_.size()) || static_cast<int64_t>(b.host_counts_[l].size()) != E) {
      return absl::FailedPreconditionError("AddExpertTokenCounts: the batch has not been through the sparse layers");
    }
    for (int64_t e = 0; e < E; ++e) counts[l * E + e] += b.host_counts_[l][e];
  }
  return absl::OkStatus();
}

}  // namespace slidedp::cuda_backend_internal
