"""Tests for experiments/pretrain.py (with run_config, dry_run, train and records) and
experiments/job/report.py: the main job end to end, offload against optax step by step, two
processes against one, a two-process run resumed from its checkpoint on two processes and on
one, config errors, the dry run and every shipped config."""

import contextlib
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest

import jax_mlpo
from experiments import pretrain
from experiments.job import host_memory, optimizer, report, run_config, train
from experiments.job.dry_run import dry_run, optimizer_plan
from jax_mlpo.testing.processes import free_port
from models import get_preset, param_count

ROOT = Path(__file__).resolve().parents[2]
TINY = str(ROOT / "experiments" / "configs" / "tiny.yaml")
NODE = str(ROOT / "experiments" / "configs" / "7b-node.yaml")
CONFIGS = sorted((ROOT / "experiments" / "configs").glob("*.yaml"))
STEPS = 10


@pytest.fixture(scope="module")
def data_cache(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("data-cache")


def _main(run_dir: Path, cache: Path, *extra: str) -> dict:
    return pretrain.main(
        [
            "--config",
            TINY,
            "--set",
            f"run_dir={run_dir}",
            "--set",
            f"data.cache_dir={cache}",
            "--set",
            f"steps={STEPS}",
            *extra,
        ]
    )


@contextlib.contextmanager
def busy_thread() -> Iterator[None]:
    """A thread that spins beside the block (Python, so it also takes the GIL in turns): the
    run's threads are pre-empted at any point, as on a loaded machine."""
    stop = threading.Event()

    def spin() -> None:
        while not stop.is_set():
            sum(range(10_000))

    thread = threading.Thread(target=spin, daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()


@pytest.fixture(scope="module")
def runs(tmp_path_factory, data_cache) -> dict[str, dict]:
    """The tiny config for STEPS steps: with optax.adamw (the first: it writes the data cache),
    with jax_mlpo's overlapped step on a machine loaded by a busy thread, with jax_mlpo's plain
    step (``overlap=false``: forward and backward, then the update) and with the README's
    command as it is (``overlap=auto``, and the run's plot)."""
    run_dir = tmp_path_factory.mktemp("tiny")
    plain_dir = tmp_path_factory.mktemp("tiny-plain")
    auto_dir = tmp_path_factory.mktemp("tiny-auto")
    optax = _main(run_dir, data_cache, "--optimizer", "optax", "--set", "report.plot=false")
    with busy_thread():
        # 8 groups: auto would give the tiny model's small update one (nothing beside it)
        offload = _main(run_dir, data_cache, "--set", "overlap=true", "--set", "overlap_groups=8",
                        "--set", "report.plot=false")  # fmt: skip
    return {
        "offload": offload,
        "optax": optax,
        "plain": _main(
            plain_dir, data_cache, "--set", "overlap=false", "--set", "report.plot=false"
        ),  # fmt: skip
        "auto": _main(auto_dir, data_cache),
        # groups enough to try, too few steps to repay compiling the overlapped step
        "auto-short": _main(
            tmp_path_factory.mktemp("tiny-auto-short"),
            data_cache,
            "--set",
            "report.plot=false",
            "--set",
            "overlap_groups=4",
        ),  # fmt: skip
    }


def test_tiny_config_runs_end_to_end(runs):
    result = runs["offload"]
    run_dir = result["metrics"].parent
    records = report.load_metrics(result["metrics"])
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))
    assert all(math.isfinite(r["loss"]) for r in records)
    assert np.mean(result["losses"][-3:]) < result["losses"][0] - 0.2  # it learns
    for r in records:
        assert r["step_s"] > 0 and r["tokens_per_s"] > 0
        assert 0 < r["rss_bytes"] <= r["peak_rss_bytes"]
    # each update beside the next forward pass: the first step only computes gradients, each
    # later one applies the last step's (the last step also the flush of its own)
    assert "subgroups" not in records[0] and records[0]["fwd_bwd_s"] == records[0]["step_s"]
    for r in records[1:]:
        assert r["subgroups"] == 10 * (2 if r["step"] == STEPS else 1)
        assert 0 <= r["cache_hit_rate"] <= 1 and len(r["tiers"]) == 2
        assert r["read_wait_s"] >= 0 and r["compute_s"] > 0 and r["write_wait_s"] >= 0
        assert r["beside_s"] > 0  # the first groups were handed back before the update's end
        # timed inside the host update's own span, on its clock: bounded by it on any load
        assert r["beside_s"] <= r["host_update_s"]
    for r in records[2:]:  # forward + backward alone, timed apart once the program is compiled
        assert r["fwd_bwd_s"] > 0 and r["update_exposed_s"] >= 0
    assert [r["peak_rss_bytes"] for r in records] == sorted(r["peak_rss_bytes"] for r in records)
    # From step 2 on, subgroups not retained in host memory are read from and written to tiers.
    moved = sum(t["read_bytes"] + t["write_bytes"] for t in records[-1]["tiers"].values())
    assert moved > 0 and records[-1]["cache_hits"] < records[-1]["subgroups"]
    summary = json.loads((run_dir / "summary-offload.json").read_text())
    assert summary["median_s"]["step"] > 0 and set(summary["tiers"]) == set(records[1]["tiers"])
    table = (run_dir / "summary-offload.md").read_text()
    assert "| update not hidden by the forward pass |" in table
    assert 0 < summary["beside_share"] <= 1  # under the busy thread too
    assert summary["overlapped"] is True
    assert summary["peak_rss_bytes"] == records[-1]["peak_rss_bytes"]
    assert result["plot"] is None and not (run_dir / "pretrain-offload.png").exists()
    resolved = run_config.load_config(str(run_dir / "config.yaml"))
    assert resolved.steps == STEPS and resolved.offload.tiers[0].path.startswith(str(run_dir))


