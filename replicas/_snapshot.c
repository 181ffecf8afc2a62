/* The replicas' snapshot loops in C (replicas/snapshot.py), each the same as the pure Python
 * function beside its dispatch there (`*_pure`: the definition and the fallback);
 * tests/test_speedups.py holds each pair equal. Kept in C: a save's and a load's Python per record
 * was most of their time (docs/replicas.md), and the checksum's BLAKE2b is hashed without the GIL.
 *
 *   records_sum     a snapshot's checksum share of many records: the sum mod 2^128 of each
 *                   record's BLAKE2b-128 (RFC 7693, unkeyed) of prefix + key + value, read as a
 *                   big-endian integer
 *   bucket_keys     the buckets a save's sorted dirty ids fall in
 *   merge_buckets   each dirty bucket's new value
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#include "../protocol/_blake2b.h"

static uint64_t get_u64(const unsigned char *p) {
    return (uint64_t)p[0] << 56 | (uint64_t)p[1] << 48 | (uint64_t)p[2] << 40 | (uint64_t)p[3] << 32 |
           (uint64_t)p[4] << 24 | (uint64_t)p[5] << 16 | (uint64_t)p[6] << 8 | p[7];
}

/* The records' bytes are found with the GIL held, then hashed without it: a snapshot thread's sums
 * (~4 ms for 22,000 books when a record was a book, profiling) run beside the thread that applies
 * instead of holding it up.
 * Each key and value is held meanwhile (whoever changes the sequence), and bytes do not change. */
static PyObject *records_sum(PyObject *self, PyObject *args) {
    Py_buffer prefix;
    PyObject *records;
    if (!PyArg_ParseTuple(args, "y*O", &prefix, &records)) return NULL;
    PyObject *seq = PySequence_Fast(records, "records must be a sequence of (key, value) pairs");
    if (seq == NULL) { PyBuffer_Release(&prefix); return NULL; }
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    PyObject **pair = PyMem_Malloc(2 * (size_t)(n ? n : 1) * sizeof(PyObject *));
    if (pair == NULL) { Py_DECREF(seq); PyBuffer_Release(&prefix); return PyErr_NoMemory(); }
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *r = PySequence_Fast_GET_ITEM(seq, i);
        if (!PyTuple_Check(r) || PyTuple_GET_SIZE(r) != 2 || !PyBytes_Check(PyTuple_GET_ITEM(r, 0))
                || !PyBytes_Check(PyTuple_GET_ITEM(r, 1))) {
            PyErr_SetString(PyExc_TypeError, "records must be (key, value) pairs of bytes");
            PyMem_Free(pair); Py_DECREF(seq); PyBuffer_Release(&prefix);
            return NULL;
        }
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *r = PySequence_Fast_GET_ITEM(seq, i);
        pair[2 * i] = Py_NewRef(PyTuple_GET_ITEM(r, 0));
        pair[2 * i + 1] = Py_NewRef(PyTuple_GET_ITEM(r, 1));
    }
    unsigned __int128 sum = 0;
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *key = pair[2 * i], *value = pair[2 * i + 1];
        const unsigned char *part[3] = {prefix.buf, (const unsigned char *)PyBytes_AS_STRING(key),
                                        (const unsigned char *)PyBytes_AS_STRING(value)};
        size_t len[3] = {(size_t)prefix.len, (size_t)PyBytes_GET_SIZE(key), (size_t)PyBytes_GET_SIZE(value)};
        unsigned char d[16];
        blake2b_parts(d, 16, 3, part, len);
        unsigned __int128 v = 0;
        for (int k = 0; k < 16; k++) v = v << 8 | d[k];
        sum += v;  /* wraps: mod 2^128 */
    }
    Py_END_ALLOW_THREADS
    for (Py_ssize_t i = 0; i < 2 * n; i++) Py_DECREF(pair[i]);
    PyMem_Free(pair);
    Py_DECREF(seq);
    PyBuffer_Release(&prefix);
    unsigned char be[16];
    for (int k = 15; k >= 0; k--) be[k] = (unsigned char)sum, sum >>= 8;
    return _PyLong_FromByteArray(be, 16, 0, 0);
}

