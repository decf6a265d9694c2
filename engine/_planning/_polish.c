/*
 * The default algorithm's second search phase, part of the planner's compiled core (the
 * method table lives in _native.c; polish.py is the one Python caller, and PolishOracle in
 * tests/oracles/planning.py is its specification, held to identical layouts).
 *
 * The first phase (refine_search in _native.c) looks for partners among the lightest ranks
 * only and exchanges one sample for a run of consecutive-by-length samples of one bin. It
 * stalls when the free room is elsewhere in a large group, and when bins are nearly full
 * with one bin per rank (only equal-token exchanges are possible, and a run rarely is one).
 * This phase works on the most loaded rank `a` with two more families:
 *
 * 1. Group-wide move: one sample of `a` (from a bin that keeps a sample) to the least loaded
 *    rank of the whole group that has a bin with room for it. Ranks are indexed by the room
 *    of their roomiest bin, so the partner is a binary search plus a prefix minimum over
 *    that index: O(R log R) per attempt, whatever the group size. The sample goes to the
 *    fullest bin of that rank that takes it.
 * 2. Subset exchange: one of `a`'s SUBSET_CANDIDATES costliest samples `i` for ANY subset
 *    of one bin `y` of the POLISH_PARTNERS lightest ranks whose token total keeps both bins
 *    within seq_len. For each partner bin a 0/1 knapsack over its samples, by exact token
 *    total T, keeps the least and the largest cost of a subset with T tokens (two arrays of
 *    T <= the largest admissible total); every admissible T is then scored for every
 *    candidate. The work is counted in DP cells against a per-call allowance, so a plan's
 *    time stays bounded; the families stop when it runs out.
 *
 * A change moving net cost d from `a` to a rank b is accepted only when 0 < d < load[a] -
 * load[b] (both end strictly below load[a]), scored max(load[a] - d, load[b] + d), the least
 * score winning and ties going to the first candidate in the order stated: the acceptance
 * rule of every family (_drive.h), so the two phases together still improve the maximum,
 * then the sum of squares, and cannot cycle. Both phases run on the one driver of _drive.h,
 * each with its table of families (PHASE1 in _native.c, PHASE2 here). Not used with packing
 * budgets.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "_drive.h"
#include "_vec.h"

/* Tuning constants: listed in engine/_planning/schedule.py (CORE_CONSTANTS), which must match. */
#define POLISH_PARTNERS 8
#define SUBSET_CANDIDATES 8

/* The constants above, exported for the test oracle (tests/oracles/planning.py) and checked
   against engine/_planning/schedule.py; called from the module's init (_native.c). */
int evenflow_polish_constants(PyObject *mod) {
    return (PyModule_AddIntConstant(mod, "POLISH_PARTNERS", POLISH_PARTNERS) < 0 ||
            PyModule_AddIntConstant(mod, "SUBSET_CANDIDATES", SUBSET_CANDIDATES) < 0)
               ? -1
               : 0;
}


typedef struct {
    Py_ssize_t ranks, per, n;
    int64_t seq_len;
    int sumsq;
    const double *cost;
    const int64_t *tok;
    vec_t *members;
    int64_t *bin_of, *bin_cnt, *bin_tok;
    double *bin_cost, *load;
    /* scratch */
    int64_t *order, *room, *prefarg, *tmp, *heavy, *items;
    double *minc, *maxc;
    unsigned char *stuck;
    long long cells_left;
    /* Entries of PHASE2 in use: bit e for entry e (all of them but in tests). */
    unsigned long long families;
} polish_t;

static inline double pmax(double x, double y) { return x >= y ? x : y; }

static int relocate(polish_t *s, int64_t i, int64_t dst) {
    int64_t src = s->bin_of[i];
    if (vec_push(&s->members[dst], i) < 0) return -1;
    vec_remove(&s->members[src], i);
    s->bin_of[i] = dst;
    s->bin_tok[src] -= s->tok[i];
    s->bin_tok[dst] += s->tok[i];
    s->bin_cnt[src] -= 1;
    s->bin_cnt[dst] += 1;
    s->bin_cost[src] -= s->cost[i];
    s->bin_cost[dst] += s->cost[i];
    s->load[src / s->per] -= s->cost[i];
    s->load[dst / s->per] += s->cost[i];
    return 0;
}

