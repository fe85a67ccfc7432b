"""The update-phase comparison's arithmetic (experiments/bench/deepspeed/peer_report.py)."""

from __future__ import annotations

import pytest

from experiments.bench.deepspeed.peer_report import summarize


def _run(system: str, rnd: int, update_s: float, engine_s: float, moved: int,
         grads: int = 0) -> dict:  # fmt: skip
    # grads: bytes DeepSpeed's backward wrote before the step (in /proc/self/io's count only)
    step = {"update_s": update_s, "bytes_read": moved // 2, "bytes_written": moved // 2 + grads}
    if system.startswith("ds"):
        step |= {"step_bytes_read": moved // 2, "step_bytes_written": moved // 2}
    if system.startswith("jax"):
        step |= {"tier_bytes_read": moved // 2, "tier_bytes_written": moved // 2,
                 "tier_busy_s": {"tier0": update_s}, "engine_s": engine_s}  # fmt: skip
    out = {"round": rnd, "steps": [step], "update_s": update_s, "grad_write_s": 0.0}
    if system.startswith("jax"):
        out["engine_s"] = engine_s
    return out


def test_disk_throughput_against_the_rounds_mixed_limit_and_the_speedup():
    # DeepSpeed moves 4 GB in its 2 s step (and 1 GB of gradients before it), jax_mlpo 2 GB in
    # 1 s (host engine 0.8 s); mixed limits 2 and 4
    runs = {
        "ds-pipelined": [
            _run("ds-pipelined", r, 2.0, 0.0, 4_000_000_000, grads=1_000_000_000) for r in (0, 1)
        ],
        "jax-all-1dir": [_run("jax-all-1dir", r, 1.0, 0.8, 2_000_000_000) for r in (0, 1)],
    }
    disk = {"write_gbps": 1.0, "read_gbps": 1.0}
    limits = {"disk": [disk, disk], "mixed": [{"mixed_gbps": 2.0}, {"mixed_gbps": 4.0}],
              "mixed_burst": [{"mixed_gbps": 4.0}, {"mixed_gbps": 4.0}]}  # fmt: skip
    rows, ratios = summarize(runs, limits)
    jax = rows["jax-all-1dir"]
    assert jax["disk_gbps"]["median"] == pytest.approx(2.0)
    assert (jax["of_mixed_limit"]["min"], jax["of_mixed_limit"]["max"]) == pytest.approx((0.5, 1.0))
    assert jax["of_burst_limit"]["median"] == pytest.approx(0.5)
    assert rows["ds-pipelined"]["disk_gbps"]["median"] == pytest.approx(2.0)  # not 2.5
    assert ratios["speedup_vs_deepspeed_pipelined_1dir_host"]["median"] == pytest.approx(2.5)
    assert ratios["speedup_vs_deepspeed_pipelined_1dir_full"]["median"] == pytest.approx(2.0)
