"""PyTorch's own checkpoint format (`torch.save`, `pytorch_model.bin`), read in place, running no pickle code.

A `torch.save` file (PyTorch >= 1.6) is a zip archive. Its records live under one
folder (`<archive>/`, named after the first record): `data.pkl`, a pickle of the
state dict in which each tensor is a call of `torch._utils._rebuild_tensor_v2`
(storage, storage offset, size, stride, ...) and each storage a persistent id
`("storage", torch.FloatStorage, "0", "cpu", numel)`; `data/0`, `data/1`, ... the
storages' raw bytes, stored uncompressed; and `byteorder` (`little` or `big`).

This module reads the zip's directory itself (bounded before a byte of it is read,
every record checked against the file), then parses `data.pkl` with a restricted
unpickler: every opcode is checked before the pickle is loaded, and how deep the objects
it would build nest, and `find_class` answers only the few globals a state dict of
tensors names, with small stand-ins; it never imports a module, so no global a file
names (`os.system`, `builtins.eval`) can run. Each tensor becomes a `TensorInfo` over
the `.bin` file itself, at its storage record's data offset plus its storage offset:
reads go through the same region reads as safetensors. PyTorch is not needed.

```python
tensors, used = read_tensors(Path("gpt2/pytorch_model.bin"), limit=100_000_000)
tensors["transformer.wte.weight"].offset     # where its row-major bytes start in the file
```
"""

from __future__ import annotations

import io
import os
import pickle
import pickletools
import struct
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

from .._dtypes import NAMES
from .._errors import CheckpointError
from .._files import open_regular, pread_exact
from .._text import one_line, quoted
from ._checkpoint import CONTROL_CHARACTERS, MAX_NBYTES, MAX_RANK, TensorInfo, tensor_bytes

MAX_PICKLE = 64 * 2**20
"""Bytes one `data.pkl` may have (a state dict of 100,000 tensors takes about 10 MB)."""
MAX_OPCODES = 1 << 23
"""Opcodes one `data.pkl` may run, so objects it may build (about 30 per tensor)."""
MAX_RECORDS = 1 << 20
"""Records one zip's directory may list."""
MAX_DEPTH = 100
"""How deep the objects one `data.pkl` builds may nest (a state dict's nest about 8 deep). Python
hashes a tuple by recursing in C with no depth check: a key a million tuples deep would run
past the C stack, and the process die by SIGSEGV, before any check of the result."""
_MAX_BYTEORDER = 16

# Zip structures (PKWARE's APPNOTE.TXT, sections 4.3.7, 4.3.12 to 4.3.16): little-endian, fixed fields first.
_LOCAL = struct.Struct("<4s5H3I2H")  # local file header, 30 bytes, then name and extra field
_CENTRAL = struct.Struct("<4s6H3I5H2I")  # central directory header, 46 bytes, then name, extra, comment
_END = struct.Struct("<4s4H2IH")  # end of central directory record, 22 bytes, then a comment
_LOCATOR = struct.Struct("<4sIQI")  # zip64 end of central directory locator, 20 bytes
_END64 = struct.Struct("<4sQ2H2I4Q")  # zip64 end of central directory record, 56 bytes
_TAIL = _END.size + 0xFFFF  # the end record and the longest comment
_STORED, _ENCRYPTED, _FOLLOWS = 0, 0x1, 0x8  # compression method 0; general purpose flag bits 0 and 3
_U16, _U32 = 0xFFFF, 0xFFFF_FFFF  # "see the zip64 record" markers

# torch/serialization.py, `_legacy_save`: the pre-zip format starts with this number, pickled (protocol 2).
_LEGACY_MAGIC = (0x1950A86A20F9469CFC6C).to_bytes(10, "little")

# torch/storage.py, `_dtype_to_storage_type_map`: the storage class each dtype is saved as; and
# `_new_dtypes`: the dtypes (float8, ...) saved as an UntypedStorage with the dtype in the rebuild's
# arguments (`torch._utils._rebuild_tensor_v3`).
_STORAGES = {
    "DoubleStorage": "float64",
    "FloatStorage": "float32",
    "HalfStorage": "float16",
    "BFloat16Storage": "bfloat16",
    "LongStorage": "int64",
    "IntStorage": "int32",
    "ShortStorage": "int16",
    "CharStorage": "int8",
    "ByteStorage": "uint8",
    "BoolStorage": "bool",
}
_UNSUPPORTED_STORAGES = {
    "ComplexDoubleStorage",
    "ComplexFloatStorage",
    "QInt8Storage",
    "QUInt8Storage",
    "QInt32Storage",
    "QUInt4x2Storage",
    "QUInt2x4Storage",
}
_UNSUPPORTED_DTYPES = {
    "uint16",
    "uint32",
    "uint64",
    "complex32",
    "complex64",
    "complex128",
    "float8_e5m2fnuz",
    "float8_e4m3fnuz",
    "float8_e8m0fnu",
    "float4_e2m1fn_x2",
    "bits8",
    "bits16",
    "bits1x8",
    "bits2x4",
    "bits4x2",
    "qint8",
    "quint8",
    "qint32",
    "quint4x2",
    "quint2x4",
}

