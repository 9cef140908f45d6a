/* What the sources of nptrace.sinks.jsonl_fast share: jsonl_fast.c (the one-event line, the
 * module), jsonl_multi.c (the line of an incident of several events) and jsonl_seconds.c
 * (a line's `ts`). */
#ifndef NPTRACE_JSONL_FAST_H
#define NPTRACE_JSONL_FAST_H
#define PY_SSIZE_T_CLEAN
#include <Python.h>

/* The pieces of a line, joined at the end: borrowed str objects or C text. */
struct piece {
	const char *text;
	Py_ssize_t len;
	PyObject *obj;          /* the str it is, borrowed; NULL for C text */
};

#define LINE_OWN 96      /* a line of MAX_EVIDENCE events keeps at most 87 */

struct line {
	struct piece *p;        /* the caller's array of cap pieces */
	int cap;
	int n;
	int full;               /* a piece did not fit: finish() raises */
	Py_ssize_t len;
	int ascii;
	PyObject *own[LINE_OWN];   /* references the pieces point into */
	int nown;
};

int plain_ascii(PyObject *s);
void put(struct line *l, const char *text, Py_ssize_t len);
void put_c(struct line *l, const char *text);
int put_s(struct line *l, PyObject *s);
int keep(struct line *l, PyObject *o);
int put_esc(struct line *l, PyObject *s, char *quote);
void put_p(struct line *l, const struct piece *p);
int decimal(PyObject *x, char *buf, struct piece *out, struct line *l);
int put_detail(struct line *ln, PyObject *sa, const struct piece *sp, PyObject *da,
	       const struct piece *dp, PyObject *spo, PyObject *dpo, char *quote);
PyObject *finish(struct line *l);

/* jsonl_multi.c */
PyObject *multi_configure(PyObject *self, PyObject *args);
/* verdict_line(v, offset, 1, None, None, prefix) of an incident of several events, or None
 * (nothing looked up) where its own path does not apply, or NULL with an exception */
PyObject *multi(PyObject *v, PyObject *offset, PyObject *prefix);

/* getattr(v, name) (name interned), a Verdict's slot read at its offset */
PyObject *vget(PyObject *v, PyObject *name);

/* jsonl_seconds.c: repr((ts_ns + offset) / 1e9) as PyMem text, or NULL with an exception */
char *epoch_seconds(PyObject *ts_ns, PyObject *offset);
int seconds_repr(double x, char *buf);
PyObject *seconds_repr_py(PyObject *self, PyObject *arg);
#endif
