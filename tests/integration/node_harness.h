// NodeHarness: a real slidedp-hostd and real slidedp-worker processes (CPU backend) on a private
// Unix socket, for integration tests. Binaries come from $SLIDEDP_BUILD_DIR/bin.
#pragma once

#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "client/cli/client.h"
#include "client/cli/embedded.h"
#include "common/data/synthetic.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"

namespace slidedp::testing {

// The whole file (empty if it cannot be read).
inline std::string ReadFile(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(f), {});
}

inline std::string BuildDir() {
  const char* b = getenv("SLIDEDP_BUILD_DIR");
  return b ? b : "build";
}

// Whether something accepts connections at `address` ("unix:PATH" or "127.0.0.1:PORT") now.
inline bool Accepts(const std::string& address) {
  const bool unix_socket = address.rfind("unix:", 0) == 0;
  const int fd = ::socket(unix_socket ? AF_UNIX : AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return false;
  int rc = -1;
  if (unix_socket) {
    sockaddr_un addr{};
    addr.sun_family = AF_UNIX;
    const std::string path = address.substr(5);
    if (path.size() < sizeof(addr.sun_path)) {
      std::memcpy(addr.sun_path, path.c_str(), path.size() + 1);
      rc = ::connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr));
    }
  } else {
    sockaddr_in addr{};
    addr.sin_family = AF_INET;
    addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    addr.sin_port = htons(static_cast<uint16_t>(std::atoi(address.substr(address.rfind(':') + 1).c_str())));
    rc = ::connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr));
  }
  ::close(fd);
  return rc == 0;
}

// Waits up to `timeout_s` until `address` accepts. A gRPC call made before hostd listens waits
// out its whole deadline (seconds), so the harness asks the socket first.
inline bool WaitAccepts(const std::string& address, double timeout_s) {
  const absl::Time deadline = absl::Now() + absl::Seconds(timeout_s);
  while (!Accepts(address)) {
    if (absl::Now() > deadline) return false;
    absl::SleepFor(absl::Milliseconds(20));
  }
  return true;
}

// A process's open file descriptors (/proc/PID/fd) and resident memory (VmRSS, KiB); -1 when
// they cannot be read.
inline int64_t OpenFdCount(int pid) {
  std::error_code ec;
  int64_t n = 0;
  for (std::filesystem::directory_iterator it(absl::StrCat("/proc/", pid, "/fd"), ec), end; !ec && it != end;
       it.increment(ec)) {
    ++n;
  }
  return ec ? -1 : n;
}

inline int64_t ResidentKb(int pid) {
  std::ifstream in(absl::StrCat("/proc/", pid, "/status"));
  std::string key;
  while (in >> key) {
    if (key == "VmRSS:") {
      int64_t kb = -1;
      in >> kb;
      return kb;
    }
  }
  return -1;
}

// A learnable synthetic dataset for the tiny preset (vocabulary 512) in `dir`, replacing one there:
// `documents` documents of 8 to `max_doc_tokens` tokens, packed in rows of `seq_len`.
inline void WriteTinyDataset(const std::string& dir, int documents, int max_doc_tokens, int seq_len, uint64_t seed) {
  data::SyntheticOptions o;
  o.vocab_size = 512;
  o.num_documents = documents;
  o.seed = seed;
  o.min_doc_tokens = 8;
  o.max_doc_tokens = max_doc_tokens;
  o.seq_len = seq_len;
  o.overwrite = data::Overwrite::kYes;
  auto m = data::WriteSyntheticDataset(dir, o);
  EXPECT_TRUE(m.ok()) << m.status();
}

class NodeHarness {
 public:
  // Starts hostd (with extra args) and `workers` CPU workers; waits until they are attached.
  explicit NodeHarness(int workers, std::vector<std::string> hostd_args = {}, std::vector<std::string> worker_env = {}) {
    static int counter = 0;
    node_ = absl::StrCat("it", getpid(), "x", counter++);
    dir_ = absl::StrCat(::testing::TempDir(), "/", node_);
    // A run before whose pid was the same left its logs, jobs and state here (kept for reading
    // after a failure): a node starts from nothing, or its hostd finds that run's jobs.
    std::filesystem::remove_all(dir_);
    std::filesystem::create_directories(dir_);
    address_ = absl::StrCat("unix:", dir_, "/hostd.sock");
    hostd_args_ = std::move(hostd_args);
    StartHostd();
    client::ClientOptions o;
    o.address = address_;
    client_ = std::make_unique<client::Client>(o);
    EXPECT_TRUE(client_->WaitReady(20).ok());
    worker_env_ = std::move(worker_env);
    for (int i = 0; i < workers; ++i) AddWorker();
    WaitWorkers(workers);
  }
  ~NodeHarness() {
    for (int pid : worker_pids_) KillAndReap(pid, SIGTERM);
    if (hostd_pid_ > 0) KillAndReap(hostd_pid_, SIGTERM);
  }

  // Starts hostd (again: same node name, socket and state dir, as after a crash or upgrade).
  void StartHostd() {
    std::vector<std::string> args = {BuildDir() + "/bin/slidedp-hostd", "--listen", address_, "--node-name", node_,
                                     "--worker-wait-s", "20", "--update-threads", "2", "--state-dir", dir_ + "/state",
                                     // The tests' relative output dirs land in their own directory,
                                     // and the absolute ones they use lie below it.
                                     "--output-root", dir_};
    args.insert(args.end(), hostd_args_.begin(), hostd_args_.end());
    auto pid = client::SpawnProcess(args, absl::StrCat(dir_, "/hostd", hostd_starts_++, ".log"));
    EXPECT_TRUE(pid.ok()) << pid.status();
    hostd_pid_ = pid.ok() ? *pid : -1;
    WaitAccepts(address_, 20);
  }

