"""proto/ agrees with the code, and what it says is true of the messages on the wire.

Fails when a model or subject changed without ``make proto``, when a catalogue
subject carries an unregistered message, or when a generated schema would reject
a message the codec really sends. The JSON Schemas are checked with a small
validator below (no jsonschema dependency); it refuses keywords it does not know
rather than ignoring them.
"""

from __future__ import annotations

import json
import re
import shutil
import zlib
from pathlib import Path
from typing import Any

import msgpack
import pytest

from phalanx.contract import encode, proto, registry
from phalanx.contract.streams import STREAMS
from phalanx.contract.subjects import CATALOGUE, Transport

ROOT = Path(__file__).resolve().parents[2] / "proto"


# -- a small JSON Schema (2020-12 subset) validator --------------------------------
_ANNOTATIONS = {"title", "description", "default", "examples", "$schema", "$id", "$defs"}
_TYPES: dict[str, Any] = {
    "object": lambda v: isinstance(v, dict),
    "array": lambda v: isinstance(v, list),
    "string": lambda v: isinstance(v, str),
    "integer": lambda v: isinstance(v, int) and not isinstance(v, bool),
    "number": lambda v: isinstance(v, int | float) and not isinstance(v, bool),
    "boolean": lambda v: isinstance(v, bool),
    "null": lambda v: v is None,
}


def validate(
    schema: dict[str, Any], value: Any, root: dict[str, Any] | None = None, path: str = "$"
) -> list[str]:
    """Errors of ``value`` against ``schema`` (empty when it is valid)."""
    root = root if root is not None else schema
    errors: list[str] = []
    for key, arg in schema.items():
        if key in _ANNOTATIONS or key.startswith("x-"):
            continue
        if key == "$ref":
            assert arg.startswith("#/"), f"only local refs are supported, got {arg}"
            target: Any = root
            for part in arg[2:].split("/"):
                target = target[part]
            errors += validate(target, value, root, path)
        elif key == "type":
            types = arg if isinstance(arg, list) else [arg]
            if not any(_TYPES[t](value) for t in types):
                errors.append(f"{path}: {value!r} is not of type {arg}")
        elif key == "const":
            if value != arg or type(value) is not type(arg):
                errors.append(f"{path}: {value!r} is not {arg!r}")
        elif key == "enum":
            if value not in arg:
                errors.append(f"{path}: {value!r} is not one of {arg}")
        elif key == "anyOf":
            if all(validate(sub, value, root, path) for sub in arg):
                errors.append(f"{path}: {value!r} matches none of anyOf")
        elif key == "allOf":
            for sub in arg:
                errors += validate(sub, value, root, path)
        elif key == "properties":
            if isinstance(value, dict):
                for name, sub in arg.items():
                    if name in value:
                        errors += validate(sub, value[name], root, f"{path}.{name}")
        elif key == "required":
            if isinstance(value, dict):
                errors += [f"{path}: missing {name!r}" for name in arg if name not in value]
        elif key == "additionalProperties":
            if isinstance(value, dict):
                extra = [k for k in value if k not in schema.get("properties", {})]
                for k in extra:
                    if arg is False:
                        errors.append(f"{path}: unexpected property {k!r}")
                    elif isinstance(arg, dict):
                        errors += validate(arg, value[k], root, f"{path}.{k}")
        elif key == "items":
            if isinstance(value, list):
                first = len(schema.get("prefixItems", []))  # items covers those after the prefix
                for i, item in enumerate(value[first:], start=first):
                    errors += validate(arg, item, root, f"{path}[{i}]")
        elif key == "prefixItems":
            if isinstance(value, list):
                for i, (sub, item) in enumerate(zip(arg, value, strict=False)):
                    errors += validate(sub, item, root, f"{path}[{i}]")
        elif key in ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum"):
            if _TYPES["number"](value):
                ok = {
                    "minimum": value >= arg,
                    "maximum": value <= arg,
                    "exclusiveMinimum": value > arg,
                    "exclusiveMaximum": value < arg,
                }[key]
                if not ok:
                    errors.append(f"{path}: {value!r} violates {key} {arg}")
        elif key in ("minLength", "maxLength"):
            if isinstance(value, str) and not (
                len(value) >= arg if key == "minLength" else len(value) <= arg
            ):
                errors.append(f"{path}: length of {value!r} violates {key} {arg}")
        elif key in ("minItems", "maxItems"):
            if isinstance(value, list) and not (
                len(value) >= arg if key == "minItems" else len(value) <= arg
            ):
                errors.append(f"{path}: {len(value)} items violate {key} {arg}")
        elif key in ("minProperties", "maxProperties"):
            if isinstance(value, dict) and not (
                len(value) >= arg if key == "minProperties" else len(value) <= arg
            ):
                errors.append(f"{path}: {len(value)} properties violate {key} {arg}")
        elif key == "uniqueItems":
            if arg and isinstance(value, list) and len({repr(v) for v in value}) != len(value):
                errors.append(f"{path}: {value!r} holds an item twice")
        elif key == "pattern":
            if isinstance(value, str) and not re.search(arg, value):
                errors.append(f"{path}: {value!r} does not match {arg}")
        else:
            raise AssertionError(f"validator does not know JSON Schema keyword {key!r}: extend it")
    return errors


