// NodeLock: one holder per node name; the holder unlinks its file when it lets go, and a lock
// taken on a file that was replaced meanwhile is not a lock.
#include "hostd/daemon/node_lock.h"

#include <fcntl.h>
#include <sys/file.h>
#include <unistd.h>

#include <filesystem>
#include <optional>
#include <string>

#include "gtest/gtest.h"

namespace slidedp::hostd {
namespace {

TEST(NodeLock, OneHolderAndTheFileGoesWithIt) {
  const std::string dir = ::testing::TempDir() + "/node-lock-" + std::to_string(getpid());
  std::filesystem::create_directories(dir);
  const std::string path = dir + "/slidedp-n1.lock";
  {
    absl::StatusOr<NodeLock> a = NodeLock::Acquire("n1", dir);
    ASSERT_TRUE(a.ok()) << a.status();
    EXPECT_EQ(a->path(), path);
    absl::StatusOr<NodeLock> b = NodeLock::Acquire("n1", dir);
    EXPECT_EQ(b.status().code(), absl::StatusCode::kAlreadyExists) << b.status();
    EXPECT_NE(b.status().message().find(std::to_string(getpid())), std::string::npos) << b.status();
    EXPECT_TRUE(NodeLock::Acquire("n2", dir).ok());  // another node
    EXPECT_TRUE(std::filesystem::exists(path));
  }
  EXPECT_FALSE(std::filesystem::exists(path));  // no lock files pile up
  // A file another process left (a crashed holder: the kernel dropped its lock) is taken over.
  const int stale = ::open(path.c_str(), O_RDWR | O_CREAT, 0600);
  ASSERT_GE(stale, 0);
  ::close(stale);
  std::optional<NodeLock> again;
  {
    absl::StatusOr<NodeLock> c = NodeLock::Acquire("n1", dir);
    ASSERT_TRUE(c.ok()) << c.status();
    again.emplace(*std::move(c));
  }
  // Held across a move: still refused to others.
  EXPECT_EQ(NodeLock::Acquire("n1", dir).status().code(), absl::StatusCode::kAlreadyExists);
  again.reset();
  EXPECT_FALSE(std::filesystem::exists(path));
  std::filesystem::remove_all(dir);
}

}  // namespace
}  // namespace slidedp::hostd
