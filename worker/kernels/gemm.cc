// cuBLASLt row-major GEMM runner; see gemm.h. Row-major D = op(A)·op(B) is computed as the
// column-major product Dᵀ = op(B)ᵀ·op(A)ᵀ, so cuBLASLt's "A" is our B and its "B" is our A.
#include "worker/kernels/gemm.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "common/status/status_macros.h"
#include "worker/kernels/cuda_check.h"

namespace slidedp {
namespace {

int PointerAlignment(const void* p) {
  auto v = reinterpret_cast<uintptr_t>(p);
  int a = 256;
  while (a > 2 && (v % a) != 0) a /= 2;
  return a;
}

int LdAlignment(int64_t ld, int elem_bytes) {
  int64_t bytes = ld * elem_bytes;
  int a = 256;
  while (a > 2 && (bytes % a) != 0) a /= 2;
  return a;
}

// The column-major layouts' rows x cols for g (see the file comment): cuBLASLt's A is our B [n x k],
// its B our A [k x m], C and D [n x m].
struct LayoutSizes {
  uint64_t a_rows, a_cols, b_rows, b_cols, c_rows, c_cols;
};

LayoutSizes SizesOf(const GemmArgs& g) {
  const uint64_t cm = g.n, cn = g.m, ck = g.k;
  const bool ta_n = g.op_b != GemmOp::kT, tb_n = g.op_a != GemmOp::kT;
  return {ta_n ? cm : ck, ta_n ? ck : cm, tb_n ? ck : cn, tb_n ? cn : ck, cm, cn};
}

absl::Status SetRowsCols(cublasLtMatrixLayout_t l, uint64_t rows, uint64_t cols) {
  SLIDEDP_CUBLAS_RETURN_IF_ERROR(cublasLtMatrixLayoutSetAttribute(l, CUBLASLT_MATRIX_LAYOUT_ROWS, &rows, sizeof(rows)));
  SLIDEDP_CUBLAS_RETURN_IF_ERROR(cublasLtMatrixLayoutSetAttribute(l, CUBLASLT_MATRIX_LAYOUT_COLS, &cols, sizeof(cols)));
  return absl::OkStatus();
}

}  // namespace

int64_t GemmRowBucket(int64_t rows) {
  int64_t b = 16;
  while (b < rows) {
    const int64_t mid = b + b / 2;  // 3 * 2^(j-1) between 2^j and 2^(j+1)
    if (rows <= mid) return mid;
    b *= 2;
  }
  return b;
}

absl::Status GemmRunner::SetLayoutSizes(const GemmArgs& g, Plan* p) {
  const LayoutSizes s = SizesOf(g);
  RETURN_IF_ERROR(SetRowsCols(p->la, s.a_rows, s.a_cols));
  RETURN_IF_ERROR(SetRowsCols(p->lb, s.b_rows, s.b_cols));
  RETURN_IF_ERROR(SetRowsCols(p->lc, s.c_rows, s.c_cols));
  return SetRowsCols(p->ld, s.c_rows, s.c_cols);
}

void GemmRunner::DropPlans() {
  for (auto& [key, plan] : plans_) {
    cublasLtMatrixLayoutDestroy(plan.la);
    cublasLtMatrixLayoutDestroy(plan.lb);
    cublasLtMatrixLayoutDestroy(plan.lc);
    cublasLtMatrixLayoutDestroy(plan.ld);
    cublasLtMatmulDescDestroy(plan.desc);
  }
  plans_.clear();
}

GemmRunner::~GemmRunner() {
  DropPlans();
  if (workspace_ != nullptr) cudaFree(workspace_);
  if (handle_ != nullptr) cublasLtDestroy(handle_);
}

absl::Status GemmRunner::Init() {
  SLIDEDP_CUBLAS_RETURN_IF_ERROR(cublasLtCreate(&handle_));
  SLIDEDP_CUDA_RETURN_IF_ERROR(cudaMalloc(&workspace_, kWorkspaceBytes));
  return absl::OkStatus();
}

absl::Status GemmRunner::MakePlan(const GemmArgs& g, int align_bytes, Plan* plan) {
  const bool out_f32 = g.out_type == Dtype::kF32;
  const cudaDataType_t out_t = out_f32 ? CUDA_R_32F : CUDA_R_16BF;
  SLIDEDP_CUBLAS_RETURN_IF_ERROR(cublasLtMatmulDescCreate(&plan->desc, CUBLAS_COMPUTE_32F, CUDA_R_32F));
  // cuBLASLt's A is our B, its B is our A (see the file comment).
  cublasOperation_t ta = g.op_b == GemmOp::kT ? CUBLAS_OP_T : CUBLAS_OP_N;
  cublasOperation_t tb = g.op_a == GemmOp::kT ? CUBLAS_OP_T : CUBLAS_OP_N;
  SLIDEDP_CUBLAS_RETURN_IF_ERROR(
      cublasLtMatmulDescSetAttribute(plan->desc, CUBLASLT_MATMUL_DESC_TRANSA, &ta, sizeof(ta)));
  SLIDEDP_CUBLAS_RETURN_IF_ERROR(
      cublasLtMatmulDescSetAttribute(plan->desc, CUBLASLT_MATMUL_DESC_TRANSB, &tb, sizeof(tb)));
  if (g.bias != nullptr) {
    // Column-major Dᵀ [n, m]: the bias runs along its rows (our columns), broadcast over m.
    const cublasLtEpilogue_t epi = CUBLASLT_EPILOGUE_BIAS;
    const cudaDataType_t bias_t = CUDA_R_16BF;
    SLIDEDP_CUBLAS_RETURN_IF_ERROR(
        cublasLtMatmulDescSetAttribute(plan->desc, CUBLASLT_MATMUL_DESC_EPILOGUE, &epi, sizeof(epi)));
    SLIDEDP_CUBLAS_RETURN_IF_ERROR(
        cublasLtMatmulDescSetAttribute(plan->desc, CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE, &bias_t, sizeof(bias_t)));
    SLIDEDP_CUBLAS_RETURN_IF_ERROR(
        cublasLtMatmulDescSetAttribute(plan->desc, CUBLASLT_MATMUL_DESC_BIAS_POINTER, &g.bias, sizeof(g.bias)));
  }
  // Column-major stored shapes: our B (row-major [K,N] if N, [N,K] if T) seen column-major.
  const LayoutSizes sz = SizesOf(g);
  SLIDEDP_CUBLAS_RETURN_IF_ERROR(cublasLtMatrixLayoutCreate(&plan->la, CUDA_R_16BF, sz.a_rows, sz.a_cols, g.ldb));
  SLIDEDP_CUBLAS_RETURN_IF_ERROR(cublasLtMatrixLayoutCreate(&plan->lb, CUDA_R_16BF, sz.b_rows, sz.b_cols, g.lda));
  SLIDEDP_CUBLAS_RETURN_IF_ERROR(
      cublasLtMatrixLayoutCreate(&plan->lc, out_t, sz.c_rows, sz.c_cols, g.beta != 0.0f ? g.ldc : g.ldd));
  SLIDEDP_CUBLAS_RETURN_IF_ERROR(cublasLtMatrixLayoutCreate(&plan->ld, out_t, sz.c_rows, sz.c_cols, g.ldd));

  cublasLtMatmulPreference_t pref = nullptr;
  SLIDEDP_CUBLAS_RETURN_IF_ERROR(cublasLtMatmulPreferenceCreate(&pref));
  uint64_t ws = kWorkspaceBytes;
  uint32_t al = static_cast<uint32_t>(align_bytes);
  cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws, sizeof(ws));
  cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, &al, sizeof(al));
  cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, &al, sizeof(al));
  cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, &al, sizeof(al));
  cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, &al, sizeof(al));
  cublasLtMatmulHeuristicResult_t result{};
  int found = 0;
  cublasStatus_t st =
      cublasLtMatmulAlgoGetHeuristic(handle_, plan->desc, plan->la, plan->lb, plan->lc, plan->ld, pref, 1, &result, &found);
  cublasLtMatmulPreferenceDestroy(pref);
  SLIDEDP_CUBLAS_RETURN_IF_ERROR(st);
  if (found == 0) {
    return absl::UnimplementedError(absl::StrCat("cuBLASLt found no algorithm for GEMM m=", g.m, " n=", g.n,
                                                 " k=", g.k, " align=", align_bytes));
  }
  plan->algo = result.algo;
  return absl::OkStatus();
}

