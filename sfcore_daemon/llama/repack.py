"""Q5_0 weights rewritten once, exactly, as Q8_0: a type llama.cpp has fast kernels for.

K-quant mixes (Q4_K_M and the like) store a tensor whose rows are not a multiple of 256
wide in a fallback type, Q5_0 for Q4_K: on Gemma 3 270M (640 wide) that is 81 of its
164 matrices, and on Qwen2.5 0.5B (896) most of its body. No repacked or AMX kernel
takes Q5_0, so those matrices run on the plain dot product. A Q5_0 block is a half-float
scale and 32 five-bit integers (-16..15); a Q8_0 block is the same scale and 32 eight-bit
integers, so each Q5_0 block is one Q8_0 block with the same numbers. Both multiply
activations quantized to Q8_0 the same way, so on the same kernels the logits are the
same bits; the file grows by 12 bytes per 32 weights of those tensors.

The rewritten file is kept in the cache folder under a name made of the source's path,
size and mtime, so later starts load it at once; a source that has nothing to rewrite is
marked so, and a file this reader cannot follow is loaded as it is (llama.cpp then says
what is wrong with it). docs/performance/repack.md has the measurements.
"""

from __future__ import annotations

import hashlib
import logging
import mmap
import os
import struct
from pathlib import Path
from typing import TYPE_CHECKING, BinaryIO, Literal, NamedTuple

from sfcore_daemon.config import ModelConfig
from sfcore_daemon.llama.capi import C
from sfcore_daemon.llama.gpu import gpu_layers
from sfcore_daemon.llama.modelfile import cache_dir

if TYPE_CHECKING:
    import numpy as np

log = logging.getLogger(__name__)

# Bumped when the rewritten file changes for the same source: old copies are not reused.
FORMAT = 1
GGML_Q5_0 = 6
GGML_Q8_0 = 8
_BLOCK = 32
_Q5_0_BYTES = 22
_Q8_0_BYTES = 34
# Blocks converted at a time: bounds the memory the rewrite takes (~6 MiB of int16).
_CHUNK_BLOCKS = 1 << 17
# Sanity bounds on what a header may claim; a file past them is loaded unchanged.
_MAX_TENSORS = 1 << 20
_MAX_KV = 1 << 20
_MAX_DIMS = 8
_MAX_STRING = 1 << 30
# GGUF value types by id: fixed sizes; 8 is a string and 9 an array.
_SCALAR_BYTES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
_STRING, _ARRAY = 8, 9
_ALIGNMENT_KEY = b"general.alignment"
_SPLIT_COUNT_KEY = b"split.count"

Mode = Literal["auto", "on", "off"]


class GgufError(ValueError):
    """The file is not a GGUF this reader can follow."""


class TensorInfo(NamedTuple):
    name: bytes
    dims: tuple[int, ...]
    ggml_type: int
    offset: int  # from the start of the data section


class Layout(NamedTuple):
    version: int
    n_kv: int
    kv: bytes  # the KV section as it is in the file
    tensors: list[TensorInfo]
    alignment: int
    data_start: int
    file_size: int


class Repacked(NamedTuple):
    """What llama.cpp loads: `path`, the source or its rewritten copy."""

    path: str
    rewritten: bool

    def line(self) -> str:
        """The start-up log's line."""
        if self.rewritten:
            return f"weights: Q5_0 tensors as Q8_0, the same numbers, read from {self.path}"
        return "weights: as the model file holds them"


