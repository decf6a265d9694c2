/*
 * Settling a plan where its samples already are: part of the planner's compiled core (the
 * method table lives in _native.c; settle.py is the one Python caller; tests/oracles/settle.py
 * is its specification in Python, held to identical layouts by tests/test_plan_settle_oracle.py).
 *
 * A balanced layout can be relabelled at no cost in balance: ranks are interchangeable, and
 * so are the bins of a rank. settle() picks the labels that keep the most sample weight
 * (bytes where the metadata carries them, else one per sample) where it was read, then - when
 * the objective is the makespan - sends moved samples back to their source rank wherever that
 * keeps every rank at or below a given load:
 *
 * 1. Ranks. Overlap W[r][s] = weight of the samples of new rank r read by rank s. The labels
 *    maximise sum_r W[r][perm[r]]: an assignment problem, solved exactly (Hungarian method,
 *    O(R^3) in exact integers) up to EXACT_ASSIGN ranks; above, greedily (overlaps in
 *    descending order, a pair taken when both ends are free, the rest matched in index order;
 *    each rank offers its TOP_PAIRS largest overlaps: O(n + R log R)). Either way the
 *    identity is kept unless the new labels keep strictly more weight, so relabelling never
 *    increases movement.
 * 2. Bins within each rank, the same way, against the bins the samples came from.
 * 3. Homecoming (makespan only, no packing budgets). In passes over the samples in canonical
 *    order, a sample away from its source rank h goes back when h stays at or below `limit`
 *    and one of its bins has room (its source bin first, else the fullest that fits), its
 *    own bin keeping a sample; otherwise it swaps with a sample of h that is itself away
 *    (one whose source is the sample's current rank first), when both bins keep their
 *    capacity and both ranks stay at or below `limit`. Each change lowers the number of
 *    moved samples, so the passes end; at most HOME_PASSES of them run (THOROUGH_PASSES, and
 *    THOROUGH_SCAN swap partners a sample, when the caller asks for a thorough settle).
 * 4. Ejection (thorough settles only), after those passes and under the peak they left: a
 *    sample that neither fits at h nor swaps goes home when an away sample of h can make
 *    room by moving on to its own source rank or to one of the EJECT_RANKS least loaded
 *    ranks (home_eject). Moved samples fall by one or two each time.
 * 5. Pairs (thorough settles of up to PAIR_MAX_SAMPLES samples), in passes of their own
 *    after the ejections and under the peak those left (pair_pass): two samples that each
 *    belong where the other is but differ too much in cost to swap both go home when a
 *    third, away on the costlier one's home, evens the difference by moving on to its own
 *    home or to the cheaper one's home (home_pair). Long documents make this the common
 *    case: a swap of one for one that keeps both ranks under the peak is rare when each
 *    sample is a large share of a rank. Moved samples fall by two or three.
 * Steps 3-5 never raise the peak above the given layout's and every change in them lowers the
 * number of moved samples; the planner settles thoroughly only a layout it has already
 * settled plainly (refine.py), so the result keeps that makespan or lowers it and moves no
 * more (a thorough settle of an unsettled layout may end above a plain one's peak or move
 * more: its wider passes take other paths). Running the pairs last keeps every peak the
 * ejections reach (a homecoming can lower it).
 *
 * All of it is a pure function of the arrays: ties go to the lowest index everywhere.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "_vec.h"

/* Tuning constants: listed in engine/_planning/schedule.py (CORE_CONSTANTS), which must match. */
#define EXACT_ASSIGN 128
#define TOP_PAIRS 8
#define HOME_PASSES 4
/* Swap partners examined per sample, from the cheapest admissible one up: bounds a pass at
   O(SWAP_SCAN n) however wide the ranks' slack. */
#define SWAP_SCAN 8
/* The thorough settle of a plan's final layout (the `thorough` argument): 8 partners and 4
   passes leave samples away that 64 and 8 bring home (median moved fraction of the planner
   benchmark's sft steps 0.50 -> 0.42 at 8 x 4, 0.76 -> 0.48 at 64 x 4, at equal makespans);
   more of either changed nothing there. Finalists are compared after the cheaper settle, so
   the chosen makespan is exactly what it was with the cheaper one alone. */
#define THOROUGH_PASSES 8
#define THOROUGH_SCAN 64
/* Ejections (home_eject): ranks offered an ejected sample after its own home, away samples
   of h tried per sample, and passes. Each pass retries every away sample: at 64 x 16 (12,700
   samples) four passes took a thorough settle from 10.6 to 22.8 ms for a median moved
   fraction 0.317 -> 0.308 on sft steps, two take 17.5 ms for 0.312. */
#define EJECT_RANKS 8
#define EJECT_SCAN 8
#define EJECT_PASSES 2
#define EJECT_MARGIN 1e-11
/* Pair passes (pair_pass), after the ejection passes: at 8 x 4 they bring the median moved
   fraction of long-context first-fit steps from 0.435 to 0.428 and of pretrain ones from
   0.321 to 0.317, for ~10% of the thorough settle's time (a third or fourth pass changed no
   median by more than 0.001). A wider chain (the second sample home from h to anywhere, the
   third on to any of three ranks) moved sft first-fit steps 0.352 -> 0.336 too, but cost
   ~80% more settle time at 64 x 16 for 0.002 of moved fraction there. */
#define PAIR_PASSES 2
/* ... on steps up to this many samples: at 1,024 x 4 (sft, 94,000 samples) they changed the
   moved fraction by < 0.001 for ~10 ms a plan. */
#define PAIR_MAX_SAMPLES 20000

