// The output-path policy on a real directory tree: relative paths land in the root; absolute
// paths, `..` and symbolic links that leave it are refused; the opt-outs allow them.
#include "hostd/core/output_policy.h"

#include <unistd.h>

#include <filesystem>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace slidedp::hostd {
namespace {

namespace fs = std::filesystem;
using ::testing::HasSubstr;

class OutputPolicyTest : public ::testing::Test {
 protected:
  void SetUp() override {
    base_ = fs::path(::testing::TempDir()) / ("output-policy-" + std::to_string(getpid()));
    fs::remove_all(base_);
    fs::create_directories(base_ / "outside");
    fs::create_directories(base_ / "extra");
    auto p = OutputPolicy::Create((base_ / "root").string(), {}, OutputAnywhere::kNo);
    ASSERT_TRUE(p.ok()) << p.status();
    policy_ = *p;
    root_ = policy_.root;
    outside_ = fs::canonical(base_ / "outside").string();
  }
  void TearDown() override { fs::remove_all(base_); }

  absl::Status Denied(const std::string& dir) {
    auto r = ResolveOutputDir(policy_, dir);
    EXPECT_EQ(r.status().code(), absl::StatusCode::kPermissionDenied) << dir << " -> " << (r.ok() ? *r : "");
    return r.status();
  }

  fs::path base_;
  OutputPolicy policy_;
  std::string root_, outside_;
};

TEST_F(OutputPolicyTest, CreateMakesTheRootAndResolvesIt) {
  EXPECT_TRUE(fs::is_directory(root_));
  EXPECT_EQ(root_, fs::canonical(base_ / "root").string());
  fs::create_directory_symlink(base_ / "root", base_ / "root-link");
  auto via_link = OutputPolicy::Create((base_ / "root-link").string(), {}, OutputAnywhere::kNo);
  ASSERT_TRUE(via_link.ok()) << via_link.status();
  EXPECT_EQ(via_link->root, root_);
  EXPECT_EQ(OutputPolicy::Create("", {}, OutputAnywhere::kNo).status().code(), absl::StatusCode::kFailedPrecondition);
  auto missing_extra = OutputPolicy::Create(root_, {(base_ / "no-such").string()}, OutputAnywhere::kNo);
  EXPECT_EQ(missing_extra.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(std::string(missing_extra.status().message()), HasSubstr("no-such"));
}

TEST_F(OutputPolicyTest, RelativePathsLandInsideTheRoot) {
  auto r = ResolveOutputDir(policy_, "out/job");
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(*r, root_ + "/out/job");
  EXPECT_EQ(*ResolveOutputDir(policy_, "a/./b/../c/"), root_ + "/a/c");
  EXPECT_EQ(*ResolveOutputDir(policy_, "."), root_);
  EXPECT_EQ(*ResolveOutputDir(policy_, root_ + "/abs/inside"), root_ + "/abs/inside");
}

TEST_F(OutputPolicyTest, AbsolutePathsOutsideTheRootAreRefusedNamingIt) {
  absl::Status s = Denied("/etc/cron.d");
  EXPECT_THAT(std::string(s.message()), HasSubstr("outside the output root " + root_));
  static_cast<void>(Denied(outside_ + "/ckpt"));
  static_cast<void>(Denied("/"));
  static_cast<void>(Denied(root_ + "-sibling/x"));  // a prefix of the string, not a parent directory
}

TEST_F(OutputPolicyTest, DotDotEscapesAreRefused) {
  absl::Status s = Denied("../outside/x");
  EXPECT_THAT(std::string(s.message()), HasSubstr("(" + outside_ + "/x)"));
  static_cast<void>(Denied("a/../../outside"));
  static_cast<void>(Denied(root_ + "/../outside"));
  static_cast<void>(Denied("../../../../../../../../../../etc"));
}

TEST_F(OutputPolicyTest, SymbolicLinksThatLeaveTheRootAreRefused) {
  fs::create_directory_symlink(outside_, fs::path(root_) / "escape");
  absl::Status s = Denied("escape/ckpt");
  EXPECT_THAT(std::string(s.message()), HasSubstr("resolves through a symbolic link to " + outside_ + "/ckpt"));
  static_cast<void>(Denied(root_ + "/escape"));
  static_cast<void>(Denied("escape/../../outside"));  // lexically inside root/.., which is outside anyway
  // A link to a place that does not exist yet cannot be checked.
  fs::create_directory_symlink(base_ / "outside" / "later", fs::path(root_) / "dangling");
  s = Denied("dangling/ckpt");
  EXPECT_THAT(std::string(s.message()), HasSubstr("does not exist"));
  // A link that stays inside is fine, and the result names the real directory.
  fs::create_directories(fs::path(root_) / "real");
  fs::create_directory_symlink(fs::path(root_) / "real", fs::path(root_) / "alias");
  EXPECT_EQ(*ResolveOutputDir(policy_, "alias/x"), root_ + "/real/x");
}

TEST_F(OutputPolicyTest, HostileTextIsRefusedWithoutThrowing) {
  EXPECT_EQ(ResolveOutputDir(policy_, std::string("a\0b", 3)).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(ResolveOutputDir(policy_, "").status().code(), absl::StatusCode::kInvalidArgument);
  auto too_long = ResolveOutputDir(policy_, std::string(5000, 'o'));
  EXPECT_EQ(too_long.status().code(), absl::StatusCode::kFailedPrecondition) << too_long.status();
  fs::create_symlink("loop", fs::path(root_) / "loop");
  EXPECT_EQ(ResolveOutputDir(policy_, "loop/x").status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(ResolveOutputDir(OutputPolicy{}, "x").status().code(), absl::StatusCode::kFailedPrecondition);
}

TEST_F(OutputPolicyTest, ExtraRootsAndAnywhereAreTheOperatorsOptOuts) {
  auto extra = OutputPolicy::Create(root_, {(base_ / "extra").string()}, OutputAnywhere::kNo);
  ASSERT_TRUE(extra.ok()) << extra.status();
  const std::string extra_dir = fs::canonical(base_ / "extra").string();
  EXPECT_EQ(*ResolveOutputDir(*extra, extra_dir + "/ckpt"), extra_dir + "/ckpt");
  EXPECT_EQ(*ResolveOutputDir(*extra, "rel"), root_ + "/rel");  // relative still means the root
  absl::Status s = ResolveOutputDir(*extra, outside_).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kPermissionDenied);
  EXPECT_THAT(std::string(s.message()), HasSubstr("or below " + extra_dir));
  auto anywhere = OutputPolicy::Create(root_, {}, OutputAnywhere::kYes);
  ASSERT_TRUE(anywhere.ok());
  EXPECT_EQ(*ResolveOutputDir(*anywhere, outside_ + "/x"), outside_ + "/x");
  EXPECT_EQ(*ResolveOutputDir(*anywhere, "../outside/y"), outside_ + "/y");
}

}  // namespace
}  // namespace slidedp::hostd
