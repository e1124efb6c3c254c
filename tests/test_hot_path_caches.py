"""The per-run fast paths (bench/README.md, "inprocess after the run
machine") change no output: cached stamps and fingerprints read the same as
computed afresh, and a bad key is still refused after good ones were cached."""

from __future__ import annotations

import hashlib
import json
import time

import pytest

from funduq_trio.broker.store import dumps, iso
from funduq_trio.identity import Identity, fingerprint_of


@pytest.mark.parametrize("ts", [0.0, 1.9995, 59.999, 1764750000.123, -1.5, 1e10 + 0.5])
def test_iso_reads_as_strftime(ts: float) -> None:
    fresh = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(ts)) + f".{int(ts % 1 * 1000):03d}Z"
    assert iso(ts) == fresh
    assert iso(ts) == fresh  # the cached second too
    assert iso(None) is None


def test_fingerprint_cached_and_still_checked() -> None:
    key = Identity.generate().public_key_hex
    expected = hashlib.sha256(bytes.fromhex(key)).hexdigest()[:16]
    assert fingerprint_of(key) == fingerprint_of(key) == expected
    for bad in (key.upper(), key[:-1], "", ["not", "a", "key"], None):
        with pytest.raises(ValueError):
            fingerprint_of(bad)  # type: ignore[arg-type]


def test_dumps_reads_as_json_dumps() -> None:
    for value in ({"a": [1, 2.5, None, True, "\ud800", "é"]}, "x", [], {"k": {"n": [{}]}}):
        assert dumps(value) == json.dumps(value, separators=(",", ":"))
