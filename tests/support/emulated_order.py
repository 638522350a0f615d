"""Stream order for :class:`~tests.support.emulated_cuda.EmulatedCuda`: streams and events with
vector clocks, the caching allocator's blocks and their access history, pinned host memory, host
syncs. The rules are described in :mod:`tests.support.emulated_cuda`; this module holds their
state and checks (:class:`OrderRules`, which ``EmulatedCuda`` extends).
"""

from __future__ import annotations

import contextlib
import linecache
import os
import re
import sys
import threading
import weakref
from dataclasses import dataclass

import torch
from torch.utils._pytree import tree_flatten

#: Modules allowed to call stream and event APIs (besides code outside the gpucache package).
STREAM_HELPER = "gpucache.decode.gpu._streams"
_SKIP_FRAMES = ("torch", "contextlib", "threading", "concurrent.futures")
_PACKAGE = __name__.rpartition(".")[0]  # the emulation's own frames, wherever it is imported from
_HERE = tuple(f"{_PACKAGE}.{m}" for m in ("emulated_cuda", "emulated_order", "emulated_nvjpeg"))
_BLOCK = 512  # CUDA's caching allocator rounds every size up to 512 bytes


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


class _Current:
    """The active EmulatedCuda (set by its ``__enter__``)."""

    emu = None


def active():
    """The active EmulatedCuda; raises outside its block."""
    if _Current.emu is None:
        raise RuntimeError("no EmulatedCuda is active")
    return _Current.emu


def _frame_outside(depth: int = 2):
    frame = sys._getframe(depth)
    while frame is not None:
        name = frame.f_globals.get("__name__", "")
        if not (name.startswith(_SKIP_FRAMES) or name in _HERE):
            return frame
        frame = frame.f_back
    return None


def _caller() -> str:
    """The first module on the stack outside torch, threading and the emulation."""
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
        raise RuntimeError(
            f"emulated CUDA: {what} called from {who}; stream and event calls "
            f"belong in {STREAM_HELPER} (the stream helper)."
        )


def _join(dst: dict, src: dict) -> None:
    for k, v in src.items():
        if dst.get(k, 0) < v:
            dst[k] = v


def _what(t: torch.Tensor) -> str:
    return f"a {tuple(t.shape)} {str(t.dtype).replace('torch.', '')} tensor"


class Stream:
    """A stream of an emulated device: work runs when queued; its order is a vector clock."""

    _made = 0

    def __init__(
        self, device=None, priority: int = 0, *, _default: bool = False, _label: str | None = None
    ):
        if not _default and _label is None:
            _check_stream_caller("torch.cuda.Stream")
        emu = active()
        self.device = emu.index_device(device)
        self.priority = priority
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
            line = (
                "" if frame is None else linecache.getline(frame.f_code.co_filename, frame.f_lineno)
            )
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
        active()._wait(self, other.clock)

    def wait_event(self, event: Event) -> None:
        _check_stream_caller("Stream.wait_event")
        self.waited.append(event)
        active()._wait(self, event.clock)

    def record_event(self, event: Event | None = None) -> Event:
        event = event if event is not None else Event()
        event.record(self)
        return event

    def synchronize(self) -> None:
        _check_stream_caller("Stream.synchronize")
        active()._host_sync("Stream.synchronize", [self], credit=True)

    def query(self) -> bool:
        _check_stream_caller("Stream.query")
        _join(active()._host(), self.clock)  # always done: the host now knows it
        return True

    def __repr__(self) -> str:
        return f"<emulated {self.label}>"


class Event:
    """An event: the clock of its stream when recorded (None before)."""

    def __init__(
        self, enable_timing: bool = False, blocking: bool = False, interprocess: bool = False
    ):
        _check_stream_caller("torch.cuda.Event")
        self.stream: Stream | None = None
        self.clock: dict[Stream, int] | None = None

    def record(self, stream: Stream | None = None) -> None:
        _check_stream_caller("Event.record")
        emu = active()
        self.stream = stream if stream is not None else emu.current_stream()
        with emu._lock:
            _join(self.stream.clock, emu._host())
            self.clock = dict(self.stream.clock)

    def synchronize(self) -> None:
        _check_stream_caller("Event.synchronize")
        active()._host_sync("Event.synchronize", [self], credit=True)

    def query(self) -> bool:
        _check_stream_caller("Event.query")
        if self.clock is not None:
            _join(active()._host(), self.clock)  # always done: the host now knows it
        return True

    def wait(self, stream: Stream | None = None) -> None:
        _check_stream_caller("Event.wait")
        emu = active()
        emu._wait(stream if stream is not None else emu.current_stream(), self.clock)


