/* The `ts` of a JSON line: repr((ts_ns + offset) / 1e9), as jsonl.py writes it, without
 * CPython's dtoa where that is safe. Part of nptrace.sinks.jsonl_fast.
 *
 * Why: float.__repr__ (PyOS_double_to_string 'r', David Gay's shortest round-trip digits) was
 * ~5k of a storm record's ~36k instructions (callgrind), the dearest single step of a line.
 * Epoch seconds are a narrow case of it that exact integer arithmetic decides in a few
 * hundred: x in [2^30, 2^34) (2004 to 2514) is m * 2^-s with m < 2^53 and s in 19..22, so
 * the shortest decimal that reads back as x has at most 7 decimals (17 digits), and for each
 * count of decimals d the nearest candidate M / 10^d and its distance to x are exact in 128
 * bits: |M 2^s - m 10^d| < 10^d / 2 says M / 10^d lies strictly inside x's rounding interval
 * (half an ulp, 2^-s / 2, either side). The smallest d with such an M gives the shortest
 * digits, and that M is the nearest of them, which is what repr prints. What this does not
 * decide exactly it leaves to dtoa: a candidate on the interval's edge (round-half-even would
 * take it for even m), two candidates equally near, m a power of two (the interval below is
 * half as wide), any x outside the range, and compilers without 128-bit integers.
 * tests/unit/test_native_paths.py compares it with repr() on 200k values, edges first (a
 * one-off run of 5.1 million found no difference).
 */
#include "jsonl_fast.h"
#include <stdint.h>
#include <string.h>

/* repr(x) into buf (>= 32 bytes) for the x it decides; its length, or -1: use dtoa. */
int seconds_repr(double x, char *buf)
{
#ifdef __SIZEOF_INT128__
	typedef unsigned __int128 u128;
	if (!(x >= 1073741824.0 && x < 17179869184.0))      /* [2^30, 2^34); NaN fails too */
		return -1;
	uint64_t bits;
	memcpy(&bits, &x, sizeof bits);
	uint64_t m = (bits & ((1ULL << 52) - 1)) | (1ULL << 52);
	if (m == 1ULL << 52)
		return -1;
	int s = 1075 - (int)((bits >> 52) & 0x7ff);         /* x = m * 2^-s, s in 19..22 */
	u128 half = (u128)1 << (s - 1), low = ((u128)1 << s) - 1;
	uint64_t p10 = 1;
	for (int d = 0; d <= 7; d++, p10 *= 10) {
		u128 t = (u128)m * p10;                        /* x * 10^d = t / 2^s */
		u128 M = (t + half) >> s;                      /* the nearest integer, ties up */
		u128 at = M << s;
		u128 dist = at > t ? at - t : t - at;          /* |M / 10^d - x| * 10^d 2^s */
		if (2 * dist > p10)
			continue;
		if (2 * dist == p10 || (t & low) == half)      /* on the edge, or two as near */
			return -1;
		uint64_t whole = (uint64_t)M / p10, frac = (uint64_t)M % p10;   /* M < 2^58 */
		char tmp[24];
		int n = 0, len = 0;
		do {
			tmp[n++] = (char)('0' + whole % 10);
			whole /= 10;
		} while (whole);
		while (n)
			buf[len++] = tmp[--n];
		buf[len++] = '.';
		if (d == 0) {
			buf[len++] = '0';
		} else {
			for (int i = d - 1; i >= 0; i--) {
				buf[len + i] = (char)('0' + frac % 10);
				frac /= 10;
			}
			len += d;
		}
		buf[len] = 0;
		return len;
	}
#else
	(void)x;
	(void)buf;
#endif
	return -1;
}

/* repr((ts_ns + offset) / 1e9) as PyMem text, or NULL with an exception. The sum is made in
 * 64 bits when it fits: (double) of an int64 rounds to nearest-even as PyLong_AsDouble does. */
char *epoch_seconds(PyObject *ts_ns, PyObject *offset)
{
	double secs;
	long long a, b, sum;
	int ova = 1, ovb = 1;
	if (PyLong_CheckExact(ts_ns) && PyLong_CheckExact(offset)) {
		a = PyLong_AsLongLongAndOverflow(ts_ns, &ova);
		b = PyLong_AsLongLongAndOverflow(offset, &ovb);
	}
	if (!ova && !ovb && !__builtin_add_overflow(a, b, &sum)) {
		secs = (double)sum;
	} else {
		PyErr_Clear();                  /* AsLongLong's error, if any: PyNumber_Add decides */
		PyObject *big = PyNumber_Add(ts_ns, offset);
		if (big == NULL)
			return NULL;
		secs = PyLong_AsDouble(big);
		Py_DECREF(big);
		if (secs == -1.0 && PyErr_Occurred())
			return NULL;
	}
	char *out = PyMem_Malloc(32);
	if (out == NULL) {
		PyErr_NoMemory();
		return NULL;
	}
	if (seconds_repr(secs / 1e9, out) >= 0)
		return out;
	PyMem_Free(out);
	return PyOS_double_to_string(secs / 1e9, 'r', 0, Py_DTSF_ADD_DOT_0, NULL);
}

/* _seconds_repr(x) -> (repr(x), decided here): the test's view of seconds_repr. */
PyObject *seconds_repr_py(PyObject *self, PyObject *arg)
{
	(void)self;
	double x = PyFloat_AsDouble(arg);
	if (x == -1.0 && PyErr_Occurred())
		return NULL;
	char buf[32];
	int n = seconds_repr(x, buf);
	if (n >= 0)
		return Py_BuildValue("(s#O)", buf, (Py_ssize_t)n, Py_True);
	char *t = PyOS_double_to_string(x, 'r', 0, Py_DTSF_ADD_DOT_0, NULL);
	if (t == NULL)
		return NULL;
	PyObject *r = Py_BuildValue("(sO)", t, Py_False);
	PyMem_Free(t);
	return r;
}
