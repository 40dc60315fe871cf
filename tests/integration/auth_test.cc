// Client authentication against a real hostd: TCP on 127.0.0.1 (a free port) with certificates
// made by the openssl CLI when the suite starts, and the Unix socket's mode and group.
//
//   no credentials, a wrong token, a token where only certificates count -> PERMISSION_DENIED
//   the right token (CLI, client library, a CPU worker over TCP)          -> jobs run
//   a client certificate from the client CA                               -> works
//   a client certificate from another CA                                  -> refused (handshake)
//   TCP without client authentication, or a token file others may read    -> hostd does not start
//   health                                                                -> open, SERVING
#include <grp.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "common/auth/hostd_channel.h"
#include "common/data/synthetic.h"
#include "gmock/gmock.h"
#include "tests/integration/node_harness.h"

namespace slidedp::testing {
namespace {

namespace fs = std::filesystem;
using ::testing::AnyOf;
using ::testing::HasSubstr;
using ::testing::Not;
using client::WaitExit;

// A port nothing listens on now (the kernel's pick for port 0).
int FreePort() {
  const int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t len = sizeof(addr);
  int port = -1;
  if (fd >= 0 && ::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) == 0 &&
      ::getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len) == 0) {
    port = ntohs(addr.sin_port);
  }
  if (fd >= 0) ::close(fd);
  return port;
}


