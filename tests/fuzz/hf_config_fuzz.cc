// libFuzzer target: HF config.json parsing (ModelConfig::FromJson). Any input must give a status,
// never a crash; an accepted config must validate, round-trip through ToJson, and give a layout
// whose sizes are consistent (checked only for configs small enough to lay out cheaply).
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>

#include "common/model/model_config.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  absl::string_view text(reinterpret_cast<const char*>(data), size);
  auto config = slidedp::ModelConfig::FromJson(text);
  if (!config.ok()) return 0;
  if (!config->Validate().ok()) {
    fprintf(stderr, "FromJson accepted a config that Validate rejects: %s\n", config->Validate().ToString().c_str());
    abort();
  }
  const std::string json = config->ToJson();
  auto again = slidedp::ModelConfig::FromJson(json);
  if (!again.ok() || again->ToJson() != json) {
    fprintf(stderr, "config does not round-trip:\n%s\n", json.c_str());
    abort();
  }
  // Layout arithmetic (int64 products of sizes) for configs up to ~10^12 parameters.
  const auto& c = *config;
  if (c.hidden_size < (1 << 16) && c.num_hidden_layers < 1024 && c.vocab_size < (1 << 22) &&
      c.intermediate_size < (1 << 18) && c.q_dim() < (1 << 18) && c.kv_dim() < (1 << 18)) {
    slidedp::ModelLayout layout = slidedp::ModelLayout::Build(c);
    if (layout.num_units() != c.num_hidden_layers + 2) {
      fprintf(stderr, "layout has %d units for %lld layers\n", layout.num_units(), (long long)c.num_hidden_layers);
      abort();
    }
    int64_t total = 0;
    for (const auto& u : layout.units) {
      if (u.numel <= 0) abort();
      total += u.numel;
    }
    if (total != layout.total_numel) {
      fprintf(stderr, "unit sizes sum to %lld, total_numel %lld\n", (long long)total, (long long)layout.total_numel);
      abort();
    }
  }
  return 0;
}