static PyObject *be64_bytes(uint64_t v) {
    unsigned char b[8];
    for (int i = 7; i >= 0; i--, v >>= 8) b[i] = (unsigned char)v;
    return PyBytes_FromStringAndSize((const char *)b, 8);
}

/* bucket_keys(joined, shift): the keys of the buckets the sorted 8-byte big-endian ids end to end in
 * `joined` fall in (id >> shift, big-endian, each once, in order): what a save looks up in LMDB
 * (replicas/snapshot.py's bucket_keys_pure). */
static PyObject *bucket_keys(PyObject *self, PyObject *args) {
    Py_buffer joined;
    int shift;
    if (!PyArg_ParseTuple(args, "y*i", &joined, &shift)) return NULL;
    PyObject *out = NULL;
    if (joined.len % 8 || shift < 0 || shift > 63) {
        PyErr_SetString(PyExc_ValueError, "ids are not whole 8-byte keys, or the shift is not in 0..63");
        goto done;
    }
    if ((out = PyList_New(0)) == NULL) goto done;
    const unsigned char *k = joined.buf;
    for (Py_ssize_t i = 0, last = -1; i < joined.len / 8; i++) {
        uint64_t bucket = get_u64(k + 8 * i) >> shift;
        if (last >= 0 && bucket == get_u64(k + 8 * last) >> shift) continue;
        PyObject *key = be64_bytes(bucket);
        if (key == NULL || PyList_Append(out, key) < 0) {
            Py_XDECREF(key);
            Py_CLEAR(out);
            goto done;
        }
        Py_DECREF(key);
        last = i;
    }
done:
    PyBuffer_Release(&joined);
    return out;
}

/* One bucket's new value: its old pairs (sorted by id) with the dirty ids' new pairs in their place
 * and the dirty ids without one left out. `k`..`k_end`: the bucket's dirty ids; `p`, `p_end`: the
 * new pairs from the bucket's first (a subset of the dirty ids, sorted); advances `*p`. */
static PyObject *merged_bucket(const unsigned char *old, Py_ssize_t old_len, const unsigned char *k,
                               const unsigned char *k_end, const unsigned char **p, const unsigned char *p_end,
                               Py_ssize_t pair_size) {
    PyObject *value = PyBytes_FromStringAndSize(NULL, old_len + (k_end - k) / 8 * pair_size);
    if (value == NULL) return NULL;
    unsigned char *out = (unsigned char *)PyBytes_AS_STRING(value), *at = out;
    const unsigned char *o = old, *o_end = old + old_len;
    while (o < o_end || k < k_end) {
        uint64_t oid = o < o_end ? get_u64(o) : UINT64_MAX, kid = k < k_end ? get_u64(k) : UINT64_MAX;
        if (o < o_end && (k == k_end || oid < kid)) {  /* not dirty: kept as it was */
            memcpy(at, o, pair_size), at += pair_size, o += pair_size;
            continue;
        }
        if (o < o_end && oid == kid) o += pair_size;  /* replaced, or deleted */
        if (*p < p_end && get_u64(*p) == kid) memcpy(at, *p, pair_size), at += pair_size, *p += pair_size;
        k += 8;
    }
    if (_PyBytes_Resize(&value, at - out) < 0) return NULL;
    return value;
}

/* merge_buckets(joined, packed, old, shift, pair_size): each dirty bucket's (key, new value), in
 * order, the value empty where the bucket has no book left. `joined`: the dirty ids, sorted, 8-byte
 * big-endian keys end to end; `packed`: the (id, record) pairs of those with a book, pair_size bytes
 * each, sorted; `old`: the (bucket key, value) pairs LMDB holds for them, in order (getmulti's); a
 * value is pairs sorted by id (replicas/snapshot.py's merge_buckets_pure). */
