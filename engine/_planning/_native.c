/*
 * The planner's compiled core: the reference greedy (lpt_assign in lpt.py) and the default
 * algorithm's local search (RefineAlgorithm in refine.py), with and without packing budgets.
 *
 * This is the only production implementation of both; native.py is the one place Python
 * calls it. The slow reference in tests/oracles/planning.py (vectorised numpy, the former
 * Python implementation) specifies the same computation, and the tests hold the two to
 * identical layouts on random problems, ties included. Floats are IEEE doubles combined in
 * the same order as the oracle's expressions, and the module is compiled without
 * floating-point contraction, so results agree bit for bit.
 *
 * CORE_VERSION enters the planner's identity, so a group whose ranks would plan differently
 * is refused before its first step: bump it with every change that can change a plan.
 *
 * Greedy rule, per sample in the given order: among ranks that have a bin with room (and
 * budget) for the sample, take the lowest load; ranks tied on that load compare (capacity
 * left after insertion, rank tokens, rank); inside the rank the fullest bin that fits wins
 * (first bin on ties). A rank whose emptiest bin cannot take the sample's tokens is parked
 * (bins only fill up, so it stays infeasible) until a sample short enough for that bin
 * comes; a rank that has token room but no budget room sits out this one sample only.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <stdlib.h>
#include <math.h>
#include <string.h>

#include "_drive.h"
#include "_vec.h"

#define CORE_VERSION 9

typedef struct {
    int64_t *ids;
    Py_ssize_t size;
} heap_t;

/* Load heap: least load first, then lowest rank. */
static inline int load_less(const double *load, int64_t a, int64_t b) {
    return load[a] < load[b] || (load[a] == load[b] && a < b);
}

/* Parking heap: largest room first (room = seq_len - fill of the rank's emptiest bin). */
static inline int room_less(const int64_t *room, int64_t a, int64_t b) {
    return room[a] > room[b] || (room[a] == room[b] && a < b);
}

#define DEFINE_HEAP(NAME, KEY_T, LESS)                                                        \
    static void NAME##_push(heap_t *h, const KEY_T *key, int64_t id) {                        \
        Py_ssize_t i = h->size++;                                                             \
        while (i > 0) {                                                                       \
            Py_ssize_t parent = (i - 1) / 2;                                                  \
            if (!LESS(key, id, h->ids[parent])) break;                                        \
            h->ids[i] = h->ids[parent];                                                       \
            i = parent;                                                                       \
        }                                                                                     \
        h->ids[i] = id;                                                                       \
    }                                                                                         \
    static void NAME##_sift(heap_t *h, const KEY_T *key, Py_ssize_t i) {                      \
        int64_t id = h->ids[i];                                                               \
        for (;;) {                                                                            \
            Py_ssize_t child = 2 * i + 1;                                                     \
            if (child >= h->size) break;                                                      \
            if (child + 1 < h->size && LESS(key, h->ids[child + 1], h->ids[child])) child++;  \
            if (!LESS(key, h->ids[child], id)) break;                                         \
            h->ids[i] = h->ids[child];                                                        \
            i = child;                                                                        \
        }                                                                                     \
        h->ids[i] = id;                                                                       \
    }                                                                                         \
    static int64_t NAME##_pop(heap_t *h, const KEY_T *key) {                                  \
        int64_t top = h->ids[0];                                                              \
        h->size--;                                                                            \
        if (h->size > 0) {                                                                    \
            h->ids[0] = h->ids[h->size];                                                      \
            NAME##_sift(h, key, 0);                                                           \
        }                                                                                     \
        return top;                                                                           \
    }

DEFINE_HEAP(loads, double, load_less)
DEFINE_HEAP(parked, int64_t, room_less)

/* Phase-1 heap: (load, rank tokens, rank) ascending, as Python compares the tuples. */
typedef struct {
    const double *load;
    const int64_t *rtok;
} opening_t;

static inline int opening_less(const opening_t *key, int64_t a, int64_t b) {
    if (key->load[a] != key->load[b]) return key->load[a] < key->load[b];
    if (key->rtok[a] != key->rtok[b]) return key->rtok[a] < key->rtok[b];
    return a < b;
}

DEFINE_HEAP(openings, opening_t, opening_less)

/* Fullest bin of rank r that can take `limit`-bounded fill (first on ties), or -1. */
static inline Py_ssize_t best_slot(const int64_t *fills, Py_ssize_t per, int64_t limit) {
    int64_t fill = -1;
    Py_ssize_t slot = -1;
    for (Py_ssize_t p = 0; p < per; p++) {
        int64_t v = fills[p];
        if (v <= limit && v > fill) {
            fill = v;
            slot = p;
        }
    }
    return slot;
}

/* Whether a sample with budget footprint `row` fits a bin whose sums are `sums`. */
static inline int budget_fits(const double *sums, const double *row, const double *limits,
                              Py_ssize_t nbud) {
    for (Py_ssize_t k = 0; k < nbud; k++) {
        if (!(sums[k] + row[k] <= limits[k])) return 0;
    }
    return 1;
}

/* best_slot that also needs the bin's budget sums (per * nbud, bin-major) to take `row`. */
static inline Py_ssize_t best_slot_budgets(const int64_t *fills, const double *sums,
                                           const double *row, const double *limits,
                                           Py_ssize_t nbud, Py_ssize_t per, int64_t limit) {
    int64_t fill = -1;
    Py_ssize_t slot = -1;
    for (Py_ssize_t p = 0; p < per; p++) {
        int64_t v = fills[p];
        if (v <= limit && v > fill && budget_fits(sums + p * nbud, row, limits, nbud)) {
            fill = v;
            slot = p;
        }
    }
    return slot;
}

static inline int64_t emptiest(const int64_t *fills, Py_ssize_t per) {
    int64_t low = fills[0];
    for (Py_ssize_t p = 1; p < per; p++) {
        if (fills[p] < low) low = fills[p];
    }
    return low;
}

static int check(Py_buffer *view, const char *name, Py_ssize_t itemsize, Py_ssize_t count) {
    if (view->len != itemsize * count) {
        PyErr_Format(PyExc_ValueError, "evenflow.engine._planning._native: %s has %zd bytes, expected %zd", name,
                     view->len, itemsize * count);
        return -1;
    }
    return 0;
}

/* Packing budgets as the greedy sees them: nbud == 0 means none (the other fields unused). */
typedef struct {
    Py_ssize_t nbud;
    const double *limits;   /* nbud */
    const double *rows;     /* m * nbud: the remaining samples' footprints, placement order */
    double *sums;           /* nb * nbud: each bin's sums, updated in place */
} budgets_t;

/*
 * Phase 2 on plain arrays. load (R), rank_tokens (R) and bin_tokens (R * per) are the state
 * after phase 1, updated in place; tokens and costs (m) are the remaining samples in
 * placement order; out (m) receives each one's bin. ids holds 4 * R scratch entries.
 * Returns 0 on a dead end (a sample fits no bin). Runs without the GIL.
 */
static int place_core(double *load, int64_t *rank_tokens, int64_t *bin_tokens,
                      const int64_t *tokens, const double *costs, const budgets_t *bud,
                      int64_t *out, Py_ssize_t ranks, Py_ssize_t per, Py_ssize_t m,
                      int64_t seq_len, int64_t *ids) {
    heap_t heap = {ids, 0};
    heap_t park = {ids + ranks, 0};
    int64_t *room = ids + 2 * ranks;
    /* Ranks off the heap for this sample only: tied ranks that lost, and ranks whose bins
       have token room but no budget room. Each rank is in the list at most once. */
    int64_t *aside = ids + 3 * ranks;
    Py_ssize_t nbud = bud->nbud;
    for (Py_ssize_t r = 0; r < ranks; r++) loads_push(&heap, load, r);
    for (Py_ssize_t i = 0; i < m; i++) {
        int64_t t = tokens[i];
        int64_t limit = seq_len - t;
        const double *row = nbud ? bud->rows + i * nbud : NULL;
        while (park.size > 0 && room[park.ids[0]] >= t) {
            int64_t r = parked_pop(&park, room);
            loads_push(&heap, load, r);
        }
        int64_t chosen = -1;
        Py_ssize_t chosen_slot = -1;
        Py_ssize_t naside = 0;
        int tie = 0; /* set once the lowest feasible load is found: its ties follow */
        double level = 0.0;
        while (heap.size > 0 && (!tie || load[heap.ids[0]] == level)) {
            int64_t q = loads_pop(&heap, load);
            const int64_t *fills = bin_tokens + q * per;
            Py_ssize_t qs = nbud ? best_slot_budgets(fills, bud->sums + q * per * nbud, row,
                                                     bud->limits, nbud, per, limit)
                                 : best_slot(fills, per, limit);
            if (qs < 0) {
                int64_t low = emptiest(fills, per);
                if (low > limit) {
                    room[q] = seq_len - low;
                    parked_push(&park, room, q);
                } else {
                    aside[naside++] = q; /* tokens fit, a budget does not */
                }
                continue;
            }
            if (!tie) {
                tie = 1;
                level = load[q];
                chosen = q;
                chosen_slot = qs;
                continue;
            }
            /* Ranks tied on this load: the smallest (room left, rank tokens, rank) wins.
               Ranks leave the heap in ascending order, so q > chosen on a full tie. */
            int64_t left_q = limit - fills[qs];
            int64_t left_c = limit - bin_tokens[chosen * per + chosen_slot];
            if (left_q < left_c || (left_q == left_c && rank_tokens[q] < rank_tokens[chosen])) {
                aside[naside++] = chosen;
                chosen = q;
                chosen_slot = qs;
            } else {
                aside[naside++] = q;
            }
        }
        if (chosen < 0) return 0; /* every rank is parked or out of budget: a dead end */
        for (Py_ssize_t k = 0; k < naside; k++) loads_push(&heap, load, aside[k]);
        Py_ssize_t b = chosen * per + chosen_slot;
        bin_tokens[b] += t;
        if (nbud) {
            double *acc = bud->sums + b * nbud;
            for (Py_ssize_t k = 0; k < nbud; k++) acc[k] += row[k];
        }
        rank_tokens[chosen] += t;
        load[chosen] = load[chosen] + costs[i];
        out[i] = b;
        loads_push(&heap, load, chosen);
    }
    return 1;
}

