"""One fixed workload for the Qwen3-Next parity tests, run on a :class:`ModelRunner` (any TP rank)
and checked against transformers' logits on the same tokens."""

from __future__ import annotations

import torch

from plan_driver import PlanDriver

PROMPT_LENS = (2, 20, 150)
NUM_STEPS = 16
CHUNK = 64   # the 150-token prompt is prefilled in chunks of 64, 64 and 22 beside the others' decodes


def prompts() -> dict[str, list[int]]:
    gen = torch.Generator().manual_seed(0)
    return {f"p{n}": torch.randint(3, 128, (n,), generator=gen).tolist() for n in PROMPT_LENS}


def run_script(runner) -> dict[str, tuple[list[int], torch.Tensor]]:
    """Prefill the three prompts together (the long one in chunks, next to the short ones'
    decodes), then decode greedily until each has ``NUM_STEPS`` tokens after its first.

    Returns:
        per prompt: its ``1 + NUM_STEPS`` greedy tokens and the logits ``[1 + NUM_STEPS, vocab]``
        that chose them (prefill logits first).
    """
    driver = PlanDriver(runner, seed=3)
    todo = {name: list(ids) for name, ids in prompts().items()}
    tokens: dict[str, list[int]] = {name: [] for name in todo}
    rows: dict[str, list[torch.Tensor]] = {name: [] for name in todo}
    while any(len(t) < 1 + NUM_STEPS for t in tokens.values()):
        work = {}
        for name, pending in todo.items():
            if len(tokens[name]) < 1 + NUM_STEPS:
                work[name] = pending[:CHUNK]
                todo[name] = pending[CHUNK:]
        for name, logits in driver.step(work).items():
            if not todo[name]:   # the step reached the last known token: its logits pick the next one
                tokens[name].append(int(logits.argmax()))
                rows[name].append(logits)
                todo[name] = [tokens[name][-1]]
    return {name: (tokens[name], torch.stack(rows[name])) for name in tokens}


@torch.no_grad()
def transformers_logits(hf, prompt: list[int], generated: list[int]) -> torch.Tensor:
    """transformers' logits (no cache, one forward) at the positions that chose ``generated``:
    ``[len(generated), vocab]``."""
    logits = hf(torch.tensor([prompt + generated[:-1]])).logits[0].float()
    return logits[len(prompt) - 1:]
