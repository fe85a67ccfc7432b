"""The object-store tier against a real S3 protocol server (moto_server on 127.0.0.1).

Each test module run starts one server at a free port, with dummy credentials in the
environment (tensorstore's ``environment`` credentials); each test gets its own bucket.
"""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import tensorstore as ts
from parity import assert_matches_reference, offloaded_adamw, run_offloaded

import jax_mlpo
from jax_mlpo.config import Bandwidth, TierLimits
from jax_mlpo.engine.step_metrics import shared_tier_path
from jax_mlpo.testing import tier_faults
from jax_mlpo.testing.processes import free_port
from jax_mlpo.testing.s3_server import S3Server
from jax_mlpo.tiers.kvstore import LOCK_KEY

SUBGROUP = 131_072


def object_tier(server: S3Server, bucket: str, prefix: str = "run/", **kw) -> jax_mlpo.ObjectTier:
    return jax_mlpo.ObjectTier(
        f"s3://{bucket}/{prefix}", endpoint=server.endpoint, region="us-east-1", **kw
    )


def config(server, tmp_path, kinds: str, dtype, **switches) -> jax_mlpo.OffloadConfig:
    """[file, s3] or [s3]: the host cache holds only the pipeline's buffers."""
    bucket = server.bucket()
    tiers = [object_tier(server, bucket)]
    if kinds == "file+s3":
        tiers.insert(0, jax_mlpo.FileTier(str(tmp_path / "disk")))
    blob = (12 if dtype == jnp.bfloat16 else 8) * SUBGROUP
    return jax_mlpo.OffloadConfig(
        host_cache=(len(tiers) + 2) * blob, tiers=tiers, subgroup_size=SUBGROUP,
        prefetch_depth=1, **switches,
    )  # fmt: skip


def list_values(server, bucket: str, prefix: str) -> dict[str, bytes]:
    kv = ts.KvStore.open(
        {
            "driver": "s3",
            "bucket": bucket,
            "path": prefix,
            "endpoint": server.endpoint,
            "aws_region": "us-east-1",
            "aws_credentials": {"type": "environment"},
        }  # fmt: skip
    ).result()
    return {k.decode(): kv.read(k).result().value for k in kv.list().result()}


# -- parity -------------------------------------------------------------------------------------


@pytest.mark.parametrize("kinds", ["file+s3", "s3"])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("mode", ["eager", "jit"])
def test_parity_with_optax(server, tmp_path, kinds, dtype, mode):
    tx = offloaded_adamw(config(server, tmp_path, kinds, dtype))
    assert_matches_reference(run_offloaded(tx, dtype, mode), dtype)


# -- what is in the bucket ----------------------------------------------------------------------


def test_bucket_holds_the_placements_share(server, tmp_path):
    cfg = config(server, tmp_path, "file+s3", jnp.bfloat16)
    s3 = cfg.tiers[1]
    tx = jax_mlpo.adamw(1e-3, offload=cfg)
    params = {"w": jnp.linspace(-1, 1, 10 * SUBGROUP, dtype=jnp.bfloat16)}
    state = tx.init(params)
    engine = jax_mlpo.engine_of(state)
    on_s3 = [i for i, k in enumerate(engine.tier_of) if k == 1]
    assert on_s3 and len(on_s3) == engine.split.counts[1]
    values = list_values(server, s3.bucket, "run/")
    assert LOCK_KEY in values  # one run per prefix
    blobs = {k: v for k, v in values.items() if k.startswith("state-")}
    assert sorted(blobs) == sorted(f"state-{i}.blob" for i in on_s3)
    trailer = 16
    for value in blobs.values():  # 12 B/param (fp32 master, m, v) for bf16 params
        assert len(value) - trailer == 12 * SUBGROUP
    jax_mlpo.close(state)
    assert LOCK_KEY not in list_values(server, s3.bucket, "run/")  # released


def test_retention_and_alternating_order_hold_on_the_object_tier(server, tmp_path):
    cfg = config(server, tmp_path, "s3", jnp.float32, write_behind=False, replan=False)
    cfg = jax_mlpo.OffloadConfig(**{**cfg.__dict__, "host_cache": 5 * 8 * SUBGROUP})
    tx = jax_mlpo.adamw(1e-3, offload=cfg)
    n = 10
    params = {"w": jnp.linspace(-1, 1, n * SUBGROUP, dtype=jnp.float32)}
    state = tx.init(params)
    engine = jax_mlpo.engine_of(state)
    update = jax.jit(tx.update)
    traces = []
    for step in range(3):
        engine.tiers[0].trace = []
        updates, state = update({"w": jnp.cos(params["w"] * (step + 1))}, state, params)
        params = optax.apply_updates(params, updates)
        jax.block_until_ready(params)
        traces.append(list(engine.tiers[0].trace))
    for step in range(2):
        written = {slot for kind, slot, *_ in traces[step] if kind == "write"}
        kept = set(range(n)) - written  # retained in host memory, not written back
        assert len(kept) == 5
        starts = {slot: t0 for kind, slot, t0, _ in traces[step + 1] if kind == "read"}
        assert set(starts) == written  # the kept ones are never read again
        lo, hi = min(starts), max(starts)
        descending = step % 2 == 0  # the step after an ascending one runs descending
        assert (starts[hi] < starts[lo]) == descending, starts
    jax_mlpo.close(state)


