"""``tierkv serve`` listens before the model stack is imported (tierkv.serve.listen)."""
import socket
import subprocess
import sys

import pytest

from tierkv.errors import ConfigError
from tierkv.serve import listen
from servers import free_port


@pytest.fixture(autouse=True)
def _none_left():
    yield
    for left in listen._early.values():
        left.close()
    listen._early.clear()


def test_the_command_listens_before_it_imports_torch() -> None:
    port = free_port()
    script = ("import socket, sys; from tierkv.serve.listen import early; "
              f"early(['--nvme-dir', 'kv', '--port', '{port}', '--api-key', 'k']); "
              f"socket.create_connection(('127.0.0.1', {port}), timeout=5).close(); "
              "print('torch' in sys.modules)")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "False"


def test_the_server_takes_the_socket_listening_early() -> None:
    port = free_port()
    listen.early(["--port", str(port)])
    early = listen._early[("127.0.0.1", port)]
    with listen.take("127.0.0.1", port) as taken:
        assert taken is early and taken.getsockname() == ("127.0.0.1", port)


def test_a_socket_listening_early_for_another_address_is_closed_before_the_server_listens() -> None:
    port = free_port()
    listen.early([f"--port={port}"])
    early = listen._early[("127.0.0.1", port)]
    with listen.take("localhost", port) as taken:      # the same address, named otherwise: it must be free
        assert taken is not early and early.fileno() == -1
        socket.create_connection(("127.0.0.1", port), timeout=5).close()


@pytest.mark.parametrize("args", [["--help"], ["--port", "x"], ["--port", "0"], ["--host", "no.such.host."],
                                  ["--po", "9123"], ["--ho=0.0.0.0"]])     # (abbreviations: the server's parser reads them)
def test_what_the_server_reports_itself_is_not_taken_early(args: list[str]) -> None:
    listen.early([*args, "--port", str(free_port())] if args[0] == "--help" else args)
    assert not listen._early


def test_a_busy_port_is_left_to_the_server_which_names_it() -> None:
    with socket.socket() as other:
        other.bind(("127.0.0.1", 0))
        other.listen()
        port = other.getsockname()[1]
        listen.early(["--port", str(port)])
        assert not listen._early
        with pytest.raises(ConfigError, match=f"--port {port}: cannot listen .*another process listens there"):
            listen.take("127.0.0.1", port)
