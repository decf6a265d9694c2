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
#include "_search.h"
#include "_vec.h"

#define CORE_VERSION 12

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

/* Whether `view` holds `count` items of `itemsize` bytes, else a ValueError naming it (the
   entry points of _native.c and _whole_bins.c check their arrays with it). */
int evenflow_check_buffer(Py_buffer *view, const char *name, Py_ssize_t itemsize,
                          Py_ssize_t count) {
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
                      int64_t seq_len, int64_t *ids, int lowest_rank) {
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
                if (lowest_rank) break; /* ties go to the lowest rank: the first popped */
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
 *     seq_len[, open_first]) -> bool
 *
 * The whole greedy (lpt_assign in lpt.py): order is the placement order
 * (np.lexsort((-tokens, -costs))), at least num_ranks * per_rank samples long;
 * budget_costs is the samples' budget footprints (num_samples x len(limits), row-major) and
 * limits the packing budgets (empty for none). The layout goes to (out_flat, out_sizes),
 * bin by bin, each bin's samples in placement order. Returns False on a dead end.
 * open_first (default true): the first num_ranks * per_rank samples each open a bin (phase
 * 1); false: every sample goes to the least-loaded rank with a feasible bin, the lowest rank
 * on ties, into its best bin as in phase 2 (the greedy sample LPT start, sample_lpt_layout
 * in lpt.py), and a bin left empty is a dead end too.
 */