# -- faults -------------------------------------------------------------------------------------


def test_a_flipped_byte_in_a_stored_value_is_detected(server, tmp_path):
    cfg = config(server, tmp_path, "s3", jnp.float32, write_behind=False)
    s3 = cfg.tiers[0]
    tx = jax_mlpo.adamw(1e-3, offload=cfg)
    params = {"w": jnp.linspace(-1, 1, 8 * SUBGROUP, dtype=jnp.float32)}
    state = tx.init(params)
    engine = jax_mlpo.engine_of(state)
    update = jax.jit(tx.update)
    updates, state = update({"w": jnp.ones_like(params["w"])}, state, params)
    jax.block_until_ready(updates)
    victim = next(i for i in range(8) if i not in engine.cache.dirty)  # read by the next step
    kv = ts.KvStore.open(s3.spec()).result()
    value = bytearray(kv.read(f"state-{victim}.blob").result().value)
    value[1234] ^= 0x10
    kv.write(f"state-{victim}.blob", bytes(value)).result()
    with (
        pytest.raises(
            jax_mlpo.CorruptBlobError, match=rf"state-{victim}.blob: the value fails its crc32c"
        ),
        jax_mlpo.errors.typed(),
    ):
        jax.block_until_ready(update({"w": jnp.ones_like(params["w"])}, state, params))
    assert engine.failed
    jax_mlpo.close(state)


def test_a_missing_bucket_fails_at_init_naming_it(server, tmp_path):
    tier = object_tier(server, "no-such-bucket-here")
    with pytest.raises(jax_mlpo.ConfigError, match="bucket 'no-such-bucket-here' does not exist"):
        jax_mlpo.OffloadConfig(host_cache="1MiB", tiers=[tier]).validate()
    with pytest.raises(jax_mlpo.ConfigError, match="bucket 'b' is not a valid S3 bucket name"):
        object_tier(server, "b").validate()


def test_an_unreachable_endpoint_fails_at_init_naming_it(server):
    endpoint = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    tier = jax_mlpo.ObjectTier("s3://bucket/p/", endpoint=endpoint, region="us-east-1",
                               request_retries=1)  # fmt: skip
    with pytest.raises(jax_mlpo.ConfigError, match=f"the endpoint {endpoint} is unreachable"):
        jax_mlpo.adamw(1e-3, offload=jax_mlpo.OffloadConfig(host_cache="1MiB", tiers=[tier]))


def test_missing_credentials_fail_at_init(server, monkeypatch):
    tier = object_tier(server, server.bucket())
    monkeypatch.delenv("AWS_ACCESS_KEY_ID")
    monkeypatch.delenv("AWS_SECRET_ACCESS_KEY")
    with pytest.raises(jax_mlpo.ConfigError, match="no credentials were found.*AWS_ACCESS_KEY_ID"):
        tier.validate()


def test_wrong_credentials_fail_at_init(server):
    """A server that checks access keys (moto's own check) refuses the dummy ones."""
    strict = S3Server(check_credentials=True).start()
    try:
        tier = object_tier(strict, strict.bucket(), request_retries=0)
        with pytest.raises(jax_mlpo.ConfigError, match="was refused.*InvalidAccessKeyId"):
            jax_mlpo.adamw(1e-3, offload=jax_mlpo.OffloadConfig(host_cache="1MiB", tiers=[tier]))
    finally:
        strict.kill()


def test_a_second_run_on_the_same_prefix_is_refused(server, tmp_path):
    """Another run's lock object on the prefix refuses the init, naming its owner; a second
    init in this process replaces the first (jax_mlpo.transforms.runtime.Runtime.take_place)."""
    cfg = config(server, tmp_path, "s3", jnp.float32)
    params = {"w": jnp.zeros(4 * SUBGROUP, jnp.float32)}
    state = jax_mlpo.adamw(1e-3, offload=cfg).init(params)
    again = jax_mlpo.adamw(1e-3, offload=cfg).init(params)
    with pytest.raises(jax_mlpo.NoEngineError, match="was replaced: a later tx.init"):
        jax_mlpo.engine_of(state)
    jax_mlpo.close(again)
    kv = ts.KvStore.open(cfg.tiers[0].spec()).result()
    owner = {"pid": 424242, "host": "elsewhere", "since": 0.0}
    kv.write(LOCK_KEY, json.dumps(owner).encode()).result()  # a run on another machine
    with pytest.raises(
        jax_mlpo.TierInUseError,
        match=f"tier {cfg.tiers[0].path!r} is in use by pid 424242 on elsewhere",
    ):
        jax_mlpo.adamw(1e-3, offload=cfg).init(params)  # fmt: skip


