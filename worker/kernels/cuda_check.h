// Macros that turn CUDA runtime and cuBLAS(Lt) failures into absl::Status carrying the failed
// expression and file:line, so a kernel launcher or backend op returns the error instead of
// aborting. Every kernel launch is followed by SLIDEDP_CUDA_RETURN_IF_LAUNCH_ERROR().
#pragma once

#include <cublasLt.h>
#include <cuda_runtime.h>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"

namespace slidedp::cuda_internal {

inline absl::Status CudaErrorStatus(cudaError_t err, const char* expr, const char* file, int line) {
  absl::StatusCode code = err == cudaErrorMemoryAllocation ? absl::StatusCode::kResourceExhausted
                                                           : absl::StatusCode::kInternal;
  return absl::Status(code, absl::StrCat(expr, " failed: ", cudaGetErrorName(err), " (",
                                         cudaGetErrorString(err), ") at ", file, ":", line));
}

inline absl::Status CublasErrorStatus(cublasStatus_t st, const char* expr, const char* file, int line) {
  absl::StatusCode code = st == CUBLAS_STATUS_ALLOC_FAILED ? absl::StatusCode::kResourceExhausted
                          : st == CUBLAS_STATUS_NOT_SUPPORTED ? absl::StatusCode::kUnimplemented
                          : st == CUBLAS_STATUS_INVALID_VALUE ? absl::StatusCode::kInvalidArgument
                                                              : absl::StatusCode::kInternal;
  return absl::Status(code, absl::StrCat(expr, " failed: cublas status ", static_cast<int>(st), " (",
                                         cublasLtGetStatusString(st), ") at ", file, ":", line));
}

}  // namespace slidedp::cuda_internal

#define SLIDEDP_CUDA_RETURN_IF_ERROR(expr)                                                          \
  do {                                                                                              \
    cudaError_t slidedp_cuda_err_ = (expr);                                                         \
    if (slidedp_cuda_err_ != cudaSuccess)                                                           \
      return ::slidedp::cuda_internal::CudaErrorStatus(slidedp_cuda_err_, #expr, __FILE__, __LINE__); \
  } while (0)

// After a <<<...>>> launch: reports configuration errors (bad grid, too much shared memory).
#define SLIDEDP_CUDA_RETURN_IF_LAUNCH_ERROR() SLIDEDP_CUDA_RETURN_IF_ERROR(cudaGetLastError())

#define SLIDEDP_CUBLAS_RETURN_IF_ERROR(expr)                                                          \
  do {                                                                                                \
    cublasStatus_t slidedp_cublas_st_ = (expr);                                                       \
    if (slidedp_cublas_st_ != CUBLAS_STATUS_SUCCESS)                                                  \
      return ::slidedp::cuda_internal::CublasErrorStatus(slidedp_cublas_st_, #expr, __FILE__, __LINE__); \
  } while (0)
