# The isolated A/B of experiments/results/restructure_ab.txt: python restructure_ab_outside.py TAG MI_PARAMS HOST_CACHE
import time, sys, statistics, shutil, os
import jax, jax.numpy as jnp, numpy as np
import jax_mlpo
tag = sys.argv[1]; d = f"/tmp/ab/o-{tag}"; shutil.rmtree(d, ignore_errors=True)
os.makedirs(d); n = int(sys.argv[2]) * 2**20
tiers = [jax_mlpo.FileTier(d + "/a", bandwidth_cap="300MB"), jax_mlpo.FileTier(d + "/b", bandwidth_cap="150MB")]
cfg = jax_mlpo.OffloadConfig(host_cache=sys.argv[3], tiers=tiers, subgroup_size=1 << 20, prefetch_depth=2)
params = {"w": jnp.zeros((n,), jnp.float32)}; grads = {"w": jnp.full((n,), 1e-3, jnp.float32)}
tx = jax_mlpo.adamw(1e-3, weight_decay=0.1, offload=cfg); state = tx.init(params)
up = jax.jit(tx.update); eng = jax_mlpo.engine_of(state)
out = []
for s in range(10):
    t0 = time.perf_counter(); u, state = up(grads, state, params); jax.block_until_ready(u); eng.drain()
    dt = time.perf_counter() - t0; m = eng.metrics[-1]
    if s >= 4: out.append((dt, m.total_s, dt - m.total_s, len(eng.pool.writes) if hasattr(eng, "pool") else len(eng._writes)))
    del u
print(tag, "wall %.3f engine %.3f outside %.3f" % tuple(statistics.median(x[i] for x in out) for i in range(3)), [round(x[2], 3) for x in out])
jax_mlpo.close(state); shutil.rmtree(d, ignore_errors=True)
