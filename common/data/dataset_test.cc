// Dataset writer/reader: round trip, packing layout, and every rejection the reader promises.
#include "common/data/dataset.h"

#include <sys/stat.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <functional>
#include <string>
#include <vector>

#include "absl/time/clock.h"
#include "common/data/micro_batch.h"
#include "common/data/synthetic.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace slidedp::data {
namespace {
namespace fs = std::filesystem;
using ::testing::HasSubstr;

// A fresh directory under the test temp dir, removed again when the test binary exits.
std::string FreshDir(const std::string& name) {
  struct Made {
    std::vector<std::string> dirs;
    ~Made() {
      for (const std::string& d : dirs) fs::remove_all(d);
    }
  };
  static Made made;
  std::string d = testing::TempDir() + "/data_test_" + std::to_string(::getpid()) + "_" + name;
  fs::remove_all(d);
  made.dirs.push_back(d);
  return d;
}

std::vector<uint32_t> Iota(uint32_t start, int n) {
  std::vector<uint32_t> v(n);
  for (int i = 0; i < n; ++i) v[i] = start + i;
  return v;
}

absl::StatusOr<Manifest> WriteDocs(const std::string& dir, const std::vector<std::vector<uint32_t>>& docs,
                                   Packing packing, int64_t seq_len, int64_t vocab = 1000) {
  WriterOptions o;
  o.vocab_size = vocab;
  o.seq_len = seq_len;
  o.packing = packing;
  auto w = DatasetWriter::Create(dir, o);
  if (!w.ok()) return w.status();
  for (const auto& d : docs) {
    std::vector<uint8_t> mask(d.size(), 1);
    mask[0] = 0;
    if (auto s = (*w)->AddDocument(d, mask); !s.ok()) return s;
  }
  return (*w)->Finish();
}

TEST(Dataset, RoundTripPackedKeepsTokensMasksAndBoundaries) {
  const std::string dir = FreshDir("roundtrip");
  // seq_len 8: docs of 3, 4 (fits: row 0 = 7), 5 (new row), 20 (long: own rows, split 8/8/4), 2 (joins the 4).
  std::vector<std::vector<uint32_t>> docs = {Iota(10, 3), Iota(20, 4), Iota(30, 5), Iota(100, 20), Iota(200, 2)};
  auto m = WriteDocs(dir, docs, Packing::kPacked, 8);
  ASSERT_TRUE(m.ok()) << m.status();
  EXPECT_EQ(m->num_documents, 5);
  EXPECT_EQ(m->num_tokens, 34);
  EXPECT_EQ(m->split_documents, 1);
  EXPECT_EQ(m->num_trained_tokens, 34 - 5);
  EXPECT_FALSE(fs::exists(dir + ".tmp-" + std::to_string(::getpid())));

  auto r = DatasetReader::Open(dir, {.model_vocab_size = 1000});
  ASSERT_TRUE(r.ok()) << r.status();
  const auto& ds = **r;
  EXPECT_EQ(ds.num_rows(), 5);
  std::vector<uint64_t> rows(ds.row_offsets().begin(), ds.row_offsets().end());
  EXPECT_EQ(rows, (std::vector<uint64_t>{0, 7, 12, 20, 28, 34}));
  std::vector<uint64_t> docs_off(ds.doc_offsets().begin(), ds.doc_offsets().end());
  EXPECT_EQ(docs_off, (std::vector<uint64_t>{0, 3, 7, 12, 32, 34}));
  uint32_t tok[2];
  uint8_t mask[2];
  ASSERT_TRUE(ds.ReadTokens(3, 5, tok, mask).ok());
  EXPECT_EQ(tok[0], 20u);
  EXPECT_EQ(mask[0], 0);
  EXPECT_EQ(mask[1], 1);
  // Row 4 = tail of the long doc (4 tokens) + the 2-token doc: two pieces.
  auto segs = ds.RowSegments(4);
  ASSERT_EQ(segs.size(), 2u);
  EXPECT_EQ(segs[0].begin, 28);
  EXPECT_EQ(segs[0].end, 32);
  EXPECT_EQ(segs[1].begin, 32);
  EXPECT_EQ(segs[1].end, 34);
  EXPECT_EQ(ds.RowSegments(0).size(), 2u);
}

TEST(Dataset, PaddedTruncatesOneDocumentPerRow) {
  const std::string dir = FreshDir("padded");
  auto m = WriteDocs(dir, {Iota(1, 3), Iota(1, 10), Iota(1, 8)}, Packing::kPadded, 8);
  ASSERT_TRUE(m.ok()) << m.status();
  EXPECT_EQ(m->truncated_documents, 1);
  EXPECT_EQ(m->num_rows, 3);
  EXPECT_EQ(m->num_tokens, 3 + 8 + 8);
  auto r = DatasetReader::Open(dir);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ((*r)->Row(1).end - (*r)->Row(1).begin, 8);
}

TEST(Dataset, RefusesExistingOutputUnlessOverwrite) {
  const std::string dir = FreshDir("exists");
  ASSERT_TRUE(WriteDocs(dir, {Iota(1, 3)}, Packing::kPacked, 8).ok());
  auto again = WriteDocs(dir, {Iota(1, 3)}, Packing::kPacked, 8);
  EXPECT_EQ(again.status().code(), absl::StatusCode::kAlreadyExists);
}

TEST(Dataset, EmptyDatasetIsInvalidArgument) {
  const std::string dir = FreshDir("empty");
  WriterOptions o{.vocab_size = 10, .seq_len = 4};
  auto w = DatasetWriter::Create(dir, o);
  ASSERT_TRUE(w.ok());
  auto m = (*w)->Finish();
  EXPECT_EQ(m.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_FALSE(fs::exists(dir));
}

TEST(Dataset, WriterRejectsOutOfVocabularyIds) {
  WriterOptions o{.vocab_size = 10, .seq_len = 4};
  auto w = DatasetWriter::Create(FreshDir("writer_oov"), o);
  ASSERT_TRUE(w.ok());
  std::vector<uint32_t> t = {1, 2, 10};
  std::vector<uint8_t> m = {1, 1, 1};
  auto s = (*w)->AddDocument(t, m);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(s.message()), HasSubstr("token 2"));
}

TEST(Dataset, TruncatedFileIsDataLossNamingFileAndSizes) {
  const std::string dir = FreshDir("truncated");
  ASSERT_TRUE(WriteDocs(dir, {Iota(1, 5), Iota(1, 6)}, Packing::kPacked, 8).ok());
  fs::resize_file(dir + "/tokens.bin", 40);
  auto r = DatasetReader::Open(dir);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kDataLoss);
  EXPECT_THAT(std::string(r.status().message()), HasSubstr("tokens.bin has 40 bytes, expected 44"));
}

