"""CupyRuntime: the kernels of accel/cuda on the current CUDA device through CuPy. Everything the
backend does on the device goes through its few methods (arrays, copies, launches, graph capture),
all on one stream, so the tests can put a CPU runtime with the same methods in its place."""
import numpy as np

from . import kernels


class CupyGraph:
    def __init__(self, graph, stream):
        self.graph, self.stream = graph, stream

    def replay(self):  # the captured launches again, reading whatever the step buffers hold now
        self.graph.launch(stream=self.stream)


class CupyRuntime:
    def __init__(self, defines=()):  # defines: extra "-DNAME=VALUE" options (the decode kernel's MV_UNROLL)
        import cupy
        self.cupy = cupy
        if cupy.cuda.runtime.getDeviceCount() == 0:  # or raises CUDARuntimeError without a driver
            raise ValueError("CuPy sees no CUDA device")
        # A blocking stream: it also orders itself after CuPy work on the legacy default stream.
        self.stream = cupy.cuda.Stream()
        self.params, self.functions = {}, {}
        for filename in kernels.FILES:
            text = kernels.source(filename)
            module = cupy.RawModule(code=text, options=(*kernels.NVRTC_OPTIONS, *defines))
            for name, kinds in kernels.kernel_params(text).items():
                self.params[name] = kinds
                self.functions[name] = module.get_function(name)  # compiles now, never during a capture

    def empty(self, shape, dtype=np.float32):
        with self.stream:
            return self.cupy.empty(shape, dtype)

    def zeros(self, shape, dtype=np.float32):
        with self.stream:
            return self.cupy.zeros(shape, dtype)

    def full(self, shape, value, dtype):
        with self.stream:
            return self.cupy.full(shape, value, dtype)

    def to_device(self, host):  # numpy -> new device array
        with self.stream:
            return self.cupy.asarray(np.ascontiguousarray(host))

    def to_host(self, dev):  # device array (a strided view too) -> numpy; waits for the stream
        with self.stream:
            return dev.get(stream=self.stream)

    def copy_in(self, dev, host):  # numpy -> an existing device array of its shape
        dev.set(np.ascontiguousarray(host, dev.dtype), stream=self.stream)

    def synchronize(self):
        self.stream.synchronize()

    def launch(self, name, grid, block, *args):
        kinds = self.params[name]
        kernels.check_args(name, kinds, args)
        packed = tuple(_pack(kind, a) for kind, a in zip(kinds, args))
        with self.stream:
            self.functions[name](tuple(grid), tuple(block), packed)

    def capture(self, run):  # run() issues launches -> CupyGraph replaying them
        with self.stream:
            self.stream.begin_capture()
            try:
                run()
            finally:
                graph = self.stream.end_capture()
        return CupyGraph(graph, self.stream)


_SCALAR_TYPES = {"int": np.int32, "i64": np.int64, "float": np.float32, "double": np.float64}


def _pack(kind, a):  # one kernel argument as CuPy passes it: an array, a null pointer or a typed scalar
    if kind == "ptr":
        return np.uint64(0) if a is None else a
    return _SCALAR_TYPES[kind](a)
