// `slidedp plan`'s text; see plan_report.h.
#include "client/cli/plan_report.h"

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <sstream>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_replace.h"
#include "absl/strings/str_split.h"
#include "google/protobuf/util/json_util.h"
#include "nlohmann/json.hpp"

namespace slidedp::client {
namespace {

constexpr double kGiB = 1073741824.0;

std::string Busy(double s) { return s < 0 ? "not known" : absl::StrFormat("%.3f s", s); }

double Median(std::vector<double> v) {
  if (v.empty()) return -1;
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

}  // namespace

std::string FormatPlan(const v1::PlanJobResponse& p) {
  std::string out = absl::StrFormat("plan: %d GPU(s), %d tokens per GPU per step\n", p.world(), p.tokens_per_step());
  if (p.step_s() > 0) {
    absl::StrAppend(&out,
                    absl::StrFormat("predicted step %.3f s = %.0f tokens/s per GPU; bound by %s (exposed %.3f s)\n",
                                    p.step_s(), p.tokens_per_step() / p.step_s(), p.bottleneck(), p.exposed_s()));
  } else {
    absl::StrAppend(&out, "predicted step: not known (see the notes)\n");
  }
  absl::StrAppend(
      &out, absl::StrFormat("%-34s %12s %14s %11s  %s\n", "resource", "work/step", "rate", "busy", "measured by"));
  for (const v1::PlanResource& r : p.resources()) {
    const std::string work = r.work() < 0 ? "-" : absl::StrFormat("%.4g %s", r.work(), r.unit());
    const std::string rate = r.rate() > 0 ? absl::StrFormat("%.3g %s/s", r.rate(), r.unit()) : "-";
    absl::StrAppend(&out,
                    absl::StrFormat("%-34s %12s %14s %11s  %s\n", r.name(), work, rate, Busy(r.busy_s()), r.source()));
  }
  if (p.gpu_peak_bytes() > 0)
    absl::StrAppend(&out, absl::StrFormat("GPU peak %.2f GiB per GPU; ", p.gpu_peak_bytes() / kGiB));
  absl::StrAppend(&out, absl::StrFormat("host memory %.2f GiB (the job's state, rings, staging, pinned copies)\n",
                                        p.host_bytes() / kGiB));
  absl::StrAppend(&out, "layout: ", p.layout_source(), "\n");
  if (!p.layout_yaml().empty()) {
    // The layers in runs of one kind: "0-3 recompute+offload, 4-29 selective+offload(0.25), 30-35 keep_all".
    std::vector<std::string> kinds;
    for (absl::string_view l : absl::StrSplit(p.layout_yaml(), '\n')) {
      const size_t k = l.find("{kind: ");
      if (l.find("  - ") != 0 || k == absl::string_view::npos) continue;
      std::string kind(l.substr(k + 7, l.find_first_of(",}", k + 7) - (k + 7)));
      const size_t keep = l.find("keep: [");
      if (keep != absl::string_view::npos) {
        const size_t end = l.find(']', keep);
        kind += absl::StrCat("(", absl::StrReplaceAll(l.substr(keep + 7, end - keep - 7), {{", ", "+"}}), ")");
      }
      if (const size_t off = l.find("offload: "); off != absl::string_view::npos) {
        const absl::string_view share = l.substr(off + 9, l.find_first_of(",}", off + 9) - (off + 9));
        kind += share == "true" || share == "1" ? std::string("+offload") : absl::StrCat("+offload(", share, ")");
      }
      kinds.push_back(kind);
    }
    std::string runs;
    for (size_t i = 0; i < kinds.size();) {
      size_t j = i;
      while (j + 1 < kinds.size() && kinds[j + 1] == kinds[i]) ++j;
      absl::StrAppend(&runs, runs.empty() ? "  layers " : ", ", i == j ? absl::StrCat(i) : absl::StrCat(i, "-", j), " ",
                      kinds[i]);
      i = j + 1;
    }
    if (!runs.empty()) absl::StrAppend(&out, runs, "\n");
  }
  if (p.alternatives_size() > 0) absl::StrAppend(&out, "what if (the same measurements):\n");
  for (const v1::PlanAlternative& a : p.alternatives()) {
    if (a.step_s() > 0) {
      absl::StrAppend(&out, absl::StrFormat("  %s: step %.3f s = %.0f tokens/s, bound by %s%s%s\n", a.what(),
                                            a.step_s(), a.tokens_per_s(), a.bottleneck(),
                                            a.layout().empty() ? "" : absl::StrCat("; ", a.layout()),
                                            a.note().empty() ? "" : absl::StrCat(" (", a.note(), ")")));
    } else {
      absl::StrAppend(&out, absl::StrFormat("  %s: not predicted: %s\n", a.what(), a.note()));
    }
  }
  for (const std::string& n : p.notes()) absl::StrAppend(&out, "note: ", n, "\n");
  return out;
}

absl::StatusOr<std::string> ComparePlan(const v1::PlanJobResponse& p, const std::string& metrics_jsonl,
                                        int64_t first_step) {
  std::vector<nlohmann::json> rows;
  int line_no = 0;
  for (absl::string_view line : absl::StrSplit(metrics_jsonl, '\n')) {
    ++line_no;
    if (line.empty()) continue;
    nlohmann::json j = nlohmann::json::parse(line.begin(), line.end(), nullptr, /*allow_exceptions=*/false);
    if (j.is_discarded() || !j.is_object() || !j.contains("step") || !j["step"].is_number() ||
        !j.contains("step_time_s") || !j["step_time_s"].is_number()) {
      return absl::InvalidArgumentError(absl::StrCat("metrics line ", line_no, " is not a step's metrics"));
    }
    rows.push_back(std::move(j));
  }
  if (rows.empty()) return absl::InvalidArgumentError("the metrics file has no steps");
  std::vector<nlohmann::json> steady;
  for (const auto& j : rows) {
    if (j["step"].get<int64_t>() >= first_step) steady.push_back(j);
  }
  if (steady.empty()) steady = rows;
  auto med = [&](auto get) {
    std::vector<double> v;
    for (const auto& j : steady) v.push_back(get(j));
    return Median(v);
  };
  auto busy = [](const nlohmann::json& j, const char* k) {
    if (!j.contains("busy_s") || !j["busy_s"].is_object() || !j["busy_s"].contains(k) || !j["busy_s"][k].is_number()) {
      return 0.0;
    }
    return j["busy_s"][k].get<double>();
  };
  const double step = med([](const nlohmann::json& j) { return j["step_time_s"].get<double>(); });
  // The workers' compute (the step less its flush, gate waits included: the GPU works through them),
  // which the prediction's GPU compute is; metrics written before the field: the step less its waits.
  const double compute = med([&](const nlohmann::json& j) {
    const double c = busy(j, "worker_compute");
    return c > 0 ? c : busy(j, "worker_step") - busy(j, "worker_gate_wait") - busy(j, "worker_ring_wait");
  });
  const double h2d = med([&](const nlohmann::json& j) { return busy(j, "worker_h2d"); });
  const double d2h = med([&](const nlohmann::json& j) { return busy(j, "worker_d2h"); });
  const double host = med([&](const nlohmann::json& j) { return busy(j, "host_update"); });
  std::string out = absl::StrFormat("measured: median of %d step(s) from step %d\n", steady.size(),
                                    steady.front()["step"].get<int64_t>());
  absl::StrAppend(&out, absl::StrFormat("%-34s %11s %11s %9s\n", "", "predicted", "measured", "error"));
  auto row = [&](const std::string& name, double predicted, double measured) {
    const std::string err = predicted > 0 && measured > 0
                                ? absl::StrFormat("%+.1f%%", 100 * (predicted - measured) / measured)
                                : std::string("-");
    absl::StrAppend(&out, absl::StrFormat("%-34s %11s %11s %9s\n", name, Busy(predicted > 0 ? predicted : -1),
                                          Busy(measured), err));
  };
  row("step", p.step_s(), step);
  for (const v1::PlanResource& r : p.resources()) {
    if (r.name() == "GPU compute") row(r.name(), r.busy_s(), compute);
    if (r.name() == "host-to-device copies") row(r.name(), r.busy_s(), h2d);
    if (r.name() == "device-to-host copies") row(r.name(), r.busy_s(), d2h);
    if (r.name() == "host updates (LayerAdam)") row(r.name(), r.busy_s(), host);
  }
  return out;
}

absl::Status WritePlanJson(const v1::PlanJobResponse& plan, const std::string& path) {
  std::string json;
  google::protobuf::util::JsonPrintOptions o;
  o.add_whitespace = true;
  o.preserve_proto_field_names = true;
  if (auto s = google::protobuf::util::MessageToJsonString(plan, &json, o); !s.ok()) {
    return absl::InternalError(absl::StrCat("plan --json: ", s.ToString()));
  }
  const std::string tmp = path + ".tmp";
  {
    std::ofstream f(tmp, std::ios::binary | std::ios::trunc);
    f << json;
    f.close();
    if (!f) return absl::UnavailableError(absl::StrCat("plan --json: cannot write ", tmp));
  }
  if (std::rename(tmp.c_str(), path.c_str()) != 0) {
    const int err = errno;
    std::remove(tmp.c_str());
    return absl::UnavailableError(absl::StrCat("plan --json: cannot rename ", tmp, " to ", path, ": ", std::strerror(err)));
  }
  return absl::OkStatus();
}

}  // namespace slidedp::client
