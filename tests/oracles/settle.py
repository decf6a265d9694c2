"""Slow reference implementation of the compiled settle (``engine/_planning/_settle.c``).

The core's settle is the only production implementation; this is its specification in plain
Python, step for step (the method and its tie rules are stated at the top of ``_settle.c``):

1. rank labels that keep the most movement weight where it was read (an exact assignment up
   to ``EXACT_ASSIGN`` ranks, greedy over each rank's ``TOP_PAIRS`` largest overlaps above),
   the identity unless strictly better; 2. the same for the bins of each rank; 3. homecoming
   passes; 4. ejections and 5. pairs in a thorough settle.

The exact assignment is solved here by brute force over permutations for few groups and by a
plain Hungarian method otherwise: among several optimal assignments the core keeps the one its
Hungarian method reaches, so the oracle runs the same method (in Python's exact integers).
Tests hold the core to identical layouts (``tests/test_plan_settle.py``). The tuning constants
are the core's, read from the compiled module.
"""

from __future__ import annotations

import numpy as np

from evenflow.engine._planning import native

__all__ = ["settle"]

_core = native._core
EXACT_ASSIGN: int = _core.SETTLE_EXACT_ASSIGN
TOP_PAIRS: int = _core.SETTLE_TOP_PAIRS
HOME_PASSES: int = _core.SETTLE_HOME_PASSES
SWAP_SCAN: int = _core.SETTLE_SWAP_SCAN
THOROUGH_PASSES: int = _core.SETTLE_THOROUGH_PASSES
THOROUGH_SCAN: int = _core.SETTLE_THOROUGH_SCAN
EJECT_RANKS: int = _core.SETTLE_EJECT_RANKS
EJECT_SCAN: int = _core.SETTLE_EJECT_SCAN
EJECT_PASSES: int = _core.SETTLE_EJECT_PASSES
PAIR_PASSES: int = _core.SETTLE_PAIR_PASSES
PAIR_MAX_SAMPLES: int = _core.SETTLE_PAIR_MAX_SAMPLES
# Written out here and in _settle.c: the relative margin under the peak for steps 4 and 5.
EJECT_MARGIN = 1e-11


# ---------------------------------------------------------------------------- 1-2. labels


def _hungarian(cost: list[list[int]]) -> list[int]:
    """Row -> column minimising the total (potentials and shortest augmenting paths), the
    assignment the core's method reaches on ties."""
    g = len(cost)
    inf = (2**63 - 1) // 4
    u = [0] * (g + 1)
    v = [0] * (g + 1)
    p = [0] * (g + 1)
    way = [0] * (g + 1)
    for i in range(1, g + 1):
        p[0] = i
        j0 = 0
        minv = [inf] * (g + 1)
        used = [False] * (g + 1)
        while True:
            used[j0] = True
            i0, delta, j1 = p[j0], inf, 0
            for j in range(1, g + 1):
                if used[j]:
                    continue
                cur = cost[i0 - 1][j - 1] - u[i0] - v[j]
                if cur < minv[j]:
                    minv[j], way[j] = cur, j0
                if minv[j] < delta:
                    delta, j1 = minv[j], j
            for j in range(g + 1):
                if used[j]:
                    u[p[j]] += delta
                    v[j] -= delta
                else:
                    minv[j] -= delta
            j0 = j1
            if p[j0] == 0:
                break
        while j0:
            j1 = way[j0]
            p[j0] = p[j1]
            j0 = j1
    out = [0] * g
    for j in range(1, g + 1):
        out[p[j] - 1] = j - 1
    return out


def assign_labels(g: int, entries: list[tuple[int, int, int]]) -> list[int]:
    """``perm[row]``: the label each of ``g`` groups takes, from ``(row, col, weight)``
    entries (``col < 0`` adds nothing); the identity unless another keeps strictly more."""
    identity_perm = list(range(g))
    if g < 2:
        return identity_perm
    overlap: dict[tuple[int, int], int] = {}
    for row, col, w in entries:
        if col >= 0:
            overlap[(row, col)] = overlap.get((row, col), 0) + w
    identity = sum(overlap.get((r, r), 0) for r in range(g))
    if g <= EXACT_ASSIGN:
        dense = [[-overlap.get((r, c), 0) for c in range(g)] for r in range(g)]
        proposal = _hungarian(dense)
        total = sum(overlap.get((r, proposal[r]), 0) for r in range(g))
    else:
        # Each row offers its TOP_PAIRS largest positive overlaps (ties: lower column), and
        # pairs are taken in descending weight (ties: lower row, then lower column).
        pairs: list[tuple[int, int, int]] = []
        for r in range(g):
            mine = sorted(
                (-w, r, c) for (row, c), w in overlap.items() if row == r and w > 0
            )
            pairs.extend(mine[:TOP_PAIRS])
        pairs.sort()
        proposal = [-1] * g
        col_done = [False] * g
        total = 0
        for neg_w, r, c in pairs:
            if proposal[r] >= 0 or col_done[c]:
                continue
            proposal[r], col_done[c] = c, True
            total += -neg_w
        free = (c for c in range(g) if not col_done[c])
        proposal = [c if c >= 0 else next(free) for c in proposal]
    return proposal if total > identity else identity_perm