/*
 * lpt(costs, tokens, budget_costs, limits, order, out_flat, out_sizes, num_ranks, per_rank,
 *     seq_len) -> bool
 *
 * The whole greedy (lpt_assign in lpt.py): order is the placement order
 * (np.lexsort((-tokens, -costs))), at least num_ranks * per_rank samples long;
 * budget_costs is the samples' budget footprints (num_samples x len(limits), row-major) and
 * limits the packing budgets (empty for none). The layout goes to (out_flat, out_sizes),
 * bin by bin, each bin's samples in placement order. Returns False on a dead end.
 */
static PyObject *lpt(PyObject *Py_UNUSED(self), PyObject *args) {
    Py_buffer cost_b, tok_b, bud_b, lim_b, order_b, of_b, os_b;
    Py_ssize_t ranks, per, seq_len;
    if (!PyArg_ParseTuple(args, "y*y*y*y*y*w*w*nnn", &cost_b, &tok_b, &bud_b, &lim_b, &order_b,
                          &of_b, &os_b, &ranks, &per, &seq_len)) {
        return NULL;
    }
    PyObject *result = NULL;
    void *block = NULL;
    double *bud_block = NULL;
    Py_ssize_t n = cost_b.len / (Py_ssize_t)sizeof(double);
    Py_ssize_t nbud = lim_b.len / (Py_ssize_t)sizeof(double);
    /* ranks * per is checked before it is formed: a wrapped product would pass n >= nb. */
    if (per < 1 || ranks < 1 || per > PY_SSIZE_T_MAX / ranks || n < ranks * per) {
        PyErr_SetString(PyExc_ValueError, "lpt: need ranks, per_rank >= 1 and a sample per bin");
        goto done;
    }
    Py_ssize_t nb = ranks * per;
    if (check(&tok_b, "tokens", sizeof(int64_t), n) ||
        check(&bud_b, "budget_costs", sizeof(double), n * nbud) ||
        check(&order_b, "order", sizeof(int64_t), n) ||
        check(&of_b, "out_flat", sizeof(int64_t), n) ||
        check(&os_b, "out_sizes", sizeof(int64_t), nb)) {
        goto done;
    }
    const int64_t *order_check = (const int64_t *)order_b.buf;
    for (Py_ssize_t k = 0; k < n; k++) {
        if (order_check[k] < 0 || order_check[k] >= n) {
            PyErr_SetString(PyExc_ValueError, "lpt: order holds an index outside the samples");
            goto done;
        }
    }
    Py_ssize_t m = n - nb;
    /* load, rank tokens, opened, heap (R each); bin fills, first sample (nb each); rest
       tokens, costs, destinations (m each); 4 R of phase-2 scratch. */
    block = malloc(sizeof(int64_t) * (size_t)(8 * ranks + 2 * nb + 3 * m + 1));
    /* Budget sums per bin (nb rows) and the remaining samples' rows (m rows). */
    bud_block = nbud ? (double *)malloc(sizeof(double) * (size_t)((nb + m) * nbud)) : NULL;
    if (block == NULL || (nbud && bud_block == NULL)) {
        PyErr_NoMemory();
        goto done;
    }
    const double *costs = (const double *)cost_b.buf;
    const int64_t *tokens = (const int64_t *)tok_b.buf;
    const double *bud_rows = (const double *)bud_b.buf;
    const int64_t *order = (const int64_t *)order_b.buf;
    int64_t *out_flat = (int64_t *)of_b.buf, *out_sizes = (int64_t *)os_b.buf;
    double *load = (double *)block;
    int64_t *rtok = (int64_t *)block + ranks;
    int64_t *opened = rtok + ranks;
    int64_t *hids = opened + ranks;
    int64_t *fills = hids + ranks;
    int64_t *opener = fills + nb;
    int64_t *rest_tok = opener + nb;
    double *rest_cost = (double *)(rest_tok + m);
    int64_t *dest = (int64_t *)(rest_cost + m);
    int64_t *scratch = dest + m;
    budgets_t bud = {nbud, (const double *)lim_b.buf, bud_block + (nbud ? nb * nbud : 0),
                     bud_block};
    int ok = 1;

    Py_BEGIN_ALLOW_THREADS
    /* Phase 1: the first nb samples each open the first empty bin of the rank minimising
       (load, rank tokens, rank); a rank with no empty bin left waits for phase 2. Budgets
       play no part: an empty bin takes any sample (the source layout is feasible, so each
       sample alone is). */
    heap_t heap = {hids, 0};
    const opening_t key = {load, rtok};
    for (Py_ssize_t r = 0; r < ranks; r++) {
        load[r] = 0.0;
        rtok[r] = 0;
        opened[r] = 0;
        heap.ids[heap.size++] = r; /* equal keys: already a heap in rank order */
    }
    for (Py_ssize_t k = 0; k < nb; k++) {
        int64_t r = openings_pop(&heap, &key);
        int64_t i = order[k];
        int64_t p = opened[r]++;
        opener[r * per + p] = i;
        fills[r * per + p] = tokens[i];
        if (nbud) memcpy(bud.sums + (r * per + p) * nbud, bud_rows + i * nbud,
                         sizeof(double) * (size_t)nbud);
        load[r] = load[r] + costs[i];
        rtok[r] += tokens[i] < seq_len ? tokens[i] : seq_len;
        if (p + 1 < per) openings_push(&heap, &key, r);
    }
    for (Py_ssize_t k = 0; k < m; k++) {
        int64_t i = order[nb + k];
        rest_tok[k] = tokens[i];
        rest_cost[k] = costs[i];
        if (nbud) memcpy(bud_block + (nb + k) * nbud, bud_rows + i * nbud,
                         sizeof(double) * (size_t)nbud);
        if (tokens[i] > seq_len) ok = 0; /* an oversized sample needs an empty bin */
    }
    if (ok) ok = place_core(load, rtok, fills, rest_tok, rest_cost, &bud, dest, ranks, per, m,
                            (int64_t)seq_len, scratch);
    if (ok) {
        /* Bin b: its opener, then its phase-2 samples in placement order. */
        for (Py_ssize_t b = 0; b < nb; b++) out_sizes[b] = 1;
        for (Py_ssize_t k = 0; k < m; k++) out_sizes[dest[k]]++;
        Py_ssize_t at = 0;
        for (Py_ssize_t b = 0; b < nb; b++) {
            out_flat[at] = opener[b];
            fills[b] = at + 1; /* reuse: next free position of bin b */
            at += out_sizes[b];
        }
        for (Py_ssize_t k = 0; k < m; k++) out_flat[fills[dest[k]]++] = order[nb + k];
    }
    Py_END_ALLOW_THREADS
    result = PyBool_FromLong(ok);

done:
    free(block);
    free(bud_block);
    PyBuffer_Release(&cost_b);
    PyBuffer_Release(&tok_b);
    PyBuffer_Release(&bud_b);
    PyBuffer_Release(&lim_b);
    PyBuffer_Release(&order_b);
    PyBuffer_Release(&of_b);
    PyBuffer_Release(&os_b);
    return result;
}

/* ============================================================================================
 * The default algorithm's local search (driven by search.py), with or without budgets.
 *
 * The oracle (tests/oracles/planning.py, OracleSearch) states each family as whole-array
 * numpy expressions; this is the same search, family by family and candidate by candidate
 * (an attempt costs microseconds here, hundreds of them there). Each comparison and float
 * operation follows the oracle's expression, in the same order, so both produce identical
 * layouts. Candidate matrices are walked in row-major order and a candidate replaces the
 * best only when its score is strictly lower, as numpy's argmin returns the first minimum.
 * ========================================================================================== */

/* Partners of the most loaded rank: every family tries the NEAR_TARGETS lightest ranks; when
   none finds a change, moves and then run exchanges try the next WIDE_TARGETS (a run that
   fits is often on a rank past the fourth lightest: at 256 x 2 on long-context steps, this
   took the planner benchmark's p90 max / bound from 1.072 to 1.063, and at 8 x 4 and 64 x 4
   it lowered 119 of 360 and 43 of 54 makespans, none raised). Last, in larger groups, moves
   and bin swaps try every other lighter rank: when the lightest ranks are full, the room is
   on heavier ones (sft, a = 24,576, 512 x 2: the search had stopped at 1.041 x bound). */
/* Tuning constants: listed in engine/_planning/schedule.py (CORE_CONSTANTS), which must match. */
#define NEAR_TARGETS 4
#define WIDE_TARGETS 32
#define FULL_SWAP_PAIRS 4096
#define SWAP_NEIGHBOURS 4
#define EXCHANGE_CANDIDATES 8
#define UNBOUNDED INT64_MAX

typedef enum { NONE = 0, MOVE, SHIFT_MOVE, BIN_SWAP, SWAP, EXCHANGE } kind_t;

typedef struct {
    kind_t kind;
    int64_t a, b, c; /* move (i, y); shift move (i, k, to); bin swap (x, y); swap (i, j);
                        exchange (i, run start, run end) within the search's `xlight` */
} change_t;

