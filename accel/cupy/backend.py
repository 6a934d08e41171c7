"""CupyBackend: the interface of reference/backend.py NumpyBackend (linear on GGUF tensors,
attention over cache rows) plus the norms, RoPE and activations of reference/ops.py, each a CUDA
kernel of accel/cuda on arrays the caller hands in and gets back on the host. The whole text forward
resident on the device, with its decode step captured as a CUDA graph, is accel/cupy/text.py's
DeviceTextModel on this backend.

Numerics (float32 activations only): products sum 8 exact weights x activations in float32 and
the groups in float64 (accel/cuda/matmul.cu); attention, norms and their sums in float64 as the
reference. CuPy compiles every kernel with -ftz=true (after our options), so float32 subnormals
(below 1.2e-38) flush to zero where the reference keeps them; no weight or activation of the
model is that small. Checked op by op by accel/harness.py, end to end by accel/cuda_harness.py.

Weights are uploaded as their raw GGUF blocks the first time a product needs them and stay on the
device (the 30B IQ2_XXS file takes about 10 GB); a tensor type without a kernel falls back to the
NumPy reference's product.
"""
import numpy as np

from reference.backend import NumpyBackend, attention_by_window

from . import kernels, launch


class CupyBackend:
    name = "cupy"
    dtypes = ("float32",)

    def __init__(self, dtype, runtime=None):
        if np.dtype(dtype) != np.float32:
            raise ValueError("the cupy backend computes in float32 only (--dtype float32)")
        if runtime is None:
            from .runtime import CupyRuntime
            runtime = CupyRuntime()
        self.dtype = np.dtype(dtype)
        self.rt = runtime
        self.tables = runtime.to_device(kernels.lookup_tables())
        self.fallback = NumpyBackend(self.dtype)
        self.tensors = {}   # gguf.Tensor -> DeviceTensor
        self.vectors = {}   # gguf.Tensor -> device float32 copy of a 1-D tensor

    def tensor(self, w):  # gguf.Tensor -> DeviceTensor, uploaded once; None when no kernel reads its type
        if w not in self.tensors:
            self.tensors[w] = launch.DeviceTensor(self.rt, w) if launch.supported(w) else None
        return self.tensors[w]

    def vector(self, w):  # gguf.Tensor -> device float32 [n] (norm weights, biases)
        if w not in self.vectors:
            self.vectors[w] = self.rt.to_device(w.get(np.float32))
        return self.vectors[w]

    def device(self, x):  # host array -> device float32 copy
        return self.rt.to_device(np.ascontiguousarray(x, np.float32))

    # -- products and attention ------------------------------------------------------------

    def linear(self, x, w):  # x [T, in], w a GGUF tensor (gguf.Tensor) [out, in] -> [T, out]
        t = self.tensor(w)
        if t is None:
            return self.fallback.linear(x, w)
        y = self.rt.empty((len(x), t.n_out))
        launch.linear(self.rt, self.device(x), t, y, self.tables)
        return self.rt.to_host(y)

    def patch_embed(self, frames, kernel):  # frames [F, H, W, C], kernel [E, F, C, p, p] -> [(H/p)*(W/p), E]
        return self.fallback.patch_embed(frames, kernel)  # one product per image, against a kernel no tensor cache holds

    def attention(self, q, k, v, visible, scale):  # [T, H, D], [S, Hkv, D] x2, [T, S] -> [T, H, D]
        out = self.rt.empty(q.shape)
        if visible.all() and q.shape[1] == k.shape[1]:  # a vision window: no mask to upload
            n = np.full(len(q), k.shape[0], np.int32)
            launch.attention_spans(self.rt, self.device(q), self.device(k), self.device(v),
                                   self.rt.to_device(np.zeros_like(n)), self.rt.to_device(n), scale, out)
        else:
            mask = self.rt.to_device(np.ascontiguousarray(visible, np.uint8))
            launch.attention_mask(self.rt, self.device(q), self.device(k), self.device(v), mask, scale, out)
        return self.rt.to_host(out)

    def window_attention(self, q, k, v, windows, scale):  # [T, H, D] x3, windows [W] -> [T, H, D]
        return attention_by_window(self.attention, q, k, v, windows, scale)

    def interpolate(self, grid, out_h, out_w):  # grid [h, w, C] -> [out_h, out_w, C]: the reference's, on the host
        return self.fallback.interpolate(grid, out_h, out_w)

    # -- norms, RoPE, activations (the functions of reference/ops.py) ----------------------

    def rms_norm(self, x, eps):  # x [..., n] -> [..., n]
        rows = self.device(x.reshape(-1, x.shape[-1]))
        out = self.rt.empty(rows.shape)
        launch.residual_norm(self.rt, rows, None, eps, None, out, None, 0.0, None)
        return self.rt.to_host(out).reshape(x.shape)

    def layer_norm(self, x, w, b, eps):  # x [..., n], w [n], b [n] -> [..., n]
        rows = self.device(x.reshape(-1, x.shape[-1]))
        out = self.rt.empty(rows.shape)
        launch.layer_norm(self.rt, rows, self.device(w), self.device(b), eps, out)
        return self.rt.to_host(out).reshape(x.shape)

    def rope_norm(self, x, theta):  # x [T, H, D], theta [T, D/2] -> [T, H, D]; pairs (2i, 2i+1)
        return self.rotate(x, [(theta, 0, 1)])

    def rope_neox(self, x, theta):  # x [T, H, D], theta [T, D/2] -> [T, H, D]; pairs (i, i + D/2)
        return self.rotate(x, [(theta, 0, x.shape[-1] // 2)])

    def rope_2d(self, x, theta_a, theta_b):  # x [T, H, D], theta_a/b [T, D/4] -> [T, H, D]
        return self.rotate(x, [(theta_a, 0, 1), (theta_b, x.shape[-1] // 2, 1)])

    def rotate(self, x, parts):  # x [T, H, D], [(theta [T, P], first, pair_stride)] -> [T, H, D]
        out = self.device(x)
        for theta, first, pair_stride in parts:
            # numpy's cos/sin of the float32 angles: the very values ops.rope_norm multiplies by
            launch.rope_pairs(self.rt, out, self.device(np.cos(theta)), self.device(np.sin(theta)), first,
                              pair_stride, out)
        return self.rt.to_host(out)

    def sigmoid(self, x):  # [...] -> [...]
        return self.elementwise("sigmoid_flat", x)

    def gelu_erf(self, x):  # [...] -> [...]
        return self.elementwise("gelu_erf_flat", x)

    def swiglu(self, gate, up):  # gate [T, F], up [T, F] -> [T, F]
        return self.elementwise("swiglu_flat", gate, up)

    def softcap(self, z, cap):  # z [...] -> [...]
        if cap == 0:
            return z
        out = self.rt.empty(z.shape)
        launch.scale_softcap(self.rt, self.device(z), 1.0, cap, out)
        return self.rt.to_host(out)

    def elementwise(self, kernel, *inputs):  # [...] arrays of one shape -> [...]
        out = self.rt.empty(inputs[0].shape)
        launch.elementwise(self.rt, kernel, out, *(self.device(a) for a in inputs))
        return self.rt.to_host(out)
