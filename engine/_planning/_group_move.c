/* The grouped search's move family: one sample i of the worked unit x into a bin q of another
   unit u that has token room and budget for it, i's bin keeping a sample, accepted by the
   group-maximum rule (_grouped.h) with d = cost(i). Ranked by the most gain, then the least
   cost moved, then the most room left below u's group's maximum, then the lowest (i, q). */
#include "_grouped.h"

int group_move_family(const groups_t *s, const gattempt_t *at, gchange_t *best) {
    Py_ssize_t per = s->per;
    int found = 0;
    double best_after = 0.0;
    for (int64_t p = at->x * per; p < (at->x + 1) * per; p++) {
        if (s->bin_cnt[p] < 2) continue;
        const vec_t *mine = &s->members[p];
        for (Py_ssize_t k = 0; k < mine->n; k++) {
            int64_t i = mine->v[k];
            double d = s->cost[i];
            double gain = d < at->room ? d : at->room;
            if (found && gain < best->gain) continue;
            int64_t t = s->tok[i];
            const double *in = s->bud + i * s->nbud;
            for (int64_t u = 0; u < s->units; u++) {
                double slack = s->slack[u];
                if (u == at->x || !group_accepts(d, slack, at->tol)) continue;
                double after = slack - d;
                for (int64_t q = u * per; q < (u + 1) * per; q++) {
                    if (s->bin_tok[q] + t > s->seq_len) continue;
                    if (s->nbud && !group_budgets_hold(s, s->bin_bud + q * s->nbud, in, 1)) {
                        continue;
                    }
                    if (found) {
                        if (gain != best->gain) {
                            if (gain < best->gain) continue;
                        } else if (d != best->d) {
                            if (d > best->d) continue;
                        } else if (after != best_after) {
                            if (after < best_after) continue;
                        } else if (i != best->i) {
                            if (i > best->i) continue;
                        } else if (q > best->target) {
                            continue;
                        }
                    }
                    found = 1;
                    best->kind = GROUP_MOVE;
                    best->gain = gain;
                    best->d = d;
                    best->i = i;
                    best->target = q;
                    best_after = after;
                }
            }
        }
    }
    return found;
}
