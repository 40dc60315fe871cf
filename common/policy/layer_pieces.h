// The pieces of a decoder layer's forward that its backward reads, as a layer's activation policy
// names them (Elastic Checkpointing, issue 22). A layer keeps its input (the checkpoint) and any
// set of these; backward recomputes the rest from the input and what is kept, so a policy changes
// what is kept, never what is computed.
//
//   qkv        the q/k/v projection's output (a GEMM)
//   attention  the attention output and its log-sum-exp (the attention kernel)
//   o_proj     h1 = x + o·Woᵀ, the residual stream after attention (a GEMM)
//   gate_up    the gate/up projection's output (the layer's largest GEMM)
//   cheap      everything else backward reads: the norms' outputs and rsqrt, q/k after their norms
//              and RoPE, the SwiGLU product (elementwise work, cheap to recompute)
//
// Whole-layer recompute keeps none; selective keeps `attention`; keep-all keeps every piece; a
// segment checkpoint keeps any subset of the four expensive ones.
#pragma once

#include <cstdint>
#include <string>

namespace slidedp {

enum LayerPiece : uint32_t {
  kPieceQkv = 1u << 0,
  kPieceAttention = 1u << 1,
  kPieceOProj = 1u << 2,
  kPieceGateUp = 1u << 3,
  kPieceCheap = 1u << 4,
};
inline constexpr uint32_t kExpensivePieces = kPieceQkv | kPieceAttention | kPieceOProj | kPieceGateUp;
inline constexpr uint32_t kAllPieces = kExpensivePieces | kPieceCheap;

struct LayerPieceName {
  LayerPiece piece;
  const char* name;
};
inline constexpr LayerPieceName kLayerPieceNames[] = {
    {kPieceQkv, "qkv"}, {kPieceAttention, "attention"}, {kPieceOProj, "o_proj"}, {kPieceGateUp, "gate_up"}};

// "qkv+gate_up": the expensive pieces of `pieces`, in the order above.
inline std::string LayerPiecesName(uint32_t pieces) {
  std::string out;
  for (const LayerPieceName& p : kLayerPieceNames) {
    if (pieces & p.piece) out += (out.empty() ? "" : "+") + std::string(p.name);
  }
  return out.empty() ? "none" : out;
}

}  // namespace slidedp
