/* Classifier.feed_many's loop compiled (issue #16 item 3), part of correlate_fast.
 *
 * A storm's record is a new one-record flow: key, Flow, label from the memo, the time queues,
 * and past max_flows the oldest flow evicted with its one-record Verdict (correlate_one). In
 * the interpreter that loop was ~17k instructions a record of the pipeline's ~67k. This is
 * the same loop, statement for statement (correlate.py's Classifier._feed_many_py is the
 * reference, tests/unit/test_native_feed.py compares the two on the same streams): the same
 * Context calls in the same order (nat_peer, drop_name, rst_name, reason_name; sessions
 * record them), the same objects made. What is rare calls back into Python: tick, _flow_of
 * (several keys: NAT), _report (an incident of more than one record), the memo's miss, the
 * rules. Before such a call the loop's copies of the classifier's clock and queue heads
 * (now_ns, _due_ns, _hs, _hw, _hf) are written back, and read again after it.
 *
 * Flow's fields are its __slots__, read and written at their offsets (the member descriptors
 * say where); only Flow itself is taken. Times are C integers while they fit in 62 bits; a
 * value that does not (a hostile session) sends the rest of the batch to the Python loop, and
 * a queue head whose time does not makes the next event tick (ticking is always exact: the
 * skipped ticks are the ones that cannot report anything).
 */
#include "correlate_fast.h"
#include "../slots.h"
#include <stdint.h>

enum { E_TS = 0, E_TYPE = 1, E_REASON = 7, E_SADDR = 8, E_SPORT = 9, E_DADDR = 10,
       E_DPORT = 11, E_CT = 23, E_NFIELDS = 28 };
enum { F_KEYS, F_PENDING, F_EXTRA, F_FIRST, F_LAST, F_ROOT, F_STRONG, F_NAT, F_N };
static const char *const FNAMES[F_N] = { "keys", "pending", "extra", "first_ns", "last_ns",
					 "root", "strong", "nat" };
#define DUE_NOW INT64_MIN       /* _NEVER_VALID: tick before the next event */
#define DUE_NEVER INT64_MAX     /* _NEVER: nothing queued */
#define TIME_MAX ((int64_t)1 << 62)

static struct {
	PyTypeObject *flow, *labeled;
	Py_ssize_t off[F_N];
	long t_drop, t_rst_sent;
	Py_ssize_t max_kept;
	PyObject *evidence_only, *type_rnames, *reason_name, *nat_bits, *weak_causes, *rank;
	PyObject *rules_of, *run_rules, *peer, *key, *mapping, *never, *never_valid;
	PyObject *zero, *one, *fzero, *empty, *no_args;
	PyObject *s[40];
	int ready;
} F;

/* interned attribute and method names, by position in F.s */
enum { S_CTX, S_KEYS, S_FLOWS, S_STRONG, S_WEAK, S_RULES, S_MEMO, S_ROOTS, S_NOW, S_DUE, S_HS,
       S_HW, S_HF, S_MAX_FLOWS, S_NAT_PEER, S_DROP_NAME, S_RST_NAME, S_HOLD, S_MAX_HOLD,
       S_WINDOW, S_STATUS, S_ODPORT, S_OSRC, S_OSPORT, S_ODST, S_RSRC, S_RSPORT, S_RDST,
       S_RDPORT, S_MOVE, S_TICK, S_FLOW_OF, S_REPORT, S_PY, S_LABEL, S_N };
static const char *const SNAMES[S_N] = {
	"ctx", "keys", "flows", "strong", "weak", "_rules", "memo", "roots", "now_ns", "_due_ns",
	"_hs", "_hw", "_hf", "max_flows", "nat_peer", "drop_name", "rst_name", "hold_ns",
	"max_hold_ns", "window_ns", "status", "orig_dport", "orig_src", "orig_sport", "orig_dst",
	"reply_src", "reply_sport", "reply_dst", "reply_dport", "move_to_end", "tick",
	"_flow_of", "_report", "_feed_many_py", "label",
};

#define SLOT(f, i) (*(PyObject **)((char *)(f) + F.off[i]))
#define SET(slot, v) do { Py_INCREF(v); Py_XSETREF(F.slot, v); } while (0)

/* configure_feed(Flow, Labeled, T_DROP, T_RST_SENT, MAX_KEPT, EVIDENCE_ONLY, _TYPE_RNAMES,
 *                reason_name, _NAT, WEAK_CAUSES, RANK, _rules_of, run_rules, _peer, _key,
 *                _mapping, _NEVER, _NEVER_VALID) */
