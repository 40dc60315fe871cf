// Dataset writer (streaming, atomic publish) and reader (mmap, validated before training).
#include "common/data/dataset.h"
#include "common/io/json_depth.h"

#include "common/io/small_file.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>
#include <zlib.h>

#include <atomic>
#include <cerrno>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "absl/cleanup/cleanup.h"
#include "absl/strings/str_cat.h"
#include "common/parallel/parallel_for.h"
#include "common/status/status_macros.h"
#include "glog/logging.h"

namespace slidedp::data {
namespace fs = std::filesystem;

namespace {

constexpr const char* kBinFiles[4] = {kTokensFile, kLossMaskFile, kDocOffsetsFile, kRowOffsetsFile};
enum StreamIndex { kTok = 0, kMask = 1, kDoc = 2, kRow = 3 };

// zlib's crc32 takes a uInt length: feed large buffers in pieces.
uint32_t Crc32Update(uint32_t crc, const void* data, size_t bytes) {
  const auto* p = static_cast<const Bytef*>(data);
  while (bytes > 0) {
    uInt n = static_cast<uInt>(std::min<size_t>(bytes, 1u << 30));
    crc = static_cast<uint32_t>(crc32(crc, p, n));
    p += n;
    bytes -= n;
  }
  return crc;
}

absl::Status FsyncPath(const std::string& path, int flags) {
  int fd = ::open(path.c_str(), flags | O_CLOEXEC);
  if (fd < 0) return ErrnoStatus(absl::StrCat("open ", path), errno);
  int rc = ::fsync(fd);
  int err = errno;
  ::close(fd);
  if (rc != 0) return ErrnoStatus(absl::StrCat("fsync ", path), err);
  return absl::OkStatus();
}

}  // namespace

const char* PackingName(Packing p) { return p == Packing::kPacked ? "packed" : "padded"; }

absl::StatusOr<Packing> ParsePacking(const std::string& name) {
  if (name == "packed") return Packing::kPacked;
  if (name == "padded") return Packing::kPadded;
  return absl::InvalidArgumentError(absl::StrCat("packing must be \"packed\" or \"padded\", got \"", name, "\""));
}

nlohmann::json Manifest::ToJson() const {
  nlohmann::json j;
  j["format"] = kFormatName;
  j["version"] = version;
  j["token_dtype"] = "uint32";
  j["vocab_size"] = vocab_size;
  j["seq_len"] = seq_len;
  j["packing"] = PackingName(packing);
  j["num_tokens"] = num_tokens;
  j["num_documents"] = num_documents;
  j["num_rows"] = num_rows;
  j["num_trained_tokens"] = num_trained_tokens;
  j["truncated_documents"] = truncated_documents;
  j["split_documents"] = split_documents;
  nlohmann::json f = nlohmann::json::array();
  for (const FileEntry& e : files) f.push_back({{"name", e.name}, {"bytes", e.bytes}, {"crc32", e.crc32}});
  j["files"] = f;
  j["metadata"] = metadata;
  if (source.has_value()) j["source"] = source->ToJson();
  return j;
}

namespace {

// "an array", "an object", "a string", "null", ...: a JSON value's type for messages.
std::string TypeWithArticle(const nlohmann::json& v) {
  if (v.is_null()) return "null";
  const std::string name = v.type_name();
  return (name[0] == 'a' || name[0] == 'o' ? "an " : "a ") + name;
}

bool IsLowerHex(const std::string& s, size_t digits) {
  if (s.size() != digits) return false;
  for (char c : s) {
    if (!((c >= '0' && c <= '9') || (c >= 'a' && c <= 'f'))) return false;
  }
  return true;
}

}  // namespace

nlohmann::json DatasetSource::ToJson() const {
  nlohmann::json j = {{"tokenizer_fingerprint", tokenizer_fingerprint},
                      {"tokenizer_vocab_size", tokenizer_vocab_size},
                      {"chat_template", chat_template},
                      {"model", model}};
  if (model_vocab_size > 0) j["model_vocab_size"] = model_vocab_size;
  if (!chat_template_sha256.empty()) j["chat_template_sha256"] = chat_template_sha256;
  return j;
}

absl::StatusOr<DatasetSource> DatasetSource::FromJson(const nlohmann::json& j, const std::string& where) {
  // A manifest is written by prepare, never by hand: a malformed source means the file is damaged.
  auto bad = [&](const std::string& field, const std::string& what) {
    return absl::DataLossError(absl::StrCat(where, ": source", field.empty() ? "" : ".", field, ": ", what));
  };
  if (!j.is_object()) return bad("", absl::StrCat(TypeWithArticle(j), ", not an object"));
  DatasetSource s;
  auto string_field = [&](const char* name, bool required, std::string* out) -> absl::Status {
    if (!j.contains(name) || j[name].is_null()) {
      return required ? bad(name, "missing") : absl::OkStatus();
    }
    if (!j[name].is_string()) return bad(name, absl::StrCat(TypeWithArticle(j[name]), ", not a string"));
    *out = j[name].get<std::string>();
    return absl::OkStatus();
  };
  // Vocabulary sizes: integers in [1, 2^32] (token ids are uint32).
  auto size_field = [&](const char* name, bool required, int64_t* out) -> absl::Status {
    if (!j.contains(name) || j[name].is_null()) {
      return required ? bad(name, "missing") : absl::OkStatus();
    }
    const nlohmann::json& v = j[name];
    const bool in_range =
        (v.is_number_unsigned() && v.get<uint64_t>() >= 1 && v.get<uint64_t>() <= (uint64_t{1} << 32)) ||
        (v.is_number_integer() && v.get<int64_t>() >= 1 && v.get<int64_t>() <= (int64_t{1} << 32));
    if (!in_range) return bad(name, absl::StrCat(v.dump().substr(0, 40), " is not an integer in [1, 2^32]"));
    *out = v.get<int64_t>();
    return absl::OkStatus();
  };
  RETURN_IF_ERROR(string_field("tokenizer_fingerprint", true, &s.tokenizer_fingerprint));
  if (s.tokenizer_fingerprint.rfind("sha256:", 0) != 0 || !IsLowerHex(s.tokenizer_fingerprint.substr(7), 64)) {
    return bad("tokenizer_fingerprint", absl::StrCat("\"", s.tokenizer_fingerprint.substr(0, 80),
                                                     "\" is not \"sha256:\" and 64 lowercase hex digits"));
  }
  RETURN_IF_ERROR(size_field("tokenizer_vocab_size", true, &s.tokenizer_vocab_size));
  RETURN_IF_ERROR(size_field("model_vocab_size", false, &s.model_vocab_size));
  s.chat_template = "none";
  RETURN_IF_ERROR(string_field("chat_template", false, &s.chat_template));
  RETURN_IF_ERROR(string_field("chat_template_sha256", false, &s.chat_template_sha256));
  if (!s.chat_template_sha256.empty() && !IsLowerHex(s.chat_template_sha256, 64)) {
    return bad("chat_template_sha256", "not 64 lowercase hex digits");
  }
  RETURN_IF_ERROR(string_field("model", false, &s.model));
  return s;
}

absl::StatusOr<Manifest> Manifest::FromJson(const nlohmann::json& j, const std::string& where) {
  auto bad = [&](const std::string& what) { return absl::InvalidArgumentError(absl::StrCat(where, ": ", what)); };
  if (!j.is_object()) return bad("not a JSON object");
  if (!j.contains("format") || !j["format"].is_string() || j["format"].get<std::string>() != kFormatName)
    return bad(absl::StrCat("\"format\" is not \"", kFormatName, "\""));
  Manifest m;
  try {
    m.version = j.at("version").get<int>();
    if (m.version != kFormatVersion) {
      return absl::FailedPreconditionError(absl::StrCat(where, ": format version ", m.version,
                                                        " is not supported (this build reads ", kFormatVersion, ")"));
    }
    if (j.at("token_dtype").get<std::string>() != "uint32") return bad("token_dtype must be uint32");
    m.vocab_size = j.at("vocab_size").get<int64_t>();
    m.seq_len = j.at("seq_len").get<int64_t>();
    auto packing = ParsePacking(j.at("packing").get<std::string>());
    if (!packing.ok()) return bad(std::string(packing.status().message()));
    m.packing = *packing;
    m.num_tokens = j.at("num_tokens").get<int64_t>();
    m.num_documents = j.at("num_documents").get<int64_t>();
    m.num_rows = j.at("num_rows").get<int64_t>();
    m.num_trained_tokens = j.value("num_trained_tokens", int64_t{0});
    m.truncated_documents = j.value("truncated_documents", int64_t{0});
    m.split_documents = j.value("split_documents", int64_t{0});
    for (const auto& f : j.at("files")) {
      m.files.push_back(
          {f.at("name").get<std::string>(), f.at("bytes").get<uint64_t>(), f.at("crc32").get<uint32_t>()});
    }
    if (j.contains("metadata")) m.metadata = j["metadata"];
  } catch (const nlohmann::json::exception& e) {
    return bad(e.what());
  }
  if (m.vocab_size <= 0 || m.seq_len <= 0 || m.num_tokens < 0 || m.num_documents < 0 || m.num_rows < 0) {
    return bad("vocab_size and seq_len must be positive and counts non-negative");
  }
  // Optional within version 1: datasets written before prepare recorded it have none.
  if (j.contains("source")) {
    ASSIGN_OR_RETURN(DatasetSource source, DatasetSource::FromJson(j["source"], where));
    m.source = std::move(source);
  }
  return m;
}

// ---------------------------------------------------------------------------------------------
// Writer

struct DatasetWriter::Stream {
  std::string path;
  FILE* file = nullptr;
  uint64_t bytes = 0;
  uint32_t crc = 0;
  std::vector<char> buffer;
  ~Stream() {
    if (file != nullptr) std::fclose(file);
  }
};

absl::StatusOr<std::unique_ptr<DatasetWriter>> DatasetWriter::Create(const std::string& dir,
                                                                     const WriterOptions& options) {
  if (options.vocab_size <= 0 || options.vocab_size > (int64_t{1} << 32)) {
    return absl::InvalidArgumentError(
        absl::StrCat("dataset vocab_size must be in [1, 2^32], got ", options.vocab_size));
  }
  if (options.seq_len <= 0) {
    return absl::InvalidArgumentError(absl::StrCat("dataset seq_len must be positive, got ", options.seq_len));
  }
  std::error_code ec;
  if (fs::exists(dir, ec) && options.overwrite == Overwrite::kNo) {
    return absl::AlreadyExistsError(absl::StrCat("dataset output ", dir, " already exists (overwrite it explicitly)"));
  }
  std::unique_ptr<DatasetWriter> w(new DatasetWriter());
  w->dir_ = fs::path(dir).lexically_normal().string();
  if (!w->dir_.empty() && w->dir_.back() == '/') w->dir_.pop_back();
  w->tmp_dir_ = absl::StrCat(w->dir_, ".tmp-", ::getpid());
  w->options_ = options;
  w->manifest_.vocab_size = options.vocab_size;
  w->manifest_.seq_len = options.seq_len;
  w->manifest_.packing = options.packing;
  w->manifest_.metadata = options.metadata;
  w->manifest_.source = options.source;
  fs::remove_all(w->tmp_dir_, ec);
  fs::create_directories(w->tmp_dir_, ec);
  if (ec) return absl::PermissionDeniedError(absl::StrCat("creating ", w->tmp_dir_, ": ", ec.message()));
  for (const char* name : kBinFiles) {
    auto s = std::make_unique<Stream>();
    s->path = absl::StrCat(w->tmp_dir_, "/", name);
    s->file = std::fopen(s->path.c_str(), "wb");
    if (s->file == nullptr) return ErrnoStatus(absl::StrCat("creating ", s->path), errno);
    s->buffer.resize(1 << 20);
    std::setvbuf(s->file, s->buffer.data(), _IOFBF, s->buffer.size());
    w->streams_.push_back(std::move(s));
  }
  const uint64_t zero = 0;
  RETURN_IF_ERROR(w->Append(kDoc, &zero, sizeof(zero)));
  RETURN_IF_ERROR(w->Append(kRow, &zero, sizeof(zero)));
  return w;
}

DatasetWriter::~DatasetWriter() {
  streams_.clear();
  if (!finished_ && !tmp_dir_.empty()) {
    std::error_code ec;
    fs::remove_all(tmp_dir_, ec);
  }
}

absl::Status DatasetWriter::Append(int which, const void* data, size_t bytes) {
  Stream& s = *streams_[which];
  if (bytes == 0) return absl::OkStatus();
  if (std::fwrite(data, 1, bytes, s.file) != bytes) return ErrnoStatus(absl::StrCat("writing ", s.path), errno);
  s.crc = Crc32Update(s.crc, data, bytes);
  s.bytes += bytes;
  return absl::OkStatus();
}

absl::Status DatasetWriter::CloseRow() {
  if (manifest_.num_tokens == row_start_) return absl::OkStatus();
  const uint64_t end = static_cast<uint64_t>(manifest_.num_tokens);
  RETURN_IF_ERROR(Append(kRow, &end, sizeof(end)));
  row_start_ = manifest_.num_tokens;
  ++manifest_.num_rows;
  return absl::OkStatus();
}

absl::Status DatasetWriter::AddDocument(absl::Span<const uint32_t> tokens, absl::Span<const uint8_t> loss_mask) {
  if (finished_) return absl::FailedPreconditionError("AddDocument after Finish");
  if (tokens.empty()) return absl::InvalidArgumentError("empty document");
  if (tokens.size() != loss_mask.size()) {
    return absl::InvalidArgumentError(
        absl::StrCat("document has ", tokens.size(), " tokens but ", loss_mask.size(), " loss-mask entries"));
  }
  for (size_t i = 0; i < tokens.size(); ++i) {
    if (tokens[i] >= static_cast<uint64_t>(options_.vocab_size)) {
      return absl::InvalidArgumentError(absl::StrCat("document ", manifest_.num_documents, " token ", i, " has id ",
                                                     tokens[i], " >= vocab_size ", options_.vocab_size));
    }
  }
  const int64_t seq_len = options_.seq_len;
  int64_t n = static_cast<int64_t>(tokens.size());
  if (options_.packing == Packing::kPadded) {
    if (n > seq_len) {
      n = seq_len;
      ++manifest_.truncated_documents;
    }
  } else {
    const int64_t open = manifest_.num_tokens - row_start_;
    if (n <= seq_len) {
      if (open + n > seq_len) RETURN_IF_ERROR(CloseRow());
    } else {
      RETURN_IF_ERROR(CloseRow());  // a long document starts its own row, then is split at seq_len
      ++manifest_.split_documents;
    }
  }
  // Write in row-sized pieces so rows close exactly at seq_len.
  int64_t done = 0;
  while (done < n) {
    const int64_t room = seq_len - (manifest_.num_tokens - row_start_);
    const int64_t take = std::min(room, n - done);
    RETURN_IF_ERROR(Append(kTok, tokens.data() + done, take * sizeof(uint32_t)));
    mask_scratch_.resize(take);  // stored as exactly 0 or 1
    for (int64_t i = 0; i < take; ++i) {
      mask_scratch_[i] = loss_mask[done + i] != 0 ? 1 : 0;
      manifest_.num_trained_tokens += mask_scratch_[i];
    }
    RETURN_IF_ERROR(Append(kMask, mask_scratch_.data(), take));
    manifest_.num_tokens += take;
    done += take;
    if (manifest_.num_tokens - row_start_ == seq_len) RETURN_IF_ERROR(CloseRow());
  }
  const uint64_t end = static_cast<uint64_t>(manifest_.num_tokens);
  RETURN_IF_ERROR(Append(kDoc, &end, sizeof(end)));
  ++manifest_.num_documents;
  if (options_.packing == Packing::kPadded) RETURN_IF_ERROR(CloseRow());
  return absl::OkStatus();
}

absl::StatusOr<Manifest> DatasetWriter::Finish() {
  if (finished_) return absl::FailedPreconditionError("Finish called twice");
  if (manifest_.num_documents == 0) {
    return absl::InvalidArgumentError(absl::StrCat("dataset ", dir_, " would be empty: no documents were added"));
  }
  RETURN_IF_ERROR(CloseRow());
  for (auto& s : streams_) {
    if (std::fflush(s->file) != 0) return ErrnoStatus(absl::StrCat("flushing ", s->path), errno);
    if (::fsync(::fileno(s->file)) != 0) return ErrnoStatus(absl::StrCat("fsync ", s->path), errno);
    std::fclose(s->file);
    s->file = nullptr;
  }
  manifest_.files.clear();
  for (int i = 0; i < 4; ++i) manifest_.files.push_back({kBinFiles[i], streams_[i]->bytes, streams_[i]->crc});
  const std::string manifest_path = absl::StrCat(tmp_dir_, "/", kManifestFile);
  {
    std::ofstream out(manifest_path);
    out << manifest_.ToJson().dump(2) << "\n";
    out.close();
    if (!out) return absl::InternalError(absl::StrCat("writing ", manifest_path));
  }
  RETURN_IF_ERROR(FsyncPath(manifest_path, O_RDONLY));
  std::error_code ec;
  if (fs::exists(dir_, ec)) {
    if (options_.overwrite == Overwrite::kNo) {
      return absl::AlreadyExistsError(absl::StrCat("dataset output ", dir_, " appeared while writing"));
    }
    fs::remove_all(dir_, ec);
    if (ec) return absl::PermissionDeniedError(absl::StrCat("removing old ", dir_, ": ", ec.message()));
  }
  if (::rename(tmp_dir_.c_str(), dir_.c_str()) != 0) {
    return ErrnoStatus(absl::StrCat("rename ", tmp_dir_, " -> ", dir_), errno);
  }
  finished_ = true;
  const std::string parent = fs::path(dir_).parent_path().string();
  RETURN_IF_ERROR(FsyncPath(parent.empty() ? "." : parent, O_RDONLY | O_DIRECTORY));
  VLOG(1) << "dataset " << dir_ << ": " << manifest_.num_documents << " documents, " << manifest_.num_tokens
          << " tokens, " << manifest_.num_rows << " rows";
  return manifest_;
}

// ---------------------------------------------------------------------------------------------
// Reader

namespace {

constexpr int64_t kScanChunkBytes = 8 << 20;  // one pread and one CRC per task of the scan

int64_t TimespecNs(const struct timespec& t) { return int64_t{t.tv_sec} * 1000000000 + t.tv_nsec; }

FileIdentity IdentityOf(const struct stat& st) {
  return {static_cast<uint64_t>(st.st_dev), static_cast<uint64_t>(st.st_ino), static_cast<int64_t>(st.st_size),
          TimespecNs(st.st_mtim), TimespecNs(st.st_ctim)};
}

// Reads exactly `bytes` at `offset`, retrying short reads; OUT_OF_RANGE when the file ends first
// (the caller names it as a truncation), errno statuses otherwise.
absl::Status PreadExactly(int fd, void* out, uint64_t bytes, uint64_t offset, const std::string& path) {
  auto* p = static_cast<char*>(out);
  while (bytes > 0) {
    const ssize_t n = ::pread(fd, p, std::min<uint64_t>(bytes, 1u << 30), static_cast<off_t>(offset));
    if (n < 0) {
      if (errno == EINTR) continue;
      return ErrnoStatus(absl::StrCat("read ", path), errno);
    }
    if (n == 0) return absl::OutOfRangeError(absl::StrCat("end of ", path, " at byte ", offset));
    p += n;
    bytes -= static_cast<uint64_t>(n);
    offset += static_cast<uint64_t>(n);
  }
  return absl::OkStatus();
}

}  // namespace

const char* BinFileName(int index) { return kBinFiles[index]; }

std::string FileIdentity::ToString() const {
  return absl::StrCat("dev 0x", absl::Hex(dev), " inode ", ino, ", ", size, " bytes, mtime ", mtime_ns, " ns, ctime ",
                      ctime_ns, " ns");
}

DatasetReader::~DatasetReader() {
  for (int fd : fds_) {
    if (fd >= 0) ::close(fd);
  }
}

std::string DatasetReader::PathOf(int file) const { return absl::StrCat(dir_, "/", kBinFiles[file]); }

absl::Status DatasetReader::CheckIdentity(int file, const FileIdentity& expected, const char* when) const {
  struct stat st {};
  if (::fstat(fds_[file], &st) != 0) return ErrnoStatus(absl::StrCat("fstat ", PathOf(file)), errno);
  const FileIdentity now = IdentityOf(st);
  if (now == expected) return absl::OkStatus();
  return absl::DataLossError(absl::StrCat("dataset file ", PathOf(file), " changed ", when, " (was ",
                                          expected.ToString(), "; now ", now.ToString(),
                                          "): a dataset must not be modified while a job uses it"));
}

absl::StatusOr<std::unique_ptr<DatasetReader>> DatasetReader::Open(const std::string& dir,
                                                                   const ReaderOptions& options) {
  std::unique_ptr<DatasetReader> r(new DatasetReader());
  r->dir_ = dir;
  const std::string manifest_path = absl::StrCat(dir, "/", kManifestFile);
  absl::StatusOr<std::string> text = ReadSmallFile(manifest_path, kMaxManifestFileBytes, "dataset manifest");
  if (absl::IsNotFound(text.status())) {
    return absl::NotFoundError(absl::StrCat("dataset ", dir, ": cannot open ", kManifestFile,
                                            " (is this a directory written by slidedp prepare?)"));
  }
  if (!text.ok()) return text.status();
  if (absl::Status deep = CheckJsonDepth(*text, manifest_path); !deep.ok()) return absl::DataLossError(deep.message());
  nlohmann::json j = nlohmann::json::parse(*text, nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded()) return absl::DataLossError(absl::StrCat(manifest_path, ": not valid JSON"));
  ASSIGN_OR_RETURN(r->manifest_, Manifest::FromJson(j, manifest_path));
  const Manifest& m = r->manifest_;
  if (m.num_rows == 0 || m.num_tokens == 0 || m.num_documents == 0) {
    return absl::InvalidArgumentError(absl::StrCat("dataset ", dir, " is empty (", m.num_documents, " documents, ",
                                                   m.num_tokens, " tokens, ", m.num_rows, " rows)"));
  }
  // (Counts are below 2^62 here, or the expected sizes overflow; no file is that large.)
  constexpr int64_t kMaxCount = int64_t{1} << 58;
  if (m.num_tokens > kMaxCount || m.num_documents > kMaxCount || m.num_rows > kMaxCount) {
    return absl::DataLossError(absl::StrCat(manifest_path, ": counts beyond any file (", m.num_tokens, " tokens, ",
                                            m.num_documents, " documents, ", m.num_rows, " rows)"));
  }
  const uint64_t expected[kNumBinFiles] = {static_cast<uint64_t>(m.num_tokens) * 4, static_cast<uint64_t>(m.num_tokens),
                                           static_cast<uint64_t>(m.num_documents + 1) * 8,
                                           static_cast<uint64_t>(m.num_rows + 1) * 8};
  if (!options.expected_files.empty() && options.expected_files.size() != kNumBinFiles) {
    return absl::InvalidArgumentError(absl::StrCat("dataset ", dir, ": ", options.expected_files.size(),
                                                   " expected file identities, not ", kNumBinFiles));
  }
  for (int i = 0; i < kNumBinFiles; ++i) {
    const std::string path = r->PathOf(i);
    const Manifest::FileEntry* entry = nullptr;
    for (const auto& e : m.files) {
      if (e.name == kBinFiles[i]) entry = &e;
    }
    if (entry == nullptr) return absl::DataLossError(absl::StrCat(manifest_path, ": no entry for ", kBinFiles[i]));
    if (entry->bytes != expected[i]) {
      return absl::DataLossError(absl::StrCat(manifest_path, ": ", kBinFiles[i], " is listed with ", entry->bytes,
                                              " bytes but the counts imply ", expected[i]));
    }
    // O_NONBLOCK: a FIFO in the dataset's place must not block the open (it is refused below).
    const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK);
    if (fd < 0) {
      if (errno == ENOENT) return absl::DataLossError(absl::StrCat("dataset file ", path, " is missing"));
      return ErrnoStatus(absl::StrCat("open ", path), errno);
    }
    r->fds_[i] = fd;
    struct stat st {};
    if (::fstat(fd, &st) != 0) return ErrnoStatus(absl::StrCat("fstat ", path), errno);
    if (!S_ISREG(st.st_mode)) {
      return absl::InvalidArgumentError(absl::StrCat("dataset file ", path, " is not a regular file"));
    }
    r->identities_.push_back(IdentityOf(st));
    if (!options.expected_files.empty() && r->identities_[i] != options.expected_files[i]) {
      return absl::DataLossError(absl::StrCat(
          "dataset file ", path, " changed since it was verified (was ", options.expected_files[i].ToString(), "; now ",
          r->identities_[i].ToString(), "): a dataset must not be modified while a job uses it"));
    }
    if (static_cast<uint64_t>(st.st_size) != expected[i]) {
      return absl::DataLossError(absl::StrCat("dataset file ", path, " has ", st.st_size, " bytes, expected ",
                                              expected[i],
                                              st.st_size < static_cast<off_t>(expected[i]) ? " (truncated)" : ""));
    }
  }
  // The offsets live in memory (8 bytes per row and per document, at most twice tokens.bin).
  r->doc_offsets_.resize(m.num_documents + 1);
  r->row_offsets_.resize(m.num_rows + 1);
  for (int i : {kDoc, kRow}) {
    std::vector<uint64_t>& off = i == kDoc ? r->doc_offsets_ : r->row_offsets_;
    absl::Status s = PreadExactly(r->fds_[i], off.data(), expected[i], 0, r->PathOf(i));
    if (absl::IsOutOfRange(s)) {
      return absl::DataLossError(absl::StrCat("dataset file ", r->PathOf(i), " was truncated while it was read"));
    }
    RETURN_IF_ERROR(s);
  }
  const bool verified_elsewhere = !options.expected_files.empty();
  if (!verified_elsewhere) {
    RETURN_IF_ERROR(r->Scan(options.verify_checksums == VerifyChecksums::kYes, options.threads));
    // What was read is what the identities describe: nothing changed the files meanwhile.
    for (int i = 0; i < kNumBinFiles; ++i)
      RETURN_IF_ERROR(r->CheckIdentity(i, r->identities_[i], "while it was verified"));
    if (options.verify_checksums == VerifyChecksums::kYes) {
      for (int i = 0; i < kNumBinFiles; ++i) {
        const Manifest::FileEntry* entry = nullptr;
        for (const auto& e : m.files) {
          if (e.name == kBinFiles[i]) entry = &e;
        }
        if (r->scan_.crc[i] != entry->crc32) {
          return absl::DataLossError(absl::StrCat("dataset file ", r->PathOf(i), " is corrupt: CRC-32 ",
                                                  r->scan_.crc[i], " does not match the manifest's ", entry->crc32));
        }
      }
    }
  }

