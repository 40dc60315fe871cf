// GPU correctness check of every CUDA kernel and of the CUDA backend (not a ctest: CI has no GPU).
//
// Each check draws fresh random inputs (seed printed; pass --seed=N to repeat) at awkward sizes,
// poisons outputs with NaN before the run, and compares against an FP64 host reference (per
// kernel) or the FP32 CPU backend (whole layer/head/embedding) by relative L2 error
// ‖got − ref‖ / ‖ref‖ with the tolerance printed. Any NaN fails. Prints PASS/FAIL per check and
// exits non-zero on any failure.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <future>
#include <memory>
#include <random>
#include <string>
#include <type_traits>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "common/model/qwen3_config.h"
#include "common/numeric/bf16.h"
#include "nlohmann/json.hpp"
#include "worker/compute/backend.h"
#include "worker/compute/cuda/cuda_backend.h"
#include "worker/kernels/attention.h"
#include "worker/kernels/cross_entropy.h"
#include "worker/kernels/cudnn_attention.h"
#include "worker/kernels/embedding.h"
#include "worker/kernels/gemm.h"
#include "worker/kernels/qk_norm_rope.h"
#include "worker/kernels/reductions.h"
#include "worker/kernels/rmsnorm.h"
#include "worker/kernels/swiglu.h"

namespace slidedp {
namespace {

using kernels::bf16;

int g_failures = 0;
std::mt19937_64 g_rng;

#define CHECK_OK(expr)                                                                          \
  do {                                                                                          \
    absl::Status s_ = (expr);                                                                   \
    if (!s_.ok()) {                                                                             \
      std::printf("FAIL  %s -> %s (%s:%d)\n", #expr, s_.ToString().c_str(), __FILE__, __LINE__); \
      ++g_failures;                                                                             \
      return;                                                                                   \
    }                                                                                           \
  } while (0)
#define CUDA_OK(expr) CHECK_OK([&]() -> absl::Status { \
  cudaError_t e_ = (expr);                             \
  return e_ == cudaSuccess ? absl::OkStatus() : absl::InternalError(cudaGetErrorString(e_)); }())

double RelErr(const std::vector<double>& got, const std::vector<double>& ref) {
  double num = 0, den = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    if (!std::isfinite(got[i])) return INFINITY;
    num += (got[i] - ref[i]) * (got[i] - ref[i]);
    den += ref[i] * ref[i];
  }
  return den == 0 ? std::sqrt(num) : std::sqrt(num / den);
}

void Report(const std::string& name, const std::vector<double>& got, const std::vector<double>& ref, double tol) {
  double err = got.size() == ref.size() ? RelErr(got, ref) : INFINITY;
  const bool ok = err <= tol;
  if (!ok) ++g_failures;
  std::printf("%s  %-58s rel_err=%.3e tol=%.1e n=%zu\n", ok ? "PASS" : "FAIL", name.c_str(), err, tol, got.size());
}

// Host data helpers: random BF16-representable values, kept as doubles for the reference.
std::vector<double> RandVec(int64_t n, double scale = 1.0, double mean = 0.0) {
  std::normal_distribution<double> d(mean, scale);
  std::vector<double> v(n);
  for (auto& x : v) x = Bf16ToFloat(FloatToBf16(static_cast<float>(d(g_rng))));
  return v;
}
std::vector<bf16_t> ToBf16(const std::vector<double>& v) {
  std::vector<bf16_t> o(v.size());
  for (size_t i = 0; i < v.size(); ++i) o[i] = FloatToBf16(static_cast<float>(v[i]));
  return o;
}
std::vector<float> ToF32(const std::vector<double>& v) { return std::vector<float>(v.begin(), v.end()); }
// Norm weights as FP32 master weights: BF16 values around `mean` plus fine-tuning updates of
// 0.25..0.45 BF16 ulp with random sign, the largest that rounding to BF16 still loses entirely.
// The values are FP32-exact and not BF16-representable.
std::vector<double> RandF32NormWeights(int64_t n, double scale, double mean) {
  std::uniform_real_distribution<double> frac(0.25, 0.45);
  std::bernoulli_distribution negative(0.5);
  std::vector<double> v = RandVec(n, scale, mean);
  for (auto& x : v) {
    const double ulp = x == 0 ? 0.0 : std::ldexp(1.0, std::ilogb(x) - 7);  // BF16: 7 stored mantissa bits
    x = static_cast<float>(x + (negative(g_rng) ? -1 : 1) * frac(g_rng) * ulp);
  }
  return v;
}

// Least-squares gain of got against ref per column of a [rows, cols] row-major matrix:
// g[c] = Σ_r got·ref / Σ_r ref². BF16 output rounding averages out over the rows, so a per-column
// scale error such as an FP32 norm weight rounded to BF16 shows as |g - 1|, while it hides inside
// the element-wise tolerance. Compare against ones with Report.
std::vector<double> ColumnGain(const std::vector<double>& got, const std::vector<double>& ref, int64_t cols) {
  std::vector<double> num(cols, 0.0), den(cols, 0.0);
  for (size_t i = 0; i < got.size() && i < ref.size(); ++i) {
    num[i % cols] += got[i] * ref[i];
    den[i % cols] += ref[i] * ref[i];
  }
  for (int64_t c = 0; c < cols; ++c) num[c] = den[c] == 0 ? 1.0 : num[c] / den[c];
  return num;
}

template <typename T>
struct Dev {
  T* p = nullptr;
  size_t n = 0;
  explicit Dev(size_t count) : n(count) {
    if (cudaMalloc(&p, std::max<size_t>(1, n) * sizeof(T)) != cudaSuccess) p = nullptr;
    Poison();
  }
  ~Dev() { cudaFree(p); }
  Dev(const Dev&) = delete;
  void Poison() { cudaMemset(p, 0xFF, n * sizeof(T)); cudaDeviceSynchronize(); }  // BF16 0xFFFF and FP32 0xFFFFFFFF are NaN
  T* get() const { return p; }
};

template <typename T>
void Upload(Dev<T>& d, const std::vector<T>& h) {
  cudaMemcpy(d.p, h.data(), h.size() * sizeof(T), cudaMemcpyHostToDevice);
}
std::vector<double> DownBf16(const bf16* p, size_t n) {
  std::vector<bf16_t> h(n);
  cudaMemcpy(h.data(), p, n * 2, cudaMemcpyDeviceToHost);
  std::vector<double> o(n);
  for (size_t i = 0; i < n; ++i) o[i] = Bf16ToFloat(h[i]);
  return o;
}
std::vector<double> DownF32(const float* p, size_t n) {
  std::vector<float> h(n);
  cudaMemcpy(h.data(), p, n * 4, cudaMemcpyDeviceToHost);
  return std::vector<double>(h.begin(), h.end());
}
Dev<bf16>* NewBf16(const std::vector<double>& v) {
  auto* d = new Dev<bf16>(v.size());
  auto h = ToBf16(v);
  cudaMemcpy(d->p, h.data(), h.size() * 2, cudaMemcpyHostToDevice);
  return d;
}

Dev<float>* NewF32(const std::vector<double>& v) {
  auto* d = new Dev<float>(v.size());
  auto h = ToF32(v);
  cudaMemcpy(d->p, h.data(), h.size() * 4, cudaMemcpyHostToDevice);
  return d;
}
// Typed helpers: T is bf16 (BF16 residual stream) or float (FP32 residual stream, or FP32 norm
// weights).
template <typename T>
Dev<T>* NewAct(const std::vector<double>& v) {
  if constexpr (std::is_same_v<T, bf16>) {
    return NewBf16(v);
  } else {
    return NewF32(v);
  }
}
std::vector<double> Down(const bf16* p, size_t n) { return DownBf16(p, n); }
std::vector<double> Down(const float* p, size_t n) { return DownF32(p, n); }
template <typename T>
const char* ActName() {
  return std::is_same_v<T, bf16> ? "bf16" : "fp32";
}

// ------------------------------------------------------------------ GEMM
void CheckGemm() {
  GemmRunner runner;
  CHECK_OK(runner.Init());
  cudaStream_t s = nullptr;
  {  // forward NT, output into a column slice of a wider buffer
    const int64_t M = 77, N = 136, K = 264, LDD = 200, COL = 24;
    auto x = RandVec(M * K), w = RandVec(N * K);
    std::unique_ptr<Dev<bf16>> dx(NewBf16(x)), dw(NewBf16(w));
    Dev<bf16> y(M * LDD);
    GemmArgs g;
    g.m = M; g.n = N; g.k = K; g.a = dx->get(); g.lda = K; g.b = dw->get(); g.ldb = K;
    g.d = y.get() + COL; g.ldd = LDD;
    CHECK_OK(runner.Run(g, s));
    CUDA_OK(cudaDeviceSynchronize());
    auto got_all = DownBf16(y.get(), M * LDD);
    std::vector<double> got, ref;
    for (int64_t i = 0; i < M; ++i)
      for (int64_t j = 0; j < N; ++j) {
        double r = 0;
        for (int64_t k = 0; k < K; ++k) r += x[i * K + k] * w[j * K + k];
        ref.push_back(r);
        got.push_back(got_all[i * LDD + COL + j]);
      }
    Report("gemm fwd X·Wᵀ bf16 (77x136x264, strided out)", got, ref, 5e-3);
    bool untouched = std::isnan(got_all[0]) && std::isnan(got_all[M * LDD - 1]);
    if (!untouched) ++g_failures;
    std::printf("%s  %-58s\n", untouched ? "PASS" : "FAIL", "gemm leaves columns outside its slice alone");
  }
  {  // dgrad NN with a residual C
    const int64_t M = 301, N = 264, K = 136;
    auto a = RandVec(M * K), b = RandVec(K * N), c = RandVec(M * N);
    std::unique_ptr<Dev<bf16>> da(NewBf16(a)), db(NewBf16(b)), dc(NewBf16(c));
    Dev<bf16> d(M * N);
    GemmArgs g;
    g.op_b = GemmOp::kN; g.m = M; g.n = N; g.k = K; g.a = da->get(); g.lda = K; g.b = db->get(); g.ldb = N;
    g.c = dc->get(); g.ldc = N; g.d = d.get(); g.ldd = N; g.beta = 1.0f;
    CHECK_OK(runner.Run(g, s));
    CUDA_OK(cudaDeviceSynchronize());
    std::vector<double> ref(M * N);
    for (int64_t i = 0; i < M; ++i)
      for (int64_t j = 0; j < N; ++j) {
        double r = c[i * N + j];
        for (int64_t k = 0; k < K; ++k) r += a[i * K + k] * b[k * N + j];
        ref[i * N + j] = r;
      }
    Report("gemm dgrad A·B + C bf16 (301x264x136)", DownBf16(d.get(), M * N), ref, 5e-3);
  }
  {  // wgrad TN into FP32 with beta = 1, twice (accumulation across micro-batches)
    const int64_t M = 136, N = 72, K = 515;
    auto a = RandVec(K * M), b = RandVec(K * N), d0 = RandVec(M * N);
    std::unique_ptr<Dev<bf16>> da(NewBf16(a)), db(NewBf16(b));
    Dev<float> d(M * N);
    Upload(d, ToF32(d0));
    GemmArgs g;
    g.op_a = GemmOp::kT; g.op_b = GemmOp::kN; g.m = M; g.n = N; g.k = K; g.a = da->get(); g.lda = M;
    g.b = db->get(); g.ldb = N; g.c = d.get(); g.ldc = N; g.d = d.get(); g.ldd = N;
    g.out_type = GemmOutType::kF32; g.beta = 1.0f;
    CHECK_OK(runner.Run(g, s));
    CHECK_OK(runner.Run(g, s));
    CUDA_OK(cudaDeviceSynchronize());
    std::vector<double> ref(M * N);
    for (int64_t i = 0; i < M; ++i)
      for (int64_t j = 0; j < N; ++j) {
        double r = 0;
        for (int64_t k = 0; k < K; ++k) r += a[k * M + i] * b[k * N + j];
        ref[i * N + j] = d0[i * N + j] + 2 * r;
      }
    Report("gemm wgrad Aᵀ·B fp32 += (136x72x515, twice)", DownF32(d.get(), M * N), ref, 1e-5);
  }
}

