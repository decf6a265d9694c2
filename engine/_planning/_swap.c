/*
 * Swap family of the first search phase: one sample of the most loaded rank for one of a
 * partner rank (cost-matched windows of SWAP_NEIGHBOURS each side past FULL_SWAP_PAIRS
 * pairs).
 */
#include "_drive.h"
#include "_search.h"

/* _swap (-1 when out of memory) */
int swap_family(search_t *s, int64_t a, const int64_t *heavy, Py_ssize_t nh_all,
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
        if (!accepts(delta, top - lload, tol)) break;                                          \
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
