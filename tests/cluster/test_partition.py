"""Whole-unit TP splits, even and weighted (llama.cpp --tensor-split semantics)."""

from __future__ import annotations

import pytest

from shardserve.workers.partition import split_units


@pytest.mark.parametrize("units,tp,weights,expected", [
    (3, 1, None, [(0, 3)]),
    (3, 2, None, [(0, 2), (2, 1)]),          # SmolLM2's 3 KV groups over 2 ranks: a real uneven split
    (3, 3, None, [(0, 1), (1, 1), (2, 1)]),
    (3, 2, [1, 2], [(0, 1), (1, 2)]),
    (3, 2, [2, 1], [(0, 2), (2, 1)]),
    (8, 2, [3, 1], [(0, 6), (6, 2)]),
    (49152, 3, None, [(0, 16384), (16384, 16384), (32768, 16384)]),
])
def test_split_units(units, tp, weights, expected):
    assert split_units(units, tp, weights) == expected


@pytest.mark.parametrize("units,tp,weights,message", [
    (3, 4, None, "each rank needs at least one"),
    (3, 2, [10, 1], "every rank needs at least one"),
    (3, 2, [1, 1, 1], "has 3 entries for tp_size=2"),
    (3, 2, [1, 0], "must be > 0"),
])
def test_bad_splits_are_config_errors(units, tp, weights, message):
    with pytest.raises(ValueError, match=message):
        split_units(units, tp, weights)


def test_a_split_error_names_the_models_units():
    with pytest.raises(ValueError, match=r"the model's 3 KV heads over 4 ranks: .* at most 3\)"):
        split_units(3, 4, what="KV heads")
