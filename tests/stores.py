"""Rendezvous stores for tests: Phalanx's store hosted in the test's process, and clients
that proved a generation's secret on it (a key ``<secret>/...`` is then theirs)."""

from __future__ import annotations

from phalanx.runtime.comm import connect_store
from phalanx.runtime.store import host_store
from phalanx.runtime.storeclient import StoreClient
from phalanx.runtime.storeserver import ThreadedStore

SECRET = "test-generation-s3cret"
"""A generation's secret for tests whose plans need one."""


def hosted(*secrets: str) -> ThreadedStore:
    """A store on 127.0.0.1 serving the generations of ``secrets``."""
    return host_store("127.0.0.1", secrets=secrets)


def addr(store: ThreadedStore) -> str:
    return f"127.0.0.1:{store.port}"


def member(store: ThreadedStore | str, secret: str, timeout_s: float = 30.0) -> StoreClient:
    """A client of ``store`` that proved ``secret``: its keys are ``<secret>/...``."""
    client = connect_store(store if isinstance(store, str) else addr(store), timeout_s)
    client.prove(secret)
    return client
