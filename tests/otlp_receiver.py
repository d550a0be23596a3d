"""A minimal OTLP/HTTP trace receiver for tests: what a collector (Jaeger's :4318)
would get from Phalanx's processes, decoded from the protobuf that arrived.

``POST /v1/traces`` with an ``ExportTraceServiceRequest`` (gzip or not) is
answered ``200`` with an empty ``ExportTraceServiceResponse``; every span is kept
with its resource's ``service.name``::

    with OtlpReceiver() as rx:           # 127.0.0.1, a free port
        env["OTEL_EXPORTER_OTLP_ENDPOINT"] = rx.endpoint
        ...
        rx.spans()                       # [ReceivedSpan(service, trace_id, name, ...)]
"""

from __future__ import annotations

import gzip
import threading
import zlib
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import TracebackType
from typing import Any

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from opentelemetry.proto.common.v1.common_pb2 import AnyValue


@dataclass(frozen=True)
class ReceivedSpan:
    service: str
    instance: str  # service.instance.id: host:pid
    trace_id: str
    span_id: str
    parent_id: str
    name: str
    start_ns: int
    end_ns: int
    attributes: dict[str, Any]


def _value(v: AnyValue) -> Any:
    kind = v.WhichOneof("value")
    if kind == "array_value":
        return [_value(x) for x in v.array_value.values]
    if kind == "kvlist_value":
        return {kv.key: _value(kv.value) for kv in v.kvlist_value.values}
    return getattr(v, kind) if kind else None


class OtlpReceiver:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._spans: list[ReceivedSpan] = []
        self.requests = 0
        self.gzipped = 0
        self.rejected = 0
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                try:
                    if self.path != "/v1/traces":
                        raise ValueError(f"unknown path {self.path}")
                    encoding = (self.headers.get("Content-Encoding") or "").lower()
                    if encoding == "gzip":
                        body = gzip.decompress(body)
                    elif encoding == "deflate":
                        body = zlib.decompress(body)
                    elif encoding:
                        raise ValueError(f"unknown Content-Encoding {encoding}")
                    req = ExportTraceServiceRequest()
                    req.ParseFromString(body)
                except Exception as exc:
                    with receiver._lock:
                        receiver.rejected += 1
                    self.send_error(400, str(exc))
                    return
                receiver._take(req, gzipped=encoding == "gzip")
                payload = ExportTraceServiceResponse().SerializeToString()
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(payload)))
                self.end_headers()
                self.wfile.write(payload)

            def log_message(self, format: str, *args: Any) -> None:
                pass

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, name="otlp-receiver", daemon=True)

    @property
    def endpoint(self) -> str:
        """The base endpoint (``OTEL_EXPORTER_OTLP_ENDPOINT``): the SDK appends ``/v1/traces``."""
        return f"http://127.0.0.1:{self._server.server_port}"

    def _take(self, req: ExportTraceServiceRequest, *, gzipped: bool) -> None:
        out = []
        for rs in req.resource_spans:
            res = {kv.key: _value(kv.value) for kv in rs.resource.attributes}
            for ss in rs.scope_spans:
                for s in ss.spans:
                    out.append(
                        ReceivedSpan(
                            service=str(res.get("service.name", "")),
                            instance=str(res.get("service.instance.id", "")),
                            trace_id=s.trace_id.hex(),
                            span_id=s.span_id.hex(),
                            parent_id=s.parent_span_id.hex(),
                            name=s.name,
                            start_ns=s.start_time_unix_nano,
                            end_ns=s.end_time_unix_nano,
                            attributes={kv.key: _value(kv.value) for kv in s.attributes},
                        )
                    )
        with self._lock:
            self.requests += 1
            self.gzipped += gzipped
            self._spans.extend(out)

    def spans(self) -> list[ReceivedSpan]:
        with self._lock:
            return list(self._spans)

    def start(self) -> OtlpReceiver:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(5)

    def __enter__(self) -> OtlpReceiver:
        return self.start()

    def __exit__(
        self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()