/* The constants above, exported for the test oracle (tests/oracles/settle.py), so that none
   is written twice; called from the module's init (_native.c). -1 on failure. */
int evenflow_settle_constants(PyObject *mod) {
    return (PyModule_AddIntConstant(mod, "SETTLE_EXACT_ASSIGN", EXACT_ASSIGN) < 0 ||
            PyModule_AddIntConstant(mod, "SETTLE_TOP_PAIRS", TOP_PAIRS) < 0 ||
            PyModule_AddIntConstant(mod, "SETTLE_HOME_PASSES", HOME_PASSES) < 0 ||
            PyModule_AddIntConstant(mod, "SETTLE_SWAP_SCAN", SWAP_SCAN) < 0 ||
            PyModule_AddIntConstant(mod, "SETTLE_THOROUGH_PASSES", THOROUGH_PASSES) < 0 ||
            PyModule_AddIntConstant(mod, "SETTLE_THOROUGH_SCAN", THOROUGH_SCAN) < 0 ||
            PyModule_AddIntConstant(mod, "SETTLE_EJECT_RANKS", EJECT_RANKS) < 0 ||
            PyModule_AddIntConstant(mod, "SETTLE_EJECT_SCAN", EJECT_SCAN) < 0 ||
            PyModule_AddIntConstant(mod, "SETTLE_EJECT_PASSES", EJECT_PASSES) < 0 ||
            PyModule_AddIntConstant(mod, "SETTLE_PAIR_PASSES", PAIR_PASSES) < 0 ||
            PyModule_AddIntConstant(mod, "SETTLE_PAIR_MAX_SAMPLES", PAIR_MAX_SAMPLES) < 0)
               ? -1
               : 0;
}

typedef struct {
    int64_t w, row, col;
} overlap_t;

static int overlap_order(const void *pa, const void *pb) {
    const overlap_t *a = (const overlap_t *)pa, *b = (const overlap_t *)pb;
    if (a->w != b->w) return a->w > b->w ? -1 : 1;
    if (a->row != b->row) return a->row < b->row ? -1 : 1;
    return (a->col > b->col) - (a->col < b->col);
}

/* Hungarian method (potentials and shortest augmenting paths) on the g x g matrix `cost`,
   minimising; row_to_col receives the assignment. Exact integer arithmetic. */
static int hungarian(const int64_t *cost, Py_ssize_t g, int64_t *row_to_col) {
    const int64_t inf = INT64_MAX / 4;
    size_t len = (size_t)(g + 1);
    int64_t *u = calloc(len, sizeof(int64_t)), *v = calloc(len, sizeof(int64_t));
    int64_t *p = calloc(len, sizeof(int64_t)), *way = calloc(len, sizeof(int64_t));
    int64_t *minv = malloc(len * sizeof(int64_t));
    unsigned char *used = malloc(len);
    int ok = u && v && p && way && minv && used;
    for (Py_ssize_t i = 1; ok && i <= g; i++) {
        p[0] = i;
        Py_ssize_t j0 = 0;
        for (Py_ssize_t j = 0; j <= g; j++) {
            minv[j] = inf;
            used[j] = 0;
        }
        do {
            used[j0] = 1;
            int64_t i0 = p[j0], delta = inf;
            Py_ssize_t j1 = 0;
            for (Py_ssize_t j = 1; j <= g; j++) {
                if (used[j]) continue;
                int64_t cur = cost[(i0 - 1) * g + (j - 1)] - u[i0] - v[j];
                if (cur < minv[j]) {
                    minv[j] = cur;
                    way[j] = j0;
                }
                if (minv[j] < delta) {
                    delta = minv[j];
                    j1 = j;
                }
            }
            for (Py_ssize_t j = 0; j <= g; j++) {
                if (used[j]) {
                    u[p[j]] += delta;
                    v[j] -= delta;
                } else {
                    minv[j] -= delta;
                }
            }
            j0 = j1;
        } while (p[j0] != 0);
        do {
            Py_ssize_t j1 = way[j0];
            p[j0] = p[j1];
            j0 = j1;
        } while (j0);
    }
    if (ok) {
        for (Py_ssize_t j = 1; j <= g; j++) row_to_col[p[j] - 1] = j - 1;
    }
    free(u);
    free(v);
    free(p);
    free(way);
    free(minv);
    free(used);
    return ok ? 0 : -1;
}

/*
 * Labels for g groups: entry k (of m) puts weight w[k] on (row[k], col[k]); col < 0 adds
 * nothing. perm[row] = the label the row takes, a permutation of 0..g-1 maximising the
 * kept weight (see the file comment), the identity unless strictly better. -1 on no memory.
 */
