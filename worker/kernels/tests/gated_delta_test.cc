// The gated delta rule's chunked CUDA kernels (gated_delta.h), forward and backward, against an FP64
// per-token reference of the recurrence and its hand-derived backward; the reference backward is
// itself checked against central differences first. Documents of awkward lengths (1, 63, 64, 65,
// 130, 200 tokens: partial chunks, exact chunks, one token past a chunk) packed in one row, key
// heads shared by value heads, every (dk, dv) in {64, 128}^2, and Qwen3.5's head shape. Outputs
// are NaN-poisoned before each call (a row left unwritten fails) and compared by max relative error
// max|got - ref| / max|ref|.
#include "worker/kernels/gated_delta.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <memory>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "worker/kernels/tests/gpu_test.h"
#include "worker/kernels/tests/kernel_test_util.h"

namespace slidedp {
namespace {

using namespace kernel_test;  // the test-support helpers (kernel_test_util.h, gpu_test.h)

using GatedDeltaGpuTest = GpuTest;

constexpr double kOutTol = 2e-2;   // o is BF16
constexpr double kGradTol = 1e-2;  // the FP32 gradients

struct Shape {
  std::vector<int> doc_lens;
  int nk, nv, dk, dv;
  int64_t tokens() const { return std::accumulate(doc_lens.begin(), doc_lens.end(), int64_t{0}); }
  std::vector<int32_t> cu() const {
    std::vector<int32_t> c{0};
    for (int l : doc_lens) c.push_back(c.back() + l);
    return c;
  }
  double scale() const { return 1.0 / std::sqrt(static_cast<double>(dk)); }
};

// The inputs as the kernels see them (q, k, v, d_o BF16-representable; g, beta FP32-representable).
struct Inputs {
  std::vector<double> q, k, v, g, beta, d_o;
};

struct Grads {
  std::vector<double> dq, dk, dv, dg, dbeta;
};

double Bf16Round(double x) { return Bf16ToFloat(FloatToBf16(static_cast<float>(x))); }

// Realistic data: q, k random then L2-normalised per head (then BF16), v and d_o ~ N(0, 1),
// beta = sigmoid(N(0, 1)), g = -exp(N(-1, 0.5)) softplus(N(0, 1)) (about -0.01 .. -3).
Inputs MakeInputs(const Shape& s) {
  const int64_t T = s.tokens();
  Inputs in;
  std::normal_distribution<double> n01(0.0, 1.0), nlog(-1.0, 0.5);
  auto normalised = [&](int heads, int dim) {
    std::vector<double> x(T * heads * dim);
    for (int64_t r = 0; r < T * heads; ++r) {
      double ss = 0;
      for (int i = 0; i < dim; ++i) {
        x[r * dim + i] = n01(Rng());
        ss += x[r * dim + i] * x[r * dim + i];
      }
      for (int i = 0; i < dim; ++i) x[r * dim + i] = Bf16Round(x[r * dim + i] / std::sqrt(ss + 1e-6));
    }
    return x;
  };
  in.q = normalised(s.nk, s.dk);
  in.k = normalised(s.nk, s.dk);
  in.v = RandVec(T * s.nv * s.dv);
  in.d_o = RandVec(T * s.nv * s.dv);
  in.g.resize(T * s.nv);
  in.beta.resize(T * s.nv);
  for (int64_t i = 0; i < T * s.nv; ++i) {
    const double a = n01(Rng()), e = std::exp(nlog(Rng()));
    in.g[i] = static_cast<float>(-e * std::log1p(std::exp(a)));
    in.beta[i] = static_cast<float>(1.0 / (1.0 + std::exp(-n01(Rng()))));
  }
  return in;
}

// ---------------------------------------------------------------- FP64 reference

// Per value head h, per document, per token t (S is dk x dv, zero at each document's start):
//   S' = e^{g_t} S;  p = S'^T k_t;  u = beta_t (v_t - p);  S_t = S' + k_t u^T;  o_t = scale S_t^T q_t.
// Backward of L = sum(o . d_o), tokens in reverse with dS = dL/dS_t (zero past the document):
//   dS += scale q_t do_t^T;  dq_t = scale S_t do_t;  du = dS^T k_t;  dk_t = dS u;
//   dbeta_t = du . (v_t - p);  dv_t = beta_t du;  dp = -beta_t du;  dk_t += S' dp;
//   dS' = dS + k_t dp^T;  dg_t = <S', dS'>;  dS(t-1) = e^{g_t} dS'.
// dq and dk of value heads sharing a key head add up.
void Reference(const Shape& s, const Inputs& in, std::vector<double>* o, Grads* gr) {
  const int64_t T = s.tokens();
  const int G = s.nv / s.nk, DK = s.dk, DV = s.dv;
  const double scale = s.scale();
  const std::vector<int32_t> cu = s.cu();
  o->assign(T * s.nv * DV, 0.0);
  if (gr != nullptr) {
    gr->dq.assign(T * s.nk * DK, 0.0);
    gr->dk.assign(T * s.nk * DK, 0.0);
    gr->dv.assign(T * s.nv * DV, 0.0);
    gr->dg.assign(T * s.nv, 0.0);
    gr->dbeta.assign(T * s.nv, 0.0);
  }
  // S x (a dk vector) -> dv vector, and y^T S (a dv vector) -> dk vector, S row-major [dk][dv]
  auto s_times = [&](const double* S, const double* x, double* out) {  // out[c] = sum_r S[r][c] x[r]
    std::fill(out, out + DV, 0.0);
    for (int r = 0; r < DK; ++r)
      for (int c = 0; c < DV; ++c) out[c] += S[r * DV + c] * x[r];
  };
  auto times_y = [&](const double* S, const double* y) {  // sum_c S[r][c] y[c] for each r
    std::vector<double> out(DK, 0.0);
    for (int r = 0; r < DK; ++r)
      for (int c = 0; c < DV; ++c) out[r] += S[r * DV + c] * y[c];
    return out;
  };
  std::vector<double> states, dS(DK * DV), Sp(DK * DV), p(DV), u(DV), du(DV), dp(DV), oc(DV);
  for (int h = 0; h < s.nv; ++h) {
    const int kh = h / G;
    for (size_t d = 0; d + 1 < cu.size(); ++d) {
      const int t0 = cu[d], L = cu[d + 1] - cu[d];
      states.assign(static_cast<size_t>(L + 1) * DK * DV, 0.0);  // states[i + 1]: after token t0 + i
      for (int i = 0; i < L; ++i) {
        const int64_t t = t0 + i;
        const double* q = &in.q[(t * s.nk + kh) * DK];
        const double* k = &in.k[(t * s.nk + kh) * DK];
        const double* v = &in.v[(t * s.nv + h) * DV];
        const double a = std::exp(in.g[t * s.nv + h]), b = in.beta[t * s.nv + h];
        double* S = &states[static_cast<size_t>(i + 1) * DK * DV];
        for (int j = 0; j < DK * DV; ++j) S[j] = a * states[static_cast<size_t>(i) * DK * DV + j];
        s_times(S, k, p.data());
        for (int c = 0; c < DV; ++c) u[c] = b * (v[c] - p[c]);
        for (int r = 0; r < DK; ++r)
          for (int c = 0; c < DV; ++c) S[r * DV + c] += k[r] * u[c];
        s_times(S, q, oc.data());
        for (int c = 0; c < DV; ++c) (*o)[(t * s.nv + h) * DV + c] = scale * oc[c];
      }
      if (gr == nullptr) continue;
      std::fill(dS.begin(), dS.end(), 0.0);
      for (int i = L - 1; i >= 0; --i) {
        const int64_t t = t0 + i;
        const double* q = &in.q[(t * s.nk + kh) * DK];
        const double* k = &in.k[(t * s.nk + kh) * DK];
        const double* v = &in.v[(t * s.nv + h) * DV];
        const double* dout = &in.d_o[(t * s.nv + h) * DV];
        const double a = std::exp(in.g[t * s.nv + h]), b = in.beta[t * s.nv + h];
        const double* S = &states[static_cast<size_t>(i + 1) * DK * DV];
        for (int j = 0; j < DK * DV; ++j) Sp[j] = a * states[static_cast<size_t>(i) * DK * DV + j];
        for (int r = 0; r < DK; ++r)
          for (int c = 0; c < DV; ++c) dS[r * DV + c] += scale * q[r] * dout[c];
        const std::vector<double> s_do = times_y(S, dout);
        for (int r = 0; r < DK; ++r) gr->dq[(t * s.nk + kh) * DK + r] += scale * s_do[r];
        s_times(Sp.data(), k, p.data());
        s_times(dS.data(), k, du.data());
        double dbeta = 0;
        for (int c = 0; c < DV; ++c) {
          u[c] = b * (v[c] - p[c]);
          dbeta += du[c] * (v[c] - p[c]);
          gr->dv[(t * s.nv + h) * DV + c] = b * du[c];
          dp[c] = -b * du[c];
        }
        gr->dbeta[t * s.nv + h] = dbeta;
        const std::vector<double> ds_u = times_y(dS.data(), u.data()), sp_dp = times_y(Sp.data(), dp.data());
        for (int r = 0; r < DK; ++r) gr->dk[(t * s.nk + kh) * DK + r] += ds_u[r] + sp_dp[r];
        double dg = 0;
        for (int r = 0; r < DK; ++r) {
          for (int c = 0; c < DV; ++c) {
            dS[r * DV + c] += k[r] * dp[c];
            dg += Sp[r * DV + c] * dS[r * DV + c];
            dS[r * DV + c] *= a;
          }
        }
        gr->dg[t * s.nv + h] = dg;
      }
    }
  }
}

// max|got - ref| / max|ref| (INFINITY if got holds a NaN or an inf), printed with its tolerance.
double MaxRelErr(const std::vector<double>& got, const std::vector<double>& ref) {
  if (got.size() != ref.size()) return INFINITY;
  double num = 0, den = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    if (!std::isfinite(got[i])) return INFINITY;
    num = std::max(num, std::fabs(got[i] - ref[i]));
    den = std::max(den, std::fabs(ref[i]));
  }
  return den == 0 ? num : num / den;
}

void ExpectMaxRel(const std::string& name, const std::vector<double>& got, const std::vector<double>& ref,
                  double tol) {
  const double err = MaxRelErr(got, ref);
  const bool ok = err <= tol;
  std::printf("%s  %-62s max_rel_err=%.3e tol=%.0e n=%zu\n", ok ? "PASS" : "FAIL", name.c_str(), err, tol, got.size());
  EXPECT_LE(err, tol) << name << ": max|got - ref| / max|ref| over " << got.size() << " elements";
}

// ---------------------------------------------------------------- running the kernels

std::string Describe(const Shape& s) {
  std::string docs;
  for (size_t i = 0; i < s.doc_lens.size(); ++i) absl::StrAppend(&docs, i ? "," : "", s.doc_lens[i]);
  return absl::StrCat("docs[", docs, "] nk=", s.nk, " nv=", s.nv, " dk=", s.dk, " dv=", s.dv);
}

kernels::GatedDeltaArgs ArgsFor(const Shape& s, const int32_t* cu_dev) {
  kernels::GatedDeltaArgs a;
  a.tokens = s.tokens();
  a.num_docs = static_cast<int>(s.doc_lens.size());
  a.cu_seqlens = cu_dev;
  a.num_k_heads = s.nk;
  a.num_v_heads = s.nv;
  a.k_dim = s.dk;
  a.v_dim = s.dv;
  a.scale = static_cast<float>(s.scale());
  return a;
}

// The kernels' results on the device for one shape and input set: o, and the gradients if asked.
struct DeviceRun {
  std::vector<double> o;
  Grads grads;
  std::vector<uint16_t> o_bits;  // o's raw BF16 bits, for the packing comparison
};

void RunKernels(const Shape& s, const Inputs& in, bool backward, DeviceRun* out) {
  const int64_t T = s.tokens();
  const kernels::GatedDeltaArgs host_args = ArgsFor(s, nullptr);
  const std::vector<int32_t> cu = s.cu();
  Dev<int32_t> cu_dev(cu.size());
  Upload(cu_dev, cu);
  const kernels::GatedDeltaArgs args = ArgsFor(s, cu_dev.get());
  std::unique_ptr<Dev<bf16>> q(NewBf16(in.q)), k(NewBf16(in.k)), v(NewBf16(in.v)), d_o(NewBf16(in.d_o));
  std::unique_ptr<Dev<float>> g(NewF32(in.g)), beta(NewF32(in.beta));
  Dev<bf16> o(T * s.nv * s.dv);
  const int64_t ws_bytes = std::max(kernels::GatedDeltaForwardWorkspaceBytes(host_args),
                                    backward ? kernels::GatedDeltaBackwardWorkspaceBytes(host_args) : int64_t{0});
  ASSERT_GT(ws_bytes, 0) << Describe(s);
  Dev<unsigned char> ws(ws_bytes);  // poisoned too: a read of an unwritten workspace row shows as NaN
  ASSERT_OK(kernels::GatedDeltaForward(args, q->get(), k->get(), v->get(), g->get(), beta->get(), o.get(), ws.get(),
                                       nullptr));
  ASSERT_CUDA_OK(cudaDeviceSynchronize());
  out->o = DownBf16(o.get(), T * s.nv * s.dv);
  out->o_bits.resize(T * s.nv * s.dv);
  ASSERT_CUDA_OK(cudaMemcpy(out->o_bits.data(), o.get(), out->o_bits.size() * 2, cudaMemcpyDeviceToHost));
  if (!backward) return;
  ws.Poison();
  Dev<float> dq(T * s.nk * s.dk), dk(T * s.nk * s.dk), dv(T * s.nv * s.dv), dg(T * s.nv), dbeta(T * s.nv);
  ASSERT_OK(kernels::GatedDeltaBackward(args, q->get(), k->get(), v->get(), g->get(), beta->get(), d_o->get(),
                                        dq.get(), dk.get(), dv.get(), dg.get(), dbeta.get(), ws.get(), nullptr));
  ASSERT_CUDA_OK(cudaDeviceSynchronize());
  out->grads.dq = DownF32(dq.get(), dq.n);
  out->grads.dk = DownF32(dk.get(), dk.n);
  out->grads.dv = DownF32(dv.get(), dv.n);
  out->grads.dg = DownF32(dg.get(), dg.n);
  out->grads.dbeta = DownF32(dbeta.get(), dbeta.n);
}

// Forward and backward of one shape against the reference.
void CheckShape(const Shape& s) {
  const Inputs in = MakeInputs(s);
  std::vector<double> ref_o;
  Grads ref;
  Reference(s, in, &ref_o, &ref);
  DeviceRun run;
  RunKernels(s, in, /*backward=*/true, &run);
  if (::testing::Test::HasFatalFailure()) return;
  const std::string tag = Describe(s);
  ExpectMaxRel("fwd o  " + tag, run.o, ref_o, kOutTol);
  ExpectMaxRel("bwd dq " + tag, run.grads.dq, ref.dq, kGradTol);
  ExpectMaxRel("bwd dk " + tag, run.grads.dk, ref.dk, kGradTol);
  ExpectMaxRel("bwd dv " + tag, run.grads.dv, ref.dv, kGradTol);
  ExpectMaxRel("bwd dg " + tag, run.grads.dg, ref.dg, kGradTol);
  ExpectMaxRel("bwd dbeta " + tag, run.grads.dbeta, ref.dbeta, kGradTol);
}

// ---------------------------------------------------------------- the reference's own check

// The reference backward against central differences of L = sum(o . d_o) in FP64, every input
// element of a tiny case (two documents, a shared key head, dk = dv = 4).
TEST(GatedDeltaReference, BackwardMatchesCentralDifferences) {
  Rng().seed(7);
  const Shape s{{3, 4}, 1, 2, 4, 4};
  Inputs in = MakeInputs(s);
  std::vector<double> o;
  Grads gr;
  Reference(s, in, &o, &gr);
  auto loss = [&](const Inputs& x) {
    std::vector<double> ox;
    Reference(s, x, &ox, nullptr);
    double l = 0;
    for (size_t i = 0; i < ox.size(); ++i) l += ox[i] * x.d_o[i];
    return l;
  };
  struct Wrt {
    const char* name;
    std::vector<double> Inputs::*x;
    std::vector<double> Grads::*dx;
  };
  const Wrt wrt[] = {{"q", &Inputs::q, &Grads::dq},
                     {"k", &Inputs::k, &Grads::dk},
                     {"v", &Inputs::v, &Grads::dv},
                     {"g", &Inputs::g, &Grads::dg},
                     {"beta", &Inputs::beta, &Grads::dbeta}};
  const double h = 1e-6;
  for (const Wrt& w : wrt) {
    std::vector<double> num((in.*w.x).size());
    for (size_t i = 0; i < num.size(); ++i) {
      Inputs plus = in, minus = in;
      (plus.*w.x)[i] += h;
      (minus.*w.x)[i] -= h;
      num[i] = (loss(plus) - loss(minus)) / (2 * h);
    }
    const double err = MaxRelErr(gr.*w.dx, num);
    std::printf("%s  reference d%-5s vs central differences max_rel_err=%.3e tol=1e-6\n", err <= 1e-6 ? "PASS" : "FAIL",
                w.name, err);
    EXPECT_LE(err, 1e-6) << "reference backward wrt " << w.name;
  }
}

// ---------------------------------------------------------------- kernel cases

TEST_F(GatedDeltaGpuTest, SingleDocumentLengths) {
  for (int len : {1, 63, 64, 65, 200}) CheckShape(Shape{{len}, 2, 4, 64, 64});
}

TEST_F(GatedDeltaGpuTest, PackedDocuments) { CheckShape(Shape{{1, 2, 63, 64, 65, 130}, 2, 4, 64, 64}); }

// Every (dk, dv) instantiation, a group of 1 (nk = nv) and a group of 4, an empty document.
TEST_F(GatedDeltaGpuTest, HeadShapes) {
  CheckShape(Shape{{70, 130}, 1, 2, 128, 64});
  CheckShape(Shape{{129, 0, 5}, 2, 2, 64, 128});  // an empty document in the row too
  CheckShape(Shape{{64, 100}, 1, 4, 128, 128});
}

// Qwen3.5's linear-attention heads: nk = 16, nv = 32, dk = dv = 128, three documents.
TEST_F(GatedDeltaGpuTest, Qwen35Heads) { CheckShape(Shape{{333, 64, 603}, 16, 32, 128, 128}); }

// A row of three documents gives exactly (bitwise) the output of each document run alone: the
// state never crosses a document and every chunk is computed the same way wherever it sits.
TEST_F(GatedDeltaGpuTest, PackingIsExact) {
  const Shape packed{{100, 64, 37}, 2, 4, 64, 128};
  const Inputs in = MakeInputs(packed);
  DeviceRun whole;
  RunKernels(packed, in, /*backward=*/false, &whole);
  if (HasFatalFailure()) return;
  int64_t row0 = 0, mismatched = 0;
  for (int len : packed.doc_lens) {
    const Shape one{{len}, packed.nk, packed.nv, packed.dk, packed.dv};
    auto rows = [&](const std::vector<double>& x, int64_t width) {
      return std::vector<double>(x.begin() + row0 * width, x.begin() + (row0 + len) * width);
    };
    const Inputs part{rows(in.q, packed.nk * packed.dk), rows(in.k, packed.nk * packed.dk),
                      rows(in.v, packed.nv * packed.dv), rows(in.g, packed.nv),
                      rows(in.beta, packed.nv),          rows(in.d_o, packed.nv * packed.dv)};
    DeviceRun alone;
    RunKernels(one, part, /*backward=*/false, &alone);
    if (HasFatalFailure()) return;
    const int64_t width = static_cast<int64_t>(packed.nv) * packed.dv;
    for (int64_t i = 0; i < len * width; ++i) mismatched += whole.o_bits[row0 * width + i] != alone.o_bits[i];
    row0 += len;
  }
  std::printf("%s  packed row of 3 documents vs each alone: %lld of %zu o elements differ (bitwise)\n",
              mismatched == 0 ? "PASS" : "FAIL", static_cast<long long>(mismatched), whole.o_bits.size());
  EXPECT_EQ(mismatched, 0);
}

TEST(GatedDeltaArgs, BadSizesAreInvalidArgument) {
  int32_t fake_cu = 0;
  const int32_t* cu = &fake_cu;
  auto args = [&](int nk, int nv, int dk, int dv, int docs) {
    kernels::GatedDeltaArgs a;
    a.tokens = 10;
    a.num_docs = docs;
    a.cu_seqlens = cu;
    a.num_k_heads = nk;
    a.num_v_heads = nv;
    a.k_dim = dk;
    a.v_dim = dv;
    a.scale = 0.1f;
    return a;
  };
  const kernels::GatedDeltaArgs bad[] = {args(2, 3, 64, 64, 1), args(1, 2, 96, 64, 1), args(1, 2, 64, 256, 1),
                                         args(1, 2, 64, 64, 0), args(0, 2, 64, 64, 1)};
  for (const kernels::GatedDeltaArgs& a : bad) {
    EXPECT_EQ(kernels::GatedDeltaForwardWorkspaceBytes(a), 0);
    EXPECT_EQ(kernels::GatedDeltaForward(a, nullptr, nullptr, nullptr, nullptr, nullptr, nullptr, nullptr, nullptr).code(),
              absl::StatusCode::kInvalidArgument);
    EXPECT_EQ(kernels::GatedDeltaBackward(a, nullptr, nullptr, nullptr, nullptr, nullptr, nullptr, nullptr, nullptr,
                                          nullptr, nullptr, nullptr, nullptr, nullptr)
                  .code(),
              absl::StatusCode::kInvalidArgument);
  }
  kernels::GatedDeltaArgs null_cu = args(1, 2, 64, 64, 1);
  null_cu.cu_seqlens = nullptr;
  EXPECT_GT(kernels::GatedDeltaForwardWorkspaceBytes(null_cu), 0);  // the query needs sizes only
  EXPECT_EQ(
      kernels::GatedDeltaForward(null_cu, nullptr, nullptr, nullptr, nullptr, nullptr, nullptr, nullptr, nullptr).code(),
      absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace slidedp
