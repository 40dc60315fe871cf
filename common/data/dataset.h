// The pre-tokenized training dataset: format constants, a streaming Writer and an mmap Reader.
//
// One dataset is a directory (docs/dataset-format.md is the normative description):
//   manifest.json    format name and version, vocab_size, seq_len, packing, counts, per-file
//                    byte sizes and CRC-32 (zlib) checksums, free-form "metadata", and the
//                    optional "source" (DatasetSource: tokenizer fingerprint, chat template)
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
#include <optional>
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

// What produced a dataset's tokens: manifest.json's optional "source" object, written by
// `slidedp prepare` (absent in datasets written before it, and in synthetic ones). hostd compares
// tokenizer_fingerprint with the model directory's tok::IdentifyTokenizer at submit, so a dataset
// tokenized for another model is refused before it trains (docs/dataset-format.md, "Source").
struct DatasetSource {
  std::string tokenizer_fingerprint;  // "sha256:<64 hex>" (tok::IdentifyTokenizer); never empty
  int64_t tokenizer_vocab_size = 0;   // max id + 1 over the tokenizer's vocabulary and added tokens
  int64_t model_vocab_size = 0;       // the model's config.json vocab_size; 0 when it had none
  std::string chat_template;          // the known template rendered ("qwen3", "llama3.1", ...) or "none"
  std::string chat_template_sha256;   // 64 hex of that template's text; empty with "none"
  std::string model;                  // the model directory prepare read (absolute)

  nlohmann::json ToJson() const;
  // DATA_LOSS naming the field ("<where>: source.tokenizer_vocab_size: ...") when malformed.
  static absl::StatusOr<DatasetSource> FromJson(const nlohmann::json& j, const std::string& where);
};

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
  std::optional<DatasetSource> source;                 // absent in older and synthetic datasets

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
  std::optional<DatasetSource> source = std::nullopt;  // may also be set later, before Finish (set_source)
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

  // The manifest's "source", when it is known only after the documents (the chat template rendered).
  void set_source(DatasetSource source) { manifest_.source = std::move(source); }

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

// What fstat says of one dataset file. While it is unchanged, the file holds the bytes that were
// verified: a write changes mtime and ctime, a truncation the size, a replacement (rename over the
// path) device or inode. (Timestamps have the kernel's coarse clock granularity, a few ms: a
// write in the same tick as the previous modification of the file keeps them.)
struct FileIdentity {
  uint64_t dev = 0;
  uint64_t ino = 0;
  int64_t size = 0;
  int64_t mtime_ns = 0;
  int64_t ctime_ns = 0;
  bool operator==(const FileIdentity&) const = default;
  std::string ToString() const;  // "dev 0x803 inode 1234, 4096 bytes, mtime ..., ctime ..."
};

// The four .bin files in manifest order (tokens, loss mask, document offsets, row offsets).
inline constexpr int kNumBinFiles = 4;
const char* BinFileName(int index);

struct ReaderOptions {
  // The model's vocabulary (embedding rows). When > 0, every token id is checked against it
  // on Open (INVALID_ARGUMENT with the first offending position). 0 skips the scan.
  int64_t model_vocab_size = 0;
  VerifyChecksums verify_checksums = VerifyChecksums::kYes;
  // Threads for the content scans and checksums (ParallelFor; 0: the hardware's, at most 16).
  int threads = 0;
  // The files as a verifier saw them (hostd at job start, passed to the workers in their
  // assignment), in BinFileName order. Open refuses a file whose identity differs (DATA_LOSS
  // naming it: changed or replaced since it was verified) and skips the content scans and
  // checksums, which the verifier ran on exactly these bytes. Empty: no comparison.
  std::vector<FileIdentity> expected_files = {};
};

// One document piece inside a row: tokens [begin, end) of the token stream.
struct RowSegment {
  int64_t begin = 0;
  int64_t end = 0;
};

