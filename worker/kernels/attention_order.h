// Ordered dQ accumulation (kernels::AttnArgs::ordered_dq): which key blocks of the backward add
// into a query block, and in which turn. Shared by FlashBwdKernel and its host test
// (attention_order_test.cc), so the kernel's turns are checked where CI runs.
//
// Blocks: query block qb holds a document's rows [qb·br, qb·br + br), key block kb its keys
// [kb·bc, kb·bc + bc); attention is causal inside the document (a query sees keys at or before it).
// Cross attention (AttnArgs::kv_bounds): a piece of len queries against len + off keys, query i
// seeing keys 0 .. i + off; off = 0 is self attention.
#pragma once

#if defined(__CUDACC__)
#define SLIDEDP_ATTN_HD __host__ __device__
#else
#define SLIDEDP_ATTN_HD
#endif

namespace slidedp::kernels {

// Whether key block kb's backward block visits query block qb (the kernel's loop bounds): its keys
// exist and qb is at or after the query block holding its first key (and, with a sliding window of
// `window` keys, at or before the one holding the last query that sees its last key). The blocks
// visiting one query block are consecutive, so DqTurn's turns stay without gaps.
SLIDEDP_ATTN_HD inline bool DqVisits(int qb, int kb, int len, int br, int bc, int off = 0, int window = 0) {
  const int k0 = kb * bc;
  const int first_q = k0 - off > 0 ? k0 - off : 0;  // the first query that sees key k0
  int end_qb = (len + br - 1) / br;
  if (window > 0) {
    const int last_key = (k0 + bc < len + off ? k0 + bc : len + off) - 1;
    const int last_q = last_key - off + window - 1;  // the last query seeing the block's last key
    const int w_end = last_q < 0 ? 0 : last_q / br + 1;
    end_qb = w_end < end_qb ? w_end : end_qb;
  }
  return k0 < len + off && qb >= first_q / br && qb < end_qb;
}

// The last key block that adds into query block qb: the one holding its last row's key.
SLIDEDP_ATTN_HD inline int DqLastKeyBlock(int qb, int len, int br, int bc, int off = 0) {
  const int end = qb * br + br < len ? qb * br + br : len;
  return (end - 1 + off) / bc;
}

// Key block kb's turn at query block qb: blocks add in descending kb, which is the backward grid's
// launch order (blockIdx.x = last key block − kb), so a block only ever waits for blocks launched
// before it. Turns of the visiting blocks are 0, 1, ... without gaps.
SLIDEDP_ATTN_HD inline int DqTurn(int qb, int kb, int len, int br, int bc, int off = 0) {
  return DqLastKeyBlock(qb, len, br, bc, off) - kb;
}

}  // namespace slidedp::kernels
