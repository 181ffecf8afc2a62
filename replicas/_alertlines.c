/* Kept in C: 0.8 us an alert against 1.8-2.5 for the Python and 5.2 for orjson of its dict
 * (building the dict is the cost, not the JSON).
 *
 * An alert's JSON line in C (replicas/sinks.py): `alert_lines_pure` there is the
 * definition and the fallback; tests/test_emitter.py holds the two equal, and each
 * equal to json.dumps of the alert as a dict.
 *
 *   alert_lines(joined, prefix, prefix_json, line_type)
 *       the AlertLine (alert_id, line) of each 88-byte alert record of `joined`
 *       (replicas/audit_core.py's ALERT_RECORD, end to end): alert_id = prefix + the
 *       purchase seq in decimal; `prefix_json` is json's escaping of `prefix`
 *       (both ASCII); client and stock decoded as ASCII with U+FFFD for any
 *       other byte, trailing whitespace stripped (str.rstrip), and escaped as
 *       json's encode_basestring_ascii escapes them.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>

#define ALERT_SIZE 88
#define CLIENT_AT 40
#define CLIENT_SIZE 16
#define STOCK_AT 56
#define STOCK_SIZE 8
#define LINE_ROOM 640 /* a line's bytes beyond its prefix: keys, seven numbers, client and stock escaped */

static uint64_t be64(const unsigned char *p) {
    uint64_t v = 0;
    for (int i = 0; i < 8; i++)
        v = (v << 8) | p[i];
    return v;
}

static int python_space(unsigned char c) { /* str.isspace() of an ASCII character */
    return c == ' ' || (c >= 0x09 && c <= 0x0d) || (c >= 0x1c && c <= 0x1f);
}

/* The field's JSON string (quotes included) at `o`; returns the end. */
static char *put_field(char *o, const unsigned char *field, Py_ssize_t n) {
    static const char hex[] = "0123456789abcdef";
    while (n > 0 && python_space(field[n - 1])) /* (a byte above 127 is U+FFFD: not space) */
        n--;
    *o++ = '"';
    for (Py_ssize_t i = 0; i < n; i++) {
        unsigned char c = field[i];
        if (c >= 0x80) { /* decoded as U+FFFD, which json escapes */
            memcpy(o, "\\ufffd", 6);
            o += 6;
        } else if (c == '"' || c == '\\') {
            *o++ = '\\';
            *o++ = (char)c;
        } else if (c >= 0x20 && c <= 0x7e) {
            *o++ = (char)c;
        } else {
            *o++ = '\\';
            switch (c) {
            case '\b': *o++ = 'b'; break;
            case '\f': *o++ = 'f'; break;
            case '\n': *o++ = 'n'; break;
            case '\r': *o++ = 'r'; break;
            case '\t': *o++ = 't'; break;
            default:
                memcpy(o, "u00", 3);
                o[3] = hex[c >> 4];
                o[4] = hex[c & 15];
                o += 5;
            }
        }
    }
    *o++ = '"';
    return o;
}

static PyObject *ascii_str(const char *s, Py_ssize_t n) {
    PyObject *out = PyUnicode_New(n, 127);
    if (out != NULL)
        memcpy(PyUnicode_1BYTE_DATA(out), s, (size_t)n);
    return out;
}

static PyObject *alert_lines(PyObject *self, PyObject *args) {
    Py_buffer joined;
    const char *prefix, *prefix_json;
    Py_ssize_t prefix_len, prefix_json_len;
    PyTypeObject *line_type;
    if (!PyArg_ParseTuple(args, "y*s#s#O!", &joined, &prefix, &prefix_len, &prefix_json, &prefix_json_len,
                          &PyType_Type, &line_type))
        return NULL;
    PyObject *out = NULL;
    char *line = NULL, *id = NULL;
    if (joined.len % ALERT_SIZE) {
        PyErr_SetString(PyExc_ValueError, "alert records are not whole");
        goto done;
    }
    /* An AlertLine is a tuple of two, made as tuple.__new__ makes one of a subclass. */
    if (!PyType_IsSubtype(line_type, &PyTuple_Type) || line_type->tp_basicsize != PyTuple_Type.tp_basicsize) {
        PyErr_SetString(PyExc_TypeError, "line_type must be a tuple subclass without fields of its own");
        goto done;
    }
    line = PyMem_Malloc((size_t)prefix_json_len + LINE_ROOM);
    id = PyMem_Malloc((size_t)prefix_len + 24);
    if (line == NULL || id == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    memcpy(id, prefix, (size_t)prefix_len);
    Py_ssize_t n = joined.len / ALERT_SIZE;
    out = PyList_New(n);
    if (out == NULL)
        goto done;
    const unsigned char *r = joined.buf;
    for (Py_ssize_t i = 0; i < n; i++, r += ALERT_SIZE) {
        unsigned long long emit = be64(r), pseq = be64(r + 8), pid = be64(r + 16), oid = be64(r + 24);
        long long requested = (long long)be64(r + 32), cumulative = (long long)be64(r + 64),
                  stamp = (long long)be64(r + 72);
        int digits = snprintf(id + prefix_len, 24, "%llu", pseq);
        char *o = line;
        o += sprintf(o, "{\"alert_id\":\"");
        memcpy(o, prefix_json, (size_t)prefix_json_len);
        o += prefix_json_len;
        o += sprintf(o, "%llu\",\"emit_seq\":%llu,\"purchase_seq\":%llu,\"purchase_id\":%llu,\"order_id\":%llu,"
                        "\"client\":", pseq, emit, pseq, pid, oid);
        o = put_field(o, r + CLIENT_AT, CLIENT_SIZE);
        o += sprintf(o, ",\"stock\":");
        o = put_field(o, r + STOCK_AT, STOCK_SIZE);
        o += sprintf(o, ",\"requested\":%lld,\"cumulative\":%lld,\"stamp_ns\":%lld}", requested, cumulative, stamp);
        PyObject *item = line_type->tp_alloc(line_type, 2);
        PyObject *alert_id = ascii_str(id, prefix_len + digits);
        PyObject *text = ascii_str(line, o - line);
        if (item == NULL || alert_id == NULL || text == NULL) {
            Py_XDECREF(item);
            Py_XDECREF(alert_id);
            Py_XDECREF(text);
            Py_CLEAR(out);
            goto done;
        }
        PyTuple_SET_ITEM(item, 0, alert_id);
        PyTuple_SET_ITEM(item, 1, text);
        PyList_SET_ITEM(out, i, item);
    }
done:
    PyMem_Free(line);
    PyMem_Free(id);
    PyBuffer_Release(&joined);
    return out;
}

static PyMethodDef methods[] = {
    {"alert_lines", alert_lines, METH_VARARGS,
     "alert_lines(joined, prefix, prefix_json, line_type): each alert record's (alert_id, JSON line) "
     "(replicas/sinks.py's alert_lines_pure)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_alertlines",
                                    "Alert records as the sinks' JSON lines, in C (beside the pure definition).",
                                    -1, methods};

PyMODINIT_FUNC PyInit__alertlines(void) { return PyModule_Create(&module); }
