"""How many tokens to draft, per request and step: speculation only where it pays.

A draft step is not free: the draft model runs (one pass that adds the accepted positions to its
cache and chains ``d`` drafts), and the target's verify step computes ``1 + d`` query rows per
request instead of one (and, on a GPU, runs eagerly instead of replaying a decode graph). What it
returns is the accepted drafts. :class:`AdaptivePolicy` measures both sides as the engine runs and
drafts at the depth that maximizes expected tokens per second; :class:`FixedPolicy` always drafts
``K`` (``--speculative-policy fixed``, vLLM's and SGLang's behaviour).

Acceptance (per request and draft position ``j``): ``c_j``, the chance that draft ``j`` is accepted
once drafts ``1..j-1`` were, counted per request and pooled over all requests (the pool, which
follows recent traffic, is the prior of a request with few observations:
``(hits + m * pool) / (trials + m)``, ``m = 4``), taken one standard error optimistic (see
:meth:`AdaptivePolicy.acceptance`) so that what was little tried gets tried. A request drafted ``d`` deep then emits
``1 + sum_{j<=d} prod_{i<=j} c_i`` tokens per step on average (Leviathan et al. 2023, eq. 1, with
position-dependent rates).

Cost (seconds, fitted online by least squares with exponential forgetting):
- a plain step of ``B`` decoding requests beside ``P`` prompt tokens (prefill chunks of other
  requests): ``T(B, P) = a + b * B + p * P``; the decisions compare decode steps, ``T(B) = T(B, 0)``;
- a verify step: ``T(B, P) + J + v * (extra rows)``, its extra over a plain step of the same shape
  (``J``: fixed cost, e.g. no decode graph; ``v``: per verified draft token);
- a draft pass: ``D0 + D1 * depth + D2 * (rows of the chained steps) + D3 * (cache entries)``;
- a verified draft costs no less than ``b``, what one more decoding request adds to a plain step
  (:meth:`AdaptivePolicy._row_s`), and the plain rate drafting must beat is that of the batch the
  scheduler's held requests will form, when higher than the decoding requests' own
  (:meth:`AdaptivePolicy._plain_share`).

Each step the policy compares staying plain with drafting at every depth ``1..K`` (per request
the depth is cut where ``prod c_i`` falls below what a draft token costs at the plain rate) and
keeps the best expected rate; drafting must beat the plain rate by 5 % (a misjudged cost must not
make decoding slower). While it drafts, every 17th step re-measures, alternately a plain step (the
draft cache kept warm), so that ``T(B)`` is measured again (the plain rate is what drafting is
compared with, and an early slow plain step would otherwise make drafting look better for good),
and a step one draft shallower (from depth 1: deeper), so that the cost fits see two depths and
can tell a fixed cost from a per-draft one. Plain steps skip the draft model entirely ("cold": the MTP cache then
misses those positions, which only weakens later drafts) unless drafting's estimate reaches the plain
rate (short of the 5 % margin), when the draft keeps its cache warm for a switch, for at most
``WARM_IDLE_LIMIT`` steps in a row that draft nothing (then cold until the next probe). A warm pass
is not free (one MTP forward per step: 15 % of a batch-1 step of the demo model), so a policy that
stayed warm further below the plain rate, or whose estimate sat between the plain rate and the
margin (drafting at break-even), made decoding slower while drafting nothing: the benchmark's
batch-8 row once read 0.79x with no draft made (issue 31). Costs that were never measured make the
policy try drafting for a step (exploration; at depths 1, 2, ... K in turn: probing at depth 1 only,
the fits could not tell a draft's cost per depth, rated deeper drafts too dear, and at batch 8 the
policy stayed cold where k = 2 and 3 were 14-18 % faster): first while it warms up, then again after
64, 128, ... 1024 cold steps (counted per batch-size bucket, reset to 64 where drafting was realized
to pay), or when the batch size moves to one it has not measured. A step
that carries prompt tokens runs them through the draft model only where drafting would pay at the
batch those requests join, that pass included (:meth:`AdaptivePolicy.wants_hidden`).

What the fits estimate is checked against what drafting realized: per batch-size bucket, the
tokens per second of plain decode steps and of the decode steps where the fits chose to draft, per
depth (the draft pass after each included), each over its last ~50 steps. A depth whose realized
rate falls 3 % below the plain one is vetoed whatever the estimate says (the fits miss a cost, or
short-lived requests keep the acceptance optimistic) until the next probe retries it: the fits
rated depth 1 too well at batch 8 and 32 of the demo model, where k = 1 reads 0.8-0.9x of k = 0.
Where drafting steps were realized but plain ones were not (the fits kept choosing to draft), the
policy takes plain steps until the two can be compared. Both ledgers and the probe intervals are
per bucket: with one probe interval, drafting that paid at the small batches of a run's tail reset
it, and every run's batch-32 phase probed again, forgot its veto and drafted 16 more steps at ~0.6x.
A batch size a run only passes through (its tail) may veto on fewer steps (8 drafting, 4 plain,
drafting started there 3 times) at a wider margin (0.93); a draft pass after a decode step that was
no realized drafting step (the warm pass before drafting starts) is charged to drafting there; a
probe drafts from the step after its decision, is kept out of the ledgers, and halves what drafting
returned instead of forgetting it (the brief veto holds through a batch size's first three probes);
and a vetoed or recently cold batch size is answered by :meth:`AdaptivePolicy.stays_cold` without
weighing depths. Together they took the demo benchmark's batch-32 runs from 2-4 drafting excursions
each (a tail at 16..8 requests, a probe's 16 steps) to none in steady state (0.97x -> 0.99x of k = 0).
"""

from __future__ import annotations

from dataclasses import dataclass, field

