/* Kept in C: Python's socket module has no recvmmsg or sendmmsg.
 *
 * Datagrams in and out a batch per system call (recvmmsg, sendmmsg): the
 * shells' per-packet socket calls, each the same as the Python loop beside
 * its dispatch in runtime/mmsg.py (the definition and the fallback where
 * Tape was built without a compiler); tests/test_mmsg.py holds each pair
 * equal on real sockets.
 *
 *   recv_datagrams  up to `limit` datagrams waiting on a non-blocking socket
 *   send_datagrams  each datagram of a list to one IPv4 address; how many
 *                   the kernel refused (a refused one is skipped, the rest
 *                   still go, as one send each would)
 *
 * The GIL is held throughout: both calls never wait (MSG_DONTWAIT), and the
 * receive slots are one static buffer.
 */
#define _GNU_SOURCE
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <arpa/inet.h>
#include <errno.h>
#include <netinet/in.h>
#include <string.h>
#include <sys/socket.h>

#define PER_CALL 64        /* datagrams one recvmmsg or sendmmsg moves */
#define SLOT_BYTES 65536   /* any UDP payload fits (protocol/limits.py's DATAGRAM_BUFFER) */

static char slots[PER_CALL][SLOT_BYTES];

static PyObject *recv_datagrams(PyObject *self, PyObject *args) {
    int fd;
    Py_ssize_t limit;
    if (!PyArg_ParseTuple(args, "in", &fd, &limit))
        return NULL;
    PyObject *out = PyList_New(0);
    if (out == NULL)
        return NULL;
    struct mmsghdr msgs[PER_CALL];
    struct iovec iov[PER_CALL];
    while (PyList_GET_SIZE(out) < limit) {
        Py_ssize_t want = limit - PyList_GET_SIZE(out);
        unsigned int n = want < PER_CALL ? (unsigned int)want : PER_CALL;
        memset(msgs, 0, sizeof(msgs[0]) * n);
        for (unsigned int i = 0; i < n; i++) {
            iov[i].iov_base = slots[i];
            iov[i].iov_len = SLOT_BYTES;
            msgs[i].msg_hdr.msg_iov = &iov[i];
            msgs[i].msg_hdr.msg_iovlen = 1;
        }
        int got = recvmmsg(fd, msgs, n, MSG_DONTWAIT, NULL);
        if (got < 0) {
            if (errno == EINTR)
                continue;
            if (errno == EAGAIN || errno == EWOULDBLOCK || PyList_GET_SIZE(out) > 0)
                break; /* an error behind datagrams already read is the next call's */
            Py_DECREF(out);
            return PyErr_SetFromErrno(PyExc_OSError);
        }
        for (int i = 0; i < got; i++) {
            PyObject *data = PyBytes_FromStringAndSize(slots[i], msgs[i].msg_len);
            if (data == NULL || PyList_Append(out, data) < 0) {
                Py_XDECREF(data);
                Py_DECREF(out);
                return NULL;
            }
            Py_DECREF(data);
        }
        if ((unsigned int)got < n)
            break; /* the socket is empty */
    }
    return out;
}

static PyObject *send_datagrams(PyObject *self, PyObject *args) {
    int fd, port;
    PyObject *datagrams;
    const char *host;
    if (!PyArg_ParseTuple(args, "iO!si", &fd, &PyList_Type, &datagrams, &host, &port))
        return NULL;
    struct sockaddr_in to;
    memset(&to, 0, sizeof to);
    to.sin_family = AF_INET;
    to.sin_port = htons((uint16_t)port);
    if (port < 0 || port > 65535 || inet_pton(AF_INET, host, &to.sin_addr) != 1) {
        PyErr_Format(PyExc_ValueError, "not an IPv4 address and port: %s:%d", host, port);
        return NULL;
    }
    Py_ssize_t total = PyList_GET_SIZE(datagrams), at = 0, refused = 0;
    for (Py_ssize_t i = 0; i < total; i++)
        if (!PyBytes_Check(PyList_GET_ITEM(datagrams, i))) {
            PyErr_SetString(PyExc_TypeError, "datagrams must be bytes");
            return NULL;
        }
    struct mmsghdr msgs[PER_CALL];
    struct iovec iov[PER_CALL];
    while (at < total) {
        unsigned int n = total - at < PER_CALL ? (unsigned int)(total - at) : PER_CALL;
        memset(msgs, 0, sizeof(msgs[0]) * n);
        for (unsigned int i = 0; i < n; i++) {
            PyObject *data = PyList_GET_ITEM(datagrams, at + i);
            iov[i].iov_base = PyBytes_AS_STRING(data);
            iov[i].iov_len = PyBytes_GET_SIZE(data);
            msgs[i].msg_hdr.msg_iov = &iov[i];
            msgs[i].msg_hdr.msg_iovlen = 1;
            msgs[i].msg_hdr.msg_name = &to;
            msgs[i].msg_hdr.msg_namelen = sizeof to;
        }
        int sent = sendmmsg(fd, msgs, n, MSG_DONTWAIT);
        if (sent < 0) {
            if (errno == EINTR)
                continue;
            refused++; /* the first of these refused: count it, go on with the next */
            at++;
        } else {
            at += sent;
        }
    }
    return PyLong_FromSsize_t(refused);
}

static PyMethodDef methods[] = {
    {"recv_datagrams", recv_datagrams, METH_VARARGS,
     "recv_datagrams(fd, limit): up to limit datagrams waiting on a non-blocking socket (runtime/mmsg.py)."},
    {"send_datagrams", send_datagrams, METH_VARARGS,
     "send_datagrams(fd, datagrams, host, port): how many of them the kernel refused (runtime/mmsg.py)."},
    {NULL, NULL, 0, NULL}};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_mmsg",
                                    "Datagrams a batch per system call (each beside its Python definition).",
                                    -1, methods};

PyMODINIT_FUNC PyInit__mmsg(void) { return PyModule_Create(&module); }
