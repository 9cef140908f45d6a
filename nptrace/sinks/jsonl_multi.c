/* jsonl.verdict_line's general path compiled (issue #16 item 3), part of jsonl_fast: the
 * line of an incident of several events (a storm's mix: the SYN's drop, the reset, the RST on
 * the wire, its drop at the client). In Python it was ~78k instructions a line, a third of
 * the mix's pipeline.
 *
 * The same text, from the same caches of encoded fragments (_HEADS, _VALS, _EVID, _HINTS:
 * looked up here, filled by jsonl.py's own _head, _val, _evid on a miss), and the same
 * Context lookups in the same order (iface_name of each evidence event with an ifindex).
 * Before any lookup it checks everything it will write; what it does not write (conntrack,
 * an outer header, IPv6, pods, a NAT mapping, a value of another type, the one-event line,
 * more than MAX_EVIDENCE events) it declines with None, and jsonl.py writes it.
 */
#include "jsonl_fast.h"

enum { E_TS = 0, E_HOOK = 2, E_IFINDEX = 5, E_NETNS = 6, E_SADDR = 8, E_SPORT = 9,
       E_DADDR = 10, E_DPORT = 11, E_CT = 23, E_OUTER_SADDR = 24, E_NFIELDS = 28 };
enum { L_EV = 0, L_RNAME = 1, L_CAUSE = 2, L_NFIELDS = 5 };
#define MAX_EV 16                       /* verdict.MAX_EVIDENCE, checked at configure */
#define PIECES (24 + 16 * MAX_EV)

enum { A_EVENT, A_LABELED, A_EVENTS, A_CONF, A_PODS, A_NATMAP, A_CTX, A_IFACE_NAME, A_KIND,
       A_DIRECTION, A_HOOK, A_REASON, A_CAUSE, A_SERVICE, A_IFACE, A_HINT, A_N };
static const char *const ANAMES[A_N] = {
	"event", "labeled", "events", "confidence", "pods", "natmap", "ctx", "iface_name", "kind",
	"direction", "hook", "reason", "cause", "service", "iface", "hint",
};

static struct {
	PyObject *heads, *head_fn, *vals, *val_fn, *evid, *evid_fn, *hints, *remember, *esc;
	PyObject *no_ctx, *empty;
	PyObject *a[A_N];
	int ready;
} M;

#define SET(slot, v) do { Py_INCREF(v); Py_XSETREF(M.slot, v); } while (0)

/* multi_configure(_HEADS, _head, _VALS, _val, _EVID, _evid, _HINTS, _remember, _esc, _NO_CTX,
 *                 MAX_EVIDENCE) */
PyObject *multi_configure(PyObject *self, PyObject *args)
{
	PyObject *heads, *head_fn, *vals, *val_fn, *evid, *evid_fn, *hints, *rem, *esc, *noctx;
	int max_ev;
	if (!PyArg_ParseTuple(args, "O!OO!OO!OO!OOOi", &PyDict_Type, &heads, &head_fn,
			      &PyDict_Type, &vals, &val_fn, &PyDict_Type, &evid, &evid_fn,
			      &PyDict_Type, &hints, &rem, &esc, &noctx, &max_ev))
		return NULL;
	if (max_ev != MAX_EV) {
		PyErr_Format(PyExc_ValueError, "MAX_EVIDENCE is %d here, %d in verdict.py", MAX_EV,
			     max_ev);
		return NULL;
	}
	for (int i = 0; i < A_N; i++)
		if (M.a[i] == NULL && (M.a[i] = PyUnicode_InternFromString(ANAMES[i])) == NULL)
			return NULL;
	if (M.empty == NULL && (M.empty = PyUnicode_FromString("")) == NULL)
		return NULL;
	SET(heads, heads);
	SET(head_fn, head_fn);
	SET(vals, vals);
	SET(val_fn, val_fn);
	SET(evid, evid);
	SET(evid_fn, evid_fn);
	SET(hints, hints);
	SET(remember, rem);
	SET(esc, esc);
	SET(no_ctx, noctx);
	M.ready = 1;
	Py_RETURN_NONE;
}

/* cache.get(key), else fn(*args) (which fills the cache): a new reference or NULL. A key that
 * is not hashable goes to fn, which raises or writes what verdict_line writes. */
