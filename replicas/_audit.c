/* Kept in C: 5.1 M msg/s decode + apply against 0.98 M for the Python rules (`tape bench
 * replica`), which Cython's pure-Python mode made only 1.19x faster; the rules stay defined once,
 * in Python, and the C is held equal to them state for state (docs/decisions.md).
 *
 * A replica's books in C, and the audit's two common cases applied straight
 * from a delivered packet's bytes (replicas/audit_core.py holds the rules; this
 * is where most messages go in a replica process, docs/replicas.md).
 *
 *   BookTable   order id -> book, a mapping with the Python books' interface
 *               (a book reads as the list [requested, cumulative, client,
 *               stock, opened_ns, alerted, request_seq], a copy: write it
 *               back to change it). 72 bytes a book in one open-addressed
 *               array, no Python object per book: nothing for the
 *               collector to walk, and a snapshot packs its dirty books
 *               without chasing seven objects each. The ids of the books
 *               the common cases change are kept here (take_dirty).
 *   ExpiryQueue the books' expiry entries in stamp order, 24 bytes each in
 *               blocks, read as a deque of (expires, order id, seq) tuples.
 *   apply_fast  applies messages index..end-1 of a packet while each is one
 *               of the cases AuditMachine._apply inlines (a purchase that
 *               fills an open book, raising its alert if it crosses it, a
 *               request that opens a new book, a control message but the
 *               session's end, where the digest folds) and no
 *               expiry falls due;
 *               returns how many it applied, leaving the next one to the
 *               Python rules. Effects, dirty ids and expiry entries are
 *               exactly those the Python records for the same messages:
 *               tests/test_audit_compiled.py holds the two equal.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <structmember.h>
#include <stdint.h>
#include <string.h>

#define HEADER_SIZE 20      /* MoldUDP64 header */
#define BLOCK_SIZE 77       /* u16 length + a 75-byte sequenced message */
#define AT_ORDER 3          /* offsets inside a block: type at 2, then the message's fields */
#define AT_SHARES 11
#define AT_CLIENT 19
#define AT_STOCK 35
#define AT_STAMP 51
#define CLIENT_LEN 16
#define STOCK_LEN 8
#define RECORD_SIZE 57      /* a snapshot's book record: ">qq16s8sQ?Q" */
#define MIN_CAPACITY 1024   /* slots; grown x2 whenever half full */
#define MAX_EXPECTED (1 << 28)  /* books a table is sized for at start, at most (36 GiB of slots): equal to
                                 * protocol/limits.py MAX_BOOKS_EXPECTED */
#define MOVE_PER_INSERT 2   /* old slots moved on each insert while the table grows: the fewest that
                             * end a doubling before the next, its cost spread the thinnest (16 moved
                             * 524,288 books within 1.1 s at 250,000 msg/s, a replica's CPU x5
                             * meanwhile, all three replicas at once: the cluster stalled 0.5 s) */
#define DUE_PER_BLOCK 4096  /* expiry entries a block of the queue (96 KiB) */
#define PURCHASE 'P'
#define REQUEST 'R'
#define SESSION_END 'E'   /* a fold point of the digest: left to the Python rules */

typedef struct {
    uint64_t order_id;
    int64_t requested, cumulative;
    uint64_t opened_ns, request_seq;
    char client[CLIENT_LEN], stock[STOCK_LEN];
    uint8_t alerted, used, dirty;  /* dirty: its id is in the table's dirty ids */
} Book;

/* A doubling moves the books a few slots at a time, on the inserts that follow it: moved in one
 * pass, 524,288 books stalled a replica for 87 ms alone on a core (over a second in the cluster),
 * and a replica's books only grow in its first hour (book_ttl_s). Meanwhile a book is in either
 * array; the old one gives up whole clusters only (runs of used slots), so that its probe runs stay
 * whole for the books not moved yet. */
typedef struct {
    PyObject_HEAD
    Book *slots;
    size_t mask;   /* capacity - 1, capacity a power of two */
    size_t count;  /* books in both arrays */
    Book *old;     /* while growing: the array before, its books not moved yet; else NULL */
    size_t old_mask, cursor, left;  /* the next old slot to visit, and how many are left to visit */
    uint64_t *dirty;  /* ids of the books the common cases changed since take_dirty() (once each) */
    size_t dirty_count, dirty_cap;
} BookTable;

static PyTypeObject BookTableType;

/* Runs of 64 consecutive order ids share a run of slots (clients number their orders in sequence,
 * and an order's purchases follow it closely: the books in use stay in a few cache lines); the
 * runs themselves are scattered by a multiplicative hash, so ids in a pattern do not pile up. */
static size_t home(uint64_t order_id, size_t mask) {
    uint64_t run = (order_id >> 6) * 0x9E3779B97F4A7C15ull;
    return (size_t)(((run ^ (run >> 29)) << 6) | (order_id & 63)) & mask;
}

static Book *probe(Book *slots, size_t mask, uint64_t order_id) {
    for (size_t i = home(order_id, mask);; i = (i + 1) & mask) {
        Book *b = &slots[i];
        if (!b->used) return NULL;
        if (b->order_id == order_id) return b;
    }
}

static Book *find(BookTable *t, uint64_t order_id) {
    Book *b = probe(t->slots, t->mask, order_id);
    return b != NULL || t->old == NULL ? b : probe(t->old, t->old_mask, order_id);
}

/* The free slot of the new array a book goes to. */
static Book *place(BookTable *t, uint64_t order_id) {
    size_t i = home(order_id, t->mask);
    while (t->slots[i].used) i = (i + 1) & t->mask;
    return &t->slots[i];
}

