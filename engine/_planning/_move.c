/*
 * Move families of the first search phase: one sample of the most loaded rank to a bin with
 * room on a partner rank, or two whole bins exchanged (move_family); the same, with a move
 * made possible by first shifting one of the partner's samples to another of its bins when no
 * plain move fits (shifted_move_family; not under packing budgets).
 */
#include "_drive.h"
#include "_search.h"

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
            if (!(th <= room && accepts(ch, top - tload, tol))) continue;
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
                    if (!(th <= s->seq_len - s->bin_tok[y] && accepts(ch, top - yload, tol))) {
                        continue;
                    }
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
                if (!accepts(delta, top - yload, tol)) continue;
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

/* Move one sample to a bin with room, or exchange two whole bins (_move). */
int move_family(search_t *s, int64_t a, const int64_t *heavy, Py_ssize_t nh,
                       const int64_t *targets, Py_ssize_t nt, double tol, change_t *best) {
    return cheap(s, a, heavy, nh, targets, nt, tol, 0, best);
}

/* move_family, with a move made possible by first shifting one of the partner's samples to
   another of its bins when no plain move fits (_cheap). */
int shifted_move_family(search_t *s, int64_t a, const int64_t *heavy, Py_ssize_t nh,
                               const int64_t *targets, Py_ssize_t nt, double tol,
                               change_t *best) {
    return cheap(s, a, heavy, nh, targets, nt, tol, 1, best);
}