PyObject *feed_configure(PyObject *self, PyObject *args)
{
	PyObject *flow, *labeled, *ev_only, *rnames, *rname, *nat, *weak, *rank, *rules_of,
		 *run_rules, *peer, *key, *mapping, *never, *never_valid;
	long t_drop, t_rst;
	Py_ssize_t kept;
	if (!PyArg_ParseTuple(args, "O!O!llnOO!OOOOOOOOOOO", &PyType_Type, &flow, &PyType_Type,
			      &labeled, &t_drop, &t_rst, &kept, &ev_only, &PyDict_Type, &rnames,
			      &rname, &nat, &weak, &rank, &rules_of, &run_rules, &peer, &key,
			      &mapping, &never, &never_valid))
		return NULL;
	for (int i = 0; i < F_N; i++)
		if ((F.off[i] = slot_offset((PyTypeObject *)flow, FNAMES[i])) < 0)
			return NULL;
	if (!PyType_IsSubtype((PyTypeObject *)labeled, &PyTuple_Type)) {
		PyErr_SetString(PyExc_TypeError, "Labeled is not a tuple");
		return NULL;
	}
	for (int i = 0; i < S_N; i++)
		if (F.s[i] == NULL && (F.s[i] = PyUnicode_InternFromString(SNAMES[i])) == NULL)
			return NULL;
	if ((F.zero == NULL && (F.zero = PyLong_FromLong(0)) == NULL)
	    || (F.one == NULL && (F.one = PyLong_FromLong(1)) == NULL)
	    || (F.fzero == NULL && (F.fzero = PyFloat_FromDouble(0.0)) == NULL)
	    || (F.empty == NULL && (F.empty = PyUnicode_FromString("")) == NULL)
	    || (F.no_args == NULL && (F.no_args = PyTuple_New(0)) == NULL))
		return NULL;
	Py_INCREF(flow);
	Py_XSETREF(F.flow, (PyTypeObject *)flow);
	Py_INCREF(labeled);
	Py_XSETREF(F.labeled, (PyTypeObject *)labeled);
	F.t_drop = t_drop;
	F.t_rst_sent = t_rst;
	F.max_kept = kept;
	SET(evidence_only, ev_only);
	SET(type_rnames, rnames);
	SET(reason_name, rname);
	SET(nat_bits, nat);
	SET(weak_causes, weak);
	SET(rank, rank);
	SET(rules_of, rules_of);
	SET(run_rules, run_rules);
	SET(peer, peer);
	SET(key, key);
	SET(mapping, mapping);
	SET(never, never);
	SET(never_valid, never_valid);
	F.ready = 1;
	Py_RETURN_NONE;
}

/* the loop's state: the classifier's tables (borrowed from it for the call) and its copies of
 * the clock and the queue heads (owned; NULL is None) */
typedef struct {
	PyObject *clf, *ctx, *kmap, *flows, *strong, *weak, *rules_of, *memo, *roots;
	PyObject *nat, *drop_name, *rst_name, *out;
	Py_ssize_t cap;
	int64_t now, due, hold, max_hold, window;
	PyObject *hs, *hw, *hf;
	int fresh;              /* the copies are newer than the classifier's attributes */
	/* ctx's lookups for correlate_one, read at the call's first eviction (lk_read 1; -1: ctx
	 * would not give them, so correlate_one reads each by name and raises as _one would) */
	struct one_lookups lk;
	int lk_read;
} St;

/* a Python int in [0, 2**62) as a C one; 0 when it is not one */
static int small_time(PyObject *o, int64_t *v)
{
	if (!PyLong_CheckExact(o))
		return 0;
	int of;
	long long x = PyLong_AsLongLongAndOverflow(o, &of);
	if (of || x < 0 || x >= TIME_MAX)
		return 0;
	*v = x;
	return 1;
}

static PyObject *slot(PyObject *flow, int i)
{
	PyObject *v = SLOT(flow, i);
	if (v == NULL)
		PyErr_Format(PyExc_AttributeError, "'Flow' object has no attribute '%s'", FNAMES[i]);
	return v;
}

static void slot_set(PyObject *flow, int i, PyObject *v)
{
	Py_INCREF(v);
	Py_XSETREF(SLOT(flow, i), v);
}

static int is_flow(PyObject *o)
{
	if (Py_IS_TYPE(o, F.flow))
		return 1;
	PyErr_SetString(PyExc_TypeError, "a queue holds something other than a Flow");
	return 0;
}

static PyObject *due_obj(int64_t due)
{
	if (due == DUE_NOW)
		return Py_NewRef(F.never_valid);
	if (due == DUE_NEVER)
		return Py_NewRef(F.never);
	return PyLong_FromLongLong(due);
}

static PyObject *head_obj(PyObject *h)
{
	return Py_NewRef(h ? h : Py_None);
}

/* the copies back into the classifier, before Python code that reads or changes them */
static int sync_out(St *st)
{
	st->fresh = 0;
	PyObject *now = PyLong_FromLongLong(st->now), *due = due_obj(st->due);
	PyObject *hs = head_obj(st->hs), *hw = head_obj(st->hw), *hf = head_obj(st->hf);
	int r = -1;
	if (now && due && !PyObject_SetAttr(st->clf, F.s[S_NOW], now)
	    && !PyObject_SetAttr(st->clf, F.s[S_DUE], due)
	    && !PyObject_SetAttr(st->clf, F.s[S_HS], hs)
	    && !PyObject_SetAttr(st->clf, F.s[S_HW], hw)
	    && !PyObject_SetAttr(st->clf, F.s[S_HF], hf))
		r = 0;
	Py_XDECREF(now);
	Py_XDECREF(due);
	Py_DECREF(hs);
	Py_DECREF(hw);
	Py_DECREF(hf);
	return r;
}

static int read_head(St *st, int name, PyObject **h)
{
	PyObject *v = PyObject_GetAttr(st->clf, F.s[name]);
	if (v == NULL)
		return -1;
	if (v == Py_None)
		Py_CLEAR(v);
	Py_XSETREF(*h, v);
	return 0;
}

/* the copies from the classifier, after such code; 0 ok, 1 a clock the loop cannot hold
 * (the rest of the batch is Python's), -1 error */