  void AddWorker() {
    int index = static_cast<int>(worker_pids_.size());
    std::vector<std::string> args = {"/usr/bin/env"};
    args.insert(args.end(), worker_env_.begin(), worker_env_.end());
    for (const std::string& a : {BuildDir() + "/bin/slidedp-worker", std::string("--hostd"), address_, std::string("--backend"),
                                 std::string("cpu"), std::string("--index"), std::to_string(index)}) {
      args.push_back(a);
    }
    auto pid = client::SpawnProcess(args, absl::StrCat(dir_, "/worker", index, ".log"));
    EXPECT_TRUE(pid.ok()) << pid.status();
    worker_pids_.push_back(pid.ok() ? *pid : -1);
  }

  void WaitWorkers(int n) {
    absl::Time deadline = absl::Now() + absl::Seconds(30);
    while (absl::Now() < deadline) {
      auto ws = client_->Workers();
      if (ws.ok() && static_cast<int>(ws->size()) == n) return;
      absl::SleepFor(absl::Milliseconds(50));
    }
    ADD_FAILURE() << n << " workers did not attach; logs in " << dir_;
  }

  static void KillAndReap(int pid, int sig) {
    if (pid <= 0) return;
    kill(pid, sig);
    absl::Time deadline = absl::Now() + absl::Seconds(10);
    while (waitpid(pid, nullptr, WNOHANG) == 0) {
      if (absl::Now() > deadline) {
        kill(pid, SIGKILL);
        waitpid(pid, nullptr, 0);
        return;
      }
      absl::SleepFor(absl::Milliseconds(10));
    }
  }

  // Submits a spec and waits for a final state.
  absl::StatusOr<v1::Job> RunJob(const std::string& spec_yaml, const std::string& job_id, double timeout_s = 120,
                                 const std::string& resume = "") {
    v1::SubmitJobRequest req;
    req.set_job_id(job_id);
    req.set_spec_yaml(spec_yaml);
    req.set_base_dir(dir_);
    req.set_resume_from(resume);
    auto resp = client_->Submit(req);
    if (!resp.ok()) return resp.status();
    return WaitFinal(job_id, timeout_s);
  }

  absl::StatusOr<v1::Job> WaitFinal(const std::string& job_id, double timeout_s) {
    absl::Time deadline = absl::Now() + absl::Seconds(timeout_s);
    while (absl::Now() < deadline) {
      auto j = client_->GetJob(job_id);
      if (!j.ok()) return j.status();
      if (j->state() == v1::JOB_STATE_SUCCEEDED || j->state() == v1::JOB_STATE_FAILED ||
          j->state() == v1::JOB_STATE_CANCELLED) {
        return j;
      }
      absl::SleepFor(absl::Milliseconds(20));
    }
    return absl::DeadlineExceededError(absl::StrCat("job ", job_id, " did not finish in ", timeout_s, " s; logs in ", dir_));
  }

  // Segments of this node still in /dev/shm, except the one state segment hostd pools for the
  // next job (PooledSegments).
  std::vector<std::string> LeakedSegments() const {
    std::vector<std::string> out;
    for (const std::string& n : Segments()) {
      if (n != PoolName()) out.push_back(n);
    }
    return out;
  }
  std::vector<std::string> PooledSegments() const {
    std::vector<std::string> out;
    for (const std::string& n : Segments()) {
      if (n == PoolName()) out.push_back(n);
    }
    return out;
  }
  std::vector<std::string> Segments() const {
    std::vector<std::string> out;
    for (const auto& e : std::filesystem::directory_iterator("/dev/shm")) {
      std::string n = e.path().filename().string();
      if (n.rfind(absl::StrCat("slidedp.", node_, "."), 0) == 0) out.push_back(n);
    }
    return out;
  }
  std::string PoolName() const { return absl::StrCat("slidedp.", node_, ".pool.pooled"); }

  client::Client& client() { return *client_; }
  const std::string& dir() const { return dir_; }
  const std::string& node() const { return node_; }
  const std::string& address() const { return address_; }
  int hostd_pid() const { return hostd_pid_; }
  std::vector<int>& worker_pids() { return worker_pids_; }

 private:
  std::string node_, dir_, address_;
  int hostd_pid_ = -1;
  std::vector<int> worker_pids_;
  std::vector<std::string> worker_env_;
  std::vector<std::string> hostd_args_;
  int hostd_starts_ = 0;
  std::unique_ptr<client::Client> client_;
};

// Runs a job to its end (3 minutes at most) and expects it to succeed; its record (empty if the
// submit failed).
inline v1::Job MustSucceed(NodeHarness& node, const std::string& spec, const std::string& id, const std::string& resume = "") {
  auto j = node.RunJob(spec, id, 180, resume);
  EXPECT_TRUE(j.ok()) << j.status();
  if (!j.ok()) return {};
  EXPECT_EQ(j->state(), v1::JOB_STATE_SUCCEEDED) << j->error() << " (logs in " << node.dir() << ")";
  return *j;
}

// The metrics JSONL lines of a job (<node dir>/<output>/metrics-<job>.jsonl), in file order.
inline std::vector<nlohmann::json> MetricsLines(const NodeHarness& node, const std::string& output,
                                                const std::string& job) {
  std::vector<nlohmann::json> out;
  std::ifstream in(node.dir() + "/" + output + "/metrics-" + job + ".jsonl");
  for (std::string line; std::getline(in, line);) out.push_back(nlohmann::json::parse(line));
  return out;
}

}  // namespace slidedp::testing
