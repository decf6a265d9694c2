"""Lower bounds on a step's makespan: how far a plan can be from the best possible layout.

Every plan carries :class:`StepBound`: the mean rank cost, the costliest sample, and the
largest of several bounds that no feasible layout can beat. A plan's ``gap`` is its makespan
over that bound, minus one; ``0`` proves the plan optimal. A step is *outlier-bound* when one
sample costs more than the mean rank cost: its rank is slower than average whatever the
planner does, so a large spread between ranks is then the data's, not the planner's.

The bounds, and why none exceeds the optimum (the makespan of the best feasible layout). Let
``R`` ranks hold ``B`` bins each, costs be non-negative and a rank's cost the sum of its
samples' costs (additive models; see the last point otherwise).

1. **Mean** ``sum(c) / R``: the ranks' costs add up to the total, so the largest is at least
   their mean.
2. **Largest sample** ``max(c)``: the rank holding it costs at least that much.
3. **Pigeonhole** ``max over k >= 1`` of the sum of the ``k + 1`` cheapest among the
   ``k * R + 1`` costliest samples: ``k * R + 1`` samples on ``R`` ranks put ``k + 1`` of them
   on one rank, which costs at least the ``k + 1`` cheapest of them.
4. **Non-empty bins and capacity**, for each of the few costliest samples ``i`` (any subset of
   samples gives a valid bound, so bounding only some of them is safe): the rank ``r`` that
   holds ``i`` has ``B`` non-empty bins, so it holds at least ``B - 1`` other samples, which
   cost at least the ``B - 1`` cheapest others. And the other ``R - 1`` ranks hold at most
   ``(R - 1) * B * seq_len`` tokens, so ``r`` holds at least
   ``need = total_tokens - (R - 1) * B * seq_len`` tokens, i.e. others worth at least
   ``need - tokens[i]``. The cheapest set of other samples with that many tokens costs at
   least the optimum of the *fractional* covering problem (take samples in ascending order of
   cost per token, the last one in part): the integral choice is one of the fractional
   problem's feasible points. So ``load[r] >= c[i] + max(cheapest B - 1, fractional cover)``.
   The capacity half needs every bin to fit ``seq_len``; a step with an oversized sample
   (allowed alone in a bin by ``oversized_policy="single"``) skips it.
5. **Heavy ranks and tokens** (cost and tokens together). Take the *heavy* samples, those
   costing more than a threshold (``_HEAVY_SHARES`` of the bounds above; each gives a set,
   and the best of them counts), ``k <= R`` of them, and a makespan ``M`` below the sum of
   the two cheapest heavy samples: no rank holds two, so ``k`` distinct ranks hold one
   each. Those ranks have ``k·M - Σ c_heavy`` cost and ``k·B·seq_len - Σ t_heavy`` tokens
   left for the other samples, the other ``R - k`` ranks ``(R - k)·M`` and
   ``(R - k)·B·seq_len``. Summing each group's capacities and letting samples split between
   the groups (both only relax the problem), a layout of makespan ``M`` needs a share of
   the other samples on the heavy ranks whose tokens ``T`` and cost ``C`` fit both groups'
   room. For a given ``T`` the shares reach exactly the costs from ``f(T)`` (cheapest per
   token first) to ``g(T)`` (dearest first), both piecewise linear, so testing ``M`` is two
   look-ups in prefix sums. The test only gets easier as ``M`` grows; the bound is the
   largest ``M`` a bisection saw fail, below the least that passes (to ``1e-10`` of it) and
   at most the cap. The compiled core computes it (``_bound.c``). It is what makes steps
   with many samples of nearly a rank's cost hard: their ranks have tokens to spare and no
   cost room, the others cost room and no tokens to spare, so the short cheap samples must
   go to the heavy ranks. Like bound 4 it needs every bin to fit ``seq_len``.
6. Cost models whose rank cost is not a sum (``ComponentCost(reduce="max")``) get 1 and 2
   only, in their own units: the mean is the cost of all samples on one rank divided by
   ``R`` (each component's sum is spread over ``R`` ranks), and a sample's scalar cost is what
   it alone costs its rank (components only add up, so the rank costs at least that).

Costs enter in the planner's canonical order and every sum is a numpy reduction over arrays
in that order, so the bound is a pure function of the step like the plan itself. Bounds 3 and
4 take differences of prefix sums, which may round up by a few units in the last place; they
are scaled down by :data:`_ROUNDING` so that rounding can never lift them above the optimum;
bound 5 is too, and its test counts a makespan as feasible within the same margin.

**Lockstep and windows** (additive costs, from arrays: :func:`lockstep_lower_bound`,
:func:`window_lower_bound`). A lockstep step costs ``Σ_b max_r cost(r, b)``, at least its
makespan, so every makespan bound holds for it. Besides, let ``m_1 ≥ … ≥ m_P`` be the maxima of
the ``P = B`` positions (``R`` bins each), sorted:

* **Alone.** Sort the samples that need a bin of their own (longer than half of ``seq_len``, or
  oversized) by cost, descending, ``h_1 ≥ h_2 ≥ …``. The bins at positions ``k..P`` cost at
  most ``m_k`` and positions ``1..k-1`` hold only ``(k-1)·R`` bins, so ``m_k ≥
  h_{(k-1)R+1}``; likewise at most ``q`` samples longer than ``seq_len / (q + 1)`` share a
  bin, so ``m_k`` is at least the ``(q·(k-1)·R + 1)``-th costliest of them (``q`` up to 4);
  and ``m_1`` is at least the costliest sample. Call the largest of these ``a_k``.
* **Positions fill up.** Positions ``1..k-1`` hold at most ``(k-1)·R·seq_len`` tokens, so the
  other positions hold the rest, ``τ_k = total tokens - (k-1)·R·seq_len``, which cost at least
  the cheapest fractional cover of ``τ_k`` tokens (samples by cost per token, ascending, the
  last one in part; as in bound 4). Those positions' ``R`` bins each cost at most their
  maximum, so ``X_k = cover(τ_k) / R ≤ m_k + … + m_P``; and ``m_k`` is at least their mean,
  ``X_k / (P - k + 1)``, which every earlier ``m_j`` is too. Hence, for every ``k``,
  ``Σ m ≥ Σ_{j<k} max(a_j, X_k / (P-k+1)) + max(X_k, Σ_{j≥k} a_j)``; ``k = 1`` is the mean
  and the alone bound. This is what makes a step with a few long samples and full bins costly
  under lockstep: the long samples' position cannot also absorb the short ones' cost, having
  no tokens to spare. Like bound 4 it needs every bin to fit ``seq_len``.

A window of ``W`` steps is the same argument over ``W`` groups of ``R·B`` bins (makespan: each
step's slowest rank holds at least its costliest sample) or ``W·B`` positions of ``R`` bins
(lockstep); and the sum of the steps' costs is at least the total over ``R`` (bound 1) and the
costliest sample (bound 2).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from evenflow.engine._planning import native
from evenflow.engine._planning.problem import BalanceProblem

__all__ = [
    "StepBound",
    "lockstep_lower_bound",
    "makespan_lower_bound",
    "outlier_bound",
    "step_bound",
    "window_lower_bound",
]

# Bound 4 is computed for this many of the costliest samples (each costs O(num_samples)).
_CAPACITY_CANDIDATES = 4
# Relative safety margin for bounds computed from differences of prefix sums.
_ROUNDING = 1e-9
# Bound 5: the heavy sets tried, the samples above these shares of the other bounds (no one
# share is best on every step of the planner benchmark).
_HEAVY_SHARES = (0.5, 0.6, 0.7, 0.8, 0.9)
# Lockstep: the position bound counts samples that at most 1, 2, ... this many share a bin.
_SHARED_BINS = 4


@dataclass(frozen=True, slots=True)
class StepBound:
    """What no layout of the step can beat, and why (see the module docstring).

    ``lower_bound``: the largest of the proven bounds (cost-model units). ``mean_cost``: the
    mean rank cost (total / ranks). ``largest_cost``: the costliest sample. ``outlier_bound``:
    ``largest_cost > mean_cost``.
    """

    lower_bound: float
    mean_cost: float
    largest_cost: float

    @property
    def outlier_bound(self) -> bool:
        return self.largest_cost > self.mean_cost


def step_bound(problem: BalanceProblem, *, upper: float | None = None) -> StepBound:
    """The lower bounds of ``problem``'s makespan (see the module docstring). ``upper``: the
    makespan of a feasible layout, if one is at hand (the plan's), which bound 5 needs not
    search past; it changes the bound by at most that search's resolution."""
    costs = np.asarray(problem.costs, dtype=np.float64)
    num_ranks = problem.num_ranks
    if costs.size == 0:
        return StepBound(0.0, 0.0, 0.0)
    largest = float(costs.max())
    if problem.rank_cost_fn is not None:
        everything = problem.rank_costs_of(np.zeros(costs.size, dtype=np.int64))
        mean = float(everything[0]) / num_ranks
        return StepBound(max(mean, largest), mean, largest)
    mean = float(costs.sum()) / num_ranks
    derived = max(_pigeonhole(costs, num_ranks), _capacity(problem, costs)) * (1.0 - _ROUNDING)
    bound = max(mean, largest, derived)
    heavy = _heavy_ranks(problem, costs, bound, upper) * (1.0 - _ROUNDING)
    return StepBound(max(bound, heavy), mean, largest)


def _pigeonhole(costs: np.ndarray, num_ranks: int) -> float:
    """Bound 3: the ``k + 1`` cheapest of the ``k * R + 1`` costliest, best ``k``."""
    n = costs.size
    top_k = (n - 1) // num_ranks
    if top_k < 1:
        return 0.0
    ordered = np.sort(costs)[::-1]
    prefix = np.concatenate([[0.0], np.cumsum(ordered)])
    k = np.arange(1, top_k + 1, dtype=np.int64)
    last = k * num_ranks  # index of the (k R + 1)-th costliest
    sums = prefix[last + 1] - prefix[last - k]
    return float(sums.max())


def _capacity(problem: BalanceProblem, costs: np.ndarray) -> float:
    """Bound 4 for the few costliest samples (0 when it does not apply)."""
    n = costs.size
    per = problem.bins_per_rank
    seq_len = problem.constraints.seq_len
    tokens = np.asarray(problem.tokens, dtype=np.int64)
    others_needed = per - 1
    capacity_applies = bool(tokens.max() <= seq_len) and problem.num_ranks > 1
    need = int(tokens.sum()) - (problem.num_ranks - 1) * per * seq_len
    if others_needed == 0 and (not capacity_applies or need <= 0):
        return 0.0
    count = min(_CAPACITY_CANDIDATES, n)
    candidates = _extreme(costs, count, largest=True)
    cheapest = _extreme(costs, min(others_needed + 1, n), largest=False)
    cover_needed = capacity_applies and need - int(tokens[candidates].min()) > 0
    if cover_needed:
        density_order = np.lexsort((np.arange(n), costs / tokens))
        dens_tokens = np.concatenate([[0], np.cumsum(tokens[density_order])])
        dens_costs = np.concatenate([[0.0], np.cumsum(costs[density_order])])
        position = np.empty(n, dtype=np.int64)
        position[density_order] = np.arange(n, dtype=np.int64)
    best = 0.0
    for i in candidates.tolist():
        count_part = 0.0
        if others_needed:
            picked = cheapest[cheapest != i][:others_needed]
            count_part = float(costs[picked].sum()) if picked.size == others_needed else 0.0
        cover_part = 0.0
        want = need - int(tokens[i])
        if cover_needed and want > 0:
            cover_part = _fractional_cover(
                want,
                skip=int(position[i]),
                skip_tokens=int(tokens[i]),
                skip_cost=float(costs[i]),
                prefix_tokens=dens_tokens,
                prefix_costs=dens_costs,
            )
        best = max(best, float(costs[i]) + max(count_part, cover_part))
    return best


def _heavy_ranks(
    problem: BalanceProblem, costs: np.ndarray, floor: float, upper: float | None
) -> float:
    """Bound 5, the best over the heavy sets ``_HEAVY_SHARES`` of ``floor`` (the other
    bounds) define, computed by the compiled core; 0 when it does not apply or proves
    nothing above ``floor``."""
    tokens = np.asarray(problem.tokens, dtype=np.int64)
    seq_len = problem.constraints.seq_len
    if problem.num_ranks < 2 or floor <= 0.0 or costs.max() <= _HEAVY_SHARES[0] * floor:
        return 0.0
    if int(tokens.max()) > seq_len or costs.min() < 0.0:
        return 0.0
    density = costs / np.maximum(tokens, 1)
    density[tokens == 0] = np.inf
    return native.heavy_bound(
        costs,
        tokens,
        np.argsort(density, kind="stable"),
        np.multiply(_HEAVY_SHARES, floor),
        num_ranks=problem.num_ranks,
        bins_per_rank=problem.bins_per_rank,
        seq_len=seq_len,
        floor=floor,
        upper=upper,
    )


def _extreme(costs: np.ndarray, count: int, *, largest: bool) -> np.ndarray:
    """Indices of the ``count`` costliest (or cheapest) samples, ties to the lowest index,
    in that order: O(n) selection, then a sort of the few selected."""
    n = costs.size
    key = -costs if largest else costs
    if count < n:
        level = np.partition(key, count - 1)[count - 1]
        pool = np.flatnonzero(key <= level)
    else:
        pool = np.arange(n)
    picked = pool[np.lexsort((pool, key[pool]))]
    return picked[:count]


def _fractional_cover(
    want: int,
    *,
    skip: int,
    skip_tokens: int,
    skip_cost: float,
    prefix_tokens: np.ndarray,
    prefix_costs: np.ndarray,
) -> float:
    """Least cost of ``want`` tokens taken fractionally by ascending cost per token, without
    the sample at position ``skip`` of that order; infinite demand is impossible (the step
    holds the tokens), so the samples always suffice."""

    def prefix_without(j: int) -> tuple[int, float]:
        # Tokens and cost of the first j samples of the order, the skipped one left out.
        t, c = int(prefix_tokens[j]), float(prefix_costs[j])
        if j > skip:
            t -= skip_tokens
            c -= skip_cost
        return t, c

    # Smallest j whose prefix (without the skipped sample) reaches want tokens (the last
    # index if none does): up to the skipped position the prefix is prefix_tokens[j], past
    # it prefix_tokens[j] - skip_tokens, and both parts are sorted.
    j = int(np.searchsorted(prefix_tokens[: skip + 1], want, side="left"))
    if j > skip:
        j = int(np.searchsorted(prefix_tokens, want + skip_tokens, side="left"))
    j = min(j, prefix_tokens.size - 1)
    if j == 0:
        return 0.0
    t_before, c_before = prefix_without(j - 1)
    # Sample j-1 of the order (never the skipped one: its prefix step adds no tokens, so the
    # search never stops on it) supplies the rest, at its own cost per token.
    t_last = int(prefix_tokens[j] - prefix_tokens[j - 1])
    c_last = float(prefix_costs[j] - prefix_costs[j - 1])
    if t_last == 0:
        return c_before
    return c_before + c_last * (want - t_before) / t_last


# -- from arrays: lockstep steps and windows (see the module docstring) -----------------------


def makespan_lower_bound(costs: np.ndarray, num_ranks: int) -> float:
    """Bounds 1 and 2 of :func:`step_bound` from costs alone (no problem at hand); 0 if empty."""
    values = np.asarray(costs, dtype=np.float64)
    if values.size == 0:
        return 0.0
    return max(math.fsum(values.tolist()) / num_ranks, float(values.max()))


def _alone_bound(
    costs: np.ndarray, tokens: np.ndarray, seq_len: int, per_group: int, num_groups: int
) -> float:
    """``Σ_k h_{(k-1)·per_group + 1}`` over ``num_groups`` groups (see the module docstring)."""
    alone = np.asarray(costs, dtype=np.float64)[2 * np.asarray(tokens) > seq_len]
    if alone.size == 0:
        return 0.0
    ordered = -np.sort(-alone)
    return math.fsum(ordered[::per_group][:num_groups].tolist())


def _positions_bound(
    costs: np.ndarray, tokens: np.ndarray, seq_len: int, per_group: int, num_groups: int
) -> float:
    """The lockstep bound over ``num_groups`` positions of ``per_group`` bins (see the module
    docstring: the alone samples and the tokens positions leave to the others)."""
    values = np.asarray(costs, dtype=np.float64)
    lengths = np.asarray(tokens, dtype=np.int64)
    if values.size == 0:
        return 0.0
    a = np.zeros(num_groups, dtype=np.float64)
    for most in range(1, _SHARED_BINS + 1):
        # Samples longer than seq_len / (most + 1): at most `most` of them share a bin.
        long = -np.sort(-values[(most + 1) * lengths > seq_len])
        picked = long[:: most * per_group][:num_groups]
        a[: picked.size] = np.maximum(a[: picked.size], picked)
    a[0] = max(a[0], float(values.max()))
    # X_k for k = 1..P: the cheapest cover of the tokens the first k - 1 positions cannot hold.
    covers = np.zeros(num_groups, dtype=np.float64)
    covers[0] = math.fsum(values.tolist()) / per_group
    if num_groups > 1 and int(lengths.max()) <= seq_len:
        has = lengths > 0
        density = values[has] / lengths[has]
        order = np.argsort(density, kind="stable")
        cum_tok = np.cumsum(lengths[has][order])
        cum_cost = np.cumsum(values[has][order])
        need = int(lengths.sum()) - np.arange(num_groups, dtype=np.int64) * per_group * seq_len
        for k in range(1, num_groups):
            if need[k] <= 0:
                break
            j = int(np.searchsorted(cum_tok, need[k]))  # the sample that completes the cover
            before_tok = int(cum_tok[j - 1]) if j else 0
            before_cost = float(cum_cost[j - 1]) if j else 0.0
            part = (need[k] - before_tok) * float(density[order[j]])
            covers[k] = (before_cost + part) * (1.0 - _ROUNDING) / per_group
    best = 0.0
    for k in range(num_groups):
        level = covers[k] / (num_groups - k)
        head = math.fsum(np.maximum(a[:k], level).tolist())
        tail = max(float(covers[k]), math.fsum(a[k:].tolist()))
        best = max(best, head + tail)
    return best


def lockstep_lower_bound(
    costs: np.ndarray,
    tokens: np.ndarray,
    num_ranks: int,
    bins_per_rank: int,
    seq_len: int,
    *,
    makespan_bound: float = 0.0,
) -> float:
    """No layout of these samples has a lower ``Σ_b max_r``; ``makespan_bound``: a proven
    bound on the step's makespan (:func:`step_bound`), which bounds it too."""
    return max(
        makespan_bound,
        makespan_lower_bound(costs, num_ranks),
        _positions_bound(costs, tokens, seq_len, num_ranks, bins_per_rank),
    )


def window_lower_bound(
    costs: np.ndarray,
    tokens: np.ndarray,
    *,
    num_ranks: int,
    bins_per_rank: int,
    num_steps: int,
    seq_len: int,
    objective: str,
) -> float:
    """No layout of a window's samples into ``num_steps`` steps has a lower sum of step costs
    (``objective``: ``"makespan"`` or ``"lockstep"``, the step cost being summed)."""
    base = makespan_lower_bound(costs, num_ranks)
    if objective == "lockstep":
        alone = _positions_bound(costs, tokens, seq_len, num_ranks, num_steps * bins_per_rank)
    else:
        alone = _alone_bound(costs, tokens, seq_len, num_ranks * bins_per_rank, num_steps)
    return max(base, alone)


def outlier_bound(costs: np.ndarray, num_ranks: int) -> bool:
    """Whether the costliest sample costs more than the mean rank (see :class:`StepBound`)."""
    values = np.asarray(costs, dtype=np.float64)
    if values.size == 0:
        return False
    return float(values.max()) > math.fsum(values.tolist()) / num_ranks
