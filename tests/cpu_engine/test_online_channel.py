"""The worker -> scheduler statistics channel of ``ddtree_adaptive_budget: "online"``:
round trip, the worker's expectations, privacy (nothing pre-created by another user is
followed, truncated or read), clean-up (gone once the worker has attached, stale
channels of killed servers swept), the config's channel name, and a SIGKILLed engine."""

from __future__ import annotations

import copy
import os
import pickle
import stat
import struct
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from vllm_ddtree.adaptive.channel import (
    FILE,
    PREFIX,
    ChannelAddress,
    ChannelRefused,
    StatsChannel,
    channel_dir_name,
    sweep_stale,
)
from vllm_ddtree.adaptive.online import OnlineSchedule, OnlineTuner
from vllm_ddtree.adaptive.publisher import ExpectationPublisher
from vllm_ddtree.config import ONLINE, DDTreeParams, attach_params, ddtree_params
from vllm_ddtree.tree import build_tree

_PID_WORD, _NAMESPACE_WORD = 1, 2  # header words (vllm_ddtree.adaptive.channel)


def _address(name: str, pid: int | None = None) -> ChannelAddress:
    return ChannelAddress(channel_dir_name(name, 0), os.getpid() if pid is None else pid)


def _dead_pid() -> int:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def _set_header_word(channel_dir: Path, word: int, value: int) -> None:
    with open(channel_dir / FILE, "r+b") as f:
        f.seek(8 * word)
        f.write(struct.pack("<q", value))


# ------------------------------------------------------------------ round trip


def test_channel_and_tuner_round_trip(shm: Path):
    owner = StatsChannel.create(channel_dir_name("rt", 0), 3)
    path = shm / channel_dir_name("rt", 0)
    try:
        worker = StatsChannel.attach(_address("rt"), 3)
        worker.add(4, [1.0, 2.0, 3.0])
        worker.add(2, [1.0, 1.0, 1.0])
        assert owner.read() == (2.0, 6.0, [2.0, 3.0, 4.0])
        pol = OnlineSchedule(63, 15, 8)  # candidates 15, 31, 63
        tuner = OnlineTuner(pol, owner, every=2)
        lookup = [0] + [15] * 8
        tuner.tick(lookup)
        assert pol.expected is None  # not yet its turn
        assert path.is_dir()
        tuner.tick(lookup)
        assert pol.expected == pytest.approx([2 / 6, 3 / 6, 4 / 6])
        assert not path.exists()  # attached: removed, both mappings still valid
        worker.add(1, [1.0, 1.0, 1.0])
        assert owner.read() == (3.0, 7.0, [3.0, 4.0, 5.0])
        worker.close()
    finally:
        owner.close()
    with pytest.raises(FileNotFoundError):
        StatsChannel.attach(_address("rt"), 3)
    assert os.listdir(shm) == []


def test_close_removes_an_unattached_channel(shm: Path):
    owner = StatsChannel.create(channel_dir_name("c", 0), 3)
    path = shm / channel_dir_name("c", 0)
    assert stat.S_IMODE(os.lstat(path).st_mode) == 0o700
    assert stat.S_IMODE(os.lstat(path / FILE).st_mode) == 0o600
    assert os.listdir(path) == [FILE]
    owner.close()
    owner.close()  # idempotent
    assert os.listdir(shm) == []


def test_prefix_is_the_smaller_tree_and_publisher_sums_expectations(shm: Path):
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 5, 40, generator=g) * 2
    full = build_tree(logits, 40)
    for n in (1, 5, 17):
        small, cut = build_tree(logits, n), full.prefix(n)
        for f in ("token_ids", "parents", "depths", "num_nodes", "scores"):
            assert torch.equal(getattr(small, f), getattr(cut, f)), (n, f)
    pub = ExpectationPublisher(40, 5, 8, "cpu", address=None)
    assert pub.budgets == [5, 15, 31]
    pub.store(full.scores)
    exp = full.scores.exp().cumsum(1)[:, [b - 1 for b in pub.budgets]]
    assert torch.allclose(pub.rows[:3], exp)
    # expectations never exceed the depth per node path and grow with the budget
    assert (exp[:, 1:] >= exp[:, :-1]).all() and (exp <= 5 + 1e-4).all()
    owner = StatsChannel.create(channel_dir_name("pub", 0), len(pub.budgets))
    try:
        pub.address = _address("pub")
        pub.publish(3)  # copies this step's sums; folded in at the next publish
        assert owner.read()[0] == 0
        pub.publish(3)
        steps, reqs, sums = owner.read()
        assert (steps, reqs) == (1, 3) and sums == pytest.approx(exp.sum(0).tolist())
        assert owner.attached
        pub.close()
    finally:
        owner.close()


