// `slidedp submit --nodes`: Slurm hostlists, node files, comma lists, and the spec they go into.
#include "common/jobspec/node_list.h"

#include <fstream>

#include "absl/strings/str_cat.h"
#include "common/jobspec/job_spec.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace slidedp {
namespace {

using ::testing::ElementsAre;

TEST(Hostlist, ExpandsSlurmsSyntax) {
  EXPECT_THAT(*ExpandHostlist("gpu[01-03,07],login-a"), ElementsAre("gpu01", "gpu02", "gpu03", "gpu07", "login-a"));
  EXPECT_THAT(*ExpandHostlist("n[8-10]"), ElementsAre("n8", "n9", "n10"));
  EXPECT_THAT(*ExpandHostlist("n[08-10]"), ElementsAre("n08", "n09", "n10"));
  EXPECT_THAT(*ExpandHostlist("r[1-2]-n[1-2].ib"), ElementsAre("r1-n1.ib", "r1-n2.ib", "r2-n1.ib", "r2-n2.ib"));
  EXPECT_THAT(*ExpandHostlist(" solo "), ElementsAre("solo"));
  for (const char* bad : {"", "n[1-3", "n1-3]", "n[3-1]", "n[a-b]", "n[1--2]", "a,,b", "n[0-100000]", "n[0-70]",
                          "a[1-9]b[1-9]"}) {
    EXPECT_EQ(ExpandHostlist(bad).status().code(), absl::StatusCode::kInvalidArgument) << bad;
  }
}

TEST(NodesArgument, SlurmFileAndList) {
  EXPECT_THAT(*NodesFromArgument("slurm", 7070, "gpu[1-2]"), ElementsAre("gpu1:7070", "gpu2:7070"));
  EXPECT_EQ(NodesFromArgument("slurm", 7070, nullptr).status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(NodesFromArgument("slurm", 0, "gpu[1-2]").status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(*NodesFromArgument("a:1, b:2", 0, nullptr), ElementsAre("a:1", "b:2"));
  EXPECT_THAT(*NodesFromArgument("a,[fd00::2]", 9, nullptr), ElementsAre("a:9", "[fd00::2]:9"));
  EXPECT_THAT(*NodesFromArgument("unix:/run/a.sock,10.0.0.2:5", 0, nullptr),
              ElementsAre("unix:/run/a.sock", "10.0.0.2:5"));
  EXPECT_EQ(NodesFromArgument("a,b", 0, nullptr).status().code(), absl::StatusCode::kInvalidArgument);  // no port
  EXPECT_EQ(NodesFromArgument("a:1", 0, nullptr).status().code(), absl::StatusCode::kInvalidArgument);  // one node
  EXPECT_EQ(NodesFromArgument("a:1,b c:2", 0, nullptr).status().code(), absl::StatusCode::kInvalidArgument);
  const std::string file = ::testing::TempDir() + "/nodes.txt";
  std::ofstream(file) << "# the job's nodes\nnode-a:7070\n\n  node-b   # the second\n";
  EXPECT_THAT(*NodesFromArgument("@" + file, 7071, nullptr), ElementsAre("node-a:7070", "node-b:7071"));
  EXPECT_EQ(NodesFromArgument("@/nonexistent/nodes", 1, nullptr).status().code(), absl::StatusCode::kNotFound);
}

TEST(NodesArgument, GoIntoTheSpec) {
  const std::string spec =
      "name: t\nmodel: {preset: tiny}\ndata: {path: d}\ntrain: {seq_len: 64, global_batch: 4, steps: 1}\n"
      "runtime: {workers: 1, nodes: [x:1, y:2]}\n";
  auto with = SpecWithNodes(spec, {"a:1", "b:2"});
  ASSERT_TRUE(with.ok()) << with.status();
  auto parsed = JobSpec::Parse(*with, "/base", JobSpec::FileCheck::kSkip);
  ASSERT_TRUE(parsed.ok()) << parsed.status();
  EXPECT_THAT(parsed->runtime.nodes, ElementsAre("a:1", "b:2"));
  EXPECT_EQ(parsed->runtime.workers, 1);
  EXPECT_TRUE(SpecWithNodes("name: t\n", {"a:1", "b:2"}).ok());  // no runtime yet
  EXPECT_EQ(SpecWithNodes("- a\n- b\n", {"a:1"}).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(SpecWithNodes("runtime: 3\n", {"a:1"}).status().code(), absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace slidedp
