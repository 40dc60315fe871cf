// attn_layouts_check: the document layouts a job actually trains on (a dump_batches file) through
// cuDNN's fused attention and the own kernels, compared per document. A GPU tool run by the GPU
// scripts (docs/verification.md), not a unit test; it was cuda_kernel_check --attn-layouts and
// keeps that mode's flags and output:
//
//   attn_layouts_check --attn-layouts=BATCHES.bin [--mb-rows=4] [--heads=16/8] [--head-dim=128]
//                      [--seed=N]
//
// Each micro-batch (`mb_rows` rows, as the workers split a step) goes through cuDNN's attention and
// through the own kernels on the same random inputs, with the strides the CUDA backend uses (q and
// k roped in their own buffers, v inside the packed qkv, dv inside the packed dqkv), and the two
// are compared per document: a layout that one of them gets wrong (a plan for that many documents
// or that length, a 1-token piece) shows as a document whose outputs differ far beyond BF16
// rounding. Both backwards take the own forward's O and LSE, so forward and backward are judged
// separately. Prints PASS/FAIL/INFO lines; exits 0 when every micro-batch agrees, 1 when some
// differ, 2 on bad arguments, an unreadable file or no CUDA device.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <future>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "nlohmann/json.hpp"
#include "worker/kernels/attention.h"
#include "worker/kernels/cudnn_attention.h"
#include "worker/kernels/tests/kernel_test_util.h"

namespace slidedp {
namespace {

using bf16 = __nv_bfloat16;
using kernel_test::Dev;
using kernel_test::DownBf16;
using kernel_test::DownF32;
using kernel_test::NewBf16;
using kernel_test::RandVec;

// A failed call ends CheckAttentionLayouts with one failure.
#define CHECK_OK(expr)                                                                           \
  do {                                                                                           \
    absl::Status s_ = (expr);                                                                    \
    if (!s_.ok()) {                                                                              \
      std::printf("FAIL  %s -> %s (%s:%d)\n", #expr, s_.ToString().c_str(), __FILE__, __LINE__); \
      return 1;                                                                                  \
    }                                                                                            \
  } while (0)
#define CUDA_OK(expr)                                                                          \
  CHECK_OK([&]() -> absl::Status {                                                             \
    cudaError_t e_ = (expr);                                                                   \
    return e_ == cudaSuccess ? absl::OkStatus() : absl::InternalError(cudaGetErrorString(e_)); \
  }())

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
        return absl::InvalidArgumentError(
            absl::StrCat(path, ": step ", l.step, " has a document piece across token ", end, " (a row boundary)"));
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
  double rel = 0;                              // the largest over the documents
  int doc = -1;                                // where
  double a_rms = 0, b_rms = 0, floor_rms = 0;  // that document's RMS on each side, and the floor
};
constexpr double kScaleFloor = 0.1;

DocDiff WorstDoc(const std::vector<double>& a, const std::vector<double>& b, const std::vector<int32_t>& cu, int64_t ld,
                 int64_t width) {
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

// Returns the number of failures: the micro-batches that differ beyond `tol`, or 1 when a call fails
// (which ends the run, as CHECK_OK says).
int CheckAttentionLayouts(const std::vector<Layout>& layouts, const std::string& path, int nq, int nkv, int hd,
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
      const std::string where =
          absl::StrCat("step ", l.step, " part ", l.part, " doc ", d, " (", d >= 0 ? l.cu[d + 1] - l.cu[d] : 0,
                       " tokens; ", a.num_docs, " docs, longest ", a.max_seqlen, ")");
      if (!(r[i].rel <= worst[i])) {
        worst[i] = r[i].rel;
        worst_at[i] = where;
      }
      if (!(r[i].rel <= tol)) {
        layout_bad = true;
        std::printf(
            "FAIL  attention layout %s: cuDNN vs own %s differ by %.3e (tolerance %.1e; RMS cuDNN %.3e, "
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
  std::printf(
      "%s  attention layouts: %d of %zu micro-batches differ beyond %.1e in some document (up to %d "
      "documents, %d one-token pieces)\n",
      bad == 0 ? "PASS" : "FAIL", bad, layouts.size(), tol, docs_max, one_token_pieces);
  for (int i = 0; i < 5; ++i) {
    std::printf("INFO  attention layouts: worst cuDNN vs own %s %.3e at %s\n", names[i], worst[i], worst_at[i].c_str());
  }
  return bad;
}

}  // namespace
}  // namespace slidedp

int main(int argc, char** argv) {
  using namespace slidedp;
  uint64_t seed = std::random_device{}();
  // --attn-layouts=FILE (a dump_batches file, required), with --mb-rows=N
  // (rows per micro-batch, default 4), --heads=NQ/NKV (default 16/8, Qwen3-1.7B) and
  // --head-dim=D (default 128).
  std::string layouts;
  int64_t mb_rows = 4;
  int nq = 16, nkv = 8, hd = 128;
  for (int i = 1; i < argc; ++i) {
    if (std::strncmp(argv[i], "--seed=", 7) == 0) seed = std::strtoull(argv[i] + 7, nullptr, 10);
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
  if (layouts.empty()) {
    std::printf("FAIL  attn_layouts_check needs --attn-layouts=FILE (a dump_batches file)\n");
    return 2;
  }
  kernel_test::Rng().seed(seed);
  // (read before the device is touched, so a bad file fails the same on a machine without one)
  absl::StatusOr<std::vector<Layout>> layout_list = ReadLayouts(layouts, mb_rows);
  if (!layout_list.ok()) {
    std::printf("FAIL  --attn-layouts: %s\n", layout_list.status().ToString().c_str());
    return 2;
  }
  int64_t pieces = 0;
  for (const Layout& l : *layout_list) pieces += static_cast<int64_t>(l.cu.size()) - 1;
  std::printf("attention layouts: %zu micro-batches, %lld document pieces\n", layout_list->size(),
              static_cast<long long>(pieces));
  cudaDeviceProp prop{};
  if (cudaGetDeviceProperties(&prop, 0) != cudaSuccess) {
    std::printf("FAIL  no CUDA device\n");
    return 2;
  }
  std::printf("attn_layouts_check on %s (sm_%d%d), seed=%llu\n", prop.name, prop.major, prop.minor,
              static_cast<unsigned long long>(seed));
  const int failures = CheckAttentionLayouts(*layout_list, layouts, nq, nkv, hd, 2e-2);
  std::printf("%s: %d failure(s)\n", failures == 0 ? "ALL PASS" : "FAILED", failures);
  return failures == 0 ? 0 : 1;
}
