/* The one driver loop of the planner's local searches: the default algorithm's two phases
   (refine_search in _native.c, polish in _polish.c) and the grouped search of lockstep plans
   and windows (_grouped.c, in rounds; its own acceptance rule is in _grouped.h). Each search
   supplies its state and one attempt (`improve_t`), a walk over its table of move families.

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
#include <string.h>

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
   after every attempt), `stuck` one flag per rank, all clear on entry. With `seen` (one flag
   per rank, all clear on entry; NULL for the plain rule) the driver works in rounds: an
   attempt takes the most loaded rank that is neither stuck nor worked yet in this round, a
   round ends when no such rank is left and the search ends after a round without a change.
   The grouped search (_grouped.c) runs so: its loads are group maxima, each of which counts
   in its objective, so every group gets its turn before any gets a second one. */
static inline drive_t drive_rounds(void *search, improve_t improve, const double *load,
                                   unsigned char *stuck, unsigned char *seen,
                                   Py_ssize_t ranks, Py_ssize_t budget, double good_enough,
                                   int sumsq) {
    drive_t out = {0, 0, 0};
    int changed = 0; /* in this round */
    while (out.attempts < budget) {
        int64_t top = 0;
        for (int64_t r = 1; r < ranks; r++) if (load[r] > load[top]) top = r;
        if (!sumsq && (stuck[top] || load[top] <= good_enough)) break;
        int64_t a = -1;
        for (int64_t r = 0; r < ranks; r++) {
            if (!stuck[r] && !(seen && seen[r]) && (a < 0 || load[r] > load[a])) a = r;
        }
        if (a < 0) {
            if (seen == NULL || !changed) break;
            memset(seen, 0, (size_t)ranks);
            changed = 0;
            continue;
        }
        int64_t partner = improve(search, a);
        if (partner == -2) {
            out.failed = 1;
            break;
        }
        out.attempts++;
        if (seen) seen[a] = 1;
        if (partner < 0) {
            stuck[a] = 1;
        } else {
            out.changes++;
            changed = 1;
            stuck[a] = 0;
            stuck[partner] = 0;
        }
    }
    return out;
}

/* The plain rule: drive_rounds without rounds. */
static inline drive_t drive(void *search, improve_t improve, const double *load,
                            unsigned char *stuck, Py_ssize_t ranks, Py_ssize_t budget,
                            double good_enough, int sumsq) {
    return drive_rounds(search, improve, load, stuck, NULL, ranks, budget, good_enough, sumsq);
}

#endif
