// Token files: mode, length and byte checks; constant-time comparison; client channel options.
#include "common/auth/bearer_token.h"

#include <sys/stat.h>

#include <fstream>

#include "common/auth/hostd_channel.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace slidedp::auth {
namespace {

using ::testing::HasSubstr;
using ::testing::Not;

constexpr char kToken[] = "0123456789abcdef0123456789abcdef";

std::string WriteToken(const std::string& name, const std::string& text, mode_t mode) {
  const std::string path = ::testing::TempDir() + "/" + name;
  std::ofstream(path, std::ios::trunc) << text;
  ::chmod(path.c_str(), mode);
  return path;
}

TEST(ReadTokenFile, ReadsOneLineFromAnOwnerOnlyFile) {
  auto t = ReadTokenFile(WriteToken("good-token", std::string(kToken) + "\n", 0600));
  ASSERT_TRUE(t.ok()) << t.status();
  EXPECT_EQ(*t, kToken);
  auto crlf = ReadTokenFile(WriteToken("crlf-token", std::string(kToken) + "\r\n", 0400));
  ASSERT_TRUE(crlf.ok()) << crlf.status();
  EXPECT_EQ(*crlf, kToken);
}

TEST(ReadTokenFile, RefusesFilesOthersMayReadOrChange) {
  for (mode_t mode : {0640, 0604, 0620, 0660, 0644}) {
    auto t = ReadTokenFile(WriteToken("open-token", kToken, mode));
    EXPECT_EQ(t.status().code(), absl::StatusCode::kPermissionDenied) << std::oct << mode;
    EXPECT_THAT(std::string(t.status().message()), HasSubstr("chmod 600"));
    EXPECT_THAT(std::string(t.status().message()), Not(HasSubstr(kToken)));
  }
}

TEST(ReadTokenFile, RefusesShortTokensOddBytesAndNonFiles) {
  EXPECT_EQ(ReadTokenFile(WriteToken("short-token", "abc\n", 0600)).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(ReadTokenFile(WriteToken("empty-token", "", 0600)).status().code(), absl::StatusCode::kInvalidArgument);
  auto spaced = ReadTokenFile(WriteToken("spaced-token", "0123456789 abcdef0123456789", 0600));
  EXPECT_EQ(spaced.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(spaced.status().message()), Not(HasSubstr("0123456789")));
  EXPECT_EQ(ReadTokenFile(WriteToken("two-lines", std::string(kToken) + "\nsecond\n", 0600)).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(ReadTokenFile(::testing::TempDir() + "/no-such-token").status().code(), absl::StatusCode::kNotFound);
  EXPECT_FALSE(ReadTokenFile("/dev/null").ok());  // mode 0666 and not a regular file
}

TEST(TokenEquals, ComparesWholeTokens) {
  EXPECT_TRUE(TokenEquals(kToken, kToken));
  EXPECT_FALSE(TokenEquals(kToken, ""));
  EXPECT_FALSE(TokenEquals(kToken, std::string(kToken).substr(0, 31)));
  EXPECT_FALSE(TokenEquals(kToken, std::string(kToken) + "0"));
  std::string last = kToken;
  last.back() = 'g';
  EXPECT_FALSE(TokenEquals(kToken, last));
  EXPECT_FALSE(TokenEquals("", "x"));
  EXPECT_TRUE(TokenEquals("", ""));
}

TEST(CreateHostdChannel, UnixSocketsNeedNoCredentialsAndTcpFilesAreChecked) {
  ClientCredentialsOptions none;
  EXPECT_TRUE(IsUnixAddress("unix:/tmp/x.sock"));
  EXPECT_FALSE(IsUnixAddress("127.0.0.1:7070"));
  ClientCredentialsOptions bad;
  bad.token_file = ::testing::TempDir() + "/no-such-token";
  EXPECT_TRUE(CreateHostdChannel("unix:/tmp/x.sock", bad).ok());  // not read for a local socket
  EXPECT_EQ(CreateHostdChannel("127.0.0.1:1", bad).status().code(), absl::StatusCode::kNotFound);
  ClientCredentialsOptions half;
  half.tls_cert_file = "/etc/hostname";
  EXPECT_EQ(CreateHostdChannel("127.0.0.1:1", half).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(CreateHostdChannel("127.0.0.1:1", none).ok());  // TLS with the system's roots
}

}  // namespace
}  // namespace slidedp::auth
