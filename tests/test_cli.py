"""The command line as a user meets it: help, wrong flags, bad values, missing files."""
import errno
import json
import os
import subprocess
import sys
from dataclasses import replace

import pytest

from tierkv import cli
from tierkv.cli import main
from tierkv.errors import BlockMissing, BudgetExceeded, ConfigError, DiskFullError, StoreReadError
from tierkv.failpoints import POINTS


def tierkv(*args):
    return subprocess.run([sys.executable, "-m", "tierkv.cli", *args], capture_output=True, text=True, timeout=300)


def test_info_json_reports_the_machine_and_probes_the_nvme_dir(tmp_path, capsys):
    assert main(["info", "--json", "--nvme-dir", str(tmp_path / "not-yet")]) == 0
    facts = json.loads(capsys.readouterr().out)
    assert facts["cuda"] is None or isinstance(facts["cuda"], str)
    assert facts["ram_bytes"] > 0
    assert set(facts["nvme"]["backends"]) == {"kvikio", "odirect", "buffered"}
    assert facts["nvme"]["backends"]["buffered"] == "ok"
    assert not (tmp_path / "not-yet").exists()  # probing creates nothing
    assert not facts["nvme"]["exists"] and facts["nvme"]["probed_in"] == str(tmp_path)
    assert main(["info", "--nvme-dir", str(tmp_path / "not-yet")]) == 0
    assert f"does not exist yet; a run makes it in {tmp_path}" in capsys.readouterr().out


def test_info_says_whether_reads_go_by_native_aio(tmp_path, capsys, monkeypatch):
    from tierkv.tiers import nvme_aio
    assert main(["info", "--json", "--nvme-dir", str(tmp_path)]) == 0
    nvme = json.loads(capsys.readouterr().out)["nvme"]
    assert nvme["native_aio_reads"] == (nvme["o_direct"] and nvme_aio.available())
    monkeypatch.setenv("TIERKV_NVME_AIO", "0")
    assert main(["info", "--nvme-dir", str(tmp_path)]) == 0
    assert "reads by native AIO no (on the I/O worker threads)" in capsys.readouterr().out


def test_the_command_sets_the_thread_switch_interval_from_its_knob(tmp_path, capsys, monkeypatch):
    """The tierkv command owns its process: it shortens the interpreter's switch interval (a hop to
    the manager's loop waits for the lock up to that long); a bad value is one clear line."""
    import sys
    before = sys.getswitchinterval()
    try:
        assert main(["info", "--json"]) == 0 and sys.getswitchinterval() == pytest.approx(0.0005)
        monkeypatch.setenv("TIERKV_SWITCH_INTERVAL", "0.002")
        assert main(["info", "--json"]) == 0 and sys.getswitchinterval() == pytest.approx(0.002)
        capsys.readouterr()
        monkeypatch.setenv("TIERKV_SWITCH_INTERVAL", "fast")
        assert main(["info"]) == 2
        assert "TIERKV_SWITCH_INTERVAL='fast': expected seconds" in capsys.readouterr().err
        monkeypatch.setenv("TIERKV_SWITCH_INTERVAL", "0")
        assert main(["info"]) == 2
        assert "more than 0 and at most 1" in capsys.readouterr().err
    finally:
        sys.setswitchinterval(before)


def test_store_verify_calls_a_store_cut_short_or_unreadable_damaged_checks_the_others_and_writes_nothing(
        tmp_path, capsys):
    import torch

    from tierkv.keys import BlockKey
    from tierkv.tiers.nvme import NvmeTier
    for name in ("a", "b", "c"):
        with NvmeTier(tmp_path / name, 4096, 16 * 4096) as tier:
            slots = [tier.pool.reserve() for _ in range(6)]
            tier.write([(BlockKey.of(name, i), slot, torch.full((4096,), i, dtype=torch.uint8))
                        for i, slot in enumerate(slots)])
    os.truncate(tmp_path / "a" / "slots.dat", 4 * 4096)              # two blocks' bytes gone
    (tmp_path / "b" / "store.json").write_text("{broken")
    (tmp_path / "c0").mkdir()
    (tmp_path / "c0" / "store.json").write_text('{"block_bytes": 0, "namespace": "x"}')
    files = {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()}
    assert main(["store", "verify", "--nvme-dir", str(tmp_path)]) == 1
    out = capsys.readouterr().out
    assert "store a: 4 blocks, all sound; 2 lost: their slots lie past the end of slots.dat" in out
    assert "store b: unusable (unreadable store.json (Expecting" in out and "store c: 6 blocks, all sound" in out
    assert "store c0: unusable (unreadable store.json (no field 'format')); a run with the settings" in out
    assert out.rstrip().splitlines()[-1].strip().startswith("DAMAGED")
    assert {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()} == files     # a check, not a repair
    assert main(["store", "verify", "--nvme-dir", str(tmp_path / "c" / "slots.dat")]) == 2
    assert "slots.dat: not a directory" in capsys.readouterr().err


