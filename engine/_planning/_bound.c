/*
 * Bound 5 of bounds.py (heavy ranks and tokens), part of the planner's compiled core (the
 * method table lives in _native.c; bounds.py is the one Python caller, through native.py,
 * and HeavyBoundOracle in tests/oracles/planning.py is its specification, held to equal
 * results). bounds.py states the argument; here is only the arithmetic.
 *
 * For each heavy set (the k samples costing more than a given threshold, 1 <= k <= ranks):
 *   - the other samples, cheapest per token first, give f(T), the least cost of T tokens
 *     taken fractionally (samples without tokens skipped: they never help), and, dearest
 *     first, G(D), the fewest tokens that cost D (samples without cost skipped);
 *   - a makespan M passes when the heavy ranks can take a share of the others within both
 *     groups' token and cost room: taken = max(least, G(rest_cost - spare * M)) tokens must
 *     fit `most` and cost f(taken) <= k * M - heavy_cost, each within a 1e-9 margin;
 *   - the test tightens as M grows, so the least passing M is found by bisection between
 *     the other bounds (`floor`) and the cap (the two cheapest heavy samples together, or
 *     the feasible makespan `upper` the caller knows), keeping the failing side.
 * The result is the largest over the sets, 0 when none fails at `floor`.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define ROUNDING 1e-9
#define BISECTIONS 64
#define RESOLUTION 1e-10

typedef struct {
    Py_ssize_t nf, ng;
    double *f_tok, *f_cost; /* nf + 1 points from (0, 0), tokens strictly increasing */
    double *g_cost, *g_tok; /* ng + 1 points from (0, 0), costs strictly increasing */
    double k, spare, heavy_cost, least, most, rest_cost, floor;
} relax_t;

/* The piecewise-linear function through (xs[j], ys[j]), j = 0..m, at x (clamped). */
static double interp(const double *xs, const double *ys, Py_ssize_t m, double x) {
    if (x <= xs[0]) return ys[0];
    if (x >= xs[m]) return ys[m];
    Py_ssize_t lo = 0, hi = m; /* xs[lo] <= x < xs[hi] */
    while (hi - lo > 1) {
        Py_ssize_t mid = lo + (hi - lo) / 2;
        if (xs[mid] <= x) {
            lo = mid;
        } else {
            hi = mid;
        }
    }
    return ys[lo] + (x - xs[lo]) * ((ys[hi] - ys[lo]) / (xs[hi] - xs[lo]));
}

static int passes(const relax_t *r, double m) {
    double afford = r->k * m - r->heavy_cost;
    double must = r->rest_cost - r->spare * m;
    double taken = must > 0.0 ? interp(r->g_cost, r->g_tok, r->ng, must) : 0.0;
    if (taken < r->least) taken = r->least;
    double cheapest = interp(r->f_tok, r->f_cost, r->nf, taken);
    double slack = ROUNDING * (fabs(afford) > r->floor ? fabs(afford) : r->floor);
    return taken <= r->most * (1.0 + ROUNDING) + ROUNDING && cheapest <= afford + slack;
}

/* The bound of one heavy set, or 0 when the set proves nothing above floor. */
static double set_bound(relax_t *r, double cap, double upper) {
    double lo = r->floor;
    double hi = upper > 0.0 ? (upper > lo ? upper : lo) : 2.0 * lo + r->heavy_cost;
    if (cap < hi) hi = cap;
    if (passes(r, lo)) return 0.0;
    if (!passes(r, hi)) return hi;
    for (int it = 0; it < BISECTIONS && hi - lo > RESOLUTION * r->floor; it++) {
        double mid = lo + (hi - lo) / 2.0;
        if (passes(r, mid)) {
            hi = mid;
        } else {
            lo = mid;
        }
    }
    return lo;
}

/*
 * heavy_bound(costs, tokens, density, thresholds, num_ranks, per_rank, seq_len, floor,
 *             upper) -> float
 *
 * density: the sample indices by cost per token, ascending; thresholds: ascending, each
 * defining the heavy set of the samples that cost more (sets of the same size as the
 * previous one's, or of none or more than num_ranks samples, are skipped); upper <= 0
 * means none.
 */
