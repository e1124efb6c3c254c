"""`GET /metrics`: what funduq counts about itself, in Prometheus text. The
offer round trip is timed under MockClock in the broker, then everything is
read back over HTTP from a real server after a real run."""

from __future__ import annotations

import re

from broker_support import Provider, broker, last_offer_for, quiet, reply, start
from support import http_client, post_sse, running_server, sdk_provider, user_input

from funduq_trio.broker.metrics import Histogram, Metrics


def samples(text: str) -> dict[str, float]:
    """name{labels} -> value, for every sample line of an exposition."""
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


def test_a_histogram_counts_each_value_in_its_bucket_and_the_ones_above():
    h = Histogram([0.001, 0.01, 0.1])
    for value in (0.0005, 0.001, 0.003, 0.05, 7.0):
        h.observe(value)
    assert h.cumulative() == [("0.001", 2), ("0.01", 3), ("0.1", 4), ("+Inf", 5)]
    assert h.count == 5 and abs(h.sum - 7.0545) < 1e-9


def test_every_family_has_help_and_type_and_labels_are_quoted():
    m = Metrics()
    m.run_ended("completed")
    m.run_ended("failed")
    m.offer_answered("declined", 0.004)
    m.completion_ended("0123456789abcdef/fake", "refused")
    text = m.render({"funduq_runs_live": ("Live runs.", 3)})
    names = re.findall(r"^# TYPE (\S+) (\S+)$", text, re.M)
    assert len(names) == len(re.findall(r"^# HELP ", text, re.M)) == 9
    assert (
        samples(text)[
            'funduq_kyok_completions_total{offering="0123456789abcdef/fake",outcome="refused"}'
        ]
        == 1
    )
    values = samples(text)
    assert values['funduq_runs_ended_total{status="failed"}'] == 1
    assert values['funduq_offers_answered_total{verdict="declined"}'] == 1
    assert values['funduq_offer_round_trip_seconds_bucket{le="0.002"}'] == 0
    assert values['funduq_offer_round_trip_seconds_bucket{le="0.005"}'] == 1
    assert values["funduq_runs_live"] == 3


async def test_the_offer_round_trip_is_timed_from_the_offer_to_the_answer(tmp_path, mock_clock):
    async with broker(tmp_path) as funduq:
        p = await Provider(funduq).attach()
        a = await start(funduq, p)
        mock_clock.jump(0.003)  # the provider takes 3 ms to answer
        p.session.answer(last_offer_for(p.link, a.run_id), "accepted")
        await quiet()
        p.stream(a.run_id, *reply(a.run_id, a.thread_id))
        await quiet()
        values = samples(funduq.metrics.render(funduq.gauges()))
    assert values['funduq_offer_round_trip_seconds_bucket{le="0.002"}'] == 0
    assert values['funduq_offer_round_trip_seconds_bucket{le="0.005"}'] == 1
    assert abs(values["funduq_offer_round_trip_seconds_sum"] - 0.003) < 1e-9
    assert values['funduq_offers_answered_total{verdict="accepted"}'] == 1
    assert values['funduq_runs_ended_total{status="completed"}'] == 1
    assert values["funduq_events_recorded_total"] == len(reply(a.run_id, a.thread_id))


async def test_metrics_over_http_after_a_real_run(tmp_path):
    async with running_server(tmp_path) as info, http_client(info) as http:
        async with sdk_provider(info) as provider:
            url = f"/agui/{provider.identity.fingerprint}/echo"
            _, events = await post_sse(http, url, user_input("hello there"))
            response = await http.get("/metrics")
            run = (await http.get(f"/runs/{events[0]['runId']}")).json()
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/plain; version=0.0.4")
    values = samples(response.text)
    assert values["funduq_runs_started_total"] == 1
    assert values['funduq_runs_ended_total{status="completed"}'] == 1
    assert values["funduq_events_recorded_total"] == len(run["events"])
    assert values["funduq_offer_round_trip_seconds_count"] == 1
    assert values["funduq_providers_attached"] == 1
    assert values["funduq_runs_live"] == 0
