"""An emulated CUDA for CPU-only machines: the device and stream-order rules CUDA enforces (or
silently breaks on), with CPU tensors inside.

``with EmulatedCuda(devices=2) as emu:`` makes ``torch.cuda`` report ``devices`` GPUs and lets code
run its CUDA branches unchanged (``device="cuda"``, streams, events, ``record_stream``, pinned
memory), so CI checks what CUDA does differently from the CPU, not only what it computes.

Devices:

- **indices**: a tensor on the emulated device reports ``cuda:N`` (never plain ``cuda``), and
  ``torch.device("cuda")`` means the *calling thread's* current device (0 in a new thread), as on
  CUDA; an un-indexed device compared with an indexed one differs, as on CUDA;
- **wrong device**: an op mixing tensors of ``cuda:0`` and ``cuda:1``, or a CUDA tensor and a CPU
  tensor with elements, raises as CUDA does; so does ``.numpy()`` of a CUDA tensor and
  ``record_stream`` of a tensor on another device than the stream;
- **stream calls**: current streams are per thread and per device; ``torch.cuda.stream``,
  ``Stream``, ``Event`` (and their waits, records, ``synchronize`` and ``query``),
  ``current_stream`` and ``record_stream`` called from any ``gpucache`` module but
  :mod:`gpucache.decode.gpu._streams` raise (the stream helper is the one place for them). A
  device's default stream is one per process, as on CUDA.

Stream order (vector clocks; a violation raises :class:`StreamOrderError`):

- **happens-before**: every stream has a vector clock. An op on a device's tensors is queued on the
  calling thread's current stream of *that* device and ticks its clock; every storage keeps the
  (stream, tick) of its last write and of the reads since. ``Event.record`` captures a stream's
  clock, ``wait_event``/``wait_stream`` join it; ``torch.cuda.synchronize``, ``Stream``/``Event``
  ``.synchronize`` and ``query()`` join it into the calling thread's *host* clock, which every
  later op of that thread joins into its stream (work queued after the host saw work finish runs
  after it). Reading memory last written on another stream, or writing memory read or written on
  another stream, without that edge raises, naming both streams. View ops (slicing, ``view``,
  ``transpose``) queue no kernel and access nothing. Host clocks are per thread and a new thread
  starts with none: a synchronisation in one thread orders nothing queued by another;
- **caching allocator**: a storage is allocated on the current stream of its device and, when
  freed, its block goes to that (device, stream)'s free list; the next allocation there of at most
  its size reuses it (best fit, whole blocks) and *inherits its history*: a write into the reused
  block by a stream not ordered after the old tensor's accesses raises (the use-after-free of a
  tensor used on another stream without ``record_stream``). ``record_stream(s)`` makes the block
  wait for ``s``: as CUDA's allocator reuses it only once the events it records on ``s`` at the
  free have completed, ``s``'s accesses are dropped from the history (emulated kernels finish when
  they are queued, so the events have completed by the next allocation). ``emu.reuses`` counts
  reuses; ``memory_allocated`` counts live blocks, ``memory_reserved`` live and cached ones;
- **pinned memory**: ``pin_memory()`` copies into (and ``pin_memory=True`` factories make) pinned
  memory, ``is_pinned()`` tells it. ``.to(cuda, non_blocking=True)`` of a pinned tensor is a write
  on the current stream and no host sync; the host writing the pinned source before the copy is
  known done raises. A device-to-host ``non_blocking`` copy lands in pinned memory that the host may
  read only after a synchronisation. Any copy from pageable memory to the device synchronises (CUDA
  stages it), as does a blocking copy either way;
- **host syncs**: ``emu.host_syncs`` lists every host synchronisation (:class:`HostSync`: thread,
  reason, stream, where): ``torch.cuda.synchronize``, stream and event ``synchronize``,
  ``.cpu()``/``.item()``/``.tolist()``/``bool()``/``repr`` of CUDA tensors, device-to-host and
  pageable host-to-device copies (``torch.tensor(data, device=cuda)``, ``.to(cuda)`` of a plain
  tensor, a CPU index tensor), data-dependent shapes (``nonzero``, boolean masks, ``unique``) and
  the decoder's own. ``emu.host_syncs_in(thread)`` filters one thread; ``with emu.count_syncs()
  as c:`` counts the calling thread's only (``len(c)``).

nvJPEG (``torchvision.io.decode_jpeg(..., device=cuda)``, TorchCodec's ``decode_jpeg`` alike):

- decodes on the CPU (libjpeg-turbo; EXIF ignored as torchvision does on CUDA, applied as
  TorchCodec does) into outputs **allocated on the current stream** of the device and **written by
  the decoder's private stream**, which waits for nothing but the host (pytorch/vision PR 9606): a
  block reused from the current stream's free list whose old tensor still has work queued there is
  a write-after-read violation. torchvision then synchronises the private stream with the host
  (two host syncs, counted) and makes the current stream wait for it (``event.block``). The
  emulation grants the host no ordering from that synchronisation (``trust_decoder_sync=True``
  does): the decoders document the current stream as where the outputs are ready, newer builds
  decode on the current stream without it (TorchCodec), so a second stream must wait for the
  current one before reading them. Called on a device's *default* stream from gpucache it raises
  (gpucache decodes under its allocation stream); code outside gpucache (a training script, a
  benchmark's baseline) may decode anywhere and gets the decoder as PR 9606 fixes it (the private
  stream first waits for the current stream);
- torchvision keeps one global decoder, rebuilt (the old one leaked) whenever a call's device
  differs from the previous call's as a ``torch.device`` (``cuda`` vs ``cuda:0`` differ):
  ``emu.decoder_rebuilds`` counts rebuilds, a new decoder comes with a new private stream;
- ``decoder_fault="oom"`` makes every CUDA decode raise torchvision's ``RuntimeError("Error while
  decoding JPEG images: CUDA out of memory. Tried to allocate ...")`` (it rethrows CUDA's error as
  a plain RuntimeError), ``"alloc"`` raise nvJPEG's own allocator failure as torchvision says it
  (``"Error while decoding JPEG images: Failed to decode batch: 5"``, 5 being
  NVJPEG_STATUS_ALLOCATOR_FAILURE), ``"init"`` makes building the decoder raise its ``"Failed to
  initialize nvjpeg with hardware backend: 5"``; ``emu.decoder_fault`` may be changed inside the
  block. ``emu.decode_calls`` counts CUDA decode calls;
- the decoder's own device memory (nvJPEG's buffers, outside torch's caching allocator):
  ``emulated_nvjpeg.DECODER_BYTES`` a decoder built (a rebuilt one's are leaked with it), and
  ``decoder_leak=B`` more bytes every CUDA decode call (a decoder that leaks); ``mem_get_info``
  counts them (``emu.outside`` a device), ``memory_allocated``/``memory_reserved`` do not.
  During a call nvJPEG also needs work memory of its own, 3 bytes a pixel of the batch
  (``emulated_nvjpeg.work_bytes``): when the device's free memory (``total_memory`` less what
  torch reserved, cached blocks included, and ``emu.outside``) is short of it, the call fails
  with ``"Error while decoding JPEG images: Failed to initialize batch decoding: 5"``, as
  nvJPEG's ``cudaMalloc`` does when torch's cache holds the memory. ``torch.cuda.empty_cache()``
  gives the cached blocks back (``emu.empty_caches`` counts the calls);
- ``stream_pool=N`` hands out ``torch.cuda.Stream()`` as torch does, round-robin from a pool of
  ``N`` streams a device (32 in torch), so the library's streams may be ones a user computes on.

A violation raised inside the block and swallowed by the code under test (a decoder error retried
on the CPU) is raised again, as the first of ``emu.violations``, when the block exits; a test that
expects one inside the block clears ``emu.violations``. Tensors "on" an emulated GPU are CPU
tensors of a subclass that carries the index; a ``TorchFunctionMode`` (entered in every thread
started inside the block) applies the rules: devices and copies here, stream order in
:mod:`.emulated_order`, the decoder in :mod:`.emulated_nvjpeg`. Nothing here is imported by the
library itself.
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from collections import deque
from dataclasses import dataclass
from typing import ClassVar

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten, tree_map

from .emulated_nvjpeg import emulated_decode_jpeg
from .emulated_order import (
    STREAM_HELPER,
    Event,
    HostSync,
    OrderRules,
    Stream,
    StreamOrderError,
    SyncCount,
    _Block,
    _check_stream_caller,
    _cls,
    _Current,
    _inplace_target,
    _join,
    _mark_pinned,
    _OnGpu,
    _pin_of,
    _what,
)

__all__ = [
    "STREAM_HELPER",
    "EmulatedCuda",
    "Event",
    "HostSync",
    "Stream",
    "StreamOrderError",
    "SyncCount",
]

_MIX_OK = {
    "copy_",
    "__setitem__",
    "__getitem__",
    "index_put_",
    "__get__",
    "__set__",
    "to",
    "cpu",
    "cuda",
    "numpy",
    "pin_memory",
    "is_pinned",
    "get_device",
    "index",
    "index_put",
}
#: Ops on CUDA tensors that return a Python value read from the device: a host sync.
_HOST_READS = {
    "item",
    "tolist",
    "__bool__",
    "__int__",
    "__float__",
    "__index__",
    "__complex__",
    "__repr__",
    "__str__",
    "__format__",
    "__array__",
    "equal",
    "allclose",
    "__contains__",
    "numpy",
}
#: Ops whose output size depends on the data: the host waits for it.
_DATA_SHAPED = {
    "nonzero",
    "argwhere",
    "masked_select",
    "unique",
    "unique_consecutive",
    "bincount",
    "_unique",
    "_unique2",
}
#: Factories that allocate without writing.
_NO_WRITE = {"empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided"}
TOTAL_MEMORY = 80 * 2**30  # each emulated device's memory unless given
_SMALL_BLOCK = 2**20  # torch's small pool: blocks of at most 1 MiB, from 2 MiB segments


@dataclass(frozen=True)
class _Properties:
    name: str
    total_memory: int
    major: int
    minor: int
    multi_processor_count: int


class _Mode(TorchFunctionMode):
    def __init__(self, emu: EmulatedCuda):
        super().__init__()
        self.emu = emu

    def __torch_function__(self, func, types, args=(), kwargs=None):
        return self.emu.handle(func, args, kwargs)


class EmulatedCuda(OrderRules):
    """Context manager: ``torch.cuda`` with ``devices`` emulated GPUs (see the module doc)."""

    _active: EmulatedCuda | None = None
    #: A device's default stream, one per process as on CUDA (tensors and transforms that cache
    #: device tensors outlive an EmulatedCuda block; the next block sees the same stream).
    _defaults: ClassVar[dict[int, Stream]] = {}

    def __init__(
        self,
        devices: int = 2,
        *,
        default_stream_decode: str = "raise",
        decoder_fault: str | None = None,
        trust_decoder_sync: bool = False,
        stream_pool: int | None = None,
        decoder_stream_from_pool: bool = False,
        decoder_leak: int = 0,
        total_memory: int = TOTAL_MEMORY,
        fail_mid_decode: bool = False,
        decode_rendezvous: int | None = None,
        rendezvous_timeout_s: float = 10.0,
    ):
        if decoder_fault not in (None, "oom", "alloc", "init"):
            raise ValueError(
                f"decoder_fault={decoder_fault!r}: use None, 'oom', 'alloc' or 'init'."
            )
        self.devices = devices
        self.default_stream_decode = default_stream_decode  # "allow": isolate the other rules
        self.decoder_fault = decoder_fault
        self.trust_decoder_sync = trust_decoder_sync
        self.stream_pool = stream_pool  # None: every Stream() its own stream
        if decoder_stream_from_pool and stream_pool is None:
            raise ValueError("decoder_stream_from_pool=True needs a stream_pool.")
        self.decoder_stream_from_pool = decoder_stream_from_pool  # torchvision's, from the pool
        self.decoder_leak = decoder_leak  # bytes a CUDA decode call never gives back
        self.total_memory = total_memory  # each device's, as get_device_properties reports it
        self.fail_mid_decode = fail_mid_decode  # memory short: fail inside nvjpegDecodeBatched
        self.decode_rendezvous = decode_rendezvous  # calls held until this many are inside
        self.rendezvous_timeout_s = rendezvous_timeout_s
        self.rendezvous_met = self.rendezvous_missed = False
        self.decode_active = 0  # CUDA decode calls inside the decoder now
        self.decode_overlap = 0  # the most at once
        self.codec_decoders_built = 0  # TorchCodec decoders built (each call takes its own)
        self.outside = [0] * devices  # device bytes held outside torch's caching allocator
        self.decode_calls = 0  # CUDA decode calls (failed ones too)
        self.empty_caches = 0  # torch.cuda.empty_cache() calls
        self._pooled: dict[tuple[int, int], list[Stream]] = {}
        self._made_streams: dict[tuple[int, int], int] = {}
        self.decoder_rebuilds = 0
        self.reuses = 0
        self.host_syncs: list[HostSync] = []
        self.violations: list[StreamOrderError] = []
        self._mode = _Mode(self)
        self._local = threading.local()
        self._lock = threading.RLock()
        self._streams: list[Stream] = []
        self._seen_defaults: dict[int, Stream] = {}
        self._free: dict[tuple[int, Stream], list[_Block]] = {}
        self._freed: deque[_Block] = deque()
        self._allocated = [0] * devices
        self._reserved = [0] * devices
        self._pin_pending: weakref.WeakSet = weakref.WeakSet()
        self._tv_decoder: tuple[torch.device, Stream] | None = None
        self._tv_mutex = threading.Lock()  # torchvision's decoderMutex: one call at a time
        self._codec_idle: dict[int, list[Stream]] = {}  # TorchCodec's idle decoders a device
        self._decode_cond = threading.Condition(self._lock)
        self._saved: list[tuple[object, str, object]] = []

    # ------------------------------------------------------------------ per-thread state
    def current_index(self) -> int:
        return getattr(self._local, "device", 0)  # a new thread starts on device 0, as on CUDA

    def index_device(self, device=None) -> torch.device:
        if device is None:
            return torch.device("cuda", self.current_index())
        dev = torch.device("cuda", device) if isinstance(device, int) else torch.device(device)
        if dev.type != "cuda":
            raise ValueError(f"emulated CUDA: expected a cuda device, got {dev}")
        index = self.current_index() if dev.index is None else dev.index
        if not 0 <= index < self.devices:
            raise RuntimeError(
                f"CUDA error: invalid device ordinal {index} (emulated: {self.devices} devices)"
            )
        return torch.device("cuda", index)

    def current_stream(self, device=None) -> Stream:
        return self._stream_of(self.index_device(device).index)

    def _stream_of(self, index: int) -> Stream:
        streams = getattr(self._local, "streams", None)
        stream = streams.get(index) if streams else None
        return stream if stream is not None else self._default(index)

    def _default(self, index: int) -> Stream:
        stream = self._seen_defaults.get(index)
        if stream is None:
            stream = EmulatedCuda._defaults.get(index)
            if stream is None:
                stream = EmulatedCuda._defaults[index] = Stream(
                    torch.device("cuda", index), _default=True
                )
            elif stream not in self._streams:
                self._streams.append(stream)
            self._seen_defaults[index] = stream
        return stream

    @contextlib.contextmanager
    def device_context(self, device):
        if device is None or (isinstance(device, int) and device < 0):
            yield
            return
        prev = self.current_index()
        self._local.device = self.index_device(device).index
        try:
            yield
        finally:
            self._local.device = prev

    def stream_context(self, stream: Stream | None):
        _check_stream_caller("torch.cuda.stream")  # where the context is made, not entered
        return self._stream_context(stream)

    @contextlib.contextmanager
    def _stream_context(self, stream: Stream | None):
        if stream is None:
            yield
            return
        prev_device = self.current_index()
        streams = getattr(self._local, "streams", None)
        if streams is None:
            streams = self._local.streams = {}
        prev = streams.get(stream.device.index)
        streams[stream.device.index] = stream
        self._local.device = stream.device.index  # torch.cuda.set_stream switches the device
        try:
            yield
        finally:
            self._local.device = prev_device
            if prev is None:
                streams.pop(stream.device.index, None)
            else:
                streams[stream.device.index] = prev

    def set_device(self, device) -> None:
        self._local.device = self.index_device(device).index

    def _pool_stream(self, device=None, priority: int = 0, *, label: str | None = None) -> Stream:
        """``torch.cuda.Stream()`` as torch hands it out: the next of ``stream_pool`` streams of
        the device and priority, round-robin, so the pool's size-plus-first one is the first one
        again (two callers may compute on one stream without knowing it). torch keeps a pool for
        each priority level (0, the default and lowest, and -1 to -3, higher), so streams of
        another priority never come from the same pool. ``label``: a stream a library takes
        from the pool (torchvision's decoder), made here when the pool is not full yet."""
        index = self.index_device(device).index
        key = (index, min(0, max(-3, int(priority))))
        made = self._made_streams.get(key, 0)
        self._made_streams[key] = made + 1
        pool = self._pooled.setdefault(key, [])
        if made < self.stream_pool:
            pool.append(Stream(device, priority, _label=label))
        return pool[made % self.stream_pool]

    def get_device_properties(self, device=None):
        """What ``torch.cuda.get_device_properties`` tells: a ``total_memory`` device (80 GiB
        unless given)."""
        index = self.index_device(device).index
        return _Properties(f"emulated CUDA device {index}", self.total_memory, 9, 0, 132)

    def mem_get_info(self, device=None) -> tuple[int, int]:
        """(free, total) bytes: the total less what the emulated allocator reserved and what
        the decoders hold outside it."""
        index = self.index_device(device).index
        total = self.total_memory
        return total - self.memory_reserved(device) - self.outside[index], total

    def empty_cache(self) -> None:
        """``torch.cuda.empty_cache()``: every device's cached free blocks of the large pool go
        back (reserved falls by their size). Blocks of at most 1 MiB stay cached, with their
        history: torch carves them from 2 MiB segments and releases a segment only when all of
        it is free, which one live block of it prevents (the emulation assumes one does)."""
        with self._lock:
            self._drain()
            self.empty_caches += 1
            for (index, _), blocks in self._free.items():
                gone = [b for b in blocks if b.size > _SMALL_BLOCK]
                self._reserved[index] -= sum(b.size for b in gone)
                blocks[:] = [b for b in blocks if b.size <= _SMALL_BLOCK]

    # ------------------------------------------------------------------ tensors
    def _wrap(self, out, index: int | None):
        if index is None:
            return out

        def wrap(x):
            if isinstance(x, torch.Tensor) and not isinstance(x, _OnGpu):
                x = x.as_subclass(_cls(index))
            return x

        return tree_map(wrap, out)

    @staticmethod
    def _plain(x):
        return x.as_subclass(torch.Tensor) if isinstance(x, _OnGpu) else x

    def _target(self, value) -> int | None:
        """The emulated index a device argument names (None for the CPU)."""
        if isinstance(value, torch.Tensor):
            return value.gpu_index if isinstance(value, _OnGpu) else None
        dev = torch.device(value)
        return self.index_device(dev).index if dev.type == "cuda" else None

    def handle(self, func, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        owner = getattr(func, "__self__", None)
        if owner is torch._C.TensorBase.device:
            t = args[0]
            return torch.device("cuda", t.gpu_index) if isinstance(t, _OnGpu) else func(*args)
        if owner is torch._C.TensorBase.is_cuda:
            return isinstance(args[0], _OnGpu)
        name = getattr(func, "__name__", "")
        flat, _ = tree_flatten((args, kwargs))
        gpu = [x for x in flat if isinstance(x, _OnGpu)]
        on = {x.gpu_index for x in gpu}
        cpu = [x for x in flat if isinstance(x, torch.Tensor) and not isinstance(x, _OnGpu)]
        big_cpu = [x for x in cpu if x.dim() > 0]
        if name not in _MIX_OK and (len(on) > 1 or (on and big_cpu)):
            found = sorted(f"cuda:{i}" for i in on) + (["cpu"] if big_cpu else [])
            raise RuntimeError(
                f"Expected all tensors to be on the same device, but found at "
                f"least two devices, {found[0]} and {found[1]}! (emulated CUDA, "
                f"in {name})"
            )
        index = next(iter(on)) if on else None
        plain_args, plain_kwargs = tree_map(self._plain, (args, kwargs))
        if name == "numpy" and on:
            raise TypeError(
                f"can't convert cuda:{index} device type tensor to numpy. Use "
                "Tensor.cpu() to copy the tensor to host memory first."
            )
        if name == "is_pinned":
            return not on and _pin_of(plain_args[0]) is not None
        if name == "pin_memory":
            return self._pin(plain_args[0], on)
        if name == "get_device":
            return -1 if index is None else index
        if name in ("cpu", "cuda", "to", "copy_"):
            return self._copy(name, func, args, plain_args, plain_kwargs, index, gpu)
        pin = bool(plain_kwargs.get("pin_memory"))
        if pin:
            plain_kwargs["pin_memory"] = False
        out_index = index
        if plain_kwargs.get("device") is not None:
            out_index = self._target(plain_kwargs["device"])
            plain_kwargs["device"] = "cpu"
        if index is None and out_index is None:  # a CPU op
            if self._pin_pending and cpu:
                self._host_touch(name, plain_args, plain_kwargs, cpu)
            out = func(*plain_args, **plain_kwargs)
            if pin:
                _mark_pinned(out)
            return out
        target = _inplace_target(name, args, kwargs)
        return self._device_op(
            name,
            func,
            plain_args,
            plain_kwargs,
            gpu,
            big_cpu,
            target,
            index if index is not None else out_index,
            out_index,
        )

    def _device_op(self, name, func, args, kwargs, gpu, big_cpu, target, index, out_index):
        """An op on (or making) tensors of emulated device ``index``: one kernel on its current
        stream, unless it only makes views or reads metadata. ``target``: the (original) tensor
        it writes in place, if any."""
        out = self._wrap(func(*args, **kwargs), out_index)
        outs = [x for x in tree_flatten(out)[0] if isinstance(x, _OnGpu)]
        host_read = name in _HOST_READS
        if target is None and not outs and not host_read:
            return out  # metadata (shape, dtype, data_ptr, ...): no kernel
        with torch._C.DisableTorchFunction():
            ins = {id(x.untyped_storage()) for x in gpu}
            fresh = [x for x in outs if id(x.untyped_storage()) not in ins]
            if target is None and not fresh and not host_read:
                return out  # views of the inputs: no kernel
            stream = self._stream_of(index)
            with self._lock:
                tick = self._tick(stream)
                for x in gpu:
                    if (
                        x is not target
                        and x.numel()
                        and (blk := self._block(x, x.gpu_index)) is not None
                    ):
                        self._read(blk, stream, tick, name, _what(x))
                writes = ([target] if isinstance(target, _OnGpu) else []) + (
                    [] if name in _NO_WRITE else fresh
                )
                for x in writes:
                    if x.numel() and (blk := self._block(x, x.gpu_index, stream)) is not None:
                        self._write(blk, stream, tick, name, _what(x))
                for x in fresh:
                    self._block(x, x.gpu_index, stream)  # allocated here even if not written
        if host_read:
            self._host_sync(
                f"{name} of a cuda:{index} tensor (device-to-host read)", [stream], credit=True
            )
        elif (
            big_cpu
            or name == "new_tensor"
            or (name in ("tensor", "as_tensor", "asarray") and not gpu)
        ):
            self._host_sync(
                f"{name} of host data on cuda:{index} (a pageable host-to-device copy)",
                [stream],
                credit=True,
            )
        elif (
            name in _DATA_SHAPED
            or (name == "repeat_interleave" and kwargs.get("output_size") is None)
            or (
                name in ("__getitem__", "index", "index_put_", "__setitem__")
                and any(
                    isinstance(x, torch.Tensor) and x.dtype == torch.bool
                    for x in tree_flatten(args[1:2])[0]
                )
            )
        ):
            self._host_sync(f"{name}: an output size read from the device", [stream], credit=True)
        return out

    # ------------------------------------------------------------------ copies and pinning
    def _pin(self, t: torch.Tensor, on) -> torch.Tensor:
        if on:
            raise RuntimeError(
                f"cannot pin '{t.type()}' only dense CPU tensors can be pinned "
                "(emulated CUDA: the tensor is on a CUDA device)"
            )
        if _pin_of(t) is not None:
            return t
        if self._pin_pending:
            self._host_touch("pin_memory", (t,), {}, [t])
        out = t.clone()
        _mark_pinned(out)
        return out

    def _copy(self, name, func, orig, args, kwargs, index, gpu):
        """``cpu``, ``cuda``, ``to`` and ``copy_``: the device rules of each direction."""
        if name == "copy_":
            dst, src = orig[0], orig[1]
            non_blocking = bool(args[2] if len(args) > 2 else kwargs.get("non_blocking", False))
            src_i = src.gpu_index if isinstance(src, _OnGpu) else None
            dst_i = dst.gpu_index if isinstance(dst, _OnGpu) else None
            if src_i is None and dst_i is None:
                return self._cpu_op(name, func, args, kwargs)
            func(*args, **kwargs)
            return self._transfer(name, src, dst, src_i, dst_i, non_blocking)
        src, src_i, non_blocking, rest = orig[0], index, False, []
        if name == "cpu":
            target = None
        elif name == "cuda":
            dev = args[1] if len(args) > 1 else kwargs.pop("device", None)
            non_blocking = bool(args[2] if len(args) > 2 else kwargs.pop("non_blocking", False))
            target = self._target(
                "cuda"
                if dev is None
                else torch.device("cuda", dev)
                if isinstance(dev, int)
                else dev
            )
        else:  # to(device, dtype, non_blocking, copy) or to(tensor, ...)
            target, bools = src_i, 0
            for a in args[1:]:
                if isinstance(a, (str, torch.device, torch.Tensor)):
                    target = self._target(a)
                    rest.append(a.dtype if isinstance(a, torch.Tensor) else "cpu")
                else:
                    if isinstance(a, bool):  # non_blocking comes before copy
                        non_blocking, bools = (a, 1) if not bools else (non_blocking, 2)
                    rest.append(a)
            if kwargs.get("device") is not None:
                target = self._target(kwargs["device"])
                kwargs["device"] = "cpu"
            non_blocking = non_blocking or bool(kwargs.get("non_blocking", False))
        if src_i is None and target is None:
            return self._cpu_op(name, func, args, kwargs)
        plain = args[0]
        out = (
            func(plain, *rest, **kwargs)
            if name == "to"
            else plain
            if name == "cuda"
            else func(*args, **kwargs)
        )
        if src_i == target:  # the same device: the tensor itself, or a dtype change (a kernel)
            if out is plain:
                return src
            return self._device_op_done(name, src, self._wrap(out, target), target)
        if out is plain:
            out = out.clone()  # a move between devices is a copy
        out = self._wrap(out, target)
        return self._transfer(name, src, out, src_i, target, non_blocking)

    def _cpu_op(self, name, func, args, kwargs):
        cpu = [x for x in tree_flatten((args, kwargs))[0] if isinstance(x, torch.Tensor)]
        if self._pin_pending and cpu:
            self._host_touch(name, args, kwargs, cpu)
        return func(*args, **kwargs)

    def _device_op_done(self, name, src, out, index):
        """A kernel on one device that already ran: ``src`` read, ``out`` written."""
        with torch._C.DisableTorchFunction(), self._lock:
            stream = self._stream_of(index)
            tick = self._tick(stream)
            if (blk := self._block(src, index)) is not None:
                self._read(blk, stream, tick, name, _what(src))
            if (blk := self._block(out, index, stream)) is not None:
                self._write(blk, stream, tick, name, _what(out))
        return out

    def _transfer(self, name, src, dst, src_i, dst_i, non_blocking):
        """A copy of ``src`` into ``dst`` (returned) between the host and a device, or two
        devices."""
        result = dst
        where = "cuda:%s" % (src_i if dst_i is None else dst_i)
        with torch._C.DisableTorchFunction():
            if src_i is not None and dst_i is not None:  # device to device
                s_src, s_dst = self._stream_of(src_i), self._stream_of(dst_i)
                with self._lock:  # torch's two-way barrier around a cross-device copy
                    _join(s_src.clock, s_dst.clock)
                    tick = self._tick(s_src)
                    if (blk := self._block(src, src_i)) is not None:
                        self._read(blk, s_src, tick, name, _what(src))
                    if (blk := self._block(dst, dst_i, s_dst)) is not None:
                        self._write(blk, s_src, tick, name, _what(dst))
                    _join(s_dst.clock, s_src.clock)
                return result
            if dst_i is not None:  # host to device
                stream = self._stream_of(dst_i)
                pin = _pin_of(src)
                with self._lock:
                    if self._pin_pending:
                        self._host_touch(name, (src,), {}, [src])
                    tick = self._tick(stream)
                    if (blk := self._block(dst, dst_i, stream)) is not None:
                        self._write(blk, stream, tick, name, _what(dst))
                    if pin is not None and non_blocking:
                        pin.read = (stream, tick)
                        self._pin_pending.add(src.untyped_storage())
                if pin is None or not non_blocking:
                    why = (
                        "non_blocking copy from pageable memory (CUDA stages it, waiting for "
                        "the stream)"
                        if non_blocking
                        else "blocking copy"
                    )
                    self._host_sync(f"{name}: host-to-{where} {why}", [stream], credit=True)
                return result
            stream = self._stream_of(src_i)  # device to host
            with self._lock:
                tick = self._tick(stream)
                if (blk := self._block(src, src_i)) is not None:
                    self._read(blk, stream, tick, name, _what(src))
                if non_blocking and (name != "copy_" or _pin_of(dst) is not None):
                    if name != "copy_":
                        _mark_pinned(dst)  # torch puts a non_blocking download in pinned memory
                    _pin_of(dst).write = (stream, tick)
                    self._pin_pending.add(dst.untyped_storage())
                    return result
            self._host_sync(f"{name}: {where}-to-host copy", [stream], credit=True)
            return result

    # ------------------------------------------------------------------ entering and leaving
    def _patch(self, obj, name: str, value) -> None:
        self._saved.append((obj, name, getattr(obj, name)))
        setattr(obj, name, value)

    def __enter__(self):
        if EmulatedCuda._active is not None:
            raise RuntimeError("EmulatedCuda is already active")
        EmulatedCuda._active = _Current.emu = self
        try:
            return self._enter()
        except BaseException:  # half entered: put everything back, so a later block can enter
            self._restore()
            raise

    def _enter(self):
        c = torch.cuda
        for name, value in {
            "is_available": lambda: True,
            "device_count": lambda: self.devices,
            "current_device": self.current_index,
            "set_device": self.set_device,
            "device": self.device_context,
            "stream": self.stream_context,
            "Stream": Stream if self.stream_pool is None else self._pool_stream,
            "Event": Event,
            "synchronize": self.synchronize,
            "current_stream": self._current_stream_api,
            "default_stream": self._default_api,
            "memory_allocated": self.memory_allocated,
            "memory_reserved": self.memory_reserved,
            "get_device_name": lambda device=None: f"emulated CUDA ({self.devices} devices)",
            "get_device_properties": self.get_device_properties,
            "mem_get_info": self.mem_get_info,
            "empty_cache": self.empty_cache,
        }.items():
            self._patch(c, name, value)
        self._patch(
            torch.Tensor,
            "record_stream",  # torch's parser takes only real streams
            lambda tensor, stream: self._record_stream(tensor, stream),
        )
        import torchvision.io

        self._patch(
            torchvision.io,
            "decode_jpeg",
            emulated_decode_jpeg(torchvision.io.decode_jpeg, library="torchvision"),
        )
        try:
            import torchcodec.decoders
        except Exception:  # noqa: BLE001 - not installed, or does not load: nothing to emulate
            pass
        else:
            self._patch(
                torchcodec.decoders,
                "decode_jpeg",
                emulated_decode_jpeg(torchcodec.decoders.decode_jpeg, library="torchcodec"),
            )
        run, mode = threading.Thread.run, self._mode

        def run_in_mode(thread):  # every thread started inside the block follows the rules
            with mode:
                run(thread)

        self._patch(threading.Thread, "run", run_in_mode)
        self._mode.__enter__()
        return self

    def _restore(self) -> None:
        for obj, name, value in reversed(self._saved):
            setattr(obj, name, value)
        self._saved.clear()
        EmulatedCuda._active = _Current.emu = None

    def __exit__(self, *exc):
        self._mode.__exit__(*exc)
        self._restore()
        if exc[0] is None and self.violations:
            first = self.violations[0]
            raise StreamOrderError(
                f"{first} [{len(self.violations)} stream-order violation(s) "
                "inside the EmulatedCuda block were caught by the code under "
                "test; the first is above]"
            ) from first

    def _current_stream_api(self, device=None) -> Stream:
        _check_stream_caller("torch.cuda.current_stream")
        return self.current_stream(device)

    def _default_api(self, device=None) -> Stream:
        _check_stream_caller("torch.cuda.default_stream")
        return self._default(self.index_device(device).index)
