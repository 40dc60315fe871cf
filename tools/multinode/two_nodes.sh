#!/usr/bin/env bash
# Two "nodes" on one host (issue 53; docs/multi-node.md): a hostd per node in its own network
# namespace (a veth pair, 10.79.0.1 / .2), TCP with TLS and a token between them, one worker each
# (CUDA: GPU 0 and GPU 1, NCCL's network transport forced between them: NCCL_P2P_DISABLE=1,
# NCCL_SHM_DISABLE=1, NVLink SHARP/multicast off), then the same global batch on one node with both
# workers. Writes the two runs' metrics, their loss and weight differences and the throughput ratio to
# $OUT/summary.txt. Needs root (ip netns) and openssl.
#
# Usage (repository root): OUT=DIR [BIN=build/bin] [BACKEND=cuda|cpu] [MODEL=tiny] [LAYERS=N]
#   [SEQ=4096] [ROWS=16] [STEPS=6] [VOCAB=...] [TIMEOUT_S=600] [NODE_STATE=replicated|sharded]
#   tools/multinode/two_nodes.sh
# NODE_STATE=sharded: each node holds half of the host state (runtime.node_state; docs/multi-node.md).
# BACKEND=cpu runs the same with CPU-backend workers (Gloo between the nodes): the script's own check
# on a machine without GPUs.
set -euo pipefail
BIN=$(realpath "${BIN:-build/bin}")
BACKEND=${BACKEND:-cuda}
MODEL=${MODEL:-tiny}
SEQ=${SEQ:-4096}
ROWS=${ROWS:-16}
STEPS=${STEPS:-6}
TIMEOUT_S=${TIMEOUT_S:-600}
# The dataset's vocabulary: the tiny presets' 512, else Qwen3's.
VOCAB=${VOCAB:-$(case $MODEL in tiny*) echo 512 ;; *) echo 151936 ;; esac)}
OUT=$(realpath -m "${OUT:?OUT=DIR}")
W=$(mktemp -d /tmp/two-nodes.XXXXXX)
mkdir -p "$OUT"
S=$OUT/summary.txt
: > "$S"
tag=tn$$
ns=("${tag}a" "${tag}b")
addr=(10.79.0.1 10.79.0.2)
pids=()
cleanup() {
  for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done
  sleep 1
  for p in "${pids[@]}"; do kill -9 "$p" 2>/dev/null || true; done
  for n in "${ns[@]}"; do ip netns del "$n" 2>/dev/null || true; done
}
trap cleanup EXIT
say() { echo "$*" >> "$S"; }

# ---- the namespaces, certificates and token ----
ip netns add "${ns[0]}"
ip netns add "${ns[1]}"
ip link add "v${tag}a" type veth peer name "v${tag}b"
for i in 0 1; do
  v="v${tag}$([ $i = 0 ] && echo a || echo b)"
  ip link set "$v" netns "${ns[$i]}"
  ip -n "${ns[$i]}" addr add "${addr[$i]}/24" dev "$v"
  ip -n "${ns[$i]}" link set "$v" up
  ip -n "${ns[$i]}" link set lo up
done
(
  cd "$W"
  openssl genpkey -algorithm EC -pkeyopt ec_paramgen_curve:P-256 -out ca.key
  openssl req -x509 -new -key ca.key -out ca.crt -days 2 -subj /CN=ca \
    -addext basicConstraints=critical,CA:TRUE -addext keyUsage=critical,keyCertSign,cRLSign
  openssl genpkey -algorithm EC -pkeyopt ec_paramgen_curve:P-256 -out hostd.key
  openssl req -new -key hostd.key -out hostd.csr -subj /CN=hostd
  printf 'subjectAltName=IP:%s,IP:%s\nextendedKeyUsage=serverAuth,clientAuth\n' "${addr[0]}" "${addr[1]}" > hostd.ext
  openssl x509 -req -in hostd.csr -CA ca.crt -CAkey ca.key -CAcreateserial -out hostd.crt -days 2 -extfile hostd.ext
) > "$W/certs.log" 2>&1
printf 'two-nodes-token-%s-0123456789abcdef\n' "$$" > "$W/token"
chmod 600 "$W/token"

