/*
 * The default algorithm's two whole-bin starts (refine.py: "dealt bins", kk.py: "kk bins"):
 * the source bins, each kept whole, given to ranks so that every rank holds `per` of them.
 * Both return `dealt`, the source bin at every new position (rank-major); the caller moves
 * the samples with their bins. tests/oracles/whole_bins.py specifies both in Python and
 * tests/test_plan_whole_bins.py holds the two to identical results.
 *
 * deal_bins: the bins in the given order (by cost descending, index ascending) each to the
 * least loaded rank that still lacks a bin, the lowest rank on equal loads: a binary heap of
 * (load, rank), as Python's heapq over those pairs.
 *
 * kk_bins: Karmarkar-Karp differencing. `per` partial partitions of `ranks` parts each (the
 * bins in the given order, one slice of `ranks` bins a partition, one bin a part); while
 * more than one is left, the two of widest spread (max - min part load; on equal spreads the
 * one made first) are merged, the heaviest part of the first with the lightest of the second
 * (parts ordered by load and then their first bin), the merged partition made last. The
 * final parts, ordered by their least bin, give the ranks, each rank's bins in ascending
 * order.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <stdlib.h>

#include "_vec.h"

int evenflow_check_buffer(Py_buffer *view, const char *name, Py_ssize_t itemsize,
                          Py_ssize_t count); /* _native.c */

/* The arguments both starts take, parsed and checked: (bin_cost, order, dealt, ranks, per). */
typedef struct {
    Py_buffer cost_b, order_b, dealt_b;
    Py_ssize_t ranks, per, nb;
    const double *cost;
    const int64_t *order;
    int64_t *dealt;
} whole_args_t;

/* 1 when parsed and checked, 0 with an exception set (and nothing left to release) or -1
   with an exception set and the buffers to release (whole_release). */
