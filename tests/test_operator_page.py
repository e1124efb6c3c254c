"""The operator's page at `/`: token-gated, live, and seen in a real browser.

The browser test drives Debian's chromium through Playwright. Outside CI it
is skipped (with the reason) when either is missing; with CI set it fails
instead, so CI cannot pass without having looked at the page."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
import trio
from support import http_client, post_sse, raw_provider, running_server, user_input

from funduq_trio.web.access import OPERATOR_COOKIE

TOKEN = "operator-token-for-the-page"
CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
]
#: docs/operator-page.png is made by running this with the variable set to it.
SCREENSHOT_VARIABLE = "FUNDUQ_OPERATOR_SCREENSHOT"


async def test_the_page_needs_the_operator_token(tmp_path):
    async with running_server(tmp_path, operator_token=TOKEN) as info, http_client(info) as http:
        refused = await http.get("/")
        assert refused.status_code == 401
        assert refused.headers["content-type"].startswith("text/html")
        assert "?token=" in refused.text and "operator.token" in refused.text
        assert (await http.get("/", params={"token": "wrong-token-0123456789"})).status_code == 401
        assert (await http.get("/operator/view")).status_code == 401

        entered = await http.get("/", params={"token": TOKEN})
        assert entered.status_code == 303 and entered.headers["location"] == "/"
        assert http.cookies[OPERATOR_COOKIE] == TOKEN  # the page's own requests carry it
        page = await http.get("/")
        assert page.status_code == 200 and "funduq operator" in page.text
        assert page.headers["cache-control"] == "no-store"
        bearer = await http_client(info).__aenter__()
        try:
            view = await bearer.get("/operator/view", headers={"Authorization": f"Bearer {TOKEN}"})
            assert view.status_code == 200
        finally:
            await bearer.aclose()

    # `?token=` is the page's way in only: anywhere else a token in the URL
    # is not the operator's (it would leak into proxy logs and Referer).
    async with (
        running_server(tmp_path / "2", operator_token=TOKEN) as info,
        http_client(info) as http,
        raw_provider(info, ["echo"]) as provider,
    ):

        async def refused_run():
            await provider.answer(await provider.next_offer(), "refused", "busy")

        async with trio.open_nursery() as nursery:
            nursery.start_soon(refused_run)
            await post_sse(http, f"/agui/{provider.fingerprint}/echo", user_input("hi"))
        assert (await http.get("/operator/view", params={"token": TOKEN})).status_code == 401
        listed = await http.get("/runs", params={"token": TOKEN})
        assert listed.status_code == 200 and listed.json()["runs"] == []
        assert OPERATOR_COOKIE not in http.cookies
        everything = await http.get("/runs", headers={"Authorization": f"Bearer {TOKEN}"})
        assert len(everything.json()["runs"]) == 1


async def test_the_page_shows_roster_counters_runs_timeline_and_failures(tmp_path):
    async with (
        running_server(tmp_path, operator_token=TOKEN) as info,
        http_client(info, headers={"Authorization": f"Bearer {TOKEN}"}) as http,
        raw_provider(info, ["echo"]) as provider,
    ):
        door = f"/agui/{provider.fingerprint}/echo"

        async def refused_run():
            run = await provider.next_offer()
            await provider.answer(run, "refused", "<script>alert(1)</script> too busy")

        async with trio.open_nursery() as nursery:
            nursery.start_soon(refused_run)
            response, events = await post_sse(http, door, user_input("hi", thread_id="t-1"))
        assert events[-1]["type"] == "RUN_ERROR"
        run_id = events[0]["runId"] if events[0].get("runId") else None
        view = (await http.get("/operator/view")).text
        assert "echo (test)" in view  # the roster, with the agent's description
        assert provider.fingerprint in view and "online" in view
        assert "misdeclared" in view and "0/3" in view  # counters against the allowance
        assert 'id="threads"' in view and "failed" in view
        # The provider's reason, verbatim and escaped: it is hostile text.
        assert "&lt;script&gt;alert(1)&lt;/script&gt; too busy" in view
        assert "<script>" not in view
        run_id = run_id or view.split('data-run="')[1].split('"')[0]
        timeline = (await http.get("/operator/view", params={"run": run_id})).text
        assert 'id="timeline"' in timeline and "RUN_ERROR" in timeline


def _browser_or_reason() -> str | None:
    try:
        import playwright.async_api  # noqa: F401
    except ImportError:
        return "the playwright package is not installed (it is in the test extra)"
    if not shutil.which(CHROMIUM):
        return f"{CHROMIUM} is missing (apt-get install -y chromium)"
    return None


async def test_the_page_in_chromium_sees_a_run_complete(tmp_path):
    reason = _browser_or_reason()
    if reason is not None:
        if os.environ.get("CI"):
            pytest.fail(f"CI must run the browser test: {reason}")
        pytest.skip(reason)
    from playwright.async_api import async_playwright

    async with (
        running_server(tmp_path, operator_token=TOKEN) as info,
        http_client(info) as http,
        raw_provider(info, ["echo"]) as provider,
    ):
        # Playwright runs on asyncio: it gets its own thread, driven step by
        # step from here, while trio serves the page and plays the provider.
        browser_calls = BrowserThread()
        try:
            await browser_calls.start(async_playwright)
            await browser_calls.do("goto", f"{info.url}/?token={TOKEN}")
            assert await browser_calls.do("text", "h1") == "funduq operator"
            assert "echo" in await browser_calls.do("text", "#agents")

            async with trio.open_nursery() as nursery:
                result = {}

                async def call():
                    result["run"] = await post_sse(
                        http,
                        f"/agui/{provider.fingerprint}/echo",
                        user_input("hi", thread_id="browser-thread"),
                    )

                nursery.start_soon(call)
                run = await provider.next_offer()
                await provider.answer(run, "accepted")
                ids = {"threadId": run["threadId"], "runId": run["runId"]}
                await provider.report(run["runId"], {"type": "RUN_STARTED", **ids})
                # The page, refreshing by itself, shows the run running...
                row = f'tr[data-run="{run["runId"]}"] .status'
                assert await browser_calls.do("wait_text", row, "running") == "running"
                await provider.report(run["runId"], {"type": "RUN_FINISHED", **ids})
                await provider.finish(run["runId"])
            # ... then completed, without anyone reloading it.
            assert await browser_calls.do("wait_text", row, "completed") == "completed"
            assert run["threadId"] in await browser_calls.do("text", "#threads")
            await browser_calls.do("goto", f"{info.url}/?run={run['runId']}")
            assert "RUN_FINISHED" in await browser_calls.do("text", "#timeline")
            shot = os.environ.get(SCREENSHOT_VARIABLE) or str(tmp_path / "operator-page.png")
            await browser_calls.do("screenshot", shot)
            assert Path(shot).stat().st_size > 0
        finally:
            await browser_calls.stop()


class BrowserThread:
    """Playwright's asyncio loop in a thread; `do` runs one step there."""

    def __init__(self) -> None:
        import asyncio
        import queue

        self._asyncio = asyncio
        self._requests: queue.Queue = queue.Queue()
        self._thread_done = trio.Event()

    async def start(self, async_playwright) -> None:
        token = trio.lowlevel.current_trio_token()
        asyncio = self._asyncio

        async def main() -> None:
            async with async_playwright() as pw:
                browser = await pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
                page = await browser.new_page(viewport={"width": 1200, "height": 900})
                loop = asyncio.get_running_loop()
                while True:
                    step, args, reply = await loop.run_in_executor(None, self._requests.get)
                    if step == "stop":
                        break
                    try:
                        value = await self._step(page, step, *args)
                    except Exception as exc:  # noqa: BLE001 -- handed back to the test
                        value = exc
                    token.run_sync_soon(reply, value)
                await browser.close()

        def run() -> None:
            try:
                asyncio.run(main())
            finally:
                token.run_sync_soon(self._thread_done.set)

        trio.lowlevel.start_thread_soon(run, lambda _: None)

    @staticmethod
    async def _step(page, step: str, *args):
        if step == "goto":
            await page.goto(args[0])
            return None
        if step == "text":
            return (await page.inner_text(args[0])).strip()
        if step == "wait_text":
            from playwright.async_api import expect

            # Playwright's own matcher (no eval: the page's CSP forbids it).
            selector, text = args
            await expect(page.locator(selector)).to_have_text(
                text, timeout=30_000
            )  # a safety net, not a behaviour clock
            return (await page.inner_text(selector)).strip()
        if step == "screenshot":
            await page.screenshot(path=args[0], full_page=True)
            return None
        raise AssertionError(step)

    async def do(self, step: str, *args):
        done = trio.Event()
        box = {}

        def reply(value) -> None:
            box["value"] = value
            done.set()

        self._requests.put((step, args, reply))
        with trio.fail_after(60):  # a safety net against a hung browser
            await done.wait()
        if isinstance(box["value"], Exception):
            raise box["value"]
        return box["value"]

    async def stop(self) -> None:
        self._requests.put(("stop", (), None))
        with trio.fail_after(60):
            await self._thread_done.wait()