def test_publisher_waits_for_the_channel_then_gives_up(shm: Path):
    pub = ExpectationPublisher(40, 5, 8, "cpu", address=_address("late"))
    pub.store(torch.zeros(1, 40))
    for _ in range(3):
        pub.publish(1)
    assert pub.address is not None and pub.channel is None  # not created yet: waiting
    owner = StatsChannel.create(channel_dir_name("late", 0), len(pub.budgets))
    try:
        pub.publish(1)
        pub.publish(1)
        assert pub.channel is not None and owner.read()[0] >= 1
    finally:
        pub.close()
        owner.close()
    pub = ExpectationPublisher(40, 5, 8, "cpu", address=_address("never"))
    for _ in range(200):
        pub.publish(1)
    assert pub.address is None  # no scheduler side: stops publishing


# --------------------------------------------------------------------- privacy


def test_symlink_at_the_old_name_is_not_followed(shm: Path):
    victim = shm.parent / "victim"
    victim.write_bytes(b"keep me")
    old_name = shm / f"vllm_ddtree_{os.getpid()}"
    old_name.symlink_to(victim)
    owner = StatsChannel.create(channel_dir_name("n", 0), 3)
    worker = StatsChannel.attach(_address("n"), 3)
    worker.add(1, [1.0, 1.0, 1.0])
    worker.close()
    owner.close()
    assert victim.read_bytes() == b"keep me"
    assert old_name.is_symlink()


@pytest.mark.parametrize("kind", ["dir", "file"])
def test_symlink_at_the_channel_name_is_neither_followed_nor_used(shm: Path, kind: str):
    victim = shm.parent / "victim"
    if kind == "dir":
        victim.mkdir(mode=0o700)
        (victim / FILE).write_bytes(b"\0" * 64)
    else:
        victim.write_bytes(b"keep me")
    before = {p.name: p.read_bytes() for p in victim.iterdir()} if kind == "dir" \
        else victim.read_bytes()
    link = shm / channel_dir_name("n", 0)
    link.symlink_to(victim)
    with pytest.raises(FileExistsError):
        StatsChannel.create(channel_dir_name("n", 0), 3)
    with pytest.raises(ChannelRefused, match="not a directory"):
        StatsChannel.attach(_address("n"), 3)
    assert sweep_stale(str(shm)) == []
    after = {p.name: p.read_bytes() for p in victim.iterdir()} if kind == "dir" \
        else victim.read_bytes()
    assert after == before and link.is_symlink()


def test_symlink_inside_a_private_directory_is_refused(shm: Path):
    victim = shm.parent / "victim"
    victim.write_bytes(b"\0" * 64)
    path = shm / channel_dir_name("n", 0)
    path.mkdir(mode=0o700)
    (path / FILE).symlink_to(victim)
    with pytest.raises(ChannelRefused):
        StatsChannel.attach(_address("n"), 3)
    assert victim.read_bytes() == b"\0" * 64


def test_wide_permission_entries_are_refused(shm: Path):
    wide_dir = shm / channel_dir_name("d", 0)
    wide_dir.mkdir()
    os.chmod(wide_dir, 0o777)
    with pytest.raises(FileExistsError):
        StatsChannel.create(channel_dir_name("d", 0), 3)
    with pytest.raises(ChannelRefused, match="mode 777, not 700"):
        StatsChannel.attach(_address("d"), 3)
    assert os.listdir(wide_dir) == []  # nothing created inside
    wide_file = shm / channel_dir_name("f", 0)
    wide_file.write_bytes(b"\0" * 96)
    os.chmod(wide_file, 0o666)
    with pytest.raises(FileExistsError):
        StatsChannel.create(channel_dir_name("f", 0), 3)
    with pytest.raises(ChannelRefused, match="not a directory"):
        StatsChannel.attach(_address("f"), 3)
    assert wide_file.read_bytes() == b"\0" * 96