  auto check_offsets = [&](absl::Span<const uint64_t> off, const char* file, int64_t max_len) -> absl::Status {
    if (off.front() != 0 || off.back() != static_cast<uint64_t>(m.num_tokens)) {
      return absl::DataLossError(absl::StrCat(dir, "/", file, ": offsets must run from 0 to num_tokens ", m.num_tokens,
                                              ", found ", off.front(), " .. ", off.back()));
    }
    for (size_t i = 1; i < off.size(); ++i) {
      if (off[i] <= off[i - 1] || (max_len > 0 && off[i] - off[i - 1] > static_cast<uint64_t>(max_len))) {
        return absl::DataLossError(absl::StrCat(dir, "/", file, ": entry ", i - 1, " spans [", off[i - 1], ", ", off[i],
                                                ")", max_len > 0 ? absl::StrCat(", seq_len ", max_len) : ""));
      }
    }
    return absl::OkStatus();
  };
  RETURN_IF_ERROR(check_offsets(r->doc_offsets_, kDocOffsetsFile, 0));
  RETURN_IF_ERROR(check_offsets(r->row_offsets_, kRowOffsetsFile, m.seq_len));
  if (verified_elsewhere) return r;  // ids and mask were checked on these very bytes
  RETURN_IF_ERROR(r->CheckTokenRange(m.vocab_size));
  RETURN_IF_ERROR(r->CheckLossMask());
  if (options.model_vocab_size > 0) {
    absl::Status s = r->CheckTokenRange(options.model_vocab_size);
    if (!s.ok()) return Annotate(s, "the dataset does not fit the model's vocabulary");
  }
  return r;
}

