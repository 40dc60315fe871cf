// Small deterministic reductions and FP32/BF16 conversions: the partial-row sum the weight
// gradients end in, the loss sum, the FP64 squared norm (device-staged gradient clipping), the
// scaled FP32 -> BF16 cast, the exact BF16 -> FP32 widening and the FP32 residual add of a BF16
// GEMM output.
//
// Every launcher takes its tensors, sizes and an explicit stream, returns a Status (bad sizes are
// INVALID_ARGUMENT, launch failures INTERNAL) and never synchronizes. BF16 storage, FP32 math.
// Weight gradients are ADDED to FP32 outputs through a two-stage deterministic reduction: each
// block writes a partial row into a caller workspace, then one pass sums the partials in a fixed
// order (so results do not depend on scheduling). PartialBlocks gives the number of partial rows;
// the families' *WorkspaceNumel() helpers size the workspace.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "absl/status/status.h"

namespace slidedp::kernels {

using bf16 = __nv_bfloat16;

// Number of partial rows the deterministic weight-gradient reductions use for `rows` rows.
int64_t PartialBlocks(int64_t rows);

// out[c] += Σ_p partial[p * cols + c] for p in [0, parts), fixed order.
absl::Status ReducePartialsInto(const float* partial, int64_t parts, int64_t cols, float* out, cudaStream_t stream);
// out[c] += Σ_r x[r * ld + c] over rows r, c < cols: a bias gradient (the column sums of a BF16
// output gradient), deterministic: ws holds ColumnSumsWorkspaceNumel(rows, cols) floats of
// partial sums over fixed row groups, added in a fixed order.
int64_t ColumnSumsWorkspaceNumel(int64_t rows, int64_t cols);
absl::Status ColumnSumsInto(const bf16* x, int64_t rows, int64_t cols, int64_t ld, float* ws, float* out,
                            cudaStream_t stream);
// *out += Σ vals[0..n) in a fixed order (one block).
absl::Status SumInto(const float* vals, int64_t n, float* out, cudaStream_t stream);
// *out = Σ x[i]² accumulated in FP64, deterministically: kSumSquaresBlocks blocks write partial
// sums (fixed element-to-thread mapping) to `partials`, then one block adds them in a fixed
// order. Calls sharing `partials` must be ordered (one stream).
constexpr int kSumSquaresBlocks = 528;
absl::Status SumSquaresF32(const float* x, int64_t n, double* partials, double* out, cudaStream_t stream);
// dst[i] = bf16(src[i] * scale).
absl::Status CastF32ToBf16(const float* src, int64_t n, float scale, bf16* dst, cudaStream_t stream);
// dst[i] = FloatToBf16(src[i]) (common/numeric/bf16.h) bit for bit: round to nearest even, a NaN
// to (bits >> 16) | 0x40. The upload cast of runtime.param_source master with cast_on device; it
// runs on at most `max_blocks` blocks, so that it takes few SMs from compute running beside it.
absl::Status CastF32ToBf16Exact(const float* src, int64_t n, bf16* dst, int max_blocks, cudaStream_t stream);
// dst[i] = float(src[i]): exact (a BF16 value is the upper half of its FP32 one; NaN payloads and
// infinities pass through). A layer input kept in BF16 (runtime.checkpoint_dtype bf16) widened back
// for its backward.
absl::Status WidenBf16ToF32(const bf16* src, int64_t n, float* dst, cudaStream_t stream);
// x[i] = float(bf16(x[i])), rounded to nearest even as FloatToBf16 (common/numeric/bf16.h): the
// FP32 values of a gradient posted in BF16 (runtime.grad_dtype bf16), whose norm is taken on them.
absl::Status RoundToBf16InPlace(float* x, int64_t n, cudaStream_t stream);
// out[i] = res[i] + float(branch[i]): the FP32 residual add of a BF16 GEMM output, in HF autocast's
// order (the branch is rounded to BF16 first, the sum is FP32). out may alias res.
absl::Status AddBf16ToF32(const float* res, const bf16* branch, int64_t n, float* out, cudaStream_t stream);
// Context parallelism's row moves (kv_dim-wide rows of keys/values and their gradients):
// out[r, 0:cols] = x[index[r], 0:cols], or zeros where index[r] < 0 (a padding row); rows of
// stride ld_x / ld_out.
absl::Status GatherRowsF32(const float* x, int64_t ld_x, const int32_t* index, int64_t rows, int64_t cols, float* out,
                           int64_t ld_out, cudaStream_t stream);
// dst[r, 0:cols] = bf16(src[r, 0:cols]) (round to nearest even), strided rows.
absl::Status CastRowsF32ToBf16(const float* src, int64_t ld_src, int64_t rows, int64_t cols, bf16* dst, int64_t ld_dst,
                               cudaStream_t stream);
// dst[r, 0:cols] += float(src[r, 0:cols]), strided rows (cuDNN's per-piece dK / dV into the FP32 sum).
absl::Status AddRowsBf16ToF32(const bf16* src, int64_t ld_src, int64_t rows, int64_t cols, float* dst, int64_t ld_dst,
                              cudaStream_t stream);
// out[i] = a[i] + b[i] in FP32 (a MoE block's FP32 output added to the residual). out may alias a or b.
absl::Status AddF32(const float* a, const float* b, int64_t n, float* out, cudaStream_t stream);

}  // namespace slidedp::kernels