/* Ranks by (room of their roomiest bin descending, rank ascending): bottom-up merge sort. */
static void sort_by_room(polish_t *s) {
    int64_t *src = s->order, *dst = s->tmp;
    Py_ssize_t n = s->ranks;
    for (Py_ssize_t r = 0; r < n; r++) src[r] = r;
    for (Py_ssize_t width = 1; width < n; width *= 2) {
        for (Py_ssize_t lo = 0; lo < n; lo += 2 * width) {
            Py_ssize_t mid = lo + width < n ? lo + width : n;
            Py_ssize_t hi = lo + 2 * width < n ? lo + 2 * width : n;
            Py_ssize_t i = lo, j = mid, k = lo;
            while (i < mid && j < hi) {
                int64_t a = src[i], b = src[j];
                int b_first = s->room[b] > s->room[a] || (s->room[b] == s->room[a] && b < a);
                dst[k++] = b_first ? src[j++] : src[i++];
            }
            while (i < mid) dst[k++] = src[i++];
            while (j < hi) dst[k++] = src[j++];
        }
        int64_t *swap = src;
        src = dst;
        dst = swap;
    }
    if (src != s->order) memcpy(s->order, src, sizeof(int64_t) * (size_t)n);
}

/* Family 1; returns 1 and fills (i, y, score) when a move qualifies. */
static int wide_move(polish_t *s, int64_t a, double tol, int64_t *mi, int64_t *my,
                     double *mscore) {
    Py_ssize_t per = s->per, R = s->ranks;
    double top = s->load[a];
    for (Py_ssize_t r = 0; r < R; r++) {
        int64_t best = -1;
        for (Py_ssize_t p = 0; p < per; p++) {
            int64_t room = s->seq_len - s->bin_tok[r * per + p];
            if (room > best) best = room;
        }
        s->room[r] = best;
    }
    sort_by_room(s);
    /* prefarg[k]: the least loaded of order[0..k] (the earlier on ties). */
    for (Py_ssize_t k = 0; k < R; k++) {
        int64_t r = s->order[k];
        s->prefarg[k] = (k == 0 || s->load[r] < s->load[s->prefarg[k - 1]]) ? r : s->prefarg[k - 1];
    }
    int found = 0;
    double best_score = 0.0;
    int64_t bi = -1, bb = -1;
    for (Py_ssize_t b = a * per; b < (a + 1) * per; b++) {
        const vec_t *l = &s->members[b];
        if (l->n < 2) continue;
        for (Py_ssize_t k = 0; k < l->n; k++) {
            int64_t i = l->v[k];
            double ci = s->cost[i];
            int64_t ti = s->tok[i];
            if (!(ci > tol) || ti > s->seq_len) continue;
            /* Ranks whose roomiest bin takes ti: a prefix of the order. */
            Py_ssize_t lo = 0, hi = R;
            while (lo < hi) {
                Py_ssize_t mid = lo + (hi - lo) / 2;
                if (s->room[s->order[mid]] >= ti) lo = mid + 1;
                else hi = mid;
            }
            if (lo == 0) continue;
            int64_t r = s->prefarg[lo - 1];
            double lr = s->load[r];
            if (!(ci < (top - lr) - tol)) continue;
            double score = pmax(top - ci, lr + ci);
            if (!found || score < best_score) {
                found = 1;
                best_score = score;
                bi = i;
                bb = r;
            }
        }
    }
    if (!found) return 0;
    int64_t y = -1;
    for (Py_ssize_t p = 0; p < per; p++) {
        int64_t q = bb * per + p;
        if (s->bin_tok[q] + s->tok[bi] <= s->seq_len && (y < 0 || s->bin_tok[q] > s->bin_tok[y]))
            y = q;
    }
    *mi = bi;
    *my = y;
    *mscore = best_score;
    return 1;
}

