// prepare at long-context row lengths (262,144 and 1,048,576 tokens): packed rows that close
// exactly at seq_len, a document of exactly seq_len, a longer one split over rows, padded rows
// that truncate, the labels the trainer builds from them (common/data/micro_batch.h), the
// manifest, and batches bounded by input bytes so memory does not grow with the corpus.
// Documents are runs of " a" (one Qwen3 token each), so every row boundary is known exactly.
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "client/prepare/prepare.h"
#include "common/data/dataset.h"
#include "common/data/micro_batch.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "client/prepare/prepare_test_util.h"

namespace slidedp::prepare {
namespace {
namespace fs = std::filesystem;
using ::testing::ElementsAre;
using ::testing::ElementsAreArray;
using ::testing::HasSubstr;
using json = nlohmann::json;

constexpr int64_t kSeqLen = 262144;
constexpr int64_t kQwen3ModelVocab = 151936;  // embedding rows; the tokenizer's ids are below

using test_data::Qwen3;
using test_data::SourceDir;
std::string ModelDir() { return test_data::Qwen3Dir(); }


uint32_t Id(const std::string& piece) {
  std::vector<uint32_t> ids = Qwen3().Encode(piece);
  EXPECT_EQ(ids.size(), 1u) << "\"" << piece << "\" is not one token";
  return ids.empty() ? 0 : ids[0];
}

std::string TempPath(const std::string& name) {
  return testing::TempDir() + "/long_context_test_" + std::to_string(::getpid()) + "_" + name;
}

std::string Repeat(const std::string& piece, int64_t n) {
  std::string s;
  s.reserve(piece.size() * n);
  for (int64_t i = 0; i < n; ++i) s += piece;
  return s;
}

// With the EOS prepare appends, a text of n " a" is n + 1 tokens.
json Text(int64_t tokens) { return {{"text", Repeat(" a", tokens - 1)}}; }

// The corpus, by token count: a short document, one of exactly seq_len (after a partial row, so
// it closes that row and fills the next), one longer than seq_len, a prompt/completion document
// (700 untrained prompt tokens, 299 completion tokens + EOS trained) and a short one.
constexpr int64_t kShort = 11, kLongTail = 1000, kPrompt = 700, kCompletion = 300, kLast = 5;
std::vector<json> Corpus() {
  return {Text(kShort),
          Text(kSeqLen),
          Text(kSeqLen + kLongTail),
          {{"prompt", Repeat(" b", kPrompt)}, {"completion", Repeat(" a", kCompletion - 1)}},
          Text(kLast)};
}

std::string WriteJsonl(const std::string& name, const std::vector<json>& docs) {
  const std::string p = TempPath(name);
  std::ofstream out(p);
  for (const json& d : docs) out << d.dump() << "\n";
  return p;
}

// The corpus in input order as three files, since a file holds one record form: the three text
// documents, the prompt/completion one, the last text one. `array`: .json files of one JSON array.
std::vector<std::string> WriteCorpus(const std::string& name, bool array = false) {
  const std::vector<json> docs = Corpus();
  const std::vector<std::vector<json>> files = {{docs[0], docs[1], docs[2]}, {docs[3]}, {docs[4]}};
  std::vector<std::string> paths;
  for (size_t f = 0; f < files.size(); ++f) {
    const std::string stem = absl::StrCat(name, "_", f);
    if (!array) {
      paths.push_back(WriteJsonl(stem + ".jsonl", files[f]));
      continue;
    }
    paths.push_back(TempPath(stem + ".json"));
    std::ofstream(paths.back()) << "\n " << json(files[f]).dump(1) << "\n";
  }
  return paths;
}

PrepareOptions Options(const std::string& name, const std::vector<std::string>& inputs, int64_t seq_len) {
  PrepareOptions o;
  o.model_dir = ModelDir();
  o.inputs = inputs;
  o.output_dir = TempPath(name);
  fs::remove_all(o.output_dir);
  o.seq_len = seq_len;
  o.threads = 2;
  return o;
}

std::unique_ptr<data::DatasetReader> OpenVerified(const std::string& dir) {
  auto r = data::DatasetReader::Open(dir, {.model_vocab_size = kQwen3ModelVocab});  // CRCs, rows <= seq_len
  EXPECT_TRUE(r.ok()) << r.status();
  return r.ok() ? std::move(*r) : nullptr;
}

std::vector<int64_t> RowLengths(const data::DatasetReader& ds) {
  std::vector<int64_t> out;
  for (int64_t r = 0; r < ds.num_rows(); ++r) out.push_back(ds.Row(r).end - ds.Row(r).begin);
  return out;
}

std::vector<uint64_t> Offsets(absl::Span<const uint64_t> s) { return {s.begin(), s.end()}; }

TEST(LongContext, PackedRowsSplitAndLabelsAt262144) {
  const uint32_t a = Id(" a"), b = Id(" b"), eos = *Qwen3().TokenId("<|im_end|>");
  auto s = Prepare(Options("packed_out", WriteCorpus("packed"), kSeqLen));
  ASSERT_TRUE(s.ok()) << s.status();
  constexpr int64_t kDocTokens = kPrompt + kCompletion;
  const int64_t total = kShort + kSeqLen + (kSeqLen + kLongTail) + kDocTokens + kLast;
  EXPECT_EQ(s->train.documents, 5);
  EXPECT_EQ(s->train.tokens, total);
  EXPECT_EQ(s->train.trained_tokens, total - kPrompt);
  EXPECT_EQ(s->train.split_documents, 1);
  EXPECT_EQ(s->train.truncated_documents, 0);
  EXPECT_EQ(s->train.rows, 4);

  // The manifest as written, and as the trainer's reader validates it.
  std::ifstream mf(s->train.dir + "/manifest.json");
  const json m = json::parse(mf);
  EXPECT_EQ(m["seq_len"], kSeqLen);
  EXPECT_EQ(m["packing"], "packed");
  EXPECT_EQ(m["num_tokens"], total);
  EXPECT_EQ(m["num_rows"], 4);
  EXPECT_EQ(m["num_documents"], 5);
  EXPECT_EQ(m["split_documents"], 1);
  EXPECT_EQ(m["num_trained_tokens"], total - kPrompt);
  EXPECT_EQ(m["files"][0]["bytes"], total * 4);  // no padding in the file
  EXPECT_EQ(m["files"][1]["bytes"], total);
  EXPECT_EQ(m["metadata"]["split"], "train");
  auto ds = OpenVerified(s->train.dir);
  ASSERT_NE(ds, nullptr);

  // Row 0: the short document (the exact one does not fit after it); row 1: the exact one, full;
  // rows 2-3: the long one split at seq_len, its tail packed with the next two documents.
  EXPECT_THAT(RowLengths(*ds), ElementsAre(kShort, kSeqLen, kSeqLen, kLongTail + kDocTokens + kLast));
  const uint64_t long_begin = kShort + kSeqLen;
  EXPECT_THAT(Offsets(ds->doc_offsets()), ElementsAre(0, kShort, long_begin, long_begin + kSeqLen + kLongTail,
                                                      long_begin + kSeqLen + kLongTail + kDocTokens, total));
  EXPECT_THAT(Offsets(ds->row_offsets()), ElementsAre(0, kShort, long_begin, long_begin + kSeqLen, total));
  std::vector<uint32_t> tokens(total);
  std::vector<uint8_t> mask(total);
  ASSERT_TRUE(ds->ReadTokens(0, total, tokens.data(), mask.data()).ok());
  const auto doc = Offsets(ds->doc_offsets());
  for (int d = 0; d < 5; ++d) {
    EXPECT_EQ(tokens[doc[d + 1] - 1], eos) << "document " << d;
    for (uint64_t t = doc[d]; t + 1 < doc[d + 1]; ++t) {
      const bool prompt = d == 3 && t < doc[3] + kPrompt;
      ASSERT_EQ(tokens[t], prompt ? b : a) << "document " << d << " token " << t;
      ASSERT_EQ(mask[t], prompt ? 0 : 1) << "document " << d << " token " << t;
    }
  }

  // The micro-batch the trainer builds from the split rows: every piece restarts at position 0 and
  // never predicts across a row or document boundary; the prompt is context only.
  auto mb = data::BuildMicroBatch(*ds, std::vector<int64_t>{2, 3});
  ASSERT_TRUE(mb.ok()) << mb.status();
  EXPECT_THAT(mb->cu_seqlens, ElementsAre(0, kSeqLen, kSeqLen + kLongTail, kSeqLen + kLongTail + kDocTokens,
                                          kSeqLen + kLongTail + kDocTokens + kLast));
  EXPECT_EQ(mb->max_seqlen, kSeqLen);
  std::vector<int32_t> want_labels, want_positions;
  auto piece = [&](int64_t begin_in_stream, int64_t n) {
    for (int64_t i = 0; i < n; ++i) {
      const int64_t t = begin_in_stream + i;
      want_positions.push_back(static_cast<int32_t>(i));
      want_labels.push_back(i + 1 < n && mask[t + 1] ? static_cast<int32_t>(tokens[t + 1]) : kIgnoreIndex);
    }
  };
  piece(long_begin, kSeqLen);
  piece(long_begin + kSeqLen, kLongTail);
  piece(doc[3], kDocTokens);
  piece(doc[4], kLast);
  ASSERT_EQ(mb->labels.size(), want_labels.size());
  EXPECT_TRUE(mb->labels == want_labels);
  EXPECT_TRUE(mb->positions == want_positions);
  EXPECT_EQ(mb->labels[kSeqLen - 1], kIgnoreIndex);  // the split piece does not predict the next row
  EXPECT_EQ(mb->labels[kSeqLen + kLongTail - 1], kIgnoreIndex);
  const int64_t doc3 = kSeqLen + kLongTail;
  EXPECT_EQ(mb->labels[doc3 + kPrompt - 2], kIgnoreIndex);             // predicts a prompt token
  EXPECT_EQ(mb->labels[doc3 + kPrompt - 1], static_cast<int32_t>(a));  // predicts the first completion token
  EXPECT_EQ(mb->labels[doc3 + kDocTokens - 2], static_cast<int32_t>(eos));
  const int64_t trained = (kSeqLen - 1) + (kLongTail - 1) + kCompletion + (kLast - 1);
  EXPECT_EQ(mb->num_trained(), trained);
  EXPECT_EQ(*data::CountTrainedLabels(*ds, std::vector<int64_t>{2, 3}), trained);
}

TEST(LongContext, PaddedRowsTruncateAt262144) {
  PrepareOptions o = Options("padded_out", WriteCorpus("padded"), kSeqLen);
  o.packing = data::Packing::kPadded;
  auto s = Prepare(o);
  ASSERT_TRUE(s.ok()) << s.status();
  constexpr int64_t kDocTokens = kPrompt + kCompletion;
  const int64_t total = kShort + kSeqLen + kSeqLen + kDocTokens + kLast;  // the long one's tail is dropped
  EXPECT_EQ(s->train.rows, 5);
  EXPECT_EQ(s->train.tokens, total);
  EXPECT_EQ(s->train.truncated_documents, 1);
  EXPECT_EQ(s->train.split_documents, 0);
  EXPECT_EQ(s->train.trained_tokens, total - kPrompt);
  auto ds = OpenVerified(s->train.dir);
  ASSERT_NE(ds, nullptr);
  EXPECT_EQ(ds->manifest().packing, data::Packing::kPadded);
  EXPECT_EQ(ds->manifest().seq_len, kSeqLen);
  EXPECT_EQ(ds->manifest().files[0].bytes, static_cast<uint64_t>(total) * 4);  // rows are not padded on disk
  // One document per row; the exact one fills its row, the long one is cut to seq_len.
  EXPECT_THAT(RowLengths(*ds), ElementsAre(kShort, kSeqLen, kSeqLen, kDocTokens, kLast));
  EXPECT_THAT(Offsets(ds->doc_offsets()), ElementsAreArray(Offsets(ds->row_offsets())));
  auto mb = data::BuildMicroBatch(*ds, std::vector<int64_t>{2});
  ASSERT_TRUE(mb.ok()) << mb.status();
  EXPECT_THAT(mb->cu_seqlens, ElementsAre(0, kSeqLen));
  EXPECT_EQ(mb->labels[kSeqLen - 2], static_cast<int32_t>(Id(" a")));  // the cut document has no EOS
  EXPECT_EQ(mb->labels[kSeqLen - 1], kIgnoreIndex);
  EXPECT_EQ(mb->num_trained(), kSeqLen - 1);
}

TEST(LongContext, AcceptsSeqLen1048576AndSplitsLongerDocuments) {
  constexpr int64_t kMillion = 1048576;
  const std::string in = WriteJsonl("million.jsonl", {Text(kMillion + 1), Text(10)});
  auto s = Prepare(Options("million_out", {in}, kMillion));
  ASSERT_TRUE(s.ok()) << s.status();
  EXPECT_EQ(s->train.split_documents, 1);
  auto ds = OpenVerified(s->train.dir);
  ASSERT_NE(ds, nullptr);
  EXPECT_EQ(ds->manifest().seq_len, kMillion);
  EXPECT_THAT(RowLengths(*ds), ElementsAre(kMillion, 1 + 10));
  auto mb = data::BuildMicroBatch(*ds, std::vector<int64_t>{0, 1});
  ASSERT_TRUE(mb.ok()) << mb.status();
  EXPECT_THAT(mb->cu_seqlens, ElementsAre(0, kMillion, kMillion + 1, kMillion + 11));
  EXPECT_EQ(mb->positions[kMillion - 1], kMillion - 1);
  EXPECT_EQ(mb->positions[kMillion], 0);
}

TEST(LongContext, SeqLenOutsideTheTrainersRangeNamesTheFlag) {
  const std::string in = WriteJsonl("range.jsonl", {Text(5)});
  for (int64_t bad : {int64_t{1}, kMaxSeqLen + 1, int64_t{1} << 40}) {
    auto s = Prepare(Options("range_out", {in}, bad));
    EXPECT_EQ(s.status().code(), absl::StatusCode::kInvalidArgument) << bad;
    EXPECT_THAT(std::string(s.status().message()), HasSubstr("--seq-len " + std::to_string(bad))) << bad;
  }
  // The largest accepted value writes rows as any other (nothing is allocated per seq_len).
  auto s = Prepare(Options("range_max", {in}, kMaxSeqLen));
  ASSERT_TRUE(s.ok()) << s.status();
  EXPECT_EQ(s->train.rows, 1);
}

TEST(LongContext, BatchesAreBoundedByInputBytesWithTheSameOutput) {
  // A JSON array input is streamed element by element; with batch_bytes 1 every document is its
  // own batch (one progress call each), and the dataset is byte-identical to one batch of all.
  const std::vector<std::string> jsonl = WriteCorpus("batches");
  const std::vector<std::string> array = WriteCorpus("batches_array", /*array=*/true);
  auto crcs = [](const std::string& dir) {
    auto ds = OpenVerified(dir);
    std::vector<uint32_t> out;
    if (ds != nullptr) {
      for (const auto& f : ds->manifest().files) out.push_back(f.crc32);
    }
    return out;
  };
  auto whole = Prepare(Options("batches_whole", jsonl, kSeqLen));
  ASSERT_TRUE(whole.ok()) << whole.status();
  for (const std::vector<std::string>& in : {jsonl, array}) {
    PrepareOptions o = Options("batches_one", in, kSeqLen);
    o.batch_bytes = 1;
    int calls = 0;
    PrepareProgress last;
    o.progress = [&](const PrepareProgress& p) {
      ++calls;
      last = p;
    };
    auto one = Prepare(o);
    ASSERT_TRUE(one.ok()) << in[0] << ": " << one.status();
    EXPECT_EQ(calls, 5) << in[0];
    EXPECT_EQ(last.bytes_done, last.bytes_total) << in[0];
    EXPECT_EQ(crcs(one->train.dir), crcs(whole->train.dir)) << in[0];
  }
}

}  // namespace
}  // namespace slidedp::prepare