static int assign_labels(Py_ssize_t g, Py_ssize_t m, const int64_t *row, const int64_t *col,
                         const int64_t *w, int64_t *perm) {
    for (Py_ssize_t r = 0; r < g; r++) perm[r] = r;
    if (g < 2) return 0;
    int64_t identity = 0, total = 0;
    int64_t *proposal = malloc(sizeof(int64_t) * (size_t)g);
    if (proposal == NULL) return -1;
    int status = 0;
    if (g <= EXACT_ASSIGN) {
        int64_t *dense = calloc((size_t)(g * g), sizeof(int64_t));
        if (dense == NULL) {
            free(proposal);
            return -1;
        }
        for (Py_ssize_t k = 0; k < m; k++) {
            if (col[k] >= 0) dense[row[k] * g + col[k]] += w[k];
        }
        for (Py_ssize_t r = 0; r < g; r++) identity += dense[r * g + r];
        for (Py_ssize_t k = 0; k < g * g; k++) dense[k] = -dense[k];
        status = hungarian(dense, g, proposal);
        if (status == 0) {
            for (Py_ssize_t r = 0; r < g; r++) total -= dense[r * g + proposal[r]];
        }
        free(dense);
    } else {
        /* Aggregate (row, col) weights: entries bucketed by row, summed per column. */
        int64_t *start = calloc((size_t)(g + 1), sizeof(int64_t));
        int64_t *by_row = malloc(sizeof(int64_t) * (size_t)(m > 0 ? m : 1));
        int64_t *acc = calloc((size_t)g, sizeof(int64_t));
        int64_t *touched = malloc(sizeof(int64_t) * (size_t)g);
        overlap_t *pairs = malloc(sizeof(overlap_t) * (size_t)(m > 0 ? m : 1));
        unsigned char *row_done = calloc((size_t)g, 1), *col_done = calloc((size_t)g, 1);
        if (!start || !by_row || !acc || !touched || !pairs || !row_done || !col_done) {
            status = -1;
        } else {
            for (Py_ssize_t k = 0; k < m; k++) start[row[k] + 1]++;
            for (Py_ssize_t r = 0; r < g; r++) start[r + 1] += start[r];
            for (Py_ssize_t k = 0; k < m; k++) by_row[start[row[k]]++] = k;
            for (Py_ssize_t r = g; r > 0; r--) start[r] = start[r - 1];
            start[0] = 0;
            Py_ssize_t np = 0;
            for (Py_ssize_t r = 0; r < g; r++) {
                Py_ssize_t nt = 0;
                for (int64_t q = start[r]; q < start[r + 1]; q++) {
                    int64_t k = by_row[q];
                    if (col[k] < 0) continue;
                    if (acc[col[k]] == 0) touched[nt++] = col[k];
                    acc[col[k]] += w[k];
                }
                /* Only the row's TOP_PAIRS largest overlaps enter the greedy: a row rarely
                   takes a column past them, and sorting every pair would cost O(n log n). */
                Py_ssize_t kept = 0;
                overlap_t *mine = pairs + np;
                for (Py_ssize_t t = 0; t < nt; t++) {
                    int64_t c = touched[t];
                    overlap_t cand = {acc[c], r, c};
                    if (c == r) identity += acc[c];
                    acc[c] = 0;
                    if (cand.w <= 0) continue;
                    if (kept == TOP_PAIRS && overlap_order(&cand, &mine[kept - 1]) >= 0) continue;
                    Py_ssize_t k = kept < TOP_PAIRS ? kept++ : kept - 1;
                    while (k > 0 && overlap_order(&cand, &mine[k - 1]) < 0) {
                        mine[k] = mine[k - 1];
                        k--;
                    }
                    mine[k] = cand;
                }
                np += kept;
            }
            qsort(pairs, (size_t)np, sizeof(overlap_t), overlap_order);
            for (Py_ssize_t r = 0; r < g; r++) proposal[r] = -1;
            for (Py_ssize_t k = 0; k < np; k++) {
                if (row_done[pairs[k].row] || col_done[pairs[k].col]) continue;
                row_done[pairs[k].row] = col_done[pairs[k].col] = 1;
                proposal[pairs[k].row] = pairs[k].col;
                total += pairs[k].w;
            }
            Py_ssize_t next = 0;
            for (Py_ssize_t r = 0; r < g; r++) {
                if (proposal[r] >= 0) continue;
                while (col_done[next]) next++;
                col_done[next] = 1;
                proposal[r] = next;
            }
        }
        free(start);
        free(by_row);
        free(acc);
        free(touched);
        free(pairs);
        free(row_done);
        free(col_done);
    }
    if (status == 0 && total > identity) {
        memcpy(perm, proposal, sizeof(int64_t) * (size_t)g);
        status = 1;
    }
    free(proposal);
    return status;
}

typedef struct {
    Py_ssize_t n, per;
    int64_t seq_len;
    const double *cost;
    const int64_t *tok, *home, *home_rank;
    vec_t *members;
    int64_t *bin_of, *bin_tok;
    int64_t *rank_of;  /* bin_of / per, kept so the scans divide nothing */
    int64_t *version;  /* per rank: bumped whenever the rank gains or loses a sample */
    int64_t *tried;    /* per sample: version[p] + version[h] when it last found nothing */
    double *load;
} home_t;

static int home_relocate(home_t *s, int64_t i, int64_t dst) {
    int64_t src = s->bin_of[i];
    if (vec_push(&s->members[dst], i) < 0) return -1;
    vec_remove(&s->members[src], i);
    s->bin_of[i] = dst;
    s->rank_of[i] = dst / s->per;
    s->version[src / s->per]++;
    s->version[dst / s->per]++;
    s->bin_tok[src] -= s->tok[i];
    s->bin_tok[dst] += s->tok[i];
    s->load[src / s->per] -= s->cost[i];
    s->load[dst / s->per] += s->cost[i];
    return 0;
}

/* A sample in the cost index: (cost, index), sorted once per settle. */
typedef struct {
    double cost;
    int64_t id;
} indexed_t;

static int indexed_order(const void *pa, const void *pb) {
    const indexed_t *a = (const indexed_t *)pa, *b = (const indexed_t *)pb;
    if (a->cost != b->cost) return a->cost < b->cost ? -1 : 1;
    return (a->id > b->id) - (a->id < b->id);
}

/* The first position of rank h's part of the cost index whose cost is at least lo (the
   part's end when none is): a binary search. */
