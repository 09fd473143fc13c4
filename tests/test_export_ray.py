"""`python -m moonvit_projector.export --engine ray`: the local engine's bytes, through faults, on a local Ray."""

from __future__ import annotations

import json
import os
import pickle
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import folder_bytes, make_checkpoint, run_export, with_threads, write_images

import moonvit.runs
from moonvit import MoonViT, MoonViTImageProcessor
from moonvit.model.attention import resolve_attn_implementation
from moonvit.runs import compute_facts
from moonvit_projector.dataset import VisualTokenDataset
from moonvit_projector.export import ExportError, ExportRun, export, load_models, plan_input, ray_engine, scan_inputs
from moonvit_projector.export.cache import TokenCache
from moonvit_projector.export.ray_engine import EncodePacks

ray = pytest.importorskip("ray")

REPO = Path(__file__).resolve().parents[1]
# the backend a bf16 CPU export runs (OpenVINO's where it is installed and the CPU has bf16 arithmetic)
ATTENTION = resolve_attn_implementation("auto", torch.device("cpu"), torch.bfloat16)


@pytest.fixture(scope="module")
def local_ray():
    """One local Ray for the module's in-process exports (the engine keeps a caller's connection)."""
    ray.init(num_cpus=3, include_dashboard=False, log_to_driver=False, configure_logging=False)
    yield ray
    ray.shutdown()


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    return make_checkpoint(tmp_path_factory.mktemp("ckpt"))


@pytest.fixture(scope="module")
def images(tmp_path_factory) -> Path:
    """Mixed sizes (some over the token limit, PNG and JPEG, a subfolder), a broken file, a file
    that is not an image by extension, and two copies of one image in different shards."""
    folder = tmp_path_factory.mktemp("ray_images")
    paths = write_images(folder, 10, seed=7)
    (folder / "broken.jpg").write_bytes(b"not a jpeg")
    (folder / "notes.txt").write_text("skipped")
    shutil.copyfile(paths[1], folder / "zz_copy.png")
    return folder


@pytest.fixture(scope="module")
def local_output(tmp_path_factory, checkpoint, images) -> Path:
    out = tmp_path_factory.mktemp("local") / "out"
    run_export(*common(images, checkpoint), "--out", out)
    return out


def common(images: Path, checkpoint: Path) -> list[str | Path]:
    # a small pack budget: several packs per shard, and more packs than actors
    return ["--inputs", images, "--checkpoint", checkpoint, "--shard-size", "3", "--max-patches-per-pack", "128"]


def ray_run(images: Path, checkpoint: Path, out: Path, **settings) -> ExportRun:
    defaults = dict(max_patches_per_pack=128, shard_size=3, device="cpu", threads=1, engine="ray")
    return ExportRun(inputs=images, checkpoint=str(checkpoint), out=out, **{**defaults, **settings})


def test_the_ray_engine_writes_the_local_engine_s_bytes(local_ray, tmp_path, checkpoint, images, local_output):
    out = tmp_path / "out"
    summary = run_export(*common(images, checkpoint), "--out", out, "--engine", "ray", "--workers", "2")
    assert folder_bytes(out) == folder_bytes(local_output)
    assert summary["images"] == 11 and summary["failed"] == 1 and summary["skipped"] == {".txt": 1}
    assert summary["encoded_this_run"] == 10 and summary["duplicates_this_run"] == 1
    assert 0.0 <= summary["data_share"] <= 1.0
    # the start-up (Ray up to the first pack back) apart from the rate after it
    assert 0.0 < summary["first_pack_s"] < summary["seconds"] and summary["steady_items_per_s"] > 0


def test_two_encoder_actors_write_the_same_bytes(local_ray, tmp_path, checkpoint, images, local_output):
    out = tmp_path / "out"
    run = ray_run(images, checkpoint, out, encoder_actors=2, workers=1, store="projected")
    with_threads(export, run)
    assert folder_bytes(out) == folder_bytes(local_output)


def encoder_pids() -> list[int]:
    """The processes of this machine's encoder actors (Ray titles them after the UDF)."""
    pids = []
    for entry in Path("/proc").iterdir():
        try:
            title = (entry / "cmdline").read_bytes()
        except OSError:  # not a process, or it ended
            continue
        if entry.name.isdigit() and title.startswith(b"ray::") and b"EncodePacks" in title:
            pids.append(int(entry.name))
    return pids


