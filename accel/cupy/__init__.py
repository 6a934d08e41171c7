"""CuPy CUDA backend: the kernels of accel/cuda, loaded with cupy.RawModule. CupyBackend has the
interface of reference/backend.py NumpyBackend; accel.cupy.text.DeviceTextModel runs the whole text
forward on the device with a captured decode graph."""
from .backend import CupyBackend

__all__ = ["CupyBackend"]