typedef struct {
    Py_ssize_t ranks, per, n;
    int64_t seq_len;
    int sumsq;
    const double *cost;
    const int64_t *tok;
    vec_t *members;
    int64_t *bin_of, *bin_cnt, *bin_tok;
    double *bin_cost, *load;
    /* scratch: n entries each */
    int64_t *heavy, *light, *kept, *xlight, *ia, *ib, *ic, *tp;
    /* the swap's window positions (NEAR_TARGETS per sample), and each kept sample's row
       (-1 between calls) */
    int64_t *at, *slot;
    double *key, *cp, *lld;
    /* scratch: one entry per rank (rooms: ranks * per) */
    int64_t *rooms, *first, *second, *best_k, *begin, *size, *pos, *order;
    unsigned char *stuck;
    /* packing budgets: nbud == 0 means none. bud is n x nbud, bin_bud nb x nbud (updated in
       place), run (n + 1) x nbud scratch for the exchange's prefix sums. */
    Py_ssize_t nbud;
    const double *bud, *limits;
    double *bin_bud, *run;
    /* Sorted views kept between attempts (re-sorting every partner's samples each time
       was most of a small step's search): each rank's samples by (cost, index), each bin's
       by (tokens, index). A moving sample is taken out of and put into the views it
       concerns; a view is stale (sorted afresh when next used) until first used, after a
       whole-bin swap, or when it could not grow. Both orders are total, so a view always
       equals a fresh sort of its samples. */
    vec_t *rank_sorted, *bin_sorted;
    unsigned char *rank_stale, *bin_stale;
    /* Entries of PHASE1 in use: bit e for entry e (all of them but in tests, which hold each
       family to its oracle on its own). */
    unsigned long long families;
} search_t;


/* np.maximum of two non-NaN doubles. */
static inline double dmax(double x, double y) { return x >= y ? x : y; }

/* _rank_samples: rank r's samples in bin order. */
static Py_ssize_t rank_samples(const search_t *s, int64_t r, int64_t *out) {
    Py_ssize_t m = 0;
    for (Py_ssize_t b = r * s->per; b < (r + 1) * s->per; b++) {
        if (s->members[b].n) {
            memcpy(out + m, s->members[b].v, sizeof(int64_t) * (size_t)s->members[b].n);
        }
        m += s->members[b].n;
    }
    return m;
}

/*
 * Sum of budget column k over a bin's members, rounded as numpy's
 * ``bud[members].sum(axis=0)`` rounds it: with one budget the column is contiguous and numpy
 * sums it pairwise (blocks of eight partial sums, halves above 128 values); with several it
 * adds row after row.
 */
static double pairwise_column(const search_t *s, const int64_t *ids, Py_ssize_t n,
                              Py_ssize_t k) {
    const double *bud = s->bud;
    Py_ssize_t K = s->nbud;
    if (n < 8) {
        double res = -0.0;
        for (Py_ssize_t i = 0; i < n; i++) res += bud[ids[i] * K + k];
        return res;
    }
    if (n <= 128) {
        double r[8];
        for (int j = 0; j < 8; j++) r[j] = bud[ids[j] * K + k];
        Py_ssize_t i = 8;
        for (; i < n - (n % 8); i += 8) {
            for (int j = 0; j < 8; j++) r[j] += bud[ids[i + j] * K + k];
        }
        double res = ((r[0] + r[1]) + (r[2] + r[3])) + ((r[4] + r[5]) + (r[6] + r[7]));
        for (; i < n; i++) res += bud[ids[i] * K + k];
        return res;
    }
    Py_ssize_t half = n / 2;
    half -= half % 8;
    return pairwise_column(s, ids, half, k) + pairwise_column(s, ids + half, n - half, k);
}

/* Bin b's budget sums afresh from its members (what the oracle's _refresh_budgets does). */
static void refresh_budgets(search_t *s, int64_t b) {
    Py_ssize_t K = s->nbud;
    if (K == 0) return;
    const vec_t *members = &s->members[b];
    double *out = s->bin_bud + b * K;
    if (K == 1) {
        out[0] = 0.0 + pairwise_column(s, members->v, members->n, 0);
        return;
    }
    for (Py_ssize_t k = 0; k < K; k++) out[k] = 0.0;
    for (Py_ssize_t j = 0; j < members->n; j++) {
        const double *row = s->bud + members->v[j] * K;
        for (Py_ssize_t k = 0; k < K; k++) out[k] += row[k];
    }
}

/* Whether every budget holds for sums (base - out) + in, term by term (NULL: no term). */
static inline int budgets_hold(const search_t *s, const double *base, const double *out,
                               const double *in) {
    for (Py_ssize_t k = 0; k < s->nbud; k++) {
        double v = out ? base[k] - out[k] : base[k];
        if (!(v + in[k] <= s->limits[k])) return 0;
    }
    return 1;
}

static inline void mark_stale(search_t *s, int64_t b) {
    s->bin_stale[b] = 1;
    s->rank_stale[b / s->per] = 1;
}

/* (cost, index) ascending: _sorted_samples, and the order of the rank views. */
static int cost_up(const search_t *s, int64_t i, int64_t j) {
    double ci = s->cost[i], cj = s->cost[j];
    return ci < cj || (ci == cj && i < j);
}

/* (tokens, index) ascending: the order of the bin views. */
static int tokens_up(const search_t *s, int64_t i, int64_t j) {
    int64_t ti = s->tok[i], tj = s->tok[j];
    return ti < tj || (ti == tj && i < j);
}

typedef int (*before_t)(const search_t *, int64_t, int64_t);

/* The first entry of a view (ordered by `before`, a strict total order) not before i. */
static Py_ssize_t view_position(const search_t *s, const vec_t *view, int64_t i,
                                before_t before) {
    Py_ssize_t lo = 0, hi = view->n;
    while (lo < hi) {
        Py_ssize_t mid = lo + (hi - lo) / 2;
        if (before(s, view->v[mid], i)) lo = mid + 1;
        else hi = mid;
    }
    return lo;
}

/* A sample leaves (gone = 1) or joins a fresh view, which stays sorted: O(size) instead of a
   re-sort. A view that cannot grow is marked stale (re-sorted, or failing, when next used). */
static void view_update(search_t *s, vec_t *view, unsigned char *stale, int64_t i, int gone,
                        before_t before) {
    if (*stale) return;
    Py_ssize_t k = view_position(s, view, i, before);
    if (gone) {
        memmove(view->v + k, view->v + k + 1, sizeof(int64_t) * (size_t)(view->n - k - 1));
        view->n--;
        return;
    }
    if (vec_push(view, i) < 0) {
        *stale = 1;
        return;
    }
    memmove(view->v + k + 1, view->v + k, sizeof(int64_t) * (size_t)(view->n - 1 - k));
    view->v[k] = i;
}

static int relocate(search_t *s, int64_t i, int64_t src, int64_t dst) {
    /* Room first: a failed allocation must leave the sample where bin_of says it is. */
    if (vec_push(&s->members[dst], i) < 0) return -1;
    view_update(s, &s->bin_sorted[src], &s->bin_stale[src], i, 1, tokens_up);
    view_update(s, &s->bin_sorted[dst], &s->bin_stale[dst], i, 0, tokens_up);
    int64_t rs = src / s->per, rd = dst / s->per;
    if (rs != rd) {
        view_update(s, &s->rank_sorted[rs], &s->rank_stale[rs], i, 1, cost_up);
        view_update(s, &s->rank_sorted[rd], &s->rank_stale[rd], i, 0, cost_up);
    }
    s->members[dst].n--;
    vec_remove(&s->members[src], i);
    s->members[dst].v[s->members[dst].n++] = i;
    s->bin_of[i] = dst;
    int64_t t = s->tok[i];
    double c = s->cost[i];
    s->bin_tok[src] -= t;
    s->bin_tok[dst] += t;
    s->bin_cnt[src] -= 1;
    s->bin_cnt[dst] += 1;
    s->bin_cost[src] -= c;
    s->bin_cost[dst] += c;
    s->load[src / s->per] -= c;
    s->load[dst / s->per] += c;
    return 0;
}