def test_offload_equals_optax_per_step(runs):
    offload, optax = runs["offload"]["losses"], runs["optax"]["losses"]
    assert len(offload) == len(optax) == STEPS
    # fp32 params: jax_mlpo follows optax.adamw operation by operation.
    np.testing.assert_allclose(offload, optax, rtol=0, atol=1e-5)
    records = report.load_metrics(runs["optax"]["metrics"])
    assert all("tiers" not in r for r in records)


def test_the_overlapped_step_is_the_plain_step_bit_for_bit(runs):
    """``overlap=true`` and ``overlap=false`` train the same params, bit for bit,
    with clipping on (the config's clip_norm)."""
    over, plain = runs["offload"], runs["plain"]
    assert over["losses"] == plain["losses"]
    assert over["summary"]["params_sha256"] == plain["summary"]["params_sha256"]
    assert plain["summary"]["overlapped"] is False
    records = report.load_metrics(plain["metrics"])
    for r in records:  # the plain step: forward and backward, then the update
        assert r["step_s"] >= r["fwd_bwd_s"] > 0 and r["update_s"] > 0
        assert r["subgroups"] == 10 and r["beside_s"] == 0


def test_overlap_auto_keeps_the_plain_step_for_the_tiny_model_and_the_same_params(runs):
    """``overlap=auto`` (the default): where the tiny model's update (156K params) is too small
    for two groups to each pay for their host call (the costs measured in this process, as
    the run did), the run keeps the plain step, compiling no overlapped one; whatever it keeps,
    the same losses and final params as ``overlap=false``."""
    from jax_mlpo.transforms import overlap_cost

    auto, plain = runs["auto"], runs["plain"]
    assert auto["losses"] == plain["losses"]
    assert auto["summary"]["params_sha256"] == plain["summary"]["params_sha256"]
    if overlap_cost.auto_groups(param_count(get_preset("tiny"))) < 2:
        assert auto["summary"]["overlapped"] is False
        for r in report.load_metrics(auto["metrics"]):
            assert r["update_s"] > 0 and r["beside_s"] == 0


def test_the_readme_command_plots_its_run(runs):
    plot = runs["auto"]["plot"]
    assert plot == runs["auto"]["metrics"].parent / "pretrain-offload.png"
    assert plot.stat().st_size > 10_000


def test_overlap_auto_does_not_try_an_overlapped_step_that_cannot_repay_its_compile(runs):
    """Four groups would each pay for their call, but the tiny run's update time over its
    steps is less than compiling the overlapped step: the plain step, never an overlapped one,
    and the plain run's params."""
    short, plain = runs["auto-short"], runs["plain"]
    assert short["summary"]["overlapped"] is False
    assert all(r["beside_s"] == 0 for r in report.load_metrics(short["metrics"]))
    assert short["summary"]["params_sha256"] == plain["summary"]["params_sha256"]


def test_the_trial_is_tried_where_the_hidden_update_repays_its_compile():
    from experiments.job.steps import OVERLAP_COMPILE_FACTOR, trial_repays

    first, later = 0.2, [0.01, 0.012, 0.011]  # the first update compiles
    cost = OVERLAP_COMPILE_FACTOR * 1.5 + first
    assert trial_repays(10_000, [first, *later], compile_s=1.5) == (True, "")
    ok, reason = trial_repays(100, [first, *later], compile_s=1.5)
    assert not ok and f"~{cost:.2f} s" in reason and "96 steps left, 1.06 s" in reason
    assert trial_repays(100, [first], compile_s=1.5) == (True, "")  # nothing timed yet


# The multi-process runs: NPROCS=2 processes of batch_size 4 on the tiny config; each process
# holds half of the state: a smaller cache and subgroups than the single-process run (the
# numerics do not depend on them) keep the tiers in use.
TWO_PROCESSES = ["--set", "batch_size=4", "--set", "report.plot=false",
                 "--set", "offload.host_cache=512KiB",
                 "--set", "offload.subgroup_size=8192", "--set", "overlap=true",
                 "--set", "overlap_groups=8"]  # fmt: skip
CHECKPOINT_EVERY = 5  # checkpoints 5 and 10
LAUNCH_TIMEOUT_S = 240


