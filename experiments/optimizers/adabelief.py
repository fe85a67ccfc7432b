"""optax.adabelief with its state offloaded, its rule in jax.numpy (docs/extending.md)."""

import jax.numpy as jnp
import optax

from jax_mlpo import extend


class AdaBelief(extend.JaxElementwiseOptimizer):
    """optax.scale_by_belief and scale_by_learning_rate, one segment at a time."""

    name = "adabelief"
    moment_names = ("mu", "nu")
    scalar_names = ("lr", "bc1", "bc2", "c1", "c2")

    def step(self, moments, grad, param, hyper, *, decay):
        m, s = moments
        m = hyper["c1"] * grad + hyper["b1"] * m
        s = hyper["c2"] * jnp.square(grad - m) + hyper["b2"] * s + hyper["eps_root"]
        u = (m / hyper["bc1"]) / (jnp.sqrt(s / hyper["bc2"]) + hyper["eps"])
        return (m, s), -hyper["lr"] * u


def adabelief(learning_rate, b1=0.9, b2=0.999, eps=1e-16, eps_root=1e-16, *, offload,
              update_dtype=None):  # fmt: skip
    """optax.adabelief with its state (fp32 master, mu, nu) offloaded."""

    def device_scalars(count_inc, hp, lr, grads):  # optax's own expressions, on the device
        b1, b2 = hp["b1"], hp["b2"]  # 1 - b: in double for a float, as optax rounds it
        return {"lr": lr, "bc1": 1 - b1**count_inc, "bc2": 1 - b2**count_inc, "c1": 1 - b1,
                "c2": 1 - b2}  # fmt: skip

    return extend.offloaded_transformation(
        AdaBelief(), learning_rate=learning_rate, offload=offload,
        hyperparams={"b1": b1, "b2": b2, "eps": eps, "eps_root": eps_root},
        device_scalars=device_scalars, update_dtype=update_dtype,
    )  # fmt: skip


reference = optax.adabelief
