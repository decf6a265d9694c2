/*
 * Run exchange family of the first search phase: one of the most loaded rank's
 * EXCHANGE_CANDIDATES costliest samples for a run of consecutive-by-length samples of one
 * partner bin with a compatible token total.
 */
#include "_drive.h"
#include "_search.h"

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
int exchange_family(search_t *s, int64_t a, const int64_t *heavy_all, Py_ssize_t nh_all,
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
    /* Per bin of partners (a run of starts k0 .. stop[k0] - 1), when costs are >= 0: the
       cheapest first two samples of any start (cp[k + 2] - cp[k], the least a run from k
       costs), at k0. A candidate the per-start window test below rejects at every start of
       a bin is rejected for the whole bin at once: its cheapest run is that minimum and its
       costliest cp[stop] - cp[k0], and subtraction is monotone, so each start's test fails
       whenever the bin's does. (s->lld is free here: only the swap family uses it.) */
    double *cheapest_pair = s->lld;
    if (nonneg) {
        for (Py_ssize_t k0 = 0; k0 < m; k0 = stop[k0]) {
            double least = INFINITY;
            for (Py_ssize_t k = k0; k < stop[k0]; k++) {
                if (stop[k] < k + 2) continue;
                double pair = cp[k + 2] - cp[k];
                if (pair < least) least = pair;
            }
            cheapest_pair[k0] = least;
        }
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
                if (nonneg && (k == 0 || stop[k - 1] == k) &&
                    (!(ch - cheapest_pair[k] > tol) ||
                     !(ch - (cp[stop[k]] - cp[k]) < gap_of[k] - tol))) {
                    k = stop[k] - 1; /* no start of this bin can qualify */
                    continue;
                }
                if (stop[k] < k + 2) continue; /* a run needs two samples of k's bin */
                /* With costs >= 0 a run from k costs at least its first two samples and at
                   most the rest of k's bin (cp never decreases, nor do differences of it from
                   cp[k]): when even those bounds leave the net cost outside the acceptance
                   window, no end can qualify. Skipping k leaves the pointer behind, which the
                   next start's walk makes up (its bound is no lower within a bin). */
                if (nonneg && (!(ch - (cp[k + 2] - cp[k]) > tol) ||
                               !(ch - (cp[stop[k]] - cp[k]) < gap_of[k] - tol))) {
                    continue;
                }
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
                if (!accepts(delta, gap, tol)) continue;
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
