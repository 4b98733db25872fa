"""How a dimension is split across tensor-parallel ranks, in whole units, evenly or by weights.

A *unit* is the smallest piece that must stay on one rank: one KV group of attention heads for
GQA (``num_heads / num_kv_heads`` query heads plus their K/V head), one head for MLA, one row
block for an MLP. Uneven weights follow llama.cpp's ``--tensor-split``: rank r gets about
``weights[r] / sum(weights)`` of the units, always a whole number and never zero.
"""

from __future__ import annotations


def split_units(num_units: int, tp_size: int, weights: list[float] | None = None,
                what: str = "units") -> list[tuple[int, int]]:
    """Split ``num_units`` into ``tp_size`` contiguous ranges by relative ``weights``; ``what``
    names the units in errors (``"KV heads"``: what a user can match against the model's config).

    Returns:
        ``[(start, count), ...]`` per rank, covering ``0..num_units`` in order.

    Raises:
        ValueError: fewer units than ranks, a bad weight list, or a split that would leave a rank
            with no unit.
    """
    weights = list(weights) if weights else [1.0] * tp_size
    if len(weights) != tp_size:
        raise ValueError(f"tensor split {weights} has {len(weights)} entries for tp_size={tp_size}")
    if any(w <= 0 for w in weights):
        raise ValueError(f"tensor split {weights}: every weight must be > 0")
    if num_units < tp_size:
        raise ValueError(f"cannot split the model's {num_units} {what} over {tp_size} ranks: each rank needs at "
                         f"least one (use a tensor-parallel size of at most {num_units})")
    total = sum(weights)
    # Cumulative boundaries rounded to whole units (largest-remainder by rounding the prefix sums).
    bounds = [0]
    acc = 0.0
    for w in weights[:-1]:
        acc += w
        bounds.append(round(num_units * acc / total))
    bounds.append(num_units)
    ranges = [(bounds[r], bounds[r + 1] - bounds[r]) for r in range(tp_size)]
    if any(count <= 0 for _, count in ranges):
        raise ValueError(
            f"tensor split {weights} over {num_units} {what} gives ranks {[c for _, c in ranges]} units: "
            f"every rank needs at least one"
        )
    return ranges


def split_rows(num_rows: int, tp_size: int, weights: list[float] | None = None,
               unit: int = 32) -> list[tuple[int, int]]:
    """Split ``num_rows`` rows (an MLP's intermediate dim) in units of ``unit`` rows when it
    divides ``num_rows``, so a row-parallel slice holds whole quantization groups of 32 inputs;
    otherwise in single rows. Returns ``[(start, count), ...]`` per rank, in rows.

    Raises:
        ValueError: as :func:`split_units`.
    """
    if num_rows % unit or num_rows // unit < tp_size:
        return split_units(num_rows, tp_size, weights)
    return [(start * unit, count * unit) for start, count in split_units(num_rows // unit, tp_size, weights)]
