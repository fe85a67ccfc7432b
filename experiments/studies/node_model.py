"""An iteration on a GPU node, predicted from the engine's own plan and the node's bandwidths.

Each of the node's GPUs has a process whose engine holds 1/gpus of the optimizer state
(:func:`experiments.job.dry_run.memory_plan`: the buffers, the subgroups and how many are retained
are the engine's). The model, per iteration:

- **Forward and backward** (``fwd_bwd_s``, on the GPUs): the host and the tiers are free. The
  write-backs an update left behind land then, and with read-ahead the next update's reads fill
  the buffers free at the end of the update.
- **Update** (on the host): every subgroup passes through the host buffers. At its start at most
  ``buffers`` subgroups are there (retained, clean or read ahead), so it reads every other
  subgroup itself, and each of those reads needs a buffer that a write-back of an updated
  subgroup has freed: it reads and writes ``subgroups - buffers`` blobs at least, whatever the
  order, retention or read-ahead. Its time is the larger of that I/O (reads at the tiers' read
  bandwidth, writes at their write bandwidth, one after the other: a disk serving both) and the
  host compute (the AdamW kernel over the state, and the bf16 gradients and updates over PCIe).
- **The limit** (what a perfect overlap of the tiers with everything would give):
  max(forward + backward + update compute, all bytes of the iteration at the tiers' bandwidth).
- **The update beside the next forward pass** (``jax_mlpo.overlapped_step``), as the engine runs
  it (:mod:`jax_mlpo.engine.retention`): every update in the forward order, what the last one
  kept first, keeping every buffer as the alternating order does (the plain step's bytes). The
  forward pass (``forward_share`` of forward + backward) runs beside the update, and its last
  group waits for the last group's update: the iteration is max(forward, update + forward /
  groups) + backward. The row below it alternates instead (``overlap_order="alternate"``):
  every other update in the reverse order, before the forward pass as in a plain step.

Read-ahead only moves reads into the forward and backward pass where buffers are free when an
update ends: with the alternating order and retention every buffer then holds a subgroup the
next update starts with, so it has nothing to do, and no policy lowers the update's I/O below
``(subgroups - buffers)`` reads and writes: only a larger host cache, a smaller state (bf16 or
q8 moments) or faster tiers do.

Usage:
  python -m experiments.studies.node_model --config experiments/configs/7b-node.yaml --gpus 8 \\
      --fwd-bwd-s 2.3 --read-gbps 27 --write-gbps 11
  python -m experiments.studies.node_model --table   # the 7B and 70B presets on the reference node
"""

from __future__ import annotations

import argparse
import dataclasses

from experiments.job.dry_run import MemoryPlan, memory_plan
from experiments.job.run_config import ConfigError, RunConfig, load_config


@dataclasses.dataclass(frozen=True)
class Node:
    """A GPU node as the model sees it.

    Attributes:
      gpus: GPUs (and processes, each with its own engine) on the node.
      fwd_bwd_s: forward and backward time of one iteration on a GPU.
      read_gbps, write_gbps: the node's tiers together, GB/s (e.g. 4 Gen5 NVMe: 27 and 11).
      host_gbps: bytes/s of state the node's CPUs update (read and written once each), GB/s.
      pcie_gbps: each GPU's host link, each way, GB/s (bf16 gradients down, updates up).
      forward_share: the forward pass's share of forward + backward (the backward pass
        computes two products per forward one).
      groups: how many groups of layers an overlapped update is split into.
    """

    gpus: int = 8
    fwd_bwd_s: float = 2.3
    read_gbps: float = 27.0
    write_gbps: float = 11.0
    host_gbps: float = 100.0
    pcie_gbps: float = 25.0
    forward_share: float = 1 / 3
    groups: int = 8


@dataclasses.dataclass(frozen=True)
class Prediction:
    """One iteration of the node, in seconds, and what its tiers move (GB, the whole node)."""

    update_s: float
    iteration_s: float
    limit_s: float
    compute_s: float
    update_io_s: float
    between_io_s: float
    read_gb: float
    written_gb: float
    read_in_update_gb: float

    @property
    def disk_busy(self) -> float:
        """The fraction of the iteration the tiers are busy."""
        return (self.update_io_s + self.between_io_s) / self.iteration_s