static int sync_in(St *st)
{
	PyObject *now = PyObject_GetAttr(st->clf, F.s[S_NOW]);
	if (now == NULL)
		return -1;
	int ok = small_time(now, &st->now);
	Py_DECREF(now);
	if (!ok)
		return 1;
	PyObject *due = PyObject_GetAttr(st->clf, F.s[S_DUE]);
	if (due == NULL)
		return -1;
	int64_t d;
	if (PyFloat_CheckExact(due) && PyFloat_AS_DOUBLE(due) > 0 && isinf(PyFloat_AS_DOUBLE(due)))
		st->due = DUE_NEVER;
	else if (small_time(due, &d))
		st->due = d;
	else
		st->due = DUE_NOW;   /* _NEVER_VALID, or a time out of range: tick (always exact) */
	Py_DECREF(due);
	if (read_head(st, S_HS, &st->hs) || read_head(st, S_HW, &st->hw)
	    || read_head(st, S_HF, &st->hf))
		return -1;
	st->fresh = 1;
	return 0;
}

/* next(iter(queue)), a new reference; NULL for an empty queue (or an error: check) */
static PyObject *first(PyObject *queue)
{
	if (PyDict_GET_SIZE(queue) == 0)
		return NULL;
	PyObject *it = PyObject_GetIter(queue);
	if (it == NULL)
		return NULL;
	PyObject *k = PyIter_Next(it);
	Py_DECREF(it);
	return k;
}

/* stamp + add when both fit, else DUE_NOW (tick: exact) */
static int64_t stamp_plus(PyObject *flow, int i, int64_t add, int *err)
{
	PyObject *v = slot(flow, i);
	int64_t x;
	if (v == NULL) {
		*err = 1;
		return DUE_NOW;
	}
	if (!small_time(v, &x) || add < 0 || add >= TIME_MAX)
		return DUE_NOW;
	return x + add;
}

/* Classifier._horizon */
static int horizon(St *st)
{
	int64_t due = DUE_NEVER, d;
	int err = 0;
	Py_CLEAR(st->hs);
	Py_CLEAR(st->hw);
	Py_CLEAR(st->hf);
	if ((st->hs = first(st->strong)) != NULL) {
		due = stamp_plus(st->hs, F_LAST, st->hold, &err);
	} else if (PyErr_Occurred()) {
		return -1;
	}
	if ((st->hw = first(st->weak)) != NULL) {
		d = stamp_plus(st->hw, F_FIRST, st->max_hold, &err);
		if (d < due)
			due = d;
	} else if (PyErr_Occurred()) {
		return -1;
	}
	if ((st->hf = first(st->flows)) != NULL) {
		PyObject *p = slot(st->hf, F_PENDING);
		int t = p ? PyObject_IsTrue(p) : -1;
		if (t < 0)
			return -1;
		if (!t) {
			d = stamp_plus(st->hf, F_LAST, st->window, &err);
			if (d < due)
				due = d;
		}
	} else if (PyErr_Occurred()) {
		return -1;
	}
	if (err)
		return -1;
	st->due = due;
	return 0;
}

/* queue.pop(flow, None) */
static int unqueue(PyObject *queue, PyObject *flow)
{
	if (PyDict_GET_SIZE(queue) == 0)
		return 0;
	int in = PyDict_Contains(queue, flow);
	if (in <= 0)
		return in;
	return PyObject_DelItem(queue, flow);
}

static int append_verdict(PyObject *out, PyObject *v)
{
	if (v == NULL)
		return -1;
	int r = v == Py_None ? 0 : PyList_Append(out, v);
	Py_DECREF(v);
	return r;
}

/* Classifier._evict: the oldest flows past max_flows, a one-record incident by correlate_one */
static int evict(St *st)
{
	if (st->lk_read == 0) {
		st->lk_read = one_lookups_read(st->ctx, &st->lk) ? -1 : 1;
		if (st->lk_read < 0)
			PyErr_Clear();
	}
	const struct one_lookups *lk = st->lk_read > 0 ? &st->lk : NULL;
	while (PyDict_GET_SIZE(st->flows) > st->cap) {
		/* flows.popitem(False)[0]: the oldest key, then its deletion (no method call, no
		 * item tuple) */
		PyObject *flow = first(st->flows);
		if (flow == NULL) {
			if (!PyErr_Occurred())
				PyErr_SetString(PyExc_KeyError, "popitem(): dictionary is empty");
			return -1;
		}
		if (PyObject_DelItem(st->flows, flow)) {
			Py_DECREF(flow);
			return -1;
		}
		int r = -1;
		PyObject *pending, *root, *keys;
		if (!is_flow(flow) || (pending = slot(flow, F_PENDING)) == NULL
		    || (root = slot(flow, F_ROOT)) == NULL)
			goto done;
		if (!PyList_Check(pending)) {
			PyErr_SetString(PyExc_TypeError, "Flow.pending is not a list");
			goto done;
		}
		if (PyList_GET_SIZE(pending) == 1 && root == Py_None) {
			PyObject *lab = PyList_GET_ITEM(pending, 0);
			if (!PyTuple_Check(lab) || PyTuple_GET_SIZE(lab) < 3) {
				PyErr_SetString(PyExc_TypeError, "a pending label is not a Labeled");
				goto done;
			}
			if (PyTuple_GET_ITEM(lab, 2) != Py_None) {
				PyObject *extra = slot(flow, F_EXTRA), *nat = slot(flow, F_NAT), *n;
				if (extra == NULL || nat == NULL)
					goto done;
				Py_INCREF(lab);
				n = PyNumber_Add(F.one, extra);
				PyObject *v = n ? correlate_one(lab, n, st->ctx, nat, lk) : NULL;
				if (append_verdict(st->out, v)) {     /* v NULL: -1 */
					Py_XDECREF(n);
					Py_DECREF(lab);
					goto done;
				}
				Py_DECREF(n);
				Py_DECREF(lab);
			}
		} else if (PyList_GET_SIZE(pending)) {
			if (append_verdict(st->out, PyObject_CallMethodObjArgs(
				st->clf, F.s[S_REPORT], flow, Py_False, NULL)))
				goto done;
		}
		/* _drop_flow, inlined */
		if ((keys = slot(flow, F_KEYS)) == NULL)
			goto done;
		keys = PySequence_Fast(keys, "Flow.keys");
		if (keys == NULL)
			goto done;
		for (Py_ssize_t i = 0; i < PySequence_Fast_GET_SIZE(keys); i++) {
			PyObject *k = PySequence_Fast_GET_ITEM(keys, i);
			PyObject *g = PyDict_GetItemWithError(st->kmap, k);
			if ((g == NULL && PyErr_Occurred()) || (g == flow && PyDict_DelItem(st->kmap, k))) {
				Py_DECREF(keys);
				goto done;
			}
		}
		Py_DECREF(keys);
		if (unqueue(st->strong, flow) || unqueue(st->weak, flow))
			goto done;
		r = 0;
done:
		Py_DECREF(flow);
		if (r)
			return -1;
	}
	return 0;
}

