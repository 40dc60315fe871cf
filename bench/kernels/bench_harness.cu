// The kernel benchmark's harness (bench_harness.h): fills, arena, timing, ceilings and rows.
#include "bench/kernels/bench_harness.h"

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <functional>
#include <string>
#include <vector>

namespace slidedp::bench {
namespace {

// Element i's value in [-1, 1) for `seed` (a multiplicative hash, then murmur's mixing).
__device__ inline float HashUniform(int64_t i, uint32_t seed) {
  uint32_t x = static_cast<uint32_t>(i) * 2654435761u ^ seed;
  x ^= x >> 13;
  x *= 0x5bd1e995u;
  x ^= x >> 15;
  return static_cast<float>(x & 0xffffff) / 16777216.0f * 2.0f - 1.0f;
}

__device__ inline void Store(bf16* p, float v) { *p = __float2bfloat16(v); }
__device__ inline void Store(float* p, float v) { *p = v; }

template <typename T>
__global__ void FillKernel(T* p, int64_t n, uint32_t seed, float scale) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    Store(p + i, HashUniform(i, seed) * scale);
  }
}

double g_peak_tflops = 0, g_copy_gbps = 0;

}  // namespace

template <typename T>
void FillRandom(T* p, int64_t n, uint32_t seed, float scale, int blocks) {
  FillKernel<<<blocks, 256>>>(p, n, seed, scale);
}
template void FillRandom<bf16>(bf16*, int64_t, uint32_t, float, int);
template void FillRandom<float>(float*, int64_t, uint32_t, float, int);

template <typename T>
T* Arena::RandOf(int64_t n, float scale, uint32_t seed) {
  T* p = Get<T>(n);
  FillRandom(p, n, seed, scale, 1024);
  CUDA_CHECK(cudaGetLastError());
  return p;
}

bf16* Arena::Rand(int64_t n, float scale) {
  static uint32_t seed = 1234;
  return RandOf<bf16>(n, scale, seed++);
}

float* Arena::RandF32(int64_t n, float scale) {
  static uint32_t seed = 4321;
  return RandOf<float>(n, scale, seed++);
}

void* Arena::RandAct(Dtype t, int64_t n, float scale) {
  return t == Dtype::kF32 ? static_cast<void*>(RandF32(n, scale)) : static_cast<void*>(Rand(n, scale));
}

void* Arena::GetAct(Dtype t, int64_t n) {
  return t == Dtype::kF32 ? static_cast<void*>(Get<float>(n)) : static_cast<void*>(Get<bf16>(n));
}

GemmArgs MakeGemm(int64_t m, int64_t n, int64_t k, const void* a, int64_t lda, const void* b, int64_t ldb, void* d,
                  int64_t ldd) {
  GemmArgs g;
  g.m = m;
  g.n = n;
  g.k = k;
  g.a = a;
  g.lda = lda;
  g.b = b;
  g.ldb = ldb;
  g.d = d;
  g.ldd = ldd;
  return g;
}

double TimeMs(const std::function<void()>& fn, int reps) {
  fn();  // warm-up (algorithm selection, module load)
  CUDA_CHECK(cudaDeviceSynchronize());
  cudaEvent_t a, b;
  cudaEventCreate(&a);
  cudaEventCreate(&b);
  std::vector<float> ts;
  for (int i = 0; i < reps; ++i) {
    cudaEventRecord(a);
    fn();
    cudaEventRecord(b);
    CUDA_CHECK(cudaEventSynchronize(b));
    float ms = 0;
    cudaEventElapsedTime(&ms, a, b);
    ts.push_back(ms);
  }
  cudaEventDestroy(a);
  cudaEventDestroy(b);
  std::sort(ts.begin(), ts.end());
  return ts[ts.size() / 2];
}

void Emit(const std::string& op, const std::string& model, int64_t tokens, double ms, double flops, double bytes) {
  const double tflops = flops > 0 ? flops / ms / 1e9 : 0;
  const double gbps = bytes > 0 ? bytes / ms / 1e6 : 0;
  const double frac = flops > 0 ? tflops / g_peak_tflops : gbps / g_copy_gbps;
  std::printf("%-26s %-10s %7lld %10.3f %9.1f %9.1f %7.1f%%\n", op.c_str(), model.c_str(),
              static_cast<long long>(tokens), ms, tflops, gbps, 100 * frac);
  std::printf(
      "JSON {\"op\":\"%s\",\"model\":\"%s\",\"tokens\":%lld,\"ms\":%.4f,\"tflops\":%.2f,\"gbps\":%.1f,"
      "\"frac_of_ceiling\":%.4f}\n",
      op.c_str(), model.c_str(), static_cast<long long>(tokens), ms, tflops, gbps, frac);
}

void MeasureCeilings(GemmRunner& gemm) {
  Arena ar;
  const int64_t n = 8192;
  bf16* a = ar.Rand(n * n);
  bf16* b = ar.Rand(n * n);
  bf16* d = ar.Get<bf16>(n * n);
  const GemmArgs g = MakeGemm(n, n, n, a, n, b, n, d, n);
  double ms = TimeMs([&] { BENCH_CHECK(gemm.Run(g, nullptr)); }, 10);
  g_peak_tflops = 2.0 * n * n * n / ms / 1e9;
  const int64_t bytes = 2ll << 30;
  char* src = ar.Get<char>(bytes);
  char* dst = ar.Get<char>(bytes);
  CUDA_CHECK(cudaMemset(src, 1, bytes));
  ms = TimeMs([&] { CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice)); }, 10);
  g_copy_gbps = 2.0 * bytes / ms / 1e6;
  std::printf("ceilings: cuBLASLt bf16 GEMM 8192^3 = %.1f TFLOP/s; D2D copy = %.1f GB/s (read+write)\n", g_peak_tflops,
              g_copy_gbps);
  std::printf(
      "JSON {\"op\":\"ceiling_gemm_bf16_8192\",\"tflops\":%.2f}\nJSON {\"op\":\"ceiling_copy_d2d\",\"gbps\":%.1f}\n",
      g_peak_tflops, g_copy_gbps);
}

}  // namespace slidedp::bench
