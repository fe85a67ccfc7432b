"""OffloadConfig / FileTier / ObjectTier and their TierLimits and Bandwidth: size parsing, the
string options' allowed values, validation messages, dict and YAML loading (nested and flat
tier settings), and the checks that run when the optimizer is built (construction) and
initialised (tx.init)."""

from __future__ import annotations

import dataclasses
import re
import stat
import typing
import warnings

import jax.numpy as jnp
import pytest
import yaml

import jax_mlpo
from jax_mlpo import ConfigError, FileTier, ObjectTier, OffloadConfig, parse_size
from jax_mlpo.config import (
    Bandwidth,
    IoEngine,
    IoMode,
    IoSubmit,
    Order,
    OverlapOrder,
    Placement,
    RetainPolicy,
    TierLimits,
)
from jax_mlpo.tiers.lock import TierLock
from jax_mlpo.tiers.object_tier import Credentials
from jax_mlpo.tiers.settings import FLAT_KEYS, NodePermits

# -- parse_size ---------------------------------------------------------------------------------

SIZES = [
    ("8GiB", 8 * 2**30),
    ("600MB", 600 * 10**6),
    ("1.5GiB", 3 * 2**29),
    ("600MB/s", 600 * 10**6),
    ("600mb/s", 600 * 10**6),
    ("  2 KiB ", 2048),
    ("512", 512),
    ("1e3", 1000),
    ("3TB", 3 * 10**12),
    ("1TiB", 2**40),
    (4096, 4096),
    (0, 0),
    (1.5e9, 1_500_000_000),
]


@pytest.mark.parametrize("value,expected", SIZES, ids=[repr(v) for v, _ in SIZES])
def test_parse_size(value, expected):
    got = parse_size(value, "host_cache")
    assert got == expected
    assert type(got) is int


BAD_SIZES = ["", "GiB", "8XB", "8 GB GB", "-1GB", "8GiB/min", "1,000", "eight", None, [8], b"8GB"]


@pytest.mark.parametrize("value", BAD_SIZES, ids=[repr(v) for v in BAD_SIZES])
def test_parse_size_rejects_non_sizes(value):
    with pytest.raises(ConfigError, match=re.escape(f"host_cache={value!r} is not a size")):
        parse_size(value, "host_cache")


@pytest.mark.parametrize("value", [True, False], ids=["True", "False"])
def test_parse_size_rejects_bools(value):
    # bool is an int subclass: True must not silently become 1 byte.
    with pytest.raises(ConfigError, match=f"bandwidth_cap={value} is not a size"):
        parse_size(value, "bandwidth_cap")


@pytest.mark.parametrize(
    "value", [float("inf"), float("nan"), "1e999GB"], ids=["inf", "nan", "huge"]
)
def test_parse_size_rejects_non_finite(value):
    with pytest.raises(ConfigError, match="host_cache="):
        parse_size(value, "host_cache")


# -- field validation ---------------------------------------------------------------------------


def _ids(cases):
    return [c[0] for c in cases]


def _args(cases):
    return [c[1:] for c in cases]


CONFIG_ERRORS = [
    ("subgroup_size-zero", dict(subgroup_size=0), r"subgroup_size=0 must be positive"),
    ("subgroup_size-negative", dict(subgroup_size=-5), r"subgroup_size=-5 must be positive"),
    ("subgroup_size-float", dict(subgroup_size=1.5), r"subgroup_size=1\.5 must be an int"),
    ("subgroup_size-bool", dict(subgroup_size=True), r"subgroup_size=True must be an int"),
    ("prefetch_depth-negative", dict(prefetch_depth=-1), r"prefetch_depth=-1 must be an int >= 0"),
    ("prefetch_depth-float", dict(prefetch_depth=1.0), r"prefetch_depth=1\.0 must be an int >= 0"),
    ("host_cache-negative", dict(host_cache=-1), r"host_cache=-1 must be >= 0 bytes"),
    ("host_cache-garbage", dict(host_cache="lots"), r"host_cache='lots' is not a size"),
    ("tiers-single", dict(tiers=FileTier("/tmp/x")), r"tiers=.* must be a list of FileTier"),
    ("tiers-int", dict(tiers=3), r"tiers=3 must be a list of FileTier"),
    ("tiers-bad-item", dict(tiers=[3]), r"tiers: 3 is not a FileTier, an ObjectTier, a path or"),
    ("placement", dict(placement="fast"), r"placement='fast': must be one of \('measured', "),
    ("order", dict(order="random"), r"order='random': must be one of \('alternate', 'ascending'\)"),
    ("retain_policy", dict(retain_policy="all"), r"retain_policy='all': must be one of"),
    ("retain-not-bool", dict(retain=1), r"retain=1 must be true or false"),
    ("replan-not-bool", dict(replan="yes"), r"replan='yes' must be true or false"),
]