@pytest.mark.skipif(not Path("/proc/self/cmdline").exists(), reason="finds the actor's process in /proc")
def test_a_killed_encoder_actor_changes_nothing(local_ray, tmp_path, checkpoint, images, local_output):
    """SIGKILL the encoder actor's process after the first pack came back: Ray restarts it and
    gives it its packs again; the folder is the local engine's, every id once."""
    killed: list[int] = []
    after: list[int] = []

    def kill_the_encoder(packs_back: int) -> None:
        if killed:
            after.append(packs_back)
            return
        pids = encoder_pids()
        assert len(pids) == 1, pids
        os.kill(pids[0], signal.SIGKILL)
        killed.append(pids[0])

    out = tmp_path / "out"
    summary = with_threads(export, ray_run(images, checkpoint, out), on_pack=kill_the_encoder)
    assert killed and after, "no pack came back after the only encoder actor was killed: it was not restarted"
    assert folder_bytes(out) == folder_bytes(local_output)
    ids = [json.loads(line)["id"] for line in (out / "manifest.jsonl").read_text().splitlines()]
    assert len(ids) == len(set(ids)) == summary["images"] == 11


def test_the_cache_serves_the_ray_engine(local_ray, tmp_path, checkpoint, images, local_output):
    cache = tmp_path / "cache"
    run_export(*common(images, checkpoint), "--out", tmp_path / "first", "--cache", cache)
    summary = with_threads(export, ray_run(images, checkpoint, tmp_path / "out", cache=cache))
    assert summary["cache_reused_this_run"] == 10 and summary["encoded_this_run"] == 0
    assert folder_bytes(tmp_path / "out") == folder_bytes(local_output)


def test_an_actor_that_would_give_other_bytes_is_refused(checkpoint):
    compute = {**compute_facts(torch.device("cpu")), "threads": 1, "torch": "1.0.0", "attention": ATTENTION}
    args = (str(checkpoint), ("projected",), "bf16", "cpu", {}, compute, "0" * 64)
    with pytest.raises(ExportError, match=r"torch: '1.0.0' on the driver, '.+' here"):
        with_threads(EncodePacks, *args)
    compute["torch"] = torch.__version__
    compute["host"] = {**compute["host"], "amx": "other"}
    with pytest.raises(ExportError, match=r"host.amx: 'other' on the driver"):
        with_threads(EncodePacks, *args)
    compute["host"] = compute_facts(torch.device("cpu"))["host"]
    compute["attention"] = "eager"
    with pytest.raises(ExportError, match=rf"attention: 'eager' on the driver, '{ATTENTION}' here"):
        with_threads(EncodePacks, *args)
    compute["attention"] = ATTENTION
    with pytest.raises(ExportError, match="holds other weights"):
        with_threads(EncodePacks, *args)


def test_a_pack_s_result_carries_its_own_tokens_only(checkpoint, images):
    """Each item's tensors are pickled on their own, not as views of the pack's whole buffer."""
    from moonvit.encode import process_pack
    from moonvit.media.packing import group_into_packs

    models = load_models(checkpoint, ("projected",), torch.bfloat16, torch.device("cpu"))
    run_json = {**compute_facts(torch.device("cpu")), "attention": ATTENTION}
    actor = EncodePacks(str(checkpoint), ("projected",), "bf16", "cpu", {}, run_json, models.checkpoint_sha256)
    planned = [plan_input(i, image, models, 4096) for i, image in enumerate(scan_inputs(images).images)]
    pack = next(group_into_packs((item for entry in planned for item in entry.items), 4096))
    processed = process_pack(models.processor, pack, skip_errors=True)
    out = actor({"id": np.array([0]), "processed": np.array([pickle.dumps(processed)], dtype=object)})
    tensors, _ = pickle.loads(out["result"][0])
    assert len(tensors) == len(processed[2]) > 3
    token_bytes = sum(t.numel() * t.element_size() for kinds in tensors.values() for t in kinds.values())
    assert len(out["result"][0]) < 1.5 * token_bytes + 50_000


def test_a_run_with_nothing_to_encode_starts_no_ray(tmp_path, checkpoint, images, monkeypatch):
    cache = tmp_path / "cache"
    run_export(*common(images, checkpoint), "--out", tmp_path / "first", "--cache", cache)

    def no_ray(*args, **kwargs):
        raise AssertionError("Ray was started")

    reads: list[tuple[str, bool]] = []
    real_read = TokenCache._read

    def counted(self, sha256, tensors):
        reads.append((sha256, tensors))
        return real_read(self, sha256, tensors)

    monkeypatch.setattr(ray_engine, "ray_session", no_ray)
    monkeypatch.setattr(TokenCache, "_read", counted)
    summary = with_threads(export, ray_run(images, checkpoint, tmp_path / "out", cache=cache))
    assert summary["encoded_this_run"] == 0 and summary["cache_reused_this_run"] == 10
    # each entry's header checked when planned, its tensors read (and their hash checked) once
    assert sorted(sha for sha, tensors in reads if tensors) == sorted(sha for sha, tensors in reads if not tensors)
    assert len(reads) == 20 and len({sha for sha, _ in reads}) == 10