# What pickling a dict of tensors writes (protocols 1 to 5): containers, numbers, strings, the memo,
# globals called with REDUCE, persistent ids, and BUILD (a state dict's `_metadata` attribute).
# Refused: INST, OBJ, NEWOBJ(_EX) (they build instances of named classes), EXT1/2/4 (the copyreg
# registry), PERSID (text persistent ids), out-of-band buffers, sets, protocol 0's text forms.
_OPCODES = frozenset(
    {
        "PROTO",
        "FRAME",
        "STOP",
        "MARK",
        "POP",
        "POP_MARK",
        "DUP",
        "NONE",
        "NEWTRUE",
        "NEWFALSE",
        "INT",
        "BININT",
        "BININT1",
        "BININT2",
        "LONG1",
        "LONG4",
        "BINFLOAT",
        "SHORT_BINUNICODE",
        "BINUNICODE",
        "BINUNICODE8",
        "SHORT_BINSTRING",
        "BINSTRING",
        "SHORT_BINBYTES",
        "BINBYTES",
        "BINBYTES8",
        "EMPTY_TUPLE",
        "TUPLE",
        "TUPLE1",
        "TUPLE2",
        "TUPLE3",
        "EMPTY_LIST",
        "APPEND",
        "APPENDS",
        "LIST",
        "EMPTY_DICT",
        "DICT",
        "SETITEM",
        "SETITEMS",
        "GET",
        "BINGET",
        "LONG_BINGET",
        "PUT",
        "BINPUT",
        "LONG_BINPUT",
        "MEMOIZE",
        "GLOBAL",
        "STACK_GLOBAL",
        "REDUCE",
        "BUILD",
        "BINPERSID",
    }
)
_PUTS = frozenset({"PUT", "BINPUT", "LONG_BINPUT"})
_GETS = frozenset({"GET", "BINGET", "LONG_BINGET"})
# Opcodes that push one object holding no other (a number, a string, a tuple of none, a global's
# stand-in); those that pop 1, 2 or 3 items into a new tuple; those that pop items into the object below.
_ATOMS = frozenset(
    {
        "NONE",
        "NEWTRUE",
        "NEWFALSE",
        "INT",
        "BININT",
        "BININT1",
        "BININT2",
        "LONG1",
        "LONG4",
        "BINFLOAT",
        "SHORT_BINUNICODE",
        "BINUNICODE",
        "BINUNICODE8",
        "SHORT_BINSTRING",
        "BINSTRING",
        "SHORT_BINBYTES",
        "BINBYTES",
        "BINBYTES8",
        "EMPTY_TUPLE",
        "GLOBAL",
    }
)
_TUPLES = {"TUPLE1": 1, "TUPLE2": 2, "TUPLE3": 3}
_CHANGES = {"APPEND": 1, "SETITEM": 2, "BUILD": 1}


class _Entry(NamedTuple):
    """One record of the zip's central directory."""

    raw_name: bytes
    flags: int
    method: int
    compressed: int
    size: int
    local: int  # offset of its local header
    disk: int


class _StorageType(NamedTuple):
    """A stand-in for `torch.FloatStorage` and its kin: the dtype its elements have."""

    name: str
    dtype: np.dtype
    untyped: bool


class _DType(NamedTuple):
    """A stand-in for a `torch.float8_e4m3fn` (or other dtype) global."""

    dtype: np.dtype


class _Storage(NamedTuple):
    """A storage record: its key, element dtype, bytes, and where its data starts in the file."""

    key: str
    dtype: np.dtype
    untyped: bool
    nbytes: int
    offset: int


class _Tensor(NamedTuple):
    """The arguments of a rebuild call, kept as they are: checked once, by `_tensor_info`."""

    args: tuple
    v3: bool


class _OrderedDict(dict):
    """A stand-in for `collections.OrderedDict` (a state dict, a tensor's empty hooks).

    A state dict pickles its `_metadata` attribute with BUILD; it is dropped here.
    """

    __slots__ = ()

    def __setstate__(self, state: Any) -> None:
        """Drop the state a BUILD gives (a state dict's `_metadata`)."""


def _rebuild_tensor_v2(*args: Any) -> _Tensor:
    return _Tensor(args, v3=False)


def _rebuild_tensor_v3(*args: Any) -> _Tensor:
    return _Tensor(args, v3=True)


def _rebuild_parameter(data: Any, requires_grad: Any, hooks: Any) -> _Tensor:
    return _parameter_data(data)


def _rebuild_parameter_with_state(data: Any, requires_grad: Any, hooks: Any, state: Any) -> _Tensor:
    return _parameter_data(data)


def _parameter_data(data: Any) -> _Tensor:
    """A parameter's tensor: only a `_Tensor`, which nothing can change, is handed back as REDUCE's
    result (`_Nesting` counts a REDUCE's result as a new object, never one of its arguments)."""
    if not isinstance(data, _Tensor):
        raise TypeError("a parameter whose data is not a tensor")
    return data


