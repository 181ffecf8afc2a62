/* Kept in C: no library does these per message without a Python object per record, and the
 * CRC-32 here is 19.5 ns a 95-byte record where this host's zlib (1.2.13) takes 115.
 *
 * Per-message loops in C (the voters' and the listeners'),
 * each the same as a pure Python function that stays beside its dispatch as
 * the definition and fallback (docs/decisions.md); tests/test_speedups.py
 * holds each pair equal.
 *
 *   encode_records     journal records (protocol/journal.py): CRC-32 u32 |
 *                      length u32 | seq u64 | term u64 | message, big-endian,
 *                      the CRC (CRC-32/IEEE, as zlib.crc32) over everything
 *                      after it: folded by carry-less multiplication where
 *                      the processor has PCLMULQDQ, else slicing-by-8 (39 ns
 *                      for a 95-byte record where this host's zlib takes 104)
 *   crc32              that CRC of any bytes, either way (for the tests)
 *   record_offsets     where some of those records start in their buffer (the
 *                      journal's sparse index)
 *   scan_good          the records of such a buffer up to the first one the
 *                      journal's scan refuses (protocol/journal.py)
 *   encode_run         the same records of a run (consecutive seqs, one term,
 *                      messages of one size back to back), with no Python
 *                      object per record
 *   client_seq_maxima  the highest client seq of each origin in a run of
 *                      sequenced messages (protocol/messages.py)
 *   stamp_blocks       a client batch's messages stamped, read straight from
 *                      its blocks (messages.py)
 *   frames             a link's complete frames (framing.py)
 *   header             a MoldUDP64 packet's header, once its checks pass
 *                      (moldudp64.py)
 *   inbound_rejects    a client batch's blocks checked and what the ingress
 *                      checks reject (messages.py)
 *   verify_sealed      a stream packet's seal checked, its keyed tag
 *                      recomputed: BLAKE2b here, BLAKE3 by the tagger
 *                      set_blake3_tagger registers (protocol/streamauth.py)
 *   good_stream_packet every check a listener makes of a data packet, in one
 *                      call, for the packets that pass them all (the Python
 *                      checks beside it name what is wrong with the others:
 *                      protocol/listener.py)
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <limits.h>
#include <stdint.h>
#include <string.h>
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>
#define HAVE_FOLDED_CRC 1
#endif

#define RECORD_HEADER 24
#define MAX_MESSAGE 0xFFFF

static uint32_t crc_table[8][256];

static int crc_folds;  /* the processor multiplies without carries (PCLMULQDQ and SSE4.1) */

static void crc_init(void) {
#ifdef HAVE_FOLDED_CRC
    __builtin_cpu_init();
    crc_folds = __builtin_cpu_supports("pclmul") && __builtin_cpu_supports("sse4.1");
#endif
    for (uint32_t i = 0; i < 256; i++) {
        uint32_t c = i;
        for (int k = 0; k < 8; k++) c = c & 1 ? 0xEDB88320u ^ (c >> 1) : c >> 1;
        crc_table[0][i] = c;
    }
    for (int i = 0; i < 256; i++)
        for (int t = 1; t < 8; t++) crc_table[t][i] = (crc_table[t - 1][i] >> 8) ^ crc_table[0][crc_table[t - 1][i] & 0xff];
}

/* The CRC register after `n` more bytes from `c`, eight bytes a step. */
static uint32_t crc32_sliced(uint32_t c, const unsigned char *p, size_t n) {
    for (; n >= 8; p += 8, n -= 8) {  /* eight bytes a step; the table is little-endian */
        uint32_t a = (p[0] | p[1] << 8 | p[2] << 16 | (uint32_t)p[3] << 24) ^ c;
        uint32_t b = p[4] | p[5] << 8 | p[6] << 16 | (uint32_t)p[7] << 24;
        c = crc_table[7][a & 0xff] ^ crc_table[6][(a >> 8) & 0xff] ^ crc_table[5][(a >> 16) & 0xff] ^
            crc_table[4][a >> 24] ^ crc_table[3][b & 0xff] ^ crc_table[2][(b >> 8) & 0xff] ^
            crc_table[1][(b >> 16) & 0xff] ^ crc_table[0][b >> 24];
    }
    while (n--) c = crc_table[0][(c ^ *p++) & 0xff] ^ (c >> 8);
    return c;
}

#ifdef HAVE_FOLDED_CRC
/* CRC-32 by carry-less multiplication (Intel's "Fast CRC Computation for Generic Polynomials Using
 * PCLMULQDQ", bit-reflected, with the constants of Linux's and zlib-ng's CRC-32): each 16-byte
 * block folded into the next, a tail of r bytes by the last block's first r bytes folded into the
 * 16 bytes that end the data, and the last 128 bits reduced to 32. With four records summed side
 * by side (crc32_folded_x4) a journal record's sum, 95 bytes, went from 61 to 19.5 ns (the tail
 * sliced, one record at a time, before: docs/performance.md). */
#define FOLDED __attribute__((target("pclmul,sse4.1"), always_inline)) static inline
#define K3K4 _mm_set_epi64x(0x0ccaa009e, 0x1751997d0)  /* x^(128-32), x^(128+32) mod P: one fold */

/* pshufb masks: loaded at SHIFT_BYTES + 16 + s they move a vector's bytes s places down (byte i
 * takes byte i + s), at SHIFT_BYTES + 16 - s s places up; a byte from outside reads as zero. */
static const signed char SHIFT_BYTES[48] = {
    -128, -128, -128, -128, -128, -128, -128, -128, -128, -128, -128, -128, -128, -128, -128, -128,
    0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15,
    -128, -128, -128, -128, -128, -128, -128, -128, -128, -128, -128, -128, -128, -128, -128, -128};

/* x (the register over the data up to `at`) folded 128 bits on, into the 16 bytes at `at`. */
FOLDED __m128i fold_into(__m128i x, const unsigned char *at) {
    const __m128i k3k4 = K3K4;
    return _mm_xor_si128(_mm_xor_si128(_mm_loadu_si128((const __m128i *)at), _mm_clmulepi64_si128(x, k3k4, 0x00)),
                         _mm_clmulepi64_si128(x, k3k4, 0x11));
}

