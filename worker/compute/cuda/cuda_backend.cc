// CUDA ComputeBackend (cuda_backend.h): micro-batch upload, the embedding, the saved-activation
// sizes and the factories. The backend object is in cuda_backend_impl.h, the decoder layer and head
// math (the numerics) in cuda_layer_math.cc.
#include "worker/compute/cuda/cuda_backend.h"

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdlib>
#include <limits>
#include <memory>
#include <numeric>
#include <optional>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/data/context_parallel.h"
#include "common/policy/layer_policy.h"
#include "common/status/status_macros.h"
#include "glog/logging.h"
#include "worker/compute/cuda/cuda_backend_impl.h"
#include "worker/compute/cuda/cuda_memory.h"
#include "worker/debug/debug_switches.h"
#include "worker/kernels/cuda_check.h"
#include "worker/kernels/embedding.h"
#include "worker/kernels/reductions.h"

namespace slidedp {
namespace cuda_backend_internal {

absl::StatusOr<std::unique_ptr<DeviceBatch>> CudaBackend::UploadBatch(const MicroBatch& mb) {
  const int64_t T = mb.num_tokens();
  // A context-parallel share: its pieces' key ranges and the gather's row maps (validated there).
  std::optional<data::ContextAttention> ctx;
  if (mb.context.ranks != 1) {
    if (context_group_ == nullptr) {
      return absl::FailedPreconditionError(
          "micro-batch is a context-parallel share, and the backend has no context group");
    }
    if (context_group_->ranks() != mb.context.ranks) {
      return absl::InvalidArgumentError(absl::StrCat("micro-batch context: ", mb.context.ranks,
                                                     " ranks, the backend's group has ", context_group_->ranks()));
    }
    ASSIGN_OR_RETURN(ctx, data::ContextAttentionOf(mb));
  }
  if (mb.labels.size() != mb.tokens.size() || mb.positions.size() != mb.tokens.size()) {
    return absl::InvalidArgumentError(absl::StrCat("micro-batch: ", mb.tokens.size(), " tokens but ", mb.labels.size(),
                                                   " labels and ", mb.positions.size(), " positions"));
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
      return absl::InvalidArgumentError(
          absl::StrCat("micro-batch: token ", mb.tokens[t], " at ", t, " outside [0, ", V, ")"));
    }
    if (mb.labels[t] != kIgnoreIndex && (mb.labels[t] < 0 || mb.labels[t] >= V)) {
      return absl::InvalidArgumentError(
          absl::StrCat("micro-batch: label ", mb.labels[t], " at ", t, " outside [0, ", V, ")"));
    }
    if (mb.positions[t] < 0) return absl::InvalidArgumentError(absl::StrCat("micro-batch: negative position at ", t));
  }
  // The embedding's ids: gemma4 embeds a multimodal model's image / video / audio placeholders as
  // pad_token_id in both its tables (Gemma4Model), so they take the pad row and give it no gradient.
  const std::vector<int32_t> ids =
      config_.is_gemma4() ? Gemma4EmbeddingTokens(config_, mb.tokens.data(), T) : mb.tokens;
  // Group positions by token id (stable) for the atomic-free embedding backward, leaving out
  // pad_token_id's (HF's nn.Embedding(padding_idx) gives that row no gradient).
  std::vector<int32_t> order(T);
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](int32_t a, int32_t b) { return ids[a] < ids[b]; });
  if (config_.pad_token_id >= 0) {
    std::erase_if(order, [&](int32_t p) { return ids[p] == config_.pad_token_id; });
  }
  const int64_t grouped = static_cast<int64_t>(order.size());
  std::vector<int32_t> uniq, seg;
  for (int64_t i = 0; i < grouped; ++i) {
    if (i == 0 || ids[order[i]] != ids[order[i - 1]]) {
      uniq.push_back(ids[order[i]]);
      seg.push_back(static_cast<int32_t>(i));
    }
  }
  seg.push_back(static_cast<int32_t>(grouped));

  auto b = std::make_unique<CudaBatch>();
  b->num_tokens_ = T;
  b->num_docs_ = static_cast<int>(mb.cu_seqlens.size()) - 1;
  b->max_seqlen_ = max_len;
  b->num_unique_ = static_cast<int64_t>(uniq.size());
  b->host_cu_seqlens_ = mb.cu_seqlens;
  Carver c;
  c.Reserve(&b->tokens_, T);
  c.Reserve(&b->labels_, T);
  c.Reserve(&b->positions_, T);
  c.Reserve(&b->cu_seqlens_, static_cast<int64_t>(mb.cu_seqlens.size()));
  c.Reserve(&b->uniq_tokens_, static_cast<int64_t>(uniq.size()));
  c.Reserve(&b->seg_offsets_, static_cast<int64_t>(seg.size()));
  c.Reserve(&b->sorted_pos_, T);
  std::vector<int32_t> gathered_row;
  if (ctx) {
    b->context_ranks_ = mb.context.ranks;
    b->context_rank_ = mb.context.rank;
    b->context_part_ = mb.context.part;
    b->context_tokens_ = static_cast<int64_t>(mb.context.gathered_position.size());
    b->max_keys_ = ctx->max_keys;
    gathered_row.assign(mb.context.gathered_position.begin(), mb.context.gathered_position.end());
    b->host_kv_bounds_ = ctx->kv_bounds;
    c.Reserve(&b->kv_bounds_, static_cast<int64_t>(ctx->kv_bounds.size()));
    c.Reserve(&b->gathered_row_, b->context_tokens_);
    c.Reserve(&b->gather_rows_, static_cast<int64_t>(ctx->gather_rows.size()));
  }
  RETURN_IF_ERROR(c.Alloc(b->block_, stream_));
  auto up = [&](int32_t* dst, const std::vector<int32_t>& src) -> absl::Status {
    if (src.empty()) return absl::OkStatus();
    SLIDEDP_CUDA_RETURN_IF_ERROR(
        cudaMemcpyAsync(dst, src.data(), src.size() * sizeof(int32_t), cudaMemcpyHostToDevice, stream_));
    return absl::OkStatus();
  };
  RETURN_IF_ERROR(up(b->tokens_, ids));
  RETURN_IF_ERROR(up(b->labels_, mb.labels));
  RETURN_IF_ERROR(up(b->positions_, mb.positions));
  RETURN_IF_ERROR(up(b->cu_seqlens_, mb.cu_seqlens));
  RETURN_IF_ERROR(up(b->uniq_tokens_, uniq));
  RETURN_IF_ERROR(up(b->seg_offsets_, seg));
  RETURN_IF_ERROR(up(b->sorted_pos_, order));
  if (ctx) {
    RETURN_IF_ERROR(up(b->kv_bounds_, ctx->kv_bounds));
    RETURN_IF_ERROR(up(b->gathered_row_, gathered_row));
    RETURN_IF_ERROR(up(b->gather_rows_, ctx->gather_rows));
  }
  // Host vectors die at return: wait for the (pageable) copies.
  SLIDEDP_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(stream_));
  return std::unique_ptr<DeviceBatch>(std::move(b));
}

