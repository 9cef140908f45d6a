/* What the two sources of nptrace.classify.correlate_fast share: correlate_fast.c (_one, the
 * Verdict of a one-record incident) and feed_fast.c (Classifier.feed_many's loop). */
#ifndef NPTRACE_CORRELATE_FAST_H
#define NPTRACE_CORRELATE_FAST_H
#define PY_SSIZE_T_CLEAN
#include <Python.h>

/* correlate._one(primary, events, ctx, nat): a new reference, or NULL with an exception */
PyObject *correlate_one(PyObject *primary, PyObject *events, PyObject *ctx, PyObject *nat);

PyObject *feed_configure(PyObject *self, PyObject *args);
PyObject *feed_many(PyObject *self, PyObject *args);
#endif
