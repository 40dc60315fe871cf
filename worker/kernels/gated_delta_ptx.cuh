// The PTX the gated delta rule kernels use (gated_delta.cu, gated_delta_backward.cu): the TF32
// tensor-core MMA, rounding to TF32 and the asynchronous global -> shared copies. Everything else
// in those kernels is plain CUDA C++; keeping the inline assembly in this one header lets a host
// emulation of the kernels (used while writing them without a GPU) swap it out.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace slidedp::kernels::gated_delta_internal {

// d += a b for one m16n8k8 tile: a is 16x8 row-major, b 8x8 column-major, TF32 inputs as 32-bit
// patterns, FP32 accumulators. Fragments (g = lane / 4, t = lane % 4): a = {(g, t), (g+8, t),
// (g, t+4), (g+8, t+4)}, b = {(t, g), (t+4, g)}, d = {(g, 2t), (g, 2t+1), (g+8, 2t), (g+8, 2t+1)}.
__device__ __forceinline__ void MmaTf32(float (&d)[4], const uint32_t (&a)[4], const uint32_t (&b)[2]) {
  asm volatile(
      "mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

// x rounded to TF32 (nearest, ties away from zero), as the bit pattern MmaTf32 reads.
__device__ __forceinline__ uint32_t ToTf32(float x) {
  uint32_t r;
  asm("cvt.rna.tf32.f32 %0, %1;\n" : "=r"(r) : "f"(x));
  return r;
}

// Asynchronous copies of 16 or 4 bytes to shared memory; with valid false the destination is
// zero-filled and nothing is read (src must still be a valid address expression).
__device__ __forceinline__ void CpAsync16(void* dst, const void* src, bool valid) {
  const uint32_t d = static_cast<uint32_t>(__cvta_generic_to_shared(dst));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(d), "l"(src), "r"(valid ? 16 : 0));
}
__device__ __forceinline__ void CpAsync4(void* dst, const void* src, bool valid) {
  const uint32_t d = static_cast<uint32_t>(__cvta_generic_to_shared(dst));
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(d), "l"(src), "r"(valid ? 4 : 0));
}
__device__ __forceinline__ void CpAsyncCommit() { asm volatile("cp.async.commit_group;\n" ::); }
// Waits until at most N of this thread's committed groups are pending (a barrier must follow
// before other threads read the data).
template <int N>
__device__ __forceinline__ void CpAsyncWait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}

}  // namespace slidedp::kernels::gated_delta_internal
