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
 * each with its table of families (PHASE1 in _search.c, PHASE2 here); each family is in a
 * file of its own (_wide_move.c, _subset.c). Not used with packing budgets.
 */
#define PY_SSIZE_T_CLEAN
#include "_polish.h"
#include "_drive.h"

/* The constants above, exported for the test oracle (tests/oracles/planning.py) and checked
   against engine/_planning/schedule.py; called from the module's init (_native.c). */
int evenflow_polish_constants(PyObject *mod) {
    return (PyModule_AddIntConstant(mod, "POLISH_PARTNERS", POLISH_PARTNERS) < 0 ||
            PyModule_AddIntConstant(mod, "SUBSET_CANDIDATES", SUBSET_CANDIDATES) < 0)
               ? -1
               : 0;
}

/* The second phase's table, tried in order until one family finds a change (family 1, then
   family 2 of the file comment). */
static const pfamily_t PHASE2[] = {move_anywhere, subset_family};

/* One attempt of this phase on rank a (an improve_t, see _drive.h): the partner rank
   changed, -1 when nothing improves, -2 on no memory. */
static int64_t polish_attempt(void *search, int64_t a) {
    search_t *s = (search_t *)search;
    double top = s->load[a];
    double tol = attempt_tolerance(top);
    pchange_t change;
    for (size_t e = 0; e < sizeof(PHASE2) / sizeof(PHASE2[0]); e++) {
        if (!((s->families >> e) & 1)) continue;
        int found = PHASE2[e](s, a, tol, &change);
        if (found < 0) return -2;
        if (!found) continue;
        if (!change.subset) {
            if (search_relocate(s, change.i, change.y) < 0) return -2;
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
    search_t s;
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
    /* The first phase's sorted views, unused here: stale throughout, so moves skip them. */
    s.bin_sorted = (vec_t *)calloc((size_t)nb, sizeof(vec_t));
    s.rank_sorted = (vec_t *)calloc((size_t)ranks, sizeof(vec_t));
    s.bin_stale = (unsigned char *)malloc((size_t)nb);
    s.rank_stale = (unsigned char *)malloc((size_t)ranks);
    if (block == NULL || s.members == NULL || s.stuck == NULL || s.bin_sorted == NULL ||
        s.rank_sorted == NULL || s.bin_stale == NULL || s.rank_stale == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    memset(s.bin_stale, 1, (size_t)nb);
    memset(s.rank_stale, 1, (size_t)ranks);
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
    free(s.bin_sorted);
    free(s.rank_sorted);
    free(s.bin_stale);
    free(s.rank_stale);
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
