"""`funduq-trio quality list | reset` on the record file, server stopped."""

from __future__ import annotations

import json
import sqlite3
import sys

import trio
from support import raw_provider, running_server
from test_cli import cli_env


async def quality(*argv: str, cwd=None):
    return await trio.run_process(
        [sys.executable, "-m", "funduq_trio", "quality", *argv],
        capture_stdout=True,
        capture_stderr=True,
        check=False,
        env=cli_env(),
        cwd=cwd,
    )


async def test_list_and_reset_a_providers_counters(tmp_path):
    async with running_server(tmp_path) as info, raw_provider(info, ["echo"]) as provider:
        key, fingerprint = provider.key, provider.fingerprint
    # Strikes recorded while it served (what the broker's count() writes).
    with sqlite3.connect(tmp_path / "funduq.sqlite3") as conn:
        conn.execute("UPDATE providers SET unanswered=3, abandoned=1 WHERE key=?", (key,))
    conn.close()

    listed = await quality("list", "--json", "--data-dir", str(tmp_path))
    assert listed.returncode == 0, listed.stderr.decode()
    [row] = json.loads(listed.stdout)["providers"]
    assert row == {
        "provider": key,
        "fingerprint": fingerprint,
        "misdeclared": 0,
        "unanswered": 3,
        "abandoned": 1,
        "undelivered": 0,
    }
    table = await quality("list", "--data-dir", str(tmp_path))
    assert fingerprint in table.stdout.decode() and "unanswered" in table.stdout.decode()

    reset = await quality("reset", fingerprint, "--data-dir", str(tmp_path))
    assert reset.returncode == 0, reset.stderr.decode()
    assert reset.stdout.decode() == f"reset the quality counters of provider {key}\n"

    # The next start reads the reset counters.
    async with running_server(tmp_path) as info:
        [seen] = info.funduq.provider_quality()
        assert seen["counters"] == {
            "misdeclared": 0,
            "unanswered": 0,
            "abandoned": 0,
            "undelivered": 0,
        }


async def test_quality_errors_are_one_line_and_create_nothing(tmp_path):
    missing = await quality("list", "--data-dir", str(tmp_path / "nope"))
    assert missing.returncode == 1
    assert missing.stderr.decode().startswith("funduq-trio quality: error: no record at ")
    assert not (tmp_path / "nope").exists()
    async with running_server(tmp_path):
        pass
    unknown = await quality("reset", "0" * 16, "--data-dir", str(tmp_path))
    assert unknown.returncode == 1
    assert f"no provider {'0' * 16}" in unknown.stderr.decode()
    bad = await quality("reset", "not-a-key", "--data-dir", str(tmp_path))
    assert bad.returncode == 1 and "neither a 64-hex" in bad.stderr.decode()