/* Visit at least `budget` old slots, moving their books, then the rest of the cluster under way:
 * the cursor stops on a free slot only. */
static void move_some(BookTable *t, size_t budget) {
    Book *old = t->old;
    while (t->left && (budget || old[t->cursor].used)) {
        Book *b = &old[t->cursor];
        if (b->used) {
            *place(t, b->order_id) = *b;
            b->used = 0;
        }
        t->cursor = (t->cursor + 1) & t->old_mask;
        t->left--;
        if (budget) budget--;
    }
    if (!t->left) {
        PyMem_Free(old);
        t->old = NULL;
    }
}

static int grow(BookTable *t) {
    if (t->old != NULL) move_some(t, SIZE_MAX);  /* (never: MOVE_PER_INSERT ends a doubling first) */
    size_t cap = (t->mask + 1) * 2;
    Book *slots = PyMem_Calloc(cap, sizeof(Book));
    if (slots == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    t->old = t->slots;
    t->old_mask = t->mask;
    t->slots = slots;
    t->mask = cap - 1;
    t->left = t->old_mask + 1;
    /* from a free slot (half are): no cluster is cut at the start */
    for (t->cursor = 0; t->old[t->cursor].used; t->cursor++) {}
    return 0;
}

/* A slot for a book not in the table (pointers into the table die here: books move). */
static Book *insert(BookTable *t, uint64_t order_id) {
    if ((t->count + 1) * 2 > t->mask + 1 && grow(t) < 0) return NULL;
    if (t->old != NULL) move_some(t, MOVE_PER_INSERT);
    Book *b = place(t, order_id);
    memset(b, 0, sizeof(Book));
    b->used = 1;
    b->order_id = order_id;
    t->count++;
    return b;
}

/* Linear probing's deletion without tombstones: later books of the same run move back (in the old
 * array too: its clusters not moved yet are whole, and stay inside the part not visited). */
static void erase(BookTable *t, Book *b) {
    int in_old = t->old != NULL && (uintptr_t)b >= (uintptr_t)t->old &&
                 (uintptr_t)b <= (uintptr_t)(t->old + t->old_mask);
    Book *slots = in_old ? t->old : t->slots;
    size_t mask = in_old ? t->old_mask : t->mask, i = (size_t)(b - slots), j = i;
    for (;;) {
        j = (j + 1) & mask;
        if (!slots[j].used) break;
        size_t k = home(slots[j].order_id, mask);
        int stays = i <= j ? (i < k && k <= j) : (i < k || k <= j);
        if (!stays) {
            slots[i] = slots[j];
            i = j;
        }
    }
    slots[i].used = 0;
    t->count--;
}

/* The common cases note the books they change here, not in the machine's set of Python ints (an
 * int and a set insert for every message). */
static int note_dirty(BookTable *t, Book *b) {
    if (b->dirty) return 0;
    if (t->dirty_count == t->dirty_cap) {
        size_t cap = t->dirty_cap ? t->dirty_cap * 2 : MIN_CAPACITY;
        uint64_t *grown = PyMem_Realloc(t->dirty, cap * sizeof(uint64_t));
        if (grown == NULL) {
            PyErr_NoMemory();
            return -1;
        }
        t->dirty = grown;
        t->dirty_cap = cap;
    }
    t->dirty[t->dirty_count++] = b->order_id;
    b->dirty = 1;
    return 0;
}

/* --- the Python mapping ------------------------------------------------------------------ */

/* An order id from Python: 0 on success, 1 if it cannot be one (no such book), -1 on error. */
static int key_of(PyObject *key, uint64_t *order_id) {
    if (!PyLong_Check(key)) {
        PyErr_SetString(PyExc_TypeError, "order ids are ints");
        return -1;
    }
    *order_id = PyLong_AsUnsignedLongLong(key);
    if (*order_id == (uint64_t)-1 && PyErr_Occurred()) {
        if (!PyErr_ExceptionMatches(PyExc_OverflowError)) return -1;
        PyErr_Clear();
        return 1;
    }
    return 0;
}

static PyObject *book_list(const Book *b) {
    return Py_BuildValue("[LLy#y#KOK]", (long long)b->requested, (long long)b->cumulative, b->client,
                         (Py_ssize_t)CLIENT_LEN, b->stock, (Py_ssize_t)STOCK_LEN,
                         (unsigned long long)b->opened_ns, b->alerted ? Py_True : Py_False,
                         (unsigned long long)b->request_seq);
}

static int text_field(PyObject *item, char *out, Py_ssize_t width, const char *name) {
    char *p;
    Py_ssize_t n;
    if (PyBytes_AsStringAndSize(item, &p, &n) < 0) return -1;
    if (n != width) {
        PyErr_Format(PyExc_ValueError, "a book's %s is %zd bytes, not %zd", name, n, width);
        return -1;
    }
    memcpy(out, p, (size_t)width);
    return 0;
}

/* A book's fields from a 7-item sequence, into `b` (a scratch copy: the table is untouched on error). */
static int book_from(PyObject *value, Book *b) {
    PyObject *seq = PySequence_Fast(value, "a book is a sequence of 7 fields");
    if (seq == NULL) return -1;
    int rc = -1;
    if (PySequence_Fast_GET_SIZE(seq) != 7) {
        PyErr_SetString(PyExc_ValueError, "a book is a sequence of 7 fields");
        goto done;
    }
    PyObject **f = PySequence_Fast_ITEMS(seq);
    b->requested = PyLong_AsLongLong(f[0]);
    b->cumulative = PyLong_AsLongLong(f[1]);
    b->opened_ns = PyLong_AsUnsignedLongLong(f[4]);
    b->request_seq = PyLong_AsUnsignedLongLong(f[6]);
    if (PyErr_Occurred()) goto done;
    int alerted = PyObject_IsTrue(f[5]);
    if (alerted < 0 || text_field(f[2], b->client, CLIENT_LEN, "client") < 0 ||
        text_field(f[3], b->stock, STOCK_LEN, "stock") < 0) goto done;
    b->alerted = (uint8_t)alerted;
    rc = 0;
done:
    Py_DECREF(seq);
    return rc;
}

static Py_ssize_t table_len(BookTable *t) { return (Py_ssize_t)t->count; }

static PyObject *table_getitem(BookTable *t, PyObject *key) {
    uint64_t order_id;
    int rc = key_of(key, &order_id);
    if (rc < 0) return NULL;
    Book *b = rc ? NULL : find(t, order_id);
    if (b == NULL) {
        PyErr_SetObject(PyExc_KeyError, key);
        return NULL;
    }
    return book_list(b);
}

static int table_setitem(BookTable *t, PyObject *key, PyObject *value) {
    uint64_t order_id;
    int rc = key_of(key, &order_id);
    if (rc < 0) return -1;
    Book *b = rc ? NULL : find(t, order_id);
    if (value == NULL) {  /* del t[key] */
        if (b == NULL) {
            PyErr_SetObject(PyExc_KeyError, key);
            return -1;
        }
        erase(t, b);
        return 0;
    }
    if (rc) {
        PyErr_SetString(PyExc_OverflowError, "an order id is an unsigned 64-bit int");
        return -1;
    }
    Book scratch;
    if (book_from(value, &scratch) < 0) return -1;
    if (b == NULL && (b = insert(t, order_id)) == NULL) return -1;
    scratch.order_id = order_id;
    scratch.used = 1;
    scratch.dirty = b->dirty;
    *b = scratch;
    return 0;
}

static int table_contains(BookTable *t, PyObject *key) {
    uint64_t order_id;
    int rc = key_of(key, &order_id);
    return rc < 0 ? -1 : rc ? 0 : find(t, order_id) != NULL;
}

static PyObject *table_get(BookTable *t, PyObject *args) {
    PyObject *key, *fallback = Py_None;
    if (!PyArg_ParseTuple(args, "O|O:get", &key, &fallback)) return NULL;
    uint64_t order_id;
    int rc = key_of(key, &order_id);
    if (rc < 0) return NULL;
    Book *b = rc ? NULL : find(t, order_id);
    if (b == NULL) return Py_NewRef(fallback);
    return book_list(b);
}

/* keys() or items(), in slot order (callers that need an order sort). */
static PyObject *listing(BookTable *t, int with_books) {
    PyObject *out = PyList_New(0);
    if (out == NULL) return NULL;
    size_t n_old = t->old == NULL ? 0 : t->old_mask + 1;
    for (size_t i = 0; i < n_old + t->mask + 1; i++) {  /* the old array's books not moved, then the new's */
        Book *b = i < n_old ? &t->old[i] : &t->slots[i - n_old];
        if (!b->used) continue;
        PyObject *item = with_books ? Py_BuildValue("(KN)", (unsigned long long)b->order_id, book_list(b))
                                    : PyLong_FromUnsignedLongLong(b->order_id);
        if (item == NULL || PyList_Append(out, item) < 0) {
            Py_XDECREF(item);
            Py_DECREF(out);
            return NULL;
        }
        Py_DECREF(item);
    }
    return out;
}

static PyObject *table_keys(BookTable *t, PyObject *unused) { return listing(t, 0); }
static PyObject *table_items(BookTable *t, PyObject *unused) { return listing(t, 1); }

static PyObject *table_iter(BookTable *t) {
    PyObject *keys = listing(t, 0);
    if (keys == NULL) return NULL;
    PyObject *it = PyObject_GetIter(keys);
    Py_DECREF(keys);
    return it;
}

static void put_be64(unsigned char *p, uint64_t v) {
    for (int i = 7; i >= 0; i--, v >>= 8) p[i] = (unsigned char)v;
}

static uint64_t get_be64(const unsigned char *p) {
    uint64_t v = 0;
    for (int i = 0; i < 8; i++) v = v << 8 | p[i];
    return v;
}

/* The noted ids taken: their books' flags cleared, the list emptied. */
static void forget_noted(BookTable *t) {
    for (size_t i = 0; i < t->dirty_count; i++) {
        Book *b = find(t, t->dirty[i]);  /* (gone if deleted since, or a new book under the id) */
        if (b != NULL) b->dirty = 0;
    }
    t->dirty_count = 0;
}

/* take_dirty(): the ids note_dirty noted since the last call (each once, or twice if deleted and
 * opened again meanwhile), their books' flags cleared. */
static PyObject *table_take_dirty(BookTable *t, PyObject *unused) {
    PyObject *ids = PyList_New((Py_ssize_t)t->dirty_count);
    for (size_t i = 0; ids != NULL && i < t->dirty_count; i++) {
        PyObject *id = PyLong_FromUnsignedLongLong(t->dirty[i]);
        if (id == NULL) Py_CLEAR(ids);
        else PyList_SET_ITEM(ids, (Py_ssize_t)i, id);
    }
    if (ids == NULL) return NULL;
    forget_noted(t);
    return ids;
}

/* A book's key and snapshot record at `key` (8 + RECORD_SIZE bytes): the snapshot's layout
 * (replicas/audit_core.py BOOK), keys u64 big-endian. */
static void pack_book(unsigned char *key, uint64_t order_id, const Book *b) {
    unsigned char *rec = key + 8;
    put_be64(key, order_id);
    put_be64(rec, (uint64_t)b->requested);
    put_be64(rec + 8, (uint64_t)b->cumulative);
    memcpy(rec + 16, b->client, CLIENT_LEN);
    memcpy(rec + 32, b->stock, STOCK_LEN);
    put_be64(rec + 40, b->opened_ns);
    rec[48] = b->alerted;
    put_be64(rec + 49, b->request_seq);
}

/* Sort n ids in place, least significant byte first, skipping the bytes every id shares (an id's
 * high bytes mostly): qsort's comparisons were most of a snapshot's part on the thread that applies.
 * `spare` holds n ids. */
static void sort_ids(uint64_t *ids, uint64_t *spare, size_t n) {
    uint64_t all = ~0ull, any = 0;
    for (size_t i = 0; i < n; i++) all &= ids[i], any |= ids[i];
    for (int shift = 0; shift < 64; shift += 8) {
        if ((((all ^ any) >> shift) & 0xFF) == 0) continue;  /* the same byte in every id */
        size_t at[256] = {0};
        for (size_t i = 0; i < n; i++) at[(ids[i] >> shift) & 0xFF]++;
        for (size_t d = 0, sum = 0; d < 256; d++) {
            size_t count = at[d];
            at[d] = sum;
            sum += count;
        }
        for (size_t i = 0; i < n; i++) spare[at[(ids[i] >> shift) & 0xFF]++] = ids[i];
        memcpy(ids, spare, n * sizeof(uint64_t));
    }
}

/* take_packed(marked): a snapshot's part on the thread that applies, in one call. The ids the common
 * cases noted (taken afresh, as take_dirty) and those in `marked` (the rules'), sorted, each once,
 * as 8-byte big-endian keys end to end; and the key and record of each with a book, packed end to end
 * (Books.packed). No Python object per id or book, so it allocates nothing for the collector. */
static PyObject *table_take_packed(BookTable *t, PyObject *marked) {
    Py_ssize_t extra = PyObject_Length(marked);
    if (extra < 0) return NULL;
    size_t n = t->dirty_count, cap = n + (size_t)extra;
    uint64_t *ids = PyMem_Malloc(2 * (cap ? cap : 1) * sizeof(uint64_t));  /* and as many to sort with */
    PyObject *it = ids == NULL ? NULL : PyObject_GetIter(marked), *item;
    if (it == NULL) {
        PyMem_Free(ids);
        return ids == NULL ? PyErr_NoMemory() : NULL;
    }
    if (n) memcpy(ids, t->dirty, n * sizeof(uint64_t));  /* (no dirty list yet: NULL, which memcpy may not take) */
    while (n < cap && (item = PyIter_Next(it)) != NULL) {
        int rc = key_of(item, &ids[n]);
        Py_DECREF(item);
        if (rc != 0) {
            if (rc > 0) PyErr_SetString(PyExc_ValueError, "an order id is a u64");
            break;
        }
        n++;
    }
    Py_DECREF(it);
    if (PyErr_Occurred()) {
        PyMem_Free(ids);
        return NULL;
    }
    t->dirty_count = 0;  /* every noted id is among `ids`: its flag is cleared below */
    sort_ids(ids, ids + cap, n);
    size_t unique = 0;
    for (size_t i = 0; i < n; i++)
        if (unique == 0 || ids[i] != ids[unique - 1]) ids[unique++] = ids[i];
    PyObject *keys = PyBytes_FromStringAndSize(NULL, (Py_ssize_t)(unique * 8));
    PyObject *books = keys == NULL ? NULL : PyBytes_FromStringAndSize(NULL, (Py_ssize_t)(unique * (8 + RECORD_SIZE)));
    Py_ssize_t used = 0;
    for (size_t i = 0; i < unique; i++) {
        Book *b = find(t, ids[i]);  /* (none if deleted since it was noted or marked) */
        if (b != NULL) b->dirty = 0;
        if (books == NULL) continue;  /* (out of memory: the flags are still cleared) */
        put_be64((unsigned char *)PyBytes_AS_STRING(keys) + 8 * i, ids[i]);
        if (b == NULL) continue;
        pack_book((unsigned char *)PyBytes_AS_STRING(books) + used, ids[i], b);
        used += 8 + RECORD_SIZE;
    }
    PyMem_Free(ids);
    if (books != NULL && (size_t)used < unique * (8 + RECORD_SIZE) && _PyBytes_Resize(&books, used) < 0) books = NULL;
    if (books == NULL) {
        Py_XDECREF(keys);
        return NULL;
    }
    PyObject *out = PyTuple_Pack(2, keys, books);
    Py_DECREF(keys);
    Py_DECREF(books);
    return out;
}

/* put_packed(pairs): books from (id, record) pairs end to end, 8 + RECORD_SIZE bytes each (a
 * snapshot's bucket, as pack_book writes them), each set as t[id] = its fields would set it: a load
 * without seven Python objects a book. */
static PyObject *table_put_packed(BookTable *t, PyObject *arg) {
    Py_buffer pairs;
    if (PyObject_GetBuffer(arg, &pairs, PyBUF_SIMPLE) < 0) return NULL;
    PyObject *out = NULL;
    if (pairs.len % (8 + RECORD_SIZE)) {
        PyErr_SetString(PyExc_ValueError, "the books are not whole (id, record) pairs");
        goto done;
    }
    for (const unsigned char *at = pairs.buf, *end = at + pairs.len; at < end; at += 8 + RECORD_SIZE) {
        const unsigned char *rec = at + 8;
        uint64_t order_id = get_be64(at);
        Book *b = find(t, order_id);
        if (b == NULL && (b = insert(t, order_id)) == NULL) goto done;
        b->requested = (int64_t)get_be64(rec);
        b->cumulative = (int64_t)get_be64(rec + 8);
        memcpy(b->client, rec + 16, CLIENT_LEN);
        memcpy(b->stock, rec + 32, STOCK_LEN);
        b->opened_ns = get_be64(rec + 40);
        b->alerted = rec[48] != 0;
        b->request_seq = get_be64(rec + 49);
    }
    out = Py_NewRef(Py_None);
done:
    PyBuffer_Release(&pairs);
    return out;
}

/* Equal to a mapping with the same books (tests compare machines' books). */
static PyObject *as_dict(PyObject *o) {
    if (PyDict_Check(o)) return Py_NewRef(o);
    PyObject *items = listing((BookTable *)o, 1), *d = items == NULL ? NULL : PyDict_New();
    if (d != NULL && PyDict_MergeFromSeq2(d, items, 1) < 0) Py_CLEAR(d);
    Py_XDECREF(items);
    return d;
}

static PyObject *table_richcompare(PyObject *t, PyObject *other, int op) {
    if ((op != Py_EQ && op != Py_NE) || !(PyDict_Check(other) || Py_IS_TYPE(other, &BookTableType)))
        Py_RETURN_NOTIMPLEMENTED;
    PyObject *a = as_dict(t), *b = a == NULL ? NULL : as_dict(other);
    PyObject *r = b == NULL ? NULL : PyObject_RichCompare(a, b, op);
    Py_XDECREF(a);
    Py_XDECREF(b);
    return r;
}

static PyObject *table_new(PyTypeObject *type, PyObject *args, PyObject *kwds) {
    static char *kwlist[] = {"expected", NULL};
    Py_ssize_t expected = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "|n:BookTable", kwlist, &expected)) return NULL;
    if (expected < 0 || expected > MAX_EXPECTED) {
        PyErr_Format(PyExc_ValueError, "BookTable: expected books %zd not in [0, %d]", expected, MAX_EXPECTED);
        return NULL;
    }
    size_t cap = MIN_CAPACITY;
    while (cap < (size_t)expected * 2) cap *= 2;  /* room for them below half full: no doubling */
    BookTable *t = (BookTable *)type->tp_alloc(type, 0);
    if (t == NULL) return NULL;
    t->slots = PyMem_Calloc(cap, sizeof(Book));
    if (t->slots == NULL) {
        Py_DECREF(t);
        return PyErr_NoMemory();
    }
    /* Written once now, so that no page of it faults while the stream runs: a first write costs
     * 2-7 us a page on this project's virtual machines (the kernel zeroes it, the host backs it) */
    if (expected) memset(t->slots, 0, cap * sizeof(Book));
    t->mask = cap - 1;
    return (PyObject *)t;
}

