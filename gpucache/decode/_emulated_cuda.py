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
  ``Stream``, ``Event``, ``current_stream`` and ``record_stream`` called from any ``gpucache``
  module but :mod:`gpucache.decode._streams` raise (the stream helper is the one place for them).

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
  a plain RuntimeError), ``"init"`` makes building the decoder raise its ``"Failed to initialize
  nvjpeg with hardware backend: 5"`` (NVJPEG_STATUS_ALLOCATOR_FAILURE); ``emu.decoder_fault`` may
  be changed inside the block.

A violation raised inside the block and swallowed by the code under test (a decoder error retried
on the CPU) is raised again, as the first of ``emu.violations``, when the block exits; a test that
expects one inside the block clears ``emu.violations``. Tensors "on" an emulated GPU are CPU
tensors of a subclass that carries the index; a ``TorchFunctionMode`` (entered in every thread
started inside the block) applies the rules. Nothing here is imported by the library itself.
"""

from __future__ import annotations

import contextlib
import linecache
import os
import re
import sys
import threading
import weakref
from collections import deque
from dataclasses import dataclass
from typing import ClassVar

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten, tree_map

#: Modules allowed to call stream and event APIs (besides code outside the gpucache package).
STREAM_HELPER = "gpucache.decode._streams"
_MIX_OK = {"copy_", "__setitem__", "__getitem__", "index_put_", "__get__", "__set__", "to",
           "cpu", "cuda", "numpy", "pin_memory", "is_pinned", "get_device", "index", "index_put"}
#: Ops on CUDA tensors that return a Python value read from the device: a host sync.
_HOST_READS = {"item", "tolist", "__bool__", "__int__", "__float__", "__index__", "__complex__",
               "__repr__", "__str__", "__format__", "__array__", "equal", "allclose",
               "__contains__", "numpy"}
#: Ops whose output size depends on the data: the host waits for it.
_DATA_SHAPED = {"nonzero", "argwhere", "masked_select", "unique", "unique_consecutive",
                "bincount", "_unique", "_unique2"}
#: Factories that allocate without writing.
_NO_WRITE = {"empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided"}
_SKIP_FRAMES = ("torch", "contextlib", "threading", "concurrent.futures")
_BLOCK = 512  # CUDA's caching allocator rounds every size up to 512 bytes
NVJPEG_ALLOCATOR_FAILURE = 5
TOTAL_MEMORY = 80 * 2**30  # each emulated device's memory, as get_device_properties reports it


@dataclass(frozen=True)
class _Properties:
    name: str
    total_memory: int
    major: int
    minor: int
    multi_processor_count: int


class StreamOrderError(RuntimeError):
    """Memory accessed on a stream not ordered after its previous access on another stream."""


@dataclass(frozen=True)
class HostSync:
    """One host synchronisation: which thread waited, why, for which stream, from where."""

    thread: str
    thread_id: int
    reason: str
    stream: str
    where: str


class SyncCount:
    """The host syncs of one thread inside ``with emu.count_syncs() as c:`` (``len(c)``)."""

    def __init__(self) -> None:
        self.syncs: list[HostSync] = []

    def __len__(self) -> int:
        return len(self.syncs)

    def __repr__(self) -> str:
        return f"SyncCount({len(self.syncs)}: {[s.reason for s in self.syncs]})"


class _OnGpu(torch.Tensor):
    """A CPU tensor standing for one on an emulated GPU; subclasses fix the index."""

    __torch_function__ = torch._C._disabled_torch_function_impl
    gpu_index = 0


_CLASSES: dict[int, type] = {}


def _cls(index: int) -> type:
    if index not in _CLASSES:
        _CLASSES[index] = type(f"EmulatedCuda{index}Tensor", (_OnGpu,), {"gpu_index": index})
    return _CLASSES[index]


def _frame_outside(depth: int = 2):
    frame = sys._getframe(depth)
    while frame is not None:
        name = frame.f_globals.get("__name__", "")
        if not (name.startswith(_SKIP_FRAMES) or name == __name__):
            return frame
        frame = frame.f_back
    return None


def _caller() -> str:
    """The first module on the stack outside torch, threading and this file."""
    frame = _frame_outside(3)
    return "" if frame is None else frame.f_globals.get("__name__", "")


def _where(frame=None) -> str:
    frame = frame or _frame_outside(3)
    if frame is None:
        return "?"
    path = frame.f_code.co_filename
    with contextlib.suppress(ValueError):
        path = os.path.relpath(path)
    return f"{path}:{frame.f_lineno}"


def _assigned_name(frame, line: str) -> str | None:
    """The name a ``torch.cuda.Stream(...)`` call on ``line`` is assigned to (``self.side = ``,
    ``a, b = torch.cuda.Stream(), torch.cuda.Stream()``), else None."""
    lhs = re.match(r"\s*([\w.]+(?:\s*,\s*[\w.]+)*)\s*=[^=]", line or "")
    calls = [m.start() for m in re.finditer(r"\btorch\.cuda\.Stream\b", line or "")]
    if frame is None or lhs is None or not calls:
        return None
    names = [n.strip().rsplit(".", 1)[-1] for n in lhs.group(1).split(",")]
    if len(names) != len(calls):
        return None
    col = None
    with contextlib.suppress(Exception):
        col = list(frame.f_code.co_positions())[frame.f_lasti // 2][2]
    before = [c for c in calls if col is not None and c <= col]
    return names[len(before) - 1] if before else names[0] if len(names) == 1 else None


def _check_stream_caller(what: str) -> None:
    who = _caller()
    if who.startswith("gpucache") and who != STREAM_HELPER:
        raise RuntimeError(f"emulated CUDA: {what} called from {who}; stream and event calls "
                           f"belong in {STREAM_HELPER} (the stream helper).")


def _join(dst: dict, src: dict) -> None:
    for k, v in src.items():
        if dst.get(k, 0) < v:
            dst[k] = v


def _size(nbytes: int) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if nbytes >= scale:
            return f"{nbytes / scale:.2f} {unit}"
    return f"{nbytes} bytes"


class Stream:
    """A stream of an emulated device: work runs when queued; its order is a vector clock."""

    _made = 0

    def __init__(self, device=None, priority: int = 0, *, _default: bool = False,
                 _label: str | None = None):
        if not _default and _label is None:
            _check_stream_caller("torch.cuda.Stream")
        emu = _emu()
        self.device = emu.index_device(device)
        self.default = _default
        self.waited: list[object] = []
        self.handed_to: list[str] = []  # who read cuda_stream (e.g. DALI's outputs())
        self.clock: dict[Stream, int] = {self: 0}
        Stream._made += 1
        if _default:
            self.label = f"the default stream of {self.device}"
        elif _label is not None:
            self.label = _label
        else:
            frame = _frame_outside(2)
            line = "" if frame is None else linecache.getline(frame.f_code.co_filename,
                                                              frame.f_lineno)
            named = _assigned_name(frame, line)
            name = f"'{named}' #{Stream._made}" if named else f"#{Stream._made}"
            self.label = f"stream {name} of {self.device} (made at {_where(frame)})"
        emu._streams.append(self)

    @property
    def cuda_stream(self) -> int:
        self.handed_to.append(_caller())
        return 0

    def wait_stream(self, other: Stream) -> None:
        _check_stream_caller("Stream.wait_stream")
        self.waited.append(other)
        _emu()._wait(self, other.clock)

    def wait_event(self, event: Event) -> None:
        _check_stream_caller("Stream.wait_event")
        self.waited.append(event)
        _emu()._wait(self, event.clock)

    def record_event(self, event: Event | None = None) -> Event:
        event = event if event is not None else Event()
        event.record(self)
        return event

    def synchronize(self) -> None:
        _emu()._host_sync("Stream.synchronize", [self], credit=True)

    def query(self) -> bool:
        _join(_emu()._host(), self.clock)  # always done: the host now knows it
        return True

    def __repr__(self) -> str:
        return f"<emulated {self.label}>"


class Event:
    """An event: the clock of its stream when recorded (None before)."""

    def __init__(self, enable_timing: bool = False, blocking: bool = False,
                 interprocess: bool = False):
        _check_stream_caller("torch.cuda.Event")
        self.stream: Stream | None = None
        self.clock: dict[Stream, int] | None = None

    def record(self, stream: Stream | None = None) -> None:
        _check_stream_caller("Event.record")
        emu = _emu()
        self.stream = stream if stream is not None else emu.current_stream()
        with emu._lock:
            _join(self.stream.clock, emu._host())
            self.clock = dict(self.stream.clock)

    def synchronize(self) -> None:
        emu = _emu()
        emu._host_sync("Event.synchronize", [self], credit=True)

    def query(self) -> bool:
        if self.clock is not None:
            _join(_emu()._host(), self.clock)
        return True

    def wait(self, stream: Stream | None = None) -> None:
        emu = _emu()
        emu._wait(stream if stream is not None else emu.current_stream(), self.clock)


class _Block:
    """A block of the caching allocator: its device, owning stream, size and access history."""

    __slots__ = ("__weakref__", "device", "owner", "reads", "recorded", "reused", "size", "used",
                 "write")

    def __init__(self, device: int, owner: Stream, size: int, used: int):
        self.device, self.owner, self.size, self.used = device, owner, size, used
        self.write: tuple[Stream, int, str] | None = None  # (stream, tick, op)
        self.reads: dict[Stream, tuple[int, str]] = {}
        self.recorded: set[Stream] = set()
        self.reused = False  # the history holds an earlier tensor's accesses


class _Pin:
    """Pinned host memory: a non_blocking copy that may still read it, or still write it."""

    __slots__ = ("read", "write")

    def __init__(self) -> None:
        self.read: tuple[Stream, int] | None = None
        self.write: tuple[Stream, int] | None = None


class _Mode(TorchFunctionMode):
    def __init__(self, emu: EmulatedCuda):
        super().__init__()
        self.emu = emu

    def __torch_function__(self, func, types, args=(), kwargs=None):
        return self.emu.handle(func, args, kwargs)


class EmulatedCuda:
    """Context manager: ``torch.cuda`` with ``devices`` emulated GPUs (see the module doc)."""

    _active: EmulatedCuda | None = None
    #: A device's default stream, one per process as on CUDA (tensors and transforms that cache
    #: device tensors outlive an EmulatedCuda block; the next block sees the same stream).
    _defaults: ClassVar[dict[int, Stream]] = {}

    def __init__(self, devices: int = 2, *, default_stream_decode: str = "raise",
                 decoder_fault: str | None = None, trust_decoder_sync: bool = False):
        if decoder_fault not in (None, "oom", "init"):
            raise ValueError(f"decoder_fault={decoder_fault!r}: use None, 'oom' or 'init'.")
        self.devices = devices
        self.default_stream_decode = default_stream_decode  # "allow": isolate the other rules
        self.decoder_fault = decoder_fault
        self.trust_decoder_sync = trust_decoder_sync
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
        self._codec_decoders: dict[int, Stream] = {}
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
            raise RuntimeError(f"CUDA error: invalid device ordinal {index} (emulated: "
                               f"{self.devices} devices)")
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
                stream = EmulatedCuda._defaults[index] = Stream(torch.device("cuda", index),
                                                                _default=True)
            elif stream not in self._streams:
                self._streams.append(stream)
            self._seen_defaults[index] = stream
        return stream

    def _host(self) -> dict:
        host = getattr(self._local, "host", None)
        if host is None:
            host = self._local.host = {}
        return host

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

    # ------------------------------------------------------------------ host syncs
    def _host_sync(self, reason: str, on: list, *, credit: bool) -> None:
        """The calling thread waits for ``on`` (streams or events); ``credit``: it then knows
        their work is done."""
        host = self._host()
        if credit:
            for s in on:
                if s.clock is not None:
                    _join(host, s.clock)
        names = ", ".join(s.label if isinstance(s, Stream) else
                          f"an event of {s.stream.label if s.stream else 'no stream'}"
                          for s in on)
        t = threading.current_thread()
        rec = HostSync(t.name, t.ident or 0, reason, names, _where())
        with self._lock:
            self.host_syncs.append(rec)
        for counter in getattr(self._local, "counters", ()):
            counter.syncs.append(rec)

    def host_syncs_in(self, thread: threading.Thread | str | None = None) -> list[HostSync]:
        """The host syncs made by ``thread`` (a Thread or its name; default: the calling one)."""
        if thread is None:
            thread = threading.current_thread()
        if isinstance(thread, threading.Thread):
            return [s for s in self.host_syncs if s.thread_id == thread.ident]
        return [s for s in self.host_syncs if s.thread == thread]

    @contextlib.contextmanager
    def count_syncs(self):
        """``with emu.count_syncs() as c:`` -> ``c`` holds the calling thread's host syncs."""
        counter = SyncCount()
        counters = getattr(self._local, "counters", None)
        if counters is None:
            counters = self._local.counters = []
        counters.append(counter)
        try:
            yield counter
        finally:
            counters.remove(counter)

    def synchronize(self, device=None) -> None:
        index = self.index_device(device).index
        streams = [s for s in self._streams if s.device.index == index]
        self._host_sync("torch.cuda.synchronize", streams, credit=True)

    # ------------------------------------------------------------------ order
    def _wait(self, stream: Stream, clock: dict | None) -> None:
        with self._lock:
            _join(stream.clock, self._host())
            if clock is not None:
                _join(stream.clock, clock)

    def _tick(self, stream: Stream) -> int:
        """Queue one kernel on ``stream`` (after all the host knows is done); its tick."""
        clock = stream.clock
        _join(clock, self._host())
        clock[stream] += 1
        return clock[stream]

    def _violation(self, message: str) -> StreamOrderError:
        err = StreamOrderError(f"emulated CUDA: stream-order violation: {message}")
        self.violations.append(err)
        return err

    def _describe(self, blk: _Block, what: str) -> str:
        return what + (" (its memory was reused from a freed tensor)" if blk.reused else "")

    def _read(self, blk: _Block, stream: Stream, tick: int, op: str, what: str) -> None:
        w = blk.write
        if w is not None and w[0] is not stream and stream.clock.get(w[0], 0) < w[1]:
            raise self._violation(
                f"{op} at {_where()} reads {self._describe(blk, what)} on {stream.label}, last "
                f"written by {w[2]} on {w[0].label}, and nothing orders that write before this "
                f"read: on CUDA the read may run first and see stale or half-written data. Fix: "
                f"make {stream.label} wait for {w[0].label} first (wait_stream, or wait_event "
                f"on an event recorded after the write).")
        blk.reads[stream] = (tick, op)

    def _write(self, blk: _Block, stream: Stream, tick: int, op: str, what: str) -> None:
        w = blk.write
        if w is not None and w[0] is not stream and stream.clock.get(w[0], 0) < w[1]:
            raise self._violation(self._overwrite(blk, stream, op, what, w[0], w[2], "wrote"))
        for s, (t, rop) in blk.reads.items():
            if s is not stream and stream.clock.get(s, 0) < t:
                raise self._violation(self._overwrite(blk, stream, op, what, s, rop, "read"))
        blk.write = (stream, tick, op)
        blk.reads = {}

    def _overwrite(self, blk: _Block, stream: Stream, op: str, what: str, other: Stream,
                   other_op: str, done: str) -> str:
        msg = (f"{op} at {_where()} writes {self._describe(blk, what)} on {stream.label}; "
               f"{other.label} {done} it ({other_op}) and nothing orders that access before "
               f"this write: on CUDA the write may land first and corrupt it.")
        if blk.reused:
            return (msg + f" The block was freed to {blk.owner.label}'s pool and handed out "
                    f"again while {other.label} may still use it. Fix: record_stream the old "
                    f"tensor on {other.label} (the allocator then waits for it), or never let "
                    f"a stream that waits for nothing write memory freed there.")
        return msg + f" Fix: make {stream.label} wait for {other.label} first."

    # ------------------------------------------------------------------ allocator
    def _drain(self) -> None:
        while self._freed:
            blk = self._freed.popleft()
            self._allocated[blk.device] -= blk.used
            if blk.recorded:  # the allocator's events on those streams have completed
                if blk.write is not None and blk.write[0] in blk.recorded:
                    blk.write = None
                blk.reads = {s: r for s, r in blk.reads.items() if s not in blk.recorded}
                blk.recorded = set()
            self._free.setdefault((blk.device, blk.owner), []).append(blk)

    def _block(self, t: torch.Tensor, index: int, stream: Stream | None = None) -> _Block | None:
        """``t``'s block, allocated on ``stream`` (default: current of ``index``) if new."""
        st = t.untyped_storage()
        blk = getattr(st, "_emu", None)
        if blk is not None or st.nbytes() == 0:
            return blk
        stream = stream or self._stream_of(index)
        need = max(_BLOCK, -(-st.nbytes() // _BLOCK) * _BLOCK)
        self._drain()
        pool = self._free.get((index, stream))
        found = None
        if pool:
            fits = [b for b in pool if b.size >= need]
            if fits:
                found = min(fits, key=lambda b: b.size)
                pool.remove(found)
        if found is None:
            blk = _Block(index, stream, need, need)
            self._reserved[index] += need
        else:
            blk = _Block(index, stream, found.size, need)
            blk.write, blk.reads, blk.reused = found.write, dict(found.reads), True
            self.reuses += 1
        self._allocated[index] += need
        st._emu = blk
        weakref.finalize(st, self._freed.append, blk)
        return blk

    def memory_allocated(self, device=None) -> int:
        index = self.index_device(device).index
        with self._lock:
            self._drain()
            return self._allocated[index]

    def memory_reserved(self, device=None) -> int:
        index = self.index_device(device).index
        with self._lock:
            self._drain()
            return self._reserved[index]

    def get_device_properties(self, device=None):
        """What ``torch.cuda.get_device_properties`` tells: an 80 GiB device."""
        index = self.index_device(device).index
        return _Properties(f"emulated CUDA device {index}", TOTAL_MEMORY, 9, 0, 132)

    def mem_get_info(self, device=None) -> tuple[int, int]:
        """(free, total) bytes: the total less what the emulated allocator reserved."""
        return TOTAL_MEMORY - self.memory_reserved(device), TOTAL_MEMORY

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

    @staticmethod
    def _what(t: torch.Tensor) -> str:
        return f"a {tuple(t.shape)} {str(t.dtype).replace('torch.', '')} tensor"

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
            raise RuntimeError(f"Expected all tensors to be on the same device, but found at "
                               f"least two devices, {found[0]} and {found[1]}! (emulated CUDA, "
                               f"in {name})")
        index = next(iter(on)) if on else None
        plain_args, plain_kwargs = tree_map(self._plain, (args, kwargs))
        if name == "numpy" and on:
            raise TypeError(f"can't convert cuda:{index} device type tensor to numpy. Use "
                            "Tensor.cpu() to copy the tensor to host memory first.")
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
        return self._device_op(name, func, plain_args, plain_kwargs, gpu, big_cpu, target,
                               index if index is not None else out_index, out_index)

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
                    if (x is not target and x.numel()
                            and (blk := self._block(x, x.gpu_index)) is not None):
                        self._read(blk, stream, tick, name, self._what(x))
                writes = ([target] if isinstance(target, _OnGpu) else []) + (
                    [] if name in _NO_WRITE else fresh)
                for x in writes:
                    if x.numel() and (blk := self._block(x, x.gpu_index, stream)) is not None:
                        self._write(blk, stream, tick, name, self._what(x))
                for x in fresh:
                    self._block(x, x.gpu_index, stream)  # allocated here even if not written
        if host_read:
            self._host_sync(f"{name} of a cuda:{index} tensor (device-to-host read)", [stream],
                            credit=True)
        elif big_cpu or name == "new_tensor" or (name in ("tensor", "as_tensor", "asarray")
                                                 and not gpu):
            self._host_sync(f"{name} of host data on cuda:{index} (a pageable host-to-device "
                            "copy)", [stream], credit=True)
        elif name in _DATA_SHAPED or (name == "repeat_interleave" and
                                      kwargs.get("output_size") is None) or (
                name in ("__getitem__", "index", "index_put_", "__setitem__")
                and any(isinstance(x, torch.Tensor) and x.dtype == torch.bool
                        for x in tree_flatten(args[1:2])[0])):
            self._host_sync(f"{name}: an output size read from the device", [stream],
                            credit=True)
        return out

    # ------------------------------------------------------------------ copies and pinning
    def _pin(self, t: torch.Tensor, on) -> torch.Tensor:
        if on:
            raise RuntimeError(f"cannot pin '{t.type()}' only dense CPU tensors can be pinned "
                               "(emulated CUDA: the tensor is on a CUDA device)")
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
            target = self._target("cuda" if dev is None else torch.device("cuda", dev)
                                  if isinstance(dev, int) else dev)
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
        out = (func(plain, *rest, **kwargs) if name == "to" else
               plain if name == "cuda" else func(*args, **kwargs))
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
                self._read(blk, stream, tick, name, self._what(src))
            if (blk := self._block(out, index, stream)) is not None:
                self._write(blk, stream, tick, name, self._what(out))
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
                        self._read(blk, s_src, tick, name, self._what(src))
                    if (blk := self._block(dst, dst_i, s_dst)) is not None:
                        self._write(blk, s_src, tick, name, self._what(dst))
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
                        self._write(blk, stream, tick, name, self._what(dst))
                    if pin is not None and non_blocking:
                        pin.read = (stream, tick)
                        self._pin_pending.add(src.untyped_storage())
                if pin is None or not non_blocking:
                    why = ("non_blocking copy from pageable memory (CUDA stages it, waiting for "
                           "the stream)" if non_blocking else "blocking copy")
                    self._host_sync(f"{name}: host-to-{where} {why}", [stream], credit=True)
                return result
            stream = self._stream_of(src_i)  # device to host
            with self._lock:
                tick = self._tick(stream)
                if (blk := self._block(src, src_i)) is not None:
                    self._read(blk, stream, tick, name, self._what(src))
                if non_blocking and (name != "copy_" or _pin_of(dst) is not None):
                    if name != "copy_":
                        _mark_pinned(dst)  # torch puts a non_blocking download in pinned memory
                    _pin_of(dst).write = (stream, tick)
                    self._pin_pending.add(dst.untyped_storage())
                    return result
            self._host_sync(f"{name}: {where}-to-host copy", [stream], credit=True)
            return result

    def _host_touch(self, name, args, kwargs, cpu) -> None:
        """The host reads (or, in place, writes) CPU tensors: pinned memory that a non_blocking
        copy may still write (or read) is an error until the host knows the copy is done."""
        target = _inplace_target(name, args, kwargs)
        host = self._host()
        with torch._C.DisableTorchFunction():
            for x in cpu:
                pin = _pin_of(x)
                if pin is None:
                    continue
                pending = [p for p in (pin.write, pin.read if x is target else None)
                           if p is not None and host.get(p[0], 0) < p[1]]
                if pin.write is not None and host.get(pin.write[0], 0) >= pin.write[1]:
                    pin.write = None
                if pin.read is not None and host.get(pin.read[0], 0) >= pin.read[1]:
                    pin.read = None
                if pin.read is None and pin.write is None:
                    self._pin_pending.discard(x.untyped_storage())
                if pending:
                    stream = pending[0][0]
                    act = "writes" if x is target else "reads"
                    copy = ("a non_blocking copy to the device may still read it"
                            if pending[0] is pin.read else
                            "a non_blocking copy from the device may still write it")
                    raise self._violation(
                        f"{name} at {_where()} {act} pinned host memory ({self._what(x)}) that "
                        f"{copy} on {stream.label}: the host has not waited for that stream "
                        f"since. Fix: synchronize the stream (or an event recorded after the "
                        f"copy) before the host touches the buffer, or use a new buffer.")

    def _record_stream(self, tensor, stream) -> None:
        _check_stream_caller("Tensor.record_stream")
        if not isinstance(tensor, _OnGpu):
            raise RuntimeError(f"record_stream of a tensor on {tensor.device}: only CUDA "
                               "tensors can be recorded on a stream (emulated CUDA)")
        if stream.device.index != tensor.gpu_index:
            raise RuntimeError(f"record_stream: tensor on cuda:{tensor.gpu_index}, stream on "
                               f"{stream.device} (emulated CUDA)")
        with torch._C.DisableTorchFunction(), self._lock:
            blk = self._block(tensor, tensor.gpu_index)
            if blk is not None and stream is not blk.owner:
                blk.recorded.add(stream)

    # ------------------------------------------------------------------ the decoder
    def _decoder_stream(self, library: str, given: torch.device, dev: torch.device) -> Stream:
        """The private stream of the decoder a call uses, building (or rebuilding) it."""
        init = RuntimeError(f"Failed to initialize nvjpeg with hardware backend: "
                            f"{NVJPEG_ALLOCATOR_FAILURE}")
        with self._lock:
            if library == "torchvision":
                cur = self._tv_decoder
                if cur is None or cur[0] != given:  # torch.device("cuda") != "cuda:0"
                    if self.decoder_fault == "init":
                        raise init
                    if cur is not None:
                        self.decoder_rebuilds += 1  # the old decoder is leaked, not freed
                    n = 1 + self.decoder_rebuilds
                    self._tv_decoder = (given, Stream(dev, _label=(
                        f"nvJPEG's private stream of {dev} (torchvision decoder #{n})")))
                return self._tv_decoder[1]
            if dev.index not in self._codec_decoders:  # TorchCodec: a decoder cache per device
                if self.decoder_fault == "init":
                    raise init
                self._codec_decoders[dev.index] = Stream(dev, _label=(
                    f"nvJPEG's private stream of {dev} (TorchCodec decoder)"))
            return self._codec_decoders[dev.index]

    def _decoded(self, outs: list[torch.Tensor], dev: torch.device, current: Stream,
                 private: Stream, ours: bool) -> None:
        """The decoder's outputs, allocated on ``current``, written by ``private``."""
        with torch._C.DisableTorchFunction():
            with self._lock:
                for x in outs:
                    self._block(x, dev.index, current)
                _join(private.clock, self._host())
                if not ours:  # outside gpucache: the decoder as pytorch/vision PR 9606 fixes it
                    _join(private.clock, current.clock)
            self._host_sync("nvJPEG decode: cudaStreamSynchronize of its private stream "
                            "(before decoding)", [private], credit=self.trust_decoder_sync)
            with self._lock:
                tick = self._tick(private)
                for x in outs:
                    if (blk := self._block(x, dev.index, current)) is not None:
                        self._write(blk, private, tick, "nvJPEG decode", self._what(x))
            self._host_sync("nvJPEG decode: cudaStreamSynchronize of its private stream "
                            "(after decoding)", [private], credit=self.trust_decoder_sync)
            self._wait(current, private.clock)  # event.record(private); event.block(current)

    # ------------------------------------------------------------------ entering and leaving
    def _patch(self, obj, name: str, value) -> None:
        self._saved.append((obj, name, getattr(obj, name)))
        setattr(obj, name, value)

    def __enter__(self):
        if EmulatedCuda._active is not None:
            raise RuntimeError("EmulatedCuda is already active")
        EmulatedCuda._active = self
        c = torch.cuda
        for name, value in {
            "is_available": lambda: True, "device_count": lambda: self.devices,
            "current_device": self.current_index, "set_device": self.set_device,
            "device": self.device_context, "stream": self.stream_context,
            "Stream": Stream, "Event": Event, "synchronize": self.synchronize,
            "current_stream": self._current_stream_api, "default_stream": self._default_api,
            "memory_allocated": self.memory_allocated, "memory_reserved": self.memory_reserved,
            "get_device_name": lambda device=None: f"emulated CUDA ({self.devices} devices)",
            "get_device_properties": self.get_device_properties,
            "mem_get_info": self.mem_get_info,
        }.items():
            self._patch(c, name, value)
        self._patch(torch.Tensor, "record_stream",  # torch's parser takes only real streams
                    lambda tensor, stream: self._record_stream(tensor, stream))
        import torchvision.io

        self._patch(torchvision.io, "decode_jpeg",
                    _decode_jpeg(torchvision.io.decode_jpeg, library="torchvision"))
        try:
            import torchcodec.decoders
        except Exception:  # noqa: BLE001 - not installed, or does not load: nothing to emulate
            pass
        else:
            self._patch(torchcodec.decoders, "decode_jpeg",
                        _decode_jpeg(torchcodec.decoders.decode_jpeg, library="torchcodec"))
        run, mode = threading.Thread.run, self._mode

        def run_in_mode(thread):  # every thread started inside the block follows the rules
            with mode:
                run(thread)

        self._patch(threading.Thread, "run", run_in_mode)
        self._mode.__enter__()
        return self

    def __exit__(self, *exc):
        self._mode.__exit__(*exc)
        for obj, name, value in reversed(self._saved):
            setattr(obj, name, value)
        self._saved.clear()
        EmulatedCuda._active = None
        if exc[0] is None and self.violations:
            first = self.violations[0]
            raise StreamOrderError(f"{first} [{len(self.violations)} stream-order violation(s) "
                                   "inside the EmulatedCuda block were caught by the code under "
                                   "test; the first is above]") from first

    def _current_stream_api(self, device=None) -> Stream:
        _check_stream_caller("torch.cuda.current_stream")
        return self.current_stream(device)

    def _default_api(self, device=None) -> Stream:
        _check_stream_caller("torch.cuda.default_stream")
        return self._default(self.index_device(device).index)


def _emu() -> EmulatedCuda:
    if EmulatedCuda._active is None:
        raise RuntimeError("no EmulatedCuda is active")
    return EmulatedCuda._active


def _pin_of(t) -> _Pin | None:
    if not isinstance(t, torch.Tensor) or isinstance(t, _OnGpu):
        return None
    with torch._C.DisableTorchFunction():
        return getattr(t.untyped_storage(), "_emu_pin", None)


def _mark_pinned(out) -> None:
    with torch._C.DisableTorchFunction():
        for x in tree_flatten(out)[0]:
            if isinstance(x, torch.Tensor) and not isinstance(x, _OnGpu):
                st = x.untyped_storage()
                if getattr(st, "_emu_pin", None) is None:
                    st._emu_pin = _Pin()


def _inplace_target(name: str, args, kwargs):
    """The tensor an op writes in place (``add_``, ``__setitem__``, ``out=``), else None."""
    if kwargs.get("out") is not None:
        out = kwargs["out"]
        return out[0] if isinstance(out, (tuple, list)) else out
    if not args or not isinstance(args[0], torch.Tensor):
        return None
    if name in ("__setitem__", "index_put_") or (name.endswith("_") and not name.startswith("__")
                                                 ) or (name.startswith("__i") and
                                                       name not in ("__index__", "__int__",
                                                                    "__invert__", "__iter__")):
        return args[0]
    return None


def _decode_jpeg(cpu_decode, *, library: str):
    """torchvision's (or TorchCodec's: it applies EXIF on CUDA too) ``decode_jpeg`` with the
    CUDA path emulated (see the module doc)."""
    exif = library == "torchcodec"

    def decode_jpeg(input, mode=None, device="cpu", **kwargs):
        given = torch.device(device)
        if given.type != "cuda":
            kw = {} if mode is None else {"mode": mode}
            return cpu_decode(input, device=device, **kw, **kwargs)
        emu = _emu()
        dev = emu.index_device(given)  # un-indexed: the calling thread's current device
        current = emu.current_stream(dev)
        ours = _caller().startswith("gpucache")
        if current.default and emu.default_stream_decode == "raise" and ours:
            raise RuntimeError(f"emulated CUDA: nvJPEG decode called on the default stream of "
                               f"{dev}; torchvision allocates its outputs on the current stream "
                               "and writes them from its own, so gpucache must decode under its "
                               "allocation stream (decode/_streams.py).")
        private = emu._decoder_stream(library, given, dev)
        kw = {} if mode is None else {"mode": mode}
        if not exif:
            kw["apply_exif_orientation"] = False  # torchvision's CUDA decoder ignores EXIF
        batch = isinstance(input, list)
        data = input if batch else [input]
        if emu.decoder_fault == "oom":
            raise RuntimeError(_oom_message(data, dev))
        out = [emu._wrap(x, dev.index) for x in cpu_decode(data, **kw)]
        emu._decoded(out, dev, current, private, ours)
        return out if batch else out[0]

    return decode_jpeg


def _oom_message(data: list[torch.Tensor], dev: torch.device) -> str:
    """torchvision's message when allocating the first output fails (CUDA's, rethrown)."""
    import io

    from PIL import Image

    size = 0
    with (contextlib.suppress(Exception), torch._C.DisableTorchFunction(),
          Image.open(io.BytesIO(data[0].numpy().tobytes())) as im):
        size = 3 * im.width * im.height
    return (f"Error while decoding JPEG images: CUDA out of memory. Tried to allocate "
            f"{_size(size)}. GPU {dev.index} has a total capacity of 79.19 GiB of which "
            f"{_size(1 << 20)} is free. Of the allocated memory 77.91 GiB is allocated by "
            "PyTorch, and 1.07 GiB is reserved by PyTorch but unallocated.")