def test_store_verify_of_a_folder_with_no_store_is_an_error_not_clean(tmp_path, capsys):
    (tmp_path / "notes.txt").write_text("not a store")
    assert main(["store", "verify", "--nvme-dir", str(tmp_path)]) == 2
    assert "no tierkv store in it" in capsys.readouterr().err


def test_info_text(capsys):
    import signal
    before = signal.getsignal(signal.SIGTERM)
    assert main(["info"]) == 0
    assert signal.getsignal(signal.SIGTERM) is before          # a caller's own handler is back
    out = capsys.readouterr().out
    assert "RAM" in out and "CUDA" in out and "GDS" in out


@pytest.mark.parametrize("args,message", [
    (["info", "--bogus"], "tierkv info: unrecognized arguments: --bogus (see tierkv info --help)"),
    (["run", "--synthetic-tokens", "100", "--bogus"], "tierkv run: unrecognized arguments: --bogus (see tierkv run --help)"),
    (["store", "verify", "--nvme-dir", "x", "--bogus"], "(see tierkv store verify --help)"),
    (["store", "verify", "--nvme-dir", ""], "argument --nvme-dir: empty: give a path"),     # not the working dir
    (["store", "repair"], "tierkv store repair: the following arguments are required: --nvme-dir"),
    (["run", "--doc", "/proc/self/mem"], "--doc /proc/self/mem: cannot read it (Input/output error)"),
    (["run", "--synthetic-tokens", "100", "--sparse-budget", "4"], "--sparse-budget=4: less than one chunk of 8 tokens"),
    (["run", "--synthetic-tokens", "100", "--nvme-dir", " "], "argument --nvme-dir: empty: give a path"),
    (["run", "--doc", "x.txt", "--question", ""], "--question number 1 is empty"),
    (["run", "--synthetic-tokens", "100", "--gpu-budget", "99999999TiB"], "more than any machine addresses"),
    (["nonsense"], "invalid choice: 'nonsense'"),
    (["chat", "--max-new-tokens", "0"], "--max-new-tokens=0: must be >= 1"),        # before the model loads
    (["chat", "--temperature", "-1"], "temperature=-1.0: must be between 0 and 100"),
    (["run"], "give exactly one of --doc FILE or --synthetic-tokens N"),
    (["run", "--synthetic-tokens", "x"], "invalid int value: 'x'"),
    (["run", "--synthetic-tokens", "100", "--cpu-budget", "lots"], "--cpu-budget='lots'"),
    (["run", "--synthetic-tokens", "100", "--gpu-budget", "-1GiB"], "--gpu-budget='-1GiB': expected a size"),
    (["serve", "--drain-s", "-1"], "--drain-s=-1.0: must be >= 0"),
    (["run", "--synthetic-tokens", "100", "--mode", "fast"], "invalid choice: 'fast' (choose from 'auto', 'dense', 'sparse')"),
    (["run", "--synthetic-tokens", "100", "--sparse-budget", "150%"], "--sparse-budget='150%': a share must be more than 0% and at most 100%"),
    (["run", "--synthetic-tokens", "100", "--selector", "best"], "selector='best': unknown; valid names:"),
    (["run", "--synthetic-tokens", "100", "--mode", "sparse", "--sparse-prefetch", "next-layer"],
     "--sparse-prefetch='next-layer': unknown; valid names: none, previous-step, speculative"),   # (no flag named)
    (["run", "--synthetic-tokens", "100", "--sparse-attend", "heads"],
     "invalid choice: 'heads' (choose from 'pages', 'chunks')"),
    (["run", "--synthetic-tokens", "100", "--rank", "500", "--mode", "sparse"], "rank=500: at most the key dimensions"),
    (["run", "--synthetic-tokens", "100", "--cxl-budget", "lots"], "--cxl-budget='lots'"),
    (["run", "--synthetic-tokens", "100", "--chunk-tokens", "1000"],
     "--chunk-tokens=1000: must be a multiple of --block-tokens=256"),
    (["run", "--synthetic-tokens", "100", "--mode", "sparse", "--rank", "-3"], "--rank=-3: must be > 0 (unset: the default)"),
    (["run", "--synthetic-tokens", "100", "--mode", "sparse", "--page-tokens", "12"],
     "--page-tokens=12: must be a multiple of the tokens one landmark summarises (the sparse chunk_tokens, 8; "
     "not --chunk-tokens"),
    (["run", "--synthetic-tokens", "100", "--dtype", "int8"], "argument --dtype: invalid choice: 'int8'"),
    (["run", "--synthetic-tokens", "100", "--mode", "dense", "--no-sparse-overlap"],
     "--no-sparse-overlap: sparse-mode settings, but --mode dense"),
    (["run", "--synthetic-tokens", "100", "--sparse-overlap"],
     "unrecognized arguments: --sparse-overlap; --sparse-overlap: overlap is the default; --no-sparse-overlap"),
    (["run", "--synthetic-tokens", "100", "--mode", "dense", "--layer-budget", "0:4096", "--rank", "64"],
     "--rank, --layer-budgets: sparse-mode settings, but --mode dense attends to every stored key"),
    (["chat", "--mode", "dense", "--sparse-budget", "64"], "--sparse-budget: sparse-mode settings, but --mode dense"),
    (["run", "--synthetic-tokens", "100", "--trace", "no/such/dir/t.json"], "--trace no/such/dir/t.json: no such "
                                                                            "directory no/such/dir"),
    (["run", "--synthetic-tokens", "100", "--record-access", "."], "--record-access .: is a directory"),
    (["run", "--synthetic-tokens", "100", "--trace", f"{__file__}/t.json"],
     f"--trace {__file__}/t.json: {__file__} is a file, not a directory"),
    (["run", "--synthetic-tokens", "100", "--trace", "/proc/t.json"], "--trace /proc/t.json: cannot write there"),
    (["run", "--doc", __file__, "--depth", "0.3", "--seed", "2"],
     "--depth, --seed: settings of the --synthetic-tokens haystack, but --doc is given"),
    (["run", "--synthetic-tokens", "100", "--trace", "/dev/null", "--record-access", "/dev/null"],
     "--trace and --record-access are both /dev/null: the second would overwrite the first"),
    (["serve", "--mode", "dense", "--rank", "64"], "--rank: sparse-mode settings, but --mode dense"),
    (["run", "--synthetic-tokens", "100", "--mode", "sparse", "--kv-dtype", "int4", "--prefetch", "none"],
     "--kv-dtype, --prefetch: dense-mode settings, but --mode sparse keeps pages"),
    (["serve", "--mode", "sparse", "--block-tokens", "128"], "--block-tokens: dense-mode settings"),
    (["chat", "--mode", "sparse", "--kv-buffer", "1MiB"], "--kv-buffer: dense-mode settings"),
    (["run", "--synthetic-tokens", "100", "--cxl-preset", "cxl2-x16"],
     "--cxl-preset='cxl2-x16': the CXL pool has no budget; give --cxl-budget=SIZE"),
    (["run", "--synthetic-tokens", "100", "--gpu-policy", "nosuch"], "--gpu-policy: policy='nosuch': unknown"),
    (["run", "--synthetic-tokens", "100", "--kv-dtype", "int8-g64-g32"], "option -g given twice"),
    (["run", "--synthetic-tokens", "100", "--cxl-preset", "nosuch"], "--cxl-preset='nosuch': unknown; valid presets"),
    (["info", "--full"], "--full: a longer link measurement, so it goes with --probe or --reprobe"),
    (["info", "--nvme-dir", __file__], f"--nvme-dir {__file__}: not a directory"),
    (["serve", "--api-key", ""], "--api-key: empty, or with spaces at its ends"),
    (["serve", "--served-name", " "], "--served-name: empty; give the name clients ask for"),
    (["serve", "--host", "0.0.0.0x"], "--host 0.0.0.0x: not an address of this machine"),   # (no warning first)
    (["serve", "--mode", "sparse", "--draft-tokens", "2"], "--draft-tokens: drafts are verified in dense mode only"),
])
def test_bad_input_is_one_line_and_exit_2(args, message, capsys):
    assert main(args) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1 and "Traceback" not in err