absl::Status DatasetReader::Scan(bool crc, int threads) {
  // Tasks: every kScanChunkBytes chunk of tokens.bin and loss_mask.bin (read with pread), and the
  // offsets (already in memory) when their checksums are wanted. Each task's CRC is combined in
  // file order afterwards (crc32_combine), so the result does not depend on the threads.
  struct Task {
    int file;
    int64_t chunk;
    uint64_t offset, bytes;
  };
  std::vector<Task> tasks;
  const uint64_t sizes[kNumBinFiles] = {static_cast<uint64_t>(identities_[kTok].size),
                                        static_cast<uint64_t>(identities_[kMask].size), doc_offsets_.size() * 8,
                                        row_offsets_.size() * 8};
  for (int f = 0; f < kNumBinFiles; ++f) {
    if (!crc && f >= kDoc) break;
    int64_t c = 0;
    for (uint64_t off = 0; off < sizes[f]; off += kScanChunkBytes, ++c) {
      tasks.push_back({f, c, off, std::min<uint64_t>(kScanChunkBytes, sizes[f] - off)});
    }
  }
  const int64_t token_chunks = static_cast<int64_t>((sizes[kTok] + kScanChunkBytes - 1) / kScanChunkBytes);
  const int64_t mask_chunks = static_cast<int64_t>((sizes[kMask] + kScanChunkBytes - 1) / kScanChunkBytes);
  scan_.token_chunk_max.assign(token_chunks, 0);
  scan_.mask_chunk_bad.assign(mask_chunks, 0);
  std::vector<uint32_t> task_crc(tasks.size(), 0);
  std::vector<int64_t> task_trained(tasks.size(), 0);
  std::vector<absl::Status> task_status(tasks.size());
  // One buffer per thread, as large as the largest chunk read, tasks taken in order from a shared
  // counter. The buffers are mapped and unmapped directly: from malloc, hostd's (long-lived) arenas
  // would keep up to 8 MiB per thread after every scan (glibc raises its mmap threshold).
  uint64_t buffer_bytes = 0;
  for (const Task& t : tasks) {
    if (t.file < kDoc) buffer_bytes = std::max(buffer_bytes, t.bytes);
  }
  std::atomic<size_t> next{0};
  const int workers = std::min<int>(ResolveThreads(threads), static_cast<int>(std::max<size_t>(tasks.size(), 1)));
  ParallelFor(workers, workers, [&](size_t) {
    char* buffer = nullptr;
    if (buffer_bytes > 0) {
      void* p = ::mmap(nullptr, buffer_bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
      if (p == MAP_FAILED) {
        const int err = errno;
        for (size_t k = next++; k < tasks.size(); k = next++) task_status[k] = ErrnoStatus("scan buffer", err);
        return;
      }
      buffer = static_cast<char*>(p);
    }
    absl::Cleanup unmap = [&] {
      if (buffer != nullptr) ::munmap(buffer, buffer_bytes);
    };
    for (size_t k = next++; k < tasks.size(); k = next++) {
      const Task& t = tasks[k];
      const char* data = nullptr;
      if (t.file == kDoc || t.file == kRow) {
        const auto& off = t.file == kDoc ? doc_offsets_ : row_offsets_;
        data = reinterpret_cast<const char*>(off.data()) + t.offset;
      } else {
        absl::Status s = PreadExactly(fds_[t.file], buffer, t.bytes, t.offset, PathOf(t.file));
        if (absl::IsOutOfRange(s)) {
          s = absl::DataLossError(absl::StrCat("dataset file ", PathOf(t.file), " was truncated while it was read"));
        }
        if (!s.ok()) {
          task_status[k] = s;
          continue;
        }
        data = buffer;
      }
      if (crc) task_crc[k] = Crc32Update(0, data, t.bytes);
      if (t.file == kTok) {
        const auto* ids = reinterpret_cast<const uint32_t*>(data);
        uint32_t max_id = 0;
        for (uint64_t i = 0; i < t.bytes / 4; ++i) max_id = std::max(max_id, ids[i]);
        scan_.token_chunk_max[t.chunk] = max_id;
      } else if (t.file == kMask) {
        const auto* mask = reinterpret_cast<const uint8_t*>(data);
        uint8_t other = 0;
        int64_t ones = 0;
        for (uint64_t i = 0; i < t.bytes; ++i) {
          other |= mask[i] & 0xFE;
          ones += mask[i] & 1;
        }
        scan_.mask_chunk_bad[t.chunk] = other != 0;
        task_trained[k] = ones;
      }
    }
  });
  for (const absl::Status& s : task_status) RETURN_IF_ERROR(s);
  for (size_t k = 0; k < tasks.size(); ++k) {
    const Task& t = tasks[k];
    if (crc) {
      scan_.crc[t.file] =
          t.chunk == 0
              ? task_crc[k]
              : static_cast<uint32_t>(crc32_combine(scan_.crc[t.file], task_crc[k], static_cast<z_off_t>(t.bytes)));
    }
    scan_.trained += task_trained[k];
  }
  scan_.done = true;
  return absl::OkStatus();
}

absl::Status DatasetReader::ReadTokens(int64_t begin, int64_t end, uint32_t* tokens, uint8_t* mask) const {
  if (begin < 0 || end < begin || end > manifest_.num_tokens) {
    return absl::InvalidArgumentError(absl::StrCat("tokens [", begin, ", ", end, ") are outside dataset ", dir_, " of ",
                                                   manifest_.num_tokens, " tokens"));
  }
  const uint64_t n = static_cast<uint64_t>(end - begin);
  for (int f : {kTok, kMask}) {
    void* out = f == kTok ? static_cast<void*>(tokens) : static_cast<void*>(mask);
    if (out == nullptr || n == 0) continue;
    const uint64_t width = f == kTok ? 4 : 1;
    absl::Status s = PreadExactly(fds_[f], out, n * width, static_cast<uint64_t>(begin) * width, PathOf(f));
    if (absl::IsOutOfRange(s)) {
      return absl::DataLossError(absl::StrCat("dataset file ", PathOf(f), " is shorter than when the job opened it (",
                                              s.message(), "; expected ", identities_[f].size,
                                              " bytes): truncated while a job reads it"));
    }
    RETURN_IF_ERROR(s);
  }
  return absl::OkStatus();
}

absl::Status DatasetReader::CheckUnchanged() const {
  for (int f : {kTok, kMask}) RETURN_IF_ERROR(CheckIdentity(f, identities_[f], "while a job reads it"));
  return absl::OkStatus();
}

absl::Status DatasetReader::CheckTokenRange(int64_t vocab_size) const {
  if (!scan_.done) return absl::FailedPreconditionError("dataset opened with expected_files: the verifier checked it");
  // The scan's per-chunk maxima first (fast path); the position is found only when an id is out of
  // range, by reading that chunk again.
  const auto& maxima = scan_.token_chunk_max;
  uint32_t max_id = 0;
  for (uint32_t mx : maxima) max_id = std::max(max_id, mx);
  if (static_cast<int64_t>(max_id) < vocab_size) return absl::OkStatus();
  const int64_t per_chunk = kScanChunkBytes / 4;
  std::vector<uint32_t> ids;
  for (size_t c = 0; c < maxima.size(); ++c) {
    if (static_cast<int64_t>(maxima[c]) < vocab_size) continue;
    const int64_t begin = static_cast<int64_t>(c) * per_chunk;
    const int64_t end = std::min(manifest_.num_tokens, begin + per_chunk);
    ids.resize(end - begin);
    RETURN_IF_ERROR(ReadTokens(begin, end, ids.data(), nullptr));
    for (int64_t i = 0; i < end - begin; ++i) {
      if (static_cast<int64_t>(ids[i]) >= vocab_size) {
        return absl::InvalidArgumentError(absl::StrCat("dataset ", dir_, ": token at position ", begin + i, " has id ",
                                                       ids[i], " >= vocab_size ", vocab_size,
                                                       " (max id in the dataset: ", max_id, ")"));
      }
    }
  }
  return absl::DataLossError(absl::StrCat("dataset file ", PathOf(kTok), " changed while it was checked"));
}

absl::Status DatasetReader::CheckLossMask() const {
  if (!scan_.done) return absl::FailedPreconditionError("dataset opened with expected_files: the verifier checked it");
  const auto& bad = scan_.mask_chunk_bad;
  for (size_t c = 0; c < bad.size(); ++c) {
    if (!bad[c]) continue;
    const int64_t begin = static_cast<int64_t>(c) * kScanChunkBytes;
    const int64_t end = std::min(manifest_.num_tokens, begin + kScanChunkBytes);
    std::vector<uint8_t> mask(end - begin);
    RETURN_IF_ERROR(ReadTokens(begin, end, nullptr, mask.data()));
    for (int64_t i = 0; i < end - begin; ++i) {
      if (mask[i] > 1) {
        return absl::DataLossError(absl::StrCat("dataset ", dir_, ": loss-mask entry at position ", begin + i, " is ",
                                                int{mask[i]}, " (entries are 0 or 1)"));
      }
    }
  }
  if (scan_.trained == 0) {
    return absl::InvalidArgumentError(absl::StrCat("dataset ", dir_, " trains no token: every loss-mask entry is 0 (",
                                                   "a chat dataset whose assistant turns were all cut off?)"));
  }
  return absl::OkStatus();
}

RowSegment DatasetReader::Row(int64_t r) const {
  CHECK(r >= 0 && r < num_rows()) << "row " << r << " of " << num_rows();
  return {static_cast<int64_t>(row_offsets_[r]), static_cast<int64_t>(row_offsets_[r + 1])};
}

std::vector<RowSegment> DatasetReader::RowSegments(int64_t r) const {
  const RowSegment row = Row(r);
  std::vector<RowSegment> out;
  // First document boundary strictly inside the row.
  auto it = std::upper_bound(doc_offsets_.begin(), doc_offsets_.end(), static_cast<uint64_t>(row.begin));
  int64_t begin = row.begin;
  for (; it != doc_offsets_.end() && static_cast<int64_t>(*it) < row.end; ++it) {
    out.push_back({begin, static_cast<int64_t>(*it)});
    begin = static_cast<int64_t>(*it);
  }
  out.push_back({begin, row.end});
  return out;
}

}  // namespace slidedp::data