static int whole_args(PyObject *args, const char *name, whole_args_t *w) {
    if (!PyArg_ParseTuple(args, "y*y*w*nn", &w->cost_b, &w->order_b, &w->dealt_b, &w->ranks,
                          &w->per)) {
        return 0;
    }
    if (w->ranks < 1 || w->per < 1 || w->per > PY_SSIZE_T_MAX / w->ranks) {
        PyErr_Format(PyExc_ValueError, "%s: need ranks, per_rank >= 1", name);
        return -1;
    }
    w->nb = w->ranks * w->per;
    if (evenflow_check_buffer(&w->cost_b, "bin_cost", sizeof(double), w->nb) ||
        evenflow_check_buffer(&w->order_b, "order", sizeof(int64_t), w->nb) ||
        evenflow_check_buffer(&w->dealt_b, "dealt", sizeof(int64_t), w->nb)) {
        return -1;
    }
    w->cost = (const double *)w->cost_b.buf;
    w->order = (const int64_t *)w->order_b.buf;
    w->dealt = (int64_t *)w->dealt_b.buf;
    unsigned char *seen = (unsigned char *)calloc((size_t)w->nb, 1);
    if (seen == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    int once = 1; /* a permutation of the bins: a bin twice would thread a part onto itself */
    for (Py_ssize_t k = 0; k < w->nb && once; k++) {
        int64_t b = w->order[k];
        once = b >= 0 && b < w->nb && !seen[b];
        if (once) seen[b] = 1;
    }
    free(seen);
    if (!once) {
        PyErr_Format(PyExc_ValueError, "%s: order must list every bin once", name);
        return -1;
    }
    return 1;
}

static void whole_release(whole_args_t *w) {
    PyBuffer_Release(&w->cost_b);
    PyBuffer_Release(&w->order_b);
    PyBuffer_Release(&w->dealt_b);
}

/* (load, rank) pairs of a min-heap, ordered as Python orders the tuples. */
typedef struct {
    double load;
    int64_t rank;
} slot_t;

static int slot_less(const slot_t *x, const slot_t *y) {
    return x->load < y->load || (x->load == y->load && x->rank < y->rank);
}

static void slot_push(slot_t *heap, Py_ssize_t *size, slot_t item) {
    Py_ssize_t k = (*size)++;
    while (k > 0) {
        Py_ssize_t parent = (k - 1) / 2;
        if (!slot_less(&item, &heap[parent])) break;
        heap[k] = heap[parent];
        k = parent;
    }
    heap[k] = item;
}

static slot_t slot_pop(slot_t *heap, Py_ssize_t *size) {
    slot_t top = heap[0], last = heap[--*size];
    Py_ssize_t k = 0, n = *size;
    for (;;) {
        Py_ssize_t child = 2 * k + 1;
        if (child >= n) break;
        if (child + 1 < n && slot_less(&heap[child + 1], &heap[child])) child++;
        if (!slot_less(&heap[child], &last)) break;
        heap[k] = heap[child];
        k = child;
    }
    if (n > 0) heap[k] = last;
    return top;
}

/* deal_bins(bin_cost, order, dealt, ranks, per): see the file comment. */
PyObject *evenflow_deal_bins(PyObject *Py_UNUSED(self), PyObject *args) {
    whole_args_t w;
    int parsed = whole_args(args, "deal_bins", &w);
    if (parsed == 0) return NULL;
    PyObject *result = NULL;
    slot_t *heap = NULL;
    int64_t *count = NULL, *held = NULL;
    if (parsed < 0) goto done;
    Py_ssize_t ranks = w.ranks, per = w.per, nb = w.nb;
    heap = (slot_t *)malloc(sizeof(slot_t) * (size_t)ranks);
    count = (int64_t *)calloc((size_t)ranks, sizeof(int64_t));
    held = (int64_t *)malloc(sizeof(int64_t) * (size_t)nb);
    if (heap == NULL || count == NULL || held == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    Py_ssize_t size = 0;
    for (Py_ssize_t r = 0; r < ranks; r++) slot_push(heap, &size, (slot_t){0.0, r});
    for (Py_ssize_t k = 0; k < nb; k++) {
        int64_t b = w.order[k];
        slot_t s = slot_pop(heap, &size);
        held[s.rank * per + count[s.rank]++] = b;
        if (count[s.rank] < per) slot_push(heap, &size, (slot_t){s.load + w.cost[b], s.rank});
    }
    for (Py_ssize_t k = 0; k < nb; k++) w.dealt[k] = held[k];
    result = Py_None;
    Py_INCREF(result);
done:
    free(heap);
    free(count);
    free(held);
    whole_release(&w);
    return result;
}

/* A part of a partial partition: its load, first and least bin, and its bins as a list
   threaded through `next` (head .. tail, in the order the merges joined them). */
typedef struct {
    double load;
    int64_t first, least, head, tail;
} part_t;

static int heavy_first(const void *pa, const void *pb) {
    const part_t *a = (const part_t *)pa, *b = (const part_t *)pb;
    if (a->load != b->load) return a->load > b->load ? -1 : 1;
    return (a->first > b->first) - (a->first < b->first);
}

static int light_first(const void *pa, const void *pb) {
    const part_t *a = (const part_t *)pa, *b = (const part_t *)pb;
    if (a->load != b->load) return a->load < b->load ? -1 : 1;
    return (a->first > b->first) - (a->first < b->first);
}

static int least_first(const void *pa, const void *pb) {
    const part_t *a = (const part_t *)pa, *b = (const part_t *)pb;
    return (a->least > b->least) - (a->least < b->least);
}

static int int64_up(const void *pa, const void *pb) {
    int64_t a = *(const int64_t *)pa, b = *(const int64_t *)pb;
    return (a > b) - (a < b);
}

static double spread_of(const part_t *parts, Py_ssize_t ranks) {
    double high = parts[0].load, low = parts[0].load;
    for (Py_ssize_t r = 1; r < ranks; r++) {
        if (parts[r].load > high) high = parts[r].load;
        if (parts[r].load < low) low = parts[r].load;
    }
    return high - low;
}

/* kk_bins(bin_cost, order, dealt, ranks, per): see the file comment. */
PyObject *evenflow_kk_bins(PyObject *Py_UNUSED(self), PyObject *args) {
    whole_args_t w;
    int parsed = whole_args(args, "kk_bins", &w);
    if (parsed == 0) return NULL;
    PyObject *result = NULL;
    part_t *parts = NULL, *merged = NULL;
    int64_t *next = NULL, *serial = NULL;
    double *spread = NULL;
    unsigned char *alive = NULL;
    if (parsed < 0) goto done;
    Py_ssize_t ranks = w.ranks, per = w.per, nb = w.nb;
    const double *cost = w.cost;
    const int64_t *order = w.order;
    int64_t *dealt = w.dealt;
    /* Partition p holds parts[p * ranks .. (p + 1) * ranks); a merge writes the merged one
       over the first of the two and retires the second. */
    parts = (part_t *)malloc(sizeof(part_t) * (size_t)nb);
    merged = (part_t *)malloc(sizeof(part_t) * (size_t)ranks);
    next = (int64_t *)malloc(sizeof(int64_t) * (size_t)nb);
    serial = (int64_t *)malloc(sizeof(int64_t) * (size_t)per);
    spread = (double *)malloc(sizeof(double) * (size_t)per);
    alive = (unsigned char *)malloc((size_t)per);
    if (parts == NULL || merged == NULL || next == NULL || serial == NULL || spread == NULL ||
        alive == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    for (Py_ssize_t k = 0; k < nb; k++) {
        int64_t b = order[k];
        parts[k] = (part_t){cost[b], b, b, b, b};
        next[b] = -1;
    }
    for (Py_ssize_t p = 0; p < per; p++) {
        serial[p] = p;
        spread[p] = spread_of(parts + p * ranks, ranks);
        alive[p] = 1;
    }
    int64_t made = per;
    for (Py_ssize_t left = per; left > 1; left--) {
        /* The two partitions first in (-spread, serial) order, as heapq pops them. */
        Py_ssize_t take[2] = {-1, -1};
        for (int t = 0; t < 2; t++) {
            for (Py_ssize_t p = 0; p < per; p++) {
                if (!alive[p] || p == take[0]) continue;
                Py_ssize_t q = take[t];
                if (q < 0 || -spread[p] < -spread[q] ||
                    (-spread[p] == -spread[q] && serial[p] < serial[q])) {
                    take[t] = p;
                }
            }
        }
        part_t *first = parts + take[0] * ranks, *second = parts + take[1] * ranks;
        qsort(first, (size_t)ranks, sizeof(part_t), heavy_first);
        qsort(second, (size_t)ranks, sizeof(part_t), light_first);
        for (Py_ssize_t r = 0; r < ranks; r++) {
            part_t a = first[r], b = second[r];
            next[a.tail] = b.head;
            merged[r] = (part_t){a.load + b.load, a.first, a.least < b.least ? a.least : b.least,
                                 a.head, b.tail};
        }
        for (Py_ssize_t r = 0; r < ranks; r++) first[r] = merged[r];
        alive[take[1]] = 0;
        serial[take[0]] = made++;
        spread[take[0]] = spread_of(first, ranks);
    }
    Py_ssize_t last = 0;
    while (!alive[last]) last++;
    part_t *final = parts + last * ranks;
    qsort(final, (size_t)ranks, sizeof(part_t), least_first);
    Py_ssize_t k = 0;
    for (Py_ssize_t r = 0; r < ranks; r++) {
        Py_ssize_t start = k;
        for (int64_t b = final[r].head; b >= 0; b = next[b]) dealt[k++] = b;
        qsort(dealt + start, (size_t)(k - start), sizeof(int64_t), int64_up);
    }
    result = Py_None;
    Py_INCREF(result);
done:
    free(parts);
    free(merged);
    free(next);
    free(serial);
    free(spread);
    free(alive);
    whole_release(&w);
    return result;
}
