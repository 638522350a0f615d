"""backend="nvjpeg": batched nvJPEG decode on a side CUDA stream, straight into device tensors.

For each batch: the GPU-decodable samples' compressed bytes are copied once into one pinned host
buffer (staging), handed to the batched ``decode_jpeg(list, device="cuda")`` (TorchCodec's when
installed, torchvision's otherwise) on a side stream, and each decoded image runs its plan there
(:func:`~gpucache.decode.cpu.apply_plan`, the same function the CPU backend uses, on CUDA tensors).
An event recorded on the side stream marks the batch done; :meth:`get` makes the consumer's stream
wait on it and ``record_stream``\\s the outputs, so the caching allocator never hands their memory
to another stream early. The loader submits at least two batches ahead, so batch k+1 decodes while
the model trains on batch k.

Samples nvJPEG does not take (PNG, GIF, WebP, CMYK, arithmetic JPEG) are decoded on the CPU and joined
back in order. If the batched call fails (one corrupt JPEG fails the whole call), the batch is
decoded one sample at a time on the GPU, and a sample that still fails is retried on the CPU before
it is reported, so a bad sample never kills the run.

On a CPU device the very same code runs with the CPU batched ``decode_jpeg`` and no streams: that is
how CI exercises staging, ordering, the fallback join and the plans. Only ``_Cuda`` is CUDA-only.
"""

from __future__ import annotations

import contextlib
import warnings
from collections import deque
from dataclasses import dataclass

import numpy as np
import torch

from ._base import Backend
from ._fallback import Part, decode_on_cpu, join, split
from .cpu import Decoded, apply_plan, check_size, failure, out_size


def _batched_decoder(device: torch.device):
    """decode(list of CPU uint8 tensors) -> list of RGB uint8 CHW tensors on ``device``."""
    try:
        from torchcodec.decoders import decode_jpeg as codec

        return lambda data: codec(data, mode="RGB", device=str(device))
    except ImportError:
        from torchvision.io import ImageReadMode
        from torchvision.io import decode_jpeg as tv

        def decode(data):
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", category=DeprecationWarning,
                                        message=r".*image decoding and encoding capabilities")
                return tv(data, mode=ImageReadMode.RGB, device=device,
                          apply_exif_orientation=True)

        return decode


class _Cuda:
    """The CUDA-only part: a side stream and an event per batch."""

    def __init__(self, device: torch.device):
        self.stream = torch.cuda.Stream(device)

    def context(self):
        return torch.cuda.stream(self.stream)

    def record(self):
        event = torch.cuda.Event()
        event.record(self.stream)
        return event

    @staticmethod
    def hand_over(event, tensors) -> None:
        consumer = torch.cuda.current_stream()
        consumer.wait_event(event)
        for t in tensors:
            t.record_stream(consumer)


@dataclass
class _Pending:
    indices: np.ndarray
    stack: bool
    gpu_pos: np.ndarray
    gpu_out: list  # one result per gpu position: tensor on device, or failure reason
    cpu_part: Part
    staging: torch.Tensor | None  # pinned bytes, kept alive until the batch is handed over
    event: object | None
    out_hw: tuple[int, int]


class NvjpegBackend(Backend):
    name = "nvjpeg"

    def __init__(self, cache, *, device: torch.device, on_error: str):
        self.cache, self.device, self.on_error = cache, torch.device(device), on_error
        self.cuda = _Cuda(self.device) if self.device.type == "cuda" else None
        self._decode = _batched_decoder(self.device)
        self._pending: deque[_Pending] = deque()

    def _stage(self, indices: np.ndarray) -> tuple[list[torch.Tensor], torch.Tensor | None]:
        """Views of one (pinned, on CUDA) buffer holding these samples' compressed bytes."""
        if not len(indices):
            return [], None
        lengths = [len(self.cache[i]) for i in indices.tolist()]
        staging = torch.empty(sum(lengths), dtype=torch.uint8, pin_memory=self.cuda is not None)
        flat = staging.numpy()
        pos = 0
        for i, n in zip(indices.tolist(), lengths):
            flat[pos:pos + n] = self.cache[i]
            pos += n
        return list(staging.split(lengths)), staging

    def _decode_gpu(self, indices: np.ndarray, plans: np.ndarray,
                    data: list[torch.Tensor]) -> list:
        try:
            images = self._decode(data)
        except RuntimeError:  # one bad JPEG fails the batched call: find it sample by sample
            images = []
            for d in data:
                try:
                    images.append(self._decode([d])[0])
                except RuntimeError as err:
                    images.append(err)
        out = []
        for i, plan, img in zip(indices.tolist(), plans, images):
            if isinstance(img, Exception):  # the CPU decoder gets a second chance
                out.append(decode_on_cpu(self.cache, np.array([i]), plan[None], [0],
                                         on_error=self.on_error)[0])
                continue
            try:
                out.append(apply_plan(check_size(self.cache, i, img), plan))
            except Exception as err:  # noqa: BLE001 - reported like any bad sample
                out.append(failure(self.cache, i, err, self.on_error))
        return out

    def submit(self, indices: np.ndarray, plans: np.ndarray, stack: bool) -> None:
        gpu_pos, cpu_pos = split(self.cache, indices)
        data, staging = self._stage(indices[gpu_pos])
        ctx = self.cuda.context() if self.cuda else contextlib.nullcontext()
        with ctx:
            gpu_out = self._decode_gpu(indices[gpu_pos], plans[gpu_pos], data)
            event = self.cuda.record() if self.cuda else None
        cpu_out = decode_on_cpu(self.cache, indices, plans, cpu_pos.tolist(),
                                on_error=self.on_error)
        self._pending.append(_Pending(indices, stack, gpu_pos, gpu_out,
                                      (cpu_pos, cpu_out, True), staging, event, out_size(plans)))

    def get(self) -> Decoded:
        p = self._pending.popleft()
        if self.cuda is not None:
            self.cuda.hand_over(p.event, [t for t in p.gpu_out if isinstance(t, torch.Tensor)])
        parts: list[Part] = [(p.gpu_pos, p.gpu_out, False), p.cpu_part]
        return join(len(p.indices), parts, indices=p.indices, stack=p.stack, device=self.device,
                    out_hw=p.out_hw)

    def __len__(self) -> int:
        return len(self._pending)

    def close(self) -> None:
        """Drop in-flight batches (their device tensors and pinned staging buffers) and the stream."""
        self._pending.clear()
        self.cuda = None
