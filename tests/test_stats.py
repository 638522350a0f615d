"""Where the time goes: ``loader.stats`` times every stage, names the bottleneck of runs built
to have one, and reaches the profiler and Lightning's loggers."""

from __future__ import annotations

import csv
import json
import time

import pytest
import torch

from gpucache import GpuCachedLoader, JpegCache
from gpucache import transforms as T
from gpucache.decode.cpu._procs import default_workers
from gpucache.loader._stats import BOTTLENECKS, COLUMNS, ROUTES, LoaderStats

STEP = 0.25  # seconds: the training step, or the batch transform, that a run is built around


@pytest.fixture(scope="module")
def photos(photo_folder) -> JpegCache:
    return JpegCache.from_folder(photo_folder, progress=False)


def _epoch(loader, step: float = 0.0) -> None:
    for _ in loader:
        if step:
            time.sleep(step)  # the training step this run is built around, not a wait


def test_a_slow_training_step_is_named_with_its_numbers(photos):
    loader = GpuCachedLoader(
        photos, batch_size=8, num_workers=1, device="cpu", transform=T.Resize((32, 32))
    )
    with loader:
        _epoch(loader, STEP)
    s = loader.stats
    assert s.bottleneck == "step", str(s)
    head = str(s).splitlines()[0]
    assert head.startswith("data wait ") and "step-bound" in head, head
    assert "the data is not what holds training back" in head, head
    steps = s.batches - 1  # the time after the last batch too; none before the first
    assert s.seconds["step"] >= STEP * steps, s.seconds
    assert s.as_dict()["step_ms_p50"] >= STEP * 1e3, s.as_dict()
    assert s.data_wait_fraction < 0.1


def _sleepy(images: torch.Tensor) -> torch.Tensor:
    time.sleep(STEP)  # a batch transform this slow is what the run is built around
    return images


def test_a_slow_batch_transform_is_named_with_its_numbers(photos):
    transform = T.Compose([T.Resize((32, 32)), _sleepy])
    loader = GpuCachedLoader(
        photos, batch_size=10, num_workers=1, device="cpu", transform=transform
    )
    with loader:
        _epoch(loader)
    s = loader.stats
    assert s.bottleneck == "transform", str(s)
    head = str(s).splitlines()[0]
    assert "transform-bound" in head and "the batch transforms take" in head, head
    assert "ms a batch" in head and "run them on the GPU" in head, head
    assert s.seconds["transform"] >= STEP * s.batches
    assert s.data_wait_fraction > 0.9


def test_random_resized_crop_on_photos_is_decode_bound(photos):
    # photo-size JPEGs (up to ~1000 px), a RandomResizedCrop of 224 and no training step: the
    # workers decode all the time, and decoding costs more than the rest
    transform = T.Compose([T.RandomResizedCrop(224), T.RandomHorizontalFlip()])
    loader = GpuCachedLoader(photos, batch_size=8, num_workers=2, device="cpu", transform=transform)
    with loader:
        _epoch(loader)
    s = loader.stats
    assert s.bottleneck == "decode", str(s)
    head = str(s).splitlines()[0]
    assert "decode-bound: 2 workers" in head and "ms an image to decode" in head, head
    assert "restart_markers=True" in head, head
    assert ("add workers" in head) == (default_workers() > 2), head  # only while cores are idle
    assert sum(s.route_images.values()) == s.samples == len(photos)
    assert s.route_images["region"] > 0  # crops decode only their box
    assert set(s.worker_busy) == {0, 1} and 0 < s.busy_fraction() <= 1


@pytest.mark.parametrize("bound", ["decode", "resize"])
def test_more_workers_are_advised_only_while_cores_are_idle(bound):
    cores = default_workers()
    for workers in {1, cores - 1, cores, cores + 2} - {0}:
        stats = LoaderStats(workers=workers, backend="cpu", batches=10, samples=80)
        stats.seconds.update(wait=5.0, step=0.1)  # the loop waits: the data is the bottleneck
        stats.seconds[bound] = 40.0
        stats.route_images["full"], stats.route_seconds["full"] = 80, 40.0
        head = stats.headline()
        assert stats.bottleneck == ("decode" if bound == "decode" else "transform"), head
        assert ("add workers" in head) == (workers < cores), (workers, cores, head)
        if workers >= cores:
            assert "every usable core already" in head, head


