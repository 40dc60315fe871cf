// slidedp-hostd: parse the config, reclaim stale state, serve gRPC, drain on SIGTERM.
#include <signal.h>
#include <unistd.h>

#include <iostream>
#include <thread>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "common/log/program_logging.h"
#include "glog/logging.h"
#include "hostd/core/host_core.h"
#include "hostd/daemon/hostd_config.h"
#include "hostd/daemon/node_lock.h"
#include "hostd/engine/training_executor.h"
#include "hostd/metrics/host_metrics.h"
#include "hostd/metrics/metrics.h"
#include "hostd/service/grpc_services.h"
#include "hostd/update/layer_adam.h"
#include "shm/shm_segment.h"

#ifdef SLIDEDP_HAVE_SYSTEMD
#include <systemd/sd-daemon.h>
#define SD_NOTIFY(...) sd_notifyf(0, __VA_ARGS__)
#else
#define SD_NOTIFY(...) ((void)0)
#endif

namespace {
int g_signal_pipe[2];
}

int main(int argc, char** argv) {
  slidedp::InitProgramLogging(argv[0], slidedp::ProgramKind::kDaemon);
  auto config = slidedp::hostd::HostdConfig::Parse(argc, argv);
  if (!config.ok()) {
    if (config.status().code() == absl::StatusCode::kCancelled) {
      std::cout << config.status().message();
      return 0;
    }
    std::cerr << "slidedp-hostd: " << config.status().message() << "\n";
    return 2;
  }
  LOG(INFO) << "slidedp-hostd starting: " << config->ToString();
  const std::string node = slidedp::shm::SanitizeNameComponent(config->node_name);
  // Before anything touches the node's segments or socket: a second hostd of the node would
  // reclaim, pool and unlink the first one's state.
  auto node_lock = slidedp::hostd::NodeLock::Acquire(node);
  if (!node_lock.ok()) {
    LOG(ERROR) << node_lock.status();
    std::cerr << "slidedp-hostd: " << node_lock.status().message() << "\n";
    return 3;
  }
  // Where jobs may write: the root exists (created) and every root is free of symbolic links
  // before the first submit.
  auto output_policy = slidedp::hostd::OutputPolicy::Create(
      config->output_root, config->extra_output_root,
      config->allow_output_anywhere ? slidedp::hostd::OutputAnywhere::kYes : slidedp::hostd::OutputAnywhere::kNo);
  if (!output_policy.ok()) {
    LOG(ERROR) << output_policy.status();
    std::cerr << "slidedp-hostd: " << output_policy.status().message() << "\n";
    return 2;
  }
  LOG(INFO) << "output root " << output_policy->root
            << (config->allow_output_anywhere ? "; jobs may write anywhere hostd can (--allow-output-anywhere)" : "");
  const bool unix_socket = config->listen.rfind("unix:", 0) == 0;
  if (unix_socket && (!config->tls_client_ca.empty() || !config->auth_token_file.empty())) {
    LOG(WARNING) << "--tls-client-ca and --auth-token-file apply to TCP listeners only; who may use " << config->listen
                 << " is decided by its mode (" << config->socket_mode << ") and group";
  }
  slidedp::hostd::TrainingExecutorOptions eopt;
  eopt.node_name = node;
  eopt.update_threads = config->update_threads;
  eopt.pool_host_state = config->pool_host_state;
  eopt.policy_cache_dir = config->policy_cache;
  if (eopt.policy_cache_dir.empty() && !config->state_dir.empty()) eopt.policy_cache_dir = config->state_dir + "/policies";
  slidedp::hostd::HostCoreOptions copt;
  copt.node_name = node;
  copt.worker_wait = absl::Seconds(config->worker_wait_s);
  copt.state_dir = config->state_dir;
  copt.resume_interrupted = config->resume_interrupted;
  // After the job records are loaded (and the state segments of jobs resumed from shared memory
  // taken over by this process), before any job runs: what dead hostds left is removed.
  if (config->reclaim_stale) {
    copt.before_first_job = [node] {
      auto reclaimed = slidedp::shm::ReclaimStaleSegments(node);
      if (!reclaimed.ok()) {
        LOG(WARNING) << "stale segment scan failed: " << reclaimed.status();
        return;
      }
      for (const auto& r : *reclaimed) {
        LOG(WARNING) << "reclaimed stale segment " << r.name << " (" << r.bytes << " bytes, creator pid "
                     << r.creator_pid << ": " << r.reason << ")";
      }
    };
  }
  copt.output_policy = *output_policy;
  if (auto cores = slidedp::update::CoresPerNumaNode(); cores.ok()) {
    int total = 0;
    for (int c : *cores) total += c;
    copt.numa_nodes = static_cast<int>(cores->size());
    copt.update_threads =
        config->update_threads > 0 ? config->update_threads : slidedp::update::DefaultUpdateThreads(total);
  }
  // Jobs over several nodes: this hostd's peers (an id that changes at every start finds it among a job's nodes).
  slidedp::hostd::NodeMeshOptions mesh_options;
  mesh_options.instance_id = absl::StrCat(node, "-", absl::ToUnixNanos(absl::Now()), "-", getpid());
  mesh_options.peer_credentials.tls_ca_file = config->peer_tls_ca;
  mesh_options.peer_credentials.tls_cert_file = config->peer_tls_cert;
  mesh_options.peer_credentials.tls_key_file = config->peer_tls_key;
  mesh_options.peer_credentials.token_file = config->peer_token_file;
  char hostname[256] = {};
  gethostname(hostname, sizeof(hostname) - 1);
  mesh_options.node_address = config->NodeAddress(hostname);
  LOG(INFO) << "jobs over nodes: this node's workers listen for the other nodes' on " << mesh_options.node_address
            << (config->node_address.empty() ? " (from --listen or the host name; --node-address sets it)" : "");
  slidedp::hostd::NodeMesh mesh(mesh_options);
  copt.mesh = &mesh;
  slidedp::hostd::HostCore core(copt, std::make_unique<slidedp::hostd::TrainingExecutor>(eopt));
  core.Start();
  slidedp::metrics::MetricsRegistry metrics_registry;  // declared after core: destroyed first
  std::unique_ptr<slidedp::metrics::MetricsHttpServer> metrics_server;
  if (config->metrics_port > 0) {
    if (absl::Status s = slidedp::metrics::RegisterHostMetrics(&metrics_registry, &core); !s.ok()) {
      LOG(ERROR) << s;
      return 3;
    }
    slidedp::metrics::MetricsHttpOptions mopt;
    mopt.port = config->metrics_port;
    auto ms = slidedp::metrics::MetricsHttpServer::Start(&metrics_registry, mopt);
    if (!ms.ok()) {
      LOG(ERROR) << ms.status();
      return 3;
    }
    metrics_server = std::move(*ms);
    LOG(INFO) << "Prometheus metrics on 127.0.0.1:" << config->metrics_port << "/metrics";
  }
  slidedp::hostd::ServerOptions sopt;
  sopt.listen = config->listen;
  sopt.tls_cert_file = config->tls_cert;
  sopt.tls_key_file = config->tls_key;
  sopt.tls_client_ca_file = config->tls_client_ca;
  sopt.auth_token_file = config->auth_token_file;
  sopt.tcp_client_auth = config->dangerously_allow_unauthenticated_tcp ? slidedp::hostd::TcpClientAuth::kDangerouslyNone
                                                                       : slidedp::hostd::TcpClientAuth::kRequired;
  sopt.socket_group = config->socket_group;
  sopt.socket_mode = config->socket_mode_bits();
  sopt.mesh = &mesh;
  auto server = slidedp::hostd::HostServer::Start(&core, sopt);
  if (!server.ok()) {
    LOG(ERROR) << server.status();
    std::cerr << "slidedp-hostd: " << server.status().message() << "\n";
    return 3;
  }
  SD_NOTIFY("READY=1\nSTATUS=serving on %s", config->listen.c_str());

  // Signals go through a pipe to a normal thread (no work inside the handler).
  if (pipe(g_signal_pipe) != 0) return 1;
  auto handler = +[](int) { (void)!write(g_signal_pipe[1], "t", 1); };
  signal(SIGTERM, handler);
  signal(SIGINT, handler);
  char c = 0;
  while (read(g_signal_pipe[0], &c, 1) != 1) {
  }
  LOG(INFO) << "signal received: draining (" << config->drain_mode << ")";
  SD_NOTIFY("STOPPING=1\nSTATUS=draining");
  (*server)->SetServing(false);
  using DrainMode = slidedp::hostd::HostCore::DrainMode;
  core.Drain(config->drain_mode == "finish"       ? DrainMode::kFinishRunning
             : config->drain_mode == "checkpoint" ? DrainMode::kCheckpointRunning
                                                  : DrainMode::kCancelRunning);
  core.WaitIdle(absl::Minutes(config->drain_mode == "finish" ? 600 : 2));
  if (metrics_server) metrics_server->Stop();
  (*server)->Shutdown();
  LOG(INFO) << "slidedp-hostd stopped";
  return 0;
}
