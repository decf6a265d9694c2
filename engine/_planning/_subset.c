/*
 * Subset exchange of the second search phase (family 2 of _polish.c's comment): one of the
 * most loaded rank's SUBSET_CANDIDATES costliest samples for any subset of one partner bin,
 * by a 0/1 knapsack over that bin's samples by exact token total, within a cell allowance.
 */
#include "_drive.h"
#include "_polish.h"

/* Knapsack over items[0..m) up to `cap` tokens: minc/maxc[T] the least / largest cost of a
   subset with exactly T tokens (+inf / -inf when none). With `take` (m * (cap + 1) bytes)
   records which item last improved each entry, for the reconstruction. */
static void knapsack(const search_t *s, const int64_t *items, Py_ssize_t m, int64_t cap,
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
static Py_ssize_t bin_items(search_t *s, int64_t y, int64_t cap, int64_t *items) {
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

/* (cost descending, index ascending): i comes before j. */
static inline int costlier(const search_t *s, int64_t i, int64_t j) {
    return s->cost[i] > s->cost[j] || (s->cost[i] == s->cost[j] && i < j);
}

/* Family 2; returns 1 and fills `best` when an exchange qualifies. */
static int subset_exchange(search_t *s, int64_t a, double tol, subset_t *best) {
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
                        if (!accepts(delta, gap, tol)) continue;
                        double score = dmax(top - delta, lr + delta);
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
int apply_subset(search_t *s, const subset_t *c) {
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
    if (search_relocate(s, c->i, c->y) < 0) return -1;
    for (Py_ssize_t k = chosen - 1; k >= 0; k--) {
        if (search_relocate(s, s->heavy[k], x) < 0) return -1;
    }
    return 0;
}

int subset_family(search_t *s, int64_t a, double tol, pchange_t *best) {
    best->subset = 1;
    best->exchange = (subset_t){-1, -1, 0, 0, 0.0};
    return subset_exchange(s, a, tol, &best->exchange);
}