class _Cursor:
    def __init__(self, data: mmap.mmap | bytes) -> None:
        self.data = data
        self.pos = 0

    def take(self, n: int) -> bytes:
        if n < 0 or self.pos + n > len(self.data):
            raise GgufError("the header runs past the end of the file")
        out = self.data[self.pos:self.pos + n]
        self.pos += n
        return bytes(out)

    def u32(self) -> int:
        return int(struct.unpack("<I", self.take(4))[0])

    def u64(self) -> int:
        return int(struct.unpack("<Q", self.take(8))[0])

    def string(self) -> bytes:
        n = self.u64()
        if n > _MAX_STRING:
            raise GgufError("a string longer than the file")
        return self.take(n)

    def skip(self, n: int) -> None:
        if n < 0 or self.pos + n > len(self.data):
            raise GgufError("the header runs past the end of the file")
        self.pos += n

    def skip_value(self, vtype: int) -> None:
        if vtype in _SCALAR_BYTES:
            self.skip(_SCALAR_BYTES[vtype])
        elif vtype == _STRING:
            self.skip(self.u64())
        elif vtype == _ARRAY:
            element, count = self.u32(), self.u64()
            if element in _SCALAR_BYTES:
                self.skip(count * _SCALAR_BYTES[element])
            elif element == _STRING:
                if count > len(self.data):
                    raise GgufError("an array longer than the file")
                for _ in range(count):
                    self.skip(self.u64())
            else:
                raise GgufError(f"an array of unknown type {element}")
        else:
            raise GgufError(f"a value of unknown type {vtype}")