/* extend out by a list Python code returned */
static int extend(PyObject *out, PyObject *got)
{
	if (got == NULL)
		return -1;
	int r = 0;
	if (PyList_GET_SIZE(got) || !PyList_CheckExact(got)) {
		PyObject *t = PySequence_InPlaceConcat(out, got);
		r = t ? 0 : -1;
		Py_XDECREF(t);
	}
	Py_DECREF(got);
	return r;
}

/* bool(o), with the common answers without a call; -1 error */
static int truth(PyObject *o)
{
	return o == Py_None ? 0 : o == Py_True ? 1 : o == Py_False ? 0 : PyObject_IsTrue(o);
}

/* _key(a, ap, b, bp) by calling it (rare: NAT) */
static PyObject *call_key(PyObject *a, PyObject *ap, PyObject *b, PyObject *bp)
{
	return PyObject_CallFunctionObjArgs(F.key, a, ap, b, bp, NULL);
}

static PyObject *ct_key(PyObject *c, int a, int ap, int b, int bp)
{
	PyObject *v[4] = {NULL, NULL, NULL, NULL}, *k = NULL;
	int idx[4] = {a, ap, b, bp};
	for (int i = 0; i < 4; i++)
		if ((v[i] = PyObject_GetAttr(c, F.s[idx[i]])) == NULL)
			goto out;
	k = call_key(v[0], v[1], v[2], v[3]);
out:
	for (int i = 0; i < 4; i++)
		Py_XDECREF(v[i]);
	return k;
}

/* ctx.nat_peer answer -> _peer(got) if got else None (new reference) */
static PyObject *ask_peer(St *st, PyObject *a, PyObject *ap, PyObject *b, PyObject *bp)
{
	PyObject *got = PyObject_CallFunctionObjArgs(st->nat, a, ap, b, bp, NULL);
	if (got == NULL)
		return NULL;
	int t = truth(got);
	PyObject *peer = t < 0 ? NULL : t ? PyObject_CallOneArg(F.peer, got) : Py_NewRef(Py_None);
	Py_DECREF(got);
	return peer;
}

