"""A training process killed inside an asynchronous checkpoint save (spawned by
tests/test_checkpoint_faults.py).

Usage: ckpt_killed_save_worker.py BASE

Trains tests/fault_training.py's problem with its state on a file tier under ``BASE/run``,
saves checkpoint 2 into ``BASE/ckpt`` and waits for it, writes what it saved to
``BASE/saved.npz`` (the params and the logical state), trains 2 more steps and starts an
asynchronous save of checkpoint 4. The save's second write of a piece of the offloaded state
kills the process with SIGKILL (a ``jax_mlpo.testing.checkpoint_faults`` action): after the
first piece is on disk, before the checkpoint is complete. Prints ``SAVING`` once the save has
started; ``SAVED`` would follow it if the save were not killed.
"""

from __future__ import annotations

import os
import signal
import sys

os.environ["JAX_PLATFORMS"] = "cpu"

from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402
from fault_training import Training, file_config  # noqa: E402

import jax_mlpo  # noqa: E402
import jax_mlpo.testing  # noqa: E402


def main() -> None:
    base = Path(sys.argv[1])
    run = Training(file_config(base / "run"))
    run.run(2)
    mngr = jax_mlpo.checkpoint.manager(str(base / "ckpt"))
    jax_mlpo.checkpoint.save(mngr, 2, run.params, run.state)
    mngr.wait_until_finished()
    state = run.engine.state_dict()
    np.savez(base / "saved.npz", params=np.asarray(run.params["w"]), mu=state["mu"][0],
             nu=state["nu"][0])  # fmt: skip
    run.run(2)
    with jax_mlpo.testing.checkpoint_faults() as plan:
        plan.on("write", lambda: os.kill(os.getpid(), signal.SIGKILL), kind="state", nth=2)
        jax_mlpo.checkpoint.save(mngr, 4, run.params, run.state)
        print("SAVING", flush=True)
        mngr.wait_until_finished()
    print("SAVED", flush=True)


if __name__ == "__main__":
    main()