// ------------------------------------------------------------------ RMSNorm
// TA: the residual-stream type of x, dy, dres and dx (y is BF16 either way). TW: the norm weight
// type; FP32 weights are not BF16-representable and the reference uses them exactly.
template <typename TA, typename TW>
void CheckRmsNorm() {
  const int64_t R = 333, H = 264;
  const double eps = 1e-6;
  constexpr bool f32w = std::is_same_v<TW, float>;
  auto x = RandVec(R * H, 1.5), w = f32w ? RandF32NormWeights(H, 0.2, 1.0) : RandVec(H, 0.2, 1.0),
       dy = RandVec(R * H), dres = RandVec(R * H), dw0 = RandVec(H);
  std::unique_ptr<Dev<TW>> dw_(NewAct<TW>(w));
  std::unique_ptr<Dev<TA>> dx_(NewAct<TA>(x)), ddy(NewAct<TA>(dy)), ddres(NewAct<TA>(dres));
  Dev<bf16> y(R * H);
  Dev<TA> dxo(R * H);
  Dev<float> rstd(R), dwacc(H), ws(kernels::RmsNormBackwardWorkspaceNumel(R, H));
  Upload(dwacc, ToF32(dw0));
  CHECK_OK(kernels::RmsNormForward(dx_->get(), dw_->get(), R, H, eps, y.get(), rstd.get(), nullptr));
  CHECK_OK(kernels::RmsNormBackward(ddy->get(), dx_->get(), dw_->get(), rstd.get(), ddres->get(), R, H, dxo.get(),
                                    dwacc.get(), ws.get(), nullptr));
  CUDA_OK(cudaDeviceSynchronize());
  std::vector<double> ry(R * H), rr(R), rdx(R * H), rdw = dw0;
  for (int64_t r = 0; r < R; ++r) {
    double ss = 0;
    for (int64_t c = 0; c < H; ++c) ss += x[r * H + c] * x[r * H + c];
    const double rs = 1.0 / std::sqrt(ss / H + eps);
    rr[r] = rs;
    double dot = 0;
    for (int64_t c = 0; c < H; ++c) {
      ry[r * H + c] = w[c] * x[r * H + c] * rs;
      dot += dy[r * H + c] * w[c] * x[r * H + c] * rs;
      rdw[c] += dy[r * H + c] * x[r * H + c] * rs;
    }
    dot /= H;
    for (int64_t c = 0; c < H; ++c)
      rdx[r * H + c] = dres[r * H + c] + rs * (dy[r * H + c] * w[c] - x[r * H + c] * rs * dot);
  }
  // FP32 dx is FP32 math on exact inputs (no BF16 output rounding): 1e-4 instead of 5e-3.
  const bool f32 = std::is_same_v<TA, float>;
  const std::string tag = std::string(" [") + ActName<TA>() + " x]" + (f32w ? " [fp32 w]" : "");
  const auto got_y = DownBf16(y.get(), R * H), got_dx = Down(dxo.get(), R * H);
  Report("rmsnorm fwd y (333x264)" + tag, got_y, ry, 5e-3);
  Report("rmsnorm fwd rstd" + tag, DownF32(rstd.get(), R), rr, 1e-5);
  Report("rmsnorm bwd dx (+residual grad)" + tag, got_dx, rdx, f32 ? 1e-4 : 5e-3);
  Report("rmsnorm bwd dw += (two-stage reduction)" + tag, DownF32(dwacc.get(), H), rdw, 1e-5);
  if (f32w) {
    // The weight must act unrounded: RMS of the per-column gains' distance from 1 under 6e-4 (a
    // simulation of the kernels' FP32 math gave <= 2.5e-4; with the weights rounded to BF16,
    // >= 1.4e-3, while the element-wise errors stay inside 5e-3). dx without the residual grad,
    // so that dres does not dilute the weight's part.
    std::vector<double> got_dn(R * H), ref_dn(R * H);
    for (int64_t i = 0; i < R * H; ++i) { got_dn[i] = got_dx[i] - dres[i]; ref_dn[i] = rdx[i] - dres[i]; }
    const std::vector<double> ones(H, 1.0);
    Report("rmsnorm fwd y per-column gain" + tag, ColumnGain(got_y, ry, H), ones, 6e-4);
    Report("rmsnorm bwd dx - dres per-column gain" + tag, ColumnGain(got_dn, ref_dn, H), ones, 6e-4);
  }
}

// ------------------------------------------------------------------ q/k norm + RoPE
// TW: the q_norm / k_norm weight type, as in CheckRmsNorm.
template <typename TW>
void CheckQkRope(int hd) {
  constexpr bool f32w = std::is_same_v<TW, float>;
  const int nq = 4, nkv = 2;
  const std::vector<int> docs = {13, 40, 24};
  int64_t T = 0;
  std::vector<int32_t> pos;
  for (int d : docs) {
    for (int i = 0; i < d; ++i) pos.push_back(i * 37 + 5);  // large positions exercise the angles
    T += d;
  }
  const int64_t ld = (nq + 2 * nkv) * hd + 8;
  const double eps = 1e-6, theta = 1e6;
  auto qkv = RandVec(T * ld, 1.3);
  auto qw = f32w ? RandF32NormWeights(hd, 0.2, 1.0) : RandVec(hd, 0.2, 1.0);
  auto kw = f32w ? RandF32NormWeights(hd, 0.2, 1.0) : RandVec(hd, 0.2, 1.0);
  auto gq = RandVec(T * nq * hd), gk = RandVec(T * nkv * hd), dqw0 = RandVec(hd), dkw0 = RandVec(hd);
  std::unique_ptr<Dev<bf16>> dqkv_in(NewBf16(qkv)), dgq(NewBf16(gq)), dgk(NewBf16(gk));
  std::unique_ptr<Dev<TW>> dqw(NewAct<TW>(qw)), dkw(NewAct<TW>(kw));
  Dev<int32_t> dpos(T);
  Upload(dpos, pos);
  Dev<bf16> qo(T * nq * hd), ko(T * nkv * hd), dqkv(T * ld);
  kernels::RopeArgs a;
  a.tokens = T; a.num_q_heads = nq; a.num_kv_heads = nkv; a.head_dim = hd; a.eps = eps; a.theta = theta;
  Dev<float> accq(hd), acck(hd), ws(kernels::QkNormRopeBackwardWorkspaceNumel(a));
  Upload(accq, ToF32(dqw0));
  Upload(acck, ToF32(dkw0));
  CHECK_OK(kernels::QkNormRopeForward(a, dqkv_in->get(), ld, dqw->get(), dkw->get(), dpos.get(), qo.get(), ko.get(),
                                      nullptr));
  CHECK_OK(kernels::QkNormRopeBackward(a, dgq->get(), dgk->get(), dqkv_in->get(), ld, dqw->get(), dkw->get(),
                                       dpos.get(), dqkv.get(), ld, accq.get(), acck.get(), ws.get(), nullptr));
  CUDA_OK(cudaDeviceSynchronize());
  std::vector<double> rq(T * nq * hd), rk(T * nkv * hd), rdq, gotdq, rdqw = dqw0, rdkw = dkw0;
  auto got_dqkv = DownBf16(dqkv.get(), T * ld);
  const int half = hd / 2;
  for (int64_t t = 0; t < T; ++t)
    for (int h = 0; h < nq + nkv; ++h) {
      const bool isq = h < nq;
      const double* xw = isq ? qw.data() : kw.data();
      std::vector<double> xv(hd), n(hd), out(hd), g(hd), dn(hd), c(half), s(half);
      double ss = 0;
      for (int i = 0; i < hd; ++i) { xv[i] = qkv[t * ld + h * hd + i]; ss += xv[i] * xv[i]; }
      const double r = 1.0 / std::sqrt(ss / hd + eps);
      for (int i = 0; i < hd; ++i) n[i] = xv[i] * r * xw[i];
      for (int i = 0; i < half; ++i) {
        const double ang = pos[t] / std::pow(theta, 2.0 * i / hd);
        c[i] = std::cos(ang); s[i] = std::sin(ang);
        out[i] = n[i] * c[i] - n[i + half] * s[i];
        out[i + half] = n[i + half] * c[i] + n[i] * s[i];
      }
      for (int i = 0; i < hd; ++i) {
        if (isq) { rq[t * nq * hd + h * hd + i] = out[i]; g[i] = gq[t * nq * hd + h * hd + i]; }
        else { rk[t * nkv * hd + (h - nq) * hd + i] = out[i]; g[i] = gk[t * nkv * hd + (h - nq) * hd + i]; }
      }
      for (int i = 0; i < half; ++i) {
        dn[i] = g[i] * c[i] + g[i + half] * s[i];
        dn[i + half] = g[i + half] * c[i] - g[i] * s[i];
      }
      double dot = 0;
      for (int i = 0; i < hd; ++i) dot += dn[i] * xw[i] * xv[i];
      for (int i = 0; i < hd; ++i) {
        rdq.push_back(r * xw[i] * dn[i] - xv[i] * r * r * r * dot / hd);
        gotdq.push_back(got_dqkv[t * ld + h * hd + i]);
        (isq ? rdqw : rdkw)[i] += dn[i] * xv[i] * r;
      }
    }
  const std::string tag = " (hd=" + std::to_string(hd) + ")" + (f32w ? " [fp32 w]" : "");
  const auto got_q = DownBf16(qo.get(), T * nq * hd), got_k = DownBf16(ko.get(), T * nkv * hd);
  Report("qk-norm+rope fwd q" + tag, got_q, rq, 5e-3);
  Report("qk-norm+rope fwd k" + tag, got_k, rk, 5e-3);
  Report("qk-norm+rope bwd dq,dk raw" + tag, gotdq, rdq, 5e-3);
  Report("qk-norm+rope bwd dq_norm_w +=" + tag, DownF32(accq.get(), hd), rdqw, 1e-4);
  Report("qk-norm+rope bwd dk_norm_w +=" + tag, DownF32(acck.get(), hd), rdkw, 1e-4);
  if (f32w) {
    // As in CheckRmsNorm: per-dimension gains (rows = token x head) show a weight rounded to BF16.
    // RoPE's FP32 angle error rotates the output, orthogonal to it, so it adds little here.
    const std::vector<double> ones(hd, 1.0);
    Report("qk-norm+rope fwd q per-dim gain" + tag, ColumnGain(got_q, rq, hd), ones, 6e-4);
    Report("qk-norm+rope fwd k per-dim gain" + tag, ColumnGain(got_k, rk, hd), ones, 6e-4);
    Report("qk-norm+rope bwd dq,dk raw per-dim gain" + tag, ColumnGain(gotdq, rdq, hd), ones, 6e-4);
  }
}

