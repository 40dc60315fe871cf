// The metrics curves and their drawing with cairo; see plot.h.
#include "client/cli/plot.h"

#include <cairo-svg.h>
#include <cairo.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <map>
#include <optional>

#include "absl/cleanup/cleanup.h"
#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "common/io/small_file.h"
#include "common/status/status_macros.h"
#include "nlohmann/json.hpp"

namespace slidedp::client {
namespace {

using nlohmann::json;

// A finite number under `key`, else nothing (absent, null for NaN, or not a number).
std::optional<double> FiniteNumber(const json& record, const char* key) {
  auto it = record.find(key);
  if (it == record.end() || !it->is_number()) return std::nullopt;
  const double v = it->get<double>();
  return std::isfinite(v) ? std::optional<double>(v) : std::nullopt;
}

Curve ToCurve(const std::map<int64_t, double>& points) { return Curve(points.begin(), points.end()); }

// ---- drawing ----

struct Rgb {
  double r, g, b;
};
constexpr Rgb kTrainColor{0.12, 0.47, 0.71};  // the usual blue, orange and green of plots
constexpr Rgb kEvalColor{1.00, 0.50, 0.05};
constexpr Rgb kLrColor{0.17, 0.63, 0.17};
constexpr Rgb kInk{0.15, 0.15, 0.15};
constexpr Rgb kGrid{0.88, 0.88, 0.88};
constexpr double kFontPx = 12;

struct Range {
  double lo, hi;
};

// The values' range with 5% room on each side; a flat curve gets some height.
Range PaddedRange(const std::vector<const Curve*>& curves) {
  double lo = INFINITY, hi = -INFINITY;
  for (const Curve* c : curves) {
    for (const auto& [step, v] : *c) {
      lo = std::min(lo, v);
      hi = std::max(hi, v);
    }
  }
  if (hi - lo <= 1e-12 * std::max(1.0, std::fabs(hi))) {
    const double pad = hi != 0 ? std::fabs(hi) * 0.1 : 1.0;
    return {lo - pad, hi + pad};
  }
  const double pad = (hi - lo) * 0.05;
  return {lo - pad, hi + pad};
}

// About `target` ticks at 1, 2 or 5 times a power of ten; at least `min_step` apart.
std::vector<double> Ticks(Range r, int target, double min_step) {
  const double raw = (r.hi - r.lo) / target;
  const double mag = std::pow(10.0, std::floor(std::log10(raw)));
  const double norm = raw / mag;
  const double step = std::max(min_step, (norm < 1.5 ? 1 : norm < 3.5 ? 2 : norm < 7.5 ? 5 : 10) * mag);
  std::vector<double> out;
  for (double v = std::ceil(r.lo / step) * step; v <= r.hi + step * 1e-9 && out.size() < 50; v += step) {
    out.push_back(std::fabs(v) < step * 1e-9 ? 0.0 : v);
  }
  return out;
}

struct Series {
  const Curve* curve;
  Rgb color;
  std::string label;
  bool markers;  // sparse curves (validation) get a dot per point
};

struct Panel {
  double x, y, w, h;  // the plot area, pixels
  Range xs, ys;
  double X(double step) const { return x + (step - xs.lo) / (xs.hi - xs.lo) * w; }
  double Y(double v) const { return y + h - (v - ys.lo) / (ys.hi - ys.lo) * h; }
};

void SetColor(cairo_t* cr, Rgb c) { cairo_set_source_rgb(cr, c.r, c.g, c.b); }

// Text with its anchor: `ax`, `ay` in [0, 1] of its width and height (0.5, 0.5: centred).
void Text(cairo_t* cr, const std::string& s, double x, double y, double ax, double ay) {
  cairo_text_extents_t e;
  cairo_text_extents(cr, s.c_str(), &e);
  cairo_move_to(cr, x - e.x_bearing - ax * e.width, y - e.y_bearing - ay * e.height);
  cairo_show_text(cr, s.c_str());
}

void DrawPanel(cairo_t* cr, const Panel& p, const std::vector<Series>& series, const std::string& y_label,
               bool step_labels) {
  cairo_set_line_width(cr, 1);
  for (double t : Ticks(p.ys, 6, 0)) {
    SetColor(cr, kGrid);
    cairo_move_to(cr, p.x, std::round(p.Y(t)) + 0.5);
    cairo_line_to(cr, p.x + p.w, std::round(p.Y(t)) + 0.5);
    cairo_stroke(cr);
    SetColor(cr, kInk);
    Text(cr, absl::StrFormat("%g", t), p.x - 6, p.Y(t), 1.0, 0.5);
  }
  for (double t : Ticks(p.xs, 8, 1)) {
    SetColor(cr, kGrid);
    cairo_move_to(cr, std::round(p.X(t)) + 0.5, p.y);
    cairo_line_to(cr, std::round(p.X(t)) + 0.5, p.y + p.h);
    cairo_stroke(cr);
    if (step_labels) {
      SetColor(cr, kInk);
      Text(cr, absl::StrFormat("%g", t), p.X(t), p.y + p.h + 6, 0.5, 0.0);
    }
  }
  SetColor(cr, kInk);
  cairo_rectangle(cr, p.x + 0.5, p.y + 0.5, p.w, p.h);
  cairo_stroke(cr);
  cairo_save(cr);
  cairo_translate(cr, p.x - 62, p.y + p.h / 2);
  cairo_rotate(cr, -M_PI / 2);
  Text(cr, y_label, 0, 0, 0.5, 0.5);
  cairo_restore(cr);

  cairo_save(cr);
  cairo_rectangle(cr, p.x, p.y, p.w, p.h);
  cairo_clip(cr);
  cairo_set_line_width(cr, 1.5);
  cairo_set_line_join(cr, CAIRO_LINE_JOIN_ROUND);
  for (const Series& s : series) {
    SetColor(cr, s.color);
    for (size_t i = 0; i < s.curve->size(); ++i) {
      const auto& [step, v] = (*s.curve)[i];
      if (i == 0) {
        cairo_move_to(cr, p.X(step), p.Y(v));
      } else {
        cairo_line_to(cr, p.X(step), p.Y(v));
      }
    }
    cairo_stroke(cr);
    if (s.markers || s.curve->size() == 1) {
      for (const auto& [step, v] : *s.curve) {
        cairo_new_sub_path(cr);
        cairo_arc(cr, p.X(step), p.Y(v), 3, 0, 2 * M_PI);
      }
      cairo_fill(cr);
    }
  }
  cairo_restore(cr);

  // Legend, top right inside the panel, on white so that a curve under it does not hide it.
  cairo_set_source_rgba(cr, 1, 1, 1, 0.85);
  cairo_rectangle(cr, p.x + p.w - 128, p.y + 4, 124, series.size() * (kFontPx + 6) + 8);
  cairo_fill(cr);
  double ly = p.y + 10;
  for (const Series& s : series) {
    SetColor(cr, s.color);
    cairo_set_line_width(cr, 2);
    cairo_move_to(cr, p.x + p.w - 120, ly + kFontPx / 2);
    cairo_line_to(cr, p.x + p.w - 100, ly + kFontPx / 2);
    cairo_stroke(cr);
    SetColor(cr, kInk);
    Text(cr, s.label, p.x + p.w - 94, ly + kFontPx / 2, 0.0, 0.5);
    ly += kFontPx + 6;
  }
}

absl::Status CairoError(cairo_status_t s, const std::string& path) {
  return absl::InternalError(absl::StrCat("plot: cannot write ", path, ": ", cairo_status_to_string(s)));
}

// errno of a path the user chose -> its status: not allowed (PERMISSION_DENIED), no room
// (RESOURCE_EXHAUSTED), or something in the way, a file where a directory must be, a read-only
// file system, ... (FAILED_PRECONDITION).
absl::Status OutputError(const std::string& what, int err) {
  const std::string msg = absl::StrCat("plot: ", what, ": ", std::strerror(err));
  switch (err) {
    case EACCES:
    case EPERM: return absl::PermissionDeniedError(msg);
    case ENOSPC:
    case EDQUOT: return absl::ResourceExhaustedError(msg);
    default: return absl::FailedPreconditionError(msg);
  }
}

// The image file, opened for writing; its directory is made first (with its parents) when
// missing.
absl::StatusOr<FILE*> OpenOutput(const std::string& path) {
  const std::filesystem::path parent = std::filesystem::path(path).parent_path();
  std::error_code ec;
  if (!parent.empty() && !std::filesystem::is_directory(parent, ec)) {
    std::filesystem::create_directories(parent, ec);
    if (ec) return OutputError(absl::StrCat("cannot create the directory ", parent.string(), " for ", path), ec.value());
  }
  FILE* f = std::fopen(path.c_str(), "wb");
  if (f == nullptr) return OutputError(absl::StrCat("cannot write ", path), errno);
  return f;
}

// cairo's write callback into a FILE*, keeping the first errno.
struct ImageSink {
  FILE* file = nullptr;
  int error = 0;
};

cairo_status_t WriteToSink(void* closure, const unsigned char* data, unsigned int length) {
  auto* sink = static_cast<ImageSink*>(closure);
  if (sink->error == 0 && std::fwrite(data, 1, length, sink->file) != length) sink->error = errno != 0 ? errno : EIO;
  return sink->error == 0 ? CAIRO_STATUS_SUCCESS : CAIRO_STATUS_WRITE_ERROR;
}

void Draw(cairo_t* cr, const MetricsCurves& c, const std::string& title, PlotSize size) {
  SetColor(cr, {1, 1, 1});
  cairo_paint(cr);
  cairo_select_font_face(cr, "sans-serif", CAIRO_FONT_SLANT_NORMAL, CAIRO_FONT_WEIGHT_NORMAL);
  cairo_set_font_size(cr, kFontPx);

  int64_t first = c.loss.front().first, last = c.loss.back().first;
  for (const Curve* curve : {&c.eval_loss, &c.lr}) {
    if (curve->empty()) continue;
    first = std::min(first, curve->front().first);
    last = std::max(last, curve->back().first);
  }
  const Range steps = first < last ? Range{double(first), double(last)} : Range{first - 1.0, last + 1.0};

  SetColor(cr, kInk);
  cairo_set_font_size(cr, kFontPx + 2);
  Text(cr, title, size.width_px / 2.0, 12, 0.5, 0.0);
  cairo_set_font_size(cr, kFontPx);

  const double left = 84, right = 24, top = 40, bottom = 48, gap = 16;
  const double w = size.width_px - left - right;
  const double h_all = size.height_px - top - bottom;
  const double h_loss = c.lr.empty() ? h_all : (h_all - gap) * 0.7;

  std::vector<Series> loss = {{&c.loss, kTrainColor, "train loss", false}};
  std::vector<const Curve*> loss_curves = {&c.loss};
  if (!c.eval_loss.empty()) {
    loss.push_back({&c.eval_loss, kEvalColor, "validation loss", true});
    loss_curves.push_back(&c.eval_loss);
  }
  DrawPanel(cr, Panel{left, top, w, h_loss, steps, PaddedRange(loss_curves)}, loss, "loss", c.lr.empty());
  if (!c.lr.empty()) {
    const Panel lr{left, top + h_loss + gap, w, h_all - h_loss - gap, steps, PaddedRange({&c.lr})};
    DrawPanel(cr, lr, {{&c.lr, kLrColor, "learning rate", false}}, "lr", true);
  }
  SetColor(cr, kInk);
  Text(cr, "step", left + w / 2, size.height_px - 8, 0.5, 1.0);
}

}  // namespace

absl::StatusOr<MetricsCurves> ParseMetricsJsonl(absl::string_view text) {
  std::map<int64_t, double> loss, eval_loss, lr;
  int64_t line_no = 0;
  std::vector<absl::string_view> lines = absl::StrSplit(text, '\n');
  for (size_t i = 0; i < lines.size(); ++i) {
    ++line_no;
    absl::string_view line = absl::StripAsciiWhitespace(lines[i]);
    if (line.empty()) continue;
    const bool unfinished = i + 1 == lines.size();  // no newline after it: still being written
    json record = json::parse(line.begin(), line.end(), nullptr, /*allow_exceptions=*/false);
    auto step = record.is_object() ? FiniteNumber(record, "step") : std::nullopt;
    if (!step) {
      if (unfinished) break;
      return absl::InvalidArgumentError(
          absl::StrCat("line ", line_no, ": not a metrics record (a JSON object with a numeric \"step\")"));
    }
    const int64_t s = static_cast<int64_t>(*step);
    // A step run again (resumed from an earlier checkpoint): its last record counts.
    loss.erase(s);
    eval_loss.erase(s);
    lr.erase(s);
    if (auto v = FiniteNumber(record, "loss")) loss[s] = *v;
    if (auto v = FiniteNumber(record, "eval_loss")) eval_loss[s] = *v;
    if (auto v = FiniteNumber(record, "lr")) lr[s] = *v;
  }
  if (loss.empty()) return absl::InvalidArgumentError("no step record with a finite \"loss\"");
  return MetricsCurves{ToCurve(loss), ToCurve(eval_loss), ToCurve(lr)};
}

absl::StatusOr<ImageFormat> ImageFormatOf(const std::string& path) {
  const std::string ext = absl::AsciiStrToLower(std::filesystem::path(path).extension().string());
  if (ext == ".png") return ImageFormat::kPng;
  if (ext == ".svg") return ImageFormat::kSvg;
  return absl::InvalidArgumentError(
      absl::StrCat("plot: ", path, ": unknown image type '", ext, "' (the name must end in .png or .svg)"));
}

absl::Status DrawCurves(const MetricsCurves& curves, const std::string& title, const std::string& out_path,
                        ImageFormat format, PlotSize size) {
  if (curves.loss.empty()) return absl::InvalidArgumentError("plot: no loss to draw");
  ASSIGN_OR_RETURN(FILE * file, OpenOutput(out_path));
  ImageSink sink{file};
  bool written = false;
  absl::Cleanup close_file = [&] {
    if (std::fclose(file) != 0 && sink.error == 0) sink.error = errno;
    if (!written) std::remove(out_path.c_str());  // no half image left behind
  };
  cairo_surface_t* surface =
      format == ImageFormat::kPng
          ? cairo_image_surface_create(CAIRO_FORMAT_ARGB32, size.width_px, size.height_px)
          : cairo_svg_surface_create_for_stream(WriteToSink, &sink, size.width_px, size.height_px);
  absl::Cleanup destroy_surface = [surface] { cairo_surface_destroy(surface); };
  if (cairo_surface_status(surface) != CAIRO_STATUS_SUCCESS) return CairoError(cairo_surface_status(surface), out_path);
  cairo_t* cr = cairo_create(surface);
  Draw(cr, curves, title, size);
  const cairo_status_t drawn = cairo_status(cr);
  cairo_destroy(cr);
  if (drawn != CAIRO_STATUS_SUCCESS) return CairoError(drawn, out_path);
  cairo_status_t status = CAIRO_STATUS_SUCCESS;
  if (format == ImageFormat::kPng) {
    status = cairo_surface_write_to_png_stream(surface, WriteToSink, &sink);
  } else {
    cairo_surface_finish(surface);  // writes the rest of the SVG
    status = cairo_surface_status(surface);
  }
  if (sink.error == 0 && std::fflush(file) != 0) sink.error = errno;
  if (sink.error != 0) return OutputError(absl::StrCat("cannot write ", out_path), sink.error);
  if (status != CAIRO_STATUS_SUCCESS) return CairoError(status, out_path);
  written = true;
  return absl::OkStatus();
}

absl::Status PlotMetricsFile(const std::string& metrics_path, const std::string& out_path) {
  ASSIGN_OR_RETURN(ImageFormat format, ImageFormatOf(out_path));
  ASSIGN_OR_RETURN(std::string text, ReadSmallFile(metrics_path, kMaxMetricsFileBytes, "metrics file"));
  absl::StatusOr<MetricsCurves> curves = ParseMetricsJsonl(text);
  if (!curves.ok()) return Annotate(curves.status(), absl::StrCat("plot: ", metrics_path));
  const std::string title =
      absl::StrFormat("%s: %d steps, last loss %.4g", std::filesystem::path(metrics_path).filename().string(),
                      static_cast<int64_t>(curves->loss.size()), curves->loss.back().second);
  return DrawCurves(*curves, title, out_path, format);
}

}  // namespace slidedp::client
