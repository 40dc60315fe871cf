#include "common/collective/gloo_group.h"

#include <cstring>

#include <chrono>
#include <exception>
#include <utility>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "gloo/allgather.h"
#include "gloo/allreduce.h"
#include "gloo/broadcast.h"
#include "gloo/common/error.h"
#include "gloo/rendezvous/context.h"
#include "gloo/rendezvous/file_store.h"
#include "gloo/rendezvous/prefix_store.h"
#include "gloo/rendezvous/store.h"
#include "gloo/transport/unbound_buffer.h"
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

// A KeyValueStore as Gloo's store: errors become Gloo's IoException (FromException maps them back).
class StoreAdapter final : public gloo::rendezvous::Store {
 public:
  StoreAdapter(KeyValueStore* kv, absl::Duration timeout) : kv_(kv), timeout_(timeout) {}
  void set(const std::string& key, const std::vector<char>& data) override {
    Check(kv_->Set(key, std::string(data.begin(), data.end())));
  }
  std::vector<char> get(const std::string& key) override {
    absl::StatusOr<std::string> v = kv_->Get(key, timeout_);
    Check(v.status());
    return std::vector<char>(v->begin(), v->end());
  }
  void wait(const std::vector<std::string>& keys) override { wait(keys, Millis(timeout_)); }
  void wait(const std::vector<std::string>& keys, const std::chrono::milliseconds& timeout) override {
    for (const std::string& key : keys) Check(kv_->Get(key, absl::Milliseconds(timeout.count())).status());
  }

 private:
  static void Check(const absl::Status& s) {
    if (s.ok()) return;
    // "timeout" stays in the text of a deadline, so FromException says DEADLINE_EXCEEDED.
    throw gloo::IoException(std::string(s.code() == absl::StatusCode::kDeadlineExceeded ? "store timeout: " : "store: ") +
                            std::string(s.message()));
  }
  KeyValueStore* kv_;
  absl::Duration timeout_;
};

}  // namespace

GlooGroup::GlooGroup(std::shared_ptr<gloo::Context> context, int rank, int size, absl::Duration timeout)
    : context_(std::move(context)), rank_(rank), size_(size), timeout_(timeout) {}

GlooGroup::~GlooGroup() = default;

absl::StatusOr<std::unique_ptr<GlooGroup>> GlooGroup::Connect(const GlooGroupOptions& o) {
  if (o.size < 1 || o.rank < 0 || o.rank >= o.size) {
    return absl::InvalidArgumentError(absl::StrCat("gloo group: rank ", o.rank, " of ", o.size));
  }
  if (o.store == nullptr && o.store_dir.empty()) return absl::InvalidArgumentError("gloo group: no store");
  if (o.timeout <= absl::ZeroDuration()) return absl::InvalidArgumentError("gloo group: a timeout must be positive");
  try {
    std::unique_ptr<gloo::rendezvous::Store> base;
    if (o.store != nullptr) {
      base = std::make_unique<StoreAdapter>(o.store.get(), o.timeout);
    } else {
      base = std::make_unique<gloo::rendezvous::FileStore>(o.store_dir);
    }
    gloo::rendezvous::PrefixStore store(o.prefix, *base);
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

absl::Status GlooGroup::AllGather(const float* mine, int64_t n, float* out) {
  if (n < 0 || (n > 0 && (mine == nullptr || out == nullptr))) return absl::InvalidArgumentError("gloo all-gather: bad buffer");
  if (n == 0) return absl::OkStatus();
  float* slot = out + static_cast<int64_t>(rank_) * n;
  if (slot != mine) std::memmove(slot, mine, static_cast<size_t>(n) * sizeof(float));
  if (size_ == 1) return absl::OkStatus();
  try {
    gloo::AllgatherOptions opts(context_);
    opts.setOutput(out, static_cast<size_t>(n) * static_cast<size_t>(size_));
    opts.setTag(next_tag_++);
    opts.setTimeout(Millis(timeout_));
    gloo::allgather(opts);  // without an input: this rank's slice of the output is its contribution
  } catch (const std::exception& e) {
    return FromException(e, absl::StrCat("all-gather of ", n, " floats"));
  }
  return absl::OkStatus();
}

absl::Status GlooGroup::Send(const float* data, int64_t n, int to) {
  if (n < 0 || (n > 0 && data == nullptr)) return absl::InvalidArgumentError("gloo send: bad buffer");
  if (to < 0 || to >= size_ || to == rank_) return absl::InvalidArgumentError(absl::StrCat("gloo send: to ", to));
  if (n == 0) return absl::OkStatus();
  try {
    // Gloo's buffer API takes a mutable pointer; a send only reads it.
    auto buf = context_->createUnboundBuffer(const_cast<float*>(data), static_cast<size_t>(n) * sizeof(float));
    buf->send(to, PointSlot());
    if (!buf->waitSend(Millis(timeout_))) return absl::UnavailableError(absl::StrCat("gloo send to ", to, ": aborted"));
  } catch (const std::exception& e) {
    return FromException(e, absl::StrCat("send of ", n, " floats to ", to));
  }
  return absl::OkStatus();
}

absl::Status GlooGroup::Recv(float* data, int64_t n, int from) {
  if (n < 0 || (n > 0 && data == nullptr)) return absl::InvalidArgumentError("gloo recv: bad buffer");
  if (from < 0 || from >= size_ || from == rank_) return absl::InvalidArgumentError(absl::StrCat("gloo recv: from ", from));
  if (n == 0) return absl::OkStatus();
  try {
    auto buf = context_->createUnboundBuffer(data, static_cast<size_t>(n) * sizeof(float));
    buf->recv(from, PointSlot());
    if (!buf->waitRecv(Millis(timeout_))) return absl::UnavailableError(absl::StrCat("gloo recv from ", from, ": aborted"));
  } catch (const std::exception& e) {
    return FromException(e, absl::StrCat("receive of ", n, " floats from ", from));
  }
  return absl::OkStatus();
}

}  // namespace slidedp
