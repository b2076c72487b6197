# Python integers read in C, exactly as the pure twins check them: an int (a
# bool or a float is not) in a range. The validators and the replay's
# preparation cimport these (cimport _pyint from cext/).
from cpython.long cimport PyLong_AsLongLongAndOverflow, PyLong_CheckExact
from libc.stdint cimport int64_t


cdef extern from "Python.h":
    int _PyLong_Sign(object v)
    size_t _PyLong_NumBits(object v) except? -1


cdef inline bint int_in(object v, int64_t lo, int64_t hi, int64_t* out):
    """v is exactly an int in [lo, hi]; its value in out."""
    cdef int overflow = 0
    cdef long long x
    if not PyLong_CheckExact(v):
        return False
    x = PyLong_AsLongLongAndOverflow(v, &overflow)
    if overflow or x < lo or x > hi:
        return False
    out[0] = x
    return True


cdef inline bint is_key(object v) except -1:
    """v is exactly an int in [0, 2**63) (a content key)."""
    return PyLong_CheckExact(v) and _PyLong_Sign(v) >= 0 and _PyLong_NumBits(v) <= 63