# torch/_utils.py: `_rebuild_tensor_v2(storage, storage_offset, size, stride, requires_grad,
# backward_hooks, metadata=None)`, `_rebuild_tensor_v3(..., backward_hooks, dtype, metadata=None)`,
# `_rebuild_parameter(data, requires_grad, backward_hooks)` and `_rebuild_parameter_with_state(...,
# state)`; torch/_tensor.py, `_reduce_ex_internal`, chooses v2 or v3; a state dict is an OrderedDict.
_GLOBALS: dict[tuple[str, str], Any] = {
    ("torch._utils", "_rebuild_tensor_v2"): _rebuild_tensor_v2,
    ("torch._utils", "_rebuild_tensor_v3"): _rebuild_tensor_v3,
    ("torch._utils", "_rebuild_parameter"): _rebuild_parameter,
    ("torch._utils", "_rebuild_parameter_with_state"): _rebuild_parameter_with_state,
    ("collections", "OrderedDict"): _OrderedDict,
    ("torch", "UntypedStorage"): _StorageType("UntypedStorage", np.dtype(np.uint8), True),
    ("torch.storage", "UntypedStorage"): _StorageType("UntypedStorage", np.dtype(np.uint8), True),
    **{("torch", name): _StorageType(name, NAMES[dtype], False) for name, dtype in _STORAGES.items()},
    **{("torch", name): _DType(dtype) for name, dtype in NAMES.items()},
}


def _global(module: str, name: str, file: str) -> Any:
    """The stand-in for the global `module.name`, or a CheckpointError: nothing is imported.

    ```python
    _global("torch", "FloatStorage", "x.bin")   # _StorageType('FloatStorage', dtype('float32'), False)
    _global("os", "system", "x.bin")            # CheckpointError: ... names the global 'os.system' ...
    ```
    """
    found = _GLOBALS.get((module, name))
    if found is not None:
        return found
    if module == "torch" and name in _UNSUPPORTED_STORAGES:
        raise CheckpointError(f"{file}: holds a torch.{name}, a storage of a dtype port does not read")
    if module == "torch" and name in _UNSUPPORTED_DTYPES:
        raise CheckpointError(f"{file}: holds tensors of dtype torch.{name}, which port does not read")
    raise CheckpointError(
        f"{file}: data.pkl names the global {quoted(f'{module}.{name}', 120)}, which a state dict of "
        "tensors does not need: refused (nothing was imported or run)"
    )


class _Unpickler(pickle.Unpickler):
    """`pickle.Unpickler` answering globals with stand-ins and storages with `storage(pid)`.

    ```python
    _Unpickler(io.BytesIO(data), "x.bin", storage).load()   # {"w": _Tensor(...), ...}
    ```
    """

    def __init__(self, file: io.BytesIO, name: str, storage: Callable[[Any], _Storage]):
        super().__init__(file)
        self._name, self._storage = name, storage

    def find_class(self, module: str, name: str) -> Any:
        return _global(module, name, self._name)

    def persistent_load(self, pid: Any) -> _Storage:
        return self._storage(pid)


