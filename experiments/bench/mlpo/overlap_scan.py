"""The update beside the forward pass, unrolled layers against scanned ones.

``jax_mlpo.overlapped_step`` splits an offloaded update into one host call per group of param
leaves, in the order the forward pass first uses them, and adds each group's update where the
forward pass reaches it. The unrolled model has one leaf per layer and weight kind: the forward
pass of the first layers runs while the host updates the last ones. The scanned model
(``LlamaConfig.scan_layers``) has one ``[layers, ...]`` leaf per weight kind, all consumed by one
``scan``: the stacked leaves are one group whose rows the scan's body receives one layer at a
time (``jax_mlpo.engine.row_stream``), so layer i runs while the host updates layers i + 1...

Both variants, at the same size and from the same initial params, with the optimizer state on
a file tier (a temporary directory, deleted at the end) and a host cache smaller than the
state, so each update reads from the tier (capped by ``--cap``, a token bucket, so that the
update is I/O-bound as on a node whose host updates from NVMe). Per round, interleaved, each
variant runs: the forward pass alone, the forward and backward pass alone, and ``--steps``
steps of three loops: plain (one jitted ``value_and_grad``, ``tx.update`` and
``optax.apply_updates``), "one call" (``jax_mlpo.overlapped_step`` with ``groups=1``: the same
program as the overlapped one with the whole update before the forward pass) and overlapped
(``overlapped_step`` with ``--groups``), each overlapped loop in a jitted step with donation.
A round's figure is the median of its steps; the table gives the median over rounds with
[min-max], and the ratios per round:

- overlapped / plain and overlapped / one call: below 1 when the update ran beside the
  forward pass (against one call: the groups' gain alone, the program otherwise the same);
- (plain or one call - overlapped) / forward alone: the part of the forward pass the update
  hid (only the forward pass can run beside it: the backward pass needs the loss);
- beside_s / total_s: the update's time after its first group was handed back
  (``jax_mlpo.metrics(state)[-1]``): the time the forward pass *could* run beside it.

At the end each variant's plain and overlapped params (after the overlapped loops' flush) are
compared bit for bit, and ``--compile-layers`` compiles the forward and backward pass of both
variants at other depths (abstract params, nothing allocated): what unrolling a scan costs.

    python -m experiments.bench.mlpo.overlap_scan --layers 8 --batch 12 --cap 150MB \\
        --rounds 3 --steps 2 --compile-layers '' --json experiments/results/overlap_scan_rows.json
"""

from __future__ import annotations

import argparse
import functools
import logging
import shutil
import statistics
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

import jax_mlpo
from experiments.bench.harness import (
    format_spread,
    interleave,
    provenance,
    ratio_spread,
    spread,
    write_json,
)
from jax_mlpo.config import TierLimits, parse_size
from jax_mlpo.transforms.overlap import forward_ranks, leaf_groups, scans_apart, stacked_scans
from models import Llama, LlamaConfig, get_preset, loss_fn, param_count

log = logging.getLogger("bench.overlap_scan")

VARIANTS = ("unrolled", "scanned")
LOOPS = ("plain", "one call", "overlapped")  # the training loops measured
SYSTEMS = ("fwd", "fwd_bwd", *LOOPS)
LR, WD = 1e-3, 0.1


def _loss(graphdef: nnx.GraphDef, params: nnx.State, rest: nnx.State, tokens: jax.Array):
    return loss_fn(nnx.merge(graphdef, params, rest), tokens)


