// The Gated DeltaNet token-local ops and the attention output gate (gdn_ops.h), forward and
// backward, against FP64 host references on random data of awkward sizes: T = 1, 3, 65, 257, packed
// documents of 1, 2, 3, 5 tokens (and an empty one) for the conv, widths that are not multiples of 8
// (the scalar paths) next to ones that are (the vector paths), strided rows, NaN-poisoned outputs.
// Each comparison prints the max relative error max|got − ref| / max|ref| and its tolerance: BF16
// outputs 1e-2 (one BF16 rounding is 2^-9 relative), FP32 outputs and gradients 1e-3 (FP32 math on
// exact inputs; measured errors should be ~1e-6). The references' own backward passes are checked
// against central differences of their forward passes on tiny cases (GdnReference*, no GPU needed).
#include "worker/kernels/gdn_ops.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <functional>
#include <memory>
#include <string>
#include <type_traits>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "worker/kernels/tests/gpu_test.h"
#include "worker/kernels/tests/kernel_test_util.h"

namespace slidedp {
namespace {

using namespace kernel_test;  // the test-support helpers (kernel_test_util.h, gpu_test.h)

constexpr double kTolBf16 = 1e-2;
constexpr double kTolF32 = 1e-3;
constexpr double kTolCentralDiff = 1e-6;  // FP64 central differences with h = 1e-5: O(h²) ≈ 1e-10

// max|got − ref| / max|ref| (the absolute error where ref is all zero); infinite on a size mismatch
// or any non-finite value in got (a NaN-poisoned output left unwritten).
double MaxRelErr(const std::vector<double>& got, const std::vector<double>& ref) {
  if (got.size() != ref.size()) return INFINITY;
  double max_err = 0, max_ref = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    if (!std::isfinite(got[i])) return INFINITY;
    max_err = std::max(max_err, std::abs(got[i] - ref[i]));
    max_ref = std::max(max_ref, std::abs(ref[i]));
  }
  return max_ref > 0 ? max_err / max_ref : max_err;
}

void ExpectMaxRel(const std::string& name, const std::vector<double>& got, const std::vector<double>& ref, double tol) {
  const double err = MaxRelErr(got, ref);
  const bool ok = err <= tol;
  std::printf("%s  %-72s max_rel_err=%.3e tol=%.1e n=%zu\n", ok ? "PASS" : "FAIL", name.c_str(), err, tol, got.size());
  EXPECT_LE(err, tol) << name << ": max relative error over " << got.size() << " elements (reference has " << ref.size()
                      << ")";
}

// Columns [off, off + width) of a [rows, ld] row-major matrix, packed.
std::vector<double> Cols(const std::vector<double>& m, int64_t rows, int64_t ld, int64_t off, int64_t width) {
  std::vector<double> o(rows * width);
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < width; ++c) o[r * width + c] = m[r * ld + off + c];
  return o;
}

double Sigmoid(double x) { return 1 / (1 + std::exp(-x)); }
double Silu(double x) { return x * Sigmoid(x); }
double SiluGrad(double x) {
  const double s = Sigmoid(x);
  return s * (1 + x * (1 - s));
}
// torch softplus (beta 1, threshold 20) and its backward.
double Softplus(double u) { return u > 20 ? u : std::log1p(std::exp(u)); }
double SoftplusGrad(double u) { return u > 20 ? 1 : Sigmoid(u); }

// The whole of a device buffer, as doubles.
template <typename T>
std::vector<double> DownAll(const Dev<T>& d) {
  return kernel_test::Down(d.get(), d.n);
}

// ================================================================================================
// FP64 references. Inputs are in their device layout (row strides); outputs packed [rows, width].

// ---- 1. Causal depthwise conv1d + SiLU. pre[t, c] = Σ_j w[c, j] · x[t-K+1+j, c] inside t's document.
struct ConvRef {
  std::vector<int32_t> cu;  // [docs + 1]
  int64_t T;
  int C, K;
  int64_t ld_x;

