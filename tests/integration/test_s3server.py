"""phalanx.devstack.s3server: a real moto S3 server process, reached through obstore."""

from __future__ import annotations

import os
import urllib.request

import obstore
import pytest
from obstore.store import S3Store

from phalanx.devstack.s3server import S3Server, S3ServerError


def store(srv: S3Server, bucket: str) -> S3Store:
    env = srv.env()
    return S3Store(
        bucket,
        endpoint=srv.endpoint,
        access_key_id=env["AWS_ACCESS_KEY_ID"],
        secret_access_key=env["AWS_SECRET_ACCESS_KEY"],
        region=env["AWS_REGION"],
        client_options={"allow_http": True},
    )


def test_server_answers_and_lists_created_bucket(s3_server: S3Server) -> None:
    assert s3_server.endpoint.startswith("http://127.0.0.1:")
    s3_server.create_bucket("answers")
    s3_server.create_bucket("answers")  # an existing bucket is kept
    with urllib.request.urlopen(s3_server.endpoint + "/", timeout=5) as r:
        assert r.status == 200
        assert b"<Name>answers</Name>" in r.read()


def test_obstore_round_trip(s3_server: S3Server) -> None:
    s3_server.create_bucket("roundtrip")
    s = store(s3_server, "roundtrip")
    small = b"phalanx" * 10
    big = os.urandom(12 << 20)  # over obstore's 5 MiB chunk: a multipart upload
    obstore.put(s, "ckpt/small.bin", small)
    obstore.put(s, "ckpt/big.bin", memoryview(big))
    assert bytes(obstore.get(s, "ckpt/small.bin").bytes()) == small
    assert bytes(obstore.get(s, "ckpt/big.bin").bytes()) == big
    assert bytes(obstore.get_range(s, "ckpt/big.bin", start=5 << 20, length=4096)) == big[5 << 20 :][:4096]
    listed = {m["path"]: m["size"] for m in obstore.list(s, "ckpt").collect()}
    assert listed == {"ckpt/small.bin": len(small), "ckpt/big.bin": len(big)}
    obstore.delete(s, ["ckpt/small.bin", "ckpt/big.bin"])
    assert obstore.list(s, "ckpt").collect() == []


def test_stop_leaves_no_process() -> None:
    srv = S3Server().start()
    assert srv.proc is not None
    pid, endpoint = srv.proc.pid, srv.endpoint
    srv.stop()
    assert srv.proc is None
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)  # exited and reaped
    with pytest.raises(OSError):
        urllib.request.urlopen(endpoint + "/", timeout=2)
    with pytest.raises(S3ServerError, match="not running"):
        srv.create_bucket("gone")
