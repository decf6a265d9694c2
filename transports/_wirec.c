/*
 * The wire format's fast frame decoder: the common case of _wire._decode_frame, in C.
 *
 * decode_many() checks each frame's prefix as _decode_frame does, walks its msgpack header and
 * builds the object tree the Python decoder would build (the same types, views of the same
 * memory), or answers NotImplemented as soon as anything in any frame is not plainly valid:
 * a prefix _decode_frame would refuse, a dict key that is not a str, a timestamp or any
 * other extension it does not build itself (numpy scalars), a tuple marker out of place, a
 * descriptor that does not claim the next buffer, bytes left over, nesting deeper than
 * MAX_DEPTH, invalid UTF-8, a failed allocation. The caller then decodes frame by frame
 * with the checked Python path, which says exactly what is wrong (or, for the rare
 * extensions left to it, decodes it). So this file never has to phrase an error, and a
 * frame it accepts is one the Python path accepts with an equal result: tests hold the two
 * paths to that on generated and corrupted frames.
 *
 * Every read of the header is bounds-checked against its end; a declared container length
 * is checked against the bytes left before anything is allocated (every element takes at
 * least one byte); the body is read only through descriptors that claim, in order, aligned
 * buffers inside it, after the frame's declared lengths were checked against its size.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#define ALIGN 64
#define MAX_DEPTH 512
#define MAX_NDIM 64
#define MAX_EXTENT ((uint64_t)1 << 48)
#define EXT_NDARRAY 1
#define EXT_TENSOR 2
#define EXT_TUPLE 3
#define EXT_RAW 4
#define RAW_BYTES 0
#define RAW_BYTEARRAY 1

/* Set once by configure(): per dtype code, its item size (0: unknown), its numpy carrier
 * dtype, and whether numpy arrays / tensors of it may travel. */
static Py_ssize_t itemsizes[256];
static PyObject *carriers[256];
static char numpy_ok[256];
static char torch_ok[256];
static PyObject *frombuffer; /* numpy.frombuffer */
static PyObject *make_tensor; /* (frame, dtype code, start, nbytes, shape) -> Tensor */
static PyObject *reshape_name;
static PyObject *tuple_mark; /* an object() of its own: the tuple marker while decoding */
#define TUPLE_MARK tuple_mark

typedef struct {
    const uint8_t *p;
    const uint8_t *end;
    const uint8_t *body; /* the frame's body */
    uint64_t body_len;
    uint64_t cursor;     /* body offset where the next buffer must start */
    Py_ssize_t base;     /* where the body starts in the buffer views are taken of */
    PyObject *frame;     /* what views are taken of: the frame, or the buffer holding it */
} reader_t;

static inline uint16_t be16(const uint8_t *p) { return (uint16_t)(p[0] << 8 | p[1]); }
static inline uint32_t be32(const uint8_t *p) {
    return (uint32_t)p[0] << 24 | (uint32_t)p[1] << 16 | (uint32_t)p[2] << 8 | p[3];
}
static inline uint64_t be64(const uint8_t *p) { return (uint64_t)be32(p) << 32 | be32(p + 4); }
static inline uint64_t le64(const uint8_t *p) {
    uint64_t v = 0;
    for (int i = 7; i >= 0; i--) v = v << 8 | p[i];
    return v;
}

static PyObject *parse(reader_t *r, int depth);

/* Take n bytes from the header, or NULL when fewer are left. */
static inline const uint8_t *take(reader_t *r, uint64_t n) {
    if ((uint64_t)(r->end - r->p) < n) return NULL;
    const uint8_t *at = r->p;
    r->p += n;
    return at;
}

/* Claim the next body buffer: it must start exactly at the cursor and fit in the body. */
static int claim(reader_t *r, uint64_t offset, uint64_t nbytes) {
    if (offset != r->cursor || nbytes > r->body_len - offset) return 0;
    r->cursor = (offset + nbytes + ALIGN - 1) & ~(uint64_t)(ALIGN - 1);
    return 1;
}