def test_an_entry_damaged_inside_is_removed_and_encoded_by_the_next_run(tmp_path, checkpoint, images, monkeypatch):
    """Its header is fine (the planning check passes), its bytes are not: the run stops naming it,
    and the next run encodes it."""
    cache = tmp_path / "cache"
    run_export(*common(images, checkpoint), "--out", tmp_path / "first", "--cache", cache)
    entry = sorted(cache.rglob("*.safetensors"))[3]
    data = bytearray(entry.read_bytes())
    data[-1] ^= 0xFF
    entry.write_bytes(bytes(data))
    monkeypatch.setattr(ray_engine, "ray_session", lambda *args, **kwargs: pytest.fail("Ray was started"))
    with pytest.raises(ExportError, match=rf"the cache entry of {entry.stem} .* it was removed: run again"):
        with_threads(export, ray_run(images, checkpoint, tmp_path / "out", cache=cache))
    assert not entry.exists()
    again = run_export(*common(images, checkpoint), "--out", tmp_path / "again", "--cache", cache)
    assert again["encoded_this_run"] == 1 and again["cache_reused_this_run"] == 9


def test_the_actors_run_the_backend_asked_for(local_ray, tmp_path, checkpoint, images):
    out = tmp_path / "out"
    local = run_export(*common(images, checkpoint), "--out", tmp_path / "local", "--attn", "eager")
    summary = with_threads(export, ray_run(images, checkpoint, out, attn="eager"))
    assert summary["encoded_this_run"] == local["encoded_this_run"] == 10
    assert json.loads((out / "run.json").read_text())["compute"]["attention"] == "eager"
    assert folder_bytes(out) == folder_bytes(tmp_path / "local")


def test_the_actors_read_the_projector_of_projector_from(local_ray, tmp_path, checkpoint, images, local_output):
    """A fine-tuned tower's folder without a projector, the projector from another folder: the actors
    load both, and the tokens are the local engine's from the folder that holds both."""
    tower = tmp_path / "tower"
    MoonViT.from_pretrained(checkpoint).save_pretrained(tower)
    MoonViTImageProcessor.from_pretrained(checkpoint).save_pretrained(tower)
    out = tmp_path / "out"
    with_threads(export, ray_run(images, tower, out, projector_from=str(checkpoint)))
    assert json.loads((out / "run.json").read_text())["checkpoint"]["projector_from"] == str(checkpoint.resolve())
    ours, reference = (VisualTokenDataset(folder) for folder in (out, local_output))
    assert len(ours) == len(reference) == 11
    assert all(torch.equal(ours[i]["projected"], reference[i]["projected"]) for i in range(len(ours)))


def test_gpu_actors_record_their_own_attention_backend(tmp_path, checkpoint, images, monkeypatch):
    """On CUDA the backend is the actors' (flash-attn may be installed there and not on the
    driver): ``run.json`` records what a GPU task resolved, and the actors are checked against it."""
    asked = []

    def on_a_gpu(run, requested):
        asked.append(requested)
        return "flash"

    def stop(*args, **kwargs):
        raise ExportError("no GPU here")

    monkeypatch.setattr(ray_engine, "actors_attention", on_a_gpu)
    monkeypatch.setattr(ray_engine, "ray_session", stop)
    with pytest.raises(ExportError, match="no GPU here"):
        with_threads(export, ray_run(images, checkpoint, tmp_path / "out", device="cuda"))
    run = json.loads((tmp_path / "out" / "run.json").read_text())
    assert asked == ["auto"] and run["compute"]["attention"] == "flash" and run["compute"]["device_type"] == "cuda"


def test_a_decoding_task_that_would_give_other_bytes_stops_the_run_with_its_reason(
    local_ray, tmp_path, checkpoint, images, monkeypatch
):
    real = moonvit.runs.host_facts
    monkeypatch.setattr(moonvit.runs, "host_facts", lambda device: {**real(device), "pillow": "0.0"})
    with pytest.raises(ExportError, match=r"pillow: '0.0' on the driver, '[\d.]+' here"):
        with_threads(export, ray_run(images, checkpoint, tmp_path / "out"))


@pytest.mark.slow
def test_cuda_actors_on_a_machine_without_gpus_are_refused(tmp_path, checkpoint, images):
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    args = [str(a) for a in common(images, checkpoint)]
    command = [sys.executable, "-m", "moonvit_projector.export", *args, "--out", str(tmp_path / "out")]
    command += ["--engine", "ray", "--device", "cuda", "--threads", "1"]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    done = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 1, done.stderr[-2000:]
    assert "--encoder-actors 1 on CUDA needs 1 GPUs; this machine's Ray sees 0" in done.stderr