def _single_node(
    nprocs: int,
    run_name: str,
    nvme: Path,
    pfs: Path,
    cache: Path,
    *extra: str,
    check: bool = True,
    python: str = sys.executable,
) -> tuple[subprocess.CompletedProcess, Path]:
    """experiments/launch/single_node.sh with NPROCS=nprocs on CPU; (the result, run_dir)."""
    env = dict(
        os.environ,
        NPROCS=str(nprocs),
        COORDINATOR_PORT=str(free_port()),
        RUN_NAME=run_name,
        CONFIG=TINY,
        NVME_DIR=str(nvme),
        PFS_DIR=str(pfs),
        PYTHON=python,
        JAX_PLATFORMS="cpu",
        JAX_NUM_CPU_DEVICES="1",
    )
    argv = [str(ROOT / "experiments" / "launch" / "single_node.sh"), "--set", f"steps={STEPS}",
            "--set", f"data.cache_dir={cache}", *TWO_PROCESSES, *extra]  # fmt: skip
    t0 = time.monotonic()
    # In a process group of its own (start_new_session): a process that hangs (its peer failed
    # inside a collective) is killed with the launcher's group, not left running.
    proc = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)  # fmt: skip
    try:
        stdout, stderr = proc.communicate(timeout=LAUNCH_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        stdout, stderr = proc.communicate()
        stderr += f"\n(stopped after {LAUNCH_TIMEOUT_S} s)"
    done = subprocess.CompletedProcess(argv, proc.returncode, stdout, stderr)
    print(f"single_node.sh NPROCS={nprocs} {run_name}: {time.monotonic() - t0:.1f} s")
    run_dir = pfs / "jax_mlpo" / run_name
    other = (run_dir / "rank1.log").read_text() if (run_dir / "rank1.log").exists() else ""
    assert done.returncode == 0 or not check, f"{stdout[-3000:]}\n{stderr[-5000:]}\n{other[-3000:]}"
    return done, run_dir


@pytest.fixture(scope="module")
def two_processes(tmp_path_factory, data_cache) -> dict:
    """The tiny config for STEPS steps on 2 processes, with a checkpoint every CHECKPOINT_EVERY
    steps."""
    base = tmp_path_factory.mktemp("dp2")
    nvme, pfs = base / "nvme", base / "pfs"
    nvme.mkdir()
    pfs.mkdir()
    done, run_dir = _single_node(2, "dp2", nvme, pfs, data_cache,
                                 "--set", f"checkpoint.every={CHECKPOINT_EVERY}")  # fmt: skip
    return {"done": done, "run_dir": run_dir, "nvme": nvme, "pfs": pfs}


def test_two_processes_match_one_process(runs, two_processes):
    """experiments/launch/single_node.sh with NPROCS=2 on CPU: two pretrain.py processes with
    batch_size 4 each train on the global batch of 8 rows of the single-process run: the same
    losses (fp32: only the order of the reductions differs); process 0 writes the metrics with
    the slowest process's step time."""
    done, run_dir = two_processes["done"], two_processes["run_dir"]
    nvme = two_processes["nvme"]
    records = report.load_metrics(run_dir / "metrics-offload.jsonl")
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))
    diff = np.abs(np.subtract([r["loss"] for r in records], runs["offload"]["losses"]))
    print(f"2 processes vs 1: max |loss difference| {diff.max():.2e} over {STEPS} steps")
    np.testing.assert_allclose(
        [r["loss"] for r in records], runs["offload"]["losses"], rtol=1e-5, atol=1e-6
    )
    for r in records:
        assert r["processes"] == 2 and len(r["per_process"]["step_s"]) == 2
        assert r["step_s"] == max(r["per_process"]["step_s"])  # the slowest process's
        assert r["step_s"] == r["per_process"]["step_s"][r["slowest_process"]]
        assert r["tokens_per_s"] == pytest.approx(8 * 128 / r["step_s"])  # the global batch
    # overlap (the default): the first step, and the first after the checkpoint's flush, apply
    # no update
    updated = [r for r in records if "subgroups" in r]
    assert [r["step"] for r in records if r not in updated] == [1, CHECKPOINT_EVERY + 1]
    for r in updated:
        assert set(r["tiers"]) == {str(nvme / "jax_mlpo" / "dp2" / "tier"),
                                   str(run_dir / "tier")}  # fmt: skip
    moved = sum(t["read_bytes"] + t["write_bytes"] for t in records[-1]["tiers"].values())
    assert moved > 0 and records[-1]["cache_hits"] < records[-1]["subgroups"]
    # Process 0 wrote the outputs; each process used its own directory of every tier.
    assert {p.name for p in run_dir.iterdir()} >= {
        "config.yaml", "metrics-offload.jsonl", "summary-offload.md", "summary-offload.json",
        "tier", "rank1.log", "checkpoints-offload",
    }  # fmt: skip
    assert sorted(p.name for p in (run_dir / "tier").iterdir()) == ["proc0", "proc1"]
    assert not (nvme / "jax_mlpo" / "dp2").exists()  # the NVMe tier is removed at the end
    assert "| parameters per process" in done.stderr and "| 2 |" in done.stderr  # dry run


