#!/usr/bin/env bash
# The whole TP = 8 check in one nvidia-h200-x8 lease: four back-to-back device
# calls with kind "nvidia-h200-x8", exactly as listed in benchmarks/gpu_tp.sh with N = 8:
#   bash benchmarks/tp8.sh stash   (carry .gpu/bundle.part-00, then part-01, + .gpu/unpack.sh)
#   bash benchmarks/tp8.sh check   (carry .gpu/bundle.part-02 .gpu/unpack.sh)
#   TPS=8 bash benchmarks/tp8.sh speed   (carry .gpu/unpack.sh): near-tie check + TP = 8 rows
#   TPS=1 bash benchmarks/tp8.sh speed   (carry .gpu/unpack.sh): TP = 1 rows
# (one TP's throughput took ~300 s on a fresh machine: one call each).  If the
# machine went back between calls (30 s idle), carry the three bundle parts again: the
# third call can run the next stage itself.
# The fixtures get 8 query heads (VLLM_DDTREE_FIXTURE_HEADS=8, set by gpu_tp.sh).
exec bash "$(dirname "$0")/gpu_tp.sh" 8 "$@"
