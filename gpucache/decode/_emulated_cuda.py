"""An emulated CUDA for CPU-only machines: the device rules CUDA enforces, with CPU tensors inside.

``with EmulatedCuda(devices=2):`` makes ``torch.cuda`` report ``devices`` GPUs and lets code run
its CUDA branches unchanged (``device="cuda"``, streams, events, ``record_stream``), so CI checks
what CUDA does differently from the CPU, not only what it computes:

- **indices**: a tensor on the emulated device reports ``cuda:N`` (never plain ``cuda``), and
  ``torch.device("cuda")`` means the *calling thread's* current device (0 in a new thread), as on
  CUDA; an un-indexed device compared with an indexed one differs, as on CUDA;
- **wrong device**: an op mixing tensors of ``cuda:0`` and ``cuda:1``, or a CUDA tensor and a CPU
  tensor with elements, raises as CUDA does; so does ``.numpy()`` of a CUDA tensor and
  ``record_stream`` of a tensor on another device than the stream;
- **streams**: current streams are per thread and per device; ``torch.cuda.stream``,
  ``Stream``, ``Event``, ``current_stream`` and ``record_stream`` called from any ``gpucache``
  module but :mod:`gpucache.decode._streams` raise (the stream helper is the one place for them);
- **nvJPEG**: ``torchvision.io.decode_jpeg(..., device=cuda)`` decodes on the CPU (libjpeg-turbo,
  EXIF ignored as on CUDA) and puts the images on the device (TorchCodec's ``decode_jpeg``
  likewise, EXIF applied as TorchCodec does); called on a device's *default*
  stream it raises, because torchvision's CUDA decoder allocates its outputs on the current
  stream and writes them from its own (pytorch/vision PR 9606): gpucache must decode under its
  allocation stream (code outside gpucache, a plain training script, may decode anywhere).

Tensors "on" an emulated GPU are CPU tensors of a subclass that carries the index; a
``TorchFunctionMode`` (entered in every thread started inside the block) applies the rules.
Memory figures (``memory_allocated``/``memory_reserved``) count the live emulated tensors'
storages and their high-water mark. Nothing here is imported by the library itself.
"""

from __future__ import annotations

import contextlib
import sys
import threading
import weakref

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten, tree_map

#: Modules allowed to call stream and event APIs (besides code outside the gpucache package).
STREAM_HELPER = "gpucache.decode._streams"
_MIX_OK = {"copy_", "__setitem__", "__getitem__", "index_put_", "__get__", "__set__", "to",
           "cpu", "cuda", "numpy", "pin_memory", "is_pinned", "get_device"}


class _OnGpu(torch.Tensor):
    """A CPU tensor standing for one on an emulated GPU; subclasses fix the index."""

    __torch_function__ = torch._C._disabled_torch_function_impl
    gpu_index = 0


_CLASSES: dict[int, type] = {}


def _cls(index: int) -> type:
    if index not in _CLASSES:
        _CLASSES[index] = type(f"EmulatedCuda{index}Tensor", (_OnGpu,), {"gpu_index": index})
    return _CLASSES[index]


def _caller() -> str:
    """The first module on the stack outside torch, threading and this file."""
    frame = sys._getframe(2)
    while frame is not None:
        name = frame.f_globals.get("__name__", "")
        if not (name.startswith(("torch", "contextlib", "threading")) or name == __name__):
            return name
        frame = frame.f_back
    return ""


def _check_stream_caller(what: str) -> None:
    who = _caller()
    if who.startswith("gpucache") and who != STREAM_HELPER:
        raise RuntimeError(f"emulated CUDA: {what} called from {who}; stream and event calls "
                           f"belong in {STREAM_HELPER} (the stream helper).")


class Stream:
    """A stream of an emulated device (work runs at once; ordering calls are recorded)."""

    def __init__(self, device=None, priority: int = 0, *, _default: bool = False):
        if not _default:
            _check_stream_caller("torch.cuda.Stream")
        self.device = _emu().index_device(device)
        self.default = _default
        self.waited: list[object] = []
        self.handed_to: list[str] = []  # who read cuda_stream (e.g. DALI's outputs())

    @property
    def cuda_stream(self) -> int:
        self.handed_to.append(_caller())
        return 0

    def wait_stream(self, other: Stream) -> None:
        _check_stream_caller("Stream.wait_stream")
        self.waited.append(other)

    def wait_event(self, event: Event) -> None:
        _check_stream_caller("Stream.wait_event")
        self.waited.append(event)

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True

    def __repr__(self) -> str:
        return f"<emulated {'default ' if self.default else ''}stream on {self.device}>"


