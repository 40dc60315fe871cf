// Deterministic reductions and casts; see reductions.h. All are memory-bound: their ceiling is device
// copy bandwidth over the bytes each reads and writes once (bench/kernels reports the fraction).
#include "worker/kernels/reductions.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "worker/kernels/common.cuh"
#include "worker/kernels/cuda_check.h"

namespace slidedp::kernels {
using namespace internal;  // common.cuh

namespace internal {

__global__ void ReducePartialsKernel(const float* __restrict__ partial, int64_t parts, int64_t cols, int64_t split,
                                     float* out_lo, float* out_hi) {
  __shared__ float sm[32][33];
  const int tx = threadIdx.x & 31, ty = threadIdx.x >> 5;
  const int64_t c = blockIdx.x * 32ll + tx;
  float s = 0.f;
  if (c < cols)
    for (int64_t p = ty; p < parts; p += 32) s += partial[p * cols + c];
  sm[ty][tx] = s;
  __syncthreads();
  if (ty == 0 && c < cols) {
    float t = 0.f;
    for (int i = 0; i < 32; ++i) t += sm[i][tx];
    if (c < split)
      out_lo[c] += t;
    else
      out_hi[c - split] += t;
  }
}

}  // namespace internal

namespace {

constexpr int kMaxPartialBlocks = 1056;  // 8 per SM on a 132-SM H200
constexpr int kColumnSumParts = 128;     // row groups of ColumnSumsInto

__global__ void SumIntoKernel(const float* __restrict__ vals, int64_t n, float* out) {
  __shared__ float scratch[33];
  float s = 0.f;
  for (int64_t i = threadIdx.x; i < n; i += blockDim.x) s += vals[i];
  s = BlockSum(s, scratch);
  if (threadIdx.x == 0) *out += s;
}

__device__ __forceinline__ double WarpSumF64(double v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

// Fixed-order block sum of doubles (blockDim.x a multiple of 32, at most 1024).
__device__ __forceinline__ double BlockSumF64(double v, double* scratch) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
  v = WarpSumF64(v);
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  double t = 0;
  if (warp == 0) {
    t = lane < nwarps ? scratch[lane] : 0.0;
    t = WarpSumF64(t);
  }
  return t;  // valid in thread 0
}

__global__ void SumSquaresPartialKernel(const float* __restrict__ x, int64_t n, double* __restrict__ partials) {
  __shared__ double scratch[32];
  double s = 0;
  const int64_t n4 = (reinterpret_cast<uintptr_t>(x) & 15) == 0 ? n / 4 : 0;
  const float4* x4 = reinterpret_cast<const float4*>(x);
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n4;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const float4 v = x4[i];
    s += static_cast<double>(v.x) * v.x + static_cast<double>(v.y) * v.y + static_cast<double>(v.z) * v.z +
         static_cast<double>(v.w) * v.w;
  }
  for (int64_t i = n4 * 4 + blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    s += static_cast<double>(x[i]) * x[i];
  }
  s = BlockSumF64(s, scratch);
  if (threadIdx.x == 0) partials[blockIdx.x] = s;
}

__global__ void SumPartialsF64Kernel(const double* __restrict__ partials, int parts, double* out) {
  __shared__ double scratch[32];
  double s = 0;
  for (int i = threadIdx.x; i < parts; i += blockDim.x) s += partials[i];
  s = BlockSumF64(s, scratch);
  if (threadIdx.x == 0) *out = s;
}

__global__ void CastKernel(const float* __restrict__ src, int64_t n, float scale, bf16* __restrict__ dst) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x)
    dst[i] = __float2bfloat16(src[i] * scale);
}

__device__ __forceinline__ uint32_t Bf16BitsOf(uint32_t x) {
  if ((x & 0x7fffffffu) > 0x7f800000u) return (x >> 16) | 0x40u;
  return (x + 0x7fffu + ((x >> 16) & 1u)) >> 16;
}

