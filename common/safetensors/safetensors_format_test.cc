// safetensors writer/reader round trips and the validator's answers to lying or broken headers.
#include "common/safetensors/safetensors.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <random>
#include <sstream>

#include "common/numeric/bf16.h"
#include "gtest/gtest.h"

namespace slidedp::safetensors {
namespace {

namespace fs = std::filesystem;

class SafetensorsFormatTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::temp_directory_path() / ("safetensors_format_test." + std::to_string(::getpid()));
    fs::create_directories(dir_);
  }
  void TearDown() override { fs::remove_all(dir_); }
  std::string Path(const std::string& name) { return (dir_ / name).string(); }

  // Writes a raw file: 8-byte length, header text, data bytes.
  std::string WriteRaw(const std::string& name, const std::string& header, const std::string& data,
                       int64_t length_override = -1) {
    std::string bytes(8, '\0');
    uint64_t n = length_override >= 0 ? static_cast<uint64_t>(length_override) : header.size();
    for (int i = 0; i < 8; ++i) bytes[i] = static_cast<char>(n >> (8 * i));
    bytes += header;
    bytes += data;
    std::ofstream(Path(name), std::ios::binary) << bytes;
    return Path(name);
  }

  fs::path dir_;
};

TEST_F(SafetensorsFormatTest, RoundTripAllSupportedDtypes) {
  std::vector<float> f32 = {1.5f, -2.25f, 3.0e-8f, 65504.0f, -0.0f, 7.0f};
  std::vector<uint16_t> bf16;
  for (float f : f32) bf16.push_back(FloatToBf16(f));
  // F16 bits for 1.0, -2.0, 0.5, 65504 (max), smallest subnormal, -0.
  std::vector<uint16_t> f16 = {0x3c00, 0xc000, 0x3800, 0x7bff, 0x0001, 0x8000};
  std::vector<TensorSource> src(3);
  src[0] = {"a.f32", Dtype::kF32, {2, 3}, f32.data(), nullptr};
  src[1] = {"b.bf16", Dtype::kBF16, {6}, bf16.data(), nullptr};
  src[2] = {"c.f16", Dtype::kF16, {3, 2}, f16.data(), nullptr};
  WriteOptions opts;
  opts.metadata = {{"format", "pt"}};
  auto stats = WriteFile(Path("x.safetensors"), src, opts);
  ASSERT_TRUE(stats.ok()) << stats.status();

  auto file = SafetensorsFile::Open(Path("x.safetensors"));
  ASSERT_TRUE(file.ok()) << file.status();
  EXPECT_EQ((*file)->file_size(), stats->file_bytes);
  EXPECT_EQ((*file)->metadata().at("format"), "pt");
  ASSERT_EQ((*file)->tensors().size(), 3u);

  const TensorInfo* a = (*file)->Find("a.f32");
  ASSERT_NE(a, nullptr);
  EXPECT_EQ(a->shape, (std::vector<int64_t>{2, 3}));
  std::vector<float> out(6);
  ASSERT_TRUE((*file)->ReadAsFloat32(*a, out.data()).ok());
  EXPECT_EQ(0, std::memcmp(out.data(), f32.data(), 24));

  ASSERT_TRUE((*file)->ReadAsFloat32(*(*file)->Find("b.bf16"), out.data()).ok());
  for (int i = 0; i < 6; ++i) EXPECT_EQ(out[i], Bf16ToFloat(FloatToBf16(f32[i])));

  ASSERT_TRUE((*file)->ReadAsFloat32(*(*file)->Find("c.f16"), out.data()).ok());
  EXPECT_EQ(out[0], 1.0f);
  EXPECT_EQ(out[1], -2.0f);
  EXPECT_EQ(out[2], 0.5f);
  EXPECT_EQ(out[3], 65504.0f);
  EXPECT_EQ(out[4], std::ldexp(1.0f, -24));
  EXPECT_TRUE(std::signbit(out[5]) && out[5] == 0.0f);
  EXPECT_EQ((*file)->Find("missing"), nullptr);
}

