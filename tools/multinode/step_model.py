#!/usr/bin/env python3
"""The multi-node step-time model of docs/multi-node.md (issue 52), on paper: for N nodes of G GPUs,
replicated or sharded host state, it predicts one optimizer step from the terms that overlap in
SlideDP's pipeline and names the one that bounds it.

  C  compute     tokens per GPU / the GPU's measured rate (compute-only mode, row 17 of
                 docs/gpu-results.md: Qwen3-8B 9,507 tok/s at 64K = 466 model TFLOP/s; other models at
                 the same model TFLOP/s)
  S  streaming   every GPU receives every unit's BF16 weights once per step: 2 P bytes over its host
                 link (53.7 GB/s measured, row 39; PCIE_GBPS)
  U  host update LayerAdam over the parameters the node owns: P (replicated) or P / N (sharded), at
                 ADAM_GPARAM_S per node (4.24 Gparam/s measured on a 16-core host at 119 GB/s, row 29;
                 an 8-GPU server's memory bandwidth gives about 2.5x: 10 by default)
  X  network     bytes through a node's NICs per step: replicated, an all-reduce of the FP32 gradient
                 among the N nodes (2 (N-1)/N x 4P); sharded, a reduce-scatter of the FP32 gradient
                 ((N-1)/N x 4P) and an all-gather of the BF16 weights ((N-1)/N x 2P)

Within a node, gradients reduce over NVLink and reach the host once (as on one node today, not a
bound here). The four run concurrently, per unit: backward's gradient of unit u goes out while unit
u-1 computes, LayerAdam updates it while the network carries the next, the weights stream ahead of
the forward. Gradients exist only during the backward (2/3 of C): their share X_grad stretches the
step past C / 3 + X_grad; the sharded weights' all-gather overlaps anything. The step is the longest
term plus the last unit's exposed tail (its share of X and U that nothing overlaps):
step = max(C, C / 3 + X_grad, X, S, U) + (X + U) / L.

Run: python3 tools/multinode/step_model.py [--tokens 65536] [--markdown]
"""
import argparse

GIB = 1024 ** 3


def dense_params(h, layers, nq, nkv, hd, inter, vocab, tied, qkv_bias=False):
    """HF num_parameters() of a Qwen-style dense decoder (q/k norms ignored: 2 x hd per layer)."""
    qd, kvd = nq * hd, nkv * hd
    per_layer = h * (qd + 2 * kvd) + qd * h + 3 * h * inter + 2 * h + 2 * hd
    if qkv_bias:
        per_layer += qd + 2 * kvd
    embed = vocab * h * (1 if tied else 2)
    return embed + layers * per_layer + h


# name: (parameters, matmul parameters a token meets, layers, q_dim, seq) — shapes of the presets
# (common/model/model_presets.cc): Qwen3-8B; and Qwen2.5-72B's for "72B" (Qwen3 has no dense 72B).
MODELS = {
    "Qwen3-8B": dict(h=4096, layers=36, nq=32, nkv=8, hd=128, inter=12288, vocab=151936, tied=False),
    "72B (Qwen2.5-72B shape)": dict(h=8192, layers=80, nq=64, nkv=8, hd=128, inter=29568, vocab=152064, tied=False,
                                    qkv_bias=True),
}


def model_flops_per_token(m, seq):
    """ModelLayout::ModelFlopsPerToken: 6 x matmul parameters + 6 x layers x seq x q_dim (causal)."""
    p = dense_params(**m)
    matmul = p - m["vocab"] * m["h"] * (0 if m["tied"] else 1)
    return 6.0 * matmul + 6.0 * m["layers"] * seq * m["nq"] * m["hd"]


def step(m, nodes, gbps, tokens, sharded, tflops, pcie_gbs, adam_gparam_s, seq=4096):
    p = dense_params(**m)
    c = tokens * model_flops_per_token(m, seq) / (tflops * 1e12)
    s = 2.0 * p / (pcie_gbs * 1e9)
    owned = p / nodes if sharded else p
    u = owned / (adam_gparam_s * 1e9)
    nic = gbps * 1e9 / 8.0
    f = (nodes - 1) / nodes
    x_grad = (f * 4.0 * p if sharded else 2.0 * f * 4.0 * p) / nic
    x = x_grad + (f * 2.0 * p / nic if sharded else 0.0)
    # Gradients exist only during the backward (2/3 of the compute): past that window the backward
    # waits for the wire. The sharded weights' all-gather overlaps anything (the next forward's
    # units arrive while earlier ones compute).
    terms = {"compute": c, "stream": s, "host": u, "network": max(x, c / 3.0 + x_grad)}
    bound = max(terms, key=terms.get)
    if bound == "network" and terms["network"] <= c * 1.0001:
        bound = "compute"
    t = max(terms.values()) + (x + u) / m["layers"]
    terms["network"] = x
    return t, bound, terms, p


def host_gib(p, nodes, sharded, gib_per_b):
    return gib_per_b * p / 1e9 / (nodes if sharded else 1)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=65536, help="tokens per GPU per step")
    ap.add_argument("--gpus", type=int, default=8, help="GPUs per node")
    ap.add_argument("--tflops", type=float, default=466.0, help="model TFLOP/s per GPU (compute-only)")
    ap.add_argument("--pcie-gbs", type=float, default=53.7, help="host link GB/s per GPU")
    ap.add_argument("--adam-gparam-s", type=float, default=10.0, help="LayerAdam Gparam/s per node")
    ap.add_argument("--gib-per-b", type=float, default=13.05, help="host state GiB per billion parameters")
    ap.add_argument("--markdown", action="store_true")
    a = ap.parse_args()
    print(f"tokens/GPU/step {a.tokens}, {a.gpus} GPUs/node, {a.tflops:g} model TFLOP/s/GPU, host link "
          f"{a.pcie_gbs:g} GB/s, LayerAdam {a.adam_gparam_s:g} Gparam/s/node, {a.gib_per_b:g} GiB/B of host state")
    print("| model | state | nodes | Gb/s | step s | bound | compute / network / host s | tok/s/GPU | "
          "of 1 node | host GiB/node |")
    print("|---|---|---:|---:|---:|---|---|---:|---:|---:|")
    for name, m in MODELS.items():
        one, _, _, _ = step(m, 1, 100, a.tokens, False, a.tflops, a.pcie_gbs, a.adam_gparam_s)
        for sharded in (False, True):
            for nodes in (2, 4, 8):
                for gbps in (100, 200, 400):
                    t, bound, terms, p = step(m, nodes, gbps, a.tokens, sharded, a.tflops, a.pcie_gbs,
                                              a.adam_gparam_s)
                    print(f"| {name} | {'sharded' if sharded else 'replicated'} | {nodes} | {gbps} | {t:.2f} | "
                          f"{bound} | {terms['compute']:.1f} / {terms['network']:.1f} / {terms['host']:.1f} | "
                          f"{a.tokens / t:,.0f} | {one / t:.2f} | "
                          f"{host_gib(p, nodes, sharded, a.gib_per_b):,.0f} |")


if __name__ == "__main__":
    main()