TEST(Dataset, CorruptedByteFailsChecksum) {
  const std::string dir = FreshDir("corrupt");
  ASSERT_TRUE(WriteDocs(dir, {Iota(1, 5), Iota(1, 6)}, Packing::kPacked, 8).ok());
  auto put = [&](char v) {
    std::fstream f(dir + "/loss_mask.bin", std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(2);
    f.put(v);
  };
  put(0);  // a valid mask value, but not the one written (entry 2 was 1): only the CRC sees it
  auto r = DatasetReader::Open(dir);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kDataLoss);
  EXPECT_THAT(std::string(r.status().message()), HasSubstr("loss_mask.bin is corrupt"));
  // Without checksum verification the same file opens.
  EXPECT_TRUE(DatasetReader::Open(dir, {.verify_checksums = VerifyChecksums::kNo}).ok());
  // A value that is no mask value at all is refused either way.
  put(7);
  r = DatasetReader::Open(dir, {.verify_checksums = VerifyChecksums::kNo});
  EXPECT_EQ(r.status().code(), absl::StatusCode::kDataLoss);
  EXPECT_THAT(std::string(r.status().message()), HasSubstr("loss-mask entry at position 2 is 7"));
}

TEST(Dataset, MissingManifestIsNotFound) {
  auto r = DatasetReader::Open(FreshDir("nothing"));
  EXPECT_EQ(r.status().code(), absl::StatusCode::kNotFound);
}

TEST(Dataset, TokensBeyondModelVocabularyNameFirstPosition) {
  const std::string dir = FreshDir("model_vocab");
  ASSERT_TRUE(WriteDocs(dir, {{1, 2, 3}, {4, 700, 5, 800}}, Packing::kPacked, 8).ok());
  auto r = DatasetReader::Open(dir, {.model_vocab_size = 512});
  EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(r.status().message()), HasSubstr("position 4 has id 700 >= vocab_size 512"));
}