/* x (up to `end` - r, at least 16 bytes in) taken on over the r (1 to 15) bytes before `end`. */
FOLDED __m128i fold_tail(__m128i x, const unsigned char *end, size_t r) {
    const __m128i k3k4 = K3K4;
    __m128i up = _mm_loadu_si128((const __m128i *)(SHIFT_BYTES + r));  /* byte i takes byte i - (16 - r) */
    __m128i spill = _mm_shuffle_epi8(x, up);  /* x's first r bytes, a block before the last */
    __m128i kept = _mm_shuffle_epi8(x, _mm_loadu_si128((const __m128i *)(SHIFT_BYTES + 16 + r)));
    __m128i last = _mm_blendv_epi8(_mm_loadu_si128((const __m128i *)(end - 16)), kept, up);
    return _mm_xor_si128(_mm_xor_si128(last, _mm_clmulepi64_si128(spill, k3k4, 0x00)),
                         _mm_clmulepi64_si128(spill, k3k4, 0x11));
}

/* The CRC register that the 128 bits of x leave. */
FOLDED uint32_t reduce(__m128i x) {
    const __m128i k3k4 = K3K4;
    const __m128i k5 = _mm_set_epi64x(0, 0x163cd6124);               /* x^64 mod P */
    const __m128i pu = _mm_set_epi64x(0x1f7011641, 0x1db710641);     /* Barrett's u', P' */
    const __m128i low32 = _mm_set_epi32(0, 0, 0, -1);
    x = _mm_xor_si128(_mm_clmulepi64_si128(x, k3k4, 0x10), _mm_srli_si128(x, 8));               /* 128 -> 96 */
    x = _mm_xor_si128(_mm_clmulepi64_si128(_mm_and_si128(x, low32), k5, 0x00), _mm_srli_si128(x, 4)); /* -> 64 */
    __m128i t1 = _mm_clmulepi64_si128(_mm_and_si128(x, low32), pu, 0x10);
    __m128i t2 = _mm_clmulepi64_si128(_mm_and_si128(t1, low32), pu, 0x00);
    return (uint32_t)_mm_extract_epi32(_mm_xor_si128(x, t2), 1);
}

/* The CRC register after p[0:n] (n >= 16) from `c`. */
__attribute__((target("pclmul,sse4.1")))
static uint32_t crc32_folded(uint32_t c, const unsigned char *p, size_t n) {
    __m128i x = _mm_xor_si128(_mm_loadu_si128((const __m128i *)p), _mm_cvtsi32_si128((int)c));
    size_t at = 16;
    for (; n - at >= 16; at += 16) x = fold_into(x, p + at);
    if (n > at) x = fold_tail(x, p + n, n - at);
    return reduce(x);
}

/* crc32_folded(0xFFFFFFFF, ...) ^ 0xFFFFFFFF of four runs of n bytes (n >= 16) `stride` apart,
 * side by side: a fold waits ~7 cycles for the multiplication before it, so four independent
 * runs take little longer than one (a journal's records: encode_run). */
__attribute__((target("pclmul,sse4.1")))
static void crc32_folded_x4(const unsigned char *p, size_t stride, size_t n, uint32_t out[4]) {
    __m128i x[4];
    size_t at = 16;
    for (int l = 0; l < 4; l++) x[l] = _mm_xor_si128(_mm_loadu_si128((const __m128i *)(p + l * stride)),
                                                     _mm_cvtsi32_si128(-1));
    for (; n - at >= 16; at += 16)
        for (int l = 0; l < 4; l++) x[l] = fold_into(x[l], p + l * stride + at);
    if (n > at)
        for (int l = 0; l < 4; l++) x[l] = fold_tail(x[l], p + l * stride + n, n - at);
    for (int l = 0; l < 4; l++) out[l] = ~reduce(x[l]);
}
#endif

static uint32_t crc32_with(const unsigned char *p, size_t n, int folded) {
#ifdef HAVE_FOLDED_CRC
    if (folded && n >= 16)
        return crc32_folded(0xFFFFFFFFu, p, n) ^ 0xFFFFFFFFu;
#else
    (void)folded;
#endif
    return crc32_sliced(0xFFFFFFFFu, p, n) ^ 0xFFFFFFFFu;
}

/* CRC-32/IEEE, as zlib.crc32. */
static uint32_t crc32_ieee(const unsigned char *p, size_t n) {
    return crc32_with(p, n, crc_folds);
}

/* crc32(data, folded): the CRC of `data` by the folded path (where the processor has it) or
 * the sliced one: tests hold both to zlib's. */
static PyObject *crc32_either(PyObject *self, PyObject *args) {
    Py_buffer data;
    int folded;
    if (!PyArg_ParseTuple(args, "y*p:crc32", &data, &folded)) return NULL;
    uint32_t c = crc32_with(data.buf, (size_t)data.len, folded && crc_folds);
    PyBuffer_Release(&data);
    return PyLong_FromUnsignedLong(c);
}

static void put_u32(unsigned char *p, uint32_t v) {
    p[0] = v >> 24; p[1] = v >> 16; p[2] = v >> 8; p[3] = v;
}

static void put_u64(unsigned char *p, uint64_t v) {
    put_u32(p, (uint32_t)(v >> 32));
    put_u32(p + 4, (uint32_t)v);
}

/* One (seq, term, message) item, a tuple or a list, with the message as bytes:
 * its fields, or -1 with the exception the caller raises. */
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

/* encode_run(first_seq, term, messages, size): encode_records of the records (first_seq + i, term,
 * message i), message i being messages[i * size:(i + 1) * size]. */