  int64_t DocStart(int64_t t) const {
    int64_t s = 0;
    for (size_t d = 0; d + 1 < cu.size(); ++d)
      if (cu[d] <= t && t < cu[d + 1]) s = cu[d];
    return s;
  }
  std::vector<double> Pre(const std::vector<double>& x, const std::vector<double>& w) const {
    std::vector<double> pre(T * C, 0.0);
    for (int64_t t = 0; t < T; ++t) {
      const int64_t start = DocStart(t);
      for (int c = 0; c < C; ++c)
        for (int j = 0; j < K; ++j) {
          const int64_t s = t - K + 1 + j;
          if (s >= start) pre[t * C + c] += w[c * K + j] * x[s * ld_x + c];
        }
    }
    return pre;
  }
  std::vector<double> Forward(const std::vector<double>& x, const std::vector<double>& w) const {
    std::vector<double> y = Pre(x, w);
    for (double& v : y) v = Silu(v);
    return y;
  }
  // dy packed [T, C]; dx packed [T, C]; dw += into [C, K].
  void Backward(const std::vector<double>& dy, const std::vector<double>& x, const std::vector<double>& w,
                std::vector<double>& dx, std::vector<double>& dw) const {
    const std::vector<double> pre = Pre(x, w);
    dx.assign(T * C, 0.0);
    for (int64_t t = 0; t < T; ++t) {
      const int64_t start = DocStart(t);
      for (int c = 0; c < C; ++c) {
        const double dpre = dy[t * C + c] * SiluGrad(pre[t * C + c]);
        for (int j = 0; j < K; ++j) {
          const int64_t s = t - K + 1 + j;
          if (s < start) continue;
          dx[s * C + c] += w[c * K + j] * dpre;
          dw[c * K + j] += dpre * x[s * ld_x + c];
        }
      }
    }
  }
};

// ---- 2. Per-head L2 norm: y = x · (Σ x² + eps)^-1/2.
struct L2Ref {
  int64_t T;
  int heads, d;
  int64_t ld_x;
  double eps;

  std::vector<double> Forward(const std::vector<double>& x) const {
    std::vector<double> y(T * heads * d);
    for (int64_t t = 0; t < T; ++t)
      for (int h = 0; h < heads; ++h) {
        const double* xr = &x[t * ld_x + h * d];
        double ss = 0;
        for (int i = 0; i < d; ++i) ss += xr[i] * xr[i];
        const double r = 1 / std::sqrt(ss + eps);
        for (int i = 0; i < d; ++i) y[(t * heads + h) * d + i] = xr[i] * r;
      }
    return y;
  }
  // dy packed; returns dx packed.
  std::vector<double> Backward(const std::vector<double>& dy, const std::vector<double>& x) const {
    std::vector<double> dx(T * heads * d);
    for (int64_t t = 0; t < T; ++t)
      for (int h = 0; h < heads; ++h) {
        const double* xr = &x[t * ld_x + h * d];
        const double* g = &dy[(t * heads + h) * d];
        double ss = 0, dot = 0;
        for (int i = 0; i < d; ++i) {
          ss += xr[i] * xr[i];
          dot += g[i] * xr[i];
        }
        const double r = 1 / std::sqrt(ss + eps);
        for (int i = 0; i < d; ++i) dx[(t * heads + h) * d + i] = r * g[i] - r * r * r * dot * xr[i];
      }
    return dx;
  }
};

// ---- 3. g = −exp(A_log) · softplus(a + dt_bias), beta = σ(b).
struct DecayRef {
  int64_t T;
  int nv;
  int64_t ld_a, ld_b;

  void Forward(const std::vector<double>& a, const std::vector<double>& b, const std::vector<double>& A_log,
               const std::vector<double>& dt_bias, std::vector<double>& g, std::vector<double>& beta) const {
    g.assign(T * nv, 0.0);
    beta.assign(T * nv, 0.0);
    for (int64_t t = 0; t < T; ++t)
      for (int h = 0; h < nv; ++h) {
        g[t * nv + h] = -std::exp(A_log[h]) * Softplus(a[t * ld_a + h] + dt_bias[h]);
        beta[t * nv + h] = Sigmoid(b[t * ld_b + h]);
      }
  }
  // da, db packed [T, nv]; dA_log, ddt_bias += .
  void Backward(const std::vector<double>& dg, const std::vector<double>& dbeta, const std::vector<double>& a,
                const std::vector<double>& b, const std::vector<double>& A_log, const std::vector<double>& dt_bias,
                std::vector<double>& da, std::vector<double>& db, std::vector<double>& dA_log,
                std::vector<double>& ddt_bias) const {
    da.assign(T * nv, 0.0);
    db.assign(T * nv, 0.0);
    for (int64_t t = 0; t < T; ++t)
      for (int h = 0; h < nv; ++h) {
        const double u = a[t * ld_a + h] + dt_bias[h], e = std::exp(A_log[h]);
        const double dgv = dg[t * nv + h];
        da[t * nv + h] = -dgv * e * SoftplusGrad(u);
        ddt_bias[h] += da[t * nv + h];
        dA_log[h] += -dgv * e * Softplus(u);
        const double s = Sigmoid(b[t * ld_b + h]);
        db[t * nv + h] = dbeta[t * nv + h] * s * (1 - s);
      }
  }
};

// ---- 4. Gated RMSNorm: y = w · o · (mean(o²) + eps)^-1/2 · silu(z), per head.
struct GatedNormRef {
  int64_t T;
  int heads, d;
  int64_t ld_o, ld_z;
  double eps;

