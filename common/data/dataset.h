// The pre-tokenized training dataset: format constants, a streaming Writer and an mmap Reader.
//
// One dataset is a directory (docs/dataset-format.md is the normative description):
//   manifest.json    format name and version, vocab_size, seq_len, packing, counts, per-file
//                    byte sizes and CRC-32 (zlib) checksums, free-form "metadata"
//   tokens.bin       uint32 little-endian [num_tokens]       the token stream (documents concatenated)
//   loss_mask.bin    uint8 [num_tokens]                      1 = token i is a trained target
//   doc_offsets.bin  uint64 [num_documents + 1]              document d = tokens [off[d], off[d+1])
//   row_offsets.bin  uint64 [num_rows + 1]                   row r = tokens [off[r], off[r+1])
//
// Packing is decided at prepare time and stored as rows, so a (epoch, index) resume position
// names exactly the same tokens forever. Rows tile the token stream contiguously, each at most
// seq_len tokens. Attention never crosses a document boundary or a row boundary: a document longer
// than seq_len is split into row-sized pieces, and each piece starts again at position 0.
//   kPacked: documents follow each other in a row while they fit; a document that does not fit
//            the rest of the current row starts a new row (documents are only split when they are
//            longer than seq_len).
//   kPadded: one document per row; the writer truncates a document to seq_len (the dropped tail
//            is not stored) and counts it in truncated_documents.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "nlohmann/json.hpp"

namespace slidedp::data {

inline constexpr char kFormatName[] = "slidedp-dataset";
inline constexpr int kFormatVersion = 1;
inline constexpr char kManifestFile[] = "manifest.json";
inline constexpr char kTokensFile[] = "tokens.bin";
inline constexpr char kLossMaskFile[] = "loss_mask.bin";
inline constexpr char kDocOffsetsFile[] = "doc_offsets.bin";
inline constexpr char kRowOffsetsFile[] = "row_offsets.bin";

enum class Packing { kPacked, kPadded };
const char* PackingName(Packing p);
absl::StatusOr<Packing> ParsePacking(const std::string& name);

// Everything manifest.json says.
struct Manifest {
  int version = kFormatVersion;
  int64_t vocab_size = 0;  // of the tokenizer that produced it; every token id is below it
  int64_t seq_len = 0;
  Packing packing = Packing::kPacked;
  int64_t num_tokens = 0;
  int64_t num_documents = 0;
  int64_t num_rows = 0;
  int64_t num_trained_tokens = 0;   // loss_mask ones
  int64_t truncated_documents = 0;  // kPadded: documents cut to seq_len
  int64_t split_documents = 0;      // kPacked: documents longer than seq_len, split over rows
  struct FileEntry {
    std::string name;
    uint64_t bytes = 0;
    uint32_t crc32 = 0;
  };
  std::vector<FileEntry> files;                        // the four .bin files, in the order above
  nlohmann::json metadata = nlohmann::json::object();  // tokenizer, sources, split, ... (free-form)

  nlohmann::json ToJson() const;
  static absl::StatusOr<Manifest> FromJson(const nlohmann::json& j, const std::string& where);
};

enum class Overwrite { kNo, kYes };

struct WriterOptions {
  int64_t vocab_size = 0;
  int64_t seq_len = 0;
  Packing packing = Packing::kPacked;
  Overwrite overwrite = Overwrite::kNo;
  nlohmann::json metadata = nlohmann::json::object();
};

// Streams documents into <dir>.tmp-<pid>/ and renames it to <dir> on Finish(), so a reader never
// sees a half-written dataset. Not thread-safe: one producer (prepare orders its threads' output).
class DatasetWriter {
 public:
  static absl::StatusOr<std::unique_ptr<DatasetWriter>> Create(const std::string& dir, const WriterOptions& options);
  ~DatasetWriter();  // without Finish(): removes the temporary directory

  // Adds one document. loss_mask[i] != 0 marks token i as a trained target. Empty documents are
  // INVALID_ARGUMENT; ids >= vocab_size are INVALID_ARGUMENT naming the position.
  absl::Status AddDocument(absl::Span<const uint32_t> tokens, absl::Span<const uint8_t> loss_mask);

  // Writes manifest.json, fsyncs and publishes the directory. An empty dataset is INVALID_ARGUMENT.
  absl::StatusOr<Manifest> Finish();

  int64_t num_documents() const { return manifest_.num_documents; }
  int64_t num_tokens() const { return manifest_.num_tokens; }

 private:
  DatasetWriter() = default;
  struct Stream;
  absl::Status Append(int which, const void* data, size_t bytes);
  absl::Status CloseRow();

  std::string dir_, tmp_dir_;
  WriterOptions options_;
  Manifest manifest_;
  std::vector<std::unique_ptr<Stream>> streams_;  // tokens, mask, doc offsets, row offsets
  int64_t row_start_ = 0;                         // token index where the open row starts
  std::vector<uint8_t> mask_scratch_;
  bool finished_ = false;
};

enum class VerifyChecksums { kNo, kYes };

struct ReaderOptions {
  // The model's vocabulary (embedding rows). When > 0, every token id is checked against it
  // on Open (INVALID_ARGUMENT with the first offending position). 0 skips the scan.
  int64_t model_vocab_size = 0;
  VerifyChecksums verify_checksums = VerifyChecksums::kYes;
};

// One document piece inside a row: tokens [begin, end) of the token stream.
struct RowSegment {
  int64_t begin = 0;
  int64_t end = 0;
};

// A read-only, memory-mapped dataset. Thread-safe after Open (all accessors are const).
class DatasetReader {
 public:
  // Validates before training starts: manifest (format, version), file sizes against the
  // counts (DATA_LOSS naming the file, expected and actual bytes), checksums, offsets monotone and
  // ending at num_tokens, rows within seq_len, an empty dataset (INVALID_ARGUMENT), ids in range.
  static absl::StatusOr<std::unique_ptr<DatasetReader>> Open(const std::string& dir, const ReaderOptions& options = {});
  ~DatasetReader();

  const Manifest& manifest() const { return manifest_; }
  const std::string& dir() const { return dir_; }
  int64_t num_rows() const { return manifest_.num_rows; }
  int64_t num_tokens() const { return manifest_.num_tokens; }

  absl::Span<const uint32_t> tokens() const { return tokens_; }
  absl::Span<const uint8_t> loss_mask() const { return loss_mask_; }
  absl::Span<const uint64_t> doc_offsets() const { return doc_offsets_; }
  absl::Span<const uint64_t> row_offsets() const { return row_offsets_; }

  // Tokens [begin, end) of row r and its document pieces in order (r < num_rows, else CHECK).
  RowSegment Row(int64_t r) const;
  std::vector<RowSegment> RowSegments(int64_t r) const;

  // INVALID_ARGUMENT naming the first token position whose id is >= vocab_size.
  // Every loss-mask entry 0 or 1 (DATA_LOSS naming the first other one), and at least one 1
  // (INVALID_ARGUMENT: a job on it would train nothing and report loss 0).
  absl::Status CheckLossMask() const;
  absl::Status CheckTokenRange(int64_t vocab_size) const;

 private:
  DatasetReader() = default;
  struct Mapping {
    void* addr = nullptr;
    size_t bytes = 0;
  };
  std::string dir_;
  Manifest manifest_;
  std::vector<Mapping> mappings_;
  absl::Span<const uint32_t> tokens_;
  absl::Span<const uint8_t> loss_mask_;
  absl::Span<const uint64_t> doc_offsets_;
  absl::Span<const uint64_t> row_offsets_;
};

}  // namespace slidedp::data
