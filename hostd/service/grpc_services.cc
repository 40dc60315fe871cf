// gRPC handlers: argument translation only; behaviour lives in HostCore (unit-tested alone).
#include "hostd/service/grpc_services.h"

#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <cstring>
#include <fstream>
#include <sstream>
#include <thread>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "common/io/small_file.h"
#include "common/status/status_macros.h"
#include "glog/logging.h"
#include "grpcpp/ext/proto_server_reflection_plugin.h"
#include "grpcpp/health_check_service_interface.h"

namespace slidedp::hostd {

namespace {

// Whether something accepts connections on the Unix socket at `path` now.
bool SocketAccepts(const std::string& path) {
  sockaddr_un addr{};
  if (path.size() >= sizeof(addr.sun_path)) return false;
  addr.sun_family = AF_UNIX;
  std::memcpy(addr.sun_path, path.c_str(), path.size() + 1);
  const int fd = ::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return false;
  const bool accepts = ::connect(fd, reinterpret_cast<const sockaddr*>(&addr), sizeof(addr)) == 0;
  ::close(fd);
  return accepts;
}

}  // namespace

grpc::Status JobServiceImpl::SubmitJob(grpc::ServerContext*, const v1::SubmitJobRequest* req,
                                       v1::SubmitJobResponse* resp) {
  auto r = core_->Submit(*req);
  if (!r.ok()) return ToGrpc(r.status());
  *resp = std::move(*r);
  return grpc::Status::OK;
}

grpc::Status JobServiceImpl::GetJob(grpc::ServerContext*, const v1::GetJobRequest* req, v1::Job* resp) {
  auto r = core_->GetJob(req->job_id());
  if (!r.ok()) return ToGrpc(r.status());
  *resp = std::move(*r);
  return grpc::Status::OK;
}

grpc::Status JobServiceImpl::ListJobs(grpc::ServerContext*, const v1::ListJobsRequest*, v1::ListJobsResponse* resp) {
  for (auto& j : core_->ListJobs()) *resp->add_jobs() = std::move(j);
  return grpc::Status::OK;
}

grpc::Status JobServiceImpl::CancelJob(grpc::ServerContext*, const v1::CancelJobRequest* req, v1::Job* resp) {
  auto r = core_->Cancel(req->job_id());
  if (!r.ok()) return ToGrpc(r.status());
  *resp = std::move(*r);
  return grpc::Status::OK;
}

grpc::Status JobServiceImpl::WatchJob(grpc::ServerContext* ctx, const v1::WatchJobRequest* req,
                                      grpc::ServerWriter<v1::JobEvent>* writer) {
  auto ch = core_->Watch(req->job_id());
  if (!ch.ok()) return ToGrpc(ch.status());
  while (!ctx->IsCancelled()) {
    auto ev = (*ch)->Pop(absl::Milliseconds(250));
    if (!ev) {
      if ((*ch)->closed()) break;
      continue;
    }
    if (!writer->Write(*ev)) break;
  }
  return grpc::Status::OK;
}

grpc::Status NodeServiceImpl::GetNode(grpc::ServerContext*, const v1::GetNodeRequest*, v1::NodeInfo* resp) {
  *resp = core_->GetNode();
  return grpc::Status::OK;
}

grpc::Status NodeServiceImpl::ListWorkers(grpc::ServerContext*, const v1::ListWorkersRequest*,
                                          v1::ListWorkersResponse* resp) {
  for (auto& w : core_->ListWorkers()) *resp->add_workers() = std::move(w);
  return grpc::Status::OK;
}

// One session per worker process: the first message must be a hello; then a writer thread
// forwards commands while this thread reads reports. The stream's end detaches the worker.
grpc::Status WorkerServiceImpl::Session(grpc::ServerContext* ctx,
                                        grpc::ServerReaderWriter<v1::HostCommand, v1::WorkerReport>* stream) {
  v1::WorkerReport first;
  if (!stream->Read(&first)) return grpc::Status(grpc::StatusCode::CANCELLED, "worker closed before hello");
  if (!first.has_hello()) return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT, "first message must be a hello");
  auto session = core_->AttachWorker(first.hello());
  if (!session.ok()) return ToGrpc(session.status());
  std::shared_ptr<WorkerSession> w = *session;
  std::thread writer([&] {
    pthread_setname_np(pthread_self(), "worker-writer");
    while (!ctx->IsCancelled()) {
      auto cmd = w->commands().Pop(absl::Milliseconds(200));
      if (!cmd) {
        if (w->gone()) break;
        continue;
      }
      if (!stream->Write(*cmd)) break;
    }
  });
  v1::WorkerReport report;
  while (stream->Read(&report)) {
    if (report.has_heartbeat()) continue;
    w->reports().Push(report);
  }
  core_->DetachWorker(w);
  writer.join();
  return grpc::Status::OK;
}