static PyObject *encode_run(PyObject *self, PyObject *args) {
    unsigned long long first, term;
    Py_buffer blob;
    Py_ssize_t size;
    if (!PyArg_ParseTuple(args, "KKy*n:encode_run", &first, &term, &blob, &size)) return NULL;
    PyObject *out = NULL;
    if (size < 1 || size > MAX_MESSAGE || blob.len % size != 0) {
        PyErr_Format(PyExc_ValueError, "encode_run: %zd bytes are not whole messages of %zd", blob.len, size);
        goto done;
    }
    Py_ssize_t n = blob.len / size;
    out = PyBytes_FromStringAndSize(NULL, n * (RECORD_HEADER + size));
    if (out == NULL) goto done;
    unsigned char *p = (unsigned char *)PyBytes_AS_STRING(out);
    const char *m = blob.buf;
    const size_t step = RECORD_HEADER + (size_t)size;
    for (Py_ssize_t i = 0; i < n; i++, m += size) {
        unsigned char *r = p + i * step;
        put_u32(r + 4, (uint32_t)size);
        put_u64(r + 8, first + (uint64_t)i);
        put_u64(r + 16, term);
        memcpy(r + RECORD_HEADER, m, (size_t)size);
    }
    Py_ssize_t i = 0;
#ifdef HAVE_FOLDED_CRC
    if (crc_folds)  /* four records' sums at a time */
        for (uint32_t crcs[4]; i + 4 <= n; i += 4) {
            crc32_folded_x4(p + i * step + 4, step, step - 4, crcs);
            for (int l = 0; l < 4; l++) put_u32(p + (i + l) * step, crcs[l]);
        }
#endif
    for (; i < n; i++)
        put_u32(p + i * step, crc32_ieee(p + i * step + 4, step - 4));
done:
    PyBuffer_Release(&blob);
    return out;
}

/* record_offsets(records, start, every) -> the offset in encode_records(records) of records start,
 * start + every, ... (the journal's sparse index: summed here, not by a Python iterator per record). */
static PyObject *record_offsets(PyObject *self, PyObject *args) {
    PyObject *records;
    Py_ssize_t start, every;
    if (!PyArg_ParseTuple(args, "Onn:record_offsets", &records, &start, &every)) return NULL;
    if (start < 0 || every < 1) {
        PyErr_SetString(PyExc_ValueError, "record_offsets needs start >= 0 and every >= 1");
        return NULL;
    }
    PyObject *seq_of = PySequence_Fast(records, "records must be a sequence of (seq, term, message)");
    PyObject *out = seq_of == NULL ? NULL : PyList_New(0);
    Py_ssize_t n = seq_of == NULL ? 0 : PySequence_Fast_GET_SIZE(seq_of), at = 0;
    for (Py_ssize_t i = 0; out != NULL && i < n; i++) {
        uint64_t s, t;
        const char *m;
        Py_ssize_t len;
        if (unpack_record(PySequence_Fast_ITEMS(seq_of)[i], &s, &t, &m, &len) < 0) {
            Py_CLEAR(out);
            break;
        }
        if (i >= start && (i - start) % every == 0) {
            PyObject *offset = PyLong_FromSsize_t(at);
            if (offset == NULL || PyList_Append(out, offset) < 0) Py_CLEAR(out);
            Py_XDECREF(offset);
        }
        at += RECORD_HEADER + len;
    }
    Py_XDECREF(seq_of);
    return out;
}

static uint32_t get_u32(const unsigned char *p) {
    return (uint32_t)p[0] << 24 | (uint32_t)p[1] << 16 | (uint32_t)p[2] << 8 | p[3];
}

static uint64_t get_u64(const unsigned char *p) {
    return (uint64_t)p[0] << 56 | (uint64_t)p[1] << 48 | (uint64_t)p[2] << 40 | (uint64_t)p[3] << 32 |
           (uint64_t)p[4] << 24 | (uint64_t)p[5] << 16 | (uint64_t)p[6] << 8 | p[7];
}

/* One journal record (seq, term, message, offset) as scan reads it; NULL on error. */
static PyObject *record_tuple(const unsigned char *p, Py_ssize_t pos, uint32_t length) {
    PyObject *rec = PyTuple_New(4);
    if (rec == NULL) return NULL;
    PyObject *items[4] = {PyLong_FromUnsignedLongLong(get_u64(p + pos + 8)),
                          PyLong_FromUnsignedLongLong(get_u64(p + pos + 16)),
                          PyBytes_FromStringAndSize((const char *)p + pos + RECORD_HEADER, length),
                          PyLong_FromSsize_t(pos)};
    if (items[0] == NULL || items[1] == NULL || items[2] == NULL || items[3] == NULL) {
        for (int i = 0; i < 4; i++) Py_XDECREF(items[i]);
        Py_DECREF(rec);  /* still empty: it owns none of them */
        return NULL;
    }
    for (int i = 0; i < 4; i++) PyTuple_SET_ITEM(rec, i, items[i]);
    return rec;
}

/* scan_good(data, pos, expect_seq, limit) -> (records, pos): the records protocol/journal.py's
 * scan_pure reads from `pos`, up to the first one it would refuse (incomplete, too long, a CRC
 * that does not match, a seq not `expect_seq`'s successor; expect_seq -1: any first seq) or
 * `limit` of them (-1: no limit), and the offset it stopped at. scan_pure goes on from there and
 * says why it stopped: it stays the definition of every refusal. */
static PyObject *scan_good(PyObject *self, PyObject *args) {
    Py_buffer data;
    Py_ssize_t pos, limit;
    long long expect;
    if (!PyArg_ParseTuple(args, "y*nLn:scan_good", &data, &pos, &expect, &limit)) return NULL;
    const unsigned char *p = data.buf;
    PyObject *out = PyList_New(0);
    while (out != NULL && pos >= 0 && data.len - pos >= RECORD_HEADER && (limit < 0 || PyList_GET_SIZE(out) < limit)) {
        uint32_t crc = get_u32(p + pos), length = get_u32(p + pos + 4);
        uint64_t seq = get_u64(p + pos + 8);
        if (length > MAX_MESSAGE || data.len - pos - RECORD_HEADER < (Py_ssize_t)length) break;
        if (crc32_ieee(p + pos + 4, RECORD_HEADER - 4 + (size_t)length) != crc) break;
        if ((expect >= 0 && seq != (uint64_t)expect) || seq >= (uint64_t)LLONG_MAX) break;
        PyObject *rec = record_tuple(p, pos, length);
        if (rec == NULL || PyList_Append(out, rec) < 0) Py_CLEAR(out);
        Py_XDECREF(rec);
        pos += RECORD_HEADER + (Py_ssize_t)length;
        expect = (long long)seq + 1;
    }
    PyBuffer_Release(&data);
    if (out == NULL) return NULL;
    PyObject *at = PyLong_FromSsize_t(pos), *res = at ? PyTuple_Pack(2, out, at) : NULL;
    Py_DECREF(out);
    Py_XDECREF(at);
    return res;
}

/* Merge one origin's highest client seq into `out` ({origin bytes: int}), as
 * `if cseq > out.get(origin, 0): out[origin] = cseq`. 0 or -1 on error. */
