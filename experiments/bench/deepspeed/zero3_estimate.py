"""DeepSpeed ZeRO-3's own memory accounting for the paper's shapes, beside jax_mlpo's plan.

For each shape, ``deepspeed.runtime.zero.stage3.estimate_zero3_model_states_mem_needs`` (the
function behind DeepSpeed's ``estimate_zero3_model_states_mem_needs_all_cold``), run in the
DeepSpeed peer's venv, on one node of ``--gpus`` GPUs, for its two offload settings: the
optimizer state in CPU memory (params on the GPUs, as jax_mlpo keeps them), and the params in
CPU memory too. DeepSpeed's estimator has no NVMe setting: with ZeRO-Infinity's NVMe offload
the state goes to disk, but these are the host figures DeepSpeed's accounting gives for the
state it swaps through. Beside them: jax_mlpo's host memory per node from ``pretrain.py
--dry-run`` (host cache + subgroup staging per process, one process per GPU).

    python -m experiments.bench.deepspeed.zero3_estimate \
        --json experiments/results/zero3_estimate.json
"""

from __future__ import annotations

import argparse
import json
import subprocess

from experiments.bench.deepspeed.peer import PEER_PYTHON, require_peer, worker_env
from experiments.bench.harness import write_json
from experiments.dry_run import dry_run
from experiments.run_config import load_config, resolve_model
from models import param_count

SHAPES = ("40B", "52B", "70B", "100B", "120B")
CONFIG = "experiments/configs/7b-node.yaml"

_ESTIMATE = """
import json, sys
from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs as estimate
out = {}
for name, total, largest, gpus in json.loads(sys.argv[1]):
    out[name] = {
        f"offload_param={p}": dict(zip(("cpu_bytes", "gpu_bytes", "largest_layer_bytes"),
                                       estimate(total, largest, num_gpus_per_node=gpus,
                                                cpu_offload=True, cpu_offload_params=p)))
        for p in (False, True)
    }
print(json.dumps(out))
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gpus", type=int, default=4)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    require_peer()
    rows, shapes = {}, []
    for name in SHAPES:
        cfg = load_config(CONFIG, [f"model={name}"])
        model = resolve_model(cfg)
        total = param_count(model)
        # the largest single weight: the embedding (or head) or an FFN matrix
        largest = max(model.vocab_size * model.hidden, model.hidden * model.ffn)
        shapes.append((name, total, largest, args.gpus))
        plan = dry_run(cfg, args.gpus)
        per_node = plan["host_bytes"] * args.gpus
        rows[name] = {"params": total, "jax_mlpo_host_bytes_per_node": per_node}
    done = subprocess.run([PEER_PYTHON, "-c", _ESTIMATE, json.dumps(shapes)], capture_output=True,
                          text=True, env=worker_env(), check=True)  # fmt: skip
    for name, figures in json.loads(done.stdout.strip().splitlines()[-1]).items():
        rows[name]["deepspeed"] = figures
    print("| shape | params | DeepSpeed: CPU per node, state offloaded | GPU each | CPU per node, "
          "params offloaded too | GPU each | jax_mlpo host per node |")  # fmt: skip
    print("|---|---|---|---|---|---|---|")
    for name, r in rows.items():
        a, b = r["deepspeed"]["offload_param=False"], r["deepspeed"]["offload_param=True"]
        print(
            f"| {name} | {r['params'] / 1e9:.1f}B | {a['cpu_bytes'] / 1e9:.0f} GB | "
            f"{a['gpu_bytes'] / 1e9:.1f} GB | {b['cpu_bytes'] / 1e9:.0f} GB | "
            f"{b['gpu_bytes'] / 1e9:.1f} GB | {r['jax_mlpo_host_bytes_per_node'] / 1e9:.0f} GB |"
        )
    if args.json:
        write_json(args.json, {"gpus_per_node": args.gpus, "config": CONFIG, "shapes": rows})


if __name__ == "__main__":
    main()
