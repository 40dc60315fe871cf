// The attention check both attention test binaries run; see attention_check.h.
#include "worker/kernels/tests/attention_check.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "gtest/gtest.h"
#include "worker/kernels/tests/gpu_test.h"
#include "worker/kernels/tests/kernel_test_util.h"

namespace slidedp::kernel_test {

namespace {

// FP64 attention, causal inside each document of cu (and, window > 0, each query seeing the
// `window` keys ending at its own, HF's sliding window), with a sink logit per q head in each
// row's denominator where `sinks` is not empty: o, lse [nq, T], and the gradients of Σ dout·o (dv
// with v's row stride; dsinks [nq]).
struct Reference {
  std::vector<double> o, lse, dq, dk, dv, dsinks;
};
Reference ReferenceAttention(const std::vector<double>& q, const std::vector<double>& k, const std::vector<double>& v,
                             const std::vector<double>& dout, const std::vector<int32_t>& cu, int hd, int nq, int nkv,
                             int64_t ldq, int64_t ldk, int64_t ldv, double sc, int window = 0,
                             const std::vector<double>& sinks = {}) {
  const int64_t T = cu.back();
  const int group = nq / nkv;
  Reference r;
  r.o.assign(T * ldq, 0);
  r.lse.assign(nq * T, 0);
  r.dq.assign(T * ldq, 0);
  r.dk.assign(T * ldk, 0);
  r.dv.assign(T * ldv, 0);
  r.dsinks.assign(nq, 0);
  std::vector<double>&ro = r.o, &rl = r.lse, &rdq = r.dq, &rdk = r.dk, &rdv_full = r.dv;
  for (size_t d = 0; d + 1 < cu.size(); ++d)
    for (int h = 0; h < nq; ++h) {
      const int kh = h / group;
      for (int64_t i = cu[d]; i < cu[d + 1]; ++i) {
        const int64_t j0 = window > 0 ? std::max<int64_t>(cu[d], i - window + 1) : cu[d];
        std::vector<double> p(i - j0 + 1);
        double m = sinks.empty() ? -INFINITY : sinks[h];
        for (int64_t j = j0; j <= i; ++j) {
          double s = 0;
          for (int c = 0; c < hd; ++c) s += q[i * ldq + h * hd + c] * k[j * ldk + kh * hd + c];
          p[j - j0] = s * sc;
          m = std::max(m, s * sc);
        }
        double sum = sinks.empty() ? 0 : std::exp(sinks[h] - m);
        for (auto& x : p) {
          x = std::exp(x - m);
          sum += x;
        }
        rl[h * T + i] = m + std::log(sum);
        for (auto& x : p) x /= sum;
        std::vector<double> oo(hd, 0), dp(p.size());
        for (int64_t j = j0; j <= i; ++j)
          for (int c = 0; c < hd; ++c) oo[c] += p[j - j0] * v[j * ldv + kh * hd + c];
        double D = 0;
        for (int c = 0; c < hd; ++c) {
          ro[i * ldq + h * hd + c] = oo[c];
          D += oo[c] * dout[i * ldq + h * hd + c];
        }
        if (!sinks.empty()) r.dsinks[h] -= std::exp(sinks[h] - rl[h * T + i]) * D;
        for (int64_t j = j0; j <= i; ++j) {
          double x = 0;
          for (int c = 0; c < hd; ++c) x += dout[i * ldq + h * hd + c] * v[j * ldv + kh * hd + c];
          const double pj = p[j - j0], ds = pj * (x - D) * sc;
          for (int c = 0; c < hd; ++c) {
            rdq[i * ldq + h * hd + c] += ds * k[j * ldk + kh * hd + c];
            rdk[j * ldk + kh * hd + c] += ds * q[i * ldq + h * hd + c];
            rdv_full[j * ldv + kh * hd + c] += pj * dout[i * ldq + h * hd + c];
          }
        }
      }
    }
  return r;
}

// Self attention over the documents of cu (host) / dcu (device), scale 1/sqrt(hd).
kernels::AttnArgs SelfArgs(const std::vector<int32_t>& cu, const int32_t* dcu, int nq, int nkv, int hd) {
  kernels::AttnArgs a;
  a.tokens = cu.back();
  a.num_docs = static_cast<int>(cu.size()) - 1;
  for (size_t d = 0; d + 1 < cu.size(); ++d) a.max_seqlen = std::max(a.max_seqlen, cu[d + 1] - cu[d]);
  a.num_q_heads = nq;
  a.num_kv_heads = nkv;
  a.head_dim = hd;
  a.softmax_scale = 1.0f / std::sqrt(static_cast<float>(hd));
  a.cu_seqlens = dcu;
  a.cu_seqlens_host = cu.data();
  return a;
}

}  // namespace

void CheckAttention(int hd, int nq, int nkv, const std::vector<int>& docs, kernels::AttnArgs::BwdSplit split,
                    kernels::CudnnAttention* cudnn, bool ordered, int window, bool sinks) {
  std::vector<int32_t> cu = {0};
  for (int d : docs) cu.push_back(cu.back() + d);
  const int64_t T = cu.back();
  const int64_t ldq = nq * hd, ldk = nkv * hd, ldv = nkv * hd + 24;  // v strided like the packed qkv
  auto q = RandVec(T * ldq), k = RandVec(T * ldk), v = RandVec(T * ldv), dout = RandVec(T * ldq);
  std::unique_ptr<Dev<bf16>> dq_in(NewBf16(q)), dk_in(NewBf16(k)), dv_in(NewBf16(v)), ddo(NewBf16(dout));
  Dev<int32_t> dcu(cu.size());
  Upload(dcu, cu);
  Dev<bf16> o(T * ldq), dq(T * ldq), dk(T * ldk), dv(T * ldv);
  Dev<float> lse(nq * T);
  kernels::AttnArgs a = SelfArgs(cu, dcu.get(), nq, nkv, hd);
  a.bwd_split = split;
  a.ordered_dq = ordered;
  a.window = window;
  // Sinks of either sign and size (GPT-OSS's learned ones spread around 0 and up to a few units).
  std::vector<double> sink_values;
  Dev<float> dsinks_dev(nq), sinks_dev(nq);
  if (sinks) {
    for (int h = 0; h < nq; ++h) sink_values.push_back(-3.0 + 6.0 * h / std::max(1, nq - 1));
    std::vector<float> f(sink_values.begin(), sink_values.end()), zero(nq, 0.f);
    Upload(sinks_dev, f);
    Upload(dsinks_dev, zero);
    a.sinks = sinks_dev.get();
    a.dsinks = dsinks_dev.get();
  }
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
    ASSERT_OK(kernels::FlashAttentionForward(a, {dq_in->get(), ldq}, {dk_in->get(), ldk}, {dv_in->get(), ldv},
                                             {o.get(), ldq}, lse.get(), nullptr));
    ASSERT_CUDA_OK(cudaDeviceSynchronize());
    // Backward consumes the kernel's own O (as in training).
    auto backward = [&] {
      ASSERT_OK(kernels::FlashAttentionBackward(a, {dq_in->get(), ldq}, {dk_in->get(), ldk}, {dv_in->get(), ldv},
                                                {o.get(), ldq}, lse.get(), {ddo->get(), ldq}, {dq.get(), ldq},
                                                {dk.get(), ldk}, {dv.get(), ldv}, ws.get(), nullptr));
      ASSERT_CUDA_OK(cudaDeviceSynchronize());
    };
    backward();
    if (ordered) {
      const std::vector<uint16_t> first = grads_bits();
      bool same = true;
      for (int run = 0; run < 2; ++run) {
        backward();
        same = same && !first.empty() && grads_bits() == first;
      }
      std::printf("%s  attention bwd ordered dQ: 3 runs bitwise equal (hd=%d %d/%d heads, %zu docs, T=%lld)\n",
                  same ? "PASS" : "FAIL", hd, nq, nkv, docs.size(), static_cast<long long>(T));
      EXPECT_TRUE(same) << "attention bwd ordered dQ: 3 runs bitwise equal (hd=" << hd << " " << nq << "/" << nkv
                        << " heads, " << docs.size() << " docs, T=" << T << ")";
    }
  } else {
    const kernels::AttnRowStrides ld{ldq, ldk, ldv, ldq, ldq, ldq, ldk, ldv};
    absl::StatusOr<int64_t> fwd_ws = cudnn->ForwardWorkspaceBytes(a, ld);
    absl::StatusOr<int64_t> bwd_ws = fwd_ws.ok() ? cudnn->BackwardWorkspaceBytes(a, ld) : fwd_ws;
    // Only head dims 128 and 256 (the models we train: Qwen3.5's full attention is 256) must be
    // supported; cuDNN may lack other shapes.
    if (!bwd_ws.ok() && hd != 128 && hd != 256 && absl::IsUnimplemented(bwd_ws.status())) {
      GTEST_SKIP() << "cudnn attention hd=" << hd << ": " << bwd_ws.status().ToString();
    }
    ASSERT_OK(bwd_ws.status());
    // Poisoned (NaN) like every output: the check also catches workspace read before written.
    Dev<char> ws(std::max(*fwd_ws, *bwd_ws));
    ASSERT_OK(cudnn->Forward(a, {dq_in->get(), ldq}, {dk_in->get(), ldk}, {dv_in->get(), ldv}, {o.get(), ldq},
                             lse.get(), ws.get(), nullptr));
    ASSERT_CUDA_OK(cudaDeviceSynchronize());
    ASSERT_OK(cudnn->Backward(a, {dq_in->get(), ldq}, {dk_in->get(), ldk}, {dv_in->get(), ldv}, {o.get(), ldq},
                              lse.get(), {ddo->get(), ldq}, {dq.get(), ldq}, {dk.get(), ldk}, {dv.get(), ldv}, ws.get(),
                              nullptr));
    ASSERT_CUDA_OK(cudaDeviceSynchronize());
    // Whether more backwards on the same inputs give the same bits: reported, not checked (cuDNN
    // 9.19's Hopper engines add dQ with atomics; small cases are usually repeatable anyway).
    const std::vector<uint16_t> first = grads_bits();
    bool same = true;
    for (int run = 0; run < 2; ++run) {
      ASSERT_OK(cudnn->Backward(a, {dq_in->get(), ldq}, {dk_in->get(), ldk}, {dv_in->get(), ldv}, {o.get(), ldq},
                                lse.get(), {ddo->get(), ldq}, {dq.get(), ldq}, {dk.get(), ldk}, {dv.get(), ldv},
                                ws.get(), nullptr));
      ASSERT_CUDA_OK(cudaDeviceSynchronize());
      same = same && grads_bits() == first;
    }
    std::printf("INFO  cudnn attention bwd bitwise repeatable over 3 runs (hd=%d, %zu docs, T=%lld): %s\n", hd,
                docs.size(), static_cast<long long>(T), same ? "yes" : "no");
  }
  const double sc = a.softmax_scale;
  const Reference r = ReferenceAttention(q, k, v, dout, cu, hd, nq, nkv, ldq, ldk, ldv, sc, window, sink_values);
  const std::vector<double>&ro = r.o, &rl = r.lse, &rdq = r.dq, &rdk = r.dk, &rdv_full = r.dv;
  std::vector<double> gdv, rdv;
  auto gv = DownBf16(dv.get(), T * ldv);
  for (int64_t t = 0; t < T; ++t)
    for (int c = 0; c < nkv * hd; ++c) {
      gdv.push_back(gv[t * ldv + c]);
      rdv.push_back(rdv_full[t * ldv + c]);
    }
  std::string tag = " (hd=" + std::to_string(hd) + " " + std::to_string(nq) + "/" + std::to_string(nkv) + " heads, " +
                    std::to_string(docs.size()) + " docs, T=" + std::to_string(T) +
                    (split == kernels::AttnArgs::BwdSplit::kPerKvHead  ? ", per-kv-head"
                     : split == kernels::AttnArgs::BwdSplit::kPerQHead ? ", per-q-head"
                                                                       : "") +
                    (ordered ? ", ordered dQ" : "") + (window > 0 ? ", window " + std::to_string(window) : "") +
                    (sinks ? ", sinks" : "") + ")";
  const std::string name = cudnn != nullptr ? "cudnn attention" : "attention";
  // The sinks' gradient: one backward added into zeros (the ordered runs add 3 times).
  if (sinks) {
    std::vector<double> got = DownF32(dsinks_dev.get(), nq);
    if (ordered && cudnn == nullptr)
      for (double& x : got) x /= 3;
    ExpectRelErr(name + " bwd dSinks" + tag, got, r.dsinks, 2e-2);
  }
  ExpectRelErr(name + " fwd O" + tag, DownBf16(o.get(), T * ldq), ro, 1e-2);
  ExpectRelErr(name + " fwd LSE" + tag, DownF32(lse.get(), nq * T), rl, 1e-4);
  ExpectRelErr(name + " bwd dQ" + tag, DownBf16(dq.get(), T * ldq), rdq, 2e-2);
  ExpectRelErr(name + " bwd dK" + tag, DownBf16(dk.get(), T * ldk), rdk, 2e-2);
  ExpectRelErr(name + " bwd dV" + tag, gdv, rdv, 2e-2);
}