  std::vector<double> Forward(const std::vector<double>& o, const std::vector<double>& z,
                              const std::vector<double>& w) const {
    std::vector<double> y(T * heads * d);
    for (int64_t t = 0; t < T; ++t)
      for (int h = 0; h < heads; ++h) {
        const double* orow = &o[t * ld_o + h * d];
        const double* zrow = &z[t * ld_z + h * d];
        double ss = 0;
        for (int i = 0; i < d; ++i) ss += orow[i] * orow[i];
        const double r = 1 / std::sqrt(ss / d + eps);
        for (int i = 0; i < d; ++i) y[(t * heads + h) * d + i] = w[i] * orow[i] * r * Silu(zrow[i]);
      }
    return y;
  }
  // dy packed; d_o, dz packed; dw += .
  void Backward(const std::vector<double>& dy, const std::vector<double>& o, const std::vector<double>& z,
                const std::vector<double>& w, std::vector<double>& d_o, std::vector<double>& dz,
                std::vector<double>& dw) const {
    d_o.assign(T * heads * d, 0.0);
    dz.assign(T * heads * d, 0.0);
    std::vector<double> dn(d);
    for (int64_t t = 0; t < T; ++t)
      for (int h = 0; h < heads; ++h) {
        const double* orow = &o[t * ld_o + h * d];
        const double* zrow = &z[t * ld_z + h * d];
        const int64_t base = (t * heads + h) * d;
        double ss = 0;
        for (int i = 0; i < d; ++i) ss += orow[i] * orow[i];
        const double r = 1 / std::sqrt(ss / d + eps);
        double dot = 0;
        for (int i = 0; i < d; ++i) {
          const double n = orow[i] * r, g = dy[base + i];
          dn[i] = g * w[i] * Silu(zrow[i]);
          dw[i] += g * n * Silu(zrow[i]);
          dz[base + i] = g * w[i] * n * SiluGrad(zrow[i]);
          dot += dn[i] * n;
        }
        for (int i = 0; i < d; ++i) d_o[base + i] = r * (dn[i] - orow[i] * r * dot / d);
      }
  }
};

// ---- 5. Attention output gate: out = attn · σ(gate), gate at qp[t, h·2hd + hd + i].
struct GateRef {
  int64_t T;
  int heads, hd;
  int64_t ld_qp;

  double Gate(const std::vector<double>& qp, int64_t t, int h, int i) const {
    return qp[t * ld_qp + h * 2 * hd + hd + i];
  }
  std::vector<double> Forward(const std::vector<double>& attn, const std::vector<double>& qp) const {
    std::vector<double> out(T * heads * hd);
    for (int64_t t = 0; t < T; ++t)
      for (int h = 0; h < heads; ++h)
        for (int i = 0; i < hd; ++i) {
          const int64_t e = (t * heads + h) * hd + i;
          out[e] = attn[e] * Sigmoid(Gate(qp, t, h, i));
        }
    return out;
  }
  // dattn packed [T, heads·hd]; dgate packed [T, heads·hd].
  void Backward(const std::vector<double>& dout, const std::vector<double>& attn, const std::vector<double>& qp,
                std::vector<double>& dattn, std::vector<double>& dgate) const {
    dattn.assign(T * heads * hd, 0.0);
    dgate.assign(T * heads * hd, 0.0);
    for (int64_t t = 0; t < T; ++t)
      for (int h = 0; h < heads; ++h)
        for (int i = 0; i < hd; ++i) {
          const int64_t e = (t * heads + h) * hd + i;
          const double s = Sigmoid(Gate(qp, t, h, i));
          dattn[e] = dout[e] * s;
          dgate[e] = dout[e] * attn[e] * s * (1 - s);
        }
  }
};

std::vector<int32_t> CuSeqlens(const std::vector<int>& doc_lens) {
  std::vector<int32_t> cu{0};
  for (int n : doc_lens) cu.push_back(cu.back() + n);
  return cu;
}

// ================================================================================================
// Central differences of the references' forward passes against their backward passes (host only).

// ∂L/∂v[i] for L = Σ dy · f(v), by central differences over every element i of v.
std::vector<double> NumericGrad(std::vector<double>& v, const std::vector<double>& dy,
                                const std::function<std::vector<double>()>& f) {
  const double h = 1e-5;
  std::vector<double> grad(v.size());
  for (size_t i = 0; i < v.size(); ++i) {
    const double keep = v[i];
    double l[2];
    for (int k = 0; k < 2; ++k) {
      v[i] = keep + (k == 0 ? h : -h);
      const std::vector<double> y = f();
      l[k] = 0;
      for (size_t j = 0; j < y.size(); ++j) l[k] += dy[j] * y[j];
    }
    v[i] = keep;
    grad[i] = (l[0] - l[1]) / (2 * h);
  }
  return grad;
}

class GdnReference : public ::testing::Test {
 protected:
  void SetUp() override { Rng().seed(12345); }
};