class Variant:
    """One model variant: its jitted programs, its two optimizers and their loops' state."""

    def __init__(self, cfg: LlamaConfig, tokens: jax.Array, tier_dir: Path, args) -> None:
        self.cfg = cfg
        self.tokens = tokens
        graphdef, params, rest = nnx.split(Llama(cfg, rngs=nnx.Rngs(0)), nnx.Param, ...)
        self.rest = rest
        loss = functools.partial(_loss, graphdef)
        self.loss = loss
        self.fwd = jax.jit(loss)
        self.fwd_bwd = jax.jit(jax.value_and_grad(loss))
        self.state_bytes = 8 * param_count(cfg)  # fp32 m and v (fp32 params: no master copy)

        def tx(name: str) -> optax.GradientTransformation:
            path = tier_dir / name
            path.mkdir(parents=True)
            limits = TierLimits(bandwidth_cap=args.cap) if args.cap else None
            config = jax_mlpo.OffloadConfig(
                host_cache=args.cache, subgroup_size=args.subgroup, prefetch_depth=1,
                tiers=[jax_mlpo.FileTier(str(path / "t0"), sync=False, limits=limits)],
            )  # fmt: skip
            return jax_mlpo.adamw(LR, weight_decay=WD, offload=config)

        self.plain_tx = tx("plain")
        # "one call": overlapped_step with one group, the same program with the whole update
        # before the forward pass; against it "overlapped" measures what the groups hide alone
        self.over_tx = {"overlapped": tx("overlapped"), "one call": tx("one-call")}

        @jax.jit
        def plain_step(params, opt_state, rest, tokens):
            value, grads = jax.value_and_grad(loss)(params, rest, tokens)
            updates, opt_state = self.plain_tx.update(grads, opt_state, params)
            return optax.apply_updates(params, updates), opt_state, value

        def over_step(tx, groups):
            @functools.partial(jax.jit, donate_argnums=(0, 1, 2))
            def step(params, opt_state, pending, rest, tokens):
                return jax_mlpo.overlapped_step(
                    loss, tx, params, opt_state, pending, rest, tokens, groups=groups
                )

            return step

        def flush(tx):
            @jax.jit
            def step(params, opt_state, pending):
                updates, opt_state = tx.update(pending, opt_state, params)
                return optax.apply_updates(params, updates), opt_state

            return step

        self.plain_step = plain_step
        groups = {"overlapped": args.groups, "one call": 1}
        self.over_step = {k: over_step(t, groups[k]) for k, t in self.over_tx.items()}
        self.flush = {k: flush(t) for k, t in self.over_tx.items()}
        # each loop starts from its own copy: the overlapped step donates its params
        self.plain = [params, self.plain_tx.init(params)]
        self.over = {}
        for k, t in self.over_tx.items():
            copy = jax.tree.map(jnp.copy, params)
            self.over[k] = [copy, t.init(copy), None]
        self.compile_s: dict[str, float] = {}
        self.groups = self._groups(loss, params, args.groups)

    def _groups(self, loss, params, groups: int) -> list[dict]:
        """Each group's leaves, as overlapped_step cuts them (forward order, then size)."""
        leaves = jax.tree.leaves_with_path(params)
        closed = jax.make_jaxpr(loss)(params, self.rest, self.tokens)
        ranks = forward_ranks(closed.jaxpr)[: len(leaves)]
        group = leaf_groups(ranks, [int(np.size(x)) for _, x in leaves], groups)
        group, _ = scans_apart(group, ranks, stacked_scans(closed.jaxpr, len(leaves)))
        out: list[dict] = [{"leaves": [], "elements": 0} for _ in range(max(group) + 1)]
        for (path, x), g in zip(leaves, group, strict=True):
            name = jax.tree_util.keystr(path, simple=True, separator=".")
            out[g]["leaves"].append(name.removesuffix(".value").removesuffix(".kernel"))
            out[g]["elements"] += int(np.size(x))
        return [g for g in out if g["leaves"]]

    def warm_up(self) -> None:
        """Compiles every program once (timed) and takes the overlapped loop's first step (it
        only computes gradients), so every timed step of the loops is a steady one."""
        for name, fn in (
            ("fwd", lambda: self.fwd(self.plain[0], self.rest, self.tokens)),
            ("fwd_bwd", lambda: self.fwd_bwd(self.plain[0], self.rest, self.tokens)),
        ):
            t0 = time.perf_counter()
            jax.block_until_ready(fn())
            self.compile_s[name] = time.perf_counter() - t0
        for loop in self.over.values():
            _, loop[2] = self.fwd_bwd(loop[0], self.rest, self.tokens)
        for system in LOOPS:
            t0 = time.perf_counter()
            self.step(system)
            self.compile_s[system] = time.perf_counter() - t0

    def step(self, system: str) -> None:
        if system == "plain":
            params, opt_state = self.plain
            params, opt_state, value = self.plain_step(params, opt_state, self.rest, self.tokens)
            self.plain = [params, opt_state]
        else:
            params, opt_state, pending = self.over[system]
            with warnings.catch_warnings():  # the update writes over the donated gradients
                warnings.filterwarnings("ignore", "Some donated buffers were not usable")
                params, opt_state, pending, value = self.over_step[system](
                    params, opt_state, pending, self.rest, self.tokens
                )
            self.over[system] = [params, opt_state, pending]
        jax.block_until_ready((params, value))

    def measure(self, system: str, steps: int) -> dict[str, float]:
        """One round of ``system``: the median of ``steps`` calls, and the update's figures."""
        if system in ("fwd", "fwd_bwd"):
            fn = self.fwd if system == "fwd" else self.fwd_bwd
            times = []
            for _ in range(steps):
                t0 = time.perf_counter()
                jax.block_until_ready(fn(self.plain[0], self.rest, self.tokens))
                times.append(time.perf_counter() - t0)
            return {"step_s": statistics.median(times)}
        rows = []
        for _ in range(steps):
            t0 = time.perf_counter()
            self.step(system)
            dt = time.perf_counter() - t0
            state = self.plain[1] if system == "plain" else self.over[system][1]
            m = jax_mlpo.metrics(state)[-1]
            rows.append({
                "step_s": dt, "total_s": m.total_s, "read_wait_s": m.read_wait_s,
                "beside_s": m.beside_s, "mb_read": sum(m.bytes_read.values()) / 1e6,
            })  # fmt: skip
        # the last update's write-backs land now, not in the next system's round
        jax_mlpo.engine_of(state).drain()
        return {k: statistics.median(r[k] for r in rows) for k in rows[0]}

    def finish(self) -> dict[str, bool]:
        """Flushes the overlapped loops, closes every optimizer; whether each overlapped loop's
        params equal the plain loop's bit for bit (the same updates on the same batch)."""
        # an overlapped loop's first step only computed gradients: with the flush it has
        # applied one update more than it took steps, as many as the plain loop after one more
        self.step("plain")
        same = {}
        for system, (params, opt_state, pending) in self.over.items():
            params, opt_state = self.flush[system](params, opt_state, pending)
            same[system] = all(
                np.array_equal(np.asarray(a), np.asarray(b))
                for a, b in zip(
                    jax.tree.leaves(params), jax.tree.leaves(self.plain[0]), strict=True
                )
            )
            jax_mlpo.close(opt_state)
        jax_mlpo.close(self.plain[1])
        return same


