// CUDA implementation of ComputeBackend (worker/compute/backend.h): BF16 parameters and
// intermediates, an FP32 (default) or BF16 residual stream, FP32 accumulation, cuBLASLt GEMMs and
// the kernels in worker/kernels/.
//
// Temporaries and saved activations come from the device's stream-ordered memory pool
// (cudaMallocAsync on the compute stream, release threshold raised so memory stays cached), so
// ops never synchronize. Options below exist for tests and benchmarks.
#pragma once

#include <cstdint>
#include <memory>

#include "absl/status/statusor.h"
#include "worker/compute/backend.h"

namespace slidedp {

struct CudaBackendOptions {
  // Upper bound on the BF16 logits chunk [tokens_per_chunk, vocab] the fused head keeps at once.
  int64_t head_logits_budget_bytes = 1ll << 30;
  // Residual stream (embedding output, layer inputs/outputs, their gradients) in FP32, as HF
  // transformers keeps it under torch.autocast(bf16) with FP32 master weights: RMSNorms read FP32
  // and emit the BF16 GEMM input, o_proj / down_proj outputs are BF16 and added in FP32, residual
  // gradients accumulate in FP32. activation_dtype() is then kF32. false: the BF16 stream.
  // MakeCudaBackend takes SLIDEDP_CUDA_FP32_RESIDUAL (worker/debug/debug_switches.h).
  bool fp32_residual = true;
  // Fused attention: cuDNN's (worker/kernels/cudnn_attention.h; 2.5-3x our kernels on H200) or
  // our own kernels (worker/kernels/attention.h). kAuto takes cuDNN when libcudnn loads and its
  // engines accept the shapes, and our kernels otherwise (logged once). kCudnn fails Init when
  // libcudnn is unavailable. MakeCudaBackend takes SLIDEDP_ATTENTION=auto|cudnn|own.
  enum class Attention { kAuto, kCudnn, kOwn };
  Attention attention = Attention::kAuto;
  // Bitwise-repeatable backward: attention backward through our kernels with dQ added in a fixed
  // order (kernels::AttnArgs::ordered_dq; cuDNN 9.19's Hopper engines add it with atomics), the
  // forward as `attention` says. Every other kernel of the step is deterministic already.
  // MakeCudaBackend takes SLIDEDP_DETERMINISTIC=1 (a job's runtime.deterministic adds to it).
  bool deterministic = false;
  // A context-parallel share's cross attention on cuDNN (kernels::CudnnAttentionOptions::cross:
  // one dense entry per query piece of at least 32K queries) instead of the own kernels: 2.1x
  // forward, 2.7x backward at 128K tokens over 2 ranks (docs/gpu-results.md). MakeCudaBackend
  // takes SLIDEDP_CUDNN_CROSS=0 (the own kernels, for comparison).
  bool cudnn_cross_attention = true;
  // Sliding windows on cuDNN (CudnnAttentionOptions::window_mask: its left-bound mask, checked
  // against FP64 on an H100, docs/gpu-results.md row 114), else on the own kernels (which run
  // head_dim 256 on their slow path: Gemma 3 4B's compute-only step 5.4x slower). MakeCudaBackend
  // takes SLIDEDP_CUDNN_WINDOW=0 (the own kernels, for comparison).
  bool cudnn_window_mask = true;
  // MoE expert GEMMs planned per bucket of routed row counts (GemmArgs::varies); false plans every
  // distinct count (bench_kernels --moe measures the difference).
  bool gemm_row_buckets = true;
};

absl::StatusOr<std::unique_ptr<ComputeBackend>> MakeCudaBackendWithOptions(const ModelConfig& config, int device,
                                                                           const CudaBackendOptions& options);

}  // namespace slidedp