static int merge_max(PyObject *out, const unsigned char *origin, Py_ssize_t origin_len, uint64_t cseq) {
    PyObject *key = PyBytes_FromStringAndSize((const char *)origin, origin_len);
    if (key == NULL) return -1;
    PyObject *old = PyDict_GetItemWithError(out, key);
    int rc = 0;
    if (old == NULL && PyErr_Occurred()) rc = -1;
    else if (old == NULL || PyLong_AsUnsignedLongLong(old) < cseq) {
        PyObject *value = PyLong_FromUnsignedLongLong(cseq);
        rc = value == NULL ? -1 : PyDict_SetItem(out, key, value);
        Py_XDECREF(value);
    }
    Py_DECREF(key);
    return rc;
}

/* client_seq_maxima(blob, stride, type_at, origin_at, origin_len, cseq_at, types): see
 * protocol/messages.py's client_seq_maxima_pure, the definition. A run of one
 * origin's messages (the usual: a client's batch) costs one dict lookup. */
static PyObject *client_seq_maxima(PyObject *self, PyObject *args) {
    Py_buffer blob, types;
    Py_ssize_t size, type_at, origin_at, origin_len, cseq_at;
    if (!PyArg_ParseTuple(args, "y*nnnnny*", &blob, &size, &type_at, &origin_at, &origin_len, &cseq_at, &types))
        return NULL;
    PyObject *out = NULL;
    if (size <= 0 || type_at < 0 || type_at >= size || origin_at < 0 || cseq_at < 0 || origin_len < 0 ||
        origin_at + origin_len > size || cseq_at + 8 > size || blob.len % size) {
        PyErr_SetString(PyExc_ValueError, "the blob is not whole messages of that layout");
        goto done;
    }
    out = PyDict_New();
    if (out == NULL) goto done;
    const unsigned char *p = blob.buf, *end = p + blob.len, *run_origin = NULL;
    uint64_t run_max = 0;
    for (; p < end; p += size) {
        if (memchr(types.buf, p[type_at], (size_t)types.len) == NULL) continue;
        uint64_t cseq = get_u64(p + cseq_at);
        if (run_origin != NULL && memcmp(run_origin, p + origin_at, (size_t)origin_len) == 0) {
            if (cseq > run_max) run_max = cseq;
            continue;
        }
        if (run_origin != NULL && run_max > 0 && merge_max(out, run_origin, origin_len, run_max) < 0) goto fail;
        run_origin = p + origin_at;
        run_max = cseq;
    }
    if (run_origin != NULL && run_max > 0 && merge_max(out, run_origin, origin_len, run_max) < 0) goto fail;
    goto done;
fail:
    Py_CLEAR(out);
done:
    PyBuffer_Release(&blob);
    PyBuffer_Release(&types);
    return out;
}

/* stamp_blocks(data, first, stride, size, count, head, first_cseq): the `count` messages of `size`
 * bytes that start `first` bytes into `data`, `stride` apart (a client batch's blocks), each + head
 * (stamp, origin) + its client seq, big-endian; protocol/messages.py's stamp_blocks_pure is the
 * definition. */
static PyObject *stamp_blocks(PyObject *self, PyObject *args) {
    Py_buffer data, head;
    Py_ssize_t first, stride, size, count;
    PyObject *first_cseq, *out = NULL;
    if (!PyArg_ParseTuple(args, "y*nnnny*O", &data, &first, &stride, &size, &count, &head, &first_cseq)) return NULL;
    unsigned long long cseq = PyLong_AsUnsignedLongLong(first_cseq);
    if (cseq == (unsigned long long)-1 && PyErr_Occurred()) goto done;
    if (count < 0 || first < 0 || size < 0 || stride < size || (count > 0 && first + (count - 1) * stride + size > data.len)) {
        PyErr_SetString(PyExc_ValueError, "the blocks run past the data");
        goto done;
    }
    if (count > 0 && cseq > UINT64_MAX - (unsigned long long)(count - 1)) {  /* as int.to_bytes(8) would refuse */
        PyErr_SetString(PyExc_OverflowError, "a client seq beyond 64 bits");
        goto done;
    }
    out = PyList_New(count);
    for (Py_ssize_t i = 0; out != NULL && i < count; i++, cseq++) {
        PyObject *m = PyBytes_FromStringAndSize(NULL, size + head.len + 8);
        if (m == NULL) { Py_CLEAR(out); break; }
        unsigned char *p = (unsigned char *)PyBytes_AS_STRING(m);
        memcpy(p, (const unsigned char *)data.buf + first + i * stride, (size_t)size);
        memcpy(p + size, head.buf, (size_t)head.len);
        put_u64(p + size + head.len, cseq);
        PyList_SET_ITEM(out, i, m);
    }
done:
    PyBuffer_Release(&data);
    PyBuffer_Release(&head);
    return out;
}

/* Whether a packet of n bytes at p fits max_size and has a MoldUDP64 header whose session is
 * left-justified printable ASCII: moldudp64.py's decode_header_pure accepts it. */
static int good_header(const unsigned char *p, Py_ssize_t n, Py_ssize_t max_size) {
    if (n < 20 || n > max_size || p[0] == ' ') return 0;
    for (int i = 0; i < 10; i++)
        if (p[i] < 0x20 || p[i] > 0x7E) return 0;
    return 1;
}

/* header(data, max_size) -> (session, seq, count) of a MoldUDP64 packet whose size and header pass
 * protocol/moldudp64.py's decode_header_pure (the definition: it names what is wrong with the
 * others), else None. */
static PyObject *header(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    Py_buffer data;
    if (nargs != 2) return PyErr_Format(PyExc_TypeError, "header takes 2 arguments (%zd given)", nargs);
    Py_ssize_t max_size = PyLong_AsSsize_t(args[1]);
    if (PyErr_Occurred() || PyObject_GetBuffer(args[0], &data, PyBUF_SIMPLE) < 0) return NULL;
    const unsigned char *p = data.buf;
    PyObject *out = Py_None;
    if (good_header(p, data.len, max_size)) {
        PyObject *session = PyBytes_FromStringAndSize((const char *)p, 10);
        PyObject *seq = PyLong_FromUnsignedLongLong(get_u64(p + 10)), *count = PyLong_FromLong(p[18] << 8 | p[19]);
        out = session && seq && count ? PyTuple_Pack(3, session, seq, count) : NULL;
        Py_XDECREF(session);
        Py_XDECREF(seq);
        Py_XDECREF(count);
    } else {
        Py_INCREF(out);
    }
    PyBuffer_Release(&data);
    return out;
}

