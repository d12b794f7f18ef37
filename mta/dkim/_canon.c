/* The two passes of DKIM canonicalisation that visit every byte of a body, in C.
 *
 * Why C: bytes methods scan at 1-2.5 GB/s, and the relaxed body and the
 * bare-LF check need four or five such scans of a 100 KB message (0.5 ms of
 * CPU, twice the RSA-2048 signature itself: docs/benchmarks.md, "DKIM
 * signing"). One pass here does each at memory speed. mta/dkim/canon.py
 * holds the same two functions in Python, used when this module was not
 * built, and the tests hold both to the same bytes as dkimpy's.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <string.h>
#ifdef __SSE2__
#include <emmintrin.h>
#endif

/* bare_lf(data) -> bool: does a LF appear that no CR precedes? */
static PyObject *
bare_lf(PyObject *module, PyObject *arg)
{
    Py_buffer view;
    if (PyObject_GetBuffer(arg, &view, PyBUF_SIMPLE) < 0)
        return NULL;
    const unsigned char *p = (const unsigned char *)view.buf;
    Py_ssize_t n = view.len, i = 0;
    int found = n > 0 && p[0] == '\n';
    Py_BEGIN_ALLOW_THREADS
    if (!found) {
        i = 1;
#ifdef __SSE2__
        /* 16 bytes at a time: a LF whose byte before is no CR */
        const __m128i lf = _mm_set1_epi8('\n'), cr = _mm_set1_epi8('\r');
        for (; i + 16 <= n; i += 16) {
            __m128i here = _mm_loadu_si128((const __m128i *)(p + i));
            __m128i before = _mm_loadu_si128((const __m128i *)(p + i - 1));
            if (_mm_movemask_epi8(_mm_andnot_si128(_mm_cmpeq_epi8(before, cr), _mm_cmpeq_epi8(here, lf)))) {
                found = 1;
                break;
            }
        }
#endif
        for (; !found && i < n; i++)
            found = p[i] == '\n' && p[i - 1] != '\r';
    }
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&view);
    return PyBool_FromLong(found);
}

/* Where the next run of WSP that relaxed_wsp changes begins, at or after i (n: none). A run is changed
 * when it holds a tab, is longer than one byte, or comes before a CR (a CRLF, or a lone CR: then the
 * caller keeps it): so its first byte is a tab, or a space before a space, a tab or a CR. Text has a
 * space every few bytes but such a run once a line or less, so 16 bytes are tested at a time. */
static Py_ssize_t
next_change(const unsigned char *in, Py_ssize_t i, Py_ssize_t n)
{
#ifdef __SSE2__
    const __m128i space = _mm_set1_epi8(' '), tab = _mm_set1_epi8('\t'), cr = _mm_set1_epi8('\r');
    while (i + 17 <= n) {
        __m128i here = _mm_loadu_si128((const __m128i *)(in + i));
        __m128i next = _mm_loadu_si128((const __m128i *)(in + i + 1));
        __m128i next_stops = _mm_or_si128(_mm_or_si128(_mm_cmpeq_epi8(next, space), _mm_cmpeq_epi8(next, tab)),
                                          _mm_cmpeq_epi8(next, cr));
        __m128i starts = _mm_or_si128(_mm_cmpeq_epi8(here, tab),
                                      _mm_and_si128(_mm_cmpeq_epi8(here, space), next_stops));
        int mask = _mm_movemask_epi8(starts);
        if (mask != 0)
            return i + __builtin_ctz((unsigned)mask);
        i += 16;
    }
#endif
    for (; i < n; i++) {
        unsigned char c = in[i];
        if (c == '\t')
            return i;
        if (c == ' ' && i + 1 < n && (in[i + 1] == ' ' || in[i + 1] == '\t' || in[i + 1] == '\r'))
            return i;
    }
    return n;
}

/* relaxed_wsp(body) -> bytes: each run of spaces and tabs as one space, and none before a CRLF
 * (RFC 6376 section 3.4.4 a and b; the trailing empty lines are the caller's). The same object back
 * when nothing changes. */
static PyObject *
relaxed_wsp(PyObject *module, PyObject *arg)
{
    Py_buffer view;
    if (PyObject_GetBuffer(arg, &view, PyBUF_SIMPLE) < 0)
        return NULL;
    const unsigned char *in = (const unsigned char *)view.buf;
    Py_ssize_t n = view.len;
    Py_ssize_t i;
    Py_BEGIN_ALLOW_THREADS  /* a large body in a signing thread: the event loop runs meanwhile */
    i = next_change(in, 0, n);
    Py_END_ALLOW_THREADS
    if (i == n && PyBytes_CheckExact(arg)) {
        PyBuffer_Release(&view);
        Py_INCREF(arg);
        return arg;
    }
    PyObject *result = PyBytes_FromStringAndSize(NULL, n);
    if (result == NULL) {
        PyBuffer_Release(&view);
        return NULL;
    }
    unsigned char *out = (unsigned char *)PyBytes_AS_STRING(result);
    Py_ssize_t done = 0, o = 0;  /* in[done:i] is copied as it is; in[i] begins a run to change */
    Py_BEGIN_ALLOW_THREADS
    while (1) {
        memcpy(out + o, in + done, (size_t)(i - done));
        o += i - done;
        if (i == n)
            break;
        while (i < n && (in[i] == ' ' || in[i] == '\t'))
            i++;
        if (!(i + 1 < n && in[i] == '\r' && in[i + 1] == '\n'))
            out[o++] = ' ';
        done = i;
        i = next_change(in, i, n);
    }
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&view);
    if (o != n && _PyBytes_Resize(&result, o) < 0)
        return NULL;
    return result;
}

static PyMethodDef methods[] = {
    {"bare_lf", bare_lf, METH_O, "Does a LF appear that no CR precedes?"},
    {"relaxed_wsp", relaxed_wsp, METH_O,
     "Each run of spaces and tabs as one space, and none before a CRLF."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "mta.dkim._canon", NULL, 0, methods,
};

PyMODINIT_FUNC
PyInit__canon(void)
{
    return PyModule_Create(&module);
}