absl::StatusOr<GemmRunner::Plan*> GemmRunner::FindPlan(const GemmArgs& g, int align) {
  Key key{static_cast<int>(g.op_a), static_cast<int>(g.op_b), g.m, g.n, g.k, g.lda, g.ldb,
          g.beta != 0.0f ? g.ldc : g.ldd, g.ldd, static_cast<int>(g.out_type), g.beta != 0.0f, align,
          g.bias != nullptr, static_cast<int>(g.varies)};
  auto it = plans_.find(key);
  if (it == plans_.end()) {
    // New shapes keep coming only from row counts the runner does not bucket (row_buckets off);
    // past kMaxPlans the cache starts over (descriptors are host objects, read when a GEMM is
    // enqueued: none in flight needs them) and the shapes in use are planned again.
    if (plans_.size() >= kMaxPlans) DropPlans();
    Plan plan;
    absl::Status s = MakePlan(g, align, &plan);
    if (!s.ok()) {
      if (plan.la) cublasLtMatrixLayoutDestroy(plan.la);
      if (plan.lb) cublasLtMatrixLayoutDestroy(plan.lb);
      if (plan.lc) cublasLtMatrixLayoutDestroy(plan.lc);
      if (plan.ld) cublasLtMatrixLayoutDestroy(plan.ld);
      if (plan.desc) cublasLtMatmulDescDestroy(plan.desc);
      return s;
    }
    ++plans_made_;
    it = plans_.emplace(key, plan).first;
  }
  return &it->second;
}