#define INBOUND_SIZE 49     /* a client's message */
#define INBOUND_BLOCK 51    /* u16 length + a client's message */

/* inbound_rejects(data, count, types, limit) -> protocol/messages.py's inbound_rejects_pure (the
 * definition) for a batch whose blocks check, else None (the definition names what is wrong):
 * `count` blocks of a client's message filling the batch after its header, each of one of `types`;
 * then (index, code) of each message the ingress checks reject: |shares| (i64 at +9) not below
 * `limit` (code 1), or its text (24 bytes at +17) not printable ASCII (code 2). */
static PyObject *inbound_rejects(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    Py_buffer data, types;
    if (nargs != 4) return PyErr_Format(PyExc_TypeError, "inbound_rejects takes 4 arguments (%zd given)", nargs);
    Py_ssize_t count = PyLong_AsSsize_t(args[1]);
    long long limit = PyLong_AsLongLong(args[3]);
    if (PyErr_Occurred() || PyObject_GetBuffer(args[0], &data, PyBUF_SIMPLE) < 0) return NULL;
    if (PyObject_GetBuffer(args[2], &types, PyBUF_SIMPLE) < 0) {
        PyBuffer_Release(&data);
        return NULL;
    }
    const unsigned char *p = data.buf;
    PyObject *out = Py_None;
    if (count < 0 || count > data.len / INBOUND_BLOCK || data.len != 20 + count * INBOUND_BLOCK) goto done;
    for (const unsigned char *b = p + 20; b < p + data.len; b += INBOUND_BLOCK)
        if (b[0] != 0 || b[1] != INBOUND_SIZE || memchr(types.buf, b[2], (size_t)types.len) == NULL) goto done;
    out = PyList_New(0);
    for (Py_ssize_t i = 0; out != NULL && i < count; i++) {
        const unsigned char *m = p + 22 + i * INBOUND_BLOCK;
        long long shares = (long long)get_u64(m + 9);
        int code = 0;
        if (!(-limit < shares && shares < limit)) code = 1;
        else
            for (int k = 17; k < 41; k++)
                if (m[k] < 0x20 || m[k] > 0x7E) { code = 2; break; }
        if (code) {
            PyObject *item = Py_BuildValue("(ni)", i, code);
            if (item == NULL || PyList_Append(out, item) < 0) Py_CLEAR(out);
            Py_XDECREF(item);
        }
    }
    PyBuffer_Release(&data);
    PyBuffer_Release(&types);
    return out;
done:
    PyBuffer_Release(&data);
    PyBuffer_Release(&types);
    return Py_NewRef(out);
}


/* frames(buf, max_frame, kinds, consumed) -> ([(type, payload, stream offset)], end): the complete
 * frames (length u32 of what follows | type u8 | payload) from the start of `buf`, stopping at the
 * first that is not whole or that protocol/framing.py's FrameReader._frames_pure (the definition)
 * refuses: a length outside 1..max_frame, or a type not in `kinds` (None: any). `end` is where
 * that frame starts; `consumed` is the stream offset of buf[0]. */
static PyObject *frames(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    Py_buffer buf, kinds = {0};
    if (nargs != 4) return PyErr_Format(PyExc_TypeError, "frames takes 4 arguments (%zd given)", nargs);
    long long max_frame = PyLong_AsLongLong(args[1]), consumed = PyLong_AsLongLong(args[3]);
    if (PyErr_Occurred() || PyObject_GetBuffer(args[0], &buf, PyBUF_SIMPLE) < 0) return NULL;
    if (args[2] != Py_None && PyObject_GetBuffer(args[2], &kinds, PyBUF_SIMPLE) < 0) {
        PyBuffer_Release(&buf);
        return NULL;
    }
    const unsigned char *p = buf.buf;
    Py_ssize_t pos = 0;
    PyObject *out = PyList_New(0), *result = NULL;
    while (out != NULL && buf.len - pos >= 5) {
        long long length = (long long)((uint32_t)p[pos] << 24 | p[pos + 1] << 16 | p[pos + 2] << 8 | p[pos + 3]);
        unsigned char kind = p[pos + 4];
        if (length < 1 || length > max_frame || buf.len - pos - 4 < length) break;
        if (args[2] != Py_None && memchr(kinds.buf, kind, (size_t)kinds.len) == NULL) break;
        PyObject *item = Py_BuildValue("(By#L)", kind, (const char *)p + pos + 5, (Py_ssize_t)(length - 1),
                                       consumed + (long long)pos);
        if (item == NULL || PyList_Append(out, item) < 0) Py_CLEAR(out);
        Py_XDECREF(item);
        pos += 4 + (Py_ssize_t)length;
    }
    if (out != NULL) result = Py_BuildValue("(Nn)", out, pos);
    if (kinds.obj != NULL) PyBuffer_Release(&kinds);
    PyBuffer_Release(&buf);
    return result;
}


#include "_blake2b.h"

/* --- the stream's seals (protocol/streamauth.py StreamKeys.verify_pure) ------------------- */

#define SEQUENCED_SIZE 75   /* every sequenced message, the seal among them */
#define SEALED_BLOCK 77     /* u16 length + a sequenced message */
#define SEAL_SIZE SEQUENCED_SIZE
#define SEAL_AT_TAG 17      /* inside the seal: 'A' | first seq u64 | entries i64 | tag 16 | key id 8 | ... */
#define SEAL_AT_KEY_ID 33
#define SEAL_AT_ALGORITHM 41  /* u64 after the key id: which hash makes the tag */
#define SEAL_BLAKE2B 0
#define SEAL_BLAKE3 1
#define TAG_SIZE 16
#define LISTENER_TAG_SIZE 8   /* the seal's last field: the listener key's tag, cut (protocol/streamauth.py) */
#define AUTH_TYPE 'A'

/* fn(key, packet with its tag zeroed) -> the 16-byte BLAKE3 tag: the `blake3` package's hash, the
 * only BLAKE3 this build has (protocol/streamauth.py registers it at import). */