class _Block:
    """A block of the caching allocator: its device, owning stream, size and access history."""

    __slots__ = (
        "__weakref__",
        "device",
        "owner",
        "reads",
        "recorded",
        "reused",
        "size",
        "used",
        "write",
    )

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


class OrderRules:
    """Happens-before between streams and the host, the caching allocator and pinned memory:
    the stream-order half of EmulatedCuda (which sets up the state this class uses)."""

    def _host(self) -> dict:
        host = getattr(self._local, "host", None)
        if host is None:
            host = self._local.host = {}
        return host

    # ------------------------------------------------------------------ host syncs
    def _host_sync(self, reason: str, on: list, *, credit: bool) -> None:
        """The calling thread waits for ``on`` (streams or events); ``credit``: it then knows
        their work is done."""
        host = self._host()
        if credit:
            for s in on:
                if s.clock is not None:
                    _join(host, s.clock)
        names = ", ".join(
            s.label
            if isinstance(s, Stream)
            else f"an event of {s.stream.label if s.stream else 'no stream'}"
            for s in on
        )
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
                f"on an event recorded after the write)."
            )
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

    def _overwrite(
        self,
        blk: _Block,
        stream: Stream,
        op: str,
        what: str,
        other: Stream,
        other_op: str,
        done: str,
    ) -> str:
        msg = (
            f"{op} at {_where()} writes {self._describe(blk, what)} on {stream.label}; "
            f"{other.label} {done} it ({other_op}) and nothing orders that access before "
            f"this write: on CUDA the write may land first and corrupt it."
        )
        if blk.reused:
            return (
                msg + f" The block was freed to {blk.owner.label}'s pool and handed out "
                f"again while {other.label} may still use it. Fix: record_stream the old "
                f"tensor on {other.label} (the allocator then waits for it), or never let "
                f"a stream that waits for nothing write memory freed there."
            )
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
                pending = [
                    p
                    for p in (pin.write, pin.read if x is target else None)
                    if p is not None and host.get(p[0], 0) < p[1]
                ]
                if pin.write is not None and host.get(pin.write[0], 0) >= pin.write[1]:
                    pin.write = None
                if pin.read is not None and host.get(pin.read[0], 0) >= pin.read[1]:
                    pin.read = None
                if pin.read is None and pin.write is None:
                    self._pin_pending.discard(x.untyped_storage())
                if pending:
                    stream = pending[0][0]
                    act = "writes" if x is target else "reads"
                    copy = (
                        "a non_blocking copy to the device may still read it"
                        if pending[0] is pin.read
                        else "a non_blocking copy from the device may still write it"
                    )
                    raise self._violation(
                        f"{name} at {_where()} {act} pinned host memory ({_what(x)}) that "
                        f"{copy} on {stream.label}: the host has not waited for that stream "
                        f"since. Fix: synchronize the stream (or an event recorded after the "
                        f"copy) before the host touches the buffer, or use a new buffer."
                    )

    def _record_stream(self, tensor, stream) -> None:
        _check_stream_caller("Tensor.record_stream")
        if not isinstance(tensor, _OnGpu):
            raise RuntimeError(
                f"record_stream of a tensor on {tensor.device}: only CUDA "
                "tensors can be recorded on a stream (emulated CUDA)"
            )
        if stream.device.index != tensor.gpu_index:
            raise RuntimeError(
                f"record_stream: tensor on cuda:{tensor.gpu_index}, stream on "
                f"{stream.device} (emulated CUDA)"
            )
        with torch._C.DisableTorchFunction(), self._lock:
            blk = self._block(tensor, tensor.gpu_index)
            if blk is not None and stream is not blk.owner:
                blk.recorded.add(stream)


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
    if (
        name in ("__setitem__", "index_put_")
        or (name.endswith("_") and not name.startswith("__"))
        or (
            name.startswith("__i")
            and name not in ("__index__", "__int__", "__invert__", "__iter__")
        )
    ):
        return args[0]
    return None
