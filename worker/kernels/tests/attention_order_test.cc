// The ordered-dQ turns (attention_order.h) against the backward's loop bounds and causality: for
// every query block, the visiting key blocks are exactly the ones whose keys some of its queries
// see, and their turns are 0..n-1 in launch order. A gap or a repeat would hang the kernel or
// race; a missing block would drop a dQ contribution. Cross attention's pieces (off keys before
// the queries' own, bottom-right causal) and sliding windows too.
#include "worker/kernels/attention_order.h"

#include <set>

#include "gtest/gtest.h"

namespace slidedp::kernels {
namespace {

TEST(AttentionOrder, TurnsCoverTheVisitingKeyBlocksInLaunchOrder) {
  for (const auto& [br, bc] : {std::pair{32, 64}, std::pair{64, 64}, std::pair{128, 64}, std::pair{16, 64}}) {
    for (int off : {0, 1, 63, 64, 100, 257}) {
      for (int window : {0, 1, 17, 64, 100, 128, 333}) {
        for (int len = 1; len <= (off == 0 ? 700 : 300); len += window == 0 ? 1 : 3) {
          const int num_kb = (len + off + bc - 1) / bc, num_qb = (len + br - 1) / br;
          for (int qb = 0; qb < num_qb; ++qb) {
            std::set<int> visitors, seeing, turns;
            int prev_turn = -1;
            for (int kb = num_kb - 1; kb >= 0; --kb) {  // launch order
              // Some query of qb (rows < len) sees some key of kb: the block's first key is at or
              // before the block's last row.
              // With a window, also: the block's last key is within the window of the block's first row.
              const int last_row = std::min(qb * br + br, len) - 1;
              const int last_key = std::min(kb * bc + bc, len + off) - 1;
              if (kb * bc <= last_row + off && (window == 0 || qb * br + off - last_key < window)) seeing.insert(kb);
              if (!DqVisits(qb, kb, len, br, bc, off, window)) continue;
              visitors.insert(kb);
              const int turn = DqTurn(qb, kb, len, br, bc, off);
              ASSERT_EQ(turn, prev_turn + 1) << "len " << len << " off " << off << " window " << window << " br " << br
                                             << " qb " << qb << " kb " << kb;
              prev_turn = turn;
              turns.insert(turn);
            }
            ASSERT_EQ(visitors, seeing) << "len " << len << " off " << off << " window " << window << " br " << br
                                        << " qb " << qb;
            // Turns 0..n-1 from the last key block down (a window leaves the first blocks out).
            if (!visitors.empty()) {
              ASSERT_EQ(*visitors.rbegin(), DqLastKeyBlock(qb, len, br, bc, off));
            }
            ASSERT_EQ(static_cast<int>(turns.size()), static_cast<int>(visitors.size()));
          }
        }
      }
    }
  }
}

}  // namespace
}  // namespace slidedp::kernels