// ------------------------------------------------------------------ SwiGLU
void CheckSwiGlu() {
  const int64_t T = 77, I = 200;
  auto gu = RandVec(T * 2 * I, 2.0), da = RandVec(T * I);
  std::unique_ptr<Dev<bf16>> dgu_in(NewBf16(gu)), dda(NewBf16(da));
  Dev<bf16> act(T * I), dgu(T * 2 * I);
  CHECK_OK(kernels::SwiGluForward(dgu_in->get(), T, I, act.get(), nullptr));
  CHECK_OK(kernels::SwiGluBackward(dgu_in->get(), dda->get(), T, I, dgu.get(), nullptr));
  CUDA_OK(cudaDeviceSynchronize());
  std::vector<double> ra(T * I), rg(T * 2 * I);
  for (int64_t t = 0; t < T; ++t)
    for (int64_t i = 0; i < I; ++i) {
      const double g = gu[t * 2 * I + i], u = gu[t * 2 * I + I + i], sg = 1 / (1 + std::exp(-g));
      ra[t * I + i] = g * sg * u;
      rg[t * 2 * I + i] = da[t * I + i] * u * sg * (1 + g * (1 - sg));
      rg[t * 2 * I + I + i] = da[t * I + i] * g * sg;
    }
  Report("swiglu fwd (77x200)", DownBf16(act.get(), T * I), ra, 5e-3);
  Report("swiglu bwd", DownBf16(dgu.get(), T * 2 * I), rg, 5e-3);
}

// ------------------------------------------------------------------ Embedding
// TA: the output / dout type (BF16 or FP32 residual stream).
template <typename TA>
void CheckEmbedding() {
  const int64_t V = 300, H = 136, T = 517;
  auto table = RandVec(V * H), dout = RandVec(T * H), acc0 = RandVec(V * H);
  std::vector<int32_t> tok(T);
  std::uniform_int_distribution<int> ud(0, 59);  // only 60 ids used: many duplicates
  for (auto& t : tok) t = ud(g_rng) * 5;
  std::vector<int32_t> order(T);
  for (int i = 0; i < T; ++i) order[i] = i;
  std::stable_sort(order.begin(), order.end(), [&](int a, int b) { return tok[a] < tok[b]; });
  std::vector<int32_t> uniq, seg;
  for (int i = 0; i < T; ++i)
    if (i == 0 || tok[order[i]] != tok[order[i - 1]]) { uniq.push_back(tok[order[i]]); seg.push_back(i); }
  seg.push_back(T);
  std::unique_ptr<Dev<bf16>> dtab(NewBf16(table));
  std::unique_ptr<Dev<TA>> ddout(NewAct<TA>(dout));
  Dev<int32_t> dtok(T), duniq(uniq.size()), dseg(seg.size()), dord(T);
  Upload(dtok, tok); Upload(duniq, uniq); Upload(dseg, seg); Upload(dord, order);
  Dev<TA> out(T * H);
  Dev<float> acc(V * H);
  Upload(acc, ToF32(acc0));
  CHECK_OK(kernels::EmbeddingForward(dtab->get(), dtok.get(), T, H, out.get(), nullptr));
  CHECK_OK(kernels::EmbeddingBackward(ddout->get(), duniq.get(), dseg.get(), dord.get(), uniq.size(), H, acc.get(),
                                      nullptr));
  CUDA_OK(cudaDeviceSynchronize());
  std::vector<double> rf(T * H), rb = acc0;
  for (int64_t t = 0; t < T; ++t)
    for (int64_t c = 0; c < H; ++c) {
      rf[t * H + c] = table[tok[t] * H + c];
      rb[tok[t] * H + c] += dout[t * H + c];
    }
  const std::string tag = std::string(" [") + ActName<TA>() + "]";
  Report("embedding fwd gather (517 tokens, 136 wide)" + tag, Down(out.get(), T * H), rf, 0.0);
  Report("embedding bwd += (deterministic grouping)" + tag, DownF32(acc.get(), V * H), rb, 1e-6);

  // FP32 rows (runtime.embedding_rows: fp32) read in place from registered host memory through
  // its mapped device pointer, as the workers read the master; values off the BF16 grid, so the
  // FP32 output must be exact and the BF16 one their round-to-nearest-even.
  std::vector<float> table32(V * H);
  std::uniform_real_distribution<float> jitter(-1e-3f, 1e-3f);
  for (int64_t i = 0; i < V * H; ++i) table32[i] = static_cast<float>(table[i]) * (1.0f + jitter(g_rng)) + 1e-4f;
  CUDA_OK(cudaHostRegister(table32.data(), table32.size() * 4, cudaHostRegisterDefault));
  float* mapped = nullptr;
  CUDA_OK(cudaHostGetDevicePointer(reinterpret_cast<void**>(&mapped), table32.data(), 0));
  CHECK_OK(kernels::EmbeddingForward(mapped, dtok.get(), T, H, out.get(), nullptr));
  CUDA_OK(cudaDeviceSynchronize());
  std::vector<double> r32(T * H);
  for (int64_t t = 0; t < T; ++t)
    for (int64_t c = 0; c < H; ++c) {
      const float v = table32[tok[t] * H + c];
      r32[t * H + c] = std::is_same_v<TA, float> ? v : Bf16ToFloat(FloatToBf16(v));
    }
  Report("embedding fwd gather, FP32 rows from mapped host memory" + tag, Down(out.get(), T * H), r32, 0.0);
  CUDA_OK(cudaHostUnregister(table32.data()));
}

// ------------------------------------------------------------------ FP32 residual add
void CheckAddBf16ToF32() {
  const int64_t n = 1000003;  // odd: the grid-stride tail
  std::normal_distribution<float> d(0.0f, 3.0f);
  std::vector<float> res(n);
  for (auto& v : res) v = d(g_rng);  // full FP32 values, not BF16-representable
  auto branch = RandVec(n, 0.5);
  std::unique_ptr<Dev<bf16>> db(NewBf16(branch));
  Dev<float> dres(n), out(n);
  Upload(dres, res);
  CHECK_OK(kernels::AddBf16ToF32(dres.get(), db->get(), n, out.get(), nullptr));
  CHECK_OK(kernels::AddBf16ToF32(dres.get(), db->get(), n, dres.get(), nullptr));  // in place (out aliases res)
  CUDA_OK(cudaDeviceSynchronize());
  std::vector<double> ref(n);  // one FP32 add each: exact agreement expected
  for (int64_t i = 0; i < n; ++i) ref[i] = static_cast<double>(res[i] + static_cast<float>(branch[i]));
  Report("residual add fp32 += bf16 (n=1000003)", DownF32(out.get(), n), ref, 0.0);
  Report("residual add fp32 += bf16 in place", DownF32(dres.get(), n), ref, 0.0);
}

// ------------------------------------------------------------------ Squared norm (device-staged clipping)
void CheckSumSquares() {
  for (int64_t n : {int64_t{0}, int64_t{1}, int64_t{1000003}, int64_t{9437187}}) {
    std::normal_distribution<float> d(0.0f, 1e-3f);
    std::vector<float> x(n + 1);
    for (auto& v : x) v = d(g_rng);
    Dev<float> dx(n + 1);
    Upload(dx, x);
    Dev<double> partials(kernels::kSumSquaresBlocks), out(2);
    for (int misaligned = 0; misaligned <= 1; ++misaligned) {  // the scalar path: x not 16-byte aligned
      CHECK_OK(kernels::SumSquaresF32(dx.get() + misaligned, n, partials.get(), out.get() + misaligned, nullptr));
    }
    CUDA_OK(cudaDeviceSynchronize());
    double got[2];
    CUDA_OK(cudaMemcpy(got, out.get(), sizeof(got), cudaMemcpyDeviceToHost));
    for (int misaligned = 0; misaligned <= 1; ++misaligned) {
      long double ref = 0;
      for (int64_t i = 0; i < n; ++i) ref += static_cast<long double>(x[i + misaligned]) * x[i + misaligned];
      Report("sum of squares fp64 (n=" + std::to_string(n) + (misaligned ? ", unaligned)" : ")"), {got[misaligned]},
             {static_cast<double>(ref)}, 1e-12);
    }
  }
}

