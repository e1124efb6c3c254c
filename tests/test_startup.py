"""`funduq-trio serve` as an operator meets it: each way it cannot start is
one line naming the setting as it was given, status 2, nothing left behind;
the start banner; the log formats; the provider attach/leave lines."""

from __future__ import annotations

import json
import logging
import signal
import socket
import subprocess
import sys
from functools import partial
from pathlib import Path

import httpx
import pytest
import trio
from support import raw_provider, running_server
from test_cli import cli_env
from trio_websocket import open_websocket_url

from funduq_trio import __version__
from funduq_trio.identity import Identity


async def serve_cli(argv: list[str], cwd: Path, env: dict[str, str] | None = None):
    return await trio.run_process(
        [sys.executable, "-m", "funduq_trio", "serve", *argv],
        capture_stdout=True,
        capture_stderr=True,
        check=False,
        cwd=cwd,
        env={**cli_env(), **(env or {})},
    )


@pytest.mark.parametrize(
    ("argv", "env", "line"),
    [
        (["--port", "70000"], {}, "--port 70000: a port is 0..65535"),
        ([], {"FUNDUQ_PORT": "70000"}, "FUNDUQ_PORT=70000: a port is 0..65535"),
        (
            ["--deliver-timeout-seconds", "nan"],
            {},
            "--deliver-timeout-seconds nan: must be a finite number",
        ),
        (
            [],
            {"FUNDUQ_UNSERVED_GRACE_SECONDS": "inf"},
            "FUNDUQ_UNSERVED_GRACE_SECONDS=inf: must be a finite number",
        ),
        (["--identity-key", "zz"], {}, "--identity-key <2 characters>: must be 64 hex characters"),
        (
            ["--database-url", "sqlite:///:memory:"],
            {},
            "--database-url sqlite:///:memory:: the record must be a file",
        ),
        (["--thread-queue-limit", "0"], {}, "--thread-queue-limit 0: must be at least 1"),
        (["--log-format", "xml"], {}, "--log-format xml: text or json"),
        (["--data-dir", "a-file"], {}, "--data-dir a-file: a-file exists and is not a directory"),
        (
            [],
            {"FUNDUQ_DATA_DIR": "a-file/below"},
            "FUNDUQ_DATA_DIR=a-file/below: cannot create or write in a-file/below",
        ),
        # The cluster's settings (docs/cluster.md), each bad value alone.
        (
            [],
            {"FUNDUQ_NODE_NAME": "node a"},
            "FUNDUQ_NODE_NAME='node a': 1 to 64 letters, digits, '-', '_' or '.'",
        ),
        (["--node-name", "n" * 65], {}, f"--node-name {'n' * 65!r}: 1 to 64 letters"),
        ([], {"FUNDUQ_LEASE_SECONDS": "soon"}, "FUNDUQ_LEASE_SECONDS=soon: must be a number"),
        ([], {"FUNDUQ_LEASE_SECONDS": "0"}, "FUNDUQ_LEASE_SECONDS=0.0: must be at least 1"),
        ([], {"FUNDUQ_LEASE_SECONDS": "0.01"}, "FUNDUQ_LEASE_SECONDS=0.01: must be at least 1"),
        ([], {"FUNDUQ_LEASE_SECONDS": "-3"}, "FUNDUQ_LEASE_SECONDS=-3.0: must not be negative"),
        ([], {"FUNDUQ_LEASE_SECONDS": "nan"}, "FUNDUQ_LEASE_SECONDS=nan: must be a finite number"),
        (
            [],
            {"FUNDUQ_NODE_URL": "node-b:8000"},
            "FUNDUQ_NODE_URL='node-b:8000': an absolute http(s) URL",
        ),
        (
            [],
            {"FUNDUQ_NODE_URL": "http://node-b:80000"},
            "FUNDUQ_NODE_URL='http://node-b:80000': an absolute http(s) URL",
        ),
        (
            ["--node-url", "http://node-b:8000/?x=1"],
            {},
            "--node-url 'http://node-b:8000/?x=1': an absolute http(s) URL",
        ),
        # Root may write anywhere a disk allows: /proc allows nothing new.
        (
            ["--data-dir", "/proc/funduq-data"],
            {},
            "--data-dir /proc/funduq-data: cannot create or write in /proc/funduq-data",
        ),
    ],
)
async def test_each_start_up_error_is_one_line_and_leaves_nothing(tmp_path, argv, env, line):
    (tmp_path / "a-file").write_text("not a directory")
    # Any free port, unless the case is about the port.
    port = [] if "--port" in argv or "FUNDUQ_PORT" in env else ["--port", "0"]
    with trio.fail_after(60):  # a safety net: a server that starts would hang here
        done = await serve_cli([*port, *argv], tmp_path, env)
    stderr = done.stderr.decode()
    assert done.returncode == 2
    assert stderr.count("\n") == 1, stderr
    assert stderr.startswith(f"funduq-trio serve: error: {line}"), stderr
    setting = line.split("=")[0].split(" ")[0]
    assert stderr.count(setting) == 1, stderr  # said once, not once per check it fails
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a-file"]  # nothing created


