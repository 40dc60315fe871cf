#include "common/collective/gloo_group.h"

#include <chrono>
#include <exception>
#include <utility>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "gloo/allreduce.h"
#include "gloo/broadcast.h"
#include "gloo/common/error.h"
#include "gloo/rendezvous/context.h"
#include "gloo/rendezvous/file_store.h"
#include "gloo/rendezvous/prefix_store.h"
#include "gloo/transport/tcp/device.h"

namespace slidedp {
namespace {

std::chrono::milliseconds Millis(absl::Duration d) { return std::chrono::milliseconds(absl::ToInt64Milliseconds(d)); }

// Gloo's exceptions as Statuses (its IoException for a peer gone or silent, EnforceNotMet for a
// broken invariant).
absl::Status FromException(const std::exception& e, const std::string& what) {
  const std::string msg = absl::StrCat("gloo ", what, ": ", e.what());
  const std::string lower = absl::AsciiStrToLower(e.what());  // "Timed out ...", "Wait timeout for key(s)"
  if (absl::StrContains(lower, "timed out") || absl::StrContains(lower, "timeout")) {
    return absl::DeadlineExceededError(msg);
  }
  if (dynamic_cast<const gloo::IoException*>(&e) != nullptr) return absl::UnavailableError(msg);
  return absl::InternalError(msg);
}

void SumF32(void* out, const void* a, const void* b, size_t n) {
  float* o = static_cast<float*>(out);
  const float* x = static_cast<const float*>(a);
  const float* y = static_cast<const float*>(b);
  for (size_t i = 0; i < n; ++i) o[i] = x[i] + y[i];
}

}  // namespace

GlooGroup::GlooGroup(std::shared_ptr<gloo::Context> context, int rank, int size, absl::Duration timeout)
    : context_(std::move(context)), rank_(rank), size_(size), timeout_(timeout) {}

GlooGroup::~GlooGroup() = default;

absl::StatusOr<std::unique_ptr<GlooGroup>> GlooGroup::Connect(const GlooGroupOptions& o) {
  if (o.size < 1 || o.rank < 0 || o.rank >= o.size) {
    return absl::InvalidArgumentError(absl::StrCat("gloo group: rank ", o.rank, " of ", o.size));
  }
  if (o.store_dir.empty()) return absl::InvalidArgumentError("gloo group: no store directory");
  if (o.timeout <= absl::ZeroDuration()) return absl::InvalidArgumentError("gloo group: a timeout must be positive");
  try {
    gloo::rendezvous::FileStore files(o.store_dir);
    gloo::rendezvous::PrefixStore store(o.prefix, files);
    gloo::transport::tcp::attr attr;
    attr.hostname = o.host;
    std::shared_ptr<gloo::transport::Device> device = gloo::transport::tcp::CreateDevice(attr);
    auto context = std::make_shared<gloo::rendezvous::Context>(o.rank, o.size);
    context->setTimeout(Millis(o.timeout));
    context->connectFullMesh(store, device);
    return std::unique_ptr<GlooGroup>(new GlooGroup(std::move(context), o.rank, o.size, o.timeout));
  } catch (const std::exception& e) {
    return FromException(e, absl::StrCat("connect (rank ", o.rank, " of ", o.size, ", ", o.host, ")"));
  }
}

absl::Status GlooGroup::AllReduceSum(float* data, int64_t n) {
  if (n < 0 || (n > 0 && data == nullptr)) return absl::InvalidArgumentError("gloo all-reduce: bad buffer");
  if (n == 0 || size_ == 1) return absl::OkStatus();
  try {
    gloo::AllreduceOptions opts(context_);
    opts.setOutput(data, static_cast<size_t>(n));
    opts.setAlgorithm(gloo::AllreduceOptions::Algorithm::RING);
    opts.setReduceFunction(&SumF32);
    opts.setTag(next_tag_++);
    opts.setTimeout(Millis(timeout_));
    gloo::allreduce(opts);
  } catch (const std::exception& e) {
    return FromException(e, absl::StrCat("all-reduce of ", n, " floats"));
  }
  return absl::OkStatus();
}

absl::Status GlooGroup::Broadcast(float* data, int64_t n, int root) {
  if (n < 0 || (n > 0 && data == nullptr)) return absl::InvalidArgumentError("gloo broadcast: bad buffer");
  if (root < 0 || root >= size_) return absl::InvalidArgumentError(absl::StrCat("gloo broadcast: root ", root));
  if (n == 0 || size_ == 1) return absl::OkStatus();
  try {
    gloo::BroadcastOptions opts(context_);
    opts.setOutput(data, static_cast<size_t>(n));
    opts.setRoot(root);
    opts.setTag(next_tag_++);
    opts.setTimeout(Millis(timeout_));
    gloo::broadcast(opts);
  } catch (const std::exception& e) {
    return FromException(e, absl::StrCat("broadcast of ", n, " floats from ", root));
  }
  return absl::OkStatus();
}

}  // namespace slidedp