// ------------------------------------------------------------------ Cross entropy
void CheckCrossEntropy() {
  const int64_t R = 37, V = 1003, LD = 1008;
  const float scale = 0.37f;
  auto logits = RandVec(R * LD, 3.0);
  std::vector<int32_t> labels(R);
  std::uniform_int_distribution<int> ud(0, V - 1);
  for (int64_t r = 0; r < R; ++r) labels[r] = (r % 5 == 3) ? kIgnoreIndex : ud(g_rng);
  labels[1] = V - 1;  // in the scalar tail
  std::unique_ptr<Dev<bf16>> dl(NewBf16(logits));
  Dev<int32_t> dlab(R);
  Upload(dlab, labels);
  Dev<float> rl(R), total(1);
  float init = 1.25f;
  cudaMemcpy(total.get(), &init, 4, cudaMemcpyHostToDevice);
  CHECK_OK(kernels::CrossEntropyInPlace(dl->get(), R, V, LD, dlab.get(), kIgnoreIndex, scale, rl.get(), nullptr));
  CHECK_OK(kernels::SumInto(rl.get(), R, total.get(), nullptr));
  CUDA_OK(cudaDeviceSynchronize());
  auto got = DownBf16(dl->get(), R * LD);
  std::vector<double> gd, rd, rloss(R);
  double rtotal = init;
  for (int64_t r = 0; r < R; ++r) {
    double m = -INFINITY;
    for (int64_t j = 0; j < V; ++j) m = std::max(m, logits[r * LD + j]);
    double s = 0;
    for (int64_t j = 0; j < V; ++j) s += std::exp(logits[r * LD + j] - m);
    const double lse = m + std::log(s);
    const bool ign = labels[r] == kIgnoreIndex;
    rloss[r] = ign ? 0 : scale * (lse - logits[r * LD + labels[r]]);
    rtotal += rloss[r];
    for (int64_t j = 0; j < V; ++j) {
      rd.push_back(ign ? 0 : scale * (std::exp(logits[r * LD + j] - lse) - (j == labels[r] ? 1 : 0)));
      gd.push_back(got[r * LD + j]);
    }
  }
  Report("cross-entropy row loss (37 rows, vocab 1003, ignore)", DownF32(rl.get(), R), rloss, 1e-5);
  Report("cross-entropy dlogits in place", gd, rd, 1e-2);
  Report("cross-entropy loss sum +=", DownF32(total.get(), 1), {rtotal}, 1e-5);
}

// ------------------------------------------------------------------ Attention
// One case through the own kernels, or through cuDNN's fused attention when `cudnn` is set (same
// inputs, reference and tolerances; cuDNN ignores `split`).
// ordered: the own backward with AttnArgs::ordered_dq, whose dQ/dK/dV must then be bitwise the same
// on two more runs.
void CheckAttention(int hd, int nq, int nkv, const std::vector<int>& docs,
                    kernels::AttnArgs::BwdSplit split = kernels::AttnArgs::BwdSplit::kAuto,
                    kernels::CudnnAttention* cudnn = nullptr, bool ordered = false) {
  std::vector<int32_t> cu = {0};
  for (int d : docs) cu.push_back(cu.back() + d);
  const int64_t T = cu.back();
  const int max_len = *std::max_element(docs.begin(), docs.end());
  const int64_t ldq = nq * hd, ldk = nkv * hd, ldv = nkv * hd + 24;  // v strided like the packed qkv
  auto q = RandVec(T * ldq), k = RandVec(T * ldk), v = RandVec(T * ldv), dout = RandVec(T * ldq);
  std::unique_ptr<Dev<bf16>> dq_in(NewBf16(q)), dk_in(NewBf16(k)), dv_in(NewBf16(v)), ddo(NewBf16(dout));
  Dev<int32_t> dcu(cu.size());
  Upload(dcu, cu);
  Dev<bf16> o(T * ldq), dq(T * ldq), dk(T * ldk), dv(T * ldv);
  Dev<float> lse(nq * T);
  kernels::AttnArgs a;
  a.tokens = T; a.num_docs = docs.size(); a.max_seqlen = max_len; a.num_q_heads = nq; a.num_kv_heads = nkv;
  a.head_dim = hd; a.softmax_scale = 1.0f / std::sqrt(static_cast<float>(hd)); a.cu_seqlens = dcu.get();
  a.bwd_split = split;
  a.ordered_dq = ordered;
  // The backward's three outputs as bits (for the repeatability checks); empty on a copy error.
  auto grads_bits = [&]() -> std::vector<uint16_t> {
    std::vector<uint16_t> bits(T * (ldq + ldk + ldv));
    const bool ok =
        cudaMemcpy(bits.data(), dq.get(), T * ldq * 2, cudaMemcpyDeviceToHost) == cudaSuccess &&
        cudaMemcpy(bits.data() + T * ldq, dk.get(), T * ldk * 2, cudaMemcpyDeviceToHost) == cudaSuccess &&
        cudaMemcpy(bits.data() + T * (ldq + ldk), dv.get(), T * ldv * 2, cudaMemcpyDeviceToHost) == cudaSuccess;
    return ok ? bits : std::vector<uint16_t>();
  };
  if (cudnn == nullptr) {
    Dev<char> ws(kernels::FlashAttentionBackwardWorkspaceBytes(a));
    CHECK_OK(kernels::FlashAttentionForward(a, {dq_in->get(), ldq}, {dk_in->get(), ldk}, {dv_in->get(), ldv},
                                            {o.get(), ldq}, lse.get(), nullptr));
    CUDA_OK(cudaDeviceSynchronize());
    // Backward consumes the kernel's own O (as in training).
    auto backward = [&] {
      CHECK_OK(kernels::FlashAttentionBackward(a, {dq_in->get(), ldq}, {dk_in->get(), ldk}, {dv_in->get(), ldv},
                                               {o.get(), ldq}, lse.get(), {ddo->get(), ldq}, {dq.get(), ldq},
                                               {dk.get(), ldk}, {dv.get(), ldv}, ws.get(), nullptr));
      CUDA_OK(cudaDeviceSynchronize());
    };
    backward();
    if (ordered) {
      const std::vector<uint16_t> first = grads_bits();
      bool same = true;
      for (int run = 0; run < 2; ++run) {
        backward();
        same = same && !first.empty() && grads_bits() == first;
      }
      if (!same) ++g_failures;
      std::printf("%s  attention bwd ordered dQ: 3 runs bitwise equal (hd=%d %d/%d heads, %zu docs, T=%lld)\n",
                  same ? "PASS" : "FAIL", hd, nq, nkv, docs.size(), static_cast<long long>(T));
    }
  } else {
    const kernels::AttnRowStrides ld{ldq, ldk, ldv, ldq, ldq, ldq, ldk, ldv};
    absl::StatusOr<int64_t> fwd_ws = cudnn->ForwardWorkspaceBytes(a, ld);
    absl::StatusOr<int64_t> bwd_ws = fwd_ws.ok() ? cudnn->BackwardWorkspaceBytes(a, ld) : fwd_ws;
    // Only head_dim 128 (the models we train) must be supported; cuDNN may lack other shapes.
    if (!bwd_ws.ok() && hd != 128 && absl::IsUnimplemented(bwd_ws.status())) {
      std::printf("SKIP  cudnn attention hd=%d: %s\n", hd, bwd_ws.status().ToString().c_str());
      return;
    }
    CHECK_OK(bwd_ws.status());
    // Poisoned (NaN) like every output: the check also catches workspace read before written.
    Dev<char> ws(std::max(*fwd_ws, *bwd_ws));
    CHECK_OK(cudnn->Forward(a, {dq_in->get(), ldq}, {dk_in->get(), ldk}, {dv_in->get(), ldv}, {o.get(), ldq},
                            lse.get(), ws.get(), nullptr));
    CUDA_OK(cudaDeviceSynchronize());
    CHECK_OK(cudnn->Backward(a, {dq_in->get(), ldq}, {dk_in->get(), ldk}, {dv_in->get(), ldv}, {o.get(), ldq},
                             lse.get(), {ddo->get(), ldq}, {dq.get(), ldq}, {dk.get(), ldk}, {dv.get(), ldv},
                             ws.get(), nullptr));
    CUDA_OK(cudaDeviceSynchronize());
    // Whether more backwards on the same inputs give the same bits: reported, not checked (cuDNN
    // 9.19's Hopper engines add dQ with atomics; small cases are usually repeatable anyway).
    const std::vector<uint16_t> first = grads_bits();
    bool same = true;
    for (int run = 0; run < 2; ++run) {
      CHECK_OK(cudnn->Backward(a, {dq_in->get(), ldq}, {dk_in->get(), ldk}, {dv_in->get(), ldv}, {o.get(), ldq},
                               lse.get(), {ddo->get(), ldq}, {dq.get(), ldq}, {dk.get(), ldk}, {dv.get(), ldv},
                               ws.get(), nullptr));
      CUDA_OK(cudaDeviceSynchronize());
      same = same && grads_bits() == first;
    }
    std::printf("INFO  cudnn attention bwd bitwise repeatable over 3 runs (hd=%d, %zu docs, T=%lld): %s\n", hd,
                docs.size(), static_cast<long long>(T), same ? "yes" : "no");
  }
  const double sc = a.softmax_scale;
  const int group = nq / nkv;
  std::vector<double> ro(T * ldq), rl(nq * T), rdq(T * ldq, 0), rdk(T * ldk, 0), rdv_full(T * ldv, 0);
  for (size_t d = 0; d + 1 < cu.size(); ++d)
    for (int h = 0; h < nq; ++h) {
      const int kh = h / group;
      for (int64_t i = cu[d]; i < cu[d + 1]; ++i) {
        std::vector<double> p(i - cu[d] + 1);
        double m = -INFINITY;
        for (int64_t j = cu[d]; j <= i; ++j) {
          double s = 0;
          for (int c = 0; c < hd; ++c) s += q[i * ldq + h * hd + c] * k[j * ldk + kh * hd + c];
          p[j - cu[d]] = s * sc;
          m = std::max(m, s * sc);
        }
        double sum = 0;
        for (auto& x : p) { x = std::exp(x - m); sum += x; }
        rl[h * T + i] = m + std::log(sum);
        for (auto& x : p) x /= sum;
        std::vector<double> oo(hd, 0), dp(p.size());
        for (int64_t j = cu[d]; j <= i; ++j)
          for (int c = 0; c < hd; ++c) oo[c] += p[j - cu[d]] * v[j * ldv + kh * hd + c];
        double D = 0;
        for (int c = 0; c < hd; ++c) { ro[i * ldq + h * hd + c] = oo[c]; D += oo[c] * dout[i * ldq + h * hd + c]; }
        for (int64_t j = cu[d]; j <= i; ++j) {
          double x = 0;
          for (int c = 0; c < hd; ++c) x += dout[i * ldq + h * hd + c] * v[j * ldv + kh * hd + c];
          const double pj = p[j - cu[d]], ds = pj * (x - D) * sc;
          for (int c = 0; c < hd; ++c) {
            rdq[i * ldq + h * hd + c] += ds * k[j * ldk + kh * hd + c];
            rdk[j * ldk + kh * hd + c] += ds * q[i * ldq + h * hd + c];
            rdv_full[j * ldv + kh * hd + c] += pj * dout[i * ldq + h * hd + c];
          }
        }
      }
    }
  std::vector<double> gdv, rdv;
  auto gv = DownBf16(dv.get(), T * ldv);
  for (int64_t t = 0; t < T; ++t)
    for (int c = 0; c < nkv * hd; ++c) { gdv.push_back(gv[t * ldv + c]); rdv.push_back(rdv_full[t * ldv + c]); }
  std::string tag = " (hd=" + std::to_string(hd) + " " + std::to_string(nq) + "/" + std::to_string(nkv) +
                    " heads, " + std::to_string(docs.size()) + " docs, T=" + std::to_string(T) +
                    (split == kernels::AttnArgs::BwdSplit::kPerKvHead  ? ", per-kv-head"
                     : split == kernels::AttnArgs::BwdSplit::kPerQHead ? ", per-q-head"
                                                                       : "") +
                    (ordered ? ", ordered dQ" : "") + ")";
  const std::string name = cudnn != nullptr ? "cudnn attention" : "attention";
  Report(name + " fwd O" + tag, DownBf16(o.get(), T * ldq), ro, 1e-2);
  Report(name + " fwd LSE" + tag, DownF32(lse.get(), nq * T), rl, 1e-4);
  Report(name + " bwd dQ" + tag, DownBf16(dq.get(), T * ldq), rdq, 2e-2);
  Report(name + " bwd dK" + tag, DownBf16(dk.get(), T * ldk), rdk, 2e-2);
  Report(name + " bwd dV" + tag, gdv, rdv, 2e-2);
}