@pytest.mark.parametrize("error,status", [
    (DiskFullError(errno.ENOSPC, "no space left for block k"), 1),
    (StoreReadError(errno.EIO, "the device failed a read"), 1),
    (OSError(errno.EIO, "Input/output error"), 1),
    (BlockMissing("block k: not stored"), 1),
    (FileNotFoundError(errno.ENOENT, "No such file or directory", "in.jsonl"), 2),
    (PermissionError(errno.EACCES, "Permission denied", "out.jsonl"), 2),
    (ConfigError("--x 3: must be 1..2"), 2),
    (BudgetExceeded("tier 'cpu' has no room: raise its budget"), 2),
])
def test_the_exit_status_tells_a_wrong_command_from_a_failed_run(error, status, monkeypatch, capsys):
    """2: the command is wrong (a flag, a file named on it); 1: the run failed (disk, device, store)."""
    def failing(sub):
        sub.add_parser("fail").set_defaults(func=lambda args: (_ for _ in ()).throw(error))
    monkeypatch.setattr(cli, "COMMANDS", [*cli.COMMANDS, failing])
    assert main(["fail"]) == status
    assert capsys.readouterr().err.startswith("tierkv: error: ")


def test_missing_document_and_missing_model_are_clear(tmp_path):
    done = tierkv("run", "--doc", str(tmp_path / "nope.txt"))
    assert done.returncode == 2 and "no such file" in done.stderr and "Traceback" not in done.stderr
    (tmp_path / "doc.pdf").write_bytes(b"%PDF-1.7\n\xe2\xe3\xcf\xd3\n")
    done = tierkv("run", "--doc", str(tmp_path / "doc.pdf"))
    assert done.returncode == 2 and "not UTF-8 text (byte 0xe2 at offset 9)" in done.stderr, done.stderr
    done = tierkv("run", "--synthetic-tokens", "100", "--model", str(tmp_path / "missing.gguf"))
    assert done.returncode == 2 and "Traceback" not in done.stderr