static PyObject *blake3_tagger = NULL;

static PyObject *set_blake3_tagger(PyObject *self, PyObject *fn) {
    if (!PyCallable_Check(fn)) {
        PyErr_SetString(PyExc_TypeError, "the BLAKE3 tagger must be callable");
        return NULL;
    }
    Py_XSETREF(blake3_tagger, Py_NewRef(fn));
    Py_RETURN_NONE;
}

/* The BLAKE3 tag of the packet p[0..n) with its tag (at `at`) zeroed, and its last `tail` bytes (the
 * listener tag's, for a listener's check), into out: 0, or -1 with an exception raised. */
static int blake3_tag(unsigned char out[TAG_SIZE], PyObject *key, const unsigned char *p, Py_ssize_t n, size_t at,
                      size_t tail) {
    if (blake3_tagger == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "no BLAKE3 tagger registered (protocol/streamauth.py does it)");
        return -1;
    }
    PyObject *unsigned_packet = PyBytes_FromStringAndSize((const char *)p, n);
    if (unsigned_packet == NULL) return -1;
    memset(PyBytes_AS_STRING(unsigned_packet) + at, 0, TAG_SIZE);
    memset(PyBytes_AS_STRING(unsigned_packet) + n - tail, 0, tail);
    PyObject *tag = PyObject_CallFunctionObjArgs(blake3_tagger, key, unsigned_packet, NULL);
    Py_DECREF(unsigned_packet);
    if (tag == NULL) return -1;
    if (!PyBytes_Check(tag) || PyBytes_GET_SIZE(tag) != TAG_SIZE) {
        Py_DECREF(tag);
        PyErr_SetString(PyExc_ValueError, "the BLAKE3 tagger must return 16 bytes");
        return -1;
    }
    memcpy(out, PyBytes_AS_STRING(tag), TAG_SIZE);
    Py_DECREF(tag);
    return 0;
}

/* The algorithm of the seal ending the packet p[0..n) if it is one whole sealed range, else -1 ("unsealed")
 * or -2 ("unknown_seal"). */
static int seal_algorithm(const unsigned char *p, Py_ssize_t n) {
    if (n < 20 + SEALED_BLOCK) return -1;
    uint64_t seq = get_u64(p + 10), count = (uint64_t)(p[18] << 8 | p[19]);
    const unsigned char *seal = p + n - SEAL_SIZE;
    if ((uint64_t)n != 20 + count * SEALED_BLOCK || seal[0] != AUTH_TYPE || get_u64(seal + 1) != seq ||
        get_u64(seal + 9) != count - 1) return -1;
    uint64_t algorithm = get_u64(seal + SEAL_AT_ALGORITHM);
    return algorithm == SEAL_BLAKE2B || algorithm == SEAL_BLAKE3 ? (int)algorithm : -2;
}

static int usable_key(PyObject *key) {
    if (PyBytes_Check(key) && PyBytes_GET_SIZE(key) <= 64) return 1;  /* as hashlib.blake2b takes it */
    PyErr_SetString(PyExc_ValueError, "a stream key is bytes of at most 64");
    return 0;
}

/* The tag by `algorithm` and `key` of the packet p[0..n) with its seal's tag (at `at`) and last `tail`
 * bytes zeroed, into out: 0, or -1 with an exception raised. */
static int packet_tag(unsigned char out[TAG_SIZE], int algorithm, PyObject *key, const unsigned char *p,
                      Py_ssize_t n, size_t at, size_t tail) {
    static const unsigned char zero[TAG_SIZE];
    if (algorithm == SEAL_BLAKE3) return blake3_tag(out, key, p, n, at, tail);
    const unsigned char *part[4] = {p, zero, p + at + TAG_SIZE, zero};
    size_t len[4] = {at, TAG_SIZE, (size_t)n - at - TAG_SIZE - tail, tail};
    blake2b_keyed_parts(out, TAG_SIZE, (const unsigned char *)PyBytes_AS_STRING(key), (size_t)PyBytes_GET_SIZE(key),
                        4, part, len);
    return 0;
}

/* Why the listener tag of the packet p[0..n) verifies under none of `keys` (a tuple of listener keys), NULL
 * if it verifies under one; NULL with *failed set and an exception raised if a key is unusable. */
static const char *listener_seal_problem(const unsigned char *p, Py_ssize_t n, PyObject *keys, int *failed) {
    *failed = 0;
    int algorithm = seal_algorithm(p, n);
    if (algorithm < 0) return algorithm == -1 ? "unsealed" : "unknown_seal";
    size_t at = (size_t)(n - SEAL_SIZE) + SEAL_AT_TAG;
    const unsigned char *tag_in = p + n - LISTENER_TAG_SIZE;
    for (Py_ssize_t k = 0; k < PyTuple_GET_SIZE(keys); k++) {
        PyObject *key = PyTuple_GET_ITEM(keys, k);
        unsigned char tag[TAG_SIZE], diff = 0;
        if (!usable_key(key) || packet_tag(tag, algorithm, key, p, n, at, LISTENER_TAG_SIZE) < 0) {
            *failed = 1;
            return NULL;
        }
        for (int i = 0; i < LISTENER_TAG_SIZE; i++) diff |= tag[i] ^ tag_in[i];  /* in constant time */
        if (!diff) return NULL;
    }
    for (int i = 0; i < LISTENER_TAG_SIZE; i++)
        if (tag_in[i]) return "bad_tag";
    return "unknown_key";  /* sealed without a listener tag */
}

/* Why the seal of the packet p[0..n) does not hold ("unsealed", "unknown_seal", "unknown_key", "bad_tag"),
 * NULL if it does; NULL with *failed set and an exception raised if `keys` is unusable. `keys`: a dict of
 * stream key id -> key (the seal's tag checked), or a tuple of listener keys (its listener tag). */