# ---- the data and the spec ----
"$BIN/make_text_dataset" --output "$W/data" --seq-len "$SEQ" --vocab "$VOCAB" --synthetic-docs $((ROWS * STEPS * 4)) \
  > "$W/data.log" 2>&1
spec() {  # spec WORKERS NODES_YAML OUTPUT
  cat <<YAML
name: two-nodes
model: {preset: $MODEL, init_seed: 1${LAYERS:+, num_hidden_layers: $LAYERS}}
data: {path: $W/data}
output: {dir: $3, save_dtype: fp32, save_final: true}
train: {seq_len: $SEQ, global_batch: $ROWS, micro_batch: 1, steps: $STEPS, seed: 1, max_grad_norm: 1.0}
optimizer: {lr: 1.0e-4, weight_decay: 0.0}
runtime: {backend: $BACKEND, workers: $1, act_policy: recompute, step_timeout_ms: 300000$2}
YAML
}
spec 1 ", nodes: [\"${addr[0]}:7070\", \"${addr[1]}:7070\"], node_state: ${NODE_STATE:-replicated}" "$W/out-nodes" > "$W/nodes.yaml"
spec 2 "" "$W/out-one" > "$W/one.yaml"

nccl_env=(NCCL_P2P_DISABLE=1 NCCL_SHM_DISABLE=1 NCCL_NVLS_ENABLE=0 NCCL_COLLNET_ENABLE=0 NCCL_DEBUG=INFO)
cli() {  # cli NODE ARGS...
  ip netns exec "${ns[$1]}" "$BIN/slidedp" --hostd "${addr[$1]}:7070" --tls-ca "$W/ca.crt" --token-file "$W/token" \
    "${@:2}"
}

# ---- two nodes ----
for i in 0 1; do
  mkdir -p "$W/node$i"
  ip netns exec "${ns[$i]}" "$BIN/slidedp-hostd" --listen "${addr[$i]}:7070" --node-name "${tag}n$i" \
    --tls-cert "$W/hostd.crt" --tls-key "$W/hostd.key" --auth-token-file "$W/token" --peer-tls-ca "$W/ca.crt" \
    --peer-token-file "$W/token" --node-address "${addr[$i]}" --state-dir "$W/node$i/state" --output-root "$W" \
    --allow-output-anywhere > "$OUT/hostd$i.log" 2>&1 &
  pids+=($!)
done
for i in 0 1; do
  for t in $(seq 100); do cli $i health > /dev/null 2>&1 && break; sleep 0.2; done
  env CUDA_VISIBLE_DEVICES=$i "${nccl_env[@]}" ip netns exec "${ns[$i]}" "$BIN/slidedp-worker" \
    --hostd "${addr[$i]}:7070" --backend "$BACKEND" --tls-ca "$W/ca.crt" --token-file "$W/token" \
    > "$OUT/worker$i.log" 2>&1 &
  pids+=($!)
done
for i in 0 1; do
  for t in $(seq 300); do cli $i workers 2>/dev/null | grep -q idle && break; sleep 0.2; done
done
t0=$SECONDS
set +e
timeout "$TIMEOUT_S" ip netns exec "${ns[0]}" "$BIN/slidedp" --hostd "${addr[0]}:7070" --tls-ca "$W/ca.crt" \
  --token-file "$W/token" submit "$W/nodes.yaml" --id over-nodes > "$OUT/submit-nodes.log" 2>&1
rc_nodes=$?
set -e
say "two nodes (one $BACKEND worker each, network transport between them): rc=$rc_nodes in $((SECONDS - t0)) s"
cli 1 status over-nodes >> "$OUT/submit-nodes.log" 2>&1 || true
for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done
wait 2>/dev/null || true
pids=()

