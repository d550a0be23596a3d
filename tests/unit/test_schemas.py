"""The msgpack codec and the message models: round trips, and every way to be refused."""

from __future__ import annotations

import zlib
from typing import Any, ClassVar

import msgpack
import pytest
from pydantic import ValidationError

from phalanx.contract import (
    DecodeError,
    Heartbeat,
    JobSpec,
    Member,
    Message,
    Ping,
    Plan,
    RankFailed,
    decode,
    encode,
    registry,
)
from phalanx.contract.codec import HDR_ENCODING, HDR_KIND, HDR_SCHEMA
from phalanx.contract.proto import examples

EXAMPLES = examples()


def _headers(kind: str, version: str | None = None, encoding: str | None = "msgpack") -> dict[str, str]:
    cls = registry().get(kind)
    h = {HDR_KIND: kind, HDR_SCHEMA: str(cls.SCHEMA_VERSION if cls else 1) if version is None else version}
    if encoding is not None:
        h[HDR_ENCODING] = encoding
    return h


def _payload(kind: str) -> dict[str, Any]:
    data, headers = encode(EXAMPLES[kind])
    if headers[HDR_ENCODING] == "msgpack+zlib":
        data = zlib.decompress(data)
    out = msgpack.unpackb(data, raw=False)
    assert isinstance(out, dict)
    return out


def _pack(obj: Any) -> bytes:
    data = msgpack.packb(obj, use_bin_type=True)
    assert isinstance(data, bytes)
    return data


# -- round trips --------------------------------------------------------------------
@pytest.mark.parametrize("kind", sorted(registry()))
def test_round_trip_every_kind(kind: str) -> None:
    msg = EXAMPLES[kind]
    data, headers = encode(msg)
    encoding = "msgpack+zlib" if type(msg).COMPRESSED else "msgpack"
    assert headers == {HDR_KIND: kind, HDR_SCHEMA: str(type(msg).SCHEMA_VERSION), HDR_ENCODING: encoding}
    assert decode(data, headers) == msg
    assert decode(data, headers, type(msg)) == msg
    assert type(decode(data, headers)) is type(msg)


def test_missing_encoding_header_is_read_as_msgpack() -> None:
    data, _ = encode(Ping(ts=1.0))
    assert decode(data, _headers("ping", encoding=None)) == Ping(ts=1.0)


def test_defaults_are_filled_on_decode() -> None:
    payload = _payload("plan")
    for optional in ("spares", "removed", "incident"):
        del payload[optional]
    plan = decode(_pack(payload), _headers("plan"), Plan)
    assert plan.spares == [] and plan.removed == [] and plan.incident is None


# -- refusals -------------------------------------------------------------------------
def _refused(
    data: bytes, headers: dict[str, str] | None, expected: type[Message] | None = None
) -> DecodeError:
    with pytest.raises(DecodeError) as info:
        if expected is None:
            decode(data, headers)
        else:
            decode(data, headers, expected)
    return info.value


@pytest.mark.parametrize(
    "data",
    [b"\xc1", b"\x81\xa3job", b"", _pack({"job": "j1"}) + b"\x00", _pack({1: "int key"})],
    ids=["reserved-byte", "truncated", "empty", "trailing-bytes", "int-key"],
)
def test_malformed_msgpack(data: bytes) -> None:
    err = _refused(data, _headers("ping"))
    assert "malformed msgpack" in err.reason and err.kind == "ping"


@pytest.mark.parametrize("headers", [None, {}, {HDR_SCHEMA: "1", HDR_ENCODING: "msgpack"}])
def test_missing_kind_header(headers: dict[str, str] | None) -> None:
    data, _ = encode(Ping(ts=1.0))
    err = _refused(data, headers)
    assert "missing Phalanx-Kind" in err.reason and err.kind is None


def test_unknown_kind() -> None:
    data, _ = encode(Ping(ts=1.0))
    err = _refused(data, _headers("teleport"))
    assert "unknown message kind 'teleport'" in err.reason and err.kind == "teleport"


@pytest.mark.parametrize("version", ["2", "0", "", "one"])
def test_schema_version_mismatch(version: str) -> None:
    data, _ = encode(EXAMPLES["rank_failed"])
    err = _refused(data, _headers("rank_failed", version=version))
    assert "schema version" in err.reason and "speaks 1" in err.reason and err.kind == "rank_failed"


def test_missing_schema_header() -> None:
    data, _ = encode(EXAMPLES["plan"])
    err = _refused(data, {HDR_KIND: "plan", HDR_ENCODING: "msgpack"})
    assert "schema version None" in err.reason


@pytest.mark.parametrize("encoding", ["json", "MSGPACK", "protobuf"])
def test_wrong_encoding(encoding: str) -> None:
    data, _ = encode(Ping(ts=1.0))
    err = _refused(data, _headers("ping", encoding=encoding))
    assert f"unsupported encoding {encoding!r}" in err.reason