TEST_F(GdnReference, ConvBackwardMatchesCentralDifferences) {
  // Documents of 2, 1 and 4 tokens, 3 channels at row stride 4, K = 3.
  ConvRef ref{CuSeqlens({2, 1, 4}), 7, 3, 3, 4};
  auto x = RandVec(ref.T * ref.ld_x), w = RandVec(ref.C * ref.K, 0.7), dy = RandVec(ref.T * ref.C);
  std::vector<double> dx, dw(ref.C * ref.K, 0.0);
  ref.Backward(dy, x, w, dx, dw);
  const auto num_x = NumericGrad(x, dy, [&] { return ref.Forward(x, w); });
  const auto num_w = NumericGrad(w, dy, [&] { return ref.Forward(x, w); });
  ExpectMaxRel("reference conv dx vs central differences", dx, Cols(num_x, ref.T, ref.ld_x, 0, ref.C), kTolCentralDiff);
  ExpectMaxRel("reference conv dw vs central differences", dw, num_w, kTolCentralDiff);
  // The padding column gets no gradient and the documents do not see each other.
  for (int64_t t = 0; t < ref.T; ++t) EXPECT_EQ(num_x[t * ref.ld_x + 3], 0.0);
}

TEST_F(GdnReference, L2NormBackwardMatchesCentralDifferences) {
  L2Ref ref{2, 2, 5, 11, 1e-6};
  auto x = RandVec(ref.T * ref.ld_x), dy = RandVec(ref.T * ref.heads * ref.d);
  const auto dx = ref.Backward(dy, x);
  const auto num = NumericGrad(x, dy, [&] { return ref.Forward(x); });
  ExpectMaxRel("reference l2norm dx vs central differences", dx, Cols(num, ref.T, ref.ld_x, 0, ref.heads * ref.d),
               kTolCentralDiff);
}

TEST_F(GdnReference, DecayBetaBackwardMatchesCentralDifferences) {
  DecayRef ref{3, 2, 3, 4};
  auto a = RandVec(ref.T * ref.ld_a, 2.0), b = RandVec(ref.T * ref.ld_b, 2.0), A_log = RandVec(ref.nv, 0.5, 1.0),
       dt_bias = RandVec(ref.nv, 0.5, 1.0);
  a[1] = 25.0;  // softplus above its threshold: identity, gradient 1
  const auto dg = RandVec(ref.T * ref.nv), dbeta = RandVec(ref.T * ref.nv);
  std::vector<double> da, db, dA_log(ref.nv, 0.0), ddt_bias(ref.nv, 0.0);
  ref.Backward(dg, dbeta, a, b, A_log, dt_bias, da, db, dA_log, ddt_bias);
  auto g_of = [&] {
    std::vector<double> g, beta;
    ref.Forward(a, b, A_log, dt_bias, g, beta);
    return g;
  };
  auto beta_of = [&] {
    std::vector<double> g, beta;
    ref.Forward(a, b, A_log, dt_bias, g, beta);
    return beta;
  };
  ExpectMaxRel("reference decay da vs central differences", da,
               Cols(NumericGrad(a, dg, g_of), ref.T, ref.ld_a, 0, ref.nv), kTolCentralDiff);
  ExpectMaxRel("reference decay db vs central differences", db,
               Cols(NumericGrad(b, dbeta, beta_of), ref.T, ref.ld_b, 0, ref.nv), kTolCentralDiff);
  ExpectMaxRel("reference decay dA_log vs central differences", dA_log, NumericGrad(A_log, dg, g_of), kTolCentralDiff);
  ExpectMaxRel("reference decay ddt_bias vs central differences", ddt_bias, NumericGrad(dt_bias, dg, g_of),
               kTolCentralDiff);
}

TEST_F(GdnReference, GatedRmsNormBackwardMatchesCentralDifferences) {
  GatedNormRef ref{2, 2, 6, 13, 15, 1e-6};
  auto o = RandVec(ref.T * ref.ld_o), z = RandVec(ref.T * ref.ld_z, 2.0), w = RandVec(ref.d, 0.2, 1.0);
  const auto dy = RandVec(ref.T * ref.heads * ref.d);
  std::vector<double> d_o, dz, dw(ref.d, 0.0);
  ref.Backward(dy, o, z, w, d_o, dz, dw);
  auto f = [&] { return ref.Forward(o, z, w); };
  const int64_t width = ref.heads * ref.d;
  ExpectMaxRel("reference gated rmsnorm d_o vs central differences", d_o,
               Cols(NumericGrad(o, dy, f), ref.T, ref.ld_o, 0, width), kTolCentralDiff);
  ExpectMaxRel("reference gated rmsnorm dz vs central differences", dz,
               Cols(NumericGrad(z, dy, f), ref.T, ref.ld_z, 0, width), kTolCentralDiff);
  ExpectMaxRel("reference gated rmsnorm dw vs central differences", dw, NumericGrad(w, dy, f), kTolCentralDiff);
}

