"""``tierkv chat``: a real process reading questions from its terminal input."""
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.model


def test_chat_answers_each_turn_from_the_last_and_reports_its_reuse(tmp_path):
    doc = tmp_path / "doc.txt"
    doc.write_text("Alice met Bob in Paris in 1999. They founded a bakery called Blue Oven on Rue Cler.\n" * 20)
    turns = "Who founded the bakery?\n/stats\nWhere is it?\n/stats \n/reset \n/stats\n/help\n/bogus\n/quit \n"
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
    assert "nothing asked yet" in done.stdout and "unknown command /bogus; commands:" in done.stdout
    assert done.stdout.count("unknown command") == 1          # a command with a space after it is the command
    assert "tokens (0 found stored)" in done.stderr


def test_ctrl_c_stops_an_answer_and_the_conversation_goes_on(tmp_path):
    import os
    import signal
    import time
    chat = subprocess.Popen([sys.executable, "-m", "tierkv.cli", "chat", "--max-new-tokens", "400",
                             "--gpu-budget", "8MiB", "--cpu-budget", "16MiB"],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=os.environ | {"PYTHONUNBUFFERED": "1"})
    try:
        chat.stdin.write("Write a very long story about a bakery in Paris.\n")
        chat.stdin.flush()
        seen = ""
        while len(seen) < 40:                          # the prompt "> ", then the answer streaming
            seen += chat.stdout.read(1)
        chat.send_signal(signal.SIGINT)
        time.sleep(1)
        out, err = chat.communicate("/stats\n/quit\n", timeout=300)
    finally:
        chat.kill()
    assert chat.returncode == 0, err
    assert " (stopped)" in out and "prompt " in out and "interrupted" not in err    # /stats answered after it


@pytest.mark.parametrize("encoding", ["utf-8", "utf-8:surrogateescape"])   # a UTF-8 locale's input, a C locale's
def test_a_question_that_is_not_utf8_is_asked_again_not_a_traceback(tmp_path, encoding):
    doc = tmp_path / "doc.txt"
    doc.write_text("The pass statement does nothing.\n")
    done = subprocess.run([sys.executable, "-m", "tierkv.cli", "chat", "--doc", str(doc), "--max-new-tokens", "2"],
                          input=b"What is \xff\xfe pass?\nWhat is pass?\n", capture_output=True, timeout=600,
                          env={**os.environ, "PYTHONIOENCODING": encoding})
    assert done.returncode == 0, done.stderr.decode()[-2000:]
    assert b"(the question: not UTF-8 text (byte 0xff" in done.stdout and b"; ask again)" in done.stdout
    after = done.stdout.split(b"ask again)\n", 1)[1]
    assert after.startswith(b"> ") and after.count(b"> ") == 2 and len(after.split(b"\n")[0]) > 2   # answered
