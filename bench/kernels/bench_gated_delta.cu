// Benchmark of the gated delta rule kernels (worker/kernels/gated_delta.h) at Qwen3.5's linear-attention
// heads (nk = 16, nv = 32, dk = dv = 128): forward and backward over T = 16384 and 65536 tokens, as one
// document and as 16 documents. Prints, per run, the median time (CUDA events, bench_harness.h's
// TimeMs), the chunked algorithm's matmul TFLOP/s and modelled DRAM GB/s, each also as a fraction of
// the nominal H100 SXM ceilings (989 TFLOP/s dense BF16, 3.35 TB/s HBM3), and one JSON line.
//
// FLOPs counted (2 per multiply-add; C = 64 tokens per chunk, per chunk and value head; the
// triangular inverse, the elementwise work and the TF32 split's extra passes are not counted):
//   forward:  C^2 (3 dk + 2 dv) + 3 C dk dv
//             (K K^T, T K, T V, Q K^T, P U; W S, K^T U, Q S)
//   backward: C^2 (11 dk + 5 dv) + 2 C^3 + 9 C dk dv
//             (the forward's prep and state recurrence again, local dU, the state backward,
//              the state gradients and the WY gradients)
// Bytes modelled: every tensor a kernel reads or writes, once per kernel that touches it (inputs,
// outputs and the FP32 workspace: W, U, dU, per-chunk states and dS), caches ignored.
//
// Usage: bench_gated_delta [--quick]   (--quick: T = 16384 only)
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <string>
#include <vector>

#include "bench/kernels/bench_harness.h"
#include "worker/kernels/gated_delta.h"

