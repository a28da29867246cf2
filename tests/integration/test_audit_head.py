"""A kernel publishes its log's audit chain head at intervals (docs/audit.md): a log line, a
signed webhook, an OpenTelemetry span event, each time the head moved; the head published
is then what `poimen audit verify --head` checks a later log against."""

from __future__ import annotations

import json
import logging
import threading
import time

import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from poimen import CallbackNotifier, Kernel, Notification, WebhookNotifier
from poimen.errors import PoimenError
from poimen.otel import OpenTelemetry
from tests.integration.test_audit_chain import app, check
from tests.integration.test_webhook import SECRET, Receiver, receiver  # noqa: F401


def wait_for(what: str, cond: object, within: float = 60.0) -> None:
    end = time.monotonic() + within
    while not cond():  # type: ignore[operator]
        assert time.monotonic() < end, f"never: {what}"
        time.sleep(0.02)


def test_a_kernel_publishes_its_head_each_time_it_moves(
    store_url: str, receiver: Receiver, caplog: pytest.LogCaptureFixture  # noqa: F811
) -> None:
    caplog.set_level(logging.INFO, logger="poimen.audit")
    notes: list[Notification] = []
    lock = threading.Lock()

    def got(n: Notification) -> None:
        with lock:
            notes.append(n)

    exporter = InMemorySpanExporter()
    tp = TracerProvider()
    tp.add_span_processor(SimpleSpanProcessor(exporter))
    k = Kernel(
        store_url,
        notifiers=[CallbackNotifier(got, name="audit-feed"),
                   WebhookNotifier(receiver.url, secret=SECRET)],
        observers=[OpenTelemetry(tracer_provider=tp)],
        audit_head_every=0.05,
    )
    app_kernel = app(store_url)  # writes the history the head moves over
    try:
        for i in range(3):
            app_kernel.call("add", {"n": i}, call_id=f"h/{i}")
        first = app_kernel.store.audit_head()
        assert first is not None and first.seq == 3
        k.launch()

        def published(seq: int) -> bool:
            with lock:
                return any(json.loads(n.payload)["audit_head"]["seq"] == seq for n in notes)

        wait_for("the head published", lambda: published(first.seq))
        app_kernel.call("add", {"n": 9}, call_id="h/9")
        second = app_kernel.store.audit_head()
        assert second is not None and second.seq == 4
        wait_for("the moved head published", lambda: published(second.seq))
        wait_for("the webhook", lambda: {first.seq, second.seq} <= {
            d.body["audit_head"]["seq"] for d in receiver.requests if d.status == 200})
    finally:
        k.close()
        app_kernel.close()
        tp.shutdown()
    with lock:
        seqs = [json.loads(n.payload)["audit_head"]["seq"] for n in notes]
        note = next(n for n in notes if json.loads(n.payload)["audit_head"]["seq"] == 3)
    assert seqs == sorted(set(seqs)), seqs  # once per head: only when it moved
    body = json.loads(note.payload)["audit_head"]
    assert (body["log_id"], body["seq"], body["hash"]) == (first.log_id, 3, first.hash)
    assert note.kind == "audit_head" and note.delivery_id == f"audit_head:{first.log_id}:3"
    # The webhook: signed like every notification, the head in its body.
    hook = next(d for d in receiver.requests if d.body["audit_head"]["seq"] == 3)
    assert hook.signature_ok and hook.body["kind"] == "audit_head"
    assert hook.body["audit_head"]["hash"] == first.hash
    # The log line: the head's token, as `poimen audit verify --head` takes it.
    lines = [r.getMessage() for r in caplog.records if r.name == "poimen.audit"]
    assert any(first.token() in line for line in lines), lines
    # The OpenTelemetry event, on a span of its own.
    spans = [s for s in exporter.get_finished_spans() if s.name == "poimen.audit_head"]
    attrs = [dict(s.events[0].attributes or {}) for s in spans]
    assert {"poimen.log_id": first.log_id, "poimen.audit.seq": 3,
            "poimen.audit.hash": first.hash} in attrs, attrs
    # What was published is a link of the log, later too.
    code, out, _ = check(store_url, "--head", first.token())
    assert code == 0 and "the published head is a link of it" in out, out


def test_publish_now_and_a_bad_interval(store_url: str) -> None:
    with pytest.raises(PoimenError, match="audit_head_every must be a positive number"):
        Kernel(store_url, notifiers=[], audit_head_every=0)
    k = app(store_url)
    try:
        k.call("add", {"n": 1}, call_id="now/1")
        head = k.publish_audit_head()
        assert head is not None and head == k.store.audit_head() and head.seq == 1
    finally:
        k.close()
