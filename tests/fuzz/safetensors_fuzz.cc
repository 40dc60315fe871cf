// libFuzzer entry point for the safetensors header validator (built with -DSLIDEDP_FUZZ=ON under
// clang; see common/safetensors/CMakeLists.txt). Any input must yield a status or a header whose
// tensors all lie inside the input, never a crash or an out-of-bounds read.
#include <cstddef>
#include <cstdint>
#include <cstdlib>

#include "common/safetensors/safetensors.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  absl::string_view bytes(reinterpret_cast<const char*>(data), size);
  auto header = slidedp::safetensors::ParseHeader(bytes, "fuzz");
  if (!header.ok()) return 0;
  uint64_t covered = 0;
  for (const auto& t : header->tensors) {
    if (header->data_start + t.data_end > size) std::abort();
    covered += t.byte_size();
    // Touch the bytes the loader would read.
    if (t.dtype == slidedp::safetensors::Dtype::kBF16 && t.numel > 0 && t.numel < (1 << 16)) {
      static float out[1 << 16];
      (void)slidedp::safetensors::ConvertToFloat32(t.dtype, data + header->data_start + t.data_begin, t.numel, out);
    }
  }
  if (covered != header->data_size) std::abort();
  return 0;
}
