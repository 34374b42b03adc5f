"""The engine's own CPU kernels for float32 on AVX2 CPUs, and when to use them: the linear layers
(``linear_f32.c``) and decode attention (``decode_attention_f32.c``).

Why: on an AVX2-only AMD EPYC, float32 is the dtype ``--dtype auto`` picks. There oneDNN's matmuls for the few
rows of a decode step read SmolLM2's weights at ~9 GB/s at 8 rows, a fraction of what the memory gives, and
torch's SDPA reads a KV head's keys and values once for each query head that shares it; these kernels stream
each weight panel once for all the rows, and each KV head once for its query heads (docs/engine.md has the
figures). Both are batch-invariant by construction: every sum runs in one order that depends only on the row.

The C sources ship in the package and are compiled once per source version with the system C compiler (``$CC``
or ``cc``) into the pdserve cache dir, then loaded with ctypes; their OpenMP threads are torch's own (the library
binds to the ``libgomp.so.1`` torch has loaded). Where the CPU lacks AVX2 or FMA, has AVX-512 (there oneDNN's
wider kernels were not measured against them), no compiler is found or ``PDSERVE_NATIVE_KERNELS=0`` is set,
the engine keeps oneDNN and SDPA, and its ready banner says which it uses and why.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from pdserve.checkpoints.cache import cache_root
from pdserve.engine.dtype_choice import cpu_flags

SOURCES = tuple(Path(__file__).with_name(name) for name in ("linear_f32.c", "decode_attention_f32.c"))
COMPILE_FLAGS = ("-O3", "-mavx2", "-mfma", "-fopenmp", "-shared", "-fPIC")
REQUIRED_FLAGS = ("avx2", "fma")
PANEL = 16  # outputs per packed panel (linear_f32.c)
OPT_OUT_ENV = "PDSERVE_NATIVE_KERNELS"  # "0": oneDNN and SDPA even where these kernels would be chosen


class KernelBuildError(RuntimeError):
    """The C source did not compile or load here."""


@dataclass(frozen=True)
class DecodeRows:
    """A decode batch's slots and the positions each row attends (int64), checked against a cache of ``num_slots``
    slots of ``max_len`` positions once per step (:meth:`NativeKernels.decode_rows`), then read by every layer."""

    slots: torch.Tensor
    lengths: torch.Tensor
    num_slots: int
    max_len: int


class NativeKernels:
    """The compiled kernels: :meth:`linear` (after :meth:`pack`) and :meth:`decode_attention` (after
    :meth:`decode_rows`)."""

    def __init__(self, library: ctypes.CDLL) -> None:
        self._linear = library.pdserve_linear_f32
        self._linear.restype = None
        self._linear.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_size_t] * 3 + [ctypes.c_int]
        self._attention = library.pdserve_decode_attention_f32
        self._attention.restype = ctypes.c_int
        self._attention.argtypes = ([ctypes.c_void_p, ctypes.c_size_t] + [ctypes.c_void_p] * 5 + [ctypes.c_size_t] * 5
                                    + [ctypes.c_float, ctypes.c_int])

    @staticmethod
    def pack(weight: torch.Tensor) -> torch.Tensor:
        """``[N, K]`` float32 into panels ``[ceil(N / 16), K, 16]``, zero rows past N."""
        n, k = weight.shape
        padded = F.pad(weight.float(), (0, 0, 0, -n % PANEL))
        return padded.view(-1, PANEL, k).transpose(1, 2).contiguous()

    def linear(self, x: torch.Tensor, packed: torch.Tensor, out_features: int) -> torch.Tensor:
        """``x @ weight.T``, ``packed`` from :meth:`pack`: ``[rows, out_features]``."""
        if x.dtype != torch.float32 or x.dim() != 2 or x.shape[1] != packed.shape[1]:
            raise ValueError(f"linear takes float32 [rows, {packed.shape[1]}], not {x.dtype} {list(x.shape)}")
        x = x.contiguous()
        out = torch.empty(x.shape[0], out_features)
        self._linear(x.data_ptr(), packed.data_ptr(), out.data_ptr(), x.shape[0], x.shape[1], out_features,
                     torch.get_num_threads())
        return out

    @staticmethod
    def decode_rows(slots: torch.Tensor, lengths: torch.Tensor, num_slots: int, max_len: int) -> DecodeRows:
        """Rows in ``slots`` attending their first ``lengths`` positions, checked against the cache they will read."""
        slots, lengths = slots.to(torch.int64).contiguous(), lengths.to(torch.int64).contiguous()
        if slots.shape != lengths.shape or (len(slots) and (
                int(lengths.min()) < 1 or int(lengths.max()) > max_len or int(slots.min()) < 0
                or int(slots.max()) >= num_slots)):
            raise ValueError("decode_attention: a row's slot or length is outside the cache")
        return DecodeRows(slots, lengths, num_slots, max_len)

    def decode_attention(self, heads: torch.Tensor, num_heads: int, keys: torch.Tensor, values: torch.Tensor,
                         rows: DecodeRows) -> torch.Tensor:
        """Each row's first ``num_heads`` heads of ``heads`` ``[rows, >= num_heads, head_dim]`` (its queries) over
        the first ``rows.lengths[row]`` positions of its slot in one layer's ``keys`` and ``values`` ``[slots,
        kv_heads, max_len, head_dim]``, scaled by ``1/sqrt(head_dim)`` as SDPA does: ``[rows, num_heads *
        head_dim]``."""
        count, _, head_dim = heads.shape
        num_slots, kv_heads, max_len, _ = keys.shape
        if (heads.dtype != torch.float32 or heads.stride(2) != 1 or heads.stride(1) != head_dim or head_dim % 8
                or num_heads % kv_heads or not keys.is_contiguous() or not values.is_contiguous()
                or keys.shape != values.shape or keys.shape[3] != head_dim or count != len(rows.slots)
                or (num_slots, max_len) != (rows.num_slots, rows.max_len)):
            raise ValueError(f"decode_attention cannot read heads {list(heads.shape)} {heads.dtype} with keys "
                             f"{list(keys.shape)}")
        out = torch.empty(count, num_heads * head_dim)
        failed = self._attention(heads.data_ptr(), heads.stride(0), keys.data_ptr(), values.data_ptr(),
                                 rows.slots.data_ptr(), rows.lengths.data_ptr(), out.data_ptr(), count, num_heads,
                                 kv_heads, max_len, head_dim, head_dim**-0.5, torch.get_num_threads())
        if failed:
            raise MemoryError("decode_attention: no memory for a row's scores")
        return out


def build_library(cache_dir: Path | None = None) -> Path:
    """The compiled library for this source and these flags, compiled on first use (atomically: servers starting
    together each compile and the last rename wins, never a half-written file)."""
    compiler = os.environ.get("CC") or "cc"
    if shutil.which(compiler) is None:
        raise KernelBuildError(f"no C compiler ({compiler!r} is not on PATH)")
    sources = b"".join(source.read_bytes() for source in SOURCES)
    digest = hashlib.sha256(sources + " ".join((compiler, *COMPILE_FLAGS)).encode()).hexdigest()[:16]
    target = (cache_dir or cache_root() / "kernels") / f"pdserve_kernels-{digest}.so"
    if target.is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    partial = target.with_name(f"{target.name}.{os.getpid()}.partial")
    done = subprocess.run([compiler, *COMPILE_FLAGS, "-o", str(partial), *map(str, SOURCES)], capture_output=True,
                          text=True, timeout=300, check=False)
    if done.returncode != 0:
        partial.unlink(missing_ok=True)
        last = (done.stderr.strip().splitlines() or ["no output"])[-1]
        raise KernelBuildError(f"{compiler} failed on the kernels' sources: {last}")
    os.replace(partial, target)
    return target


@functools.cache
def load_native_kernels() -> NativeKernels:
    """The kernels, built and loaded (KernelBuildError when they cannot be). They need a CPU with AVX2 and FMA."""
    path = build_library()
    try:
        return NativeKernels(ctypes.CDLL(str(path)))
    except OSError as e:
        raise KernelBuildError(f"cannot load {path}: {e}") from e


@dataclass(frozen=True)
class KernelChoice:
    kernels: NativeKernels | None  # None: oneDNN for the linears, torch's SDPA for attention
    reason: str  # for the ready banner


NATIVE = "pdserve's AVX2 kernels"
TORCH = "oneDNN and SDPA"


@functools.cache
def choose_kernels(dtype: torch.dtype) -> KernelChoice:
    """Which kernels this process's model of ``dtype`` runs, and why."""
    if dtype != torch.float32:
        return KernelChoice(None, TORCH)
    if os.environ.get(OPT_OUT_ENV) == "0":
        return KernelChoice(None, f"{TORCH} ({OPT_OUT_ENV}=0)")
    flags = cpu_flags()
    missing = [flag for flag in REQUIRED_FLAGS if flag not in flags]
    if missing:
        return KernelChoice(None, f"{TORCH} (the CPU lacks {', '.join(missing)})")
    if "avx512f" in flags:
        return KernelChoice(None, f"{TORCH} (an AVX-512 CPU)")
    try:
        return KernelChoice(load_native_kernels(), NATIVE)
    except (KernelBuildError, subprocess.TimeoutExpired) as e:
        return KernelChoice(None, f"{TORCH} ({NATIVE} unavailable: {e})")
