// The CPU backend through the ComputeBackend interface: agreement with the FP64 reference math,
// document masking, activation policies, gradient accumulation, aliasing, thread-count
// independence, batch validation and the memory ops.
#include "worker/compute/cpu/cpu_backend.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <memory>
#include <string>

#include "absl/strings/str_cat.h"

#include "common/policy/layer_policy.h"
#include "gtest/gtest.h"
#include "worker/compute/cpu/cpu_reference_model.h"
#include "worker/compute/cpu/dense_reference_math.h"
#include "worker/compute/cpu/tests/cpu_test_util.h"

namespace slidedp {
namespace {

using testing::AwkwardConfig;
using testing::AwkwardConfigOf;
using testing::AwkwardYarnConfig;
using testing::MakeBatch;
using testing::RandomNormals;
using testing::RandomUnitParams;
using testing::ToBf16;
using testing::ToDouble;

std::unique_ptr<ComputeBackend> Backend(const ModelConfig& c, CpuBackendOptions options = {}) {
  auto b = MakeCpuBackend(c, options);
  EXPECT_TRUE(b.ok()) << b.status();
  return std::move(b).value();
}

// FP32 backend (BF16 params) against the FP64 math on the same BF16-rounded params.
class BackendVsDouble : public ::testing::TestWithParam<int> {};

TEST_P(BackendVsDouble, LossAndEveryGradientMatchWithinFp32Tolerance) {
  const ModelConfig config =
      GetParam() == 0   ? AwkwardConfig(false)
      : GetParam() == 1 ? AwkwardConfig(true)
      : GetParam() == 2 ? testing::TinyConfig()
      : GetParam() == 3 ? testing::AwkwardYarnConfig(false)
      : GetParam() == 4
          ? testing::AwkwardSlidingConfig(ModelFamily::kQwen2, 3, {AttentionSpan::kSliding, AttentionSpan::kFull})
          : testing::AwkwardGemma3Config(true);
  const ModelLayout layout = ModelLayout::Build(config);
  const auto bf16 = ToBf16(RandomUnitParams(layout, 17));
  const std::vector<MicroBatch> batches = {MakeBatch({9, 1, 13, 4}, config.vocab_size, 1),
                                           MakeBatch({17, 6}, config.vocab_size, 2)};
  int64_t trained = 0;
  for (const auto& b : batches) trained += b.num_trained();
  const float scale = 1.0f / static_cast<float>(trained);

  std::vector<std::vector<float>> grads;
  auto loss = ReferenceLossAndGrads(layout, bf16, batches, scale, &grads);
  ASSERT_TRUE(loss.ok()) << loss.status();
  std::vector<std::vector<double>> grads64;
  const double loss64 = ModelLossAndGrads<double>(layout, ToDouble(bf16), batches, scale, &grads64, nullptr);
  EXPECT_NEAR(*loss, loss64, 1e-5 * loss64);
  for (const UnitLayout& u : layout.units) {
    for (const TensorSlot& t : u.tensors) {
      std::vector<double> a(grads[u.index].begin() + t.offset_numel, grads[u.index].begin() + t.offset_numel + t.numel);
      std::vector<double> b(grads64[u.index].begin() + t.offset_numel,
                            grads64[u.index].begin() + t.offset_numel + t.numel);
      EXPECT_LT(testing::RelativeL2(a, b), 1e-4) << t.hf_name;
    }
  }
}

// 3: yarn; 4: a sliding layer (window 3) beside a full one; 5: gemma3 (scaled embedding, sandwich
// norms, GeGLU, two RoPEs, capped logits).
INSTANTIATE_TEST_SUITE_P(Shapes, BackendVsDouble, ::testing::Values(0, 1, 2, 3, 4, 5));

struct LayerRun {
  std::vector<float> y, dx, dparams;
  int64_t saved_bytes = 0;
};

// One decoder layer forward + backward under a policy, optionally accumulating into dparams.
LayerRun RunLayer(ComputeBackend& be, const std::vector<bf16_t>& params, const MicroBatch& mb,
                  const std::vector<float>& x, const std::vector<float>& dy, ActPolicy policy,
                  std::vector<float> dparams = {}) {
  LayerRun r;
  auto batch = be.UploadBatch(mb);
  EXPECT_TRUE(batch.ok()) << batch.status();
  r.y.assign(x.size(), 0.0f);
  std::unique_ptr<SavedActivations> saved;
  EXPECT_TRUE(be.DecoderForward(params.data(), **batch, x.data(), r.y.data(), policy, &saved).ok());
  r.saved_bytes = saved->bytes();
  r.dx.assign(x.size(), 0.0f);
  r.dparams = dparams.empty() ? std::vector<float>(params.size(), 0.0f) : dparams;
  EXPECT_TRUE(be.DecoderBackward(params.data(), **batch, x.data(), saved.get(), dy.data(), r.dx.data(),
                                 r.dparams.data())
                  .ok());
  return r;
}

bool BitwiseEqual(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

class DecoderLayerTest : public ::testing::Test {
 protected:
  ModelConfig config_ = AwkwardConfig(false);
  ModelLayout layout_ = ModelLayout::Build(config_);
  std::vector<bf16_t> params_ = ToBf16(RandomUnitParams(layout_, 4))[1];
  MicroBatch mb_ = MakeBatch({7, 1, 10, 5}, config_.vocab_size, 8);
  int64_t n_ = mb_.num_tokens() * config_.hidden_size;
  std::vector<float> x_ = RandomNormals<float>(n_, 1);
  std::vector<float> dy_ = RandomNormals<float>(n_, 2);
};

TEST_F(DecoderLayerTest, PoliciesGiveBitwiseIdenticalOutputsAndGradients) {
  auto be = Backend(config_);
  const LayerRun keep = RunLayer(*be, params_, mb_, x_, dy_, ActPolicy::kKeepAll);
  const LayerRun sel = RunLayer(*be, params_, mb_, x_, dy_, ActPolicy::kSelective);
  const LayerRun rec = RunLayer(*be, params_, mb_, x_, dy_, ActPolicy::kRecomputeLayer);
  for (const LayerRun* r : {&sel, &rec}) {
    EXPECT_TRUE(BitwiseEqual(r->y, keep.y));
    EXPECT_TRUE(BitwiseEqual(r->dx, keep.dx));
    EXPECT_TRUE(BitwiseEqual(r->dparams, keep.dparams));
  }
  // Every segment checkpoint (each subset of the expensive pieces) too, keeping exactly its pieces.
  for (uint32_t keep_mask = 1; keep_mask <= kExpensivePieces; ++keep_mask) {
    const ActPolicy seg = ActPolicy::Segment(keep_mask);
    const LayerRun r = RunLayer(*be, params_, mb_, x_, dy_, seg);
    EXPECT_TRUE(BitwiseEqual(r.y, keep.y)) << LayerPiecesName(keep_mask);
    EXPECT_TRUE(BitwiseEqual(r.dx, keep.dx)) << LayerPiecesName(keep_mask);
    EXPECT_TRUE(BitwiseEqual(r.dparams, keep.dparams)) << LayerPiecesName(keep_mask);
    EXPECT_EQ(r.saved_bytes, be->SavedBytesPerToken(seg) * mb_.num_tokens()) << LayerPiecesName(keep_mask);
    EXPECT_GT(be->SavedBytesPerToken(ActPolicy::kKeepAll), be->SavedBytesPerToken(seg));
  }
  EXPECT_EQ(be->SavedBytesPerToken(ActPolicy::Segment(kPieceAttention)), be->SavedBytesPerToken(ActPolicy::kSelective));
  // Backward with no saved state at all is the whole-layer recompute too.
  auto batch = be->UploadBatch(mb_);
  ASSERT_TRUE(batch.ok());
  std::vector<float> dx(n_), dparams(params_.size(), 0.0f);
  ASSERT_TRUE(be->DecoderBackward(params_.data(), **batch, x_.data(), nullptr, dy_.data(), dx.data(), dparams.data()).ok());
  EXPECT_TRUE(BitwiseEqual(dx, keep.dx));
  EXPECT_TRUE(BitwiseEqual(dparams, keep.dparams));
  // Saved bytes are what SavedBytesPerToken promises, and ordered as the policies intend.
  const int64_t T = mb_.num_tokens();
  EXPECT_EQ(keep.saved_bytes, be->SavedBytesPerToken(ActPolicy::kKeepAll) * T);
  EXPECT_EQ(sel.saved_bytes, be->SavedBytesPerToken(ActPolicy::kSelective) * T);
  EXPECT_EQ(rec.saved_bytes, 0);
  EXPECT_EQ(be->SavedBytesPerToken(ActPolicy::kSelective), 4 * (config_.q_dim() + config_.num_attention_heads));
  EXPECT_GT(be->SavedBytesPerToken(ActPolicy::kKeepAll), be->SavedBytesPerToken(ActPolicy::kSelective));
}

// What a forward keeps moves out whole (an activation store's Detach) and comes back at another
// address (Attach), with the same backward to the bit; a backward while it is out, or a block of
// another size, is refused. The FP32 elements per token are what hostd's admission counts.
TEST_F(DecoderLayerTest, SavedActivationsMoveOutAndBack) {
  auto be = Backend(config_);
  auto batch = be->UploadBatch(mb_);
  ASSERT_TRUE(batch.ok());
  for (uint32_t pieces = 1; pieces <= kAllPieces; ++pieces) {
    const ActPolicy policy{pieces};
    if (!policy.keeps_all() && (pieces & kPieceCheap)) continue;  // the cheap pieces go only with keep-all
    const LayerRun want = RunLayer(*be, params_, mb_, x_, dy_, policy);
    std::vector<float> y(n_);
    std::unique_ptr<SavedActivations> saved;
    ASSERT_TRUE(be->DecoderForward(params_.data(), **batch, x_.data(), y.data(), policy, &saved).ok());
    const int64_t bytes = saved->bytes();
    EXPECT_EQ(bytes, 4 * KeptElementsPerToken(ModelShape::Of(config_), pieces) * mb_.num_tokens())
        << LayerPiecesName(pieces);
    std::unique_ptr<DeviceBuffer> block = saved->Detach();
    ASSERT_NE(block, nullptr) << LayerPiecesName(pieces);
    ASSERT_EQ(block->bytes(), bytes);
    std::vector<char> host(static_cast<const char*>(block->data()), static_cast<const char*>(block->data()) + bytes);
    block.reset();
    std::vector<float> dx(n_), dparams(params_.size(), 0.0f);
    EXPECT_EQ(be->DecoderBackward(params_.data(), **batch, x_.data(), saved.get(), dy_.data(), dx.data(),
                                  dparams.data())
                  .code(),
              absl::StatusCode::kFailedPrecondition);
    auto wrong = be->Allocate(bytes + 4);
    ASSERT_TRUE(wrong.ok());
    EXPECT_EQ(saved->Attach(std::move(*wrong)).code(), absl::StatusCode::kInvalidArgument);
    auto back = be->Allocate(bytes);
    ASSERT_TRUE(back.ok());
    std::memcpy((*back)->data(), host.data(), bytes);
    ASSERT_TRUE(saved->Attach(std::move(*back)).ok());
    ASSERT_TRUE(
        be->DecoderBackward(params_.data(), **batch, x_.data(), saved.get(), dy_.data(), dx.data(), dparams.data())
            .ok());
    EXPECT_TRUE(BitwiseEqual(dx, want.dx)) << LayerPiecesName(pieces);
    EXPECT_TRUE(BitwiseEqual(dparams, want.dparams)) << LayerPiecesName(pieces);
  }
}

TEST_F(DecoderLayerTest, AccumulatingTwoMicroBatchesEqualsTheSum) {
  auto be = Backend(config_);
  const MicroBatch mb2 = MakeBatch({4, 9, 3}, config_.vocab_size, 9);
  const int64_t n2 = mb2.num_tokens() * config_.hidden_size;
  const std::vector<float> x2 = RandomNormals<float>(n2, 3), dy2 = RandomNormals<float>(n2, 4);
  const LayerRun a = RunLayer(*be, params_, mb_, x_, dy_, ActPolicy::kSelective);
  const LayerRun b = RunLayer(*be, params_, mb2, x2, dy2, ActPolicy::kKeepAll);
  const LayerRun acc = RunLayer(*be, params_, mb2, x2, dy2, ActPolicy::kKeepAll, a.dparams);
  std::vector<float> sum(a.dparams.size());
  for (size_t i = 0; i < sum.size(); ++i) sum[i] = a.dparams[i] + b.dparams[i];
  EXPECT_TRUE(BitwiseEqual(acc.dparams, sum));
}

TEST_F(DecoderLayerTest, DxMayAliasDy) {
  auto be = Backend(config_);
  const LayerRun ref = RunLayer(*be, params_, mb_, x_, dy_, ActPolicy::kKeepAll);
  auto batch = be->UploadBatch(mb_);
  ASSERT_TRUE(batch.ok());
  std::vector<float> y(n_), grad = dy_, dparams(params_.size(), 0.0f);
  std::unique_ptr<SavedActivations> saved;
  ASSERT_TRUE(be->DecoderForward(params_.data(), **batch, x_.data(), y.data(), ActPolicy::kSelective, &saved).ok());
  ASSERT_TRUE(be->DecoderBackward(params_.data(), **batch, x_.data(), saved.get(), grad.data(), grad.data(),
                                  dparams.data()).ok());
  EXPECT_TRUE(BitwiseEqual(grad, ref.dx));
  EXPECT_TRUE(BitwiseEqual(dparams, ref.dparams));
}

TEST_F(DecoderLayerTest, ResultsDoNotDependOnTheThreadCount) {
  CpuBackendOptions one, three;
  one.num_threads = 1;
  three.num_threads = 3;
  auto be1 = Backend(config_, one);
  auto be3 = Backend(config_, three);
  const LayerRun a = RunLayer(*be1, params_, mb_, x_, dy_, ActPolicy::kKeepAll);
  const LayerRun b = RunLayer(*be3, params_, mb_, x_, dy_, ActPolicy::kKeepAll);
  EXPECT_TRUE(BitwiseEqual(a.y, b.y));
  EXPECT_TRUE(BitwiseEqual(a.dx, b.dx));
  EXPECT_TRUE(BitwiseEqual(a.dparams, b.dparams));
}

// The largest |a - b| relative to the largest |b| (0 for equal vectors).
double RelMaxDiff(const std::vector<float>& a, const std::vector<float>& b) {
  double diff = 0, scale = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    diff = std::max(diff, std::fabs(static_cast<double>(a[i]) - b[i]));
    scale = std::max(scale, std::fabs(static_cast<double>(b[i])));
  }
  return scale > 0 ? diff / scale : diff;
}

// A micro-batch longer than the backend's tile runs the token-local work tile by tile: outputs and
// input gradients are the untiled ones bit for bit (every op there works row by row), weight
// gradients within FP32 rounding (summed per tile, then added), for tiles that cut documents
// anywhere (odd sizes, a tile of one token, a last tile of one token), every family and policy, and
// a sliding window shorter than the documents (attention runs whole, the window included).
TEST(Tiling, TiledLayerEqualsUntiled) {
  const MicroBatch mb = MakeBatch({7, 1, 10, 5}, 37, 8);  // 23 tokens
  for (const ModelConfig& config :
       {AwkwardConfigOf(ModelFamily::kQwen3, false), AwkwardConfigOf(ModelFamily::kQwen2, false),
        AwkwardConfigOf(ModelFamily::kLlama, false),
        testing::AwkwardSlidingConfig(ModelFamily::kMistral, 3, {AttentionSpan::kSliding, AttentionSpan::kSliding})}) {
    const ModelFamily family = config.family;
    const ModelLayout layout = ModelLayout::Build(config);
    const std::vector<bf16_t> params = ToBf16(RandomUnitParams(layout, 4))[1];
    const int64_t n = mb.num_tokens() * config.hidden_size;
    const std::vector<float> x = RandomNormals<float>(n, 1), dy = RandomNormals<float>(n, 2);
    auto whole = Backend(config);
    whole->SetTileTokens(1 << 20);
    const LayerRun ref = RunLayer(*whole, params, mb, x, dy, ActPolicy::kRecomputeLayer);
    for (const int64_t tile : {1, 2, 5, 11, 22, 23}) {
      auto be = Backend(config);
      be->SetTileTokens(tile);
      ASSERT_EQ(be->TileRows(mb.num_tokens()), tile);
      for (const ActPolicy policy : {ActPolicy::kRecomputeLayer, ActPolicy::kSelective, ActPolicy::kKeepAll}) {
        const LayerRun r = RunLayer(*be, params, mb, x, dy, policy);
        const std::string what = absl::StrCat(ModelTypeName(family), " tile ", tile, " policy ", policy.pieces);
        EXPECT_TRUE(BitwiseEqual(r.y, ref.y)) << what;
        EXPECT_TRUE(BitwiseEqual(r.dx, ref.dx)) << what;
        EXPECT_LT(RelMaxDiff(r.dparams, ref.dparams), 2e-6) << what;
        if (tile == 23) {  // one tile: untiled
          EXPECT_TRUE(BitwiseEqual(r.dparams, ref.dparams)) << what;
        }
      }
    }
  }
}

// The reference math's tiled layer in double against central differences would repeat the
// gradient checks; in double the tiled layer equals the untiled one to rounding, which carries
// the untiled layer's gradient check over.
TEST(Tiling, TiledReferenceMathInDoubleMatchesUntiled) {
  const ModelConfig config = AwkwardYarnConfig(false);
  const ModelLayout layout = ModelLayout::Build(config);
  const std::vector<double> params = RandomUnitParams(layout, 5)[1];
  const MicroBatch mb = MakeBatch({9, 4, 6}, config.vocab_size, 3);
  const RopeTables rope = BuildRopeTables(mb.positions, config);
  const TokenGeometry geom = MakeTokenGeometry(mb, rope);
  const DecoderDims dims = DecoderDims::From(config);
  const DecoderOffsets offs = DecoderOffsets::From(config);
  const int64_t n = mb.num_tokens() * config.hidden_size;
  const std::vector<double> x = RandomNormals<double>(n, 6), dy = RandomNormals<double>(n, 7);
  std::vector<double> y0(n), dx0(n), g0(params.size(), 0.0);
  DecoderForwardTiled(dims, offs, params.data(), geom, x.data(), y0.data(), 0, nullptr);
  DecoderBackwardTiled(dims, offs, params.data(), geom, x.data(), dy.data(), dx0.data(), g0.data(), 0, nullptr);
  for (const int64_t tile : {3, 7, 18}) {
    std::vector<double> y(n), dx(n), g(params.size(), 0.0);
    DecoderForwardTiled(dims, offs, params.data(), geom, x.data(), y.data(), tile, nullptr);
    DecoderBackwardTiled(dims, offs, params.data(), geom, x.data(), dy.data(), dx.data(), g.data(), tile, nullptr);
    EXPECT_EQ(y, y0) << tile;
    EXPECT_EQ(dx, dx0) << tile;
    for (size_t i = 0; i < g.size(); ++i) ASSERT_NEAR(g[i], g0[i], 1e-12 * (1 + std::fabs(g0[i]))) << tile << " " << i;
  }
}

// Changing the tokens of one document leaves every other document's outputs (after the whole
// stack) untouched, and does change its own.
TEST(DocumentMasking, OtherDocumentsInTheRowAreUnaffected) {
  for (const ModelConfig& config : {AwkwardConfig(false), testing::TinyConfig()}) {
    const ModelLayout layout = ModelLayout::Build(config);
    const auto params = ToBf16(RandomUnitParams(layout, 6));
    auto be = Backend(config);
    MicroBatch mb = MakeBatch({6, 5, 8}, config.vocab_size, 5);
    auto forward = [&](const MicroBatch& b) {
      auto batch = be->UploadBatch(b);
      EXPECT_TRUE(batch.ok());
      const int64_t n = b.num_tokens() * config.hidden_size;
      std::vector<float> h(n), next(n);
      EXPECT_TRUE(be->EmbeddingForward(params[0].data(), **batch, h.data()).ok());
      for (int u = 1; u + 1 < layout.num_units(); ++u) {
        EXPECT_TRUE(be->DecoderForward(params[u].data(), **batch, h.data(), next.data(), ActPolicy::kKeepAll, nullptr).ok());
        h.swap(next);
      }
      return h;
    };
    const std::vector<float> before = forward(mb);
    for (int32_t t = 6; t < 11; ++t) mb.tokens[t] = (mb.tokens[t] + 1 + t) % config.vocab_size;  // document 1
    const std::vector<float> after = forward(mb);
    const int64_t H = config.hidden_size;
    for (int64_t t = 0; t < mb.num_tokens(); ++t) {
      const bool in_changed_doc = t >= 6 && t < 11;
      const bool same = std::memcmp(&before[t * H], &after[t * H], H * sizeof(float)) == 0;
      EXPECT_EQ(same, !in_changed_doc) << "token " << t;
    }
  }
}

TEST(Head, IgnoredTokensGetZeroGradientAndAllIgnoredAddsNothing) {
  const ModelConfig config = AwkwardConfig(false);
  const ModelLayout layout = ModelLayout::Build(config);
  const auto params = ToBf16(RandomUnitParams(layout, 2));
  CpuBackendOptions options;
  options.head_chunking = HeadChunking{3, 7};
  auto be = Backend(config, options);
  MicroBatch mb = MakeBatch({5, 8}, config.vocab_size, 3, /*ignore_every=*/2);
  const int64_t n = mb.num_tokens() * config.hidden_size;
  const std::vector<float> x = RandomNormals<float>(n, 6);
  const bf16_t* norm = params.back().data();
  const bf16_t* lm = params.back().data() + layout.head().tensors[1].offset_numel;
  std::vector<float> dx(n, 5.0f), dnorm(config.hidden_size, 0.0f), dlm(config.vocab_size * config.hidden_size, 0.0f);
  float loss = 1.0f;
  {
    auto batch = be->UploadBatch(mb);
    ASSERT_TRUE(batch.ok());
    ASSERT_TRUE(be->HeadForwardBackward(norm, lm, **batch, x.data(), 0.5f, dx.data(), dnorm.data(), dlm.data(), &loss).ok());
  }
  EXPECT_GT(loss, 1.0f);
  for (int64_t t = 0; t < mb.num_tokens(); ++t) {
    double row = 0;
    for (int64_t i = 0; i < config.hidden_size; ++i) row += std::abs(dx[t * config.hidden_size + i]);
    if (mb.labels[t] == kIgnoreIndex) {
      EXPECT_EQ(row, 0.0) << "token " << t;
    } else {
      EXPECT_GT(row, 0.0) << "token " << t;
    }
  }
  // Every label ignored: loss and gradients unchanged, dx zero.
  for (auto& l : mb.labels) l = kIgnoreIndex;
  auto batch = be->UploadBatch(mb);
  ASSERT_TRUE(batch.ok());
  const float loss_before = loss;
  const std::vector<float> dlm_before = dlm;
  ASSERT_TRUE(be->HeadForwardBackward(norm, lm, **batch, x.data(), 0.5f, dx.data(), dnorm.data(), dlm.data(), &loss).ok());
  EXPECT_EQ(loss, loss_before);
  EXPECT_TRUE(BitwiseEqual(dlm, dlm_before));
  for (float v : dx) ASSERT_EQ(v, 0.0f);
}

class Validation : public ::testing::Test {
 protected:
  void ExpectInvalid(const MicroBatch& mb, const std::string& needle) {
    auto r = be_->UploadBatch(mb);
    ASSERT_FALSE(r.ok()) << "accepted a bad batch (expected: " << needle << ")";
    EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_NE(std::string(r.status().message()).find(needle), std::string::npos) << r.status();
  }
  ModelConfig config_ = AwkwardConfig(false);  // vocab 37, max positions 128
  std::unique_ptr<ComputeBackend> be_ = Backend(config_);
  MicroBatch good_ = MakeBatch({4, 3}, config_.vocab_size, 1);
};

TEST_F(Validation, AcceptsAGoodBatch) { EXPECT_TRUE(be_->UploadBatch(good_).ok()); }

TEST_F(Validation, RejectsTokenIdsOutsideTheVocabularyNamingIndexAndValue) {
  MicroBatch mb = good_;
  mb.tokens[5] = 37;
  ExpectInvalid(mb, "token 5 has id 37");
  mb.tokens[5] = -1;
  ExpectInvalid(mb, "token 5 has id -1");
}

TEST_F(Validation, RejectsBadLabels) {
  MicroBatch mb = good_;
  mb.labels[2] = 40;
  ExpectInvalid(mb, "label 2 is 40");
  mb.labels[2] = -5;
  ExpectInvalid(mb, "label 2 is -5");
}

TEST_F(Validation, RejectsPositionsOutOfRange) {
  MicroBatch mb = good_;
  mb.positions[1] = -1;
  ExpectInvalid(mb, "position 1 is -1");
  mb.positions[1] = 128;
  ExpectInvalid(mb, "position 1 is 128");
}

TEST_F(Validation, RejectsInconsistentCuSeqlensAndSizes) {
  MicroBatch mb = good_;
  mb.cu_seqlens = {1, 4, 7};
  ExpectInvalid(mb, "from 0 to T=7");
  mb.cu_seqlens = {0, 4, 6};
  ExpectInvalid(mb, "from 0 to T=7");
  mb.cu_seqlens = {0, 5, 4, 7};
  ExpectInvalid(mb, "decreases at entry 2");
  mb.cu_seqlens = {0};
  ExpectInvalid(mb, "at least 2");
  mb = good_;
  mb.max_seqlen = 3;
  ExpectInvalid(mb, "longest document (4 tokens)");
  mb = good_;
  mb.labels.pop_back();
  ExpectInvalid(mb, "sizes disagree");
  mb = good_;
  mb.positions.push_back(0);
  ExpectInvalid(mb, "sizes disagree");
  ExpectInvalid(MicroBatch{}, "no tokens");
}

TEST(MemoryOps, AllocateCopyMemsetRoundTrip) {
  auto be = Backend(AwkwardConfig(false));
  auto buf = be->Allocate(64);
  ASSERT_TRUE(buf.ok());
  EXPECT_EQ((*buf)->bytes(), 64);
  EXPECT_EQ(reinterpret_cast<uintptr_t>((*buf)->data()) % 64, 0u);
  std::vector<uint8_t> in(64), out(64);
  for (int i = 0; i < 64; ++i) in[i] = static_cast<uint8_t>(i * 3);
  ASSERT_TRUE(be->CopyToDevice(in.data(), (*buf)->data(), 64).ok());
  ASSERT_TRUE(be->CopyToHost((*buf)->data(), out.data(), 64).ok());
  EXPECT_EQ(in, out);
  ASSERT_TRUE(be->Memset(**buf, 0).ok());
  ASSERT_TRUE(be->CopyToHost((*buf)->data(), out.data(), 64).ok());
  EXPECT_EQ(out, std::vector<uint8_t>(64, 0));
  EXPECT_EQ(be->Allocate(-1).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(be->activation_dtype(), Dtype::kF32);
  EXPECT_TRUE(be->Synchronize().ok());
}

// The checkpoint conversion (runtime.checkpoint_dtype bf16): FP32 -> BF16 rounds to nearest even
// (ties to the even mantissa, both ways; a carry into the exponent; overflow to infinity), keeps
// NaNs NaN (quiet) and infinities and signed zeros as they are; BF16 -> FP32 is exact for every
// bit pattern, so a round trip is the rounding. An odd count; a dtype to itself copies.
TEST(MemoryOps, ConvertActivationsRoundsToNearestEvenAndWidensExactly) {
  auto be = Backend(AwkwardConfig(false));
  auto f32 = [](uint32_t bits) {
    float f;
    std::memcpy(&f, &bits, 4);
    return f;
  };
  struct Case {
    uint32_t in;
    uint16_t want;
  };
  const std::vector<Case> cases = {
      {0x3f800000u, 0x3f80},  // 1.0: exact
      {0x3f808000u, 0x3f80},  // 1 + half a BF16 ulp: a tie, to the even mantissa (down)
      {0x3f818000u, 0x3f82},  // a tie above an odd mantissa: up, to even
      {0x3f808001u, 0x3f81},  // just over the tie: up
      {0x3f817fffu, 0x3f81},  // just under the tie: down
      {0xbf808000u, 0xbf80},  // negative tie: to even, in magnitude
      {0xbf818000u, 0xbf82},  // negative tie above an odd mantissa: to even, up in magnitude
      {0x3fffffffu, 0x4000},  // rounds up into the next exponent
      {0x7f7fffffu, 0x7f80},  // FLT_MAX: rounds to infinity
      {0x7f800000u, 0x7f80},  // +inf
      {0xff800000u, 0xff80},  // -inf
      {0x00000000u, 0x0000},  // +0
      {0x80000000u, 0x8000},  // -0
      {0x00000001u, 0x0000},  // the smallest subnormal: to zero
      {0x00418000u, 0x0042},  // a subnormal tie: to even
      {0x7fc00000u, 0x7fc0},  // quiet NaN
      {0x7f800001u, 0x7fc0},  // signalling NaN, payload only in the low bits: a quiet NaN
      {0xffffffffu, 0xffff},  // negative NaN, all payload bits
  };
  const int64_t n = static_cast<int64_t>(cases.size()) + 5;  // odd, with random normals after the cases
  std::vector<float> in(n);
  for (size_t i = 0; i < cases.size(); ++i) in[i] = f32(cases[i].in);
  const std::vector<float> extra = RandomNormals<float>(n - static_cast<int64_t>(cases.size()), 3);
  for (size_t i = cases.size(); i < static_cast<size_t>(n); ++i) in[i] = extra[i - cases.size()];
  auto src = *be->Allocate(n * 4);
  auto narrow = *be->Allocate(n * 2);
  auto wide = *be->Allocate(n * 4);
  ASSERT_TRUE(be->CopyToDevice(in.data(), src->data(), n * 4).ok());
  ASSERT_TRUE(be->ConvertActivations(src->data(), Dtype::kF32, narrow->data(), Dtype::kBF16, n).ok());
  std::vector<uint16_t> got(n);
  ASSERT_TRUE(be->CopyToHost(narrow->data(), got.data(), n * 2).ok());
  for (size_t i = 0; i < cases.size(); ++i) {
    EXPECT_EQ(got[i], cases[i].want) << std::hex << "0x" << cases[i].in;
  }
  for (int64_t i = 0; i < n; ++i) EXPECT_EQ(got[i], FloatToBf16(in[i])) << i;
  ASSERT_TRUE(be->ConvertActivations(narrow->data(), Dtype::kBF16, wide->data(), Dtype::kF32, n).ok());
  std::vector<uint32_t> back(n);
  ASSERT_TRUE(be->CopyToHost(wide->data(), back.data(), n * 4).ok());
  for (int64_t i = 0; i < n; ++i) EXPECT_EQ(back[i], static_cast<uint32_t>(got[i]) << 16) << i;
  // Every BF16 pattern widens exactly (NaN payloads included).
  std::vector<uint16_t> all(65536);
  for (int i = 0; i < 65536; ++i) all[i] = static_cast<uint16_t>(i);
  auto all_dev = *be->Allocate(65536 * 2);
  auto all_wide = *be->Allocate(65536 * 4);
  ASSERT_TRUE(be->CopyToDevice(all.data(), all_dev->data(), 65536 * 2).ok());
  ASSERT_TRUE(be->ConvertActivations(all_dev->data(), Dtype::kBF16, all_wide->data(), Dtype::kF32, 65536).ok());
  std::vector<uint32_t> all_back(65536);
  ASSERT_TRUE(be->CopyToHost(all_wide->data(), all_back.data(), 65536 * 4).ok());
  int64_t differ = 0;
  for (int i = 0; i < 65536; ++i) differ += all_back[i] != static_cast<uint32_t>(i) << 16;
  EXPECT_EQ(differ, 0);
  // A dtype to itself copies; a negative count and null pointers are refused; nothing to do is fine.
  auto copy = *be->Allocate(n * 4);
  ASSERT_TRUE(be->ConvertActivations(src->data(), Dtype::kF32, copy->data(), Dtype::kF32, n).ok());
  EXPECT_EQ(std::memcmp(copy->data(), src->data(), n * 4), 0);
  EXPECT_EQ(be->ConvertActivations(src->data(), Dtype::kF32, narrow->data(), Dtype::kBF16, -1).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(be->ConvertActivations(nullptr, Dtype::kF32, narrow->data(), Dtype::kBF16, 1).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(be->ConvertActivations(nullptr, Dtype::kF32, nullptr, Dtype::kBF16, 0).ok());
}

TEST(Factory, RejectsBadConfigAndOptions) {
  ModelConfig bad = AwkwardConfig(false);
  bad.num_key_value_heads = 4;  // 6 heads not a multiple of 4
  EXPECT_EQ(MakeCpuBackend(bad).status().code(), absl::StatusCode::kInvalidArgument);
  CpuBackendOptions options;
  options.head_chunking.vocab_chunk = 0;
  EXPECT_EQ(MakeCpuBackend(AwkwardConfig(false), options).status().code(), absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace slidedp
