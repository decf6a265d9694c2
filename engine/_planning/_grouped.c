/*
 * The grouped search (_grouped.h): its state's upkeep, its table of families with one attempt
 * walking it, and the Python entry, grouped_search. The driver loop is _drive.h's, over the
 * groups' maxima; the Python oracle is tests/oracles/grouped.py.
 */
#include "_drive.h"
#include "_grouped.h"

/* The table: an attempt takes the best candidate over every entry in use (the most gain,
   then the least cost changed; ties to the earlier entry). */
static const gfamily_t GROUPED[] = {group_move_family, group_exchange_family};

/* (cost descending, unit ascending): the order of `order`. */
static inline int costlier(const groups_t *s, int64_t u, int64_t v) {
    double cu = s->unit_cost[u], cv = s->unit_cost[v];
    return cu > cv || (cu == cv && u < v);
}

/* Restore `order` after units changed cost (insertion sort: only the changed units are out of
   place), then every group's maximum; unsticks the groups whose members changed. */
static void regroup(groups_t *s) {
    Py_ssize_t lo = s->units, hi = -1;
    for (Py_ssize_t k = 1; k < s->units; k++) {
        int64_t v = s->order[k];
        Py_ssize_t j = k;
        while (j > 0 && costlier(s, v, s->order[j - 1])) {
            s->order[j] = s->order[j - 1];
            j--;
        }
        if (j == k) continue;
        s->order[j] = v;
        if (j < lo) lo = j;
        if (k > hi) hi = k;
    }
    for (Py_ssize_t k = lo; k <= hi; k++) s->pos[s->order[k]] = k;
    for (Py_ssize_t g = lo / s->group; hi >= 0 && g <= hi / s->group; g++) s->stuck[g] = 0;
    for (Py_ssize_t g = 0; g < s->groups; g++) s->gmax[g] = s->unit_cost[s->order[g * s->group]];
}

/* Apply a change; the unit that received cost. -1 when out of memory (nothing changed). */
static int64_t apply(groups_t *s, const gchange_t *c) {
    Py_ssize_t per = s->per, nbud = s->nbud;
    int64_t i = c->i, p = s->bin_of[i];
    if (c->kind == GROUP_MOVE) {
        int64_t q = c->target;
        if (vec_push(&s->members[q], i) < 0) return -1;
        vec_remove(&s->members[p], i);
        s->bin_of[i] = q;
        s->bin_cnt[p] -= 1;
        s->bin_cnt[q] += 1;
        s->bin_tok[p] -= s->tok[i];
        s->bin_tok[q] += s->tok[i];
        for (Py_ssize_t k = 0; k < nbud; k++) {
            s->bin_bud[p * nbud + k] -= s->bud[i * nbud + k];
            s->bin_bud[q * nbud + k] += s->bud[i * nbud + k];
        }
        s->unit_cost[p / per] -= s->cost[i];
        s->unit_cost[q / per] += s->cost[i];
        return q / per;
    }
    int64_t j = c->target, q = s->bin_of[j];
    vec_t *mp = &s->members[p], *mq = &s->members[q];
    for (Py_ssize_t k = 0; k < mp->n; k++) if (mp->v[k] == i) mp->v[k] = j;
    for (Py_ssize_t k = 0; k < mq->n; k++) if (mq->v[k] == j) mq->v[k] = i;
    int64_t dt = s->tok[i] - s->tok[j];
    double dc = s->cost[i] - s->cost[j];
    s->bin_of[i] = q;
    s->bin_of[j] = p;
    s->bin_tok[p] -= dt;
    s->bin_tok[q] += dt;
    for (Py_ssize_t k = 0; k < nbud; k++) {
        double db = s->bud[i * nbud + k] - s->bud[j * nbud + k];
        s->bin_bud[p * nbud + k] -= db;
        s->bin_bud[q * nbud + k] += db;
    }
    s->unit_cost[p / per] -= dc;
    s->unit_cost[q / per] += dc;
    return q / per;
}

/* One attempt on group g (an improve_t of _drive.h): the best change out of its most costly
   unit by the table; the group that received cost, -1 when none, -2 when out of memory. */
static int64_t improve_group(void *search, int64_t g) {
    groups_t *s = (groups_t *)search;
    Py_ssize_t size = s->group;
    int64_t x = s->order[g * size];
    gattempt_t at;
    at.x = x;
    at.top = s->unit_cost[x];
    at.room = at.top - s->unit_cost[s->order[g * size + 1]];
    at.tol = attempt_tolerance(at.top);
    for (int64_t u = 0; u < s->units; u++) {
        s->slack[u] = s->gmax[s->pos[u] / size] - s->unit_cost[u];
    }
    s->slack[x] = -INFINITY;
    gchange_t best, found;
    best.kind = GROUP_NONE;
    for (size_t e = 0; e < sizeof(GROUPED) / sizeof(GROUPED[0]); e++) {
        if (!((s->families >> e) & 1)) continue;
        if (!GROUPED[e](s, &at, &found)) continue;
        if (best.kind == GROUP_NONE || found.gain > best.gain ||
            (found.gain == best.gain && found.d < best.d)) {
            best = found;
        }
    }
    if (best.kind == GROUP_NONE) return -1;
    int64_t y = apply(s, &best);
    if (y < 0) return -2;
    regroup(s);
    return s->pos[y] / size;
}

static int sized(const Py_buffer *b, Py_ssize_t item, Py_ssize_t count, const char *name) {
    if (b->len != item * count) {
        PyErr_Format(PyExc_ValueError, "grouped_search: %s holds %zd bytes, not %zd", name,
                     b->len, item * count);
        return 1;
    }
    return 0;
}