/* Knapsack over items[0..m) up to `cap` tokens: minc/maxc[T] the least / largest cost of a
   subset with exactly T tokens (+inf / -inf when none). With `take` (m * (cap + 1) bytes)
   records which item last improved each entry, for the reconstruction. */
static void knapsack(const polish_t *s, const int64_t *items, Py_ssize_t m, int64_t cap,
                     double *minc, double *maxc, unsigned char *take_min,
                     unsigned char *take_max) {
    minc[0] = 0.0;
    maxc[0] = 0.0;
    for (int64_t t = 1; t <= cap; t++) {
        minc[t] = INFINITY;
        maxc[t] = -INFINITY;
    }
    for (Py_ssize_t k = 0; k < m; k++) {
        int64_t tk = s->tok[items[k]];
        double ck = s->cost[items[k]];
        unsigned char *tmin = take_min ? take_min + k * (cap + 1) : NULL;
        unsigned char *tmax = take_max ? take_max + k * (cap + 1) : NULL;
        if (tmin) memset(tmin, 0, (size_t)(cap + 1));
        if (tmax) memset(tmax, 0, (size_t)(cap + 1));
        for (int64_t t = cap; t >= tk; t--) {
            double lo = minc[t - tk] + ck;
            double hi = maxc[t - tk] + ck;
            if (lo < minc[t]) {
                minc[t] = lo;
                if (tmin) tmin[t] = 1;
            }
            if (hi > maxc[t]) {
                maxc[t] = hi;
                if (tmax) tmax[t] = 1;
            }
        }
    }
}

/* Items of bin y for the knapsack: its samples of at most `cap` tokens, by index. */
static Py_ssize_t bin_items(polish_t *s, int64_t y, int64_t cap, int64_t *items) {
    const vec_t *l = &s->members[y];
    Py_ssize_t m = 0;
    for (Py_ssize_t k = 0; k < l->n; k++) {
        if (s->tok[l->v[k]] <= cap) items[m++] = l->v[k];
    }
    for (Py_ssize_t k = 1; k < m; k++) { /* insertion sort: bins hold few samples */
        int64_t v = items[k];
        Py_ssize_t j = k;
        while (j > 0 && items[j - 1] > v) {
            items[j] = items[j - 1];
            j--;
        }
        items[j] = v;
    }
    return m;
}

typedef struct {
    int64_t i, y, t;
    int which; /* 0: least-cost subset, 1: largest-cost subset */
    double score;
} subset_t;

/* (cost descending, index ascending): i comes before j. */
static inline int costlier(const polish_t *s, int64_t i, int64_t j) {
    return s->cost[i] > s->cost[j] || (s->cost[i] == s->cost[j] && i < j);
}