// The CheckAttention cases through cuDNN's fused attention (kernels::CudnnAttention). Prints SKIP
// instead of failing where libcudnn cannot be loaded (set SLIDEDP_CUDNN_LIB).
void CheckCudnnAttention() {
  absl::StatusOr<std::unique_ptr<kernels::CudnnAttention>> cudnn = kernels::CudnnAttention::Create(0);
  if (!cudnn.ok()) {
    std::printf("SKIP  cudnn attention: %s\n", cudnn.status().ToString().c_str());
    return;
  }
  std::printf("cudnn attention: cuDNN %lld\n", static_cast<long long>((*cudnn)->version()));
  using Split = kernels::AttnArgs::BwdSplit;
  kernels::CudnnAttention* c = cudnn->get();
  CheckAttention(128, 4, 2, {1, 130, 67, 200, 5}, Split::kAuto, c);
  CheckAttention(128, 8, 1, {64, 192}, Split::kAuto, c);
  CheckAttention(128, 2, 2, {300, 17}, Split::kAuto, c);
  CheckAttention(64, 4, 2, {64, 129, 31}, Split::kAuto, c);
  CheckAttention(16, 4, 2, {17, 40}, Split::kAuto, c);
  // Training-sized documents: many key/value tiles per query tile, where an engine that adds dQ
  // with atomics shows up as not repeatable.
  CheckAttention(128, 8, 2, {1024, 900, 700}, Split::kAuto, c);
}

// ------------------------------------------------------------------ Attention on real layouts
// --attn-layouts=FILE: the document layouts a job actually trains on (a dump_batches file). Each
// micro-batch (`mb_rows` rows, as the workers split a step) goes through cuDNN's attention and
// through the own kernels on the same random inputs, with the strides the CUDA backend uses (q and
// k roped in their own buffers, v inside the packed qkv, dv inside the packed dqkv), and the two
// are compared per document: a layout that one of them gets wrong (a plan for that many documents
// or that length, a 1-token piece) shows as a document whose outputs differ far beyond BF16
// rounding. Both backwards take the own forward's O and LSE, so forward and backward are judged
// separately.
struct Layout {
  int64_t step = 0;
  int part = 0;
  std::vector<int32_t> cu;
};

absl::StatusOr<std::vector<Layout>> ReadLayouts(const std::string& path, int64_t mb_rows) {
  std::ifstream f(path, std::ios::binary);
  if (!f) return absl::NotFoundError("cannot open " + path);
  std::string line;
  std::getline(f, line);
  const int64_t data_start = static_cast<int64_t>(line.size()) + 1;
  nlohmann::json h = nlohmann::json::parse(line, nullptr, /*allow_exceptions=*/false);
  if (h.is_discarded() || h.value("format", "") != "slidedp-batches" || !h.contains("steps")) {
    return absl::InvalidArgumentError(path + ": not a dump_batches file");
  }
  std::vector<Layout> out;
  for (const auto& st : h["steps"]) {
    const int64_t T = st.at("num_tokens").get<int64_t>(), D = st.at("num_segments").get<int64_t>();
    std::vector<int32_t> cu(D + 1);
    f.seekg(data_start + st.at("offset").get<int64_t>() + 3 * T * 4);
    f.read(reinterpret_cast<char*>(cu.data()), static_cast<std::streamsize>(cu.size() * 4));
    if (!f || cu.front() != 0 || cu.back() != T) return absl::DataLossError(path + ": bad cu_seqlens");
    if (!st.contains("row_tokens")) return absl::InvalidArgumentError(path + ": no row_tokens (an older dump)");
    const std::vector<int64_t> rows = st["row_tokens"].get<std::vector<int64_t>>();
    int part = 0;
    size_t i = 0;
    int64_t end = 0;
    for (size_t r = 0; r < rows.size(); r += mb_rows) {  // the worker's micro-batches: mb_rows rows each
      for (size_t j = r; j < std::min(rows.size(), r + mb_rows); ++j) end += rows[j];
      Layout l{st.at("step").get<int64_t>(), part++, {0}};
      const int32_t base = cu[i];
      while (i + 1 < cu.size() && cu[i + 1] <= end) l.cu.push_back(cu[++i] - base);
      if (l.cu.back() != end - base) {
        return absl::InvalidArgumentError(absl::StrCat(path, ": step ", l.step, " has a document piece across token ",
                                                       end, " (a row boundary)"));
      }
      out.push_back(std::move(l));
    }
    if (i + 1 != cu.size()) return absl::DataLossError(absl::StrCat(path, ": row_tokens do not add up to ", T));
  }
  return out;
}

// Per document of a [T, width] pair (row stride ld): the L2 difference relative to the reference
// `b`'s L2 over the document, with the reference's RMS over the whole micro-batch, times
// kScaleFloor, as the least RMS it is judged against. The floor matters where a document's true
// values are zero: a one-token piece attends to itself only (P = 1), so its dS = dP - D and hence
// its dQ and dK are zero in exact arithmetic, and both engines return rounding noise whose
// relative difference is of order 1. A layout bug (a piece that sees another document's keys)
// still shows: its error is of the micro-batch's scale, kScaleFloor^-1 times the tolerance and more.
struct DocDiff {
  double rel = 0;  // the largest over the documents
  int doc = -1;    // where
  double a_rms = 0, b_rms = 0, floor_rms = 0;  // that document's RMS on each side, and the floor
};
constexpr double kScaleFloor = 0.1;

DocDiff WorstDoc(const std::vector<double>& a, const std::vector<double>& b, const std::vector<int32_t>& cu,
                 int64_t ld, int64_t width) {
  double all = 0;
  for (int64_t t = 0; t < cu.back(); ++t)
    for (int64_t c = 0; c < width; ++c) all += b[t * ld + c] * b[t * ld + c];
  const double floor_ms = kScaleFloor * kScaleFloor * all / static_cast<double>(cu.back() * width);
  DocDiff worst;
  worst.floor_rms = std::sqrt(floor_ms);
  for (size_t d = 0; d + 1 < cu.size(); ++d) {
    double num = 0, aa = 0, bb = 0;
    for (int64_t t = cu[d]; t < cu[d + 1]; ++t)
      for (int64_t c = 0; c < width; ++c) {
        const double x = a[t * ld + c], y = b[t * ld + c];
        num += std::isfinite(x) && std::isfinite(y) ? (x - y) * (x - y) : INFINITY;
        aa += x * x;
        bb += y * y;
      }
    const double n = static_cast<double>((cu[d + 1] - cu[d]) * width);
    const double den = std::max(bb, n * floor_ms);
    const double r = den > 0 ? std::sqrt(num / den) : std::sqrt(num);
    if (!(r <= worst.rel)) worst = {r, static_cast<int>(d), std::sqrt(aa / n), std::sqrt(bb / n), worst.floor_rms};
  }
  return worst;
}