def test_worker_refuses_wrong_mode_owner_creator_or_size(shm: Path,
                                                         monkeypatch: pytest.MonkeyPatch):
    owner = StatsChannel.create(channel_dir_name("w", 0), 3)
    path = shm / channel_dir_name("w", 0)
    try:
        os.chmod(path / FILE, 0o644)
        with pytest.raises(ChannelRefused, match="mode 644, not 600"):
            StatsChannel.attach(_address("w"), 3)
        os.chmod(path / FILE, 0o600)
        os.chmod(path, 0o755)
        with pytest.raises(ChannelRefused, match="mode 755, not 700"):
            StatsChannel.attach(_address("w"), 3)
        os.chmod(path, 0o700)
        with pytest.raises(ChannelRefused, match="not by the scheduler's process"):
            StatsChannel.attach(_address("w", pid=os.getpid() + 1), 3)
        with pytest.raises(ChannelRefused, match="bytes, not"):
            StatsChannel.attach(_address("w"), 4)
        uid = os.geteuid()
        with monkeypatch.context() as other_user:
            other_user.setattr(os, "geteuid", lambda: uid + 1)
            with pytest.raises(ChannelRefused, match=f"owned by uid {uid}, not {uid + 1}"):
                StatsChannel.attach(_address("w"), 3)
        assert not owner.attached  # none of those attached
        StatsChannel.attach(_address("w"), 3).close()
        assert owner.attached
    finally:
        owner.close()


def test_publisher_refusal_keeps_the_static_schedule(shm: Path):
    path = shm / channel_dir_name("r", 0)
    path.mkdir()
    os.chmod(path, 0o777)
    pub = ExpectationPublisher(40, 5, 8, "cpu", address=_address("r"))
    pub.store(torch.zeros(1, 40))
    pub.publish(1)
    pub.publish(1)
    assert pub.address is None and pub.channel is None


# --------------------------------------------------------------------- clean-up


def test_sweep_removes_only_this_users_dead_channels(shm: Path):
    dead, live, foreign, keep_dir = "dead", "live", "foreign", "mode"
    channels = {n: StatsChannel.create(channel_dir_name(n, 0), 3) for n in
                (dead, live, foreign, keep_dir)}
    for channel in channels.values():
        channel._owned_dir = None  # leave the directories to the sweep
    _set_header_word(shm / channel_dir_name(dead, 0), _PID_WORD, _dead_pid())
    _set_header_word(shm / channel_dir_name(foreign, 0), _PID_WORD, _dead_pid())
    _set_header_word(shm / channel_dir_name(foreign, 0), _NAMESPACE_WORD, 12345)
    _set_header_word(shm / channel_dir_name(keep_dir, 0), _PID_WORD, _dead_pid())
    os.chmod(shm / channel_dir_name(keep_dir, 0), 0o755)
    (shm / f"{PREFIX}link").symlink_to(shm / channel_dir_name(dead, 0))
    (shm / f"{PREFIX}empty").mkdir(mode=0o700)  # being created: no header yet
    fresh = StatsChannel.create(channel_dir_name("fresh", 0), 3)  # sweeps first
    left = sorted(os.listdir(shm))
    assert channel_dir_name(dead, 0) not in left
    assert left == sorted([channel_dir_name(n, 0) for n in (live, foreign, keep_dir, "fresh")]
                          + [f"{PREFIX}link", f"{PREFIX}empty"])
    fresh.close()
    for channel in channels.values():
        channel.close()


def test_scheduler_keeps_the_static_schedule_when_the_name_is_taken(
        shm: Path, monkeypatch: pytest.MonkeyPatch):
    pytest.importorskip("vllm")
    from vllm_ddtree._patch import online_budget

    def scheduler(name: str) -> SimpleNamespace:
        spec = SimpleNamespace(method="dflash", num_speculative_tokens=63)
        attach_params(spec, DDTreeParams(63, 15, ONLINE, online_channel=name))
        config = SimpleNamespace(speculative_config=spec,
                                 parallel_config=SimpleNamespace(data_parallel_rank=1))
        return SimpleNamespace(vllm_config=config, dynamic_sd_lookup=[0] + [63] * 8,
                               schedule=lambda: "scheduled", shutdown=lambda: None)

    taken = shm / channel_dir_name("taken", 1)
    taken.mkdir(mode=0o700)
    sched = scheduler("taken")
    online_budget.attach(sched)
    assert not hasattr(sched, "ddtree_online") and sched.schedule() == "scheduled"
    assert os.listdir(taken) == []

    sched = scheduler("free")
    online_budget.attach(sched)
    tuner = sched.ddtree_online
    path = shm / channel_dir_name("free", 1)  # the data-parallel rank in the name
    assert path.is_dir()
    pub = ExpectationPublisher(63, 15, 8, "cpu", address=ChannelAddress(path.name,
                                                                        os.getpid()))
    pub.store(torch.zeros(1, 63))
    pub.publish(1)
    pub.publish(1)
    for _ in range(16):
        assert sched.schedule() == "scheduled"
    assert not path.exists()  # the worker attached: removed at the next tick
    assert tuner.channel.read()[:2] == (1.0, 1.0)
    sched.shutdown()
    pub.close()