TEST_F(SafetensorsFormatTest, HeaderIsPaddedSoDataIsEightByteAligned) {
  std::vector<uint8_t> one = {7};
  for (int name_len = 1; name_len < 12; ++name_len) {
    std::vector<TensorSource> src = {{std::string(name_len, 'n'), Dtype::kU8, {1}, one.data(), nullptr}};
    std::vector<uint64_t> offsets;
    auto header = SerializeHeader(src, {}, &offsets);
    ASSERT_TRUE(header.ok());
    EXPECT_EQ(header->size() % 8, 0u) << name_len;
    EXPECT_EQ(header->back() == ' ' || header->back() == '}', true);
  }
}

TEST_F(SafetensorsFormatTest, FillCallbackAndThreadCountGiveIdenticalFiles) {
  // 3 MiB of F32 produced by a fill callback in 64 KiB chunks, written with 1 and 5 threads.
  const int64_t n = 3 << 18;
  auto fill = [](uint64_t off, size_t len, char* dst) {
    for (size_t i = 0; i < len; i += 4) {
      float v = static_cast<float>((off + i) / 4) * 0.5f;
      std::memcpy(dst + i, &v, 4);
    }
  };
  std::vector<uint16_t> tail = {1, 2, 3};
  std::vector<TensorSource> src = {{"big", Dtype::kF32, {n}, nullptr, fill},
                                   {"tail", Dtype::kI16, {3}, tail.data(), nullptr}};
  WriteOptions opts;
  opts.chunk_bytes = 64 << 10;
  opts.threads = 1;
  ASSERT_TRUE(WriteFile(Path("t1.safetensors"), src, opts).ok());
  opts.threads = 5;
  ASSERT_TRUE(WriteFile(Path("t5.safetensors"), src, opts).ok());
  std::ifstream f1(Path("t1.safetensors"), std::ios::binary), f5(Path("t5.safetensors"), std::ios::binary);
  std::stringstream s1, s5;
  s1 << f1.rdbuf();
  s5 << f5.rdbuf();
  ASSERT_EQ(s1.str(), s5.str());

  auto file = SafetensorsFile::Open(Path("t5.safetensors"));
  ASSERT_TRUE(file.ok()) << file.status();
  std::vector<float> out(n);
  ASSERT_TRUE((*file)->ReadAsFloat32(*(*file)->Find("big"), out.data()).ok());
  for (int64_t i = 0; i < n; i += 9973) ASSERT_EQ(out[i], static_cast<float>(i) * 0.5f);
  EXPECT_EQ(out[n - 1], static_cast<float>(n - 1) * 0.5f);
  auto unsupported = (*file)->ReadAsFloat32(*(*file)->Find("tail"), out.data());
  EXPECT_EQ(unsupported.code(), absl::StatusCode::kUnimplemented) << unsupported;
  EXPECT_NE(unsupported.message().find("I16"), std::string::npos) << unsupported;
}

