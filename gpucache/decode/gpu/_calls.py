"""The batched decoder's calls under the fault rules (:mod:`._faults`): a batch's call retried
once when nvJPEG's own allocator fails, a failed batch decoded one sample at a time to find its
bad JPEGs, and out of device memory never taken for a bad sample."""

from __future__ import annotations

import logging

import torch

from ._batched import BatchDecoder
from ._faults import allocator_failure, raise_if_broken, raise_if_out_of_memory
from ._streams import HostStreams

log = logging.getLogger(__name__)


class DecoderCalls:
    """``decoder``'s calls on ``device``; ``streams`` empty torch's cache before a retry."""

    def __init__(self, decoder: BatchDecoder, streams: HostStreams, device: torch.device) -> None:
        self.decoder, self.streams, self.device = decoder, streams, device

    def each(self, data: list[torch.Tensor]) -> list[torch.Tensor | Exception]:
        """The decoded images of ``data``, in order: one batched call (:meth:`batch`), or
        where it fails (one corrupt JPEG fails it all) one call a sample, each failure kept in
        its place (the CPU retries it). Out of memory, or a decoder that cannot start, raises."""
        try:
            return list(self.batch(data, f"decoding a batch of {len(data)} samples"))
        except torch.OutOfMemoryError:
            raise
        except Exception as err:  # noqa: BLE001 - one bad JPEG fails the batched call: find it
            raise_if_broken(err, self.decoder.name, self.device)
            out: list[torch.Tensor | Exception] = []
            for d in data:
                try:
                    out.append(self.decoder.decode([d])[0])
                except Exception as one:  # noqa: BLE001 - retried on the CPU, then reported
                    self.raise_if_oom(one, "decoding one sample", retried=False)
                    out.append(one)
            return out

    def batch(self, data: list[torch.Tensor], what: str) -> list[torch.Tensor]:
        """The decoder's call; nvJPEG's allocator failing (status 5) synchronises the device
        (the failed call's kernels may still write the outputs it freed, which the retry's
        outputs would reuse), empties torch's caching allocator and retries once
        (:meth:`._streams.CudaStreams.release_cached`). Out of memory then (or at first, as
        torch or CUDA say it) raises ``torch.OutOfMemoryError``; any other error is the
        caller's."""
        try:
            return self.decoder.decode(data)
        except Exception as err:  # noqa: BLE001 - classified here, re-raised otherwise
            if not allocator_failure(err):
                self.raise_if_oom(err, what, retried=False)
                raise
            log.info("gpucache: %s on %s; emptying torch's cached memory and retrying", err, what)
        self.streams.release_cached()
        try:
            return self.decoder.decode(data)
        except Exception as err:  # noqa: BLE001 - classified here, re-raised otherwise
            self.raise_if_oom(err, what, retried=True)
            raise

    def raise_if_oom(self, err: BaseException, what: str, *, retried: bool) -> None:
        """Out of device memory is not a bad sample, however the decoder says it (torchvision
        rethrows CUDA's as ``RuntimeError("Error while decoding JPEG images: CUDA out of
        memory...")``, nvJPEG's own allocator says status 5): ``torch.OutOfMemoryError``
        with advice, never retries one sample at a time or the CPU."""
        raise_if_out_of_memory(err, self.decoder.name, self.device, what, retried=retried)