/* Family 2; returns 1 and fills `best` when an exchange qualifies. */
static int subset_exchange(polish_t *s, int64_t a, double tol, subset_t *best) {
    Py_ssize_t per = s->per, R = s->ranks;
    double top = s->load[a];
    /* Candidates: a's SUBSET_CANDIDATES costliest samples by (cost desc, index), kept in a
       short sorted list. */
    Py_ssize_t nh = 0;
    for (Py_ssize_t b = a * per; b < (a + 1) * per; b++) {
        const vec_t *l = &s->members[b];
        for (Py_ssize_t k = 0; k < l->n; k++) {
            int64_t i = l->v[k];
            if (s->tok[i] > s->seq_len) continue;
            if (nh == SUBSET_CANDIDATES && !costlier(s, i, s->heavy[nh - 1])) continue;
            Py_ssize_t j = nh < SUBSET_CANDIDATES ? nh++ : nh - 1;
            while (j > 0 && costlier(s, i, s->heavy[j - 1])) {
                s->heavy[j] = s->heavy[j - 1];
                j--;
            }
            s->heavy[j] = i;
        }
    }
    if (nh == 0) return 0;
    int64_t cap = 0;
    for (Py_ssize_t h = 0; h < nh; h++) {
        int64_t i = s->heavy[h], x = s->bin_of[i];
        int64_t hi = s->bin_cnt[x] == 1 ? s->seq_len : s->seq_len - s->bin_tok[x] + s->tok[i];
        if (hi > cap) cap = hi;
    }
    /* Partners: the POLISH_PARTNERS lightest ranks below top - tol, by (load, rank). Ranks
       arrive in ascending order, so a later rank displaces an earlier one only when
       strictly lighter. */
    Py_ssize_t np = 0;
    for (Py_ssize_t r = 0; r < R; r++) {
        if (!(s->load[r] < top - tol)) continue;
        if (np == POLISH_PARTNERS && !(s->load[r] < s->load[s->order[np - 1]])) continue;
        Py_ssize_t j = np < POLISH_PARTNERS ? np++ : np - 1;
        while (j > 0 && s->load[r] < s->load[s->order[j - 1]]) {
            s->order[j] = s->order[j - 1];
            j--;
        }
        s->order[j] = r;
    }
    int found = 0;
    for (Py_ssize_t q = 0; q < np; q++) {
        int64_t r = s->order[q];
        double lr = s->load[r], gap = top - lr;
        for (Py_ssize_t p = 0; p < per; p++) {
            int64_t y = r * per + p;
            Py_ssize_t m = bin_items(s, y, cap, s->items);
            if (m == 0) continue;
            long long cells = (long long)m * (long long)(cap + 1);
            if (cells > s->cells_left) return found;
            s->cells_left -= cells;
            knapsack(s, s->items, m, cap, s->minc, s->maxc, NULL, NULL);
            int64_t room_y = s->seq_len - s->bin_tok[y];
            for (Py_ssize_t h = 0; h < nh; h++) {
                int64_t i = s->heavy[h], x = s->bin_of[i];
                double ci = s->cost[i];
                int64_t ti = s->tok[i];
                int64_t hi = s->bin_cnt[x] == 1 ? s->seq_len : s->seq_len - s->bin_tok[x] + ti;
                int64_t lo = ti - room_y > 1 ? ti - room_y : 1;
                for (int64_t t = lo; t <= hi; t++) {
                    for (int which = 0; which < 2; which++) {
                        double v = which ? s->maxc[t] : s->minc[t];
                        if (!isfinite(v)) continue;
                        double delta = ci - v;
                        if (!(delta > tol && delta < gap - tol)) continue;
                        double score = pmax(top - delta, lr + delta);
                        if (!found || score < best->score) {
                            found = 1;
                            best->i = i;
                            best->y = y;
                            best->t = t;
                            best->which = which;
                            best->score = score;
                        }
                    }
                }
            }
        }
    }
    return found;
}

/* Apply a subset exchange: rebuild the knapsack for bin y with its records, take the
   subset back out, and swap it for sample i. 0, or -1 on no memory. */
static int apply_subset(polish_t *s, const subset_t *c) {
    int64_t x = s->bin_of[c->i];
    Py_ssize_t m = bin_items(s, c->y, c->t, s->items);
    unsigned char *take = (unsigned char *)malloc((size_t)m * (size_t)(c->t + 1));
    if (take == NULL) return -1;
    knapsack(s, s->items, m, c->t, s->minc, s->maxc, c->which ? NULL : take,
             c->which ? take : NULL);
    int64_t t = c->t;
    Py_ssize_t chosen = 0;
    for (Py_ssize_t k = m - 1; k >= 0 && t > 0; k--) {
        if (take[k * (c->t + 1) + t]) {
            s->heavy[chosen++] = s->items[k];
            t -= s->tok[s->items[k]];
        }
    }
    free(take);
    if (relocate(s, c->i, c->y) < 0) return -1;
    for (Py_ssize_t k = chosen - 1; k >= 0; k--) {
        if (relocate(s, s->heavy[k], x) < 0) return -1;
    }
    return 0;
}

/* A change of this phase: a group-wide move of sample i to bin y, or a subset exchange. */
typedef struct {
    int subset; /* 0: move (i, y), 1: the exchange `exchange` */
    int64_t i, y;
    subset_t exchange;
} pchange_t;

/* This phase's move families, one signature: the best change of the family on rank a by the
   acceptance rule of _drive.h, into `best`; 1 when found, 0 when none, -1 on no memory. */