static void table_dealloc(BookTable *t) {
    PyMem_Free(t->slots);
    PyMem_Free(t->old);
    PyMem_Free(t->dirty);
    Py_TYPE(t)->tp_free((PyObject *)t);
}

static PyMappingMethods table_mapping = {(lenfunc)table_len, (binaryfunc)table_getitem,
                                         (objobjargproc)table_setitem};
static PySequenceMethods table_sequence = {.sq_contains = (objobjproc)table_contains};

static PyMethodDef table_methods[] = {
    {"get", (PyCFunction)table_get, METH_VARARGS, "get(order_id, default=None): the book as a list, or default"},
    {"keys", (PyCFunction)table_keys, METH_NOARGS, "the order ids with a book, in no particular order"},
    {"items", (PyCFunction)table_items, METH_NOARGS, "(order id, book) pairs, in no particular order"},
    {"take_dirty", (PyCFunction)table_take_dirty, METH_NOARGS,
     "the ids of the books the common cases changed since the last call (a list, each once), afresh"},
    {"take_packed", (PyCFunction)table_take_packed, METH_O,
     "take_packed(marked): (the sorted ids changed, noted or marked, as 8-byte keys; their books packed)"},
    {"put_packed", (PyCFunction)table_put_packed, METH_O,
     "put_packed(pairs): books from (id, record) pairs end to end, as a snapshot's bucket holds them"},
    {NULL, NULL, 0, NULL},
};

