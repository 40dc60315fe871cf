// Seeded synthetic document generator (own PRNG so output never depends on the standard library).
#include "common/data/synthetic.h"

#include <cmath>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/status/status_macros.h"

namespace slidedp::data {
namespace {

struct Rng {
  uint64_t state;
  uint64_t Next() {
    uint64_t z = (state += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
  }
  // [lo, hi] inclusive; the modulo bias is irrelevant for synthetic data.
  int64_t Uniform(int64_t lo, int64_t hi) { return lo + static_cast<int64_t>(Next() % static_cast<uint64_t>(hi - lo + 1)); }
};

}  // namespace

absl::StatusOr<Manifest> WriteSyntheticDataset(const std::string& dir, const SyntheticOptions& o) {
  if (o.vocab_size < 2 || o.num_documents <= 0 || o.min_doc_tokens <= 0 || o.max_doc_tokens < o.min_doc_tokens ||
      o.prompt_fraction < 0 || o.prompt_fraction >= 1) {
    return absl::InvalidArgumentError(absl::StrCat(
        "synthetic dataset: need vocab_size >= 2, num_documents > 0, 0 < min_doc_tokens <= max_doc_tokens, "
        "prompt_fraction in [0, 1); got vocab ", o.vocab_size, ", documents ", o.num_documents, ", lengths [",
        o.min_doc_tokens, ", ", o.max_doc_tokens, "], prompt_fraction ", o.prompt_fraction));
  }
  WriterOptions wo;
  wo.vocab_size = o.vocab_size;
  wo.seq_len = o.seq_len;
  wo.packing = o.packing;
  wo.overwrite = o.overwrite;
  wo.metadata = {{"source", "synthetic"},
                 {"pattern", o.pattern == SyntheticPattern::kLearnable ? "learnable" : "random"},
                 {"seed", o.seed},
                 {"prompt_fraction", o.prompt_fraction}};
  ASSIGN_OR_RETURN(auto writer, DatasetWriter::Create(dir, wo));
  Rng rng{o.seed * 0x2545F4914F6CDD1Dull + 0x1234567ull};
  std::vector<uint32_t> tokens;
  std::vector<uint8_t> mask;
  for (int64_t d = 0; d < o.num_documents; ++d) {
    const int64_t n = rng.Uniform(o.min_doc_tokens, o.max_doc_tokens);
    tokens.resize(n);
    mask.assign(n, 1);
    if (o.pattern == SyntheticPattern::kLearnable) {
      const int64_t start = rng.Uniform(0, o.vocab_size - 1);
      const int64_t stride = rng.Uniform(1, 8);
      for (int64_t i = 0; i < n; ++i) tokens[i] = static_cast<uint32_t>((start + i * stride) % o.vocab_size);
    } else {
      for (int64_t i = 0; i < n; ++i) tokens[i] = static_cast<uint32_t>(rng.Uniform(0, o.vocab_size - 1));
    }
    const int64_t prompt = static_cast<int64_t>(std::floor(o.prompt_fraction * static_cast<double>(n)));
    for (int64_t i = 0; i < prompt; ++i) mask[i] = 0;
    RETURN_IF_ERROR(writer->AddDocument(tokens, mask));
  }
  return writer->Finish();
}

absl::StatusOr<Manifest> WriteSyntheticDataset(const std::string& dir, int64_t vocab_size, int64_t num_documents,
                                               uint64_t seed, int64_t seq_len) {
  SyntheticOptions o;
  o.vocab_size = vocab_size;
  o.num_documents = num_documents;
  o.seed = seed;
  o.seq_len = seq_len;
  o.max_doc_tokens = std::max<int64_t>(o.min_doc_tokens, seq_len);
  return WriteSyntheticDataset(dir, o);
}

}  // namespace slidedp::data