void CheckOutputLowHalf(int hd, int nq, int nkv, const std::vector<int>& docs, bool sinks, double bias,
                        double gain) {
  std::vector<int32_t> cu = {0};
  for (int d : docs) cu.push_back(cu.back() + d);
  const int64_t T = cu.back();
  const int64_t ldq = nq * hd, ldk = nkv * hd, ldv = nkv * hd;
  auto q = RandVec(T * ldq, 0.3), k = RandVec(T * ldk, 0.3), dout = RandVec(T * ldq);
  const std::vector<double> common = RandVec(ldv, bias);
  std::vector<double> v = RandVec(T * ldv, 0.3);
  for (int64_t t = 0; t < T; ++t)
    for (int64_t c = 0; c < ldv; ++c) v[t * ldv + c] = Bf16ToFloat(FloatToBf16(static_cast<float>(v[t * ldv + c] + common[c])));
  std::unique_ptr<Dev<bf16>> dq_in(NewBf16(q)), dk_in(NewBf16(k)), dv_in(NewBf16(v)), ddo(NewBf16(dout));
  Dev<int32_t> dcu(cu.size());
  Upload(dcu, cu);
  Dev<bf16> o(T * ldq), o_lo(T * ldq), dq(T * ldq), dk(T * ldk), dv(T * ldv);
  Dev<float> lse(nq * T), sinks_dev(nq), dsinks_dev(nq);
  kernels::AttnArgs a = SelfArgs(cu, dcu.get(), nq, nkv, hd);
  std::vector<double> sink_values;
  if (sinks) {
    for (int h = 0; h < nq; ++h) sink_values.push_back(-2.0 + 4.0 * h / std::max(1, nq - 1));
    Upload(sinks_dev, std::vector<float>(sink_values.begin(), sink_values.end()));
    a.sinks = sinks_dev.get();
    a.dsinks = dsinks_dev.get();
  }
  a.o_lo = o_lo.get();
  ASSERT_OK(kernels::FlashAttentionForward(a, {dq_in->get(), ldq}, {dk_in->get(), ldk}, {dv_in->get(), ldv},
                                           {o.get(), ldq}, lse.get(), nullptr));
  Dev<char> ws(kernels::FlashAttentionBackwardWorkspaceBytes(a));
  const Reference r = ReferenceAttention(q, k, v, dout, cu, hd, nq, nkv, ldq, ldk, ldv, a.softmax_scale, 0, sink_values);
  std::string tag = " (hd=" + std::to_string(hd) + " " + std::to_string(nq) + "/" + std::to_string(nkv) +
                    " heads, T=" + std::to_string(T) + ", v component " + std::to_string(bias).substr(0, 4) +
                    (sinks ? ", sinks" : "") + ")";
  const std::vector<double> hi = DownBf16(o.get(), T * ldq), lo = DownBf16(o_lo.get(), T * ldq);
  std::vector<double> whole(hi.size());
  for (size_t i = 0; i < hi.size(); ++i) whole[i] = hi[i] + lo[i];
  // o + o_lo is the kernel's FP32 output, whose error is the BF16 probabilities' in P·V (on the
  // tensor-core path) rather than o's rounding, which the shared component makes the larger.
  const double hi_err = RelErr(hi, r.o);
  ExpectRelErr("attention fwd O" + tag, hi, r.o, 1e-2);
  ExpectRelErr("attention fwd O + o_lo (at most half o's error)" + tag, whole, r.o, 0.5 * hi_err);
  double err[2][2];
  for (int with = 1; with >= 0; --with) {
    a.o_lo = with ? o_lo.get() : nullptr;
    if (sinks) Upload(dsinks_dev, std::vector<float>(nq, 0.f));
    ASSERT_OK(kernels::FlashAttentionBackward(a, {dq_in->get(), ldq}, {dk_in->get(), ldk}, {dv_in->get(), ldv},
                                              {o.get(), ldq}, lse.get(), {ddo->get(), ldq}, {dq.get(), ldq},
                                              {dk.get(), ldk}, {dv.get(), ldv}, ws.get(), nullptr));
    ASSERT_CUDA_OK(cudaDeviceSynchronize());
    err[with][0] = RelErr(DownBf16(dq.get(), T * ldq), r.dq);
    err[with][1] = RelErr(DownBf16(dk.get(), T * ldk), r.dk);
    if (with) {
      ExpectRelErr("attention bwd dQ, row dots from o + o_lo" + tag, DownBf16(dq.get(), T * ldq), r.dq, 2e-2);
      ExpectRelErr("attention bwd dK, row dots from o + o_lo" + tag, DownBf16(dk.get(), T * ldk), r.dk, 2e-2);
      if (sinks) ExpectRelErr("attention bwd dSinks, o + o_lo" + tag, DownF32(dsinks_dev.get(), nq), r.dsinks, 2e-2);
    }
  }
  const bool ok = err[1][0] * gain <= err[0][0];
  std::printf("%s  attention bwd dQ / dK rel err: from o + o_lo %.3e / %.3e, from o alone %.3e / %.3e (dQ gain >= %g)%s\n",
              ok ? "PASS" : "FAIL", err[1][0], err[1][1], err[0][0], err[0][1], gain, tag.c_str());
  EXPECT_TRUE(ok) << "dQ from o + o_lo " << err[1][0] << " not " << gain << "x closer than from o alone " << err[0][0];
}

