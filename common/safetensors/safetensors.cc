// safetensors reader (validating, mmap) and writer (pre-allocated, parallel pwrite).
#include "common/safetensors/safetensors.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <filesystem>
#include <limits>
#include <mutex>
#include <set>
#include <thread>

#include "absl/strings/str_cat.h"
#include "common/io/json_depth.h"
#include "common/io/small_file.h"
#include "common/numeric/bf16.h"
#include "common/status/status_macros.h"
#include "nlohmann/json.hpp"

namespace slidedp::safetensors {
namespace {

struct DtypeEntry {
  Dtype dtype;
  const char* name;
  size_t size;
};

constexpr DtypeEntry kDtypes[] = {
    {Dtype::kBool, "BOOL", 1},   {Dtype::kU8, "U8", 1},     {Dtype::kI8, "I8", 1},
    {Dtype::kF8E5M2, "F8_E5M2", 1}, {Dtype::kF8E4M3, "F8_E4M3", 1}, {Dtype::kI16, "I16", 2},
    {Dtype::kU16, "U16", 2},     {Dtype::kF16, "F16", 2},   {Dtype::kBF16, "BF16", 2},
    {Dtype::kI32, "I32", 4},     {Dtype::kU32, "U32", 4},   {Dtype::kF32, "F32", 4},
    {Dtype::kF64, "F64", 8},     {Dtype::kI64, "I64", 8},   {Dtype::kU64, "U64", 8},
};

// JSON nesting allowed in a header: the format needs 3 levels; the cap keeps hostile input from
// exhausting the stack anywhere in the JSON library.
constexpr int kMaxJsonDepth = 16;
// Entries (tensors and __metadata__) a header may hold: the largest MoE checkpoints' shards hold
// tens of thousands.
constexpr uint64_t kMaxHeaderEntries = uint64_t{1} << 20;

// Error text quotes at most this much of a JSON value.
std::string Excerpt(const nlohmann::json& j) {
  std::string s = j.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
  if (s.size() > 80) s = s.substr(0, 77) + "...";
  return s;
}

std::string Quote(absl::string_view name) {
  std::string s(name.substr(0, 200));
  return absl::StrCat("\"", s, name.size() > 200 ? "...\"" : "\"");
}

// Top-level keys of a header, read by a SAX pass (linear; the callback form of the DOM parser
// rescans each object's parent when the object ends: quadratic in the tensor count). Counts them
// and notes the first one given twice (HF rejects duplicates, so do we).
struct TopLevelKeys : nlohmann::json_sax<nlohmann::json> {
  int depth = 0;
  uint64_t count = 0;
  std::set<std::string> seen;
  std::string duplicate;
  bool null() override { return true; }
  bool boolean(bool) override { return true; }
  bool number_integer(number_integer_t) override { return true; }
  bool number_unsigned(number_unsigned_t) override { return true; }
  bool number_float(number_float_t, const string_t&) override { return true; }
  bool string(string_t&) override { return true; }
  bool binary(binary_t&) override { return true; }
  bool start_object(std::size_t) override { return ++depth, true; }
  bool end_object() override { return --depth, true; }
  bool start_array(std::size_t) override { return ++depth, true; }
  bool end_array() override { return --depth, true; }
  bool key(string_t& k) override {
    if (depth != 1) return true;
    ++count;
    if (!seen.insert(k).second && duplicate.empty()) duplicate = k;
    return count <= kMaxHeaderEntries;  // stop reading a header past the limit
  }
  bool parse_error(std::size_t, const std::string&, const nlohmann::detail::exception&) override { return false; }
};

// A non-negative integer JSON value as uint64, or false.
bool AsU64(const nlohmann::json& j, uint64_t* out) {
  if (j.is_number_unsigned()) {
    *out = j.get<uint64_t>();
    return true;
  }
  if (j.is_number_integer()) {
    int64_t v = j.get<int64_t>();
    if (v < 0) return false;
    *out = static_cast<uint64_t>(v);
    return true;
  }
  return false;
}

absl::StatusOr<TensorInfo> ParseEntry(const std::string& name, const nlohmann::json& entry,
                                      absl::string_view path) {
  auto bad = [&](const std::string& what) {
    return absl::InvalidArgumentError(absl::StrCat(path, ": tensor ", Quote(name), ": ", what));
  };
  if (!entry.is_object()) return bad(absl::StrCat("entry must be an object, got ", Excerpt(entry)));
  TensorInfo t;
  t.name = name;

  auto dt = entry.find("dtype");
  if (dt == entry.end() || !dt->is_string()) return bad("missing string \"dtype\"");
  absl::StatusOr<Dtype> dtype = ParseDtype(dt->get_ref<const std::string&>());
  if (!dtype.ok()) return bad(std::string(dtype.status().message()));
  t.dtype = *dtype;

  auto sh = entry.find("shape");
  if (sh == entry.end() || !sh->is_array()) return bad("missing array \"shape\"");
  uint64_t numel = 1;
  for (const nlohmann::json& d : *sh) {
    uint64_t dim;
    if (!AsU64(d, &dim) || dim > static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) {
      return bad(absl::StrCat("shape ", Excerpt(*sh), " must hold non-negative integers"));
    }
    t.shape.push_back(static_cast<int64_t>(dim));
    if (__builtin_mul_overflow(numel, dim, &numel)) {
      return bad(absl::StrCat("shape ", Excerpt(*sh), " overflows 64 bits"));
    }
  }
  uint64_t nbytes;
  if (numel > static_cast<uint64_t>(std::numeric_limits<int64_t>::max()) ||
      __builtin_mul_overflow(numel, DtypeSize(t.dtype), &nbytes)) {
    return bad(absl::StrCat("shape ", Excerpt(*sh), " overflows 64 bits"));
  }
  t.numel = static_cast<int64_t>(numel);

  auto off = entry.find("data_offsets");
  if (off == entry.end() || !off->is_array() || off->size() != 2 || !AsU64((*off)[0], &t.data_begin) ||
      !AsU64((*off)[1], &t.data_end)) {
    return bad("\"data_offsets\" must be [begin, end] with non-negative integers");
  }
  if (t.data_end < t.data_begin) {
    return bad(absl::StrCat("data_offsets [", t.data_begin, ", ", t.data_end, "] end before begin"));
  }
  if (t.data_end - t.data_begin != nbytes) {
    return bad(absl::StrCat("data_offsets [", t.data_begin, ", ", t.data_end, "] span ", t.data_end - t.data_begin,
                            " bytes but ", DtypeName(t.dtype), " shape ", Excerpt(*sh), " needs ", nbytes));
  }
  return t;
}

absl::Status WriteAll(int fd, const char* p, size_t n, uint64_t offset, const std::string& path,
                      uint64_t file_bytes) {
  while (n > 0) {
    ssize_t w = ::pwrite(fd, p, n, static_cast<off_t>(offset));
    if (w < 0) {
      if (errno == EINTR) continue;
      int err = errno;
      if (err == ENOSPC || err == EDQUOT) {
        struct statvfs vfs {};
        uint64_t free_bytes = ::fstatvfs(fd, &vfs) == 0 ? uint64_t{vfs.f_bavail} * vfs.f_frsize : 0;
        return absl::ResourceExhaustedError(
            absl::StrCat("writing ", path, ": no space left on device at offset ", offset, " of ", file_bytes,
                         " bytes (", free_bytes, " bytes free on its file system)"));
      }
      return ErrnoStatus(absl::StrCat("pwrite ", path, " at offset ", offset), err);
    }
    if (w == 0) return absl::InternalError(absl::StrCat("pwrite ", path, " wrote 0 bytes at offset ", offset));
    p += w;
    n -= static_cast<size_t>(w);
    offset += static_cast<uint64_t>(w);
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<Dtype> ParseDtype(absl::string_view name) {
  for (const DtypeEntry& e : kDtypes) {
    if (name == e.name) return e.dtype;
  }
  return absl::InvalidArgumentError(absl::StrCat("unknown dtype ", Quote(name)));
}

const char* DtypeName(Dtype dtype) {
  for (const DtypeEntry& e : kDtypes) {
    if (e.dtype == dtype) return e.name;
  }
  return "?";
}

size_t DtypeSize(Dtype dtype) {
  for (const DtypeEntry& e : kDtypes) {
    if (e.dtype == dtype) return e.size;
  }
  return 0;
}

absl::StatusOr<Header> ParseHeader(absl::string_view file, absl::string_view path) {
  if (file.size() < 8) {
    return absl::DataLossError(
        absl::StrCat(path, ": file is ", file.size(), " bytes, too short for the 8-byte header length"));
  }
  uint64_t header_len = 0;
  for (int i = 7; i >= 0; --i) header_len = header_len << 8 | static_cast<uint8_t>(file[i]);
  if (header_len > kMaxHeaderBytes) {
    return absl::InvalidArgumentError(absl::StrCat(path, ": header length ", header_len, " exceeds the limit of ",
                                                   kMaxHeaderBytes, " bytes (not a safetensors file?)"));
  }
  if (header_len > file.size() - 8) {
    return absl::DataLossError(absl::StrCat(path, ": header length ", header_len, " but the file has only ",
                                            file.size() - 8, " bytes after the length (truncated?)"));
  }
  absl::string_view text = file.substr(8, header_len);
  if (text.empty() || text[0] != '{') {
    return absl::InvalidArgumentError(absl::StrCat(path, ": header does not start with '{'"));
  }
  int depth = JsonNestingDepth(text, kMaxJsonDepth);
  if (depth < 0 || depth > kMaxJsonDepth) {
    return absl::InvalidArgumentError(absl::StrCat(path, ": header JSON is unbalanced or nested deeper than ",
                                                   kMaxJsonDepth));
  }
  // Duplicate top-level keys would silently keep the last one; HF rejects them, so do we.
  TopLevelKeys keys;
  const bool parsed = nlohmann::json::sax_parse(text.begin(), text.end(), &keys, nlohmann::json::input_format_t::json,
                                                /*strict=*/true);
  if (keys.count > kMaxHeaderEntries) {
    return absl::InvalidArgumentError(
        absl::StrCat(path, ": header holds more than ", kMaxHeaderEntries, " entries (not a checkpoint shard?)"));
  }
  if (!parsed) {
    return absl::InvalidArgumentError(absl::StrCat(path, ": header (", header_len, " bytes) is not a JSON object"));
  }
  if (!keys.duplicate.empty()) {
    return absl::InvalidArgumentError(absl::StrCat(path, ": header names ", Quote(keys.duplicate), " twice"));
  }
  nlohmann::json j = nlohmann::json::parse(text.begin(), text.end(), nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded() || !j.is_object()) {
    return absl::InvalidArgumentError(absl::StrCat(path, ": header (", header_len, " bytes) is not a JSON object"));
  }

  Header h;
  h.data_start = 8 + header_len;
  h.data_size = file.size() - h.data_start;
  for (auto it = j.begin(); it != j.end(); ++it) {
    if (it.key() == "__metadata__") {
      if (!it->is_object()) return absl::InvalidArgumentError(absl::StrCat(path, ": __metadata__ must be an object"));
      for (auto m = it->begin(); m != it->end(); ++m) {
        if (!m->is_string()) {
          return absl::InvalidArgumentError(
              absl::StrCat(path, ": __metadata__ value for ", Quote(m.key()), " must be a string, got ", Excerpt(*m)));
        }
        h.metadata[m.key()] = m->get<std::string>();
      }
      continue;
    }
    ASSIGN_OR_RETURN(TensorInfo t, ParseEntry(it.key(), *it, path));
    if (t.data_end > h.data_size) {
      return absl::DataLossError(absl::StrCat(path, ": tensor ", Quote(t.name), " ends at data offset ", t.data_end,
                                              " but the data area has only ", h.data_size, " bytes (truncated?)"));
    }
    h.tensors.push_back(std::move(t));
  }
  std::sort(h.tensors.begin(), h.tensors.end(), [](const TensorInfo& a, const TensorInfo& b) {
    return a.data_begin != b.data_begin ? a.data_begin < b.data_begin : a.data_end < b.data_end;
  });
  // Tensors must tile the data area exactly: no overlap, no gap, nothing after the last one.
  uint64_t covered = 0;
  const TensorInfo* prev = nullptr;
  for (const TensorInfo& t : h.tensors) {
    if (t.data_begin < covered) {
      return absl::InvalidArgumentError(absl::StrCat(path, ": tensor ", Quote(t.name), " [", t.data_begin, ", ",
                                                     t.data_end, ") overlaps tensor ", Quote(prev->name), " [",
                                                     prev->data_begin, ", ", prev->data_end, ")"));
    }
    if (t.data_begin > covered) {
      return absl::InvalidArgumentError(absl::StrCat(path, ": data bytes [", covered, ", ", t.data_begin,
                                                     ") belong to no tensor (before ", Quote(t.name), ")"));
    }
    covered = t.data_end;
    prev = &t;
  }
  if (covered != h.data_size) {
    return absl::InvalidArgumentError(absl::StrCat(path, ": data area has ", h.data_size, " bytes but tensors cover ",
                                                   covered, " (", h.data_size - covered, " trailing bytes)"));
  }
  return h;
}

absl::StatusOr<std::unique_ptr<SafetensorsFile>> SafetensorsFile::Open(const std::string& path) {
  // O_NONBLOCK: a FIFO named as a weights file must not block the opening thread (the check for
  // a regular file comes after the open).
  int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK | O_NOCTTY);
  if (fd < 0) return ErrnoStatus(absl::StrCat("open ", path), errno);
  struct stat st {};
  if (::fstat(fd, &st) != 0) {
    int err = errno;
    ::close(fd);
    return ErrnoStatus(absl::StrCat("fstat ", path), err);
  }
  if (!S_ISREG(st.st_mode)) {
    ::close(fd);
    return absl::InvalidArgumentError(absl::StrCat(path, ": not a regular file"));
  }
  std::unique_ptr<SafetensorsFile> f(new SafetensorsFile());
  f->path_ = path;
  f->size_ = static_cast<uint64_t>(st.st_size);
  if (f->size_ < 8) {
    ::close(fd);
    return absl::DataLossError(
        absl::StrCat(path, ": file is ", f->size_, " bytes, too short for the 8-byte header length"));
  }
  void* p = ::mmap(nullptr, f->size_, PROT_READ, MAP_PRIVATE, fd, 0);
  int err = errno;
  ::close(fd);
  if (p == MAP_FAILED) return ErrnoStatus(absl::StrCat("mmap ", path), err);
  f->base_ = static_cast<const char*>(p);
  ASSIGN_OR_RETURN(f->guard_, MappingGuard::Register(f->base_, f->size_, path));
  absl::StatusOr<Header> header = ParseHeader(absl::string_view(f->base_, f->size_), path);
  RETURN_IF_ERROR(f->Intact());  // shrank between the fstat and the parse: the header read zeros
  RETURN_IF_ERROR(header.status());
  f->header_ = *std::move(header);
  for (size_t i = 0; i < f->header_.tensors.size(); ++i) f->by_name_.emplace(f->header_.tensors[i].name, i);
  return f;
}

SafetensorsFile::~SafetensorsFile() {
  guard_ = MappingGuard();  // unguarded before the range is unmapped (and maybe mapped again)
  if (base_ != nullptr) ::munmap(const_cast<char*>(base_), size_);
}

const TensorInfo* SafetensorsFile::Find(absl::string_view name) const {
  auto it = by_name_.find(name);
  return it == by_name_.end() ? nullptr : &header_.tensors[it->second];
}

absl::string_view SafetensorsFile::Bytes(const TensorInfo& t) const {
  return absl::string_view(base_ + header_.data_start + t.data_begin, t.byte_size());
}

absl::Status ConvertToFloat32(Dtype dtype, const void* src, int64_t n, float* out) {
  const char* s = static_cast<const char*>(src);
  switch (dtype) {
    case Dtype::kF32:
      std::memcpy(out, s, static_cast<size_t>(n) * 4);
      return absl::OkStatus();
    case Dtype::kBF16:
      for (int64_t i = 0; i < n; ++i) {
        uint16_t v;
        std::memcpy(&v, s + 2 * i, 2);
        out[i] = Bf16ToFloat(v);
      }
      return absl::OkStatus();
    case Dtype::kF16:
      for (int64_t i = 0; i < n; ++i) {
        uint16_t v;
        std::memcpy(&v, s + 2 * i, 2);
        out[i] = Fp16ToFloat(v);
      }
      return absl::OkStatus();
    default:
      return absl::UnimplementedError(
          absl::StrCat("dtype ", DtypeName(dtype), " cannot be loaded (supported: BF16, F16, F32)"));
  }
}

absl::Status SafetensorsFile::ReadAsFloat32(const TensorInfo& t, float* out) const {
  absl::Status s = ConvertToFloat32(t.dtype, Bytes(t).data(), t.numel, out);
  if (!s.ok()) return Annotate(s, absl::StrCat(path_, ": tensor ", Quote(t.name)));
  return Intact();
}

uint64_t TensorSource::byte_size() const {
  uint64_t n = DtypeSize(dtype);
  for (int64_t d : shape) n *= static_cast<uint64_t>(d);
  return n;
}

absl::StatusOr<std::string> SerializeHeader(const std::vector<TensorSource>& tensors,
                                            const std::map<std::string, std::string>& metadata,
                                            std::vector<uint64_t>* data_offsets) {
  nlohmann::ordered_json j = nlohmann::ordered_json::object();
  if (!metadata.empty()) {
    nlohmann::ordered_json m = nlohmann::ordered_json::object();
    for (const auto& [k, v] : metadata) m[k] = v;
    j["__metadata__"] = std::move(m);
  }
  std::set<std::string> names;
  uint64_t offset = 0;
  data_offsets->clear();
  for (const TensorSource& t : tensors) {
    if (t.name == "__metadata__" || !names.insert(t.name).second) {
      return absl::InvalidArgumentError(absl::StrCat("safetensors writer: duplicate or reserved tensor name ",
                                                     Quote(t.name)));
    }
    if ((t.data == nullptr) == !t.fill) {
      return absl::InvalidArgumentError(
          absl::StrCat("safetensors writer: tensor ", Quote(t.name), " needs exactly one of data or fill"));
    }
    uint64_t numel = 1;
    for (int64_t d : t.shape) {
      if (d < 0 || __builtin_mul_overflow(numel, static_cast<uint64_t>(d), &numel)) {
        return absl::InvalidArgumentError(absl::StrCat("safetensors writer: tensor ", Quote(t.name), " has a bad shape"));
      }
    }
    uint64_t bytes = t.byte_size();
    data_offsets->push_back(offset);
    j[t.name] = {{"dtype", DtypeName(t.dtype)}, {"shape", t.shape}, {"data_offsets", {offset, offset + bytes}}};
    offset += bytes;
  }
  std::string text = j.dump();
  text.append((8 - text.size() % 8) % 8, ' ');  // data area starts 8-byte aligned
  std::string out(8, '\0');
  uint64_t n = text.size();
  for (int i = 0; i < 8; ++i) out[i] = static_cast<char>(n >> (8 * i) & 0xff);
  out += text;
  return out;
}

absl::StatusOr<WriteStats> WriteFile(const std::string& path, const std::vector<TensorSource>& tensors,
                                     const WriteOptions& options) {
  auto t0 = std::chrono::steady_clock::now();
  std::vector<uint64_t> offsets;
  ASSIGN_OR_RETURN(std::string header, SerializeHeader(tensors, options.metadata, &offsets));
  uint64_t data_bytes = 0;
  for (const TensorSource& t : tensors) data_bytes += t.byte_size();
  const uint64_t file_bytes = header.size() + data_bytes;

  const bool existing = options.into_existing;
  int fd = existing ? ::open(path.c_str(), O_RDWR | O_CLOEXEC | O_NOFOLLOW)
                    : ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) return ErrnoStatus(absl::StrCat(existing ? "open " : "create ", path), errno);
  struct stat st {};
  const bool regular = ::fstat(fd, &st) == 0 && S_ISREG(st.st_mode);
  auto fail = [&](absl::Status s) -> absl::Status {
    ::close(fd);
    if (regular && !existing) ::unlink(path.c_str());  // a partial file must not survive
    return s;
  };
  if (existing) {  // the creator's file: the same header, the same size
    if (!regular || static_cast<uint64_t>(st.st_size) != file_bytes) {
      return fail(absl::FailedPreconditionError(absl::StrCat(path, ": not the file this write expects (",
                                                             regular ? absl::StrCat(st.st_size, " bytes, ") : "",
                                                             file_bytes, " bytes planned)")));
    }
    std::string theirs(header.size(), '\0');
    if (::pread(fd, theirs.data(), theirs.size(), 0) != static_cast<ssize_t>(theirs.size()) || theirs != header) {
      return fail(absl::FailedPreconditionError(absl::StrCat(path, ": its header differs from this write's")));
    }
  }

  // Reserve every block now: a full disk fails here, before any byte is written.
  if (!existing && regular && file_bytes > 0 && ::fallocate(fd, 0, 0, static_cast<off_t>(file_bytes)) != 0) {
    int err = errno;
    if (err == ENOSPC || err == EDQUOT) {
      struct statvfs vfs {};
      uint64_t free_bytes = ::fstatvfs(fd, &vfs) == 0 ? uint64_t{vfs.f_bavail} * vfs.f_frsize : 0;
      return fail(absl::ResourceExhaustedError(absl::StrCat("writing ", path, ": no space left on device: the file needs ",
                                                            file_bytes, " bytes, its file system has ", free_bytes,
                                                            " bytes free")));
    }
    if (err != EOPNOTSUPP && err != ENOSYS) return fail(ErrnoStatus(absl::StrCat("fallocate ", path), err));
  }
  if (!existing) {
    absl::Status hs = WriteAll(fd, header.data(), header.size(), 0, path, file_bytes);
    if (!hs.ok()) return fail(hs);
  }

  struct Chunk {
    size_t tensor;
    uint64_t begin, len;
  };
  const uint64_t chunk = std::max<uint64_t>(8, options.chunk_bytes / 8 * 8);
  std::vector<Chunk> chunks;
  for (size_t i = 0; i < tensors.size(); ++i) {
    const uint64_t n = tensors[i].byte_size();
    if (!tensors[i].only) {
      for (uint64_t b = 0; b < n; b += chunk) chunks.push_back({i, b, std::min(chunk, n - b)});
      continue;
    }
    for (const auto& [begin, end] : *tensors[i].only) {
      if (begin > end || end > n) {
        return fail(absl::InvalidArgumentError(absl::StrCat(path, ": tensor ", tensors[i].name, " range [", begin, ", ",
                                                            end, ") outside its ", n, " bytes")));
      }
      for (uint64_t b = begin; b < end; b += chunk) chunks.push_back({i, b, std::min(chunk, end - b)});
    }
  }
  std::atomic<size_t> next{0};
  std::atomic<bool> failed{false};
  std::mutex mu;
  absl::Status first_error;
  auto worker = [&] {
    std::unique_ptr<char[]> buf;
    for (size_t c = next++; c < chunks.size() && !failed.load(); c = next++) {
      const Chunk& ch = chunks[c];
      const TensorSource& t = tensors[ch.tensor];
      const char* src;
      if (t.data != nullptr) {
        src = static_cast<const char*>(t.data) + ch.begin;
      } else {
        if (!buf) buf.reset(new char[chunk]);
        t.fill(ch.begin, ch.len, buf.get());
        src = buf.get();
      }
      absl::Status s = WriteAll(fd, src, ch.len, header.size() + offsets[ch.tensor] + ch.begin, path, file_bytes);
      if (!s.ok()) {
        std::lock_guard<std::mutex> lock(mu);
        if (first_error.ok()) first_error = s;
        failed = true;
      }
    }
  };
  const int nthreads =
      static_cast<int>(std::min<size_t>(static_cast<size_t>(std::max(1, options.threads)), std::max<size_t>(chunks.size(), 1)));
  std::vector<std::thread> pool;
  for (int i = 1; i < nthreads; ++i) pool.emplace_back(worker);
  worker();
  for (std::thread& th : pool) th.join();
  if (!first_error.ok()) return fail(first_error);

  if (options.durability == Durability::kFsync && regular && ::fsync(fd) != 0) {
    return fail(ErrnoStatus(absl::StrCat("fsync ", path), errno));
  }
  if (::close(fd) != 0) {
    int err = errno;
    if (regular && !existing) ::unlink(path.c_str());
    return ErrnoStatus(absl::StrCat("close ", path), err);
  }
  WriteStats stats;
  stats.file_bytes = file_bytes;
  stats.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return stats;
}

absl::StatusOr<bool> ModelDirHasTensor(const std::string& dir, const std::function<bool(absl::string_view)>& matches) {
  std::error_code ec;
  if (std::filesystem::exists(dir + "/model.safetensors", ec)) {
    ASSIGN_OR_RETURN(auto f, SafetensorsFile::Open(dir + "/model.safetensors"));
    for (const TensorInfo& t : f->tensors()) {
      if (matches(t.name)) return true;
    }
    return false;
  }
  const std::string index_path = dir + "/model.safetensors.index.json";
  if (!std::filesystem::exists(index_path, ec)) return false;
  ASSIGN_OR_RETURN(std::string text, ReadSmallFile(index_path, kMaxManifestFileBytes, "safetensors index"));
  RETURN_IF_ERROR(CheckJsonDepth(text, index_path));
  nlohmann::json index = nlohmann::json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (index.is_discarded() || !index.is_object() || !index.contains("weight_map") || !index["weight_map"].is_object()) {
    return absl::InvalidArgumentError(absl::StrCat(index_path, ": not a JSON object with a \"weight_map\" object"));
  }
  for (auto it = index["weight_map"].begin(); it != index["weight_map"].end(); ++it) {
    if (matches(it.key())) return true;
  }
  return false;
}

}  // namespace slidedp::safetensors