static PyMemberDef table_members[] = {
    {"moving", T_PYSSIZET, offsetof(BookTable, left), READONLY,
     "old slots still to visit after a doubling (moved a few on each insert), 0 when none"},
    {NULL, 0, 0, 0, NULL},
};

static PyObject *table_capacity(BookTable *t, void *closure) {
    return PyLong_FromSize_t(t->mask + 1);
}

static PyGetSetDef table_getset[] = {
    {"capacity", (getter)table_capacity, NULL, "slots of the table (it doubles when half of them hold books)", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyTypeObject BookTableType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "tape.replicas._audit.BookTable",
    .tp_basicsize = sizeof(BookTable),
    .tp_dealloc = (destructor)table_dealloc,
    .tp_as_mapping = &table_mapping,
    .tp_as_sequence = &table_sequence,
    .tp_iter = (getiterfunc)table_iter,
    .tp_richcompare = table_richcompare,
    .tp_hash = PyObject_HashNotImplemented,
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "order id -> book, in C (see the module's comment)",
    .tp_methods = table_methods,
    .tp_members = table_members,
    .tp_getset = table_getset,
    .tp_new = table_new,
};

/* --- books' expiry entries ---------------------------------------------------------------- */

/* (expires, order id, request seq) of each book opened, in stamp order: a book's entry lives as
 * long as it does (an hour by default), so an entry is 24 bytes in a block, not a tuple of three
 * ints (~170 bytes, built on every request); the queue grows and shrinks a block at a time and is
 * never copied whole. Reads as a deque of tuples: append, popleft, len, [i], iteration. */
typedef struct {
    uint64_t expires, order_id, seq;
} Due;

typedef struct {
    PyObject_HEAD
    Due **blocks;             /* blocks[first .. first + nblocks - 1] hold the entries */
    size_t cap, first, nblocks;
    size_t head, count;       /* the oldest entry's place in blocks[first]; entries held */
} ExpiryQueue;

static PyTypeObject ExpiryQueueType;

static Due *due_at(ExpiryQueue *q, size_t i) {
    size_t at = q->head + i;
    return &q->blocks[q->first + at / DUE_PER_BLOCK][at % DUE_PER_BLOCK];
}

static int due_push(ExpiryQueue *q, uint64_t expires, uint64_t order_id, uint64_t seq) {
    if (q->head + q->count == q->nblocks * DUE_PER_BLOCK) {  /* the last block is full: one more */
        if (q->first + q->nblocks == q->cap && q->first) {  /* room at the front: slide the pointers */
            memmove(q->blocks, q->blocks + q->first, q->nblocks * sizeof(Due *));
            q->first = 0;
        } else if (q->first + q->nblocks == q->cap) {
            size_t cap = q->cap ? q->cap * 2 : 8;
            Due **grown = PyMem_Realloc(q->blocks, cap * sizeof(Due *));
            if (grown == NULL) {
                PyErr_NoMemory();
                return -1;
            }
            q->blocks = grown;
            q->cap = cap;
        }
        Due *block = PyMem_Malloc(DUE_PER_BLOCK * sizeof(Due));
        if (block == NULL) {
            PyErr_NoMemory();
            return -1;
        }
        q->blocks[q->first + q->nblocks++] = block;
    }
    *due_at(q, q->count) = (Due){expires, order_id, seq};
    q->count++;
    return 0;
}

static PyObject *due_tuple(const Due *d) {
    return Py_BuildValue("(KKK)", (unsigned long long)d->expires, (unsigned long long)d->order_id,
                         (unsigned long long)d->seq);
}

static PyObject *queue_append(ExpiryQueue *q, PyObject *entry) {
    unsigned long long expires, order_id, seq;
    if (!PyArg_ParseTuple(entry, "KKK:append", &expires, &order_id, &seq)) return NULL;
    if (due_push(q, expires, order_id, seq) < 0) return NULL;
    Py_RETURN_NONE;
}

static PyObject *queue_popleft(ExpiryQueue *q, PyObject *unused) {
    if (q->count == 0) {
        PyErr_SetString(PyExc_IndexError, "pop from an empty expiry queue");
        return NULL;
    }
    PyObject *entry = due_tuple(due_at(q, 0));
    if (entry == NULL) return NULL;
    q->count--;
    if (++q->head == DUE_PER_BLOCK) {  /* the first block is spent */
        PyMem_Free(q->blocks[q->first++]);
        q->nblocks--;
        q->head = 0;
    }
    return entry;
}

static Py_ssize_t queue_len(ExpiryQueue *q) {
    return (Py_ssize_t)q->count;
}

static PyObject *queue_item(ExpiryQueue *q, Py_ssize_t i) {
    if (i < 0 || (size_t)i >= q->count) {
        PyErr_SetString(PyExc_IndexError, "expiry queue index out of range");
        return NULL;
    }
    return due_tuple(due_at(q, (size_t)i));
}

static void queue_dealloc(ExpiryQueue *q) {
    for (size_t i = 0; i < q->nblocks; i++) PyMem_Free(q->blocks[q->first + i]);
    PyMem_Free(q->blocks);
    Py_TYPE(q)->tp_free((PyObject *)q);
}

/* ExpiryQueue(entries=()): the entries, (expires, order id, seq) each, in their order. */
static PyObject *queue_new(PyTypeObject *type, PyObject *args, PyObject *kwds) {
    PyObject *entries = NULL;
    static char *kwlist[] = {"entries", NULL};
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "|O:ExpiryQueue", kwlist, &entries)) return NULL;
    ExpiryQueue *q = (ExpiryQueue *)type->tp_alloc(type, 0);
    PyObject *it = q == NULL || entries == NULL ? NULL : PyObject_GetIter(entries), *entry;
    if (it != NULL) {
        while ((entry = PyIter_Next(it)) != NULL) {
            PyObject *done = queue_append(q, entry);
            Py_DECREF(entry);
            if (done == NULL) break;
            Py_DECREF(done);
        }
        Py_DECREF(it);
    }
    if (PyErr_Occurred()) Py_CLEAR(q);
    return (PyObject *)q;
}