class Auth : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    dir_ = absl::StrCat(::testing::TempDir(), "/auth-", getpid());
    fs::remove_all(dir_);
    fs::create_directories(dir_);
    // Two CAs; hostd's certificate (for 127.0.0.1) and one client's from the first, another
    // client's from the second. EC P-256 keys: fast to make.
    const std::string script = absl::StrCat(R"(set -e
cd ')",
                                            dir_, R"('
key() { openssl genpkey -algorithm EC -pkeyopt ec_paramgen_curve:P-256 -out "$1"; }
ca() { key $1.key; openssl req -x509 -new -key $1.key -out $1.crt -days 2 -subj /CN=$1 \
  -addext basicConstraints=critical,CA:TRUE -addext keyUsage=critical,keyCertSign,cRLSign; }
leaf() {  # name ca cn extensions
  key $1.key; openssl req -new -key $1.key -out $1.csr -subj /CN=$3
  printf '%s\n' "$4" > $1.ext
  openssl x509 -req -in $1.csr -CA $2.crt -CAkey $2.key -CAcreateserial -out $1.crt -days 2 -extfile $1.ext
}
ca ca1; ca ca2
leaf server ca1 localhost "subjectAltName=IP:127.0.0.1,DNS:localhost
extendedKeyUsage=serverAuth"
leaf client1 ca1 alice "extendedKeyUsage=clientAuth"
leaf client2 ca2 mallory "extendedKeyUsage=clientAuth"
)");
    std::ofstream(dir_ + "/make-certs.sh") << script;
    const int rc =
        std::system(absl::StrCat("sh '", dir_, "/make-certs.sh' > '", dir_, "/make-certs.log' 2>&1").c_str());
    ASSERT_EQ(rc, 0) << "openssl failed: " << ReadFile(dir_ + "/make-certs.log");
    token_file_ = WriteToken("token", "right-token-0123456789abcdef0123456789");
    wrong_token_file_ = WriteToken("wrong-token", "wrong-token-0123456789abcdef0123456789");
    data::SyntheticOptions o;
    o.vocab_size = 512;
    o.num_documents = 32;
    o.seq_len = 32;
    o.min_doc_tokens = 8;
    o.max_doc_tokens = 40;
    o.overwrite = data::Overwrite::kYes;
    ASSERT_TRUE(data::WriteSyntheticDataset(dir_ + "/data", o).ok());
  }

  static std::string WriteToken(const std::string& name, const std::string& token, mode_t mode = 0600) {
    const std::string path = dir_ + "/" + name;
    std::ofstream(path, std::ios::trunc) << token << "\n";
    ::chmod(path.c_str(), mode);
    return path;
  }

  // A hostd on 127.0.0.1:<free port> with TLS and `args`; stopped by the destructor.
  struct Hostd {
    int pid = -1;
    std::string address, log;
    ~Hostd() { NodeHarness::KillAndReap(pid, SIGTERM); }
  };
  static std::unique_ptr<Hostd> StartTcpHostd(const std::vector<std::string>& args) {
    auto h = std::make_unique<Hostd>();
    h->address = absl::StrCat("127.0.0.1:", FreePort());
    h->log = absl::StrCat(dir_, "/hostd", counter_, ".log");
    std::vector<std::string> argv = {BuildDir() + "/bin/slidedp-hostd",
                                     "--listen",
                                     h->address,
                                     "--node-name",
                                     absl::StrCat("auth", getpid(), "x", counter_++),
                                     "--output-root",
                                     dir_ + "/outputs",
                                     "--worker-wait-s",
                                     "20",
                                     "--update-threads",
                                     "2",
                                     "--tls-cert",
                                     dir_ + "/server.crt",
                                     "--tls-key",
                                     dir_ + "/server.key"};
    argv.insert(argv.end(), args.begin(), args.end());
    auto pid = client::SpawnProcess(argv, h->log);
    EXPECT_TRUE(pid.ok()) << pid.status();
    h->pid = pid.ok() ? *pid : -1;
    return h;
  }

  // Client options for `address`: hostd's CA, plus what the test adds.
  static client::ClientOptions Options(const std::string& address) {
    client::ClientOptions o;
    o.address = address;
    o.timeout_s = 5;
    o.credentials.tls_ca_file = dir_ + "/ca1.crt";
    return o;
  }

  // Waits until hostd answers health (open without credentials).
  static void WaitServing(const Hostd& h) {
    WaitAccepts(h.address, 20);
    client::Client c(Options(h.address));
    absl::Status s = c.WaitReady(20);
    ASSERT_TRUE(s.ok()) << s << "\n" << ReadFile(h.log);
  }

  static std::string Spec(const std::string& name) {
    return absl::StrCat("name: ", name, "\nmodel: {preset: tiny, init_seed: 1}\ndata: {path: ", dir_,
                        "/data}\noutput: {dir: ", name, ", save_final: true}\n",
                        "train: {seq_len: 32, global_batch: 4, micro_batch: 2, steps: 2, seed: 1}\n",
                        "optimizer: {lr: 1.0e-3}\nruntime: {workers: 1, step_timeout_ms: 20000}\n");
  }
  static v1::SubmitJobRequest Request(const std::string& name, bool dry_run) {
    v1::SubmitJobRequest req;
    req.set_job_id(name);
    req.set_spec_yaml(Spec(name));
    req.set_dry_run(dry_run);
    return req;
  }

  // Every JobService and NodeService call of `c` is refused with PERMISSION_DENIED; returns the
  // message of the first.
  static std::string ExpectAllDenied(client::Client& c) {
    auto submit = c.Submit(Request("denied", true));
    EXPECT_EQ(submit.status().code(), absl::StatusCode::kPermissionDenied) << submit.status();
    EXPECT_EQ(c.ListJobs().status().code(), absl::StatusCode::kPermissionDenied);
    EXPECT_EQ(c.GetJob("x").status().code(), absl::StatusCode::kPermissionDenied);
    EXPECT_EQ(c.Cancel("x").status().code(), absl::StatusCode::kPermissionDenied);
    EXPECT_EQ(c.Node().status().code(), absl::StatusCode::kPermissionDenied);
    EXPECT_EQ(c.Workers().status().code(), absl::StatusCode::kPermissionDenied);
    std::string health;
    EXPECT_TRUE(c.Health(&health).ok());  // health stays open
    EXPECT_EQ(health, "SERVING");
    return std::string(submit.status().message());
  }

  // A WorkerService session that says hello with `credentials`; the status it ends with.
  static absl::Status WorkerSession(const std::string& address, const auth::ClientCredentialsOptions& credentials) {
    auto channel = auth::CreateHostdChannel(address, credentials);
    if (!channel.ok()) return channel.status();
    auto stub = v1::WorkerService::NewStub(*channel);
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(5));
    auto stream = stub->Session(&ctx);
    v1::WorkerReport hello;
    hello.mutable_hello()->set_worker_id("intruder");
    hello.mutable_hello()->set_pid(getpid());
    stream->Write(hello);
    stream->WritesDone();
    v1::HostCommand cmd;
    while (stream->Read(&cmd)) {
    }
    return FromGrpc(stream->Finish());
  }

  // Runs the slidedp CLI with `args` (and `env` assignments); its exit code, output into *out.
  static int Cli(const std::string& env, const std::string& args, std::string* out) {
    const std::string log = absl::StrCat(dir_, "/cli", counter_++, ".log");
    const int rc =
        std::system(absl::StrCat("env ", env, " '", BuildDir(), "/bin/slidedp' ", args, " > '", log, "' 2>&1").c_str());
    *out = ReadFile(log);
    return WIFEXITED(rc) ? WEXITSTATUS(rc) : -1;
  }

  static std::string dir_, token_file_, wrong_token_file_;
  static int counter_;
};