# ------------------------------------------------------------ the config's name


def test_config_draws_one_channel_name(root):
    """Drawn once per config, carried by every copy, never taken from the user (the
    name locates a directory in /dev/shm)."""
    pytest.importorskip("vllm")
    from vllm.config import ModelConfig, ParallelConfig
    from vllm.config.speculative import SpeculativeConfig

    import vllm_ddtree
    from vllm_ddtree.config import DDTreeConfigError
    from vllm_ddtree.testing.fixtures import make_tiny_pair

    vllm_ddtree.register()
    t, d = make_tiny_pair(root, "random", "float32")
    kw = {"model": str(d), "target_model_config": ModelConfig(model=str(t), dtype="float32"),
          "target_parallel_config": ParallelConfig(), "num_speculative_tokens": 16}
    online = SpeculativeConfig(method="ddtree", ddtree_adaptive_budget="online", **kw)
    name = ddtree_params(online).online_channel
    assert len(name) == 32 and int(name, 16) >= 0
    for clone in (pickle.loads(pickle.dumps(online)), copy.deepcopy(online)):
        # every copy names the same channel
        assert ddtree_params(clone).online_channel == name
    other = SpeculativeConfig(method="ddtree", ddtree_adaptive_budget="online", **kw)
    assert ddtree_params(other).online_channel != name
    assert ddtree_params(SpeculativeConfig(method="ddtree", **kw)).online_channel is None
    for method in ("ddtree", "dflash"):
        with pytest.raises(DDTreeConfigError, match=r"ddtree_online_channel is not a DDTree "
                                                    r"option: vllm-ddtree names"):
            SpeculativeConfig(method=method, ddtree_adaptive_budget="online",
                              ddtree_online_channel="abc123", **kw)


# ------------------------------------------------------------ a SIGKILLed engine


@pytest.mark.vllm
@pytest.mark.slow
def test_sigkilled_engine_leaves_a_stale_channel_that_the_next_creation_removes(root,
                                                                              tmp_path):
    """An online engine whose worker has not attached yet (no request served) holds its
    channel directory; SIGKILL the engine core (in-process here: one process), and the
    next channel creation of this user removes the directory."""
    pytest.importorskip("vllm")
    from vllm_ddtree.testing.fixtures import make_tiny_pair

    t, d = make_tiny_pair(root, "random", "float32")
    ready = tmp_path / "ready"
    script = textwrap.dedent(f"""
        import os, time
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the engine core: this process
        from vllm import LLM
        from vllm_ddtree.config import ddtree_params
        llm = LLM(model={str(t)!r}, dtype="float32", max_model_len=256, enforce_eager=True,
                  max_num_seqs=4, gpu_memory_utilization=0.2,
                  speculative_config={{"method": "ddtree", "model": {str(d)!r},
                                       "num_speculative_tokens": 16,
                                       "ddtree_adaptive_budget": "online"}})
        spec = llm.llm_engine.vllm_config.speculative_config
        with open({str(ready)!r} + ".tmp", "w") as f:  # the name the engine drew
            f.write(ddtree_params(spec).online_channel)
        os.replace({str(ready)!r} + ".tmp", {str(ready)!r})
        time.sleep(3600)
    """)
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    with open(tmp_path / "engine.log", "w") as log:
        engine = subprocess.Popen([sys.executable, "-c", script], stdout=log,
                                  stderr=subprocess.STDOUT, env=env)
        try:
            deadline = time.monotonic() + 600
            while not ready.exists():
                assert engine.poll() is None, (tmp_path / "engine.log").read_text()[-3000:]
                assert time.monotonic() < deadline, "engine did not start"
                time.sleep(1)
            path = Path(StatsChannel.DIR) / channel_dir_name(ready.read_text(), 0)
            assert path.is_dir()
            with open(path / FILE, "rb") as f:
                assert struct.unpack("<2q", f.read(16))[1] == engine.pid
        finally:
            engine.kill()  # SIGKILL: no shutdown runs
            engine.wait()
    assert path.is_dir()  # left behind
    fresh = StatsChannel.create(channel_dir_name("after" + os.urandom(8).hex(), 0), 3)
    assert not path.exists()  # swept: its creator is gone
    fresh.close()
