// Fuzz-style test: random byte flips, truncations, extensions and header edits over valid files.
// Every mutant must parse to a header that tiles its data area or give an error; never crash or
// read out of bounds (run it under ASan to make the latter visible). Bounded and seeded.
#include <algorithm>
#include <cstring>
#include <random>
#include <string>

#include "common/safetensors/safetensors.h"
#include "gtest/gtest.h"

namespace slidedp::safetensors {
namespace {

// A valid file image built with the writer's own header serializer.
std::string ValidImage() {
  static std::vector<float> a(37, 1.25f);
  static std::vector<uint16_t> b(20, 0x3f80);
  static std::vector<uint16_t> c(6, 0x3c00);
  std::vector<TensorSource> src = {{"model.layers.0.weight", Dtype::kF32, {37}, a.data(), nullptr},
                                   {"model.embed", Dtype::kBF16, {4, 5}, b.data(), nullptr},
                                   {"h", Dtype::kF16, {2, 3}, c.data(), nullptr}};
  std::vector<uint64_t> offsets;
  std::string image = SerializeHeader(src, {{"format", "pt"}}, &offsets).value();
  image.append(reinterpret_cast<const char*>(a.data()), a.size() * 4);
  image.append(reinterpret_cast<const char*>(b.data()), b.size() * 2);
  image.append(reinterpret_cast<const char*>(c.data()), c.size() * 2);
  return image;
}

// Parses, and if accepted checks the invariants a loader relies on and touches every byte.
void CheckMutant(const std::string& bytes, int* accepted) {
  // Copy into an exactly sized heap buffer so ASan catches any read past the end.
  std::unique_ptr<char[]> exact(new char[bytes.size() + 1]);
  std::memcpy(exact.get(), bytes.data(), bytes.size());
  absl::string_view view(exact.get(), bytes.size());
  auto h = ParseHeader(view, "mutant");
  if (!h.ok()) {
    ASSERT_FALSE(h.status().message().empty());
    ASSERT_TRUE(h.status().code() == absl::StatusCode::kInvalidArgument ||
                h.status().code() == absl::StatusCode::kDataLoss)
        << h.status();
    return;
  }
  ++*accepted;
  uint64_t covered = 0;
  for (const TensorInfo& t : h->tensors) {
    ASSERT_LE(h->data_start + t.data_end, bytes.size());
    ASSERT_EQ(t.byte_size(), static_cast<uint64_t>(t.numel) * DtypeSize(t.dtype));
    covered += t.byte_size();
    if (t.numel <= (1 << 20)) {
      std::vector<float> out(static_cast<size_t>(t.numel));
      absl::Status s = ConvertToFloat32(t.dtype, view.data() + h->data_start + t.data_begin, t.numel, out.data());
      ASSERT_TRUE(s.ok() || s.code() == absl::StatusCode::kUnimplemented) << s;
    }
  }
  ASSERT_EQ(covered, h->data_size);
}

TEST(SafetensorsMutationTest, RandomByteFlipsTruncationsAndHeaderEdits) {
  const std::string valid = ValidImage();
  int accepted = 0;
  ASSERT_TRUE(ParseHeader(valid, "valid").ok());
  std::mt19937_64 rng(20261129);
  const uint64_t header_end = 8 + (static_cast<uint8_t>(valid[0]) | static_cast<uint8_t>(valid[1]) << 8);
  const char* tokens[] = {"{", "}", "[", "]", ",", ":", "\"", "-1", "0", "18446744073709551615", "1e3",
                          "\"BF16\"", "\"F64\"", "\"shape\"", "\"dtype\"", "\"data_offsets\"", "null", "\\u0000",
                          "9223372036854775807", "\"__metadata__\""};
  for (int iter = 0; iter < 20000; ++iter) {
    std::string m = valid;
    const int kind = static_cast<int>(rng() % 6);
    const int edits = 1 + static_cast<int>(rng() % 4);
    for (int e = 0; e < edits; ++e) {
      switch (kind) {
        case 0:  // flip a bit anywhere
          m[rng() % m.size()] ^= static_cast<char>(1 << (rng() % 8));
          break;
        case 1:  // flip a bit in the header (where it matters most)
          m[rng() % std::min<uint64_t>(header_end, m.size())] ^= static_cast<char>(1 << (rng() % 8));
          break;
        case 2:  // truncate
          m.resize(rng() % (m.size() + 1));
          break;
        case 3:  // append junk
          m.append(rng() % 17, static_cast<char>(rng()));
          break;
        case 4: {  // splice a JSON token into the header, keeping the length prefix consistent
          uint64_t hl = 0;
          if (m.size() < 8) break;
          for (int i = 7; i >= 0; --i) hl = hl << 8 | static_cast<uint8_t>(m[i]);
          if (hl == 0 || 8 + hl > m.size()) break;
          std::string tok = tokens[rng() % (sizeof(tokens) / sizeof(tokens[0]))];
          uint64_t at = 8 + rng() % hl;
          uint64_t erase = rng() % 4;
          erase = std::min<uint64_t>(erase, 8 + hl - at);
          m.replace(at, erase, tok);
          hl = hl - erase + tok.size();
          for (int i = 0; i < 8; ++i) m[i] = static_cast<char>(hl >> (8 * i));
          break;
        }
        default:  // rewrite the length prefix
          if (m.size() >= 8) {
            uint64_t hl = rng() % (m.size() + 16);
            if (rng() % 8 == 0) hl = rng();
            for (int i = 0; i < 8; ++i) m[i] = static_cast<char>(hl >> (8 * i));
          }
      }
    }
    ASSERT_NO_FATAL_FAILURE(CheckMutant(m, &accepted)) << "iteration " << iter << " kind " << kind;
  }
  // Some mutants (e.g. flips inside tensor data) must still parse, or the test isn't exercising
  // the accept path at all.
  EXPECT_GT(accepted, 100);
}

}  // namespace
}  // namespace slidedp::safetensors
