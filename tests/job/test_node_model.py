"""experiments/studies/node_model.py: the update beside the forward pass, as the engine runs it,
against the plain step on the reference node's 7B and 70B presets."""

from __future__ import annotations

import dataclasses

import pytest

from experiments.job.run_config import load_config
from experiments.studies import node_model


@pytest.mark.parametrize("preset", sorted(node_model.REFERENCE))
def test_the_forward_order_moves_the_plain_steps_bytes_and_is_never_slower(preset):
    cache, fwd_bwd = node_model.REFERENCE[preset]
    sets = [f"model={preset}", f"offload.host_cache={cache}"]
    cfg = load_config("experiments/configs/7b-node.yaml", sets)
    node = dataclasses.replace(node_model.Node(), fwd_bwd_s=fwd_bwd)
    rows = {name.strip(): p for name, _, p in node_model.rows(cfg, node)}
    plain = rows["alternate + retain (plain step)"]
    forward = rows["beside the forward pass (forward order)"]
    alternating = rows["alternating, beside every other"]
    for p in (forward, alternating):
        assert p.read_gb == plain.read_gb and p.written_gb == plain.written_gb
        assert round(p.read_in_update_gb, 6) == round(plain.read_in_update_gb, 6)
    assert forward.iteration_s <= alternating.iteration_s <= plain.iteration_s
    assert forward.iteration_s < plain.iteration_s  # the forward pass hides part of the update