absl::Status CudaBackend::ConvertActivations(const void* src, Dtype from, void* dst, Dtype to, int64_t n) {
  if (n < 0) return absl::InvalidArgumentError(absl::StrCat("ConvertActivations: negative count ", n));
  if (n == 0) return absl::OkStatus();
  if (src == nullptr || dst == nullptr) return absl::InvalidArgumentError("ConvertActivations: null pointer");
  if (from == to) {
    SLIDEDP_CUDA_RETURN_IF_ERROR(
        cudaMemcpyAsync(dst, src, static_cast<size_t>(n * DtypeBytes(from)), cudaMemcpyDeviceToDevice, stream_));
    return absl::OkStatus();
  }
  if (from == Dtype::kF32) {
    // The exact cast (FloatToBf16 bit for bit, as the CPU backend rounds), on as many blocks as it
    // wants: nothing else runs on the compute stream meanwhile.
    return kernels::CastF32ToBf16Exact(static_cast<const float*>(src), n, static_cast<bf16*>(dst),
                                       std::numeric_limits<int>::max(), stream_);
  }
  return kernels::WidenBf16ToF32(static_cast<const bf16*>(src), n, static_cast<float*>(dst), stream_);
}

absl::Status CudaBackend::EmbeddingForward(const UnitParams& embed, const DeviceBatch& batch, void* out) {
  const auto& b = static_cast<const CudaBatch&>(batch);
  auto lookup = [&](const auto* table) {
    return f32() ? kernels::EmbeddingForward(table, b.tokens_, b.num_tokens_, H_, static_cast<float*>(out), stream_,
                                             embed_scale_)
                 : kernels::EmbeddingForward(table, b.tokens_, b.num_tokens_, H_, static_cast<bf16*>(out), stream_,
                                             embed_scale_);
  };
  RETURN_IF_ERROR(embed.fp32 != nullptr ? lookup(embed.fp32) : lookup(reinterpret_cast<const bf16*>(embed.bf16)));
  // gemma4: its per-layer table too, and the batch's state from here (cuda_gemma4_layer.cc).
  if (config_.is_gemma4()) return Gemma4EmbeddingForward(embed, b);
  return absl::OkStatus();
}