/* _move_with_room: returns the best score (INFINITY when nothing qualifies). */
static double move_with_room(search_t *s, const int64_t *hi, Py_ssize_t nh,
                             const int64_t *targets, Py_ssize_t nt, double tol, change_t *best) {
    Py_ssize_t per = s->per;
    double top = s->load[s->bin_of[hi[0]] / per];
    int64_t *rooms = s->rooms;
    int possible = 0;
    for (Py_ssize_t t = 0; t < nt; t++) {
        int64_t *row = rooms + t * per;
        for (Py_ssize_t p = 0; p < per; p++) row[p] = s->seq_len - s->bin_tok[targets[t] * per + p];
        Py_ssize_t f = 0;
        for (Py_ssize_t p = 1; p < per; p++) if (row[p] > row[f]) f = p;
        Py_ssize_t g = -1;
        for (Py_ssize_t p = 0; p < per; p++) {
            if (p != f && (g < 0 || row[p] > row[g])) g = p;
        }
        s->first[t] = f;
        s->second[t] = g;
        int64_t two = row[f] + row[g];
        double limit = (top - s->load[targets[t]]) - tol;
        for (Py_ssize_t h = 0; h < nh && !possible; h++) {
            if (s->tok[hi[h]] <= two && s->cost[hi[h]] < limit) possible = 1;
        }
    }
    if (!possible) return INFINITY;
    int64_t *light = s->xlight, *slot = s->ia, *freed = s->ib;
    Py_ssize_t m = 0;
    for (Py_ssize_t t = 0; t < nt; t++) {
        Py_ssize_t k0 = m;
        m += rank_samples(s, targets[t], light + m);
        for (Py_ssize_t k = k0; k < m; k++) slot[k] = t;
    }
    int any = 0;
    for (Py_ssize_t k = 0; k < m; k++) {
        int64_t yk = s->bin_of[light[k]];
        Py_ssize_t t = slot[k];
        int64_t own = yk % per;
        int64_t dest = own == s->first[t] ? s->second[t] : s->first[t];
        int64_t tk = s->tok[light[k]];
        int shiftable = tk <= rooms[t * per + dest] && s->bin_cnt[yk] >= 2;
        any |= shiftable;
        freed[k] = shiftable ? rooms[t * per + own] + tk : -1;
    }
    if (!any) return INFINITY;
    /* Per target, the shift that frees the most room (first on ties). */
    for (Py_ssize_t t = 0; t < nt; t++) s->best_k[t] = -1;
    for (Py_ssize_t k = 0; k < m; k++) {
        Py_ssize_t t = slot[k];
        if (s->best_k[t] < 0 || freed[k] > freed[s->best_k[t]]) s->best_k[t] = k;
    }
    double best_score = INFINITY;
    Py_ssize_t br = -1, bc = -1;
    for (Py_ssize_t h = 0; h < nh; h++) {
        int64_t th = s->tok[hi[h]];
        double ch = s->cost[hi[h]];
        for (Py_ssize_t t = 0; t < nt; t++) {
            int64_t room = s->best_k[t] >= 0 ? freed[s->best_k[t]] : -1;
            double tload = s->load[targets[t]];
            if (!(th <= room && ch < (top - tload) - tol)) continue;
            double score = dmax(top - ch, tload + ch);
            if (score < best_score) {
                best_score = score;
                br = h;
                bc = t;
            }
        }
    }
    if (br < 0) return INFINITY;
    int64_t k = s->best_k[bc];
    int64_t own = s->bin_of[light[k]] % per;
    best->kind = SHIFT_MOVE;
    best->a = hi[br];
    best->b = light[k];
    best->c = targets[bc] * per + (own == s->first[bc] ? s->second[bc] : s->first[bc]);
    return best_score;
}

/* _cheap (and _move, which is _cheap without the shift). */
static int cheap(search_t *s, int64_t a, const int64_t *heavy, Py_ssize_t nh,
                 const int64_t *targets, Py_ssize_t nt, double tol, int shift, change_t *best) {
    Py_ssize_t per = s->per;
    double top = s->load[a];
    double best_score = INFINITY;
    best->kind = NONE;
    int64_t *hi = s->kept;
    Py_ssize_t nm = 0;
    for (Py_ssize_t h = 0; h < nh; h++) {
        int64_t i = heavy[h];
        if (s->bin_cnt[s->bin_of[i]] >= 2 && s->cost[i] > tol) hi[nm++] = i;
    }
    if (nm > 0) {
        Py_ssize_t br = -1;
        int64_t by = -1;
        /* Per target, its margin and its widest room: a sample that exceeds either fits none
           of its bins, so those are skipped whole (the same candidates pass as one by one). */
        double *margin = s->key;
        int64_t *widest = s->tp;
        for (Py_ssize_t t = 0; t < nt; t++) {
            margin[t] = (top - s->load[targets[t]]) - tol;
            widest[t] = INT64_MIN;
            for (Py_ssize_t p = 0; p < per; p++) {
                int64_t room = s->seq_len - s->bin_tok[targets[t] * per + p];
                if (room > widest[t]) widest[t] = room;
            }
        }
        for (Py_ssize_t h = 0; h < nm; h++) {
            double ch = s->cost[hi[h]];
            int64_t th = s->tok[hi[h]];
            for (Py_ssize_t t = 0; t < nt; t++) {
                if (!(ch < margin[t]) || th > widest[t]) continue;
                double yload = s->load[targets[t]];
                for (Py_ssize_t p = 0; p < per; p++) {
                    int64_t y = targets[t] * per + p;
                    if (!(th <= s->seq_len - s->bin_tok[y] && ch < (top - yload) - tol)) continue;
                    if (s->nbud &&
                        !budgets_hold(s, s->bin_bud + y * s->nbud, NULL, s->bud + hi[h] * s->nbud))
                        continue;
                    double score = dmax(top - ch, yload + ch);
                    if (br < 0 || score < best_score) {
                        best_score = score;
                        br = h;
                        by = y;
                    }
                }
            }
        }
        if (br >= 0) {
            best->kind = MOVE;
            best->a = hi[br];
            best->b = by;
        } else if (shift && per > 1 && s->nbud == 0) {
            best_score = move_with_room(s, hi, nm, targets, nt, tol, best);
        }
    }
    double swap_score = INFINITY;
    int64_t bx = -1, byb = -1;
    for (Py_ssize_t px = 0; px < per; px++) {
        int64_t x = a * per + px;
        for (Py_ssize_t t = 0; t < nt; t++) {
            double yload = s->load[targets[t]];
            for (Py_ssize_t p = 0; p < per; p++) {
                int64_t y = targets[t] * per + p;
                double delta = s->bin_cost[x] - s->bin_cost[y];
                if (!(delta > tol && delta < (top - yload) - tol)) continue;
                double score = dmax(top - delta, yload + delta);
                if (bx < 0 || score < swap_score) {
                    swap_score = score;
                    bx = x;
                    byb = y;
                }
            }
        }
    }
    if (bx >= 0 && swap_score < best_score) {
        best->kind = BIN_SWAP;
        best->a = bx;
        best->b = byb;
    }
    return best->kind != NONE;
}

/* Sort sample indices by `before` (a strict total order), bottom-up merge sort via `tmp`. */
static void sort_samples(const search_t *s, int64_t *a, Py_ssize_t n, int64_t *tmp,
                         before_t before) {
    int64_t *src = a, *dst = tmp;
    for (Py_ssize_t width = 1; width < n; width *= 2) {
        for (Py_ssize_t lo = 0; lo < n; lo += 2 * width) {
            Py_ssize_t mid = lo + width < n ? lo + width : n;
            Py_ssize_t hi = lo + 2 * width < n ? lo + 2 * width : n;
            Py_ssize_t i = lo, j = mid, k = lo;
            while (i < mid && j < hi) dst[k++] = before(s, src[j], src[i]) ? src[j++] : src[i++];
            while (i < mid) dst[k++] = src[i++];
            while (j < hi) dst[k++] = src[j++];
        }
        int64_t *swap = src;
        src = dst;
        dst = swap;
    }
    if (src != a) memcpy(a, src, sizeof(int64_t) * (size_t)n);
}

/* (-cost, index) ascending: the exchange's heavy candidates. */
static int cost_down(const search_t *s, int64_t i, int64_t j) {
    double ci = s->cost[i], cj = s->cost[j];
    return ci > cj || (ci == cj && i < j);
}

/* Room for exactly n entries in vec (its contents undefined); -1 when out of memory. */
static int vec_resize(vec_t *vec, Py_ssize_t n) {
    if (n > vec->cap) {
        Py_ssize_t cap = n < 8 ? 8 : n;
        int64_t *v = (int64_t *)realloc(vec->v, sizeof(int64_t) * (size_t)cap);
        if (v == NULL) return -1;
        vec->v = v;
        vec->cap = cap;
    }
    vec->n = n;
    return 0;
}

static Py_ssize_t rank_count(const search_t *s, int64_t r) {
    Py_ssize_t m = 0;
    for (Py_ssize_t b = r * s->per; b < (r + 1) * s->per; b++) m += s->members[b].n;
    return m;
}

/* Rank r's samples by (cost, index), re-sorted only when stale; NULL when out of memory.
   Sorting uses s->ic as scratch. */
static const vec_t *rank_by_cost(search_t *s, int64_t r) {
    vec_t *view = &s->rank_sorted[r];
    if (s->rank_stale[r]) {
        if (vec_resize(view, rank_count(s, r)) < 0) return NULL;
        rank_samples(s, r, view->v);
        sort_samples(s, view->v, view->n, s->ic, cost_up);
        s->rank_stale[r] = 0;
    }
    return view;
}

/* Bin b's samples by (tokens, index), likewise. */
static const vec_t *bin_by_tokens(search_t *s, int64_t b) {
    vec_t *view = &s->bin_sorted[b];
    if (s->bin_stale[b]) {
        const vec_t *members = &s->members[b];
        if (vec_resize(view, members->n) < 0) return NULL;
        if (members->n) memcpy(view->v, members->v, sizeof(int64_t) * (size_t)members->n);
        sort_samples(s, view->v, view->n, s->ic, tokens_up);
        s->bin_stale[b] = 0;
    }
    return view;
}

