// Fused cross entropy of the LM head over a chunk of BF16 logits, computing the loss and the
// logits' gradient in place.
//
// Every launcher takes its tensors, sizes and an explicit stream, returns a Status (bad sizes are
// INVALID_ARGUMENT, launch failures INTERNAL) and never synchronizes. BF16 storage, FP32 math.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "absl/status/status.h"

namespace slidedp::kernels {

using bf16 = __nv_bfloat16;

// Cross entropy over a chunk of BF16 logits rows (row stride ld), in place: the logits become
// dlogits = loss_scale * (softmax - onehot(label)) (zero for ignored rows), and
// row_loss[r] = loss_scale * (logsumexp - logit[label]) (0 if ignored). softcap > 0 (Gemma's
// final_logit_softcapping) takes the loss over softcap * tanh(logits / softcap) and writes the
// gradient with respect to the stored, uncapped logits.
absl::Status CrossEntropyInPlace(bf16* logits, int64_t rows, int64_t vocab, int64_t ld, const int32_t* labels,
                                 int32_t ignore_index, float loss_scale, float* row_loss, cudaStream_t stream,
                                 float softcap = 0.0f);

}  // namespace slidedp::kernels