absl::Status CudaBackend::EmbeddingBackward(const void* dout, const DeviceBatch& batch, float* dembed) {
  const auto& b = static_cast<const CudaBatch&>(batch);
  if (config_.is_gemma4()) {  // FP32 stream only (Init); its per-layer table's gradient too
    RETURN_IF_ERROR(kernels::EmbeddingBackward(static_cast<const float*>(dout), b.uniq_tokens_, b.seg_offsets_,
                                               b.sorted_pos_, b.num_unique_, H_, dembed, stream_, embed_scale_));
    return Gemma4EmbeddingBackward(b, dembed);
  }
  if (f32()) {
    return kernels::EmbeddingBackward(static_cast<const float*>(dout), b.uniq_tokens_, b.seg_offsets_, b.sorted_pos_,
                                      b.num_unique_, H_, dembed, stream_, embed_scale_);
  }
  return kernels::EmbeddingBackward(static_cast<const bf16*>(dout), b.uniq_tokens_, b.seg_offsets_, b.sorted_pos_,
                                    b.num_unique_, H_, dembed, stream_, embed_scale_);
}

int64_t CudaBackend::SavedBytesPerToken(ActPolicy policy) const {
  // qwen3_5's layers (and gemma3's and gemma4's: LayersKeepNothing) keep nothing under any policy:
  // backward recomputes them from the layer input, so the activation store moves only their inputs.
  if (config_.is_qwen3_5() || LayersKeepNothing()) return 0;
  const int64_t low_half = KeepsOutputLowHalf() && (policy.pieces & kPieceAttention) ? 2 * qd_ : 0;  // o_lo
  return CudaKeptBytesPerToken(ModelShape::Of(config_), policy.pieces, act_bytes()) + low_half;
}

}  // namespace cuda_backend_internal

using cuda_backend_internal::CudaBackend;

absl::StatusOr<std::unique_ptr<ComputeBackend>> MakeCudaBackendWithOptions(const ModelConfig& config, int device,
                                                                           const CudaBackendOptions& options) {
  auto backend = std::make_unique<CudaBackend>(config, device, options);
  RETURN_IF_ERROR(backend->Init());
  return std::unique_ptr<ComputeBackend>(std::move(backend));
}

absl::StatusOr<std::unique_ptr<ComputeBackend>> MakeCudaBackend(const ModelConfig& config, int device) {
  // The debug and comparison switches (SLIDEDP_CUDA_FP32_RESIDUAL, SLIDEDP_ATTENTION,
  // SLIDEDP_DETERMINISTIC, SLIDEDP_CUDNN_CROSS, SLIDEDP_CUDNN_WINDOW: docs/environment.md), read once
  // per process.
  const absl::StatusOr<DebugSwitches>& switches = ProcessDebugSwitches();
  RETURN_IF_ERROR(switches.status());
  CudaBackendOptions options;
  options.fp32_residual = switches->cuda_fp32_residual;
  switch (switches->attention) {
    case DebugSwitches::Attention::kAuto: options.attention = CudaBackendOptions::Attention::kAuto; break;
    case DebugSwitches::Attention::kCudnn: options.attention = CudaBackendOptions::Attention::kCudnn; break;
    case DebugSwitches::Attention::kOwn: options.attention = CudaBackendOptions::Attention::kOwn; break;
  }
  options.deterministic = switches->deterministic;
  options.cudnn_cross_attention = switches->cudnn_cross_attention;
  options.cudnn_window_mask = switches->cudnn_window;
  auto backend = std::make_unique<CudaBackend>(config, device, options);
  RETURN_IF_ERROR(backend->Init());
  LOG(INFO) << "CUDA backend on GPU " << device << ": " << (options.fp32_residual ? "FP32" : "BF16")
            << " residual stream, attention " << backend->attention_impl()
            << (options.deterministic ? ", deterministic (attention backward: own kernels, ordered dQ)" : "");
  return std::unique_ptr<ComputeBackend>(std::move(backend));
}

}  // namespace slidedp