static Py_ssize_t first_costing(const indexed_t *index, const int64_t *rank_start, int64_t h,
                                double lo) {
    Py_ssize_t a = rank_start[h], z = rank_start[h + 1];
    while (a < z) {
        Py_ssize_t mid = a + (z - a) / 2;
        if (index[mid].cost < lo) a = mid + 1;
        else z = mid;
    }
    return a;
}

/* A bin of rank g with room for `tok` more tokens once some samples have left or joined
   its bins (`gone[t]` lost `gone_tok[t]` tokens and `came[t]` gained `came_tok[t]`, t <
   `moves`; -1 for no bin): `prefer` when it fits, else the fullest that fits (the first on
   ties), else -1. */
static int64_t fit_after(const home_t *s, int64_t g, int64_t tok, const int64_t *gone,
                         const int64_t *gone_tok, const int64_t *came, const int64_t *came_tok,
                         int moves, int64_t prefer) {
    int64_t best = -1, best_used = -1;
    for (int64_t b = g * s->per; b < (g + 1) * s->per; b++) {
        int64_t used = s->bin_tok[b];
        for (int t = 0; t < moves; t++) {
            if (gone[t] == b) used -= gone_tok[t];
            if (came[t] == b) used += came_tok[t];
        }
        if (used + tok > s->seq_len) continue;
        if (b == prefer) return b;
        if (used > best_used) best = b, best_used = used;
    }
    return best;
}

/* The fullest bin of rank h with room for `tok` more tokens (the first on ties), or -1. */
static int64_t fullest_fit(const home_t *s, int64_t h, int64_t tok) {
    return fit_after(s, h, tok, NULL, NULL, NULL, NULL, 0, -1);
}

/* The nlight least loaded ranks, lightest first (ties: lowest index), into light. */
static void light_ranks(const double *load, Py_ssize_t ranks, int64_t *light, Py_ssize_t nlight) {
    Py_ssize_t m = 0;
    for (Py_ssize_t r = 0; r < ranks; r++) {
        if (m == nlight && load[r] >= load[light[m - 1]]) continue;
        Py_ssize_t k = m < nlight ? m++ : m - 1;
        while (k > 0 && load[light[k - 1]] > load[r]) {
            light[k] = light[k - 1];
            k--;
        }
        light[k] = r;
    }
}

/* A rank to take the away sample j of rank h, so that the sample i of bin x (rank p) can go
   home to h: j's own home rank first (then both come home), else the least loaded ranks of
   `light` (loads ascending when the pass began; re-checked here). Only ranks that stay at or
   below `limit` with a bin that has room for j qualify; p counts i as gone. The bin, or -1. */
static int64_t eject_target(const home_t *s, int64_t j, int64_t h, int64_t p, int64_t x,
                            int64_t i, double limit, const int64_t *light, Py_ssize_t nlight) {
    int64_t tj = s->tok[j], hj = s->home_rank[j], none = -1, ti = s->tok[i];
    for (Py_ssize_t k = -1; k < nlight; k++) {
        int64_t g = k < 0 ? hj : light[k];
        if (g == h || (k >= 0 && g == hj)) continue;
        double load = s->load[g] + s->cost[j] - (g == p ? s->cost[i] : 0.0);
        if (load > limit) continue;
        /* i leaves bin x (of p); j's source bin first. */
        int64_t b = fit_after(s, g, tj, &x, &ti, &none, &none, 1, s->home[j]);
        if (b >= 0) return b;
    }
    return -1;
}

/* The ejection of the thorough settle, after a swap found nothing: sample i (bin x of rank
   p) goes home to h and an away sample j of h makes room, moving on to its own home or to
   a light rank (eject_target). Moved samples fall by one, or by two when j goes home.
   Partners are scanned from the cheapest that keeps h at or below `limit`. 1 when done,
   0 when nothing fits, -1 on no memory. */
static int home_eject(home_t *s, int64_t i, double limit, Py_ssize_t scan, const indexed_t *index,
                      const int64_t *rank_start, const int64_t *light, Py_ssize_t nlight) {
    int64_t x = s->bin_of[i], p = s->rank_of[i], h = s->home_rank[i], ti = s->tok[i];
    int64_t seq_len = s->seq_len;
    Py_ssize_t a = first_costing(index, rank_start, h, s->cost[i] - (limit - s->load[h]));
    Py_ssize_t last = a + scan < rank_start[h + 1] ? a + scan : rank_start[h + 1];
    for (Py_ssize_t k = a; k < last; k++) {
        int64_t j = index[k].id;
        if (s->rank_of[j] != h || s->home_rank[j] == h || s->tok[j] > seq_len) continue;
        if (s->load[h] - s->cost[j] + s->cost[i] > limit) continue;
        int64_t yb = s->bin_of[j], y = -1;
        if (s->bin_tok[yb] - s->tok[j] + ti <= seq_len) {
            y = yb;
        } else if (s->members[yb].n >= 2) {
            y = fullest_fit(s, h, ti); /* never yb: i does not fit there even once j left */
        }
        if (y < 0) continue;
        int64_t dst = eject_target(s, j, h, p, x, i, limit, light, nlight);
        if (dst < 0) continue;
        if (home_relocate(s, j, dst) < 0 || home_relocate(s, i, y) < 0) return -1;
        return 1;
    }
    return 0;
}

/* The pair homecoming of the thorough settle (pair_pass), after the ejections: sample i
   (bin x of rank p) goes home to h and a sample j of h that was read by p goes home to p,
   where their costs differ too much for a plain swap: an away sample k of p evens the
   difference by moving on to its own home or to h. Moved samples fall by two, or by three
   when k goes home. j and k are scanned from the cheapest that keeps h (then p) at or below
   `limit`, `scan` index entries each. 1 when done, 0 when nothing fits, -1 on no memory. */
