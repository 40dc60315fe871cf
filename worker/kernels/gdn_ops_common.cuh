// Shared by the Gated DeltaNet token-local ops' files (gdn_ops.cu, gdn_conv.cu): vector access of V
// consecutive elements and the launchers' host checks.
#pragma once

#include <cstdint>
#include <initializer_list>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "worker/kernels/common.cuh"
#include "worker/kernels/gdn_ops.h"

namespace slidedp::kernels::gdn_internal {
using namespace ::slidedp::kernels::internal;  // common.cuh

// ---- Vector access of V consecutive elements (V = 1, 2, 4, 8), widened to / narrowed from FP32.
// The caller guarantees V * sizeof(T)-byte alignment (checked on the host by Aligned()).
struct alignas(8) Bf16x4 {
  __nv_bfloat162 v[2];
};

template <int V>
__device__ __forceinline__ void LoadV(const bf16* p, float* f) {
  if constexpr (V == 8) {
    Load8(p, f);
  } else if constexpr (V == 4) {
    const Bf16x4 x = *reinterpret_cast<const Bf16x4*>(p);
    const float2 a = __bfloat1622float2(x.v[0]), b = __bfloat1622float2(x.v[1]);
    f[0] = a.x;
    f[1] = a.y;
    f[2] = b.x;
    f[3] = b.y;
  } else if constexpr (V == 2) {
    const float2 a = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(p));
    f[0] = a.x;
    f[1] = a.y;
  } else {
    static_assert(V == 1);
    f[0] = __bfloat162float(*p);
  }
}

template <int V>
__device__ __forceinline__ void LoadV(const float* p, float* f) {
  if constexpr (V == 8) {
    Load8(p, f);
  } else if constexpr (V == 4) {
    const float4 a = *reinterpret_cast<const float4*>(p);
    f[0] = a.x;
    f[1] = a.y;
    f[2] = a.z;
    f[3] = a.w;
  } else if constexpr (V == 2) {
    const float2 a = *reinterpret_cast<const float2*>(p);
    f[0] = a.x;
    f[1] = a.y;
  } else {
    static_assert(V == 1);
    f[0] = *p;
  }
}

template <int V>
__device__ __forceinline__ void StoreV(bf16* p, const float* f) {
  if constexpr (V == 8) {
    Store8(p, f);
  } else if constexpr (V == 4) {
    Bf16x4 x;
    x.v[0] = __floats2bfloat162_rn(f[0], f[1]);
    x.v[1] = __floats2bfloat162_rn(f[2], f[3]);
    *reinterpret_cast<Bf16x4*>(p) = x;
  } else if constexpr (V == 2) {
    *reinterpret_cast<__nv_bfloat162*>(p) = __floats2bfloat162_rn(f[0], f[1]);
  } else {
    static_assert(V == 1);
    *p = __float2bfloat16_rn(f[0]);
  }
}

template <int V>
__device__ __forceinline__ void StoreV(float* p, const float* f) {
  if constexpr (V == 8) {
    Store8(p, f);
  } else if constexpr (V == 4) {
    *reinterpret_cast<float4*>(p) = make_float4(f[0], f[1], f[2], f[3]);
  } else if constexpr (V == 2) {
    *reinterpret_cast<float2*>(p) = make_float2(f[0], f[1]);
  } else {
    static_assert(V == 1);
    *p = f[0];
  }
}

__device__ __forceinline__ float ToF32(bf16 v) { return __bfloat162float(v); }
__device__ __forceinline__ float ToF32(float v) { return v; }

// Accurate expf (not __expf): these kernels are memory-bound, the extra instructions are free.
__device__ __forceinline__ float Sigmoid(float x) { return 1.0f / (1.0f + expf(-x)); }

// silu'(u) = σ(u)·(1 + u·(1 − σ(u))).
__device__ __forceinline__ float SiluGrad(float u) {
  const float s = Sigmoid(u);
  return s * (1.0f + u * (1.0f - s));
}

// Host side: a V-wide path needs every width and stride divisible by V and every pointer aligned
// to V elements.
template <typename T>
bool Aligned(const T* p, int v) {
  return reinterpret_cast<uintptr_t>(p) % (static_cast<uintptr_t>(v) * sizeof(T)) == 0;
}
inline bool Divisible(std::initializer_list<int64_t> xs, int v) {
  for (int64_t x : xs)
    if (x % v != 0) return false;
  return true;
}

struct RowStride {
  const char* name;
  int64_t ld;
};
inline absl::Status CheckStrides(const char* op, int64_t width, std::initializer_list<RowStride> strides) {
  for (const RowStride& r : strides) {
    if (r.ld < width) {
      return absl::InvalidArgumentError(absl::StrCat(op, ": ", r.name, " = ", r.ld, " < row width ", width));
    }
  }
  return absl::OkStatus();
}

// The first error of a launcher's checks (all are cheap host checks).
inline absl::Status FirstError(std::initializer_list<absl::Status> checks) {
  for (const absl::Status& s : checks)
    if (!s.ok()) return s;
  return absl::OkStatus();
}

}  // namespace slidedp::kernels::gdn_internal
