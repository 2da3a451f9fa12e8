"""Prometheus metrics: engine load (read from tts.stats() at scrape time), latency, real-time factor, requests."""
from __future__ import annotations

import time
from typing import Callable

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import GaugeMetricFamily, SummaryMetricFamily
from starlette.types import ASGIApp, Message, Receive, Scope, Send

PREFIX = "nano_qwen3tts"


class _EngineCollector:
    def __init__(self, stats: Callable[[], dict], in_flight: Callable[[], int]):
        self.stats, self.in_flight = stats, in_flight

    def collect(self):
        s = self.stats()
        for key, doc in (("running", "Requests the engine is generating."),
                         ("waiting", "Requests queued in the engine's scheduler."),
                         ("kv_usage", "Fraction of KV-cache blocks in use (0..1)."),
                         ("kv_blocks_free", "Free KV-cache blocks."),
                         ("kv_blocks_total", "KV-cache blocks in all."),
                         ("preemptions", "Sequences preempted since start."),
                         ("codec_streams", "Live streams holding a streaming decoder slot."),
                         ("codec_streams_max", "Streaming decoder slots in all (more streams get 429)."),
                         ("alive", "1 while the engine runs.")):
            name = {"running": "requests_running", "waiting": "requests_waiting"}.get(key, key)
            yield GaugeMetricFamily(f"{PREFIX}_{name}", doc, value=float(s.get(key, 0)))
        n = s.get("first_frames", 0)
        yield SummaryMetricFamily(f"{PREFIX}_request_queue_seconds", "From submission to the engine to the first "
                                  "prefill, over the requests that reached their first frame.", count_value=n,
                                  sum_value=s.get("queued_seconds_sum", 0.0))
        yield SummaryMetricFamily(f"{PREFIX}_time_to_first_frame_seconds", "From submission to the engine to the "
                                  "first generated frame (before any audio decoding).", count_value=n,
                                  sum_value=s.get("first_frame_seconds_sum", 0.0))
        yield SummaryMetricFamily(f"{PREFIX}_first_chunk_decode_seconds", "From a stream's first chunk of frames "
                                  "to its decoded audio: the codec's share of time to first audio.",
                                  count_value=s.get("first_chunks", 0),
                                  sum_value=s.get("first_chunk_decode_seconds_sum", 0.0))
        yield GaugeMetricFamily(f"{PREFIX}_requests_in_flight", "Speech requests the server holds (queue depth "
                                "for --max-queue), including those still being validated or encoded.",
                                value=float(self.in_flight()))


class Metrics:
    def __init__(self, stats: Callable[[], dict], in_flight: Callable[[], int]):
        self.registry = CollectorRegistry()  # one per app, so several apps can live in one process
        self.registry.register(_EngineCollector(stats, in_flight))
        self.requests = Counter(f"{PREFIX}_http_requests", "HTTP requests by route and status code.",
                                ["route", "status"], registry=self.registry)
        self.speech_outcomes = Counter(f"{PREFIX}_speech_outcomes", "Speech responses by how they ended: "
                                       "completed, disconnected (client left; request aborted) or error.",
                                       ["outcome"], registry=self.registry)
        self.ttfa = Histogram(f"{PREFIX}_time_to_first_audio_seconds",
                              "From the request's arrival (before its body is read) to its first audio.",
                              buckets=(.025, .05, .1, .15, .2, .3, .5, .75, 1, 1.5, 2, 3, 5, 10, 20),
                              registry=self.registry)
        self.ttfb = Histogram(f"{PREFIX}_time_to_first_byte_seconds", "Streamed responses: from the request's "
                              "arrival to its first audio bytes handed to the HTTP server for sending.",
                              buckets=(.025, .05, .1, .15, .2, .3, .5, .75, 1, 1.5, 2, 3, 5, 10, 20),
                              registry=self.registry)
        self.rtf = Histogram(f"{PREFIX}_real_time_factor", "Generation wall time / audio duration (<1 is "
                             "faster than real time).", buckets=(.05, .1, .2, .3, .5, .75, 1, 1.5, 2, 5, 10),
                             registry=self.registry)
        self.audio_seconds = Counter(f"{PREFIX}_audio_seconds", "Seconds of audio produced.", registry=self.registry)


class RequestCounter:
    """ASGI middleware counting every HTTP response by route template and status code. It also stamps the
    request's arrival (`request.state.arrived`, time.perf_counter()) before the body is read and validated, so
    latencies measured from it include that work."""

    def __init__(self, app: ASGIApp, metrics: Metrics):
        self.app, self.metrics = app, metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        scope.setdefault("state", {})["arrived"] = time.perf_counter()
        status = [500]

        async def record_status(message: Message) -> None:
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)
        try:
            await self.app(scope, receive, record_status)
        finally:
            route = getattr(scope.get("route"), "path", "unmatched")  # a template: bounded label values
            self.metrics.requests.labels(route, str(status[0])).inc()
