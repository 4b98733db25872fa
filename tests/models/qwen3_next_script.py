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


def verify_with_rejection(runner, greedy_tokens: list[int]) -> torch.Tensor:
    """On a fresh runner: prefill the 20-token prompt, verify two drafts of which the second is
    wrong, continue from the accepted position; every rank builds the same plans (as the
    coordinator would send them).

    Args:
        runner: a runner that has not served any request yet.
        greedy_tokens: the prompt's greedy continuation (at least 3 tokens).

    Returns:
        the logits ``[vocab]`` after ``prompt + greedy_tokens[:3]`` (row 3 of the plain run's).
    """
    from shardserve.workers.messages import NewRequestData, SamplingOptions, ScheduledRequest, StepPlan

    prompt = prompts()["p20"]
    wrong = (greedy_tokens[2] + 1) % 128
    blocks = list(range(7))   # 28 token slots for 23 positions
    runner.compute_logits(StepPlan([NewRequestData("v", SamplingOptions(temperature=0), 0)],
                                   [ScheduledRequest("v", prompt, 0, blocks, True, 0)]))
    runner.compute_logits(StepPlan([], [ScheduledRequest("v", [greedy_tokens[0], greedy_tokens[1], wrong], 20, [],
                                                         True, 1, num_spec_tokens=2)]))
    # rank 0 accepts greedy_tokens[1], rejects `wrong` and emits greedy_tokens[2]: resume at 22
    return runner.compute_logits(StepPlan([], [ScheduledRequest("v", [greedy_tokens[2]], 22, [], True, 3)]))[0]