def test_serve_with_a_store_directory_that_cannot_be_made_stops_at_once(tmp_path):
    taken = tmp_path / "a-file"
    taken.write_text("not a directory")
    done = tierkv("serve", "--nvme-dir", str(taken / "kv"))      # not: listen, then fail every request
    assert done.returncode == 2 and f"--nvme-dir {taken / 'kv'}: cannot create" in done.stderr, done.stderr
    assert "Traceback" not in done.stderr


@pytest.mark.parametrize("lines", [200_000, 1])       # written while it runs; one line still buffered at the end
def test_output_piped_into_a_reader_that_stops_early_ends_quietly(lines):
    """``tierkv ... | head``: no "Broken pipe" error when head exits, the status of a command SIGPIPE ended."""
    script = ("import sys, time\nfrom tierkv import cli\n"
              "cli.COMMANDS.append(lambda sub: sub.add_parser('lines').set_defaults("
              f"func=lambda args: [print('x' * 99) for _ in range({lines})] and time.sleep(0.5) or 0))\n"
              "sys.exit(cli.main(['lines']))\n")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}
    reader = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
    if lines > 1:
        assert reader.stdout.read(10) == b"x" * 10
    reader.stdout.close()                              # as head does once it has its lines
    assert reader.wait(timeout=60) == 141 and reader.stderr.read() == b""


def test_help_lists_the_commands():
    done = tierkv("--help")
    assert done.returncode == 0 and "info" in done.stdout and "run" in done.stdout


@pytest.mark.model
def test_sparse_settings_that_auto_mode_leaves_unused_are_named():
    done = tierkv("run", "--synthetic-tokens", "200", "--max-new-tokens", "1", "--sparse-budget", "512")
    assert done.returncode == 0, done.stderr
    assert "note: --sparse-budget unused: --mode auto ran dense" in done.stdout
    done = tierkv("run", "--synthetic-tokens", "200", "--max-new-tokens", "1", "--page-dtype", "int4", "--json")
    assert done.returncode == 0, done.stderr                            # (--json said nothing of it)
    assert json.loads(done.stdout)["notes"] == ["--page-dtype unused: --mode auto ran dense, the prompt and its "
                                                "answer being within the model's trained window; --mode sparse "
                                                "applies them"]