def test_two_process_checkpoint_resumes_exactly_on_two_and_on_one(two_processes, data_cache,
                                                                   tmp_path):  # fmt: skip
    """Every process writes its shards of each checkpoint. As if the 2-process job had died
    after step 9 (checkpoint 10 never written, its tiers left behind), --resume on 2 processes
    restores checkpoint 5, continues the metrics file and recomputes steps 6-10 bit for bit;
    the same checkpoint resumed on 1 process (batch_size 8, the same global batch, another
    cache, subgroups and tiers) gives the same losses to fp32 rounding (the order of the
    gradient reductions differs), and a summary of steps 4-10 without the tiers that changed."""
    full_dir, pfs = two_processes["run_dir"], two_processes["pfs"]
    full = report.load_metrics(full_dir / "metrics-offload.jsonl")
    losses = [r["loss"] for r in full]
    ckpt = full_dir / "checkpoints-offload"
    assert sorted(p.name for p in ckpt.iterdir() if p.is_dir()) == ["10", "5"]
    # the global params, each process writing the chunks of its shards (a zarr3 chunk a shard)
    sharded = [p.name for p in (ckpt / "5" / "params").iterdir() if (p / "c" / "1").exists()]
    assert sharded, sorted(p.name for p in (ckpt / "5" / "params").iterdir())
    streamed = ckpt / "5" / "opt_state" / "jax_mlpo_state" / "0"  # the offloaded state's shards
    assert sorted(p.name for p in streamed.iterdir()) == ["process_0", "process_1"]
    assert "checkpoint_s" in full[4] and "checkpoint_s" in full[9]

    # 1 process, in this process: a copy of checkpoint 5 and of the metrics.
    one_dir = tmp_path / "one"
    shutil.copytree(ckpt, one_dir / "checkpoints-offload")
    shutil.rmtree(one_dir / "checkpoints-offload" / "10")
    shutil.copy(full_dir / "metrics-offload.jsonl", one_dir)
    one = pretrain.main(["--config", TINY, "--set", f"run_dir={one_dir}", "--set",
                         f"data.cache_dir={data_cache}", "--set", f"steps={STEPS}", "--set",
                         f"checkpoint.every={CHECKPOINT_EVERY}", "--set", "report.plot=false",
                         "--set", "report.skip_steps=3", "--resume"])  # fmt: skip
    assert one["losses"][:CHECKPOINT_EVERY] == losses[:CHECKPOINT_EVERY]  # from the metrics
    diff = np.abs(np.subtract(one["losses"], losses))
    print(f"2-process checkpoint resumed on 1 process: max |loss difference| {diff.max():.2e}")
    np.testing.assert_allclose(one["losses"], losses, rtol=1e-5, atol=1e-6)
    records = report.load_metrics(one["metrics"])
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))
    assert all("processes" not in r for r in records[CHECKPOINT_EVERY:])
    # steps 4-5 used the 2-process run's tiers, 6-10 this run's: the summary shows neither
    assert one["summary"]["first_step"] == 4 and one["summary"]["tiers"] == {}

    # 2 processes, in a copy of the run directory without checkpoint 10.
    resumed_dir = pfs / "jax_mlpo" / "dp2-resumed"
    shutil.copytree(full_dir, resumed_dir)
    shutil.rmtree(resumed_dir / "checkpoints-offload" / "10")
    done, _ = _single_node(2, "dp2-resumed", two_processes["nvme"], pfs, data_cache,
                           "--set", f"checkpoint.every={CHECKPOINT_EVERY}", "--resume")  # fmt: skip
    assert "resumed from step 5" in done.stderr and "saved by 2 process(es)" in done.stderr
    records = report.load_metrics(resumed_dir / "metrics-offload.jsonl")
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))
    assert [r["loss"] for r in records] == losses  # bit for bit
    assert records[:CHECKPOINT_EVERY] == full[:CHECKPOINT_EVERY]  # kept, not rewritten
    assert all(r["processes"] == 2 for r in records)
    assert "checkpoint_s" in records[9]  # and the run saved checkpoint 10 again
    ckpts = resumed_dir / "checkpoints-offload"
    assert sorted(p.name for p in ckpts.iterdir() if p.is_dir()) == ["10", "5"]
    summary = json.loads((resumed_dir / "summary-offload.json").read_text())
    assert summary["last_step"] == STEPS and len(summary["per_process_median_s"]["step_s"]) == 2


_FAILING_PYTHON = """#!{python}
# An interpreter for rank.sh ($PYTHON experiments/pretrain.py ...): pretrain.py as the command
# runs it (pretrain.cli), its step failing in process 1 at step 3.
import sys

import jax
from experiments import pretrain
from experiments.job import train

steps_for = train.make_step_runner


def failing_steps(*args, **kwargs):
    steps = steps_for(*args, **kwargs)
    run, calls = steps.run, [0]

    def failing_run(*args):
        calls[0] += 1
        if jax.process_index() == 1 and calls[0] == 3:
            raise RuntimeError("injected failure of process 1 at step 3")
        return run(*args)

    steps.run = failing_run
    return steps


train.make_step_runner = failing_steps
pretrain.cli(sys.argv[2:])
"""