static PyObject *array_from(reader_t *r, int8_t code, const uint8_t *d, uint32_t len) {
    if (len < 18) return NULL;
    unsigned ndim = d[1];
    if (ndim > MAX_NDIM || len != 18 + 8 * ndim) return NULL;
    unsigned dtype = d[0];
    if (!itemsizes[dtype] || !(code == EXT_NDARRAY ? numpy_ok[dtype] : torch_ok[dtype]))
        return NULL;
    uint64_t offset = le64(d + 2), nbytes = le64(d + 10);
    uint64_t dims[MAX_NDIM];
    uint64_t count = 1, extent = 1;
    int empty = 0;
    for (unsigned i = 0; i < ndim; i++) {
        dims[i] = le64(d + 18 + 8 * i);
        if (!dims[i]) {
            empty = 1;
            continue;
        }
        if (__builtin_mul_overflow(extent, dims[i], &extent)) return NULL;
    }
    if (empty) {
        if (extent > MAX_EXTENT) return NULL;
        count = 0;
    } else {
        count = extent;
    }
    uint64_t size;
    if (__builtin_mul_overflow(count, (uint64_t)itemsizes[dtype], &size) || size != nbytes)
        return NULL;
    if (!claim(r, offset, nbytes)) return NULL;
    /* Offsets are below body_len, which fits in a Py_ssize_t (the frame is in memory). */
    Py_ssize_t start = r->base + (Py_ssize_t)offset;
    PyObject *shape = NULL, *result = NULL;
    if (code == EXT_TENSOR || ndim != 1) {
        shape = PyTuple_New(ndim);
        if (!shape) return NULL;
        for (unsigned i = 0; i < ndim; i++) {
            PyObject *dim = PyLong_FromUnsignedLongLong(dims[i]);
            if (!dim) goto done;
            PyTuple_SET_ITEM(shape, i, dim);
        }
    }
    if (code == EXT_TENSOR) {
        PyObject *args[5] = {r->frame, NULL, NULL, NULL, shape};
        args[1] = PyLong_FromLong((long)dtype);
        args[2] = PyLong_FromSsize_t(start);
        args[3] = PyLong_FromUnsignedLongLong(nbytes);
        if (args[1] && args[2] && args[3]) result = PyObject_Vectorcall(make_tensor, args, 5, NULL);
        Py_XDECREF(args[1]);
        Py_XDECREF(args[2]);
        Py_XDECREF(args[3]);
        goto done;
    }
    PyObject *args[4] = {r->frame, carriers[dtype], NULL, NULL};
    args[2] = PyLong_FromUnsignedLongLong(count);
    args[3] = PyLong_FromSsize_t(start);
    if (args[2] && args[3]) result = PyObject_Vectorcall(frombuffer, args, 4, NULL);
    Py_XDECREF(args[2]);
    Py_XDECREF(args[3]);
    if (result && ndim != 1) {
        PyObject *call[2] = {result, shape};
        PyObject *reshaped = PyObject_VectorcallMethod(reshape_name, call, 2, NULL);
        Py_SETREF(result, reshaped);
    }
done:
    Py_XDECREF(shape);
    return result;
}

static PyObject *ext_from(reader_t *r, int8_t code, const uint8_t *d, uint32_t len) {
    if (code == EXT_NDARRAY || code == EXT_TENSOR) return array_from(r, code, d, len);
    if (code == EXT_TUPLE && len == 0) {
        Py_INCREF(TUPLE_MARK);
        return TUPLE_MARK;
    }
    if (code == EXT_RAW && len == 17 && (d[0] == RAW_BYTES || d[0] == RAW_BYTEARRAY)) {
        uint64_t offset = le64(d + 1), nbytes = le64(d + 9);
        if (!claim(r, offset, nbytes)) return NULL;
        const char *at = (const char *)r->body + offset;
        return d[0] == RAW_BYTES ? PyBytes_FromStringAndSize(at, (Py_ssize_t)nbytes)
                                 : PyByteArray_FromStringAndSize(at, (Py_ssize_t)nbytes);
    }
    return NULL; /* numpy scalars, timestamps, anything unknown: the Python path decides */
}

static PyObject *str_from(reader_t *r, uint64_t n) {
    const uint8_t *at = take(r, n);
    return at ? PyUnicode_DecodeUTF8((const char *)at, (Py_ssize_t)n, "strict") : NULL;
}

