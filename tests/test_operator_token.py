"""The operator token (DESIGN §8): configured, or generated on first start and
kept in the data directory (0600), the same across restarts; and how a request
presents it."""

from __future__ import annotations

import stat
from types import SimpleNamespace

import pytest

from funduq_trio.cli import build_parser, settings_from_args
from funduq_trio.web.access import OPERATOR_COOKIE, is_operator
from tests.support import running_server


async def test_generated_once_kept_0600_and_stable_across_restarts(tmp_path):
    async with running_server(tmp_path) as info:
        first = info.funduq.operator_token
    path = tmp_path / "operator.token"
    assert path.read_text().strip() == first
    assert len(first) >= 16
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    async with running_server(tmp_path) as info:
        assert info.funduq.operator_token == first


async def test_configured_token_wins_and_nothing_is_generated(tmp_path):
    async with running_server(tmp_path, operator_token="configured-token-0123") as info:
        assert info.funduq.operator_token == "configured-token-0123"
    assert not (tmp_path / "operator.token").exists()


@pytest.mark.parametrize("bad", ["short", "has space in it 0123", "x" * 257])
def test_bad_token_refused_at_start(bad):
    args = build_parser().parse_args(["serve", "--operator-token", bad])
    with pytest.raises(ValueError, match="(?i)operator.token"):
        settings_from_args(args, env={})


def _request(headers=None, args=None, cookies=None):
    return SimpleNamespace(headers=headers or {}, args=args or {}, cookies=cookies or {})


def test_is_operator_by_bearer_query_or_cookie_only_with_the_right_token():
    funduq = SimpleNamespace(operator_token="the-right-token-123")
    assert is_operator(funduq, _request(headers={"Authorization": "Bearer the-right-token-123"}))
    # `?token=` only where the route asks for it (the operator page's own).
    assert is_operator(funduq, _request(args={"token": "the-right-token-123"}), from_query=True)
    assert not is_operator(funduq, _request(args={"token": "the-right-token-123"}))
    assert is_operator(funduq, _request(cookies={OPERATOR_COOKIE: "the-right-token-123"}))
    assert not is_operator(funduq, _request())
    assert not is_operator(funduq, _request(headers={"Authorization": "Bearer wrong-token-00000"}))
    assert not is_operator(funduq, _request(args={"token": "the-right-token-12"}), from_query=True)
    assert not is_operator(funduq, _request(headers={"Authorization": "Bearer \ud800"}))
