/* A growable array of int64 values, shared by the compiled core's translation units
   (_native.c, _polish.c, _settle.c). Zero-initialise a vec_t ({NULL, 0, 0}); free(v) when done. */
#ifndef EVENFLOW_VEC_H
#define EVENFLOW_VEC_H

#include <Python.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

typedef struct {
    int64_t *v;
    Py_ssize_t n, cap;
} vec_t;

/* list.append: -1 when memory ran out (the vector is unchanged), else 0. */
static inline int vec_push(vec_t *vec, int64_t value) {
    if (vec->n == vec->cap) {
        Py_ssize_t cap = vec->cap ? 2 * vec->cap : 8;
        int64_t *v = (int64_t *)realloc(vec->v, sizeof(int64_t) * (size_t)cap);
        if (v == NULL) return -1;
        vec->v = v;
        vec->cap = cap;
    }
    vec->v[vec->n++] = value;
    return 0;
}

/* list.remove: the first occurrence, the rest keeping their order. */
static inline void vec_remove(vec_t *vec, int64_t value) {
    for (Py_ssize_t k = 0; k < vec->n; k++) {
        if (vec->v[k] == value) {
            memmove(vec->v + k, vec->v + k + 1, sizeof(int64_t) * (size_t)(vec->n - k - 1));
            vec->n--;
            return;
        }
    }
}

#endif
