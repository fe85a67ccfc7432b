"""A small GPT (LLaMA-shaped) trained with ``deepspeed.initialize``, ZeRO-3, optimizer on NVMe.

The DeepSpeed side of the end-to-end comparison (``deepspeed_e2e.py``, docs/deepspeed.md "End to
end"). Runs in the DeepSpeed venv (``.peer-venv``: torch CPU, ``DS_ACCELERATOR=cpu``), one
process, and prints one JSON line (the last line of stdout) with the per-step times.

The model is ``models/llama.py`` in torch, parameter for parameter: token embedding, ``layers``
pre-norm blocks (RMSNorm scale, q/k/v/o without bias, causal grouped-query attention with RoPE
in the "rotate half" layout, RMSNorm scale, SwiGLU gate/up/down), a final RMSNorm and an untied
output projection; init N(0, 0.02), residual-branch outputs N(0, 0.02 / sqrt(2 layers)); logits
and the loss in float32. ``--expect-params`` (the jax side's ``param_count``) is checked.

Training is what ``experiments/pretrain.py`` does: the same batches (``experiments/job/data.py``,
windows of the stdlib corpus drawn with ``default_rng((seed, step))``), AdamW with b1, b2, eps and
weight decay on the 2-D parameters only, global-norm clipping, optax's warm-up + cosine schedule
(a ``LambdaLR``). DeepSpeed config: ZeRO stage 3, bf16, ``offload_optimizer`` to ``nvme`` at
``--nvme-path`` with ``pin_memory``, ``buffer_count`` pinned swap buffers and pipelined reads and
writes, ``aio`` (libaio, O_DIRECT, 1 MiB blocks, queue depth 8), ``sub_group_size``; the
optimizer is DeepSpeedCPUAdam in AdamW mode (what DeepSpeed builds for ``AdamW`` with an offloaded
optimizer). The fp32 master params, both moments and the fp32 gradient partitions live in
``nvme_path`` (16 B per parameter).

Per step (outside the timing: ``sync`` + drop of the page cache, so nothing is served from RAM):
``fwd_s`` (``engine(tokens)``), ``bwd_s`` (``engine.backward``: autograd, ZeRO-3 gradient
partitioning and the swap-out of the fp32 gradients), ``step_s`` (``engine.step``: per subgroup
swap in p, m, v and the gradient, clip, CPU Adam, bf16 copy, swap out); inside them, from wrappers
around DeepSpeed's swapper and optimizer: ``grad_swap_out_s``, ``swap_in_s``, ``adam_s``,
``swap_out_s``; the bytes this process read and wrote (``/proc/self/io``).

Usage (normally through deepspeed_e2e.py, which passes the shape of the jax config; the
repository root on ``PYTHONPATH`` for :mod:`experiments.job.data` and
:mod:`experiments.bench.sysio`):
  DS_ACCELERATOR=cpu TORCH_EXTENSIONS_DIR=$PWD/.torch_ext PYTHONPATH=$PWD .peer-venv/bin/python \
      experiments/bench/deepspeed/ds_gpt.py --nvme-path /tmp/jax_mlpo-e2e/ds --steps 8 \
      --warmup 3
"""

from __future__ import annotations

import argparse
import collections
import functools
import gc
import json
import logging
import math
import os
import shutil
import sys
import time
from pathlib import Path

from experiments.bench.harness import medians
from experiments.bench.sysio import drop_page_cache, proc_io

ROOT = str(Path(__file__).resolve().parents[3])

logger = logging.getLogger("bench.ds_gpt")


