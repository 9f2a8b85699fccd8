"""``tierkv chat``: a real process reading questions from its terminal input."""
import subprocess
import sys

import pytest

pytestmark = pytest.mark.model


def test_chat_answers_each_turn_from_the_last_and_reports_its_reuse(tmp_path):
    doc = tmp_path / "doc.txt"
    doc.write_text("Alice met Bob in Paris in 1999. They founded a bakery called Blue Oven on Rue Cler.\n" * 20)
    turns = "Who founded the bakery?\n/stats\nWhere is it?\n/stats\n/reset\n/help\n/quit\n"
    done = subprocess.run([sys.executable, "-m", "tierkv.cli", "chat", "--doc", str(doc), "--max-new-tokens", "6",
                           "--nvme-dir", str(tmp_path / "store"), "--gpu-budget", "8MiB", "--cpu-budget", "16MiB",
                           "--block-tokens", "16", "--chunk-tokens", "256"],
                          input=turns, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    stats = [line for line in done.stdout.splitlines() if "reused" in line and "first token after" in line]
    assert len(stats) == 2
    first, second = (int(line.split(" tokens, ")[1].split(" reused")[0]) for line in stats)
    prompts = [int(line.split("prompt ")[1].split(" tokens")[0]) for line in stats]
    assert second > first and prompts[1] - second < 40        # the second turn went on from the first
    assert "(a new conversation)" in done.stdout and "commands:" in done.stdout
    assert "tokens (0 found stored)" in done.stderr