@pytest.mark.parametrize("kwargs,message", _args(CONFIG_ERRORS), ids=_ids(CONFIG_ERRORS))
def test_offload_config_errors(kwargs, message):
    with pytest.raises(ConfigError, match=message):
        OffloadConfig(**kwargs)


TIER_ERRORS = [
    ("io_mode", dict(io_mode="bogus"), r"FileTier\.io_mode='bogus' for /t: must be one of"),
    ("io_mode-memmap-posix", dict(io_mode="memmap"), r"io_mode='memmap' .*io_engine='posix'"),
    ("io_engine", dict(io_engine="aio"), r"FileTier\.io_engine='aio' for /t: must be one of"),
    ("queue_depth-zero", dict(queue_depth=0), r"FileTier\.queue_depth=0 for /t: .*>= 1"),
    ("io_submit", dict(io_submit="uring"), r"FileTier\.io_submit='uring' for /t: must be one"),
    ("limits-dict", dict(limits={"max_concurrency": 1}), r"limits=TierLimits\(max_concurrency"),
    ("bandwidth-str", dict(bandwidth="2GB"), r"FileTier\.bandwidth='2GB' for /t: must be a Band"),
]


@pytest.mark.parametrize("kwargs,message", _args(TIER_ERRORS), ids=_ids(TIER_ERRORS))
def test_file_tier_errors(kwargs, message):
    with pytest.raises(ConfigError, match=message):
        FileTier("/t", **kwargs)


SETTINGS_ERRORS = [
    ("concurrency-zero", TierLimits, dict(max_concurrency=0), r"max_concurrency=0: .*>= 1"),
    ("concurrency-float", TierLimits, dict(max_concurrency=2.0), r"max_concurrency=2\.0: "),
    ("concurrency-bool", TierLimits, dict(max_concurrency=True), r"max_concurrency=True: "),
    ("cap-zero", TierLimits, dict(bandwidth_cap=0), r"bandwidth_cap=0: must be positive"),
    ("node-cap-0MB", TierLimits, dict(node_bandwidth_cap="0MB"), r"node_bandwidth_cap='0MB': "),
    ("cap-0MB/s", TierLimits, dict(bandwidth_cap="0MB/s"), r"bandwidth_cap='0MB/s': must be"),
    ("cap-garbage", TierLimits, dict(bandwidth_cap="fast"), r"bandwidth_cap='fast' is not a"),
    ("node-concurrency-0", TierLimits, dict(node_max_concurrency=0), r"node_max_concurrency=0"),
    ("read-zero", Bandwidth, dict(read=0), r"read=0: must be positive"),
    ("write-garbage", Bandwidth, dict(write="x"), r"write='x' is not a size"),
]


@pytest.mark.parametrize("cls,kwargs,message", _args(SETTINGS_ERRORS), ids=_ids(SETTINGS_ERRORS))
def test_tier_settings_errors(cls, kwargs, message):
    with pytest.raises(ConfigError, match=rf"^{cls.__name__}\.{message}"):
        cls(**kwargs)


def test_tier_settings_parse_rates():
    limits = TierLimits(bandwidth_cap="600MB/s", node_bandwidth_cap="1GB")
    assert (limits.bandwidth_cap, limits.node_bandwidth_cap) == (600_000_000, 10**9)
    assert Bandwidth("2GB", 5e8) == Bandwidth(read=2 * 10**9, write=500_000_000)


# every string option: (how to build it with a value, its Literal type)
STRING_OPTIONS = [
    ("io_engine", lambda v: FileTier("/t", io_engine=v), IoEngine),
    ("io_mode", lambda v: FileTier("/t", io_engine="tensorstore", io_mode=v), IoMode),
    ("io_submit", lambda v: FileTier("/t", io_submit=v), IoSubmit),
    ("node_permits", lambda v: TierLimits(node_permits=v), NodePermits),
    ("credentials", lambda v: ObjectTier("s3://b/p", credentials=v), Credentials),
    ("placement", lambda v: OffloadConfig(placement=v), Placement),
    ("order", lambda v: OffloadConfig(order=v), Order),
    ("overlap_order", lambda v: OffloadConfig(overlap_order=v), OverlapOrder),
    ("retain_policy", lambda v: OffloadConfig(retain_policy=v), RetainPolicy),
]