TEST(Dataset, ManifestFromANewerFormatIsRefused) {
  const std::string dir = FreshDir("version");
  ASSERT_TRUE(WriteDocs(dir, {Iota(1, 5)}, Packing::kPacked, 8).ok());
  std::ifstream in(dir + "/manifest.json");
  auto j = nlohmann::json::parse(in);
  in.close();
  j["version"] = 99;
  std::ofstream(dir + "/manifest.json") << j.dump();
  auto r = DatasetReader::Open(dir);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kFailedPrecondition);
}

// manifest.json's optional "source": written and read back; a manifest without it (every dataset
// written before prepare recorded it) still opens; a malformed one is DATA_LOSS naming the field.
TEST(Dataset, SourceRoundTripsIsOptionalAndValidated) {
  const std::string dir = FreshDir("source");
  WriterOptions o{.vocab_size = 1000, .seq_len = 8};
  auto w = DatasetWriter::Create(dir, o);
  ASSERT_TRUE(w.ok()) << w.status();
  ASSERT_TRUE((*w)->AddDocument(Iota(1, 5), std::vector<uint8_t>{0, 1, 1, 1, 1}).ok());
  DatasetSource source;
  source.tokenizer_fingerprint = "sha256:" + std::string(64, 'a');
  source.tokenizer_vocab_size = 1000;
  source.model_vocab_size = 1024;
  source.chat_template = "qwen3";
  source.chat_template_sha256 = std::string(64, '0');
  source.model = "/models/qwen3";
  (*w)->set_source(source);
  ASSERT_TRUE((*w)->Finish().ok());
  auto r = DatasetReader::Open(dir);
  ASSERT_TRUE(r.ok()) << r.status();
  ASSERT_TRUE((*r)->manifest().source.has_value());
  const DatasetSource& got = *(*r)->manifest().source;
  EXPECT_EQ(got.tokenizer_fingerprint, source.tokenizer_fingerprint);
  EXPECT_EQ(got.tokenizer_vocab_size, 1000);
  EXPECT_EQ(got.model_vocab_size, 1024);
  EXPECT_EQ(got.chat_template, "qwen3");
  EXPECT_EQ(got.chat_template_sha256, source.chat_template_sha256);
  EXPECT_EQ(got.model, "/models/qwen3");

  std::ifstream in(dir + "/manifest.json");
  const nlohmann::json original = nlohmann::json::parse(in);
  in.close();
  auto open_with = [&](const std::function<void(nlohmann::json&)>& edit) {
    nlohmann::json j = original;
    edit(j);
    std::ofstream(dir + "/manifest.json") << j.dump();
    return DatasetReader::Open(dir);
  };
  auto old = open_with([](nlohmann::json& j) { j.erase("source"); });
  ASSERT_TRUE(old.ok()) << old.status();
  EXPECT_FALSE((*old)->manifest().source.has_value());
  auto minimal = open_with([](nlohmann::json& j) {
    j["source"] = {{"tokenizer_fingerprint", "sha256:" + std::string(64, 'b')}, {"tokenizer_vocab_size", 7}};
  });
  ASSERT_TRUE(minimal.ok()) << minimal.status();
  EXPECT_EQ((*minimal)->manifest().source->model_vocab_size, 0);
  EXPECT_EQ((*minimal)->manifest().source->chat_template, "none");

  struct Case {
    std::function<void(nlohmann::json&)> edit;
    std::string expect;
  };
  for (const Case& c : std::vector<Case>{
           {[](nlohmann::json& j) { j["source"] = "qwen3"; }, "source: a string, not an object"},
           {[](nlohmann::json& j) { j["source"].erase("tokenizer_fingerprint"); },
            "source.tokenizer_fingerprint: missing"},
           {[](nlohmann::json& j) { j["source"]["tokenizer_fingerprint"] = "md5:abc"; },
            "source.tokenizer_fingerprint: \"md5:abc\" is not"},
           {[](nlohmann::json& j) { j["source"]["tokenizer_vocab_size"] = -3; }, "source.tokenizer_vocab_size: -3"},
           {[](nlohmann::json& j) { j["source"]["model_vocab_size"] = "big"; }, "source.model_vocab_size"},
           {[](nlohmann::json& j) { j["source"]["chat_template"] = 5; }, "source.chat_template: a number"},
           {[](nlohmann::json& j) { j["source"]["chat_template_sha256"] = "xyz"; }, "source.chat_template_sha256"},
       }) {
    auto bad = open_with(c.edit);
    EXPECT_EQ(bad.status().code(), absl::StatusCode::kDataLoss) << c.expect;
    EXPECT_THAT(std::string(bad.status().message()), HasSubstr(c.expect));
    EXPECT_THAT(std::string(bad.status().message()), HasSubstr("manifest.json"));
  }
}