static PyObject *lpt(PyObject *Py_UNUSED(self), PyObject *args) {
    Py_buffer cost_b, tok_b, bud_b, lim_b, order_b, of_b, os_b;
    Py_ssize_t ranks, per, seq_len;
    int open_first = 1;
    if (!PyArg_ParseTuple(args, "y*y*y*y*y*w*w*nnn|p", &cost_b, &tok_b, &bud_b, &lim_b,
                          &order_b, &of_b, &os_b, &ranks, &per, &seq_len, &open_first)) {
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
    if (evenflow_check_buffer(&tok_b, "tokens", sizeof(int64_t), n) ||
        evenflow_check_buffer(&bud_b, "budget_costs", sizeof(double), n * nbud) ||
        evenflow_check_buffer(&order_b, "order", sizeof(int64_t), n) ||
        evenflow_check_buffer(&of_b, "out_flat", sizeof(int64_t), n) ||
        evenflow_check_buffer(&os_b, "out_sizes", sizeof(int64_t), nb)) {
        goto done;
    }
    const int64_t *order_check = (const int64_t *)order_b.buf;
    for (Py_ssize_t k = 0; k < n; k++) {
        if (order_check[k] < 0 || order_check[k] >= n) {
            PyErr_SetString(PyExc_ValueError, "lpt: order holds an index outside the samples");
            goto done;
        }
    }
    Py_ssize_t opened_first = open_first ? nb : 0; /* samples placed by phase 1 */
    Py_ssize_t m = n - opened_first;
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
    for (Py_ssize_t b = 0; b < nb; b++) fills[b] = 0;
    if (nbud) memset(bud.sums, 0, sizeof(double) * (size_t)(nb * nbud));
    for (Py_ssize_t k = 0; k < opened_first; k++) {
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
        int64_t i = order[opened_first + k];
        rest_tok[k] = tokens[i];
        rest_cost[k] = costs[i];
        if (nbud) memcpy(bud_block + (nb + k) * nbud, bud_rows + i * nbud,
                         sizeof(double) * (size_t)nbud);
        if (tokens[i] > seq_len) ok = 0; /* an oversized sample needs an empty bin */
    }
    /* Without openers, while every rank placed so far has a positive load, the next sample's
       least-loaded ranks are the untouched ones: the rule gives it the first bin of the
       lowest of them. Placed directly, as the rule would, without a heap operation. */
    Py_ssize_t direct = 0;
    if (!open_first && nbud == 0) {
        while (direct < m && direct < ranks && rest_cost[direct] > 0.0 &&
               rest_tok[direct] <= (int64_t)seq_len) {
            Py_ssize_t r = direct;
            fills[r * per] = rest_tok[direct];
            rtok[r] += rest_tok[direct];
            load[r] = load[r] + rest_cost[direct];
            dest[direct] = r * per;
            direct++;
        }
    }
    if (ok) ok = place_core(load, rtok, fills, rest_tok + direct, rest_cost + direct, &bud,
                            dest + direct, ranks, per, m - direct, (int64_t)seq_len, scratch,
                            !open_first);
    if (ok) {
        /* Bin b: its opener, then its phase-2 samples in placement order. */
        for (Py_ssize_t b = 0; b < nb; b++) out_sizes[b] = open_first ? 1 : 0;
        for (Py_ssize_t k = 0; k < m; k++) out_sizes[dest[k]]++;
        Py_ssize_t at = 0;
        for (Py_ssize_t b = 0; b < nb; b++) {
            if (out_sizes[b] == 0) ok = 0; /* without openers a bin may end empty */
            if (open_first) out_flat[at] = opener[b];
            fills[b] = at + (open_first ? 1 : 0); /* reuse: next free position of bin b */
            at += out_sizes[b];
        }
        if (ok) {
            for (Py_ssize_t k = 0; k < m; k++)
                out_flat[fills[dest[k]]++] = order[opened_first + k];
        }
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
 * The default algorithm's local search (driven by search.py), with or without budgets: its
 * Python entry, refine_search, below; the search itself is _search.c (state, table, attempt),
 * one file per move family (_move.c, _swap.c, _exchange.c) and the driver loop of _drive.h.
 *
 * The oracle (tests/oracles/planning.py, OracleSearch) states each family as whole-array
 * numpy expressions; this is the same search, family by family and candidate by candidate
 * (an attempt costs microseconds here, hundreds of them there). Each comparison and float
 * operation follows the oracle's expression, in the same order, so both produce identical
 * layouts. Candidate matrices are walked in row-major order and a candidate replaces the
 * best only when its score is strictly lower, as numpy's argmin returns the first minimum.
 * ========================================================================================== */
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
    if (evenflow_check_buffer(&tok_b, "tok", sizeof(int64_t), n) ||
        evenflow_check_buffer(&flat_b, "flat", sizeof(int64_t), n) ||
        evenflow_check_buffer(&bin_of_b, "bin_of", sizeof(int64_t), n) ||
        evenflow_check_buffer(&cnt_b, "bin_cnt", sizeof(int64_t), nb) ||
        evenflow_check_buffer(&btok_b, "bin_tok", sizeof(int64_t), nb) ||
        evenflow_check_buffer(&bcost_b, "bin_cost", sizeof(double), nb) ||
        evenflow_check_buffer(&bud_b, "bud", sizeof(double), n * nbud) ||
        evenflow_check_buffer(&bbud_b, "bin_bud", sizeof(double), nb * nbud) ||
        evenflow_check_buffer(&of_b, "out_flat", sizeof(int64_t), n) ||
        evenflow_check_buffer(&os_b, "out_sizes", sizeof(int64_t), nb)) {
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
    if (evenflow_check_buffer(&tok_b, "tok", sizeof(int64_t), n) ||
        evenflow_check_buffer(&flat_b, "flat", sizeof(int64_t), n) ||
        evenflow_check_buffer(&bud_b, "bud", sizeof(double), n * nbud) ||
        evenflow_check_buffer(&bin_of_b, "bin_of", sizeof(int64_t), n) ||
        evenflow_check_buffer(&cnt_b, "bin_cnt", sizeof(int64_t), nb) ||
        evenflow_check_buffer(&btok_b, "bin_tok", sizeof(int64_t), nb) ||
        evenflow_check_buffer(&bcost_b, "bin_cost", sizeof(double), nb) ||
        evenflow_check_buffer(&bbud_b, "bin_bud", sizeof(double), nb * nbud)) {
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

/* Defined in _settle.c, _polish.c, _bound.c, _grouped.c and _whole_bins.c (the search's other
   files, _search.c, _move.c, _swap.c, _exchange.c, _wide_move.c, _subset.c and the grouped
   search's families, define no method). */
PyObject *evenflow_settle(PyObject *self, PyObject *args);
int evenflow_settle_constants(PyObject *mod);
int evenflow_polish_constants(PyObject *mod);
PyObject *evenflow_polish(PyObject *self, PyObject *args);
PyObject *evenflow_heavy_bound(PyObject *self, PyObject *args);
PyObject *evenflow_grouped_search(PyObject *self, PyObject *args); /* _grouped.c */
PyObject *evenflow_deal_bins(PyObject *self, PyObject *args);       /* _whole_bins.c */
PyObject *evenflow_kk_bins(PyObject *self, PyObject *args);         /* _whole_bins.c */

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
    {"grouped_search", evenflow_grouped_search, METH_VARARGS,
     "The grouped search of lockstep plans and windows (see grouped.py)."},
    {"deal_bins", evenflow_deal_bins, METH_VARARGS,
     "Whole bins dealt to the least loaded rank (the 'dealt bins' start, see refine.py)."},
    {"kk_bins", evenflow_kk_bins, METH_VARARGS,
     "Whole bins split by Karmarkar-Karp differencing (the 'kk bins' start, see kk.py)."},
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