RECORD = b"[2026-01-02 03:04:05,678 E 4242 4242] core_worker.cc:2465: Actor with class name: 'X' ...\n"


def test_ray_s_records_are_left_out_of_stderr_and_the_rest_passes_as_it_comes():
    """A record of Ray's C++ core goes, wherever the stream is cut and after a partial bar line;
    a bar's own brackets pass at once, a fatal record and anything else pass."""
    bar = b"\rexport:  50%|#####     | 3/6 [00:11<00:11,  3.89s/img]"
    stream = b"\rexport:   0%|          | 0/6 [00:00<?, ?img/s]" + RECORD + bar + b"\nWARNING a warning of ours\n"
    for size in (1, 7, 64, len(stream)):
        records = ray_engine.RayRecordFilter()
        passed = b"".join(records.feed(stream[i : i + size]) for i in range(0, len(stream), size))
        assert passed + records.flush() == stream.replace(RECORD, b"")
    records = ray_engine.RayRecordFilter()
    assert records.feed(bar) == bar
    fatal = b"[2026-01-02 03:04:05,678 F 4242 4242] logging.cc:1: this process ends\n"
    assert records.feed(fatal) == fatal


def test_stderr_keeps_everything_but_ray_s_records(capfd):
    """On the descriptor itself, where Ray's core and Python's stderr both write."""
    with ray_engine.without_ray_records():
        os.write(2, b"before " + RECORD)
        os.write(2, b"WARNING a warning of ours\n")
    os.write(2, b"after\n")
    assert capfd.readouterr().err == "before WARNING a warning of ours\nafter\n"


@pytest.mark.slow
def test_a_ray_export_s_stderr_holds_its_bar_only(tmp_path, checkpoint):
    """Ray's start notice and its core worker's records (Ray Data gives its actors their
    arguments in the object store) stay off the export's stderr."""
    write_images(tmp_path / "images", 3, seed=5)
    command = [sys.executable, "-m", "moonvit_projector.export", "--inputs", str(tmp_path / "images")]
    command += ["--checkpoint", str(checkpoint), "--out", str(tmp_path / "out"), "--engine", "ray", "--threads", "1"]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    env.pop("RAY_AUTH_MODE", None)  # the notice is Ray's on a start with the mode unset
    done = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.startswith("exported 3 images, 0 failed")
    lines = [line.strip() for line in done.stderr.replace("\r", "\n").splitlines() if line.strip()]
    bar = re.compile(r"export: +\d+%\|[^|]*\| \d+/3 \[[^\]]*\]")  # a bar update and nothing after it
    assert lines and all(bar.fullmatch(line) for line in lines), done.stderr


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"encoder_actors": 2}, "--encoder-actors and --ray-address are settings of --engine ray"),
        ({"ray_address": "auto"}, "--encoder-actors and --ray-address are settings of --engine ray"),
        ({"engine": "spark"}, "engine 'spark': expected one of local, ray"),
    ],
)
def test_engine_settings_are_checked(tmp_path, settings, message):
    with pytest.raises(ExportError, match=message):
        ExportRun(inputs=tmp_path, checkpoint="x", out=tmp_path / "out", **settings)


def test_the_ray_engine_refuses_torchrun(tmp_path, checkpoint, images, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ExportError, match="launch it without torchrun"):
        export(ray_run(images, checkpoint, tmp_path / "out"))


@pytest.mark.slow
def test_a_killed_driver_resumes_to_the_same_bytes(tmp_path, checkpoint):
    """SIGKILL the driver (which started its own local Ray) after its first shard, run the same
    command again: only the unfinished shards are redone, and the folder is the local engine's."""
    write_images(tmp_path / "images", 24, seed=11)
    args = [str(a) for a in common(tmp_path / "images", checkpoint)] + ["--threads", "1"]
    out = tmp_path / "out"
    command = [sys.executable, "-m", "moonvit_projector.export", *args, "--out", str(out), "--engine", "ray"]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    # its own process group: the driver and the local Ray it started die together, as on a lost machine
    process = subprocess.Popen(
        command, cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True
    )
    try:
        deadline = time.monotonic() + 300
        while not (out / "parts" / "shard-000000.json").exists():
            assert process.poll() is None and time.monotonic() < deadline, "the export ended before it was killed"
            time.sleep(0.005)
    finally:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()
    assert process.returncode == -signal.SIGKILL and not (out / "manifest.jsonl").exists()
    finished = len(list((out / "parts").glob("*.json")))
    assert 1 <= finished < 8

    rerun = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert rerun.returncode == 0, rerun.stderr[-2000:]
    assert f"this run processed {24 - 3 * finished} images" in rerun.stdout
    run_export(*args[:-2], "--out", tmp_path / "reference")
    assert folder_bytes(out) == folder_bytes(tmp_path / "reference")