absl::StatusOr<std::unique_ptr<HostServer>> HostServer::Start(HostCore* core, const ServerOptions& options) {
  std::unique_ptr<HostServer> s(new HostServer());
  s->jobs_ = std::make_unique<JobServiceImpl>(core);
  s->node_ = std::make_unique<NodeServiceImpl>(core);
  s->workers_ = std::make_unique<WorkerServiceImpl>(core);
  grpc::EnableDefaultHealthCheckService(true);
  grpc::reflection::InitProtoReflectionServerBuilderPlugin();
  grpc::ServerBuilder builder;
  std::shared_ptr<grpc::ServerCredentials> creds;
  std::string socket_path;
  if (absl::StartsWith(options.listen, "unix:")) {
    socket_path = options.listen.substr(5);
    // A socket file left by a dead hostd is removed; one a live process still accepts on is not
    // taken over (that daemon would keep running, unreachable).
    if (SocketAccepts(socket_path)) {
      return absl::AlreadyExistsError(absl::StrCat("another process serves ", options.listen, "; not taking it over"));
    }
    ::unlink(socket_path.c_str());
    creds = grpc::InsecureServerCredentials();
  } else {
    if (options.tls_cert_file.empty() || options.tls_key_file.empty()) {
      return absl::InvalidArgumentError("TCP listeners require TLS: give --tls-cert and --tls-key");
    }
    ASSIGN_OR_RETURN(std::string key, ReadSmallFile(options.tls_key_file, kMaxConfigFileBytes, "TLS key"));
    ASSIGN_OR_RETURN(std::string cert, ReadSmallFile(options.tls_cert_file, kMaxConfigFileBytes, "TLS certificate"));
    grpc::SslServerCredentialsOptions ssl;
    ssl.pem_key_cert_pairs.push_back({key, cert});
    creds = grpc::SslServerCredentials(ssl);
  }
  builder.AddListeningPort(options.listen, creds);
  builder.RegisterService(s->jobs_.get());
  builder.RegisterService(s->node_.get());
  builder.RegisterService(s->workers_.get());
  builder.SetMaxReceiveMessageSize(4 << 20);  // specs are small; refuse oversized requests
  s->server_ = builder.BuildAndStart();
  if (!s->server_) return absl::UnavailableError(absl::StrCat("cannot listen on ", options.listen));
  if (!socket_path.empty() && ::chmod(socket_path.c_str(), 0660) != 0) {
    return absl::PermissionDeniedError(absl::StrCat("chmod 0660 ", socket_path, " failed"));
  }
  s->address_ = options.listen;
  s->SetServing(true);
  LOG(INFO) << "hostd listening on " << options.listen;
  return s;
}

void HostServer::SetServing(bool serving) {
  if (auto* h = server_->GetHealthCheckService()) {
    h->SetServingStatus(serving);
    h->SetServingStatus("slidedp.v1.JobService", serving);
  }
}

void HostServer::Shutdown() {
  if (server_) server_->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(2));
}

void HostServer::Wait() {
  if (server_) server_->Wait();
}

HostServer::~HostServer() { Shutdown(); }

}  // namespace slidedp::hostd
