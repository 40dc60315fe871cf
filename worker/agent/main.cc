// slidedp-worker: one process per GPU (or CPU backend worker). Parses flags, runs WorkerAgent.
#include <algorithm>
#include <cctype>
#include <csignal>
#include <iostream>
#include <thread>

#include "CLI/CLI.hpp"
#include "common/auth/hostd_channel.h"
#include "common/log/program_logging.h"
#include "common/version.h"
#include "glog/logging.h"
#include "worker/agent/worker_agent.h"
#include "worker/debug/debug_switches.h"

#ifdef SLIDEDP_HAVE_CUDA
#include <cuda_runtime_api.h>
#endif

namespace {
slidedp::worker::WorkerAgent* g_agent = nullptr;
int g_signal_pipe[2];
}  // namespace

int main(int argc, char** argv) {
  slidedp::InitProgramLogging(argv[0], slidedp::ProgramKind::kDaemon);
  slidedp::worker::WorkerOptions opt;
  std::string backend = "cpu";
  int gpu = -1;
  bool count_gpus = false;
  CLI::App app{"slidedp-worker: streams layers through one GPU (or the CPU backend) for hostd"};
  app.add_option("--hostd", opt.hostd_address, "hostd address: unix:PATH, or HOST:PORT (TLS)");
  opt.credentials = slidedp::auth::ClientCredentialsOptions::FromEnvironment();
  app.add_option("--tls-ca", opt.credentials.tls_ca_file, "TCP: PEM CA of hostd's certificate (env SLIDEDP_TLS_CA)");
  app.add_option("--tls-cert", opt.credentials.tls_cert_file, "TCP: PEM client certificate (env SLIDEDP_TLS_CERT)");
  app.add_option("--tls-key", opt.credentials.tls_key_file, "TCP: PEM key of --tls-cert (env SLIDEDP_TLS_KEY)");
  app.add_option("--token-file", opt.credentials.token_file,
                 "TCP: file (mode 0600) with hostd's bearer token (env SLIDEDP_TOKEN_FILE)");
  app.add_option("--tls-server-name", opt.credentials.tls_server_name,
                 "TCP: name in hostd's certificate, when not the address's host (env SLIDEDP_TLS_SERVER_NAME)");
  app.add_option("--backend", backend, "cuda | cpu")->check(CLI::IsMember({"cuda", "cpu"}));
  app.add_option("--gpu", gpu, "GPU ordinal (implies --backend cuda)");
  app.add_option("--index", opt.index, "worker number (CPU backend)");
  app.add_option("--id", opt.id,
                 "the worker's name at hostd (default gpu<N> / cpu<N>): several workers on one GPU need their own")
      ->check([](const std::string& v) {
        const bool ok = !v.empty() && v.size() <= 64 && std::all_of(v.begin(), v.end(), [](unsigned char c) {
          return std::isalnum(c) || c == '-' || c == '_';
        });
        return ok ? std::string() : std::string("--id: 1-64 letters, digits, '-' or '_'");
      });
  app.add_flag("--count-gpus", count_gpus, "print the number of visible CUDA devices and exit");
  app.add_option("--exit-after-disconnects", opt.exit_after_disconnects, "give up after N failed sessions");
  app.set_version_flag("--version", [] { return slidedp::VersionReport(); });
  bool quiet = false;
  app.add_flag("--quiet", quiet, "log warnings and errors only");
  CLI11_PARSE(app, argc, argv);
  if (quiet) slidedp::SetLogVerbosity(slidedp::ProgramKind::kDaemon, slidedp::LogVerbosity::kQuiet);
  if (count_gpus) {
    int n = 0;
#ifdef SLIDEDP_HAVE_CUDA
    if (cudaGetDeviceCount(&n) != cudaSuccess) n = 0;
#endif
    std::cout << n << "\n";
    return 0;
  }
  if (gpu >= 0) {
    backend = "cuda";
    opt.index = gpu;
  }
  opt.backend = backend == "cuda" ? slidedp::worker::BackendKind::kCuda : slidedp::worker::BackendKind::kCpu;
  // The debug and fault-injection switches (SLIDEDP_*, docs/environment.md): a malformed one is a
  // configuration error, refused before the worker registers.
  const absl::StatusOr<slidedp::DebugSwitches>& switches = slidedp::ProcessDebugSwitches();
  if (!switches.ok()) {
    std::cerr << "slidedp-worker: " << switches.status().message() << "\n";
    return 2;
  }
  opt.switches = *switches;
  // Unusable credentials are a configuration error: exit now rather than retry sessions forever.
  if (auto channel = slidedp::auth::CreateHostdChannel(opt.hostd_address, opt.credentials); !channel.ok()) {
    std::cerr << "slidedp-worker: " << channel.status().message() << "\n";
    return 2;
  }

  // Signals: a pipe wakes a normal thread that stops the agent (no work in the handler).
  if (pipe(g_signal_pipe) != 0) return 1;
  slidedp::worker::WorkerAgent agent(opt);
  g_agent = &agent;
  std::thread stopper([] {
    char c;
    if (read(g_signal_pipe[0], &c, 1) == 1 && c == 's') g_agent->Stop();
  });
  auto handler = +[](int) { (void)!write(g_signal_pipe[1], "s", 1); };
  std::signal(SIGTERM, handler);
  std::signal(SIGINT, handler);
  absl::Status s = agent.Run();
  (void)!write(g_signal_pipe[1], "x", 1);
  stopper.join();
  LOG(INFO) << "worker exiting: " << s;
  return 0;
}