def test_a_failed_process_stops_the_job_at_once(data_cache, tmp_path):
    """A process of a multi-process run that fails exits at once (pretrain.cli) instead of
    waiting up to 300 s in jax.distributed's shutdown barrier while process 0 waits for it in
    the step's collective (with pretrain.main instead, the job still ran after 180 s); process
    0's collective then fails, and single_node.sh stops the job."""
    python = tmp_path / "failing-python"
    python.write_text(_FAILING_PYTHON.format(python=sys.executable))
    python.chmod(0o755)
    nvme, pfs = tmp_path / "nvme", tmp_path / "pfs"
    nvme.mkdir()
    pfs.mkdir()
    done, run_dir = _single_node(2, "failing", nvme, pfs, data_cache, check=False,
                                 python=str(python))  # fmt: skip
    rank1 = (run_dir / "rank1.log").read_text()
    assert done.returncode != 0 and "injected failure of process 1 at step 3" in rank1
    assert "process 1 of 2 exits with status 1, not waiting for the others" in rank1, rank1
    # the launcher saw process 1 exit and stopped process 0 (rather than process 0 finding out
    # from jax.distributed's heartbeat, 100 s later)
    assert "single_node.sh: a process failed; stopping the others" in done.stderr, done.stderr
    steps = [r["step"] for r in report.load_metrics(run_dir / "metrics-offload.jsonl")]
    assert steps == [1, 2]


def test_report_compares_runs_and_plots(runs, tmp_path):
    out = tmp_path / "report.png"
    summary = report.main(
        [str(runs["offload"]["metrics"]), str(runs["optax"]["metrics"]), "--out", str(out)]
    )
    assert summary["compare"]["steps"] == STEPS
    assert summary["compare"]["max_abs_loss_diff"] < 1e-5
    assert out.stat().st_size > 10_000


_BAD = (
    ("steps_word", ["steps=ten"], r"config key 'steps': Couldn't parse 'ten' into an int"),
    ("batch_float", ["batch_size=1.5"], r"'batch_size': Couldn't parse '1.5' into an int"),
    ("steps_mapping", ["steps={a: 1}"], r"config key 'steps': Couldn't parse '\{'a': 1\}'"),
    ("lr_word", ["optimizer.peak_lr=fast"], r"'optimizer.peak_lr': Couldn't parse 'fast'"),
    ("plot_number", ["report.plot=3"], r"config key 'report.plot': Couldn't parse '3' into a bool"),
    ("unknown_key", ["stepz=3"], r"The fields `stepz` are not valid for RunConfig"),
    ("unknown_nested", ["optimizer.lr=1"], r"'optimizer': The fields `lr` are not valid"),
    ("section_as_value", ["data=default"], r"'data': Failed when parsing value='default'"),
    ("value_as_section", ["steps.x=1"], r"config key 'steps': Couldn't parse '\{'x': 1\}'"),
    ("no_equals", ["steps"], r"expected key=value"),
    ("unknown_preset", ["model=13X"], r"config key 'model': unknown model preset '13X'"),
    ("unknown_override", ["model_overrides.layerz=2"], r"'model_overrides.layerz'"),
    ("bad_override", ["model_overrides.heads=3"], r"'model_overrides'.*heads"),
    (
        "missing_text",
        ["data.source=text", "data.paths=[/no/such/file.txt]"],
        r"'data.paths\[0\]': data file '/no/such/file.txt' not found",
    ),
    (
        "missing_tokens",
        ["data.source=tokens", "data.paths=[/no/tokens.bin]"],
        r"'data.paths\[0\]'.*not found",
    ),
    ("paths_not_list", ["data.source=text", "data.paths=3"], r"'data.paths': must be a list"),
    ("paths_string", ["data.source=text", "data.paths=a.txt"], r"'data.paths': must be a list"),
    ("text_without_paths", ["data.source=text"], r"set config key 'data.paths'"),
    ("bad_source", ["data.source=web"], r"'data.source': Cannot convert 'web'.* default, text"),
    ("negative", ["steps=-1"], r"'steps' must be positive"),
    ("bad_overlap", ["overlap=sometimes"], r"(?s)'overlap': .*'sometimes' into a bool.*: auto"),
    ("bad_groups", ["overlap_groups=0"], r"'overlap_groups' must be a positive integer or auto"),
    ("groups_word", ["overlap_groups=many"], r"(?s)'overlap_groups': .*'many' into an int.*auto"),
    ("offload_size", ["offload.host_cache=lots"], r"config key 'offload': host_cache='lots'"),
    ("offload_type", ["offload.prefetch_depth=x"], r"'offload.prefetch_depth': Couldn't parse 'x'"),
    ("tiers_string", ["offload.tiers=/x"], r"config key 'offload': tiers='/x' must be a list"),
    ("offload_key", ["offload.cache=1"], r"config key 'offload': The fields `cache` are not valid"),
    ("offload_value", ["offload=3"], r"config key 'offload' must be a mapping"),
)