void CheckAttentionLayouts(const std::vector<Layout>& layouts, const std::string& path, int nq, int nkv, int hd,
                           double tol) {
  absl::StatusOr<std::unique_ptr<kernels::CudnnAttention>> cudnn = kernels::CudnnAttention::Create(0);
  CHECK_OK(cudnn.status());
  int64_t T_max = 0;
  for (const Layout& l : layouts) T_max = std::max<int64_t>(T_max, l.cu.back());
  std::printf("attention layouts: %zu micro-batches of up to %lld tokens from %s; %d/%d heads, hd %d; cuDNN %lld\n",
              layouts.size(), static_cast<long long>(T_max), path.c_str(), nq, nkv, hd,
              static_cast<long long>((*cudnn)->version()));
  const int64_t qd = nq * hd, kvd = nkv * hd, ldqkv = qd + 2 * kvd;
  // Inputs once, at the largest size (every layout reads a prefix); q and k a little larger than
  // unit variance for peakier softmax rows, like a trained model's.
  std::unique_ptr<Dev<bf16>> q(NewBf16(RandVec(T_max * qd, 1.5))), k(NewBf16(RandVec(T_max * kvd, 1.5))),
      qkv(NewBf16(RandVec(T_max * ldqkv))), dout(NewBf16(RandVec(T_max * qd)));
  Dev<bf16> o_own(T_max * qd), o_cud(T_max * qd), dq_own(T_max * qd), dq_cud(T_max * qd), dk_own(T_max * kvd),
      dk_cud(T_max * kvd), dqkv_own(T_max * ldqkv), dqkv_cud(T_max * ldqkv);
  Dev<float> lse_own(nq * T_max), lse_cud(nq * T_max);
  Dev<int32_t> dcu(T_max + 1);
  const kernels::AttnRowStrides ld{qd, kvd, ldqkv, qd, qd, qd, kvd, ldqkv};
  const bf16* v = qkv->get() + qd + kvd;
  double worst[5] = {0, 0, 0, 0, 0};
  const char* names[5] = {"O", "LSE", "dQ", "dK", "dV"};
  std::string worst_at[5];
  int bad = 0, docs_max = 0, one_token_pieces = 0, done = 0;
  for (const Layout& l : layouts) {
    const int64_t T = l.cu.back();
    kernels::AttnArgs a;
    a.tokens = T;
    a.num_docs = static_cast<int>(l.cu.size()) - 1;
    a.max_seqlen = 0;
    for (size_t d = 0; d + 1 < l.cu.size(); ++d) {
      a.max_seqlen = std::max(a.max_seqlen, l.cu[d + 1] - l.cu[d]);
      one_token_pieces += l.cu[d + 1] - l.cu[d] == 1;
    }
    docs_max = std::max(docs_max, a.num_docs);
    a.num_q_heads = nq;
    a.num_kv_heads = nkv;
    a.head_dim = hd;
    a.softmax_scale = 1.0f / std::sqrt(static_cast<float>(hd));
    a.cu_seqlens = dcu.get();
    CUDA_OK(cudaMemcpy(dcu.get(), l.cu.data(), l.cu.size() * 4, cudaMemcpyHostToDevice));
    for (Dev<bf16>* out : {&o_own, &o_cud, &dq_own, &dq_cud, &dk_own, &dk_cud, &dqkv_own, &dqkv_cud}) out->Poison();
    absl::StatusOr<int64_t> fwd_ws = (*cudnn)->ForwardWorkspaceBytes(a, ld);
    CHECK_OK(fwd_ws.status());
    absl::StatusOr<int64_t> bwd_ws = (*cudnn)->BackwardWorkspaceBytes(a, ld);
    CHECK_OK(bwd_ws.status());
    Dev<char> ws(std::max({*fwd_ws, *bwd_ws, kernels::FlashAttentionBackwardWorkspaceBytes(a)}));
    CHECK_OK(kernels::FlashAttentionForward(a, {q->get(), qd}, {k->get(), kvd}, {v, ldqkv}, {o_own.get(), qd},
                                            lse_own.get(), nullptr));
    CHECK_OK((*cudnn)->Forward(a, {q->get(), qd}, {k->get(), kvd}, {v, ldqkv}, {o_cud.get(), qd}, lse_cud.get(),
                               ws.get(), nullptr));
    CUDA_OK(cudaDeviceSynchronize());
    CHECK_OK(kernels::FlashAttentionBackward(a, {q->get(), qd}, {k->get(), kvd}, {v, ldqkv}, {o_own.get(), qd},
                                             lse_own.get(), {dout->get(), qd}, {dq_own.get(), qd}, {dk_own.get(), kvd},
                                             {dqkv_own.get() + qd + kvd, ldqkv}, ws.get(), nullptr));
    CUDA_OK(cudaDeviceSynchronize());
    CHECK_OK((*cudnn)->Backward(a, {q->get(), qd}, {k->get(), kvd}, {v, ldqkv}, {o_own.get(), qd}, lse_own.get(),
                                {dout->get(), qd}, {dq_cud.get(), qd}, {dk_cud.get(), kvd},
                                {dqkv_cud.get() + qd + kvd, ldqkv}, ws.get(), nullptr));
    CUDA_OK(cudaDeviceSynchronize());
    // LSE [nq, T] as a [T, nq] view for the per-document walk.
    auto lse_rows = [&](const Dev<float>& x) {
      std::vector<double> h = DownF32(x.get(), nq * T), r(T * nq);
      for (int hh = 0; hh < nq; ++hh)
        for (int64_t t = 0; t < T; ++t) r[t * nq + hh] = h[hh * T + t];
      return r;
    };
    // The five comparisons on their own threads (each a few million elements on the host).
    // (a BF16 pair [T, width] with row stride ld, from element `at`)
    auto bf16_pair = [&](const Dev<bf16>& x, const Dev<bf16>& y, int64_t at, int64_t ld, int64_t width) -> DocDiff {
      const int64_t n = (T - 1) * ld + width;
      return WorstDoc(DownBf16(x.get() + at, n), DownBf16(y.get() + at, n), l.cu, ld, width);
    };
    std::future<DocDiff> pending[5] = {
        std::async(std::launch::async, [&] { return bf16_pair(o_cud, o_own, 0, qd, qd); }),
        std::async(std::launch::async, [&] { return WorstDoc(lse_rows(lse_cud), lse_rows(lse_own), l.cu, nq, nq); }),
        std::async(std::launch::async, [&] { return bf16_pair(dq_cud, dq_own, 0, qd, qd); }),
        std::async(std::launch::async, [&] { return bf16_pair(dk_cud, dk_own, 0, kvd, kvd); }),
        std::async(std::launch::async, [&] { return bf16_pair(dqkv_cud, dqkv_own, qd + kvd, ldqkv, kvd); })};
    DocDiff r[5];
    for (int i = 0; i < 5; ++i) r[i] = pending[i].get();
    bool layout_bad = false;
    for (int i = 0; i < 5; ++i) {
      const int d = r[i].doc;
      const std::string where = absl::StrCat("step ", l.step, " part ", l.part, " doc ", d, " (",
                                             d >= 0 ? l.cu[d + 1] - l.cu[d] : 0, " tokens; ", a.num_docs,
                                             " docs, longest ", a.max_seqlen, ")");
      if (!(r[i].rel <= worst[i])) {
        worst[i] = r[i].rel;
        worst_at[i] = where;
      }
      if (!(r[i].rel <= tol)) {
        layout_bad = true;
        std::printf("FAIL  attention layout %s: cuDNN vs own %s differ by %.3e (tolerance %.1e; RMS cuDNN %.3e, "
                    "own %.3e, floor %.3e)\n",
                    where.c_str(), names[i], r[i].rel, tol, r[i].a_rms, r[i].b_rms, r[i].floor_rms);
      }
    }
    bad += layout_bad;
    if (++done % 25 == 0) {
      std::printf("attention layouts: %d of %zu done, %d differ\n", done, layouts.size(), bad);
      std::fflush(stdout);
    }
  }
  g_failures += bad;
  std::printf("%s  attention layouts: %d of %zu micro-batches differ beyond %.1e in some document (up to %d "
              "documents, %d one-token pieces)\n",
              bad == 0 ? "PASS" : "FAIL", bad, layouts.size(), tol, docs_max, one_token_pieces);
  for (int i = 0; i < 5; ++i) {
    std::printf("INFO  attention layouts: worst cuDNN vs own %s %.3e at %s\n", names[i], worst[i], worst_at[i].c_str());
  }
}

#ifdef SLIDEDP_HAVE_CPU_BACKEND
// ------------------------------------------------------------------ Backend vs CPU backend
struct Pair {
  std::unique_ptr<ComputeBackend> gpu, cpu;
};

// Activations: the GPU backend's activation_dtype() (BF16 or FP32 residual stream), FP32 on the CPU
// backend; both get the same BF16-representable values.
struct Act {
  std::unique_ptr<DeviceBuffer> g, c;
  int64_t n = 0;
};

int64_t GpuActBytes(const Pair& p) { return DTypeBytes(p.gpu->activation_dtype()); }

absl::Status MakeAct(Pair& p, const std::vector<double>& v, Act* a) {
  a->n = v.size();
  const int64_t ab = GpuActBytes(p);
  auto g = p.gpu->Allocate(a->n * ab);
  if (!g.ok()) return g.status();
  auto c = p.cpu->Allocate(a->n * 4);
  if (!c.ok()) return c.status();
  a->g = std::move(*g);
  a->c = std::move(*c);
  auto hb = ToBf16(v);
  auto hf = ToF32(v);
  absl::Status s = ab == 4 ? p.gpu->CopyToDevice(hf.data(), a->g->data(), a->n * 4)
                           : p.gpu->CopyToDevice(hb.data(), a->g->data(), a->n * 2);
  if (!s.ok()) return s;
  return p.cpu->CopyToDevice(hf.data(), a->c->data(), a->n * 4);
}
std::vector<double> GetG(Pair& p, DeviceBuffer& b, int64_t n) {
  if (GpuActBytes(p) == 4) {
    std::vector<float> h(n);
    (void)p.gpu->CopyToHost(b.data(), h.data(), n * 4);
    return std::vector<double>(h.begin(), h.end());
  }
  std::vector<bf16_t> h(n);
  (void)p.gpu->CopyToHost(b.data(), h.data(), n * 2);
  std::vector<double> o(n);
  for (int64_t i = 0; i < n; ++i) o[i] = Bf16ToFloat(h[i]);
  return o;
}
std::vector<double> GetF(ComputeBackend& be, const void* d, int64_t n) {
  std::vector<float> h(n);
  (void)be.CopyToHost(d, h.data(), n * 4);
  return std::vector<double>(h.begin(), h.end());
}

