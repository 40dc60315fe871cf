// The kernel benchmark's GEMM family: each decoder projection's forward, dgrad and wgrad through
// GemmRunner (cuBLASLt), against the BF16 GEMM ceiling.
#include <string>

#include "bench/kernels/bench_kernels.h"

namespace slidedp::bench {

void BenchGemms(GemmRunner& gemm, const std::string& model, const ModelConfig& c, int64_t T, const OpOperands& o) {
  const int64_t H = c.hidden_size, I = c.intermediate_size, qd = c.q_dim(), kvd = c.kv_dim(), QKV = qd + 2 * kvd;
  struct G {
    const char* name;
    int64_t n, k;
  };
  const G gs[] = {{"qkv", QKV, H}, {"o_proj", H, qd}, {"gate_up", 2 * I, H}, {"down", H, I}};
  for (const G& s : gs) {
    const auto emit_pass = [&](const char* pass, const GemmArgs& g) {
      Emit(std::string("gemm_") + pass + "_" + s.name, model, T, TimeMs([&] { BENCH_CHECK(gemm.Run(g, nullptr)); }),
           2.0 * T * s.n * s.k, 0);
    };
    // forward Y[T,n] = X[T,k] Wᵀ
    emit_pass("fwd", MakeGemm(T, s.n, s.k, o.big, s.k, o.w, s.k, o.big2, s.n));
    GemmArgs d = MakeGemm(T, s.k, s.n, o.big, s.n, o.w, s.k, o.big2, s.k);  // dgrad dX[T,k] = dY[T,n] W
    d.op_b = GemmOp::kN;
    emit_pass("dgrad", d);
    GemmArgs wg = MakeGemm(s.n, s.k, T, o.big, s.n, o.big2, s.k, o.dw, s.k);  // wgrad dW[n,k] += dYᵀ X (FP32)
    wg.op_a = GemmOp::kT;
    wg.op_b = GemmOp::kN;
    wg.c = o.dw;
    wg.ldc = s.k;
    wg.out_type = Dtype::kF32;
    wg.beta = 1.0f;
    emit_pass("wgrad", wg);
  }
}

}  // namespace slidedp::bench