def _schema(kind: str) -> dict[str, Any]:
    return json.loads((ROOT / "schemas" / f"{kind}.json").read_text())


def _wire(kind: str) -> tuple[Any, dict[str, str]]:
    """What the codec really sends for the example of ``kind``: decoded msgpack and headers."""
    data, headers = encode(proto.examples()[kind])
    if headers.get("Phalanx-Encoding") == "msgpack+zlib":
        data = zlib.decompress(data)
    return msgpack.unpackb(data, raw=False), headers


# -- proto/ agrees with the code ------------------------------------------------------
def test_proto_dir_matches_the_code() -> None:
    problems = proto.diff(ROOT)
    assert not problems, "proto/ is out of date; run `make proto`:\n" + "\n".join(problems)


def test_check_reports_drift_and_write_repairs_it(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    root = tmp_path / "proto"
    shutil.copytree(ROOT, root)
    plan = root / "schemas" / "plan.json"
    plan.write_text(plan.read_text().replace('"minimum": 1', '"minimum": 0', 1))
    (root / "schemas" / "heartbeat.json").unlink()
    (root / "schemas" / "gone.json").write_text("{}\n")

    assert proto.main(["check", str(root)]) == 1
    err = capsys.readouterr().err
    assert "plan.json" in err and '"minimum": 0' in err and '"minimum": 1' in err
    assert "missing:" in err and "heartbeat.json" in err
    assert "stale" in err and "gone.json" in err
    assert "make proto" in err

    assert proto.main(["write", str(root)]) == 0
    assert proto.main(["check", str(root)]) == 0
    assert not (root / "schemas" / "gone.json").exists()
    assert (root / "README.md").read_text() == (ROOT / "README.md").read_text()


def test_generation_is_deterministic() -> None:
    assert proto.generate() == proto.generate()


# -- the catalogue is consistent ---------------------------------------------------------
def test_every_catalogue_subject_carries_a_registered_message() -> None:
    reg = registry()
    for s in CATALOGUE:
        assert s.message.KIND, f"{s.pattern} carries {s.message.__name__}, which has no KIND"
        assert reg.get(s.message.KIND) is s.message, f"{s.pattern}: {s.message.KIND!r} not registered"


def test_every_registered_message_travels_somewhere() -> None:
    carried = (
        {s.message.KIND for s in CATALOGUE}
        | {m.KIND for m in proto.REQUESTS.values()}
        | {m.KIND for m in proto.KV_RECORDS.values()}
        | {m.KIND for m in proto.LOCAL_SOCKETS.values()}
    )
    orphans = set(registry()) - carried
    assert not orphans, f"registered kinds on no subject: {sorted(orphans)}"


def test_every_subject_has_a_sender_and_a_receiver() -> None:
    for s in CATALOGUE:
        senders, receivers = proto.PARTIES.get(s.pattern, ((), ()))
        assert senders and receivers, f"add {s.pattern} to phalanx.contract.proto.PARTIES"
    assert set(proto.PARTIES) == {s.pattern for s in CATALOGUE}


def test_jetstream_subjects_land_in_exactly_one_stream_and_core_in_none() -> None:
    doc = json.loads((ROOT / "subjects.json").read_text())
    by_pattern = {e["pattern"]: e for e in doc["subjects"]}
    assert len(by_pattern) == len(CATALOGUE)
    names = {st.name for st in STREAMS}
    for s in CATALOGUE:
        entry = by_pattern[s.pattern]
        assert entry["kind"] == s.message.KIND and entry["transport"] == str(s.transport)
        if s.transport is Transport.JETSTREAM:
            assert entry["stream"] in names
        else:
            assert entry["stream"] is None


@pytest.mark.parametrize(
    ("filter_", "subject", "match"),
    [
        ("phalanx.evt.>", "phalanx.evt.j1.failed", True),
        ("phalanx.evt.>", "phalanx.evt", False),
        ("phalanx.*.j1", "phalanx.evt.j1", True),
        ("phalanx.*.j1", "phalanx.evt.j1.x", False),
        ("phalanx.hb.*.*", "phalanx.hb.j1.w0", True),
        ("phalanx.cmd.>", "phalanx.evt.j1.plan", False),
    ],
)
def test_subject_matching(filter_: str, subject: str, match: bool) -> None:
    assert proto.subject_matches(filter_, subject) is match


# -- generated schemas describe the real wire -------------------------------------------
def test_there_is_an_example_of_every_kind() -> None:
    missing = set(registry()) - set(proto.examples())
    assert not missing, f"add examples of {sorted(missing)} to phalanx.contract.proto.examples()"


@pytest.mark.parametrize("kind", sorted(registry()))
def test_generated_schema_accepts_what_the_codec_sends(kind: str) -> None:
    schema = _schema(kind)
    assert schema["x-phalanx-kind"] == kind
    assert schema["x-phalanx-schema-version"] == registry()[kind].SCHEMA_VERSION
    payload, headers = _wire(kind)
    assert validate(schema, payload) == []
    assert validate(schema["x-phalanx-headers"], headers) == []


@pytest.mark.parametrize(
    ("kind", "mutate", "expect"),
    [
        ("rank_failed", lambda p: p.update(surprise=1), "unexpected property 'surprise'"),
        ("rank_failed", lambda p: p.pop("incident"), "missing 'incident'"),
        ("rank_failed", lambda p: p.update(rank="two"), "is not of type integer"),
        ("rank_failed", lambda p: p.update(cause="boredom"), "is not one of"),
        ("rank_failed", lambda p: p.update(job="a.b"), "does not match"),
        ("heartbeat", lambda p: p.update(rank=-2), "violates minimum"),
        ("heartbeat", lambda p: p.update(interval_ms=0), "violates exclusiveMinimum"),
        ("plan", lambda p: p["members"].append({"rank": 4}), "is not of type array"),
        ("health", lambda p: p.update(status="meh"), "is not one of"),
        ("recovery_done", lambda p: p.update(incident=7), "matches none of anyOf"),
        ("collective_error", lambda p: p.update(error="x" * 2001), "violates maxLength"),
    ],
)
def test_generated_schema_rejects_what_the_codec_would_refuse(kind: str, mutate: Any, expect: str) -> None:
    payload, _ = _wire(kind)
    mutate(payload)
    errors = validate(_schema(kind), payload)
    assert any(expect in e for e in errors), errors


def test_header_schema_rejects_another_version() -> None:
    _, headers = _wire("plan")
    headers["Phalanx-Schema"] = "3"
    assert validate(_schema("plan")["x-phalanx-headers"], headers)


# -- AsyncAPI -----------------------------------------------------------------------------------
def _refs(node: Any) -> list[str]:
    if isinstance(node, dict):
        own = [node["$ref"]] if isinstance(node.get("$ref"), str) else []
        return own + [r for v in node.values() for r in _refs(v)]
    if isinstance(node, list):
        return [r for v in node for r in _refs(v)]
    return []


def test_asyncapi_document_is_complete_and_consistent() -> None:
    doc = json.loads((ROOT / "asyncapi.json").read_text())
    assert doc["asyncapi"] == "3.0.0"
    assert doc["servers"]["nats"]["protocol"] == "nats"
    addresses = {c["address"]: c for c in doc["channels"].values() if c["address"]}
    assert set(addresses) == {s.pattern for s in CATALOGUE}
    for s in CATALOGUE:
        ch = addresses[s.pattern]
        assert set(ch.get("parameters", {})) == set(s.params)
    for ref in _refs(doc):
        assert ref.startswith("#/"), ref
        node: Any = doc
        for part in ref[2:].split("/"):
            assert part in node, f"dangling $ref {ref}"
            node = node[part]
    for kind, msg in doc["components"]["messages"].items():
        assert msg["contentType"] == "application/msgpack"
        assert msg["headers"]["properties"]["Phalanx-Kind"]["const"] == kind
        for ex in msg.get("examples", []):
            assert validate(msg["payload"], ex["payload"], doc) == []
    for name, op in doc["operations"].items():
        assert op["action"] in ("send", "receive"), name
        assert op["x-phalanx-service"] in name


def test_asyncapi_says_who_sends_and_receives_scheduler_signals() -> None:
    doc = json.loads((ROOT / "asyncapi.json").read_text())
    ops = doc["operations"]
    assert ops["scheduler-signal.send.capacity_changed"]["channel"] == {"$ref": "#/channels/capacity_changed"}
    # the planner acts on them; operators and custom policies read them too (PARTIES)
    assert ops["operator.receive.preemption_notice"]["action"] == "receive"
    assert ops["policy.receive.capacity_changed"]["action"] == "receive"
    assert any(k.startswith("elasticity-planner.receive.") and "capacity" in k for k in ops)
    assert "reply" in ops["state-replication.receive.health"]


def test_readme_explains_the_headers() -> None:
    text = (ROOT / "README.md").read_text()
    for word in (
        "Phalanx-Kind",
        "Phalanx-Schema",
        "Phalanx-Encoding",
        "Nats-Msg-Id",
        "traceparent",
        "generation",
    ):
        assert word in text
