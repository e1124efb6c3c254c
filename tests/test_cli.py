"""The command line: `serve` settings and signals, and `call` against a real server."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
import trio
from support import http_client, raw_provider, running_server

from funduq_trio.cli import build_parser, settings_from_args


def settings_for(argv: list[str], env: dict[str, str]):
    return settings_from_args(build_parser().parse_args(["serve", *argv]), env)


def test_flags_override_the_environment():
    env = {"FUNDUQ_PORT": "9001", "FUNDUQ_THREAD_QUEUE_LIMIT": "3", "FUNDUQ_DATA_DIR": "/tmp/x"}
    settings = settings_for(["--port", "9002", "--provider-keys", f"{'a' * 64},{'B' * 64}"], env)
    assert settings.port == 9002  # flag wins
    assert settings.thread_queue_limit == 3  # env where no flag
    assert settings.data_dir == Path("/tmp/x")
    assert settings.provider_keys == frozenset({"a" * 64, "b" * 64})
    assert settings_for([], {}).port == 8000  # the design's default


@pytest.mark.parametrize(
    ("argv", "env", "names"),
    [
        (["--port", "eighty"], {}, "--port"),
        ([], {"FUNDUQ_PORT": "99999"}, "FUNDUQ_PORT"),
        # Named as given: the flag when a flag was used.
        (["--thread-queue-limit", "0"], {}, "--thread-queue-limit 0"),
        (["--lane-inbox-reports", "0"], {}, "--lane-inbox-reports 0"),
        (["--provider-keys", "abc"], {}, "--provider-keys"),
        (["--database-url", "mysql://x"], {}, "--database-url mysql://x"),
        (
            ["--database-url", "postgresql://u:pw@x/db?bogus=1"],
            {},
            r"--database-url postgresql://u:\*\*\*@x/db\?bogus=1: not a PostgreSQL URL",
        ),
        ([], {"FUNDUQ_DELIVER_TIMEOUT_SECONDS": "soon"}, "FUNDUQ_DELIVER_TIMEOUT_SECONDS"),
    ],
)
def test_bad_settings_are_refused_naming_the_setting(argv, env, names):
    with pytest.raises(ValueError, match=names):
        settings_for(argv, env)


def cli_env() -> dict[str, str]:
    root = str(Path(__file__).resolve().parent.parent)
    path = os.environ.get("PYTHONPATH")
    return {**os.environ, "PYTHONPATH": root + (os.pathsep + path if path else "")}


async def test_serve_exits_cleanly_on_sigint(tmp_path):
    process = await trio.lowlevel.open_process(
        [sys.executable, "-m", "funduq_trio", "serve", "--port", "0", "--data-dir", str(tmp_path)],
        stderr=subprocess.PIPE,
        env=cli_env(),
    )
    try:
        output = b""
        while b"serving on " not in output or not output.endswith(b"\n"):
            chunk = await process.stderr.receive_some()
            assert chunk, output.decode()
            output += chunk
        url = output.decode().split("serving on ", 1)[1].split()[0]
        async with httpx.AsyncClient(timeout=30) as http:
            assert (await http.get(f"{url}/healthz")).status_code == 200
        process.send_signal(signal.SIGINT)
        with trio.fail_after(30):  # a safety net, not a behaviour clock
            assert await process.wait() == 0
    finally:
        if process.returncode is None:
            process.kill()
            await process.wait()
    assert (tmp_path / "funduq.sqlite3").exists()


@pytest.mark.parametrize("by_name", [False, True])
async def test_call_sends_one_message_and_prints_the_reply(tmp_path, by_name):
    async with (
        running_server(tmp_path) as info,
        http_client(info) as http,
        raw_provider(info, ["echo"]) as provider,
    ):
        async with trio.open_nursery() as nursery:
            result = {}

            if by_name:  # the server's URL and the agent's name
                where = ["--url", info.url, "--agent", "echo"]
            else:  # the agent's A2A URL
                where = ["--url", info.a2a_url(provider.fingerprint, "echo")]

            async def call():
                result["done"] = await trio.run_process(
                    [sys.executable, "-m", "funduq_trio", "call", *where, "hello there"],
                    capture_stdout=True,
                    capture_stderr=True,
                    check=False,
                    env=cli_env(),
                )

            nursery.start_soon(call)
            run = await provider.next_offer()
            said = run["runInput"]["messages"][-1]["content"]
            await provider.answer(run, "accepted")
            ids = {"threadId": run["threadId"], "runId": run["runId"]}
            await provider.play(
                run,
                [
                    {"type": "RUN_STARTED", **ids},
                    {"type": "TEXT_MESSAGE_START", "messageId": "m-1", "role": "assistant"},
                    {"type": "TEXT_MESSAGE_CONTENT", "messageId": "m-1", "delta": "you said: "},
                    {"type": "TEXT_MESSAGE_CONTENT", "messageId": "m-1", "delta": said},
                    {"type": "TEXT_MESSAGE_END", "messageId": "m-1"},
                    {"type": "RUN_FINISHED", **ids},
                ],
            )
        done = result["done"]
        assert done.returncode == 0, done.stderr.decode()
        assert done.stdout.decode() == "you said: hello there\n"
        assert (await http.get(f"/runs/{run['runId']}")).json()["status"] == "completed"


async def test_call_by_name_says_when_no_agent_is_online(tmp_path):
    async with running_server(tmp_path) as info:
        done = await trio.run_process(
            [
                sys.executable,
                "-m",
                "funduq_trio",
                "call",
                "--url",
                info.url,
                "--agent",
                "echo",
                "hi",
            ],
            capture_stdout=True,
            capture_stderr=True,
            check=False,
            env=cli_env(),
        )
    assert done.returncode == 1
    assert "no online agent named 'echo'" in done.stderr.decode()


async def read_until(stream, output: bytes, marker: bytes) -> bytes:
    while marker not in output:
        chunk = await stream.receive_some()
        assert chunk, output.decode()
        output += chunk
    return output


async def test_call_streams_shows_ids_continues_a_thread_and_prints_json(tmp_path):
    async with (
        running_server(tmp_path) as info,
        http_client(info) as http,
        raw_provider(info, ["echo"]) as provider,
    ):
        process = await trio.lowlevel.open_process(
            [
                sys.executable,
                "-m",
                "funduq_trio",
                "call",
                "-v",
                "--url",
                info.url,
                "--agent",
                "echo",
                "hello",
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env=cli_env(),
        )
        try:
            with trio.fail_after(60):  # a safety net: a call that exits at once sends nothing
                run = await provider.next_offer()
            await provider.answer(run, "accepted")
            ids = {"threadId": run["threadId"], "runId": run["runId"]}
            for event in [
                {"type": "RUN_STARTED", **ids},
                {"type": "TEXT_MESSAGE_START", "messageId": "m-1", "role": "assistant"},
                {"type": "TEXT_MESSAGE_CONTENT", "messageId": "m-1", "delta": "first part, "},
            ]:
                await provider.report(run["runId"], event)
            with trio.fail_after(30):  # a safety net, not a behaviour clock
                # The first part is printed while the run is still going.
                out = await read_until(process.stdout, b"", b"first part, ")
                err = await read_until(process.stderr, b"", b"thread: ")
                err = await read_until(
                    process.stderr, err, b"\n" + b"thread: " + run["threadId"].encode() + b"\n"
                )
            assert err.decode() == f"run: {run['runId']}\nthread: {run['threadId']}\n"
            assert out == b"first part, "
            await provider.play(
                run,
                [
                    {"type": "TEXT_MESSAGE_CONTENT", "messageId": "m-1", "delta": "then the rest"},
                    {"type": "TEXT_MESSAGE_END", "messageId": "m-1"},
                    {"type": "RUN_FINISHED", **ids},
                ],
            )
            with trio.fail_after(30):
                assert await process.wait() == 0
            rest = b""
            while chunk := await process.stdout.receive_some():
                rest += chunk
            assert out + rest == b"first part, then the rest\n"
        finally:
            if process.returncode is None:
                process.kill()
                await process.wait()

        # The thread's id from -v continues it; --json says everything.
        async with trio.open_nursery() as nursery:
            result = {}

            async def again():
                result["done"] = await trio.run_process(
                    [
                        sys.executable,
                        "-m",
                        "funduq_trio",
                        "call",
                        "--json",
                        "--thread",
                        run["threadId"],
                        "--url",
                        info.a2a_url(provider.fingerprint, "echo"),
                        "again",
                    ],
                    capture_stdout=True,
                    capture_stderr=True,
                    check=False,
                    env=cli_env(),
                )

            nursery.start_soon(again)
            with trio.fail_after(60):  # a safety net, as above
                second = await provider.next_offer()
            assert second["threadId"] == run["threadId"]
            await provider.answer(second, "accepted")
            ids = {"threadId": second["threadId"], "runId": second["runId"]}
            await provider.play(
                second,
                [
                    {"type": "RUN_STARTED", **ids},
                    {"type": "TEXT_MESSAGE_START", "messageId": "m-2", "role": "assistant"},
                    {"type": "TEXT_MESSAGE_CONTENT", "messageId": "m-2", "delta": "once more"},
                    {"type": "TEXT_MESSAGE_END", "messageId": "m-2"},
                    {"type": "RUN_FINISHED", **ids},
                ],
            )
        done = result["done"]
        assert done.returncode == 0, done.stderr.decode()
        printed = json.loads(done.stdout)
        assert printed["runId"] == second["runId"] and printed["threadId"] == run["threadId"]
        assert printed["state"] == "TASK_STATE_COMPLETED" and printed["reply"] == "once more"
        assert printed["responses"]  # every response a2a-sdk handed over, as JSON
        record = (await http.get(f"/runs/{printed['runId']}")).json()
        assert record["status"] == "completed" and record["threadId"] == run["threadId"]


async def test_call_shows_funduqs_own_error_for_an_unknown_agent(tmp_path):
    async with running_server(tmp_path) as info, raw_provider(info, ["echo"]) as provider:
        done = await trio.run_process(
            [
                sys.executable,
                "-m",
                "funduq_trio",
                "call",
                "--url",
                info.a2a_url(provider.fingerprint, "nobody"),
                "hi",
            ],
            capture_stdout=True,
            capture_stderr=True,
            check=False,
            env=cli_env(),
        )
    stderr = done.stderr.decode()
    assert done.returncode == 1
    assert stderr.count("\n") == 1, stderr
    assert stderr.startswith("funduq-trio call: error: ") and "(404 " in stderr
    assert "nobody" in stderr and "https://" not in stderr  # funduq's words, no a2a-sdk link


def test_serve_says_in_one_line_when_its_postgresql_does_not_answer(tmp_path):
    """A database that does not answer at start: exit 2 with one line naming
    the database (never its password), no traceback."""
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "funduq_trio",
            "serve",
            "--port",
            "0",
            "--data-dir",
            str(tmp_path),
            "--database-url",
            "postgresql://funduq:hunter2@127.0.0.1:1/records",
        ],
        capture_output=True,
        text=True,
        env=cli_env(),
        timeout=60,
    )
    assert result.returncode == 2, result.stderr
    assert (
        "serve: error: PostgreSQL database records on 127.0.0.1:1 does not answer" in result.stderr
    )
    assert "Traceback" not in result.stderr and "hunter2" not in result.stderr