std::string Auth::dir_;
std::string Auth::token_file_;
std::string Auth::wrong_token_file_;
int Auth::counter_ = 0;

// A TCP listener with no client authentication configured: hostd exits at once (status 2) with
// the reason; only the loudly named opt-out lets it serve unauthenticated.
TEST_F(Auth, TcpWithoutClientAuthenticationRefusesToStart) {
  auto h = StartTcpHostd({});
  EXPECT_EQ(WaitExit(h->pid, 15), 2);
  h->pid = -1;
  EXPECT_THAT(ReadFile(h->log), HasSubstr("needs client authentication"));

  auto open = StartTcpHostd({"--dangerously-allow-unauthenticated-tcp"});
  WaitServing(*open);
  client::Client c(Options(open->address));
  EXPECT_TRUE(c.ListJobs().ok());
  EXPECT_THAT(ReadFile(open->log), HasSubstr("WITHOUT client authentication"));
}

// hostd refuses a token file that group or others may read, and says how to fix it; the token
// never appears in its output.
TEST_F(Auth, TokenFileReadableByOthersRefusesToStart) {
  const std::string open_token = WriteToken("open-token", "open-token-0123456789abcdef0123456789", 0644);
  auto h = StartTcpHostd({"--auth-token-file", open_token});
  EXPECT_NE(WaitExit(h->pid, 15), -1);
  h->pid = -1;
  const std::string log = ReadFile(h->log);
  EXPECT_THAT(log, HasSubstr("chmod 600"));
  EXPECT_THAT(log, Not(HasSubstr("open-token-0123")));
}