@pytest.mark.parametrize("obj", [[1, 2], 7, "ping", None, b"\x00"], ids=["list", "int", "str", "nil", "bin"])
def test_non_map_payload(obj: Any) -> None:
    err = _refused(_pack(obj), _headers("ping"))
    assert "not a map" in err.reason


@pytest.mark.parametrize(
    ("kind", "change", "field"),
    [
        ("rank_failed", {"cause": "boredom"}, "cause"),
        ("rank_failed", {"rank": "two"}, "rank"),
        ("heartbeat", {"rank": -2}, "rank"),
        ("heartbeat", {"interval_ms": 0}, "interval_ms"),
        ("heartbeat", {"job": "a.b"}, "job"),
        ("heartbeat", {"job": ""}, "job"),
        ("plan", {"generation": 0}, "generation"),
        ("plan", {"members": [{"rank": 0}]}, "members.0.worker"),
        ("capacity_changed", {"available_slots": -1}, "available_slots"),
        ("health", {"status": "meh"}, "status"),
    ],
)
def test_validation_errors_name_the_field(kind: str, change: dict[str, Any], field: str) -> None:
    payload = _payload(kind)
    payload.update(change)
    err = _refused(_pack(payload), _headers(kind))
    assert err.reason.startswith(f"invalid {kind!r}: ") and f"{field}:" in err.reason, err.reason


def test_missing_required_field() -> None:
    payload = _payload("rank_failed")
    del payload["incident"]
    err = _refused(_pack(payload), _headers("rank_failed"))
    assert "incident: Field required" in err.reason


def test_extra_fields_are_refused() -> None:
    payload = _payload("rank_failed")
    payload["surprise"] = True
    err = _refused(_pack(payload), _headers("rank_failed"))
    assert "surprise: Extra inputs are not permitted" in err.reason


def test_expected_kind_mismatch() -> None:
    data, headers = encode(EXAMPLES["heartbeat"])
    err = _refused(data, headers, RankFailed)
    assert "expected 'rank_failed', got 'heartbeat'" in err.reason


def test_decode_error_is_a_value_error() -> None:
    assert issubclass(DecodeError, ValueError)


# -- models ----------------------------------------------------------------------------
def _plan(members: list[tuple[int, str]]) -> Plan:
    return Plan(
        job="j1",
        generation=2,
        members=[Member(rank=r, worker=w) for r, w in members],
        reason="test",
        store_prefix="phalanx/j1/g2",
    )


def test_plan_accepts_dense_ranks_in_any_order() -> None:
    plan = _plan([(1, "w1"), (0, "w0"), (2, "w4")])
    assert plan.world_size == 3
    assert plan.rank_of("w4") == 2 and plan.rank_of("w2") is None


@pytest.mark.parametrize(
    ("members", "message"),
    [
        ([(0, "w0"), (2, "w2")], "ranks must be 0..n-1"),
        ([(1, "w1")], "ranks must be 0..n-1"),
        ([(0, "w0"), (0, "w1")], "ranks must be 0..n-1"),
        ([(0, "w0"), (1, "w0")], "a worker appears twice"),
    ],
)
def test_plan_validators(members: list[tuple[int, str]], message: str) -> None:
    with pytest.raises(ValidationError, match=message):
        _plan(members)


def test_plan_validators_run_on_decode() -> None:
    payload = _payload("plan")
    payload["members"] = [{"rank": 0, "worker": "w0"}, {"rank": 0, "worker": "w1"}]
    err = _refused(_pack(payload), _headers("plan"))
    assert "ranks must be 0..n-1" in err.reason


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"min_nodes": 3, "max_nodes": 2}, "min_nodes <= max_nodes"),
        ({"ranks": 5}, "more ranks than workers"),
        ({"workers": ["a-w0", "a-w0"]}, "a worker appears twice"),
        ({"workers": []}, "at least 1 item"),
        ({"node": "a.b"}, "String should match pattern"),
        ({"global_batch": 0}, "greater than or equal to 1"),
    ],
)
def test_job_spec_validators(fields: dict[str, object], message: str) -> None:
    base: dict[str, object] = {
        "job": "j1",
        "node": "a",
        "launcher": "a-1",
        "workers": ["a-w0", "a-w1"],
        "ranks": 2,
        "global_batch": 8,
    }
    JobSpec.model_validate(base)  # valid as it is
    with pytest.raises(ValidationError, match=message):
        JobSpec.model_validate({**base, **fields})


def test_messages_are_frozen() -> None:
    hb = EXAMPLES["heartbeat"]
    assert isinstance(hb, Heartbeat)
    with pytest.raises(ValidationError):
        hb.step = 7  # type: ignore[misc]


def test_a_kind_cannot_be_registered_twice() -> None:
    with pytest.raises(TypeError, match="registered twice"):

        class _Impostor(Message):
            KIND: ClassVar[str] = "ping"

    assert registry()["ping"] is Ping