@pytest.mark.model
def test_recorded_access_trace_feeds_tune(tmp_path):
    trace = tmp_path / "access.tkv"
    done = tierkv("run", "--synthetic-tokens", "700", "--max-new-tokens", "3", "--nvme-dir", str(tmp_path / "s"),
                  "--gpu-budget", "2MiB", "--cpu-budget", "4MiB", "--record-access", str(trace), "--json")
    assert done.returncode == 0, done.stderr
    tuned = subprocess.run([sys.executable, "-m", "tierkv.cli", "tune", str(trace), "--policies", "lru,arc",
                            "--json", "--out", str(tmp_path / "best.json")],
                           capture_output=True, text=True, timeout=300)
    assert tuned.returncode == 0, tuned.stderr
    assert json.loads((tmp_path / "best.json").read_text())["format"] == "tierkv-run-config"


@pytest.mark.model
def test_a_dense_run_takes_the_prompt_tier_and_engine_flags(tmp_path, monkeypatch):
    """The passkey, tier and engine flags no other test gives, in one run that must still find the key;
    the JSON has its documented fields and the trace its write-backs and the links probed on this machine."""
    from tierkv.profile import probe
    monkeypatch.setattr(probe, "QUICK", replace(probe.QUICK, copy_bytes=2**20, file_bytes=2**20, min_seconds=0.0))
    probe.probe_links(tmp_path / "s", cache_dir=tmp_path / "cache")
    monkeypatch.setenv("TIERKV_CACHE_DIR", str(tmp_path / "cache"))
    done = tierkv("run", "--synthetic-tokens", "700", "--depth", "0.2", "--seed", "3", "--filler", "text",
                  "--nvme-dir", str(tmp_path / "s"), "--nvme-budget", "256MiB", "--gpu-budget", "2MiB",
                  "--cpu-budget", "4MiB", "--cxl-budget", "8MiB", "--cxl-preset", "cxl2-x16",
                  "--cpu-policy", "arc", "--nvme-policy", "lru", "--draft-tokens", "3",
                  "--mode", "dense", "--max-new-tokens", "12", "--json", "--trace", str(tmp_path / "t.json"))
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout)
    for field in ("text", "prompt_tokens", "generated_tokens", "prefill_s", "ttft_s", "decode_tokens_per_s",
                  "stall_fraction", "reused_prompt_tokens", "tiers", "answers"):
        assert field in result
    assert result["prompt_tokens"] == 700 and result["generated_tokens"] == 12
    nvme = result["tiers"]["nvme"]
    assert nvme["backend"] in ("odirect", "buffered") and nvme["bytes_written"] > 0
    assert set(nvme) >= {"budget_bytes", "peak_bytes", "bytes_read", "answer_bytes_read", "bytes_written", "backend"}
    assert 0 <= nvme["answer_bytes_read"] <= nvme["bytes_read"]
    assert result["tiers"]["cpu"]["policy"] == "arc" and nvme["policy"] == "lru"      # what the flags chose, shown
    assert result["dtype"] == "float32" and result["kv_dtype"] is None
    trace = json.loads((tmp_path / "t.json").read_text())
    assert any(e.get("name") == "writeback" for e in trace["traceEvents"])
    prefills = [e for e in trace["traceEvents"] if e.get("name") == "prefill"]
    assert len(prefills) == 2         # the document, then the prompt's own pass (its last token): a phase's too
    assert min(e["ts"] for e in trace["traceEvents"] if "ts" in e) >= 0       # none before the trace's origin
    assert {"nvme->cpu", "cpu->gpu"} <= set(trace["tierkv"]["links"])          # `tierkv profile`'s limits
    assert result["found"] and result["mode"] == "dense" and result["reused_prompt_tokens"] == 0
    assert set(result["tiers"]) == {"gpu", "cpu", "cxl", "nvme"}
    assert result["tiers"]["cxl"]["backend"].startswith("simulated CXL pool in host memory (")   # not "host memory"
    assert 255 << 20 < result["tiers"]["nvme"]["budget_bytes"] <= 256 << 20     # whole blocks of the cap
    assert result["answers"][0]["drafted_tokens"] > 0