// fp32_residual: which residual stream the CUDA backend keeps (CudaBackendOptions). The tolerances
// are the BF16-stream ones in both modes (the FP32 stream is expected to be well inside them).
// attention: the backend's attention (cuDNN or the own kernels).
// fp32_norms: the norm weights also come as an FP32 side copy (UnitParams::fp32), with values
// between BF16 neighbours, which both backends must use.
void CheckBackend(const std::string& label_base, const Qwen3Config& cfg, bool fp32_residual,
                  CudaBackendOptions::Attention attention, bool fp32_norms) {
  const std::string label = label_base + (fp32_residual ? "[fp32 res" : "[bf16 res") +
                            (attention == CudaBackendOptions::Attention::kCudnn ? ", cudnn" : ", own") +
                            (fp32_norms ? ", fp32 norms]" : "]");
  Pair p;
  CudaBackendOptions opt;
  opt.fp32_residual = fp32_residual;
  opt.attention = attention;
  auto g = MakeCudaBackendWithOptions(cfg, 0, opt);
  CHECK_OK(g.status());
  auto c = MakeCpuBackend(cfg);
  CHECK_OK(c.status());
  p.gpu = std::move(*g);
  p.cpu = std::move(*c);
  const bool dtype_ok = p.gpu->activation_dtype() == (fp32_residual ? DType::kF32 : DType::kBF16);
  if (!dtype_ok) ++g_failures;
  std::printf("%s  %-58s\n", dtype_ok ? "PASS" : "FAIL", (label + " activation_dtype matches the option").c_str());
  const int64_t H = cfg.hidden_size, V = cfg.vocab_size;
  const int64_t AB = GpuActBytes(p);  // GPU activation bytes per element
  // A packed micro-batch: three documents, positions restarting, some labels ignored.
  MicroBatch mb;
  const std::vector<int> docs = {37, 100, 13};
  mb.cu_seqlens = {0};
  std::uniform_int_distribution<int> ut(0, static_cast<int>(V) - 1);
  for (int d : docs) {
    for (int i = 0; i < d; ++i) {
      mb.tokens.push_back(ut(g_rng) % 97);  // repeated ids exercise the embedding grouping
      mb.positions.push_back(i);
      mb.labels.push_back(i == d - 1 || i % 11 == 5 ? kIgnoreIndex : ut(g_rng));
    }
    mb.cu_seqlens.push_back(mb.cu_seqlens.back() + d);
    mb.max_seqlen = std::max(mb.max_seqlen, d);
  }
  const int64_t T = mb.num_tokens();
  auto bg = p.gpu->UploadBatch(mb);
  CHECK_OK(bg.status());
  auto bc = p.cpu->UploadBatch(mb);
  CHECK_OK(bc.status());

  ModelLayout layout = ModelLayout::Build(cfg);
  const UnitLayout& unit = layout.units.at(1);
  std::vector<double> params(unit.numel, 0.0);
  for (int t = 0; t < kNumDecoderTensors; ++t) {
    const auto& ts = unit.tensors[t];
    const bool norm = t == kInputNorm || t == kPostNorm || t == kQNorm || t == kKNorm;
    auto v = norm ? RandVec(ts.numel, 0.2, 1.0) : RandVec(ts.numel, 1.0 / std::sqrt(static_cast<double>(ts.shape[1])));
    std::copy(v.begin(), v.end(), params.begin() + ts.offset_numel);
  }
  auto pb = ToBf16(params);
  auto pg = p.gpu->Allocate(pb.size() * 2);
  CHECK_OK(pg.status());
  auto pc = p.cpu->Allocate(pb.size() * 2);
  CHECK_OK(pc.status());
  CHECK_OK(p.gpu->CopyToDevice(pb.data(), (*pg)->data(), pb.size() * 2));
  CHECK_OK(p.cpu->CopyToDevice(pb.data(), (*pc)->data(), pb.size() * 2));
  std::vector<float> side(unit.fp32_numel, 0.0f);
  for (const TensorSlot& ts : unit.tensors) {
    if (ts.fp32_offset < 0) continue;
    for (int64_t i = 0; i < ts.numel; ++i) {  // the BF16 value plus 0.3 of a BF16 step
      const float b = Bf16ToFloat(pb[ts.offset_numel + i]);
      side[ts.fp32_offset + i] = b + 0.3f * std::fabs(b) * 0.0078125f;
    }
  }
  auto sg = p.gpu->Allocate(std::max<int64_t>(1, side.size()) * 4);
  CHECK_OK(sg.status());
  auto sc_side = p.cpu->Allocate(std::max<int64_t>(1, side.size()) * 4);
  CHECK_OK(sc_side.status());
  CHECK_OK(p.gpu->CopyToDevice(side.data(), (*sg)->data(), side.size() * 4));
  CHECK_OK(p.cpu->CopyToDevice(side.data(), (*sc_side)->data(), side.size() * 4));
  const UnitParams PG((*pg)->as<bf16_t>(), fp32_norms ? (*sg)->as<float>() : nullptr);
  const UnitParams PC((*pc)->as<bf16_t>(), fp32_norms ? (*sc_side)->as<float>() : nullptr);

  Act x, y, dy, dx;
  CHECK_OK(MakeAct(p, RandVec(T * H), &x));
  CHECK_OK(MakeAct(p, std::vector<double>(T * H, 0.0), &y));
  CHECK_OK(MakeAct(p, RandVec(T * H), &dy));
  CHECK_OK(MakeAct(p, std::vector<double>(T * H, 0.0), &dx));
  std::unique_ptr<SavedActivations> sc;
  CHECK_OK(p.cpu->DecoderForward(PC, **bc, x.c->data(), y.c->data(), ActPolicy::kKeepAll, &sc));
  auto ref_y = GetF(*p.cpu, y.c->data(), T * H);
  auto dpc = p.cpu->Allocate(unit.numel * 4);
  CHECK_OK(dpc.status());
  CHECK_OK(p.cpu->Memset(**dpc, 0));
  CHECK_OK(p.cpu->DecoderBackward(PC, **bc, x.c->data(), sc.get(), dy.c->data(), dx.c->data(), (*dpc)->as<float>()));
  auto ref_dx = GetF(*p.cpu, dx.c->data(), T * H);
  auto ref_dp = GetF(*p.cpu, (*dpc)->data(), unit.numel);

  for (ActPolicy pol : {ActPolicy::kKeepAll, ActPolicy::kSelective, ActPolicy::kRecomputeLayer}) {
    const char* pname = pol == ActPolicy::kKeepAll ? "keep-all" : pol == ActPolicy::kSelective ? "selective" : "recompute";
    cudaMemset(y.g->data(), 0xFF, T * H * AB); cudaDeviceSynchronize();
    std::unique_ptr<SavedActivations> sg;
    CHECK_OK(p.gpu->DecoderForward(PG, **bg, x.g->data(), y.g->data(), pol, &sg));
    CHECK_OK(p.gpu->Synchronize());
    const bool bytes_ok = sg->bytes() >= p.gpu->SavedBytesPerToken(pol) * T;
    if (!bytes_ok) ++g_failures;
    std::printf("%s  %-58s saved=%lld B, %lld B/token\n", bytes_ok ? "PASS" : "FAIL",
                (label + " saved bytes >= SavedBytesPerToken·T " + pname).c_str(),
                static_cast<long long>(sg->bytes()), static_cast<long long>(p.gpu->SavedBytesPerToken(pol)));
    Report(label + " layer fwd y [" + pname + "]", GetG(p, *y.g, T * H), ref_y, 1.5e-2);
    auto dpg = p.gpu->Allocate(unit.numel * 4);
    CHECK_OK(dpg.status());
    CHECK_OK(p.gpu->Memset(**dpg, 0));
    // dx aliases a copy of dy (the interface allows it) on the recompute run.
    void* dx_ptr = dx.g->data();
    if (pol == ActPolicy::kRecomputeLayer) {
      cudaMemcpy(dx.g->data(), dy.g->data(), T * H * AB, cudaMemcpyDeviceToDevice); cudaDeviceSynchronize();
    } else {
      cudaMemset(dx.g->data(), 0xFF, T * H * AB); cudaDeviceSynchronize();
    }
    CHECK_OK(p.gpu->DecoderBackward(PG, **bg, x.g->data(), pol == ActPolicy::kRecomputeLayer ? nullptr : sg.get(),
                                    pol == ActPolicy::kRecomputeLayer ? dx_ptr : dy.g->data(), dx_ptr,
                                    (*dpg)->as<float>()));
    CHECK_OK(p.gpu->Synchronize());
    Report(label + " layer bwd dx [" + pname + "]", GetG(p, *dx.g, T * H), ref_dx, 3e-2);
    auto got_dp = GetF(*p.gpu, (*dpg)->data(), unit.numel);
    for (int t = 0; t < kNumDecoderTensors; ++t) {
      const auto& ts = unit.tensors[t];
      std::vector<double> gv(got_dp.begin() + ts.offset_numel, got_dp.begin() + ts.offset_numel + ts.numel);
      std::vector<double> rv(ref_dp.begin() + ts.offset_numel, ref_dp.begin() + ts.offset_numel + ts.numel);
      std::string tn = ts.hf_name.substr(ts.hf_name.find("layers.") + 7);
      Report(label + " layer bwd d" + tn + " [" + pname + "]", gv, rv, 4e-2);
    }
  }

  // Embedding forward/backward.
  {
    auto table = RandVec(V * H);
    auto tb = ToBf16(table);
    auto tg = p.gpu->Allocate(tb.size() * 2);
    auto tc = p.cpu->Allocate(tb.size() * 2);
    CHECK_OK(tg.status());
    CHECK_OK(tc.status());
    CHECK_OK(p.gpu->CopyToDevice(tb.data(), (*tg)->data(), tb.size() * 2));
    CHECK_OK(p.cpu->CopyToDevice(tb.data(), (*tc)->data(), tb.size() * 2));
    cudaMemset(y.g->data(), 0xFF, T * H * AB); cudaDeviceSynchronize();
    CHECK_OK(p.gpu->EmbeddingForward((*tg)->as<bf16_t>(), **bg, y.g->data()));
    CHECK_OK(p.cpu->EmbeddingForward((*tc)->as<bf16_t>(), **bc, y.c->data()));
    CHECK_OK(p.gpu->Synchronize());
    Report(label + " embedding fwd", GetG(p, *y.g, T * H), GetF(*p.cpu, y.c->data(), T * H), 0.0);
    {  // FP32 rows (runtime.embedding_rows: fp32), off the BF16 grid
      std::vector<float> t32(V * H);
      for (int64_t i = 0; i < V * H; ++i) t32[i] = static_cast<float>(table[i]) * 1.0007f + 1e-4f;
      auto fg = p.gpu->Allocate(V * H * 4);
      auto fc = p.cpu->Allocate(V * H * 4);
      CHECK_OK(fg.status());
      CHECK_OK(fc.status());
      CHECK_OK(p.gpu->CopyToDevice(t32.data(), (*fg)->data(), V * H * 4));
      CHECK_OK(p.cpu->CopyToDevice(t32.data(), (*fc)->data(), V * H * 4));
      CHECK_OK(p.gpu->EmbeddingForward(UnitParams((*tg)->as<bf16_t>(), (*fg)->as<float>()), **bg, y.g->data()));
      CHECK_OK(p.cpu->EmbeddingForward(UnitParams((*tc)->as<bf16_t>(), (*fc)->as<float>()), **bc, y.c->data()));
      CHECK_OK(p.gpu->Synchronize());
      // The CPU backend keeps FP32 activations: with the BF16 stream the GPU rounds the rows.
      Report(label + " embedding fwd, FP32 rows", GetG(p, *y.g, T * H), GetF(*p.cpu, y.c->data(), T * H),
             AB == 4 ? 0.0 : 4e-3);
    }
    auto eg = p.gpu->Allocate(V * H * 4);
    auto ec = p.cpu->Allocate(V * H * 4);
    CHECK_OK(eg.status());
    CHECK_OK(ec.status());
    CHECK_OK(p.gpu->Memset(**eg, 0));
    CHECK_OK(p.cpu->Memset(**ec, 0));
    CHECK_OK(p.gpu->EmbeddingBackward(dy.g->data(), **bg, (*eg)->as<float>()));
    CHECK_OK(p.cpu->EmbeddingBackward(dy.c->data(), **bc, (*ec)->as<float>()));
    CHECK_OK(p.gpu->Synchronize());
    Report(label + " embedding bwd", GetF(*p.gpu, (*eg)->data(), V * H), GetF(*p.cpu, (*ec)->data(), V * H), 1e-5);
  }
  // Head: final norm + LM head + CE, forward and backward.
  {
    auto nw = RandVec(H, 0.2, 1.0);
    auto lw = RandVec(V * H, 1.0 / std::sqrt(static_cast<double>(H)));
    auto nb = ToBf16(nw), lb = ToBf16(lw);
    auto ng = p.gpu->Allocate(H * 2), nc = p.cpu->Allocate(H * 2), lg = p.gpu->Allocate(V * H * 2),
         lc = p.cpu->Allocate(V * H * 2);
    CHECK_OK(ng.status()); CHECK_OK(nc.status()); CHECK_OK(lg.status()); CHECK_OK(lc.status());
    CHECK_OK(p.gpu->CopyToDevice(nb.data(), (*ng)->data(), H * 2));
    CHECK_OK(p.cpu->CopyToDevice(nb.data(), (*nc)->data(), H * 2));
    CHECK_OK(p.gpu->CopyToDevice(lb.data(), (*lg)->data(), V * H * 2));
    CHECK_OK(p.cpu->CopyToDevice(lb.data(), (*lc)->data(), V * H * 2));
    const float loss_scale = 1.0f / static_cast<float>(mb.num_trained());
    auto dn_g = p.gpu->Allocate(H * 4), dn_c = p.cpu->Allocate(H * 4), dl_g = p.gpu->Allocate(V * H * 4),
         dl_c = p.cpu->Allocate(V * H * 4), ls_g = p.gpu->Allocate(4), ls_c = p.cpu->Allocate(4);
    CHECK_OK(dn_g.status()); CHECK_OK(dn_c.status()); CHECK_OK(dl_g.status()); CHECK_OK(dl_c.status());
    CHECK_OK(ls_g.status()); CHECK_OK(ls_c.status());
    for (auto* b : {dn_g->get(), dl_g->get(), ls_g->get()}) CHECK_OK(p.gpu->Memset(*b, 0));
    for (auto* b : {dn_c->get(), dl_c->get(), ls_c->get()}) CHECK_OK(p.cpu->Memset(*b, 0));
    cudaMemset(dx.g->data(), 0xFF, T * H * AB); cudaDeviceSynchronize();
    CHECK_OK(p.gpu->HeadForwardBackward((*ng)->as<bf16_t>(), (*lg)->as<bf16_t>(), **bg, x.g->data(), loss_scale,
                                        dx.g->data(), (*dn_g)->as<float>(), (*dl_g)->as<float>(),
                                        (*ls_g)->as<float>()));
    CHECK_OK(p.cpu->HeadForwardBackward((*nc)->as<bf16_t>(), (*lc)->as<bf16_t>(), **bc, x.c->data(), loss_scale,
                                        dx.c->data(), (*dn_c)->as<float>(), (*dl_c)->as<float>(),
                                        (*ls_c)->as<float>()));
    CHECK_OK(p.gpu->Synchronize());
    Report(label + " head loss", GetF(*p.gpu, (*ls_g)->data(), 1), GetF(*p.cpu, (*ls_c)->data(), 1), 2e-3);
    Report(label + " head dx", GetG(p, *dx.g, T * H), GetF(*p.cpu, dx.c->data(), T * H), 3e-2);
    Report(label + " head dnorm", GetF(*p.gpu, (*dn_g)->data(), H), GetF(*p.cpu, (*dn_c)->data(), H), 3e-2);
    Report(label + " head dlm_head", GetF(*p.gpu, (*dl_g)->data(), V * H), GetF(*p.cpu, (*dl_c)->data(), V * H), 3e-2);
  }
}
#endif  // SLIDEDP_HAVE_CPU_BACKEND

}  // namespace
}  // namespace slidedp