// Three long documents (split into seq_len rows): tokens.bin of 12 MB, two 8 MiB scan chunks.
std::string BigDataset(const std::string& name) {
  const std::string dir = FreshDir(name);
  WriterOptions o{.vocab_size = 50000, .seq_len = 4096};
  auto w = DatasetWriter::Create(dir, o);
  EXPECT_TRUE(w.ok());
  std::vector<uint32_t> doc(1000000);
  std::vector<uint8_t> mask(doc.size(), 1);
  for (int d = 0; d < 3; ++d) {
    for (size_t i = 0; i < doc.size(); ++i) doc[i] = static_cast<uint32_t>((i * 7919 + d) % 50000);
    EXPECT_TRUE((*w)->AddDocument(doc, mask).ok());
  }
  EXPECT_TRUE((*w)->Finish().ok());
  return dir;
}

void FlipByte(const std::string& path, int64_t offset) {
  std::fstream f(path, std::ios::in | std::ios::out | std::ios::binary);
  f.seekg(offset);
  char c = 0;
  f.get(c);
  f.seekp(offset);
  f.put(static_cast<char>(c ^ 0x01));
}

TEST(Dataset, ChecksumsOverSeveralChunksAndThreadsAreVerified) {
  const std::string dir = BigDataset("big_crc");
  ASSERT_GT(fs::file_size(dir + "/tokens.bin"), 8u << 20);
  for (int threads : {1, 3}) {
    auto r = DatasetReader::Open(dir, {.threads = threads});
    ASSERT_TRUE(r.ok()) << r.status();
  }
  FlipByte(dir + "/tokens.bin", (9 << 20) + 1);  // in the second chunk; the id stays below the vocabulary
  for (int threads : {1, 3}) {
    auto r = DatasetReader::Open(dir, {.threads = threads});
    EXPECT_EQ(r.status().code(), absl::StatusCode::kDataLoss) << r.status();
    EXPECT_THAT(std::string(r.status().message()), HasSubstr(dir + "/tokens.bin is corrupt: CRC-32"));
  }
  EXPECT_TRUE(DatasetReader::Open(dir, {.verify_checksums = VerifyChecksums::kNo}).ok());
}

// Rows are read with pread: a dataset truncated under an open reader is DATA_LOSS naming the
// file (with mmap this was SIGBUS, killing the worker).
TEST(Dataset, TruncatedWhileOpenIsDataLossNotSigbus) {
  const std::string dir = BigDataset("truncated_open");
  auto r = DatasetReader::Open(dir, {.verify_checksums = VerifyChecksums::kNo});
  ASSERT_TRUE(r.ok()) << r.status();
  const int64_t last = (*r)->num_rows() - 1;
  ASSERT_TRUE(BuildMicroBatch(**r, std::vector<int64_t>{last}).ok());
  fs::resize_file(dir + "/tokens.bin", 4096);
  auto mb = BuildMicroBatch(**r, std::vector<int64_t>{last});
  EXPECT_EQ(mb.status().code(), absl::StatusCode::kDataLoss) << mb.status();
  EXPECT_THAT(std::string(mb.status().message()),
              HasSubstr(dir + "/tokens.bin is shorter than when the job opened it"));
  fs::resize_file(dir + "/loss_mask.bin", 0);
  auto n = CountTrainedLabels(**r, std::vector<int64_t>{0});
  EXPECT_EQ(n.status().code(), absl::StatusCode::kDataLoss) << n.status();
  EXPECT_THAT(std::string(n.status().message()), HasSubstr("loss_mask.bin"));
}

// A write into an open dataset (same size) changes its identity: the next batch is DATA_LOSS.
TEST(Dataset, ChangedWhileOpenIsDataLoss) {
  const std::string dir = FreshDir("changed_open");
  ASSERT_TRUE(WriteDocs(dir, {Iota(1, 5), Iota(1, 6)}, Packing::kPacked, 8).ok());
  auto r = DatasetReader::Open(dir);
  ASSERT_TRUE(r.ok()) << r.status();
  ASSERT_TRUE(BuildMicroBatch(**r, std::vector<int64_t>{0}).ok());
  absl::SleepFor(absl::Milliseconds(20));  // past the file system's timestamp granularity
  FlipByte(dir + "/loss_mask.bin", 1);
  auto mb = BuildMicroBatch(**r, std::vector<int64_t>{0});
  EXPECT_EQ(mb.status().code(), absl::StatusCode::kDataLoss) << mb.status();
  EXPECT_THAT(std::string(mb.status().message()), HasSubstr(dir + "/loss_mask.bin changed while a job reads it"));
}