@pytest.mark.model
def test_a_sparse_run_through_the_cli_finds_the_passkey_and_stores_a_sound_index(tmp_path):
    """Sparse mode end to end through the command, with the sparse flags no other test gives (reuse of
    the stored index: tests/model/test_sparse_engine.py, tests/session)."""
    args = ["run", "--mode", "sparse", "--synthetic-tokens", "1100", "--nvme-dir", str(tmp_path / "s"),
            "--gpu-budget", "4MiB", "--cpu-budget", "8MiB", "--checkpoint-every", "0.5", "--prefill-budget", "512",
            "--page-tokens", "32", "--page-dtype", "bfloat16", "--layer-allocation", "adaptive",
            "--positions", "remap", "--dense-prefill-tokens", "512", "--sparse-prefetch", "previous-step",
            "--layer-budgets", "0:64", "--max-new-tokens", "12", "--json"]
    first = tierkv(*args)
    assert first.returncode == 0, first.stderr
    one = json.loads(first.stdout)
    assert one["mode"] == "sparse" and one["found"] and one["reused_prompt_tokens"] == 0
    assert one["sparse"]["page_tokens"] == 32 and one["sparse"]["positions"] == "remap"
    assert one["sparse"]["prefetch"] == "previous-step"
    assert one["sparse"]["layer_tokens"][0] < min(one["sparse"]["layer_tokens"][1:])      # layer 0: its own budget
    assert one["sparse"]["allocation"] == "adaptive" and one["sparse"]["dense_prefill_tokens"] == 512
    assert one["sparse"]["approximate_prefill"] and one["sparse"]["repairs"] == []
    assert list((tmp_path / "s" / "sparse-indexes").glob("*.restore-*")) == []   # a prefill under 4K tokens
    assert tierkv("store", "verify", "--nvme-dir", str(tmp_path / "s")).returncode == 0


def test_ctrl_c_while_the_command_starts_is_an_interruption_not_a_traceback():
    """The command's first seconds go to importing torch; Ctrl-C there used to print a long traceback
    from inside it and end the process by the signal. The signal is sent as torch's import begins."""
    script = ("import os, signal, sys\n"
              "class Interrupt:\n"
              "    def find_spec(self, name, path=None, target=None):\n"
              "        if name == 'torch':\n"
              "            os.kill(os.getpid(), signal.SIGINT)\n"
              "sys.meta_path.insert(0, Interrupt())\n"
              "from tierkv.__main__ import main\n"
              "sys.exit(main(['info']))\n")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 130 and done.stderr.strip().splitlines() == ["tierkv: interrupted"], done.stderr


def test_a_bad_failpoints_variable_is_one_line_even_for_help():
    """It is read as tierkv is imported: every command, --help included, printed a traceback."""
    env = {**os.environ, "TIERKV_FAILPOINTS": "bogus"}
    done = subprocess.run([sys.executable, "-m", "tierkv", "--help"], capture_output=True, text=True, env=env,
                          timeout=120)
    assert done.returncode == 2 and done.stderr.strip().splitlines() == [
        "tierkv: error: TIERKV_FAILPOINTS: unknown point 'bogus'; points: " + ", ".join(POINTS)], done.stderr


def test_an_output_that_is_an_input_is_refused_and_the_input_left_as_it_was(tmp_path, capsys):
    doc, trace = tmp_path / "doc.txt", tmp_path / "run.tkv"
    doc.write_text("A short document.")
    trace.write_bytes(b"TKVTRACE: kept")
    for args, message in (
            (["run", "--doc", str(doc), "--record-access", str(doc)], f"--record-access {doc}: is also the --doc file"),
            (["tune", str(trace), "--out", str(trace)], f"--out {trace}: is also the input file, which this would "
                                                         "overwrite; give another file")):
        assert main(args) == 2 and message in capsys.readouterr().err
    assert doc.read_text() == "A short document." and trace.read_bytes() == b"TKVTRACE: kept"


@pytest.mark.parametrize("command", [["run", "--synthetic-tokens", "100"], ["chat"]])
def test_one_store_s_folder_as_nvme_dir_is_refused_before_the_model_loads(command, tmp_path, capsys):
    """It was taken, and a store nested in it (another, empty) found nothing stored."""
    store = tmp_path / "kv-L30-H3-D64-T256-B1-float32"
    store.mkdir()
    (store / "store.json").write_text("{}")
    assert main([*command, "--nvme-dir", str(store)]) == 2
    err = capsys.readouterr().err
    assert f"is the folder of one store (it holds a store.json); give the directory above it ({tmp_path})" in err
    assert [p.name for p in store.iterdir()] == ["store.json"]


@pytest.mark.model
def test_a_run_of_one_token_a_question_says_it_made_no_decode_step():
    """It said "decode 1 tokens at 0.00 tok/s"."""
    done = tierkv("run", "--synthetic-tokens", "200", "--max-new-tokens", "1")
    assert done.returncode == 0, done.stderr
    assert "decode: no step (1 token(s), each from its prompt's pass)" in done.stdout and "0.00 tok/s" not in done.stdout