// Four elements a thread where src and dst allow 16- and 8-byte accesses; the rest one by one.
__global__ void CastExactKernel(const float* __restrict__ src, int64_t n, uint16_t* __restrict__ dst, bool vec) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  const int64_t first = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  int64_t done = 0;
  if (vec) {
    const int64_t quads = n / 4;
    const uint4* in = reinterpret_cast<const uint4*>(src);
    uint2* out = reinterpret_cast<uint2*>(dst);
    for (int64_t q = first; q < quads; q += stride) {
      const uint4 x = in[q];
      out[q] = make_uint2(Bf16BitsOf(x.x) | (Bf16BitsOf(x.y) << 16), Bf16BitsOf(x.z) | (Bf16BitsOf(x.w) << 16));
    }
    done = quads * 4;
  }
  const uint32_t* bits = reinterpret_cast<const uint32_t*>(src);
  for (int64_t i = done + first; i < n; i += stride) dst[i] = static_cast<uint16_t>(Bf16BitsOf(bits[i]));
}

// Bit shifts, not __bfloat162float: exact for every pattern, NaN payloads included. Four elements a
// thread where src and dst allow 8- and 16-byte accesses; the rest one by one.
__global__ void WidenKernel(const uint16_t* __restrict__ src, int64_t n, uint32_t* __restrict__ dst, bool vec) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  const int64_t first = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  int64_t done = 0;
  if (vec) {
    const int64_t quads = n / 4;
    const uint2* in = reinterpret_cast<const uint2*>(src);
    uint4* out = reinterpret_cast<uint4*>(dst);
    for (int64_t q = first; q < quads; q += stride) {
      const uint2 x = in[q];
      out[q] = make_uint4(x.x << 16, x.x & 0xffff0000u, x.y << 16, x.y & 0xffff0000u);
    }
    done = quads * 4;
  }
  for (int64_t i = done + first; i < n; i += stride) dst[i] = static_cast<uint32_t>(src[i]) << 16;
}

__global__ void RoundToBf16Kernel(float* x, int64_t n) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x)
    x[i] = __bfloat162float(__float2bfloat16_rn(x[i]));
}

// No __restrict__: out may alias res (each element is read before it is written, by one thread).
__global__ void AddBf16ToF32Kernel(const float* res, const bf16* __restrict__ branch, int64_t n, float* out) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x)
    out[i] = res[i] + __bfloat162float(branch[i]);
}

// No __restrict__: out may alias a or b.
__global__ void AddF32Kernel(const float* a, const float* b, int64_t n, float* out) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x)
    out[i] = a[i] + b[i];
}

// Column sums of a BF16 [rows, cols] matrix (row stride ld): block (bx, by) sums rows
// by, by + gridDim.y, ... of columns [bx * 256, bx * 256 + 256) into partial[by][col], one thread
// per column (consecutive threads read consecutive columns of a row: coalesced).
__global__ void ColumnSumsPartialKernel(const bf16* __restrict__ x, int64_t rows, int64_t cols, int64_t ld,
                                        float* __restrict__ partial) {
  const int64_t c = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (c >= cols) return;
  float s = 0.f;
  for (int64_t r = blockIdx.y; r < rows; r += gridDim.y) s += __bfloat162float(x[r * ld + c]);
  partial[blockIdx.y * cols + c] = s;
}

}  // namespace

int64_t ColumnSumsWorkspaceNumel(int64_t rows, int64_t cols) {
  return std::max<int64_t>(1, std::min<int64_t>(rows, kColumnSumParts)) * cols;
}

absl::Status ColumnSumsInto(const bf16* x, int64_t rows, int64_t cols, int64_t ld, float* ws, float* out,
                            cudaStream_t stream) {
  if (rows < 0 || cols < 0 || ld < cols) {
    return absl::InvalidArgumentError(absl::StrCat("ColumnSumsInto: rows ", rows, ", cols ", cols, ", ld ", ld));
  }
  if (rows == 0 || cols == 0) return absl::OkStatus();
  const int64_t parts = std::max<int64_t>(1, std::min<int64_t>(rows, kColumnSumParts));
  ColumnSumsPartialKernel<<<dim3(static_cast<unsigned>((cols + 255) / 256), static_cast<unsigned>(parts)), 256, 0,
                            stream>>>(x, rows, cols, ld, ws);
  SLIDEDP_CUDA_RETURN_IF_LAUNCH_ERROR();
  return ReducePartialsInto(ws, parts, cols, out, stream);
}

