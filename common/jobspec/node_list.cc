#include "common/jobspec/node_list.h"

#include <fstream>
#include <sstream>

#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "common/jobspec/job_spec.h"
#include "common/status/status_macros.h"
#include "yaml-cpp/yaml.h"

namespace slidedp {
namespace {

// The top-level comma split of a hostlist (commas inside brackets are ranges).
absl::StatusOr<std::vector<std::string>> TopLevelItems(const std::string& s) {
  std::vector<std::string> items;
  std::string cur;
  int depth = 0;
  for (char c : s) {
    if (c == '[') ++depth;
    if (c == ']' && --depth < 0) return absl::InvalidArgumentError(absl::StrCat("hostlist '", s, "': a ']' unopened"));
    if (c == ',' && depth == 0) {
      items.push_back(cur);
      cur.clear();
      continue;
    }
    cur += c;
  }
  if (depth != 0) return absl::InvalidArgumentError(absl::StrCat("hostlist '", s, "': a '[' unclosed"));
  items.push_back(cur);
  return items;
}

// The values of one bracket's ranges ("01-03,7"), formatted with the first bound's width.
absl::StatusOr<std::vector<std::string>> RangeValues(const std::string& ranges, size_t limit) {
  std::vector<std::string> out;
  for (absl::string_view r : absl::StrSplit(ranges, ',')) {
    std::vector<std::string> bounds = absl::StrSplit(r, '-');
    uint64_t lo = 0, hi = 0;
    if (bounds.size() > 2 || bounds[0].empty() || bounds[0].size() > 9 || !absl::SimpleAtoi(bounds[0], &lo) ||
        (bounds.size() == 2 && (bounds[1].size() > 9 || !absl::SimpleAtoi(bounds[1], &hi)))) {
      return absl::InvalidArgumentError(absl::StrCat("hostlist range '", r, "' is not N or N-M"));
    }
    if (bounds.size() == 1) hi = lo;
    if (hi < lo) return absl::InvalidArgumentError(absl::StrCat("hostlist range '", r, "' runs backwards"));
    if (hi - lo >= limit) {
      return absl::InvalidArgumentError(absl::StrCat("hostlist range '", r, "' names more than ", limit, " nodes"));
    }
    const size_t width = bounds[0].size();
    for (uint64_t v = lo; v <= hi; ++v) {
      std::string digits = absl::StrCat(v);
      if (digits.size() < width) digits.insert(0, width - digits.size(), '0');
      out.push_back(std::move(digits));
    }
  }
  return out;
}

absl::Status ExpandItem(const std::string& item, std::vector<std::string>& out) {
  const size_t open = item.find('[');
  if (open == std::string::npos) {
    out.push_back(item);
    return absl::OkStatus();
  }
  const size_t close = item.find(']', open);
  if (close == std::string::npos) return absl::InvalidArgumentError(absl::StrCat("hostlist '", item, "': '[' unclosed"));
  ASSIGN_OR_RETURN(std::vector<std::string> values, RangeValues(item.substr(open + 1, close - open - 1), kMaxJobNodes));
  for (const std::string& v : values) {
    RETURN_IF_ERROR(ExpandItem(item.substr(0, open) + v + item.substr(close + 1), out));
    if (out.size() > kMaxJobNodes) {
      return absl::InvalidArgumentError(absl::StrCat("hostlist names more than ", kMaxJobNodes, " nodes"));
    }
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<std::vector<std::string>> ExpandHostlist(const std::string& hostlist) {
  const std::string s(absl::StripAsciiWhitespace(hostlist));
  if (s.empty()) return absl::InvalidArgumentError("hostlist is empty");
  ASSIGN_OR_RETURN(std::vector<std::string> items, TopLevelItems(s));
  std::vector<std::string> out;
  for (const std::string& item : items) {
    if (item.empty()) return absl::InvalidArgumentError(absl::StrCat("hostlist '", s, "': an empty name"));
    RETURN_IF_ERROR(ExpandItem(item, out));
  }
  return out;
}

absl::StatusOr<std::vector<std::string>> NodesFromArgument(const std::string& argument, int port,
                                                           const char* slurm_nodelist) {
  std::vector<std::string> names;
  if (argument == "slurm") {
    if (slurm_nodelist == nullptr || *slurm_nodelist == '\0') {
      return absl::FailedPreconditionError("--nodes slurm: SLURM_JOB_NODELIST is not set (not inside a Slurm job)");
    }
    if (port <= 0) return absl::InvalidArgumentError("--nodes slurm needs --node-port (the port every hostd listens on)");
    ASSIGN_OR_RETURN(names, ExpandHostlist(slurm_nodelist));
  } else if (absl::StartsWith(argument, "@")) {
    std::ifstream in(argument.substr(1));
    if (!in) return absl::NotFoundError(absl::StrCat("--nodes ", argument, ": cannot read the file"));
    std::string line;
    for (int n = 0; std::getline(in, line) && n < 10000; ++n) {
      absl::string_view v = absl::StripAsciiWhitespace(line.substr(0, line.find('#')));
      if (!v.empty()) names.emplace_back(v);
    }
  } else {
    for (absl::string_view v : absl::StrSplit(argument, ',', absl::SkipWhitespace())) {
      names.emplace_back(absl::StripAsciiWhitespace(v));
    }
  }
  if (names.size() < 2 || names.size() > kMaxJobNodes) {
    return absl::InvalidArgumentError(
        absl::StrCat("--nodes ", argument, ": ", names.size(), " nodes; a job over nodes names 2 to ", kMaxJobNodes));
  }
  std::vector<std::string> out;
  for (const std::string& n : names) {
    // A bare host gets the port (an IPv6 address in brackets, a name, a dotted address).
    const bool has_port = absl::StartsWith(n, "unix:") || (n.rfind(':') != std::string::npos && n.back() != ']' &&
                                                          (n.front() != '[' || n.find("]:") != std::string::npos));
    std::string address = has_port ? n : absl::StrCat(n, ":", port);
    if (!has_port && port <= 0) {
      return absl::InvalidArgumentError(absl::StrCat("--nodes: '", n, "' has no port; give HOST:PORT or --node-port"));
    }
    RETURN_IF_ERROR(CheckNodeAddress(address, "--nodes"));
    out.push_back(std::move(address));
  }
  return out;
}

absl::StatusOr<std::string> SpecWithNodes(const std::string& spec_yaml, const std::vector<std::string>& nodes) {
  try {
    YAML::Node root = YAML::Load(spec_yaml);
    if (!root.IsMap()) return absl::InvalidArgumentError("job spec: not a YAML map");
    YAML::Node runtime = root["runtime"];
    if (runtime && !runtime.IsMap()) return absl::InvalidArgumentError("job spec: runtime is not a map");
    YAML::Node list(YAML::NodeType::Sequence);
    for (const std::string& n : nodes) list.push_back(n);
    root["runtime"]["nodes"] = list;
    YAML::Emitter out;
    out << root;
    return std::string(out.c_str());
  } catch (const YAML::Exception& e) {
    return absl::InvalidArgumentError(absl::StrCat("job spec: ", e.what()));
  }
}

}  // namespace slidedp
