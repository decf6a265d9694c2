/* The grouped search (lockstep and balance windows, grouped.py): units of `per` bins in groups
   of `group`, the cost of a layout being the sum of its groups' maxima. It runs on the one
   driver of _drive.h in rounds, the group maxima standing for the rank loads: each attempt
   works the group of highest maximum that is neither stuck nor worked yet in the round,
   through its most costly unit x; a round without a change ends the search. The files: this
   state and the table with one attempt (_grouped.c, also the Python entry) and one move family
   per file (_group_move.c, _group_exchange.c).

   Units keep their numbers; `order` lists them by (cost descending, unit ascending) and group
   g is positions g*group .. g*group + group - 1 of it, so groups are always the sorted runs
   that minimise the sum of maxima for the units at hand (grouped.py's docstring proves it).

   Group-maximum acceptance rule (the rule of _drive.h with a unit's room below its own
   group's maximum for the gap): a change moving net cost d out of x into a unit u is accepted
   only when tol < d < slack(u) - tol, where slack(u) = max(group of u) - cost(u) (x's own
   group's maximum being x's cost). The receiving unit then stays below its group's maximum
   and x's group's maximum falls by gain = min(d, room), room being how far x is above the
   next unit of its group; no other group's maximum rises. Candidates are ranked by the most
   gain, then the least d, ties to the family's stated order; the attempt takes the best over
   its whole table (ties to the earlier entry). */
#ifndef EVENFLOW_GROUPED_H
#define EVENFLOW_GROUPED_H

#ifndef PY_SSIZE_T_CLEAN
#define PY_SSIZE_T_CLEAN
#endif
#include <Python.h>
#include <math.h>
#include <stdint.h>

#include "_vec.h"

typedef struct {
    Py_ssize_t n, units, per, group, groups, nbud, partner_units;
    int64_t seq_len;
    int single; /* oversized_policy "single": a bin of one sample may exceed seq_len */
    const double *cost, *bud, *limits;
    const int64_t *tok;
    int64_t *bin_of, *bin_cnt, *bin_tok;
    double *bin_bud, *unit_cost;
    int64_t *order, *pos; /* units by (cost desc, unit asc); each unit's position there */
    double *gmax;         /* each group's maximum: unit_cost[order[g * group]] */
    double *slack;        /* scratch: each unit's room below its group's maximum */
    int64_t *partners;    /* scratch: the exchange's partner units */
    unsigned char *stuck, *seen; /* the driver's flags, one per group (it works in rounds) */
    vec_t *members;       /* each bin's samples */
    unsigned long long families; /* entries of GROUPED in use, bit e for entry e */
} groups_t;

/* What the families read in one attempt: the unit x worked, its cost `top`, how far it is
   above the next unit of its group (`room`) and the tolerance of _drive.h. */
typedef struct {
    int64_t x;
    double top, room, tol;
} gattempt_t;

typedef enum { GROUP_NONE = 0, GROUP_MOVE, GROUP_EXCHANGE } gkind_t;

/* A candidate: sample i of x to bin `target` (move) or for sample `target` (exchange). */
typedef struct {
    gkind_t kind;
    double gain, d;
    int64_t i, target;
} gchange_t;

/* A family: its best candidate by the rule above into `best` (1), or 0 when none. */
typedef int (*gfamily_t)(const groups_t *s, const gattempt_t *at, gchange_t *best);

int group_move_family(const groups_t *s, const gattempt_t *at, gchange_t *best);
int group_exchange_family(const groups_t *s, const gattempt_t *at, gchange_t *best);

/* The acceptance rule of the header comment. */
static inline int group_accepts(double d, double slack, double tol) {
    return d > tol && d < slack - tol;
}

/* Whether every budget holds for base + in (sign +1) or base - in (sign -1), term by term. */
static inline int group_budgets_hold(const groups_t *s, const double *base, const double *in,
                                     int sign) {
    for (Py_ssize_t k = 0; k < s->nbud; k++) {
        double v = sign > 0 ? base[k] + in[k] : base[k] - in[k];
        if (!(v <= s->limits[k])) return 0;
    }
    return 1;
}

#endif