PyObject *evenflow_heavy_bound(PyObject *Py_UNUSED(self), PyObject *args) {
    Py_buffer cost_b, tok_b, density_b, thr_b;
    Py_ssize_t ranks, per, seq_len;
    double floor, upper;
    if (!PyArg_ParseTuple(args, "y*y*y*y*nnndd", &cost_b, &tok_b, &density_b, &thr_b, &ranks,
                          &per, &seq_len, &floor, &upper)) {
        return NULL;
    }
    PyObject *result = NULL;
    unsigned char *heavy = NULL;
    double *block = NULL;
    Py_ssize_t n = cost_b.len / (Py_ssize_t)sizeof(double);
    Py_ssize_t nt = thr_b.len / (Py_ssize_t)sizeof(double);
    const double *cost = (const double *)cost_b.buf;
    const int64_t *tok = (const int64_t *)tok_b.buf;
    const int64_t *density = (const int64_t *)density_b.buf;
    const double *thr = (const double *)thr_b.buf;
    if (cost_b.len != n * (Py_ssize_t)sizeof(double) ||
        tok_b.len != n * (Py_ssize_t)sizeof(int64_t) ||
        density_b.len != n * (Py_ssize_t)sizeof(int64_t) ||
        thr_b.len != nt * (Py_ssize_t)sizeof(double) || ranks < 2 || per < 1 || seq_len < 1 ||
        !(floor > 0.0)) {
        PyErr_SetString(PyExc_ValueError,
                        "heavy_bound: costs, tokens and the density order must have one entry "
                        "per sample, with at least 2 ranks and a positive floor");
        goto done;
    }
    for (Py_ssize_t j = 0; j < n; j++) {
        if (density[j] < 0 || density[j] >= n || tok[j] < 0 || !(cost[j] >= 0.0)) {
            PyErr_SetString(PyExc_ValueError,
                            "heavy_bound: the density order must index the samples; tokens and "
                            "costs must be non-negative");
            goto done;
        }
    }
    heavy = (unsigned char *)malloc((size_t)(n > 0 ? n : 1));
    block = (double *)malloc(sizeof(double) * (size_t)(4 * (n + 1)));
    if (heavy == NULL || block == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    double room = (double)per * (double)seq_len;
    double best = 0.0;
    Py_ssize_t previous = -1;
    for (Py_ssize_t q = 0; q < nt; q++) {
        Py_ssize_t k = 0;
        double heavy_cost = 0.0, heavy_tokens = 0.0;
        double cheapest = INFINITY, second = INFINITY; /* of the heavy samples */
        for (Py_ssize_t i = 0; i < n; i++) {
            heavy[i] = cost[i] > thr[q];
            if (!heavy[i]) continue;
            k++;
            heavy_cost += cost[i];
            heavy_tokens += (double)tok[i];
            if (cost[i] < cheapest) {
                second = cheapest;
                cheapest = cost[i];
            } else if (cost[i] < second) {
                second = cost[i];
            }
        }
        if (k < 1 || k > ranks || k == previous) continue;
        previous = k;
        /* Below the two cheapest heavy samples together, no rank holds two. */
        double cap = k >= 2 ? cheapest + second : INFINITY;
        relax_t r;
        r.f_tok = block;
        r.f_cost = block + (n + 1);
        r.g_cost = block + 2 * (n + 1);
        r.g_tok = block + 3 * (n + 1);
        r.f_tok[0] = r.f_cost[0] = r.g_cost[0] = r.g_tok[0] = 0.0;
        r.nf = r.ng = 0;
        double rest_tokens = 0.0;
        for (Py_ssize_t j = 0; j < n; j++) {
            int64_t i = density[j];
            if (heavy[i]) continue;
            rest_tokens += (double)tok[i];
            if (tok[i] > 0) {
                r.f_tok[r.nf + 1] = r.f_tok[r.nf] + (double)tok[i];
                r.f_cost[r.nf + 1] = r.f_cost[r.nf] + cost[i];
                r.nf++;
            }
        }
        for (Py_ssize_t j = n - 1; j >= 0; j--) {
            int64_t i = density[j];
            if (heavy[i] || !(cost[i] > 0.0)) continue;
            r.g_cost[r.ng + 1] = r.g_cost[r.ng] + cost[i];
            r.g_tok[r.ng + 1] = r.g_tok[r.ng] + (double)tok[i];
            r.ng++;
        }
        r.k = (double)k;
        r.spare = (double)(ranks - k);
        r.heavy_cost = heavy_cost;
        r.rest_cost = r.g_cost[r.ng];
        r.floor = floor;
        r.least = rest_tokens - r.spare * room;
        if (r.least < 0.0) r.least = 0.0;
        r.most = (double)k * room - heavy_tokens;
        if (r.most > rest_tokens) r.most = rest_tokens;
        if (r.least > r.most) continue; /* no feasible layout at all */
        double found = set_bound(&r, cap, upper);
        if (found > best) best = found;
    }
    result = PyFloat_FromDouble(best);

done:
    free(heavy);
    free(block);
    PyBuffer_Release(&cost_b);
    PyBuffer_Release(&tok_b);
    PyBuffer_Release(&density_b);
    PyBuffer_Release(&thr_b);
    return result;
}
