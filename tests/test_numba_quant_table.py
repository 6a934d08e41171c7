"""accel/numba/quant.py's one table of kernels: it covers every tensor type the GGUF loader accepts
but the documented fallback set, and every type it lacks is refused with TypeWithoutKernel by each
product, never multiplied by another type's kernel."""
import numpy as np
import pytest

from conftest import require

require("numba")  # the [accel] extra

from gguf import GGMLQuantizationType as GT  # noqa: E402

from accel.numba import quant  # noqa: E402
from reference import gguf  # noqa: E402

# quant.py's docstring and the README: the loader's types that NumbaBackend hands to the reference's
# product (tests/test_numba.py checks that hand-over for MXFP4)
FALLBACK_TYPES = frozenset({GT.MXFP4, GT.NVFP4})
NOT_A_TYPE = 1000  # an id neither gguf-py nor the pinned ggml defines


def accepted_types():  # -> every type id reference/gguf/weights.py dequantizes
    return frozenset(t for t in [*GT, *gguf.GgmlType] if gguf.decodable(t))


def test_the_table_has_every_accepted_type_but_the_fallback_set():
    assert quant.KERNEL_TYPES <= accepted_types()
    assert accepted_types() - quant.KERNEL_TYPES == FALLBACK_TYPES


def products(type_id):  # -> the three products, each called with type_id on 256-value float32 rows
    blocks, x = np.zeros((2, 256), np.uint8), np.ones((1, 256), np.float32)
    out, tiles = np.empty((1, 2), np.float32), np.empty((2, 256), np.float32)
    xsum16 = x.reshape(1, -1, 16).sum(-1, dtype=np.float64)
    return {"matmul_rows": lambda: quant.matmul_rows(type_id, blocks, x, xsum16, out, quant.TABLES),
            "matmul_tiles": lambda: quant.matmul_tiles(type_id, blocks, x, out, quant.TABLES),
            "dequantize_rows": lambda: quant.dequantize_rows(type_id, blocks, 256, 0, tiles, quant.TABLES)}


@pytest.mark.parametrize("type_id, name", [*((int(t), t.name) for t in sorted(FALLBACK_TYPES)),
                                           (NOT_A_TYPE, f"id {NOT_A_TYPE}")])
@pytest.mark.parametrize("product", sorted(products(0)))
def test_a_type_without_kernel_is_refused_by_each_product(type_id, name, product):
    with pytest.raises(quant.TypeWithoutKernel, match=f"^no numba kernel for tensor type {name}$") as e:
        products(type_id)[product]()
    assert e.value.type_id == type_id
    assert isinstance(e.value, gguf.UnsupportedTensorType)  # the loader's own refusal of a type


def test_the_dispatchers_refuse_what_the_table_lacks():
    # decode_chunk and row_dot on their own, as the products call them
    row, x = np.zeros(256, np.uint8), np.ones(256, np.float32)
    xsum16 = x.reshape(-1, 16).sum(-1, dtype=np.float64)
    with pytest.raises(quant.TypeWithoutKernel, match="MXFP4"):
        quant.row_dot(int(GT.MXFP4), row, x, xsum16, quant.TABLES)
    with pytest.raises(quant.TypeWithoutKernel, match=f"id {NOT_A_TYPE}"):
        quant.decode_chunk(NOT_A_TYPE, row, 0, 256, np.empty(256, np.float32), quant.TABLES)