/* The length of a str whose type byte is t, or -1 when t does not start a str. */
static int64_t str_len(reader_t *r, uint8_t t) {
    const uint8_t *at;
    if ((t & 0xe0) == 0xa0) return t & 0x1f;
    switch (t) {
    case 0xd9: return (at = take(r, 1)) ? at[0] : -1;
    case 0xda: return (at = take(r, 2)) ? be16(at) : -1;
    case 0xdb: return (at = take(r, 4)) ? be32(at) : -1;
    default: return -1;
    }
}

static PyObject *list_from(reader_t *r, uint64_t n, int depth) {
    if (n > (uint64_t)(r->end - r->p)) return NULL;
    PyObject *list = PyList_New((Py_ssize_t)n);
    if (!list) return NULL;
    for (uint64_t i = 0; i < n; i++) {
        PyObject *item = parse(r, depth + 1);
        if (!item || (item == TUPLE_MARK && i)) {
            Py_XDECREF(item);
            Py_DECREF(list);
            return NULL;
        }
        PyList_SET_ITEM(list, (Py_ssize_t)i, item);
    }
    if (n && PyList_GET_ITEM(list, 0) == TUPLE_MARK) {
        PyObject *tuple = PyList_GetSlice(list, 1, (Py_ssize_t)n);
        Py_DECREF(list);
        if (!tuple) return NULL;
        Py_SETREF(tuple, PyList_AsTuple(tuple));
        return tuple;
    }
    return list;
}

static PyObject *dict_from(reader_t *r, uint64_t n, int depth) {
    if (n > (uint64_t)(r->end - r->p) / 2) return NULL;
    PyObject *dict = PyDict_New();
    if (!dict) return NULL;
    for (uint64_t i = 0; i < n; i++) {
        const uint8_t *t = take(r, 1);
        int64_t len = t ? str_len(r, t[0]) : -1;
        PyObject *key = len >= 0 ? str_from(r, (uint64_t)len) : NULL;
        PyObject *value = key ? parse(r, depth + 1) : NULL;
        int ok = value && value != TUPLE_MARK && PyDict_SetItem(dict, key, value) == 0;
        Py_XDECREF(key);
        Py_XDECREF(value);
        if (!ok) {
            Py_DECREF(dict);
            return NULL;
        }
    }
    return dict;
}

