"""SIGTERM to `python -m jpaged serve`: a stream still running when the shutdown timeout
ends gets its final event and `data: [DONE]`, then the process exits without an error."""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys

import pytest

from tests.plugins.http_server import http_connection, wait_until_healthy

# A server process of its own: the full tier.
pytestmark = pytest.mark.full


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_sigterm_ends_a_running_stream_with_its_final_event_and_done(tiny_llama_dir):
    port = _free_port()
    process = subprocess.Popen(
        [sys.executable, "-m", "jpaged", "serve", "--model", str(tiny_llama_dir),
         "--port", str(port), "--served-model-name", "tiny", "--max-model-len", "256",
         "--block-size", "8", "--num-blocks", "64", "--shutdown-timeout", "0"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    base_url = f"http://127.0.0.1:{port}"
    try:
        wait_until_healthy(base_url, process)
        connection = http_connection(base_url)
        body = {"model": "tiny", "prompt": "the", "max_tokens": 240, "ignore_eos": True,
                "stream": True}
        connection.request("POST", "/v1/completions", json.dumps(body),
                           {"Content-Type": "application/json"})
        response = connection.getresponse()
        first = response.readline()
        assert first.startswith(b"data: {"), first
        process.send_signal(signal.SIGTERM)
        lines = [line.decode().strip() for line in response.read().splitlines()]
        data = [line.removeprefix("data: ") for line in lines if line]
        assert data[-1] == "[DONE]"
        final = json.loads(data[-2])
        assert "error" in final and "stopped" in final["error"]["message"], final
        streamed = [json.loads(line) for line in [first.decode()[6:]] + data[:-2]]
        assert all(chunk["choices"][0]["finish_reason"] is None for chunk in streamed)
        assert sum(len(chunk["choices"][0]["text"]) > 0 for chunk in streamed) < 240
        # uvicorn from 0.29 re-raises the signal it handled once it has shut down.
        assert process.wait(60) in (0, -signal.SIGTERM)
    finally:
        if process.poll() is None:
            process.kill()
        _, stderr = process.communicate(timeout=60)
    assert "Traceback" not in stderr, stderr
