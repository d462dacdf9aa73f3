#!/usr/bin/env bash
# The paper's PD-disaggregation figures (21, 22, 23) from one command, prefill-only as the
# paper measures them, on the embedded sample:weka trace and sized for a 2-core machine:
# 16 prefill instances (the paper: 32), 10 simulated minutes a run, the first 2 left out.
#   sweep/max_tps.png               Fig. 22a  max prefill TPS within SLO per global tier
#   sweep/reuse_by_provisioning.png Fig. 22b  local / global / miss split at those points
#   sweep/tps_vs_rate.png           Fig. 21a  prefill TPS within SLO vs offered rate
#   full/heatmaps.png               Fig. 21b  in-flight prefill-token load per instance
#   full/latency.png                Fig. 23   TTFT CDFs (full global tier)
# Usage: scripts/pd_figures.sh [OUT]   (default smetric-out/pd-figures; about 15 minutes on 2 cores)
set -euo pipefail
OUT=${1:-smetric-out/pd-figures}
SMETRIC=${SMETRIC:-smetric}
POLICIES=${POLICIES:-smetric,linear,lmetric,prefill_tokens,smetric_cost}
COMMON=(sample:weka --prefill-instances 16 --decode-instances 0 --duration 600 --warmup 120)
"$SMETRIC" sweep "${COMMON[@]}" -p "$POLICIES" --rates 0.1,0.2,0.3,0.4,0.5,0.6,0.7 \
    --globals none,1x,1.6x,full -o "$OUT/sweep"
# Figures 21b and 23 at the rate where the best baseline peaks under the full global tier.
RATE=$(python3 -c '
import json, sys
best = json.load(open(sys.argv[1]))["max_tps"]["full"]
base = max((v for k, v in best.items() if not k.startswith("smetric")), key=lambda v: v["tps"])
print(base["rate"])' "$OUT/sweep/sweep.json")
"$SMETRIC" simulate "${COMMON[@]}" -p "$POLICIES" --rate "$RATE" --global full -o "$OUT/full"