// Several writers filling one file (a sharded state's nodes, TensorSource::only + into_existing): the
// creator makes it with no data, each writer its byte ranges; the result is the single writer's file.
TEST_F(SafetensorsFormatTest, WritersOfDisjointRangesMakeTheSingleWritersFile) {
  std::vector<float> a(1000), b(37);
  for (size_t i = 0; i < a.size(); ++i) a[i] = 0.25f * static_cast<float>(i) - 3.0f;
  for (size_t i = 0; i < b.size(); ++i) b[i] = -1.0f * static_cast<float>(i);
  const std::vector<TensorSource> whole = {{"a", Dtype::kF32, {1000}, a.data(), nullptr},
                                           {"b", Dtype::kF32, {37}, b.data(), nullptr}};
  WriteOptions opts;
  opts.metadata = {{"format", "pt"}};
  ASSERT_TRUE(WriteFile(Path("one.safetensors"), whole, opts).ok());
  auto with = [&](std::vector<std::vector<std::pair<uint64_t, uint64_t>>> only) {
    std::vector<TensorSource> t = whole;
    for (size_t i = 0; i < t.size(); ++i) t[i].only = only[i];
    return t;
  };
  ASSERT_TRUE(WriteFile(Path("many.safetensors"), with({{}, {}}), opts).ok());  // the creator: no data
  WriteOptions into = opts;
  into.into_existing = true;
  ASSERT_TRUE(WriteFile(Path("many.safetensors"), with({{{0, 1600}}, {{0, 20}}}), into).ok());
  ASSERT_TRUE(WriteFile(Path("many.safetensors"), with({{{1600, 4000}}, {{20, 148}}}), into).ok());
  std::ifstream f1(Path("one.safetensors"), std::ios::binary), f2(Path("many.safetensors"), std::ios::binary);
  std::stringstream s1, s2;
  s1 << f1.rdbuf();
  s2 << f2.rdbuf();
  EXPECT_EQ(s1.str(), s2.str());
  // Another header (a different tensor set), a missing file, a range outside a tensor: refused, and the
  // creator's file is left as it was.
  const std::vector<TensorSource> other = {{"a", Dtype::kF32, {999}, a.data(), nullptr}};
  EXPECT_EQ(WriteFile(Path("many.safetensors"), other, into).status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_FALSE(WriteFile(Path("absent.safetensors"), whole, into).ok());
  EXPECT_FALSE(fs::exists(Path("absent.safetensors")));
  EXPECT_EQ(WriteFile(Path("many.safetensors"), with({{{0, 4004}}, {}}), into).status().code(),
            absl::StatusCode::kInvalidArgument);
  std::ifstream f3(Path("many.safetensors"), std::ios::binary);
  std::stringstream s3;
  s3 << f3.rdbuf();
  EXPECT_EQ(s1.str(), s3.str());
}

TEST_F(SafetensorsFormatTest, EmptyAndZeroSizedTensorsAreValid) {
  std::vector<TensorSource> none;
  ASSERT_TRUE(WriteFile(Path("empty.safetensors"), none).ok());
  auto f = SafetensorsFile::Open(Path("empty.safetensors"));
  ASSERT_TRUE(f.ok()) << f.status();
  EXPECT_TRUE((*f)->tensors().empty());

  std::vector<float> one = {1.0f};
  std::vector<TensorSource> src = {{"zero", Dtype::kF32, {0, 5}, one.data(), nullptr},
                                   {"scalar", Dtype::kF32, {}, one.data(), nullptr}};
  ASSERT_TRUE(WriteFile(Path("zero.safetensors"), src).ok());
  f = SafetensorsFile::Open(Path("zero.safetensors"));
  ASSERT_TRUE(f.ok()) << f.status();
  EXPECT_EQ((*f)->Find("zero")->numel, 0);
  EXPECT_EQ((*f)->Find("scalar")->numel, 1);
}

TEST_F(SafetensorsFormatTest, WriterRejectsDuplicateNamesAndMissingSource) {
  std::vector<float> v = {1};
  std::vector<TensorSource> dup = {{"a", Dtype::kF32, {1}, v.data(), nullptr}, {"a", Dtype::kF32, {1}, v.data(), nullptr}};
  EXPECT_EQ(WriteFile(Path("d.safetensors"), dup).status().code(), absl::StatusCode::kInvalidArgument);
  std::vector<TensorSource> nosrc = {{"a", Dtype::kF32, {1}, nullptr, nullptr}};
  EXPECT_EQ(WriteFile(Path("d.safetensors"), nosrc).status().code(), absl::StatusCode::kInvalidArgument);
}

TEST_F(SafetensorsFormatTest, DiskFullIsResourceExhausted) {
  // /dev/full answers every write with ENOSPC; a symlink keeps the writer's cleanup away from it.
  if (::access("/dev/full", W_OK) != 0) GTEST_SKIP() << "/dev/full not writable here";
  fs::create_symlink("/dev/full", dir_ / "full.safetensors");
  std::vector<float> v(1000, 1.0f);
  std::vector<TensorSource> src = {{"a", Dtype::kF32, {1000}, v.data(), nullptr}};
  auto s = WriteFile(Path("full.safetensors"), src);
  ASSERT_EQ(s.status().code(), absl::StatusCode::kResourceExhausted) << s.status();
  EXPECT_NE(s.status().message().find("full.safetensors"), std::string::npos);
  EXPECT_NE(s.status().message().find("no space"), std::string::npos);
}

struct BadCase {
  const char* label;
  std::string header;
  std::string data;
  absl::StatusCode code;
  const char* needle;  // must appear in the message
  int64_t length_override = -1;
};

TEST_F(SafetensorsFormatTest, LyingAndBrokenHeadersAreRejectedWithTheRightCode) {
  using C = absl::StatusCode;
  const std::string d8(8, 'x');
  std::vector<BadCase> cases = {
      {"not json", "{abc", d8, C::kInvalidArgument, "not a JSON object"},
      {"not object", "[1,2]", "", C::kInvalidArgument, "does not start with '{'"},
      {"unknown dtype", R"({"t":{"dtype":"Q7","shape":[2],"data_offsets":[0,8]}})", d8, C::kInvalidArgument, "Q7"},
      {"missing dtype", R"({"t":{"shape":[2],"data_offsets":[0,8]}})", d8, C::kInvalidArgument, "dtype"},
      {"negative dim", R"({"t":{"dtype":"F32","shape":[-2],"data_offsets":[0,8]}})", d8, C::kInvalidArgument, "non-negative"},
      {"float dim", R"({"t":{"dtype":"F32","shape":[2.0],"data_offsets":[0,8]}})", d8, C::kInvalidArgument, "non-negative"},
      {"size lie", R"({"t":{"dtype":"F32","shape":[3],"data_offsets":[0,8]}})", d8, C::kInvalidArgument, "needs 12"},
      {"end before begin", R"({"t":{"dtype":"U8","shape":[0],"data_offsets":[8,0]}})", d8, C::kInvalidArgument, "end before begin"},
      {"overflow", R"({"t":{"dtype":"F32","shape":[4294967296,4294967296],"data_offsets":[0,8]}})", d8, C::kInvalidArgument, "overflows"},
      {"offsets arity", R"({"t":{"dtype":"F32","shape":[2],"data_offsets":[0]}})", d8, C::kInvalidArgument, "data_offsets"},
      {"past end", R"({"t":{"dtype":"F32","shape":[4],"data_offsets":[0,16]}})", d8, C::kDataLoss, "truncated"},
      {"overlap", R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},"b":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}})", d8, C::kInvalidArgument, "overlaps"},
      {"gap", R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}})", d8, C::kInvalidArgument, "belong to no tensor"},
      {"trailing", R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}})", d8, C::kInvalidArgument, "trailing"},
      {"duplicate", R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},"a":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}})", d8, C::kInvalidArgument, "twice"},
      {"metadata type", R"({"__metadata__":{"k":1}})", "", C::kInvalidArgument, "must be a string"},
      {"deep nesting", "{\"a\":" + std::string(5000, '[') + std::string(5000, ']') + "}", "", C::kInvalidArgument, "nested"},
      {"length beyond file", R"({})", "", C::kDataLoss, "truncated", 1000},
      {"length absurd", R"({})", "", C::kInvalidArgument, "exceeds the limit", int64_t{1} << 40},
      {"empty header", "", "", C::kInvalidArgument, "does not start"},
  };
  for (const BadCase& c : cases) {
    std::string path = WriteRaw("bad.safetensors", c.header, c.data, c.length_override);
    auto f = SafetensorsFile::Open(path);
    ASSERT_FALSE(f.ok()) << c.label;
    EXPECT_EQ(f.status().code(), c.code) << c.label << ": " << f.status();
    EXPECT_NE(f.status().message().find(c.needle), std::string::npos) << c.label << ": " << f.status();
    EXPECT_NE(f.status().message().find("bad.safetensors"), std::string::npos) << c.label << ": " << f.status();
  }
  // Files shorter than the length prefix.
  std::ofstream(Path("short.safetensors"), std::ios::binary) << "abc";
  EXPECT_EQ(SafetensorsFile::Open(Path("short.safetensors")).status().code(), absl::StatusCode::kDataLoss);
  EXPECT_EQ(SafetensorsFile::Open(Path("nope.safetensors")).status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(SafetensorsFile::Open(dir_.string()).status().code(), absl::StatusCode::kInvalidArgument);
}

