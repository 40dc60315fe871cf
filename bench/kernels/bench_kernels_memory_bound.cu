// The kernel benchmark's memory-bound family: RMSNorm, QK-norm + RoPE, SwiGLU and the embedding's
// forward and backward, each against the device-to-device copy ceiling (bytes read + written).
#include <cuda_runtime.h>

#include <algorithm>
#include <string>
#include <vector>

#include "bench/kernels/bench_kernels.h"
#include "worker/kernels/embedding.h"
#include "worker/kernels/qk_norm_rope.h"
#include "worker/kernels/rmsnorm.h"
#include "worker/kernels/swiglu.h"

namespace slidedp::bench {

void BenchNormRopeSwiGlu(Arena& ar, const std::string& model, const ModelConfig& c, int64_t T, const OpOperands& o) {
  const int64_t H = c.hidden_size, I = c.intermediate_size, qd = c.q_dim(), kvd = c.kv_dim(), QKV = qd + 2 * kvd;
  const float eps = 1e-6f;
  Emit("rmsnorm_fwd", model, T,
       TimeMs([&] { BENCH_CHECK(kernels::RmsNormForward(o.x, o.w, T, H, eps, o.y, o.rstd, nullptr)); }), 0,
       2.0 * T * H * 2);
  Emit("rmsnorm_bwd", model, T, TimeMs([&] {
         BENCH_CHECK(kernels::RmsNormBackward(o.dy, o.x, o.w, o.rstd, o.dy, T, H, o.y, o.dwv, o.ws, nullptr));
       }),
       0, 4.0 * T * H * 2);
  kernels::RopeArgs ra;
  ra.tokens = T;
  ra.num_q_heads = c.num_attention_heads;
  ra.num_kv_heads = c.num_key_value_heads;
  ra.head_dim = c.head_dim;
  int32_t* pos = ar.Get<int32_t>(T);
  {
    std::vector<int32_t> hp(T);
    for (int64_t t = 0; t < T; ++t) hp[t] = static_cast<int32_t>(t % 4096);
    CUDA_CHECK(cudaMemcpy(pos, hp.data(), T * 4, cudaMemcpyHostToDevice));
  }
  const double rope_bytes = 2.0 * T * (qd + kvd) * 2;  // read q,k raw; write q,k
  Emit("qknorm_rope_fwd", model, T, TimeMs([&] {
         BENCH_CHECK(kernels::QkNormRopeForward(ra, o.big, QKV, o.w, o.w, pos, o.mid, o.mid + T * qd, nullptr));
       }),
       0, rope_bytes);
  Emit("qknorm_rope_bwd", model, T, TimeMs([&] {
         BENCH_CHECK(kernels::QkNormRopeBackward(ra, o.mid, o.mid + T * qd, o.big, QKV, o.w, o.w, pos, o.big2, QKV,
                                                 o.dwv, o.dwv, o.ws, nullptr));
       }),
       0, 1.5 * rope_bytes);
  Emit("swiglu_fwd", model, T, TimeMs([&] { BENCH_CHECK(kernels::SwiGluForward(o.big, T, I, o.mid, nullptr)); }), 0,
       3.0 * T * I * 2);
  Emit("swiglu_bwd", model, T,
       TimeMs([&] { BENCH_CHECK(kernels::SwiGluBackward(o.big, o.mid, T, I, o.big2, nullptr)); }), 0, 5.0 * T * I * 2);
}

// Embedding over c's vocabulary (151,936 rows at Qwen3's presets).
void BenchEmbedding(Arena& ar, const std::string& model, const ModelConfig& c, int64_t T, const OpOperands& o) {
  const int64_t H = c.hidden_size, V = c.vocab_size;
  bf16* table = ar.Rand(V * H);
  int32_t* tok = ar.Get<int32_t>(T);
  std::vector<int32_t> ht(T);
  for (int64_t t = 0; t < T; ++t) ht[t] = static_cast<int32_t>((t * 7919) % V);
  CUDA_CHECK(cudaMemcpy(tok, ht.data(), T * 4, cudaMemcpyHostToDevice));
  Emit("embedding_fwd", model, T,
       TimeMs([&] { BENCH_CHECK(kernels::EmbeddingForward(table, tok, T, H, o.y, nullptr)); }), 0, 2.0 * T * H * 2);
  // Backward over a host-built grouping (tokens drawn from 4096 ids, so ids repeat).
  std::vector<int32_t> ids(T), order(T), uniq, seg;
  for (int64_t t = 0; t < T; ++t) ids[t] = static_cast<int32_t>((t * 7919) % 4096);
  for (int64_t t = 0; t < T; ++t) order[t] = static_cast<int32_t>(t);
  std::stable_sort(order.begin(), order.end(), [&](int32_t p, int32_t q) { return ids[p] < ids[q]; });
  for (int64_t i = 0; i < T; ++i)
    if (i == 0 || ids[order[i]] != ids[order[i - 1]]) {
      uniq.push_back(ids[order[i]]);
      seg.push_back(static_cast<int32_t>(i));
    }
  seg.push_back(static_cast<int32_t>(T));
  int32_t* duniq = ar.Get<int32_t>(uniq.size());
  int32_t* dseg = ar.Get<int32_t>(seg.size());
  int32_t* dord = ar.Get<int32_t>(T);
  CUDA_CHECK(cudaMemcpy(duniq, uniq.data(), uniq.size() * 4, cudaMemcpyHostToDevice));
  CUDA_CHECK(cudaMemcpy(dseg, seg.data(), seg.size() * 4, cudaMemcpyHostToDevice));
  CUDA_CHECK(cudaMemcpy(dord, order.data(), T * 4, cudaMemcpyHostToDevice));
  float* demb = ar.Get<float>(4096 * H);
  CUDA_CHECK(cudaMemset(demb, 0, 4096 * H * 4));
  Emit("embedding_bwd", model, T,
       TimeMs([&] { BENCH_CHECK(kernels::EmbeddingBackward(o.dy, duniq, dseg, dord, uniq.size(), H, demb, nullptr)); }),
       0, T * H * 2.0 + uniq.size() * H * 8.0);
}

}  // namespace slidedp::bench
