/* The journal's record encoding in C: the same bytes as
 * protocol/journal.py's encode_records_pure, without a Python call per
 * record (the pure function spends ~0.36 us a record on four calls and two
 * concatenations; a voter writes every message it replicates).
 *
 * Record: CRC-32 u32 | length u32 | seq u64 | term u64 | message, big-endian,
 * the CRC (CRC-32/IEEE, as zlib.crc32) over everything after it, computed
 * slicing-by-8 (39 ns for a 95-byte record where this host's zlib takes 104).
 * docs/journal-format.md is the definition; tests/test_speedups.py holds the
 * two functions equal.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#define RECORD_HEADER 24
#define MAX_MESSAGE 0xFFFF

static uint32_t crc_table[8][256];

static void crc_init(void) {
    for (uint32_t i = 0; i < 256; i++) {
        uint32_t c = i;
        for (int k = 0; k < 8; k++) c = c & 1 ? 0xEDB88320u ^ (c >> 1) : c >> 1;
        crc_table[0][i] = c;
    }
    for (int i = 0; i < 256; i++)
        for (int t = 1; t < 8; t++) crc_table[t][i] = (crc_table[t - 1][i] >> 8) ^ crc_table[0][crc_table[t - 1][i] & 0xff];
}

static uint32_t crc32_ieee(const unsigned char *p, size_t n) {
    uint32_t c = 0xFFFFFFFFu;
    for (; n >= 8; p += 8, n -= 8) {  /* eight bytes a step; the table is little-endian */
        uint32_t a = (p[0] | p[1] << 8 | p[2] << 16 | (uint32_t)p[3] << 24) ^ c;
        uint32_t b = p[4] | p[5] << 8 | p[6] << 16 | (uint32_t)p[7] << 24;
        c = crc_table[7][a & 0xff] ^ crc_table[6][(a >> 8) & 0xff] ^ crc_table[5][(a >> 16) & 0xff] ^
            crc_table[4][a >> 24] ^ crc_table[3][b & 0xff] ^ crc_table[2][(b >> 8) & 0xff] ^
            crc_table[1][(b >> 16) & 0xff] ^ crc_table[0][b >> 24];
    }
    while (n--) c = crc_table[0][(c ^ *p++) & 0xff] ^ (c >> 8);
    return c ^ 0xFFFFFFFFu;
}

static void put_u32(unsigned char *p, uint32_t v) {
    p[0] = v >> 24; p[1] = v >> 16; p[2] = v >> 8; p[3] = v;
}

static void put_u64(unsigned char *p, uint64_t v) {
    put_u32(p, (uint32_t)(v >> 32));
    put_u32(p + 4, (uint32_t)v);
}

/* One (seq, term, message) item, a tuple or a list, with the message as bytes:
 * its fields, or -1 with an exception set (anything else takes the pure path). */
static int unpack_record(PyObject *item, uint64_t *seq, uint64_t *term, const char **msg, Py_ssize_t *len) {
    PyObject *fields[3];
    if (PyTuple_Check(item) && PyTuple_GET_SIZE(item) == 3) {
        fields[0] = PyTuple_GET_ITEM(item, 0); fields[1] = PyTuple_GET_ITEM(item, 1); fields[2] = PyTuple_GET_ITEM(item, 2);
    } else if (PyList_Check(item) && PyList_GET_SIZE(item) == 3) {
        fields[0] = PyList_GET_ITEM(item, 0); fields[1] = PyList_GET_ITEM(item, 1); fields[2] = PyList_GET_ITEM(item, 2);
    } else {
        PyErr_SetString(PyExc_TypeError, "a record is a (seq, term, message) tuple");
        return -1;
    }
    *seq = PyLong_AsUnsignedLongLong(fields[0]);
    if (*seq == (uint64_t)-1 && PyErr_Occurred()) return -1;
    *term = PyLong_AsUnsignedLongLong(fields[1]);
    if (*term == (uint64_t)-1 && PyErr_Occurred()) return -1;
    if (!PyBytes_Check(fields[2])) {
        PyErr_SetString(PyExc_TypeError, "a record's message is bytes");
        return -1;
    }
    *len = PyBytes_GET_SIZE(fields[2]);
    if (*len > MAX_MESSAGE) {
        PyErr_Format(PyExc_ValueError, "message of %zd bytes exceeds %d", *len, MAX_MESSAGE);
        return -1;
    }
    *msg = PyBytes_AS_STRING(fields[2]);
    return 0;
}

static PyObject *encode_records(PyObject *self, PyObject *arg) {
    PyObject *seq_of = PySequence_Fast(arg, "records must be a sequence of (seq, term, message)");
    if (seq_of == NULL) return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq_of);
    PyObject **items = PySequence_Fast_ITEMS(seq_of);
    Py_ssize_t total = 0;
    for (Py_ssize_t i = 0; i < n; i++) {  /* first pass: check every record and size the output */
        uint64_t s, t;
        const char *m;
        Py_ssize_t len;
        if (unpack_record(items[i], &s, &t, &m, &len) < 0) goto fail;
        total += RECORD_HEADER + len;
    }
    PyObject *out = PyBytes_FromStringAndSize(NULL, total);
    if (out == NULL) goto fail;
    unsigned char *p = (unsigned char *)PyBytes_AS_STRING(out);
    for (Py_ssize_t i = 0; i < n; i++) {
        uint64_t s, t;
        const char *m;
        Py_ssize_t len;
        unpack_record(items[i], &s, &t, &m, &len);  /* checked above */
        put_u32(p + 4, (uint32_t)len);
        put_u64(p + 8, s);
        put_u64(p + 16, t);
        memcpy(p + RECORD_HEADER, m, (size_t)len);
        put_u32(p, crc32_ieee(p + 4, (size_t)(RECORD_HEADER - 4 + len)));
        p += RECORD_HEADER + len;
    }
    Py_DECREF(seq_of);
    return out;
fail:
    Py_DECREF(seq_of);
    return NULL;
}

static PyMethodDef methods[] = {
    {"encode_records", encode_records, METH_O,
     "Many (seq, term, message) records as one contiguous buffer (docs/journal-format.md)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_speedups",
                                    "Hot loops of the journal format in C (pure fallbacks in protocol/journal.py).",
                                    -1, methods};

PyMODINIT_FUNC PyInit__speedups(void) {
    crc_init();
    return PyModule_Create(&module);
}
