// PolicyCache: see policy_cache.h.
#include "hostd/engine/policy_cache.h"

#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <filesystem>

#include "absl/strings/str_cat.h"
#include "common/io/small_file.h"
#include "common/status/status_macros.h"
#include "yaml-cpp/yaml.h"

namespace slidedp::hostd {
namespace {

uint64_t Fnv1a(const std::string& s) {
  uint64_t h = 0xcbf29ce484222325ull;
  for (unsigned char c : s) h = (h ^ c) * 0x100000001b3ull;
  return h;
}

constexpr const char* kKeyPrefix = "# key: ";

}  // namespace

std::string PolicyCache::KeyText(const JobSpec& spec, const ModelConfig& config,
                                 absl::Span<const v1::WorkerHello> workers) {
  // Every runtime setting but the policy: each can change the working set or the step's costs.
  YAML::Node runtime = YAML::Clone(YAML::Load(spec.ToYaml())["runtime"]);
  if (runtime.IsMap()) {
    runtime.remove("policy");
    runtime.remove("layer_policy");
  }
  YAML::Emitter e;
  e << runtime;
  std::string settings = e.c_str();
  for (char& c : settings) c = c == '\n' ? ';' : c;  // one line: the file's first
  const ModelShape m = ModelShape::Of(config);
  const v1::WorkerHello none;
  const v1::WorkerHello& w = workers.empty() ? none : workers[0];
  return absl::StrCat("build=", w.build(), " device=", w.device().name(), " memory=", w.device().memory_bytes(),
                      " world=", workers.size(), " model=", m.model_type, "/", m.hidden_size, "/", m.num_hidden_layers,
                      "/", m.num_attention_heads, "/", m.num_key_value_heads, "/", m.head_dim, "/", m.intermediate_size,
                      "/", m.vocab_size, " global_batch=", spec.train.global_batch,
                      " micro_batch=", spec.train.micro_batch, " seq_len=", spec.train.seq_len,
                      " clip=", spec.train.max_grad_norm > 0 ? 1 : 0, " runtime=", settings);
}

std::string PolicyCache::PathOf(const std::string& key_text) const {
  return (std::filesystem::path(dir_) / absl::StrCat(absl::Hex(Fnv1a(key_text), absl::kZeroPad16), ".yaml")).string();
}

std::optional<LayerLayout> PolicyCache::Find(const std::string& key_text, const ModelConfig& config,
                                             const v1::WorkerHello& worker, std::string* why_not) const {
  why_not->clear();
  if (!enabled()) return std::nullopt;
  const std::string path = PathOf(key_text);
  absl::StatusOr<std::string> text = ReadSmallFile(path, kMaxPolicyFileBytes, "cached policy");
  if (!text.ok()) {
    if (text.status().code() != absl::StatusCode::kNotFound) *why_not = std::string(text.status().message());
    return std::nullopt;
  }
  // The first line names the key in full: a digest collision is a miss, not another job's layout.
  const std::string first = text->substr(0, text->find('\n'));
  if (first != kKeyPrefix + key_text) {
    *why_not = absl::StrCat(path, " was made for another job shape");
    return std::nullopt;
  }
  absl::StatusOr<LayerLayout> layout = LayerLayout::Parse(*text, path);
  if (!layout.ok()) {
    *why_not = std::string(layout.status().message());
    return std::nullopt;
  }
  absl::Status fits = layout->CheckModel(config);
  if (fits.ok()) fits = layout->CheckDevice(worker.device().name());
  if (!fits.ok()) {
    *why_not = absl::StrCat(path, ": ", fits.message());
    return std::nullopt;
  }
  if (!layout->autopolicy || layout->autopolicy->build != worker.build()) {
    *why_not = absl::StrCat(path, " was measured by build '", layout->autopolicy ? layout->autopolicy->build : "",
                            "', the workers run '", worker.build(), "' (stale: measured again)");
    return std::nullopt;
  }
  return std::move(*layout);
}

absl::Status PolicyCache::Store(const std::string& key_text, const std::string& policy_yaml,
                                const ModelConfig& config) const {
  if (!enabled()) return absl::OkStatus();
  ASSIGN_OR_RETURN(LayerLayout layout, LayerLayout::Parse(policy_yaml, "AutoPolicy's report"));
  RETURN_IF_ERROR(layout.CheckModel(config));
  if (!layout.autopolicy) return absl::InvalidArgumentError("AutoPolicy's report carries no measurements");
  std::error_code ec;
  std::filesystem::create_directories(dir_, ec);
  if (ec) return absl::FailedPreconditionError(absl::StrCat("policy cache ", dir_, ": ", ec.message()));
  const std::string path = PathOf(key_text);
  const std::string tmp = path + ".tmp";
  const std::string body = absl::StrCat(kKeyPrefix, key_text, "\n", policy_yaml);
  const int fd = open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC | O_NOFOLLOW, 0644);
  if (fd < 0) return absl::FailedPreconditionError(absl::StrCat("policy cache ", tmp, ": ", strerror(errno)));
  size_t done = 0;
  while (done < body.size()) {
    const ssize_t n = write(fd, body.data() + done, body.size() - done);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      const int err = errno;
      close(fd);
      unlink(tmp.c_str());
      return absl::FailedPreconditionError(absl::StrCat("policy cache ", tmp, ": ", strerror(err)));
    }
    done += static_cast<size_t>(n);
  }
  const bool synced = fsync(fd) == 0;
  close(fd);
  if (!synced || rename(tmp.c_str(), path.c_str()) != 0) {  // atomic: a reader sees the old file or the new
    unlink(tmp.c_str());
    return absl::FailedPreconditionError(absl::StrCat("policy cache ", path, ": ", strerror(errno)));
  }
  return absl::OkStatus();
}

}  // namespace slidedp::hostd
