// libFuzzer target: the dataset reader (common/data) on corrupted dataset directories.
//
// A small valid dataset is generated once; each input then damages one of its five files:
//   byte 0: file = b % 5 (manifest.json, tokens.bin, loss_mask.bin, doc_offsets.bin,
//           row_offsets.bin); mode = (b / 5) % 2: 0 replaces the file with the rest of the
//           input, 1 overwrites bytes at offset (bytes 1-2, little endian) with the rest.
// Checksums are not verified, so the structural checks (manifest fields, file sizes, offsets
// monotonic and in range, token ids against the model's vocabulary) are what stands between the
// bytes and the trainer. Whatever Open accepts must be safe to read: every row and every
// micro-batch built from it stays inside the token stream.
//
// SLIDEDP_FUZZ_WRITE_SEEDS=DIR writes one seed per file (the unchanged contents) into DIR.
#include <unistd.h>

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "common/data/dataset.h"
#include "common/data/micro_batch.h"
#include "common/data/synthetic.h"

namespace {

namespace fs = std::filesystem;
namespace data = slidedp::data;

const char* const kFiles[5] = {"manifest.json", "tokens.bin", "loss_mask.bin", "doc_offsets.bin", "row_offsets.bin"};
constexpr int64_t kModelVocab = 512;

std::string g_case_dir;
std::vector<std::string> g_seed_files;

std::string ReadAll(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(f), {});
}

void WriteAll(const std::string& path, const std::string& bytes) {
  std::ofstream f(path, std::ios::binary | std::ios::trunc);
  f.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
}

}  // namespace

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  const std::string root = std::string(getenv("TMPDIR") ? getenv("TMPDIR") : "/tmp") + "/slidedp-dataset-fuzz-" +
                           std::to_string(getpid());
  data::SyntheticOptions o;
  o.vocab_size = kModelVocab;
  o.num_documents = 12;
  o.seed = 3;
  o.min_doc_tokens = 2;
  o.max_doc_tokens = 40;
  o.seq_len = 16;
  o.prompt_fraction = 0.25;
  o.overwrite = data::Overwrite::kYes;
  auto m = data::WriteSyntheticDataset(root + "/seed", o);
  if (!m.ok()) {
    fprintf(stderr, "cannot write the seed dataset: %s\n", m.status().ToString().c_str());
    abort();
  }
  for (const char* f : kFiles) g_seed_files.push_back(ReadAll(root + "/seed/" + f));
  g_case_dir = root + "/case";
  fs::create_directories(g_case_dir);
  if (const char* seeds = getenv("SLIDEDP_FUZZ_WRITE_SEEDS")) {
    fs::create_directories(seeds);
    for (int i = 0; i < 5; ++i) {
      std::string replace(1, static_cast<char>(i));
      WriteAll(std::string(seeds) + "/seed_replace_" + kFiles[i], replace + g_seed_files[i]);
    }
  }
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* input, size_t size) {
  if (size < 1) return 0;
  const int which = input[0] % 5;
  const int mode = (input[0] / 5) % 2;
  for (int i = 0; i < 5; ++i) {
    std::string bytes = g_seed_files[i];
    if (i == which) {
      if (mode == 0) {
        bytes.assign(reinterpret_cast<const char*>(input + 1), size - 1);
      } else {
        if (size < 3) return 0;
        const size_t offset = input[1] | (size_t{input[2]} << 8);
        const size_t n = size - 3;
        if (offset + n > bytes.size()) bytes.resize(offset + n);
        memcpy(bytes.data() + offset, input + 3, n);
      }
    }
    WriteAll(g_case_dir + "/" + kFiles[i], bytes);
  }
  data::ReaderOptions ro;
  ro.model_vocab_size = kModelVocab;
  ro.verify_checksums = data::VerifyChecksums::kNo;
  auto reader = data::DatasetReader::Open(g_case_dir, ro);
  if (!reader.ok()) return 0;
  const data::DatasetReader& d = **reader;
  const int64_t num_tokens = d.num_tokens();
  if (d.row_offsets().back() != static_cast<uint64_t>(num_tokens)) abort();
  const int64_t rows = std::min<int64_t>(d.num_rows(), 64);
  for (int64_t r = 0; r < rows; ++r) {
    for (const auto& seg : d.RowSegments(r)) {
      if (seg.begin > seg.end || seg.end > num_tokens) {
        fprintf(stderr, "row %lld segment [%lld, %lld) outside %lld tokens\n", (long long)r, (long long)seg.begin,
                (long long)seg.end, (long long)num_tokens);
        abort();
      }
    }
    const int64_t one[1] = {r};
    auto mb = data::BuildMicroBatch(d, absl::MakeConstSpan(one, 1));
    if (mb.ok()) (void)data::CountTrainedLabels(d, absl::MakeConstSpan(one, 1));
  }
  return 0;
}