static PyObject *merge_buckets(PyObject *self, PyObject *args) {
    Py_buffer joined, packed;
    PyObject *old;
    int shift;
    Py_ssize_t pair_size;
    if (!PyArg_ParseTuple(args, "y*y*Oin", &joined, &packed, &old, &shift, &pair_size)) return NULL;
    PyObject *seq = NULL, *out = NULL;
    if (joined.len % 8 || pair_size <= 8 || packed.len % pair_size || shift < 0 || shift > 63) {
        PyErr_SetString(PyExc_ValueError, "ids or pairs are not whole, or the shift is not in 0..63");
        goto done;
    }
    if ((seq = PySequence_Fast(old, "old must be a sequence of (key, value) pairs")) == NULL) goto done;
    if ((out = PyList_New(0)) == NULL) goto done;
    const unsigned char *k = joined.buf, *k_end = k + joined.len, *p = packed.buf, *p_end = p + packed.len;
    Py_ssize_t next_old = 0, n_old = PySequence_Fast_GET_SIZE(seq);
    while (k < k_end) {
        uint64_t bucket = get_u64(k) >> shift;
        const unsigned char *first = k;
        while (k < k_end && get_u64(k) >> shift == bucket) k += 8;
        const char *old_value = "";
        Py_ssize_t old_len = 0;
        if (next_old < n_old) {
            PyObject *pair = PySequence_Fast_GET_ITEM(seq, next_old);
            if (!PyTuple_Check(pair) || PyTuple_GET_SIZE(pair) != 2 || !PyBytes_Check(PyTuple_GET_ITEM(pair, 0))
                    || !PyBytes_Check(PyTuple_GET_ITEM(pair, 1)) || PyBytes_GET_SIZE(PyTuple_GET_ITEM(pair, 0)) != 8) {
                PyErr_SetString(PyExc_TypeError, "old must be (8-byte key, value) pairs of bytes");
                Py_CLEAR(out);
                goto done;
            }
            if (get_u64((const unsigned char *)PyBytes_AS_STRING(PyTuple_GET_ITEM(pair, 0))) == bucket) {
                old_value = PyBytes_AS_STRING(PyTuple_GET_ITEM(pair, 1));
                old_len = PyBytes_GET_SIZE(PyTuple_GET_ITEM(pair, 1));
                next_old++;
                if (old_len % pair_size) {
                    PyErr_SetString(PyExc_ValueError, "a bucket on disk is not whole pairs");
                    Py_CLEAR(out);
                    goto done;
                }
            }
        }
        PyObject *key = be64_bytes(bucket);
        PyObject *value = key ? merged_bucket((const unsigned char *)old_value, old_len, first, k, &p, p_end,
                                              pair_size) : NULL;
        PyObject *item = value ? PyTuple_Pack(2, key, value) : NULL;
        Py_XDECREF(key);
        Py_XDECREF(value);
        if (item == NULL || PyList_Append(out, item) < 0) {
            Py_XDECREF(item);
            Py_CLEAR(out);
            goto done;
        }
        Py_DECREF(item);
    }
    if (p != p_end || next_old != n_old) {
        PyErr_SetString(PyExc_ValueError, "pairs or old buckets that no dirty id names");
        Py_CLEAR(out);
    }
done:
    Py_XDECREF(seq);
    PyBuffer_Release(&joined);
    PyBuffer_Release(&packed);
    return out;
}

static PyMethodDef methods[] = {
    {"bucket_keys", bucket_keys, METH_VARARGS,
     "bucket_keys(joined, shift): the buckets sorted 8-byte ids fall in (replicas/snapshot.py)."},
    {"merge_buckets", merge_buckets, METH_VARARGS,
     "merge_buckets(joined, packed, old, shift, pair_size): each dirty bucket's new value (replicas/snapshot.py)."},
    {"records_sum", records_sum, METH_VARARGS,
     "Sum mod 2^128 of BLAKE2b-128(prefix + key + value) of each record (replicas/snapshot.py)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_snapshot",
                                    "The replicas' snapshot loops in C (each beside its pure Python definition).",
                                    -1, methods};

PyMODINIT_FUNC PyInit__snapshot(void) { return PyModule_Create(&module); }
