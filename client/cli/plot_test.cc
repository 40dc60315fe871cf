// `slidedp plot`: the metrics JSONL's curves (last record of a step wins, nulls and an unfinished
// last line left out, bad lines named), PNG and SVG images that hold the curves, and clear errors.
#include "client/cli/plot.h"

#include <cairo.h>
#include <unistd.h>

#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <fstream>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"

namespace slidedp::client {
namespace {

std::string Dir() {
  const std::string d = ::testing::TempDir() + "/plot-" + std::to_string(getpid());
  std::filesystem::create_directories(d);
  return d;
}

// The test's files go when the tests are done.
class RemoveDir : public ::testing::Environment {
  void TearDown() override { std::filesystem::remove_all(Dir()); }
};
::testing::Environment* const kRemoveDir = ::testing::AddGlobalTestEnvironment(new RemoveDir);

std::string Write(const std::string& name, const std::string& text) {
  const std::string path = Dir() + "/" + name;
  std::ofstream(path) << text;
  return path;
}

std::string ReadBytes(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), {});
}

// 40 steps of a decaying loss under a cosine-ish lr, a validation loss every 10 steps.
std::string Jsonl(bool with_eval) {
  std::string out;
  for (int s = 1; s <= 40; ++s) {
    out +=
        absl::StrCat(R"({"step":)", s, R"(,"loss":)", 4.0 * std::exp(-s / 15.0) + 1.0, R"(,"lr":)",
                     1e-4 * (1 + std::cos(M_PI * s / 40)) / 2,
                     with_eval && s % 10 == 0 ? absl::StrCat(R"(,"eval_loss":)", 4.2 * std::exp(-s / 15.0) + 1.1) : "",
                     R"(,"tokens_per_s":1000.5})", "\n");
  }
  return out;
}

TEST(ParseMetricsJsonl, CurvesByStep) {
  auto c = ParseMetricsJsonl(
      "{\"step\":1,\"loss\":3.0,\"lr\":1e-4}\n"
      "{\"step\":2,\"loss\":null,\"lr\":1e-4,\"skipped\":true}\n"  // a non-finite loss
      "\n"
      "{\"step\":3,\"loss\":2.5,\"lr\":2e-4,\"eval_loss\":2.75}\n"
      "{\"step\":3,\"loss\":2.25,\"lr\":2e-4}\n"  // step 3 again (resumed): the last record wins
      "{\"step\":4,\"loss\":2.0,\"l");            // being written
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->loss, (Curve{{1, 3.0}, {3, 2.25}}));
  EXPECT_EQ(c->lr, (Curve{{1, 1e-4}, {2, 1e-4}, {3, 2e-4}}));
  EXPECT_TRUE(c->eval_loss.empty());
  auto e = ParseMetricsJsonl(Jsonl(true));
  ASSERT_TRUE(e.ok()) << e.status();
  EXPECT_EQ(e->loss.size(), 40u);
  EXPECT_EQ(e->eval_loss.size(), 4u);
  EXPECT_EQ(e->eval_loss[3].first, 40);
}

TEST(ParseMetricsJsonl, BadInputIsNamed) {
  absl::Status s = ParseMetricsJsonl("{\"step\":1,\"loss\":3}\nnot json\n{\"step\":2,\"loss\":2}\n").status();
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(absl::StrContains(s.message(), "line 2: not a metrics record")) << s;
  s = ParseMetricsJsonl("[1,2]\n").status();
  EXPECT_TRUE(absl::StrContains(s.message(), "line 1")) << s;
  s = ParseMetricsJsonl("{\"step\":1,\"lr\":1e-4}\n{\"step\":2,\"loss\":null}\n").status();
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(absl::StrContains(s.message(), "no step record with a finite \"loss\"")) << s;
  EXPECT_FALSE(ParseMetricsJsonl("").ok());
}

TEST(ImageFormatOf, ByExtension) {
  EXPECT_EQ(*ImageFormatOf("a/curve.png"), ImageFormat::kPng);
  EXPECT_EQ(*ImageFormatOf("curve.SVG"), ImageFormat::kSvg);
  absl::Status s = ImageFormatOf("curve.jpg").status();
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(absl::StrContains(s.message(), "unknown image type '.jpg' (the name must end in .png or .svg)")) << s;
  EXPECT_FALSE(ImageFormatOf("curve").ok());
}

// Pixels of the image near `rgb` (0..255).
int CountPixels(const std::string& png, int r, int g, int b) {
  cairo_surface_t* s = cairo_image_surface_create_from_png(png.c_str());
  EXPECT_EQ(cairo_surface_status(s), CAIRO_STATUS_SUCCESS);
  int n = 0;
  const unsigned char* data = cairo_image_surface_get_data(s);
  const int stride = cairo_image_surface_get_stride(s);
  for (int y = 0; data != nullptr && y < cairo_image_surface_get_height(s); ++y) {
    for (int x = 0; x < cairo_image_surface_get_width(s); ++x) {
      const uint32_t px = *reinterpret_cast<const uint32_t*>(data + y * stride + 4 * x);  // native ARGB32
      const int pr = (px >> 16) & 0xff, pg = (px >> 8) & 0xff, pb = px & 0xff;
      n += std::abs(pr - r) < 24 && std::abs(pg - g) < 24 && std::abs(pb - b) < 24;
    }
  }
  cairo_surface_destroy(s);
  return n;
}

