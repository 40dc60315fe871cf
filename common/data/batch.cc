// MicroBatch's out-of-line pieces; see batch.h.
#include "common/data/batch.h"

#include <algorithm>

namespace slidedp {

int64_t MicroBatch::num_trained() const {
  return static_cast<int64_t>(std::count_if(labels.begin(), labels.end(), [](int32_t l) { return l != kIgnoreIndex; }));
}

}  // namespace slidedp