@pytest.mark.parametrize("name,build,choices", STRING_OPTIONS, ids=_ids(STRING_OPTIONS))
def test_string_options_take_exactly_their_literal_values(name, build, choices):
    allowed = typing.get_args(choices)
    assert len(allowed) >= 2
    for value in allowed:
        assert getattr(build(value), name) == value
    for wrong in ("bogus", allowed[0].upper(), 1):
        with pytest.raises(ConfigError, match=rf"{name}={wrong!r}.*: must be one of") as e:
            build(wrong)
        assert str(allowed) in str(e.value)  # the error lists every allowed value


def test_object_tier_has_only_its_own_fields():
    tier = ObjectTier("s3://b/p")
    for name in ("io_engine", "io_mode", "sync", "effective_io_mode"):
        assert not hasattr(tier, name), name
    assert tier.limits == TierLimits() and tier.bandwidth == Bandwidth()


def test_io_mode_none_means_the_engines_own():
    posix = FileTier("/t")
    assert posix.io_mode is None and posix.effective_io_mode == "direct"
    # nothing was written into the field: another engine gets its own default
    tensorstore = dataclasses.replace(posix, io_engine="tensorstore")
    assert tensorstore.io_mode is None and tensorstore.effective_io_mode == "default"
    assert FileTier("/t", io_mode="default").effective_io_mode == "default"
    memmap = FileTier("/t", io_engine="tensorstore", io_mode="memmap")
    assert memmap.effective_io_mode == "memmap"


@pytest.mark.parametrize("cls", [FileTier, ObjectTier])
def test_a_parts_limits_share_the_node_permits_of_the_whole(cls):
    tier = cls("s3://b/run/" if cls is ObjectTier else "/t", limits=TierLimits(max_concurrency=2))
    part = tier.for_process(1)
    assert part.path.rstrip("/").endswith("proc1") and part.path != tier.path
    assert part.limits == TierLimits(max_concurrency=2, permits_key=tier.path)
    keyed = dataclasses.replace(tier, limits=TierLimits(permits_key="device0"))
    assert keyed.for_part("muon").limits.permits_key == "device0"


@pytest.mark.parametrize("path", ["", None, 7], ids=["empty", "None", "int"])
def test_file_tier_path_must_be_a_path(path):
    with pytest.raises(ConfigError, match="must be a non-empty directory path"):
        FileTier(path)


def test_file_tier_normalises_path_and_chunk(tmp_path):
    tier = FileTier(tmp_path / "t", chunk_bytes="1MiB")
    assert tier.path == str(tmp_path / "t") and type(tier.path) is str
    assert tier.chunk_bytes == 2**20


def test_tiers_as_a_single_string_is_refused(tmp_path):
    with pytest.raises(ConfigError, match="must be a list"):
        OffloadConfig(tiers=str(tmp_path / "tier"))


SAME_DIR = [
    ("identical", lambda d: str(d / "a")),
    ("trailing-slash", lambda d: str(d / "a") + "/"),
    ("dotdot", lambda d: str(d / "b" / ".." / "a")),
    ("dot", lambda d: str(d / "." / "a")),
    ("symlink", lambda d: str(d / "link")),
]


@pytest.mark.parametrize("spell", [s for _, s in SAME_DIR], ids=[n for n, _ in SAME_DIR])
def test_duplicate_tier_paths(spell, tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "a")
    other = spell(tmp_path)
    with pytest.raises(ConfigError, match="are the same place; give each tier its own directory"):
        OffloadConfig(tiers=[FileTier(str(tmp_path / "a")), FileTier(other)])
    OffloadConfig(tiers=[str(tmp_path / "a"), str(tmp_path / "b")])  # distinct ones are fine


# -- validation against the file system ---------------------------------------------------------


def test_validate_creates_directory_0700_without_leftovers(tmp_path):
    path = tmp_path / "tier"
    OffloadConfig(tiers=[str(path)]).validate()
    assert path.is_dir()
    assert stat.S_IMODE(path.stat().st_mode) == 0o700
    assert list(path.iterdir()) == []  # the probe file is removed