TEST(PlotMetricsFile, PngHoldsTheCurves) {
  const std::string metrics = Write("metrics-job-1.jsonl", Jsonl(true));
  const std::string png = Dir() + "/curve.png";
  ASSERT_TRUE(PlotMetricsFile(metrics, png).ok());
  const std::string bytes = ReadBytes(png);
  ASSERT_GT(bytes.size(), 24u);
  EXPECT_EQ(bytes.substr(0, 8), std::string("\x89PNG\r\n\x1a\n", 8));
  EXPECT_EQ(bytes.substr(12, 4), "IHDR");
  EXPECT_EQ(bytes.substr(16, 8), std::string("\0\0\x03\xc0\0\0\x02\x58", 8));  // 960 x 600
  EXPECT_GT(CountPixels(png, 31, 120, 181), 200);                              // the train loss line (blue)
  EXPECT_GT(CountPixels(png, 255, 127, 13), 20);                               // validation points (orange)
  EXPECT_GT(CountPixels(png, 43, 160, 43), 200);                               // the lr panel (green)
}

TEST(PlotMetricsFile, SvgIsXmlWithPaths) {
  const std::string metrics = Write("metrics-job-2.jsonl", Jsonl(false));
  const std::string svg = Dir() + "/curve.svg";
  ASSERT_TRUE(PlotMetricsFile(metrics, svg).ok());
  const std::string text = ReadBytes(svg);
  EXPECT_TRUE(absl::StrContains(text, "<svg")) << text.substr(0, 200);
  // A real XML parser: the file is well-formed, its root is <svg> and it draws paths.
  const std::string check = absl::StrCat(
      "python3 -c \"import sys, xml.etree.ElementTree as E; r = E.parse(sys.argv[1]).getroot(); "
      "ns = '{http://www.w3.org/2000/svg}'; assert r.tag == ns + 'svg', r.tag; "
      "assert len(list(r.iter(ns + 'path'))) >= 3\" ",
      svg);
  EXPECT_EQ(std::system(check.c_str()), 0) << check;
}

TEST(PlotMetricsFile, ClearErrors) {
  const std::string dir = Dir();
  absl::Status s = PlotMetricsFile(dir + "/missing.jsonl", dir + "/x.png");
  EXPECT_EQ(s.code(), absl::StatusCode::kNotFound);
  EXPECT_TRUE(absl::StrContains(s.message(), dir + "/missing.jsonl")) << s;
  const std::string metrics = Write("ok.jsonl", Jsonl(false));
  s = PlotMetricsFile(metrics, dir + "/x.jpg");
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_FALSE(std::filesystem::exists(dir + "/x.jpg"));
  s = PlotMetricsFile(Write("noloss.jsonl", "{\"step\":1,\"lr\":1}\n"), dir + "/x.png");
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(absl::StrContains(s.message(), "noloss.jsonl: no step record")) << s;
  EXPECT_FALSE(std::filesystem::exists(dir + "/x.png"));
  // A directory that does not exist is made; a path through a file is the path's fault, named.
  for (const char* out : {"/no-such-dir/deeper/x.png", "/no-such-dir/x.svg"}) {
    s = PlotMetricsFile(metrics, dir + out);
    EXPECT_TRUE(s.ok()) << out << ": " << s;
    EXPECT_GT(std::filesystem::file_size(dir + out), 100u) << out;
  }
  for (const char* out : {"/ok.jsonl/x.png", "/ok.jsonl/sub/x.svg"}) {
    s = PlotMetricsFile(metrics, dir + out);
    EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition) << out << ": " << s;
    EXPECT_TRUE(absl::StrContains(s.message(), dir + out)) << s;
  }
  if (geteuid() != 0) {  // root writes anywhere
    std::filesystem::create_directories(dir + "/read-only");
    std::filesystem::permissions(dir + "/read-only", std::filesystem::perms::owner_read | std::filesystem::perms::owner_exec);
    s = PlotMetricsFile(metrics, dir + "/read-only/x.png");
    EXPECT_EQ(s.code(), absl::StatusCode::kPermissionDenied) << s;
    EXPECT_TRUE(absl::StrContains(s.message(), "cannot write " + dir + "/read-only/x.png")) << s;
    EXPECT_FALSE(std::filesystem::exists(dir + "/read-only/x.png"));
    std::filesystem::permissions(dir + "/read-only", std::filesystem::perms::owner_all);
  }
  s = PlotMetricsFile(dir, dir + "/x.png");  // a directory, not a metrics file
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
}

}  // namespace
}  // namespace slidedp::client
