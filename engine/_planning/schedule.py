"""What the default algorithm runs: its tuning constants, budgets and the order of its phases.

Every number that tunes a plan is defined here, each with the measurement that justifies it
(``evenflow bench planner`` unless said otherwise), and so is every budget derived from them;
``tests/test_plan_schedule.py`` fails when a tuning constant is defined in another planning
module. The compiled core's tuning constants are ``#define``s of its C files: they are listed
in :data:`CORE_CONSTANTS` with the rule that they must match, which the same test checks
against the compiled module's exports.

Budgets count attempts, knapsack cells and passes, never time: every rank of a group must stop
at the same point, so a plan stays a pure function of the step.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

if TYPE_CHECKING:
    from evenflow.engine._planning.problem import BalanceProblem

__all__ = [
    "CLOSE",
    "CORE_CONSTANTS",
    "DEFAULT",
    "LOCKSTEP_MAX_WORK",
    "LOCKSTEP_PASSES",
    "MULTI_START_SAMPLES",
    "NEAR_OPTIMAL",
    "PARTNER_UNITS",
    "STAY_CLOSE",
    "TIE",
    "STAY_MORE",
    "STAY_ROUNDS",
    "SUBSET_CELLS",
    "WINDOW_PASSES",
    "Choose",
    "FromSource",
    "Schedule",
    "Search",
    "Settle",
    "Start",
    "default_budget",
    "knapsack_cells",
    "lockstep_budget",
    "polish_rounds",
    "second_stay_budget",
    "stay_again_budget",
    "stay_budget",
    "stays_from_source",
]

# ---------------------------------------------------------------------------- starts

# Problems up to this many samples are searched from every start, to convergence. Beyond
# it an attempt costs far more than a greedy pass (a 4-rank step of ~160 samples took ~80 ms
# when the search ran in numpy), so the budget below applies.
MULTI_START_SAMPLES = 48
# Attempts of a tiny problem's searches (up to MULTI_START_SAMPLES samples): to convergence.
TINY_BUDGET = 256
# A start that is no search origin (the greedy sample LPT) and beats every searched layout is
# searched from as well on steps up to this many samples; above, it is a candidate as it is.
# At 1,024 x 4 (pretrain bfd, a = 0, ~40,000 samples) that search took ~140 ms of a 300 ms
# plan, where the plan without the start took 110 ms.
LATE_SEARCH_SAMPLES = 20_000

# ---------------------------------------------------------------------------- first phase

# Makespan search stops once the most loaded rank is this close to the lower bound
# max(mean rank load, costliest sample) (search.good_enough).
NEAR_OPTIMAL = 2e-4
# Improvement attempts: one per this many samples, within [MIN_BUDGET, MAX_BUDGET]. The
# first few attempts bring most of the gain (at 8 ranks x 4 bins, 8 attempts close ~70% of
# what 100 do; one per 120 samples instead of per 80 changes the benchmark's mean reduction
# against LPT from 1.20% to 1.16% and takes ~0.4 ms off its slowest 8-rank plans). An
# attempt costs 50-150 us there; at 1,024 ranks attempts beyond the old cap of 96 still cut
# the makespan by ~1% (a = 4,096, first-fit sources).
SAMPLES_PER_ATTEMPT = 120
# ... and at least one per this many ranks: an attempt works one rank, and a step whose ranks
# hold few long samples (longctx, 256 x 2: ~8 a rank, so 16 attempts by samples) has most of
# its ranks above the bound; 128 attempts there take the benchmark's p90 max / bound from
# 1.105 to 1.072 (pretrain 1.062 to 1.052), and more changed nothing.
RANKS_PER_ATTEMPT = 2
MIN_BUDGET = 6
MAX_BUDGET = 512

# ---------------------------------------------------------------------------- second phase

# Alternations of the second search phase with the first: two, one past STAY_MAX_SAMPLES
# samples, where each round's fresh search state and search cost ~30 ms (1,024 x 4) and the
# third round gained < 0.1% of makespan on the benchmark's steps.
POLISH_ROUNDS = 2
# ... plus one per this many ranks, at most MAX_POLISH_ROUNDS: the first phase stalls once
# the most loaded rank has no change with the lightest ranks, and each round of group-wide
# moves lets it go on. At 256 x 2 (sft, a = 24,576) the third and fourth rounds took a step
# from 1.0158 to 1.0016 x bound; past four nothing changed on the benchmark's steps.
RANKS_PER_ROUND = 128
MAX_POLISH_ROUNDS = 4
# Knapsack cells (partner samples x token totals) a plan may spend on subset exchanges:
# ~2-4 ms compiled. A 32k-token bin of 24 samples costs ~0.8 M cells per partner bin. Only
# with one bin per rank: with several, whole bins move instead.
SUBSET_CELLS = 1 << 21
# ... and at most this many a rank: a 32k-token bin's knapsack costs ~1 ms per partner, so a
# small group spent most of its plan there for little. At 8 x 1 (180 benchmark plans, 3
# distributions x 2 packers x 3 costs x 10 steps, least CPU of 3 runs) 2^21 cells gave p99
# 9.0 ms CPU and 2^14 a rank (131k cells) 2.0 ms, max cost / proven bound mean 1.00035 ->
# 1.00038 (7 steps higher, the most 1.0319 -> 1.0333); 2^12 a rank saved nothing more, 2^16
# a rank gave p99 3.1 ms. From 128 ranks on the allowance is SUBSET_CELLS as before.
SUBSET_CELLS_PER_RANK = 1 << 14

# ---------------------------------------------------------------------------- finish

# LPT, the greedy sample LPT and KK over bins are settled as finalists too when their score is
# within this factor of the best one: settling can lower a layout's makespan. With the
# sample LPT start but only LPT among them, the planner settling the greedy's own layout
# (the benchmark's "sample lpt" peer) ended below the default on 40 of the benchmark's 1,266
# steps (22 cases, most at 8 and 64 x 16); with all three, on none.
CLOSE = 1.001
# Finalists whose scores are within this factor of the best are equal, and the one that moves
# the fewest samples is chosen. Strict equality let the settled greedy sample LPT win by
# slivers of 1e-6..1e-4 while moving nearly every sample: moved fraction p50 0.38 -> 0.73 at
# sft bfd 64 x 4 for a max cost / bound equal to four digits. A 0.01% difference in predicted
# step time is below what any cost model predicts; sending twice the samples is not.
TIE = 1e-4
# The search from the source towards the best makespan runs on steps up to this many
# samples, with STAY_ATTEMPTS attempts plus one per STAY_SAMPLES_PER_ATTEMPT samples (and
# one per STAY_RANKS_PER_ATTEMPT ranks, below): each attempt changes one or two samples, and
# reaching a balanced layout from a source 1.3x above its bound takes ~1 per 25 (p50 26
# attempts at 8 x 4, 235 at 64 x 4, sft). A step that does not get there in time keeps the
# other layout, so the cap bounds the planning time (~2 ms at 8 x 4) and nothing else. Past
# ~20,000 samples it would cost more than the rest of the plan and rarely arrive.
STAY_MAX_SAMPLES = 20_000
# STAY_ATTEMPTS was 24; 16 took the 8 x 4 p99 from 4.8 to 3.95 ms CPU (108 plans, least CPU
# of 3 runs; 5.2 -> 3.7 in a rerun) at the same max cost / bound (mean 1.00689 -> 1.00688, 16
# steps higher and 11 lower) and moved fraction (mean 0.493 both); at 64 x 4 (36 plans) the
# moved fraction's mean went 0.493 -> 0.499 and its p50 0.426 -> 0.468. The 8 x 4 tail is
# sft's steps (~100 samples a rank), where this search was ~2 of a ~4.5 ms plan.
STAY_ATTEMPTS = 16
STAY_SAMPLES_PER_ATTEMPT = 64
# The first search from the source gets one attempt more per two ranks (each attempt works
# one rank: at 64 x 4, sft first-fit steps then reach the best score more often, median
# moved 0.58 -> 0.48), and when it stops within STAY_CLOSE of that score it goes on from
# where it stopped for STAY_MORE of its attempts again (sft first-fit 8 x 4: median moved
# 0.51 -> 0.36, at +0.3 ms p99 planning time; going on within 1% or for all the attempts
# again moved less still but cost ~1 ms more at p99).
STAY_RANKS_PER_ATTEMPT = 2
STAY_CLOSE = 0.003
STAY_MORE = 0.5
# The search from the source alternates with the second phase once.
STAY_ROUNDS = 1
# The second search from the source runs where ranks hold at most STAY_FEW samples on
# average (long documents: ~16 a rank on the benchmark's longctx steps, ~88 on its sft
# ones), with STAY_WORK attempts-times-samples-per-rank: an attempt's work grows with the
# samples of the ranks it examines, so this is about the work of the first search on an sft
# step at 8 x 4 (35 attempts), ~190 attempts on longctx. There the first search often stops
# short of the best score (its 25 attempts end in a stalled layout) and the second brings the
# median moved fraction of longctx 8 x 4 steps from 0.50 to 0.45 (firstfit); past ~200
# attempts nothing changed.
STAY_FEW = 48
STAY_WORK = 3072
# ... and at most this many: one bin per rank of long documents (~4 samples a rank) would
# otherwise get ~770, where past ~200 nothing changed on the benchmark's steps.
STAY_WIDEST = 256

# ---------------------------------------------------------------------------- grouped search

# Units whose samples are exchange candidates in one attempt of the grouped search (the ones
# with the most room below their group's maximum): bounds an attempt's work. The compiled
# grouped search (_grouped.c) is given it.
PARTNER_UNITS = 8
# Rounds of the grouped search over the positions of a step (a round gives every group that
# is not stuck one attempt, ~5-200 us compiled, growing with the group's units; a round
# without a change ends the search), and at most LOCKSTEP_MAX_WORK attempts x ranks in all
# (lockstep_budget). Measured with ``evenflow bench planner --lockstep`` (8 and 64 ranks x 2
# and 4 bins, 3 steps a case, 12 rows): against the former numpy search (4 passes), 4 rounds
# lowered the p50 excess over the bound on 7 rows and raised none, 64 on all 12 (longctx
# 8 x 4: 0.115 -> 0.098; pretrain 64 x 4: 0.147 -> 0.132) at the same or less planning time,
# which the makespan starts dominate. Run to convergence the search needs up to ~2,300 rounds
# (p50 17, p90 300) and lowers the raw lockstep cost by up to 2% (geometric mean over a
# shape; pretrain and sft, 2 bins) more than 64 rounds, but at 64 x 16 it then costs up to
# 0.46 s a step. 512 rounds within LOCKSTEP_MAX_WORK, against 64 rounds (2-16 bins at 8 and
# 64 ranks, 4 bins at 1,024; 288 steps): raw cost -0.8% (8 x 2), -0.3% (8 x 4), -0.04%
# (8 x 16), -0.3% (64 x 2), -0.4% (64 x 4) geometric mean, up to -6.9% on a step, none higher,
# 64 x 16 unchanged; CPU per plan p50 within noise but at 64 x 4 (+2 ms), p90 +1 to +3 ms. At
# 1,024 x 4 an attempt costs ~0.1-0.2 ms: 1,024 attempts took the plan from 193 to 300 ms
# (p50) for -0.6% raw cost; the cap's 64 cost +1 ms for -0.1% against the numpy search's 16
# (and +0.2%, -11% CPU against 64 rounds).
LOCKSTEP_PASSES = 512
LOCKSTEP_MAX_WORK = 1 << 16
# Rounds of the grouped search over a window's groups. Most of a window's gain comes from the
# joint balance and the sorted grouping (on longctx at 8 ranks x 2 bins, W = 4 removes 98% of
# W = 1's excess without a search). Measured with ``evenflow bench planner --window 2 4
# --objectives makespan lockstep`` at 8 ranks x 1, 2, 4 bins, 8 steps (36 rows of W = 2, 4):
# against the former numpy search (2 passes), 2 rounds were within 0.01% on every row; 8
# lowered cost/lb on all 36 (geometric mean -0.3%; lockstep sft 8 x 4 W = 4 0.956 -> 0.948)
# at less planning time than the numpy search; 32 by -0.8% at about the numpy search's time.
WINDOW_PASSES = 8


def lockstep_budget(positions: int, ranks: int) -> int:
    """Attempts of a lockstep step's grouped search: LOCKSTEP_PASSES rounds over its
    ``positions`` groups of ``ranks`` bins, at most LOCKSTEP_MAX_WORK / ``ranks`` (at least
    one round)."""
    return max(min(LOCKSTEP_PASSES * positions, LOCKSTEP_MAX_WORK // ranks), positions)


# ---------------------------------------------------------------------------- the core's

# The compiled core's tuning constants: name -> (value, file, what it tunes). Each is a
# #define of that file and MUST equal the value here; the module exports it under the name
# given (tests/test_plan_schedule.py compares all three). The measurements are next to the
# #define, where the C reads them.
CORE_CONSTANTS: dict[str, tuple[int, str, str]] = {
    "NEAR_TARGETS": (4, "_search.h", "lightest ranks every first-phase family tries"),
    "WIDE_TARGETS": (32, "_search.h", "next ranks moves and run exchanges try before giving up"),
    "FULL_SWAP_PAIRS": (4096, "_search.h", "swap pairs scanned in full; above, cost windows"),
    "SWAP_NEIGHBOURS": (4, "_search.h", "swap window: partners each side of the matched cost"),
    "EXCHANGE_CANDIDATES": (8, "_search.h", "costliest samples offered for a run exchange"),
    "POLISH_PARTNERS": (8, "_polish.h", "lightest ranks the subset exchange tries"),
    "SUBSET_CANDIDATES": (8, "_polish.h", "costliest samples offered for a subset exchange"),
    "SETTLE_EXACT_ASSIGN": (128, "_settle.c", "ranks up to which labels are exact (Hungarian)"),
    "SETTLE_TOP_PAIRS": (8, "_settle.c", "overlaps per rank in the greedy labelling"),
    "SETTLE_HOME_PASSES": (4, "_settle.c", "homecoming passes of a plain settle"),
    "SETTLE_SWAP_SCAN": (8, "_settle.c", "swap partners a sample, plain settle"),
    "SETTLE_THOROUGH_PASSES": (8, "_settle.c", "homecoming passes of a thorough settle"),
    "SETTLE_THOROUGH_SCAN": (64, "_settle.c", "swap partners a sample, thorough settle"),
    "SETTLE_EJECT_RANKS": (8, "_settle.c", "light ranks offered an ejected sample"),
    "SETTLE_EJECT_SCAN": (8, "_settle.c", "away samples tried per ejection or pair"),
    "SETTLE_EJECT_PASSES": (2, "_settle.c", "ejection passes"),
    "SETTLE_PAIR_PASSES": (2, "_settle.c", "pair passes"),
    "SETTLE_PAIR_MAX_SAMPLES": (20_000, "_settle.c", "steps up to which pairs run"),
}


# ---------------------------------------------------------------------------- budgets


def default_budget(problem: BalanceProblem) -> int:
    """Improvement attempts of the first search: proportional to the step (its samples, or
    its ranks where they hold few samples), within [MIN_BUDGET, MAX_BUDGET]; TINY_BUDGET for
    tiny problems.

    An attempt's work grows with the samples of the ranks it examines, so attempts
    proportional to the step keep the search a bounded share of the plan.
    """
    if problem.num_samples <= MULTI_START_SAMPLES:
        return TINY_BUDGET
    attempts = max(
        problem.num_samples // SAMPLES_PER_ATTEMPT, problem.num_ranks // RANKS_PER_ATTEMPT
    )
    return min(max(attempts, MIN_BUDGET), MAX_BUDGET)


def polish_rounds(problem: BalanceProblem) -> int:
    """Alternations of the two search phases: POLISH_ROUNDS plus one per RANKS_PER_ROUND
    ranks, at most MAX_POLISH_ROUNDS; one past STAY_MAX_SAMPLES samples."""
    if problem.num_samples > STAY_MAX_SAMPLES:
        return 1
    return min(POLISH_ROUNDS + problem.num_ranks // RANKS_PER_ROUND, MAX_POLISH_ROUNDS)


def knapsack_cells(problem: BalanceProblem) -> int:
    """The knapsack allowance of a plan with one bin per rank: SUBSET_CELLS_PER_RANK a rank,
    at most SUBSET_CELLS; none with several bins per rank."""
    if problem.bins_per_rank != 1:
        return 0
    return min(SUBSET_CELLS, SUBSET_CELLS_PER_RANK * problem.num_ranks)


def stays_from_source(problem: BalanceProblem) -> bool:
    """Whether the finish searches from the source at all (makespan objective only; the
    caller checks the objective)."""
    return problem.num_samples <= STAY_MAX_SAMPLES


def stay_budget(num_samples: int, num_ranks: int) -> int:
    """Attempts of the search from the source: STAY_ATTEMPTS plus one per
    STAY_SAMPLES_PER_ATTEMPT samples and one per STAY_RANKS_PER_ATTEMPT ranks."""
    by_samples = num_samples // STAY_SAMPLES_PER_ATTEMPT
    return STAY_ATTEMPTS + by_samples + num_ranks // STAY_RANKS_PER_ATTEMPT


def second_stay_budget(problem: BalanceProblem) -> int:
    """Attempts of the second search from the source (STAY_WORK over the samples per rank,
    at most STAY_WIDEST), or 0 where ranks hold more than STAY_FEW samples and it does not
    run."""
    per_rank = max(1, problem.num_samples // max(1, problem.num_ranks))
    return min(STAY_WORK // per_rank, STAY_WIDEST) if per_rank <= STAY_FEW else 0


def stay_again_budget(problem: BalanceProblem) -> int:
    """:func:`second_stay_budget` where it exceeds the first search from the source's
    attempts, else 0 (the second search does not run)."""
    wider = second_stay_budget(problem)
    return wider if wider > stay_budget(problem.num_samples, problem.num_ranks) else 0


def _first_stay_budget(problem: BalanceProblem) -> int:
    return stay_budget(problem.num_samples, problem.num_ranks)


def _stay_rounds(problem: BalanceProblem) -> int:
    return STAY_ROUNDS


# ---------------------------------------------------------------------------- the schedule


@dataclass(frozen=True, slots=True)
class Start:
    """A layout the search may start from: ``name`` is one of the algorithm's start makers
    (``"source"``, ``"lpt"``, ``"dealt bins"``, ``"kk bins"``, ``"sample lpt"``);
    ``several_bins``: only with more than one bin per rank. ``origin``: whether the start
    competes to be the search's origin on steps past ``multi_start_samples``; a start that
    does not is searched from only when it beats every layout the search reached."""

    name: str
    several_bins: bool = False
    origin: bool = True


@dataclass(frozen=True, slots=True)
class Search:
    """One search: the first phase for ``budget`` attempts (None: the plan's attempt budget,
    :func:`default_budget` unless the algorithm is given one), then the second phase and the
    first again while the second changes something, at most ``rounds`` times (none under
    packing budgets); ``knapsack``: whether the second phase may spend its knapsack cells."""

    budget: Callable[[BalanceProblem], int] | None
    rounds: Callable[[BalanceProblem], int]
    knapsack: bool


@dataclass(frozen=True, slots=True)
class Settle:
    """Settle the finalists (``what="finalists"``; one an earlier stage settled plainly is
    not settled again), the best-scoring finalist alone (``"best"``) or the chosen layout
    (``"chosen"``), ``"plain"`` or ``"thorough"`` (``settle.Settler``)."""

    what: Literal["finalists", "best", "chosen"]
    how: Literal["plain", "thorough"]


@dataclass(frozen=True, slots=True)
class Choose:
    """Choose among the settled finalists: the best score, and among equal scores the layout
    that moves fewest samples."""


@dataclass(frozen=True, slots=True)
class FromSource:
    """A search from the source layout that stops once it reaches ``aim``: the best
    finalist's makespan (``"best finalist"``: settled when an earlier stage settled the
    finalists, else as searched) or the chosen layout's score (``"chosen"``).
    It runs under the makespan objective on steps :func:`stays_from_source` admits, when its
    budget is positive. Stopped short within ``go_on_within`` of the aim, it goes on from
    where it stopped for ``go_on_share`` of its attempts (second phase without knapsack).
    Reaching the aim within the packing budgets, it is settled by ``settles`` in turn and
    ``keep``: joins the finalists (``"finalist"``) or replaces the chosen layout when it
    still scores no higher and moves fewer samples (``"fewer moved"``). With ``"plan"`` it
    is settled by the first of ``settles``; when it then scores within half of :data:`TIE`
    of every finalist as it stands (the other half is for what settling a finalist could
    gain), it is settled by the rest and is the plan (the finish ends there), else it joins
    the finalists."""

    search: Search
    aim: Literal["best finalist", "chosen"]
    settles: tuple[Literal["plain", "thorough"], ...]
    keep: Literal["plan", "finalist", "fewer moved"]
    go_on_within: float = 0.0
    go_on_share: float = 0.0


Stage = Settle | Choose | FromSource


@dataclass(frozen=True, slots=True)
class Schedule:
    """What a plan of the default algorithm runs, in order.

    1. ``starts`` (the source first: what every candidate must beat): every start is made
       and scored; steps up to ``multi_start_samples`` samples are searched from each,
       larger ones from the best ``origin`` start only;
    2. ``search``: the search from those starts, then, on steps up to
       ``late_search_samples`` samples, from the best start that was no origin if it beats
       every searched layout; the best of the searched layouts and the
       starts (strictly better than the source, within the packing budgets) wins;
    3. the finalists: the winner, and each start named in ``close_starts`` whose score is
       within ``close`` of the winner's;
    4. ``finish``: the stages, in order; the chosen layout is the plan.
    """

    starts: tuple[Start, ...]
    multi_start_samples: int
    late_search_samples: int
    search: Search
    close_starts: tuple[str, ...]
    close: float
    finish: tuple[Stage, ...]


DEFAULT = Schedule(
    starts=(
        Start("source"),
        Start("lpt"),
        Start("dealt bins", several_bins=True),
        Start("kk bins", several_bins=True),
        # The greedy sample LPT (lpt.sample_lpt_layout). Before it, that greedy beat the
        # default on 172 of 792 steps of ``evenflow bench planner --heldout`` (by up to 5%:
        # 256 x 2 longctx first-fit p50 1.054 x the proven bound, the greedy 1.007). As an
        # origin it sent the search elsewhere on other steps: 31 of 523 makespan steps of
        # planner_digests.py planned higher than before. Searched from only when it beats
        # every searched layout: 84 lower, none higher, and 0 of 792 held-out steps where
        # any peer beats the default (p90 1.023 -> 1.012 x bound).
        Start("sample lpt", origin=False),
    ),
    multi_start_samples=MULTI_START_SAMPLES,
    late_search_samples=LATE_SEARCH_SAMPLES,
    search=Search(budget=None, rounds=polish_rounds, knapsack=True),
    close_starts=("lpt", "sample lpt", "kk bins"),
    close=CLOSE,
    finish=(
        Settle("best", "plain"),
        # The search from the source first, aiming at the best finalist settled: where it
        # gets there it moves only what balance needs and is the plan, so the other
        # finalists need no settling and the second search from the source no run. Settling
        # every finalist first took 1.7-4.9 plain settles a plan, the largest part of it at
        # 16 bins a rank. Against that order (CPU per plan, least of 3 runs, 30 steps a
        # shape, p50 ms): sft bfd 8 x 16 7.12 -> 5.51, pretrain first-fit 8 x 16 4.38 ->
        # 3.13, longctx first-fit 8 x 4 1.13 -> 0.93 and 64 x 4 4.83 -> 4.31, sft bfd 64 x 4
        # 28.1 -> 26.9, sft bfd 8 x 4 unchanged (2.2); moved fractions equal within 0.006 on
        # every shape of ``evenflow bench planner --ranks 8 64 --bins 1 4 16``, 0 of 792
        # held-out steps where a peer wins. The price: a finalist left unsettled could have
        # settled lower, so 25 of its 648 steps plan a higher max cost than before (2 beyond
        # the tie, by at most 0.042%; 11 lower), and of planner_digests.py's 4,369 steps 78
        # changed (50 higher, 14 lower), 17 beyond the tie, the most by 0.136% (sft 4 x 2,
        # a = 24,576). The stay must come within half the tie of every finalist as it
        # stands: within the tie of the best settled alone, a held-out code step (8 x 4,
        # bfd) lost to the settled greedy sample LPT by 1.04e-4.
        FromSource(
            Search(budget=_first_stay_budget, rounds=_stay_rounds, knapsack=True),
            aim="best finalist",
            settles=("plain", "thorough"),
            keep="plan",
            go_on_within=STAY_CLOSE,
            go_on_share=STAY_MORE,
        ),
        Settle("finalists", "plain"),
        Choose(),
        Settle("chosen", "thorough"),
        FromSource(
            Search(budget=stay_again_budget, rounds=_stay_rounds, knapsack=False),
            aim="chosen",
            settles=("plain", "thorough"),
            keep="fewer moved",
        ),
    ),
)
"""The default algorithm's schedule (see :class:`Schedule`)."""