static const char *seal_problem(const unsigned char *p, Py_ssize_t n, PyObject *keys, int *failed) {
    *failed = 0;
    if (PyTuple_Check(keys)) return listener_seal_problem(p, n, keys, failed);
    int algorithm = seal_algorithm(p, n);
    if (algorithm < 0) return algorithm == -1 ? "unsealed" : "unknown_seal";
    const unsigned char *seal = p + n - SEAL_SIZE;
    PyObject *id = PyBytes_FromStringAndSize((const char *)seal + SEAL_AT_KEY_ID, 8);
    if (id == NULL) { *failed = 1; return NULL; }
    PyObject *key = PyDict_GetItemWithError(keys, id);  /* borrowed */
    Py_DECREF(id);
    if (key == NULL && PyErr_Occurred()) { *failed = 1; return NULL; }
    if (key == NULL) return "unknown_key";
    size_t at = (size_t)(seal - p) + SEAL_AT_TAG;
    unsigned char tag[TAG_SIZE], diff = 0;
    if (!usable_key(key) || packet_tag(tag, algorithm, key, p, n, at, 0) < 0) { *failed = 1; return NULL; }
    for (int i = 0; i < TAG_SIZE; i++) diff |= tag[i] ^ p[at + i];  /* in constant time */
    return diff ? "bad_tag" : NULL;
}

/* verify_sealed(packet, keys_by_id) -> None, or why not: "unsealed", "unknown_seal", "unknown_key", "bad_tag". */
static PyObject *verify_sealed(PyObject *self, PyObject *args) {
    Py_buffer data;
    PyObject *keys;
    if (!PyArg_ParseTuple(args, "y*O:verify_sealed", &data, &keys)) return NULL;
    if (!PyDict_Check(keys) && !PyTuple_Check(keys)) {
        PyBuffer_Release(&data);
        PyErr_SetString(PyExc_TypeError, "keys: a dict of key id -> key, or a tuple of listener keys");
        return NULL;
    }
    int failed;
    const char *why = seal_problem(data.buf, data.len, keys, &failed);
    PyBuffer_Release(&data);
    if (failed) return NULL;
    if (why == NULL) Py_RETURN_NONE;
    return PyUnicode_InternFromString(why);
}

/* (session, seq, count) of a data packet that passes every check a listener makes, else None (the
 * listener's checks in Python then find and name what is wrong): size, a left-justified printable
 * session, a count that is no heartbeat, blocks of `types`' sequenced messages filling the packet
 * exactly, and with `keys` (None: no stream key) a seal that verifies. */
static PyObject *good_stream_packet(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    Py_buffer data, types;
    Py_ssize_t max_size;
    PyObject *keys, *out = Py_None;
    /* (Read one by one, not by a format, as _audit.apply_fast: every listener calls it a packet.) */
    if (nargs != 4) return PyErr_Format(PyExc_TypeError, "good_stream_packet takes 4 arguments (%zd given)", nargs);
    max_size = PyLong_AsSsize_t(args[1]);
    keys = args[3];
    if (PyErr_Occurred() || PyObject_GetBuffer(args[0], &data, PyBUF_SIMPLE) < 0) return NULL;
    if (PyObject_GetBuffer(args[2], &types, PyBUF_SIMPLE) < 0) {
        PyBuffer_Release(&data);
        return NULL;
    }
    const unsigned char *p = data.buf;
    Py_ssize_t n = data.len, count = 0;
    if (!good_header(p, n, max_size)) goto done;
    count = p[18] << 8 | p[19];
    if (count == 0 || count == 0xFFFF || n != 20 + count * SEALED_BLOCK) goto done;
    for (const unsigned char *b = p + 20; b < p + n; b += SEALED_BLOCK)
        if (b[0] != 0 || b[1] != SEQUENCED_SIZE || memchr(types.buf, b[2], (size_t)types.len) == NULL) goto done;
    if (keys != Py_None) {
        if (!PyDict_Check(keys) && !PyTuple_Check(keys)) {
            PyErr_SetString(PyExc_TypeError, "keys: a dict of key id -> key, a tuple of listener keys, or None");
            out = NULL;
            goto done;
        }
        int failed;
        const char *why = seal_problem(p, n, keys, &failed);
        if (failed) out = NULL;
        if (failed || why != NULL) goto done;
    }
    PyObject *session = PyBytes_FromStringAndSize((const char *)p, 10);
    PyObject *seq = PyLong_FromUnsignedLongLong(get_u64(p + 10)), *blocks = PyLong_FromSsize_t(count);
    out = session && seq && blocks ? PyTuple_Pack(3, session, seq, blocks) : NULL;
    Py_XDECREF(session);
    Py_XDECREF(seq);
    Py_XDECREF(blocks);
    PyBuffer_Release(&data);
    PyBuffer_Release(&types);
    return out;
done:
    PyBuffer_Release(&data);
    PyBuffer_Release(&types);
    return out == NULL ? NULL : Py_NewRef(out);
}

/* seal_run(entries, per, session, first_seq, stamp, origin, key, key_id, algorithm[, listener_key]) ->
 * (sealed, packets): the entries (sequenced messages) cut `per` to a packet, each packet ended by its seal,
 * its tag made by `algorithm` (SEAL_BLAKE2B, SEAL_BLAKE3) over the packet with its listener tag (made first
 * with `listener_key`, else zero) in place; `sealed` the entries with each seal in its place, `packets` the
 * sealed packets. protocol/streamauth.py's StreamKeys.seal_run_pure is the definition. */