class _Nesting:
    """The objects a pickle would build, followed opcode by opcode without building one: how deep
    each nests, every one refused past `MAX_DEPTH`.

    An object that cannot change (a number, a string, a tuple, a global's stand-in, a storage) is
    its depth, a positive int. One that APPEND, SETITEM or BUILD may change (a list, a dict, what
    REDUCE returns: a new object, one level above its arguments) is `~i`, its depth
    `self.depths[i]`: once it is inside another object it is frozen, for changing it then (a list
    appended to itself, a memoized dict filled after it was nested) would deepen the objects
    holding it past what was counted; a state dict never does.

    ```python
    nesting = _Nesting("x.bin")
    for opcode, arg, position in pickletools.genops(data):
        nesting.step(opcode.name, arg, position)   # CheckpointError: ... nests objects more than 100 deep ...
    ```
    """

    def __init__(self, name: str):
        self.name = name
        self.stack: list[int] = []
        self.marks: list[int] = []  # the stack's length at each open MARK
        self.memo: list[int | None] = []  # indices in order (`_scan` checks), so a list
        self.filled = 0  # memo entries set: where MEMOIZE puts (the C unpickler's memo_len)
        self.depths: list[int] = []
        self.frozen = bytearray()

    def _corrupt(self, what: str, position: int) -> CheckpointError:
        return CheckpointError(f"{self.name}: corrupt data.pkl: {what} at byte {position}")

    def _pop(self, n: int, opcode: str, position: int) -> list[int]:
        """The top `n` objects, above the last MARK."""
        floor = self.marks[-1] if self.marks else 0
        if len(self.stack) - n < floor:
            raise self._corrupt(f"{opcode} takes more objects than the stack holds", position)
        items = self.stack[len(self.stack) - n :]
        del self.stack[len(self.stack) - n :]
        return items

    def _pop_mark(self, opcode: str, position: int) -> list[int]:
        """The objects above the last MARK, and the MARK."""
        if not self.marks:
            raise self._corrupt(f"{opcode} without a MARK", position)
        return self._pop(len(self.stack) - self.marks.pop(), opcode, position)

    def _nest(self, items: list[int]) -> int:
        """The depth of an object holding `items`, which are frozen from now on."""
        deepest = 0
        for item in items:
            if item < 0:
                self.frozen[~item] = 1
                item = self.depths[~item]
            deepest = max(deepest, item)
        if deepest >= MAX_DEPTH:
            raise CheckpointError(
                f"{self.name}: data.pkl nests objects more than {MAX_DEPTH} deep: refused (nothing was run)"
            )
        return deepest + 1

    def _changeable(self, depth: int) -> int:
        self.depths.append(depth)
        self.frozen.append(0)
        return ~(len(self.depths) - 1)

    def _top(self, opcode: str, position: int) -> int:
        if len(self.stack) <= (self.marks[-1] if self.marks else 0):
            raise self._corrupt(f"{opcode} on an empty stack", position)
        return self.stack[-1]

    def _change(self, items: list[int], opcode: str, position: int) -> None:
        """`items` put into the object on top of the stack (APPEND, SETITEM, BUILD and their batches)."""
        target = self._top(opcode, position)
        depth = self._nest(items)
        if target > 0:
            raise self._corrupt(f"{opcode} changes an object that is not a list, dict or REDUCE's result", position)
        if self.frozen[~target]:
            raise CheckpointError(
                f"{self.name}: data.pkl changes an object after nesting it in another ({opcode} at byte "
                f"{position}), which a state dict never does: refused (nothing was run)"
            )
        self.depths[~target] = max(self.depths[~target], depth)

    def step(self, opcode: str, arg: Any, position: int) -> None:
        """Follow one opcode (already one of `_OPCODES`, its memo index checked)."""
        stack = self.stack
        if opcode in _PUTS or opcode == "MEMOIZE":  # the most frequent first
            index, memo = self.filled if opcode == "MEMOIZE" else arg, self.memo
            if index >= len(memo):
                memo.extend([None] * (index + 1 - len(memo)))
            self.filled += memo[index] is None
            memo[index] = self._top(opcode, position)
        elif opcode in _GETS:
            if arg >= len(self.memo) or self.memo[arg] is None:
                raise CheckpointError(f"{self.name}: corrupt data.pkl: memo index {quoted(arg, 30)} was never set")
            stack.append(self.memo[arg])
        elif opcode in _ATOMS:
            stack.append(1)
        elif opcode == "MARK":
            self.marks.append(len(stack))
        elif opcode in _TUPLES:
            stack.append(self._nest(self._pop(_TUPLES[opcode], opcode, position)))
        elif opcode == "TUPLE":
            stack.append(self._nest(self._pop_mark(opcode, position)))
        elif opcode in ("EMPTY_LIST", "EMPTY_DICT"):
            stack.append(self._changeable(1))
        elif opcode in ("LIST", "DICT"):
            stack.append(self._changeable(self._nest(self._pop_mark(opcode, position))))
        elif opcode in _CHANGES:
            self._change(self._pop(_CHANGES[opcode], opcode, position), opcode, position)
        elif opcode in ("APPENDS", "SETITEMS"):
            self._change(self._pop_mark(opcode, position), opcode, position)
        elif opcode == "REDUCE":  # what a stand-in returns may hold its arguments
            stack.append(self._changeable(self._nest(self._pop(2, opcode, position))))
        elif opcode == "STACK_GLOBAL":
            self._pop(2, opcode, position)
            stack.append(1)
        elif opcode == "BINPERSID":
            stack.append(self._nest(self._pop(1, opcode, position)))
        elif opcode == "DUP":
            stack.append(self._top(opcode, position))
        elif opcode == "POP":  # the C unpickler's load_pop: a MARK with nothing above it is what it pops
            if self.marks and self.marks[-1] == len(stack):
                self.marks.pop()
            else:
                self._pop(1, opcode, position)
        elif opcode == "POP_MARK":
            self._pop_mark(opcode, position)
        elif opcode == "STOP":
            self._pop(1, opcode, position)
        # PROTO and FRAME build nothing


def _scan(data: bytes, name: str) -> None:
    """Every opcode of `data` is one a state dict needs, at most `MAX_OPCODES` of them (so at most
    as many objects built and memo entries), the memo filled in order (the C unpickler sizes its
    memo by the largest index it is given), no object nested more than `MAX_DEPTH` deep, and
    nothing after STOP: checked by reading the opcodes (`pickletools.genops`), running none."""
    count = puts = 0
    end = -1
    nesting = _Nesting(name)
    try:
        for opcode, arg, position in pickletools.genops(data):
            assert position is not None  # genops reads bytes through a BytesIO, which tells where it is
            count += 1
            if count > MAX_OPCODES:
                raise CheckpointError(f"{name}: data.pkl builds more than {MAX_OPCODES} objects")
            if opcode.name not in _OPCODES:
                raise CheckpointError(
                    f"{name}: data.pkl uses the pickle opcode {opcode.name}, which a state dict of tensors "
                    "does not need: refused (nothing was run)"
                )
            if opcode.name in _PUTS and not (type(arg) is int and 0 <= arg <= puts):
                raise CheckpointError(f"{name}: corrupt data.pkl: memo index {quoted(arg, 30)} out of order")
            if opcode.name in _GETS and not (type(arg) is int and 0 <= arg < puts):
                raise CheckpointError(f"{name}: corrupt data.pkl: memo index {quoted(arg, 30)} was never set")
            puts += opcode.name in _PUTS or opcode.name == "MEMOIZE"
            nesting.step(opcode.name, arg, position)
            end = position
    except CheckpointError:
        raise
    except Exception as e:  # genops' ValueError for a bad opcode or argument, and what decoding raises
        raise CheckpointError(f"{name}: corrupt data.pkl: {one_line(str(e) or type(e).__name__, 200)}") from None
    if end != len(data) - 1:
        raise CheckpointError(f"{name}: corrupt data.pkl: {len(data) - 1 - end} bytes after its end")


