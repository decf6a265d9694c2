/*
 * Group-wide move of the second search phase (family 1 of _polish.c's comment): one sample of
 * the most loaded rank to the least loaded rank of the whole group that has a bin with room,
 * ranks indexed by the room of their roomiest bin.
 */
#include "_drive.h"
#include "_polish.h"

/* Ranks by (room of their roomiest bin descending, rank ascending): bottom-up merge sort. */
static void sort_by_room(search_t *s) {
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
static int wide_move(search_t *s, int64_t a, double tol, int64_t *mi, int64_t *my,
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
            if (!accepts(ci, top - lr, tol)) continue;
            double score = dmax(top - ci, lr + ci);
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

int move_anywhere(search_t *s, int64_t a, double tol, pchange_t *best) {
    double score;
    best->subset = 0;
    return wide_move(s, a, tol, &best->i, &best->y, &score);
}