static int home_pair(home_t *s, int64_t i, double limit, Py_ssize_t scan, const indexed_t *index,
                      const int64_t *rank_start) {
    int64_t x = s->bin_of[i], p = s->rank_of[i], h = s->home_rank[i], ti = s->tok[i];
    double ci = s->cost[i];
    int64_t seq_len = s->seq_len;
    Py_ssize_t a = first_costing(index, rank_start, h, ci - (limit - s->load[h]));
    Py_ssize_t last = a + scan < rank_start[h + 1] ? a + scan : rank_start[h + 1];
    for (Py_ssize_t kj = a; kj < last; kj++) {
        int64_t j = index[kj].id;
        if (s->rank_of[j] != h || s->home_rank[j] != p || s->tok[j] > seq_len) continue;
        double cj = s->cost[j];
        if (s->load[h] - cj + ci > limit) continue;
        /* i takes j's bin when it fits there once j left, else the fullest other bin of h,
           j's bin keeping a sample. */
        int64_t yb = s->bin_of[j], y = -1;
        if (s->bin_tok[yb] - s->tok[j] + ti <= seq_len) {
            y = yb;
        } else if (s->members[yb].n >= 2) {
            y = fullest_fit(s, h, ti);
        }
        if (y < 0) continue;
        double lp = s->load[p] - ci; /* p once i left */
        Py_ssize_t b0 = first_costing(index, rank_start, p, cj - (limit - lp));
        Py_ssize_t b1 = b0 + scan < rank_start[p + 1] ? b0 + scan : rank_start[p + 1];
        for (Py_ssize_t kk = b0; kk < b1; kk++) {
            int64_t k = index[kk].id, hk = s->home_rank[k];
            if (k == i || s->rank_of[k] != p || hk == p || s->tok[k] > seq_len) continue;
            double ck = s->cost[k];
            if (lp - ck + cj > limit) continue;
            /* Where k can go by load first (cheap): its home, then h. */
            int home_ok = hk != h && s->load[hk] + ck <= limit;
            int h_ok = s->load[h] + ci - cj + ck <= limit;
            if (!home_ok && !h_ok) continue;
            /* Tokens once i left x and joined y, j left yb, and k leaves zb. */
            int64_t zb = s->bin_of[k];
            int64_t gone[3] = {x, yb, zb}, gone_tok[3] = {ti, s->tok[j], s->tok[k]};
            int64_t came[3] = {y, -1, -1}, came_tok[3] = {ti, 0, 0};
            /* j takes k's bin when it fits there once k left, else the fullest other bin of
               p. k's bin never ends empty: when k (and i, if it was there too) were all it
               held, j fits it (tok[j] <= seq_len) and takes it. */
            int64_t z = fit_after(s, p, s->tok[j], gone, gone_tok, came, came_tok, 3, zb);
            if (z < 0) continue;
            came[1] = z;
            came_tok[1] = s->tok[j];
            int64_t w = -1;
            if (home_ok) w = fit_after(s, hk, s->tok[k], gone, gone_tok, came, came_tok, 2,
                                        s->home[k]);
            if (w < 0 && h_ok) w = fit_after(s, h, s->tok[k], gone, gone_tok, came, came_tok, 2,
                                              -1);
            if (w < 0) continue;
            if (home_relocate(s, i, y) < 0 || home_relocate(s, j, z) < 0 ||
                home_relocate(s, k, w) < 0) {
                return -1;
            }
            return 1;
        }
    }
    return 0;
}

/* The cost index by rank: index[rank_start[r] .. rank_start[r + 1]) lists rank r's samples
   by (cost, index), from the global order by_cost by a stable counting sort (O(n)). */
static void index_by_rank(const home_t *s, const indexed_t *by_cost, indexed_t *index,
                          int64_t *rank_start, Py_ssize_t ranks) {
    for (Py_ssize_t r = 0; r <= ranks; r++) rank_start[r] = 0;
    for (Py_ssize_t i = 0; i < s->n; i++) rank_start[s->rank_of[i] + 1]++;
    for (Py_ssize_t r = 0; r < ranks; r++) rank_start[r + 1] += rank_start[r];
    for (Py_ssize_t k = 0; k < s->n; k++) {
        int64_t r = s->rank_of[by_cost[k].id];
        index[rank_start[r]++] = by_cost[k];
    }
    for (Py_ssize_t r = ranks; r > 0; r--) rank_start[r] = rank_start[r - 1];
    rank_start[0] = 0;
}

/* One homecoming pass (see the file comment); the number of changes, or -1 on no memory.
   A swap partner's cost must lie in [ci - slack of h, ci + slack of p]: it is found by
   binary search in h's part of a cost index, rebuilt when the pass starts from the global
   cost order `by_cost` by a stable counting sort on each sample's current rank (O(n)).
   Samples that moved during the pass are re-checked before use (an entry whose sample left
   h is skipped), so the index only ever hides candidates until the next pass. */
