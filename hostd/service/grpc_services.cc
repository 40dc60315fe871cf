// gRPC handlers: argument translation only; behaviour lives in HostCore (unit-tested alone).
#include "hostd/service/grpc_services.h"

#include <grp.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <cstring>
#include <fstream>
#include <sstream>
#include <thread>

#include "absl/cleanup/cleanup.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/auth/bearer_token.h"
#include "common/io/small_file.h"
#include "common/status/status_macros.h"
#include "glog/logging.h"
#include "grpcpp/ext/proto_server_reflection_plugin.h"
#include "grpcpp/health_check_service_interface.h"
#include "hostd/service/client_auth.h"

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

// The TCP listener's credentials: TLS with hostd's certificate and, unless the operator opted
// out, client authentication by certificate and/or bearer token.
absl::StatusOr<std::shared_ptr<grpc::ServerCredentials>> TcpCredentials(const ServerOptions& options) {
  if (options.tls_cert_file.empty() || options.tls_key_file.empty()) {
    return absl::InvalidArgumentError("TCP listeners require TLS: give --tls-cert and --tls-key");
  }
  const bool authenticated = !options.tls_client_ca_file.empty() || !options.auth_token_file.empty();
  if (!authenticated && options.tcp_client_auth == TcpClientAuth::kRequired) {
    return absl::InvalidArgumentError(
        "TCP listeners require client authentication: give --tls-client-ca and/or --auth-token-file");
  }
  ASSIGN_OR_RETURN(std::string key, ReadSmallFile(options.tls_key_file, kMaxConfigFileBytes, "TLS key"));
  ASSIGN_OR_RETURN(std::string cert, ReadSmallFile(options.tls_cert_file, kMaxConfigFileBytes, "TLS certificate"));
  grpc::SslServerCredentialsOptions ssl;
  ssl.pem_key_cert_pairs.push_back({key, cert});
  ClientAuthPolicy policy;
  if (!options.tls_client_ca_file.empty()) {
    ASSIGN_OR_RETURN(ssl.pem_root_certs,
                     ReadSmallFile(options.tls_client_ca_file, kMaxConfigFileBytes, "TLS client CA"));
    // A certificate a client presents must verify against the CA, or the handshake fails. One is
    // not required at the handshake, so that health checks need none; every other call without
    // one (or a token) is refused by ClientAuthProcessor.
    ssl.client_certificate_request = GRPC_SSL_REQUEST_CLIENT_CERTIFICATE_AND_VERIFY;
    policy.certificates = ClientAuthPolicy::Certificates::kAccepted;
  }
  if (!options.auth_token_file.empty()) {
    ASSIGN_OR_RETURN(policy.token, auth::ReadTokenFile(options.auth_token_file));
  }
  std::shared_ptr<grpc::ServerCredentials> creds = grpc::SslServerCredentials(ssl);
  if (authenticated) {
    creds->SetAuthMetadataProcessor(std::make_shared<ClientAuthProcessor>(std::move(policy)));
  } else {
    LOG(WARNING) << "TCP listener " << options.listen << " WITHOUT client authentication "
                 << "(--dangerously-allow-unauthenticated-tcp): anyone who reaches it may submit jobs that read and "
                    "write files as this user";
  }
  return creds;
}

// The socket's access policy: group first, then the mode (the file was created owner-only).
absl::Status ApplySocketPolicy(const std::string& path, const ServerOptions& options) {
  if (!options.socket_group.empty()) {
    std::vector<char> buf(16384);
    group gr{};
    group* found = nullptr;
    const int rc = ::getgrnam_r(options.socket_group.c_str(), &gr, buf.data(), buf.size(), &found);
    if (rc != 0 || found == nullptr) {
      return absl::InvalidArgumentError(absl::StrCat("--socket-group ", options.socket_group, ": no such group"));
    }
    if (::lchown(path.c_str(), static_cast<uid_t>(-1), found->gr_gid) != 0) {
      return ErrnoStatus(
          absl::StrCat("chgrp ", options.socket_group, " ", path, " (hostd's user must be a member of the group)"),
          errno);
    }
  }
  if (::chmod(path.c_str(), options.socket_mode) != 0) {
    return ErrnoStatus(absl::StrCat("chmod ", absl::StrFormat("%04o", options.socket_mode), " ", path), errno);
  }
  return absl::OkStatus();
}

}  // namespace

