// Two "nodes" on one machine for the multi-node tests (docs/multi-node.md): network namespaces
// joined by a veth pair with private addresses <subnet>.1 and <subnet>.2, each with its loopback up.
// Making them needs root and `ip`; ok() says whether it worked (tests skip otherwise).
#pragma once

#include <fcntl.h>
#include <sched.h>
#include <unistd.h>

#include <cstdlib>
#include <string>

namespace slidedp::testing {

class NetnsPair {
 public:
  // `tag`: a few letters that keep concurrent tests' namespaces and links apart; `subnet`: the
  // first three octets of the pair's /24 ("10.77.0").
  NetnsPair(const std::string& tag, const std::string& subnet) : subnet_(subnet) {
    const std::string id = tag + std::to_string(getpid() % 100000);
    names_[0] = "sd" + id + "a";
    names_[1] = "sd" + id + "b";
    const std::string va = "v" + id + "a", vb = "v" + id + "b";
    ok_ = geteuid() == 0 && Run("ip netns add " + names_[0]) && Run("ip netns add " + names_[1]) &&
          Run("ip link add " + va + " type veth peer name " + vb) && Run("ip link set " + va + " netns " + names_[0]) &&
          Run("ip link set " + vb + " netns " + names_[1]) &&
          Run("ip -n " + names_[0] + " addr add " + address(0) + "/24 dev " + va) &&
          Run("ip -n " + names_[1] + " addr add " + address(1) + "/24 dev " + vb) &&
          Run("ip -n " + names_[0] + " link set " + va + " up") && Run("ip -n " + names_[1] + " link set " + vb + " up") &&
          Run("ip -n " + names_[0] + " link set lo up") && Run("ip -n " + names_[1] + " link set lo up");
  }
  ~NetnsPair() {
    for (const std::string& n : names_) Run("ip netns del " + n);
  }
  NetnsPair(const NetnsPair&) = delete;
  NetnsPair& operator=(const NetnsPair&) = delete;

  bool ok() const { return ok_; }
  const std::string& name(int i) const { return names_[i]; }
  std::string address(int i) const { return subnet_ + (i == 0 ? ".1" : ".2"); }
  // Moves the calling process (a forked child) into namespace i.
  bool Enter(int i) const {
    const int fd = open(("/run/netns/" + names_[i]).c_str(), O_RDONLY | O_CLOEXEC);
    if (fd < 0) return false;
    const bool entered = setns(fd, CLONE_NEWNET) == 0;
    close(fd);
    return entered;
  }

 private:
  static bool Run(const std::string& cmd) { return std::system((cmd + " > /dev/null 2>&1").c_str()) == 0; }
  std::string subnet_;
  std::string names_[2];
  bool ok_ = false;
};

}  // namespace slidedp::testing
