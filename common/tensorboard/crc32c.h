// CRC-32C (Castagnoli, RFC 3720) and TFRecord's masked form, for event file framing.
//
// A byte-at-a-time table: event records are a few hundred bytes per training step, so speed does
// not matter here. (abseil 20220623 has no absl/crc, and Debian 12 packages no crc32c library.)
#pragma once

#include <cstdint>

#include "absl/strings/string_view.h"

namespace slidedp::tensorboard {

// CRC-32C of `data`; Crc32c("123456789") == 0xE3069283 (RFC 3720 check value).
uint32_t Crc32c(absl::string_view data);

// TFRecord stores CRCs masked, so that the CRC of data holding CRCs stays well distributed
// (tensorflow/core/lib/hash/crc32c.h: rotate right by 15 bits, add a constant).
inline constexpr uint32_t kCrcMaskDelta = 0xa282ead8u;
inline constexpr uint32_t MaskCrc(uint32_t crc) { return ((crc >> 15) | (crc << 17)) + kCrcMaskDelta; }
inline constexpr uint32_t UnmaskCrc(uint32_t masked) {
  const uint32_t rot = masked - kCrcMaskDelta;
  return (rot >> 17) | (rot << 15);
}

}  // namespace slidedp::tensorboard
