/* The grouped search's exchange family: one sample i of the worked unit x for a cheaper
   sample j of one of the `partner_units` units with the most room below their groups' maxima
   (ties to the lower unit), accepted by the group-maximum rule (_grouped.h) with
   d = cost(i) - cost(j), both bins within seq_len (or holding that one sample, under the
   oversized policy "single") and their budgets. Ranked by the most gain, then the least cost
   exchanged, then the lowest (i, j). */
#include "_grouped.h"

/* Whether unit u comes before v among partners: more slack, then the lower unit. */
static int roomier(const groups_t *s, int64_t u, int64_t v) {
    return s->slack[u] > s->slack[v] || (s->slack[u] == s->slack[v] && u < v);
}

int group_exchange_family(const groups_t *s, const gattempt_t *at, gchange_t *best) {
    Py_ssize_t per = s->per, nbud = s->nbud, want = s->partner_units;
    /* The partner units: the `want` with the most slack, among those with any (insertion into
       a short list). */
    int64_t *partners = s->partners;
    Py_ssize_t held = 0;
    for (int64_t u = 0; u < s->units; u++) {
        if (u == at->x || !(s->slack[u] > 0.0)) continue;
        if (held == want && !roomier(s, u, partners[held - 1])) continue;
        Py_ssize_t k = held < want ? held++ : held - 1;
        while (k > 0 && roomier(s, u, partners[k - 1])) {
            partners[k] = partners[k - 1];
            k--;
        }
        partners[k] = u;
    }
    int found = 0;
    for (int64_t p = at->x * per; p < (at->x + 1) * per; p++) {
        const vec_t *mine = &s->members[p];
        int alone_p = s->single && s->bin_cnt[p] == 1;
        for (Py_ssize_t k = 0; k < mine->n; k++) {
            int64_t i = mine->v[k];
            double ci = s->cost[i];
            int64_t ti = s->tok[i];
            for (Py_ssize_t e = 0; e < held; e++) {
                int64_t u = partners[e];
                double slack = s->slack[u];
                for (int64_t q = u * per; q < (u + 1) * per; q++) {
                    const vec_t *theirs = &s->members[q];
                    int alone_q = s->single && s->bin_cnt[q] == 1;
                    for (Py_ssize_t m = 0; m < theirs->n; m++) {
                        int64_t j = theirs->v[m];
                        double d = ci - s->cost[j];
                        if (!group_accepts(d, slack, at->tol)) continue;
                        double gain = d < at->room ? d : at->room;
                        if (found) {
                            if (gain != best->gain) {
                                if (gain < best->gain) continue;
                            } else if (d != best->d) {
                                if (d > best->d) continue;
                            } else if (i != best->i) {
                                if (i > best->i) continue;
                            } else if (j > best->target) {
                                continue;
                            }
                        }
                        int64_t tj = s->tok[j];
                        if (!(s->bin_tok[p] - ti + tj <= s->seq_len || alone_p)) continue;
                        if (!(s->bin_tok[q] - tj + ti <= s->seq_len || alone_q)) continue;
                        if (nbud) {
                            const double *bi = s->bud + i * nbud, *bj = s->bud + j * nbud;
                            int ok = 1;
                            for (Py_ssize_t c = 0; c < nbud && ok; c++) {
                                double diff = bj[c] - bi[c];
                                ok = s->bin_bud[p * nbud + c] + diff <= s->limits[c] &&
                                     s->bin_bud[q * nbud + c] - diff <= s->limits[c];
                            }
                            if (!ok) continue;
                        }
                        found = 1;
                        best->kind = GROUP_EXCHANGE;
                        best->gain = gain;
                        best->d = d;
                        best->i = i;
                        best->target = j;
                    }
                }
            }
        }
    }
    return found;
}
