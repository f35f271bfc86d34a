"""The fake provider as its own process, driven over HTTP as other processes
(Celery workers, docker-compose services) will drive it."""

from __future__ import annotations

import http.client
import json
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from typing import Any
from urllib.parse import urlsplit

import openai
import pytest

from budget_tasks.providers import classify
from budget_tasks.providers.outcomes import ErrorOutcome
from budget_tasks.providers.registry import openai_client
from tests.support.sdk_calls import openai_chat


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def control(url: str, path: str, body: dict[str, Any] | None = None) -> Any:
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(
        f"{url}/_fake/{path}", data=data, method="POST" if data is not None else "GET"
    )
    with urllib.request.urlopen(request, timeout=5) as response:
        return json.loads(response.read())


@pytest.fixture
def process() -> Iterator[str]:
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "budget_tasks.testing.fake_provider", "--port", str(port)],
        stdout=subprocess.PIPE,
        text=True,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 20
        while True:
            try:
                control(url, "state")
                break
            except OSError:
                if time.monotonic() > deadline or proc.poll() is not None:
                    raise
                time.sleep(0.1)
        yield url
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def test_served_counted_and_faults_planned_over_http(process: str) -> None:
    client = openai_client(base_url=f"{process}/v1", api_key="x", timeout=5.0)
    prompt = [{"role": "user", "content": "hi"}]
    first = openai_chat(
        client,
        key="p-1",
        model="gpt-4o-mini",
        messages=prompt,
        max_completion_tokens=16,
        store_for_lookup=False,
    )
    control(process, "faults", {"fault": "status=429", "count": 1})
    with pytest.raises(openai.RateLimitError) as info:
        openai_chat(
            client, key="p-2", model="gpt-4o-mini", messages=prompt, max_completion_tokens=16
        )
    assert classify(info.value) is ErrorOutcome.RATE_LIMITED
    openai_chat(
        client,
        key="p-3",
        model="gpt-4o-mini",
        messages=prompt,
        max_completion_tokens=16,
        store_for_lookup=False,
    )  # the planned fault was used up
    state = control(process, "state")
    assert state["by_key"] == {"p-1": 1, "p-2": 1, "p-3": 1}
    assert [r["status"] for r in state["requests"]] == [200, 429, 200]
    assert state["billed_total"] == 2 * first.cost
    # p-1 and p-3 sent the same body (only their Idempotency-Key differs): counted twice
    assert sorted(state["by_body"].values()) == [1, 2]
    control(process, "reset", {})
    assert control(process, "state")["requests"] == []


def test_answers_on_a_kept_alive_connection_do_not_wait_for_a_delayed_ack(process: str) -> None:
    """TCP_NODELAY on the fake's side: an answer goes out as two writes (headers, then
    body), and with Nagle on the second waits for the client's delayed ACK, ~40 ms on
    every request after the first on a connection. The fastest of several requests
    shows it: load can slow a request down, never make one skip the stall."""
    parts = urlsplit(process)
    body = json.dumps(
        {
            "model": "gpt-4o-mini",
            "max_completion_tokens": 16,
            "messages": [{"role": "user", "content": "hi"}],
        }
    )
    conn = http.client.HTTPConnection(parts.hostname or "127.0.0.1", parts.port, timeout=5)
    took = []
    try:
        for _ in range(8):
            started = time.perf_counter()
            conn.request("POST", "/v1/chat/completions", body, {"Content-Type": "application/json"})
            response = conn.getresponse()
            assert response.status == 200
            response.read()
            took.append(time.perf_counter() - started)
    finally:
        conn.close()
    assert min(took[1:]) < 0.02, [round(t * 1e3, 1) for t in took]