@pytest.mark.parametrize("overrides,message", [b[1:] for b in _BAD], ids=[b[0] for b in _BAD])
def test_config_errors_name_the_key(overrides, message, tmp_path):
    argv = ["--config", TINY, "--set", f"run_dir={tmp_path}/run", "--dry-run"]
    for item in overrides:
        argv += ["--set", item]
    with pytest.raises(SystemExit, match=message):
        pretrain.main(argv)
    assert not (tmp_path / "run").exists()


def test_config_file_errors(tmp_path):
    with pytest.raises(SystemExit, match=r"config file '/no/such.yaml' not found"):
        pretrain.main(["--config", "/no/such.yaml"])
    bad = tmp_path / "bad.yaml"
    bad.write_text('steps: "ten"\nbatch_size: 4\n')
    with pytest.raises(run_config.ConfigError, match=r"config key 'steps': Couldn't parse 'ten'"):
        run_config.load_config(str(bad))
    bad.write_text("- a list\n")
    with pytest.raises(run_config.ConfigError, match=r"must hold a mapping"):
        run_config.load_config(str(bad))


def test_overrides_and_yaml_values(tmp_path):
    cfg = run_config.load_config(
        TINY,
        [
            f"run_dir={tmp_path}",
            "optimizer.peak_lr=3e-4",
            "offload.prefetch_depth=1",
            "model_overrides.layers=1",
            "data.source=text",
            f"data.paths=[{TINY}]",
        ],
    )
    assert cfg.optimizer.peak_lr == 3e-4  # YAML 1.1 reads 3e-4 as a string; accepted as float
    assert cfg.offload.prefetch_depth == 1 and cfg.data.paths == (TINY,)
    assert run_config.resolve_model(cfg).layers == 1
    assert [t.path for t in cfg.offload.tiers] == [
        f"{tmp_path}/tiers/t0",
        f"{tmp_path}/tiers/t1",
    ]


def test_datasets_from_text_and_token_files(tmp_path):
    text = tmp_path / "a.txt"
    text.write_text("hello world " * 100)
    cfg = run_config.load_config(
        TINY, ["data.source=text", f"data.paths=[{text}]", f"data.cache_dir={tmp_path}/c"]
    )
    assert train.build_dataset(cfg, 256).tokens.size == 1200
    tokens = tmp_path / "t.bin"
    np.arange(1000, dtype="<u2").tofile(tokens)
    cfg = run_config.load_config(TINY, ["data.source=tokens", f"data.paths=[{tokens}]"])
    assert train.build_dataset(cfg, 1000).tokens.size == 1000
    with pytest.raises(ValueError, match="token id 999 >= vocab_size=256"):
        train.build_dataset(cfg, 256)


def test_dry_run_280b_on_64_processes(tmp_path, caplog):
    caplog.set_level("INFO")
    run_dir = tmp_path / "never-created"
    plan = pretrain.main(
        [
            "--config",
            NODE,
            "--set",
            "model=280B",
            "--set",
            f"run_dir={run_dir}",
            "--processes",
            "64",
            "--dry-run",
        ]
    )
    n = param_count(get_preset("280B"))
    assert plan["params"] == n > 2.7e11
    assert plan["params_per_process"] == math.ceil(n / 64)
    assert plan["state_bytes_per_process"] == 12 * math.ceil(n / 64)  # bf16: fp32 p, m, v
    assert plan["subgroups_per_process"] == math.ceil(n / 64 / 100_000_000)
    on_tiers = sum(t["bytes"] for t in plan["tiers"].values())
    assert on_tiers == plan["state_bytes_per_process"]
    assert sum(t["subgroups"] for t in plan["tiers"].values()) == plan["subgroups_per_process"]
    assert plan["host_bytes"] > plan["engine_host_bytes"] > 0 and plan["problem"] is None
    assert "| parameters " in caplog.text and "280,090,132,480" in caplog.text
    assert "host memory per process on a GPU node" in caplog.text
    assert "train on CPU" not in caplog.text  # 64 processes: not this machine's plan
    assert not run_dir.exists()


def test_dry_run_fp32_state_and_problems():
    cfg = run_config.load_config(TINY, ["offload.host_cache=1GiB"])
    plan = dry_run(cfg, 1)
    assert plan["state_bytes_per_process"] == 8 * param_count(get_preset("tiny"))
    assert plan["tiers"] == {} and plan["problem"] is None
    plan = dry_run(run_config.load_config(TINY, ["offload.host_cache=64KiB"]), 1)
    assert "pipeline needs 6" in plan["problem"]