static PyObject *cached(PyObject *cache, PyObject *key, PyObject *fn, PyObject *args)
{
	PyObject *got = key ? PyDict_GetItemWithError(cache, key) : NULL;
	if (got != NULL)
		return Py_NewRef(got);
	if (PyErr_Occurred()) {
		if (!PyErr_ExceptionMatches(PyExc_TypeError))
			return NULL;
		PyErr_Clear();
	}
	return PyObject_Call(fn, args, NULL);
}

static int exact_ints(PyObject *e, const int *idx, int n)
{
	for (int i = 0; i < n; i++)
		if (!PyLong_CheckExact(PyTuple_GET_ITEM(e, idx[i])))
			return 0;
	return 1;
}

/* An Event of the general path: a tuple of its fields, no conntrack entry, the values it
 * writes of the types it writes them as */
static int plain_event(PyObject *x)
{
	static const int ints[] = {E_TS, E_SPORT, E_DPORT, E_IFINDEX};
	return PyTuple_Check(x) && PyTuple_GET_SIZE(x) == E_NFIELDS
	       && PyTuple_GET_ITEM(x, E_CT) == Py_None && exact_ints(x, ints, 4)
	       && PyUnicode_CheckExact(PyTuple_GET_ITEM(x, E_SADDR))
	       && PyUnicode_CheckExact(PyTuple_GET_ITEM(x, E_DADDR));
}