static PySequenceMethods queue_sequence = {.sq_length = (lenfunc)queue_len, .sq_item = (ssizeargfunc)queue_item};

static PyMethodDef queue_methods[] = {
    {"append", (PyCFunction)queue_append, METH_O, "append((expires, order_id, seq)) at the end"},
    {"popleft", (PyCFunction)queue_popleft, METH_NOARGS, "remove and return the first entry"},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject ExpiryQueueType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "tape.replicas._audit.ExpiryQueue",
    .tp_basicsize = sizeof(ExpiryQueue),
    .tp_dealloc = (destructor)queue_dealloc,
    .tp_as_sequence = &queue_sequence,
    .tp_hash = PyObject_HashNotImplemented,
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "books' expiry entries (expires, order id, seq) in stamp order, in C (see the module's comment)",
    .tp_methods = queue_methods,
    .tp_new = queue_new,
};

/* --- the common cases, from a packet's bytes ------------------------------------------------ */

#define AT_PURCHASE_ID 43
#define ALERT_RECORD 88     /* audit_core.py ALERT_RECORD: ">QQQQq16s8sqqQ" */

typedef struct {  /* one apply_fast call's context */
    BookTable *t;
    PyObject *orphans, *alerts;
    ExpiryQueue *expiry;
    uint64_t book_ttl, next_expiry;
    int expiry_empty;
    char *effects;  /* the digest's effect bytes of what was applied, for `codes` */
    size_t used, cap;
} Run;

