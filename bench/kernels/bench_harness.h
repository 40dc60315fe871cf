// The kernel benchmark's harness, shared by its families (bench_kernels_*.cu): checks that end the
// run on the first failure (a benchmark has nothing to recover), deterministic random fills, a
// device arena, CUDA-event timing, the ceilings measured in the same run and the rows it prints (a
// table row and a JSON line per measurement).
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "worker/compute/backend.h"
#include "worker/kernels/gemm.h"

namespace slidedp::bench {

using bf16 = __nv_bfloat16;  // as worker/kernels' headers name it

#define BENCH_CHECK(expr)                                                                                  \
  do {                                                                                                     \
    absl::Status s_ = (expr);                                                                              \
    if (!s_.ok()) {                                                                                        \
      std::fprintf(stderr, "error: %s -> %s (%s:%d)\n", #expr, s_.ToString().c_str(), __FILE__, __LINE__); \
      std::exit(1);                                                                                        \
    }                                                                                                      \
  } while (0)
#define CUDA_CHECK(expr)                                                                                    \
  do {                                                                                                      \
    cudaError_t e_ = (expr);                                                                                \
    if (e_ != cudaSuccess) {                                                                                \
      std::fprintf(stderr, "error: %s -> %s (%s:%d)\n", #expr, cudaGetErrorString(e_), __FILE__, __LINE__); \
      std::exit(1);                                                                                         \
    }                                                                                                       \
  } while (0)

// Deterministic pseudo-random values in [-scale, scale) (never zeros: zeros time faster), from
// `blocks` blocks of 256 threads on the default stream; the launch is not checked (the next
// checked call reports a failure). T: bf16 or float.
template <typename T>
void FillRandom(T* p, int64_t n, uint32_t seed, float scale, int blocks);

// Device buffers freed together. Rand* draw from one seed sequence per type (so a benchmark's data
// depends on the order of its draws alone).
struct Arena {
  std::vector<void*> ptrs;
  ~Arena() {
    for (void* p : ptrs) cudaFree(p);
  }
  template <typename T>
  T* Get(int64_t n) {
    void* p = nullptr;
    CUDA_CHECK(cudaMalloc(&p, std::max<int64_t>(n, 1) * sizeof(T)));
    ptrs.push_back(p);
    return static_cast<T*>(p);
  }
  bf16* Rand(int64_t n, float scale = 1.0f);
  float* RandF32(int64_t n, float scale = 1.0f);
  // A residual-stream activation in the backend's dtype (FP32 or BF16).
  void* RandAct(Dtype t, int64_t n, float scale = 1.0f);
  void* GetAct(Dtype t, int64_t n);

 private:
  template <typename T>
  T* RandOf(int64_t n, float scale, uint32_t seed);
};

// A GEMM D[m, n] = A B^T with these leading dimensions, GemmArgs' defaults for the rest (BF16 out,
// no C, beta 0, planned for exactly this shape).
GemmArgs MakeGemm(int64_t m, int64_t n, int64_t k, const void* a, int64_t lda, const void* b, int64_t ldb, void* d,
                  int64_t ldd);

// The median of `reps` CUDA-event-timed runs of fn after one warm-up.
double TimeMs(const std::function<void()>& fn, int reps = 5);

// One measurement's table row and JSON line; its fraction of the ceiling is by FLOPs where it has
// any, else by bytes (MeasureCeilings must have run).
void Emit(const std::string& op, const std::string& model, int64_t tokens, double ms, double flops, double bytes);

// The ceilings Emit compares against: a cuBLASLt BF16 GEMM (8192^3) and a device-to-device copy.
void MeasureCeilings(GemmRunner& gemm);

}  // namespace slidedp::bench
