// MXFP4 experts (the released gpt-oss checkpoints: quantization_config.quant_method "mxfp4"),
// dequantized at load exactly as transformers 5.17 does (integrations/mxfp4.py,
// convert_moe_packed_tensors). A fused expert tensor W [E, in, out] (gpt_oss's gate_up_proj
// [E, hidden, 2 I], down_proj [E, I, hidden]) is stored transposed and in blocks of 32 values:
//   <name>_blocks [E, out, in / 32, 16] uint8: byte b of block g of row r holds the values at
//                 in = 32 g + 2 b (low nibble) and 32 g + 2 b + 1 (high nibble), FP4 e2m1 codes
//                 (Mxfp4Value: sign bit 3, then 0, 0.5, 1, 1.5, 2, 3, 4, 6);
//   <name>_scales [E, out, in / 32] uint8: the block's power of two, 2^(scale - 127).
// Each value is code * 2^(scale - 127): transformers computes it in bfloat16 (lut in bf16 times a
// float32 power of two, cast back), which every such product fits exactly; a scale of 254 or 255
// overflows to inf (or 0 * inf = NaN), which the loader then refuses as non-finite, as transformers
// would train on it. The biases (<name>_bias) are stored unquantized.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "common/model/model_config.h"
#include "common/safetensors/safetensors.h"

namespace slidedp::checkpoint {

// transformers' FP4_VALUES[code & 15].
float Mxfp4Value(uint8_t code);

// One expert's matrix: blocks [out, in / 32, 16] and scales [out, in / 32] -> w [in, out] (the
// transposed matrix, transformers' parameter layout), `in` a multiple of 32.
void DequantizeMxfp4Transposed(const uint8_t* blocks, const uint8_t* scales, int64_t out_dim, int64_t in_dim, float* w);

// The MXFP4 pair a layout slot (one expert's slice of a fused tensor, TensorSlot::hf_shape
// [E, in, out]) reads: OK when `blocks` and `scales` are uint8 of the shapes above; INVALID_ARGUMENT
// naming what differs otherwise.
absl::Status CheckMxfp4Pair(const TensorSlot& slot, const safetensors::TensorInfo& blocks,
                            const safetensors::TensorInfo& scales);
// The slot's expert, dequantized into dst (slot.numel floats), from the pair's bytes (whole tensors).
void DequantizeMxfp4Slot(const TensorSlot& slot, const char* blocks, const char* scales, float* dst);

}  // namespace slidedp::checkpoint