def test_validate_parent_missing(tmp_path):
    path = tmp_path / "missing" / "tier"
    with pytest.raises(
        ConfigError,
        match=re.escape(f"parent directory {str(tmp_path / 'missing')!r} does not exist"),
    ):
        FileTier(str(path)).validate()
    assert not (tmp_path / "missing").exists()


def test_validate_path_is_a_file(tmp_path):
    path = tmp_path / "file"
    path.write_text("x")
    message = re.escape(f"FileTier.path={str(path)!r} exists and is not a directory")
    with pytest.raises(ConfigError, match=message):
        OffloadConfig(tiers=[str(path)]).validate()


def test_validate_not_writable():
    # Running as root, chmod does not stop writes; /proc refuses new directories to anyone.
    path = "/proc/jax_mlpo_tier"
    with pytest.raises(ConfigError, match=re.escape(f"FileTier.path={path!r} is not writable")):
        FileTier(path).validate()


def test_validate_checks_every_tier(tmp_path):
    ok = tmp_path / "ok"
    bad = tmp_path / "nope" / "tier"
    with pytest.raises(ConfigError, match="does not exist"):
        OffloadConfig(tiers=[str(ok), str(bad)]).validate()


# -- from_dict / from_yaml ----------------------------------------------------------------------


def test_from_dict_with_nested_tiers(tmp_path):
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    config = OffloadConfig.from_dict(
        {
            "host_cache": "2GiB",
            "tiers": [
                {"path": a, "max_concurrency": 2, "bandwidth_cap": "600MB/s", "io_mode": "direct"},
                b,
            ],
            "subgroup_size": 1000,
            "prefetch_depth": 1,
        }
    )
    limits = TierLimits(max_concurrency=2, bandwidth_cap=600_000_000)
    assert config == OffloadConfig(
        host_cache=2 * 2**30,
        tiers=(FileTier(a, limits, io_mode="direct"), FileTier(b)),
        subgroup_size=1000,
        prefetch_depth=1,
    )
    assert config.tiers[1].limits.max_concurrency == 4 and config.tiers[1].sync is False


FLAT_AND_NESTED = [
    (
        "limits",
        {"max_concurrency": 1, "node_max_concurrency": 1, "bandwidth_cap": "1GB"},
        {"limits": {"max_concurrency": 1, "node_max_concurrency": 1, "bandwidth_cap": "1GB"}},
        dict(limits=TierLimits(max_concurrency=1, node_max_concurrency=1, bandwidth_cap=10**9)),
    ),
    (
        "bandwidth",
        {"read_bandwidth": "2GB", "write_bandwidth": "1GB"},
        {"bandwidth": {"read": "2GB", "write": "1GB"}},
        dict(bandwidth=Bandwidth(read=2 * 10**9, write=10**9)),
    ),
    (
        "mixed",
        {"node_permits": "direction", "read_bandwidth": "2GB"},
        {"limits": {"node_permits": "direction"}, "bandwidth": {"read": "2GB"}},
        dict(limits=TierLimits(node_permits="direction"), bandwidth=Bandwidth(read="2GB")),
    ),
]


@pytest.mark.parametrize("flat,nested,fields", _args(FLAT_AND_NESTED), ids=_ids(FLAT_AND_NESTED))
def test_tier_settings_load_flat_or_nested(flat, nested, fields):
    for url, cls in (("/lustre/run", FileTier), ("s3://b/run/", ObjectTier)):
        key = "url" if cls is ObjectTier else "path"
        expected = cls(url, **fields)
        for spelling in (flat, nested):
            config = OffloadConfig.from_dict({"tiers": [{key: url, **spelling}]})
            assert config.tiers == (expected,)


@pytest.mark.parametrize("flat,nested,fields", _args(FLAT_AND_NESTED), ids=_ids(FLAT_AND_NESTED))
def test_tier_constructors_take_settings_flat_or_nested(flat, nested, fields):
    for url, cls in (("/lustre/run", FileTier), ("s3://b/run/", ObjectTier)):
        assert cls(url, **flat) == cls(url, **fields)


def test_a_setting_given_flat_and_nested_to_a_constructor_is_refused():
    with pytest.raises(ConfigError, match=r"\['max_concurrency'\] given both in limits and flat"):
        FileTier("/x", max_concurrency=2, limits=TierLimits(max_concurrency=3))


