// The gated delta rule, the core recurrence of Qwen3.5's linear-attention (Gated DeltaNet) layers,
// forward and backward, in the chunked form (WY representation, Yang et al. "Gated Delta Networks";
// flash-linear-attention's chunk_gated_delta_rule): the matrix work inside chunks of 64 tokens runs
// on tensor cores, an FP32 state is carried from chunk to chunk.
//
// Per value head h (key head kh = h / (nv / nk), as HF's repeat_interleave), per document (the state
// starts at zero at each document's first token and never crosses into the next one), per token t:
//   S = exp(g_t) S;   u_t = beta_t (v_t - S^T k_t);   S = S + k_t u_t^T;   o_t = S^T (scale q_t)
// with S a k_dim x v_dim FP32 matrix. q and k are expected L2-normalised per head (the caller's job).
//
// Layouts (row-major, tokens packed, documents given by cu_seqlens):
//   q, k [T, nk * dk] BF16;  v, o, d_o [T, nv * dv] BF16;  g, beta [T, nv] FP32 (g = log decay <= 0,
//   beta in (0, 1));  dq, dk [T, nk * dk], dv [T, nv * dv], dg, dbeta [T, nv] FP32.
// Every pointer must be 16-byte aligned, the workspace 256-byte aligned.
//
// The chunked algorithm, per chunk of C = 64 tokens (documents are chunked from their own first
// token; the last chunk of a document is partial), with gamma the in-chunk cumulative sum of g,
// E_ij = exp(gamma_i - gamma_j) k_i.k_j (j < i), T = (I + diag(beta) E)^-1, S_0 the state entering
// the chunk:
//   W = T diag(beta exp(gamma)) K,  U~ = T diag(beta) V          (chunk-local; "prep")
//   U = U~ - W S_0,  S_next = exp(gamma_last) S_0 + K^T diag(exp(gamma_last - gamma)) U   (sequential)
//   O = scale (diag(exp(gamma)) Q S_0 + (M o Q K^T) U),  M_ij = exp(gamma_i - gamma_j) (j <= i)
// The backward reruns the first two, then runs the chunk recurrence of dS backwards and forms the
// gradients chunk by chunk (derivation in docs/kernels.md, "Gated delta rule").
//
// Kernels (256-thread blocks; nc = chunks = sum over documents of ceil(len / 64) <= T/64 + num_docs;
// MFLOP per (chunk, value head) at dk = dv = 128, matmuls only):
//   chunk map    1 block: document -> chunk table from the device cu_seqlens (no host copy needed)
//   prep         nc x nv: K K^T, the 64x64 triangular inverse (FP32 forward substitution, ~0.1
//                MFLOP), W and U~; 3.1 MFLOP
//   state fwd    num_docs x nv x dv/32, each walking its document's chunks in order (the only
//                sequential part of the forward): W S and K^T U on a 32-column slice of S; 4.2
//                MFLOP over the slices; the next chunk's operands load (cp.async) during this one
//   output       nc x nv x dv/64: O from Q, K, U and S_0; 4.2 MFLOP
//   backward:    prep and state fwd again, then
//   local dU     nc x nv x dv/64: dU_local = scale (M o Q K^T)^T dO; 2.1 MFLOP
//   state bwd    num_docs x nv x dv/32, chunks in reverse: dU += diag(decay) K dH, and
//                dH_prev = exp(gamma_last) dH + scale Q^T diag(exp(gamma)) dO - W^T dU; 6.3 MFLOP
//   state grads  nc x nk x dk/64: dq, the state and attention parts of dk, dW, dgamma parts;
//                12.6 MFLOP
//   WY grads     nc x nk: E and T again, then dv, dbeta, the rest of dk, dgamma -> dg; 8.4 MFLOP
// So 11.5 MFLOP per (chunk, head) forward, 36.7 backward: linear in T; the sequential part is the
// longest document's chunk count of dependent steps.
//
// Precision: all products on TF32 tensor cores (mma.sync m16n8k8) with FP32 accumulation; BF16
// data are exact in TF32 (one MMA), FP32 operands (the state, the triangular inverse, U, dU, ...)
// are split into big + small TF32 parts (2 MMAs against BF16 data, 3 against FP32; ~2^-21 relative),
// the inverse is FP32 forward substitution, decays are exp of differences <= 0 (never overflow).
// Deterministic: no atomics; value heads sharing a key head are summed in a fixed order.
//
// Every launcher takes its tensors, sizes and an explicit stream, returns a Status (bad sizes are
// INVALID_ARGUMENT, launch failures INTERNAL) and never synchronizes.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "absl/status/status.h"

namespace slidedp::kernels {

using bf16 = __nv_bfloat16;

struct GatedDeltaArgs {
  int64_t tokens = 0;                   // T, all documents together (T >= 1; T = 0 does nothing)
  int num_docs = 0;                     // >= 1
  const int32_t* cu_seqlens = nullptr;  // device, num_docs + 1 entries: 0 = cu[0] <= cu[1] <= ... = T
  int num_k_heads = 0;                  // nk
  int num_v_heads = 0;                  // nv, a multiple of nk
  int k_dim = 0;                        // dk: 64 or 128
  int v_dim = 0;                        // dv: 64 or 128
  float scale = 0.0f;                   // multiplies q (1/sqrt(dk) for Qwen3.5)
};

// Workspace bytes (0 for sizes the launcher rejects; cu_seqlens is not read). Both grow linearly in T:
//   forward:  W and U [T, nv, dk|dv] FP32 + one FP32 state per chunk that is not a document's first
//             (<= T/64 of them) [nv, dk, dv] + the chunk map;
//   backward: the forward's + dU [T, nv, dv] + the dS states + dgamma parts [dk/64, T, nv].
// At T = 65536, nv = 32, dk = dv = 128 (1 or 16 documents): forward 4,294,984,448 bytes (4.00 GiB:
// W 1 GiB, U 1 GiB, states 2 GiB), backward 7,532,987,136 bytes (7.02 GiB: + dU 1 GiB, dS 2 GiB,
// dgamma 16 MiB). Both fit in one allocation next to a 64K-token step's activations.
int64_t GatedDeltaForwardWorkspaceBytes(const GatedDeltaArgs& args);
int64_t GatedDeltaBackwardWorkspaceBytes(const GatedDeltaArgs& args);

// o = the gated delta rule's output (BF16). Reads cu_seqlens on the device.
absl::Status GatedDeltaForward(const GatedDeltaArgs& args, const bf16* q, const bf16* k, const bf16* v,
                               const float* g, const float* beta, bf16* o, void* workspace, cudaStream_t stream);

// Gradients of sum(o * d_o) with respect to every input, all OVERWRITTEN (not accumulated); dq and
// dk sum the value heads that share a key head. Recomputes the forward's intermediates (the forward
// keeps nothing but o).
absl::Status GatedDeltaBackward(const GatedDeltaArgs& args, const bf16* q, const bf16* k, const bf16* v,
                                const float* g, const float* beta, const bf16* d_o, float* dq, float* dk, float* dv,
                                float* dg, float* dbeta, void* workspace, cudaStream_t stream);

}  // namespace slidedp::kernels