typedef int (*pfamily_t)(polish_t *s, int64_t a, double tol, pchange_t *best);

static int move_anywhere(polish_t *s, int64_t a, double tol, pchange_t *best) {
    double score;
    best->subset = 0;
    return wide_move(s, a, tol, &best->i, &best->y, &score);
}

static int subset_family(polish_t *s, int64_t a, double tol, pchange_t *best) {
    best->subset = 1;
    best->exchange = (subset_t){-1, -1, 0, 0, 0.0};
    return subset_exchange(s, a, tol, &best->exchange);
}

/* The second phase's table, tried in order until one family finds a change (family 1, then
   family 2 of the file comment). */
static const pfamily_t PHASE2[] = {move_anywhere, subset_family};

/* One attempt of this phase on rank a (an improve_t, see _drive.h): the partner rank
   changed, -1 when nothing improves, -2 on no memory. */
static int64_t polish_attempt(void *search, int64_t a) {
    polish_t *s = (polish_t *)search;
    double top = s->load[a];
    double tol = 1e-12 * fabs(top) + 1e-300;
    pchange_t change;
    for (size_t e = 0; e < sizeof(PHASE2) / sizeof(PHASE2[0]); e++) {
        if (!((s->families >> e) & 1)) continue;
        int found = PHASE2[e](s, a, tol, &change);
        if (found < 0) return -2;
        if (!found) continue;
        if (!change.subset) {
            if (relocate(s, change.i, change.y) < 0) return -2;
            return change.y / s->per;
        }
        if (apply_subset(s, &change.exchange) < 0) return -2;
        return change.exchange.y / s->per;
    }
    return -1;
}

/*
 * polish(cost, tok, flat, sizes, bin_of, bin_cnt, bin_tok, bin_cost, load, out_flat,
 *        out_sizes, per_rank, seq_len, budget, good_enough, sumsq, cells[, families]) -> changes
 *
 * The search state (bin_of .. load, see search.py) describes the layout (flat, sizes) and is
 * updated in place; the final layout goes to (out_flat, out_sizes). At most `budget`
 * attempts, and `cells` knapsack cells in all; `families`: the PHASE2 entries in use, bit e
 * for entry e (default all). Returns the number of changes applied.
 */
