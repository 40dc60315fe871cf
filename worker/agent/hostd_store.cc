#include "worker/agent/hostd_store.h"

#include <chrono>

#include "common/status/grpc_status.h"
#include "common/status/status_macros.h"
#include "slidedp/v1/slidedp.grpc.pb.h"

namespace slidedp::worker {
namespace {

class PeerStore final : public KeyValueStore {
 public:
  PeerStore(std::unique_ptr<v1::PeerService::Stub> stub, std::string job_id)
      : stub_(std::move(stub)), job_id_(std::move(job_id)) {}

  absl::Status Set(const std::string& key, const std::string& value) override {
    v1::StoreSetRequest req;
    req.set_job_id(job_id_);
    req.set_key(key);
    req.set_value(value);
    v1::PeerAck ack;
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(60));
    return FromGrpc(stub_->StoreSet(&ctx, req, &ack));
  }

  absl::StatusOr<std::string> Get(const std::string& key, absl::Duration timeout) override {
    v1::StoreGetRequest req;
    req.set_job_id(job_id_);
    req.set_key(key);
    req.set_timeout_ms(absl::ToInt64Milliseconds(timeout));
    v1::StoreGetResponse resp;
    grpc::ClientContext ctx;
    // hostd answers within the timeout (DEADLINE_EXCEEDED naming the key); the call allows a minute more.
    ctx.set_deadline(std::chrono::system_clock::now() +
                     std::chrono::milliseconds(absl::ToInt64Milliseconds(timeout + absl::Minutes(1))));
    RETURN_IF_ERROR(FromGrpc(stub_->StoreGet(&ctx, req, &resp)));
    return resp.value();
  }

 private:
  std::unique_ptr<v1::PeerService::Stub> stub_;
  std::string job_id_;
};

}  // namespace

absl::StatusOr<std::shared_ptr<KeyValueStore>> HostdStore(const std::string& address,
                                                          const auth::ClientCredentialsOptions& credentials,
                                                          const std::string& job_id) {
  ASSIGN_OR_RETURN(std::shared_ptr<grpc::Channel> channel, auth::CreateHostdChannel(address, credentials));
  return std::shared_ptr<KeyValueStore>(std::make_shared<PeerStore>(v1::PeerService::NewStub(channel), job_id));
}

}  // namespace slidedp::worker