static char *effect_space(Run *r, size_t n) {
    if (r->used + n > r->cap) {
        size_t cap = (r->used + n) * 2;
        char *grown = PyMem_Realloc(r->effects, cap);
        if (grown == NULL) {
            PyErr_NoMemory();
            return NULL;
        }
        r->effects = grown;
        r->cap = cap;
    }
    char *at = r->effects + r->used;
    r->used += n;
    return at;
}

static int effect(Run *r, char code) {
    char *at = effect_space(r, 1);
    if (at != NULL) *at = code;
    return at == NULL ? -1 : 0;
}

/* The purchase that first crosses its book: its alert record (audit_core.py's Alert.encode, byte for
 * byte), appended to the alerts, and its effect ('A' + the record). */
static int alert(Run *r, const Book *b, const unsigned char *m, uint64_t seq, uint64_t stamp) {
    unsigned char *rec = (unsigned char *)effect_space(r, 1 + ALERT_RECORD);
    if (rec == NULL) return -1;
    rec[0] = 'A';
    put_be64(rec + 1, seq);  /* emit seq */
    put_be64(rec + 9, seq);  /* purchase seq */
    put_be64(rec + 17, get_be64(m + AT_PURCHASE_ID));
    put_be64(rec + 25, b->order_id);
    put_be64(rec + 33, (uint64_t)b->requested);
    memcpy(rec + 41, b->client, CLIENT_LEN);
    memcpy(rec + 57, b->stock, STOCK_LEN);
    put_be64(rec + 65, (uint64_t)b->cumulative);
    put_be64(rec + 73, stamp);
    put_be64(rec + 81, 0);
    PyObject *record = PyBytes_FromStringAndSize((const char *)rec + 1, ALERT_RECORD);
    int rc = record == NULL ? -1 : PyList_Append(r->alerts, record);
    Py_XDECREF(record);
    return rc;
}

