// One attention case checked against an FP64 reference (causal per document, GQA): forward O and
// LSE, backward dQ, dK, dV, through the own kernels (attention.h) or cuDNN's fused attention
// (cudnn_attention.h), with the same inputs, reference and tolerances. Shared by attention_test.cc
// and cudnn_attention_test.cc; reports through gtest (ExpectRelErr), so call it from a test body.
#pragma once

#include <vector>

#include "worker/kernels/attention.h"
#include "worker/kernels/cudnn_attention.h"

namespace slidedp::kernel_test {

// `cudnn` set: cuDNN runs the case (it ignores `split`); a head_dim other than 128 and 256 that its
// engines reject is a skip, 128 and 256 (the models trained) must work. ordered: the own backward with
// AttnArgs::ordered_dq, whose dQ/dK/dV must then be bitwise the same on two more runs. window:
// AttnArgs::window (0: none); sinks: a sink logit per q head (AttnArgs::sinks, values -3..3), its
// gradient checked too.
void CheckAttention(int hd, int nq, int nkv, const std::vector<int>& docs,
                    kernels::AttnArgs::BwdSplit split = kernels::AttnArgs::BwdSplit::kAuto,
                    kernels::CudnnAttention* cudnn = nullptr, bool ordered = false, int window = 0,
                    bool sinks = false);

// The output's low half (AttnArgs::o_lo), own kernels: values sharing a component per kv head of
// `bias` (N(0, bias) per dimension; GPT-OSS's v bias) beside their N(0, 0.3) part, q and k
// N(0, 0.3). Forward writes o + o_lo at most half as far from the FP64 output as o alone;
// backward from it and the same backward without it (row dots from the BF16 o), dQ and dK against
// FP64, printed; with it both within 2e-2 and dQ at least `gain` times closer than without.
void CheckOutputLowHalf(int hd, int nq, int nkv, const std::vector<int>& docs, bool sinks, double bias, double gain);

// Cross attention (AttnArgs::kv_bounds, context parallelism): the documents cut zig-zag over
// `ranks` shares as one row; each share's queries attend the whole batch's keys through the own
// kernels; O, LSE and dQ at each share's rows and dK/dV added over the shares (FP32) against the
// FP64 reference of the whole batch. ordered: rank 0's backward twice, bitwise equal. `cudnn` set:
// cuDNN's cross attention runs the shares instead (its options must allow it: cross, and a
// cross_min_tokens the pieces reach).
void CheckCrossAttention(int hd, int nq, int nkv, const std::vector<int>& docs, int ranks, bool ordered = false,
                         kernels::CudnnAttention* cudnn = nullptr);

}  // namespace slidedp::kernel_test