def predict(
    plan: MemoryPlan,
    node: Node,
    *,
    order: str,
    retain: bool,
    read_ahead: bool,
    overlap: str | None = None,
) -> Prediction:
    """One iteration of ``node`` running the engines of ``plan`` (one per GPU); with ``overlap``
    each update beside the next forward pass (the module doc): ``"forward"`` every update in the
    engine's forward order, ``"alternating"`` every other one reversed.
    """
    if overlap is not None:
        return _beside_forward(plan, node, read_ahead=read_ahead, policy=overlap)
    host = plan.engine
    kept = host.retained if retain else 0
    return _iteration(plan, node, kept=kept, order=order, retain=retain, read_ahead=read_ahead)


def _beside_forward(plan: MemoryPlan, node: Node, *, read_ahead: bool, policy: str) -> Prediction:
    forward = node.fwd_bwd_s * node.forward_share
    backward = node.fwd_bwd_s - forward
    host = plan.engine
    if host.host_only:
        alone = _iteration(plan, node, kept=0, order="alternate", retain=True, read_ahead=False)
        iteration = max(forward, alone.compute_s + forward / node.groups) + backward
        return dataclasses.replace(alone, iteration_s=iteration)
    buffers = min(host.buffers, plan.num_subgroups)
    # both orders keep every buffer (the plain step's bytes); the update starts after the
    # backward pass, the only window between updates
    window = dataclasses.replace(node, fwd_bwd_s=backward)
    beside = _iteration(plan, window, kept=buffers, order="alternate", retain=True,
                        read_ahead=read_ahead)  # fmt: skip
    every = max(forward, beside.update_s + forward / node.groups) + backward
    if policy == "forward":
        return dataclasses.replace(
            beside,
            iteration_s=every,
            limit_s=max(node.fwd_bwd_s + beside.compute_s, beside.limit_s),
        )
    # alternating: every other update reversed, before the forward pass as in the plain step
    plain = _iteration(plan, node, kept=buffers, order="alternate", retain=True,
                       read_ahead=read_ahead)  # fmt: skip
    return dataclasses.replace(
        plain,
        update_s=(beside.update_s + plain.update_s) / 2,
        iteration_s=(every + plain.iteration_s) / 2,
    )


def _iteration(
    plan: MemoryPlan, node: Node, *, kept: int, order: str, retain: bool, read_ahead: bool
) -> Prediction:
    """A plain iteration (forward and backward, then the update) keeping ``kept`` subgroups."""
    gpus, gb = node.gpus, 1e9
    state = plan.state_bytes_per_process * gpus
    compute = max(
        2 * state / (node.host_gbps * gb), plan.params_per_process * 4 / (node.pcie_gbps * gb)
    )
    host = plan.engine
    if host.host_only:
        return Prediction(compute, node.fwd_bwd_s + compute, node.fwd_bwd_s + compute, compute,
                          0.0, 0.0, 0.0, 0.0, 0.0)  # fmt: skip
    n, buffers = plan.num_subgroups, min(host.buffers, plan.num_subgroups)
    kept = min(kept, buffers)
    # resident when the update starts: kept, plus clean copies (alternating order: the ones the
    # last update wrote last are the first this one needs) or reads ahead in the free buffers
    clean = buffers - kept if retain and order == "alternate" else 0
    ahead = buffers - kept - clean if read_ahead else 0
    reads_in_update = n - kept - clean - ahead
    writes = n - kept
    writes_in_update = min(writes, reads_in_update)  # each read there needs a freed buffer
    blob = state / n  # the node's bytes of one subgroup index (one such subgroup per GPU)
    rd, wr = node.read_gbps * gb, node.write_gbps * gb
    update_io = blob * (reads_in_update / rd + writes_in_update / wr)
    between_io = blob * (ahead / rd + (writes - writes_in_update) / wr)
    spill = max(0.0, between_io - node.fwd_bwd_s)  # what the pass could not hide
    update = max(compute, update_io) + spill
    total_io = blob * ((n - kept - clean) / rd + writes / wr)
    return Prediction(
        update_s=update,
        iteration_s=node.fwd_bwd_s + update,
        limit_s=max(node.fwd_bwd_s + compute, total_io),
        compute_s=compute,
        update_io_s=update_io,
        between_io_s=between_io,
        read_gb=blob * (n - kept - clean) / gb,
        written_gb=blob * writes / gb,
        read_in_update_gb=blob * reads_in_update / gb,
    )


