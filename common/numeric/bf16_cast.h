// CastF32ToBf16: an FP32 array to BF16, each value exactly FloatToBf16 (common/numeric/bf16.h:
// round to nearest even, a NaN to a quiet NaN of the same sign and top payload bits), on the
// widest vector unit the host has (AVX-512, AVX2, else scalar; chosen once per process).
//
// Used where BF16 values are made from the FP32 master on the host: the workers' uploads with
// runtime.param_source master (CPU backend, and CUDA with runtime.cast_on host).
#pragma once

#include <cstdint>

#include "common/numeric/bf16.h"

namespace slidedp {

void CastF32ToBf16(const float* in, bf16_t* out, int64_t n);

// The same on one ISA, for tests and benchmarks: false when the host lacks it (nothing written).
enum class CastIsa { kScalar, kAvx2, kAvx512 };
bool CastF32ToBf16On(CastIsa isa, const float* in, bf16_t* out, int64_t n);

}  // namespace slidedp
