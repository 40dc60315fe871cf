// The job's initial state; see initial_weights.h.
#include "hostd/engine/initial_weights.h"

#include <cstring>
#include <filesystem>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/numeric/bf16.h"
#include "common/parallel/parallel_for.h"
#include "common/status/status_macros.h"
#include "hostd/update/adamw_state.h"
#include "nlohmann/json.hpp"

namespace slidedp::hostd {
namespace {

constexpr int64_t kPieceNumel = 16 << 20;  // elements per task of the bulk loops (64 MiB of FP32)
static_assert(kPieceNumel % kInt8MomentBlock == 0, "pieces must not split an int8 block");

struct Piece {
  int unit;
  int64_t offset, numel;
};

// Every unit in pieces, so the embedding does not leave one thread alone.
std::vector<Piece> PiecesOf(const ModelLayout& layout) {
  std::vector<Piece> pieces;
  for (int u = 0; u < layout.num_units(); ++u) {
    for (int64_t off = 0; off < layout.units[u].numel; off += kPieceNumel) {
      pieces.push_back({u, off, std::min<int64_t>(kPieceNumel, layout.units[u].numel - off)});
    }
  }
  return pieces;
}

}  // namespace

checkpoint::StateArrays StateArraysOf(shm::JobState& js) {
  checkpoint::StateArrays arrays;
  arrays.master = [&js](int u) { return js.master(u); };
  arrays.moment_form = js.moment_form();
  arrays.moments = [&js](int u) {
    const shm::JobState::Moments mo = js.moments(u);
    return checkpoint::UnitMoments{mo.m, mo.v, mo.m_scale, mo.v_scale};
  };
  return arrays;
}

void ZeroMoments(const ModelLayout& layout, shm::JobState& js, int threads) {
  // All-zero bytes are zero moments in every layout: FP32 and BF16 +0, int8 code 0 with scale 0
  // (decodes to +0 for m and v; tested against the decoders).
  const size_t element_bytes = js.moment_form() == MomentForm::kF32    ? 4
                               : js.moment_form() == MomentForm::kBF16 ? 2
                                                                        : 1;
  const std::vector<Piece> pieces = PiecesOf(layout);
  ParallelFor(pieces.size(), threads, [&](size_t p) {
    const Piece& pc = pieces[p];
    const shm::JobState::Moments mo = js.moments(pc.unit);
    std::memset(static_cast<char*>(mo.m) + pc.offset * element_bytes, 0, pc.numel * element_bytes);
    std::memset(static_cast<char*>(mo.v) + pc.offset * element_bytes, 0, pc.numel * element_bytes);
    if (mo.m_scale != nullptr) {
      // Pieces start on block boundaries (kPieceNumel is a multiple of the block), so each block's
      // scale belongs to exactly one piece.
      const int64_t first = pc.offset / kInt8MomentBlock, blocks = Int8MomentBlocks(pc.numel);
      std::memset(mo.m_scale + first, 0, blocks * sizeof(float));
      std::memset(mo.v_scale + first, 0, blocks * sizeof(float));
    }
  });
}

absl::StatusOr<InitialState> WriteInitialState(JobContext& ctx, const JobSpec& spec, const ModelLayout& layout,
                                               shm::JobState& js, bool reused_segment, int threads,
                                               const ModelLayout& model_layout, const NodeSharding& sharding) {
  const std::vector<Piece> pieces = PiecesOf(layout);
  // Until the end of this function the segment holds no step of anything (ConsistentStep).
  js.state_written().store(0, std::memory_order_release);
  if (reused_segment && ctx.resume_from().empty()) {
    // A fresh segment is zero: so must the moments of a reused one be. (Master is written whole
    // below, padding included, by the random init or the weight loader; a resumed job's
    // checkpoint writes master, moments and scales.)
    ZeroMoments(layout, js, threads);
  }
  const checkpoint::StateArrays arrays = StateArraysOf(js);
  InitialState state;
  checkpoint::LoadOptions load{.threads = threads};
  // A sharded state: each unit's array holds the node's range of the model's unit.
  if (sharding.sharded()) {
    for (const UnitLayout& u : model_layout.units) load.windows.push_back(sharding.Range(u.index, u.numel));
  }
  checkpoint::LoadOptions load_hf = load;
  load_hf.windows.clear();  // the node's layout cuts the tensors itself
  load_hf.pass_through = &state.pass_through;
  if (!ctx.resume_from().empty()) {
    std::string dir = ctx.resume_from();
    std::error_code ec;  // the non-throwing form: a looping or over-long path is "not there"
    if (!std::filesystem::exists(std::filesystem::path(dir) / "COMPLETE", ec)) {
      ASSIGN_OR_RETURN(dir, checkpoint::FindLatestCheckpoint(dir));
    }
    ASSIGN_OR_RETURN(auto loaded, checkpoint::LoadCheckpoint(dir, model_layout, arrays, load));
    ASSIGN_OR_RETURN(state.pass_through, checkpoint::ReadPassThrough(dir, layout.config));
    state.first_step = loaded.step;
    // Checkpoints from before train.skip_nonfinite have no count: nothing was skipped then.
    const nlohmann::json& ts = loaded.trainer_state;
    if (ts.is_object() && ts.contains("skipped_steps")) {
      const nlohmann::json& k = ts["skipped_steps"];
      if (!k.is_number_integer() || k.get<int64_t>() < 0 || k.get<int64_t>() > state.first_step) {
        return absl::DataLossError(absl::StrCat(dir, "/trainer_state.json: skipped_steps ", k.dump(),
                                                " is not a count of steps in [0, ", state.first_step, "]"));
      }
      state.skipped_steps = k.get<int64_t>();
    }
    ctx.Log(absl::StrCat(
        "resumed from ", dir, " at step ", state.first_step,
        state.skipped_steps > 0 ? absl::StrCat(" (", state.skipped_steps, " skipped as non-finite)") : std::string()));
    if (!loaded.conversion_note.empty()) ctx.Log(loaded.conversion_note);
  } else if (!spec.model.path.empty()) {
    RETURN_IF_ERROR(checkpoint::LoadHfModel(spec.model.path, layout, arrays.master, load_hf));
    ctx.Log(absl::StrCat("loaded weights from ", spec.model.path));
    if (!state.pass_through.empty()) {
      ctx.Log(absl::StrCat(state.pass_through.size(), " tensor(s) not trained (vision tower, multi-token prediction) "
                           "are kept unchanged in every checkpoint"));
    }
  } else {
    checkpoint::InitRandom(model_layout, spec.model.init_seed, arrays.master, /*threads=*/0,
                           sharding.sharded() ? &load.windows : nullptr);
    ctx.Log(absl::StrCat("random init (seed ", spec.model.init_seed, ")"));
  }
  // The BF16 mirror of the initial weights, in pieces over the threads (one thread converts only
  // ~1 Gparam/s: seconds for a 4B model). Without one the workers cast the master themselves.
  if (js.has_mirror()) ParallelFor(pieces.size(), threads, [&](size_t p) {
    const Piece& pc = pieces[p];
    const float* w = js.master(pc.unit) + pc.offset;
    bf16_t* mirror = js.mirror(pc.unit) + pc.offset;
    for (int64_t i = 0; i < pc.numel; ++i) mirror[i] = FloatToBf16(w[i]);
  });
  for (int u = 0; u < layout.num_units(); ++u) js.version(u).Publish(static_cast<uint32_t>(state.first_step));
  js.step_counter().store(state.first_step);
  js.skipped_steps_counter().store(state.skipped_steps);
  js.state_written().store(1, std::memory_order_release);
  return state;
}

}  // namespace slidedp::hostd
