// CRC-32C by a 256-entry table of the reflected polynomial; see crc32c.h.
#include "common/tensorboard/crc32c.h"

#include <array>

namespace slidedp::tensorboard {
namespace {

constexpr uint32_t kReflectedPolynomial = 0x82f63b78u;  // 0x1EDC6F41 bit-reversed

constexpr std::array<uint32_t, 256> MakeTable() {
  std::array<uint32_t, 256> table{};
  for (uint32_t i = 0; i < 256; ++i) {
    uint32_t c = i;
    for (int k = 0; k < 8; ++k) c = (c & 1) ? (c >> 1) ^ kReflectedPolynomial : c >> 1;
    table[i] = c;
  }
  return table;
}

constexpr std::array<uint32_t, 256> kTable = MakeTable();

}  // namespace

uint32_t Crc32c(absl::string_view data) {
  uint32_t crc = 0xffffffffu;
  for (unsigned char b : data) crc = kTable[(crc ^ b) & 0xff] ^ (crc >> 8);
  return crc ^ 0xffffffffu;
}

}  // namespace slidedp::tensorboard