static PyObject *parse(reader_t *r, int depth) {
    if (depth > MAX_DEPTH) return NULL;
    const uint8_t *at = take(r, 1);
    if (!at) return NULL;
    uint8_t t = at[0];
    if (t <= 0x7f) return PyLong_FromLong(t);
    if (t >= 0xe0) return PyLong_FromLong((int8_t)t);
    if ((t & 0xf0) == 0x80) return dict_from(r, t & 0x0f, depth);
    if ((t & 0xf0) == 0x90) return list_from(r, t & 0x0f, depth);
    if ((t & 0xe0) == 0xa0) return str_from(r, t & 0x1f);
    uint32_t len;
    switch (t) {
    case 0xc0: Py_RETURN_NONE;
    case 0xc2: Py_RETURN_FALSE;
    case 0xc3: Py_RETURN_TRUE;
    case 0xc4: case 0xc5: case 0xc6: {
        unsigned width = t == 0xc4 ? 1 : t == 0xc5 ? 2 : 4;
        if (!(at = take(r, width))) return NULL;
        len = width == 1 ? at[0] : width == 2 ? be16(at) : be32(at);
        return (at = take(r, len)) ? PyBytes_FromStringAndSize((const char *)at, len) : NULL;
    }
    case 0xc7: case 0xc8: case 0xc9: {
        unsigned width = t == 0xc7 ? 1 : t == 0xc8 ? 2 : 4;
        if (!(at = take(r, width + 1))) return NULL;
        len = width == 1 ? at[0] : width == 2 ? be16(at) : be32(at);
        int8_t code = (int8_t)at[width];
        return (at = take(r, len)) ? ext_from(r, code, at, len) : NULL;
    }
    case 0xca: {
        if (!(at = take(r, 4))) return NULL;
        uint32_t bits = be32(at);
        float value;
        memcpy(&value, &bits, 4);
        return PyFloat_FromDouble((double)value);
    }
    case 0xcb: {
        if (!(at = take(r, 8))) return NULL;
        uint64_t bits = be64(at);
        double value;
        memcpy(&value, &bits, 8);
        return PyFloat_FromDouble(value);
    }
    case 0xcc: return (at = take(r, 1)) ? PyLong_FromLong(at[0]) : NULL;
    case 0xcd: return (at = take(r, 2)) ? PyLong_FromLong(be16(at)) : NULL;
    case 0xce: return (at = take(r, 4)) ? PyLong_FromUnsignedLong(be32(at)) : NULL;
    case 0xcf: return (at = take(r, 8)) ? PyLong_FromUnsignedLongLong(be64(at)) : NULL;
    case 0xd0: return (at = take(r, 1)) ? PyLong_FromLong((int8_t)at[0]) : NULL;
    case 0xd1: return (at = take(r, 2)) ? PyLong_FromLong((int16_t)be16(at)) : NULL;
    case 0xd2: return (at = take(r, 4)) ? PyLong_FromLong((int32_t)be32(at)) : NULL;
    case 0xd3: return (at = take(r, 8)) ? PyLong_FromLongLong((int64_t)be64(at)) : NULL;
    case 0xd4: case 0xd5: case 0xd6: case 0xd7: case 0xd8: {
        len = 1u << (t - 0xd4);
        if (!(at = take(r, 1))) return NULL;
        int8_t code = (int8_t)at[0];
        return (at = take(r, len)) ? ext_from(r, code, at, len) : NULL;
    }
    case 0xd9: case 0xda: case 0xdb: {
        int64_t n = str_len(r, t);
        return n >= 0 ? str_from(r, (uint64_t)n) : NULL;
    }
    case 0xdc: return (at = take(r, 2)) ? list_from(r, be16(at), depth) : NULL;
    case 0xdd: return (at = take(r, 4)) ? list_from(r, be32(at), depth) : NULL;
    case 0xde: return (at = take(r, 2)) ? dict_from(r, be16(at), depth) : NULL;
    case 0xdf: return (at = take(r, 4)) ? dict_from(r, be32(at), depth) : NULL;
    default: return NULL; /* 0xc1 is never used */
    }
}

/* The object of the frame at buf[origin:origin + size] (views are taken of `owner`, whose
 * buffer buf is), or NULL with no exception set when the frame is declined. */
static PyObject *frame_at(PyObject *owner, const uint8_t *buf, Py_ssize_t origin,
                          Py_ssize_t header_len, Py_ssize_t base, Py_ssize_t body_len) {
    const uint8_t *frame = buf + origin;
    reader_t r = {frame + 20, frame + 20 + header_len, frame + base, (uint64_t)body_len, 0,
                  origin + base, owner};
    PyObject *result = parse(&r, 0);
    if (!result || result == TUPLE_MARK || r.p != r.end || r.cursor != (uint64_t)body_len) {
        Py_XDECREF(result);
        PyErr_Clear();
        return NULL;
    }
    return result;
}

