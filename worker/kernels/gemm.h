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
#include "absl/status/statusor.h"
#include "common/numeric/dtype.h"

namespace slidedp {

enum class GemmOp { kN, kT };

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
  Dtype out_type = Dtype::kBF16;
  // Optional BF16 bias [n] added to every row of D in the epilogue (BF16 D only): D = A·B + bias,
  // rounded once, as torch's addmm through cuBLASLt (an nn.Linear with a bias under autocast).
  const void* bias = nullptr;
  float alpha = 1.0f;
  float beta = 0.0f;
  // Which dimension is a token-row count that changes from call to call (a MoE expert's rows, set by
  // the routing): the runner then plans for a bucket of such counts (GemmRowBucket) and runs the
  // bucket's algorithm at the call's size, instead of one cuBLASLt heuristic call per distinct count.
  // kNone: planned for exactly this shape (every dense-layer GEMM).
  enum class Varies { kNone, kM, kK };
  Varies varies = Varies::kNone;
};

// The bucket a varying row count is planned for: the smallest of 2^j and 3 * 2^(j-1) (j >= 4) that
// holds `rows` (16, 24, 32, 48, 64, 96, ...): at most two buckets per octave, each at most 1.5x the
// counts it serves. rows >= 1.
int64_t GemmRowBucket(int64_t rows);

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
  // Enqueues on stream; never synchronizes. A GEMM whose args say `varies` runs the algorithm cuBLASLt
  // chose for its row count's bucket (the same for every count in it: bitwise repeatable per shape),
  // or, where that algorithm does not take this size, one planned for the exact shape.
  absl::Status Run(const GemmArgs& args, cudaStream_t stream);
  // Off: every GEMM is planned for its exact shape (bench_kernels compares the two).
  void set_row_buckets(bool on) { row_buckets_ = on; }
  // Plans made so far (each a cublasLtMatmulAlgoGetHeuristic call), for benchmarks and tests.
  int64_t plans_made() const { return plans_made_; }

 private:
  using Key =
      std::tuple<int, int, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int, bool, int, bool, int>;
  struct Plan {
    cublasLtMatmulDesc_t desc = nullptr;
    cublasLtMatrixLayout_t la = nullptr, lb = nullptr, lc = nullptr, ld = nullptr;
    cublasLtMatmulAlgo_t algo{};
  };
  absl::Status MakePlan(const GemmArgs& args, int align_bytes, Plan* plan);
  // The cached plan for args (made on a miss).
  absl::StatusOr<Plan*> FindPlan(const GemmArgs& args, int align_bytes);
  // Sets p's four layouts to args' sizes (a bucket's plan run at one call's row count).
  static absl::Status SetLayoutSizes(const GemmArgs& args, Plan* p);
  void DropPlans();

  cublasLtHandle_t handle_ = nullptr;
  void* workspace_ = nullptr;
  std::map<Key, Plan> plans_;
  bool row_buckets_ = true;
  int64_t plans_made_ = 0;
};

}  // namespace slidedp