grpc::Status JobServiceImpl::SubmitJob(grpc::ServerContext*, const v1::SubmitJobRequest* req,
                                       v1::SubmitJobResponse* resp) {
  auto r = core_->Submit(*req);
  if (!r.ok()) return ToGrpc(r.status());
  *resp = std::move(*r);
  return grpc::Status::OK;
}

grpc::Status JobServiceImpl::PlanJob(grpc::ServerContext*, const v1::PlanJobRequest* req, v1::PlanJobResponse* resp) {
  auto r = core_->Plan(*req);
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
  auto r = core_->Cancel(req->job_id(), req->save_checkpoint() ? HostCore::CancelSave::kCheckpoint
                                                                : HostCore::CancelSave::kNone);
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
  core_->Unwatch(req->job_id(), *ch);
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

grpc::Status PeerServiceImpl::JoinJob(grpc::ServerContext*, const v1::JoinJobRequest* req, v1::JoinJobResponse* resp) {
  absl::StatusOr<std::string> backend = core_->JoinJob(*req);
  if (!backend.ok()) return ToGrpc(backend.status());
  resp->set_backend(*backend);
  resp->set_instance_id(mesh_ != nullptr ? mesh_->instance_id() : "");
  return grpc::Status::OK;
}

grpc::Status PeerServiceImpl::StoreSet(grpc::ServerContext*, const v1::StoreSetRequest* req, v1::PeerAck*) {
  if (mesh_ == nullptr) return ToGrpc(absl::FailedPreconditionError("this hostd runs no jobs over several nodes"));
  return ToGrpc(mesh_->StoreSet(req->job_id(), req->key(), req->value()));
}

grpc::Status PeerServiceImpl::StoreGet(grpc::ServerContext*, const v1::StoreGetRequest* req,
                                       v1::StoreGetResponse* resp) {
  if (mesh_ == nullptr) return ToGrpc(absl::FailedPreconditionError("this hostd runs no jobs over several nodes"));
  absl::StatusOr<std::string> v = mesh_->StoreGet(req->job_id(), req->key(), absl::Milliseconds(req->timeout_ms()));
  if (!v.ok()) return ToGrpc(v.status());
  resp->set_value(std::move(*v));
  return grpc::Status::OK;
}

grpc::Status PeerServiceImpl::ReportNodeStep(grpc::ServerContext*, const v1::NodeStep* req, v1::PeerAck*) {
  if (mesh_ == nullptr) return ToGrpc(absl::FailedPreconditionError("this hostd runs no jobs over several nodes"));
  return ToGrpc(mesh_->ReportNodeStep(*req));
}

grpc::Status PeerServiceImpl::AbortJob(grpc::ServerContext*, const v1::AbortJobRequest* req, v1::PeerAck*) {
  core_->AbortFromPeer(*req);
  return grpc::Status::OK;
}

grpc::Status PeerServiceImpl::Probe(grpc::ServerContext*, grpc::ServerReader<v1::ProbeChunk>* reader,
                                    v1::ProbeResult* resp) {
  v1::ProbeChunk chunk;
  int64_t bytes = 0;
  while (reader->Read(&chunk)) {
    bytes += static_cast<int64_t>(chunk.data().size());
    if (bytes > kMaxProbeBytes) return ToGrpc(absl::ResourceExhaustedError("probe: more bytes than a measurement needs"));
  }
  resp->set_bytes(bytes);
  return grpc::Status::OK;
}

WorkerServiceImpl::WorkerServiceImpl(HostCore* core) : core_(core) {
  watchdog_ = std::thread([this] {
    pthread_setname_np(pthread_self(), "hello-watchdog");
    HelloWatchdog();
  });
}

WorkerServiceImpl::~WorkerServiceImpl() {
  {
    absl::MutexLock l(&mu_);
    stop_ = true;
  }
  watchdog_.join();
}

void WorkerServiceImpl::HelloWatchdog() {
  absl::MutexLock l(&mu_);
  while (!stop_) {
    mu_.AwaitWithTimeout(absl::Condition(&stop_), absl::Milliseconds(250));
    const absl::Time now = absl::Now();
    for (auto it = awaiting_hello_.begin(); it != awaiting_hello_.end();) {
      if (it->second > now) {
        ++it;
        continue;
      }
      it->first->TryCancel();  // the session's Read returns false; it leaves the map itself too
      it = awaiting_hello_.erase(it);
    }
  }
}

// One session per worker process: the first message must be a hello (within kHelloTimeout);
// then a writer thread forwards commands while this thread reads reports. The stream's end
// detaches the worker.
grpc::Status WorkerServiceImpl::Session(grpc::ServerContext* ctx,
                                        grpc::ServerReaderWriter<v1::HostCommand, v1::WorkerReport>* stream) {
  {
    absl::MutexLock l(&mu_);
    if (sessions_ >= kMaxWorkerSessions) {
      return grpc::Status(grpc::StatusCode::RESOURCE_EXHAUSTED,
                          absl::StrCat(kMaxWorkerSessions, " worker sessions are open already"));
    }
    ++sessions_;
    awaiting_hello_[ctx] = absl::Now() + kHelloTimeout;
  }
  absl::Cleanup closed = [this, ctx] {
    absl::MutexLock l(&mu_);
    --sessions_;
    awaiting_hello_.erase(ctx);
  };
  v1::WorkerReport first;
  const bool read = stream->Read(&first);
  bool overdue;
  {
    absl::MutexLock l(&mu_);
    overdue = awaiting_hello_.erase(ctx) == 0;  // the watchdog took it out
  }
  if (!read) {
    if (overdue) LOG(WARNING) << "a worker session sent no hello within " << kHelloTimeout << "; cancelled";
    return grpc::Status(grpc::StatusCode::CANCELLED, "no hello");
  }
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
  int64_t dropped = 0;
  while (stream->Read(&report)) {
    if (report.has_heartbeat()) continue;
    // A report that lands just after its job ended is dropped routinely; many are a misbehaving worker.
    if (!w->QueueReport(std::move(report)) && ++dropped == 1000) {
      LOG(WARNING) << "worker " << w->id() << ": 1000 reports dropped that hostd does not wait for (while idle, "
                   << "for another job, or past " << (kMaxQueuedReportBytes >> 20) << " MiB unread)";
    }
    report.Clear();
  }
  if (dropped > 0) LOG(INFO) << "worker " << w->id() << ": " << dropped << " reports dropped in this session";
  core_->DetachWorker(w);
  writer.join();
  return grpc::Status::OK;
}

absl::StatusOr<std::unique_ptr<HostServer>> HostServer::Start(HostCore* core, const ServerOptions& options) {
  std::unique_ptr<HostServer> s(new HostServer());
  s->jobs_ = std::make_unique<JobServiceImpl>(core);
  s->node_ = std::make_unique<NodeServiceImpl>(core);
  s->workers_ = std::make_unique<WorkerServiceImpl>(core);
  s->peers_ = std::make_unique<PeerServiceImpl>(core, options.mesh);
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
    ASSIGN_OR_RETURN(creds, TcpCredentials(options));
  }
  builder.AddListeningPort(options.listen, creds);
  builder.RegisterService(s->jobs_.get());
  builder.RegisterService(s->node_.get());
  builder.RegisterService(s->workers_.get());
  builder.RegisterService(s->peers_.get());
  builder.SetMaxReceiveMessageSize(4 << 20);  // specs are small; refuse oversized requests
  grpc::ResourceQuota quota("slidedp-hostd");
  quota.SetMaxThreads(kMaxServerThreads);
  builder.SetResourceQuota(quota);
  {
    // The socket file is created by bind() inside BuildAndStart, with the process umask. Owner
    // only until its group and mode are set, so no one else can connect in between. (umask is
    // process-wide; nothing else creates files while hostd starts, and 077 only narrows.)
    const mode_t old_umask = socket_path.empty() ? 0 : ::umask(077);
    s->server_ = builder.BuildAndStart();
    if (!socket_path.empty()) ::umask(old_umask);
  }
  if (!s->server_) return absl::UnavailableError(absl::StrCat("cannot listen on ", options.listen));
  if (!socket_path.empty()) RETURN_IF_ERROR(ApplySocketPolicy(socket_path, options));
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
