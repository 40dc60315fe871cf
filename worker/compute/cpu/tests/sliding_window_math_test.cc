// Sliding-window attention in the reference math (AttentionForward / AttentionBackward with a
// window): the keys each query sees against transformers' mask written out pair by pair, the
// output against a dense softmax over that mask, the gradients against central differences in
// double, and the edges: window 1, windows at or past the longest document (full attention, bit for
// bit), documents shorter and longer than the window.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "gtest/gtest.h"
#include "worker/compute/cpu/dense_reference_math.h"
#include "worker/compute/cpu/tests/cpu_test_util.h"

namespace slidedp {
namespace {

using testing::MakeBatch;
using testing::RandomNormals;

// transformers 5.17's rule, as masking_utils.py composes it for a sliding layer over a packed row:
// causal_mask_function (kv_idx <= q_idx), sliding_window_overlay (kv_idx > q_idx - sliding_window)
// and packed_sequence_mask_function (the same document). window 0: a full layer (no overlay).
bool HfSees(const MicroBatch& mb, int64_t q, int64_t kv, int64_t window) {
  auto doc = [&](int64_t t) {
    return std::upper_bound(mb.cu_seqlens.begin(), mb.cu_seqlens.end(), t) - mb.cu_seqlens.begin();
  };
  const bool causal = kv <= q;
  const bool overlay = window == 0 || kv > q - window;
  return causal && overlay && doc(q) == doc(kv);
}

struct Shape {
  DecoderDims dims;
  MicroBatch mb;
  RopeTables rope;  // unused by attention; MakeTokenGeometry's
  TokenGeometry geom;
};

// heads query heads over kv_heads of head_dim, on documents of the given lengths.
Shape MakeShape(int64_t heads, int64_t kv_heads, int64_t head_dim, const std::vector<int32_t>& docs) {
  Shape s;
  s.dims.heads = heads;
  s.dims.kv_heads = kv_heads;
  s.dims.head_dim = head_dim;
  s.mb = MakeBatch(docs, 50, 3);
  s.rope = BuildRopeTables(s.mb.positions, head_dim, 10000.0);
  s.geom = MakeTokenGeometry(s.mb, s.rope);
  return s;
}

// Documents shorter than, as long as, and longer than the windows below, and one of one token.
const std::vector<int32_t> kDocs = {5, 1, 9, 3, 12, 2};
const int64_t kWindows[] = {1, 2, 3, 4, 7, 12, 13, 40};

// With every score equal (q = 0), a query's output is the mean of the values it sees: value
// vectors one-hot in the key's index say exactly which keys those are.
TEST(SlidingWindowMask, EachQuerySeesExactlyTheKeysOfTransformersMask) {
  const int64_t T = 32;
  Shape s = MakeShape(2, 1, T, kDocs);
  ASSERT_EQ(s.mb.num_tokens(), T);
  const int64_t qd = s.dims.q_dim(), kvd = s.dims.kv_dim();
  std::vector<double> q(T * qd, 0.0), k = RandomNormals<double>(T * kvd, 1), v(T * kvd, 0.0);
  for (int64_t j = 0; j < T; ++j) v[j * kvd + j] = 1.0;
  for (int64_t window : {int64_t{0}, int64_t{1}, int64_t{2}, int64_t{3}, int64_t{12}, int64_t{13}}) {
    std::vector<double> attn(T * qd), lse(T * s.dims.heads);
    AttentionForward(s.dims, s.geom, window, q.data(), k.data(), v.data(), attn.data(), lse.data(), nullptr);
    for (int64_t i = 0; i < T; ++i) {
      int64_t seen = 0;
      for (int64_t j = 0; j < T; ++j) seen += HfSees(s.mb, i, j, window);
      ASSERT_GE(seen, 1);
      EXPECT_LE(seen, window > 0 ? window : T);
      for (int64_t h = 0; h < s.dims.heads; ++h) {
        EXPECT_NEAR(lse[i * s.dims.heads + h], std::log(static_cast<double>(seen)), 1e-14);
        for (int64_t j = 0; j < T; ++j) {
          const double expect = HfSees(s.mb, i, j, window) ? 1.0 / static_cast<double>(seen) : 0.0;
          ASSERT_NEAR(attn[i * qd + h * T + j], expect, 1e-15)
              << "window " << window << ": query " << i << " key " << j;
        }
      }
    }
  }
}

// Random scores: AttentionForward equals a dense softmax over the whole row with transformers'
// mask (-inf where it hides a key), output and log-sum-exp.
TEST(SlidingWindowMask, OutputEqualsDenseSoftmaxOverTheMask) {
  Shape s = MakeShape(6, 2, 8, kDocs);
  const int64_t T = s.mb.num_tokens(), qd = s.dims.q_dim(), kvd = s.dims.kv_dim(), hd = s.dims.head_dim;
  const int64_t group = s.dims.heads / s.dims.kv_heads;
  const std::vector<double> q = RandomNormals<double>(T * qd, 2), k = RandomNormals<double>(T * kvd, 3),
                            v = RandomNormals<double>(T * kvd, 4);
  const double scale = 1.0 / std::sqrt(static_cast<double>(hd));
  for (int64_t window : kWindows) {
    std::vector<double> attn(T * qd), lse(T * s.dims.heads);
    AttentionForward(s.dims, s.geom, window, q.data(), k.data(), v.data(), attn.data(), lse.data(), nullptr);
    for (int64_t i = 0; i < T; ++i) {
      for (int64_t h = 0; h < s.dims.heads; ++h) {
        const int64_t g = h / group;
        std::vector<double> score(T, -std::numeric_limits<double>::infinity());
        double mx = -std::numeric_limits<double>::infinity();
        for (int64_t j = 0; j < T; ++j) {
          if (!HfSees(s.mb, i, j, window)) continue;
          double dot = 0;
          for (int64_t c = 0; c < hd; ++c) dot += q[i * qd + h * hd + c] * k[j * kvd + g * hd + c];
          score[j] = scale * dot;
          mx = std::max(mx, score[j]);
        }
        double sum = 0;
        for (int64_t j = 0; j < T; ++j) sum += std::exp(score[j] - mx);  // exp(-inf) = 0
        EXPECT_NEAR(lse[i * s.dims.heads + h], mx + std::log(sum), 1e-12);
        for (int64_t c = 0; c < hd; ++c) {
          double o = 0;
          for (int64_t j = 0; j < T; ++j) o += std::exp(score[j] - mx) / sum * v[j * kvd + g * hd + c];
          ASSERT_NEAR(attn[i * qd + h * hd + c], o, 1e-12) << "window " << window << " query " << i << " head " << h;
        }
      }
    }
  }
}

// A window at least as long as the longest document is full attention, bit for bit, in both
// directions; a shorter one is not.
TEST(SlidingWindowMask, WindowAtLeastTheLongestDocumentIsFullAttention) {
  Shape s = MakeShape(4, 2, 8, kDocs);
  const int64_t T = s.mb.num_tokens(), qd = s.dims.q_dim(), kvd = s.dims.kv_dim();
  const std::vector<float> q = RandomNormals<float>(T * qd, 5), k = RandomNormals<float>(T * kvd, 6),
                           v = RandomNormals<float>(T * kvd, 7), dout = RandomNormals<float>(T * qd, 8);
  auto run = [&](int64_t window) {
    std::vector<float> out(T * qd), lse(T * s.dims.heads), dq(T * qd), dk(T * kvd), dv(T * kvd);
    AttentionForward(s.dims, s.geom, window, q.data(), k.data(), v.data(), out.data(), lse.data(), nullptr);
    AttentionBackward(s.dims, s.geom, window, q.data(), k.data(), v.data(), out.data(), lse.data(), dout.data(),
                      dq.data(), dk.data(), dv.data(), nullptr);
    out.insert(out.end(), dq.begin(), dq.end());
    out.insert(out.end(), dk.begin(), dk.end());
    out.insert(out.end(), dv.begin(), dv.end());
    return out;
  };
  const std::vector<float> full = run(0);
  EXPECT_EQ(run(12), full);  // the longest document
  EXPECT_EQ(run(1 << 20), full);
  EXPECT_NE(run(11), full);
}

// Window 1: each query sees itself alone, so its output is its value and nothing flows to q or k.
TEST(SlidingWindowMask, WindowOfOneIsTheValueItself) {
  Shape s = MakeShape(4, 2, 8, kDocs);
  const int64_t T = s.mb.num_tokens(), qd = s.dims.q_dim(), kvd = s.dims.kv_dim(), hd = s.dims.head_dim;
  const std::vector<double> q = RandomNormals<double>(T * qd, 9), k = RandomNormals<double>(T * kvd, 10),
                            v = RandomNormals<double>(T * kvd, 11), dout = RandomNormals<double>(T * qd, 12);
  std::vector<double> attn(T * qd), lse(T * s.dims.heads), dq(T * qd), dk(T * kvd), dv(T * kvd);
  AttentionForward(s.dims, s.geom, 1, q.data(), k.data(), v.data(), attn.data(), lse.data(), nullptr);
  AttentionBackward(s.dims, s.geom, 1, q.data(), k.data(), v.data(), attn.data(), lse.data(), dout.data(), dq.data(),
                    dk.data(), dv.data(), nullptr);
  const int64_t group = s.dims.heads / s.dims.kv_heads;
  for (int64_t t = 0; t < T; ++t) {
    for (int64_t h = 0; h < s.dims.heads; ++h) {
      for (int64_t c = 0; c < hd; ++c) {
        ASSERT_EQ(attn[t * qd + h * hd + c], v[t * kvd + (h / group) * hd + c]);
        ASSERT_EQ(dq[t * qd + h * hd + c], 0.0);
      }
    }
    for (int64_t c = 0; c < kvd; ++c) {
      ASSERT_EQ(dk[t * kvd + c], 0.0);
      double sum = 0;  // dv: the gradients of the query heads sharing the kv head
      for (int64_t h = (c / hd) * group; h < (c / hd + 1) * group; ++h) sum += dout[t * qd + h * hd + c % hd];
      ASSERT_NEAR(dv[t * kvd + c], sum, 1e-15);
    }
  }
}

// dL/dq, dL/dk, dL/dv of L = sum(c * attn) against central differences in double, every window.
TEST(SlidingWindowGradCheck, AttentionGradientsMatchCentralDifferences) {
  Shape s = MakeShape(6, 2, 4, kDocs);
  const int64_t T = s.mb.num_tokens(), qd = s.dims.q_dim(), kvd = s.dims.kv_dim();
  std::vector<double> q = RandomNormals<double>(T * qd, 13), k = RandomNormals<double>(T * kvd, 14),
                      v = RandomNormals<double>(T * kvd, 15);
  const std::vector<double> c = RandomNormals<double>(T * qd, 16);
  constexpr double kStep = 1e-5, kRelTol = 1e-6;
  for (int64_t window : kWindows) {
    SCOPED_TRACE(::testing::Message() << "window " << window);
    auto objective = [&]() {
      std::vector<double> attn(T * qd), lse(T * s.dims.heads);
      AttentionForward(s.dims, s.geom, window, q.data(), k.data(), v.data(), attn.data(), lse.data(), nullptr);
      double sum = 0;
      for (int64_t i = 0; i < T * qd; ++i) sum += c[i] * attn[i];
      return sum;
    };
    std::vector<double> attn(T * qd), lse(T * s.dims.heads), dq(T * qd), dk(T * kvd), dv(T * kvd);
    AttentionForward(s.dims, s.geom, window, q.data(), k.data(), v.data(), attn.data(), lse.data(), nullptr);
    AttentionBackward(s.dims, s.geom, window, q.data(), k.data(), v.data(), attn.data(), lse.data(), c.data(),
                      dq.data(), dk.data(), dv.data(), nullptr);
    for (auto [x, grad] : {std::pair{&q, &dq}, std::pair{&k, &dk}, std::pair{&v, &dv}}) {
      double largest = 0;
      for (double g : *grad) largest = std::max(largest, std::abs(g));
      for (size_t i = 0; i < x->size(); i += 3) {
        const double saved = (*x)[i];
        (*x)[i] = saved + kStep;
        const double up = objective();
        (*x)[i] = saved - kStep;
        const double down = objective();
        (*x)[i] = saved;
        const double fd = (up - down) / (2 * kStep), an = (*grad)[i];
        // Relative to the entry, floored at 1e-3 of the tensor's largest gradient (window 1: q and
        // k get none, and the differences must be as small as rounding).
        const double denom = std::max({std::abs(an), std::abs(fd), 1e-3 * largest, 1e-6});
        ASSERT_LT(std::abs(fd - an) / denom, kRelTol) << i << ": analytic " << an << " vs " << fd;
      }
    }
  }
}

}  // namespace
}  // namespace slidedp
