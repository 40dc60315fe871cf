// Row-major GEMMs through cuBLASLt with a cached algorithm per shape and one workspace.
//
//   D[M,N] = alpha * op(A)[M,K] * op(B)[K,N] + beta * C[M,N]      (all row-major, with leading dims)
//
// A and B are BF16; C/D are BF16 (forward, input gradient; C may be a residual) or FP32 (weight
// gradients accumulated across micro-batches with beta = 1 and C == D). Accumulation is FP32.
// The three uses in a layer (W row-major [out, in]):
//   forward  Y  = X · Wᵀ      : op(A)=N (X [T,in]),   op(B)=T (W [out,in])
//   dgrad    dX = dY · W      : op(A)=N (dY [T,out]), op(B)=N (W [out,in])
//   wgrad    dW += dYᵀ · X    : op(A)=T (dY [T,out]), op(B)=N (X [T,in]), FP32 D, beta 1
#pragma once

#include <cublasLt.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <map>
#include <tuple>

#include "absl/status/status.h"

namespace slidedp {

enum class GemmOp { kN, kT };
enum class GemmOutType { kBF16, kF32 };

struct GemmArgs {
  GemmOp op_a = GemmOp::kN;
  GemmOp op_b = GemmOp::kT;
  int64_t m = 0, n = 0, k = 0;
  const void* a = nullptr;  // BF16
  int64_t lda = 0;
  const void* b = nullptr;  // BF16
  int64_t ldb = 0;
  const void* c = nullptr;  // same type as D; may equal d; ignored when beta == 0
  int64_t ldc = 0;
  void* d = nullptr;
  int64_t ldd = 0;
  GemmOutType out_type = GemmOutType::kBF16;
  // Optional BF16 bias [n] added to every row of D in the epilogue (BF16 D only): D = A·B + bias,
  // rounded once, as torch's addmm through cuBLASLt (an nn.Linear with a bias under autocast).
  const void* bias = nullptr;
  float alpha = 1.0f;
  float beta = 0.0f;
};

// Owns a cuBLASLt handle, a workspace and the per-shape algorithm cache. Not thread-safe: one per
// stream-owning backend.
class GemmRunner {
 public:
  static constexpr size_t kWorkspaceBytes = 64ull << 20;
  static constexpr size_t kMaxPlans = 4096;  // cached shapes (each a few descriptors)
  GemmRunner() = default;
  ~GemmRunner();
  GemmRunner(const GemmRunner&) = delete;
  GemmRunner& operator=(const GemmRunner&) = delete;

  absl::Status Init();
  // Enqueues on stream; never synchronizes.
  absl::Status Run(const GemmArgs& args, cudaStream_t stream);

 private:
  using Key = std::tuple<int, int, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int, bool, int, bool>;
  struct Plan {
    cublasLtMatmulDesc_t desc = nullptr;
    cublasLtMatrixLayout_t la = nullptr, lb = nullptr, lc = nullptr, ld = nullptr;
    cublasLtMatmulAlgo_t algo{};
  };
  absl::Status MakePlan(const GemmArgs& args, int align_bytes, Plan* plan);
  void DropPlans();

  cublasLtHandle_t handle_ = nullptr;
  void* workspace_ = nullptr;
  std::map<Key, Plan> plans_;
};

}  // namespace slidedp