MIN_OBSERVATIONS = 3         # measurements of a cost term before the policy trusts it
PRIOR_STRENGTH = 4.0         # pseudo-trials of the pooled acceptance in a request's estimate (at least)
MAX_PRIOR_STRENGTH = 400.0   # ... and at most, where requests accept alike (see _Spread)
SPREAD_DECAY = 0.98          # per finished request: the spread of requests' acceptance follows the last ~50
SPREAD_MIN_REQUESTS = 8.0    # finished requests (decayed count) before their spread sets the prior's strength
SPREAD_MIN_TRIALS = 4        # first-draft trials of a finished request before it counts in the spread
POOL_DECAY = 0.998           # per observed sequence-step: the pooled rates follow recent traffic
WARM_MARGIN = 1.0            # stay warm only while drafting's estimate reaches the plain rate (a warm pass costs)
DRAFT_MARGIN = 1.05          # draft only when its estimate beats the plain rate by this factor
RECHECK_INTERVAL = 16        # drafting steps between two re-measuring steps (plain, then a neighbour depth)
CLEAR_GAIN = 1.2             # realized drafting / plain rate above which re-measuring steps come 4x less often
WARM_IDLE_LIMIT = 3          # warm steps in a row that draft nothing before the policy goes cold
SHORT_IDLE_LIMIT = 8         # ... not counting up to this many whose requests had no room for K drafts
MIN_PROBE_INTERVAL = 64      # cold steps between explorations of a batch-size bucket, at first
MAX_PROBE_INTERVAL = 1024    # ... and at most (doubled by each probe, reset where drafting paid)
LEDGER_DECAY = 0.98          # per observation: the realized rates follow the last ~50 steps of a kind
LEDGER_MIN = 16              # realized drafting steps (in a batch bucket) before they can veto drafting,
PLAIN_LEDGER_MIN = 8         # ... against this many plain ones (alike: no acceptance varies their yield)
LEDGER_VETO = 0.97           # realized drafting / plain rate below which drafting is vetoed (noise margin)
BRIEF_DRAFTING_MIN = 8       # ... or, on fewer steps (a batch size visited briefly: a run's tail), drafting
BRIEF_PLAIN_MIN = 4          # steps and plain steps at least these many, and the ratio below BRIEF_VETO
BRIEF_VETO = 0.93
BRIEF_EPISODES = 3           # ... once drafting started there (a warm pass charged) this many times
COLD_RECHECK = 8             # steps a cold decision of depths() stands (stays_cold) before it is weighed again,
MAX_COLD_RECHECK = 64        # ... doubled by each cold decision in a row at the batch size, up to this
DECODE_ONLY_DECAY = 0.9      # per decode-carrying step: the share of decode-only steps at a batch size follows
EVIDENCE_SHARE = 0.25        # ... the last ~10; above this share its realized rates will come (see _pays_at)
MIN_BATCH_SPREAD = 1.0       # std of the plain steps' batch sizes before the plain fit's slope is a measurement
ANY_DEPTH = -1               # the ledger of every drafting step the fits (or a probe) chose, whatever its depth


class LinearFit:
    """Least squares ``y ~ w . x`` over exponentially forgotten observations, with a ridge toward
    ``prior`` that is never forgotten: ``w = (sum f^age x x^T + s I)^-1 (sum f^age x y + s prior)``.

    Recursive least squares with forgetting (the first version) winds up where the data do not vary
    a regressor: at batch 1 every verify step had 3 drafts, so ``J + 3 v`` was all it saw, its
    covariance grew without bound along that direction, and the fit drifted to ``J = 13 ms,
    v = -2.3 ms``: a shallower verify looked dearer than a deeper one, and the policy drafted 3 deep
    where 2 was faster (issue 31). Here the ridge holds such a direction at the smallest weights
    that explain the data (the policy also varies the depth now and then, see
    :meth:`AdaptivePolicy.depths`).

    Args:
        prior: weights the ridge pulls toward. strength: ridge weight ``s``. forget: per-observation decay ``f``.
    """

    def __init__(self, prior: list[float], strength: float = 1e-3, forget: float = 0.98) -> None:
        size = len(prior)
        self.prior = list(prior)
        self._w: list[float] | None = list(prior)
        self.strength = strength
        self.forget = forget
        self.xx = [[0.0] * size for _ in range(size)]
        self.xy = [0.0] * size
        self.count = 0

    @property
    def w(self) -> list[float]:
        """The weights, solved when first needed after an observation (a plain step at batch 32 is
        observed every step but predicted only while the policy weighs drafting there)."""
        if self._w is None:
            size = len(self.prior)
            self._w = _solve([[self.xx[i][j] + (self.strength if i == j else 0.0) for j in range(size)]
                              for i in range(size)], [self.xy[i] + self.strength * self.prior[i] for i in range(size)])
        return self._w

    def predict(self, x: list[float]) -> float:
        return sum(w * v for w, v in zip(self.w, x))

    def spread(self, index: int) -> float:
        """Standard deviation of regressor ``index`` over the (forgotten) observations, the first
        regressor being the constant 1: 0 where it never varied and its weight is the ridge's split
        of the constant's, not a measurement."""
        total = self.xx[0][0]
        if total <= 0.0:
            return 0.0
        mean = self.xx[0][index] / total
        return max(self.xx[index][index] / total - mean * mean, 0.0) ** 0.5

    def observe(self, x: list[float], y: float) -> None:
        size, f = len(self.prior), self.forget
        self.xx = [[f * self.xx[i][j] + x[i] * x[j] for j in range(size)] for i in range(size)]
        self.xy = [f * self.xy[i] + x[i] * y for i in range(size)]
        self._w = None
        self.count += 1


def _solve(matrix: list[list[float]], rhs: list[float]) -> list[float]:
    """``matrix^-1 rhs`` by Gaussian elimination with partial pivoting (``matrix`` is symmetric
    positive definite here: a Gram matrix plus a ridge)."""
    size = len(rhs)
    rows = [list(row) + [value] for row, value in zip(matrix, rhs)]
    for col in range(size):
        pivot = max(range(col, size), key=lambda r: abs(rows[r][col]))
        rows[col], rows[pivot] = rows[pivot], rows[col]
        for r in range(col + 1, size):
            factor = rows[r][col] / rows[col][col]
            rows[r] = [a - factor * b for a, b in zip(rows[r], rows[col])]
    out = [0.0] * size
    for r in range(size - 1, -1, -1):
        out[r] = (rows[r][size] - sum(rows[r][c] * out[c] for c in range(r + 1, size))) / rows[r][r]
    return out