class Event:
    def __init__(self, enable_timing: bool = False, blocking: bool = False,
                 interprocess: bool = False):
        _check_stream_caller("torch.cuda.Event")
        self.stream: Stream | None = None

    def record(self, stream: Stream | None = None) -> None:
        _check_stream_caller("Event.record")
        self.stream = stream if stream is not None else _emu().current_stream()

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True

    def wait(self, stream: Stream | None = None) -> None:
        pass


class _Mode(TorchFunctionMode):
    def __init__(self, emu: EmulatedCuda):
        super().__init__()
        self.emu = emu

    def __torch_function__(self, func, types, args=(), kwargs=None):
        return self.emu.handle(func, args, kwargs)


class EmulatedCuda:
    """Context manager: ``torch.cuda`` with ``devices`` emulated GPUs (see the module doc)."""

    _active: EmulatedCuda | None = None

    def __init__(self, devices: int = 2, *, default_stream_decode: str = "raise"):
        self.devices = devices
        self.default_stream_decode = default_stream_decode  # "allow": isolate the other rules
        self._mode = _Mode(self)
        self._local = threading.local()
        self._defaults: dict[int, Stream] = {}
        self._live: weakref.WeakSet = weakref.WeakSet()
        self._peak = [0] * devices
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
        index = self.index_device(device).index
        streams = getattr(self._local, "streams", None) or {}
        return streams[index] if index in streams else self._default(index)

    def _default(self, index: int) -> Stream:
        if index not in self._defaults:
            self._defaults[index] = Stream(torch.device("cuda", index), _default=True)
        return self._defaults[index]

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

    def memory_allocated(self, device=None) -> int:
        index = self.index_device(device).index
        seen, total = set(), 0
        for t in list(self._live):
            if t.gpu_index == index:
                s = t.untyped_storage()
                if s.data_ptr() not in seen:
                    seen.add(s.data_ptr())
                    total += s.nbytes()
        self._peak[index] = max(self._peak[index], total)
        return total

    def memory_reserved(self, device=None) -> int:
        index = self.index_device(device).index
        self.memory_allocated(device)
        return self._peak[index]

    # ------------------------------------------------------------------ tensors
    def _wrap(self, out, index: int | None):
        if index is None:
            return out

        def wrap(x):
            if isinstance(x, torch.Tensor) and not isinstance(x, _OnGpu):
                x = x.as_subclass(_cls(index))
                self._live.add(x)
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
        on = {x.gpu_index for x in flat if isinstance(x, _OnGpu)}
        cpu = [x for x in flat if isinstance(x, torch.Tensor) and not isinstance(x, _OnGpu)
               and x.dim() > 0]
        if name not in _MIX_OK and (len(on) > 1 or (on and cpu)):
            found = sorted(f"cuda:{i}" for i in on) + (["cpu"] if cpu else [])
            raise RuntimeError(f"Expected all tensors to be on the same device, but found at "
                               f"least two devices, {found[0]} and {found[1]}! (emulated CUDA, "
                               f"in {name})")
        index = next(iter(on)) if on else None
        plain_args, plain_kwargs = tree_map(self._plain, (args, kwargs))
        if name == "numpy" and on:
            raise TypeError(f"can't convert cuda:{index} device type tensor to numpy. Use "
                            "Tensor.cpu() to copy the tensor to host memory first.")
        if name in ("pin_memory", "is_pinned"):
            return plain_args[0] if name == "pin_memory" else False
        if name == "get_device":
            return -1 if index is None else index
        if name == "cpu":
            return plain_args[0].clone() if on else plain_args[0]
        if name == "cuda":
            dev = plain_args[1] if len(plain_args) > 1 else plain_kwargs.get("device")
            return self._wrap(plain_args[0], self._target("cuda" if dev is None else
                                                          torch.device("cuda", dev)
                                                          if isinstance(dev, int) else dev))
        if name == "to":
            return self._to(func, plain_args, plain_kwargs, index)
        if "device" in plain_kwargs and plain_kwargs["device"] is not None:
            index = self._target(plain_kwargs["device"])
            plain_kwargs["device"] = "cpu"
        return self._wrap(func(*plain_args, **plain_kwargs), index)

    def _to(self, func, args, kwargs, index):
        target, rest = index, []
        for a in args[1:]:
            if isinstance(a, (str, torch.device, torch.Tensor)):
                target = self._target(a)
                rest.append(a.dtype if isinstance(a, torch.Tensor) else "cpu")
            else:
                rest.append(a)
        if kwargs.get("device") is not None:
            target = self._target(kwargs["device"])
            kwargs["device"] = "cpu"
        out = func(args[0], *rest, **kwargs)
        if target != index and out is args[0]:
            out = out.clone()  # a move between devices is a copy
        return self._wrap(out, target)

    def _record_stream(self, tensor, stream) -> None:
        _check_stream_caller("Tensor.record_stream")
        if not isinstance(tensor, _OnGpu):
            raise RuntimeError(f"record_stream of a tensor on {tensor.device}: only CUDA "
                               "tensors can be recorded on a stream (emulated CUDA)")
        if stream.device.index != tensor.gpu_index:
            raise RuntimeError(f"record_stream: tensor on cuda:{tensor.gpu_index}, stream on "
                               f"{stream.device} (emulated CUDA)")

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
            "Stream": Stream, "Event": Event, "synchronize": lambda device=None: None,
            "current_stream": self._current_stream_api, "default_stream": self._default_api,
            "memory_allocated": self.memory_allocated, "memory_reserved": self.memory_reserved,
            "get_device_name": lambda device=None: f"emulated CUDA ({self.devices} devices)",
            "get_device_properties": self._properties,
        }.items():
            self._patch(c, name, value)
        self._patch(torch.Tensor, "record_stream",  # torch's parser takes only real streams
                    lambda tensor, stream: self._record_stream(tensor, stream))
        import torchvision.io

        self._patch(torchvision.io, "decode_jpeg", _decode_jpeg(torchvision.io.decode_jpeg))
        try:
            import torchcodec.decoders
        except Exception:  # noqa: BLE001 - not installed, or does not load: nothing to emulate
            pass
        else:
            self._patch(torchcodec.decoders, "decode_jpeg",
                        _decode_jpeg(torchcodec.decoders.decode_jpeg, exif=True))
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

    def _properties(self, device=None):
        """What ``torch.cuda.get_device_properties`` reports that gpucache reads."""
        from types import SimpleNamespace

        index = self.index_device(device).index
        return SimpleNamespace(name=f"emulated CUDA {index}", total_memory=80 * 2**30,
                               multi_processor_count=132)

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