def compile_times(cfg: LlamaConfig, layers: list[int], tokens: jax.Array) -> list[dict]:
    """Seconds to trace, lower and compile the forward and backward pass of each variant at
    each depth (abstract params: nothing is allocated), and the compiled program's size."""
    out = []
    for n in layers:
        row: dict[str, Any] = {"layers": n}
        for variant in VARIANTS:
            c = cfg.replace(layers=n, scan_layers=variant == "scanned")
            graphdef, params, rest = nnx.split(
                nnx.eval_shape(lambda c=c: Llama(c, rngs=nnx.Rngs(0))), nnx.Param, ...
            )
            fn = jax.jit(jax.value_and_grad(functools.partial(_loss, graphdef)))
            t0 = time.perf_counter()
            compiled = fn.lower(params, rest, tokens).compile()
            row[variant] = {
                "compile_s": time.perf_counter() - t0,
                "hlo_chars": len(compiled.as_text()),
            }
        out.append(row)
        log.info("compile at %d layers: %s", n, row)
    return out


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--preset", default="small", help="the model's shape (models.PRESETS)")
    parser.add_argument("--layers", type=int, default=8, help="the preset's layers replaced")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--cache", default="8MiB", help="host cache (below the state's size)")
    parser.add_argument(
        "--cap", default="300MB", help="the tier's bandwidth cap (B/s; 0: the disk's own pace)"
    )
    parser.add_argument("--subgroup", type=int, default=1 << 18, help="elements per subgroup")
    parser.add_argument("--groups", type=int, default=8, help="overlapped_step's groups")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=3, help="steps per system per round")
    parser.add_argument("--compile-layers", default="8,32", help="depths to compile ('' none)")
    parser.add_argument("--dir", default=None, help="parent of the temporary tier directory")
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    args.cache = parse_size(args.cache, "--cache")
    args.cap = parse_size(args.cap, "--cap")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s", force=True)

    cfg = get_preset(args.preset).replace(layers=args.layers, max_seq_len=max(args.seq, 2))
    rng = np.random.default_rng(0)
    tokens = jnp.asarray(rng.integers(0, cfg.vocab_size, (args.batch, args.seq)), jnp.int32)
    if args.cache >= 8 * param_count(cfg):
        parser.error(f"--cache must be below the state's {8 * param_count(cfg)} bytes")
    tier_dir = Path(tempfile.mkdtemp(prefix="jax_mlpo-overlap-scan-", dir=args.dir))
    try:
        variants = {
            v: Variant(cfg.replace(scan_layers=v == "scanned"), tokens, tier_dir / v, args)
            for v in VARIANTS
        }
        for v in variants.values():
            v.warm_up()
        systems = [f"{v}/{s}" for v in VARIANTS for s in SYSTEMS]

        def run(system: str, rnd: int) -> dict[str, float]:
            variant, name = system.split("/")
            got = variants[variant].measure(name, args.steps)
            log.info("round %d %s: %s", rnd, system, {k: round(x, 4) for k, x in got.items()})
            return got

        rounds = interleave(systems, args.rounds, run, rotate=True)
        same = {v: variants[v].finish() for v in VARIANTS}
    finally:
        shutil.rmtree(tier_dir, ignore_errors=True)
    compiled = compile_times(
        cfg, [int(n) for n in args.compile_layers.split(",") if n], tokens[:, :-1]
    )

    results: dict[str, Any] = {}
    for v in VARIANTS:
        r = {s: rounds[f"{v}/{s}"] for s in SYSTEMS}
        step = {s: [x["step_s"] for x in r[s]] for s in r}
        saved = [p - o for p, o in zip(step["plain"], step["overlapped"], strict=True)]
        saved_by_groups = [p - o for p, o in zip(step["one call"], step["overlapped"], strict=True)]
        results[v] = {
            "step_s": {s: spread(step[s]) for s in step},
            "overlapped_over_plain": ratio_spread(step["overlapped"], step["plain"]),
            "overlapped_over_one_call": ratio_spread(step["overlapped"], step["one call"]),
            "hidden_over_fwd": ratio_spread(saved, step["fwd"]),
            "hidden_by_groups_over_fwd": ratio_spread(saved_by_groups, step["fwd"]),
            "update": {
                s: {
                    k: spread(x[k] for x in r[s])
                    for k in ("total_s", "read_wait_s", "beside_s", "mb_read")
                }
                for s in LOOPS
            },
            "beside_over_total": spread(x["beside_s"] / x["total_s"] for x in r["overlapped"]),
            "bit_equal_to_plain": same[v],
            "compile_s": variants[v].compile_s,
            "groups": variants[v].groups,
        }

    machine = provenance()["machine"]
    print(
        f"{args.preset} with {args.layers} layers ({param_count(cfg) / 1e6:.1f}M params, state "
        f"{8 * param_count(cfg) / 2**20:.0f} MiB, host cache {args.cache / 2**20:.0f} MiB, file "
        f"tier capped at {args.cap / 1e6:.0f} MB/s), batch {args.batch}x{args.seq}, groups "
        f"{args.groups}; medians of {args.rounds} rounds of {args.steps} steps [min-max]; "
        f"{machine['cpu']}, {machine['cpus']} cores"
    )
    update = "update of the overlapped step: "
    rows = [
        ("forward s", lambda r: format_spread(r["step_s"]["fwd"], digits=3)),
        ("forward+backward s", lambda r: format_spread(r["step_s"]["fwd_bwd"], digits=3)),
        ("plain step s", lambda r: format_spread(r["step_s"]["plain"], digits=3)),
        ("overlapped step, one call s", lambda r: format_spread(r["step_s"]["one call"], digits=3)),
        ("overlapped step s", lambda r: format_spread(r["step_s"]["overlapped"], digits=3)),
        ("overlapped / plain", lambda r: format_spread(r["overlapped_over_plain"])),
        ("overlapped / one call", lambda r: format_spread(r["overlapped_over_one_call"])),
        ("(plain - overlapped) / forward", lambda r: format_spread(r["hidden_over_fwd"])),
        ("(one call - overlapped) / forward",
         lambda r: format_spread(r["hidden_by_groups_over_fwd"])),
        ("update total_s, plain step",
         lambda r: format_spread(r["update"]["plain"]["total_s"], digits=3)),
        (update + "total_s",
         lambda r: format_spread(r["update"]["overlapped"]["total_s"], digits=3)),
        (update + "read_wait_s",
         lambda r: format_spread(r["update"]["overlapped"]["read_wait_s"], digits=3)),
        (update + "beside_s",
         lambda r: format_spread(r["update"]["overlapped"]["beside_s"], digits=3)),
        ("beside_s / total_s", lambda r: format_spread(r["beside_over_total"])),
        ("MB read from the tier per update",
         lambda r: format_spread(r["update"]["overlapped"]["mb_read"], digits=1)),
        ("params equal to plain, bit for bit",
         lambda r: "/".join(str(x) for x in r["bit_equal_to_plain"].values())),
        ("first call s, fwd+bwd / plain / overlapped step",
         lambda r: f"{r['compile_s']['fwd_bwd']:.1f} / {r['compile_s']['plain']:.1f} / "
                   f"{r['compile_s']['overlapped']:.1f}"),
    ]  # fmt: skip
    print(f"{'':<46}{'unrolled':>26}{'scanned':>26}")
    for label, fn in rows:
        print(f"{label:<46}{fn(results['unrolled']):>26}{fn(results['scanned']):>26}")
    for v in VARIANTS:
        print(f"{v}'s groups in forward order: " + "; ".join(
            f"{g['elements'] / 1e6:.2f}M {g['leaves'][0]}" + (
                f" .. {g['leaves'][-1]} ({len(g['leaves'])})" if len(g["leaves"]) > 1 else "")
            for g in results[v]["groups"]
        ))  # fmt: skip
    for row in compiled:
        print(f"compile fwd+bwd at {row['layers']} layers: " + ", ".join(
            f"{v} {row[v]['compile_s']:.1f} s ({row[v]['hlo_chars'] / 1e3:.0f}k HLO chars)"
            for v in VARIANTS
        ))  # fmt: skip
    out = {"args": vars(args), "variants": results, "compile": compiled}
    write_json(args.json, out)
    return out


if __name__ == "__main__":
    main()