int64_t PartialBlocks(int64_t rows) { return std::max<int64_t>(1, std::min<int64_t>(rows, kMaxPartialBlocks)); }

absl::Status ReducePartialsInto(const float* partial, int64_t parts, int64_t cols, float* out, cudaStream_t stream) {
  if (cols <= 0) return absl::OkStatus();
  ReducePartialsKernel<<<(cols + 31) / 32, 1024, 0, stream>>>(partial, parts, cols, cols, out, nullptr);
  SLIDEDP_CUDA_RETURN_IF_LAUNCH_ERROR();
  return absl::OkStatus();
}

absl::Status SumSquaresF32(const float* x, int64_t n, double* partials, double* out, cudaStream_t stream) {
  if (n < 0) return absl::InvalidArgumentError(absl::StrCat("SumSquaresF32: n = ", n));
  SumSquaresPartialKernel<<<kSumSquaresBlocks, 256, 0, stream>>>(x, n, partials);
  SLIDEDP_CUDA_RETURN_IF_LAUNCH_ERROR();
  SumPartialsF64Kernel<<<1, 512, 0, stream>>>(partials, kSumSquaresBlocks, out);
  SLIDEDP_CUDA_RETURN_IF_LAUNCH_ERROR();
  return absl::OkStatus();
}

absl::Status SumInto(const float* vals, int64_t n, float* out, cudaStream_t stream) {
  SumIntoKernel<<<1, 1024, 0, stream>>>(vals, n, out);
  SLIDEDP_CUDA_RETURN_IF_LAUNCH_ERROR();
  return absl::OkStatus();
}

namespace {
// op(r, c) for every element of a rows x cols block (grid-stride): the strided row moves below.
template <typename Op>
__global__ void RowsKernel(int64_t rows, int64_t cols, Op op) {
  const int64_t n = rows * cols;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    op(i / cols, i % cols);
  }
}
struct GatherRowsOp {
  const float* x;
  int64_t ld_x;
  const int32_t* index;
  float* out;
  int64_t ld_out;
  __device__ void operator()(int64_t r, int64_t c) const {
    const int32_t src = index[r];
    out[r * ld_out + c] = src >= 0 ? x[src * ld_x + c] : 0.f;
  }
};
struct CastRowsOp {
  const float* src;
  int64_t ld_src;
  bf16* dst;
  int64_t ld_dst;
  __device__ void operator()(int64_t r, int64_t c) const { dst[r * ld_dst + c] = __float2bfloat16_rn(src[r * ld_src + c]); }
};
struct AddRowsOp {
  const bf16* src;
  int64_t ld_src;
  float* dst;
  int64_t ld_dst;
  __device__ void operator()(int64_t r, int64_t c) const { dst[r * ld_dst + c] += __bfloat162float(src[r * ld_src + c]); }
};

// Checks a row move's shape (both strides hold the row) and runs it.
template <typename Op>
absl::Status RunRows(const char* name, int64_t rows, int64_t cols, int64_t ld_in, int64_t ld_out, Op op,
                     cudaStream_t stream) {
  if (rows < 0 || cols < 0 || ld_in < cols || ld_out < cols) {
    return absl::InvalidArgumentError(absl::StrCat(name, ": rows ", rows, ", cols ", cols, ", ld ", ld_in, "/", ld_out));
  }
  if (rows == 0 || cols == 0) return absl::OkStatus();
  RowsKernel<<<GridFor(rows * cols, 256), 256, 0, stream>>>(rows, cols, op);
  SLIDEDP_CUDA_RETURN_IF_LAUNCH_ERROR();
  return absl::OkStatus();
}
}  // namespace

absl::Status GatherRowsF32(const float* x, int64_t ld_x, const int32_t* index, int64_t rows, int64_t cols, float* out,
                           int64_t ld_out, cudaStream_t stream) {
  return RunRows("GatherRowsF32", rows, cols, ld_x, ld_out, GatherRowsOp{x, ld_x, index, out, ld_out}, stream);
}