/* _swap (-1 when out of memory) */
static int swap_family(search_t *s, int64_t a, const int64_t *heavy, Py_ssize_t nh_all,
                       const int64_t *targets, Py_ssize_t nt, double tol, change_t *best) {
    double top = s->load[a];
    int64_t *light = s->light;
    Py_ssize_t L = 0;
    double cl_min = INFINITY;
    for (Py_ssize_t t = 0; t < nt; t++) {
        s->begin[t] = L;
        s->size[t] = 0;
        for (Py_ssize_t b = targets[t] * s->per; b < (targets[t] + 1) * s->per; b++) {
            const vec_t *members = &s->members[b];
            for (Py_ssize_t k = 0; k < members->n; k++) {
                if (s->cost[members->v[k]] < cl_min) cl_min = s->cost[members->v[k]];
            }
            s->size[t] += members->n;
        }
        L += s->size[t];
    }
    int64_t *kept = s->kept;
    Py_ssize_t nh = 0;
    for (Py_ssize_t h = 0; h < nh_all; h++) {
        if (s->cost[heavy[h]] > cl_min + tol) kept[nh++] = heavy[h];
    }
    if (nh == 0) return 0;
    int windowed = (int64_t)nh * (int64_t)L > FULL_SWAP_PAIRS;
    double span = 0.0;
    if (!windowed) {
        for (Py_ssize_t t = 0; t < nt; t++) rank_samples(s, targets[t], light + s->begin[t]);
    } else {
        /* Each target's samples by (cost, index). */
        for (Py_ssize_t t = 0; t < nt; t++) {
            const vec_t *view = rank_by_cost(s, targets[t]);
            if (view == NULL) return -1;
            if (view->n) memcpy(light + s->begin[t], view->v, sizeof(int64_t) * (size_t)view->n);
        }
        double cl_max = s->cost[light[0]], ch_max = s->cost[kept[0]];
        for (Py_ssize_t k = 1; k < L; k++) cl_max = dmax(cl_max, s->cost[light[k]]);
        for (Py_ssize_t h = 1; h < nh; h++) ch_max = dmax(ch_max, s->cost[kept[h]]);
        span = 2.0 * (ch_max > cl_max ? ch_max : cl_max) + 1.0;
        for (Py_ssize_t t = 0; t < nt; t++) {
            for (Py_ssize_t k = s->begin[t]; k < s->begin[t] + s->size[t]; k++) {
                s->key[k] = (double)t * span + s->cost[light[k]];
            }
        }
    }
    /* Per-partner terms once per call (the numpy search computes them as whole arrays too):
       cost, tokens, the room its bin keeps for a swapped-in sample, and its rank's margin. */
    double *cl = s->cp, *lld = s->lld;
    int64_t *tl = s->ia, *room_y = s->ib;
    for (Py_ssize_t t = 0; t < nt; t++) {
        for (Py_ssize_t k = s->begin[t]; k < s->begin[t] + s->size[t]; k++) {
            int64_t j = light[k];
            int64_t yl = s->bin_of[j];
            cl[k] = s->cost[j];
            tl[k] = s->tok[j];
            room_y[k] = s->bin_cnt[yl] == 1 ? UNBOUNDED : s->seq_len - s->bin_tok[yl] + tl[k];
            lld[k] = s->load[targets[t]];
        }
    }
    /* Windowed: where each candidate's window starts in each target, i.e. numpy's
       searchsorted(key, q, side="left") with q = t * span + max(ch - half_gap, 0) (keys of
       earlier targets are below t * span <= q and keys of later ones above (t + 1) * span > q,
       span being over twice any cost, so the answer lies in t's own segment or just past
       it). q grows with ch, so walking the rank's samples by cost moves one pointer forward
       through each target's keys: O(samples) per target instead of a search per pair.
       swap_family is only called with nt <= NEAR_TARGETS targets (at holds that many). */
    int64_t *at = s->at;
    if (windowed) {
        const vec_t *mine = rank_by_cost(s, a);
        if (mine == NULL) return -1;
        for (Py_ssize_t h = 0; h < nh; h++) s->slot[kept[h]] = h;
        for (Py_ssize_t t = 0; t < nt; t++) {
            double half_gap = 0.5 * (top - s->load[targets[t]]);
            Py_ssize_t ptr = s->begin[t], end = s->begin[t] + s->size[t];
            for (Py_ssize_t v = 0; v < mine->n; v++) {
                int64_t i = mine->v[v], h = s->slot[i];
                if (h < 0) continue;
                double q = (double)t * span + dmax(s->cost[i] - half_gap, 0.0);
                while (ptr < end && s->key[ptr] < q) ptr++;
                at[h * nt + t] = ptr;
            }
        }
        for (Py_ssize_t h = 0; h < nh; h++) s->slot[kept[h]] = -1;
    }
    double best_score = INFINITY;
    int64_t bi = -1, bj = -1;
    for (Py_ssize_t h = 0; h < nh; h++) {
        int64_t i = kept[h];
        double ch = s->cost[i];
        int64_t th = s->tok[i];
        int64_t xh = s->bin_of[i];
        int64_t room_x = s->bin_cnt[xh] == 1 ? UNBOUNDED : s->seq_len - s->bin_tok[xh] + th;
        /* One candidate pair (i, light[k]): the numpy search's row-major argmin keeps the
           first strictly lowest score. */
#define SWAP_CANDIDATE(k)                                                                      \
    do {                                                                                       \
        double lload = lld[k];                                                                 \
        double delta = ch - cl[k];                                                             \
        if (!(delta > tol && delta < (top - lload) - tol)) break;                              \
        if (!(tl[k] <= room_x && th <= room_y[k])) break;                                      \
        if (s->nbud) {                                                                         \
            /* x keeps (sums - i) + j unless i is alone there; y (sums - j) + i likewise. */   \
            Py_ssize_t K = s->nbud;                                                            \
            int64_t j = light[k], yl = s->bin_of[j];                                           \
            const double *bi_row = s->bud + i * K, *bj_row = s->bud + j * K;                   \
            if (s->bin_cnt[xh] != 1 && !budgets_hold(s, s->bin_bud + xh * K, bi_row, bj_row))  \
                break;                                                                         \
            if (s->bin_cnt[yl] != 1 && !budgets_hold(s, s->bin_bud + yl * K, bj_row, bi_row))  \
                break;                                                                         \
        }                                                                                      \
        double score = dmax(top - delta, lload + delta);                                       \
        if (bi < 0 || score < best_score) {                                                    \
            best_score = score;                                                                \
            bi = i;                                                                            \
            bj = light[k];                                                                     \
        }                                                                                      \
    } while (0)
        if (!windowed) {
            for (Py_ssize_t k = 0; k < L; k++) SWAP_CANDIDATE(k);
            continue;
        }
        for (Py_ssize_t t = 0; t < nt; t++) {
            Py_ssize_t first = s->begin[t], last = s->begin[t] + s->size[t] - 1;
            Py_ssize_t lo = at[h * nt + t];
            /* The window pos - SWAP_NEIGHBOURS .. pos + SWAP_NEIGHBOURS - 1, each end
               clipped to t's segment: a clipped window repeats an edge partner, whose
               repeats score the same and cannot be the first argmin, so each partner of the
               clipped range is tried once, in order. A target holds samples (bins are never
               empty), so the segment is not empty. */
            Py_ssize_t from = lo - SWAP_NEIGHBOURS, to = lo + SWAP_NEIGHBOURS - 1;
            if (from < first) from = first;
            if (from > last) from = last;
            if (to > last) to = last;
            if (to < first) to = first;
            for (Py_ssize_t k = from; k <= to; k++) SWAP_CANDIDATE(k);
        }
#undef SWAP_CANDIDATE
    }
    if (bi < 0) return 0;
    best->kind = SWAP;
    best->a = bi;
    best->b = bj;
    return 1;
}

/* Budgets of exchanging sample i (bin x) for the sorted partners [start, end) of bin y:
   x keeps (sums - i) + run and y (sums - run) + i, run being the partners' budget sums. */
static int exchange_budgets_hold(const search_t *s, int64_t i, int64_t y, Py_ssize_t start,
                                 Py_ssize_t end) {
    Py_ssize_t K = s->nbud;
    const double *bi_row = s->bud + i * K;
    const double *x_sums = s->bin_bud + s->bin_of[i] * K, *y_sums = s->bin_bud + y * K;
    for (Py_ssize_t k = 0; k < K; k++) {
        double run_k = s->run[end * K + k] - s->run[start * K + k];
        if (!((x_sums[k] - bi_row[k]) + run_k <= s->limits[k])) return 0;
        if (!((y_sums[k] - run_k) + bi_row[k] <= s->limits[k])) return 0;
    }
    return 1;
}