// With the identities a verifier saw, Open checks nothing else of the content and refuses files
// that changed or were replaced since.
TEST(Dataset, ExpectedIdentitiesSkipTheScanAndCatchChanges) {
  const std::string dir = FreshDir("identities");
  ASSERT_TRUE(WriteDocs(dir, {Iota(1, 5), Iota(1, 6)}, Packing::kPacked, 8).ok());
  auto verified = DatasetReader::Open(dir);
  ASSERT_TRUE(verified.ok()) << verified.status();
  const std::vector<FileIdentity> ids = (*verified)->file_identities();
  ASSERT_EQ(ids.size(), 4u);
  auto r = DatasetReader::Open(dir, {.expected_files = ids});
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_TRUE(BuildMicroBatch(**r, std::vector<int64_t>{0}).ok());
  EXPECT_EQ((*r)->CheckLossMask().code(), absl::StatusCode::kFailedPrecondition);  // the verifier did it
  // Replaced (same bytes, another inode).
  fs::copy_file(dir + "/row_offsets.bin", dir + "/row_offsets.copy");
  fs::rename(dir + "/row_offsets.copy", dir + "/row_offsets.bin");
  r = DatasetReader::Open(dir, {.expected_files = ids});
  EXPECT_EQ(r.status().code(), absl::StatusCode::kDataLoss) << r.status();
  EXPECT_THAT(std::string(r.status().message()), HasSubstr("row_offsets.bin changed since it was verified"));
  EXPECT_EQ(DatasetReader::Open(dir, {.expected_files = {ids[0]}}).status().code(), absl::StatusCode::kInvalidArgument);
}

TEST(Dataset, AFifoInPlaceOfAFileIsRefusedWithoutBlocking) {
  const std::string dir = FreshDir("fifo");
  ASSERT_TRUE(WriteDocs(dir, {Iota(1, 5)}, Packing::kPacked, 8).ok());
  fs::remove(dir + "/tokens.bin");
  ASSERT_EQ(::mkfifo((dir + "/tokens.bin").c_str(), 0600), 0);
  auto r = DatasetReader::Open(dir);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument) << r.status();
  EXPECT_THAT(std::string(r.status().message()), HasSubstr("tokens.bin is not a regular file"));
}

TEST(Synthetic, IsDeterministicAndWithinVocabulary) {
  SyntheticOptions o;
  o.vocab_size = 97;
  o.num_documents = 50;
  o.seed = 5;
  o.prompt_fraction = 0.25;
  const std::string dir_b = FreshDir("syn_b");
  auto a = WriteSyntheticDataset(FreshDir("syn_a"), o);
  auto b = WriteSyntheticDataset(dir_b, o);
  ASSERT_TRUE(a.ok() && b.ok());
  EXPECT_EQ(a->files[0].crc32, b->files[0].crc32);
  EXPECT_EQ(a->files[1].crc32, b->files[1].crc32);
  EXPECT_LT(a->num_trained_tokens, a->num_tokens);
  o.seed = 6;
  auto c = WriteSyntheticDataset(FreshDir("syn_c"), o);
  ASSERT_TRUE(c.ok());
  EXPECT_NE(a->files[0].crc32, c->files[0].crc32);
  auto r = DatasetReader::Open(dir_b, {.model_vocab_size = 97});
  ASSERT_TRUE(r.ok()) << r.status();
  // Learnable pattern: constant stride inside a document.
  std::vector<uint32_t> t((*r)->num_tokens());
  ASSERT_TRUE((*r)->ReadTokens(0, (*r)->num_tokens(), t.data(), nullptr).ok());
  auto d = (*r)->doc_offsets();
  const int64_t stride = (t[d[0] + 1] + 97 - t[d[0]]) % 97;
  EXPECT_EQ((t[d[0] + 2] + 97 - t[d[0] + 1]) % 97, stride);
}

}  // namespace
}  // namespace slidedp::data
