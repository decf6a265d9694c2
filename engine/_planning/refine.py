"""The default balancing algorithm: the best of several starts, then bounded local search.

Why not just the greedy: LPT (``lpt``) is good when bins have room, but when the source packs
bins to ~100% (best-fit-decreasing sources do) a long sample late in its order fits nowhere,
the run dead-ends and the step keeps its source layout, however unbalanced. This algorithm
never dead-ends and is never worse than either of them:

1. **Starts.** The source layout, the LPT layout (when it exists) and a bin-level LPT of the
   source bins (whole source bins dealt to ranks heaviest first; always feasible because the
   bins are). The best start under the problem's objective is searched from; small problems
   search from every start.
2. **Local search** on the scalar sample costs, always working on the most loaded rank ``a``
   against the lightest ranks ``b``. A change moves a net cost ``d`` from ``a`` to ``b``; it
   is accepted only when ``0 < d < load[a] - load[b]``, i.e. when both ranks end strictly
   below ``load[a]``. That condition strictly lowers the pair's maximum *and* the sum of
   squared loads, so the search improves lexicographically (the maximum, then the spread)
   and cannot cycle; ties at the maximum still make progress because the next tied rank is
   worked on next. Families, cheapest first: moving one sample to a bin with room, exchanging
   two whole bins, swapping two samples, and exchanging one sample for a run of samples of
   another bin with a compatible token total (what still works when every bin is full and
   costs are convex in length: one long sample for several short ones of the same length is
   a cost reduction at equal tokens); last, a move made possible by first shifting one of
   the partner's samples to another of its bins (costly, and it rarely succeeds, so it waits
   until the others fail; not tried under packing budgets). The families look at the 4
   lightest ranks; before giving up on ``a``, moves and run exchanges look at the next 32
   (at 256 ranks the partner with a fitting run is often past the fourth). Every candidate
   is checked against ``seq_len``, the packing budgets, the oversized rule (an oversized
   sample stays alone) and non-empty bins.
3. **Final choice**: the best of the searched layout, the source and LPT under the problem's
   own objective (``problem.score``), so the result is never worse than either even when the
   objective is not what the search optimises (``balance``, or a component cost model whose
   rank cost is not a sum).
4. **Second phase** (``polish.py``), when the first stops above the bound: moves to the least
   loaded rank with room anywhere in the group, and one sample for any subset of a partner
   bin (one bin per rank); alternated with the first phase while it finds changes. Multi-bin
   steps also start from whole bins split by Karmarkar-Karp differencing (``kk.py``).
5. **Finish**: the best layout is settled (ranks and bins relabelled towards the source,
   samples sent home where the makespan allows: ``settle.py``; settling can lower a
   makespan). Under the makespan objective the search is then run from the source layout,
   stopping as soon as it is as good as the best: LPT, dealt and differenced bins start from
   scratch and move nearly every sample, a search from the source only what balance needs,
   so when it gets there it is the plan (settled plainly, then thoroughly). Otherwise the
   other starts within 0.1% of the best are settled too (LPT, the greedy sample LPT, KK over
   bins), the best score wins, among equal scores the layout that moves fewest samples, and
   it is settled again, thoroughly. Where ranks hold few samples, a second search from the
   source, with more attempts, aims at that final score and replaces the layout when it
   moves fewer samples.

What runs, in which order and with which budget, is data: ``schedule.DEFAULT`` (starts, the
search's phases, the finalists and the finish's stages), which :meth:`RefineAlgorithm.assign`
runs; ``schedule.py`` also holds every tuning constant with its measurement.

Under the ``lockstep`` objective the same algorithm runs the method of ``lockstep.py``: it
balances the step as ``R·B`` one-bin ranks with the steps above, deals the bins into positions
by cost and searches position by position (see that module).

Budget: the search stops after ``max_iterations`` improvement attempts (by default
proportional to the number of samples) or when the most loaded rank admits no improving
change (``makespan``) / no rank does (``balance``). Deterministic: no randomness, ties go to
the lowest index, and the budget counts attempts, never time.

One implementation: the search runs in the compiled core (``native.py``, driven by
``search.py``), with or without packing budgets; ``tests/oracles/planning.py`` holds its
specification as whole-array numpy expressions, and tests hold the two to identical layouts.
Every tuning constant and budget is in ``schedule.py`` (the core's are listed there with the
rule that they must match their ``#define``).

Limits: moves are between two ranks at a time (no ejection chains), runs in one-for-many
exchanges are contiguous in token order within a bin, and the search optimises the sum of
scalar sample costs, which is only a proxy when a component cost model takes the maximum of
its components.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from evenflow.engine._planning import schedule
from evenflow.engine._planning.kk import deal_bins, kk_bins
from evenflow.engine._planning.lockstep import lockstep_assign
from evenflow.engine._planning.lpt import lpt_layout, sample_lpt_layout
from evenflow.engine._planning.objectives import lockstep, makespan
from evenflow.engine._planning.polish import polish
from evenflow.engine._planning.problem import (
    BalanceProblem,
    FlatLayout,
    _flatten,
    first_infeasible_bin,
)
from evenflow.engine._planning.search import search
from evenflow.engine._planning.settle import Settler
from evenflow.engine._validate import check_optional_int

__all__ = ["RefineAlgorithm"]


class RefineAlgorithm:
    """Best of source, LPT and bin-level LPT, then capacity-aware local search (the default).

    ``max_iterations`` bounds the number of improvement attempts; ``None`` uses 256 for tiny
    problems and ``num_samples // 120`` within [6, 512] otherwise. See the module documentation for
    the method and its guarantees: its objective is never above that of the source layout or
    of :class:`LPTAlgorithm`.
    """

    name = "refine"
    algorithm_id = "refine-v15"

    def __init__(self, *, max_iterations: int | None = None) -> None:
        self.max_iterations = check_optional_int("max_iterations", max_iterations, minimum=0)

    def __repr__(self) -> str:
        return f"RefineAlgorithm(max_iterations={self.max_iterations!r})"

    def assign(self, problem: BalanceProblem) -> Sequence[Sequence[int]] | None:
        """The refined layout (a ``FlatLayout``), or ``None`` when nothing beats the source."""
        if problem.objective is lockstep:
            return lockstep_assign(problem, self.assign)
        if problem.num_ranks < 2:
            return None
        return self._run(problem, schedule.DEFAULT)

    def _run(self, problem: BalanceProblem, sched: schedule.Schedule) -> FlatLayout | None:
        """Run ``sched`` (see :class:`~evenflow.engine._planning.schedule.Schedule`)."""
        # Layouts travel as (flat, sizes) arrays, each scored once: at 100,000 samples a pass
        # over nested lists costs ~10 ms, more than a dozen compiled search attempts.
        source = FlatLayout(*_flatten(problem.source_bins))
        made: dict[str, int] = {}  # start name -> its index in starts
        starts: list[FlatLayout] = []
        specs: list[schedule.Start] = []
        for start in sched.starts:
            if start.several_bins and problem.bins_per_rank == 1:
                continue
            layout = self._start(problem, start.name, source)
            if layout is not None:
                made[start.name] = len(starts)
                starts.append(layout)
                specs.append(start)
        scores = [_score_of(problem, problem.ranks_of(s)) for s in starts]
        budget = self._budget(problem, sched.search)
        tiny = problem.num_samples <= sched.multi_start_samples
        if tiny:
            origins = starts
        else:
            eligible = [k for k, spec in enumerate(specs) if spec.origin]
            origins = [starts[min(eligible, key=scores.__getitem__)]]
        # Same candidates, order and strict comparison as scoring every layout afresh: the
        # searched layouts first, then the other starts; ties keep the earlier one.
        candidates: list[tuple[FlatLayout, float]] = []
        for origin in origins:
            layout, rank_of = self._phases(problem, origin, budget, sched.search)
            candidates.append((layout, _score_of(problem, rank_of)))
        late = [k for k, spec in enumerate(specs) if not (tiny or spec.origin)]
        reached = min(score for _, score in candidates)
        searched_late = problem.num_samples <= sched.late_search_samples
        if late and searched_late and min(scores[k] for k in late) < reached:
            # A start that is no origin beat every searched layout: search from it too.
            origin = starts[min(late, key=scores.__getitem__)]
            layout, rank_of = self._phases(problem, origin, budget, sched.search)
            candidates.append((layout, _score_of(problem, rank_of)))
        candidates.extend(zip(starts[1:], scores[1:], strict=True))
        best_layout: FlatLayout | None = None
        best_score = scores[0]
        for layout, score in candidates:
            if score < best_score and _budgets_hold(problem, layout):
                # The budget replay is exact where incremental sums may round.
                best_layout, best_score = layout, score
        if best_layout is None:
            return None
        finalists = [best_layout]
        for name in sched.close_starts:
            k = made.get(name, -1)
            if k >= 0 and starts[k] is not best_layout and scores[k] <= best_score * sched.close:
                # Settling may lower a layout's makespan (a sample sent home can leave the
                # most loaded rank), so a start settled could end below the best one settled.
                finalists.append(starts[k])
        return self._finish(problem, source, finalists, sched.finish)

    def _start(self, problem: BalanceProblem, name: str, source: FlatLayout) -> FlatLayout | None:
        if name == "source":
            return source
        if name == "lpt":
            return self._greedy(problem)
        if name == "sample lpt":
            return self._sample_greedy(problem)
        if name == "dealt bins":
            return deal_bins(problem, source)
        if name == "kk bins":
            return kk_bins(problem, source)
        raise ValueError(f"The schedule names an unknown start {name!r}.")

    def _budget(self, problem: BalanceProblem, search: schedule.Search) -> int:
        if search.budget is not None:
            return search.budget(problem)
        if self.max_iterations is not None:
            return self.max_iterations
        return schedule.default_budget(problem)

    def _phases(
        self,
        problem: BalanceProblem,
        origin: FlatLayout,
        budget: int,
        search: schedule.Search,
        *,
        stop_at: float | None = None,
    ) -> tuple[FlatLayout, np.ndarray]:
        return self._refine(
            problem,
            origin,
            budget,
            stop_at=stop_at,
            rounds=search.rounds(problem),
            knapsack=search.knapsack,
        )

    def _finish(
        self,
        problem: BalanceProblem,
        source: FlatLayout,
        finalists: list[FlatLayout],
        stages: tuple[schedule.Stage, ...],
    ) -> FlatLayout:
        """Run the finish ``stages`` on the finalists: settles, searches from the source (which
        change only what balance needs, whereas LPT and dealt bins start from scratch and move
        nearly every sample) and the choice among them; the chosen layout, settled."""
        settler = Settler(problem, source.flat, source.sizes)
        score, moved = settler.score_of, settler.moved_of
        thorough = {"plain": False, "thorough": True}
        layouts = list(finalists)
        scores = [score(lay) for lay in layouts]
        chosen = layouts[0]
        for stage in stages:
            if isinstance(stage, schedule.Settle) and stage.what == "finalists":
                wide = thorough[stage.how]
                # A finalist an earlier stage settled plainly is not settled again.
                layouts = [
                    f if f.settled and not wide else settler.settled(f, thorough=wide)
                    for f in layouts
                ]
                scores = [score(lay) for lay in layouts]
            elif isinstance(stage, schedule.Settle) and stage.what == "best":
                k = scores.index(min(scores))
                layouts[k] = settler.settled(layouts[k], thorough=thorough[stage.how])
                scores[k] = score(layouts[k])
            elif isinstance(stage, schedule.Settle):
                chosen = settler.settled(chosen, thorough=thorough[stage.how])
            elif isinstance(stage, schedule.Choose):
                best, pick, fewest = min(scores), 0, -1
                for k, lay in enumerate(layouts):
                    if scores[k] > best * (1.0 + schedule.TIE):
                        continue
                    count = moved(lay)
                    if fewest < 0 or count < fewest:
                        pick, fewest = k, count
                chosen = layouts[pick]
            else:
                if problem.objective is not makespan or not schedule.stays_from_source(problem):
                    continue
                budget = self._budget(problem, stage.search)
                if budget <= 0:
                    continue
                if stage.aim == "best finalist":
                    reach = min(scores)
                    rank_of = problem.ranks_of(layouts[scores.index(reach)])
                    stop = float(np.bincount(rank_of, weights=problem.costs).max(initial=0.0))
                else:
                    reach = stop = score(chosen)
                stay = self._stay(problem, source, budget, stage, stop, reach)
                if stay is None:
                    continue
                if stage.keep == "plan":
                    # Settled by the first of its settles, the plan when it is within half
                    # the tie of every finalist as it stands (the best one settled by the
                    # schedule, the others not: the other half is for what settling them
                    # could gain); settled by the rest, it ends the finish. Else it is a
                    # finalist.
                    stay = settler.settled(stay, thorough=thorough[stage.settles[0]])
                    mine = score(stay)
                    if mine <= min(scores) * (1.0 + schedule.TIE / 2):
                        for how in stage.settles[1:]:
                            stay = settler.settled(stay, thorough=thorough[how])
                        chosen = stay
                        break
                    layouts.insert(0, stay)
                    scores.insert(0, mine)
                    continue
                for how in stage.settles:
                    stay = settler.settled(stay, thorough=thorough[how])
                if stage.keep == "finalist":
                    layouts.insert(0, stay)
                    scores.insert(0, score(stay))
                else:
                    fewer = moved(stay) < moved(chosen)
                    if fewer and score(stay) <= reach * (1.0 + schedule.TIE):
                        chosen = stay
        done = FlatLayout(chosen.flat, chosen.sizes, settled=True)
        done._ranks = chosen._ranks
        return done

    def _stay(
        self,
        problem: BalanceProblem,
        source: FlatLayout,
        budget: int,
        stage: schedule.FromSource,
        stop: float,
        reach: float,
    ) -> FlatLayout | None:
        """The search of ``stage`` from the source, stopping at load ``stop``, going on after a
        near miss; the layout when it scores ``reach`` or less within the packing budgets."""
        stay, rank_of = self._phases(problem, source, budget, stage.search, stop_at=stop)
        reached = _score_of(problem, rank_of)
        tied = reach * (1.0 + schedule.TIE)  # within TIE of the aim counts as reaching it
        if tied < reached <= reach * (1.0 + stage.go_on_within):  # a near miss: go on
            stay, rank_of = self._refine(
                problem,
                stay,
                int(budget * stage.go_on_share),
                stop_at=stop,
                rounds=stage.search.rounds(problem),
                knapsack=False,
            )
            reached = _score_of(problem, rank_of)
        if reached <= tied and _budgets_hold(problem, stay):
            return stay
        return None

    def _refine(
        self,
        problem: BalanceProblem,
        origin: FlatLayout,
        budget: int,
        *,
        stop_at: float | None = None,
        rounds: int = 0,
        knapsack: bool = True,
    ) -> tuple[FlatLayout, np.ndarray]:
        """The first search phase, then the second one (``polish.py``) and the first again
        while the second finds changes (at most ``rounds`` times, default
        ``schedule.polish_rounds``). ``stop_at``: a load at or below which the most loaded rank is
        good enough (default: near the bound). ``knapsack``: whether the second phase may
        spend its knapsack allowance on subset exchanges (one bin per rank only)."""
        layout, rank_of = _known(*self._search(problem, origin, budget, stop_at=stop_at))
        if problem.constraints.budgets:
            return layout, rank_of
        # The allowance is per round: two rounds spend it all, later ones as much again.
        cells = schedule.knapsack_cells(problem) // schedule.POLISH_ROUNDS if knapsack else 0
        # Partners come from the whole group, so the attempts scale with it too.
        attempts = max(budget, problem.num_ranks // 2)
        if not rounds:
            rounds = schedule.polish_rounds(problem)
        for _ in range(rounds):
            polished, _, changes = self._polish(problem, layout, attempts, cells, stop_at=stop_at)
            if changes == 0:
                break
            layout, rank_of = _known(*self._search(problem, polished, budget, stop_at=stop_at))
        return layout, rank_of

    # The kernels, compiled. Overridden only by the test oracle, which runs the same
    # starts and final choice around its slow reference kernels.

    def _greedy(self, problem: BalanceProblem) -> FlatLayout | None:
        return lpt_layout(problem)

    def _sample_greedy(self, problem: BalanceProblem) -> FlatLayout | None:
        return sample_lpt_layout(problem)

    def _search(
        self,
        problem: BalanceProblem,
        start: FlatLayout,
        budget: int,
        *,
        stop_at: float | None = None,
    ) -> tuple[FlatLayout, np.ndarray]:
        return search(problem, start, budget, stop_at=stop_at)

    def _polish(
        self,
        problem: BalanceProblem,
        start: FlatLayout,
        budget: int,
        cells: int,
        *,
        stop_at: float | None = None,
    ) -> tuple[FlatLayout, np.ndarray, int]:
        return polish(problem, start, budget, cells, stop_at=stop_at)


def _known(layout: FlatLayout, rank_of: np.ndarray) -> tuple[FlatLayout, np.ndarray]:
    """A searched layout with its sample ranks (what the search reports) kept on it, so the
    finish need not recompute them (``BalanceProblem.ranks_of``)."""
    if layout._ranks is None:
        rank_of.setflags(write=False)
        layout._ranks = rank_of
    return layout, rank_of


def _score_of(problem: BalanceProblem, rank_of: np.ndarray) -> float:
    """``problem.score`` of the layout whose samples go to ranks ``rank_of``."""
    return float(problem.objective(problem.rank_costs_of(rank_of)))


def _budgets_hold(problem: BalanceProblem, bins: Sequence[Sequence[int]]) -> bool:
    if not problem.constraints.budgets:
        return True
    return first_infeasible_bin(problem, bins) < 0