static Py_ssize_t home_pass(home_t *s, double limit, Py_ssize_t scan, const indexed_t *by_cost,
                            indexed_t *index, int64_t *rank_start, Py_ssize_t ranks,
                            int64_t *light, Py_ssize_t nlight, Py_ssize_t eject_scan) {
    Py_ssize_t changes = 0;
    int64_t seq_len = s->seq_len;
    index_by_rank(s, by_cost, index, rank_start, ranks);
    if (nlight > 0) light_ranks(s->load, ranks, light, nlight);
    for (Py_ssize_t i = 0; i < s->n; i++) {
        int64_t x = s->bin_of[i], p = s->rank_of[i], hb = s->home[i], h = s->home_rank[i];
        int64_t ti = s->tok[i];
        double ci = s->cost[i];
        if (p == h || ti > seq_len) continue;
        /* Nothing worked last time and neither rank changed since: nothing will now. */
        if (s->tried[i] == s->version[p] + s->version[h]) continue;
        if (s->members[x].n >= 2 && s->load[h] + ci <= limit) {
            int64_t y = -1;
            if (s->bin_tok[hb] + ti <= seq_len) {
                y = hb;
            } else {
                y = fullest_fit(s, h, ti);
            }
            if (y >= 0) {
                if (home_relocate(s, i, y) < 0) return -1;
                changes++;
                continue;
            }
        }
        /* A swap with an away sample of h: one that belongs on p first. */
        double lo = ci - (limit - s->load[h]), hi = ci + (limit - s->load[p]);
        Py_ssize_t a = first_costing(index, rank_start, h, lo);
        int64_t best = -1;
        Py_ssize_t last = a + scan < rank_start[h + 1] ? a + scan : rank_start[h + 1];
        for (Py_ssize_t k = a; k < last && index[k].cost <= hi; k++) {
            int64_t j = index[k].id;
            int64_t hj = s->home_rank[j];
            if (s->rank_of[j] != h || hj == h || s->tok[j] > seq_len) continue;
            int64_t yb = s->bin_of[j];
            if (s->bin_tok[x] - ti + s->tok[j] > seq_len) continue;
            if (s->bin_tok[yb] - s->tok[j] + ti > seq_len) continue;
            if (s->load[h] - s->cost[j] + ci > limit) continue;
            if (s->load[p] - ci + s->cost[j] > limit) continue;
            if (best < 0) best = j;
            if (hj == p) {
                best = j;
                break;
            }
        }
        if (best >= 0) {
            int64_t yb = s->bin_of[best];
            if (home_relocate(s, i, yb) < 0 || home_relocate(s, best, x) < 0) return -1;
            changes++;
            continue;
        }
        if (nlight > 0 && s->members[x].n >= 2) {
            int done = home_eject(s, i, limit, eject_scan, index, rank_start, light, nlight);
            if (done < 0) return -1;
            if (done) {
                changes++;
                continue;
            }
        }
        s->tried[i] = s->version[p] + s->version[h];
    }
    return changes;
}

/* One pass of pairs (home_pair) over the samples still away, after the ejection passes
   have done what they can: the number of changes, or -1 on no memory. A sample is retried
   only once its rank or its home changed since it last found nothing. */
static Py_ssize_t pair_pass(home_t *s, double limit, const indexed_t *by_cost,
                             indexed_t *index, int64_t *rank_start, Py_ssize_t ranks) {
    Py_ssize_t changes = 0;
    index_by_rank(s, by_cost, index, rank_start, ranks);
    for (Py_ssize_t i = 0; i < s->n; i++) {
        int64_t p = s->rank_of[i], h = s->home_rank[i];
        if (p == h || s->tok[i] > s->seq_len || s->members[s->bin_of[i]].n < 2) continue;
        if (s->tried[i] == s->version[p] + s->version[h]) continue;
        int done = home_pair(s, i, limit, EJECT_SCAN, index, rank_start);
        if (done < 0) return -1;
        if (done) {
            changes++;
        } else {
            s->tried[i] = s->version[p] + s->version[h];
        }
    }
    return changes;
}

/*
 * settle(cost, tok, weight, home, flat, sizes, out_flat, out_sizes, per_rank, seq_len,
 *        limit, order) -> number of homecoming changes
 *
 * home[i] is the source bin of sample i (rank-major), weight[i] >= 0 its movement weight.
 * (flat, sizes) is the layout to settle; the settled one goes to (out_flat, out_sizes),
 * each bin's samples in their order (a sample brought home joins the end of its bin).
 * limit < 0 skips homecoming (relabelling only); thorough (optional, default false) runs
 * THOROUGH_PASSES passes of THOROUGH_SCAN swap partners, then the ejection and pair passes
 * (steps 4 and 5 of the file comment). order lists the samples by (cost,
 * index) ascending, what homecoming's cost index is built from; an empty order has it sorted here
 * (a caller settling several layouts of one step sorts once).
 */
