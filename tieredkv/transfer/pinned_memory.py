"""Page-locked host memory of exactly the size asked: an anonymous mapping registered with CUDA.

Why not ``torch.empty(..., pin_memory=True)``: that goes through PyTorch's caching host
allocator, which rounds every request up to a power of two and keeps the block for the
process's life (``host_bytes: 40GiB`` would page-lock 64 GiB of RAM). ``cudaHostRegister``
on an anonymous mapping locks exactly the pages asked for, and ``cudaHostUnregister`` gives
them back when the host tier closes.
"""

from __future__ import annotations

import contextlib
import ctypes
import mmap
import os
import weakref
from typing import Any, Protocol

import torch

# cudaHostRegisterPortable | cudaHostRegisterMapped: pinned for every CUDA context, and mapped
# into the device address space (the CuPy backend's kernel reads the pool through UVA).
HOST_REGISTER_FLAGS = 1 | 2
CUDA_ERROR_MEMORY_ALLOCATION = 2  # cudaErrorMemoryAllocation: "out of memory"


class HostRegisterError(RuntimeError):
    """``cudaHostRegister`` refused; ``code`` is the cudaError value."""

    def __init__(self, code: int, text: str) -> None:
        super().__init__(f"cudaHostRegister failed: {text} (cudaError {code})")
        self.code = code


class Registrar(Protocol):
    """Page-locks and releases host memory (the CUDA runtime, or a test double)."""

    name: str

    def register(self, ptr: int, size: int) -> None: ...

    def unregister(self, ptr: int) -> None: ...


class TorchCudart:
    """``cudaHostRegister`` through PyTorch's own CUDA runtime bindings."""

    name = "torch.cuda.cudart"

    def __init__(self) -> None:
        self._rt: Any = torch.cuda.cudart()  # initialises CUDA; raises without it
        if not hasattr(self._rt, "cudaHostRegister"):
            raise RuntimeError("this torch build's cudart has no cudaHostRegister")

    def _text(self, code: int) -> str:
        try:
            return str(self._rt.cudaGetErrorString(self._rt.cudaError(code)))
        except Exception:  # noqa: BLE001 - an unknown code still gets reported by number
            return "unknown CUDA error"

    def register(self, ptr: int, size: int) -> None:
        code = int(self._rt.cudaHostRegister(ptr, size, HOST_REGISTER_FLAGS))
        if code:
            self._clear_last_error()
            raise HostRegisterError(code, self._text(code))

    def _clear_last_error(self) -> None:
        """Reset the thread's last CUDA error that the refusal left set: torch checks
        ``cudaGetLastError`` after every kernel launch, so the next one would raise it.
        torch's cudart bindings have no ``cudaGetLastError`` (newer ones might): call it in the
        libcudart this process loaded, if one is mapped (a static cudart cannot be reached)."""
        with contextlib.suppress(Exception):  # best effort: the refusal is what to report
            get_last_error = getattr(self._rt, "cudaGetLastError", None)
            if get_last_error is None:
                lib = loaded_cudart()
                get_last_error = None if lib is None else lib.cudaGetLastError
            if get_last_error is not None:
                get_last_error()

    def unregister(self, ptr: int) -> None:
        code = int(self._rt.cudaHostUnregister(ptr))
        if code:
            raise HostRegisterError(code, self._text(code))


class CupyRuntime:
    """``cudaHostRegister`` through CuPy, for torch builds without the cudart bindings."""

    name = "cupy.cuda.runtime"

    def __init__(self) -> None:
        import cupy

        self._rt = cupy.cuda.runtime

    def register(self, ptr: int, size: int) -> None:
        try:
            self._rt.hostRegister(ptr, size, HOST_REGISTER_FLAGS)
        except self._rt.CUDARuntimeError as exc:
            raise HostRegisterError(int(getattr(exc, "status", -1)), str(exc)) from exc

    def unregister(self, ptr: int) -> None:
        self._rt.hostUnregister(ptr)


def cuda_registrar() -> Registrar:
    """The first CUDA runtime binding that can page-lock memory here."""
    try:
        return TorchCudart()
    except (AssertionError, AttributeError, RuntimeError) as torch_exc:
        try:
            return CupyRuntime()
        except ImportError:
            raise RuntimeError(
                f"no CUDA runtime binding can page-lock host memory: torch.cuda.cudart() "
                f"failed ({torch_exc}) and cupy is not installed"
            ) from torch_exc


def cudart_path(maps: str) -> str | None:
    """The path of the shared libcudart in ``maps`` (``/proc/self/maps``'s text), if any."""
    for line in maps.splitlines():
        fields = line.split(maxsplit=5)  # address perms offset dev inode [path]
        path = fields[5].strip() if len(fields) == 6 else ""
        if os.path.basename(path).startswith("libcudart.so"):
            return path
    return None


def loaded_cudart() -> Any:
    """The libcudart already mapped into this process (dlopen returns that same copy, whose
    per-thread error state torch reads), or None."""
    try:
        with open("/proc/self/maps", encoding="utf-8", errors="replace") as maps:
            path = cudart_path(maps.read())
        return None if path is None else ctypes.CDLL(path)
    except OSError:
        return None


def _release(registrar: Registrar, ptr: int, mapping: mmap.mmap) -> None:
    """Unregister, then unmap (the unmap waits for any view still alive: BufferError)."""
    with contextlib.suppress(Exception):  # a dying CUDA context must not raise from close/gc
        registrar.unregister(ptr)
    with contextlib.suppress(BufferError):
        mapping.close()


class PinnedMapping:
    """``size`` bytes of anonymous, page-aligned memory, page-locked until :meth:`close`.

    ``pinned_bytes`` is what was registered: ``size`` rounded up to the OS page (equal to
    ``size`` whenever it is a page multiple, as host slots are).
    """

    def __init__(self, size: int, registrar: Registrar | None = None) -> None:
        if size <= 0:
            raise ValueError(f"size must be > 0, got {size}")
        self.size = size
        self.pinned_bytes = -(-size // mmap.PAGESIZE) * mmap.PAGESIZE
        registrar = registrar if registrar is not None else cuda_registrar()
        self.registrar_name = registrar.name
        mapping = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        dont_fork = getattr(mmap, "MADV_DONTFORK", None)  # Linux only
        if dont_fork is not None:
            # A fork() (a worker, a subprocess without exec) would otherwise copy every page of
            # the host tier into the child; pinned pages are no use there anyway.
            with contextlib.suppress(OSError):
                mapping.madvise(dont_fork)
        tensor = torch.frombuffer(mapping, dtype=torch.uint8)
        ptr = tensor.data_ptr()
        try:
            registrar.register(ptr, self.pinned_bytes)
        except BaseException:
            del tensor
            with contextlib.suppress(BufferError):
                mapping.close()
            raise
        self.tensor: torch.Tensor = tensor
        # Unregister even if close() is never called; not at interpreter exit, where the CUDA
        # context may already be gone and the OS takes the memory back anyway.
        self._finalizer = weakref.finalize(self, _release, registrar, ptr, mapping)
        self._finalizer.atexit = False

    @property
    def closed(self) -> bool:
        return not self._finalizer.alive

    def close(self) -> None:
        """Unpin and unmap; views handed out before must no longer be used."""
        self.tensor = torch.empty(0, dtype=torch.uint8)
        self._finalizer()
