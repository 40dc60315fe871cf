// A job over two nodes as separate machines see it: each hostd in its own network namespace (a veth
// pair with private addresses), listening on TCP with TLS and a bearer token, its CPU worker over TCP,
// the hostds calling each other with their peer credentials, the workers' Gloo link over the pair.
//   the job runs on both nodes, the coordinator writes the checkpoint      -> succeeded
//   a node whose peer token the other does not accept                      -> the join is refused,
//                                                                            PERMISSION_DENIED naming it
// Needs root (ip netns); skipped otherwise.
#include <sys/stat.h>
#include <sys/wait.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "tests/integration/node_harness.h"
#include "tests/netns/netns_pair.h"

namespace slidedp::testing {
namespace {

namespace fs = std::filesystem;
using ::testing::HasSubstr;

constexpr int kPort = 7070;

// `ip`, for running a process inside a namespace (SpawnProcess takes a path, not a name).
std::string Ip() { return fs::exists("/usr/sbin/ip") ? "/usr/sbin/ip" : "/sbin/ip"; }

class TwoMachines {
 public:
  explicit TwoMachines(const NetnsPair& net) : net_(net) {
    dir_ = absl::StrCat(::testing::TempDir(), "/mn-netns-", getpid());
    fs::remove_all(dir_);
    fs::create_directories(dir_);
    // One CA; a hostd certificate for both addresses; EC P-256 keys (fast).
    const std::string script = absl::StrCat("set -e\ncd '", dir_, R"('
openssl genpkey -algorithm EC -pkeyopt ec_paramgen_curve:P-256 -out ca.key
openssl req -x509 -new -key ca.key -out ca.crt -days 2 -subj /CN=ca \
  -addext basicConstraints=critical,CA:TRUE -addext keyUsage=critical,keyCertSign,cRLSign
openssl genpkey -algorithm EC -pkeyopt ec_paramgen_curve:P-256 -out hostd.key
openssl req -new -key hostd.key -out hostd.csr -subj /CN=hostd
printf 'subjectAltName=IP:)", net.address(0), ",IP:", net.address(1), R"(\nextendedKeyUsage=serverAuth,clientAuth\n' > hostd.ext
openssl x509 -req -in hostd.csr -CA ca.crt -CAkey ca.key -CAcreateserial -out hostd.crt -days 2 -extfile hostd.ext
)");
    std::ofstream(dir_ + "/certs.sh") << script;
    ok_ = std::system(absl::StrCat("sh '", dir_, "/certs.sh' > '", dir_, "/certs.log' 2>&1").c_str()) == 0;
    token_ = Token("token", "node-token-0123456789abcdef0123456789");
    wrong_ = Token("wrong", "wrong-token-0123456789abcdef012345678");
    WriteTinyDataset(dir_ + "/data", 64, 60, 64, 3);
  }
  ~TwoMachines() {
    for (int i = 0; i < 2; ++i) Stop(i);
  }
  bool ok() const { return ok_; }
  const std::string& dir() const { return dir_; }
  std::string Address(int i) const { return absl::StrCat(net_.address(i), ":", kPort); }

  // Node i's hostd (TLS, token) and one CPU worker, in namespace i; `peer_token`: what it presents to
  // the other node's hostd.
  void Start(int i, const std::string& peer_token) {
    const std::string nd = absl::StrCat(dir_, "/node", i);
    fs::create_directories(nd);
    auto hostd = client::SpawnProcess(
        {Ip(), "netns", "exec", net_.name(i), BuildDir() + "/bin/slidedp-hostd", "--listen", Address(i), "--node-name",
         absl::StrCat("nn", getpid(), "x", i), "--tls-cert", dir_ + "/hostd.crt", "--tls-key", dir_ + "/hostd.key",
         "--auth-token-file", token_, "--peer-tls-ca", dir_ + "/ca.crt", "--peer-token-file", peer_token,
         "--node-address", net_.address(i), "--state-dir", nd + "/state", "--output-root", nd, "--update-threads", "2",
         "--worker-wait-s", "20"},
        nd + "/hostd.log");
    hostd_[i] = hostd.ok() ? *hostd : -1;
    for (int t = 0; t < 100 && Cli(i, "health") != 0; ++t) absl::SleepFor(absl::Milliseconds(100));
    auto worker = client::SpawnProcess({Ip(), "netns", "exec", net_.name(i), BuildDir() + "/bin/slidedp-worker",
                                        "--hostd", Address(i), "--backend", "cpu", "--tls-ca", dir_ + "/ca.crt",
                                        "--token-file", token_},
                                       nd + "/worker.log");
    worker_[i] = worker.ok() ? *worker : -1;
    for (int t = 0; t < 100 && !absl::StrContains(CliOut(i, "workers"), "cpu0"); ++t) {
      absl::SleepFor(absl::Milliseconds(100));
    }
  }
  void Stop(int i) {
    NodeHarness::KillAndReap(worker_[i], SIGTERM);
    NodeHarness::KillAndReap(hostd_[i], SIGTERM);
    worker_[i] = hostd_[i] = -1;
  }