@dataclass(slots=True)
class Candidate:
    """A request that decodes next step, as the policy sees it."""

    req_id: str
    max_depth: int                   # drafts that cannot pass max_tokens or the context length (<= K)


@dataclass(slots=True)
class _Realized:
    """Tokens emitted and seconds spent (step, plus the draft pass after a drafting step) by one
    kind of decode step, exponentially forgotten per step: what drafting really returned."""

    tokens: float = 0.0
    seconds: float = 0.0
    count: int = 0
    charges: int = 0                  # draft passes charged (see charge)

    def add(self, tokens: float, seconds: float) -> None:
        self.tokens = self.tokens * LEDGER_DECAY + tokens
        self.seconds = self.seconds * LEDGER_DECAY + seconds
        self.count += 1

    def rate(self) -> float:
        return self.tokens / max(self.seconds, 1e-9)

    def charge(self, seconds: float) -> None:
        """A draft pass after a decode step that was no realized drafting step (a plain step that
        kept the draft cache warm, or a re-measuring step): a cost of drafting at the batch size it
        drafts for, in no step's rate. Uncharged, 2-3 drafting steps at the end of a run looked as fast as plain
        ones while the pass before them made the run's tail ~10 % slower (issue 31)."""
        self.seconds += seconds
        self.charges += 1

    def halve(self, holds: bool) -> None:
        """A probe of the batch size: what drafting returned there weighs half; with ``holds`` (the
        first three probes of the batch size) it still counts as many steps as the brief veto
        needs, after that half its steps. Forgetting it (the first version) made every probe at
        batch 32 of the demo model let the fits draft again until 16 new steps vetoed them anew,
        and the next run's prompt chunks (no ledger sees them) went through the draft model too:
        10-15 % of a run each time, and the benchmark's six runs see two or three probes of batch
        32. Halved without a floor, the second probe lapsed a veto and read 0.97x there. So a veto
        holds for 64 + 128 + 256 cold steps and is retried from the 4th probe on (after 512, then
        every 1,024 cold steps at that batch size). A probe's own step
        is not counted: right after a cold spell the draft cache misses recent positions, and such
        steps kept a veto from ever lapsing in a test (issue 31)."""
        self.tokens, self.seconds, self.charges = self.tokens / 2, self.seconds / 2, self.charges // 2
        self.count = max(self.count // 2, min(self.count, BRIEF_DRAFTING_MIN)) if holds else self.count // 2


@dataclass(slots=True)
class _Spread:
    """How much requests differ in accepting their first draft: the between-request variance
    ``tau^2`` of ``c_1``, by the method of moments over finished requests
    (``E[(rate_i - pooled)^2] = tau^2 + pooled (1 - pooled) / n_i`` for a request's ``n_i``
    trials), exponentially forgotten per request. A new request's ``c_1`` is a draw from the pool,
    so its prior is a beta of the pooled mean whose strength ``m`` has that variance,
    ``pooled (1 - pooled) / (m + 1) = tau^2`` (empirical Bayes; Casella 1985, "An introduction to
    empirical Bayes data analysis")."""

    count: float = 0.0
    excess: float = 0.0

    def add(self, rate: float, pooled: float, trials: float) -> None:
        self.count = self.count * SPREAD_DECAY + 1.0
        self.excess = self.excess * SPREAD_DECAY + (rate - pooled) ** 2 - pooled * (1.0 - pooled) / trials

    def prior_strength(self, pooled: float) -> float:
        """``m`` of a new request's ``c_1`` prior: ``PRIOR_STRENGTH`` until ``SPREAD_MIN_REQUESTS``
        finished requests were measured (little is known: requests get tried), then from ``tau^2``
        within ``PRIOR_STRENGTH .. MAX_PRIOR_STRENGTH``."""
        if self.count < SPREAD_MIN_REQUESTS:
            return PRIOR_STRENGTH
        variance = pooled * (1.0 - pooled)
        tau2 = max(self.excess / self.count, variance / (MAX_PRIOR_STRENGTH + 1.0))
        return min(MAX_PRIOR_STRENGTH, max(PRIOR_STRENGTH, variance / tau2 - 1.0))


@dataclass(slots=True)
class _Acceptance:
    """Per-position conditional acceptance counts (``trials[j]``: draft ``j + 1`` was verified
    after ``j`` accepted ones; ``hits[j]``: it was accepted)."""

    trials: list[float] = field(default_factory=list)
    hits: list[float] = field(default_factory=list)

    def add(self, num_drafts: int, num_accepted: int, decay: float = 1.0) -> None:
        if decay != 1.0:
            self.trials = [t * decay for t in self.trials]
            self.hits = [h * decay for h in self.hits]
        for j in range(min(num_drafts, num_accepted + 1)):
            if j >= len(self.trials):
                self.trials.append(0.0)
                self.hits.append(0.0)
            self.trials[j] += 1.0
            self.hits[j] += j < num_accepted


class FixedPolicy:
    """Always ``K`` drafts (cut by each request's limits); the draft model always runs."""

    name = "fixed"

    def __init__(self, max_depth: int) -> None:
        self.max_depth = max_depth

    def wants_hidden(self, num_seqs: int, prompt_tokens: int = 0, batch_after: int = 0) -> bool:
        return True

    def caches_prompts(self, batch_after: int) -> bool:
        return True

    def stays_cold(self, num_seqs: int) -> bool:
        return False

    def depths(self, candidates: list[Candidate], in_flight: int = 0, batch_after: int = 0) -> list[int]:
        return [min(self.max_depth, c.max_depth) for c in candidates]

    def observe_step(self, num_seqs: int, prompt_tokens: int, num_drafts: int, seconds: float) -> None:
        pass

    def observe_draft(self, depth: int, chain_rows: int, entries: int, seconds: float) -> None:
        pass

    def observe_acceptance(self, req_id: str, num_drafts: int, num_accepted: int) -> None:
        pass

    def forget(self, req_id: str) -> None:
        pass


class AdaptivePolicy(FixedPolicy):
    """Drafts only when and as deep as it pays (see the module docstring).

    Args:
        max_depth: ``K`` (``--speculative-tokens``).
        prior_acceptance: pooled acceptance rate assumed before any draft was verified.
    """

    name = "adaptive"

    def __init__(self, max_depth: int, prior_acceptance: float = 0.6) -> None:
        super().__init__(max_depth)
        self.plain = LinearFit([0.0, 0.0, 0.0])         # T(B, P) = a + b B + p P (P: 1000s of prefill tokens)
        self.verify = LinearFit([0.0, 0.0])             # extra over T(B, P) = J + v * extra rows
        self.draft = LinearFit([0.0, 0.0, 0.0, 0.0])    # D0 + D1 depth + D2 chain rows + D3 entries
        self.pool = _Acceptance([PRIOR_STRENGTH] * max_depth, [PRIOR_STRENGTH * prior_acceptance] * max_depth)
        self.requests: dict[str, _Acceptance] = {}
        self.spread = _Spread()                         # of finished requests' first-draft acceptance
        self.warm = True                                # the last decision keeps the draft cache filled
        self.cold_steps: dict[int, int] = {}           # batch-size bucket -> cold steps at it since its last
        self.last_bucket = 0                            # probe or warm step; the bucket of the last decision
        self.warm_idle = 0                              # warm steps in a row that drafted nothing
        self.short_steps = 0                            # ... of which every request was short of room
        self.drafting_steps = 0                         # since the last re-measuring step
        self.rechecks = 0
        self.probes = 0                                 # exploring steps so far (their depth cycles 1..K)
        self.probe_intervals: dict[int, int] = {}      # batch-size bucket -> cold steps between its probes
        self.seen_batches: set[int] = set()             # batch-size buckets with a measured drafting step
        self.realized: dict[int, dict[int, _Realized]] = {}   # bucket -> depth (0: plain) -> realized
        self.accepted = 0                               # accepted drafts of the step being recorded
        self.pending: tuple[int, int, int, float] | None = None   # a drafting step awaiting its draft pass
        self.charged = False                            # the next draft pass is a cost of drafting (no step's)
        self.chosen = 0                                 # deepest draft of the fits' (or a probe's) last choice
        self.probe_next = 0                             # a probe's depth, decided cold, drafted next step
        self.exploring = False                          # depths' last answer explored (a probe, or costs unknown)
        self.cold_skips: dict[int, int] = {}            # bucket -> steps stays_cold answers before depths weighs again
        self.cold_streak: dict[int, int] = {}           # bucket -> cold decisions of depths in a row there
        self.version = 0                                # bumped whenever an acceptance estimate may change
        self.reach_cache: dict[str, tuple[int, int, list[float]]] = {}   # req -> (version, max depth, reach)
        self.decode_only: dict[int, float] = {}         # bucket -> share of its steps with no prompt tokens

    # -- observations ----------------------------------------------------------------------------
    def observe_step(self, num_seqs: int, prompt_tokens: int, num_drafts: int, seconds: float) -> None:
        """A finished target step (engine overhead included): ``num_seqs`` decoding requests, which
        verified ``num_drafts`` drafts in all, beside ``prompt_tokens`` prefill tokens (chunks)."""
        accepted, self.accepted = self.accepted, 0
        self._settle(0.0)
        if num_seqs == 0:
            return
        bucket = _bucket(num_seqs)
        self.decode_only[bucket] = DECODE_ONLY_DECAY * self.decode_only.get(bucket, 1.0) + \
            (1.0 - DECODE_ONLY_DECAY) * (prompt_tokens == 0)
        if prompt_tokens == 0:                          # realized rates: decode-only steps
            if num_drafts == 0:
                self._ledger(num_seqs, 0).add(num_seqs, seconds)
            elif self.chosen:                           # re-measuring steps are not the policy's rate
                self.pending = (num_seqs, self.chosen, num_seqs + accepted, seconds)
            self.charged = self.pending is None         # ... but a draft pass after them is drafting's cost
        # P in thousands of tokens: where every step carries about as many prompt tokens (short
        # requests arriving all the time) the fit cannot tell ``a`` from ``p P``; its ridge then
        # keeps ``p`` small, so T(B, 0) predicts what such steps cost (the plain step there).
        x = [1.0, float(num_seqs), prompt_tokens / 1000.0]
        if num_drafts == 0:
            self.plain.observe(x, seconds)
        else:
            self.verify.observe([1.0, float(num_drafts)], seconds - self.plain.predict(x))
            self.seen_batches.add(_bucket(num_seqs))

    def observe_draft(self, depth: int, chain_rows: int, entries: int, seconds: float) -> None:
        """A finished draft pass: ``depth`` drafts deep, ``chain_rows`` rows over its chained
        steps, ``entries`` cache entries written by its first forward."""
        self.draft.observe([1.0, float(depth), float(chain_rows), float(entries)], seconds)
        self._settle(seconds)

    def _ledger(self, num_seqs: int, depth: int) -> _Realized:
        return self.realized.setdefault(_bucket(num_seqs), {}).setdefault(depth, _Realized())

    def _settle(self, draft_seconds: float) -> None:
        """A drafting step's realized rate, once the draft pass after it (if any) is timed."""
        if self.pending is not None:
            num_seqs, depth, tokens, seconds = self.pending
            self._ledger(num_seqs, depth).add(tokens, seconds + draft_seconds)
            self._ledger(num_seqs, ANY_DEPTH).add(tokens, seconds + draft_seconds)
            self.pending = None
        elif self.charged and draft_seconds and not self.exploring:   # for depths' last batch size
            self.realized.setdefault(self.last_bucket, {}).setdefault(ANY_DEPTH, _Realized()).charge(draft_seconds)
        self.charged = False

    def observe_acceptance(self, req_id: str, num_drafts: int, num_accepted: int) -> None:
        self.accepted += num_accepted
        self.version += 1
        self.requests.setdefault(req_id, _Acceptance()).add(num_drafts, num_accepted)
        self.pool.add(num_drafts, num_accepted, POOL_DECAY)

    def forget(self, req_id: str) -> None:
        """``req_id`` finished: its first-draft acceptance joins the spread of requests'."""
        self.reach_cache.pop(req_id, None)
        self.version += 1
        mine = self.requests.pop(req_id, None)
        if mine is not None and mine.trials and mine.trials[0] >= SPREAD_MIN_TRIALS:
            self.spread.add(mine.hits[0] / mine.trials[0], self.pool.hits[0] / self.pool.trials[0], mine.trials[0])

    # -- decisions -------------------------------------------------------------------------------
    def wants_hidden(self, num_seqs: int, prompt_tokens: int = 0, batch_after: int = 0) -> bool:
        """Whether the coming step's hidden states feed a draft pass (the draft cache stays warm).

        A step that carries ``prompt_tokens`` prefill tokens would put them all through the draft
        model (its cache then holds the prompts). It does so only where a drafting step would pay
        at ``batch_after`` decoding requests (the batch the new requests join: every request the
        scheduler holds, up to ``max_num_seqs``) with that pass's cost included. Otherwise the
        prompts stay out of the draft cache and no probe runs on the step: on the demo model,
        batch 32 prefills over 16 such steps on CPU, which cost k = 2 a quarter more wall time than
        k = 0's. On the benchmark's random-token prompts the acceptance length did not change
        without them (2.54 vs 2.53); on text it does: a served request whose prompt the draft
        cache lacked drafted 4 times in 120 tokens where one with it drafted ~40 (its own
        acceptance shows the gap, and the policy stops drafting for it). See :meth:`_pays_at`."""
        if not (self.warm or self._probe_due(num_seqs)):
            return False
        return not prompt_tokens or self._pays_at(max(num_seqs, batch_after), prompt_tokens)

    def caches_prompts(self, batch_after: int) -> bool:
        """Whether prompts admitted now will likely go through the draft model (:meth:`wants_hidden`
        of a step that carries them, its prompt pass not counted): only then is the last block of a
        prefix-cache hit recomputed for the draft cache. Before, a policy that stayed cold (batch 32 of
        the demo model) recomputed a block per hit that k = 0 kept: 512 more prompt tokens for 32
        prompts of 64 tokens whose prefixes were cached (issue 31)."""
        return (self.warm or self._probe_due(batch_after)) and self._pays_at(max(batch_after, 1), 0)

    def _pays_at(self, num_seqs: int, prompt_tokens: int) -> bool:
        """Whether drafting clearly pays at ``num_seqs`` decoding requests, so that prompts joining
        them go through the draft model: a step drafting at some depth at the pooled mean acceptance
        (not :meth:`acceptance`'s optimistic one: a prompt pass is an investment, not an
        experiment), whose draft pass also writes ``prompt_tokens`` entries, beats the plain rate
        by the drafting margin, the realized rates at that batch size agree by the same margin, and
        no brief veto stands there (a probe halves the ledgers below ``LEDGER_MIN``, where the brief
        veto still holds: the prompts of a demo batch-32 run went through the draft model after one,
        0.90x of k = 0) (True while the costs are being measured).

        Where drafting was not realized on ``LEDGER_MIN`` decode steps at that batch size, the
        prompts wait for it if decode-only steps (which the realized rates are measured on) are at
        least ``EVIDENCE_SHARE`` of its recent steps: there the fits alone let batch-32 runs of the
        demo model put their prompts through the draft model and draft in their prefill steps,
        0.89x of k = 0 by the wall clock where drafting at batch 32 returns nothing (the same
        drafts without prompt passes: 1.01x; issue 31). Where drafting was realized but plain
        steps were not (the policy drafts nearly every step, as at batch 1), the fits decide:
        waiting for plain steps kept a served replica's second request out of the draft model, and
        on text whose prompt the draft cache lacks it drafted 4 times in 120 tokens instead of ~40.
        Where nearly every step carries prompt chunks (requests arriving all the time) no realized
        rate ever comes, and the fits decide too."""
        if not self._costs_known():
            return True
        ratio = self._realized_ratio(num_seqs)
        bucket = _bucket(num_seqs)
        drafted = self.realized.get(bucket, {}).get(ANY_DEPTH)
        if (ratio is None and (drafted is None or drafted.count < LEDGER_MIN)
                and self.decode_only.get(bucket, 1.0) >= EVIDENCE_SHARE):
            return False
        if (ratio is not None and ratio < DRAFT_MARGIN) or self._brief_ratio(num_seqs) < BRIEF_VETO:
            return False
        rates = [self.pool.hits[j] / self.pool.trials[j] for j in range(self.max_depth)]
        reach = [_reach(rates, self.max_depth)] * num_seqs
        plain_s = max(self.plain.predict([1.0, float(num_seqs), prompt_tokens / 1000.0]), 1e-6)   # prompts in both
        return any(self._rate([depth] * num_seqs, reach, num_seqs, plain_s, prompt_tokens)
                   >= DRAFT_MARGIN * num_seqs / plain_s for depth in range(1, self.max_depth + 1))

    def _probe_due(self, num_seqs: int) -> bool:
        bucket = _bucket(num_seqs)
        return (self.cold_steps.get(bucket, 0) >= self.probe_intervals.get(bucket, MIN_PROBE_INTERVAL)
                or bucket not in self.seen_batches)

    def acceptance(self, req_id: str) -> list[float]:
        """``c_1..c_K`` of a request (conditional acceptance per draft position), optimistic by one
        standard error: something little tried looks better than its mean, so the policy tries it
        (and learns) instead of never finding out. ``c_1`` (whether the request drafts at all) by its
        own trials' error, so a good request among hopeless ones gets tried; deeper positions by the
        pooled rate's error: requests are short (a 64-token one verifies ~25 times), so an error from
        their own trials stayed about 0.1 per position for their whole life; multiplied over three
        positions that rated the third draft 1.5x what it returned, and the policy drafted 3 deep
        where 2 was faster (issue 31).

        The pooled prior of ``c_1`` weighs as many trials as the requests seen so far differ
        (:class:`_Spread`): 4 where they differ much (0.9 beside 0.0), up to 400 where they accept
        alike. With the fixed 4, 32 new requests of the demo model (which accept alike, ~0.65) each
        looked 0.24 better than the pool for the first draft, the batch-32 estimate ~20 % above what
        drafting returned, and the policy drafted where k = 0 was 15 % faster until the realized
        rates vetoed it, after every probe again (issue 31)."""
        mine = self.requests.get(req_id, _Acceptance())
        rates = []
        for j in range(self.max_depth):
            pooled = self.pool.hits[j] / self.pool.trials[j]
            trials = mine.trials[j] if j < len(mine.trials) else 0.0
            hits = mine.hits[j] if j < len(mine.hits) else 0.0
            strength = self.spread.prior_strength(pooled) if j == 0 else PRIOR_STRENGTH
            mean = (hits + strength * pooled) / (trials + strength)
            count = trials + strength if j == 0 else self.pool.trials[j]
            rates.append(min(1.0, mean + (mean * (1.0 - mean) / count) ** 0.5))
        return rates

    def _reach_of(self, candidate: Candidate) -> list[float]:
        """``_reach(acceptance(req), max_depth)``, recomputed only after an acceptance observation or a
        finished request (what it depends on). While the policy drafts nothing, nothing is observed,
        and recomputing it for every request every step was most of a cold step's bookkeeping:
        0.12 ms a step at batch 32, ~1 % of the demo model's step (issue 31)."""
        cached = self.reach_cache.get(candidate.req_id)
        if cached is not None and cached[0] == self.version and cached[1] == candidate.max_depth:
            return cached[2]
        reach = _reach(self.acceptance(candidate.req_id), candidate.max_depth)
        self.reach_cache[candidate.req_id] = (self.version, candidate.max_depth, reach)
        return reach

    def _costs_known(self) -> bool:
        return min(self.plain.count, self.verify.count, self.draft.count) >= MIN_OBSERVATIONS

    def stays_cold(self, num_seqs: int) -> bool:
        """Whether the next step of ``num_seqs`` decoding requests is plain for certain, decided
        without candidates (the caller then skips :meth:`depths`; a cold step is counted): the
        policy is cold, no probe of this batch size is due, and its realized rates veto drafting at
        every depth, or :meth:`depths` found it cold at this batch size fewer than
        ``COLD_RECHECK`` steps ago, twice that after two cold findings in a row there, ... up to
        ``MAX_COLD_RECHECK`` (while cold, nothing it weighs moves but the plain fit; re-weighing every
        8th step was still ~0.3 % of the demo model's batch-32 time, a third of what adaptive
        lost to k = 0 there). Building
        candidates and weighing depths 1..K for 32 requests each step cost ~0.1 ms, 1 % of the demo
        model's batch-32 step, where drafting never pays; and a vetoed, cold batch size no longer
        turns warm (up to ``WARM_IDLE_LIMIT`` draft passes that drafted nothing, 0.7 % of a batch-32
        run), as :meth:`depths` let it (issue 31)."""
        if self.warm or not num_seqs or not self._costs_known() or self._probe_due(num_seqs):
            return False
        bucket = _bucket(num_seqs)
        skips = self.cold_skips.get(bucket, 0)
        if skips:
            self.cold_skips[bucket] = skips - 1
        elif not self._vetoed(num_seqs, ANY_DEPTH):
            return False
        self.last_bucket = bucket
        self.cold_steps[bucket] = self.cold_steps.get(bucket, 0) + 1
        self.chosen = self.drafting_steps = 0
        return True

    def depths(self, candidates: list[Candidate], in_flight: int = 0, batch_after: int = 0) -> list[int]:
        """Each candidate's drafts for the next step (0: none); updates the warm/cold state.
        ``batch_after``: the decoding batch the held requests will form (see :meth:`_plain_share`). No
        candidates while cold: a step sent ahead (async scheduling) is in flight with ``in_flight``
        decoding requests, one more cold step at their batch size. (Counted at the bucket of the
        last decision instead, a served replica that went cold during a burst of 12 streams
        counted every later batch-1 step at the burst's batch size: batch 1 never came due for a
        probe, its steps were never weighed again (async scheduling runs while the policy drafts
        nothing, so no step had candidates) and it drafted nothing for thousands of steps; issue 31.)"""
        self.chosen = 0
        if not candidates:
            if not self.warm:
                if in_flight:
                    self.last_bucket = _bucket(in_flight)
                self.cold_steps[self.last_bucket] = self.cold_steps.get(self.last_bucket, 0) + 1
            return []
        num_seqs = len(candidates)
        bucket = self.last_bucket = _bucket(num_seqs)
        room = max(c.max_depth for c in candidates)          # < K: every request near its end
        if not room:                                         # no room for a draft (max_tokens, context)
            if self.warm and not self._short_of_room():
                self.warm_idle += 1
                self.warm = self.warm_idle < WARM_IDLE_LIMIT
            return [0] * num_seqs
        self.exploring = True                                # (the pass after this step is not charged)
        if self.probe_next:                                  # a probe decided on a cold step: its drafts
            depth, self.probe_next = self.probe_next, 0      # come from this (warm) step's pass
            return [min(depth, c.max_depth) for c in candidates]   # (not the fits' rate: not in a ledger)
        if self.plain.count < MIN_OBSERVATIONS:              # explore: plain steps (cache kept warm) first,
            self.warm = True
            return [0] * num_seqs
        if not self._costs_known() or (not self.warm and self._probe_due(num_seqs)):
            if self._costs_known():                          # then drafting steps, at depths 1, 2, ... K in
                self.probe_intervals[bucket] = min(MAX_PROBE_INTERVAL,
                                                   2 * self.probe_intervals.get(bucket, MIN_PROBE_INTERVAL))
                holds = self.probe_intervals[bucket] < MAX_PROBE_INTERVAL    # vetoed depths of this batch
                for depth, ledger in self.realized.get(bucket, {}).items():  # size get retried, from the
                    if depth != 0:                                             # 4th probe on (see
                        ledger.halve(holds)                                    # _Realized.halve)
            self.warm, self.cold_steps[bucket], self.warm_idle = True, 0, 0
            depth = 1 + self.probes % self.max_depth         # turn: fits that saw one depth cannot tell
            self.probes += 1                                 # a fixed cost from a per-draft one
            if self._costs_known():                          # cold: this step kept no hidden states, so
                self.probe_next = depth                      # the probe drafts after the next one
            return [min(depth, c.max_depth) for c in candidates]
        self.exploring = False
        reach = [self._reach_of(c) for c in candidates]                                # prod c_i per depth
        plain_s = self._plain_share(num_seqs, batch_after)
        plain_rate = num_seqs / plain_s
        per_token = max(self._row_s() + self.draft.w[2], 0.0)                         # one more draft token
        floor = per_token * plain_rate                                                 # tokens it must bring
        best_rate, best = DRAFT_MARGIN * plain_rate, [0] * num_seqs
        paying = [_cut(r, len(r), floor) for r in reach]     # reach falls with depth: a cut is a prefix
        for depth in range(1, self.max_depth + 1):
            choice = [min(depth, p) for p in paying]
            if not any(choice):
                continue
            if self._vetoed(num_seqs, max(choice)):
                continue
            rate = self._rate(choice, reach, num_seqs, plain_s)
            if rate > best_rate:
                best_rate, best = rate, choice
        if not any(best) and room < self.max_depth and self._short_of_room():   # the requests' room, not drafting's
            return best                                            # worth, decided this step
        drafting_rate = best_rate if any(best) else self._rate([min(1, c.max_depth) for c in candidates], reach,
                                                                num_seqs, plain_s)
        if any(best):
            self.warm_idle = self.short_steps = 0
        elif self.warm:
            self.warm_idle += 1
        self.warm = any(best) or (drafting_rate >= WARM_MARGIN * plain_rate and self.warm_idle < WARM_IDLE_LIMIT)
        self.cold_steps[bucket] = 0 if self.warm else self.cold_steps.get(bucket, 0) + 1
        streak = self.cold_streak[bucket] = 0 if self.warm else self.cold_streak.get(bucket, 0) + 1
        self.cold_skips[bucket] = 0 if self.warm else min(COLD_RECHECK << (streak - 1), MAX_COLD_RECHECK)
        if any(best):
            if self._realized_ratio(num_seqs, max(best)) is not None:   # it paid where measured: probe soon
                self.probe_intervals[bucket] = MIN_PROBE_INTERVAL        # after it stops (not while a veto
                                                                        # is retried)
            if self._plain_unmeasured(num_seqs):             # the realized rates need plain steps of this
                return [0] * num_seqs                        # batch size to judge drafting: a warm plain one
            self.drafting_steps += 1
            if self.drafting_steps > self._recheck_interval(num_seqs):   # re-measure: alternately a warm plain step
                self.drafting_steps = 0                      # (T(B) current) and one a draft off the best
                self.rechecks += 1                           # depth (the cost fits see two depths)
                if self.rechecks % 2:
                    return [0] * num_seqs
                return [_neighbour(depth, c.max_depth) for depth, c in zip(best, candidates)]
        else:
            self.drafting_steps = 0
        self.chosen = max(best)
        return best

    def _plain_share(self, num_seqs: int, batch_after: int) -> float:
        """Seconds that ``num_seqs`` plain decode tokens are worth: ``T(B)``, or their share of a
        plain step of the ``batch_after`` requests the scheduler holds if that runs at a higher
        rate (``B T(N) / N``). Every request held waits while a step drafts, so drafting must buy
        tokens at the rate of the batch they will decode in, not of the few that decode now: while
        32 prompts of the demo model prefilled beside 2..30 decoding requests, drafting at depth 3
        paid against their own small batch's rate and lost against the batch-32 rate that followed
        (+360 ms of a 1.75 s run, 0.92-0.98x of k = 0; issue 31)."""
        plain_s = max(self.plain.predict([1.0, float(num_seqs), 0.0]), 1e-6)
        if batch_after > num_seqs:
            held_s = max(self.plain.predict([1.0, float(batch_after), 0.0]), 1e-6)
            plain_s = min(plain_s, num_seqs * held_s / batch_after)
        return plain_s

    def _recheck_interval(self, num_seqs: int) -> int:
        """Drafting steps between two re-measuring steps: ``RECHECK_INTERVAL``, four times that
        where drafting was realized to beat plain steps by ``CLEAR_GAIN`` at this batch size. A
        re-measuring step gives up most of a drafting step's gain, and where drafting clearly pays a
        stale plain rate cannot turn the comparison: at batch 1 of the demo model (~22 steps a
        64-token request) one in 17 cost the adaptive policy ~4 % against k = 3 (issue 31)."""
        ratio = self._realized_ratio(num_seqs)
        return RECHECK_INTERVAL * (4 if ratio is not None and ratio >= CLEAR_GAIN else 1)

    def _short_of_room(self) -> bool:
        """A step that drafts nothing because every request is within ``K`` tokens of its end
        (``max_tokens``, the context) leaves the warm/cold state as it is, up to
        ``SHORT_IDLE_LIMIT`` such steps in a row (True), as warm steps that drafted nothing they
        turned the policy cold at the end of every request: the next request's prompt then skipped
        the draft model, its drafts missed the prompt, and served batch-1 decoding on the demo model
        drafted about half as often (issue 31). Past the limit (a stream of requests too short to
        draft) they count as idle warm steps again (False)."""
        if not self.warm or self.short_steps >= SHORT_IDLE_LIMIT:
            return False
        self.short_steps += 1
        return True

    def _vetoed(self, num_seqs: int, depth: int) -> bool:
        """Whether this batch size's realized drafting steps at ``depth``, or at all depths (those
        the fits chose, with the draft pass after each), returned fewer tokens per second than its
        plain ones (both measured, ``LEDGER_MIN`` / ``PLAIN_LEDGER_MIN`` steps; ``LEDGER_VETO`` absorbs the noise of
        ~50 steps), or on fewer steps at a wider margin (:meth:`_brief_ratio`): the fits' estimate
        is then wrong somewhere, and what was measured wins. Each probe of the batch size halves
        what its drafting steps returned (:meth:`_Realized.halve`) and adds its own step, so a
        vetoed depth is retried after 64, 128, ... 1024 cold steps (at that batch size)."""
        return any(ratio is not None and ratio < LEDGER_VETO
                   for ratio in (self._realized_ratio(num_seqs, depth), self._realized_ratio(num_seqs, ANY_DEPTH))) \
            or self._brief_ratio(num_seqs) < BRIEF_VETO

    def _brief_ratio(self, num_seqs: int) -> float:
        """Realized drafting / plain tokens per second at this batch size on fewer steps than a veto
        needs (``BRIEF_DRAFTING_MIN`` drafting, ``BRIEF_PLAIN_MIN`` plain; infinite with fewer), held to the
        wider margin ``BRIEF_VETO``. A batch size a run passes through in 2-3 steps (the demo
        benchmark's batch-32 runs end at 16..8 requests) gathers ``LEDGER_MIN`` of each kind over many
        runs or never: there the fits rated depth 3 at 1.12-1.14x, 14 realized drafting steps read
        0.90x of 6 plain ones, and every run drafted its tail, ~2 % of its time (issue 31)."""
        ledger = self.realized.get(_bucket(num_seqs), {})
        drafting, plain = ledger.get(ANY_DEPTH), ledger.get(0)
        if (drafting is None or plain is None or drafting.count < BRIEF_DRAFTING_MIN or plain.count < BRIEF_PLAIN_MIN
                or drafting.charges < BRIEF_EPISODES):
            return float("inf")
        return drafting.rate() / max(plain.rate(), 1e-9)

    def _plain_unmeasured(self, num_seqs: int) -> bool:
        """Whether this batch size has ``LEDGER_MIN`` realized drafting steps but fewer than
        ``PLAIN_LEDGER_MIN`` plain decode steps, so that the realized rates cannot judge drafting
        yet. While the fits keep choosing to draft, plain steps come only as every 34th (a
        re-measuring step): at batch 32 of the demo model the policy drafted for whole runs at 0.62x
        of its plain rate with no veto, for want of plain steps to compare with (issue 31). The plain
        steps taken for it give up a drafting step's gain each: 16 of them (the first version) cost
        a batch-8 run of the demo model ~10 %, and plain steps, whose yield no acceptance varies,
        need fewer to measure."""
        ledger = self.realized.get(_bucket(num_seqs), {})
        drafting, plain = ledger.get(ANY_DEPTH), ledger.get(0)
        return (drafting is not None and drafting.count >= LEDGER_MIN
                and (plain is None or plain.count < PLAIN_LEDGER_MIN))

    def _realized_ratio(self, num_seqs: int, depth: int = ANY_DEPTH) -> float | None:
        """Realized tokens per second of drafting at ``depth`` (``ANY_DEPTH``: every drafting step)
        over plain steps at this batch size; None until there are ``LEDGER_MIN`` drafting and
        ``PLAIN_LEDGER_MIN`` plain steps."""
        ledger = self.realized.get(_bucket(num_seqs), {})
        plain = ledger.get(0)
        if plain is None or plain.count < PLAIN_LEDGER_MIN:
            return None
        drafting = ledger.get(depth)
        if drafting is None or drafting.count < LEDGER_MIN:
            return None
        return drafting.rate() / max(plain.rate(), 1e-9)

    def _row_s(self) -> float:
        """Seconds a verified draft adds to a step: the verify fit's ``v``, but no less than the
        plain fit's ``b``, what one more decoding request adds to a plain step (a verified draft is
        one more query row of the same kind). Fitted over a run's batch sizes, ``v`` averages cheap
        rows of small batches with dear ones of large ones: at batch 32 of the demo model it read
        0.16 ms a row where a verify step of 32 x 2 drafts paid 0.30 ms a row (``b``: 0.23 ms), and
        the policy drafted there at 0.92-0.97x of k = 0 (issue 31). On a GPU at small batches ``b``
        is small (decode is memory-bound), and so is the floor. Only where the plain steps' batch
        sizes varied (``MIN_BATCH_SPREAD``) does ``b`` measure anything: at a steady batch of 1 the
        fit splits ``T(1)`` between ``a`` and ``b``, and a floor of ``T(1) / 2`` a row stopped all
        drafting at batch 1."""
        if self.plain.spread(1) < MIN_BATCH_SPREAD:
            return self.verify.w[1]
        return max(self.verify.w[1], self.plain.w[1])

    def _rate(self, choice: list[int], reach: list[list[float]], num_seqs: int, plain_s: float,
              prompt_tokens: int = 0) -> float:
        """Expected tokens per second of a step drafting ``choice`` (per request), whose draft pass
        also writes ``prompt_tokens`` prompt entries."""
        tokens = sum(1.0 + sum(r[:d]) for r, d in zip(reach, choice))
        extra = sum(choice)
        depth = max(choice)
        chain_rows = sum(sum(1 for d in choice if d > step) for step in range(1, depth))
        entries = num_seqs + sum(sum(r[:d]) for r, d in zip(reach, choice)) + prompt_tokens
        seconds = (plain_s + max(self.verify.w[0] + self._row_s() * extra, 0.0)
                   + max(self.draft.predict([1.0, float(depth), float(chain_rows), entries]), 0.0))
        return tokens / max(seconds, 1e-6)


def _reach(rates: list[float], max_depth: int) -> list[float]:
    """``P(draft j accepted) = prod_{i<=j} c_i`` for ``j = 1..max_depth``."""
    out, prob = [], 1.0
    for rate in rates[:max_depth]:
        prob *= rate
        out.append(prob)
    return out


def _cut(reach: list[float], depth: int, floor: float) -> int:
    """The deepest ``j <= depth`` whose acceptance chance still pays for a draft token."""
    best = 0
    for j, prob in enumerate(reach[:depth]):
        if prob >= floor:
            best = j + 1
    return best


def _neighbour(depth: int, max_depth: int) -> int:
    """A re-measuring step's depth beside ``depth``: one shallower, or from depth 1 one deeper."""
    if depth > 1:
        return depth - 1
    return min(depth + 1, max_depth) if depth else 0


def _bucket(num_seqs: int) -> int:
    """Batch sizes 1, 2, 3-4, 5-8, ... share a bucket (costs scale smoothly in between)."""
    return max(0, num_seqs - 1).bit_length()


def make_policy(name: str, max_depth: int) -> FixedPolicy:
    """``--speculative-policy``: ``"adaptive"`` or ``"fixed"``.

    Raises:
        ValueError: another name.
    """
    if name == "adaptive":
        return AdaptivePolicy(max_depth)
    if name == "fixed":
        return FixedPolicy(max_depth)
    raise ValueError(f"--speculative-policy must be 'adaptive' or 'fixed', got {name!r}")