/* _exchange */
static int exchange_family(search_t *s, int64_t a, const int64_t *heavy_all, Py_ssize_t nh_all,
                           const int64_t *targets, Py_ssize_t nt, double tol, change_t *best) {
    Py_ssize_t per = s->per;
    double top = s->load[a];
    int64_t *heavy = s->kept;
    Py_ssize_t nh = nh_all;
    if (nh > EXCHANGE_CANDIDATES) {
        /* The first EXCHANGE_CANDIDATES by (-cost, index), in that order: what a full sort
           would put first, by insertion into a short list. */
        Py_ssize_t held = 0;
        for (Py_ssize_t h = 0; h < nh_all; h++) {
            int64_t i = heavy_all[h];
            if (held == EXCHANGE_CANDIDATES && !cost_down(s, i, heavy[held - 1])) continue;
            Py_ssize_t k = held < EXCHANGE_CANDIDATES ? held++ : held - 1;
            while (k > 0 && cost_down(s, i, heavy[k - 1])) {
                heavy[k] = heavy[k - 1];
                k--;
            }
            heavy[k] = i;
        }
        nh = EXCHANGE_CANDIDATES;
    } else {
        memcpy(heavy, heavy_all, sizeof(int64_t) * (size_t)nh_all);
    }
    /* The partners by (bin, tokens, index): the target ranks in ascending order (their bins
       are contiguous), each bin's cached view by (tokens, index). */
    int64_t *ranks_up = s->pos;
    for (Py_ssize_t t = 0; t < nt; t++) {
        Py_ssize_t k = t;
        while (k > 0 && ranks_up[k - 1] > targets[t]) {
            ranks_up[k] = ranks_up[k - 1];
            k--;
        }
        ranks_up[k] = targets[t];
    }
    int64_t *light = s->xlight;
    Py_ssize_t m = 0;
    for (Py_ssize_t t = 0; t < nt; t++) {
        for (Py_ssize_t p = 0; p < per; p++) {
            int64_t y = ranks_up[t] * per + p;
            if (s->bin_cnt[y] < 2) continue;
            const vec_t *view = bin_by_tokens(s, y);
            if (view == NULL) return -1;
            memcpy(light + m, view->v, sizeof(int64_t) * (size_t)view->n);
            m += view->n;
        }
    }
    if (m == 0) return 0;
    int64_t *tp = s->tp, *stop = s->ia;
    double *cp = s->cp;
    tp[0] = 0;
    cp[0] = 0.0;
    int nonneg = 1;
    for (Py_ssize_t k = 0; k < m; k++) {
        tp[k + 1] = tp[k] + s->tok[light[k]];
        cp[k + 1] = cp[k] + s->cost[light[k]];
        nonneg &= s->cost[light[k]] >= 0.0;
    }
    Py_ssize_t K = s->nbud;
    double *run = s->run;
    if (K) {
        /* np.cumsum over the sorted partners, column by column, after a zero row. */
        for (Py_ssize_t k = 0; k < K; k++) run[k] = 0.0;
        for (Py_ssize_t j = 0; j < m; j++) {
            const double *row = s->bud + light[j] * K;
            for (Py_ssize_t k = 0; k < K; k++) run[(j + 1) * K + k] = run[j * K + k] + row[k];
        }
    }
    for (Py_ssize_t k = m - 1; k >= 0; k--) {
        int last = k == m - 1 || s->bin_of[light[k + 1]] != s->bin_of[light[k]];
        stop[k] = last ? k + 1 : stop[k + 1];
    }
    /* Per-start terms once per call: the room of the start's bin and its rank's gap. */
    int64_t *room = s->ib;
    double *gap_of = s->key;
    for (Py_ssize_t k = 0; k < m; k++) {
        int64_t yl = s->bin_of[light[k]];
        room[k] = s->seq_len - s->bin_tok[yl];
        gap_of[k] = top - s->load[yl / per];
    }
    double best_score = INFINITY;
    int64_t brow = -1, bs = -1, be = -1;
    for (int pass = 0; pass < 2; pass++) {
        double pass_score = INFINITY;
        int64_t prow = -1, ps = -1, pe = -1;
        for (Py_ssize_t h = 0; h < nh; h++) {
            int64_t i = heavy[h];
            int64_t th = s->tok[i];
            int64_t xh = s->bin_of[i];
            double ch = s->cost[i];
            int64_t hi = s->bin_cnt[xh] == 1 ? s->seq_len : s->seq_len - s->bin_tok[xh] + th;
            /* With costs >= 0 a run costs >= 0 (cp never decreases), so exchanging i scores
               at least top - ch: once that cannot beat the pass's best, skip i. */
            if (nonneg && prow >= 0 && top - ch >= pass_score) continue;
            /* Both searches start above k (the bound is > tp[k]) and only ends up to stop[k]
               can qualify, so searching tp[k + 1 .. stop[k]] gives the same verdict as
               numpy's search over all of tp. Within a bin the bound only grows with k (tp
               does, and the bin's room and hi are fixed), so the answer does too: one
               pointer walks each bin once per candidate (what searchsorted would return
               for every start, in linear rather than n log n steps). */
            Py_ssize_t e = 0;
            for (Py_ssize_t k = 0; k < m; k++) {
                if (stop[k] < k + 2) continue; /* a run needs two samples of k's bin */
                int64_t lo = th - room[k];
                int64_t base = tp[k];
                int64_t end;
                Py_ssize_t last = stop[k];
                if (e < k + 1) e = k + 1;
                if (pass == 0) {
                    /* searchsorted left: the first end in (k, last] with tp[end] >= bound */
                    int64_t bound = base + (lo > 1 ? lo : 1);
                    while (e <= last && tp[e] < bound) e++;
                    end = e;
                } else {
                    /* searchsorted right, less one: the last end in (k, last] with
                       tp[end] <= bound, else k */
                    int64_t bound = base + hi;
                    while (e <= last && tp[e] <= bound) e++;
                    end = e - 1;
                }
                if (end > m) end = m;
                int64_t run_tok = tp[end] - base;
                if (!(end >= k + 2 && end <= stop[k] && run_tok >= lo && run_tok <= hi)) continue;
                double gap = gap_of[k];
                double delta = ch - (cp[end] - cp[k]);
                if (!(delta > tol && delta < gap - tol)) continue;
                if (K && !exchange_budgets_hold(s, i, s->bin_of[light[k]], k, end)) continue;
                double score = dmax(top - delta, (top - gap) + delta);
                if (prow < 0 || score < pass_score) {
                    pass_score = score;
                    prow = h;
                    ps = k;
                    pe = end;
                }
            }
        }
        if (prow >= 0 && pass_score < best_score) {
            best_score = pass_score;
            brow = prow;
            bs = ps;
            be = pe;
        }
    }
    if (brow < 0) return 0;
    best->kind = EXCHANGE;
    best->a = heavy[brow];
    best->b = bs;
    best->c = be;
    return 1;
}

/* Apply a change; returns the partner rank, or -2 when out of memory. */
static int64_t apply_change(search_t *s, const change_t *c) {
    Py_ssize_t per = s->per;
    int64_t x, y;
    switch (c->kind) {
    case MOVE:
        y = c->b;
        x = s->bin_of[c->a];
        if (relocate(s, c->a, x, y) < 0) return -2;
        refresh_budgets(s, x);
        refresh_budgets(s, y);
        return y / per;
    case SHIFT_MOVE: /* never with budgets (cheap does not offer it then) */
        y = s->bin_of[c->b];
        if (relocate(s, c->b, y, c->c) < 0) return -2;
        if (relocate(s, c->a, s->bin_of[c->a], y) < 0) return -2;
        return y / per;
    case SWAP:
        x = s->bin_of[c->a];
        y = s->bin_of[c->b];
        if (relocate(s, c->a, x, y) < 0 || relocate(s, c->b, y, x) < 0) return -2;
        refresh_budgets(s, x);
        refresh_budgets(s, y);
        return y / per;
    case EXCHANGE: {
        x = s->bin_of[c->a];
        y = s->bin_of[s->xlight[c->b]];
        if (relocate(s, c->a, x, y) < 0) return -2;
        for (int64_t k = c->b; k < c->c; k++) {
            if (relocate(s, s->xlight[k], y, x) < 0) return -2;
        }
        refresh_budgets(s, x);
        refresh_budgets(s, y);
        return y / per;
    }
    case BIN_SWAP: {
        x = c->a;
        y = c->b;
        mark_stale(s, x);
        mark_stale(s, y);
        vec_t held = s->members[x];
        s->members[x] = s->members[y];
        s->members[y] = held;
        for (Py_ssize_t k = 0; k < s->members[x].n; k++) s->bin_of[s->members[x].v[k]] = x;
        for (Py_ssize_t k = 0; k < s->members[y].n; k++) s->bin_of[s->members[y].v[k]] = y;
        int64_t ti = s->bin_tok[x]; s->bin_tok[x] = s->bin_tok[y]; s->bin_tok[y] = ti;
        ti = s->bin_cnt[x]; s->bin_cnt[x] = s->bin_cnt[y]; s->bin_cnt[y] = ti;
        double td = s->bin_cost[x]; s->bin_cost[x] = s->bin_cost[y]; s->bin_cost[y] = td;
        for (Py_ssize_t k = 0; k < s->nbud; k++) {
            td = s->bin_bud[x * s->nbud + k];
            s->bin_bud[x * s->nbud + k] = s->bin_bud[y * s->nbud + k];
            s->bin_bud[y * s->nbud + k] = td;
        }
        double moved = s->bin_cost[y] - s->bin_cost[x];
        s->load[x / per] -= moved;
        s->load[y / per] += moved;
        return y / per;
    }
    default:
        return -1;
    }
}

static inline int lighter(const double *load, int64_t p, int64_t q) {
    return load[p] < load[q] || (load[p] == load[q] && p < q);
}

/* The first phase's move families, one signature: the best change of the family moving cost
   from rank a (its samples `heavy`, nh of them) to one of the ranks `targets` (nt of them) by
   the acceptance rule of _drive.h, into `best`; 1 when found, 0 when none, -1 on no memory. */
typedef int (*family_t)(search_t *s, int64_t a, const int64_t *heavy, Py_ssize_t nh,
                        const int64_t *targets, Py_ssize_t nt, double tol, change_t *best);

/* Move one sample to a bin with room, or exchange two whole bins (_move). */
static int move_family(search_t *s, int64_t a, const int64_t *heavy, Py_ssize_t nh,
                       const int64_t *targets, Py_ssize_t nt, double tol, change_t *best) {
    return cheap(s, a, heavy, nh, targets, nt, tol, 0, best);
}

/* move_family, with a move made possible by first shifting one of the partner's samples to
   another of its bins when no plain move fits (_cheap). */
static int shifted_move_family(search_t *s, int64_t a, const int64_t *heavy, Py_ssize_t nh,
                               const int64_t *targets, Py_ssize_t nt, double tol,
                               change_t *best) {
    return cheap(s, a, heavy, nh, targets, nt, tol, 1, best);
}

/* Partner sets of an attempt on rank a, from its lighter ranks by (load, rank): the
   NEAR_TARGETS lightest; the next WIDE_TARGETS; every other lighter rank (in larger groups,
   once the first two sets are all the lighter ranks there are within reach). */
typedef enum { NEAR, WIDE, FAR } partners_t;

typedef struct {
    family_t family;
    partners_t partners;
} entry_t;

/* The first phase's table, tried in order until one family finds a change, which is applied:
   the cheap families on the lightest ranks first, the costly shifted move last among them;
   then, before giving up on a, moves and one-for-run exchanges with the wider set; last,
   moves and bin swaps with every other lighter rank. */
static const entry_t PHASE1[] = {
    {move_family, NEAR},         {swap_family, NEAR},     {exchange_family, NEAR},
    {shifted_move_family, NEAR}, {shifted_move_family, WIDE}, {exchange_family, WIDE},
    {move_family, FAR},
};

/* One attempt of the first phase on rank a (an improve_t, see _drive.h): the partner rank
   changed, -1 when a admits no improving change, -2 when out of memory. */
