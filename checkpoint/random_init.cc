// HF Qwen3 random initializer (Qwen3PreTrainedModel._init_weights): Linear and Embedding weights
// ~ Normal(0, initializer_range), RMSNorm weights = 1 (0 for the (1 + w) norms of qwen3_5 and gemma3;
// gemma3's and gpt_oss's embedding row pad_token_id is 0, as HF's Embedding(padding_idx) starts it;
// gpt_oss: its attention sinks and router bias normal too, its expert biases 0; gemma4: the pad row of
// both its tables 0, its layer_scalar buffers 1). Each tensor
// is cut into fixed chunks whose random stream is derived from (seed, tensor name, chunk index), so
// the values do not depend on the thread count or on which unit a tensor lives in. HF's own init is not reproduced
// bit-wise (torch's generator differs); only the distribution matches.
#include <algorithm>
#include <cmath>
#include <cstring>

#include "absl/strings/match.h"
#include "checkpoint/checkpoint.h"
#include "common/parallel/parallel_for.h"

namespace slidedp::checkpoint {
namespace {

constexpr int64_t kChunkNumel = int64_t{1} << 20;

uint64_t SplitMix64(uint64_t& x) {
  uint64_t z = (x += 0x9e3779b97f4a7c15ull);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

uint64_t Fnv1a(const std::string& s) {
  uint64_t h = 0xcbf29ce484222325ull;
  for (unsigned char c : s) h = (h ^ c) * 0x100000001b3ull;
  return h;
}

// xoshiro256**: fast, good quality, trivially seeded per chunk.
class ChunkRng {
 public:
  explicit ChunkRng(uint64_t seed) {
    for (uint64_t& w : s_) w = SplitMix64(seed);
  }
  uint64_t Next() {
    const uint64_t result = Rotl(s_[1] * 5, 7) * 9;
    const uint64_t t = s_[1] << 17;
    s_[2] ^= s_[0];
    s_[3] ^= s_[1];
    s_[1] ^= s_[2];
    s_[0] ^= s_[3];
    s_[2] ^= t;
    s_[3] = Rotl(s_[3], 45);
    return result;
  }
  // Uniform in (0, 1]: 53 random bits, never 0 so log() is finite.
  double Uniform() { return (static_cast<double>(Next() >> 11) + 1.0) * 0x1.0p-53; }

 private:
  static uint64_t Rotl(uint64_t x, int k) { return (x << k) | (x >> (64 - k)); }
  uint64_t s_[4];
};

bool IsNormWeight(const std::string& name) { return name.find("norm.weight") != std::string::npos; }
// HF initialises linear biases to zero (PreTrainedModel._init_weights).
bool IsBias(const std::string& name) { return absl::EndsWith(name, ".bias"); }

}  // namespace

void InitRandom(const ModelLayout& layout, uint64_t seed, const UnitArrayFn& master_of_unit, int threads,
                const std::vector<ShardRange>* windows) {
  // A unit's window: the elements its array holds (element e at index e - offset); whole by default.
  auto window = [&](const UnitLayout& u) {
    return windows != nullptr && u.index < static_cast<int>(windows->size()) ? (*windows)[u.index]
                                                                             : ShardRange{0, u.numel};
  };
  struct Job {
    float* base;  // the unit's array
    const TensorSlot* slot;
    int64_t chunk;
    ShardRange window;
  };
  std::vector<Job> jobs;
  std::vector<std::pair<float*, int64_t>> zero;  // padding stays 0: every unit cleared first, in chunks
  for (const UnitLayout& unit : layout.units) {
    float* base = master_of_unit(unit.index);
    const ShardRange w = window(unit);
    for (int64_t off = 0; off < w.numel; off += kChunkNumel) {
      zero.emplace_back(base + off, std::min(kChunkNumel, w.numel - off));
    }
    for (const TensorSlot& t : unit.tensors) {
      for (int64_t c = 0; c * kChunkNumel < t.numel; ++c) {
        // Every chunk's values come from its own stream: one outside the window is not drawn.
        const int64_t first = t.offset_numel + c * kChunkNumel, last = std::min(t.offset_numel + t.numel, first + kChunkNumel);
        if (last <= w.offset || first >= w.offset + w.numel) continue;
        jobs.push_back({base, &t, c, w});
      }
    }
  }
  ParallelFor(zero.size(), threads,
              [&](size_t i) { std::memset(zero[i].first, 0, static_cast<size_t>(zero[i].second) * sizeof(float)); });
  const double stddev = layout.config.initializer_range;
  ParallelFor(jobs.size(), threads, [&](size_t j) {
    const Job& job = jobs[j];
    const int64_t begin = job.chunk * kChunkNumel;
    const int64_t end = std::min(job.slot->numel, begin + kChunkNumel);
    // Element i of the tensor, where the window holds it.
    const int64_t at = job.slot->offset_numel - job.window.offset;
    const int64_t lo = std::max(begin, -at), hi = std::min(end, job.window.numel - at);
    auto put = [&](int64_t i, float value) {
      if (i >= lo && i < hi) job.base[at + i] = value;
    };
    const std::string& name = job.slot->hf_name;
    if (IsNormWeight(name)) {
      // qwen3_5's RMSNorms compute x * (1 + w): HF initialises w to 0; its gated norm (a plain
      // weight) to 1.
      const bool one_plus = layout.config.norms_add_one() && !absl::EndsWith(name, "linear_attn.norm.weight");
      for (int64_t i = lo; i < hi; ++i) put(i, one_plus ? 0.0f : 1.0f);
      return;
    }
    // Biases start at 0 (cleared with the padding above), gpt_oss's expert biases too; its router's
    // bias is drawn like its weight (GptOssPreTrainedModel._init_weights).
    const bool router_bias = absl::EndsWith(name, "mlp.router.bias");
    if ((IsBias(name) && !router_bias) || absl::EndsWith(name, "experts.gate_up_proj_bias") ||
        absl::EndsWith(name, "experts.down_proj_bias")) {
      return;
    }
    if (absl::EndsWith(name, "linear_attn.dt_bias") || absl::EndsWith(name, ".layer_scalar")) {  // HF: ones
      for (int64_t i = lo; i < hi; ++i) put(i, 1.0f);
      return;
    }
    uint64_t mix = seed ^ Fnv1a(job.slot->Key());
    uint64_t chunk_seed = SplitMix64(mix) ^ (static_cast<uint64_t>(job.chunk) * 0xd1b54a32d192ed03ull);
    ChunkRng rng(chunk_seed);
    if (absl::EndsWith(name, "linear_attn.A_log")) {  // HF Qwen3_5: log(Uniform(0, 16))
      for (int64_t i = begin; i < end; ++i) put(i, static_cast<float>(std::log(16.0 * rng.Uniform())));
      return;
    }
    for (int64_t i = begin; i < end; i += 2) {  // Box-Muller gives two normals per draw
      const double r = std::sqrt(-2.0 * std::log(rng.Uniform()));
      const double theta = 2.0 * M_PI * rng.Uniform();
      put(i, static_cast<float>(stddev * r * std::cos(theta)));
      if (i + 1 < end) put(i + 1, static_cast<float>(stddev * r * std::sin(theta)));
    }
  });
  // HF's Embedding(padding_idx=pad_token_id) (gemma3's) starts with that row zero
  // (PreTrainedModel._init_weights); tied, so does the LM head.
  // gemma4's embed_tokens_per_layer (the embedding unit's second table) too.
  const int64_t pad = layout.config.pad_token_id;
  if (pad >= 0 && pad < layout.config.vocab_size) {
    const ShardRange w = window(layout.embedding());
    for (const TensorSlot& t : layout.embedding().tensors) {
      const int64_t width = t.shape[1];
      const int64_t first = std::max(t.offset_numel + pad * width, w.offset);
      const int64_t last = std::min(t.offset_numel + (pad + 1) * width, w.offset + w.numel);
      float* array = master_of_unit(layout.embedding().index);
      for (int64_t e = first; e < last; ++e) array[e - w.offset] = 0.0f;
    }
  }
}

}  // namespace slidedp::checkpoint