def test_server_lost_mid_update_fails_clearly_and_resumes_from_the_checkpoint(server, tmp_path):
    """The server dies during an update's reads: the update fails naming the endpoint, nothing
    is applied, and a new optimizer on a new server restored from the last checkpoint goes on
    exactly as a run that was never interrupted."""
    lost = S3Server().start()
    try:
        # An even split without re-planning: the update reads subgroups from the object tier
        # whatever the start-up probe measures (with a measured split, a loaded machine could
        # put only retained subgroups there, and the update would read none of them).
        cfg = config(lost, tmp_path, "file+s3", jnp.float32, write_behind=False,
                     placement="even", replan=False)  # fmt: skip
        tx = jax_mlpo.adamw(1e-3, weight_decay=0.1, offload=cfg)
        params = {"w": jnp.linspace(-1, 1, 8 * SUBGROUP, dtype=jnp.float32)}
        grads = [{"w": jnp.cos(params["w"] * (k + 1))} for k in range(4)]
        state = tx.init(params)
        update = jax.jit(tx.update)
        for k in range(2):
            updates, state = update(grads[k], state, params)
            params = optax.apply_updates(params, updates)
        mngr = jax_mlpo.checkpoint.manager(str(tmp_path / "ckpt"), max_to_keep=1)
        jax_mlpo.checkpoint.save(mngr, 2, params, state, {"step": 2})
        mngr.wait_until_finished()
        with tier_faults(state, tier=1) as plan:  # the object tier's first read loses it
            plan.on("read", lost.kill)
            with (
                pytest.raises(
                    jax_mlpo.TierIOError, match=f"the endpoint {lost.endpoint} is unreachable"
                ),
                jax_mlpo.errors.typed(),
            ):
                jax.block_until_ready(update(grads[2], state, params))
        assert plan.outcomes("read")[0] == "called"
        assert jax_mlpo.engine_of(state).failed
        jax_mlpo.close(state)
    finally:
        lost.kill()

    # resume: the same tiers on a new (empty) server, state from the checkpoint
    cfg2 = config(server, tmp_path / "again", "file+s3", jnp.float32, write_behind=False)
    (tmp_path / "again").mkdir(exist_ok=True)
    tx2 = jax_mlpo.adamw(1e-3, weight_decay=0.1, offload=cfg2)
    restored = jax_mlpo.checkpoint.restore(mngr, params, tx2.init(params))
    params2, state2 = restored.params, restored.opt_state
    update2 = jax.jit(tx2.update)
    for k in (2, 3):
        updates, state2 = update2(grads[k], state2, params2)
        params2 = optax.apply_updates(params2, updates)

    # the uninterrupted run, on file tiers only
    ref_cfg = jax_mlpo.OffloadConfig(
        host_cache=cfg.host_cache, tiers=[jax_mlpo.FileTier(str(tmp_path / "ref"))],
        subgroup_size=SUBGROUP, prefetch_depth=1,
    )  # fmt: skip
    ref_tx = jax_mlpo.adamw(1e-3, weight_decay=0.1, offload=ref_cfg)
    ref_params = {"w": jnp.linspace(-1, 1, 8 * SUBGROUP, dtype=jnp.float32)}
    ref_state = ref_tx.init(ref_params)
    ref_update = jax.jit(ref_tx.update)
    for k in range(4):
        updates, ref_state = ref_update(grads[k], ref_state, ref_params)
        ref_params = optax.apply_updates(ref_params, updates)
    np.testing.assert_array_equal(np.asarray(params2["w"]), np.asarray(ref_params["w"]))
    jax_mlpo.close(state2)
    jax_mlpo.close(ref_state)


# -- configuration -------------------------------------------------------------------------------