static int64_t improve(search_t *s, int64_t a) {
    double top = s->load[a];
    double tol = 1e-12 * fabs(top) + 1e-300;
    Py_ssize_t count = s->ranks;
    Py_ssize_t reach = NEAR_TARGETS + (s->sumsq ? 0 : WIDE_TARGETS);
    Py_ssize_t want = count - 1 > reach ? reach : count;
    /* The first `want` ranks by (load, rank), ascending (insertion into a short list). */
    int64_t *order = s->order;
    Py_ssize_t held = 0;
    for (int64_t r = 0; r < count; r++) {
        if (held == want && !lighter(s->load, r, order[held - 1])) continue;
        Py_ssize_t k = held < want ? held++ : held - 1;
        while (k > 0 && lighter(s->load, r, order[k - 1])) {
            order[k] = order[k - 1];
            k--;
        }
        order[k] = r;
    }
    Py_ssize_t size = 0;
    while (size < held && s->load[order[size]] < top - tol) size++;
    if (size == 0) return -1;
    Py_ssize_t nh = rank_samples(s, a, s->heavy);
    Py_ssize_t far = -1; /* the FAR set's size, once built (after the ranks above) */
    change_t change;
    for (size_t e = 0; e < sizeof(PHASE1) / sizeof(PHASE1[0]); e++) {
        const int64_t *targets = order;
        Py_ssize_t nt = size < NEAR_TARGETS ? size : NEAR_TARGETS;
        if (PHASE1[e].partners == WIDE) {
            targets = order + NEAR_TARGETS;
            nt = size > NEAR_TARGETS ? size - NEAR_TARGETS : 0;
        } else if (PHASE1[e].partners == FAR) {
            if (far < 0) {
                far = 0;
                if (size == held && want < count) {
                    for (int64_t r = 0; r < count && far < s->n; r++) {
                        if (s->load[r] < top - tol && lighter(s->load, order[held - 1], r)) {
                            order[held + far++] = r;
                        }
                    }
                }
            }
            targets = order + held;
            nt = far;
        }
        if (nt == 0 || !((s->families >> e) & 1)) continue;
        int found = PHASE1[e].family(s, a, s->heavy, nh, targets, nt, tol, &change);
        if (found < 0) return -2;
        if (found) return apply_change(s, &change);
    }
    return -1;
}

static int64_t improve_attempt(void *s, int64_t a) { return improve((search_t *)s, a); }

/*
 * refine_search(cost, tok, bud, limits, flat, sizes, bin_of, bin_cnt, bin_tok, bin_cost,
 *               bin_bud, load, out_flat, out_sizes, per_rank, seq_len, budget, good_enough,
 *               sumsq[, families]) -> attempts
 *
 * bud is the samples' budget footprints (n x len(limits)), limits the packing budgets
 * (empty for none). The start layout is (flat, sizes); bin_of .. load are the search state
 * for it (search.py builds them) and are updated in place; the final layout goes to
 * (out_flat, out_sizes). families: the PHASE1 entries in use, bit e for entry e (default all).
 */