def _unpickle(data: bytes, name: str, storage: Callable[[Any], _Storage]) -> Any:
    """The object `data` pickles, every global a stand-in and every storage `storage(pid)`."""
    _scan(data, name)
    try:
        return _Unpickler(io.BytesIO(data), name, storage).load()
    except CheckpointError:
        raise
    except Exception as e:  # no foreign code ran: this is the unpickler, or a stand-in, refusing bad data
        message = one_line(str(e) or type(e).__name__, 200)
        raise CheckpointError(f"{name}: corrupt data.pkl: {message}") from None


def _is_zip_start(fd: int, size: int, name: str) -> None:
    """The file starts as a zip does, or one line saying what it is instead."""
    head = pread_exact(fd, min(size, 32), 0, name)
    if head.startswith(b"PK\x03\x04"):
        return
    if not head:
        raise CheckpointError(f"{name}: empty file, not a torch.save checkpoint")
    if head[:1] == b"\x80":  # pickle's PROTO opcode: the legacy format, or some other pickle
        what = "the legacy torch.save format" if _LEGACY_MAGIC in head else "a bare pickle"
        raise CheckpointError(
            f"{name}: {what} (PyTorch before 1.6, or _use_new_zipfile_serialization=False), which port "
            "does not read: re-save it with torch.save's default (a zip)"
        )
    raise CheckpointError(f"{name}: not a torch.save checkpoint (not a zip archive)")


def _zip64_end(fd: int, at: int, name: str) -> tuple[int, tuple[int, ...]] | None:
    """The zip64 end record (its offset and fields) whose locator ends at `at`, if there is one."""
    if at < _LOCATOR.size + _END64.size:
        return None
    signature, disk, offset, disks = _LOCATOR.unpack(pread_exact(fd, _LOCATOR.size, at - _LOCATOR.size, name))
    if signature != b"PK\x06\x07":
        return None
    if disk != 0 or disks != 1 or offset > at - _LOCATOR.size - _END64.size:
        raise CheckpointError(f"{name}: corrupt zip: bad zip64 end-of-directory locator")
    fields = _END64.unpack(pread_exact(fd, _END64.size, offset, name))
    if fields[0] != b"PK\x06\x06" or offset + 12 + fields[1] != at - _LOCATOR.size:
        raise CheckpointError(f"{name}: corrupt zip: bad zip64 end-of-directory record")
    return offset, fields[4:]


def _end_records(fd: int, size: int, name: str) -> tuple[int, int, int]:
    """The central directory's offset, size and record count, from the end records.

    The end record must end exactly where the file does (no trailing bytes), the zip64
    record (PyTorch's writer always adds one) agree with it, the archive be one disk,
    and the directory end where the end records begin.
    """
    start = max(0, size - _TAIL)
    tail = pread_exact(fd, size - start, start, name)
    at = tail.rfind(b"PK\x05\x06")
    while at >= 0 and (at + _END.size > len(tail) or at + _END.size + _END.unpack_from(tail, at)[-1] != len(tail)):
        at = tail.rfind(b"PK\x05\x06", 0, at)
    if at < 0:
        raise CheckpointError(f"{name}: truncated or corrupt zip: no end-of-directory record at its end")
    _, disk, directory_disk, on_disk, total, directory_size, directory_offset, _ = _END.unpack_from(tail, at)
    fields = (disk, directory_disk, on_disk, total, directory_size, directory_offset)
    ends = start + at
    zip64 = _zip64_end(fd, ends, name)
    if zip64 is not None:
        ends, wide = zip64
        markers = (_U16, _U16, _U16, _U16, _U32, _U32)
        if any(narrow not in (marker, value) for narrow, marker, value in zip(fields, markers, wide)):
            raise CheckpointError(f"{name}: corrupt zip: its end records disagree")
        fields = wide
    disk, directory_disk, on_disk, total, directory_size, directory_offset = fields
    if disk or directory_disk or on_disk != total:
        raise CheckpointError(f"{name}: a zip spanning several disks, which port does not read")
    if directory_offset + directory_size != ends:
        raise CheckpointError(
            f"{name}: truncated or corrupt zip: its directory ({directory_size} bytes at {directory_offset}) "
            f"does not end where its end records begin ({ends})"
        )
    if total * _CENTRAL.size > directory_size:
        raise CheckpointError(f"{name}: corrupt zip: {total} records cannot fit a {directory_size}-byte directory")
    return directory_offset, directory_size, total


def directory_length(path: Path) -> int:
    """Bytes of a `torch.save` zip's central directory, checked against the file; reads its end only.

    ```python
    directory_length(Path("gpt2/pytorch_model.bin"))   # 1400
    ```
    """
    fd, st = open_regular(path)
    try:
        _is_zip_start(fd, st.st_size, path.name)
        return _end_records(fd, st.st_size, path.name)[1]
    finally:
        os.close(fd)


