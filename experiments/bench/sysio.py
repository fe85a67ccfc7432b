"""The machine around a benchmark: page-cache control, per-process I/O counters, the disk's raw
bandwidth (fio) and its file system.

Standard library only, shared by every benchmark group: the DeepSpeed peer's workers
(``experiments/bench/deepspeed/ds_*.py``) run in a venv without jax and import it too.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess


def drop_page_cache(level: int = 3) -> bool:
    """Writes back and drops the page cache (root only), so the next reads hit the disk.

    Args:
      level: what ``/proc/sys/vm/drop_caches`` drops: 1 page cache, 3 also dentries/inodes.

    Returns:
      Whether the cache could be dropped.
    """
    try:
        os.sync()
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write(f"{level}\n")
        return True
    except OSError:
        return False


def proc_io() -> dict[str, int]:
    """Bytes this process read from and wrote to storage (page cache misses, O_DIRECT)."""
    with open("/proc/self/io") as f:
        fields = dict(line.split(": ") for line in f.read().splitlines())
    return {"read": int(fields["read_bytes"]), "write": int(fields["write_bytes"])}


def fio_bandwidth(directory: str, size: str = "1GiB") -> dict:
    """Sequential O_DIRECT write then read of one file: 1 MiB requests, queue depth 8 (libaio)."""
    if shutil.which("fio") is None:
        return {"error": "fio not installed (apt-get install fio)"}
    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, "fio.dat")
    out = {}
    for rw in ("write", "read"):
        cmd = [
            "fio",
            "--name=seq",
            f"--filename={path}",
            f"--rw={rw}",
            "--bs=1M",
            "--iodepth=8",
            "--ioengine=libaio",
            "--direct=1",
            f"--size={size}",
            "--output-format=json",
        ]
        res = subprocess.run(cmd, capture_output=True, text=True, check=True)
        job = json.loads(res.stdout)["jobs"][0][rw]
        out[f"{rw}_gbps"] = job["bw_bytes"] / 1e9
    os.remove(path)
    return out


def _fio(args: list[str], files: list[str], block: str, depth: int) -> dict:
    """Runs fio (JSON output) on ``files``, deleting them afterwards; returns each job's read and
    write bandwidth summed, as :func:`fio_mixed` does, or ``{"error": ...}`` without fio."""
    if shutil.which("fio") is None:
        return {"error": "fio not installed (apt-get install fio)"}
    os.makedirs(os.path.dirname(files[0]), exist_ok=True)
    try:
        res = subprocess.run(["fio", "--output-format=json", *args], capture_output=True,
                             text=True, check=True)  # fmt: skip
    finally:
        for path in files:
            if os.path.exists(path):
                os.remove(path)
    jobs = json.loads(res.stdout)["jobs"]
    read = sum(job["read"]["bw_bytes"] for job in jobs) / 1e9
    write = sum(job["write"]["bw_bytes"] for job in jobs) / 1e9
    return {"block": block, "depth": depth, "read_gbps": read, "write_gbps": write,
            "mixed_gbps": read + write}  # fmt: skip


def fio_mixed(directory: str, size: str = "2GiB", block: str = "8M", depth: int = 16,
              runtime_s: int = 10) -> dict:  # fmt: skip
    """50/50 random reads and writes at once on one file, O_DIRECT (libaio): the combined
    bandwidth of a mixed load such as an update's, for ``runtime_s`` seconds.

    Returns:
      ``{"read_gbps", "write_gbps", "mixed_gbps"}`` (mixed: read + write), with the request size
      and depth; ``{"error": ...}`` without fio.
    """
    path = os.path.join(directory, "fio-mixed.dat")
    args = [
        "--name=mixed", f"--filename={path}", "--rw=randrw", "--rwmixread=50",
        f"--bs={block}", f"--iodepth={depth}", "--ioengine=libaio", "--direct=1",
        f"--size={size}", "--time_based", f"--runtime={runtime_s}",
    ]  # fmt: skip
    return _fio(args, [path], block, depth)


def fio_copy(directory: str, size: str = "2GiB", block: str = "8M", depth: int = 8,
             runtime_s: int = 10) -> dict:  # fmt: skip
    """A sequential read of an existing file and a sequential write of a new one at once,
    O_DIRECT (libaio), ``depth`` requests in flight each: a checkpoint's access pattern (a save
    reads the tier's blobs and writes new files; a restore the reverse).

    Returns:
      ``{"read_gbps", "write_gbps", "mixed_gbps"}`` (mixed: read + write), with the request size
      and depth; ``{"error": ...}`` without fio.
    """
    source, target = (os.path.join(directory, f"fio-copy-{k}.dat") for k in ("src", "dst"))
    common = [f"--bs={block}", f"--iodepth={depth}", "--ioengine=libaio", "--direct=1",
              "--time_based", f"--runtime={runtime_s}"]  # fmt: skip
    args = [
        "--name=read", f"--filename={source}", "--rw=read", f"--size={size}", *common,
        # larger than the run can write, so every write goes to newly allocated space, reserved
        # first (fio fallocates it, as jax_mlpo does its checkpoint files)
        "--name=write", f"--filename={target}", "--rw=write", "--size=32GiB", *common,
    ]  # fmt: skip
    return _fio(args, [source, target], block, depth)


def filesystem(directory: str) -> str:
    """``df -hT``'s line for the file system holding ``directory`` (for a result's metadata)."""
    res = subprocess.run(["df", "-hT", directory], capture_output=True, text=True)
    lines = res.stdout.splitlines()
    return lines[-1] if lines else f"df -hT {directory} failed: {res.stderr.strip()}"
