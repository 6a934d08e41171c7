"""Kernels compiled twice, with their prange loops on the thread pool and serial: a call too small
to pay for waking the pool (a decode row, a norm of one token) takes the serial compile. Both run
the same float operations in the same order, so the choice never changes a bit."""
import types

import numba

SERIAL_BELOW = 1 << 16  # elements of work under which the pool's wake-up and join cost more than they save


class Threaded:
    def __init__(self, fn):
        serial = types.FunctionType(fn.__code__, fn.__globals__, fn.__name__ + "_serial", fn.__defaults__,
                                    fn.__closure__)
        serial.__qualname__ = fn.__qualname__ + "_serial"  # its own cache file beside the parallel one
        self.parallel = numba.njit(cache=True, parallel=True)(fn)
        self.serial = numba.njit(cache=True)(serial)
        self.__doc__, self.__name__ = fn.__doc__, fn.__name__

    def __call__(self, work, *args):  # work: about how many elements the call touches
        return (self.parallel if work >= SERIAL_BELOW else self.serial)(*args)


def threaded(fn):  # decorator: a prange kernel -> Threaded, called as kernel(work, *args)
    return Threaded(fn)