def test_launch_scripts_tier_loads():
    # experiments/launch/rank.sh's shared file system tier, through --set offload.tiers=[...]
    tier = yaml.safe_load("{path: /pfs/tier, max_concurrency: 1, node_max_concurrency: 1}")
    (got,) = OffloadConfig.from_dict({"tiers": [tier]}).tiers
    assert got == FileTier("/pfs/tier", TierLimits(max_concurrency=1, node_max_concurrency=1))


TIER_MAPPING_ERRORS = [
    (
        "flat-and-nested",
        {"max_concurrency": 1, "limits": {"max_concurrency": 2}},
        r"tiers\[\] \(/x\): \['max_concurrency'\] given both in limits and flat",
    ),
    (
        "flat-beside-built",
        {"read_bandwidth": "1GB", "bandwidth": Bandwidth()},
        r"\['read'\] given both in bandwidth and flat",
    ),
    (
        "nested-unknown",
        {"limits": {"concurrency": 1}},
        r"tiers\[\] \(/x\)\.limits: unknown key\(s\) \['concurrency'\]; valid keys are \['band",
    ),
    ("nested-not-a-mapping", {"bandwidth": "1GB"}, r"bandwidth='1GB' must be a mapping of Band"),
    ("flat-value", {"max_concurrency": 0}, r"tiers\[\] \(/x\): TierLimits\.max_concurrency=0:"),
    ("nested-value", {"bandwidth": {"write": 0}}, r"tiers\[\] \(/x\): Bandwidth\.write=0:"),
]


@pytest.mark.parametrize("tier,message", _args(TIER_MAPPING_ERRORS), ids=_ids(TIER_MAPPING_ERRORS))
def test_tier_mapping_errors(tier, message):
    with pytest.raises(ConfigError, match=message):
        OffloadConfig.from_dict({"tiers": [{"path": "/x", **tier}]})


def test_from_dict_defaults():
    assert OffloadConfig.from_dict({}) == OffloadConfig()
    assert OffloadConfig().host_cache == 2**30


def valid_keys(cls) -> str:
    return str(sorted(f.name for f in dataclasses.fields(cls)))


def test_from_dict_unknown_key():
    valid = valid_keys(OffloadConfig)
    assert "'host_cache', " in valid and "'tiers'" in valid
    with pytest.raises(
        ConfigError, match=re.escape(f"offload: unknown key(s) ['tier']; valid keys are {valid}")
    ):
        OffloadConfig.from_dict({"host_cache": "1GiB", "tier": ["/tmp/x"]})


def test_from_dict_unknown_tier_key():
    # the valid keys: the tier's fields, and the settings a mapping may give flat
    valid = sorted({f.name for f in dataclasses.fields(FileTier)} | set(FLAT_KEYS))
    assert {"limits", "bandwidth", "path", "max_concurrency", "read_bandwidth"} <= set(valid)
    message = f"tiers[] (/tmp/x): unknown key(s) ['speed']; valid keys are {valid}"
    with pytest.raises(ConfigError, match=re.escape(message)):
        OffloadConfig.from_dict({"tiers": [{"path": "/tmp/x", "speed": "fast"}]})


def test_from_dict_nested_value_error():
    with pytest.raises(ConfigError, match=r"FileTier\.io_submit='uring' for /tmp/x"):
        OffloadConfig.from_dict({"tiers": [{"path": "/tmp/x", "io_submit": "uring"}]})


@pytest.mark.parametrize("data", [["host_cache"], "1GiB", 3], ids=["list", "str", "int"])
def test_from_dict_not_a_mapping(data):
    with pytest.raises(ConfigError, match="offload config must be a mapping"):
        OffloadConfig.from_dict(data)