static PyObject *refine_search(PyObject *Py_UNUSED(self), PyObject *args) {
    Py_buffer cost_b, tok_b, bud_b, lim_b, flat_b, sizes_b, bin_of_b, cnt_b, btok_b, bcost_b,
        bbud_b, load_b, of_b, os_b;
    Py_ssize_t per, seq_len, budget;
    double good_enough;
    int sumsq;
    unsigned long long families = ~0ULL;
    if (!PyArg_ParseTuple(args, "y*y*y*y*y*y*w*w*w*w*w*w*w*w*nnndp|K", &cost_b, &tok_b, &bud_b,
                          &lim_b, &flat_b, &sizes_b, &bin_of_b, &cnt_b, &btok_b, &bcost_b,
                          &bbud_b, &load_b, &of_b, &os_b, &per, &seq_len, &budget,
                          &good_enough, &sumsq, &families)) {
        return NULL;
    }
    PyObject *result = NULL;
    search_t s;
    memset(&s, 0, sizeof(s));
    s.families = families;
    void *block = NULL;
    Py_ssize_t n = cost_b.len / (Py_ssize_t)sizeof(double);
    Py_ssize_t nb = sizes_b.len / (Py_ssize_t)sizeof(int64_t);
    Py_ssize_t ranks = load_b.len / (Py_ssize_t)sizeof(double);
    Py_ssize_t nbud = lim_b.len / (Py_ssize_t)sizeof(double);
    Py_ssize_t attempts = 0;
    int failed = 0;
    if (per < 1 || ranks < 1 || nb % per != 0 || nb / per != ranks) {
        PyErr_SetString(PyExc_ValueError, "refine_search: inconsistent ranks and bins");
        goto done;
    }
    if (check(&tok_b, "tok", sizeof(int64_t), n) || check(&flat_b, "flat", sizeof(int64_t), n) ||
        check(&bin_of_b, "bin_of", sizeof(int64_t), n) ||
        check(&cnt_b, "bin_cnt", sizeof(int64_t), nb) ||
        check(&btok_b, "bin_tok", sizeof(int64_t), nb) ||
        check(&bcost_b, "bin_cost", sizeof(double), nb) ||
        check(&bud_b, "bud", sizeof(double), n * nbud) ||
        check(&bbud_b, "bin_bud", sizeof(double), nb * nbud) ||
        check(&of_b, "out_flat", sizeof(int64_t), n) ||
        check(&os_b, "out_sizes", sizeof(int64_t), nb)) {
        goto done;
    }
    size_t words = (size_t)((10 + NEAR_TARGETS) * n + 2 + 2 * (n + 1)) + (size_t)(ranks * per + 7 * ranks);
    block = calloc(words, sizeof(int64_t));
    s.members = (vec_t *)calloc((size_t)nb, sizeof(vec_t));
    s.stuck = (unsigned char *)calloc((size_t)ranks, 1);
    s.run = nbud ? (double *)calloc((size_t)((n + 1) * nbud), sizeof(double)) : NULL;
    s.rank_sorted = (vec_t *)calloc((size_t)ranks, sizeof(vec_t));
    s.bin_sorted = (vec_t *)calloc((size_t)nb, sizeof(vec_t));
    s.rank_stale = (unsigned char *)malloc((size_t)ranks);
    s.bin_stale = (unsigned char *)malloc((size_t)nb);
    if (block == NULL || s.members == NULL || s.stuck == NULL || (nbud && s.run == NULL) ||
        s.rank_sorted == NULL || s.bin_sorted == NULL || s.rank_stale == NULL ||
        s.bin_stale == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    memset(s.rank_stale, 1, (size_t)ranks);
    memset(s.bin_stale, 1, (size_t)nb);
    int64_t *w = (int64_t *)block;
    s.heavy = w; w += n;
    s.light = w; w += n;
    s.kept = w; w += n;
    s.xlight = w; w += n;
    s.ia = w; w += n;
    s.ib = w; w += n;
    s.ic = w; w += n;
    s.key = (double *)w; w += n;
    s.lld = (double *)w; w += n;
    s.at = w; w += NEAR_TARGETS * n;
    s.slot = w; w += n;
    for (Py_ssize_t i = 0; i < n; i++) s.slot[i] = -1;
    s.tp = w; w += n + 1;
    s.cp = (double *)w; w += n + 1;
    s.rooms = w; w += ranks * per;
    s.first = w; w += ranks;
    s.second = w; w += ranks;
    s.best_k = w; w += ranks;
    s.begin = w; w += ranks;
    s.size = w; w += ranks;
    s.pos = w; w += ranks;
    s.order = w; w += ranks;
    s.ranks = ranks;
    s.per = per;
    s.n = n;
    s.seq_len = seq_len;
    s.sumsq = sumsq;
    s.cost = (const double *)cost_b.buf;
    s.tok = (const int64_t *)tok_b.buf;
    s.bin_of = (int64_t *)bin_of_b.buf;
    s.bin_cnt = (int64_t *)cnt_b.buf;
    s.bin_tok = (int64_t *)btok_b.buf;
    s.bin_cost = (double *)bcost_b.buf;
    s.load = (double *)load_b.buf;
    s.nbud = nbud;
    s.bud = (const double *)bud_b.buf;
    s.limits = (const double *)lim_b.buf;
    s.bin_bud = (double *)bbud_b.buf;
    const int64_t *flat = (const int64_t *)flat_b.buf;
    const int64_t *sizes = (const int64_t *)sizes_b.buf;
    Py_ssize_t at = 0;
    /* Every index below is trusted by the search, so the state must agree with itself:
       flat lists each sample once, bin by bin as sizes say, and bin_of and bin_cnt describe
       the same layout. Then the bins always hold exactly n samples and every scratch array
       of n entries is large enough. */
    unsigned char *seen = (unsigned char *)calloc((size_t)(n > 0 ? n : 1), 1);
    if (seen == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    for (Py_ssize_t b = 0; b < nb && !failed; b++) {
        if (sizes[b] < 0 || s.bin_cnt[b] != sizes[b]) {
            failed = 1;
            break;
        }
        for (int64_t k = 0; k < sizes[b]; k++) {
            int64_t i = at < n ? flat[at] : -1;
            if (i < 0 || i >= n || seen[i] || s.bin_of[i] != b) {
                failed = 1;
                break;
            }
            seen[i] = 1;
            at++;
            if (vec_push(&s.members[b], i) < 0) {
                free(seen);
                PyErr_NoMemory();
                goto done;
            }
        }
    }
    free(seen);
    if (failed || at != n) {
        PyErr_SetString(PyExc_ValueError,
                        "refine_search: flat must list every sample index once, as sizes say, "
                        "and bin_of and bin_cnt must describe the same layout");
        goto done;
    }

    Py_BEGIN_ALLOW_THREADS
    drive_t run = drive(&s, improve_attempt, s.load, s.stuck, ranks, budget, good_enough, sumsq);
    attempts = run.attempts;
    failed = run.failed;
    Py_END_ALLOW_THREADS
    if (failed) {
        PyErr_NoMemory();
        goto done;
    }
    int64_t *out_flat = (int64_t *)of_b.buf, *out_sizes = (int64_t *)os_b.buf;
    at = 0;
    for (Py_ssize_t b = 0; b < nb; b++) {
        out_sizes[b] = s.members[b].n;
        memcpy(out_flat + at, s.members[b].v, sizeof(int64_t) * (size_t)s.members[b].n);
        at += s.members[b].n;
    }
    result = PyLong_FromSsize_t(attempts);

done:
    if (s.members != NULL) {
        for (Py_ssize_t b = 0; b < nb; b++) free(s.members[b].v);
    }
    if (s.bin_sorted != NULL) {
        for (Py_ssize_t b = 0; b < nb; b++) free(s.bin_sorted[b].v);
    }
    if (s.rank_sorted != NULL) {
        for (Py_ssize_t r = 0; r < ranks; r++) free(s.rank_sorted[r].v);
    }
    free(s.members);
    free(s.bin_sorted);
    free(s.rank_sorted);
    free(s.rank_stale);
    free(s.bin_stale);
    free(s.stuck);
    free(s.run);
    free(block);
    PyBuffer_Release(&cost_b);
    PyBuffer_Release(&tok_b);
    PyBuffer_Release(&flat_b);
    PyBuffer_Release(&sizes_b);
    PyBuffer_Release(&bin_of_b);
    PyBuffer_Release(&cnt_b);
    PyBuffer_Release(&btok_b);
    PyBuffer_Release(&bcost_b);
    PyBuffer_Release(&bud_b);
    PyBuffer_Release(&lim_b);
    PyBuffer_Release(&bbud_b);
    PyBuffer_Release(&load_b);
    PyBuffer_Release(&of_b);
    PyBuffer_Release(&os_b);
    return result;
}

/*
 * search_state(cost, tok, bud, flat, sizes, bin_of, bin_cnt, bin_tok, bin_cost, bin_bud, load)
 *
 * The search state of the layout (flat, sizes) (see search.py), written into the given
 * arrays: each sample's bin, each bin's count, tokens, cost and budget sums, each rank's
 * load. Sums run in flat order from zero, as numpy's bincount adds them, and a rank's load
 * adds its bins in order from the first, as numpy sums fewer than eight values along an
 * axis; search.py calls this only with fewer than eight bins per rank (numpy sums longer rows
 * pairwise), so the state is the one its numpy expressions give, to the last bit.
 */
static PyObject *search_state(PyObject *Py_UNUSED(self), PyObject *args) {
    Py_buffer cost_b, tok_b, bud_b, flat_b, sizes_b, bin_of_b, cnt_b, btok_b, bcost_b, bbud_b,
        load_b;
    if (!PyArg_ParseTuple(args, "y*y*y*y*y*w*w*w*w*w*w*", &cost_b, &tok_b, &bud_b, &flat_b,
                          &sizes_b, &bin_of_b, &cnt_b, &btok_b, &bcost_b, &bbud_b, &load_b)) {
        return NULL;
    }
    PyObject *result = NULL;
    Py_ssize_t n = cost_b.len / (Py_ssize_t)sizeof(double);
    Py_ssize_t nb = sizes_b.len / (Py_ssize_t)sizeof(int64_t);
    Py_ssize_t ranks = load_b.len / (Py_ssize_t)sizeof(double);
    Py_ssize_t nbud = nb ? bbud_b.len / (Py_ssize_t)sizeof(double) / nb : 0;
    if (ranks < 1 || nb % ranks != 0 || nb / ranks >= 8) {
        PyErr_SetString(PyExc_ValueError,
                        "search_state: bins must split evenly into ranks, fewer than 8 each");
        goto done;
    }
    if (check(&tok_b, "tok", sizeof(int64_t), n) || check(&flat_b, "flat", sizeof(int64_t), n) ||
        check(&bud_b, "bud", sizeof(double), n * nbud) ||
        check(&bin_of_b, "bin_of", sizeof(int64_t), n) ||
        check(&cnt_b, "bin_cnt", sizeof(int64_t), nb) ||
        check(&btok_b, "bin_tok", sizeof(int64_t), nb) ||
        check(&bcost_b, "bin_cost", sizeof(double), nb) ||
        check(&bbud_b, "bin_bud", sizeof(double), nb * nbud)) {
        goto done;
    }
    const double *cost = (const double *)cost_b.buf, *bud = (const double *)bud_b.buf;
    const int64_t *tok = (const int64_t *)tok_b.buf, *flat = (const int64_t *)flat_b.buf;
    const int64_t *sizes = (const int64_t *)sizes_b.buf;
    int64_t *bin_of = (int64_t *)bin_of_b.buf, *cnt = (int64_t *)cnt_b.buf;
    int64_t *btok = (int64_t *)btok_b.buf;
    double *bcost = (double *)bcost_b.buf, *bbud = (double *)bbud_b.buf;
    double *load = (double *)load_b.buf;
    Py_ssize_t per = nb / ranks, at = 0;
    for (Py_ssize_t b = 0; b < nb; b++) {
        if (sizes[b] < 0 || at + sizes[b] > n) break;
        at += sizes[b];
    }
    int bad = at != n;
    for (Py_ssize_t k = 0; k < n && !bad; k++) bad = flat[k] < 0 || flat[k] >= n;
    if (bad) {
        PyErr_SetString(PyExc_ValueError,
                        "search_state: flat must hold sample indices, as many as sizes say");
        goto done;
    }
    at = 0;
    for (Py_ssize_t b = 0; b < nb; b++) {
        double c = 0.0;
        int64_t t = 0;
        double *sums = bbud + b * nbud;
        for (Py_ssize_t k = 0; k < nbud; k++) sums[k] = 0.0;
        for (int64_t q = 0; q < sizes[b]; q++, at++) {
            int64_t i = flat[at];
            bin_of[i] = b;
            c += cost[i];
            t += tok[i];
            for (Py_ssize_t k = 0; k < nbud; k++) sums[k] += bud[i * nbud + k];
        }
        cnt[b] = sizes[b];
        btok[b] = t;
        bcost[b] = c;
    }
    for (Py_ssize_t r = 0; r < ranks; r++) {
        double l = bcost[r * per];
        for (Py_ssize_t p = 1; p < per; p++) l += bcost[r * per + p];
        load[r] = l;
    }
    Py_INCREF(Py_None);
    result = Py_None;

done:
    PyBuffer_Release(&cost_b);
    PyBuffer_Release(&tok_b);
    PyBuffer_Release(&bud_b);
    PyBuffer_Release(&flat_b);
    PyBuffer_Release(&sizes_b);
    PyBuffer_Release(&bin_of_b);
    PyBuffer_Release(&cnt_b);
    PyBuffer_Release(&btok_b);
    PyBuffer_Release(&bcost_b);
    PyBuffer_Release(&bbud_b);
    PyBuffer_Release(&load_b);
    return result;
}

/* Defined in _settle.c, _polish.c and _bound.c. */
PyObject *evenflow_settle(PyObject *self, PyObject *args);
int evenflow_settle_constants(PyObject *mod);
int evenflow_polish_constants(PyObject *mod);
PyObject *evenflow_polish(PyObject *self, PyObject *args);
PyObject *evenflow_heavy_bound(PyObject *self, PyObject *args);

static PyMethodDef methods[] = {
    {"lpt", lpt, METH_VARARGS, "The reference greedy, with or without budgets (see lpt.py)."},
    {"refine_search", refine_search, METH_VARARGS,
     "The default algorithm's local search, with or without budgets (see search.py)."},
    {"search_state", search_state, METH_VARARGS,
     "The local search's start state of a layout (see search.py)."},
    {"polish", evenflow_polish, METH_VARARGS,
     "The default algorithm's second search phase (see polish.py)."},
    {"settle", evenflow_settle, METH_VARARGS,
     "Relabel a layout towards its source and bring samples home (see settle.py)."},
    {"heavy_bound", evenflow_heavy_bound, METH_VARARGS,
     "Bound 5 of a step's makespan, heavy ranks and tokens (see bounds.py)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_native",
    "The planner's compiled core (greedy and search); native.py is its one caller.",
    -1, methods, NULL, NULL, NULL, NULL,
};

/* The version and the tuning constants (the search's, the second phase's and settle's) are
   exported: the planner's identity reads the one, the test oracles and the schedule's test the
   others (engine/_planning/schedule.py lists them with the rule that they must match). */
PyMODINIT_FUNC PyInit__native(void) {
    PyObject *mod = PyModule_Create(&module);
    if (mod == NULL) return NULL;
    if (PyModule_AddIntConstant(mod, "CORE_VERSION", CORE_VERSION) < 0 ||
        PyModule_AddIntConstant(mod, "NEAR_TARGETS", NEAR_TARGETS) < 0 ||
        PyModule_AddIntConstant(mod, "WIDE_TARGETS", WIDE_TARGETS) < 0 ||
        PyModule_AddIntConstant(mod, "FULL_SWAP_PAIRS", FULL_SWAP_PAIRS) < 0 ||
        PyModule_AddIntConstant(mod, "SWAP_NEIGHBOURS", SWAP_NEIGHBOURS) < 0 ||
        PyModule_AddIntConstant(mod, "EXCHANGE_CANDIDATES", EXCHANGE_CANDIDATES) < 0 ||
        evenflow_polish_constants(mod) < 0 || evenflow_settle_constants(mod) < 0) {
        Py_DECREF(mod);
        return NULL;
    }
    return mod;
}
