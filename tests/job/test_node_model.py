"""experiments/studies/node_model.py: the update beside the forward pass, as the engine chooses it,
against the plain step on the reference node's 7B and 70B presets."""

from __future__ import annotations

import dataclasses

import pytest

from experiments.job.run_config import load_config
from experiments.studies import node_model


@pytest.mark.parametrize("preset", sorted(node_model.REFERENCE))
def test_the_engines_choice_is_the_faster_variant_and_never_slower_than_the_plain_step(preset):
    cache, fwd_bwd = node_model.REFERENCE[preset]
    sets = [f"model={preset}", f"offload.host_cache={cache}"]
    cfg = load_config("experiments/configs/7b-node.yaml", sets)
    node = dataclasses.replace(node_model.Node(), fwd_bwd_s=fwd_bwd)
    rows = {name.strip(): p for name, _, p in node_model.rows(cfg, node)}
    plain = rows["alternate + retain (plain step)"]
    choice = rows["beside the forward (engine's choice)"]
    variants = [rows["forward order every step"], rows["alternating, beside every other"]]
    assert choice in variants
    assert choice.iteration_s == min(v.iteration_s for v in variants)
    assert choice.iteration_s <= plain.iteration_s
    # alternating moves the plain step's bytes; the forward order more, never less
    assert variants[1].read_gb == plain.read_gb and variants[1].written_gb == plain.written_gb
    assert variants[0].read_gb > plain.read_gb
    # every update reads the same inside itself, whatever the order
    assert {round(p.read_in_update_gb, 6) for p in (plain, *variants)} == {
        round(plain.read_in_update_gb, 6)
    }