def test_every_stage_is_timed_and_reset_starts_afresh(photos):
    loader = GpuCachedLoader(
        photos, batch_size=16, num_workers=0, device="cpu", transform=T.RandomResizedCrop(64)
    )
    _epoch(loader)
    _epoch(loader)
    s = loader.stats
    for stage in ("wait", "plan", "read", "decode", "resize", "collate", "transform", "transfer"):
        assert s.seconds[stage] > 0, (stage, s.seconds)
    assert abs(sum(s.route_seconds.values()) - s.seconds["decode"]) < 1e-6
    assert set(s.route_seconds) == set(ROUTES)
    assert [e["epoch"] for e in s.epochs] == [0, 1] and s.passes == 2
    assert s.epochs[1]["batches"] == 2 * len(loader) and s.first_wait > 0
    flat = s.as_dict()
    assert flat["bottleneck"] in BOTTLENECKS
    assert all(f"{c}_ms" in flat for c in COLUMNS)
    assert all(isinstance(v, (int, float)) for k, v in flat.items() if k != "bottleneck")
    for c in COLUMNS:
        p = s.percentiles(c)
        assert p[50] <= p[90] <= p[99]
    s.reset()
    assert s.batches == 0 and s.seconds["decode"] == 0 and s.epochs == [] and s.bottleneck is None
    assert str(s).splitlines()[0] == "no batches yet"
    _epoch(loader)
    assert s.batches == len(loader) and loader.stats is s


def test_the_profiler_trace_shows_the_stages(photos):
    loader = GpuCachedLoader(
        photos, batch_size=16, num_workers=0, device="cpu", transform=T.RandomResizedCrop(64)
    )
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        _epoch(loader)
    names = {e.key for e in prof.key_averages()}
    for stage in ("plan", "wait_for_batch", "transfer", "transform"):
        assert f"gpucache.{stage}" in names, sorted(n for n in names if "gpucache" in n)
    # decode and resize run inside the batch's wait (num_workers=0 decodes in this process)
    assert {"gpucache.decode", "gpucache.resize"} <= names


def test_timings_can_be_turned_off(photo_folder, tmp_path):
    import subprocess
    import sys

    script = (
        "import sys\n"
        "from gpucache import GpuCachedLoader, JpegCache\n"
        "from gpucache import transforms as T\n"
        "c = JpegCache.from_folder(sys.argv[1], progress=False)\n"
        "l = GpuCachedLoader(c, batch_size=16, num_workers=1, device='cpu', "
        "transform=T.Resize((32, 32)))\n"
        "for _ in l: pass\n"
        "print(l.stats.batches, l.stats.seconds['decode'], l.stats.seconds['wait'])\n"
    )
    env = dict(__import__("os").environ, GPUCACHE_TIMINGS="0")
    out = subprocess.run(
        [sys.executable, "-c", script, str(photo_folder)],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    batches, decode, wait = out.stdout.split()
    assert int(batches) == 4 and float(decode) == 0 and float(wait) == 0


def test_lightning_callback_logs_the_data_wait_to_the_csv_logger(photos, tmp_path):
    L = pytest.importorskip("lightning")
    from lightning.pytorch.loggers import CSVLogger

    from gpucache.lightning import LoaderStatsCallback

    class Tiny(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.layer = torch.nn.Linear(3 * 16 * 16, 2)

        def training_step(self, batch, _):
            x, y = batch
            return torch.nn.functional.cross_entropy(self.layer(x.float().flatten(1)), y)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.01)

    loader = GpuCachedLoader(
        photos, batch_size=16, num_workers=1, device="cpu", transform=T.Resize((16, 16))
    )
    trainer = L.Trainer(
        max_epochs=2,
        accelerator="cpu",
        devices=1,
        logger=CSVLogger(tmp_path, name="run"),
        callbacks=[LoaderStatsCallback()],
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    with loader:
        trainer.fit(Tiny(), train_dataloaders=loader)
    (path,) = tmp_path.glob("run/*/metrics.csv")
    rows = [r for r in csv.DictReader(path.open()) if r.get("gpucache/data_wait_fraction")]
    assert len(rows) == 2, rows  # one row an epoch
    for r in rows:
        assert 0 <= float(r["gpucache/data_wait_fraction"]) <= 1
        assert float(r["gpucache/decode_ms"]) > 0
        assert int(float(r["gpucache/bottleneck"])) in range(len(BOTTLENECKS))
    assert float(rows[-1]["gpucache/batches"]) == 2 * len(loader)


def test_bench_explain_prints_the_report_for_a_users_own_data(photo_folder, capsys, tmp_path):
    from gpucache.bench import main

    out_json = tmp_path / "stats.json"
    argv = [str(photo_folder), "--explain", "--epochs", "1", "--workers", "1"]
    assert main([*argv, "--batch-size", "16", "--json", str(out_json)]) == 0
    lines = capsys.readouterr().out.splitlines()
    head = next(k for k, line in enumerate(lines) if line.startswith("data wait "))
    assert "-bound: " in lines[head] and lines[head + 1].startswith("4 batches, 60 samples")
    assert json.loads(out_json.read_text())["batches"] == 4