static inline uint32_t le32(const uint8_t *p) {
    return (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24;
}

/* decode_many(buffer, sizes, max_frame_bytes) -> a list (None for empty sizes), or
 * NotImplemented when any frame's prefix or header is not plainly valid. The caller has
 * checked that the sizes are non-negative ints adding up to the buffer's length. Each
 * prefix is checked as _decode_frame checks it. */
static PyObject *decode_many(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 3 || !PyList_Check(args[1])) {
        PyErr_SetString(PyExc_TypeError, "decode_many(buffer, sizes: list, max_frame_bytes)");
        return NULL;
    }
    if (!frombuffer) {
        PyErr_SetString(PyExc_RuntimeError, "configure() must run first");
        return NULL;
    }
    Py_ssize_t limit = PyLong_AsSsize_t(args[2]);
    if (limit == -1 && PyErr_Occurred()) return NULL;
    Py_buffer view;
    if (PyObject_GetBuffer(args[0], &view, PyBUF_SIMPLE) < 0) return NULL;
    const uint8_t *buf = (const uint8_t *)view.buf;
    Py_ssize_t count = PyList_GET_SIZE(args[1]), position = 0;
    PyObject *out = PyList_New(count);
    if (!out) goto fail;
    for (Py_ssize_t i = 0; i < count; i++) {
        Py_ssize_t size = PyLong_AsSsize_t(PyList_GET_ITEM(args[1], i));
        if (size < 0 || size > view.len - position) goto decline; /* also a conversion error */
        if (!size) {
            PyList_SET_ITEM(out, i, Py_NewRef(Py_None));
            continue;
        }
        const uint8_t *f = buf + position;
        if (size < 20 || memcmp(f, "EVFW", 4) != 0 || f[4] != 1 || f[5] != 0 || f[6] || f[7])
            goto decline;
        uint32_t header_len = le32(f + 8);
        uint64_t body_len = (uint64_t)le32(f + 12) | (uint64_t)le32(f + 16) << 32;
        uint64_t base = (20 + (uint64_t)header_len + ALIGN - 1) & ~(uint64_t)(ALIGN - 1);
        /* body_len is bounded first, so that the sums below cannot wrap. */
        if (!header_len || body_len > (uint64_t)size || body_len % ALIGN ||
            base + body_len != (uint64_t)size || base + body_len > (uint64_t)limit)
            goto decline;
        PyObject *item =
            frame_at(args[0], buf, position, header_len, (Py_ssize_t)base, (Py_ssize_t)body_len);
        if (!item) goto decline;
        PyList_SET_ITEM(out, i, item);
        position += size;
    }
    PyBuffer_Release(&view);
    return out;
decline:
    PyErr_Clear();
    Py_DECREF(out);
    PyBuffer_Release(&view);
    return Py_NewRef(Py_NotImplemented);
fail:
    PyBuffer_Release(&view);
    return NULL;
}

/* configure(specs, frombuffer, make_tensor): specs holds (code, itemsize, carrier,
 * numpy_ok, torch_ok) for every dtype code that may travel. */
static PyObject *configure(PyObject *self, PyObject *args) {
    PyObject *specs, *fb, *mt;
    if (!PyArg_ParseTuple(args, "OOO", &specs, &fb, &mt)) return NULL;
    PyObject *seq = PySequence_Fast(specs, "specs must be a sequence");
    if (!seq) return NULL;
    for (Py_ssize_t i = 0; i < PySequence_Fast_GET_SIZE(seq); i++) {
        int code, np_ok, t_ok;
        Py_ssize_t size;
        PyObject *carrier;
        if (!PyArg_ParseTuple(PySequence_Fast_GET_ITEM(seq, i), "inOpp", &code, &size, &carrier,
                              &np_ok, &t_ok)) {
            Py_DECREF(seq);
            return NULL;
        }
        if (code < 0 || code > 255 || size <= 0) {
            Py_DECREF(seq);
            PyErr_SetString(PyExc_ValueError, "dtype code out of range");
            return NULL;
        }
        Py_XSETREF(carriers[code], Py_NewRef(carrier));
        itemsizes[code] = size;
        numpy_ok[code] = (char)np_ok;
        torch_ok[code] = (char)t_ok;
    }
    Py_DECREF(seq);
    Py_XSETREF(frombuffer, Py_NewRef(fb));
    Py_XSETREF(make_tensor, Py_NewRef(mt));
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"decode_many", (PyCFunction)(void (*)(void))decode_many, METH_FASTCALL,
     "decode_many(buffer, sizes, max_frame_bytes): every frame's object, or NotImplemented."},
    {"configure", configure, METH_VARARGS,
     "configure(specs, frombuffer, make_tensor): the dtype table and array constructors."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_wirec",
    "The wire format's fast frame decoder (see _wire.py; the Python path is the reference).",
    -1, methods,
};

PyMODINIT_FUNC PyInit__wirec(void) {
    reshape_name = PyUnicode_InternFromString("reshape");
    tuple_mark = PyObject_CallNoArgs((PyObject *)&PyBaseObject_Type);
    if (!reshape_name || !tuple_mark) return NULL;
    return PyModule_Create(&module);
}
