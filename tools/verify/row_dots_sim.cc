// Host simulation of the attention backward's row dots (docs/kernels.md, "The row dots"): how much
// D = rowsum(dO ∘ O) formed from the BF16 output O adds to dQ / dK, against D from the FP32 output
// (AttnArgs::o_lo) and against HF autocast's eager attention (BF16 scores, FP32 softmax, BF16 dP,
// D = Σ P dP). One head, causal over T tokens; every operand BF16-rounded as the kernels see it; the
// flash-like variants use FP32 P for dS and BF16 P in the forward's P·V, as the own kernels do.
//
//   build/bin/row_dots_sim BIAS SPREAD KCOMMON
// q, k, v = N(0, SPREAD) + a bias N(0, BIAS) per dimension, k's bias plus N(0, KCOMMON): a component
// its rows share.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <vector>

#include "common/numeric/bf16.h"

namespace {

using slidedp::Bf16ToFloat;
using slidedp::FloatToBf16;

float Bf16(float x) { return Bf16ToFloat(FloatToBf16(x)); }  // round to BF16 and back

using Vec = std::vector<double>;

// Relative L2 distance of got (rounded to BF16, as the kernels' outputs are) from ref.
double RelErr(const Vec& got, const Vec& ref) {
  double num = 0, den = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    const double x = Bf16(static_cast<float>(got[i]));
    num += (x - ref[i]) * (x - ref[i]);
    den += ref[i] * ref[i];
  }
  return std::sqrt(num / den);
}

}  // namespace

int main(int argc, char** argv) {
  const int T = 384, H = 64;
  const double bias = argc > 1 ? std::atof(argv[1]) : 0.2, spread = argc > 2 ? std::atof(argv[2]) : 0.32,
               kcommon = argc > 3 ? std::atof(argv[3]) : 0.3, scale = 1.0 / std::sqrt(static_cast<double>(H));
  std::mt19937 rng(1);
  std::normal_distribution<double> n(0, 1);
  Vec q(T * H), k(T * H), v(T * H), dout(T * H), bq(H), bk(H), bv(H);
  for (int d = 0; d < H; ++d) bq[d] = bias * n(rng), bk[d] = bias * n(rng) + kcommon * n(rng), bv[d] = bias * n(rng);
  for (int t = 0; t < T; ++t)
    for (int d = 0; d < H; ++d) {
      q[t * H + d] = Bf16(static_cast<float>(spread * n(rng) + bq[d]));
      k[t * H + d] = Bf16(static_cast<float>(spread * n(rng) + bk[d]));
      v[t * H + d] = Bf16(static_cast<float>(spread * n(rng) + bv[d]));
      dout[t * H + d] = Bf16(static_cast<float>(n(rng)));
    }
  // dQ, dK: exact (double), flash with D from the BF16 O, flash with D from the FP32 O, HF autocast.
  Vec dq[4], dk[4];
  for (int r = 0; r < 4; ++r) dq[r].assign(T * H, 0), dk[r].assign(T * H, 0);
  for (int i = 0; i < T; ++i) {
    Vec s(i + 1), p(i + 1), ph(i + 1), dph(i + 1);
    double m = -1e300, mh = -1e300;
    for (int j = 0; j <= i; ++j) {
      double dot = 0;
      for (int d = 0; d < H; ++d) dot += q[i * H + d] * k[j * H + d];
      s[j] = dot * scale;
      ph[j] = Bf16(static_cast<float>(dot)) * scale;  // HF: BF16 scores
      m = std::max(m, s[j]);
      mh = std::max(mh, ph[j]);
    }
    double l = 0, lh = 0;
    for (int j = 0; j <= i; ++j) p[j] = std::exp(s[j] - m), l += p[j];
    for (int j = 0; j <= i; ++j) ph[j] = static_cast<float>(std::exp(ph[j] - mh)), lh += ph[j];
    Vec o(H, 0), o32(H, 0);
    for (int j = 0; j <= i; ++j)
      for (int d = 0; d < H; ++d) {
        o[d] += p[j] / l * v[j * H + d];
        o32[d] += Bf16(static_cast<float>(p[j])) * v[j * H + d] / l;  // the kernel's P·V: BF16 P, FP32 sum
      }
    for (int j = 0; j <= i; ++j) p[j] /= l, ph[j] = static_cast<float>(ph[j] / lh);
    double d_exact = 0, d_bf16 = 0, d_f32 = 0, d_hf = 0;
    for (int d = 0; d < H; ++d) {
      d_exact += dout[i * H + d] * o[d];
      d_bf16 += Bf16(static_cast<float>(o32[d])) * dout[i * H + d];
      d_f32 += static_cast<float>(o32[d]) * dout[i * H + d];
    }
    Vec dps(i + 1);  // dP = dO·v_j
    for (int j = 0; j <= i; ++j) {
      for (int d = 0; d < H; ++d) dps[j] += dout[i * H + d] * v[j * H + d];
      dph[j] = Bf16(static_cast<float>(dps[j]));  // HF: BF16 dP
      d_hf += ph[j] * dph[j];
    }
    for (int j = 0; j <= i; ++j) {
      const double dp = dps[j];
      const float pf = static_cast<float>(p[j]);
      const double ds[4] = {p[j] * (dp - d_exact) * scale,
                            Bf16(pf * (static_cast<float>(dp) - static_cast<float>(d_bf16))) * scale,
                            Bf16(pf * (static_cast<float>(dp) - static_cast<float>(d_f32))) * scale,
                            Bf16(static_cast<float>(ph[j] * (dph[j] - d_hf))) * scale};
      for (int r = 0; r < 4; ++r)
        for (int d = 0; d < H; ++d) dq[r][i * H + d] += ds[r] * k[j * H + d], dk[r][j * H + d] += ds[r] * q[i * H + d];
    }
  }
  std::printf("bias %.2f spread %.2f kcommon %.2f | dQ rel err: D from BF16 O %.2e, from FP32 O %.2e, HF autocast "
              "%.2e | dK: %.2e, %.2e, %.2e\n",
              bias, spread, kcommon, RelErr(dq[1], dq[0]), RelErr(dq[2], dq[0]), RelErr(dq[3], dq[0]),
              RelErr(dk[1], dk[0]), RelErr(dk[2], dk[0]), RelErr(dk[3], dk[0]));
  return 0;
}