/* the label walk of feed_many over memo.roots; lab a new reference or NULL */
static PyObject *label(St *st, PyObject *ev, PyObject *t, PyObject *rname, PyObject *pending,
		       int evidence)
{
	PyObject *lab = NULL, *rk = NULL, *node = NULL, *key = Py_NewRef(Py_None),
		 *val = Py_NewRef(Py_None), *got = NULL, *rules = NULL;
	PyTypeObject *lt = F.labeled;
	if (evidence) {
		if ((lab = lt->tp_alloc(lt, 5)) == NULL)
			goto out;
		PyObject *items[5] = {ev, rname, Py_None, F.fzero, F.empty};
		for (int i = 0; i < 5; i++)
			PyTuple_SET_ITEM(lab, i, Py_NewRef(items[i]));
		goto out;
	}
	if ((rk = PyTuple_Pack(2, t, rname)) == NULL)
		goto out;
	node = PyDict_GetItemWithError(st->roots, rk);
	if (node == NULL && PyErr_Occurred())
		goto out;
	Py_XINCREF(node);
	while (node != NULL && node != Py_None) {
		PyObject *getter = NULL, *table = NULL, *v;
		if (!PyList_CheckExact(node) || PyList_GET_SIZE(node) < 4) {
			PyErr_SetString(PyExc_TypeError, "a label memo node is not a node");
			goto out;
		}
		getter = PyList_GET_ITEM(node, 0);
		table = PyList_GET_ITEM(node, 2);
		Py_SETREF(key, PyObject_CallOneArg(getter, ev));
		if (key == NULL || !PyDict_Check(table))
			goto out;
		v = PyDict_GetItemWithError(table, key);
		if (v == NULL && PyErr_Occurred())
			goto out;
		Py_SETREF(val, Py_NewRef(v ? v : Py_None));
		if (PyList_CheckExact(val)) {    /* a node below: another branch of the rules */
			Py_SETREF(node, Py_NewRef(val));
			continue;
		}
		if (val == Py_None) {            /* a branch that read fewer fields */
			PyObject *shorts = PySequence_Fast(PyList_GET_ITEM(node, 3), "shorts");
			if (shorts == NULL)
				goto out;
			for (Py_ssize_t i = 0; i < PySequence_Fast_GET_SIZE(shorts); i++) {
				PyObject *sh = PySequence_Fast_GET_ITEM(shorts, i), *k2, *v2;
				if (!PyTuple_Check(sh) || PyTuple_GET_SIZE(sh) != 3
				    || !PyDict_Check(PyTuple_GET_ITEM(sh, 2))) {
					PyErr_SetString(PyExc_TypeError, "a memo short is not one");
					Py_DECREF(shorts);
					goto out;
				}
				k2 = PyObject_CallOneArg(PyTuple_GET_ITEM(sh, 0), ev);
				if (k2 == NULL) {
					Py_DECREF(shorts);
					goto out;
				}
				v2 = PyDict_GetItemWithError(PyTuple_GET_ITEM(sh, 2), k2);
				Py_DECREF(k2);
				if (v2 == NULL && PyErr_Occurred()) {
					Py_DECREF(shorts);
					goto out;
				}
				Py_SETREF(val, Py_NewRef(v2 ? v2 : Py_None));
				if (val != Py_None)
					break;
			}
			Py_DECREF(shorts);
		}
		break;
	}
	if (PyTuple_CheckExact(val)) {
		got = Py_NewRef(val);
	} else {
		rules = PyDict_GetItemWithError(st->rules_of, rk);
		if (rules == NULL) {
			if (PyErr_Occurred())
				goto out;
			rules = PyObject_CallFunctionObjArgs(F.rules_of, st->rules_of, t, rname, NULL);
			if (rules == NULL)
				goto out;
		} else {
			Py_INCREF(rules);
		}
		if (st->memo != Py_None)
			got = PyObject_CallMethodObjArgs(st->memo, F.s[S_LABEL], ev, rname, pending,
							 st->ctx, rules, t, node ? node : Py_None,
							 key, val, NULL);
		else
			got = PyObject_CallFunctionObjArgs(F.run_rules, ev, rname, pending, st->ctx,
							   rules, t, NULL);
		if (got == NULL)
			goto out;
		Py_SETREF(got, PySequence_Tuple(got));
		if (got == NULL)
			goto out;
	}
	Py_ssize_t n = PyTuple_GET_SIZE(got);
	if ((lab = lt->tp_alloc(lt, 2 + n)) == NULL)
		goto out;
	PyTuple_SET_ITEM(lab, 0, Py_NewRef(ev));
	PyTuple_SET_ITEM(lab, 1, Py_NewRef(rname));
	for (Py_ssize_t i = 0; i < n; i++)
		PyTuple_SET_ITEM(lab, 2 + i, Py_NewRef(PyTuple_GET_ITEM(got, i)));
out:
	Py_XDECREF(rk);
	Py_XDECREF(node);
	Py_XDECREF(key);
	Py_XDECREF(val);
	Py_XDECREF(got);
	Py_XDECREF(rules);
	return lab;
}

/* all(l.cause is None or RANK[cause] < RANK[l.cause] for l in pending): 1, 0, -1 error */
static int better_than_all(PyObject *cause, PyObject *pending)
{
	for (Py_ssize_t i = 0; i < PyList_GET_SIZE(pending); i++) {
		PyObject *l = PyList_GET_ITEM(pending, i);
		if (!PyTuple_Check(l) || PyTuple_GET_SIZE(l) < 3) {
			PyErr_SetString(PyExc_TypeError, "a pending label is not a Labeled");
			return -1;
		}
		PyObject *lc = PyTuple_GET_ITEM(l, 2);
		if (lc == Py_None)
			continue;
		PyObject *a = PyObject_GetItem(F.rank, cause), *b = a ? PyObject_GetItem(F.rank, lc) : NULL;
		int lt = b ? PyObject_RichCompareBool(a, b, Py_LT) : -1;
		Py_XDECREF(a);
		Py_XDECREF(b);
		if (lt <= 0)
			return lt;
	}
	return 1;
}

/* ts > v, v a flow's time: C integers when both fit */
static int later(int64_t ts, PyObject *ts_obj, PyObject *v)
{
	int64_t x;
	if (small_time(v, &x))
		return ts > x;
	return PyObject_RichCompareBool(ts_obj, v, Py_GT);
}

/* Python's loop on the rest: 0, or -1 */
static int rest_in_python(St *st, PyObject *seq)
{
	if (st->fresh && sync_out(st))
		return -1;
	return extend(st->out, PyObject_CallMethodOneArg(st->clf, F.s[S_PY], seq));
}

