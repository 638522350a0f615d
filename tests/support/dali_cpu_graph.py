"""The DALI backend with its CPU graph on an emulated GPU device: DALI runs the graph DALI's CPU
mode runs (no GPU here), torch's side is :class:`~tests.support.emulated_cuda.EmulatedCuda`, and
the stream each ``outputs()`` call is handed is recorded in ``backend._pipe.handed`` (a CPU
graph cannot take one). Needs DALI: import it after ``pytest.importorskip("nvidia.dali")``."""

from __future__ import annotations

from gpucache.decode.gpu._dali import DaliBackend


class CpuGraph(DaliBackend):
    def _graph_on_gpu(self):
        return False

    def _pipeline(self):
        pipe = super()._pipeline()
        if not hasattr(pipe, "handed"):
            real, pipe.handed = pipe.outputs, []

            def outputs(cuda_stream=None):
                pipe.handed.append(cuda_stream)
                return real()

            pipe.outputs = outputs
        return pipe