def read_layout(data: mmap.mmap | bytes) -> Layout:
    """The header of a GGUF file (versions 2 and 3); GgufError if it does not hold."""
    cursor = _Cursor(data)
    if cursor.take(4) != b"GGUF":
        raise GgufError("not a GGUF file")
    version = cursor.u32()
    if version not in (2, 3):
        raise GgufError(f"GGUF version {version}")
    n_tensors, n_kv = cursor.u64(), cursor.u64()
    if n_tensors > _MAX_TENSORS or n_kv > _MAX_KV:
        raise GgufError("more tensors or keys than a model has")
    kv_start = cursor.pos
    alignment = 32
    for _ in range(n_kv):
        key = cursor.string()
        vtype = cursor.u32()
        if key == _ALIGNMENT_KEY and vtype == 4:
            alignment = cursor.u32()
        elif key == _SPLIT_COUNT_KEY:
            # llama.cpp finds a split model's other parts by the first one's name, which
            # a copy would not have.
            raise GgufError("one part of a split model")
        else:
            cursor.skip_value(vtype)
    if alignment <= 0 or alignment & (alignment - 1) or alignment > 1 << 16:
        raise GgufError(f"alignment {alignment}")
    kv = bytes(data[kv_start:cursor.pos])
    tensors = []
    for _ in range(n_tensors):
        name = cursor.string()
        n_dims = cursor.u32()
        if not 1 <= n_dims <= _MAX_DIMS:
            raise GgufError(f"a tensor of {n_dims} dimensions")
        dims = tuple(cursor.u64() for _ in range(n_dims))
        ggml_type, offset = cursor.u32(), cursor.u64()
        tensors.append(TensorInfo(name, dims, ggml_type, offset))
    data_start = -(-cursor.pos // alignment) * alignment
    layout = Layout(version, n_kv, kv, tensors, alignment, data_start, len(data))
    tensor_spans(layout)
    return layout


def tensor_spans(layout: Layout) -> dict[int, int]:
    """Each tensor's bytes in the file up to the next tensor (its padding included), by
    offset; GgufError where tensors overlap, share an offset or run past the end."""
    offsets = sorted(t.offset for t in layout.tensors)
    if not offsets:
        return {}
    data_bytes = layout.file_size - layout.data_start
    if len(set(offsets)) != len(offsets) or offsets[-1] > data_bytes:
        raise GgufError("tensor offsets that overlap or run past the end")
    ends = [*offsets[1:], data_bytes]
    spans = {start: end - start for start, end in zip(offsets, ends, strict=True)}
    for tensor in layout.tensors:
        if tensor.ggml_type == GGML_Q5_0 and _q5_0_bytes(tensor) > spans[tensor.offset]:
            raise GgufError(f"Q5_0 tensor {tensor.name!r} runs past its space")
    return spans


def _elements(tensor: TensorInfo) -> int:
    count = 1
    for dim in tensor.dims:
        count *= dim
    return count


def _q5_0_bytes(tensor: TensorInfo) -> int:
    if tensor.dims[0] % _BLOCK:
        raise GgufError(f"Q5_0 tensor {tensor.name!r} with rows of {tensor.dims[0]}")
    return _elements(tensor) // _BLOCK * _Q5_0_BYTES


def q5_0_share(layout: Layout) -> float:
    """The Q5_0 tensors' share of the weights' bytes."""
    total = layout.file_size - layout.data_start
    q5 = sum(_q5_0_bytes(t) for t in layout.tensors if t.ggml_type == GGML_Q5_0)
    return q5 / total if total else 0.0


def q5_0_to_q8_0(blocks: np.ndarray) -> np.ndarray:
    """Q5_0 blocks (n x 22 bytes) as Q8_0 blocks (n x 34 bytes) with the same values:
    ggml's dequantize_row_q5_0 layout (low nibbles the first 16 values, high nibbles the
    last 16, the fifth bits in qh)."""
    import numpy as np  # only when a file is rewritten: start-up does not wait for it

    scale = blocks[:, 0:2]
    high = blocks[:, 2:6].copy().view("<u4").reshape(-1, 1)
    nibbles = blocks[:, 6:22]
    shift = np.arange(16, dtype=np.uint32)
    first = (nibbles & 0x0F) | (((high >> shift) << 4) & 0x10).astype(np.uint8)
    second = (nibbles >> 4) | ((high >> (shift + 12)) & 0x10).astype(np.uint8)
    values = np.concatenate([first, second], axis=1).astype(np.int16) - 16
    return np.concatenate([scale, values.astype(np.int8).view(np.uint8)], axis=1)


def write_repacked(source: mmap.mmap | bytes, layout: Layout, out: os.PathLike[str] | str) -> int:
    """Write `layout`'s file with every Q5_0 tensor as Q8_0; returns how many were."""
    import numpy as np

    spans = tensor_spans(layout)
    new_infos: list[TensorInfo] = []
    offset = 0
    for tensor in layout.tensors:
        size, ggml_type = spans[tensor.offset], tensor.ggml_type
        if ggml_type == GGML_Q5_0:
            size, ggml_type = _elements(tensor) // _BLOCK * _Q8_0_BYTES, GGML_Q8_0
        new_infos.append(tensor._replace(ggml_type=ggml_type, offset=offset))
        offset += -(-size // layout.alignment) * layout.alignment
    header = [b"GGUF", struct.pack("<IQQ", layout.version, len(new_infos), layout.n_kv),
              layout.kv]
    for tensor in new_infos:
        header += [struct.pack("<Q", len(tensor.name)), tensor.name,
                   struct.pack("<I", len(tensor.dims)),
                   struct.pack(f"<{len(tensor.dims)}Q", *tensor.dims),
                   struct.pack("<IQ", tensor.ggml_type, tensor.offset)]
    head = b"".join(header)
    converted = 0
    with open(out, "wb") as file:
        file.write(head + b"\0" * (-len(head) % layout.alignment))
        for old in layout.tensors:
            start = layout.data_start + old.offset
            if old.ggml_type == GGML_Q5_0:
                n_blocks = _elements(old) // _BLOCK
                for first in range(0, n_blocks, _CHUNK_BLOCKS):
                    count = min(_CHUNK_BLOCKS, n_blocks - first)
                    at = start + first * _Q5_0_BYTES
                    raw = np.frombuffer(source, np.uint8, count * _Q5_0_BYTES, at)
                    file.write(q5_0_to_q8_0(raw.reshape(count, _Q5_0_BYTES)).tobytes())
                written = n_blocks * _Q8_0_BYTES
                converted += 1
            else:
                written = spans[old.offset]
                file.write(source[start:start + written])
            file.write(b"\0" * (-written % layout.alignment))
    return converted


def _cache_names(path: Path, folder: Path) -> tuple[Path, Path, str]:
    """The rewritten file's name and the "nothing to rewrite" mark's for the source as it
    is now, and the prefix every copy of this source's path shares."""
    info = path.stat()
    source = hashlib.sha256(str(path.resolve()).encode()).hexdigest()[:16]
    state = hashlib.sha256(f"{FORMAT}:{info.st_size}:{info.st_mtime_ns}".encode()).hexdigest()[:16]
    stem = f"{source}-{state}"
    return folder / f"{stem}.gguf", folder / f"{stem}.none", source


def prepare(model_path: str, mode: Mode, folder: Path, *, amx: bool = False) -> Repacked:
    """The file to load for `model_path`: the source itself, or its rewritten copy in
    `folder` (written now if it is missing). "on" rewrites any file with Q5_0 tensors;
    "auto" one whose Q5_0 tensors are a mix's fallbacks (under half its bytes), and any
    with `amx` (the CPU has AMX-INT8, which has Q8_0 kernels and no Q5_0 ones)."""
    unchanged = Repacked(model_path, False)
    if mode == "off":
        return unchanged
    path = Path(model_path)
    try:
        target, none_mark, source = _cache_names(path, folder)
        if target.exists():
            return Repacked(str(target), True)
        if none_mark.exists():
            return unchanged
        with path.open("rb") as file, _mapped(file) as data:
            layout = read_layout(data)
            q5_tensors = sum(t.ggml_type == GGML_Q5_0 for t in layout.tensors)
            if not q5_tensors:
                folder.mkdir(parents=True, exist_ok=True)
                none_mark.touch()
                return unchanged
            if mode == "auto" and not amx and q5_0_share(layout) >= 0.5:
                # Mostly Q5_0: the copy reads half as many bytes again a token, which a
                # large model's decode, bound by memory, would pay for.
                return unchanged
            log.info("rewriting %d Q5_0 tensors of %s as Q8_0 into %s (once)",
                     q5_tensors, path, target)
            folder.mkdir(parents=True, exist_ok=True)
            partial = target.with_name(f"{target.name}.{os.getpid()}.partial")
            try:
                write_repacked(data, layout, partial)
                os.replace(partial, target)
            finally:
                partial.unlink(missing_ok=True)
    except GgufError as exc:
        # llama.cpp says what is wrong with the file, as the one line a user sees.
        log.debug("%s: %s; loading it as it is", model_path, exc)
        return unchanged
    except (OSError, ValueError) as exc:
        log.warning("cannot keep a Q8_0 copy of %s in %s (%s); loading it as it is",
                    model_path, folder, exc)
        return unchanged
    _remove_stale(folder, source, keep=target.stem)
    return Repacked(str(target), True)


def _mapped(file: BinaryIO) -> mmap.mmap:
    if os.fstat(file.fileno()).st_size == 0:
        raise GgufError("an empty file")  # which mmap refuses with a ValueError of its own
    return mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ)


def _remove_stale(folder: Path, source: str, keep: str) -> None:
    """Drop the copies of earlier versions of the same source file (another size, mtime
    or format): only the current one is ever loaded again."""
    for old in folder.glob(f"{source}-*"):
        if old.stem != keep and not old.name.endswith(".partial"):
            old.unlink(missing_ok=True)


def weights_for(model_path: str, config: ModelConfig) -> Repacked:
    """`prepare` with the daemon's cache folder and the CPU's features. "auto" leaves a
    model that goes to a GPU as it is: there every weight is read from memory each token,
    and Q8_0 is half as many bytes again as Q5_0."""
    mode = config.rewrite_q5_0
    if mode == "auto" and gpu_layers(config.n_gpu_layers) != 0:
        return Repacked(model_path, False)
    amx = "AMX_INT8 = 1" in C.llama_print_system_info().decode(errors="replace")
    return prepare(model_path, mode, cache_dir() / "models" / "q8_0", amx=amx)