/* one event, the body of _feed_many_py's loop. 0 ok, 1 the rest goes to Python, -1 error */
static int feed_one(St *st, PyObject *ev)
{
	PyObject *ts_obj = PyTuple_GET_ITEM(ev, E_TS), *t = PyTuple_GET_ITEM(ev, E_TYPE);
	int64_t ts;
	int r = -1;
	int of;
	if (!small_time(ts_obj, &ts) || !PyLong_Check(t))   /* an EvType, or an int */
		return 1;
	long tl = PyLong_AsLongAndOverflow(t, &of);
	if (of)
		return 1;
	/* what went quiet before this event joins its flow */
	if (ts > st->now)
		st->now = ts;
	if (st->now >= st->due) {
		if (sync_out(st) || extend(st->out, PyObject_CallMethodOneArg(st->clf, F.s[S_TICK], ts_obj)))
			return -1;
		int s = sync_in(st);
		if (s)
			return s;
	} else if (PyDict_GET_SIZE(st->flows) > st->cap) {
		if (evict(st) || horizon(st))
			return -1;
	}
	PyObject *sa = PyTuple_GET_ITEM(ev, E_SADDR), *sp = PyTuple_GET_ITEM(ev, E_SPORT),
		 *da = PyTuple_GET_ITEM(ev, E_DADDR), *dp = PyTuple_GET_ITEM(ev, E_DPORT);
	PyObject *k0 = NULL, *known = NULL, *keys = NULL, *mapped = NULL, *flow = NULL,
		 *rname = NULL, *lab = NULL, *s = NULL, *peer = NULL;
	int order = PyObject_RichCompareBool(sa, da, Py_LT);
	if (order == 0) {
		order = PyObject_RichCompareBool(sa, da, Py_EQ);
		if (order > 0)
			order = PyObject_RichCompareBool(sp, dp, Py_LE);
	}
	if (order < 0)
		return -1;
	k0 = order ? PyTuple_Pack(4, sa, sp, da, dp) : PyTuple_Pack(4, da, dp, sa, sp);
	if (k0 == NULL)
		return -1;
	known = PyDict_GetItemWithError(st->kmap, k0);
	if (known == NULL && PyErr_Occurred())
		goto out;
	Py_XINCREF(known);
	if (known != NULL && !is_flow(known))
		goto out;
	PyObject *c = PyTuple_GET_ITEM(ev, E_CT);
	int evidence = PySet_Contains(F.evidence_only, t);
	if (evidence < 0)
		goto out;
	int plain = 1;
	if (c != Py_None) {
		PyObject *status = PyObject_GetAttr(c, F.s[S_STATUS]), *bits;
		if (status == NULL)
			goto out;
		bits = PyNumber_And(status, F.nat_bits);
		Py_DECREF(status);
		if (bits == NULL || (plain = truth(bits)) < 0) {
			Py_XDECREF(bits);
			goto out;
		}
		Py_DECREF(bits);
		plain = !plain;
	}
	if (plain) {
		int ask = known == NULL;
		if (!ask && c == Py_None) {
			PyObject *kk = slot(known, F_KEYS);
			Py_ssize_t n = kk ? PyObject_Length(kk) : -1;
			if (n < 0)
				goto out;
			ask = n < 2;
		}
		if (ask && !evidence) {
			/* the kernel's NAT map for the connection's other tuple, either direction */
			s = PyTuple_Pack(4, sa, sp, da, dp);
			if (s == NULL || (peer = ask_peer(st, sa, sp, da, dp)) == NULL)
				goto out;
			if (peer == Py_None) {
				Py_SETREF(s, PyTuple_Pack(4, da, dp, sa, sp));
				Py_SETREF(peer, s ? ask_peer(st, da, dp, sa, sp) : NULL);
				if (peer == NULL)
					goto out;
			}
			int yes = truth(peer);
			if (yes < 0)
				goto out;
			if (yes) {
				PyObject *pk = PySequence_Tuple(peer), *k1;
				if (pk == NULL)
					goto out;
				k1 = PyObject_Call(F.key, pk, NULL);
				Py_DECREF(pk);
				if (k1 == NULL)
					goto out;
				keys = PyList_New(2);
				if (keys == NULL) {
					Py_DECREF(k1);
					goto out;
				}
				PyList_SET_ITEM(keys, 0, Py_NewRef(k0));
				PyList_SET_ITEM(keys, 1, k1);
				PyObject *kn = known ? slot(known, F_NAT) : Py_None;
				if (kn == NULL)
					goto out;
				if (known == NULL || kn == Py_None) {
					mapped = PyObject_CallFunctionObjArgs(F.mapping, s, peer, NULL);
					if (mapped == NULL)
						goto out;
				}
			}
		}
	} else {
		PyObject *od = PyObject_GetAttr(c, F.s[S_ODPORT]);
		int yes = od ? truth(od) : -1;
		Py_XDECREF(od);
		if (yes < 0)
			goto out;
		if (yes) {
			PyObject *k1 = ct_key(c, S_OSRC, S_OSPORT, S_ODST, S_ODPORT), *k2;
			k2 = k1 ? ct_key(c, S_RSRC, S_RSPORT, S_RDST, S_RDPORT) : NULL;
			if (k2 == NULL) {
				Py_XDECREF(k1);
				goto out;
			}
			keys = PyList_New(3);
			if (keys == NULL) {
				Py_DECREF(k1);
				Py_DECREF(k2);
				goto out;
			}
			PyList_SET_ITEM(keys, 0, Py_NewRef(k0));
			PyList_SET_ITEM(keys, 1, k1);
			PyList_SET_ITEM(keys, 2, k2);
		}
	}
	if (keys != NULL) {
		if (sync_out(st))
			goto out;
		PyObject *got = PyObject_CallMethodOneArg(st->clf, F.s[S_FLOW_OF], keys);
		if (got == NULL)
			goto out;
		int ex = PyTuple_Check(got) && PyTuple_GET_SIZE(got) == 2
			 ? truth(PyTuple_GET_ITEM(got, 1)) : -1;
		if (ex < 0) {
			if (!PyErr_Occurred())
				PyErr_SetString(PyExc_TypeError, "_flow_of gave no (flow, existed)");
			Py_DECREF(got);
			goto out;
		}
		flow = Py_NewRef(PyTuple_GET_ITEM(got, 0));
		Py_DECREF(got);
		Py_CLEAR(known);
		if (ex)
			known = Py_NewRef(flow);
		int s2 = sync_in(st);
		if (s2 > 0)             /* _flow_of does not move the clock */
			PyErr_SetString(PyExc_OverflowError, "the classifier's clock left 62 bits");
		if (s2 || !is_flow(flow))
			goto out;
		if (mapped != NULL && mapped != Py_None) {
			PyObject *fn = slot(flow, F_NAT);
			if (fn == NULL)
				goto out;
			if (fn == Py_None)
				slot_set(flow, F_NAT, mapped);
		}
	} else if (known == NULL) {           /* the storm's case: a new one-tuple flow */
		PyObject *fk, *fp;
		flow = PyBaseObject_Type.tp_new(F.flow, F.no_args, NULL);
		if (flow == NULL)
			goto out;
		if ((fk = PyList_New(1)) == NULL)
			goto out;
		PyList_SET_ITEM(fk, 0, Py_NewRef(k0));
		SLOT(flow, F_KEYS) = fk;
		if ((fp = PyList_New(0)) == NULL)
			goto out;
		SLOT(flow, F_PENDING) = fp;
		SLOT(flow, F_LAST) = Py_NewRef(F.zero);
		SLOT(flow, F_ROOT) = Py_NewRef(Py_None);
		SLOT(flow, F_NAT) = Py_NewRef(Py_None);
		if (PyDict_SetItem(st->kmap, k0, flow) || PyObject_SetItem(st->flows, flow, flow))
			goto out;
	} else {
		flow = Py_NewRef(known);
		PyObject *m = PyObject_CallMethodOneArg(st->flows, F.s[S_MOVE], known);
		if (m == NULL)
			goto out;
		Py_DECREF(m);
	}
	/* the reason's name */
	PyObject *reason = PyTuple_GET_ITEM(ev, E_REASON);
	if (tl == F.t_drop) {
		rname = PyObject_CallOneArg(st->drop_name, reason);
	} else if (tl == F.t_rst_sent) {
		rname = PyObject_CallOneArg(st->rst_name, reason);
	} else {
		rname = PyDict_GetItemWithError(F.type_rnames, t);
		int yes = rname ? truth(rname) : PyErr_Occurred() ? -1 : 0;
		if (yes < 0)
			goto out;
		rname = yes ? Py_NewRef(rname)
			    : PyObject_CallFunctionObjArgs(F.reason_name, ev, st->ctx, NULL);
	}
	if (rname == NULL)
		goto out;
	PyObject *pending = slot(flow, F_PENDING);
	if (pending == NULL)
		goto out;
	if (!PyList_Check(pending)) {
		PyErr_SetString(PyExc_TypeError, "Flow.pending is not a list");
		goto out;
	}
	Py_INCREF(pending);
	lab = label(st, ev, t, rname, pending, evidence);
	if (lab == NULL)
		goto out_pending;
	if (PyList_GET_SIZE(pending) == 0) {
		slot_set(flow, F_FIRST, ts_obj);
		slot_set(flow, F_STRONG, Py_False);
		slot_set(flow, F_EXTRA, F.zero);
	}
	if (PyTuple_GET_SIZE(lab) < 3) {
		PyErr_SetString(PyExc_IndexError, "tuple index out of range");
		goto out_pending;
	}
	PyObject *cause = PyTuple_GET_ITEM(lab, 2);
	int more = 0;
	if (PyList_GET_SIZE(pending) < F.max_kept) {
		if (PyList_Append(pending, lab))
			goto out_pending;
	} else {
		int better = cause == Py_None ? 0 : better_than_all(cause, pending);
		if (better < 0)
			goto out_pending;
		if (better && PyList_SetItem(pending, PyList_GET_SIZE(pending) - 1, Py_NewRef(lab)))
			goto out_pending;
		more = 1;
	}
	if (more) {
		PyObject *extra = slot(flow, F_EXTRA), *n;
		if (extra == NULL || (n = PyNumber_Add(extra, F.one)) == NULL)
			goto out_pending;
		Py_XSETREF(SLOT(flow, F_EXTRA), n);
	}
	PyObject *last = slot(flow, F_LAST);
	int lt = last ? later(ts, ts_obj, last) : -1;
	if (lt < 0)
		goto out_pending;
	if (lt)
		slot_set(flow, F_LAST, ts_obj);
	if (cause != Py_None) {
		int weak = PySequence_Contains(F.weak_causes, cause);
		if (weak < 0)
			goto out_pending;
		if (!weak)
			slot_set(flow, F_STRONG, Py_True);
	}
	/* _queue, inlined; a queue's head changing means tick may be due sooner */
	PyObject *fs = slot(flow, F_STRONG), *root = fs ? slot(flow, F_ROOT) : NULL;
	int strong = root ? truth(fs) : -1;
	if (strong < 0)
		goto out_pending;
	if (strong || root != Py_None) {
		if (known == NULL) {
			if (PyObject_SetItem(st->strong, flow, flow))
				goto out_pending;
			if (st->hs == NULL)
				st->due = DUE_NOW;
		} else {
			if (unqueue(st->weak, flow) || PyObject_SetItem(st->strong, flow, flow))
				goto out_pending;
			PyObject *m = PyObject_CallMethodOneArg(st->strong, F.s[S_MOVE], flow);
			if (m == NULL)
				goto out_pending;
			Py_DECREF(m);
			if (st->hs == NULL || flow == st->hs || flow == st->hw || flow == st->hf)
				st->due = DUE_NOW;
		}
	} else {
		int in = PyDict_Contains(st->weak, flow);
		if (in < 0)
			goto out_pending;
		if (!in) {
			if (PyObject_SetItem(st->weak, flow, flow))
				goto out_pending;
			if (st->hw == NULL || flow == st->hf || flow == st->hs)
				st->due = DUE_NOW;
		} else if (flow == st->hf || flow == st->hs || flow == st->hw) {
			st->due = DUE_NOW;
		}
	}
	if (known == NULL && st->hf == NULL)
		st->due = DUE_NOW;
	r = 0;
out_pending:
	Py_DECREF(pending);
out:
	Py_XDECREF(k0);
	Py_XDECREF(known);
	Py_XDECREF(keys);
	Py_XDECREF(mapped);
	Py_XDECREF(flow);
	Py_XDECREF(rname);
	Py_XDECREF(lab);
	Py_XDECREF(s);
	Py_XDECREF(peer);
	return r;
}