def _decode_jpeg(cpu_decode, *, exif: bool = False):
    """torchvision's (or, ``exif=True``, TorchCodec's: it applies EXIF on CUDA too)
    ``decode_jpeg`` with the CUDA path emulated (see the module doc)."""

    def decode_jpeg(input, mode=None, device="cpu", **kwargs):
        dev = torch.device(device)
        if dev.type != "cuda":
            kw = {} if mode is None else {"mode": mode}
            return cpu_decode(input, device=device, **kw, **kwargs)
        emu = _emu()
        dev = emu.index_device(dev)  # un-indexed: the calling thread's current device
        with emu.device_context(dev):
            stream = emu.current_stream(dev)
        if (stream.default and emu.default_stream_decode == "raise"
                and _caller().startswith("gpucache")):
            raise RuntimeError(f"emulated CUDA: nvJPEG decode called on the default stream of "
                               f"{dev}; torchvision allocates its outputs on the current stream "
                               "and writes them from its own, so gpucache must decode under its "
                               "allocation stream (decode/_streams.py).")
        kw = {} if mode is None else {"mode": mode}
        if not exif:
            kw["apply_exif_orientation"] = False  # torchvision's CUDA decoder ignores EXIF
        batch = isinstance(input, list)
        out = cpu_decode(input if batch else [input], **kw)
        out = [emu._wrap(x, dev.index) for x in out]
        return out if batch else out[0]

    return decode_jpeg
