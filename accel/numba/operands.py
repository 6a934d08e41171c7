"""An intrinsic's arguments by name. numba hands an intrinsic's codegen its arguments as two parallel
lists, the numba types (signature.args) and the LLVM values (args); reading them as args[9] and
tys[9] ties the code to a parameter's position. `operands` pairs them with the names of the typing
function's own parameters, so the codegen reads `a.raw.at([o])`, `a.ad.shape(1)`, `a.offset.int32()`."""
import inspect

from llvmlite import ir
from numba import types
from numba.core import cgutils

I8_PTR = ir.IntType(8).as_pointer()


def element_pointer(context, builder, array_type, array, indices):  # LLVM pointer (element type) to array[indices..., 0, ...]
    zero = ir.Constant(context.get_value_type(types.intp), 0)
    view = context.make_array(array_type)(context, builder, array)
    indices = list(indices) + [zero] * (array_type.ndim - len(indices))
    return cgutils.get_item_pointer(context, builder, array_type, view, indices)


def item_pointer(context, builder, array_type, array, indices):  # LLVM i8* to array[indices..., 0, ...]
    return builder.bitcast(element_pointer(context, builder, array_type, array, indices), I8_PTR)


def array_data(context, builder, array_type, array):  # LLVM i8* to an array's first element
    return builder.bitcast(context.make_array(array_type)(context, builder, array).data, I8_PTR)


class Operand:
    """One argument of an intrinsic: its numba type `ty` and LLVM value `value`, with the reads the
    codegens make of it."""

    def __init__(self, context, builder, ty, value):
        self.context, self.builder, self.ty, self.value = context, builder, ty, value

    def index(self):  # an integer argument as an intp LLVM value
        return self.context.cast(self.builder, self.value, self.ty, types.intp)

    def int32(self):  # an integer argument as an i32 LLVM value
        return self.context.cast(self.builder, self.value, self.ty, types.int32)

    def element_at(self, indices):  # an array argument -> pointer of its element type to array[indices..., 0, ...]
        return element_pointer(self.context, self.builder, self.ty, self.value, indices)

    def at(self, indices):  # an array argument -> i8* to array[indices..., 0, ...]
        return item_pointer(self.context, self.builder, self.ty, self.value, indices)

    def data(self):  # an array argument -> i8* to its first element
        return array_data(self.context, self.builder, self.ty, self.value)

    def view(self):  # an array argument -> numba's array structure (data, shape, strides)
        return self.context.make_array(self.ty)(self.context, self.builder, self.value)

    def shape(self, axis):  # an array argument -> its extent along axis (intp)
        return self.builder.extract_value(self.view().shape, axis)

    def stride(self, axis):  # an array argument -> its byte stride along axis (intp)
        return self.builder.extract_value(self.view().strides, axis)


class Operands:
    """The arguments of one codegen call, each an Operand under its typing parameter's name."""

    def __init__(self, names, context, builder, signature, args):
        if len(names) != len(args):
            raise TypeError(f"{len(args)} arguments for the parameters {names}")
        self.__dict__.update({name: Operand(context, builder, ty, value)
                              for name, ty, value in zip(names, signature.args, args)})


def operands(typing_fn, context, builder, signature, args):  # -> Operands named as typing_fn's parameters
    """typing_fn: the function @intrinsic wraps, whose first parameter is numba's typing context."""
    return Operands(list(inspect.signature(typing_fn).parameters)[1:], context, builder, signature, args)