async def test_a_port_in_use_is_one_line_with_the_address(tmp_path):
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    port = taken.getsockname()[1]
    try:
        done = await serve_cli(["--port", str(port), "--data-dir", "data"], tmp_path)
    finally:
        taken.close()
    stderr = done.stderr.decode()
    assert done.returncode == 2
    assert stderr == (
        f"funduq-trio serve: error: --port {port}: cannot listen on "
        f"127.0.0.1:{port}: Address already in use\n"
    )
    assert list(tmp_path.iterdir()) == []  # no data dir, no key


async def test_a_corrupt_key_file_is_one_line(tmp_path):
    (tmp_path / "funduq.key").write_text("junk")
    done = await serve_cli(["--port", "0", "--data-dir", str(tmp_path)], tmp_path)
    stderr = done.stderr.decode()
    assert done.returncode == 2
    assert stderr.count("\n") == 1 and "funduq.key is corrupt" in stderr, stderr


async def read_until(stream, output: bytes, marker: bytes) -> bytes:
    while marker not in output or not output.endswith(b"\n"):
        chunk = await stream.receive_some()
        assert chunk, output.decode()
        output += chunk
    return output


async def test_banner_json_logs_and_access_log(tmp_path):
    """JSON lines, each from funduq's own loggers; the banner names the
    version, the absolute record file, funduq's key, what was set, and the
    operator page; the access log, asked for, logs each request."""
    record = tmp_path / "elsewhere" / "record.sqlite3"
    process = await trio.lowlevel.open_process(
        [
            sys.executable,
            "-m",
            "funduq_trio",
            "serve",
            "--port",
            "0",
            "--data-dir",
            "data",
            "--database-url",
            f"sqlite:///{record}",
            "--log-format",
            "json",
            "--access-log",
            "true",
            "--thread-queue-limit",
            "3",
            "--operator-token",
            "operator-token-0123456789",
        ],
        stderr=subprocess.PIPE,
        cwd=tmp_path,
        env=cli_env(),
    )
    try:
        output = await read_until(process.stderr, b"", b"operator page")
        lines = [json.loads(line) for line in output.decode().splitlines()]
        assert {line["logger"] for line in lines} == {"funduq_trio.server"}
        assert {line["level"] for line in lines} == {"info"}
        said = [line["message"] for line in lines]
        url = next(m for m in said if "serving on" in m).split("serving on ")[1]
        assert f"funduq-trio {__version__} serving on {url}" in said
        assert f"record: {record}" in said  # sqlite://// + absolute path, as opened
        key = Identity.load_or_create(tmp_path / "data" / "funduq.key").public_key_hex
        assert any(m.startswith(f"funduq key: {key}") for m in said)
        settings = next(m for m in said if m.startswith("settings: "))
        assert "FUNDUQ_THREAD_QUEUE_LIMIT=3" in settings
        assert "FUNDUQ_OPERATOR_TOKEN=(set)" in settings  # never the secret itself
        assert "operator-token-0123456789" not in settings
        assert f"operator page: {url}/?token=operator-token-0123456789" in said
        async with httpx.AsyncClient(timeout=30) as http:
            assert (await http.get(f"{url}/healthz")).status_code == 200
        output = await read_until(process.stderr, output, b"/healthz")
        access = json.loads(output.decode().splitlines()[-1])
        assert access["logger"] == "funduq_trio.access"
        assert '"GET /healthz 1.1"' in access["message"]
        process.send_signal(signal.SIGINT)
        with trio.fail_after(30):  # a safety net, not a behaviour clock
            assert await process.wait() == 0
    finally:
        if process.returncode is None:
            process.kill()
            await process.wait()
    assert record.exists()