TEST_F(SafetensorsFormatTest, TruncatedValidFileIsDataLoss) {
  std::vector<float> v(64, 2.0f);
  std::vector<TensorSource> src = {{"a", Dtype::kF32, {64}, v.data(), nullptr}};
  ASSERT_TRUE(WriteFile(Path("v.safetensors"), src).ok());
  uint64_t size = fs::file_size(Path("v.safetensors"));
  ASSERT_EQ(::truncate(Path("v.safetensors").c_str(), static_cast<off_t>(size - 1)), 0);
  auto f = SafetensorsFile::Open(Path("v.safetensors"));
  EXPECT_EQ(f.status().code(), absl::StatusCode::kDataLoss) << f.status();
  EXPECT_NE(f.status().message().find("\"a\""), std::string::npos) << f.status();
}


// A file truncated after Open checked it (a client rewriting its model while hostd loads it): the
// reads past the new end get zeros instead of SIGBUS, and the file answers DATA_LOSS from then on.
TEST_F(SafetensorsFormatTest, FileTruncatedWhileMappedIsDataLossNotSigbus) {
  const size_t page = static_cast<size_t>(::sysconf(_SC_PAGESIZE));
  std::vector<float> v(4 * page / sizeof(float), 3.0f);  // several pages of data
  std::vector<TensorSource> src = {{"big", Dtype::kF32, {static_cast<int64_t>(v.size())}, v.data(), nullptr}};
  ASSERT_TRUE(WriteFile(Path("t.safetensors"), src).ok());
  auto f = SafetensorsFile::Open(Path("t.safetensors"));
  ASSERT_TRUE(f.ok()) << f.status();
  ASSERT_TRUE((*f)->Intact().ok());
  ASSERT_EQ(::truncate(Path("t.safetensors").c_str(), static_cast<off_t>(page)), 0);
  std::vector<float> out(v.size(), -1.0f);
  absl::Status s = (*f)->ReadAsFloat32(*(*f)->Find("big"), out.data());
  EXPECT_EQ(s.code(), absl::StatusCode::kDataLoss) << s;
  EXPECT_NE(s.message().find("t.safetensors"), std::string::npos) << s;
  EXPECT_EQ(out.back(), 0.0f);  // past the new end: a page of zeros
  EXPECT_EQ((*f)->Intact().code(), absl::StatusCode::kDataLoss);

  // Another file opened after it is not marked by the first one's fault.
  ASSERT_TRUE(WriteFile(Path("u.safetensors"), src).ok());
  auto g = SafetensorsFile::Open(Path("u.safetensors"));
  ASSERT_TRUE(g.ok()) << g.status();
  EXPECT_TRUE((*g)->ReadAsFloat32(*(*g)->Find("big"), out.data()).ok());
  EXPECT_EQ(out.back(), 3.0f);
}