def build_model(args):
    import torch
    import torch.nn.functional as F
    from torch import nn

    class RMSNorm(nn.Module):
        def __init__(self, features: int, eps: float):
            super().__init__()
            self.scale = nn.Parameter(torch.ones(features))
            self.eps = eps

        def forward(self, x):
            x32 = x.float()
            x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
            return (x32 * self.scale.float()).to(x.dtype)

    def rope(x, theta: float):  # x [B, T, H, d], pairs (i, i + d/2), angles in float32
        _, t, _, d = x.shape
        inv_freq = 1.0 / (theta ** (torch.arange(0, d, 2, dtype=torch.float32) / d))
        angles = torch.arange(t, dtype=torch.float32)[:, None] * inv_freq[None, :]
        cos, sin = angles.cos()[None, :, None, :], angles.sin()[None, :, None, :]
        x1, x2 = x.float().chunk(2, dim=-1)
        return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)

    def linear(d_in: int, d_out: int, std: float) -> nn.Linear:
        layer = nn.Linear(d_in, d_out, bias=False)
        nn.init.normal_(layer.weight, std=std)
        return layer

    h, heads, kv_heads, layers = args.hidden, args.heads, args.kv_heads, args.layers
    head_dim = h // heads
    out_std = 0.02 / math.sqrt(2 * layers)

    class Attention(nn.Module):
        def __init__(self):
            super().__init__()
            self.q = linear(h, h, 0.02)
            self.k = linear(h, kv_heads * head_dim, 0.02)
            self.v = linear(h, kv_heads * head_dim, 0.02)
            self.o = linear(h, h, out_std)

        def forward(self, x):
            b, t, _ = x.shape
            q = rope(self.q(x).view(b, t, heads, head_dim), args.rope_theta).transpose(1, 2)
            k = rope(self.k(x).view(b, t, kv_heads, head_dim), args.rope_theta).transpose(1, 2)
            v = self.v(x).view(b, t, kv_heads, head_dim).transpose(1, 2)
            out = F.scaled_dot_product_attention(
                q, k, v, is_causal=True, enable_gqa=kv_heads != heads
            )
            return self.o(out.transpose(1, 2).reshape(b, t, h))

    class SwiGLU(nn.Module):
        def __init__(self):
            super().__init__()
            self.gate = linear(h, args.ffn, 0.02)
            self.up = linear(h, args.ffn, 0.02)
            self.down = linear(args.ffn, h, out_std)

        def forward(self, x):
            return self.down(F.silu(self.gate(x)) * self.up(x))

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.attn_norm = RMSNorm(h, args.norm_eps)
            self.attn = Attention()
            self.mlp_norm = RMSNorm(h, args.norm_eps)
            self.mlp = SwiGLU()

        def forward(self, x):
            x = x + self.attn(self.attn_norm(x))
            return x + self.mlp(self.mlp_norm(x))

    class GPT(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = nn.Embedding(args.vocab, h)
            nn.init.normal_(self.embed.weight, std=0.02)
            self.blocks = nn.ModuleList(Block() for _ in range(layers))
            self.final_norm = RMSNorm(h, args.norm_eps)
            self.lm_head = linear(h, args.vocab, 0.02)

        def forward(self, tokens):  # mean next-token cross entropy, as models.llama.loss_fn
            x = self.embed(tokens[:, :-1])
            for block in self.blocks:
                x = block(x)
            logits = self.lm_head(self.final_norm(x)).float()
            return F.cross_entropy(logits.reshape(-1, args.vocab), tokens[:, 1:].reshape(-1))

    return GPT()


def jax_param_count(args) -> int:
    """``models.presets.param_count`` for this shape (that module needs jax)."""
    h, kv_dim = args.hidden, args.kv_heads * (args.hidden // args.heads)
    block = 2 * h * h + 2 * h * kv_dim + 3 * h * args.ffn + 2 * h
    return args.vocab * h + args.layers * block + h + h * args.vocab


def warmup_cosine(args):
    """optax.warmup_cosine_decay_schedule(0, peak, warmup, max(steps, warmup + 1), peak * min)
    as a multiplier of the peak learning rate, for LambdaLR."""
    warmup, decay = args.warmup_steps, max(args.total_steps, args.warmup_steps + 1)
    alpha = args.min_lr_ratio

    def factor(count: int) -> float:
        if count < warmup:
            return count / warmup
        c = min(count - warmup, decay - warmup)
        return (1 - alpha) * 0.5 * (1 + math.cos(math.pi * c / (decay - warmup))) + alpha

    return factor


class Timers:
    """Accumulates the wall time of wrapped methods, per step."""

    def __init__(self):
        self.s = collections.defaultdict(float)
        self.calls = collections.defaultdict(int)

    def wrap(self, obj, method: str, key: str) -> None:
        fn = getattr(obj, method)

        @functools.wraps(fn)
        def timed(*a, **kw):
            t0 = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                self.s[key] += time.perf_counter() - t0
                self.calls[key] += 1

        setattr(obj, method, timed)

    def take(self) -> dict:
        out = {k: v for k, v in self.s.items()}
        out.update({f"{k}_calls": v for k, v in self.calls.items()})
        self.s.clear()
        self.calls.clear()
        return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    # the model shape (defaults: the 125M preset with vocab 8192, experiments/configs/e2e-125m.yaml)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--hidden", type=int, default=768)
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--heads", type=int, default=12)
    parser.add_argument("--kv-heads", type=int, default=12)
    parser.add_argument("--ffn", type=int, default=2048)
    parser.add_argument("--rope-theta", type=float, default=10000.0)
    parser.add_argument("--norm-eps", type=float, default=1e-5)
    parser.add_argument("--expect-params", type=int, default=None, help="jax side's count")
    # the batch and the data
    parser.add_argument("--batch-size", type=int, default=2)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--data-cache", default=os.path.join(ROOT, "runs", "data-cache"))
    # the optimizer (experiments/pretrain.py's OptimizerConfig)
    parser.add_argument("--peak-lr", type=float, default=6e-4)
    parser.add_argument("--warmup-steps", type=int, default=2)
    parser.add_argument("--total-steps", type=int, default=None, help="schedule length (steps)")
    parser.add_argument("--min-lr-ratio", type=float, default=0.1)
    parser.add_argument("--b1", type=float, default=0.9)
    parser.add_argument("--b2", type=float, default=0.95)
    parser.add_argument("--eps", type=float, default=1e-8)
    parser.add_argument("--weight-decay", type=float, default=0.1)
    parser.add_argument("--clip-norm", type=float, default=1.0)
    # DeepSpeed
    parser.add_argument("--nvme-path", required=True, help="created; removed at the end")
    parser.add_argument("--sub-group-size", type=int, default=8388608)
    parser.add_argument("--buffer-count", type=int, default=12, help="pipelined needs 3 x 4")
    parser.add_argument("--pipeline", choices=("on", "off"), default="on")
    parser.add_argument("--dtype", choices=("bf16", "fp32"), default="bf16")
    parser.add_argument("--block-size", type=int, default=1 << 20)
    parser.add_argument("--queue-depth", type=int, default=8)
    parser.add_argument("--intra-op-parallelism", type=int, default=1)
    # the run
    parser.add_argument("--steps", type=int, default=8, help="all steps, warm-up included")
    parser.add_argument("--warmup", type=int, default=3, help="steps left out of the medians")
    parser.add_argument("--no-drop", action="store_true", help="keep the page cache")
    parser.add_argument("--port", default="29531")
    args = parser.parse_args()
    args.total_steps = args.total_steps or args.steps
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(name)s: %(message)s", stream=sys.stderr
    )

    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    for key, value in (
        ("MASTER_ADDR", "127.0.0.1"),
        ("MASTER_PORT", args.port),
        ("RANK", "0"),
        ("WORLD_SIZE", "1"),
        ("LOCAL_RANK", "0"),
        ("LOCAL_SIZE", "1"),
    ):
        os.environ.setdefault(key, value)
    t_start = time.perf_counter()
    import deepspeed
    import numpy as np
    import torch

    from experiments.job.data import TokenDataset, batches

    deepspeed.init_distributed(dist_backend="gloo", auto_mpi_discovery=False, verbose=False)
    import_s = time.perf_counter() - t_start

    torch.manual_seed(args.seed)
    model = build_model(args)
    n_params = sum(p.numel() for p in model.parameters())
    expected = jax_param_count(args)
    logger.info(
        "model: %s parameters (torch), %s (models.presets.param_count formula)%s",
        f"{n_params:,}",
        f"{expected:,}",
        f", jax side reports {args.expect_params:,}" if args.expect_params else "",
    )
    if n_params != expected or (args.expect_params and n_params != args.expect_params):
        raise SystemExit("parameter counts differ: the torch model is not the jax model's shape")
    if args.dtype == "bf16":
        model = model.to(torch.bfloat16)

    decay = [p for p in model.parameters() if p.ndim > 1]  # pretrain.py: no decay on 1-D leaves
    no_decay = [p for p in model.parameters() if p.ndim <= 1]
    groups = [
        {"params": decay, "weight_decay": args.weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    shutil.rmtree(args.nvme_path, ignore_errors=True)
    os.makedirs(args.nvme_path)
    pipelined = args.pipeline == "on"
    config = {
        "train_micro_batch_size_per_gpu": args.batch_size,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": args.clip_norm,
        "steps_per_print": 1 << 30,
        "wall_clock_breakdown": False,
        "bf16": {"enabled": args.dtype == "bf16"},
        "optimizer": {
            "type": "AdamW",
            "params": {
                "lr": args.peak_lr,
                "betas": [args.b1, args.b2],
                "eps": args.eps,
                "weight_decay": args.weight_decay,
            },
        },
        "zero_optimization": {
            "stage": 3,
            "sub_group_size": args.sub_group_size,
            "offload_optimizer": {
                "device": "nvme",
                "nvme_path": args.nvme_path,
                "pin_memory": True,
                "buffer_count": args.buffer_count,
                "pipeline_read": pipelined,
                "pipeline_write": pipelined,
            },
        },
        "aio": {
            "block_size": args.block_size,
            "queue_depth": args.queue_depth,
            "intra_op_parallelism": args.intra_op_parallelism,
            "single_submit": False,
            "overlap_events": True,
        },
    }
    factor = warmup_cosine(args)
    t0 = time.perf_counter()
    engine, optimizer, _, scheduler = deepspeed.initialize(
        model=model,
        model_parameters=groups,
        config=config,
        lr_scheduler=lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, factor),
    )
    init_s = time.perf_counter() - t0
    basic = engine.basic_optimizer if hasattr(engine, "basic_optimizer") else optimizer.optimizer
    swapper = optimizer.optimizer_swapper
    timers = Timers()
    timers.wrap(swapper, "swap_in_optimizer_state", "swap_in_s")
    timers.wrap(swapper, "swap_out_optimizer_state", "swap_out_s")
    timers.wrap(swapper, "swap_out_gradients", "grad_swap_out_s")
    timers.wrap(basic, "step", "adam_s")
    subgroups = [int(n) for n in optimizer.fp16_partitioned_groups_flat_numel]
    buffers = swapper.swap_buffer_manager
    pinned_bytes = (
        buffers.count * buffers.num_elems * torch.tensor([], dtype=buffers.dtype).itemsize
    )
    logger.info(
        "deepspeed %s, torch %s, %s: ZeRO-3 ready in %.1f s; %s (%s); %d subgroups (elements: "
        "%s); pinned swap buffers %d x %d elements = %.0f MiB",
        deepspeed.__version__,
        torch.__version__,
        args.dtype,
        init_s,
        type(optimizer).__name__,
        type(swapper).__name__,
        len(subgroups),
        subgroups,
        buffers.count,
        buffers.num_elems,
        pinned_bytes / 2**20,
    )

    dataset = TokenDataset.from_default_corpus(args.data_cache)
    steps = []
    timers.take()
    for step, batch in batches(
        dataset, args.batch_size, args.seq_len, args.seed, 0, end_step=args.steps
    ):
        tokens = torch.from_numpy(np.asarray(batch, dtype=np.int64))
        t_drop = time.perf_counter()
        dropped = False if args.no_drop else drop_page_cache(level=1)
        drop_s = time.perf_counter() - t_drop
        lr = scheduler.get_last_lr()[0]
        io0 = proc_io()
        t0 = time.perf_counter()
        loss = engine(tokens)
        t1 = time.perf_counter()
        engine.backward(loss)
        t2 = time.perf_counter()
        engine.step()
        t3 = time.perf_counter()
        io1 = proc_io()
        row = {
            "step": step + 1,
            "loss": float(loss),
            "lr": lr,
            "iter_s": t3 - t0,
            "fwd_s": t1 - t0,
            "bwd_s": t2 - t1,
            "fwd_bwd_s": t2 - t0,
            "step_s": t3 - t2,
            "bytes_read": io1["read"] - io0["read"],
            "bytes_written": io1["write"] - io0["write"],
            "page_cache_dropped": dropped,
            "drop_s": drop_s,
            "grad_norm": float(engine.get_global_grad_norm() or 0.0),
        }
        row.update(timers.take())
        logger.info(
            "step %d loss %.4f iter %.2f s (fwd %.2f bwd %.2f [grad swap-out %.2f] step %.2f "
            "[swap in %.2f adam %.2f swap out %.2f]) read %.2f GB written %.2f GB",
            row["step"],
            row["loss"],
            row["iter_s"],
            row["fwd_s"],
            row["bwd_s"],
            row.get("grad_swap_out_s", 0.0),
            row["step_s"],
            row.get("swap_in_s", 0.0),
            row.get("adam_s", 0.0),
            row.get("swap_out_s", 0.0),
            row["bytes_read"] / 1e9,
            row["bytes_written"] / 1e9,
        )
        if step >= args.warmup:
            steps.append(row)
        if not math.isfinite(row["loss"]):
            raise SystemExit(f"loss became {row['loss']} at step {step + 1}")

    folder = os.path.join(args.nvme_path, "zero_stage_3", "optimizer", "rank0")
    files = sorted(os.listdir(folder)) if os.path.isdir(folder) else []
    disk_bytes = sum(os.path.getsize(os.path.join(folder, f)) for f in files)
    out = {
        "system": "deepspeed zero-3 nvme" + (" pipelined" if pipelined else " partitioned"),
        "deepspeed": deepspeed.__version__,
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "dtype": args.dtype,
        "params": n_params,
        "params_formula": expected,
        "subgroups": subgroups,
        "buffer_count": buffers.count,
        "pinned_bytes": pinned_bytes,
        "swap_files": len(files),
        "disk_bytes": disk_bytes,
        "import_s": import_s,
        "init_s": init_s,
        "losses": [s["loss"] for s in steps],
        "steps": steps,
    }
    keys = (
        "iter_s", "fwd_s", "bwd_s", "fwd_bwd_s", "step_s", "swap_in_s", "swap_out_s",
        "grad_swap_out_s", "adam_s", "bytes_read", "bytes_written", "drop_s",
    )  # fmt: skip
    out.update(medians(steps, keys, missing=0.0))
    # A ZeRO-3 engine left alive aborts the interpreter at exit (deepspeed-on-cpu.md).
    engine.destroy()
    del engine, optimizer, swapper, basic
    gc.collect()
    shutil.rmtree(args.nvme_path, ignore_errors=True)
    out["process_s"] = time.perf_counter() - t_start
    sys.stdout.write(json.dumps(out) + "\n")  # the driver reads this last line
    sys.stdout.flush()


if __name__ == "__main__":
    main()
