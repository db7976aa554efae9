"""A GGUF file's header walked against the file's own size, before gguf.GGUFReader reads it.

GGUFReader trusts every count and length it finds: an array that says it holds 1e12 items makes it
loop until the file ends, building a numpy view per item (~100 bytes each, from a 1-byte item), and a
string or a tensor's data is sliced as long as it says. `check_layout` walks the same header (GGUF v2
and v3: magic, version, tensor count, metadata count, the metadata, the tensor infos) keeping only
offsets and counts, and stops at the first field that runs past the end of the file or past a bound
below: one line naming the field, nothing allocated. The values themselves are GGUFReader's to read.
"""

from __future__ import annotations

import math
import mmap
import struct
from pathlib import Path

from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType

from kvscope.backend.errors import ModelLoadError

V = GGUFValueType
SCALAR_BYTES = {V.UINT8: 1, V.INT8: 1, V.UINT16: 2, V.INT16: 2, V.UINT32: 4, V.INT32: 4, V.FLOAT32: 4, V.BOOL: 1,
                V.UINT64: 8, V.INT64: 8, V.FLOAT64: 8}
MAX_ARRAY_ITEMS = 1 << 20  # one metadata array: a vocabulary's tokens, scores, types or merges (Gemma 3: 262,144)
MAX_VALUES = 1 << 22  # metadata fields and array items together: what GGUFReader makes a view of each
MAX_TENSORS = 1 << 16  # a 1024-layer decoder has ~12,000
MAX_DIMS = 4  # GGML_MAX_DIMS
HEADER_BYTES = 24  # magic, version, tensor count, metadata count
DEFAULT_ALIGNMENT = 32


class _Walk:
    """A cursor over the file's bytes that refuses to pass its end."""

    def __init__(self, data: mmap.mmap, path: Path, order: str) -> None:
        self.data, self.path, self.order = data, path, order
        self.at = 0
        self.values = 0

    def fail(self, what: str, reason: str) -> ModelLoadError:
        return ModelLoadError(str(self.path), f"{what}: {reason}")

    def take(self, size: int, what: str) -> int:
        """Step over `size` bytes; their offset."""
        if size > len(self.data) - self.at:
            raise self.fail(what, f"{size:,} bytes at offset {self.at:,} run past the end of the file "
                                  f"({len(self.data):,} bytes)")
        start, self.at = self.at, self.at + size
        return start

    def unpack(self, fmt: str, what: str) -> tuple:
        fmt = self.order + fmt  # with the order: packed, no native alignment
        return struct.unpack_from(fmt, self.data, self.take(struct.calcsize(fmt), what))

    def string(self, what: str) -> bytes:
        (length,) = self.unpack("Q", what)
        start = self.take(length, what)
        return self.data[start:self.at]

    def count(self, n: int, what: str) -> None:
        self.values += n
        if self.values > MAX_VALUES:
            raise self.fail(what, f"more than {MAX_VALUES:,} metadata values in all")

    def value(self, vtype: int, key: str) -> None:
        if vtype in SCALAR_BYTES:
            self.take(SCALAR_BYTES[vtype], key)
        elif vtype == V.STRING:
            self.take(self.unpack("Q", key)[0], key)
        elif vtype == V.ARRAY:
            item, n = self.unpack("IQ", key)
            if n > MAX_ARRAY_ITEMS:
                raise self.fail(key, f"an array of {n:,} items; at most {MAX_ARRAY_ITEMS:,} are read")
            self.count(n, key)
            if item in SCALAR_BYTES:
                self.take(n * SCALAR_BYTES[item], key)
            elif item == V.STRING:
                for _ in range(n):
                    self.take(self.unpack("Q", key)[0], key)
            else:
                raise self.fail(key, f"an array of value type {item} (arrays of strings or numbers are read)")
        else:
            raise self.fail(key, f"unknown value type {vtype}")


def check_layout(path: Path) -> None:
    """Raise ModelLoadError naming the field whose length or count the file cannot hold."""
    with path.open("rb") as fh:
        if path.stat().st_size < HEADER_BYTES:
            return  # GGUFReader says what it is not
        with mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) as data:
            magic, version = data[:4], struct.unpack_from("<I", data, 4)[0]
            order = ">" if version & 0xFFFF == 0 else "<"  # written on a machine of the other byte order
            if magic != b"GGUF" or struct.unpack_from(order + "I", data, 4)[0] not in (2, 3):
                return  # GGUFReader names the bad magic or version
            walk = _Walk(data, path, order)
            walk.take(8, "GGUF.version")
            tensors, fields = walk.unpack("QQ", "GGUF.tensor_count")
            if tensors > MAX_TENSORS:
                raise walk.fail("GGUF.tensor_count", f"{tensors:,} tensors; at most {MAX_TENSORS:,} are read")
            alignment = _metadata(walk, fields)
            _tensor_infos(walk, tensors, alignment)


def _metadata(walk: _Walk, fields: int) -> int:
    """Walk the key-value section; the data alignment it sets (general.alignment), or the default."""
    walk.count(fields, "GGUF.kv_count")
    alignment, seen = DEFAULT_ALIGNMENT, set()
    for _ in range(fields):
        key = walk.string("a metadata key").decode("utf-8", "replace")
        if key in seen:
            raise walk.fail(key, "given twice")
        seen.add(key)
        (vtype,) = walk.unpack("I", key)
        if key == "general.alignment" and vtype == V.UINT32:
            alignment = struct.unpack_from(walk.order + "I", walk.data, walk.at)[0] or DEFAULT_ALIGNMENT
        walk.value(vtype, key)
    return alignment


def _tensor_infos(walk: _Walk, tensors: int, alignment: int) -> None:
    """Each tensor's dims and type, and its data inside the file."""
    spans: dict[str, tuple[int, int]] = {}
    for _ in range(tensors):
        name = walk.string("a tensor name").decode("utf-8", "replace")
        if name in spans:
            raise walk.fail(f"tensor {name}", "given twice")
        (n_dims,) = walk.unpack("I", name)
        if not 1 <= n_dims <= MAX_DIMS:
            raise walk.fail(f"tensor {name}", f"{n_dims} dimensions (1 to {MAX_DIMS})")
        dims = walk.unpack(f"{n_dims}Q", name)
        (raw_type,), (offset,) = walk.unpack("I", name), walk.unpack("Q", name)
        try:
            block, type_bytes = GGML_QUANT_SIZES[GGMLQuantizationType(raw_type)]
        except (ValueError, KeyError):
            raise walk.fail(f"tensor {name}", f"unknown tensor type {raw_type}") from None
        if 0 in dims or dims[0] % block:
            raise walk.fail(f"tensor {name}", f"shape {list(dims)} is not whole blocks of {block} values")
        spans[name] = offset, math.prod(dims) // block * type_bytes
    start = -(-walk.at // alignment) * alignment
    for name, (offset, size) in spans.items():
        if start + offset + size > len(walk.data):
            raise walk.fail(f"tensor {name}", f"its {size:,} bytes at offset {start + offset:,} run past the end "
                                              f"of the file ({len(walk.data):,} bytes)")
