"""One run of DeepSpeed's NVMe optimizer swapper, driven standalone the way ZeRO-3 drives it.

Runs in the DeepSpeed venv (``.peer-venv``, torch CPU), started by ``deepspeed_peer.py``; prints
one JSON line with the per-step times. What one run does, following
``deepspeed/runtime/zero/stage3.py`` (0.19.8):

- ``initialize_parameters``: the fp32 master params of every subgroup written to ``nvme_path``.
- An initial pass (one synchronous step per subgroup, zero gradients): DeepSpeedCPUAdam creates
  the moments, and the swap-out writes their files (ZeRO-3 does this in its first step).
- Each step: the "backward" part, ``swap_out_gradients`` of each subgroup's fp32 gradient plus
  ``flush_gradients`` (timed as ``grad_write_s``; ZeRO-3 does it at the end of backward), then
  the update, as ``stage3.step``: per subgroup ``swap_in_optimizer_state`` (params, exp_avg,
  exp_avg_sq and the gradient; the pipelined swapper also prefetches the next subgroup) →
  ``DeepSpeedCPUAdam.step`` → copy of the fp32 params into the model's param partition →
  ``swap_out_optimizer_state`` (asynchronous for all but the last subgroup when pipelined).

Usage (normally through deepspeed_peer.py; the repository root on ``PYTHONPATH`` for
:mod:`experiments.bench.sysio` and :mod:`experiments.bench.harness`):
  DS_ACCELERATOR=cpu PYTHONPATH=$PWD .peer-venv/bin/python \
      experiments/bench/deepspeed/ds_update.py --swapper pipelined --dir /tmp/ds-nvme \
      --elems 134217728 --subgroup 8388608 --buffer-count 12
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time

from experiments.bench.harness import medians
from experiments.bench.sysio import drop_page_cache, proc_io


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--swapper", choices=("partitioned", "pipelined"), required=True)
    parser.add_argument("--dir", required=True, help="nvme_path (created, removed at the end)")
    parser.add_argument("--elems", type=int, required=True, help="fp32 params in all subgroups")
    parser.add_argument("--subgroup", type=int, required=True, help="sub_group_size (elements)")
    parser.add_argument("--buffer-count", type=int, default=12)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=1, help="steps after the initial pass")
    parser.add_argument(
        "--no-grad-swap",
        action="store_true",
        help="keep gradients in memory instead of swapping them (not ZeRO-3)",
    )
    parser.add_argument("--block-size", type=int, default=1 << 20)
    parser.add_argument("--queue-depth", type=int, default=8)
    parser.add_argument("--intra-op-parallelism", type=int, default=1)
    args = parser.parse_args()

    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    for key, value in (
        ("MASTER_ADDR", "127.0.0.1"),
        ("MASTER_PORT", "29517"),
        ("RANK", "0"),
        ("WORLD_SIZE", "1"),
        ("LOCAL_RANK", "0"),
    ):
        os.environ.setdefault(key, value)
    t_import = time.perf_counter()
    import deepspeed
    import torch
    from deepspeed.ops.adam import DeepSpeedCPUAdam
    from deepspeed.runtime.swap_tensor.partitioned_optimizer_swapper import (
        PartitionedOptimizerSwapper,
    )
    from deepspeed.runtime.swap_tensor.pipelined_optimizer_swapper import (
        PipelinedOptimizerSwapper,
    )
    from deepspeed.runtime.zero.offload_config import DeepSpeedZeroOffloadOptimizerConfig

    deepspeed.init_distributed(dist_backend="gloo", auto_mpi_discovery=False, verbose=False)
    import_s = time.perf_counter() - t_import

    pipelined = args.swapper == "pipelined"
    swap_config = DeepSpeedZeroOffloadOptimizerConfig(
        device="nvme",
        nvme_path=args.dir,
        buffer_count=args.buffer_count,
        pin_memory=True,
        pipeline_read=pipelined,
        pipeline_write=pipelined,
    )
    aio_config = {
        "block_size": args.block_size,
        "queue_depth": args.queue_depth,
        "intra_op_parallelism": args.intra_op_parallelism,
        "single_submit": False,
        "overlap_events": True,
        "use_gds": False,
    }
    n_sub = -(-args.elems // args.subgroup)
    sizes = [min(args.subgroup, args.elems - i * args.subgroup) for i in range(n_sub)]
    shutil.rmtree(args.dir, ignore_errors=True)
    os.makedirs(args.dir)

    # The fp32 master partitions: empty until swapped in (stage3.py: torch.empty(0)).
    params = []
    for i in range(n_sub):
        p = torch.empty(0, dtype=torch.float32)
        p.ds_id = f"{i}_{i}"
        p.requires_grad = True
        params.append(p)
    nxt = [params[i + 1] if i + 1 < n_sub else None for i in range(n_sub)]
    optimizer = DeepSpeedCPUAdam(
        [torch.nn.Parameter(torch.zeros(1))],
        lr=1e-3,
        betas=(0.9, 0.999),
        eps=1e-8,
        weight_decay=0.1,
        adamw_mode=True,
    )
    optimizer.param_groups[0]["params"] = []
    cls = PipelinedOptimizerSwapper if pipelined else PartitionedOptimizerSwapper
    t0 = time.perf_counter()
    swapper = cls(
        swap_config=swap_config,
        aio_config=aio_config,
        base_folder=os.path.join(args.dir, "zero_stage_3"),
        optimizer=optimizer,
        largest_numel=max(sizes),
        device="cpu",
        dtype=torch.float32,
        timers=None,
    )
    gen = torch.Generator().manual_seed(0)
    init = torch.randn(max(sizes), generator=gen)
    swapper.initialize_parameters(parameters=params, src_tensors=[init[:s] for s in sizes])
    grads = [torch.randn(s, generator=gen) * 1e-3 for s in sizes]  # the backward's fp32 grads
    model = [torch.empty(s) for s in sizes]  # the model's param partitions (stage3: fp16 flat)

    def adam(i: int) -> float:
        t = time.perf_counter()
        optimizer.param_groups[0]["params"] = [params[i]]
        optimizer.step()
        optimizer.param_groups[0]["params"] = []
        model[i].copy_(params[i].data)
        return time.perf_counter() - t

    # Initial pass: synchronous, zero gradients; creates the moments and their files.
    zero = torch.zeros(max(sizes))
    for i in range(n_sub):
        swapper.swap_in_optimizer_state(parameter=params[i], async_parameter=None)
        params[i].grad = zero[: sizes[i]]
        adam(i)
        swapper.swap_out_optimizer_state(parameter=params[i], async_swap=False)
        params[i].grad = None
    init_s = time.perf_counter() - t0

    steps = []
    for step in range(args.warmup + args.steps):
        dropped = drop_page_cache(level=1)  # outside the timing: every step reads from the disk
        io0 = proc_io()
        t0 = time.perf_counter()
        if not args.no_grad_swap:
            for i in range(n_sub):
                swapper.swap_out_gradients(
                    parameter=params[i], gradient_offsets=[0], gradient_tensors=[grads[i]]
                )
            swapper.flush_gradients()
        io_grads = proc_io()  # the step's own bytes start here: the grads were written before it
        t1 = time.perf_counter()
        adam_s = 0.0
        for i in range(n_sub):
            swapper.swap_in_optimizer_state(parameter=params[i], async_parameter=nxt[i])
            if args.no_grad_swap:
                params[i].grad = grads[i]
            adam_s += adam(i)
            swapper.swap_out_optimizer_state(parameter=params[i], async_swap=nxt[i] is not None)
            params[i].grad = None
        t2 = time.perf_counter()
        io1 = proc_io()
        row = {
            "grad_write_s": t1 - t0,
            "update_s": t2 - t1,
            "adam_s": adam_s,
            "bytes_read": io1["read"] - io0["read"],
            "bytes_written": io1["write"] - io0["write"],
            "step_bytes_read": io1["read"] - io_grads["read"],
            "step_bytes_written": io1["write"] - io_grads["write"],
            "page_cache_dropped": dropped,
        }
        print(f"{args.swapper} step {step}: {json.dumps(row)}", file=sys.stderr)
        if step >= args.warmup:
            steps.append(row)

    files = sorted(os.listdir(os.path.join(args.dir, "zero_stage_3", "optimizer", "rank0")))
    disk_bytes = sum(
        os.path.getsize(os.path.join(args.dir, "zero_stage_3", "optimizer", "rank0", f))
        for f in files
    )
    out = {
        "system": f"deepspeed {args.swapper}",
        "deepspeed": deepspeed.__version__,
        "torch": torch.__version__,
        "subgroups": n_sub,
        "buffer_count": args.buffer_count,
        "pinned_bytes": args.buffer_count * swapper.largest_numel * 4,
        "files": len(files),
        "disk_bytes": disk_bytes,
        "import_s": import_s,
        "init_s": init_s,
        "steps": steps,
        **medians(steps, ("update_s", "grad_write_s", "adam_s")),
    }
    # stage3 note: a swapper left alive aborts the interpreter at exit on some versions.
    del swapper
    shutil.rmtree(args.dir, ignore_errors=True)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