// A read-only dataset. Thread-safe after Open (all accessors are const).
//
// Nothing is memory-mapped: a mapped file that is truncated while it is read kills the process
// with SIGBUS (a worker mid-step, or hostd validating a submit). The offsets are read into memory
// at Open (8 bytes per row and per document); tokens and loss mask are read per row with pread
// (ReadTokens), and a short read or a changed identity (CheckUnchanged) is DATA_LOSS naming the
// file, so a dataset truncated or rewritten under a running job fails that job cleanly.
class DatasetReader {
 public:
  // Validates before training starts: manifest (format, version), regular files whose sizes
  // match the counts (DATA_LOSS naming the file, expected and actual bytes), checksums (read in
  // parallel chunks, combined with crc32_combine; the files must not change while they are read),
  // offsets monotone and ending at num_tokens, rows within seq_len, an empty dataset
  // (INVALID_ARGUMENT), ids in range, the loss mask (CheckLossMask).
  static absl::StatusOr<std::unique_ptr<DatasetReader>> Open(const std::string& dir, const ReaderOptions& options = {});
  ~DatasetReader();

  const Manifest& manifest() const { return manifest_; }
  const std::string& dir() const { return dir_; }
  int64_t num_rows() const { return manifest_.num_rows; }
  int64_t num_tokens() const { return manifest_.num_tokens; }
  // Each .bin file as Open found it (BinFileName order).
  const std::vector<FileIdentity>& file_identities() const { return identities_; }

  absl::Span<const uint64_t> doc_offsets() const { return doc_offsets_; }
  absl::Span<const uint64_t> row_offsets() const { return row_offsets_; }

  // Tokens and loss-mask entries [begin, end) of the token stream into tokens[0, end - begin) and
  // mask[...] (either may be null: not read). INVALID_ARGUMENT outside [0, num_tokens); DATA_LOSS
  // naming the file when it has become shorter than at Open.
  absl::Status ReadTokens(int64_t begin, int64_t end, uint32_t* tokens, uint8_t* mask) const;
  // DATA_LOSS naming the tokens or loss-mask file when its identity is no longer what Open saw
  // (written, truncated or replaced). Called after a batch's reads, it proves they read the
  // verified bytes: a write changes the timestamps before it changes data.
  absl::Status CheckUnchanged() const;

  // Tokens [begin, end) of row r and its document pieces in order (r < num_rows, else CHECK).
  RowSegment Row(int64_t r) const;
  std::vector<RowSegment> RowSegments(int64_t r) const;

  // Every loss-mask entry 0 or 1 (DATA_LOSS naming the first other one), and at least one 1
  // (INVALID_ARGUMENT: a job on it would train nothing and report loss 0).
  absl::Status CheckLossMask() const;
  // INVALID_ARGUMENT naming the first token position whose id is >= vocab_size.
  absl::Status CheckTokenRange(int64_t vocab_size) const;

 private:
  DatasetReader() = default;
  // One parallel pass over the files: checksums (when `crc`), the largest token id, the loss
  // mask's other-than-0/1 entries and ones. Fills scan_.
  absl::Status Scan(bool crc, int threads);
  absl::Status CheckIdentity(int file, const FileIdentity& expected, const char* when) const;
  std::string PathOf(int file) const;

  struct ScanResult {
    bool done = false;
    uint32_t crc[kNumBinFiles] = {};
    std::vector<uint32_t> token_chunk_max;  // the largest id of each scan chunk of tokens.bin
    std::vector<uint8_t> mask_chunk_bad;    // whether a chunk of loss_mask.bin holds a value > 1
    int64_t trained = 0;                    // loss-mask ones
  };
  std::string dir_;
  Manifest manifest_;
  int fds_[kNumBinFiles] = {-1, -1, -1, -1};
  std::vector<FileIdentity> identities_;
  std::vector<uint64_t> doc_offsets_;
  std::vector<uint64_t> row_offsets_;
  ScanResult scan_;
};

}  // namespace slidedp::data
