"""Support code for the tests and ``benchmarks/gpu_check.py`` (run from the repository root), kept
out of the wheel: the CUDA emulation (``emulated_cuda``, ``emulated_order``, ``emulated_nvjpeg``),
hostile image files (``hostile``), directory-listing counts (``audit``), the S3 server
(``s3server``), free ports (``ports``), children forked from the test process (``forked``), and
the cases a run selected, for fixtures that start all their processes at once (``selected``)."""