TEST_F(GdnReference, AttnOutputGateBackwardMatchesCentralDifferences) {
  GateRef ref{2, 2, 3, 14};
  auto attn = RandVec(ref.T * ref.heads * ref.hd), qp = RandVec(ref.T * ref.ld_qp, 2.0);
  const auto dout = RandVec(ref.T * ref.heads * ref.hd);
  std::vector<double> dattn, dgate;
  ref.Backward(dout, attn, qp, dattn, dgate);
  auto f = [&] { return ref.Forward(attn, qp); };
  ExpectMaxRel("reference gate dattn vs central differences", dattn, NumericGrad(attn, dout, f), kTolCentralDiff);
  const auto num_qp = NumericGrad(qp, dout, f);
  std::vector<double> num_gate(ref.T * ref.heads * ref.hd);
  for (int64_t t = 0; t < ref.T; ++t)
    for (int h = 0; h < ref.heads; ++h)
      for (int i = 0; i < ref.hd; ++i) {
        num_gate[(t * ref.heads + h) * ref.hd + i] = num_qp[t * ref.ld_qp + h * 2 * ref.hd + ref.hd + i];
        EXPECT_EQ(num_qp[t * ref.ld_qp + h * 2 * ref.hd + i], 0.0);  // the query half does not act here
      }
  ExpectMaxRel("reference gate dgate vs central differences", dgate, num_gate, kTolCentralDiff);
}

// ================================================================================================
// GPU kernels against the references.

using GdnOpsGpuTest = GpuTest;

// ---- 1. Conv: forward, backward with BF16 dx and with FP32 dx (separate dw accumulators, which
// must agree bit for bit: same partial rows, same order).
void CheckConv(const std::vector<int>& doc_lens, int C, int64_t ld, int K) {
  ConvRef ref{CuSeqlens(doc_lens), 0, C, K, ld};
  ref.T = ref.cu.back();
  const int64_t T = ref.T;
  const int docs = static_cast<int>(doc_lens.size());
  const std::string tag = absl::StrCat(" (T=", T, " docs=", docs, " C=", C, " ld=", ld, " K=", K, ")");
  auto x = RandVec(T * ld), w = RandVec(int64_t{C} * K, 0.5), dy = RandVec(T * ld), dw0 = RandVec(int64_t{C} * K);
  std::unique_ptr<Dev<bf16>> dx_in(NewBf16(x)), dw_in(NewBf16(w));
  std::unique_ptr<Dev<float>> ddy(NewF32(dy)), dw_a(NewF32(dw0)), dw_b(NewF32(dw0));
  Dev<int32_t> cu(ref.cu.size());
  Upload(cu, ref.cu);
  Dev<bf16> y(T * ld), dx_bf16(T * ld);
  Dev<float> dx_f32(T * ld), ws(kernels::CausalConvSiluBackwardWorkspaceNumel(T, C, K));
  ASSERT_OK(
      kernels::CausalConvSiluForward(dx_in->get(), ld, dw_in->get(), cu.get(), docs, T, C, K, y.get(), ld, nullptr));
  ASSERT_OK(kernels::CausalConvSiluBackward(ddy->get(), ld, dx_in->get(), ld, dw_in->get(), cu.get(), docs, T, C, K,
                                            dx_bf16.get(), ld, dw_a->get(), ws.get(), nullptr));
  ASSERT_OK(kernels::CausalConvSiluBackward(ddy->get(), ld, dx_in->get(), ld, dw_in->get(), cu.get(), docs, T, C, K,
                                            dx_f32.get(), ld, dw_b->get(), ws.get(), nullptr));
  ASSERT_CUDA_OK(cudaDeviceSynchronize());
  std::vector<double> rdx, rdw = dw0;
  ref.Backward(Cols(dy, T, ld, 0, C), x, w, rdx, rdw);
  ExpectMaxRel("conv+silu fwd y" + tag, Cols(DownAll(y), T, ld, 0, C), ref.Forward(x, w), kTolBf16);
  ExpectMaxRel("conv+silu bwd dx bf16" + tag, Cols(DownAll(dx_bf16), T, ld, 0, C), rdx, kTolBf16);
  ExpectMaxRel("conv+silu bwd dx fp32" + tag, Cols(DownAll(dx_f32), T, ld, 0, C), rdx, kTolF32);
  const auto got_dw_a = DownAll(*dw_a), got_dw_b = DownAll(*dw_b);
  ExpectMaxRel("conv+silu bwd dw += (two-stage reduction)" + tag, got_dw_a, rdw, kTolF32);
  EXPECT_EQ(got_dw_a, got_dw_b) << "dw differs between two identical reductions" << tag;
}

