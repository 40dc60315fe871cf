#!/usr/bin/env bash
# GPU session Q (session 6), in calls of at most 10 minutes each (Q=1, 2, 3), using session_p.sh's
# parts:
#   Q=1 (nvidia-h200)  ordered: SLIDEDP_DETERMINISTIC=1 on the GPU for the first time (the kernel
#                      check's ordered-dQ cases must PASS; two 0.6B runs must log the same unit
#                      norms), then ratio without offload at 64K (the new 4 x 32 MiB rings' own
#                      effect on speed; session 4 with 8 x 64 MiB rings: 15,774 tok/s)
#   Q=2 (nvidia-h200)  stable for Qwen3-1.7B, ours against HF autocast: the steadier regime that
#                      brought 0.6B within 3.5e-4 of HF autocast over 200 steps (session 5), with
#                      200 pretrain steps instead of 250 (~4 min) so the call fits its 10 minutes
#   Q=3 (nvidia-h200-x2, when lent) routes and weak14 (issue 7)
#   Q=4 (nvidia-h200)  graddiff again, now with grad_diff.py's "vs HF mirror" column: whether the
#                      early layers' 1-2 % gradient differences from HF autocast (session 5) are
#                      the BF16 embedding rows (ours close to HF at our arithmetic) or our kernels
# Output: $out/session-p.log (the parts' log) and the parts' files.
set -u
case "${Q:-1}" in
  1) PARTS="ordered ratio" RATIO_RUNTIME_EXTRA="" RATIO_TOKENS=65536 RATIO_FSDP2=0 exec bash tools/gpu/session_p.sh ;;
  2) PARTS=stable STABLE_PRESET=qwen3-1.7b STABLE_PRE=200 STABLE_REFS=bf16-autocast STABLE_HF_CAP=240 \
       exec bash tools/gpu/session_p.sh ;;
  3) PARTS="routes weak14" exec bash tools/gpu/session_p.sh ;;
  4) PARTS=graddiff exec bash tools/gpu/session_p.sh ;;
  *) echo "Q=$Q: expected 1, 2, 3 or 4" >&2; exit 2 ;;
esac