/* A purchase that fills its open book (crossing it or not); 1 if applied, 0 if the rules must take it
 * (a reject or a hold), -1 on error. */
static int purchase(Run *r, const unsigned char *m, uint64_t seq, uint64_t stamp) {
    uint64_t order_id = get_be64(m + AT_ORDER);
    int64_t shares = (int64_t)get_be64(m + AT_SHARES), total;
    Book *b = find(r->t, order_id);
    if (b == NULL || shares <= 0 || memcmp(b->client, m + AT_CLIENT, CLIENT_LEN) ||
        memcmp(b->stock, m + AT_STOCK, STOCK_LEN) || __builtin_add_overflow(b->cumulative, shares, &total))
        return 0;
    int crosses = total > b->requested && !b->alerted;
    if (crosses && stamp > INT64_MAX) return 0;  /* an alert's stamp is an i64: the rules refuse it */
    if (note_dirty(r->t, b) < 0) return -1;
    b->cumulative = total;
    if (!crosses) return effect(r, 'F') < 0 ? -1 : 1;
    b->alerted = 1;
    return alert(r, b, m, seq, stamp) < 0 ? -1 : 1;
}

/* A request that opens a new book (shares > 0, no purchases held for it); 1, 0 or -1 as above. */
static int request(Run *r, const unsigned char *m, uint64_t seq, uint64_t stamp) {
    uint64_t order_id = get_be64(m + AT_ORDER);
    int64_t shares = (int64_t)get_be64(m + AT_SHARES);
    if (shares <= 0 || stamp > UINT64_MAX - r->book_ttl || find(r->t, order_id) != NULL) return 0;
    if (PyDict_GET_SIZE(r->orphans)) {  /* purchases held for some order: is it this one? */
        PyObject *id = PyLong_FromUnsignedLongLong(order_id);
        int held = id == NULL ? -1 : PyDict_Contains(r->orphans, id);
        Py_XDECREF(id);
        if (held) return held < 0 ? -1 : 0;
    }
    Book *b;
    if (due_push(r->expiry, stamp + r->book_ttl, order_id, seq) < 0 || (b = insert(r->t, order_id)) == NULL ||
        note_dirty(r->t, b) < 0) return -1;
    b->requested = shares;
    b->opened_ns = stamp;
    b->request_seq = seq;
    memcpy(b->client, m + AT_CLIENT, CLIENT_LEN);
    memcpy(b->stock, m + AT_STOCK, STOCK_LEN);
    if (r->expiry_empty && stamp + r->book_ttl < r->next_expiry) r->next_expiry = stamp + r->book_ttl;
    r->expiry_empty = 0;
    return effect(r, 'O') < 0 ? -1 : 1;
}