# ---- one node, both workers ----
"$BIN/slidedp-hostd" --listen "unix:$W/one.sock" --node-name "${tag}one" --state-dir "$W/one-state" \
  --output-root "$W" --allow-output-anywhere > "$OUT/hostd-one.log" 2>&1 &
pids+=($!)
sleep 1
for i in 0 1; do
  env CUDA_VISIBLE_DEVICES=$i "$BIN/slidedp-worker" --hostd "unix:$W/one.sock" --backend "$BACKEND" --index "$i" \
    > "$OUT/worker-one$i.log" 2>&1 &
  pids+=($!)
done
for t in $(seq 300); do [ "$("$BIN/slidedp" --hostd "unix:$W/one.sock" workers 2>/dev/null | wc -l)" -ge 2 ] && break; sleep 0.2; done
t0=$SECONDS
set +e
timeout "$TIMEOUT_S" "$BIN/slidedp" --hostd "unix:$W/one.sock" submit "$W/one.yaml" --id one-node > "$OUT/submit-one.log" 2>&1
rc_one=$?
set -e
say "one node (two $BACKEND workers): rc=$rc_one in $((SECONDS - t0)) s"

# ---- the comparison ----
cp "$W"/out-nodes/metrics-*.jsonl "$OUT/metrics-nodes.jsonl" 2>/dev/null || true
cp "$W"/out-one/metrics-*.jsonl "$OUT/metrics-one.jsonl" 2>/dev/null || true
python3 - "$OUT" "$W" "$STEPS" >> "$S" 2>&1 <<'PY' || true
import json, os, struct, sys
out, w, steps = sys.argv[1], sys.argv[2], int(sys.argv[3])
def lines(p):
    return [json.loads(l) for l in open(p)] if os.path.exists(p) else []
a, b = lines(f"{out}/metrics-nodes.jsonl"), lines(f"{out}/metrics-one.jsonl")
print(f"steps: {len(a)} over nodes, {len(b)} on one node")
for x, y in zip(a, b):
    print(f"step {x['step']}: loss {x['loss']:.7f} vs {y['loss']:.7f} (|d| {abs(x['loss'] - y['loss']):.2e}), "
          f"tok/s {x.get('tokens_per_s', 0):.0f} vs {y.get('tokens_per_s', 0):.0f}")
if len(a) > 2 and len(b) > 2:
    med = lambda v: sorted(v)[len(v) // 2]
    ta, tb = med([x['tokens_per_s'] for x in a[1:]]), med([y['tokens_per_s'] for y in b[1:]])
    print(f"throughput over nodes / one node (median of steps >= 2): {ta / tb:.3f} ({ta:.0f} / {tb:.0f} tok/s)")
def tensors(p):
    with open(p, 'rb') as f:
        n = struct.unpack('<Q', f.read(8))[0]
        head = json.loads(f.read(n))
        base = 8 + n
        for name, t in head.items():
            if name == '__metadata__' or t['dtype'] != 'F32':
                continue
            s, e = t['data_offsets']
            f.seek(base + s)
            yield name, struct.unpack(f'<{(e - s) // 4}f', f.read(e - s))
pa, pb = f"{w}/out-nodes/checkpoint-{steps}/model.safetensors", f"{w}/out-one/checkpoint-{steps}/model.safetensors"
if os.path.exists(pa) and os.path.exists(pb):
    tb = dict(tensors(pb))
    worst, bitwise = 0.0, True
    for name, va in tensors(pa):
        vb = tb[name]
        num = sum((x - y) ** 2 for x, y in zip(va, vb)) ** 0.5
        den = sum(y * y for y in vb) ** 0.5 or 1.0
        worst = max(worst, num / den)
        bitwise &= va == vb
    print(f"final weights: {'bitwise equal' if bitwise else 'differ'}; worst tensor rel L2 {worst:.3e}")
else:
    print("final weights: a checkpoint is missing")
PY
cat "$S"
