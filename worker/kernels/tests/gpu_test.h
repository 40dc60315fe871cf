// The gtest side of the GPU kernel checks (the *_gpu_test binaries, ctest label gpu): the fixture
// every case derives from, which fails the case when there is no CUDA device (these tests run only
// on purpose, with ctest -L gpu, so a missing GPU must not pass as a skip), reseeds the random
// inputs and checks the device for errors afterwards; the relative-error expectation; and
// ASSERT_OK / ASSERT_CUDA_OK for setup calls.
#pragma once

#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "gtest/gtest.h"
#include "worker/kernels/tests/kernel_test_util.h"

#define ASSERT_OK(expr)                                                         \
  do {                                                                          \
    const absl::Status slidedp_st_ = (expr);                                    \
    ASSERT_TRUE(slidedp_st_.ok()) << #expr << " -> " << slidedp_st_.ToString(); \
  } while (0)

#define ASSERT_CUDA_OK(expr)                                                                     \
  do {                                                                                           \
    const cudaError_t slidedp_err_ = (expr);                                                     \
    ASSERT_EQ(slidedp_err_, cudaSuccess) << #expr << " -> " << cudaGetErrorString(slidedp_err_); \
  } while (0)

namespace slidedp::kernel_test {

// The seed of this process's random inputs: SLIDEDP_TEST_SEED when set (to repeat a failing run),
// else drawn once per process. Every case starts from it.
inline uint64_t TestSeed() {
  static const uint64_t seed = [] {
    const char* e = std::getenv("SLIDEDP_TEST_SEED");
    return e != nullptr && *e != '\0' ? std::strtoull(e, nullptr, 10) : std::random_device{}();
  }();
  return seed;
}

class GpuTest : public ::testing::Test {
 protected:
  void SetUp() override {
    int devices = 0;
    const cudaError_t e = cudaGetDeviceCount(&devices);
    if (e != cudaSuccess || devices == 0) {
      GTEST_FAIL() << "no CUDA device (cudaGetDeviceCount: " << (e == cudaSuccess ? "0 devices" : cudaGetErrorString(e))
                   << "): the *_gpu_test binaries check kernels on a GPU and fail without one; CI runs ctest -LE gpu";
    }
    static const bool printed = [] {
      cudaDeviceProp prop{};
      if (cudaGetDeviceProperties(&prop, 0) == cudaSuccess) {
        std::printf("cuda device 0: %s (sm_%d%d)\n", prop.name, prop.major, prop.minor);
      }
      return true;
    }();
    (void)printed;
    Rng().seed(TestSeed());
    RecordProperty("seed", std::to_string(TestSeed()));
    std::printf("seed %llu (SLIDEDP_TEST_SEED=%llu repeats it)\n", static_cast<unsigned long long>(TestSeed()),
                static_cast<unsigned long long>(TestSeed()));
  }
  // A kernel fault shows here at the latest (asynchronous errors surface at a synchronize).
  void TearDown() override {
    if (HasFatalFailure()) return;
    const cudaError_t e = cudaDeviceSynchronize();
    EXPECT_EQ(e, cudaSuccess) << "device error at the end of the case: " << cudaGetErrorString(e);
  }
};

// got against ref by relative L2 error (RelErr; any NaN in got fails), with a PASS/FAIL line per
// comparison as cuda_kernel_check printed it: name, error, tolerance, element count.
inline void ExpectRelErr(const std::string& name, const std::vector<double>& got, const std::vector<double>& ref,
                         double tol) {
  const double err = got.size() == ref.size() ? RelErr(got, ref) : INFINITY;
  const bool ok = err <= tol;
  std::printf("%s  %-58s rel_err=%.3e tol=%.1e n=%zu\n", ok ? "PASS" : "FAIL", name.c_str(), err, tol, got.size());
  EXPECT_LE(err, tol) << name << ": relative error over " << got.size() << " elements (reference has " << ref.size()
                      << ")";
}

}  // namespace slidedp::kernel_test