TEST_F(GdnOpsGpuTest, ConvSiluDocuments1235) {
  for (int C : {37, 136}) CheckConv({1, 2, 3, 5}, C, C == 37 ? 45 : 152, 4);
}
TEST_F(GdnOpsGpuTest, ConvSiluAwkwardLengths) {
  for (int C : {37, 136}) {
    const int64_t ld = C == 37 ? 45 : 152;
    CheckConv({1}, C, ld, 4);
    CheckConv({3}, C, ld, 4);
    CheckConv({20, 1, 44}, C, ld, 4);
    CheckConv({1, 2, 3, 5, 0, 100, 146}, C, ld, 4);  // 257 tokens, an empty document
  }
}
TEST_F(GdnOpsGpuTest, ConvSiluKernelSizes) {
  for (int K : {1, 2, 3, 8}) {
    CheckConv({2, 1, 62}, 37, 45, K);
    CheckConv({2, 1, 62}, 136, 152, K);
  }
  CheckConv({65}, 8, 8, 4);  // contiguous rows, one vector per row
}

// ---- 2. L2 norm (q|k side by side: heads = 2·nk), y in BF16 and FP32.
template <typename TY>
void CheckL2Norm(int64_t T, int heads, int d, int64_t ld_x) {
  const int64_t width = int64_t{heads} * d;
  L2Ref ref{T, heads, d, ld_x, 1e-6};
  const std::string tag = absl::StrCat(" (T=", T, " heads=", heads, " d=", d, " ld=", ld_x, ")");
  auto x = RandVec(T * ld_x, 1.5), dy = RandVec(T * ld_x);
  std::unique_ptr<Dev<bf16>> dx_in(NewBf16(x));
  std::unique_ptr<Dev<float>> ddy(NewF32(dy));
  Dev<TY> y(T * width);
  Dev<float> dxo(T * ld_x);
  ASSERT_OK(kernels::L2NormHeadsForward(dx_in->get(), ld_x, T, heads, d, 1e-6f, y.get(), width, nullptr));
  ASSERT_OK(
      kernels::L2NormHeadsBackward(ddy->get(), ld_x, dx_in->get(), ld_x, T, heads, d, 1e-6f, dxo.get(), ld_x, nullptr));
  ASSERT_CUDA_OK(cudaDeviceSynchronize());
  constexpr bool f32 = std::is_same_v<TY, float>;
  ExpectMaxRel(std::string("l2norm fwd y ") + ActName<TY>() + tag, DownAll(y), ref.Forward(x),
               f32 ? kTolF32 : kTolBf16);
  ExpectMaxRel("l2norm bwd dx fp32" + tag, Cols(DownAll(dxo), T, ld_x, 0, width),
               ref.Backward(Cols(dy, T, ld_x, 0, width), x), kTolF32);
}

TEST_F(GdnOpsGpuTest, L2NormHeads) {
  for (int64_t T : {1, 3, 65, 257}) {
    CheckL2Norm<bf16>(T, 6, 128, 6 * 128 + 16);
    CheckL2Norm<float>(T, 6, 128, 6 * 128 + 16);
    CheckL2Norm<bf16>(T, 6, 37, 6 * 37 + 5);
    CheckL2Norm<float>(T, 6, 37, 6 * 37 + 5);
  }
  CheckL2Norm<bf16>(65, 2, 256, 512);
  CheckL2Norm<float>(65, 3, 68, 3 * 68);  // vector path, a partly idle second chunk
}

