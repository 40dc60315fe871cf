// Fused AdamW kernels: every ISA this CPU has against a double-precision reference of
// torch.optim.AdamW, bit-identity across ISAs, tails and misaligned pointers, the BF16 mirror,
// non-finite propagation, and the squared-sum reduction.
#include "hostd/update/adamw_kernels.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

#include "common/numeric/bf16.h"
#include "gtest/gtest.h"

namespace slidedp::update {
namespace {

std::vector<AdamIsa> SupportedIsas() {
  std::vector<AdamIsa> out;
  for (AdamIsa isa : {AdamIsa::kScalar, AdamIsa::kAvx2, AdamIsa::kAvx512}) {
    if (AdamKernelsFor(isa) != nullptr) out.push_back(isa);
  }
  return out;
}

uint32_t Bits(float f) {
  uint32_t b;
  std::memcpy(&b, &f, 4);
  return b;
}

// PyTorch's AdamW (decoupled weight decay, bias correction) in double precision.
struct RefState {
  std::vector<double> theta, m, v;
};
void RefStep(const AdamWStepParams& p, RefState& s, const std::vector<float>& grad) {
  const double bc1 = 1 - std::pow(p.beta1, static_cast<double>(p.step));
  const double bc2 = 1 - std::pow(p.beta2, static_cast<double>(p.step));
  for (size_t i = 0; i < grad.size(); ++i) {
    const double g = static_cast<double>(grad[i]) * p.grad_scale;
    s.theta[i] *= 1 - p.lr * p.weight_decay;
    s.m[i] = p.beta1 * s.m[i] + (1 - p.beta1) * g;
    s.v[i] = p.beta2 * s.v[i] + (1 - p.beta2) * g * g;
    s.theta[i] -= p.lr / bc1 * s.m[i] / (std::sqrt(s.v[i]) / std::sqrt(bc2) + p.eps);
  }
}

// Owns arrays with a chosen misalignment (in elements) from a 64-byte boundary.
template <typename T>
struct Buffer {
  Buffer(size_t n, size_t shift) : storage(n + 64), data(storage.data() + AlignShift(shift)) {}
  size_t AlignShift(size_t shift) {
    const auto addr = reinterpret_cast<uintptr_t>(storage.data());
    const size_t to_align = ((64 - addr % 64) % 64) / sizeof(T);
    return to_align + shift;
  }
  std::vector<T> storage;
  T* data;
};

struct StepCase {
  const char* name;
  AdamWStepParams params;
};

std::vector<StepCase> Cases() {
  std::vector<StepCase> cases;
  cases.push_back({"defaults", AdamWStepParams{}});
  AdamWStepParams big_wd;
  big_wd.lr = 3e-4;
  big_wd.weight_decay = 0.1;
  big_wd.beta2 = 0.95;
  cases.push_back({"wd0.1_b2_0.95", big_wd});
  AdamWStepParams no_wd;
  no_wd.lr = 1e-2;
  no_wd.weight_decay = 0.0;
  no_wd.eps = 1e-6;
  no_wd.grad_scale = 0.37f;
  cases.push_back({"no_wd_scaled", no_wd});
  AdamWStepParams low_beta1;  // 1 - beta1 >= 0.5 takes ATen's other lerp branch
  low_beta1.beta1 = 0.3;
  low_beta1.beta2 = 0.5;
  low_beta1.lr = 5e-3;
  cases.push_back({"beta1_0.3", low_beta1});
  return cases;
}

// Several steps of every case on every ISA; compares with the double reference and checks that all
// ISAs agree bit for bit and that the mirror is FloatToBf16(master).
TEST(AdamWKernels, MatchesDoubleReferenceAndIsasAgree) {
  constexpr int64_t kN = 1027;
  constexpr int kSteps = 5;
  for (const StepCase& c : Cases()) {
    SCOPED_TRACE(c.name);
    std::mt19937 rng(7);
    std::normal_distribution<float> normal(0.0f, 1.0f);
    std::vector<float> theta0(kN);
    for (float& x : theta0) x = normal(rng) * 0.05f;
    std::vector<std::vector<float>> grads(kSteps, std::vector<float>(kN));
    for (auto& g : grads) {
      for (float& x : g) x = normal(rng) * 1e-2f;
    }
    std::vector<float> first_master;
    for (AdamIsa isa : SupportedIsas()) {
      SCOPED_TRACE(AdamIsaName(isa));
      const AdamKernelTable* k = AdamKernelsFor(isa);
      std::vector<float> master = theta0, m(kN, 0.0f), v(kN, 0.0f);
      std::vector<bf16_t> mirror(kN, 0);
      RefState ref{std::vector<double>(theta0.begin(), theta0.end()), std::vector<double>(kN, 0),
                   std::vector<double>(kN, 0)};
      for (int t = 1; t <= kSteps; ++t) {
        AdamWStepParams p = c.params;
        p.step = t;
        k->step_f32(MakeAdamWConstants(p), master.data(), m.data(), v.data(), mirror.data(),
                    grads[t - 1].data(), kN);
        RefStep(p, ref, grads[t - 1]);
      }
      for (int64_t i = 0; i < kN; ++i) {
        // Each step moves theta by about lr; float rounding of the state stays far below 1e-4 of
        // it.
        const double tol = 2e-7 * std::fabs(ref.theta[i]) + 1e-4 * c.params.lr;
        ASSERT_NEAR(master[i], ref.theta[i], tol) << "i=" << i;
        // m mixes gradients of both signs: its error scales with |g| (~1e-2), not with |m|.
        ASSERT_NEAR(m[i], ref.m[i], 1e-5 * std::fabs(ref.m[i]) + 1e-9) << "i=" << i;
        ASSERT_NEAR(v[i], ref.v[i], 1e-5 * std::fabs(ref.v[i]) + 1e-16) << "i=" << i;
        ASSERT_EQ(mirror[i], FloatToBf16(master[i])) << "i=" << i;
      }
      if (first_master.empty()) {
        first_master = master;
      } else {
        for (int64_t i = 0; i < kN; ++i) ASSERT_EQ(Bits(master[i]), Bits(first_master[i])) << i;
      }
    }
  }
}

// Every tail length and misalignment of each array gives the same bits as the scalar kernel, for
// the FP32 and the BF16 gradient.
TEST(AdamWKernels, TailsAndMisalignment) {
  AdamWStepParams p;
  p.lr = 2e-3;
  p.step = 3;
  p.grad_scale = 0.5f;
  const AdamKernelTable* scalar = AdamKernelsFor(AdamIsa::kScalar);
  for (const bool stream : {true, false}) {
    for (AdamIsa isa : SupportedIsas()) {
      AdamWConstants c = MakeAdamWConstants(p);
      c.stream_mirror = stream;
      const AdamKernelTable* k = AdamKernelsFor(isa);
      for (int64_t n : {0, 1, 7, 15, 16, 17, 22, 31, 33, 64, 1000, 1027}) {
        for (size_t shift = 0; shift < 4; ++shift) {
          SCOPED_TRACE(testing::Message() << AdamIsaName(isa) << " n=" << n << " shift=" << shift
                                          << " stream=" << stream);
          std::mt19937 rng(static_cast<uint32_t>(n * 10 + shift));
          std::uniform_real_distribution<float> u(-1.0f, 1.0f);
          // Different misalignment per array so the head loop cannot align them all at once.
          Buffer<float> master(n, shift), m(n, (shift + 1) % 4), v(n, (shift + 2) % 4),
              grad(n, (shift + 3) % 4);
          Buffer<bf16_t> mirror(n + 1, (shift * 3 + 1) % 16), grad16(n, shift * 5 % 16);
          for (int64_t i = 0; i < n; ++i) {
            master.data[i] = u(rng);
            m.data[i] = u(rng) * 1e-2f;
            v.data[i] = std::fabs(u(rng)) * 1e-4f;
            grad.data[i] = u(rng) * 1e-2f;
            grad16.data[i] = FloatToBf16(grad.data[i]);
          }
          std::vector<float> m0(m.data, m.data + n), v0(v.data, v.data + n),
              th0(master.data, master.data + n);
          const bf16_t kGuard = 0xBEEF;
          mirror.data[n] = kGuard;

          std::vector<float> em(m0), ev(v0), eth(th0);
          std::vector<bf16_t> emirror(n + 1);
          scalar->step_f32(c, eth.data(), em.data(), ev.data(), emirror.data(), grad.data, n);
          k->step_f32(c, master.data, m.data, v.data, mirror.data, grad.data, n);
          for (int64_t i = 0; i < n; ++i) {
            ASSERT_EQ(Bits(master.data[i]), Bits(eth[i])) << i;
            ASSERT_EQ(Bits(m.data[i]), Bits(em[i])) << i;
            ASSERT_EQ(Bits(v.data[i]), Bits(ev[i])) << i;
            ASSERT_EQ(mirror.data[i], FloatToBf16(master.data[i])) << i;
          }
          ASSERT_EQ(mirror.data[n], kGuard) << "wrote past the end";

          // BF16 gradient: same as the FP32 kernel fed the widened values.
          std::vector<float> widened(n);
          for (int64_t i = 0; i < n; ++i) widened[i] = Bf16ToFloat(grad16.data[i]);
          std::vector<float> wm(m0), wv(v0), wth(th0);
          std::vector<bf16_t> wmirror(n + 1);
          scalar->step_f32(c, wth.data(), wm.data(), wv.data(), wmirror.data(), widened.data(), n);
          std::copy(th0.begin(), th0.end(), master.data);
          std::copy(m0.begin(), m0.end(), m.data);
          std::copy(v0.begin(), v0.end(), v.data);
          k->step_bf16(c, master.data, m.data, v.data, mirror.data, grad16.data, n);
          for (int64_t i = 0; i < n; ++i) {
            ASSERT_EQ(Bits(master.data[i]), Bits(wth[i])) << i;
            ASSERT_EQ(Bits(m.data[i]), Bits(wm[i])) << i;
            ASSERT_EQ(Bits(v.data[i]), Bits(wv[i])) << i;
            ASSERT_EQ(mirror.data[i], wmirror[i]) << i;
          }
          ASSERT_EQ(mirror.data[n], kGuard);
        }
      }
    }
  }
}

// Without a mirror (runtime.param_source: master) every kernel, checked or not, FP32 or BF16
// gradient, leaves master, m and v bit for bit as the scalar kernel with a mirror does; the
// checked ones stop at the same element.
TEST(AdamWKernels, NoMirrorIsTheMirrorStepWithoutItsStores) {
  AdamWStepParams p;
  p.lr = 1e-3;
  p.step = 5;
  p.weight_decay = 0.1;
  const AdamKernelTable* scalar = AdamKernelsFor(AdamIsa::kScalar);
  for (AdamIsa isa : SupportedIsas()) {
    const AdamKernelTable* k = AdamKernelsFor(isa);
    for (const bool stream : {true, false}) {
      AdamWConstants c = MakeAdamWConstants(p);
      c.stream_mirror = stream;
      for (int64_t n : {0, 1, 15, 16, 17, 33, 1000, 1027}) {
        for (int64_t bad_at : {int64_t{-1}, n / 2, n - 1}) {
          if (n == 0 && bad_at >= 0) continue;
          SCOPED_TRACE(testing::Message() << AdamIsaName(isa) << " n=" << n << " stream=" << stream
                                          << " bad_at=" << bad_at);
          std::mt19937 rng(static_cast<uint32_t>(n * 31 + 7));
          std::uniform_real_distribution<float> u(-1.0f, 1.0f);
          Buffer<float> master(n, n % 3), m(n, 1), v(n, 2), grad(n, 3);
          Buffer<bf16_t> grad16(n, 5);
          for (int64_t i = 0; i < n; ++i) {
            master.data[i] = u(rng);
            m.data[i] = u(rng) * 1e-2f;
            v.data[i] = std::fabs(u(rng)) * 1e-4f;
            grad.data[i] = u(rng) * 1e-2f;
          }
          if (bad_at >= 0) grad.data[bad_at] = std::numeric_limits<float>::quiet_NaN();
          for (int64_t i = 0; i < n; ++i) grad16.data[i] = FloatToBf16(grad.data[i]);
          const std::vector<float> th0(master.data, master.data + n), m0(m.data, m.data + n), v0(v.data, v.data + n);
          for (const bool bf16_grad : {false, true}) {
            for (const bool checked : {false, true}) {
              if (bad_at >= 0 && !checked) continue;  // (unchecked kernels propagate NaN: not this test)
              std::vector<float> eth(th0), em(m0), ev(v0);
              std::vector<bf16_t> emirror(n);
              std::copy(th0.begin(), th0.end(), master.data);
              std::copy(m0.begin(), m0.end(), m.data);
              std::copy(v0.begin(), v0.end(), v.data);
              int64_t want = -1, got = -1;
              if (bf16_grad) {
                if (checked) {
                  want = scalar->step_bf16_checked(c, eth.data(), em.data(), ev.data(), emirror.data(), grad16.data, n);
                  got = k->step_bf16_checked(c, master.data, m.data, v.data, nullptr, grad16.data, n);
                } else {
                  scalar->step_bf16(c, eth.data(), em.data(), ev.data(), emirror.data(), grad16.data, n);
                  k->step_bf16(c, master.data, m.data, v.data, nullptr, grad16.data, n);
                }
              } else {
                if (checked) {
                  want = scalar->step_f32_checked(c, eth.data(), em.data(), ev.data(), emirror.data(), grad.data, n);
                  got = k->step_f32_checked(c, master.data, m.data, v.data, nullptr, grad.data, n);
                } else {
                  scalar->step_f32(c, eth.data(), em.data(), ev.data(), emirror.data(), grad.data, n);
                  k->step_f32(c, master.data, m.data, v.data, nullptr, grad.data, n);
                }
              }
              ASSERT_EQ(got, want);
              ASSERT_EQ(want, bad_at);
              for (int64_t i = 0; i < n; ++i) {
                ASSERT_EQ(Bits(master.data[i]), Bits(eth[i])) << i;
                ASSERT_EQ(Bits(m.data[i]), Bits(em[i])) << i;
                ASSERT_EQ(Bits(v.data[i]), Bits(ev[i])) << i;
              }
            }
          }
        }
      }
    }
  }
}

// With lr = 0 the master is unchanged, so the mirror shows the vector BF16 rounding on chosen bit
// patterns: ties to even both ways, values that round up into the exponent, to infinity,
// subnormals, signed zeros, infinities and NaNs.
TEST(AdamWKernels, MirrorRoundsToNearestEvenLikeFloatToBf16) {
  const uint32_t patterns[] = {0x3f808000u, 0x3f818000u, 0x3f80ffffu, 0x3f807fffu, 0x3fffffffu,
                               0x7f7fffffu, 0x7f7f8000u, 0x00000001u, 0x00008000u, 0x00018000u,
                               0x80000000u, 0x00000000u, 0x7f800000u, 0xff800000u, 0x7fc00000u,
                               0x7f800001u, 0xffa00001u, 0xbf808000u, 0xc0490fdbu, 0x0080ffffu};
  const int64_t n = sizeof(patterns) / sizeof(patterns[0]);
  AdamWStepParams p;
  p.lr = 0.0;
  for (AdamIsa isa : SupportedIsas()) {
    SCOPED_TRACE(AdamIsaName(isa));
    std::vector<float> master(n), m(n, 0.0f), v(n, 0.0f), grad(n, 0.0f);
    for (int64_t i = 0; i < n; ++i) std::memcpy(&master[i], &patterns[i], 4);
    std::vector<bf16_t> mirror(n);
    AdamKernelsFor(isa)->step_f32(MakeAdamWConstants(p), master.data(), m.data(), v.data(),
                                  mirror.data(), grad.data(), n);
    for (int64_t i = 0; i < n; ++i) {
      float orig;
      std::memcpy(&orig, &patterns[i], 4);
      if (!std::isnan(orig)) {
        EXPECT_EQ(Bits(master[i]), patterns[i]) << "lr=0 changed master " << i;
      }
      EXPECT_EQ(mirror[i], FloatToBf16(master[i])) << std::hex << patterns[i];
    }
    // Spot values: ties to even.
    EXPECT_EQ(mirror[0], 0x3f80);            // 1.00390625 is a tie, rounds down to even
    EXPECT_EQ(mirror[1], 0x3f82);            // tie rounds up to even
    EXPECT_EQ(mirror[5], 0x7f80);            // FLT_MAX rounds to +inf
    EXPECT_EQ(mirror[14] & 0x7fc0, 0x7fc0);  // NaN stays a quiet NaN
  }
}

// A NaN or infinite gradient poisons exactly its own element, as in PyTorch: m, v and theta become
// NaN/inf there and the mirror holds a NaN; neighbours are untouched by it.
TEST(AdamWKernels, NonFiniteGradientsPropagateLikeTorch) {
  constexpr int64_t kN = 40;
  const float nan = std::numeric_limits<float>::quiet_NaN();
  const float inf = std::numeric_limits<float>::infinity();
  for (AdamIsa isa : SupportedIsas()) {
    SCOPED_TRACE(AdamIsaName(isa));
    std::vector<float> master(kN, 0.5f), m(kN, 0.0f), v(kN, 0.0f), grad(kN, 0.25f);
    grad[3] = nan;
    grad[20] = inf;
    grad[37] = -inf;
    std::vector<bf16_t> mirror(kN);
    AdamWStepParams p;
    AdamKernelsFor(isa)->step_f32(MakeAdamWConstants(p), master.data(), m.data(), v.data(),
                                  mirror.data(), grad.data(), kN);
    EXPECT_TRUE(std::isnan(m[3]) && std::isnan(v[3]) && std::isnan(master[3]));
    EXPECT_TRUE(std::isinf(m[20]) && m[20] > 0 && std::isinf(v[20]));
    EXPECT_TRUE(std::isnan(master[20]));  // inf / inf in the update, as torch
    EXPECT_TRUE(std::isinf(m[37]) && m[37] < 0 && std::isnan(master[37]));
    for (int64_t i : {3, 20, 37}) EXPECT_EQ(mirror[i] & 0x7fc0, 0x7fc0) << i;
    for (int64_t i : {2, 4, 19, 21, 36, 38}) {
      EXPECT_TRUE(std::isfinite(master[i]) && std::isfinite(m[i]) && std::isfinite(v[i])) << i;
      EXPECT_EQ(Bits(master[i]), Bits(master[0])) << i;
    }
  }
}

TEST(AdamWKernels, FirstStepOfDefaultAdamMovesByLr) {
  // Known closed form: at t=1 with m=v=0, m/bc1 = g and sqrt(v/bc2) = |g|, so
  // theta' = theta*(1 - lr*wd) - lr * g / (|g| + eps) ~ theta*(1-lr*wd) - lr*sign(g).
  AdamWStepParams p;
  p.lr = 1e-3;
  float master[2] = {1.0f, -2.0f}, m[2] = {0, 0}, v[2] = {0, 0}, grad[2] = {0.5f, -3.0f};
  bf16_t mirror[2];
  AdamWStep(p, master, m, v, mirror, grad, 2);
  EXPECT_NEAR(master[0], 1.0 * (1 - 1e-5) - 1e-3, 1e-7);
  EXPECT_NEAR(master[1], -2.0 * (1 - 1e-5) + 1e-3, 2e-7);
}

TEST(AdamWKernels, SumSquaresAllIsas) {
  for (int64_t n : {0, 1, 7, 15, 22, 33, 1000, 1027, 100003}) {
    std::mt19937 rng(static_cast<uint32_t>(n));
    std::normal_distribution<float> normal(0.0f, 3.0f);
    Buffer<float> g(n, n % 5);
    Buffer<bf16_t> g16(n, n % 7);
    double ref = 0, ref16 = 0;
    for (int64_t i = 0; i < n; ++i) {
      g.data[i] = normal(rng);
      g16.data[i] = FloatToBf16(g.data[i]);
      ref += static_cast<double>(g.data[i]) * g.data[i];
      ref16 += static_cast<double>(Bf16ToFloat(g16.data[i])) * Bf16ToFloat(g16.data[i]);
    }
    for (AdamIsa isa : SupportedIsas()) {
      SCOPED_TRACE(testing::Message() << AdamIsaName(isa) << " n=" << n);
      const AdamKernelTable* k = AdamKernelsFor(isa);
      EXPECT_NEAR(k->sumsq_f32(g.data, n), ref, 1e-12 * ref);
      EXPECT_NEAR(k->sumsq_bf16(g16.data, n), ref16, 1e-12 * ref16);
    }
  }
  EXPECT_EQ(SumSquares(nullptr, 0), 0.0);
  const float big[3] = {1e30f, -1e30f, 3.0f};  // would overflow a float accumulator
  const double b = big[0];
  EXPECT_NEAR(SumSquares(big, 3), 2 * b * b + 9, 1e-15 * b * b);
}

// The checked kernels of every ISA: on finite data bit for bit the unchecked kernel; with a NaN or
// inf at any position of awkward lengths and mirror alignments (vector body, head, tails) they
// stop there: the elements before it as the unchecked kernel makes them, nothing from it on.
TEST(AdamWKernels, CheckedKernelsStopBeforeTheFirstNonFiniteGradient) {
  const float kBad[] = {std::numeric_limits<float>::quiet_NaN(), -std::numeric_limits<float>::infinity()};
  AdamWStepParams p;
  p.lr = 1e-3;
  p.weight_decay = 0.1;
  const AdamWConstants c = MakeAdamWConstants(p);
  for (AdamIsa isa : SupportedIsas()) {
    SCOPED_TRACE(AdamIsaName(isa));
    const AdamKernelTable* k = AdamKernelsFor(isa);
    for (int64_t n : {1, 22, 31, 33, 100, 1000}) {
      for (int64_t shift : {0, 3}) {  // the mirror's alignment decides the head
        std::vector<float> g(n);
        for (int64_t i = 0; i < n; ++i) g[i] = 1e-3f * static_cast<float>((i * 7) % 13 - 6) + 1e30f * (i == 5);
        std::vector<bf16_t> gb(n);
        for (int64_t i = 0; i < n; ++i) gb[i] = FloatToBf16(g[i]);
        for (int64_t pos : {int64_t{-1}, int64_t{0}, n / 2, n - 1}) {
          for (float bad : kBad) {
            std::vector<float> gg = g;
            std::vector<bf16_t> ggb = gb;
            if (pos >= 0) {
              gg[pos] = bad;
              ggb[pos] = FloatToBf16(bad);
            }
            for (bool bf16 : {false, true}) {
              std::vector<float> m0(n + 8, 0.5f), m1 = m0, mm0(n + 8, 1e-3f), mm1 = mm0, v0(n + 8, 1e-6f), v1 = v0;
              std::vector<bf16_t> r0(n + 8, 0), r1 = r0;
              const int64_t stop = pos >= 0 ? pos : n;
              int64_t got;
              if (bf16) {
                k->step_bf16(c, m0.data() + shift, mm0.data() + shift, v0.data() + shift, r0.data() + shift, ggb.data(),
                             stop);
                got = k->step_bf16_checked(c, m1.data() + shift, mm1.data() + shift, v1.data() + shift,
                                           r1.data() + shift, ggb.data(), n);
              } else {
                k->step_f32(c, m0.data() + shift, mm0.data() + shift, v0.data() + shift, r0.data() + shift, gg.data(),
                            stop);
                got = k->step_f32_checked(c, m1.data() + shift, mm1.data() + shift, v1.data() + shift,
                                          r1.data() + shift, gg.data(), n);
              }
              ASSERT_EQ(got, pos) << "n " << n << " pos " << pos << " bf16 " << bf16;
              ASSERT_EQ(0, std::memcmp(m0.data(), m1.data(), m0.size() * 4)) << n << " " << pos;
              ASSERT_EQ(0, std::memcmp(mm0.data(), mm1.data(), mm0.size() * 4)) << n << " " << pos;
              ASSERT_EQ(0, std::memcmp(v0.data(), v1.data(), v0.size() * 4)) << n << " " << pos;
              ASSERT_EQ(0, std::memcmp(r0.data(), r1.data(), r0.size() * 2)) << n << " " << pos;
            }
            if (pos < 0) break;  // without a bad element one pass is enough
          }
        }
      }
    }
  }
}

}  // namespace
}  // namespace slidedp::update
