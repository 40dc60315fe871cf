// AuthorizeCall without gRPC: which calls pass, and that refusals never quote a token.
#include "hostd/service/client_auth.h"

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace slidedp::hostd {
namespace {

using ::testing::HasSubstr;
using ::testing::Not;

constexpr char kToken[] = "s3cret-token-0123456789abcdef";
constexpr char kSubmit[] = "/slidedp.v1.JobService/SubmitJob";
constexpr auto kDenied = absl::StatusCode::kPermissionDenied;

ClientAuthPolicy TokenOnly() {
  ClientAuthPolicy p;
  p.token = kToken;
  return p;
}

ClientAuthPolicy CertificatesOnly() {
  ClientAuthPolicy p;
  p.certificates = ClientAuthPolicy::Certificates::kAccepted;
  return p;
}

TEST(AuthorizeCall, HealthIsOpen) {
  for (const ClientAuthPolicy& p : {TokenOnly(), CertificatesOnly()}) {
    EXPECT_TRUE(AuthorizeCall(p, "/grpc.health.v1.Health/Check", false, std::nullopt).ok());
    EXPECT_TRUE(AuthorizeCall(p, "/grpc.health.v1.Health/Watch", false, std::nullopt).ok());
    // Not a prefix trick: another service whose name starts alike is not health.
    EXPECT_EQ(AuthorizeCall(p, "/grpc.health.v1.HealthX/Check", false, std::nullopt).code(), kDenied);
  }
}

TEST(AuthorizeCall, TokenMustMatch) {
  const ClientAuthPolicy p = TokenOnly();
  EXPECT_TRUE(AuthorizeCall(p, kSubmit, false, "Bearer s3cret-token-0123456789abcdef").ok());
  for (const char* presented : {"Bearer wrong", "Bearer s3cret-token-0123456789abcde", "Bearer ", "s3cret-token",
                                "Basic s3cret-token-0123456789abcdef", "bearer s3cret-token-0123456789abcdef"}) {
    absl::Status s = AuthorizeCall(p, kSubmit, false, absl::string_view(presented));
    EXPECT_EQ(s.code(), kDenied) << presented;
    EXPECT_THAT(std::string(s.message()), Not(HasSubstr("s3cret"))) << presented;
    EXPECT_THAT(std::string(s.message()), HasSubstr("--auth-token-file"));
  }
  absl::Status none = AuthorizeCall(p, kSubmit, false, std::nullopt);
  EXPECT_EQ(none.code(), kDenied);
  EXPECT_THAT(std::string(none.message()), HasSubstr("requires client authentication"));
  // A verified certificate does not count where the listener accepts none.
  EXPECT_EQ(AuthorizeCall(p, kSubmit, true, std::nullopt).code(), kDenied);
  EXPECT_EQ(AuthorizeCall(p, "/slidedp.v1.WorkerService/Session", false, std::nullopt).code(), kDenied);
  EXPECT_EQ(AuthorizeCall(p, "", false, std::nullopt).code(), kDenied);
}

TEST(AuthorizeCall, VerifiedCertificateOrToken) {
  EXPECT_TRUE(AuthorizeCall(CertificatesOnly(), kSubmit, true, std::nullopt).ok());
  absl::Status s = AuthorizeCall(CertificatesOnly(), kSubmit, false, absl::string_view("Bearer anything-at-all-here"));
  EXPECT_EQ(s.code(), kDenied);
  EXPECT_THAT(std::string(s.message()), HasSubstr("accepts no bearer token"));
  ClientAuthPolicy both = TokenOnly();
  both.certificates = ClientAuthPolicy::Certificates::kAccepted;
  EXPECT_TRUE(AuthorizeCall(both, kSubmit, true, std::nullopt).ok());
  EXPECT_TRUE(AuthorizeCall(both, kSubmit, false, "Bearer s3cret-token-0123456789abcdef").ok());
  absl::Status neither = AuthorizeCall(both, kSubmit, false, std::nullopt);
  EXPECT_THAT(std::string(neither.message()), HasSubstr("--tls-client-ca"));
  EXPECT_THAT(std::string(neither.message()), HasSubstr("--auth-token-file"));
}

}  // namespace
}  // namespace slidedp::hostd