static int attr(PyObject *o, int name, PyObject **v)
{
	*v = PyObject_GetAttr(o, F.s[name]);
	return *v ? 0 : -1;
}

static int attr_time(PyObject *o, int name, int64_t *v)
{
	PyObject *x = PyObject_GetAttr(o, F.s[name]);
	if (x == NULL)
		return -1;
	int ok = small_time(x, v);
	Py_DECREF(x);
	return ok ? 0 : 1;
}

/* feed_many(clf, events) -> list of Verdicts: Classifier._feed_many_py's result */
PyObject *feed_many(PyObject *self, PyObject *args)
{
	PyObject *clf, *events, *it = NULL, *ev, *res = NULL, *cap = NULL;
	St st = {0};
	if (!PyArg_ParseTuple(args, "OO", &clf, &events))
		return NULL;
	if (!F.ready) {
		PyErr_SetString(PyExc_RuntimeError, "configure_feed() first");
		return NULL;
	}
	st.clf = clf;
	if ((st.out = PyList_New(0)) == NULL)
		return NULL;
	if (attr(clf, S_CTX, &st.ctx) || attr(clf, S_KEYS, &st.kmap) || attr(clf, S_FLOWS, &st.flows)
	    || attr(clf, S_STRONG, &st.strong) || attr(clf, S_WEAK, &st.weak)
	    || attr(clf, S_RULES, &st.rules_of) || attr(clf, S_MEMO, &st.memo)
	    || attr(st.ctx, S_MAX_FLOWS, &cap) || attr(st.ctx, S_NAT_PEER, &st.nat)
	    || attr(st.ctx, S_DROP_NAME, &st.drop_name) || attr(st.ctx, S_RST_NAME, &st.rst_name))
		goto out;
	if (st.memo != Py_None) {
		if (attr(st.memo, S_ROOTS, &st.roots))
			goto out;
	} else if ((st.roots = PyDict_New()) == NULL) {
		goto out;
	}
	it = PyObject_GetIter(events);
	if (it == NULL)
		goto out;
	int s = 0;
	st.cap = PyLong_CheckExact(cap) ? PyLong_AsSsize_t(cap) : -1;
	if (st.cap == -1 && PyErr_Occurred())
		PyErr_Clear();
	/* the tables feed_many needs as plain dicts and OrderedDicts, the times as C integers:
	 * anything else is the Python loop's */
	if (st.cap < 0 || !PyDict_CheckExact(st.kmap) || !PyDict_Check(st.flows)
	    || !PyDict_Check(st.strong) || !PyDict_Check(st.weak) || !PyDict_CheckExact(st.roots)
	    || !PyDict_CheckExact(st.rules_of))
		s = 1;
	if (!s && ((s = attr_time(st.ctx, S_HOLD, &st.hold)) || (s = attr_time(st.ctx, S_MAX_HOLD, &st.max_hold))
		   || (s = attr_time(st.ctx, S_WINDOW, &st.window)) || (s = sync_in(&st))))
		if (s < 0)
			goto out;
	if (s) {
		if (extend(st.out, PyObject_CallMethodOneArg(clf, F.s[S_PY], it)))
			goto out;
		goto done;
	}
	while ((ev = PyIter_Next(it)) != NULL) {
		/* not an Event: it and the rest are the Python loop's */
		int r = PyTuple_Check(ev) && PyTuple_GET_SIZE(ev) == E_NFIELDS ? feed_one(&st, ev) : 1;
		if (r == 1) {           /* this event and the rest: the Python loop */
			PyObject *rest = PySequence_List(it);
			if (rest == NULL || PyList_Insert(rest, 0, ev)) {
				Py_XDECREF(rest);
				Py_DECREF(ev);
				goto out;
			}
			Py_DECREF(ev);
			r = rest_in_python(&st, rest);
			Py_DECREF(rest);
			if (r)
				goto out;
			goto done;
		}
		Py_DECREF(ev);
		if (r)
			goto out;
	}
	if (PyErr_Occurred() || (st.fresh && sync_out(&st)))
		goto out;
done:
	res = Py_NewRef(st.out);
out:
	if (res == NULL && st.fresh) {     /* an error: the classifier keeps what was done */
		PyObject *et, *evv, *tb;
		PyErr_Fetch(&et, &evv, &tb);
		if (sync_out(&st))
			PyErr_Clear();
		PyErr_Restore(et, evv, tb);
	}
	Py_XDECREF(it);
	Py_XDECREF(cap);
	Py_XDECREF(st.ctx);
	Py_XDECREF(st.kmap);
	Py_XDECREF(st.flows);
	Py_XDECREF(st.strong);
	Py_XDECREF(st.weak);
	Py_XDECREF(st.rules_of);
	Py_XDECREF(st.memo);
	Py_XDECREF(st.roots);
	Py_XDECREF(st.nat);
	Py_XDECREF(st.drop_name);
	Py_XDECREF(st.rst_name);
	Py_XDECREF(st.hs);
	Py_XDECREF(st.hw);
	Py_XDECREF(st.hf);
	Py_XDECREF(st.out);
	one_lookups_clear(&st.lk);
	return res;
}