namespace slidedp::bench {
namespace {

constexpr double kPeakTflops = 989.0;  // H100 SXM dense BF16
constexpr double kPeakGbps = 3350.0;   // H100 SXM HBM3
constexpr int kChunk = 64;

struct Heads {
  int nk = 16, nv = 32, dk = 128, dv = 128;
};

// q and k rows L2-normalised per head, as the kernels expect (unnormalised keys make the WY
// inverse meaningless); one thread per (token, head) row.
__global__ void NormaliseRows(bf16* x, int64_t rows, int dim) {
  const int64_t r = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (r >= rows) return;
  bf16* p = x + r * dim;
  float ss = 0;
  for (int i = 0; i < dim; ++i) ss += __bfloat162float(p[i]) * __bfloat162float(p[i]);
  const float inv = rsqrtf(ss + 1e-6f);
  for (int i = 0; i < dim; ++i) p[i] = __float2bfloat16(__bfloat162float(p[i]) * inv);
}

// Uniform [-1, 1) values into realistic gates: g in [-3, -0.01] (log decay), beta in (0.01, 0.99).
__global__ void MakeGates(float* g, float* beta, int64_t n) {
  const int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (i >= n) return;
  g[i] = -0.01f - 1.495f * (g[i] + 1.0f);
  beta[i] = 0.5f + 0.49f * beta[i];
}

double ForwardFlops(int64_t chunks, const Heads& h) {
  const double C = kChunk, dk = h.dk, dv = h.dv;
  return 2.0 * chunks * h.nv * (C * C * (3 * dk + 2 * dv) + 3 * C * dk * dv);
}
double BackwardFlops(int64_t chunks, const Heads& h) {
  const double C = kChunk, dk = h.dk, dv = h.dv;
  return 2.0 * chunks * h.nv * (C * C * (11 * dk + 5 * dv) + 2 * C * C * C + 9 * C * dk * dv);
}

// Modelled bytes (see the file comment). T tokens, S = per-chunk state bytes of all heads.
double ForwardBytes(int64_t T, int64_t chunks, const Heads& h) {
  const double qk = 2.0 * T * h.nk * h.dk, v = 2.0 * T * h.nv * h.dv, gates = 4.0 * T * h.nv,
               w = 4.0 * T * h.nv * h.dk, u = 4.0 * T * h.nv * h.dv, s = 4.0 * chunks * h.nv * h.dk * h.dv;
  const double prep = qk + v + 2 * gates + w + u;
  const double state = w + u + qk + gates + u + s;
  const double out = 2 * qk + u + s + gates + v;
  return prep + state + out;
}
double BackwardBytes(int64_t T, int64_t chunks, const Heads& h) {
  const double qk = 2.0 * T * h.nk * h.dk, v = 2.0 * T * h.nv * h.dv, gates = 4.0 * T * h.nv,
               w = 4.0 * T * h.nv * h.dk, u = 4.0 * T * h.nv * h.dv, s = 4.0 * chunks * h.nv * h.dk * h.dv,
               dqk = 4.0 * T * h.nk * h.dk, dgam = 4.0 * T * h.nv * (h.dk / 64);
  const double recompute = (qk + v + 2 * gates + w + u) + (w + u + qk + gates + u + s);
  const double local = 2 * qk + v + gates + u;
  const double state_bwd = 2 * qk + w + v + u + gates + u + s;
  const double state_grad = 2 * qk + 2 * u + v + 2 * s + gates + 2 * dqk + w + dgam;
  const double wy = qk + v + 2 * u + w + 4 * gates + dgam + 2 * dqk;
  return recompute + local + state_bwd + state_grad + wy;
}

void Row(const char* dir, int64_t T, int docs, double ms, double flops, double bytes) {
  const double tflops = flops / ms / 1e9, gbps = bytes / ms / 1e6;
  std::printf("%-8s %7lld %5d %10.3f %9.1f %7.1f%% %9.1f %7.1f%%\n", dir, static_cast<long long>(T), docs, ms, tflops,
              100 * tflops / kPeakTflops, gbps, 100 * gbps / kPeakGbps);
  std::printf(
      "JSON {\"op\":\"gated_delta_%s\",\"tokens\":%lld,\"docs\":%d,\"ms\":%.4f,\"tflops\":%.2f,"
      "\"frac_of_989_tflops\":%.4f,\"gbps\":%.1f,\"frac_of_3350_gbps\":%.4f}\n",
      dir, static_cast<long long>(T), docs, ms, tflops, tflops / kPeakTflops, gbps, gbps / kPeakGbps);
}

void BenchOne(int64_t T, int docs, const Heads& h) {
  Arena ar;
  bf16* q = ar.Rand(T * h.nk * h.dk);
  bf16* k = ar.Rand(T * h.nk * h.dk);
  bf16* v = ar.Rand(T * h.nv * h.dv);
  bf16* d_o = ar.Rand(T * h.nv * h.dv);
  float* g = ar.RandF32(T * h.nv);
  float* beta = ar.RandF32(T * h.nv);
  NormaliseRows<<<static_cast<unsigned>((T * h.nk + 255) / 256), 256>>>(q, T * h.nk, h.dk);
  NormaliseRows<<<static_cast<unsigned>((T * h.nk + 255) / 256), 256>>>(k, T * h.nk, h.dk);
  MakeGates<<<static_cast<unsigned>((T * h.nv + 255) / 256), 256>>>(g, beta, T * h.nv);
  CUDA_CHECK(cudaGetLastError());
  std::vector<int32_t> cu(docs + 1);
  for (int d = 0; d <= docs; ++d) cu[d] = static_cast<int32_t>(T * d / docs);
  int32_t* cu_dev = ar.Get<int32_t>(docs + 1);
  CUDA_CHECK(cudaMemcpy(cu_dev, cu.data(), cu.size() * 4, cudaMemcpyHostToDevice));
  int64_t chunks = 0;
  for (int d = 0; d < docs; ++d) chunks += (cu[d + 1] - cu[d] + kChunk - 1) / kChunk;

  kernels::GatedDeltaArgs a;
  a.tokens = T;
  a.num_docs = docs;
  a.cu_seqlens = cu_dev;
  a.num_k_heads = h.nk;
  a.num_v_heads = h.nv;
  a.k_dim = h.dk;
  a.v_dim = h.dv;
  a.scale = 1.0f / std::sqrt(static_cast<float>(h.dk));
  const int64_t fwd_ws = kernels::GatedDeltaForwardWorkspaceBytes(a), bwd_ws = kernels::GatedDeltaBackwardWorkspaceBytes(a);
  unsigned char* ws = ar.Get<unsigned char>(std::max(fwd_ws, bwd_ws));
  bf16* o = ar.Get<bf16>(T * h.nv * h.dv);
  float* dq = ar.Get<float>(T * h.nk * h.dk);
  float* dk = ar.Get<float>(T * h.nk * h.dk);
  float* dv = ar.Get<float>(T * h.nv * h.dv);
  float* dg = ar.Get<float>(T * h.nv);
  float* dbeta = ar.Get<float>(T * h.nv);
  std::printf("# T=%lld docs=%d chunks=%lld workspace fwd %.2f GiB, bwd %.2f GiB\n", static_cast<long long>(T), docs,
              static_cast<long long>(chunks), fwd_ws / 1073741824.0, bwd_ws / 1073741824.0);
  const double fwd_ms =
      TimeMs([&] { BENCH_CHECK(kernels::GatedDeltaForward(a, q, k, v, g, beta, o, ws, nullptr)); });
  Row("forward", T, docs, fwd_ms, ForwardFlops(chunks, h), ForwardBytes(T, chunks, h));
  const double bwd_ms = TimeMs([&] {
    BENCH_CHECK(kernels::GatedDeltaBackward(a, q, k, v, g, beta, d_o, dq, dk, dv, dg, dbeta, ws, nullptr));
  });
  Row("backward", T, docs, bwd_ms, BackwardFlops(chunks, h), BackwardBytes(T, chunks, h));
}

}  // namespace
}  // namespace slidedp::bench

int main(int argc, char** argv) {
  using namespace slidedp::bench;
  cudaDeviceProp prop{};
  CUDA_CHECK(cudaGetDeviceProperties(&prop, 0));
  const bool quick = argc > 1 && std::string(argv[1]) == "--quick";
  const Heads h;
  std::printf("bench_gated_delta on %s, %d SMs: nk=%d nv=%d dk=%d dv=%d, ceilings 989 TFLOP/s, 3350 GB/s (H100 SXM)\n",
              prop.name, prop.multiProcessorCount, h.nk, h.nv, h.dk, h.dv);
  std::printf("%-8s %7s %5s %10s %9s %8s %9s %8s\n", "dir", "tokens", "docs", "ms", "TFLOP/s", "of989", "GB/s",
              "of3350");
  std::vector<int64_t> tokens = {16384, 65536};
  if (quick) tokens = {16384};
  for (int64_t T : tokens) {
    for (int docs : {1, 16}) BenchOne(T, docs, h);
  }
  return 0;
}