def test_moment_dtypes_in_the_config_set_the_bytes_and_the_optimizer(tmp_path):
    """optimizer.mu_dtype/nu_dtype: 2 bytes each in the plan and on the tiers; optax gets
    mu_dtype and refuses nu_dtype (it has none); other dtypes are refused at load."""
    sets = ["optimizer.mu_dtype=bfloat16", "optimizer.nu_dtype=bfloat16", "offload.host_cache=1MiB",
            f"run_dir={tmp_path}"]  # fmt: skip
    cfg = run_config.load_config(TINY, sets)
    n = param_count(get_preset("tiny"))
    plan = dry_run(cfg, 1)
    assert plan["state_bytes_per_process"] == 4 * n  # fp32 params: m and v only
    assert plan["state_parts"] == "m bfloat16, v bfloat16"
    state = optimizer.build_optimizer(cfg, use_optax=False).init({"w": jnp.zeros((64, 1000))})
    assert jax_mlpo.engine_of(state).layout.state_bytes == 4 * 64_000
    jax_mlpo.close(state)
    with pytest.raises(run_config.ConfigError, match="nu_dtype=bfloat16 is jax_mlpo's"):
        optimizer.build_optimizer(cfg, use_optax=True)
    with pytest.raises(run_config.ConfigError, match="'optimizer.mu_dtype': Cannot convert "
                       "'float16'.* into one of: float32, bfloat16, q8"):  # fmt: skip
        run_config.load_config(TINY, ["optimizer.mu_dtype=float16"])


def test_lion_in_the_config_trains_beside_optax_lion(data_cache, tmp_path):
    """optimizer.name=lion: one moment in the plan and on the tiers (4 B/param for fp32
    params), and the offloaded run's losses are optax.lion's in the same job."""
    sets = ["--set", "optimizer.name=lion", "--set", "optimizer.peak_lr=1e-3",
            "--set", "report.plot=false"]  # fmt: skip
    cfg = run_config.load_config(TINY, ["optimizer.name=lion", f"run_dir={tmp_path}"])
    plan = dry_run(cfg, 1)
    assert plan["state_bytes_per_process"] == 4 * param_count(get_preset("tiny"))
    assert plan["state_parts"] == "m float32"
    offload = _main(tmp_path, data_cache, *sets)
    optax = _main(tmp_path, data_cache, *sets, "--optimizer", "optax")
    assert np.mean(offload["losses"][-3:]) < offload["losses"][0] - 0.2  # it learns
    np.testing.assert_allclose(offload["losses"], optax["losses"], rtol=0, atol=1e-4)
    with pytest.raises(
        run_config.ConfigError,
        match="'optimizer.name': Cannot convert 'sgd'.* one of: adamw, lion, muon",
    ):
        run_config.load_config(TINY, ["optimizer.name=sgd"])
    with pytest.raises(run_config.ConfigError, match="not q8"):
        run_config.load_config(TINY, ["optimizer.name=lion", "optimizer.mu_dtype=q8"])


def test_muon_in_the_config_trains_beside_optax_muon(data_cache, tmp_path):
    """optimizer.name=muon: the offloaded run's losses are optax.contrib.muon's in the same
    job, with Muon's own learning rate on the matrices and AdamW's on the rest; the state is
    split over its engines (the matrices' momentum, the vectors' AdamW moments)."""
    sets = ["--set", "optimizer.name=muon", "--set", "optimizer.peak_lr=0.02",
            "--set", "optimizer.adam_peak_lr=3e-3", "--set", "report.plot=false"]  # fmt: skip
    offload = _main(tmp_path, data_cache, *sets)
    optax = _main(tmp_path, data_cache, *sets, "--optimizer", "optax")
    assert np.mean(offload["losses"][-3:]) < offload["losses"][0] - 0.2  # it learns
    np.testing.assert_allclose(offload["losses"], optax["losses"], rtol=0, atol=1e-4)
    cfg = run_config.load_config(TINY, ["optimizer.name=muon", f"run_dir={tmp_path}"])
    state = optimizer.build_optimizer(cfg, use_optax=False).init(
        {"w": jnp.zeros((64, 1000)), "scale": jnp.zeros((1000,))}
    )
    engines = [jax_mlpo.engine_of(s) for s in jax_mlpo.transforms.opt_state.find_offloaded(state)]
    # float32 params: the master's engine is over no leaves and holds nothing
    assert [e.layout.state_bytes for e in engines] == [4 * 64_000, 0, 8 * 1000]
    jax_mlpo.close(state)
    with pytest.raises(run_config.ConfigError, match="muon stores its moments"):
        run_config.load_config(TINY, ["optimizer.name=muon", "optimizer.mu_dtype=q8"])


def test_q8_moments_in_the_config(tmp_path):
    """optimizer.mu_dtype/nu_dtype=q8: a byte and 4/256 of a scale each in the plan and the
    optimizer, q8_rounding passed on; optax refuses q8 (it has no such dtype)."""
    sets = ["optimizer.mu_dtype=q8", "optimizer.nu_dtype=q8", "optimizer.q8_rounding=stochastic",
            "offload.host_cache=1MiB", f"run_dir={tmp_path}"]  # fmt: skip
    cfg = run_config.load_config(TINY, sets)
    n = param_count(get_preset("tiny"))
    plan = dry_run(cfg, 1)
    assert plan["state_bytes_per_process"] == pytest.approx(n * (2 + 8 / 256), rel=1e-4)
    assert plan["state_parts"] == "m q8, v q8"
    state = optimizer.build_optimizer(cfg, use_optax=False).init({"w": jnp.zeros((n,))})
    # the engine's bytes, each subgroup's padding to whole words and scales included
    assert jax_mlpo.engine_of(state).layout.state_bytes == plan["state_bytes_per_process"]
    jax_mlpo.close(state)
    state = optimizer.build_optimizer(cfg, use_optax=False).init({"w": jnp.zeros((64, 1000))})
    engine = jax_mlpo.engine_of(state)
    assert engine.optimizer.stochastic_rounding
    assert engine.layout.state_bytes == 2 * 64_000 + 8 * math.ceil(64_000 / 256)
    jax_mlpo.close(state)
    with pytest.raises(run_config.ConfigError, match="mu_dtype=q8 is jax_mlpo's"):
        optimizer.build_optimizer(run_config.load_config(TINY, sets[:1]), use_optax=True)
    with pytest.raises(
        run_config.ConfigError,
        match="'optimizer.q8_rounding': Cannot convert 'up'.* stochastic, nearest",
    ):
        run_config.load_config(TINY, ["optimizer.q8_rounding=up"])