absl::Status GemmRunner::Run(const GemmArgs& g, cudaStream_t stream) {
  if (g.m <= 0 || g.n <= 0 || g.k <= 0) {
    if (g.m > 0 && g.n > 0 && g.k == 0) {
      return absl::InvalidArgumentError("GEMM with k = 0 is not supported (would need a scale-only pass)");
    }
    return absl::OkStatus();  // empty product: nothing to write
  }
  const int esz_out = g.out_type == Dtype::kF32 ? 4 : 2;
  if (g.bias != nullptr && g.out_type != Dtype::kBF16) {
    return absl::InvalidArgumentError("GEMM bias epilogue: BF16 output only");
  }
  int align = std::min({PointerAlignment(g.a), PointerAlignment(g.b), PointerAlignment(g.d), LdAlignment(g.lda, 2),
                        LdAlignment(g.ldb, 2), LdAlignment(g.ldd, esz_out)});
  if (g.beta != 0.0f) align = std::min({align, PointerAlignment(g.c), LdAlignment(g.ldc, esz_out)});
  const void* c = g.beta != 0.0f ? g.c : g.d;
  auto matmul = [&](const Plan& p) {
    return cublasLtMatmul(handle_, p.desc, &g.alpha, g.b, p.la, g.a, p.lb, &g.beta, c, p.lc, g.d, p.ld, &p.algo,
                          workspace_, kWorkspaceBytes, stream);
  };

  if (row_buckets_ && g.varies != GemmArgs::Varies::kNone && g.bias == nullptr) {
    GemmArgs bucket = g;
    (g.varies == GemmArgs::Varies::kM ? bucket.m : bucket.k) = GemmRowBucket(g.varies == GemmArgs::Varies::kM ? g.m : g.k);
    ASSIGN_OR_RETURN(Plan * p, FindPlan(bucket, align));
    RETURN_IF_ERROR(SetLayoutSizes(g, p));  // this call's rows; the next call of the bucket sets its own
    const cublasStatus_t st = matmul(*p);
    if (st == CUBLAS_STATUS_SUCCESS) return absl::OkStatus();
    if (st != CUBLAS_STATUS_NOT_SUPPORTED && st != CUBLAS_STATUS_INVALID_VALUE) SLIDEDP_CUBLAS_RETURN_IF_ERROR(st);
    // The bucket's algorithm does not take this size: the exact shape's own plan below.
  }
  GemmArgs exact = g;
  exact.varies = GemmArgs::Varies::kNone;
  ASSIGN_OR_RETURN(Plan * p, FindPlan(exact, align));
  if (g.bias != nullptr) {  // the plan is cached per shape; the bias is this call's
    SLIDEDP_CUBLAS_RETURN_IF_ERROR(
        cublasLtMatmulDescSetAttribute(p->desc, CUBLASLT_MATMUL_DESC_BIAS_POINTER, &g.bias, sizeof(g.bias)));
  }
  SLIDEDP_CUBLAS_RETURN_IF_ERROR(matmul(*p));
  return absl::OkStatus();
}

}  // namespace slidedp
