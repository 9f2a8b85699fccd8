"""``tierkv batch --ray local`` on a real local Ray instance: the single-process job's outputs, one error
line per bad document, a killed worker's documents retried, and a killed job resumed."""
from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tierkv.schedule.job import JobConfig, run_job

pytestmark = [pytest.mark.model, pytest.mark.slow, pytest.mark.xdist_group("ray")]   # one cluster at a time
TEXTS = {"a.txt": "The cat sat on the mat. It was warm and the cat was happy to be there all day.",
         "b.txt": "Rain fell on the city for three days. The river rose and the bridges were closed.",
         "c.txt": "A new library opened downtown with ten thousand books and a reading garden.",
         "d.txt": "The team trained every morning and won the regional cup in the spring."}


def documents(root: Path, *, bad: bool = True) -> Path:
    folder = root / "docs"
    folder.mkdir()
    for name, text in TEXTS.items():
        (folder / name).write_text(text)
    if bad:
        (folder / "empty.txt").write_text("")
        (folder / "binary.txt").write_bytes(b"\xff\xfe\x00")
    return folder


def batch(*args: str, env: dict | None = None, **kw) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "tierkv.cli", "batch", "--max-new-tokens", "6", "--json",
                             "--dtype", "float32", *args],      # the single-process reference runs in fp32
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, **kw)


def records(path: Path) -> dict[str, dict]:
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert len(lines) == len({r["id"] for r in lines}), "a document was written twice"
    return {r["id"]: r for r in lines}


@pytest.fixture(scope="module")
def single(smollm2, tmp_path_factory) -> tuple[Path, dict[str, dict]]:
    """The documents and the single-process job's records of them."""
    root = tmp_path_factory.mktemp("single")
    folder = documents(root)
    run_job(JobConfig(inputs=folder, out=root / "single.jsonl", max_new_tokens=6), loaded=smollm2)
    return folder, records(root / "single.jsonl")


def same(got: dict[str, dict], want: dict[str, dict]) -> None:
    assert got.keys() == want.keys()
    for key, record in want.items():
        assert got[key].get("summary") == record.get("summary") and got[key].get("error") == record.get("error")


def test_ray_with_workers_killed_gives_the_single_process_outputs(single, tmp_path):
    """Each worker dies at its second batch (retried on a new one), and every worker that takes c.txt
    dies: its batch is skipped after its retries, run again a document at a time, and c.txt alone gets
    an error line (Ray restarted workers for ever, so such a document hung the job)."""
    folder, want = single
    env = dict(os.environ, TIERKV_FAILPOINTS="batch.worker-call:2,batch.worker-document@c.txt")
    job = batch("--inputs", str(folder), "--out", str(tmp_path / "ray.jsonl"), "--ray", "local", "--ray-batch", "2",
                "--ray-retries", "1", env=env)
    out, err = job.communicate(timeout=600)
    assert job.returncode == 1 and "3 document(s) failed" in err, err[-3000:]     # each an error line
    got = records(tmp_path / "ray.jsonl")
    assert got.pop("c.txt")["error"] == ("failed: the worker running it died at every try (killed, out of memory "
                                         "or crashed; --ray-retries 1)")
    same(got, {k: v for k, v in want.items() if k != "c.txt"})
    assert got["empty.txt"]["error"] == "empty document" and "not UTF-8" in got["binary.txt"]["error"]
    assert json.loads(out)["failed"] == 3


def test_a_stopped_job_resumes_without_redoing_finished_documents(single, tmp_path):
    """SIGTERM stops the job as Ctrl-C would (Ray's own handler made it abort); the rerun skips what it wrote."""
    folder, want = single
    out = tmp_path / "out.jsonl"
    job = batch("--inputs", str(folder), "--out", str(out), "--ray", "local", "--ray-batch", "1",
                start_new_session=True)
    deadline = time.monotonic() + 600
    while not (out.exists() and out.read_text().count("\n") >= 3):
        assert job.poll() is None and time.monotonic() < deadline, "the job ended before it could be stopped"
        time.sleep(0.2)
    job.send_signal(signal.SIGTERM)
    try:
        _, err = job.communicate(timeout=120)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(job.pid, signal.SIGKILL)                   # Ray's processes, whatever happened
    assert job.returncode == 128 + signal.SIGTERM and "tierkv: terminated" in err, err[-3000:]
    done = set(records(out))
    assert 3 <= len(done) < 6
    again = batch("--inputs", str(folder), "--out", str(out), "--ray", "local")
    stdout, err = again.communicate(timeout=600)
    assert again.returncode == (1 if {"empty.txt", "binary.txt"} - done else 0), err[-3000:]   # (their error lines)
    summary = json.loads(stdout)
    assert summary["skipped"] == len(done) and summary["documents"] == 6 - len(done)
    same(records(out), want)


def test_a_policy_file_that_cannot_be_read_fails_before_ray_starts(tmp_path):
    """``--policy`` is read on the driver and handed to every worker (it was not read at all)."""
    from tierkv.errors import ConfigError
    from tierkv.schedule.ray_job import RayOptions, run_ray_job
    config = JobConfig(inputs=documents(tmp_path, bad=False), out=tmp_path / "out.jsonl",
                       policy=str(tmp_path / "missing.json"))
    with pytest.raises((ConfigError, OSError), match="missing.json"):
        run_ray_job(config, RayOptions(address="local", workers=1))
    assert not (tmp_path / "out.jsonl").exists()


def test_settings_no_worker_can_run_stop_the_job_as_in_one_process(tmp_path):
    """Workers the cluster cannot start are refused (Ray waited for them, saying nothing); budgets no
    policy fits are one error, exit 2, as without Ray (they were a failed line a document, exit 0)."""
    folder = documents(tmp_path, bad=False)
    for flags, message in ((["--cpus-per-worker", "4096"], "--workers 1 x --cpus-per-worker 4096: the Ray cluster "
                                                           "has"),
                           (["--gpu-budget", "10MiB", "--cpu-budget", "20MiB"], "no policy fits")):
        out = tmp_path / f"out{len(flags)}.jsonl"
        job = batch("--inputs", str(folder), "--out", str(out), "--ray", "local", *flags)
        try:
            _, err = job.communicate(timeout=300)
        except subprocess.TimeoutExpired:             # (it hung: its Ray instance goes with it)
            job.send_signal(signal.SIGINT)
            job.communicate(timeout=60)
            raise
        assert job.returncode == 2 and message in err, err[-3000:]
        assert not out.exists() and "ray_remote_args` is deprecated" not in err      # (Ray's, for restarts)