def test_from_yaml_round_trip(tmp_path):
    a, b = str(tmp_path / "nvme"), str(tmp_path / "pfs")
    expected = OffloadConfig(
        host_cache="3GiB",
        tiers=[
            FileTier(a, limits=TierLimits(bandwidth_cap="2GB/s")),
            FileTier(b, limits=TierLimits(max_concurrency=1), sync=False),
        ],
        subgroup_size=12_345,
        prefetch_depth=3,
    )
    text = (
        "host_cache: 3GiB\n"
        "subgroup_size: 12345\n"
        "prefetch_depth: 3\n"
        "tiers:\n"
        f"  - {{path: {a}, bandwidth_cap: 2GB/s}}\n"
        f"  - path: {b}\n"
        "    max_concurrency: 1\n"
        "    sync: false\n"
    )
    (tmp_path / "offload.yaml").write_text(text)
    assert OffloadConfig.from_yaml(tmp_path / "offload.yaml") == expected
    # and back: the config's own fields, dumped and reloaded, give the same config
    dumped = {
        "host_cache": expected.host_cache,
        "tiers": [dataclasses.asdict(t) for t in expected.tiers],
        "subgroup_size": expected.subgroup_size,
        "prefetch_depth": expected.prefetch_depth,
    }
    (tmp_path / "dumped.yaml").write_text(yaml.safe_dump(dumped))
    assert OffloadConfig.from_yaml(str(tmp_path / "dumped.yaml")) == expected


def test_from_yaml_empty_file_gives_defaults(tmp_path):
    (tmp_path / "empty.yaml").write_text("")
    assert OffloadConfig.from_yaml(tmp_path / "empty.yaml") == OffloadConfig()


# -- checks when the optimizer is built and initialised ----------------------------------------


def test_adamw_rejects_a_bad_tier_path_at_construction(tmp_path):
    config = OffloadConfig(tiers=[str(tmp_path / "missing" / "tier")])  # no file system check yet
    with pytest.raises(ConfigError, match="parent directory .* does not exist"):
        jax_mlpo.adamw(1e-3, offload=config)


def test_adamw_rejects_a_non_config():
    with pytest.raises(TypeError, match="offload must be a jax_mlpo.OffloadConfig, got dict"):
        jax_mlpo.adamw(1e-3, offload={"host_cache": "1GiB"})


N_PARAMS = 1000
SUBGROUP = 100  # 10 subgroups, so the pipeline is smaller than the state


PIPELINES = [
    # dtype, prefetch_depth, tiers, bytes per element of state
    (jnp.float32, 2, 1, 8),
    (jnp.float32, 0, 1, 8),
    (jnp.bfloat16, 3, 1, 12),
    (jnp.float32, 1, 2, 8),
]


@pytest.mark.parametrize(
    "dtype,depth,num_tiers,per_elem",
    PIPELINES,
    ids=["fp32-depth2", "fp32-depth0", "bf16-depth3", "fp32-depth1-2tiers"],
)
def test_host_cache_too_small_for_pipeline(dtype, depth, num_tiers, per_elem, tmp_path):
    # prefetch_depth reads in flight per tier, plus the subgroup computing and one writing back
    minimum = (depth * num_tiers + 2) * per_elem * SUBGROUP
    params = {"w": jnp.zeros((N_PARAMS,), dtype)}
    tiers = [str(tmp_path / f"tier{k}") for k in range(num_tiers)]

    def make(cache):
        return jax_mlpo.adamw(
            1e-3,
            offload=OffloadConfig(
                host_cache=cache,
                tiers=tiers,
                subgroup_size=SUBGROUP,
                prefetch_depth=depth,
                placement="even",  # no bandwidth probe
            ),
        )

    tx = make(minimum - 1)  # constructing is fine: the layout is only known at init
    message = rf"host_cache={minimum - 1} bytes .*pipeline.*at least {minimum}\b"
    with pytest.raises(ConfigError, match=message):
        tx.init(params)
    for tier in tiers:
        TierLock(tier).release()  # the failed init left the tiers unlocked
    state = make(minimum).init(params)  # the minimum itself works
    assert len(jax_mlpo.engine_of(state).tiers) == num_tiers
    jax_mlpo.close(state)


def test_state_bigger_than_cache_without_tiers():
    state_bytes = 8 * N_PARAMS
    params = {"w": jnp.zeros((N_PARAMS,), jnp.float32)}
    config = OffloadConfig(host_cache=state_bytes - 1, subgroup_size=SUBGROUP)
    tx = jax_mlpo.adamw(1e-3, offload=config)
    with pytest.raises(
        ConfigError,
        match=rf"host_cache={state_bytes - 1} bytes cannot hold the optimizer state "
        rf"\({state_bytes} bytes\) and no tiers are configured.*at least {state_bytes}",
    ):
        tx.init(params)
    config = OffloadConfig(host_cache=state_bytes, subgroup_size=SUBGROUP)
    tx = jax_mlpo.adamw(1e-3, offload=config)
    state = tx.init(params)
    engine = jax_mlpo.engine_of(state)
    assert engine.tiers == []
    _, state = tx.update(params, state, params)
    metrics = engine.metrics[-1]
    assert metrics.cache_hits == metrics.subgroups == N_PARAMS // SUBGROUP
    jax_mlpo.close(state)