PyObject *evenflow_settle(PyObject *Py_UNUSED(self), PyObject *args) {
    Py_buffer cost_b, tok_b, w_b, home_b, flat_b, sizes_b, of_b, os_b, order_b;
    Py_ssize_t per, seq_len;
    double limit;
    int thorough = 0;
    if (!PyArg_ParseTuple(args, "y*y*y*y*y*y*w*w*nndy*|p", &cost_b, &tok_b, &w_b, &home_b,
                          &flat_b, &sizes_b, &of_b, &os_b, &per, &seq_len, &limit, &order_b,
                          &thorough)) {
        return NULL;
    }
    PyObject *result = NULL;
    Py_ssize_t n = cost_b.len / (Py_ssize_t)sizeof(double);
    Py_ssize_t nb = sizes_b.len / (Py_ssize_t)sizeof(int64_t);
    vec_t *members = NULL;
    int64_t *block = NULL;
    Py_ssize_t changes = 0;
    int failed = 0;
    if (per < 1 || nb % per != 0 || tok_b.len != n * 8 || w_b.len != n * 8 ||
        home_b.len != n * 8 || flat_b.len != n * 8 || of_b.len != n * 8 ||
        os_b.len != nb * 8) {
        PyErr_SetString(PyExc_ValueError, "settle: inconsistent array sizes");
        goto done;
    }
    const int64_t *order = order_b.len ? (const int64_t *)order_b.buf : NULL;
    failed = order != NULL && order_b.len != n * 8;
    if (order != NULL && !failed) {
        /* Trusted below as a permutation in (cost, index) order: checked here, O(n). */
        unsigned char *seen = calloc((size_t)(n > 0 ? n : 1), 1);
        if (seen == NULL) {
            PyErr_NoMemory();
            goto done;
        }
        const double *c = (const double *)cost_b.buf;
        for (Py_ssize_t k = 0; k < n && !failed; k++) {
            int64_t i = order[k];
            if (i < 0 || i >= n || seen[i]) {
                failed = 1;
            } else {
                seen[i] = 1;
                if (k > 0 && (c[order[k - 1]] > c[i] || (c[order[k - 1]] == c[i] && order[k - 1] > i)))
                    failed = 1;
            }
        }
        free(seen);
    }
    if (failed) {
        PyErr_SetString(PyExc_ValueError,
                        "settle: order must list every sample once by (cost, index)");
        goto done;
    }
    Py_ssize_t ranks = nb / per;
    const double *cost = (const double *)cost_b.buf;
    const int64_t *tok = (const int64_t *)tok_b.buf, *w = (const int64_t *)w_b.buf;
    const int64_t *home = (const int64_t *)home_b.buf, *flat = (const int64_t *)flat_b.buf;
    const int64_t *sizes = (const int64_t *)sizes_b.buf;
    /* Indices are trusted below: flat must list every sample once, as sizes say. */
    {
        Py_ssize_t at = 0;
        unsigned char *seen = calloc((size_t)(n > 0 ? n : 1), 1);
        if (seen == NULL) {
            PyErr_NoMemory();
            goto done;
        }
        for (Py_ssize_t b = 0; b < nb && !failed; b++) {
            if (sizes[b] < 0 || at + sizes[b] > n) failed = 1;
            for (int64_t k = 0; !failed && k < sizes[b]; k++, at++) {
                int64_t i = flat[at];
                if (i < 0 || i >= n || seen[i] || home[i] < 0 || home[i] >= nb || w[i] < 0)
                    failed = 1;
                else
                    seen[i] = 1;
            }
        }
        free(seen);
        if (failed || at != n) {
            PyErr_SetString(PyExc_ValueError,
                            "settle: flat must list every sample once, as sizes say, with "
                            "home bins in range and weights >= 0");
            goto done;
        }
    }
    /* rows, cols (n each), bin_of (n), bin start (nb + 1), rank perm (ranks), bin perm
       (per), position of each old bin (nb), bin tokens (nb), loads (ranks). */
    block = malloc(sizeof(int64_t) * (size_t)(3 * n + 3 * nb + 2 * ranks + per + 2));
    members = calloc((size_t)nb, sizeof(vec_t));
    if (block == NULL || members == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    int64_t *rows = block, *cols = rows + n, *bin_of = cols + n, *first = bin_of + n;
    int64_t *rank_perm = first + nb + 1, *bin_perm = rank_perm + ranks, *where = bin_perm + per;
    int64_t *bin_tok = where + nb;
    double *load = (double *)(bin_tok + nb);
    Py_BEGIN_ALLOW_THREADS
    first[0] = 0;
    for (Py_ssize_t b = 0; b < nb; b++) first[b + 1] = first[b] + sizes[b];
    for (Py_ssize_t b = 0; b < nb; b++) {
        for (int64_t k = first[b]; k < first[b + 1]; k++) bin_of[flat[k]] = b;
    }
    /* 1. Ranks. */
    for (Py_ssize_t k = 0; k < n; k++) {
        int64_t i = flat[k];
        rows[k] = bin_of[i] / per;
        cols[k] = home[i] / per;
    }
    /* Weights in flat order (then, per rank, in that rank's order). */
    {
        int64_t *wflat = malloc(sizeof(int64_t) * (size_t)(n > 0 ? n : 1));
        if (wflat == NULL) {
            failed = 1;
        } else {
            for (Py_ssize_t k = 0; k < n; k++) wflat[k] = w[flat[k]];
            if (assign_labels(ranks, n, rows, cols, wflat, rank_perm) < 0) failed = 1;
            /* 2. Bins within each rank, against the bins of the rank it now stands for. */
            for (Py_ssize_t r = 0; r < ranks && !failed; r++) {
                int64_t q = rank_perm[r];
                Py_ssize_t m = 0;
                for (int64_t k = first[r * per]; k < first[(r + 1) * per]; k++) {
                    int64_t i = flat[k];
                    rows[m] = bin_of[i] - r * per;
                    cols[m] = home[i] / per == q ? home[i] - q * per : -1;
                    wflat[m] = w[i];
                    m++;
                }
                if (assign_labels(per, m, rows, cols, wflat, bin_perm) < 0) failed = 1;
                for (Py_ssize_t p = 0; p < per; p++) where[r * per + p] = q * per + bin_perm[p];
            }
            free(wflat);
        }
    }
    if (!failed) {
        for (Py_ssize_t b = 0; b < nb; b++) {
            int64_t dst = where[b];
            bin_tok[dst] = 0;
            for (int64_t k = first[b]; k < first[b + 1]; k++) {
                if (vec_push(&members[dst], flat[k]) < 0) failed = 1;
                bin_tok[dst] += tok[flat[k]];
            }
        }
    }
    /* 3. Homecoming. */
    if (!failed && limit >= 0.0) {
        for (Py_ssize_t r = 0; r < ranks; r++) load[r] = 0.0;
        for (Py_ssize_t b = 0; b < nb; b++) {
            for (Py_ssize_t k = 0; k < members[b].n; k++) {
                bin_of[members[b].v[k]] = b;
                load[b / per] += cost[members[b].v[k]];
            }
        }
        /* rows and cols are free again: the source and current rank of every sample. */
        for (Py_ssize_t i = 0; i < n; i++) {
            rows[i] = home[i] / per;
            cols[i] = bin_of[i] / per;
        }
        int64_t *version = calloc((size_t)ranks, sizeof(int64_t));
        int64_t *tried = malloc(sizeof(int64_t) * (size_t)(n > 0 ? n : 1));
        if (tried != NULL) {
            for (Py_ssize_t i = 0; i < n; i++) tried[i] = -1;
        }
        home_t s = {n,    per,  (int64_t)seq_len, cost,    tok,     home,  rows,
                    members, bin_of, bin_tok,     cols, version, tried, load};
        indexed_t *index = malloc(sizeof(indexed_t) * (size_t)(n > 0 ? n : 1));
        indexed_t *by_cost = malloc(sizeof(indexed_t) * (size_t)(n > 0 ? n : 1));
        int64_t *rank_start = malloc(sizeof(int64_t) * (size_t)(ranks + 2));
        if (by_cost != NULL && order != NULL) {
            for (Py_ssize_t k = 0; k < n; k++) {
                by_cost[k].cost = cost[order[k]];
                by_cost[k].id = order[k];
            }
        } else if (by_cost != NULL) {
            for (Py_ssize_t i = 0; i < n; i++) {
                by_cost[i].cost = cost[i];
                by_cost[i].id = i;
            }
            qsort(by_cost, (size_t)n, sizeof(indexed_t), indexed_order);
        }
        Py_ssize_t nlight = thorough ? (ranks < EJECT_RANKS ? ranks : EJECT_RANKS) : 0;
        int64_t *light = malloc(sizeof(int64_t) * (size_t)(nlight > 0 ? nlight : 1));
        int passes = thorough ? THOROUGH_PASSES : HOME_PASSES;
        Py_ssize_t scan = thorough ? THOROUGH_SCAN : SWAP_SCAN;
        int ready = index && by_cost && rank_start && version && tried && light;
        failed = !ready;
        for (int pass = 0; pass < passes && !failed; pass++) {
            Py_ssize_t done_now =
                home_pass(&s, limit, scan, by_cost, index, rank_start, ranks, NULL, 0, 0);
            failed = done_now < 0;
            changes += done_now > 0 ? done_now : 0;
            if (done_now == 0) break;
        }
        if (nlight > 0 && !failed) {
            /* Ejections, once the passes above are done, under the makespan they reached:
               they only lower movement, never raise the peak those passes left. */
            double peak = 0.0;
            for (Py_ssize_t r = 0; r < ranks; r++) peak = load[r] > peak ? load[r] : peak;
            double cap = peak - EJECT_MARGIN * peak;
            cap = cap < limit ? cap : limit;
            for (Py_ssize_t i = 0; i < n; i++) tried[i] = -1;
            for (int pass = 0; pass < EJECT_PASSES && !failed; pass++) {
                Py_ssize_t done_now = home_pass(&s, cap, SWAP_SCAN, by_cost, index, rank_start,
                                                ranks, light, nlight, EJECT_SCAN);
                failed = done_now < 0;
                changes += done_now > 0 ? done_now : 0;
                if (done_now == 0) break;
            }
            /* Pairs last, in passes of their own and under the peak the passes before left
               (a homecoming can lower it): everything before runs as it would without them,
               and every rank a pair touches stays below that peak, so pairs never raise a
               makespan and only move less. */
            peak = 0.0;
            for (Py_ssize_t r = 0; r < ranks; r++) peak = load[r] > peak ? load[r] : peak;
            double below = peak - EJECT_MARGIN * peak;
            cap = below < cap ? below : cap;
            for (Py_ssize_t i = 0; i < n; i++) tried[i] = -1;
            int pair_passes = n <= PAIR_MAX_SAMPLES ? PAIR_PASSES : 0;
            for (int pass = 0; pass < pair_passes && !failed; pass++) {
                Py_ssize_t done_now = pair_pass(&s, cap, by_cost, index, rank_start, ranks);
                failed = done_now < 0;
                changes += done_now > 0 ? done_now : 0;
                if (done_now == 0) break;
            }
        }
        free(light);
        free(index);
        free(by_cost);
        free(rank_start);
        free(version);
        free(tried);
    }
    if (!failed) {
        int64_t *out_flat = (int64_t *)of_b.buf, *out_sizes = (int64_t *)os_b.buf;
        Py_ssize_t at = 0;
        for (Py_ssize_t b = 0; b < nb; b++) {
            out_sizes[b] = members[b].n;
            memcpy(out_flat + at, members[b].v, sizeof(int64_t) * (size_t)members[b].n);
            at += members[b].n;
        }
    }
    Py_END_ALLOW_THREADS
    if (failed) {
        PyErr_NoMemory();
        goto done;
    }
    result = PyLong_FromSsize_t(changes);

done:
    if (members != NULL) {
        for (Py_ssize_t b = 0; b < nb; b++) free(members[b].v);
    }
    free(members);
    free(block);
    PyBuffer_Release(&cost_b);
    PyBuffer_Release(&tok_b);
    PyBuffer_Release(&w_b);
    PyBuffer_Release(&home_b);
    PyBuffer_Release(&flat_b);
    PyBuffer_Release(&sizes_b);
    PyBuffer_Release(&of_b);
    PyBuffer_Release(&os_b);
    PyBuffer_Release(&order_b);
    return result;
}
