/* The one driver loop of the default algorithm's local search, shared by its two phases
   (refine_search in _native.c, polish in _polish.c): each phase supplies its state and one
   attempt (`improve_t`), a walk over its table of move families.

   Rule of the driver: each attempt works on the most loaded rank `a` that is not stuck. An
   attempt that finds no change marks `a` stuck; one that changes `a` and a partner rank
   unsticks both. The search ends after `budget` attempts, when no rank is left, or - under
   the makespan objective (`sumsq` false) - once the most loaded rank is stuck or at or below
   `good_enough`.

   Rule of every family (the acceptance rule): a change moving net cost d from `a` to a rank
   b is accepted only when 0 < d < load[a] - load[b] (within a tolerance tol of load[a]'s
   rounding), i.e. both ranks end strictly below load[a]; candidates are scored
   max(load[a] - d, load[b] + d), the least score winning and ties going to the first
   candidate in the family's stated order. Every accepted change lowers the pair's maximum and
   the sum of squared loads, so the two phases together improve the maximum, then the spread,
   and cannot cycle. */
#ifndef EVENFLOW_DRIVE_H
#define EVENFLOW_DRIVE_H

#include <Python.h>
#include <math.h>
#include <stdint.h>

/* The tolerance of an attempt on a rank of load `top`: a change within it of top's rounding is
   no improvement. */
static inline double attempt_tolerance(double top) { return 1e-12 * fabs(top) + 1e-300; }

/* The acceptance rule of every family (see above): net cost d moved from the attempt's rank to
   a rank `gap` below it improves when 0 < d < gap, beyond the tolerance. */
static inline int accepts(double d, double gap, double tol) { return d > tol && d < gap - tol; }

/* One attempt on rank a: the partner rank changed, -1 when a admits no improving change, -2
   when memory ran out. */
typedef int64_t (*improve_t)(void *search, int64_t a);

typedef struct {
    Py_ssize_t attempts, changes;
    int failed; /* memory ran out */
} drive_t;

/* Run `improve` on `search` by the driver's rule; `load` is the search's rank loads (read
   after every attempt), `stuck` one flag per rank, all clear on entry. */
static inline drive_t drive(void *search, improve_t improve, const double *load,
                            unsigned char *stuck, Py_ssize_t ranks, Py_ssize_t budget,
                            double good_enough, int sumsq) {
    drive_t out = {0, 0, 0};
    for (; out.attempts < budget; out.attempts++) {
        int64_t top = 0;
        for (int64_t r = 1; r < ranks; r++) if (load[r] > load[top]) top = r;
        if (!sumsq && (stuck[top] || load[top] <= good_enough)) break;
        int64_t a = -1;
        for (int64_t r = 0; r < ranks; r++) {
            if (!stuck[r] && (a < 0 || load[r] > load[a])) a = r;
        }
        if (a < 0) break;
        int64_t partner = improve(search, a);
        if (partner == -2) {
            out.failed = 1;
            break;
        }
        if (partner < 0) {
            stuck[a] = 1;
        } else {
            out.changes++;
            stuck[a] = 0;
            stuck[partner] = 0;
        }
    }
    return out;
}

#endif
