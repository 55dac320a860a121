# Sourced by the staged GPU scripts (gpu_stages.sh, gpu_tp.sh): shared shell helpers.
banner() { echo; echo "=== $* ($(date +%T))"; }
# cleanup: stop vLLM servers and engines and wait (up to 30 s, then SIGKILL) until no
# process holds GPU memory: an engine core still tearing down after `timeout` killed its
# parent has held 120 GiB, and the next engine failed to start.
cleanup() {
  [ -n "${NO_CLEANUP:-}" ] && return 0
  pkill -f "vllm.entrypoints"; pkill -f EngineCore; pkill -f "VLLM::"
  local i pids
  for i in $(seq 1 15); do
    pids=$(nvidia-smi --query-compute-apps=pid --format=csv,noheader 2>/dev/null | tr -d ' ')
    [ -z "$pids" ] && return 0
    sleep 2
  done
  echo "cleanup: SIGKILL to GPU processes still alive: $pids"; kill -9 $pids
  sleep 3
} 2>/dev/null
# install_plugin: this checkout into the carried vLLM's Python (editable, offline)
install_plugin() { python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . \
                     2>&1 | tail -n 2; }
descendants() { local c; for c in $(pgrep -P "$1"); do echo "$c"; descendants "$c"; done; }
# watchdog SECS LOG CMD...: CMD with stdout and stderr in LOG and Python's faulthandler on.
# Past SECS every process under it gets SIGABRT, so each Python one writes its stacks to
# LOG (where a hang sits), then SIGKILL; returns 124 like `timeout`.
watchdog() {
  local secs=$1 log=$2 pid t=0 all; shift 2
  PYTHONFAULTHANDLER=1 "$@" > "$log" 2>&1 &
  pid=$!
  while kill -0 "$pid" 2>/dev/null; do
    if [ "$t" -ge "$secs" ]; then
      all=$(descendants "$pid")
      echo "watchdog: past ${secs}s, SIGABRT to $pid $all; stacks follow" >> "$log"
      kill -ABRT $all "$pid" 2>/dev/null; sleep 5; kill -9 $all "$pid" 2>/dev/null
      wait "$pid" 2>/dev/null; return 124
    fi
    sleep 2; t=$((t + 2))
  done
  wait "$pid"
}
# need_bundle: stop at once on a host without the unpacked vLLM bundle (one that was
# reset): a vLLM stage would otherwise spend minutes failing.
need_bundle() {
  [ -d /tmp/vllm-site ] && return 0
  echo "no vLLM bundle on this host (reset?): copy the bundle parts again"; exit 3
}
