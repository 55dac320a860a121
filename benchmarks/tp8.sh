#!/usr/bin/env bash
# The TP = 8 check on an 8-GPU host without a package index: the stages of
# benchmarks/gpu_tp.sh with N = 8, one invocation each:
#   bash benchmarks/tp8.sh stash   (with each .gpu/bundle.part-* but the last, one call
#                                   each, + .gpu/unpack.sh)
#   bash benchmarks/tp8.sh check   (with the last .gpu/bundle.part-* and .gpu/unpack.sh)
#   TPS=8 bash benchmarks/tp8.sh speed   (with .gpu/unpack.sh): near-tie check + TP = 8 rows
#   TPS=1 bash benchmarks/tp8.sh speed   (with .gpu/unpack.sh): TP = 1 rows
# (one TP's throughput took ~300 s on a freshly started host: one invocation each).  If
# the host was reset between stages, copy the bundle parts again: the call with the last
# part can run the next stage itself.  Not run on an 8-GPU host yet.
# The fixtures get 8 query heads (VLLM_DDTREE_FIXTURE_HEADS=8, set by gpu_tp.sh).
exec bash "$(dirname "$0")/gpu_tp.sh" 8 "$@"