int main(int argc, char** argv) {
  using namespace slidedp;
  uint64_t seed = std::random_device{}();
  bool kernels_only = false;  // --kernels-only: skip the backend-vs-CPU part (for sanitizer runs)
  // --attn-layouts=FILE (a dump_batches file): only CheckAttentionLayouts, with --mb-rows=N
  // (rows per micro-batch, default 4), --heads=NQ/NKV (default 16/8, Qwen3-1.7B) and
  // --head-dim=D (default 128).
  std::string layouts;
  int64_t mb_rows = 4;
  int nq = 16, nkv = 8, hd = 128;
  for (int i = 1; i < argc; ++i) {
    if (std::strncmp(argv[i], "--seed=", 7) == 0) seed = std::strtoull(argv[i] + 7, nullptr, 10);
    if (std::strcmp(argv[i], "--kernels-only") == 0) kernels_only = true;
    if (std::strncmp(argv[i], "--attn-layouts=", 15) == 0) layouts = argv[i] + 15;
    if (std::strncmp(argv[i], "--mb-rows=", 10) == 0) {
      mb_rows = std::max(1ll, std::strtoll(argv[i] + 10, nullptr, 10));
    }
    if (std::strncmp(argv[i], "--heads=", 8) == 0 && std::sscanf(argv[i] + 8, "%d/%d", &nq, &nkv) != 2) {
      std::printf("FAIL  --heads wants NQ/NKV\n");
      return 2;
    }
    if (std::strncmp(argv[i], "--head-dim=", 11) == 0) hd = std::atoi(argv[i] + 11);
  }
  g_rng.seed(seed);
  // (read before the device is touched, so a bad file fails the same on a machine without one)
  absl::StatusOr<std::vector<Layout>> layout_list;
  if (!layouts.empty()) {
    layout_list = ReadLayouts(layouts, mb_rows);
    if (!layout_list.ok()) {
      std::printf("FAIL  --attn-layouts: %s\n", layout_list.status().ToString().c_str());
      return 2;
    }
    int64_t pieces = 0;
    for (const Layout& l : *layout_list) pieces += static_cast<int64_t>(l.cu.size()) - 1;
    std::printf("attention layouts: %zu micro-batches, %lld document pieces\n", layout_list->size(),
                static_cast<long long>(pieces));
  }
  cudaDeviceProp prop{};
  if (cudaGetDeviceProperties(&prop, 0) != cudaSuccess) {
    std::printf("FAIL  no CUDA device\n");
    return 2;
  }
  std::printf("cuda_kernel_check on %s (sm_%d%d), seed=%llu\n", prop.name, prop.major, prop.minor,
              static_cast<unsigned long long>(seed));
  if (!layouts.empty()) {
    CheckAttentionLayouts(*layout_list, layouts, nq, nkv, hd, 2e-2);
    std::printf("%s: %d failure(s)\n", g_failures == 0 ? "ALL PASS" : "FAILED", g_failures);
    return g_failures == 0 ? 0 : 1;
  }
  CheckGemm();
  CheckRmsNorm<bf16, bf16>();
  CheckRmsNorm<float, bf16>();
  CheckRmsNorm<bf16, float>();
  CheckRmsNorm<float, float>();
  CheckQkRope<bf16>(128);
  CheckQkRope<bf16>(64);  // half the lanes idle: catches use of unset per-lane state
  CheckQkRope<bf16>(16);
  CheckQkRope<float>(128);
  CheckQkRope<float>(64);
  CheckQkRope<float>(16);
  CheckSwiGlu();
  CheckEmbedding<bf16>();
  CheckEmbedding<float>();
  CheckAddBf16ToF32();
  CheckSumSquares();
  CheckCrossEntropy();
  using Split = kernels::AttnArgs::BwdSplit;
  CheckAttention(128, 4, 2, {1, 130, 67, 200, 5}, Split::kPerKvHead);
  CheckAttention(128, 4, 2, {1, 130, 67, 200, 5}, Split::kPerQHead);
  CheckAttention(128, 8, 1, {64, 192}, Split::kPerKvHead);
  CheckAttention(128, 8, 1, {64, 192}, Split::kPerQHead);
  CheckAttention(64, 4, 2, {64, 129, 31}, Split::kPerKvHead);
  CheckAttention(64, 4, 2, {64, 129, 31}, Split::kPerQHead);
  CheckAttention(128, 2, 2, {300, 17});
  CheckAttention(16, 4, 2, {17, 40});
  CheckAttention(48, 2, 2, {33});
  // Ordered dQ (SLIDEDP_DETERMINISTIC): both work splits, both head dims, 1-token documents, and
  // training-sized documents where many key blocks add into each query block.
  CheckAttention(128, 4, 2, {1, 130, 67, 200, 5}, Split::kPerKvHead, nullptr, true);
  CheckAttention(128, 4, 2, {1, 130, 67, 200, 5}, Split::kPerQHead, nullptr, true);
  CheckAttention(64, 4, 2, {64, 129, 31}, Split::kAuto, nullptr, true);
  CheckAttention(128, 8, 2, {1024, 900, 700}, Split::kAuto, nullptr, true);
  CheckCudnnAttention();
#ifdef SLIDEDP_HAVE_CPU_BACKEND
  if (!kernels_only) {
    Qwen3Config c;
    c.hidden_size = 256; c.num_hidden_layers = 1; c.num_attention_heads = 4; c.num_key_value_heads = 2;
    c.head_dim = 64; c.intermediate_size = 384; c.vocab_size = 1000; c.tie_word_embeddings = false;
    Qwen3Config c128 = c;
    c128.head_dim = 128; c128.num_attention_heads = 4; c128.num_key_value_heads = 1;
    auto tiny = Qwen3Config::Preset("tiny");
    std::vector<CudaBackendOptions::Attention> attention = {CudaBackendOptions::Attention::kOwn};
    if (kernels::CudnnAttention::Create(0).ok()) attention.push_back(CudaBackendOptions::Attention::kCudnn);
    for (CudaBackendOptions::Attention attn : attention) {
      for (bool fp32_residual : {true, false}) {
        // The FP32 norm weights (the workers' default) with cuDNN (the default attention).
        const bool norms = attn == CudaBackendOptions::Attention::kCudnn;
        CheckBackend("qwen3-mini(hd64)", c, fp32_residual, attn, norms);
        CheckBackend("qwen3-mini(hd128)", c128, fp32_residual, attn, norms);
        if (tiny.ok()) CheckBackend("tiny(hd16)", *tiny, fp32_residual, attn, norms);
      }
    }
  }
#else
  std::printf("SKIP  backend-vs-CPU checks (cpu_backend not built)\n");
#endif
  cudaError_t e = cudaDeviceSynchronize();
  if (e != cudaSuccess) {
    std::printf("FAIL  device error at end: %s\n", cudaGetErrorString(e));
    ++g_failures;
  }
  std::printf("%s: %d failure(s)\n", g_failures == 0 ? "ALL PASS" : "FAILED", g_failures);
  return g_failures == 0 ? 0 : 1;
}
