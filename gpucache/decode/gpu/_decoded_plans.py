"""The nvjpeg backend's transform stage on what its batched decoder gave: each decoded image's size
checked against its header, the plans run (a fixed-size batch in a constant number of ops a chunk,
:func:`gpucache.transforms._resample.resample`, then ``fill`` where they pad), and what the decoder
rejected decoded on the CPU, which gets the last word."""

from __future__ import annotations

import logging

import numpy as np
import torch

from ...store._store import Store
from ...transforms._chunks import BUDGET_BYTES, Scratch
from ...transforms._orientation import orient, steps
from ...transforms._resample import resample
from .._apply import apply_plan
from .._masks import fill_padding
from .._options import DecodeOptions
from .._outcome import check_size, failure
from ._fallback import Part, decode_on_cpu

log = logging.getLogger(__name__)


class DecodedPlans:
    """Plans of ``cache``'s samples run on the decoder's output; ``applies_exif``: whether the
    decoder (``decoder_name``) applied the EXIF orientation itself."""

    def __init__(
        self, cache: Store, options: DecodeOptions, *, applies_exif: bool, decoder_name: str
    ) -> None:
        self.cache, self.options = cache, options
        self.applies_exif, self.decoder_name = applies_exif, decoder_name
        # the stage's work buffer (its one thread and stream), within the stage's fixed budget
        # whatever the GPU's size
        self.scratch = Scratch(BUDGET_BYTES)

    def parts(
        self,
        indices: np.ndarray,
        plans: np.ndarray,
        stack: bool,
        positions: np.ndarray,
        images: list[torch.Tensor | Exception],
    ) -> list[Part]:
        """The decoded samples' plans (one batched call when ``stack``); samples the decoder
        rejected try the CPU, and a decoded size that differs from the header fails the sample."""
        if not len(positions):
            return []
        ok, retry, kept, results = [], [], [], []
        orientation = self.cache.samples["orientation"]
        for p, img in zip(positions.tolist(), images):
            i = int(indices[p])
            if isinstance(img, Exception):
                retry.append(p)
                continue
            o = 1 if self.applies_exif or not 1 <= orientation[i] <= 8 else int(orientation[i])
            try:  # the displayed size, from the shape alone (orienting is a copy on CUDA)
                check_size(self.cache, i, img.transpose(-1, -2) if steps(o)[0] else img)
            except ValueError as err:
                results.append((p, failure(self.cache, i, err, self.options.on_error)))
                continue
            ok.append(p)
            kept.append(img if stack else orient(img, o))
        parts: list[Part] = []
        if ok and stack:
            rows = indices[ok]
            parts.append(
                (
                    np.asarray(ok, dtype=np.int64),
                    fill_padding(  # the batched resize pads with zeros
                        resample(
                            kept,
                            plans[ok],
                            orientations=None if self.applies_exif else orientation[rows],
                            scratch=self.scratch,
                        ),
                        plans[ok],
                        self.options.fill,
                    ),
                    False,
                )
            )
        elif ok:
            parts.append(
                (
                    np.asarray(ok, dtype=np.int64),
                    [apply_plan(x, plans[p], self.options.fill) for x, p in zip(kept, ok)],
                    False,
                )
            )
        if results:
            parts.append(
                (
                    np.asarray([p for p, _ in results], dtype=np.int64),
                    [r for _, r in results],
                    False,
                )
            )
        if retry:  # libjpeg-turbo gets the last word: decoded there, or reported as failed
            rescued = decode_on_cpu(self.cache, indices, plans, retry, self.options)
            for p, r in zip(retry, rescued):
                if isinstance(r, torch.Tensor):
                    log.warning(
                        "gpucache: %s could not decode sample %d (%s); decoded it on the CPU",
                        self.decoder_name,
                        int(indices[p]),
                        self.cache.paths[int(indices[p])],
                    )
            parts.append((np.asarray(retry, dtype=np.int64), rescued, True))
        return parts