def _zip64_fields(extra: bytes, values: list[int], markers: tuple[int, ...], name: str) -> list[int]:
    """`values` (size, compressed size, local offset, disk) with each one at its marker replaced
    from the zip64 extended information extra field (ID 1), in the order APPNOTE 4.5.3 gives."""
    position = 0
    while position + 4 <= len(extra):
        tag, length = struct.unpack_from("<2H", extra, position)
        body = extra[position + 4 : position + 4 + length]
        if len(body) != length:
            break
        if tag == 1:
            at = 0
            for i, (value, marker) in enumerate(zip(values, markers)):
                if value == marker:
                    width = 8 if marker == _U32 else 4
                    if at + width > length:
                        raise CheckpointError(f"{name}: corrupt zip: a zip64 extra field is too short")
                    values[i] = int.from_bytes(body[at : at + width], "little")
                    at += width
            return values
        position += 4 + length
    if any(value == marker for value, marker in zip(values, markers)):
        raise CheckpointError(f"{name}: corrupt zip: a record's sizes are in a zip64 field it lacks")
    return values


def _directory(raw: bytes, count: int, name: str) -> dict[str, _Entry]:
    """The records the central directory `raw` lists, by name: each header checked to lie within it."""
    entries: dict[str, _Entry] = {}
    position = 0
    for i in range(count):
        if position + _CENTRAL.size > len(raw):
            raise CheckpointError(f"{name}: corrupt zip: its directory ends inside record {i}")
        (
            signature,
            _,
            _,
            flags,
            method,
            _,
            _,
            _,
            compressed,
            size,
            name_length,
            extra_length,
            comment_length,
            disk,
            _,
            _,
            local,
        ) = _CENTRAL.unpack_from(raw, position)
        body = position + _CENTRAL.size
        if signature != b"PK\x01\x02" or body + name_length + extra_length + comment_length > len(raw):
            raise CheckpointError(f"{name}: corrupt zip: directory record {i} is malformed")
        raw_name = raw[body : body + name_length]
        extra = raw[body + name_length : body + name_length + extra_length]
        size, compressed, local, disk = _zip64_fields(
            extra, [size, compressed, local, disk], (_U32, _U32, _U32, _U16), name
        )
        try:
            record = raw_name.decode("utf-8")
        except UnicodeDecodeError:
            raise CheckpointError(f"{name}: corrupt zip: record {i} has a name that is not UTF-8") from None
        if record in entries:
            raise CheckpointError(f"{name}: corrupt zip: record {quoted(record, 200)} appears twice")
        entries[record] = _Entry(raw_name, flags, method, compressed, size, local, disk)
        position = body + name_length + extra_length + comment_length
    if position != len(raw):
        raise CheckpointError(f"{name}: corrupt zip: {len(raw) - position} bytes after its directory's records")
    return entries


class _Zip:
    """An open `torch.save` zip: its directory, and its records' data found through their local headers.

    ```python
    archive = _Zip(fd, "x.bin", entries, directory_offset)
    archive.data("x/data/0")      # (data offset, size): stored, inside the file, its own bytes
    ```
    """

    def __init__(self, fd: int, name: str, entries: dict[str, _Entry], directory_offset: int):
        self.fd, self.name, self.entries, self.limit = fd, name, entries, directory_offset
        self.spans: dict[str, tuple[int, int]] = {}

    def data(self, record: str) -> tuple[int, int]:
        """Where the bytes of `record` start in the file, and how many there are."""
        entry = self.entries[record]
        shown = quoted(record, 200)
        if entry.flags & _ENCRYPTED:
            raise CheckpointError(f"{self.name}: record {shown} is encrypted")
        if entry.method != _STORED or entry.compressed != entry.size:
            raise CheckpointError(
                f"{self.name}: record {shown} is compressed (method {entry.method}): port reads only "
                "the stored (uncompressed) records torch.save writes"
            )
        if entry.disk != 0 or entry.local + _LOCAL.size > self.limit:
            raise CheckpointError(f"{self.name}: corrupt zip: record {shown} starts outside the archive")
        fields = _LOCAL.unpack(pread_exact(self.fd, _LOCAL.size, entry.local, self.name))
        signature, _, flags, method, _, _, _, compressed, size, name_length, extra_length = fields
        start = entry.local + _LOCAL.size + name_length + extra_length
        sized = flags & _FOLLOWS or (compressed, size) in ((entry.compressed, entry.size), (_U32, _U32))
        if signature != b"PK\x03\x04" or method != entry.method or not sized:
            raise CheckpointError(f"{self.name}: corrupt zip: the local header of record {shown} is not its own")
        if start + entry.size > self.limit:
            raise CheckpointError(
                f"{self.name}: truncated or corrupt zip: record {shown} ({entry.size} bytes at {start}) runs "
                f"past the archive's data ({self.limit} bytes)"
            )
        if pread_exact(self.fd, name_length, entry.local + _LOCAL.size, self.name) != entry.raw_name:
            raise CheckpointError(f"{self.name}: corrupt zip: the local header of record {shown} names another")
        self.spans[record] = (entry.local, start + entry.size)
        return start, entry.size

    def read(self, record: str, limit: int, what: str) -> bytes:
        """The bytes of a small record, refused unread when more than `limit`."""
        start, size = self.data(record)
        if size > limit:
            raise CheckpointError(f"{self.name}: its {what} takes {size} bytes, more than port reads ({limit})")
        return pread_exact(self.fd, size, start, self.name)

    def check_apart(self) -> None:
        """The records used share no byte: a storage's data is nobody else's."""
        spans = sorted((begin, end, record) for record, (begin, end) in self.spans.items())
        for (_, end, first), (begin, _, second) in zip(spans, spans[1:]):
            if begin < end:
                raise CheckpointError(
                    f"{self.name}: corrupt zip: records {quoted(first, 200)} and {quoted(second, 200)} overlap"
                )


