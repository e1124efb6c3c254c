"""`funduq-trio provider` as a user meets it: a bad URL is one line, not a
traceback; "serving" is said once attached; a reconnect is said."""

from __future__ import annotations

import signal
import subprocess
import sys

import pytest
import trio
from support import running_server
from test_cli import cli_env


@pytest.mark.parametrize(
    ("url", "said"),
    [
        (
            "http://127.0.0.1:8000/ws/provider",
            "--url http://127.0.0.1:8000/ws/provider: the provider link is a WebSocket URL "
            "(try ws://127.0.0.1:8000/ws/provider)",
        ),
        ("127.0.0.1:8000", "--url 127.0.0.1:8000: expected ws://HOST:PORT/ws/provider"),
        (
            "ws://127.0.0.1:99999/ws/provider",
            "--url ws://127.0.0.1:99999/ws/provider: Port out of range",
        ),
    ],
)
async def test_a_wrong_url_is_one_line(tmp_path, url, said):
    with trio.fail_after(60):  # a safety net: a provider that does start would hang here
        done = await trio.run_process(
            [
                sys.executable,
                "-m",
                "funduq_trio",
                "provider",
                "--url",
                url,
                "--key-file",
                str(tmp_path / "p.key"),
            ],
            capture_stdout=True,
            capture_stderr=True,
            check=False,
            env=cli_env(),
        )
    assert done.returncode == 2
    assert done.stderr.decode().startswith(f"funduq-trio provider: error: {said}")
    assert done.stderr.decode().count("\n") == 1


async def wait_for(stream, output: bytes, marker: bytes, times: int = 1) -> bytes:
    with trio.fail_after(30):  # a safety net, not a behaviour clock
        while output.count(marker) < times:
            chunk = await stream.receive_some()
            assert chunk, output.decode()
            output += chunk
    return output


async def test_serving_is_said_once_attached_and_again_after_a_reconnect(tmp_path):
    async with running_server(tmp_path / "one") as info:
        port, url = info.port, info.provider_url
        process = await trio.lowlevel.open_process(
            [
                sys.executable,
                "-m",
                "funduq_trio",
                "provider",
                "--url",
                url,
                "--key-file",
                str(tmp_path / "p.key"),
            ],
            stderr=subprocess.PIPE,
            env=cli_env(),
        )
        try:
            output = await wait_for(process.stderr, b"", b"attached to ")
            text = output.decode()
            assert f"connecting to {url}" in text
            assert f"attached to {url} serving echo" in text
            assert text.index("connecting to") < text.index("attached to")
            assert "serving echo at" not in text  # never said before it is true
        except BaseException:
            process.kill()
            raise
    try:
        # The server went away: the provider says it lost the link, then,
        # with a server back on the same port, that it attached again.
        output = await wait_for(process.stderr, output, b"reconnecting in")
        async with running_server(tmp_path / "two", port=port):
            output = await wait_for(
                process.stderr, output, f"attached to {url} serving echo".encode(), times=2
            )
        assert "Traceback" not in output.decode()
        process.send_signal(signal.SIGINT)
        with trio.fail_after(30):
            assert await process.wait() == 0
    finally:
        if process.returncode is None:
            process.kill()
            await process.wait()
