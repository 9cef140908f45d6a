/* What the two sources of nptrace.classify.correlate_fast share: correlate_fast.c (_one, the
 * Verdict of a one-record incident) and feed_fast.c (Classifier.feed_many's loop). */
#ifndef NPTRACE_CORRELATE_FAST_H
#define NPTRACE_CORRELATE_FAST_H
#define PY_SSIZE_T_CLEAN
#include <Python.h>

/* The Context lookups correlate._one asks, as ctx's attributes: read once for a batch of
 * incidents (feed_many's evictions) instead of by name for each (~150 instructions a name). */
struct one_lookups {
	PyObject *iface_name, *service_of, *endpoint_of, *pod_of, *pod_of_netns;
};
/* ctx's five lookups into lk (new references), 0; or -1 with an exception and lk cleared */
int one_lookups_read(PyObject *ctx, struct one_lookups *lk);
void one_lookups_clear(struct one_lookups *lk);

/* correlate._one(primary, events, ctx, nat): a new reference, or NULL with an exception.
 * lk: ctx's lookups as one_lookups_read gave them, or NULL to read them here. */
PyObject *correlate_one(PyObject *primary, PyObject *events, PyObject *ctx, PyObject *nat,
			const struct one_lookups *lk);

PyObject *feed_configure(PyObject *self, PyObject *args);
PyObject *feed_many(PyObject *self, PyObject *args);
#endif