def test_pipeline_error_names_the_true_minimum(tmp_path):
    # 2 subgroups of 800 bytes: the state (1600 bytes) is smaller than 4 pipeline buffers.
    params = {"w": jnp.zeros((2 * SUBGROUP,), jnp.float32)}
    state_bytes = 8 * 2 * SUBGROUP

    def make(cache):
        config = OffloadConfig(
            host_cache=cache, tiers=[str(tmp_path / "tier")], subgroup_size=SUBGROUP
        )
        return jax_mlpo.adamw(1e-3, offload=config)

    # this much is enough, and the tier goes unused: no host cache streams a state smaller
    # than the pipeline's buffers through it
    with pytest.warns(jax_mlpo.UnusedTiersWarning, match="lower subgroup_size"):
        jax_mlpo.close(make(state_bytes).init(params))
    with pytest.raises(
        ConfigError,
        match=rf"at least {state_bytes} \(the whole state: it then stays in host memory and "
        r"the tiers go unused\), or lower subgroup_size or prefetch_depth",
    ):
        make(state_bytes - 1).init(params)


def test_a_state_that_fits_the_host_cache_warns_that_the_tiers_go_unused(tmp_path):
    """Tiers configured, a state that fits in host_cache: init warns with the sizes and both
    fixes; a host cache between the pipeline's buffers and the state uses the tier, silently."""
    n = 64 * SUBGROUP
    params = {"w": jnp.zeros((n,), jnp.float32)}
    state_bytes = 8 * n  # m and v
    pipeline = (2 * 1 + 2) * 8 * SUBGROUP  # prefetch_depth 2 x 1 tier + 2 buffers

    def make(cache):
        config = OffloadConfig(host_cache=cache, tiers=[str(tmp_path / "tier")],
                               subgroup_size=SUBGROUP, placement="even")  # fmt: skip
        return jax_mlpo.adamw(1e-3, offload=config)

    with pytest.warns(jax_mlpo.UnusedTiersWarning) as caught:
        state = make(state_bytes).init(params)
    assert len(caught) == 1
    assert str(caught[0].message) == (
        f"jax_mlpo.adamw: the optimizer state ({state_bytes} bytes) fits in host_cache="
        f"{state_bytes} bytes, so it stays all in host memory and the 1 configured tier(s) "
        f"({str(tmp_path / 'tier')!r}) are not used. To put it on the tiers, lower host_cache "
        f"below {state_bytes} bytes (at least {pipeline}: the pipeline's buffers). To keep it "
        "in host memory, drop the tiers (tiers=()) or say so with warnings.filterwarnings("
        '"ignore", category=jax_mlpo.UnusedTiersWarning).'
    )
    assert jax_mlpo.engine_of(state).tiers == []
    jax_mlpo.close(state)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        state = make(state_bytes - 1).init(params)
    assert len(jax_mlpo.engine_of(state).tiers) == 1
    jax_mlpo.close(state)
    # the user's word that host memory is fine
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        warnings.filterwarnings("ignore", category=jax_mlpo.UnusedTiersWarning)
        jax_mlpo.close(make(state_bytes).init(params))


def test_a_too_small_host_cache_names_both_sizes_and_what_each_means(tmp_path):
    n = 64 * SUBGROUP
    params = {"w": jnp.zeros((n,), jnp.float32)}
    pipeline = (2 * 1 + 2) * 8 * SUBGROUP
    config = OffloadConfig(host_cache=pipeline - 1, tiers=[str(tmp_path / "tier")],
                           subgroup_size=SUBGROUP, placement="even")  # fmt: skip
    with pytest.raises(
        ConfigError,
        match=rf"Raise host_cache to at least {pipeline} \(the pipeline's buffers: the state "
        rf"streams through the tiers; {8 * n} or more holds the whole state in host memory and "
        r"leaves the tiers unused\)",
    ):
        jax_mlpo.adamw(1e-3, offload=config).init(params)
    TierLock(str(tmp_path / "tier")).release()
