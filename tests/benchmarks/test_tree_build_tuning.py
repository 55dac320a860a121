"""The tree-build tuning sweep's checks, on CPU under the Triton interpreter: every setting
is run against the default and recorded; a setting that changes a token is reported as
an error, not timed.  (Timing needs CUDA graphs: a stub stands in for it here.)"""


import pytest
import torch

import benchmarks.tree_build_tuning as sweep
from vllm_ddtree.kernels import topk_lse as topk_module

pytestmark = pytest.mark.triton


@pytest.fixture
def small_sweep(monkeypatch):
    monkeypatch.setattr(sweep, "DEV", "cuda" if torch.cuda.is_available() else "cpu")
    monkeypatch.setattr(sweep, "V", 3000)
    monkeypatch.setattr(sweep, "D", 2)
    monkeypatch.setattr(sweep, "CHOICES", dict(bound_sort=(False, True),
                                                merge_small=(0, 128)))
    monkeypatch.setattr(sweep, "timed_us", lambda fn: (fn(), 1.0)[1])


def test_every_setting_is_checked_and_recorded(small_sweep):
    rows = []
    res = sweep.run_case(2, 15, rows)
    topk = [(r["field"], r["value"]) for r in rows if r["kernel"] == "topk"]
    assert topk == [("bound_sort", False), ("bound_sort", True), ("merge_small", 0),
                    ("merge_small", 128)]
    assert all(r["error"] is None for r in rows if r["kernel"] == "topk")
    assert [r["value"] for r in rows if r["kernel"] == "build"] == [1, 2, 4, 8]
    assert res["build_best"] in (1, 2, 4, 8) and res["live"] > 0


def test_a_setting_that_changes_tokens_is_an_error(small_sweep, monkeypatch):
    real = topk_module.topk_lse_triton

    def wrong_without_sort(x, k, tuning=None, **kw):
        out = real(x, k, tuning=tuning, **kw)
        if tuning is not None and not tuning.bound_sort:
            out = (out[0], out[1].flip(-1), *out[2:])
        return out

    monkeypatch.setattr(sweep, "topk_lse_triton", wrong_without_sort)
    rows = []
    sweep.run_case(1, 15, rows)
    errors = {(r["field"], r["value"]) for r in rows if r["kernel"] == "topk" and r["error"]}
    assert errors == {("bound_sort", False)}