// ---- 3. Decay and beta. TP: the A_log / dt_bias type; TD: the da / db type.
template <typename TP, typename TD>
void CheckDecay(int64_t T, int nv) {
  DecayRef ref{T, nv, nv + 3, nv + 7};
  const std::string tag =
      absl::StrCat(" [", ActName<TP>(), " params, ", ActName<TD>(), " da/db] (T=", T, " nv=", nv, ")");
  auto a = RandVec(T * ref.ld_a, 2.0), b = RandVec(T * ref.ld_b, 2.0), A_log = RandVec(nv, 0.6, 1.5),
       dt_bias = RandVec(nv, 0.5, 1.0), dg = RandVec(T * nv), dbeta = RandVec(T * nv), dA0 = RandVec(nv),
       ddt0 = RandVec(nv);
  a[0] = 25.0;  // above the softplus threshold
  if (T * ref.ld_a > 2) a[2] = -30.0;
  std::unique_ptr<Dev<bf16>> d_a(NewBf16(a)), d_b(NewBf16(b));
  std::unique_ptr<Dev<TP>> d_Alog(NewAct<TP>(A_log)), d_dt(NewAct<TP>(dt_bias));
  std::unique_ptr<Dev<float>> d_dg(NewF32(dg)), d_dbeta(NewF32(dbeta)), d_dA(NewF32(dA0)), d_ddt(NewF32(ddt0));
  Dev<float> g(T * nv), beta(T * nv), ws(kernels::GdnDecayBetaBackwardWorkspaceNumel(T, nv));
  Dev<TD> da(T * ref.ld_a), db(T * ref.ld_b);
  ASSERT_OK(kernels::GdnDecayBetaForward(d_a->get(), ref.ld_a, d_b->get(), ref.ld_b, d_Alog->get(), d_dt->get(), T, nv,
                                         g.get(), beta.get(), nullptr));
  ASSERT_OK(kernels::GdnDecayBetaBackward(d_dg->get(), d_dbeta->get(), d_a->get(), ref.ld_a, d_b->get(), ref.ld_b,
                                          d_Alog->get(), d_dt->get(), T, nv, da.get(), ref.ld_a, db.get(), ref.ld_b,
                                          d_dA->get(), d_ddt->get(), ws.get(), nullptr));
  ASSERT_CUDA_OK(cudaDeviceSynchronize());
  // TP = bf16: the BF16-rounded parameters are exact in the reference too.
  std::vector<double> rg, rbeta, rda, rdb, rdA = dA0, rddt = ddt0;
  ref.Forward(a, b, A_log, dt_bias, rg, rbeta);
  ref.Backward(dg, dbeta, a, b, A_log, dt_bias, rda, rdb, rdA, rddt);
  constexpr double tol_d = std::is_same_v<TD, float> ? kTolF32 : kTolBf16;
  ExpectMaxRel("decay fwd g fp32" + tag, DownAll(g), rg, kTolF32);
  ExpectMaxRel("decay fwd beta fp32" + tag, DownAll(beta), rbeta, kTolF32);
  ExpectMaxRel("decay bwd da" + tag, Cols(DownAll(da), T, ref.ld_a, 0, nv), rda, tol_d);
  ExpectMaxRel("decay bwd db" + tag, Cols(DownAll(db), T, ref.ld_b, 0, nv), rdb, tol_d);
  ExpectMaxRel("decay bwd dA_log +=" + tag, DownAll(*d_dA), rdA, kTolF32);
  ExpectMaxRel("decay bwd ddt_bias +=" + tag, DownAll(*d_ddt), rddt, kTolF32);
}

TEST_F(GdnOpsGpuTest, DecayBeta) {
  for (int64_t T : {1, 3, 65, 257})
    for (int nv : {5, 40}) {
      CheckDecay<float, bf16>(T, nv);
      CheckDecay<float, float>(T, nv);
      CheckDecay<bf16, bf16>(T, nv);
    }
}

// ---- 4. Gated RMSNorm, BF16 and FP32 weights.
template <typename TW>
void CheckGatedRmsNorm(int64_t T, int heads, int d) {
  const int64_t width = int64_t{heads} * d;
  GatedNormRef ref{T, heads, d, width, width + 8, 1e-6};
  constexpr bool f32w = std::is_same_v<TW, float>;
  const std::string tag = absl::StrCat(" [", ActName<TW>(), " w] (T=", T, " heads=", heads, " d=", d, ")");
  auto o = RandVec(T * ref.ld_o, 0.7), z = RandVec(T * ref.ld_z, 2.0),
       w = f32w ? RandF32NormWeights(d, 0.2, 1.0) : RandVec(d, 0.2, 1.0), dy = RandVec(T * width), dw0 = RandVec(d);
  std::unique_ptr<Dev<bf16>> d_o_in(NewBf16(o)), d_z(NewBf16(z)), d_dy(NewBf16(dy));
  std::unique_ptr<Dev<TW>> d_w(NewAct<TW>(w));
  std::unique_ptr<Dev<float>> d_dw(NewF32(dw0));
  Dev<bf16> y(T * width), dz(T * ref.ld_z);
  Dev<float> d_o(T * width), ws(kernels::GatedRmsNormBackwardWorkspaceNumel(T, heads, d));
  ASSERT_OK(kernels::GatedRmsNormForward(d_o_in->get(), ref.ld_o, d_z->get(), ref.ld_z, d_w->get(), T, heads, d, 1e-6f,
                                         y.get(), width, nullptr));
  ASSERT_OK(kernels::GatedRmsNormBackward(d_dy->get(), width, d_o_in->get(), ref.ld_o, d_z->get(), ref.ld_z, d_w->get(),
                                          T, heads, d, 1e-6f, d_o.get(), width, dz.get(), ref.ld_z, d_dw->get(),
                                          ws.get(), nullptr));
  ASSERT_CUDA_OK(cudaDeviceSynchronize());
  std::vector<double> rdo, rdz, rdw = dw0;
  ref.Backward(dy, o, z, w, rdo, rdz, rdw);
  ExpectMaxRel("gated rmsnorm fwd y bf16" + tag, DownAll(y), ref.Forward(o, z, w), kTolBf16);
  ExpectMaxRel("gated rmsnorm bwd d_o fp32" + tag, DownAll(d_o), rdo, kTolF32);
  ExpectMaxRel("gated rmsnorm bwd dz bf16" + tag, Cols(DownAll(dz), T, ref.ld_z, 0, width), rdz, kTolBf16);
  ExpectMaxRel("gated rmsnorm bwd dw += (two-stage reduction)" + tag, DownAll(*d_dw), rdw, kTolF32);
}

