"""The default algorithm's second search phase: partners across the whole group, and one
sample for any subset of a partner bin.

The first phase (``search.py``) works against the lightest ranks and exchanges a sample for
a run of consecutive-by-length samples. When it stops above the bound, this phase tries two
more families on the most loaded rank (the method and its tie rules are stated at the top of
``_polish.c``, where it runs; ``PolishOracle`` in ``tests/oracles/planning.py`` specifies it
in Python, and tests hold the two to identical layouts):

* **group-wide moves**: one sample to the least loaded rank, in the whole group, that has a
  bin with room for it (ranks indexed by their largest free room), so free room that is not
  on the lightest ranks is still found at 256 or 1,024 ranks;
* **subset exchanges**: one of the rank's costliest samples for any subset of one bin of a
  light rank whose token total keeps both bins within ``seq_len`` (a 0/1 knapsack over the
  partner bin's samples by tokens, keeping the cheapest and the costliest subset of every
  total), which is what still improves nearly full layouts with one bin per rank.

The knapsack's work is counted in cells against an allowance (``schedule.knapsack_cells``:
``SUBSET_CELLS`` with one bin per rank, none with several: there whole bins move instead),
and the number of attempts against the search's budget, so a plan's time stays bounded and
never depends on a clock.
Not used with packing budgets.
"""

from __future__ import annotations

import numpy as np

from evenflow.engine._planning import native
from evenflow.engine._planning.objectives import balance
from evenflow.engine._planning.problem import BalanceProblem, FlatLayout
from evenflow.engine._planning.search import good_enough, search_state

__all__ = ["polish"]


def polish(
    problem: BalanceProblem,
    start: FlatLayout,
    budget: int,
    cells: int,
    *,
    stop_at: float | None = None,
) -> tuple[FlatLayout, np.ndarray, int]:
    """Run the second phase from ``start`` for at most ``budget`` attempts and ``cells``
    knapsack cells, stopping once the most loaded rank is at or below ``stop_at`` (default
    :func:`~evenflow.engine._planning.search.good_enough`): the layout reached, its sample
    ranks, and the number of changes."""
    state = search_state(problem, start)
    stop = good_enough(problem, state["load"]) if stop_at is None else stop_at
    flat, sizes, changes = native.polish(
        problem,
        (start.flat, start.sizes),
        state,
        budget=budget,
        good_enough=stop,
        sumsq=problem.objective is balance,
        cells=cells,
    )
    rank_of: np.ndarray = state["bin_of"] // problem.bins_per_rank
    return FlatLayout(flat, sizes), rank_of, changes