void CheckCrossAttention(int hd, int nq, int nkv, const std::vector<int>& docs, int ranks, bool ordered,
                         kernels::CudnnAttention* cudnn) {
  std::vector<int32_t> cu = {0};
  for (int d : docs) cu.push_back(cu.back() + d);
  const int64_t T = cu.back();
  const int64_t ldq = nq * hd, ldk = nkv * hd, ldv = nkv * hd + 24;
  auto q = RandVec(T * ldq), k = RandVec(T * ldk), v = RandVec(T * ldv), dout = RandVec(T * ldq);
  std::unique_ptr<Dev<bf16>> dk_in(NewBf16(k)), dv_in(NewBf16(v));
  const double sc = 1.0 / std::sqrt(static_cast<double>(hd));
  const Reference r = ReferenceAttention(q, k, v, dout, cu, hd, nq, nkv, ldq, ldk, ldv, sc);
  // The group's dK | dV in FP32, [T, 2 * kvd]: every rank's backward adds into it (the sum a
  // reduce-scatter forms across GPUs).
  const int64_t kvd = nkv * hd, ld_acc = 2 * kvd;
  Dev<float> dkv(T * ld_acc);
  ASSERT_CUDA_OK(cudaMemset(dkv.get(), 0, T * ld_acc * 4));
  std::vector<double> got_o(T * ldq), got_dq(T * ldq), got_lse(nq * T), ref_o(T * ldq), ref_dq(T * ldq),
      ref_lse(nq * T);
  const std::string tag = " (hd=" + std::to_string(hd) + " " + std::to_string(nq) + "/" + std::to_string(nkv) +
                          " heads, " + std::to_string(docs.size()) + " docs, T=" + std::to_string(T) + ", " +
                          std::to_string(ranks) + " ranks" + (ordered ? ", ordered dQ" : "") +
                          (cudnn != nullptr ? ", cudnn" : "") + ")";
  for (int rank = 0; rank < ranks; ++rank) {
    // Zig-zag share of the micro-batch as one row: chunks rank and 2C-1-rank of 2C.
    std::vector<int64_t> rows;
    for (int c : {rank, 2 * ranks - 1 - rank}) {
      for (int64_t g = c * T / (2 * ranks); g < (c + 1) * T / (2 * ranks); ++g) rows.push_back(g);
    }
    const int64_t L = static_cast<int64_t>(rows.size());
    // Pieces: runs of consecutive tokens of one document; keys from the document's start.
    std::vector<int32_t> lcu = {0}, bounds;
    int max_q = 0, max_kv = 0;
    for (int64_t i = 0; i < L; ++i) {
      const int64_t g = rows[i];
      const int doc = static_cast<int>(std::upper_bound(cu.begin(), cu.end(), g) - cu.begin()) - 1;
      const bool ends = i + 1 == L || rows[i + 1] != g + 1 || rows[i + 1] >= cu[doc + 1];
      if (!ends) continue;
      lcu.push_back(static_cast<int32_t>(i + 1));
      bounds.push_back(cu[doc]);
      bounds.push_back(static_cast<int32_t>(g + 1));
      max_q = std::max(max_q, lcu.back() - lcu[lcu.size() - 2]);
      max_kv = std::max(max_kv, static_cast<int>(g + 1 - cu[doc]));
    }
    std::vector<double> lq(L * ldq), ldo(L * ldq);
    for (int64_t i = 0; i < L; ++i)
      for (int64_t c = 0; c < ldq; ++c) {
        lq[i * ldq + c] = q[rows[i] * ldq + c];
        ldo[i * ldq + c] = dout[rows[i] * ldq + c];
      }
    std::unique_ptr<Dev<bf16>> dq_in(NewBf16(lq)), ddo(NewBf16(ldo));
    Dev<int32_t> dcu(lcu.size()), dbounds(bounds.size());
    Upload(dcu, lcu);
    Upload(dbounds, bounds);
    Dev<bf16> o(L * ldq), dq(L * ldq);
    Dev<float> lse(nq * L);
    kernels::AttnArgs a;
    a.tokens = L;
    a.num_docs = static_cast<int>(lcu.size()) - 1;
    a.max_seqlen = max_q;
    a.num_q_heads = nq;
    a.num_kv_heads = nkv;
    a.head_dim = hd;
    a.softmax_scale = static_cast<float>(sc);
    a.cu_seqlens = dcu.get();
    a.kv_bounds = dbounds.get();
    a.kv_tokens = T;
    a.max_seqlen_kv = max_kv;
    a.ordered_dq = ordered;
    a.cu_seqlens_host = lcu.data();
    a.kv_bounds_host = bounds.data();
    if (cudnn != nullptr) {
      const kernels::AttnRowStrides ld{ldq, ldk, ldv, ldq, ldq, ldq, 0, 0};
      absl::StatusOr<int64_t> fwd_ws = cudnn->ForwardWorkspaceBytes(a, ld);
      ASSERT_OK(fwd_ws.status());
      absl::StatusOr<int64_t> bwd_ws = cudnn->BackwardWorkspaceBytes(a, ld);
      ASSERT_OK(bwd_ws.status());
      Dev<char> ws(std::max(*fwd_ws, *bwd_ws));
      ASSERT_OK(cudnn->Forward(a, {dq_in->get(), ldq}, {dk_in->get(), ldk}, {dv_in->get(), ldv}, {o.get(), ldq},
                               lse.get(), ws.get(), nullptr));
      ASSERT_OK(cudnn->BackwardCross(a, {dq_in->get(), ldq}, {dk_in->get(), ldk}, {dv_in->get(), ldv}, {o.get(), ldq},
                                     lse.get(), {ddo->get(), ldq}, {dq.get(), ldq}, dkv.get(), dkv.get() + kvd, ld_acc,
                                     ws.get(), nullptr));
      ASSERT_CUDA_OK(cudaDeviceSynchronize());
      ordered = false;  // cuDNN's engines add dQ with atomics
    }
    Dev<char> ws(kernels::FlashAttentionBackwardWorkspaceBytes(a));
    if (cudnn == nullptr) {
      ASSERT_OK(kernels::FlashAttentionForward(a, {dq_in->get(), ldq}, {dk_in->get(), ldk}, {dv_in->get(), ldv},
                                               {o.get(), ldq}, lse.get(), nullptr));
      ASSERT_OK(kernels::FlashAttentionBackwardCross(a, {dq_in->get(), ldq}, {dk_in->get(), ldk}, {dv_in->get(), ldv},
                                                     {o.get(), ldq}, lse.get(), {ddo->get(), ldq}, {dq.get(), ldq},
                                                     dkv.get(), dkv.get() + kvd, ld_acc, ws.get(), nullptr));
    }
    ASSERT_CUDA_OK(cudaDeviceSynchronize());
    if (ordered && rank == 0) {  // dQ bitwise repeatable; dK/dV: at most two adds per row from one rank
      Dev<float> again(T * ld_acc);
      ASSERT_CUDA_OK(cudaMemset(again.get(), 0, T * ld_acc * 4));
      auto first_dq = DownBf16(dq.get(), L * ldq);
      std::vector<double> first_dkv = DownF32(dkv.get(), T * ld_acc);
      ASSERT_OK(kernels::FlashAttentionBackwardCross(a, {dq_in->get(), ldq}, {dk_in->get(), ldk}, {dv_in->get(), ldv},
                                                     {o.get(), ldq}, lse.get(), {ddo->get(), ldq}, {dq.get(), ldq},
                                                     again.get(), again.get() + kvd, ld_acc, ws.get(), nullptr));
      ASSERT_CUDA_OK(cudaDeviceSynchronize());
      const bool same = DownBf16(dq.get(), L * ldq) == first_dq && DownF32(again.get(), T * ld_acc) == first_dkv;
      std::printf("%s  cross attention bwd ordered dQ: 2 runs bitwise equal%s\n", same ? "PASS" : "FAIL", tag.c_str());
      EXPECT_TRUE(same) << "cross attention bwd ordered dQ: 2 runs bitwise equal" << tag;
    }
    const auto go = DownBf16(o.get(), L * ldq), gdq = DownBf16(dq.get(), L * ldq);
    const auto gl = DownF32(lse.get(), nq * L);
    for (int64_t i = 0; i < L; ++i) {
      for (int64_t c = 0; c < ldq; ++c) {
        got_o[rows[i] * ldq + c] = go[i * ldq + c];
        got_dq[rows[i] * ldq + c] = gdq[i * ldq + c];
      }
      for (int h = 0; h < nq; ++h) got_lse[h * T + rows[i]] = gl[h * L + i];
    }
  }
  const auto acc = DownF32(dkv.get(), T * ld_acc);
  std::vector<double> gdk, gdv, rdk, rdv;
  for (int64_t t = 0; t < T; ++t)
    for (int64_t c = 0; c < kvd; ++c) {
      gdk.push_back(acc[t * ld_acc + c]);
      gdv.push_back(acc[t * ld_acc + kvd + c]);
      rdk.push_back(r.dk[t * ldk + c]);
      rdv.push_back(r.dv[t * ldv + c]);
    }
  ExpectRelErr("cross attention fwd O" + tag, got_o, r.o, 1e-2);
  ExpectRelErr("cross attention fwd LSE" + tag, got_lse, r.lse, 1e-4);
  ExpectRelErr("cross attention bwd dQ" + tag, got_dq, r.dq, 2e-2);
  ExpectRelErr("cross attention bwd dK (summed over ranks)" + tag, gdk, rdk, 2e-2);
  ExpectRelErr("cross attention bwd dV (summed over ranks)" + tag, gdv, rdv, 2e-2);
}

}  // namespace slidedp::kernel_test
