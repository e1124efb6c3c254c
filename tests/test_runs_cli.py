"""`funduq-trio runs` and `funduq-trio show`: finding runs through the real
server's read routes, as the operator (its token from the data directory) and
as a caller who names a thread (DESIGN §8 scoping)."""

from __future__ import annotations

import json
import sys

import trio
from support import http_client, post_sse, running_server, sdk_provider, user_input
from test_cli import cli_env


async def cli(*argv: str, env: dict[str, str] | None = None) -> trio.CompletedProcess:
    return await trio.run_process(
        [sys.executable, "-m", "funduq_trio", *argv],
        capture_stdout=True,
        capture_stderr=True,
        check=False,
        env=env or cli_env(),
    )


async def test_runs_lists_as_the_operator_and_show_prints_a_run(tmp_path):
    async with (
        running_server(tmp_path) as info,
        http_client(info) as http,
        sdk_provider(info) as provider,
    ):
        url = info.agui_url(provider.identity.fingerprint, "echo")
        first, _ = await post_sse(http, url, user_input("one", thread_id="t1"))
        second, _ = await post_sse(http, url, user_input("two", thread_id="t2"))
        assert first.status_code == second.status_code == 200
        run_ids = [
            r["runId"]
            for r in (
                await http.get(
                    "/runs", headers={"Authorization": f"Bearer {info.funduq.operator_token}"}
                )
            ).json()["runs"]
        ]
        assert len(run_ids) == 2

        # The operator: the token read from the data directory's operator.token.
        done = await cli("runs", "--url", info.url, "--data-dir", str(tmp_path), "--json")
        assert done.returncode == 0, done.stderr.decode()
        assert [r["runId"] for r in json.loads(done.stdout)["runs"]] == run_ids
        done = await cli("runs", "--url", info.url, "--data-dir", str(tmp_path), "--limit", "1")
        lines = done.stdout.decode().splitlines()
        assert len(lines) == 1 and lines[0].startswith(run_ids[0])
        assert "completed" in lines[0]
        assert f"more: --cursor {run_ids[0]}" in done.stderr.decode()

        # A stranger with no token sees nothing unless it names a thread it holds.
        stranger = await cli("runs", "--url", info.url, "--data-dir", str(tmp_path / "none"))
        assert stranger.returncode == 0 and stranger.stdout == b""
        thread = (await http.get(f"/runs/{run_ids[1]}")).json()["threadId"]
        named = await cli(
            "runs",
            "--url",
            info.url,
            "--data-dir",
            str(tmp_path / "none"),
            "--thread",
            thread,
            "--json",
        )
        assert [r["runId"] for r in json.loads(named.stdout)["runs"]] == [run_ids[1]]

        shown = await cli("show", run_ids[1], "--url", info.url, "--data-dir", str(tmp_path))
        text = shown.stdout.decode()
        assert shown.returncode == 0, shown.stderr.decode()
        assert f"run     {run_ids[1]}" in text and "status  completed" in text
        assert "RUN_STARTED" in text and "RUN_FINISHED" in text
        missing = await cli("show", "run_nosuch", "--url", info.url)
        assert missing.returncode == 1
        assert "404 run_not_found" in missing.stderr.decode()