  // The CLI in namespace i against node i's hostd; its exit code (output in *out).
  int Cli(int i, const std::string& args, std::string* out = nullptr) {
    const std::string log = absl::StrCat(dir_, "/cli", counter_++, ".log");
    const int rc = std::system(absl::StrCat("ip netns exec ", net_.name(i), " '", BuildDir(), "/bin/slidedp' --hostd ",
                                            Address(i), " --tls-ca '", dir_, "/ca.crt' --token-file '", token_, "' ",
                                            args, " > '", log, "' 2>&1")
                                   .c_str());
    if (out != nullptr) *out = ReadFile(log);
    return WIFEXITED(rc) ? WEXITSTATUS(rc) : -1;
  }
  std::string CliOut(int i, const std::string& args) {
    std::string out;
    Cli(i, args, &out);
    return out;
  }
  const std::string& token() const { return token_; }
  const std::string& wrong() const { return wrong_; }

 private:
  std::string Token(const std::string& name, const std::string& value) {
    const std::string path = dir_ + "/" + name;
    std::ofstream(path) << value << "\n";
    ::chmod(path.c_str(), 0600);
    return path;
  }
  const NetnsPair& net_;
  std::string dir_, token_, wrong_;
  bool ok_ = false;
  int hostd_[2] = {-1, -1}, worker_[2] = {-1, -1};
  int counter_ = 0;
};

TEST(MultiNodeNetns, TwoHostdsOverTlsWithPeerAuthentication) {
  NetnsPair net("m", "10.78.0");
  if (!net.ok()) GTEST_SKIP() << "network namespaces need root and `ip`";
  TwoMachines m(net);
  ASSERT_TRUE(m.ok()) << ReadFile(m.dir() + "/certs.log");
  m.Start(0, m.token());
  m.Start(1, m.token());
  const std::string spec = absl::StrCat(
      "name: mnn\nmodel: {preset: tiny, init_seed: 5}\ndata: {path: ", m.dir(), "/data}\noutput: {dir: out}\n",
      "train: {seq_len: 64, global_batch: 4, micro_batch: 1, steps: 3, seed: 1}\n",
      "runtime: {workers: 1, step_timeout_ms: 20000, nodes: [\"", m.Address(0), "\", \"", m.Address(1), "\"]}\n");
  std::ofstream(m.dir() + "/job.yaml") << spec;
  std::string out;
  ASSERT_EQ(m.Cli(0, "submit " + m.dir() + "/job.yaml --id over-tls", &out), 0) << out;
  EXPECT_TRUE(fs::exists(m.dir() + "/node0/out/checkpoint-3/model.safetensors")) << out;
  EXPECT_FALSE(fs::exists(m.dir() + "/node1/out"));
  EXPECT_THAT(m.CliOut(1, "status over-tls"), HasSubstr("succeeded"));

  // Node 1 comes back presenting a token node 0 does not take: a job it coordinates cannot join node 0.
  m.Stop(1);
  m.Start(1, m.wrong());
  EXPECT_NE(m.Cli(1, "submit " + m.dir() + "/job.yaml --id refused --detach", &out), 0);
  EXPECT_THAT(out, HasSubstr("PERMISSION_DENIED"));
  EXPECT_THAT(out, HasSubstr("runtime.nodes[0]"));
}

}  // namespace
}  // namespace slidedp::testing