PyObject *multi(PyObject *v, PyObject *offset, PyObject *prefix)
{
	PyObject *at[A_N] = {NULL};
	PyObject *res = NULL, *seq = NULL, *xiface[MAX_EV] = {NULL}, *pp[MAX_EV] = {NULL};
	PyObject *head = NULL, *val = NULL, *hint = NULL, *iface_fn = NULL, *key = NULL;
	char *ts = NULL, *xts[MAX_EV] = {NULL};
	Py_ssize_t n = 0;
	if (!M.ready) {
		PyErr_SetString(PyExc_RuntimeError, "configure() first");
		return NULL;
	}
	static const int first[] = {A_EVENT, A_LABELED, A_EVENTS, A_CONF, A_PODS, A_NATMAP};
	for (int i = 0; i < 6; i++)
		if ((at[first[i]] = vget(v, M.a[first[i]])) == NULL)
			goto out;
	PyObject *e = at[A_EVENT], *events = at[A_EVENTS];
	/* verdict_line's conditions for its general path, and this one's own (types, sizes) */
	if (!PyLong_CheckExact(offset) || !PyLong_CheckExact(events)
	    || !PyFloat_CheckExact(at[A_CONF]) || at[A_NATMAP] != Py_None
	    || !PyTuple_Check(e) || PyTuple_GET_SIZE(e) != E_NFIELDS
	    || PyTuple_GET_ITEM(e, E_OUTER_SADDR) != Py_None || !plain_event(e)
	    || !PyLong_CheckExact(PyTuple_GET_ITEM(e, E_NETNS)))
		goto other;
	PyObject *sa = PyTuple_GET_ITEM(e, E_SADDR), *da = PyTuple_GET_ITEM(e, E_DADDR);
	if (PyUnicode_FindChar(sa, ':', 0, PyUnicode_GET_LENGTH(sa), 1) != -1)
		goto other;
	int t = PyObject_IsTrue(at[A_PODS]);
	if (t < 0)
		goto out;
	if (t)
		goto other;
	seq = PySequence_Fast(at[A_LABELED], "Verdict.labeled");
	if (seq == NULL)
		goto out;
	n = PySequence_Fast_GET_SIZE(seq);
	if (n > MAX_EV || n == 0)
		goto other;
	for (Py_ssize_t i = 0; i < n; i++) {
		PyObject *l = PySequence_Fast_GET_ITEM(seq, i);
		if (!PyTuple_Check(l) || PyTuple_GET_SIZE(l) != L_NFIELDS
		    || !plain_event(PyTuple_GET_ITEM(l, L_EV)))
			goto other;
	}
	if (n == 1 && PyTuple_GET_ITEM(PySequence_Fast_GET_ITEM(seq, 0), L_EV) == e)
		goto other;                     /* the one-event line: one()'s, or Python's */

	/* the general path: from here on it writes the line */
	if ((at[A_CTX] = vget(v, M.a[A_CTX])) == NULL || (t = PyObject_IsTrue(at[A_CTX])) < 0)
		goto out;
	if (!t)
		Py_SETREF(at[A_CTX], Py_NewRef(M.no_ctx));
	if ((iface_fn = PyObject_GetAttr(at[A_CTX], M.a[A_IFACE_NAME])) == NULL)
		goto out;
	if ((ts = epoch_seconds(PyTuple_GET_ITEM(e, E_TS), offset)) == NULL)
		goto out;
	for (Py_ssize_t i = 0; i < n; i++) {
		PyObject *l = PySequence_Fast_GET_ITEM(seq, i), *x = PyTuple_GET_ITEM(l, L_EV);
		PyObject *ifx = PyTuple_GET_ITEM(x, E_IFINDEX);
		PyObject *cause = PyTuple_GET_ITEM(l, L_CAUSE), *label;
		if ((t = PyObject_IsTrue(ifx)) < 0)
			goto out;
		xiface[i] = t ? PyObject_CallFunctionObjArgs(iface_fn, PyTuple_GET_ITEM(x, E_NETNS),
							     ifx, NULL)
			      : Py_NewRef(Py_None);
		if (xiface[i] == NULL || (t = PyObject_IsTrue(cause)) < 0)
			goto out;
		label = t ? cause : M.empty;
		key = PyTuple_Pack(4, PyTuple_GET_ITEM(x, E_HOOK), PyTuple_GET_ITEM(l, L_RNAME),
				   xiface[i], label);
		if (key == NULL)
			goto out;
		pp[i] = cached(M.evid, key, M.evid_fn, key);
		Py_CLEAR(key);
		if (pp[i] == NULL)
			goto out;
		if (!PyTuple_Check(pp[i]) || PyTuple_GET_SIZE(pp[i]) != 2) {
			PyErr_SetString(PyExc_TypeError, "an evidence fragment is not (pre, post)");
			goto out;
		}
		t = PyObject_RichCompareBool(PyTuple_GET_ITEM(x, E_TS), PyTuple_GET_ITEM(e, E_TS), Py_EQ);
		if (t < 0)
			goto out;
		if (!t && (xts[i] = epoch_seconds(PyTuple_GET_ITEM(x, E_TS), offset)) == NULL)
			goto out;
	}
	static const int hk[] = {A_KIND, A_DIRECTION, A_HOOK, A_REASON, A_CAUSE, A_SERVICE,
				 A_IFACE, A_HINT};
	for (int i = 0; i < 8; i++)
		if ((at[hk[i]] = vget(v, M.a[hk[i]])) == NULL)
			goto out;
	/* _head(v): by (kind, direction, hook, reason, cause, confidence, service) */
	key = PyTuple_Pack(7, at[A_KIND], at[A_DIRECTION], at[A_HOOK], at[A_REASON], at[A_CAUSE],
			   at[A_CONF], at[A_SERVICE]);
	PyObject *vargs = key ? PyTuple_Pack(1, v) : NULL;
	head = vargs ? cached(M.heads, key, M.head_fn, vargs) : NULL;
	Py_XDECREF(vargs);
	Py_CLEAR(key);
	if (head == NULL)
		goto out;
	PyObject *iargs = PyTuple_Pack(1, at[A_IFACE]);
	val = iargs ? cached(M.vals, at[A_IFACE], M.val_fn, iargs) : NULL;
	Py_XDECREF(iargs);
	if (val == NULL)
		goto out;
	hint = PyDict_GetItemWithError(M.hints, at[A_HINT]);
	if (hint != NULL) {
		Py_INCREF(hint);
	} else {
		if (PyErr_Occurred())
			goto out;
		PyObject *esc = PyObject_CallOneArg(M.esc, at[A_HINT]);
		if (esc == NULL)
			goto out;
		hint = PyObject_CallFunctionObjArgs(M.remember, M.hints, at[A_HINT], esc, NULL);
		Py_DECREF(esc);
		if (hint == NULL)
			goto out;
	}

	/* f'{prefix}"ts":{ts}{_head(v)}{_esc(e.saddr)},"sport":{e.sport},"daddr":{_esc(e.daddr)},'
	 * f'"dport":{e.dport},"netns":{e.netns},"iface":{_val(v.iface)},"ifindex":{e.ifindex},'
	 * f'"hint":{h},"events":{events},"evidence":[{",".join(parts)}],"repeat":1}' */
	char quote[] = "\"";
	struct piece pieces[PIECES];
	struct line ln = {.p = pieces, .cap = PIECES, .n = 0, .len = 0, .ascii = 1, .nown = 0};
	char nb[5][24], xb[MAX_EV][3][24];
	struct piece sp, dp, ns, ix, ev, xp[MAX_EV][3];
	if (decimal(PyTuple_GET_ITEM(e, E_SPORT), nb[0], &sp, &ln)
	    || decimal(PyTuple_GET_ITEM(e, E_DPORT), nb[1], &dp, &ln)
	    || decimal(PyTuple_GET_ITEM(e, E_NETNS), nb[2], &ns, &ln)
	    || decimal(PyTuple_GET_ITEM(e, E_IFINDEX), nb[3], &ix, &ln)
	    || decimal(events, nb[4], &ev, &ln))
		goto line_fail;
	if (put_s(&ln, prefix))
		goto line_fail;
	put_c(&ln, "\"ts\":");
	put_c(&ln, ts);
	if (put_s(&ln, head) || put_esc(&ln, sa, quote))
		goto line_fail;
	put_c(&ln, ",\"sport\":");
	put_p(&ln, &sp);
	put_c(&ln, ",\"daddr\":");
	if (put_esc(&ln, da, quote))
		goto line_fail;
	put_c(&ln, ",\"dport\":");
	put_p(&ln, &dp);
	put_c(&ln, ",\"netns\":");
	put_p(&ln, &ns);
	put_c(&ln, ",\"iface\":");
	if (put_s(&ln, val))
		goto line_fail;
	put_c(&ln, ",\"ifindex\":");
	put_p(&ln, &ix);
	put_c(&ln, ",\"hint\":");
	if (put_s(&ln, hint))
		goto line_fail;
	put_c(&ln, ",\"events\":");
	put_p(&ln, &ev);
	put_c(&ln, ",\"evidence\":[");
	for (Py_ssize_t i = 0; i < n; i++) {
		PyObject *x = PyTuple_GET_ITEM(PySequence_Fast_GET_ITEM(seq, i), L_EV);
		PyObject *xs = PyTuple_GET_ITEM(x, E_SPORT), *xd = PyTuple_GET_ITEM(x, E_DPORT);
		if (decimal(PyTuple_GET_ITEM(x, E_TS), xb[i][0], &xp[i][0], &ln)
		    || decimal(xs, xb[i][1], &xp[i][1], &ln) || decimal(xd, xb[i][2], &xp[i][2], &ln))
			goto line_fail;
		put_c(&ln, i ? ",{\"ts_ns\":" : "{\"ts_ns\":");
		put_p(&ln, &xp[i][0]);
		put_c(&ln, ",\"ts\":");
		put_c(&ln, xts[i] ? xts[i] : ts);
		if (put_s(&ln, PyTuple_GET_ITEM(pp[i], 0))
		    || put_detail(&ln, PyTuple_GET_ITEM(x, E_SADDR), &xp[i][1],
				  PyTuple_GET_ITEM(x, E_DADDR), &xp[i][2], xs, xd, quote)
		    || put_s(&ln, PyTuple_GET_ITEM(pp[i], 1)))
			goto line_fail;
	}
	put_c(&ln, "],\"repeat\":1}");
	res = finish(&ln);
	goto out;
line_fail:
	for (int i = 0; i < ln.nown; i++)
		Py_DECREF(ln.own[i]);
	goto out;
other:
	res = Py_NewRef(Py_None);
out:
	PyMem_Free(ts);
	for (Py_ssize_t i = 0; i < MAX_EV; i++) {
		PyMem_Free(xts[i]);
		Py_XDECREF(xiface[i]);
		Py_XDECREF(pp[i]);
	}
	for (int i = 0; i < A_N; i++)
		Py_XDECREF(at[i]);
	Py_XDECREF(seq);
	Py_XDECREF(head);
	Py_XDECREF(val);
	Py_XDECREF(hint);
	Py_XDECREF(iface_fn);
	Py_XDECREF(key);
	return res;
}
