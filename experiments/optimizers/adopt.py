"""optax.contrib.adopt with its state offloaded, its rule in jax.numpy (docs/extending.md)."""

import jax.numpy as jnp
import optax

from jax_mlpo import extend


class Adopt(extend.JaxElementwiseOptimizer):
    """optax.contrib.scale_by_adopt (clipped) and scale_by_learning_rate, per segment."""

    name = "adopt"
    moment_names = ("mu", "nu")
    scalar_names = ("lr", "b1_t", "b2_t", "clip")

    def step(self, moments, grad, param, hyper, *, decay):
        m, v = moments  # the second moment of the last step scales this step's gradient
        b1, b2 = hyper["b1_t"], hyper["b2_t"]
        scaled = grad / jnp.maximum(jnp.sqrt(v), hyper["eps"])
        m = (1 - b1) * jnp.clip(scaled, -hyper["clip"], hyper["clip"]) + b1 * m
        v = (1 - b2) * jnp.square(grad) + b2 * v
        return (m, v), -hyper["lr"] * m


def adopt(learning_rate, b1=0.9, b2=0.9999, eps=1e-6, *, offload, update_dtype=None,
          clip_value_fn=lambda count: count**0.25):  # fmt: skip
    """optax.contrib.adopt with its state (fp32 master, mu, nu) offloaded."""

    def device_scalars(count_inc, hp, lr, grads):  # optax's step-0 rules, on the device
        count = count_inc - 1
        b1_t, b2_t = jnp.where(count > 0, hp["b1"], 1), jnp.where(count > 0, hp["b2"], 0)
        return {"lr": lr, "b1_t": b1_t, "b2_t": b2_t, "clip": clip_value_fn(count)}

    return extend.offloaded_transformation(
        Adopt(), learning_rate=learning_rate, offload=offload,
        hyperparams={"b1": b1, "b2": b2, "eps": eps},
        device_scalars=device_scalars, update_dtype=update_dtype,
    )  # fmt: skip


reference = optax.contrib.adopt