@pytest.mark.parametrize("path", CONFIGS, ids=[p.name for p in CONFIGS])
def test_every_config_loads_and_validates(path, monkeypatch):
    # Not XLA's count of the pass's temporaries (compiling a 2B model's step takes 15-25 s;
    # test_dry_run_prints_the_training_plan_and_refusals compiles beyond-ram.yaml's).
    monkeypatch.setattr(host_memory, "grad_step_temp_bytes", lambda cfg: 0)
    cfg = run_config.load_config(str(path))
    model = run_config.resolve_model(cfg)
    assert model.max_seq_len == cfg.seq_len
    plan = dry_run(cfg, 1)
    assert plan["problem"] is None, plan["problem"]
    assert len(CONFIGS) >= 3


@pytest.mark.parametrize("optimizer", ["optax", "offload"])
def test_a_run_that_cannot_fit_is_refused_before_it_allocates(optimizer, data_cache, tmp_path,
                                                               monkeypatch):  # fmt: skip
    """The memory plan against MemAvailable, before the model is built: the figures, the fix."""
    available = 256 * 2**20  # below the jax runtime's own share of the plan
    monkeypatch.setattr(train, "meminfo", lambda field: available)
    built = []
    monkeypatch.setattr(train, "Llama", lambda *a, **k: built.append(1))
    fix = "drop --optimizer optax" if optimizer == "optax" else "lower offload.host_cache"
    with pytest.raises(SystemExit, match=r"needs [\d.]+ GiB of host memory \(params .*" + fix):
        _main(tmp_path / "run", data_cache, "--optimizer", optimizer)
    assert not built


def test_dry_run_prints_the_training_plan_and_refusals(tmp_path, caplog):
    from experiments.job import host_memory

    cfg = run_config.load_config(str(ROOT / "experiments" / "configs" / "beyond-ram.yaml"))
    engines = {"offload": optimizer_plan(cfg, 1), "optax": None}
    plans = {o: host_memory.training_memory(cfg, engine) for o, engine in engines.items()}
    n = param_count(run_config.resolve_model(cfg))
    assert n >= 2_100_000_000 and 12 * n >= 25_000_000_000  # more state than 24 GiB of RAM
    # offload: params + gradients + cache + runtime; optax: the moments and XLA's buffers too
    assert plans["offload"].host_total < 12 * 2**30 < 24 * 2**30 < plans["optax"].host_total
    d = dry_run(cfg, 1)
    assert d["training_memory"]["optax"]["host_bytes"] == plans["optax"].host_total
    caplog.set_level("INFO")
    pretrain.main(["--config", str(ROOT / "experiments" / "configs" / "beyond-ram.yaml"),
                   "--set", f"run_dir={tmp_path / 'never'}", "--dry-run"])  # fmt: skip
    assert "train on CPU, optax: host memory" in caplog.text
    assert not (tmp_path / "never").exists()


# -- experiments/pretrain.py --resume --------------------------------------------------------


def test_pretrain_resume_continues_the_run_exactly(tmp_path):
    def main(*extra: str) -> dict:
        config = ROOT / "experiments" / "configs" / "tiny.yaml"
        sets = [f"run_dir={tmp_path / 'run'}", f"data.cache_dir={tmp_path / 'data'}", "steps=6"]
        sets += ["checkpoint.every=3", "report.plot=false", "model_overrides={layers: 1}"]
        sets += ["seq_len=32", "batch_size=2"]
        return pretrain.main(["--config", str(config), *[a for s in sets for a in ("--set", s)],
                              *extra])  # fmt: skip

    full = main()
    ckpt = tmp_path / "run" / "checkpoints-offload"
    assert sorted(p.name for p in ckpt.iterdir()) == ["3", "6"]
    with pytest.raises(SystemExit, match="pass --resume to continue it"):
        main()
    shutil.rmtree(ckpt / "6")  # as if the run had died after step 5
    resumed = main("--resume")
    assert resumed["losses"] == full["losses"]  # steps 1-3 from the metrics, 4-6 recomputed
    assert resumed["summary"]["params_sha256"] == full["summary"]["params_sha256"]
    records = [json.loads(line) for line in resumed["metrics"].read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3, 4, 5, 6]
    assert "checkpoint_s" in records[2] and "checkpoint_s" in records[5]
