// Load: 50 tiny jobs submitted back to back on a warm hostd with two CPU workers, every fifth
// cancelled (queued or running). All must reach a final state, nothing may stay in /dev/shm, and
// hostd's open files and resident memory must stay within stated bounds. Also reports the
// submit-to-first-step time of the first (cold) and later (warm) jobs.
#include <fstream>

#include "common/data/synthetic.h"
#include "tests/integration/node_harness.h"

namespace slidedp::testing {
namespace {

TEST(Load, FiftyJobsWithCancellationsLeakNothing) {
  std::string data = ::testing::TempDir() + "/load-data-" + std::to_string(getpid());
  data::SyntheticOptions so;
  so.vocab_size = 512;
  so.num_documents = 64;
  so.seq_len = 32;
  so.max_doc_tokens = 40;
  so.overwrite = data::Overwrite::kYes;
  ASSERT_TRUE(data::WriteSyntheticDataset(data, so).ok());
  NodeHarness node(2);
  auto spec = [&](int steps) {
    return absl::StrCat("name: load\nmodel: {preset: tiny}\ndata: {path: ", data, "}\n",
                        "output: {dir: out-load, save_final: false}\n",
                        "train: {seq_len: 32, global_batch: 4, micro_batch: 1, steps: ", steps, "}\n",
                        "runtime: {step_timeout_ms: 20000}\n");
  };
  int64_t fds_warm = 0, rss_warm = 0;
  std::vector<double> first_step_s;
  for (int i = 0; i < 50; ++i) {
    const std::string id = absl::StrCat("load-", i);
    v1::SubmitJobRequest req;
    req.set_job_id(id);
    req.set_spec_yaml(spec(i % 5 == 4 ? 1000 : 3));
    req.set_base_dir(node.dir());
    ASSERT_TRUE(node.client().Submit(req).ok()) << id;
    if (i % 10 == 4) {
      ASSERT_TRUE(node.client().Cancel(id).ok());  // most likely still queued or starting
    } else if (i % 10 == 9) {
      absl::SleepFor(absl::Milliseconds(100));  // running by now
      ASSERT_TRUE(node.client().Cancel(id).ok());
    }
    if (i % 5 != 4) {
      auto j = node.WaitFinal(id, 60);
      ASSERT_TRUE(j.ok()) << j.status();
      EXPECT_EQ(j->state(), v1::JOB_STATE_SUCCEEDED) << id << ": " << j->error();
      first_step_s.push_back(j->submit_to_first_step_s());
    }
    if (i == 9) {
      fds_warm = OpenFdCount(node.hostd_pid());
      rss_warm = ResidentKb(node.hostd_pid());
    }
  }
  for (int i = 0; i < 50; ++i) {
    auto j = node.WaitFinal(absl::StrCat("load-", i), 60);
    ASSERT_TRUE(j.ok()) << j.status();
    if (i % 5 == 4) {
      EXPECT_EQ(j->state(), v1::JOB_STATE_CANCELLED) << i << ": " << j->error();
    }
  }
  EXPECT_TRUE(node.LeakedSegments().empty());
  EXPECT_LE(node.PooledSegments().size(), 1u);  // hostd keeps at most one state segment for reuse
  const int64_t fds_end = OpenFdCount(node.hostd_pid());
  const int64_t rss_end = ResidentKb(node.hostd_pid());
  std::cout << "hostd after 10 jobs: " << fds_warm << " fds, " << rss_warm / 1024 << " MiB RSS; after 50: " << fds_end
            << " fds, " << rss_end / 1024 << " MiB RSS\n";
  std::cout << "submit to first step: first job " << first_step_s.front() << " s, last job " << first_step_s.back()
            << " s\n";
  // Bounds: no descriptor per job survives; memory may grow by job records only (a few KB each).
  EXPECT_LE(fds_end - fds_warm, 4);
  EXPECT_LE(rss_end - rss_warm, 64 * 1024);
  auto ws = node.client().Workers();
  ASSERT_TRUE(ws.ok());
  EXPECT_EQ(ws->size(), 2u);  // both workers stayed attached through all of it
}

}  // namespace
}  // namespace slidedp::testing
