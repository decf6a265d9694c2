/* The second search phase of the default algorithm, shared by the files that make it up:
   _polish.c (the Python entry, the table of families and one attempt) and one file per move
   family (_wide_move.c, _subset.c). It runs on the first phase's state (search_t, _search.h)
   and the driver loop of _drive.h. */
#ifndef EVENFLOW_POLISH_H
#define EVENFLOW_POLISH_H

#ifndef PY_SSIZE_T_CLEAN
#define PY_SSIZE_T_CLEAN
#endif
#include <Python.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "_search.h"
#include "_vec.h"

/* Tuning constants: listed in engine/_planning/schedule.py (CORE_CONSTANTS), which must match. */
#define POLISH_PARTNERS 8
#define SUBSET_CANDIDATES 8

typedef struct {
    int64_t i, y, t;
    int which; /* 0: least-cost subset, 1: largest-cost subset */
    double score;
} subset_t;

/* A change of this phase: a group-wide move of sample i to bin y, or a subset exchange. */
typedef struct {
    int subset; /* 0: move (i, y), 1: the exchange `exchange` */
    int64_t i, y;
    subset_t exchange;
} pchange_t;

/* This phase's move families, one signature: the best change of the family on rank a by the
   acceptance rule of _drive.h, into `best`; 1 when found, 0 when none, -1 on no memory. */
typedef int (*pfamily_t)(search_t *s, int64_t a, double tol, pchange_t *best);

/* The families (one file each): the group-wide move (_wide_move.c) and the subset exchange
   (_subset.c), and applying the latter. */
int move_anywhere(search_t *s, int64_t a, double tol, pchange_t *best);
int subset_family(search_t *s, int64_t a, double tol, pchange_t *best);
int apply_subset(search_t *s, const subset_t *c);

#endif