absl::Status CastRowsF32ToBf16(const float* src, int64_t ld_src, int64_t rows, int64_t cols, bf16* dst, int64_t ld_dst,
                               cudaStream_t stream) {
  return RunRows("CastRowsF32ToBf16", rows, cols, ld_src, ld_dst, CastRowsOp{src, ld_src, dst, ld_dst}, stream);
}

absl::Status AddRowsBf16ToF32(const bf16* src, int64_t ld_src, int64_t rows, int64_t cols, float* dst, int64_t ld_dst,
                              cudaStream_t stream) {
  return RunRows("AddRowsBf16ToF32", rows, cols, ld_src, ld_dst, AddRowsOp{src, ld_src, dst, ld_dst}, stream);
}

absl::Status CastF32ToBf16(const float* src, int64_t n, float scale, bf16* dst, cudaStream_t stream) {
  if (n <= 0) return absl::OkStatus();
  CastKernel<<<GridFor(n, 256), 256, 0, stream>>>(src, n, scale, dst);
  SLIDEDP_CUDA_RETURN_IF_LAUNCH_ERROR();
  return absl::OkStatus();
}

absl::Status CastF32ToBf16Exact(const float* src, int64_t n, bf16* dst, int max_blocks, cudaStream_t stream) {
  if (n <= 0) return absl::OkStatus();
  if (max_blocks <= 0) return absl::InvalidArgumentError(absl::StrCat("CastF32ToBf16Exact: max_blocks ", max_blocks));
  const bool vec = reinterpret_cast<uintptr_t>(src) % 16 == 0 && reinterpret_cast<uintptr_t>(dst) % 8 == 0;
  const int blocks = std::min(GridFor((n + 3) / 4, 256), max_blocks);
  CastExactKernel<<<blocks, 256, 0, stream>>>(src, n, reinterpret_cast<uint16_t*>(dst), vec);
  SLIDEDP_CUDA_RETURN_IF_LAUNCH_ERROR();
  return absl::OkStatus();
}

absl::Status WidenBf16ToF32(const bf16* src, int64_t n, float* dst, cudaStream_t stream) {
  if (n < 0) return absl::InvalidArgumentError(absl::StrCat("WidenBf16ToF32: n = ", n));
  if (n == 0) return absl::OkStatus();
  if (src == nullptr || dst == nullptr) return absl::InvalidArgumentError("WidenBf16ToF32: null pointer");
  const bool vec = reinterpret_cast<uintptr_t>(src) % 8 == 0 && reinterpret_cast<uintptr_t>(dst) % 16 == 0;
  WidenKernel<<<GridFor((n + 3) / 4, 256), 256, 0, stream>>>(reinterpret_cast<const uint16_t*>(src), n,
                                                             reinterpret_cast<uint32_t*>(dst), vec);
  SLIDEDP_CUDA_RETURN_IF_LAUNCH_ERROR();
  return absl::OkStatus();
}

absl::Status RoundToBf16InPlace(float* x, int64_t n, cudaStream_t stream) {
  if (n <= 0) return absl::OkStatus();
  RoundToBf16Kernel<<<GridFor(n, 256), 256, 0, stream>>>(x, n);
  SLIDEDP_CUDA_RETURN_IF_LAUNCH_ERROR();
  return absl::OkStatus();
}

absl::Status AddBf16ToF32(const float* res, const bf16* branch, int64_t n, float* out, cudaStream_t stream) {
  if (n <= 0) return absl::OkStatus();
  AddBf16ToF32Kernel<<<GridFor(n, 256), 256, 0, stream>>>(res, branch, n, out);
  SLIDEDP_CUDA_RETURN_IF_LAUNCH_ERROR();
  return absl::OkStatus();
}

absl::Status AddF32(const float* a, const float* b, int64_t n, float* out, cudaStream_t stream) {
  if (n <= 0) return absl::OkStatus();
  AddF32Kernel<<<GridFor(n, 256), 256, 0, stream>>>(a, b, n, out);
  SLIDEDP_CUDA_RETURN_IF_LAUNCH_ERROR();
  return absl::OkStatus();
}

}  // namespace slidedp::kernels
