// Specs made from a spec (route variants, the measuring job of `slidedp plan --measure`) and the
// text helpers that show names, ids and paths from a client safely; see job_spec.h.
#include "common/jobspec/job_spec.h"

#include <algorithm>
#include <cmath>
#include <cerrno>
#include <cstdlib>
#include <filesystem>
#include <functional>
#include <limits>
#include <map>
#include <set>
#include <vector>

#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "common/status/status_macros.h"
#include "common/status/utf8_prefix.h"
#include "nlohmann/json.hpp"
#include "yaml-cpp/yaml.h"

namespace slidedp {

// The offset of the first byte that is not part of well-formed UTF-8 (RFC 3629: no overlong
// forms, no surrogates, at most U+10FFFF), or text.size().
size_t FirstInvalidUtf8(absl::string_view text) {
  size_t i = 0;
  while (i < text.size()) {
    const auto b = static_cast<uint8_t>(text[i]);
    size_t n = 0;
    uint32_t cp = 0, min = 0;
    if (b < 0x80) {
      ++i;
      continue;
    }
    if ((b & 0xE0) == 0xC0) {
      n = 1;
      cp = b & 0x1F;
      min = 0x80;
    } else if ((b & 0xF0) == 0xE0) {
      n = 2;
      cp = b & 0x0F;
      min = 0x800;
    } else if ((b & 0xF8) == 0xF0) {
      n = 3;
      cp = b & 0x07;
      min = 0x10000;
    } else
      return i;
    for (size_t k = 1; k <= n; ++k) {
      if (i + k >= text.size()) return i;
      const auto c = static_cast<uint8_t>(text[i + k]);
      if ((c & 0xC0) != 0x80) return i;
      cp = (cp << 6) | (c & 0x3F);
    }
    if (cp < min || cp > 0x10FFFF || (cp >= 0xD800 && cp <= 0xDFFF)) return i;
    i += n + 1;
  }
  return text.size();
}

std::vector<JobSpec> RouteVariants(const JobSpec& spec, int world, bool cuda, bool all) {
  JobSpec base = spec;
  base.runtime.grad_reduction_auto = base.runtime.param_delivery_auto = base.runtime.chunk_bytes_auto = false;
  std::vector<GradReduction> reductions = {spec.runtime.grad_reduction_auto ? GradReduction::kGpu
                                                                            : spec.runtime.grad_reduction};
  std::vector<ParamDelivery> deliveries = {spec.runtime.param_delivery_auto ? ParamDelivery::kReplicated
                                                                            : spec.runtime.param_delivery};
  if (world > 1 && (all || spec.runtime.grad_reduction_auto)) reductions = {GradReduction::kGpu, GradReduction::kCpu};
  if (world > 1 && (all || spec.runtime.param_delivery_auto)) {
    deliveries = {ParamDelivery::kReplicated};
    if (cuda) deliveries.push_back(ParamDelivery::kSharded);
  }
  std::vector<int64_t> chunks = {spec.runtime.chunk_bytes};
  if (spec.runtime.chunk_bytes_auto) chunks.assign(std::begin(kAutoChunkBytes), std::end(kAutoChunkBytes));
  std::vector<JobSpec> out;
  for (GradReduction r : reductions) {
    for (ParamDelivery d : deliveries) {
      for (int64_t c : chunks) {
        JobSpec v = base;
        v.runtime.grad_reduction = r;
        v.runtime.param_delivery = d;
        v.runtime.chunk_bytes = c;
        out.push_back(std::move(v));
      }
    }
  }
  return out;
}

std::string RouteName(const JobSpec& spec) {
  return absl::StrCat("grad_reduction ", ToString(spec.runtime.grad_reduction), ", param_delivery ",
                      ToString(spec.runtime.param_delivery), ", chunk_bytes ", spec.runtime.chunk_bytes);
}

JobSpec PolicyMeasureSpec(const JobSpec& spec) {
  JobSpec m = spec;
  m.name = absl::StrCat(spec.name.substr(0, kMaxJobNameBytes - 5), "-plan");
  m.runtime.policy_auto = true;
  m.runtime.policy_file.clear();
  m.runtime.layer_layout.reset();
  m.runtime.act_policy = ActivationPolicy::kRecomputeLayer;
  m.runtime.offload_ratio = 0;
  m.train.measure_only = true;
  m.train.steps = kPolicyMeasureSteps;
  m.train.epochs = 0;
  m.schedule.kind = ScheduleKind::kConstant;
  m.schedule.warmup_steps = 0;
  m.schedule.min_lr = 0;
  m.output.save_every = 0;
  m.output.save_final = false;
  m.output.tensorboard = false;
  m.data.validation.clear();
  m.train.eval_every = 0;
  return m;
}

std::string PrintableUtf8(absl::string_view text) {
  std::string out;
  out.reserve(text.size());
  while (!text.empty()) {
    const size_t good = FirstInvalidUtf8(text);
    for (char c : text.substr(0, good)) {
      const auto u = static_cast<unsigned char>(c);
      out += (u < 0x20 && c != '\t' && c != '\n') || u == 0x7f ? '?' : c;
    }
    if (good == text.size()) break;
    out += '?';
    text.remove_prefix(good + 1);
  }
  return out;
}

std::string BoundedLine(absl::string_view text, size_t max_bytes) {
  std::string spaced(text);
  for (char& c : spaced) {
    if (c == '\n' || c == '\r' || c == '\t') c = ' ';
  }
  std::string out = PrintableUtf8(spaced);
  if (out.size() <= max_bytes) return out;
  const size_t kept = Utf8Prefix(out, max_bytes).size();
  return absl::StrCat(out.substr(0, kept), "... (", out.size() - kept, " more bytes)");
}

namespace {
// The first max_bytes bytes of `text`, those outside printable ASCII as '?'.
std::string PrintableAsciiPrefix(absl::string_view text, size_t max_bytes) {
  std::string shown;
  for (char c : text.substr(0, max_bytes)) {
    const auto u = static_cast<unsigned char>(c);
    shown += u >= 0x20 && u < 0x7f ? c : '?';
  }
  return shown;
}
}  // namespace

std::string ShownId(absl::string_view id) {
  return absl::StrCat(PrintableAsciiPrefix(id, 80), id.size() > 80 ? "..." : "");
}

absl::Status CheckPathText(absl::string_view path, absl::string_view what) {
  auto refuse = [&](absl::string_view why) {
    const std::string shown = PrintableAsciiPrefix(path, 120);
    return absl::InvalidArgumentError(
        absl::StrCat(what, " '", shown, "'", path.size() > 120 ? "..." : "", " is not a usable path: ", why));
  };
  if (path.empty()) return refuse("it is empty");
  if (path.size() > kMaxPathBytes) return refuse(absl::StrCat("longer than ", kMaxPathBytes, " bytes"));
  for (char c : path) {
    const auto u = static_cast<unsigned char>(c);
    if (u < 0x20 || u == 0x7f) return refuse("it holds a control character (NUL, newline, escape, ...)");
  }
  if (FirstInvalidUtf8(path) != path.size()) return refuse("it is not UTF-8 text");
  return absl::OkStatus();
}

absl::Status ValidateJobName(const std::string& name) {
  // The name becomes a directory (out/<name>) and a job id (<name>-N, shm segment names and record
  // files): nothing that could leave a directory, reach a terminal raw, or fail later at start.
  bool ok = !name.empty() && name.size() <= kMaxJobNameBytes && name[0] != '.' && name[0] != '-';
  for (char c : name) {
    ok = ok && (absl::ascii_isalnum(static_cast<unsigned char>(c)) || c == '.' || c == '_' || c == '-');
  }
  if (ok) return absl::OkStatus();
  std::string shown;
  for (char c : name.substr(0, 80)) shown += absl::ascii_isprint(static_cast<unsigned char>(c)) ? c : '?';
  return absl::InvalidArgumentError(absl::StrCat("job spec: name '", shown, "'", name.size() > 80 ? "..." : "",
                                                 " is not valid: use 1-", kMaxJobNameBytes,
                                                 " characters of [A-Za-z0-9._-], not starting with '.' or '-'"));
}

}  // namespace slidedp