def _archive_folder(entries: dict[str, _Entry], name: str) -> str:
    """The folder every record lives in: the first record's (PyTorch's reader,
    caffe2/serialize/inline_container.cc, takes the archive name from it)."""
    first = next(iter(entries), "")
    folder, slash, _ = first.partition("/")
    if not slash or not folder or f"{folder}/data.pkl" not in entries:
        raise CheckpointError(f"{name}: a zip without data.pkl, not a torch.save checkpoint")
    return folder


def _check_byteorder(archive: _Zip, folder: str) -> None:
    """Little-endian data, or one line: torch/serialization.py writes a `byteorder` record
    (`sys.byteorder`) since 2.1; without one it reads the data as little-endian."""
    record = f"{folder}/byteorder"
    if record not in archive.entries:
        return
    order = archive.read(record, _MAX_BYTEORDER, "byteorder record")
    if order == b"big":
        raise CheckpointError(
            f"{archive.name}: saved big-endian (its byteorder record says 'big'); port reads little-endian"
        )
    if order != b"little":
        raise CheckpointError(f"{archive.name}: corrupt byteorder record {quoted(order.decode('latin-1'), 20)}")


def _storages(archive: _Zip, folder: str) -> Callable[[Any], _Storage]:
    """The `persistent_load` of one archive: a storage's id to its checked record.

    torch/serialization.py, `_save`'s `persistent_id`: `("storage", storage type, key, location,
    numel)`, its bytes in the record `data/<key>`; `_load`'s `persistent_load` makes a storage of
    numel elements of the type's dtype (bytes for an UntypedStorage) and keeps one per key.
    """
    found: dict[str, _Storage] = {}

    def storage(pid: Any) -> _Storage:
        if not (type(pid) is tuple and len(pid) == 5 and pid[0] == "storage"):
            raise CheckpointError(f"{archive.name}: corrupt data.pkl: a persistent id that is not a storage")
        _, kind, key, location, numel = pid
        if not (
            isinstance(kind, _StorageType)
            and type(key) is str
            and type(location) is str
            and type(numel) is int
            and numel >= 0
        ):
            raise CheckpointError(f"{archive.name}: corrupt data.pkl: a malformed storage id")
        if numel > MAX_NBYTES // kind.dtype.itemsize:  # refused unprinted: Python will not print 5000 digits
            raise CheckpointError(
                f"{archive.name}: corrupt data.pkl: storage {quoted(key, 60)} claims more than 2**63 - 1 bytes"
            )
        nbytes = numel * kind.dtype.itemsize
        if key in found:
            if (found[key].dtype, found[key].untyped, found[key].nbytes) != (kind.dtype, kind.untyped, nbytes):
                raise CheckpointError(
                    f"{archive.name}: corrupt data.pkl: storage {quoted(key, 60)} is declared twice, differently"
                )
            return found[key]
        record = f"{folder}/data/{key}"
        if record not in archive.entries:
            raise CheckpointError(f"{archive.name}: storage {quoted(key, 60)} has no record {quoted(record, 200)}")
        start, size = archive.data(record)
        if size != nbytes:
            raise CheckpointError(
                f"{archive.name}: record {quoted(record, 200)} holds {size} bytes but its storage of {numel} "
                f"{kind.dtype.name} needs {nbytes}"
            )
        found[key] = _Storage(key, kind.dtype, kind.untyped, nbytes, start)
        return found[key]

    return storage


def _row_major(shape: tuple[int, ...], stride: tuple[int, ...]) -> bool:
    """Whether `stride` lays `shape` out row-major (C order) without gaps, as `torch.Tensor.is_contiguous`
    judges it: the stride of a dimension of size 1 does not matter, nor any of an empty tensor."""
    if 0 in shape:
        return True
    expected = 1
    for size, step in zip(reversed(shape), reversed(stride)):
        if size != 1 and step != expected:
            return False
        expected *= size
    return True