TEST_F(GdnOpsGpuTest, GatedRmsNorm) {
  for (int64_t T : {1, 3, 65, 257}) {
    CheckGatedRmsNorm<bf16>(T, 3, 128);
    CheckGatedRmsNorm<float>(T, 3, 128);
    CheckGatedRmsNorm<bf16>(T, 3, 37);
    CheckGatedRmsNorm<float>(T, 3, 37);
  }
  CheckGatedRmsNorm<float>(65, 2, 256);
}

// ---- 5. Attention output gate; the backward once more in place (dattn = dout).
void CheckAttnGate(int64_t T, int heads, int hd, bool in_place) {
  const int64_t width = int64_t{heads} * hd, ld_qp = 2 * width + 8;
  GateRef ref{T, heads, hd, ld_qp};
  const std::string tag =
      absl::StrCat(" (T=", T, " heads=", heads, " hd=", hd, in_place ? ", dattn = dout in place)" : ")");
  auto attn = RandVec(T * width), qp = RandVec(T * ld_qp, 2.0), dout = RandVec(T * width), dqp0 = RandVec(T * ld_qp);
  std::unique_ptr<Dev<bf16>> d_attn(NewBf16(attn)), d_qp(NewBf16(qp)), d_dout(NewBf16(dout)), d_dqp(NewBf16(dqp0));
  Dev<bf16> out(T * width), dattn_sep(T * width);
  bf16* dattn = in_place ? d_dout->get() : dattn_sep.get();
  ASSERT_OK(kernels::AttnOutputGateForward(d_attn->get(), d_qp->get(), ld_qp, T, heads, hd, out.get(), nullptr));
  ASSERT_OK(kernels::AttnOutputGateBackward(d_dout->get(), d_attn->get(), d_qp->get(), ld_qp, T, heads, hd, dattn,
                                            d_dqp->get(), ld_qp, nullptr));
  ASSERT_CUDA_OK(cudaDeviceSynchronize());
  std::vector<double> rdattn, rdgate;
  ref.Backward(dout, attn, qp, rdattn, rdgate);
  const auto got_dqp = DownAll(*d_dqp);
  std::vector<double> got_gate(T * width), got_query(T * width), want_query(T * width);
  for (int64_t t = 0; t < T; ++t)
    for (int h = 0; h < heads; ++h)
      for (int i = 0; i < hd; ++i) {
        const int64_t e = (t * heads + h) * hd + i, q = t * ld_qp + h * 2 * hd + i;
        got_gate[e] = got_dqp[q + hd];
        got_query[e] = got_dqp[q];
        want_query[e] = dqp0[q];
      }
  ExpectMaxRel("attn gate fwd out bf16" + tag, DownAll(out), ref.Forward(attn, qp), kTolBf16);
  ExpectMaxRel("attn gate bwd dattn bf16" + tag, DownBf16(dattn, T * width), rdattn, kTolBf16);
  ExpectMaxRel("attn gate bwd dgate bf16 (into dqp)" + tag, got_gate, rdgate, kTolBf16);
  EXPECT_EQ(got_query, want_query) << "the query columns of dqp were written" << tag;
}

TEST_F(GdnOpsGpuTest, AttnOutputGate) {
  for (int64_t T : {1, 3, 65, 257}) {
    CheckAttnGate(T, 3, 128, false);
    CheckAttnGate(T, 3, 36, false);
  }
  CheckAttnGate(65, 3, 128, true);
  CheckAttnGate(65, 3, 36, true);
}

// Bad sizes are INVALID_ARGUMENT, before any launch.
TEST_F(GdnOpsGpuTest, RejectsBadSizes) {
  EXPECT_EQ(kernels::CausalConvSiluForward(nullptr, 8, nullptr, nullptr, 1, 4, 8, 9, nullptr, 8, nullptr).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(kernels::CausalConvSiluForward(nullptr, 7, nullptr, nullptr, 1, 4, 8, 4, nullptr, 8, nullptr).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(
      kernels::L2NormHeadsForward(nullptr, 300, 4, 1, 257, 1e-6f, static_cast<bf16*>(nullptr), 300, nullptr).code(),
      absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(kernels::GatedRmsNormForward(nullptr, 64, nullptr, 63, static_cast<const float*>(nullptr), 4, 1, 64, 1e-6f,
                                         nullptr, 64, nullptr)
                .code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(kernels::AttnOutputGateForward(nullptr, nullptr, 255, 4, 1, 128, nullptr, nullptr).code(),
            absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace slidedp