TEST_F(Auth, BearerTokenIsRequiredOnEveryServiceButHealth) {
  auto h = StartTcpHostd({"--auth-token-file", token_file_});
  WaitServing(*h);

  client::Client none(Options(h->address));
  const std::string message = ExpectAllDenied(none);
  EXPECT_THAT(message, HasSubstr("requires client authentication"));
  EXPECT_THAT(message, HasSubstr("--auth-token-file"));
  EXPECT_THAT(message, Not(HasSubstr("right-token")));

  client::ClientOptions wrong_options = Options(h->address);
  wrong_options.credentials.token_file = wrong_token_file_;
  client::Client wrong(wrong_options);
  const std::string wrong_message = ExpectAllDenied(wrong);
  EXPECT_THAT(wrong_message, HasSubstr("is not that token"));
  EXPECT_THAT(wrong_message, Not(HasSubstr("right-token")));
  EXPECT_THAT(wrong_message, Not(HasSubstr("wrong-token")));

  // WorkerService too: a worker session without the token never reaches hostd's core.
  auth::ClientCredentialsOptions ca_only = Options(h->address).credentials;
  EXPECT_EQ(WorkerSession(h->address, ca_only).code(), absl::StatusCode::kPermissionDenied);

  client::ClientOptions right_options = Options(h->address);
  right_options.credentials.token_file = token_file_;
  client::Client right(right_options);
  auto dry = right.Submit(Request("dry", true));
  ASSERT_TRUE(dry.ok()) << dry.status();
  EXPECT_THAT(dry->job().resolved_spec_yaml(), HasSubstr(fs::canonical(dir_ + "/outputs").string() + "/dry"));

  // A CPU worker over TCP with the token attaches and runs a job; one without it cannot attach.
  auto worker = client::SpawnProcess({BuildDir() + "/bin/slidedp-worker", "--hostd", h->address, "--backend", "cpu",
                                      "--tls-ca", dir_ + "/ca1.crt", "--token-file", token_file_},
                                     dir_ + "/worker-token.log");
  ASSERT_TRUE(worker.ok()) << worker.status();
  auto stray =
      client::SpawnProcess({"/usr/bin/env", "SLIDEDP_TLS_CA=" + dir_ + "/ca1.crt", BuildDir() + "/bin/slidedp-worker",
                            "--hostd", h->address, "--backend", "cpu", "--index", "1", "--exit-after-disconnects", "0"},
                           dir_ + "/worker-no-token.log");
  ASSERT_TRUE(stray.ok()) << stray.status();
  EXPECT_NE(WaitExit(*stray, 20), -1);
  EXPECT_THAT(ReadFile(dir_ + "/worker-no-token.log"), HasSubstr("PERMISSION_DENIED"));
  ASSERT_TRUE(right.Submit(Request("real", false)).ok());
  absl::StatusOr<v1::Job> job;
  for (int i = 0; i < 1200; ++i) {
    job = right.GetJob("real");
    if (!job.ok() || job->state() == v1::JOB_STATE_SUCCEEDED || job->state() == v1::JOB_STATE_FAILED ||
        job->state() == v1::JOB_STATE_CANCELLED) {
      break;
    }
    absl::SleepFor(absl::Milliseconds(50));
  }
  ASSERT_TRUE(job.ok()) << job.status();
  EXPECT_EQ(job->state(), v1::JOB_STATE_SUCCEEDED) << job->error() << "\n" << ReadFile(dir_ + "/worker-token.log");
  EXPECT_THAT(job->last_checkpoint(), HasSubstr(fs::canonical(dir_ + "/outputs").string() + "/real/"));
  auto workers = right.Workers();
  ASSERT_TRUE(workers.ok()) << workers.status();
  EXPECT_EQ(workers->size(), 1u);
  NodeHarness::KillAndReap(*worker, SIGTERM);

  // The CLI binary: refused without a token, served with --token-file or SLIDEDP_TOKEN_FILE.
  std::string out;
  const std::string base = absl::StrCat("--hostd ", h->address, " --tls-ca ", dir_, "/ca1.crt ");
  EXPECT_EQ(Cli("", base + "jobs", &out), 2) << out;
  EXPECT_THAT(out, HasSubstr("PERMISSION_DENIED"));
  EXPECT_EQ(Cli("", base + "--token-file " + token_file_ + " jobs", &out), 0) << out;
  EXPECT_THAT(out, HasSubstr("real"));
  EXPECT_EQ(Cli("SLIDEDP_TOKEN_FILE=" + token_file_, base + "status real", &out), 0) << out;
  EXPECT_EQ(Cli("", base + "health", &out), 0) << out;  // open
  EXPECT_THAT(out, HasSubstr("SERVING"));
  // A token file others may read is refused by the client too, before anything is sent.
  const std::string leaky = WriteToken("leaky-token", "right-token-0123456789abcdef0123456789", 0644);
  EXPECT_EQ(Cli("SLIDEDP_TOKEN_FILE=" + leaky, base + "jobs", &out), 2) << out;
  EXPECT_THAT(out, HasSubstr("chmod 600"));
}

