// The kernel benchmark's attention family: one causal document through the own FlashAttention
// kernels and cuDNN's (BenchOps' rows), cuDNN's attention alone per layout and engine (--attn), and a
// context-parallel share's attention against gathered keys and values (--attn-cross). FLOPs count
// the causal area: 4 x heads x head_dim per (query, key) pair forward, 2.5x that backward.
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <functional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "bench/kernels/bench_kernels.h"
#include "worker/kernels/attention.h"

namespace slidedp::bench {

kernels::CudnnAttention* g_cudnn = nullptr;

namespace {

// An attention call over `tokens` queries in `docs` pieces of at most `max_seqlen`, with c's heads.
kernels::AttnArgs HeadsArgs(const ModelConfig& c, int64_t tokens, int docs, int64_t max_seqlen, const int32_t* cu,
                            const int32_t* cu_host) {
  kernels::AttnArgs a;
  a.tokens = tokens;
  a.num_docs = docs;
  a.max_seqlen = static_cast<int>(max_seqlen);
  a.num_q_heads = c.num_attention_heads;
  a.num_kv_heads = c.num_key_value_heads;
  a.head_dim = c.head_dim;
  a.softmax_scale = 1.0f / std::sqrt(static_cast<float>(c.head_dim));
  a.cu_seqlens = cu;
  a.cu_seqlens_host = cu_host;
  return a;
}

// The bytes of workspace cuDNN's forward and backward of `a` need (the larger of the two), or the
// reason cuDNN does not take the call.
absl::StatusOr<int64_t> CudnnWorkspaceBytes(const kernels::AttnArgs& a, const kernels::AttnRowStrides& ld) {
  absl::StatusOr<int64_t> fws = g_cudnn->ForwardWorkspaceBytes(a, ld);
  if (!fws.ok()) return fws.status();
  absl::StatusOr<int64_t> bws = g_cudnn->BackwardWorkspaceBytes(a, ld);
  if (!bws.ok()) return bws.status();
  return std::max<int64_t>(*fws, *bws);
}

// Median forward and backward times of one variant (milliseconds).
struct AttnTimes {
  double fwd_ms, bwd_ms;
};

// `reps` CUDA-event-timed runs each of fwd and bwd in a cuDNN workspace for `a` (freed after), or the
// reason cuDNN does not take the call.
absl::StatusOr<AttnTimes> TimeCudnn(const kernels::AttnArgs& a, const kernels::AttnRowStrides& ld, int reps,
                                    const std::function<void(void* ws)>& fwd,
                                    const std::function<void(void* ws)>& bwd) {
  absl::StatusOr<int64_t> bytes = CudnnWorkspaceBytes(a, ld);
  if (!bytes.ok()) return bytes.status();
  void* ws = nullptr;
  CUDA_CHECK(cudaMalloc(&ws, *bytes));
  const double f_ms = TimeMs([&] { fwd(ws); }, reps);
  const double b_ms = TimeMs([&] { bwd(ws); }, reps);
  CUDA_CHECK(cudaFree(ws));
  return AttnTimes{f_ms, b_ms};
}

// One variant's rows: "<fwd_name> tokens column ms TFLOP/s" and the backward's (at 2.5x the
// forward's FLOPs), then "JSON {<json_head>,"tokens":..,"<column_key>":..,"fwd_ms":..,"bwd_ms":..}".
void ReportAttention(const std::string& fwd_name, const std::string& bwd_name, const std::string& json_head,
                     const char* column_key, int64_t tokens, int column, double fwd_flops, double f_ms, double b_ms) {
  std::printf("%-34s %8lld %6d %10.2f %9.1f\n", fwd_name.c_str(), static_cast<long long>(tokens), column, f_ms,
              fwd_flops / f_ms / 1e9);
  std::printf("%-34s %8lld %6d %10.2f %9.1f\n", bwd_name.c_str(), static_cast<long long>(tokens), column, b_ms,
              2.5 * fwd_flops / b_ms / 1e9);
  std::printf("JSON {%s,\"tokens\":%lld,\"%s\":%d,\"fwd_ms\":%.3f,\"bwd_ms\":%.3f}\n", json_head.c_str(),
              static_cast<long long>(tokens), column_key, column, f_ms, b_ms);
  std::fflush(stdout);
}

}  // namespace

void BenchCausalAttention(Arena& ar, const std::string& model, const ModelConfig& c, int64_t T, const OpOperands& ops) {
  const int64_t qd = c.q_dim(), kvd = c.kv_dim();
  const int nq = c.num_attention_heads, hd = c.head_dim;
  int32_t* cu = ar.Get<int32_t>(2);
  int32_t hcu[2] = {0, static_cast<int32_t>(T)};
  CUDA_CHECK(cudaMemcpy(cu, hcu, 8, cudaMemcpyHostToDevice));
  const kernels::AttnArgs a = HeadsArgs(c, T, 1, T, cu, nullptr);
  bf16* q = ops.big;
  bf16* k = ops.big + T * qd;
  bf16* v = k + T * kvd;
  bf16* o = ops.big2;
  bf16* dO = ar.Rand(T * qd);
  bf16* dq = ops.mid;
  bf16* dk = ops.mid + T * qd;
  bf16* dv = dk + T * kvd;
  float* lse = ar.Get<float>(T * nq);
  char* aws = ar.Get<char>(kernels::FlashAttentionBackwardWorkspaceBytes(a));
  const double fwd_flops = 4.0 * nq * hd * (static_cast<double>(T) * (T + 1) / 2);
  Emit("attn_fwd_causal", model, T, TimeMs([&] {
         BENCH_CHECK(kernels::FlashAttentionForward(a, {q, qd}, {k, kvd}, {v, kvd}, {o, qd}, lse, nullptr));
       }),
       fwd_flops, 0);
  Emit("attn_bwd_causal", model, T, TimeMs([&] {
         BENCH_CHECK(kernels::FlashAttentionBackward(a, {q, qd}, {k, kvd}, {v, kvd}, {o, qd}, lse, {dO, qd}, {dq, qd},
                                                     {dk, kvd}, {dv, kvd}, aws, nullptr));
       }),
       2.5 * fwd_flops, 0);
  // With dQ added in a fixed order (SLIDEDP_DETERMINISTIC's backward).
  kernels::AttnArgs ordered = a;
  ordered.ordered_dq = true;
  char* ows = ar.Get<char>(kernels::FlashAttentionBackwardWorkspaceBytes(ordered));
  Emit("attn_bwd_causal_ordered", model, T, TimeMs([&] {
         BENCH_CHECK(kernels::FlashAttentionBackward(ordered, {q, qd}, {k, kvd}, {v, kvd}, {o, qd}, lse, {dO, qd},
                                                     {dq, qd}, {dk, kvd}, {dv, kvd}, ows, nullptr));
       }),
       2.5 * fwd_flops, 0);
  // The same call through cuDNN (same tensors, strides and FLOP convention).
  if (g_cudnn != nullptr) {
    const kernels::AttnRowStrides ld{qd, kvd, kvd, qd, qd, qd, kvd, kvd};
    absl::StatusOr<int64_t> ws_bytes = CudnnWorkspaceBytes(a, ld);
    if (!ws_bytes.ok()) {
      std::printf("%-26s %-10s %7lld   skipped: %s\n", "attn_*_causal_cudnn", model.c_str(), static_cast<long long>(T),
                  ws_bytes.status().ToString().c_str());
    } else {
      char* cws = ar.Get<char>(*ws_bytes);
      Emit("attn_fwd_causal_cudnn", model, T, TimeMs([&] {
             BENCH_CHECK(g_cudnn->Forward(a, {q, qd}, {k, kvd}, {v, kvd}, {o, qd}, lse, cws, nullptr));
           }),
           fwd_flops, 0);
      Emit("attn_bwd_causal_cudnn", model, T, TimeMs([&] {
             BENCH_CHECK(g_cudnn->Backward(a, {q, qd}, {k, kvd}, {v, kvd}, {o, qd}, lse, {dO, qd}, {dq, qd}, {dk, kvd},
                                           {dv, kvd}, cws, nullptr));
           }),
           2.5 * fwd_flops, 0);
    }
  }
}

// --attn: cuDNN's attention alone over one causal document of each length, with Qwen3-8B's heads
// and the training strides (v inside the fused QKV rows), per layout (ragged THD entry, dense entry,
// dense with the padding mask) and engine configuration (the heuristics' first `engines`).
void BenchAttention(const std::vector<int64_t>& lengths, int engines) {
  auto c = ModelConfig::Preset("qwen3-8b");
  BENCH_CHECK(c.status());
  const int nq = c->num_attention_heads, nkv = c->num_key_value_heads, hd = c->head_dim;
  const int64_t qd = c->q_dim(), kvd = c->kv_dim(), qkv = qd + 2 * kvd;
  std::printf("%-34s %8s %6s %10s %9s\n", "attention (cudnn, qwen3-8b heads)", "tokens", "engine", "ms", "TFLOP/s");
  for (int64_t T : lengths) {
    Arena ar;
    int32_t* cu = ar.Get<int32_t>(2);
    const int32_t hcu[2] = {0, static_cast<int32_t>(T)};
    CUDA_CHECK(cudaMemcpy(cu, hcu, 8, cudaMemcpyHostToDevice));
    kernels::AttnArgs a = HeadsArgs(*c, T, 1, T, cu, hcu);
    bf16* q = ar.Rand(T * qd, 0.5f);
    bf16* k = ar.Rand(T * kvd, 0.5f);
    bf16* fused = ar.Rand(T * qkv, 0.5f);  // v at column qd + kvd of the fused rows
    bf16* v = fused + qd + kvd;
    bf16* o = ar.Get<bf16>(T * qd);
    bf16* dO = ar.Rand(T * qd);
    bf16* dq = ar.Get<bf16>(T * qd);
    bf16* dk = ar.Get<bf16>(T * kvd);
    bf16* dv_fused = ar.Get<bf16>(T * qkv);
    bf16* dv = dv_fused + qd + kvd;
    float* lse = ar.Get<float>(T * nq);
    const kernels::AttnRowStrides ld{qd, kvd, qkv, qd, qd, qd, kvd, qkv};
    const double fwd_flops = 4.0 * nq * hd * (static_cast<double>(T) * (T + 1) / 2);
    const int reps = T >= 131072 ? 2 : 5;
    // One variant's rows: forward and backward (backward at 2.5x the forward's FLOPs) and a JSON line.
    const auto report = [&](const std::string& variant, int engine, double f_ms, double b_ms) {
      ReportAttention("attn_fwd_cudnn_" + variant, "attn_bwd_cudnn_" + variant,
                      "\"op\":\"attn_cudnn\",\"layout\":\"" + variant + "\"", "engine", T, engine, fwd_flops, f_ms,
                      b_ms);
    };
    struct Layout {
      const char* name;
      bool dense, padding;
    };
    for (const Layout& lay :
         {Layout{"ragged", false, true}, Layout{"dense", true, false}, Layout{"dense+padding", true, true}}) {
      for (int e = 0; e < engines; ++e) {
        kernels::CudnnAttentionOptions opt;
        opt.dense_single_document = lay.dense;
        opt.dense_min_tokens = 0;
        opt.dense_padding_mask = lay.padding;
        opt.engine = e;
        g_cudnn->set_options(opt);
        absl::StatusOr<AttnTimes> t = TimeCudnn(
            a, ld, reps,
            [&](void* ws) {
              BENCH_CHECK(g_cudnn->Forward(a, {q, qd}, {k, kvd}, {v, qkv}, {o, qd}, lse, ws, nullptr));
            },
            [&](void* ws) {
              BENCH_CHECK(g_cudnn->Backward(a, {q, qd}, {k, kvd}, {v, qkv}, {o, qd}, lse, {dO, qd}, {dq, qd}, {dk, kvd},
                                            {dv, qkv}, ws, nullptr));
            });
        if (!t.ok()) {
          std::printf("attn_cudnn_%-23s %8lld %6d   %s\n", lay.name, static_cast<long long>(T), e,
                      t.status().ToString().c_str());
          break;
        }
        report(lay.name, e, t->fwd_ms, t->bwd_ms);
      }
    }
    // One call per kv-head group (its q heads and kv head, pointers offset): whether a call whose
    // keys and values are one head's streams them from L2 better than all heads at once.
    {
      g_cudnn->set_options({});
      const int groups = nkv, gq = nq / nkv;
      kernels::AttnArgs g = a;
      g.num_q_heads = gq;
      g.num_kv_heads = 1;
      absl::StatusOr<AttnTimes> t = TimeCudnn(
          g, ld, reps,
          [&](void* ws) {
            for (int h = 0; h < groups; ++h) {
              const int64_t qo = int64_t{h} * gq * hd, ko = int64_t{h} * hd;
              BENCH_CHECK(g_cudnn->Forward(g, {q + qo, qd}, {k + ko, kvd}, {v + ko, qkv}, {o + qo, qd},
                                           lse + int64_t{h} * gq * T, ws, nullptr));
            }
          },
          [&](void* ws) {
            for (int h = 0; h < groups; ++h) {
              const int64_t qo = int64_t{h} * gq * hd, ko = int64_t{h} * hd;
              BENCH_CHECK(g_cudnn->Backward(g, {q + qo, qd}, {k + ko, kvd}, {v + ko, qkv}, {o + qo, qd},
                                            lse + int64_t{h} * gq * T, {dO + qo, qd}, {dq + qo, qd}, {dk + ko, kvd},
                                            {dv + ko, qkv}, ws, nullptr));
            }
          });
      if (!t.ok()) {
        std::printf("attn_cudnn_per_kv_head %8lld   %s\n", static_cast<long long>(T), t.status().ToString().c_str());
      } else {
        report("per_kv_head", 0, t->fwd_ms, t->bwd_ms);
      }
    }
    g_cudnn->set_options({});
  }
}

// --attn-cross: a context-parallel share's attention alone: rank 0's zig-zag share of one causal
// document of T tokens over `ranks` (its first and last chunks of 2 x ranks, T / ranks queries)
// against the document's gathered keys | values ([T, 2 kv_dim] rows, as GatherContextKv lays them),
// Qwen3-8B's heads; the own kernels against cuDNN's cross entries (CudnnAttentionOptions::cross).
// FLOPs: the share's causal area (a balanced share holds 1 / ranks of the document's).
void BenchCrossAttention(const std::vector<int64_t>& lengths, int ranks) {
  auto c = ModelConfig::Preset("qwen3-8b");
  BENCH_CHECK(c.status());
  const int nq = c->num_attention_heads, nkv = c->num_key_value_heads, hd = c->head_dim;
  const int64_t qd = c->q_dim(), kvd = c->kv_dim(), ld_kv = 2 * kvd;
  std::printf("%-34s %8s %6s %10s %9s\n", "cross attention (qwen3-8b heads)", "tokens", "ranks", "ms", "TFLOP/s");
  for (int64_t T : lengths) {
    const int64_t chunk = T / (2 * ranks), L = 2 * chunk;
    Arena ar;
    const int32_t hcu[3] = {0, static_cast<int32_t>(chunk), static_cast<int32_t>(L)};
    const int32_t hbounds[4] = {0, static_cast<int32_t>(chunk), 0, static_cast<int32_t>(T)};
    int32_t* cu = ar.Get<int32_t>(3);
    int32_t* bounds = ar.Get<int32_t>(4);
    CUDA_CHECK(cudaMemcpy(cu, hcu, sizeof(hcu), cudaMemcpyHostToDevice));
    CUDA_CHECK(cudaMemcpy(bounds, hbounds, sizeof(hbounds), cudaMemcpyHostToDevice));
    kernels::AttnArgs a = HeadsArgs(*c, L, 2, chunk, cu, hcu);
    a.kv_bounds = bounds;
    a.kv_bounds_host = hbounds;
    a.kv_tokens = T;
    a.max_seqlen_kv = static_cast<int>(T);
    bf16* q = ar.Rand(L * qd, 0.5f);
    bf16* kv = ar.Rand(T * ld_kv, 0.5f);
    bf16* o = ar.Get<bf16>(L * qd);
    bf16* dO = ar.Rand(L * qd);
    bf16* dq = ar.Get<bf16>(L * qd);
    float* dkv = ar.Get<float>(T * ld_kv);
    float* lse = ar.Get<float>(L * nq);
    const double area = static_cast<double>(chunk) * (chunk + 1) / 2 + static_cast<double>(chunk) * (T - chunk) +
                        static_cast<double>(chunk) * (chunk + 1) / 2;
    const double fwd_flops = 4.0 * nq * hd * area;
    const int reps = T >= 262144 ? 2 : 5;
    const auto report = [&](const std::string& impl, double f_ms, double b_ms) {
      ReportAttention("attn_cross_fwd_" + impl, "attn_cross_bwd_" + impl,
                      "\"op\":\"attn_cross\",\"impl\":\"" + impl + "\"", "ranks", T, ranks, fwd_flops, f_ms, b_ms);
    };
    const kernels::AttnTensor keys{kv, ld_kv}, values{kv + kvd, ld_kv};
    {  // the own kernels
      void* ws = nullptr;
      CUDA_CHECK(cudaMalloc(&ws, kernels::FlashAttentionBackwardWorkspaceBytes(a)));
      const double f_ms = TimeMs(
          [&] {
            BENCH_CHECK(kernels::FlashAttentionForward(a, {q, qd}, keys, values, {o, qd}, lse, nullptr));
          },
          reps);
      const double b_ms = TimeMs(
          [&] {
            BENCH_CHECK(kernels::FlashAttentionBackwardCross(a, {q, qd}, keys, values, {o, qd}, lse, {dO, qd}, {dq, qd},
                                                             dkv, dkv + kvd, ld_kv, ws, nullptr));
          },
          reps);
      CUDA_CHECK(cudaFree(ws));
      report("own", f_ms, b_ms);
    }
    kernels::CudnnAttentionOptions opt;
    opt.cross = true;
    opt.cross_min_tokens = 0;
    g_cudnn->set_options(opt);
    const kernels::AttnRowStrides ld{qd, ld_kv, ld_kv, qd, qd, qd, 0, 0};
    absl::StatusOr<AttnTimes> t = TimeCudnn(
        a, ld, reps,
        [&](void* ws) {
          BENCH_CHECK(g_cudnn->Forward(a, {q, qd}, keys, values, {o, qd}, lse, ws, nullptr));
        },
        [&](void* ws) {
          BENCH_CHECK(g_cudnn->BackwardCross(a, {q, qd}, keys, values, {o, qd}, lse, {dO, qd}, {dq, qd}, dkv, dkv + kvd,
                                             ld_kv, ws, nullptr));
        });
    if (!t.ok()) {
      std::printf("attn_cross_cudnn %8lld   %s\n", static_cast<long long>(T), t.status().ToString().c_str());
    } else {
      report("cudnn", t->fwd_ms, t->bwd_ms);
    }
    g_cudnn->set_options({});
  }
}

}  // namespace slidedp::bench