# ---------------------------------------------------------------------------- 3-5. homecoming


class _Home:
    """The homecoming state: bins' members in order, per-sample bins and ranks, loads."""

    def __init__(
        self,
        cost: list[float],
        tok: list[int],
        home: list[int],
        members: list[list[int]],
        per: int,
        seq_len: int,
    ) -> None:
        n, nb = len(cost), len(members)
        self.cost, self.tok, self.home, self.members = cost, tok, home, members
        self.per, self.seq_len, self.ranks = per, seq_len, nb // per
        self.home_rank = [h // per for h in home]
        self.bin_of = [0] * n
        self.load = [0.0] * self.ranks
        self.bin_tok = [sum(tok[i] for i in m) for m in members]
        for b, m in enumerate(members):
            for i in m:
                self.bin_of[i] = b
                self.load[b // per] += cost[i]
        self.rank_of = [b // per for b in self.bin_of]
        self.version = [0] * self.ranks
        self.tried = [-1] * n
        self.index: list[int] = []
        self.rank_start: list[int] = []

    def relocate(self, i: int, dst: int) -> None:
        src = self.bin_of[i]
        self.members[dst].append(i)
        self.members[src].remove(i)
        self.bin_of[i], self.rank_of[i] = dst, dst // self.per
        self.version[src // self.per] += 1
        self.version[dst // self.per] += 1
        self.bin_tok[src] -= self.tok[i]
        self.bin_tok[dst] += self.tok[i]
        self.load[src // self.per] -= self.cost[i]
        self.load[dst // self.per] += self.cost[i]

    def index_by_rank(self, by_cost: list[int]) -> None:
        """Every rank's samples by (cost, index): ``index[rank_start[r]:rank_start[r + 1]]``."""
        parts: list[list[int]] = [[] for _ in range(self.ranks)]
        for i in by_cost:
            parts[self.rank_of[i]].append(i)
        self.index = [i for part in parts for i in part]
        self.rank_start = [0]
        for part in parts:
            self.rank_start.append(self.rank_start[-1] + len(part))

    def first_costing(self, h: int, lo: float) -> int:
        a, z = self.rank_start[h], self.rank_start[h + 1]
        while a < z:
            mid = a + (z - a) // 2
            if self.cost[self.index[mid]] < lo:
                a = mid + 1
            else:
                z = mid
        return a

    def fit_after(
        self, g: int, tok: int, changes: list[tuple[int, int, int, int]], prefer: int
    ) -> int:
        """A bin of rank ``g`` with room for ``tok`` once each ``(gone, gone_tok, came,
        came_tok)`` applied: ``prefer`` when it fits, else the fullest (first on ties)."""
        best, best_used = -1, -1
        for b in range(g * self.per, (g + 1) * self.per):
            used = self.bin_tok[b]
            for gone, gone_tok, came, came_tok in changes:
                if gone == b:
                    used -= gone_tok
                if came == b:
                    used += came_tok
            if used + tok > self.seq_len:
                continue
            if b == prefer:
                return b
            if used > best_used:
                best, best_used = b, used
        return best

    def fullest_fit(self, h: int, tok: int) -> int:
        return self.fit_after(h, tok, [], -1)

    def light_ranks(self, nlight: int) -> list[int]:
        return sorted(range(self.ranks), key=lambda r: (self.load[r], r))[:nlight]

    def _room_on_h(self, i: int, j: int, h: int) -> int:
        """Where ``i`` goes on ``h`` once ``j`` left: ``j``'s bin, else (``j``'s bin keeping
        a sample) the fullest bin of ``h`` with room, else -1."""
        yb = self.bin_of[j]
        if self.bin_tok[yb] - self.tok[j] + self.tok[i] <= self.seq_len:
            return yb
        if len(self.members[yb]) >= 2:
            return self.fullest_fit(h, self.tok[i])
        return -1

    def eject_target(
        self, j: int, h: int, p: int, x: int, i: int, limit: float, light: list[int]
    ) -> int:
        hj, ti = self.home_rank[j], self.tok[i]
        for k in range(-1, len(light)):
            g = hj if k < 0 else light[k]
            if g == h or (k >= 0 and g == hj):
                continue
            load = self.load[g] + self.cost[j] - (self.cost[i] if g == p else 0.0)
            if load > limit:
                continue
            b = self.fit_after(g, self.tok[j], [(x, ti, -1, -1)], self.home[j])
            if b >= 0:
                return b
        return -1

    def eject(self, i: int, limit: float, light: list[int]) -> bool:
        x, p, h = self.bin_of[i], self.rank_of[i], self.home_rank[i]
        a = self.first_costing(h, self.cost[i] - (limit - self.load[h]))
        for k in range(a, min(a + EJECT_SCAN, self.rank_start[h + 1])):
            j = self.index[k]
            if self.rank_of[j] != h or self.home_rank[j] == h or self.tok[j] > self.seq_len:
                continue
            if self.load[h] - self.cost[j] + self.cost[i] > limit:
                continue
            y = self._room_on_h(i, j, h)
            if y < 0:
                continue
            dst = self.eject_target(j, h, p, x, i, limit, light)
            if dst < 0:
                continue
            self.relocate(j, dst)
            self.relocate(i, y)
            return True
        return False

    def pair(self, i: int, limit: float) -> bool:
        x, p, h = self.bin_of[i], self.rank_of[i], self.home_rank[i]
        ti, ci, tok, cost = self.tok[i], self.cost[i], self.tok, self.cost
        a = self.first_costing(h, ci - (limit - self.load[h]))
        for kj in range(a, min(a + EJECT_SCAN, self.rank_start[h + 1])):
            j = self.index[kj]
            if self.rank_of[j] != h or self.home_rank[j] != p or tok[j] > self.seq_len:
                continue
            cj = cost[j]
            if self.load[h] - cj + ci > limit:
                continue
            yb = self.bin_of[j]
            y = self._room_on_h(i, j, h)
            if y < 0:
                continue
            lp = self.load[p] - ci
            b0 = self.first_costing(p, cj - (limit - lp))
            for kk in range(b0, min(b0 + EJECT_SCAN, self.rank_start[p + 1])):
                k = self.index[kk]
                hk = self.home_rank[k]
                if k == i or self.rank_of[k] != p or hk == p or tok[k] > self.seq_len:
                    continue
                ck = cost[k]
                if lp - ck + cj > limit:
                    continue
                home_ok = hk != h and self.load[hk] + ck <= limit
                h_ok = self.load[h] + ci - cj + ck <= limit
                if not home_ok and not h_ok:
                    continue
                zb = self.bin_of[k]
                changes = [(x, ti, y, ti), (yb, tok[j], -1, 0), (zb, tok[k], -1, 0)]
                z = self.fit_after(p, tok[j], changes, zb)
                if z < 0:
                    continue
                changes = changes[:2]
                changes[1] = (yb, tok[j], z, tok[j])
                w = self.fit_after(hk, tok[k], changes, self.home[k]) if home_ok else -1
                if w < 0 and h_ok:
                    w = self.fit_after(h, tok[k], changes, -1)
                if w < 0:
                    continue
                self.relocate(i, y)
                self.relocate(j, z)
                self.relocate(k, w)
                return True
        return False

    def home_pass(self, limit: float, scan: int, by_cost: list[int], nlight: int) -> int:
        changes = 0
        self.index_by_rank(by_cost)
        light = self.light_ranks(nlight) if nlight > 0 else []
        cost, tok, seq_len = self.cost, self.tok, self.seq_len
        for i in range(len(cost)):
            x, p, hb, h = self.bin_of[i], self.rank_of[i], self.home[i], self.home_rank[i]
            ti, ci = tok[i], cost[i]
            if p == h or ti > seq_len:
                continue
            if self.tried[i] == self.version[p] + self.version[h]:
                continue
            if len(self.members[x]) >= 2 and self.load[h] + ci <= limit:
                y = hb if self.bin_tok[hb] + ti <= seq_len else self.fullest_fit(h, ti)
                if y >= 0:
                    self.relocate(i, y)
                    changes += 1
                    continue
            # A swap with an away sample of h: one that belongs on p first.
            lo, hi = ci - (limit - self.load[h]), ci + (limit - self.load[p])
            a = self.first_costing(h, lo)
            best = -1
            for k in range(a, min(a + scan, self.rank_start[h + 1])):
                j = self.index[k]
                if cost[j] > hi:
                    break
                hj = self.home_rank[j]
                if self.rank_of[j] != h or hj == h or tok[j] > seq_len:
                    continue
                yb = self.bin_of[j]
                if self.bin_tok[x] - ti + tok[j] > seq_len:
                    continue
                if self.bin_tok[yb] - tok[j] + ti > seq_len:
                    continue
                if self.load[h] - cost[j] + ci > limit:
                    continue
                if self.load[p] - ci + cost[j] > limit:
                    continue
                if best < 0:
                    best = j
                if hj == p:
                    best = j
                    break
            if best >= 0:
                self.relocate(i, self.bin_of[best])
                self.relocate(best, x)
                changes += 1
                continue
            if nlight > 0 and len(self.members[x]) >= 2 and self.eject(i, limit, light):
                changes += 1
                continue
            self.tried[i] = self.version[p] + self.version[h]
        return changes

    def pair_pass(self, limit: float, by_cost: list[int]) -> int:
        changes = 0
        self.index_by_rank(by_cost)
        for i in range(len(self.cost)):
            p, h = self.rank_of[i], self.home_rank[i]
            if p == h or self.tok[i] > self.seq_len or len(self.members[self.bin_of[i]]) < 2:
                continue
            if self.tried[i] == self.version[p] + self.version[h]:
                continue
            if self.pair(i, limit):
                changes += 1
            else:
                self.tried[i] = self.version[p] + self.version[h]
        return changes

    def peak(self) -> float:
        top = 0.0
        for value in self.load:
            top = value if value > top else top
        return top


def settle(
    costs: np.ndarray,
    tokens: np.ndarray,
    weights: np.ndarray,
    home: np.ndarray,
    flat: np.ndarray,
    sizes: np.ndarray,
    per: int,
    seq_len: int,
    limit: float,
    *,
    thorough: bool = False,
) -> tuple[np.ndarray, np.ndarray]:
    """What ``native.settle`` returns for the same arguments (see the module docstring)."""
    cost: list[float] = np.asarray(costs, dtype=np.float64).tolist()
    tok: list[int] = np.asarray(tokens, dtype=np.int64).tolist()
    w: list[int] = np.asarray(weights, dtype=np.int64).tolist()
    home_l: list[int] = np.asarray(home, dtype=np.int64).tolist()
    flat_l: list[int] = np.asarray(flat, dtype=np.int64).tolist()
    size_l: list[int] = np.asarray(sizes, dtype=np.int64).tolist()
    n, nb = len(cost), len(size_l)
    ranks = nb // per
    bins: list[list[int]] = []
    at = 0
    for size in size_l:
        bins.append(flat_l[at : at + size])
        at += size
    # 1. Ranks: new rank r against the source rank of each of its samples.
    rank_perm = assign_labels(
        ranks,
        [(b // per, home_l[i] // per, w[i]) for b, members in enumerate(bins) for i in members],
    )
    # 2. Bins of each rank, against the bins of the rank it now stands for.
    where = [0] * nb
    for r in range(ranks):
        q = rank_perm[r]
        entries = [
            (b - r * per, home_l[i] - q * per if home_l[i] // per == q else -1, w[i])
            for b in range(r * per, (r + 1) * per)
            for i in bins[b]
        ]
        bin_perm = assign_labels(per, entries)
        for p in range(per):
            where[r * per + p] = q * per + bin_perm[p]
    members: list[list[int]] = [[] for _ in range(nb)]
    for b in range(nb):
        members[where[b]] = list(bins[b])
    # 3-5. Homecoming.
    if limit >= 0.0:
        state = _Home(cost, tok, home_l, members, per, seq_len)
        by_cost = sorted(range(n), key=lambda i: (cost[i], i))
        passes = THOROUGH_PASSES if thorough else HOME_PASSES
        scan = THOROUGH_SCAN if thorough else SWAP_SCAN
        for _ in range(passes):
            if state.home_pass(limit, scan, by_cost, 0) == 0:
                break
        if thorough:
            nlight = min(ranks, EJECT_RANKS)
            peak = state.peak()
            cap = min(peak - EJECT_MARGIN * peak, limit)
            state.tried = [-1] * n
            for _ in range(EJECT_PASSES):
                if state.home_pass(cap, SWAP_SCAN, by_cost, nlight) == 0:
                    break
            peak = state.peak()
            cap = min(peak - EJECT_MARGIN * peak, cap)
            state.tried = [-1] * n
            for _ in range(PAIR_PASSES if n <= PAIR_MAX_SAMPLES else 0):
                if state.pair_pass(cap, by_cost) == 0:
                    break
    out_sizes = np.array([len(m) for m in members], dtype=np.int64)
    out_flat = np.array([i for m in members for i in m], dtype=np.int64)
    return out_flat, out_sizes