// A fault outside every guarded mapping still ends the process as SIGBUS would.
TEST_F(SafetensorsFormatTest, SigbusOutsideGuardedMappingsStillKills) {
  std::vector<float> v(16, 1.0f);
  std::vector<TensorSource> src = {{"x", Dtype::kF32, {16}, v.data(), nullptr}};
  ASSERT_TRUE(WriteFile(Path("g.safetensors"), src).ok());
  ASSERT_TRUE(SafetensorsFile::Open(Path("g.safetensors")).ok());  // the handler is installed
  const std::string raw = Path("raw.bin");
  std::ofstream(raw, std::ios::binary) << std::string(2 * ::sysconf(_SC_PAGESIZE), 'x');
  EXPECT_DEATH(
      {
        int fd = ::open(raw.c_str(), O_RDONLY);
        const size_t page = static_cast<size_t>(::sysconf(_SC_PAGESIZE));
        auto* p = static_cast<volatile const char*>(::mmap(nullptr, 2 * page, PROT_READ, MAP_PRIVATE, fd, 0));
        if (::ftruncate(::open(raw.c_str(), O_WRONLY), 0) != 0) std::abort();
        std::printf("%d\n", p[page]);
      },
      "");
}

}  // namespace
}  // namespace slidedp::safetensors