PyObject *evenflow_grouped_search(PyObject *Py_UNUSED(self), PyObject *args) {
    Py_buffer cost_b, tok_b, bud_b, lim_b, bin_of_b, cnt_b, btok_b, bbud_b, ucost_b, order_b;
    Py_ssize_t per, group, seq_len, budget, partner_units;
    int single;
    unsigned long long families = ~0ULL;
    if (!PyArg_ParseTuple(args, "y*y*y*y*w*w*w*w*w*w*nnnpnn|K", &cost_b, &tok_b, &bud_b,
                          &lim_b, &bin_of_b, &cnt_b, &btok_b, &bbud_b, &ucost_b, &order_b, &per,
                          &group, &seq_len, &single, &budget, &partner_units, &families)) {
        return NULL;
    }
    PyObject *result = NULL;
    groups_t s;
    memset(&s, 0, sizeof(s));
    void *block = NULL;
    Py_ssize_t n = cost_b.len / (Py_ssize_t)sizeof(double);
    Py_ssize_t units = ucost_b.len / (Py_ssize_t)sizeof(double);
    Py_ssize_t nbud = lim_b.len / (Py_ssize_t)sizeof(double);
    if (per < 1 || group < 2 || units % group != 0 || partner_units < 0) {
        PyErr_SetString(PyExc_ValueError,
                         "grouped_search: units must split into groups of at least two, each "
                         "unit at least one bin, partner_units at least 0");
        goto done;
    }
    Py_ssize_t nb = units * per;
    if (sized(&tok_b, 8, n, "tok") || sized(&bud_b, 8, n * nbud, "bud") ||
        sized(&bin_of_b, 8, n, "bin_of") || sized(&cnt_b, 8, nb, "bin_cnt") ||
        sized(&btok_b, 8, nb, "bin_tok") || sized(&bbud_b, 8, nb * nbud, "bin_bud") ||
        sized(&order_b, 8, units, "order")) {
        goto done;
    }
    s.n = n;
    s.units = units;
    s.per = per;
    s.group = group;
    s.groups = units / group;
    s.nbud = nbud;
    s.partner_units = partner_units;
    s.seq_len = seq_len;
    s.single = single;
    s.families = families;
    s.cost = (const double *)cost_b.buf;
    s.bud = (const double *)bud_b.buf;
    s.limits = (const double *)lim_b.buf;
    s.tok = (const int64_t *)tok_b.buf;
    s.bin_of = (int64_t *)bin_of_b.buf;
    s.bin_cnt = (int64_t *)cnt_b.buf;
    s.bin_tok = (int64_t *)btok_b.buf;
    s.bin_bud = (double *)bbud_b.buf;
    s.unit_cost = (double *)ucost_b.buf;
    s.order = (int64_t *)order_b.buf;
    block = calloc((size_t)(3 * units + s.groups + 1), sizeof(int64_t));
    s.members = (vec_t *)calloc((size_t)nb, sizeof(vec_t));
    s.stuck = (unsigned char *)calloc((size_t)s.groups, 1);
    s.seen = (unsigned char *)calloc((size_t)s.groups, 1);
    if (block == NULL || s.members == NULL || s.stuck == NULL || s.seen == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    int64_t *w = (int64_t *)block;
    s.pos = w; w += units;
    s.partners = w; w += units;
    s.slack = (double *)w; w += units;
    s.gmax = (double *)w;
    {
        /* The state must agree with itself: every index below is trusted. */
        int bad = 0;
        for (Py_ssize_t u = 0; u < units; u++) s.pos[u] = -1;
        for (Py_ssize_t k = 0; k < units && !bad; k++) {
            int64_t u = s.order[k];
            bad = u < 0 || u >= units || s.pos[u] >= 0;
            if (!bad) s.pos[u] = k;
        }
        for (Py_ssize_t i = 0; i < n && !bad; i++) {
            int64_t b = s.bin_of[i];
            bad = b < 0 || b >= nb;
            if (!bad && vec_push(&s.members[b], i) < 0) {
                PyErr_NoMemory();
                goto done;
            }
        }
        for (Py_ssize_t b = 0; b < nb && !bad; b++) bad = s.members[b].n != s.bin_cnt[b];
        if (bad) {
            PyErr_SetString(PyExc_ValueError,
                            "grouped_search: order must list every unit once, bin_of hold bin "
                            "indices and bin_cnt count them");
            goto done;
        }
    }
    drive_t run;
    Py_BEGIN_ALLOW_THREADS
    regroup(&s);
    memset(s.stuck, 0, (size_t)s.groups);
    run = drive_rounds(&s, improve_group, s.gmax, s.stuck, s.seen, s.groups, budget, 0.0, 1);
    Py_END_ALLOW_THREADS
    if (run.failed) {
        PyErr_NoMemory();
        goto done;
    }
    result = Py_BuildValue("nn", run.attempts, run.changes);

done:
    if (s.members != NULL) {
        for (Py_ssize_t b = 0; b < s.units * s.per; b++) free(s.members[b].v);
    }
    free(s.members);
    free(s.stuck);
    free(s.seen);
    free(block);
    PyBuffer_Release(&cost_b);
    PyBuffer_Release(&tok_b);
    PyBuffer_Release(&bud_b);
    PyBuffer_Release(&lim_b);
    PyBuffer_Release(&bin_of_b);
    PyBuffer_Release(&cnt_b);
    PyBuffer_Release(&btok_b);
    PyBuffer_Release(&bbud_b);
    PyBuffer_Release(&ucost_b);
    PyBuffer_Release(&order_b);
    return result;
}