async def test_text_logs_carry_the_level_and_the_logger(tmp_path):
    process = await trio.lowlevel.open_process(
        [sys.executable, "-m", "funduq_trio", "serve", "--port", "0", "--data-dir", "data"],
        stderr=subprocess.PIPE,
        cwd=tmp_path,
        env=cli_env(),
    )
    try:
        output = await read_until(process.stderr, b"", b"operator page")
        for line in output.decode().splitlines():
            assert " INFO funduq_trio.server: " in line, line
        assert "settings: FUNDUQ_PORT=0, FUNDUQ_DATA_DIR=data" in output.decode()
    finally:
        process.kill()
        await process.wait()


async def test_provider_attach_leave_and_refusal_are_logged(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="funduq_trio")
    async with running_server(tmp_path) as info:
        async with raw_provider(info, ["echo"]) as provider:
            fingerprint = provider.fingerprint
            key = provider.key
        # A refused link: a connect whose proof does not verify.
        stranger = Identity.generate()
        async with open_websocket_url(info.provider_url) as ws:
            await ws.get_message()  # hello
            await ws.send_message(
                json.dumps(
                    {
                        "kind": "connect",
                        "publicKey": stranger.public_key_hex,
                        "nonce": "n" * 32,
                        "proof": "00" * 64,
                        "maxConcurrentRuns": None,
                    }
                )
            )
            assert json.loads(await ws.get_message())["kind"] == "connect.err"
        with trio.fail_after(30):  # safety net: the server logs once it sees the close
            while not any("refused" in r.getMessage() for r in caplog.records):
                await trio.sleep(0.01)
    said = [r.getMessage() for r in caplog.records if r.name.startswith("funduq_trio")]
    assert any(m.startswith(f"provider {fingerprint} attached (key {key}") for m in said), said
    assert f"provider {fingerprint} left: the provider closed the connection" in said
    refused = [m for m in said if m.startswith("refused a provider link")]
    assert (
        refused and stranger.public_key_hex in refused[0] and "proof does not verify" in refused[0]
    )
    assert not any("None" in m for m in said if "provider link" in m)


def test_log_level_and_format_govern_every_funduq_logger():
    import io

    from funduq_trio.logs import configure_logging

    root = logging.getLogger()
    saved = root.handlers[:], root.level
    stream = io.StringIO()
    try:
        configure_logging("warning", "json", stream)
        logging.getLogger("funduq_trio.server").info("quiet at warning")
        logging.getLogger("funduq.providers").warning("withdrawing provider x: y")
    finally:
        root.handlers, root.level = saved
    [line] = stream.getvalue().splitlines()
    said = json.loads(line)
    assert said["level"] == "warning" and said["logger"] == "funduq.providers"
    assert said["message"] == "withdrawing provider x: y"


async def test_run_lifecycle_lines_at_debug(tmp_path, caplog):
    caplog.set_level(logging.DEBUG, logger="funduq")
    async with running_server(tmp_path) as info, raw_provider(info, ["echo"]) as provider:
        async with httpx.AsyncClient(base_url=info.url, timeout=30) as http:
            body = {
                "threadId": "t",
                "runId": "r",
                "messages": [{"id": "m", "role": "user", "content": "hi"}],
            }
            async with trio.open_nursery() as nursery:
                nursery.start_soon(
                    partial(http.post, f"/agui/{provider.fingerprint}/echo", json=body)
                )
                with trio.fail_after(30):  # a safety net
                    run = await provider.next_offer()
                await provider.answer(run, "refused", "not today")
    said = [r.getMessage() for r in caplog.records if r.levelno == logging.DEBUG]
    assert (
        f"run {run['runId']} queued on thread {run['threadId']} for {provider.fingerprint}/echo"
        in said
    )
    assert f"run {run['runId']} ended failed (not today)" in said


def test_the_open_files_limit_is_raised_for_max_connections_or_a_warning_says_why_not():
    import resource

    from funduq_trio.config import Settings
    from funduq_trio.server import FILES_BESIDE_CONNECTIONS, open_files_for

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    try:
        fits = 64
        assert open_files_for(Settings(max_connections=fits)) is None
        assert resource.getrlimit(resource.RLIMIT_NOFILE)[0] >= fits + FILES_BESIDE_CONNECTIONS
        if hard != resource.RLIM_INFINITY:
            warning = open_files_for(Settings(max_connections=hard))  # + the files beside
            assert warning is not None
            assert f"FUNDUQ_MAX_CONNECTIONS={hard}" in warning
            assert f"about {hard - FILES_BESIDE_CONNECTIONS} connections fit" in warning
            assert resource.getrlimit(resource.RLIMIT_NOFILE)[0] == hard  # raised as far as it goes
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