static PyObject *seal_run(PyObject *self, PyObject *args) {
    PyObject *entries, *key_object, *listener = Py_None;
    Py_ssize_t per, session_len, origin_len, id_len;
    unsigned long long first, stamp;
    int algorithm;
    const char *session, *origin, *key_id;
    if (!PyArg_ParseTuple(args, "Ony#KKy#O!y#i|O:seal_run", &entries, &per, &session, &session_len, &first, &stamp,
                          &origin, &origin_len, &PyBytes_Type, &key_object, &key_id, &id_len, &algorithm, &listener))
        return NULL;
    Py_ssize_t key_len = PyBytes_GET_SIZE(key_object);
    if (session_len != 10 || origin_len != 10 || id_len != 8 || key_len > 64 || per < 1 ||
        per > 0xFFFE || (algorithm != SEAL_BLAKE2B && algorithm != SEAL_BLAKE3) ||
        (listener != Py_None && !(PyBytes_Check(listener) && PyBytes_GET_SIZE(listener) <= 64))) {
        PyErr_SetString(PyExc_ValueError, "seal_run: a 10-byte session and origin, an 8-byte key id, a key of "
                                          "at most 64 bytes, 1 to 65534 entries a packet, a known algorithm, a "
                                          "listener key of at most 64 bytes or None");
        return NULL;
    }
    PyObject *seq_of = PySequence_Fast(entries, "entries must be a sequence of bytes");
    if (seq_of == NULL) return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq_of), npackets = (n + per - 1) / per;
    PyObject **items = PySequence_Fast_ITEMS(seq_of);
    PyObject *sealed = PyList_New(n + npackets), *packets = PyList_New(npackets), *out = NULL;
    if (sealed == NULL || packets == NULL) goto done;
    uint64_t seq = first;
    for (Py_ssize_t k = 0, i = 0; k < npackets; k++) {
        Py_ssize_t count = n - i < per ? n - i : per;
        PyObject *pkt = PyBytes_FromStringAndSize(NULL, 20 + (count + 1) * SEALED_BLOCK);
        if (pkt == NULL) goto done;
        PyList_SET_ITEM(packets, k, pkt);
        unsigned char *p = (unsigned char *)PyBytes_AS_STRING(pkt), *b = p + 20;
        memcpy(p, session, 10);
        put_u64(p + 10, seq);
        p[18] = (unsigned char)((count + 1) >> 8), p[19] = (unsigned char)(count + 1);
        for (Py_ssize_t j = 0; j < count; j++, i++, b += SEALED_BLOCK) {
            PyObject *m = items[i];
            if (!PyBytes_Check(m) || PyBytes_GET_SIZE(m) != SEQUENCED_SIZE) {
                PyErr_SetString(PyExc_ValueError, "an entry is a sequenced message: 75 bytes");
                goto done;
            }
            b[0] = 0, b[1] = SEQUENCED_SIZE;
            memcpy(b + 2, PyBytes_AS_STRING(m), SEQUENCED_SIZE);
            PyList_SET_ITEM(sealed, i + k, Py_NewRef(m));
        }
        unsigned char *seal = b + 2;  /* 'A' | first seq | entries | tag | key id | algorithm | stamp | origin |
                                   * listener tag */
        b[0] = 0, b[1] = SEQUENCED_SIZE;
        memset(seal, 0, SEQUENCED_SIZE);
        seal[0] = AUTH_TYPE;
        put_u64(seal + 1, seq);
        put_u64(seal + 9, (uint64_t)count);
        memcpy(seal + SEAL_AT_KEY_ID, key_id, 8);
        put_u64(seal + SEAL_AT_ALGORITHM, (uint64_t)algorithm);
        put_u64(seal + SEAL_AT_KEY_ID + 16, stamp);
        memcpy(seal + SEAL_AT_KEY_ID + 24, origin, 10);
        Py_ssize_t size = 20 + (count + 1) * SEALED_BLOCK;
        size_t at = (size_t)(seal - p) + SEAL_AT_TAG;
        unsigned char listener_tag[TAG_SIZE];
        if (listener != Py_None) {  /* first: the seal's tag covers it */
            if (packet_tag(listener_tag, algorithm, listener, p, size, at, 0) < 0) goto done;
            memcpy(p + size - LISTENER_TAG_SIZE, listener_tag, LISTENER_TAG_SIZE);
        }
        if (packet_tag(seal + SEAL_AT_TAG, algorithm, key_object, p, size, at, 0) < 0) goto done;
        PyObject *seal_entry = PyBytes_FromStringAndSize((const char *)seal, SEQUENCED_SIZE);
        if (seal_entry == NULL) goto done;
        PyList_SET_ITEM(sealed, i + k, seal_entry);
        seq += (uint64_t)count + 1;
    }
    out = PyTuple_Pack(2, sealed, packets);
done:
    Py_XDECREF(sealed);
    Py_XDECREF(packets);
    Py_DECREF(seq_of);
    return out;
}

static PyMethodDef methods[] = {
    {"verify_sealed", verify_sealed, METH_VARARGS,
     "None if a packet is one whole sealed range whose tag verifies, else why (protocol/streamauth.py)."},
    {"good_stream_packet", (PyCFunction)(void (*)(void))good_stream_packet, METH_FASTCALL,
     "(session, seq, count) of a data packet every listener check passes, else None (protocol/listener.py)."},
    {"seal_run", seal_run, METH_VARARGS,
     "Entries cut into packets, each ended by its seal (protocol/streamauth.py's StreamKeys.seal_run_pure)."},
    {"set_blake3_tagger", set_blake3_tagger, METH_O,
     "Register fn(key, packet with its tag zeroed) -> the 16-byte BLAKE3 tag of a seal (protocol/streamauth.py)."},
    {"frames", (PyCFunction)(void (*)(void))frames, METH_FASTCALL,
     "The complete frames of a link's buffer (protocol/framing.py's FrameReader._frames_pure)."},
    {"header", (PyCFunction)(void (*)(void))header, METH_FASTCALL,
     "(session, seq, count) of a packet whose header checks, else None (protocol/moldudp64.py)."},
    {"inbound_rejects", (PyCFunction)(void (*)(void))inbound_rejects, METH_FASTCALL,
     "What ingress rejects in a batch whose blocks check, else None (protocol/messages.py)."},
    {"stamp_blocks", stamp_blocks, METH_VARARGS,
     "A batch's inbound messages stamped, read from its blocks (protocol/messages.py's stamp_blocks_pure)."},
    {"client_seq_maxima", client_seq_maxima, METH_VARARGS,
     "The highest client seq of each origin in a run of sequenced messages (protocol/messages.py)."},
    {"record_offsets", record_offsets, METH_VARARGS,
     "Where records start in encode_records' buffer (protocol/journal.py's record_offsets_pure)."},
    {"encode_run", encode_run, METH_VARARGS,
     "encode_records of a run of one term's fixed-size messages (protocol/journal.py's encode_run_pure)."},
    {"scan_good", scan_good, METH_VARARGS,
     "The good journal records of a buffer from pos, up to the first scan_pure refuses (protocol/journal.py)."},
    {"crc32", crc32_either, METH_VARARGS,
     "CRC-32/IEEE of bytes (as zlib.crc32), folded by carry-less multiplication if asked and able."},
    {"encode_records", encode_records, METH_O,
     "Many (seq, term, message) records as one contiguous buffer (docs/journal-format.md)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_speedups",
                                    "Per-message loops in C (each beside its pure Python definition and fallback).",
                                    -1, methods};

PyMODINIT_FUNC PyInit__speedups(void) {
    crc_init();
    return PyModule_Create(&module);
}