/* apply_fast(books, codes, book_expiry, orphans, book_ttl, now, orphans_due, packet, index, end,
 *            seq, alerts) -> (applied, now): the records of the alerts raised are appended to `alerts`.
 * orphans_due: when the first orphan expires (2^64 - 1: none); the books' first expiry is read here
 * from their queue (handed over from Python it built a tuple a packet). */
static PyObject *apply_fast(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    /* (Its arguments read one by one, not by a format: a replica calls it at least once a packet, and
     * PyArg_ParseTuple's conversions were ~3,000 of the ~55,000 instructions of a packet's
     * way through a replica, callgrind.) */
    Run r = {0};
    PyObject *codes;
    unsigned long long book_ttl, now, next_due, seq;
    Py_buffer pkt;
    Py_ssize_t index, end, n = 0;
    if (nargs != 12) return PyErr_Format(PyExc_TypeError, "apply_fast takes 12 arguments (%zd given)", nargs);
    if (!Py_IS_TYPE(args[0], &BookTableType) || !PyByteArray_Check(args[1]) || !Py_IS_TYPE(args[2], &ExpiryQueueType)
        || !PyDict_Check(args[3]) || !PyList_Check(args[11])) {
        PyErr_SetString(PyExc_TypeError, "apply_fast: books, codes, book_expiry, orphans or alerts of another type");
        return NULL;
    }
    r.t = (BookTable *)args[0], codes = args[1], r.expiry = (ExpiryQueue *)args[2], r.orphans = args[3];
    r.alerts = args[11];
    book_ttl = PyLong_AsUnsignedLongLong(args[4]), now = PyLong_AsUnsignedLongLong(args[5]);
    next_due = PyLong_AsUnsignedLongLong(args[6]), seq = PyLong_AsUnsignedLongLong(args[10]);
    index = PyLong_AsSsize_t(args[8]), end = PyLong_AsSsize_t(args[9]);
    if (PyErr_Occurred() || PyObject_GetBuffer(args[7], &pkt, PyBUF_SIMPLE) < 0) return NULL;
    r.book_ttl = book_ttl;
    r.next_expiry = next_due;
    if (r.expiry->count && due_at(r.expiry, 0)->expires < r.next_expiry) r.next_expiry = due_at(r.expiry, 0)->expires;
    PyObject *result = NULL;
    if (index < 0 || end < index || HEADER_SIZE + end * BLOCK_SIZE > pkt.len) {
        PyErr_SetString(PyExc_ValueError, "message range outside the packet");
        goto done;
    }
    if (effect_space(&r, (size_t)(end - index) + 64) == NULL) goto done;
    r.used = 0;
    r.expiry_empty = r.expiry->count == 0;
    const unsigned char *p = (const unsigned char *)pkt.buf + HEADER_SIZE;
    for (; index + n < end; n++) {
        const unsigned char *m = p + (index + n) * BLOCK_SIZE;
        uint64_t stamp = get_be64(m + AT_STAMP);
        if (stamp > now) {
            if (r.next_expiry <= stamp) break;  /* an expiry falls due at this message */
            now = stamp;
        }
        int rc = m[2] == PURCHASE ? purchase(&r, m, seq + (uint64_t)n, stamp)
               : m[2] == REQUEST ? request(&r, m, seq + (uint64_t)n, stamp)
               : m[2] == SESSION_END ? 0
               : effect(&r, 'C') < 0 ? -1 : 1;  /* control: term start, time tick, seal */
        if (rc < 0) goto done;
        if (rc == 0) break;
    }
    Py_ssize_t had = PyByteArray_GET_SIZE(codes);
    if (PyByteArray_Resize(codes, had + (Py_ssize_t)r.used) < 0) goto done;
    memcpy(PyByteArray_AS_STRING(codes) + had, r.effects, r.used);
    PyObject *applied = PyLong_FromSsize_t(n), *clock = PyLong_FromUnsignedLongLong(now);
    result = applied && clock ? PyTuple_Pack(2, applied, clock) : NULL;
    Py_XDECREF(applied);
    Py_XDECREF(clock);
done:
    PyMem_Free(r.effects);
    PyBuffer_Release(&pkt);
    return result;
}

static PyMethodDef methods[] = {
    {"apply_fast", (PyCFunction)(void (*)(void))apply_fast, METH_FASTCALL, "the audit's common cases from a packet's bytes (see the module)"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_audit",
                                    "A replica's books in C and the audit's common cases", -1, methods};

PyMODINIT_FUNC PyInit__audit(void) {
    if (PyType_Ready(&BookTableType) < 0 || PyType_Ready(&ExpiryQueueType) < 0) return NULL;
    PyObject *mod = PyModule_Create(&module);
    if (mod == NULL) return NULL;
    if (PyModule_AddObjectRef(mod, "BookTable", (PyObject *)&BookTableType) < 0 ||
        PyModule_AddObjectRef(mod, "ExpiryQueue", (PyObject *)&ExpiryQueueType) < 0 ||
        PyModule_AddIntConstant(mod, "MAX_EXPECTED", MAX_EXPECTED) < 0 ||
        PyModule_AddIntConstant(mod, "MIN_CAPACITY", MIN_CAPACITY) < 0 ||
        PyModule_AddIntConstant(mod, "SLOT_BYTES", sizeof(Book)) < 0 ||
        PyModule_AddIntConstant(mod, "DUE_BYTES", sizeof(Due)) < 0) {
        Py_DECREF(mod);
        return NULL;
    }
    return mod;
}