def _tensor_info(key: str, tensor: _Tensor, path: Path, file_id: tuple[int, int, int]) -> TensorInfo:
    """The `TensorInfo` of one rebuilt tensor: its arguments checked, its bytes inside its storage."""
    name, shown = path.name, quoted(key, 200)
    count = 7 if tensor.v3 else 6  # v3 has the dtype after the hooks; each may add metadata
    if len(tensor.args) not in (count, count + 1):
        raise CheckpointError(f"{name}: corrupt data.pkl: tensor {shown} has {len(tensor.args)} arguments")
    storage, offset, shape, stride = tensor.args[:4]
    metadata = tensor.args[count] if len(tensor.args) > count else None
    dtype = tensor.args[6] if tensor.v3 else None
    if not isinstance(storage, _Storage) or (tensor.v3 and not (storage.untyped and isinstance(dtype, _DType))):
        raise CheckpointError(f"{name}: corrupt data.pkl: tensor {shown} has no valid storage")
    dtype = dtype.dtype if isinstance(dtype, _DType) else storage.dtype  # v3's, checked above
    if not (
        type(offset) is int
        and offset >= 0
        and type(shape) is tuple
        and type(stride) is tuple
        and len(shape) == len(stride)
        and all(type(d) is int and d >= 0 for d in shape)
        and all(type(s) is int for s in stride)
    ):
        raise CheckpointError(f"{name}: corrupt data.pkl: tensor {shown} has a malformed offset, shape or stride")
    if offset > MAX_NBYTES or any(d > MAX_NBYTES for d in shape) or any(abs(s) > MAX_NBYTES for s in stride):
        raise CheckpointError(  # before any arithmetic or printing: Python will not print 5000 digits
            f"{name}: corrupt data.pkl: tensor {shown} has an offset, size or stride past 2**63 - 1"
        )
    if len(shape) > MAX_RANK:
        raise CheckpointError(f"{name}: tensor {shown} has {len(shape)} dimensions (at most {MAX_RANK})")
    if metadata:  # torch._utils.get_tensor_metadata: flags (such as a conjugate bit) that change the values
        raise CheckpointError(
            f"{name}: tensor {shown} carries metadata port does not read (a {type(metadata).__name__})"
        )
    if not _row_major(shape, stride):
        raise CheckpointError(
            f"{name}: tensor {shown} is not stored row-major (shape {list(shape)}, strides {list(stride)}): "
            "port reads contiguous tensors only; save tensor.contiguous()"
        )
    nbytes = tensor_bytes(shape, dtype.itemsize)
    begin = offset * dtype.itemsize
    if nbytes is None or begin + nbytes > storage.nbytes:
        raise CheckpointError(
            f"{name}: tensor {shown} {dtype.name}{list(shape)} at element {offset} runs past its storage "
            f"{quoted(storage.key, 60)} of {storage.nbytes} bytes"
        )
    return TensorInfo(key, path, dtype, shape, storage.offset + begin, file_id)


def _state_dict(result: Any, path: Path, file_id: tuple[int, int, int]) -> dict[str, TensorInfo]:
    """The tensors of the unpickled object: a dict of names to tensors, nothing else."""
    name = path.name
    if not isinstance(result, dict):
        raise CheckpointError(f"{name}: data.pkl holds a {type(result).__name__}, not a state dict of tensors")
    tensors = {}
    for key, value in result.items():
        if type(key) is not str:
            raise CheckpointError(f"{name}: data.pkl has a key that is not a string (a {type(key).__name__})")
        if CONTROL_CHARACTERS.search(key):
            raise CheckpointError(f"{name}: tensor name {quoted(key, 200)} has control characters")
        if not isinstance(value, _Tensor):
            kind = "dict" if isinstance(value, dict) else type(value).__name__
            raise CheckpointError(f"{name}: entry {quoted(key, 200)} is a {kind}, not a tensor")
        tensors[key] = _tensor_info(key, value, path, file_id)
    return tensors


def read_tensors(path: Path, limit: int) -> tuple[dict[str, TensorInfo], int]:
    """The tensors of one `torch.save` zip, and the bytes of directory and pickle read for them.

    Nothing outside the file is read and nothing it names is imported or run; the directory
    and `data.pkl` together may take at most `limit` bytes (`MAX_PICKLE` for the pickle),
    refused before they are read. Refuses, in one line naming the file: the legacy (pre-zip)
    format, compressed or encrypted records, a truncated or corrupt zip, big-endian data,
    dtypes port does not read, and tensors that are not row-major inside their storage.

    ```python
    tensors, used = read_tensors(Path("ckpt/pytorch_model.bin"), 100_000_000)
    ```
    """
    name = path.name
    fd, st = open_regular(path)
    try:
        _is_zip_start(fd, st.st_size, name)
        directory_offset, directory_size, count = _end_records(fd, st.st_size, name)
        if directory_size > limit:
            raise CheckpointError(f"{name}: its zip directory would take the checkpoint's headers past their limit")
        if count > MAX_RECORDS:
            raise CheckpointError(f"{name}: its zip lists {count} records, more than {MAX_RECORDS}")
        entries = _directory(pread_exact(fd, directory_size, directory_offset, name), count, name)
        archive = _Zip(fd, name, entries, directory_offset)
        folder = _archive_folder(entries, name)
        _check_byteorder(archive, folder)
        data = archive.read(f"{folder}/data.pkl", min(MAX_PICKLE, limit - directory_size), "data.pkl")
        result = _unpickle(data, name, _storages(archive, folder))
        archive.check_apart()
        return _state_dict(result, path, (st.st_dev, st.st_ino, st.st_size)), directory_size + len(data)
    finally:
        os.close(fd)
