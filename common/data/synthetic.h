// Synthetic datasets for tests, benchmarks and the README's example job.
//
// kLearnable documents are arithmetic sequences modulo the vocabulary (start and stride drawn per
// document, stride in [1, 8]): after two tokens the rest is predictable, so even a tiny model's
// loss falls visibly within a few dozen steps. kRandom documents are uniform ids (nothing to
// learn; for throughput benchmarks). A prompt_fraction of each document's leading tokens is left
// untrained (loss mask 0) to exercise masking. Output is a function of the options only.
#pragma once

#include <cstdint>
#include <string>

#include "absl/status/statusor.h"
#include "common/data/dataset.h"

namespace slidedp::data {

enum class SyntheticPattern { kLearnable, kRandom };

struct SyntheticOptions {
  int64_t vocab_size = 512;
  int64_t num_documents = 256;
  uint64_t seed = 1;
  int64_t min_doc_tokens = 16;
  int64_t max_doc_tokens = 256;
  int64_t seq_len = 256;
  Packing packing = Packing::kPacked;
  SyntheticPattern pattern = SyntheticPattern::kLearnable;
  double prompt_fraction = 0.0;  // in [0, 1)
  Overwrite overwrite = Overwrite::kNo;
};

absl::StatusOr<Manifest> WriteSyntheticDataset(const std::string& dir, const SyntheticOptions& options);

// The README's default: learnable, packed.
absl::StatusOr<Manifest> WriteSyntheticDataset(const std::string& dir, int64_t vocab_size, int64_t num_documents,
                                               uint64_t seed, int64_t seq_len = 256);

}  // namespace slidedp::data
