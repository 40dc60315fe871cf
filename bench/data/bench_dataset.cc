// bench_dataset: what the dataset's integrity costs.
//  1. Verification (hostd at job start): DatasetReader::Open with CRC-32 of every file, token
//     ids and loss mask, in one parallel pread pass, per GB of dataset, with the files in the page
//     cache (warm) and evicted from it (cold: posix_fadvise DONTNEED, no root needed), for 1 and
//     --threads threads.
//  2. The read path (every worker, every step): BuildMicroBatch with pread + the identity check
//     against the same micro-batches built from an mmap of the files (the old read path), random
//     rows of seq_len tokens, warm page cache.
//
//   bench_dataset [--dir DIR] [--tokens N] [--seq-len L] [--threads T] [--rows-per-batch B]
//                 [--batches K] [--keep]
// The last stdout line is one JSON object with every figure.
#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "absl/time/clock.h"
#include "CLI/CLI.hpp"
#include "common/data/batch.h"
#include "common/data/dataset.h"
#include "common/data/micro_batch.h"
#include "nlohmann/json.hpp"

namespace slidedp::data {
namespace {

void Evict(const std::string& dir) {
  for (int f = 0; f < kNumBinFiles; ++f) {
    const int fd = ::open((dir + "/" + BinFileName(f)).c_str(), O_RDONLY);
    if (fd < 0) continue;
    ::fdatasync(fd);
    ::posix_fadvise(fd, 0, 0, POSIX_FADV_DONTNEED);
    ::close(fd);
  }
}

// The old read path: the files mapped, labels built from the mapping (as micro_batch.cc did).
struct MappedDataset {
  explicit MappedDataset(const std::string& dir) {
    for (int f : {0, 1}) {
      const std::string path = dir + "/" + BinFileName(f);
      const int fd = ::open(path.c_str(), O_RDONLY);
      bytes[f] = std::filesystem::file_size(path);
      addr[f] = ::mmap(nullptr, bytes[f], PROT_READ, MAP_PRIVATE, fd, 0);
      ::close(fd);
    }
  }
  ~MappedDataset() {
    for (int f : {0, 1}) ::munmap(addr[f], bytes[f]);
  }
  MicroBatch Build(const DatasetReader& d, const std::vector<int64_t>& rows) const {
    const auto* tokens = static_cast<const uint32_t*>(addr[0]);
    const auto* mask = static_cast<const uint8_t*>(addr[1]);
    MicroBatch mb;
    mb.cu_seqlens.push_back(0);
    for (int64_t r : rows) {
      for (const RowSegment& seg : d.RowSegments(r)) {
        for (int64_t t = seg.begin; t < seg.end; ++t) {
          mb.tokens.push_back(static_cast<int32_t>(tokens[t]));
          mb.positions.push_back(static_cast<int32_t>(t - seg.begin));
          const bool trained_next = t + 1 < seg.end && mask[t + 1] != 0;
          mb.labels.push_back(trained_next ? static_cast<int32_t>(tokens[t + 1]) : kIgnoreIndex);
        }
        mb.cu_seqlens.push_back(static_cast<int32_t>(mb.tokens.size()));
        mb.max_seqlen = std::max<int32_t>(mb.max_seqlen, static_cast<int32_t>(seg.end - seg.begin));
      }
    }
    return mb;
  }
  void* addr[2] = {nullptr, nullptr};
  size_t bytes[2] = {0, 0};
};

int Main(int argc, char** argv) {
  CLI::App app("bench_dataset");
  std::string dir = "/tmp/bench_dataset";
  int64_t num_tokens = 250'000'000;
  int64_t seq_len = 4096;
  int threads = 16;
  int rows_per_batch = 8;
  int batches = 2000;
  bool keep = false;
  app.add_option("--dir", dir);
  app.add_option("--tokens", num_tokens);
  app.add_option("--seq-len", seq_len);
  app.add_option("--threads", threads);
  app.add_option("--rows-per-batch", rows_per_batch);
  app.add_option("--batches", batches);
  app.add_flag("--keep", keep, "keep (and reuse) the dataset");
  CLI11_PARSE(app, argc, argv);

  nlohmann::json out;
  if (!std::filesystem::exists(dir + "/manifest.json")) {
    // Documents of 300..3000 tokens, packed; every other token trained.
    WriterOptions o{.vocab_size = 151669, .seq_len = seq_len, .overwrite = Overwrite::kYes};
    auto w = DatasetWriter::Create(dir, o);
    if (!w.ok()) return fprintf(stderr, "%s\n", w.status().ToString().c_str()), 1;
    std::mt19937_64 rng(1);
    std::vector<uint32_t> doc;
    std::vector<uint8_t> mask;
    for (int64_t written = 0; written < num_tokens;) {
      const int64_t n = std::min<int64_t>(300 + rng() % 2700, num_tokens - written);
      doc.resize(n);
      mask.resize(n);
      for (int64_t i = 0; i < n; ++i) {
        doc[i] = static_cast<uint32_t>(rng() % 151669);
        mask[i] = i % 2;
      }
      mask[0] = 1;
      if (absl::Status s = (*w)->AddDocument(doc, mask); !s.ok()) {
        fprintf(stderr, "%s\n", s.ToString().c_str());
        return 1;
      }
      written += n;
    }
    if (auto m = (*w)->Finish(); !m.ok()) return fprintf(stderr, "%s\n", m.status().ToString().c_str()), 1;
  }
  uint64_t bytes = 0;
  for (int f = 0; f < kNumBinFiles; ++f) bytes += std::filesystem::file_size(dir + "/" + BinFileName(f));
  out["dataset_bytes"] = bytes;
  out["hardware_threads"] = std::thread::hardware_concurrency();

  // ---- 1. verification ----
  nlohmann::json verify = nlohmann::json::array();
  for (const char* cache : {"warm", "cold"}) {
    for (int t : {1, threads}) {
      if (std::string(cache) == "cold") {
        Evict(dir);
      } else {  // read once: in the page cache
        (void)DatasetReader::Open(dir, {.verify_checksums = VerifyChecksums::kNo, .threads = t});
      }
      const absl::Time t0 = absl::Now();
      auto r = DatasetReader::Open(dir, {.model_vocab_size = 151669, .threads = t});
      const double s = absl::ToDoubleSeconds(absl::Now() - t0);
      if (!r.ok()) return fprintf(stderr, "%s\n", r.status().ToString().c_str()), 1;
      verify.push_back({{"cache", cache},
                        {"threads", t},
                        {"seconds", s},
                        {"seconds_per_gb", s / (bytes / 1e9)},
                        {"gb_per_s", bytes / 1e9 / s}});
      printf("verify %s cache, %2d threads: %.3f s for %.2f GB = %.3f s/GB (%.2f GB/s)\n", cache, t, s, bytes / 1e9,
             s / (bytes / 1e9), bytes / 1e9 / s);
    }
  }
  out["verify"] = verify;

  // ---- 2. read path ----
  auto reader = DatasetReader::Open(dir, {.verify_checksums = VerifyChecksums::kNo, .threads = threads});
  if (!reader.ok()) return fprintf(stderr, "%s\n", reader.status().ToString().c_str()), 1;
  const DatasetReader& d = **reader;
  MappedDataset mapped(dir);
  std::mt19937_64 rng(7);
  std::vector<std::vector<int64_t>> plan(batches);
  for (auto& rows : plan) {
    for (int k = 0; k < rows_per_batch; ++k) rows.push_back(static_cast<int64_t>(rng() % d.num_rows()));
  }
  // Warm both paths over the same rows, then time each (alternating, best of 3).
  int64_t tokens = 0;
  for (const auto& rows : plan) tokens += BuildMicroBatch(d, rows)->num_tokens();
  for (const auto& rows : plan) (void)mapped.Build(d, rows);
  double best_pread = 1e30, best_mmap = 1e30;
  for (int rep = 0; rep < 3; ++rep) {
    absl::Time t0 = absl::Now();
    int64_t check = 0;
    for (const auto& rows : plan) check += BuildMicroBatch(d, rows)->num_tokens();
    best_pread = std::min(best_pread, absl::ToDoubleSeconds(absl::Now() - t0));
    t0 = absl::Now();
    for (const auto& rows : plan) check -= mapped.Build(d, rows).num_tokens();
    best_mmap = std::min(best_mmap, absl::ToDoubleSeconds(absl::Now() - t0));
    if (check != 0) return fprintf(stderr, "paths disagree\n"), 1;
  }
  out["read"] = {{"batches", batches},
                 {"rows_per_batch", rows_per_batch},
                 {"tokens", tokens},
                 {"pread_us_per_batch", best_pread / batches * 1e6},
                 {"mmap_us_per_batch", best_mmap / batches * 1e6},
                 {"pread_mtokens_per_s", tokens / best_pread / 1e6},
                 {"mmap_mtokens_per_s", tokens / best_mmap / 1e6},
                 {"pread_over_mmap", best_pread / best_mmap}};
  printf(
      "read %d batches of %d rows (%lld tokens): pread %.1f us/batch (%.0f Mtok/s), mmap %.1f us/batch (%.0f "
      "Mtok/s): x%.3f\n",
      batches, rows_per_batch, static_cast<long long>(tokens), best_pread / batches * 1e6, tokens / best_pread / 1e6,
      best_mmap / batches * 1e6, tokens / best_mmap / 1e6, best_pread / best_mmap);
  if (!keep) std::filesystem::remove_all(dir);
  printf("%s\n", out.dump().c_str());
  return 0;
}

}  // namespace
}  // namespace slidedp::data

int main(int argc, char** argv) { return slidedp::data::Main(argc, argv); }
