/* The search state of both phases of the default algorithm's local search, and the first
   phase, shared by the files that make it up: _search.c (the state's upkeep, the table of
   families and one attempt), one file per move family (_move.c, _swap.c, _exchange.c) and
   _native.c (the Python entry, refine_search). The second phase (_polish.h) runs on the same
   state; the driver loop is _drive.h's. */
#ifndef EVENFLOW_SEARCH_H
#define EVENFLOW_SEARCH_H

#ifndef PY_SSIZE_T_CLEAN
#define PY_SSIZE_T_CLEAN
#endif
#include <Python.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "_vec.h"

/* Partners of the most loaded rank: every family tries the NEAR_TARGETS lightest ranks; when
   none finds a change, moves and then run exchanges try the next WIDE_TARGETS (a run that
   fits is often on a rank past the fourth lightest: at 256 x 2 on long-context steps, this
   took the planner benchmark's p90 max / bound from 1.072 to 1.063, and at 8 x 4 and 64 x 4
   it lowered 119 of 360 and 43 of 54 makespans, none raised). Last, in larger groups, moves
   and bin swaps try every other lighter rank: when the lightest ranks are full, the room is
   on heavier ones (sft, a = 24,576, 512 x 2: the search had stopped at 1.041 x bound). */
/* Tuning constants: listed in engine/_planning/schedule.py (CORE_CONSTANTS), which must match. */
#define NEAR_TARGETS 4
#define WIDE_TARGETS 32
#define FULL_SWAP_PAIRS 4096
#define SWAP_NEIGHBOURS 4
#define EXCHANGE_CANDIDATES 8
#define UNBOUNDED INT64_MAX

typedef enum { NONE = 0, MOVE, SHIFT_MOVE, BIN_SWAP, SWAP, EXCHANGE } kind_t;

typedef struct {
    kind_t kind;
    int64_t a, b, c; /* move (i, y); shift move (i, k, to); bin swap (x, y); swap (i, j);
                        exchange (i, run start, run end) within the search's `xlight` */
} change_t;

typedef struct {
    Py_ssize_t ranks, per, n;
    int64_t seq_len;
    int sumsq;
    const double *cost;
    const int64_t *tok;
    vec_t *members;
    int64_t *bin_of, *bin_cnt, *bin_tok;
    double *bin_cost, *load;
    /* scratch: n entries each */
    int64_t *heavy, *light, *kept, *xlight, *ia, *ib, *ic, *tp;
    /* the swap's window positions (NEAR_TARGETS per sample), and each kept sample's row
       (-1 between calls) */
    int64_t *at, *slot;
    double *key, *cp, *lld;
    /* scratch: one entry per rank (rooms: ranks * per) */
    int64_t *rooms, *first, *second, *best_k, *begin, *size, *pos, *order;
    unsigned char *stuck;
    /* packing budgets: nbud == 0 means none. bud is n x nbud, bin_bud nb x nbud (updated in
       place), run (n + 1) x nbud scratch for the exchange's prefix sums. */
    Py_ssize_t nbud;
    const double *bud, *limits;
    double *bin_bud, *run;
    /* Sorted views kept between attempts (re-sorting every partner's samples each time
       was most of a small step's search): each rank's samples by (cost, index), each bin's
       by (tokens, index). A moving sample is taken out of and put into the views it
       concerns; a view is stale (sorted afresh when next used) until first used, after a
       whole-bin swap, or when it could not grow. Both orders are total, so a view always
       equals a fresh sort of its samples. */
    vec_t *rank_sorted, *bin_sorted;
    unsigned char *rank_stale, *bin_stale;
    /* Entries of the phase's table in use (PHASE1, or PHASE2 of _polish.c): bit e for entry e
       (all of them but in tests, which hold each family to its oracle on its own). */
    unsigned long long families;
    /* The second phase's scratch (_polish.c, its families): ranks by the room of their
       roomiest bin and prefix minima over them, a merge buffer, a knapsack's items and cost
       tables, and the knapsack cells left. */
    int64_t *room, *prefarg, *tmp, *items;
    double *minc, *maxc;
    long long cells_left;
} search_t;

/* np.maximum of two non-NaN doubles. */
static inline double dmax(double x, double y) { return x >= y ? x : y; }

/* Whether every budget holds for sums (base - out) + in, term by term (NULL: no term). */
static inline int budgets_hold(const search_t *s, const double *base, const double *out,
                               const double *in) {
    for (Py_ssize_t k = 0; k < s->nbud; k++) {
        double v = out ? base[k] - out[k] : base[k];
        if (!(v + in[k] <= s->limits[k])) return 0;
    }
    return 1;
}

static inline void mark_stale(search_t *s, int64_t b) {
    s->bin_stale[b] = 1;
    s->rank_stale[b / s->per] = 1;
}

typedef int (*before_t)(const search_t *, int64_t, int64_t);

/* The state's upkeep (_search.c); search_relocate moves sample i to bin dst (-1 when out of
   memory, the sample left where it was). */
int search_relocate(search_t *s, int64_t i, int64_t dst);
Py_ssize_t rank_samples(const search_t *s, int64_t r, int64_t *out);
int cost_down(const search_t *s, int64_t i, int64_t j);
const vec_t *rank_by_cost(search_t *s, int64_t r);
const vec_t *bin_by_tokens(search_t *s, int64_t b);

/* The first phase's move families, one signature: the best change of the family moving cost
   from rank a (its samples `heavy`, nh of them) to one of the ranks `targets` (nt of them) by
   the acceptance rule of _drive.h, into `best`; 1 when found, 0 when none, -1 on no memory. */
typedef int (*family_t)(search_t *s, int64_t a, const int64_t *heavy, Py_ssize_t nh,
                        const int64_t *targets, Py_ssize_t nt, double tol, change_t *best);

/* The families (one file each): move_family and shifted_move_family (_move.c), swap_family
   (_swap.c), exchange_family (_exchange.c). */
int move_family(search_t *s, int64_t a, const int64_t *heavy, Py_ssize_t nh,
                const int64_t *targets, Py_ssize_t nt, double tol, change_t *best);
int shifted_move_family(search_t *s, int64_t a, const int64_t *heavy, Py_ssize_t nh,
                        const int64_t *targets, Py_ssize_t nt, double tol, change_t *best);
int swap_family(search_t *s, int64_t a, const int64_t *heavy, Py_ssize_t nh_all,
                const int64_t *targets, Py_ssize_t nt, double tol, change_t *best);
int exchange_family(search_t *s, int64_t a, const int64_t *heavy_all, Py_ssize_t nh_all,
                    const int64_t *targets, Py_ssize_t nt, double tol, change_t *best);

/* One attempt of the first phase on rank a, an improve_t of _drive.h (_search.c). */
int64_t improve_attempt(void *s, int64_t a);

#endif
