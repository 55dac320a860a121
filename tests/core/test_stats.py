"""vllm_ddtree.testing.metrics.spec_counts on a stand-in for ``LLM.get_metrics()``."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from vllm_ddtree.testing.metrics import SpecCounts, spec_counts


class FakeLLM:
    def __init__(self, **values):
        self.values = values

    def get_metrics(self):
        out = [SimpleNamespace(name=f"vllm:spec_decode_num_{k}", value=v)
               for k, v in self.values.items()]
        out.append(SimpleNamespace(name="vllm:spec_decode_num_accepted_tokens_per_pos"))
        out.append(SimpleNamespace(name="vllm:num_requests_running", value=3))
        return out


def test_counts_tau_and_difference():
    llm = FakeLLM(drafts=10, draft_tokens=150, accepted_tokens=25)
    c = spec_counts(llm, strict=True)
    assert c == SpecCounts(10, 150, 25) and c.tau == pytest.approx(3.5)
    assert (c - SpecCounts(4, 60, 13)).tau == pytest.approx(3.0)


def test_missing_counters():
    assert spec_counts(FakeLLM()) == SpecCounts(0, 0, 0)
    assert spec_counts(FakeLLM()).tau is None
    with pytest.raises(KeyError):
        spec_counts(FakeLLM(drafts=1, draft_tokens=2), strict=True)