POLICIES = {  # name: (order, retain, read_ahead, overlap)
    "alternate + retain (plain step)": ("alternate", True, True, None),
    "beside the forward pass (forward order)": ("alternate", True, True, "forward"),
    "  alternating, beside every other": ("alternate", True, True, "alternating"),
    "ascending + retain + read-ahead": ("ascending", True, True, None),
    "alternate, no retention, read-ahead": ("alternate", False, True, None),
    "alternate, no retention": ("alternate", False, False, None),
}


def rows(cfg: RunConfig, node: Node) -> list[tuple[str, MemoryPlan, Prediction]]:
    """Every policy of :data:`POLICIES` for ``cfg`` on ``node``."""
    out = []
    for name, (order, retain, ahead, overlap) in POLICIES.items():
        off = dataclasses.replace(cfg.offload, order=order, retain=retain, read_ahead=ahead)
        plan = memory_plan(dataclasses.replace(cfg, offload=off), node.gpus)
        out.append((name, plan, predict(plan, node, order=order, retain=retain, read_ahead=ahead,
                                        overlap=overlap)))  # fmt: skip
    return out


def format_rows(title: str, node: Node, table: list[tuple[str, MemoryPlan, Prediction]]) -> str:
    plan = table[0][1]
    state_gb = plan.state_bytes_per_process * node.gpus / 1e9
    lines = [
        f"{title}: {plan.params / 1e9:.1f}B params, {state_gb:.0f} GB of state on "
        f"{node.gpus} GPUs ({plan.num_subgroups} subgroups and "
        f"{plan.engine.buffers} host buffers per GPU); fwd+bwd {node.fwd_bwd_s} s, tiers "
        f"{node.read_gbps}/{node.write_gbps} GB/s read/write, host {node.host_gbps} GB/s",
        f"  {'policy':<42}{'iter s':>8}{'update s':>9}{'limit s':>8}{'/ limit':>8}"
        f"{'read in upd GB':>15}{'moved GB':>9}{'disk busy':>10}",
    ]
    for name, _, p in table:
        lines.append(
            f"  {name:<42}{p.iteration_s:>8.2f}{p.update_s:>9.2f}{p.limit_s:>8.2f}"
            f"{p.iteration_s / p.limit_s:>7.2f}x{p.read_in_update_gb:>15.1f}"
            f"{p.read_gb + p.written_gb:>9.1f}{p.disk_busy:>10.0%}"
        )
    return "\n".join(lines)


REFERENCE = {  # preset: (host cache per GPU, fwd+bwd s per GPU at batch 8 x 2048 with remat)
    "7B": ("8GiB", 2.3),
    "70B": ("64GiB", 23.0),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--config", default="experiments/configs/7b-node.yaml")
    parser.add_argument("--set", action="append", default=[], help="config overrides")
    parser.add_argument("--table", action="store_true", help="the presets on the reference node")
    for field in dataclasses.fields(Node):
        parser.add_argument(f"--{field.name.replace('_', '-')}", type=type(field.default),
                            default=field.default)  # fmt: skip
    args = parser.parse_args()
    node = Node(**{f.name: getattr(args, f.name) for f in dataclasses.fields(Node)})
    if not args.table:
        try:
            cfg = load_config(args.config, args.set)
            table = rows(cfg, node)
        except ConfigError as e:
            raise SystemExit(f"config error: {e}") from None
        print(format_rows(args.config, node, table))
        return
    for preset, (cache, fwd_bwd) in REFERENCE.items():
        cfg = load_config(args.config, [f"model={preset}", f"offload.host_cache={cache}"])
        here = dataclasses.replace(node, fwd_bwd_s=fwd_bwd)
        print(format_rows(f"{preset}, host cache {cache} per GPU", here, rows(cfg, here)))


if __name__ == "__main__":
    main()
