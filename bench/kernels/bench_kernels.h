// The kernel benchmark's families, one file each, as bench_kernels.cu's main runs them: the per-op
// rows at a model's shapes (BenchOps: GEMMs, memory-bound ops, attention, embedding), cuDNN's and
// the own attention alone, and whole layers and the head through the CUDA backend.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "bench/kernels/bench_harness.h"
#include "common/model/model_config.h"
#include "worker/kernels/cudnn_attention.h"
#include "worker/kernels/gemm.h"

namespace slidedp::bench {

// BenchOps' operands at one (model, T), shared by its families: activations [T, hidden], one weight
// as large as the largest projection (and its FP32 gradient), scratch rows as wide as gate_up and
// the RMSNorm's statistics, workspace and weight gradient.
struct OpOperands {
  bf16 *x, *y, *dy, *w;
  float* dw;
  bf16 *big, *big2, *mid;
  float *rstd, *ws, *dwv;
};

// cuDNN's fused attention (attn_*_causal_cudnn rows, --attn, --attn-cross); null when libcudnn is
// unavailable.
extern kernels::CudnnAttention* g_cudnn;

// bench_kernels_gemm.cu: each projection's forward, dgrad and wgrad GEMM.
void BenchGemms(GemmRunner& gemm, const std::string& model, const ModelConfig& c, int64_t T, const OpOperands& o);

// bench_kernels_memory_bound.cu: RMSNorm, QK-norm + RoPE, SwiGLU and the embedding, against the
// copy ceiling.
void BenchNormRopeSwiGlu(Arena& ar, const std::string& model, const ModelConfig& c, int64_t T, const OpOperands& o);
void BenchEmbedding(Arena& ar, const std::string& model, const ModelConfig& c, int64_t T, const OpOperands& o);

// bench_kernels_attention.cu: one causal document of T tokens, own kernels and cuDNN (BenchOps'
// rows); --attn (BenchAttention) and --attn-cross (BenchCrossAttention).
void BenchCausalAttention(Arena& ar, const std::string& model, const ModelConfig& c, int64_t T, const OpOperands& o);
void BenchAttention(const std::vector<int64_t>& lengths, int engines);
void BenchCrossAttention(const std::vector<int64_t>& lengths, int ranks);

// bench_kernels_layer.cu: a decoder layer forward + backward per activation policy, the fused LM head
// + loss against the unfused one, and a MoE preset's sparse layer (--moe).
void BenchLayer(const ModelConfig& c, int64_t T, int64_t doc_len, bool fp32_residual, int64_t tile_tokens = 0);
void BenchHead(const ModelConfig& c, int64_t T);
void BenchMoe(const std::string& preset, int64_t T);

}  // namespace slidedp::bench