TEST_F(Auth, ClientCertificatesFromTheClientCaOnly) {
  auto h = StartTcpHostd({"--tls-client-ca", dir_ + "/ca1.crt"});
  WaitServing(*h);

  client::ClientOptions good_options = Options(h->address);
  good_options.credentials.tls_cert_file = dir_ + "/client1.crt";
  good_options.credentials.tls_key_file = dir_ + "/client1.key";
  client::Client good(good_options);
  auto dry = good.Submit(Request("mtls", true));
  EXPECT_TRUE(dry.ok()) << dry.status() << "\n" << ReadFile(h->log);
  EXPECT_TRUE(good.ListJobs().ok());
  EXPECT_TRUE(WorkerSession(h->address, good_options.credentials).code() != absl::StatusCode::kPermissionDenied);

  // Signed by another CA: the handshake fails (UNAVAILABLE), or the call is refused.
  client::ClientOptions rogue_options = Options(h->address);
  rogue_options.credentials.tls_cert_file = dir_ + "/client2.crt";
  rogue_options.credentials.tls_key_file = dir_ + "/client2.key";
  client::Client rogue(rogue_options);
  auto refused = rogue.Submit(Request("rogue", true));
  ASSERT_FALSE(refused.ok());
  EXPECT_THAT(refused.status().code(), AnyOf(absl::StatusCode::kUnavailable, absl::StatusCode::kPermissionDenied))
      << refused.status();
  EXPECT_FALSE(rogue.ListJobs().ok());

  // No certificate: the connection is made (health answers), every other call is refused.
  client::Client none(Options(h->address));
  EXPECT_THAT(ExpectAllDenied(none), HasSubstr("--tls-client-ca"));
  // A bearer token counts for nothing where hostd has none.
  client::ClientOptions token_options = Options(h->address);
  token_options.credentials.token_file = token_file_;
  client::Client token(token_options);
  EXPECT_THAT(ExpectAllDenied(token), HasSubstr("accepts no bearer token"));
}

// The Unix socket's mode and group are its access policy: 0660 and hostd's group by default,
// 0600 or another group when asked; a mode that lets others in is refused.
TEST_F(Auth, UnixSocketModeAndGroup) {
  auto start = [&](const std::string& name, std::vector<std::string> args) {
    const std::string sock = absl::StrCat(dir_, "/", name, ".sock");
    std::vector<std::string> argv = {
        BuildDir() + "/bin/slidedp-hostd",    "--listen",      "unix:" + sock,   "--node-name",
        absl::StrCat("auth", getpid(), name), "--output-root", dir_ + "/outputs"};
    argv.insert(argv.end(), args.begin(), args.end());
    auto h = std::make_unique<Hostd>();
    h->address = "unix:" + sock;
    h->log = absl::StrCat(dir_, "/", name, ".log");
    auto pid = client::SpawnProcess(argv, h->log);
    EXPECT_TRUE(pid.ok());
    h->pid = pid.ok() ? *pid : -1;
    return h;
  };
  auto mode_of = [](const std::string& address, gid_t* gid) -> int {
    struct stat st;
    if (::stat(address.substr(5).c_str(), &st) != 0 || !S_ISSOCK(st.st_mode)) return -1;
    *gid = st.st_gid;
    return st.st_mode & 07777;
  };
  gid_t gid = 0;
  {
    auto h = start("default", {});
    WaitServing(*h);
    EXPECT_EQ(mode_of(h->address, &gid), 0660);
    EXPECT_EQ(gid, getegid());
  }
  {
    const group* g = ::getgrgid(getegid());
    ASSERT_NE(g, nullptr);
    auto h = start("private", {"--socket-mode", "0600", "--socket-group", g->gr_name});
    WaitServing(*h);
    EXPECT_EQ(mode_of(h->address, &gid), 0600);
    EXPECT_EQ(gid, g->gr_gid);
  }
  {
    auto h = start("world", {"--socket-mode", "0666"});
    EXPECT_EQ(WaitExit(h->pid, 15), 2);
    h->pid = -1;
    EXPECT_THAT(ReadFile(h->log), HasSubstr("--socket-mode"));
  }
  {
    auto h = start("nogroup", {"--socket-group", "no-such-group-slidedp"});
    EXPECT_EQ(WaitExit(h->pid, 15), 3);
    h->pid = -1;
    EXPECT_THAT(ReadFile(h->log), HasSubstr("no such group"));
  }
}

}  // namespace
}  // namespace slidedp::testing