def test_object_tiers_from_yaml_dicts_and_urls():
    cfg = jax_mlpo.OffloadConfig.from_dict(
        {
            "host_cache": "64MiB",
            "tiers": [
                "/tmp/x",
                "s3://bucket/a/",
                {"url": "s3://bucket/b", "endpoint": "http://h:1", "region": "r",
                 "request_concurrency": 4},
                {"kvstore": {"driver": "s3", "bucket": "c", "path": "p"}},
            ],
        }
    )  # fmt: skip
    kinds = [type(t).__name__ for t in cfg.tiers]
    assert kinds == ["FileTier", "ObjectTier", "ObjectTier", "ObjectTier"]
    assert [t.path for t in cfg.tiers[1:]] == ["s3://bucket/a/", "s3://bucket/b/", "s3://c/p/"]
    spec = cfg.tiers[2].spec()
    assert spec["endpoint"] == "http://h:1" and spec["aws_region"] == "r"
    assert cfg.tiers[2].context()["s3_request_concurrency"] == {"limit": 4}
    assert cfg.tiers[1].for_process(3).path == "s3://bucket/a/proc3/"
    # a process's figures are summed under the tier as configured
    assert shared_tier_path(cfg.tiers[1].for_process(3).path) == cfg.tiers[1].path


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(), "give exactly one of url"),
        (dict(url="http://x/y"), "must look like 's3://bucket/prefix/'"),
        (dict(url="s3:///p"), "names no bucket"),
        (dict(url="s3://b/p", credentials="password"), "credentials='password'"),
        (dict(url="s3://b/p", limits=dict(max_concurrency=2)), "ObjectTier.limits=.* e.g. "),
        (dict(url="s3://b/p", bandwidth="1GB"), "must be a Bandwidth, e.g. bandwidth=Bandwidth"),
        (dict(kvstore={"bucket": "b"}), "must be a tensorstore kvstore spec"),
        (dict(kvstore={"driver": "s3"}), "and a 'bucket' for s3"),
    ],
)
def test_bad_object_tier_configs_are_refused(kwargs, match):
    with pytest.raises(jax_mlpo.ConfigError, match=match):
        jax_mlpo.ObjectTier(**kwargs)


def test_spec_is_json():
    tier = jax_mlpo.ObjectTier("s3://b/p", endpoint="http://h:1", credentials="anonymous")
    assert json.loads(json.dumps(tier.spec()))["aws_credentials"] == {"type": "anonymous"}


def test_replanning_moves_subgroups_off_an_object_tier_that_slows_down(server, tmp_path):
    """As for two file tiers (test_policies): the object tier becomes 40x slower than its
    given bandwidth; after 3 steps off the model its subgroups migrate on their write-backs,
    and the blobs they left are never read again (their new homes are).

    40x, not 10x: the disk tier's own first steps run up to ~5x its model (files created and
    preallocated, a loaded CI machine), and at 10x the rescaled split then left 4 of 6
    subgroups on the object tier (seen in CI)."""
    given = dict(limits=TierLimits(bandwidth_cap="40MB"), bandwidth=Bandwidth("40MB", "40MB"))
    tiers = [
        jax_mlpo.FileTier(str(tmp_path / "disk"), sync=False, **given),
        object_tier(server, server.bucket(), **given),
    ]
    n, sub = 12, 4096
    config = jax_mlpo.OffloadConfig(
        host_cache=4 * 8 * sub, tiers=tiers, subgroup_size=sub, prefetch_depth=1, retain=False,
        write_behind=False,
    )  # fmt: skip
    params = {"w": jnp.linspace(-1, 1, n * sub, dtype=jnp.float32)}
    tx = jax_mlpo.adamw(1e-3, offload=config)
    state = tx.init(params)
    engine = jax_mlpo.engine_of(state)
    assert engine.tier_of.count(0) == engine.tier_of.count(1) == 6
    engine.tiers[1].set_bandwidth_cap(1e6)
    update = jax.jit(tx.update)
    for _ in range(6):
        updates, state = update({"w": jnp.full(n * sub, 0.1)}, state, params)
        jax.block_until_ready(updates)
    assert engine.tier_of.count(1) <= 3, engine.tier_of
    assert engine.bandwidth[0][0] / engine.bandwidth[1][0] > 2
    jax_mlpo.close(state)


def test_two_processes_each_use_their_own_prefix(server, tmp_path, monkeypatch):
    """A data-parallel run on 2 processes with a disk tier and an object tier gives the
    1-process run's params (test_distributed's worker), each process under its own prefix."""
    from processes import run_data_parallel as _run

    bucket = server.bucket()
    monkeypatch.setenv("JAX_MLPO_TEST_S3_ENDPOINT", server.endpoint)
    monkeypatch.setenv("JAX_MLPO_TEST_S3_BUCKET", bucket)
    ref_params, _, _ = _run(1, tmp_path / "one", mode="s3")
    params, infos, _ = _run(2, tmp_path / "two", mode="s3")
    for name, ref in ref_params.items():
        np.testing.assert_allclose(params[name], ref, rtol=0, atol=1e-6, err_msg=name)
    assert [info["tiers"][1] for info in infos] == [
        f"s3://{bucket}/dist/proc0/",
        f"s3://{bucket}/dist/proc1/",
    ]
    keys = list_values(server, bucket, "dist/")
    for k in range(2):  # each process's blobs under its prefix; every lock released
        assert any(key.startswith(f"proc{k}/state-") for key in keys), sorted(keys)
    assert not any(key.endswith(LOCK_KEY) for key in keys)