PyObject *evenflow_polish(PyObject *Py_UNUSED(self), PyObject *args) {
    Py_buffer cost_b, tok_b, flat_b, sizes_b, bin_of_b, cnt_b, btok_b, bcost_b, load_b, of_b,
        os_b;
    Py_ssize_t per, seq_len, budget;
    double good_enough;
    int sumsq;
    long long cells;
    unsigned long long families = ~0ULL;
    if (!PyArg_ParseTuple(args, "y*y*y*y*w*w*w*w*w*w*w*nnndpL|K", &cost_b, &tok_b, &flat_b,
                          &sizes_b, &bin_of_b, &cnt_b, &btok_b, &bcost_b, &load_b, &of_b, &os_b,
                          &per, &seq_len, &budget, &good_enough, &sumsq, &cells, &families)) {
        return NULL;
    }
    PyObject *result = NULL;
    polish_t s;
    memset(&s, 0, sizeof(s));
    s.families = families;
    void *block = NULL;
    Py_ssize_t n = cost_b.len / (Py_ssize_t)sizeof(double);
    Py_ssize_t nb = sizes_b.len / (Py_ssize_t)sizeof(int64_t);
    Py_ssize_t ranks = load_b.len / (Py_ssize_t)sizeof(double);
    Py_ssize_t changes = 0;
    int failed = 0;
    if (per < 1 || ranks < 1 || nb % per != 0 || nb / per != ranks || seq_len < 1 ||
        tok_b.len != n * 8 || flat_b.len != n * 8 || bin_of_b.len != n * 8 ||
        cnt_b.len != nb * 8 || btok_b.len != nb * 8 || bcost_b.len != nb * 8 ||
        of_b.len != n * 8 || os_b.len != nb * 8) {
        PyErr_SetString(PyExc_ValueError, "polish: inconsistent array sizes");
        goto done;
    }
    /* A knapsack runs only while its m * (cap + 1) cells fit the allowance, so cap < cells:
       its two tables need no more entries than that, and memory does not grow with seq_len. */
    Py_ssize_t kcap = (long long)seq_len < cells ? seq_len : (Py_ssize_t)cells;
    if (kcap < 0) kcap = 0;
    size_t words = (size_t)(4 * ranks + 2 * n + 2) + 2 * (size_t)(kcap + 1);
    block = calloc(words, sizeof(int64_t));
    s.members = (vec_t *)calloc((size_t)nb, sizeof(vec_t));
    s.stuck = (unsigned char *)calloc((size_t)ranks, 1);
    if (block == NULL || s.members == NULL || s.stuck == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    int64_t *w = (int64_t *)block;
    s.order = w; w += ranks;
    s.room = w; w += ranks;
    s.prefarg = w; w += ranks;
    s.tmp = w; w += ranks;
    s.heavy = w; w += n + 1;
    s.items = w; w += n + 1;
    s.minc = (double *)w; w += kcap + 1;
    s.maxc = (double *)w;
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
    s.cells_left = cells;
    const int64_t *flat = (const int64_t *)flat_b.buf;
    const int64_t *sizes = (const int64_t *)sizes_b.buf;
    {
        /* The state must agree with itself: every index below is trusted. */
        Py_ssize_t at = 0;
        unsigned char *seen = (unsigned char *)calloc((size_t)(n > 0 ? n : 1), 1);
        if (seen == NULL) {
            PyErr_NoMemory();
            goto done;
        }
        for (Py_ssize_t b = 0; b < nb && !failed; b++) {
            if (sizes[b] < 0 || s.bin_cnt[b] != sizes[b]) failed = 1;
            for (int64_t k = 0; !failed && k < sizes[b]; k++, at++) {
                int64_t i = at < n ? flat[at] : -1;
                if (i < 0 || i >= n || seen[i] || s.bin_of[i] != b) {
                    failed = 1;
                } else {
                    seen[i] = 1;
                    if (vec_push(&s.members[b], i) < 0) failed = 2;
                }
            }
        }
        free(seen);
        if (failed == 2) {
            PyErr_NoMemory();
            goto done;
        }
        if (failed || at != n) {
            PyErr_SetString(PyExc_ValueError,
                            "polish: flat must list every sample index once, as sizes say, and "
                            "bin_of and bin_cnt must describe the same layout");
            goto done;
        }
    }
    Py_BEGIN_ALLOW_THREADS
    drive_t run = drive(&s, polish_attempt, s.load, s.stuck, ranks, budget, good_enough, sumsq);
    changes = run.changes;
    failed = run.failed;
    Py_END_ALLOW_THREADS
    if (failed) {
        PyErr_NoMemory();
        goto done;
    }
    {
        int64_t *out_flat = (int64_t *)of_b.buf, *out_sizes = (int64_t *)os_b.buf;
        Py_ssize_t at = 0;
        for (Py_ssize_t b = 0; b < nb; b++) {
            out_sizes[b] = s.members[b].n;
            memcpy(out_flat + at, s.members[b].v, sizeof(int64_t) * (size_t)s.members[b].n);
            at += s.members[b].n;
        }
    }
    result = PyLong_FromSsize_t(changes);

done:
    if (s.members != NULL) {
        for (Py_ssize_t b = 0; b < nb; b++) free(s.members[b].v);
    }
    free(s.members);
    free(s.stuck);
    free(block);
    PyBuffer_Release(&cost_b);
    PyBuffer_Release(&tok_b);
    PyBuffer_Release(&flat_b);
    PyBuffer_Release(&sizes_b);
    PyBuffer_Release(&bin_of_b);
    PyBuffer_Release(&cnt_b);
    PyBuffer_Release(&btok_b);
    PyBuffer_Release(&bcost_b);
    PyBuffer_Release(&load_b);
    PyBuffer_Release(&of_b);
    PyBuffer_Release(&os_b);
    return result;
}
