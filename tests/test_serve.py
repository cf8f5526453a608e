"""`strata serve` end to end: a real uvicorn server on 127.0.0.1, driven by the official `openai` client.

The model is tests/test_scheduler.py's tiny random qwen3moe with SmolLM2's tokenizer and chat template;
every expected text comes from the engine itself, one request at a time.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import threading
import time

import httpx
import openai
import pytest
import torch

pytest.importorskip("fastapi")
uvicorn = pytest.importorskip("uvicorn")

from strata.serve.app import create_app  # noqa: E402
from strata.serve.cli import parser as serve_parser  # noqa: E402
from test_scheduler import CTX, tiny_chat_engine  # noqa: E402

MODEL = "tiny-chat"
KEY = "sk-test-key"
MESSAGES = [{"role": "user", "content": "Write a haiku about batching."}]


@contextlib.contextmanager
def serving(app):
    """Run `app` with uvicorn in a thread on a free loopback port; yield its base URL."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="on"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.time() + 20
    while not server.started:
        assert thread.is_alive() and time.time() < deadline, "the server did not start"
        time.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(10)
        sock.close()


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny matrices: threads only contend (the scheduler copies this)
    yield tiny_chat_engine(tmp_path_factory)
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def server(engine):
    app = create_app(engine, MODEL, api_key=KEY, max_concurrent=8)
    with serving(app) as url:
        yield url, app


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server[0] + "/v1", api_key=KEY, max_retries=0, timeout=60)


def chat_ids(engine, messages=MESSAGES) -> list[int]:
    return engine.tokenizer.encode(engine.tokenizer.apply_chat_template(messages), add_special_tokens=False)


def alone(engine, ids, n) -> tuple[str, int]:
    """Text and token count of `ids` generated greedily on its own, without the server."""
    out = engine.generate(ids, max_new_tokens=n)
    return engine.tokenizer.decode(out, skip_special_tokens=True), len(out)


def metric(url: str, name: str) -> float:
    for line in httpx.get(url + "/metrics").text.splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    raise KeyError(name)


def wait_for(predicate, timeout=10.0) -> bool:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if predicate():
            return True
        time.sleep(0.02)
    return predicate()


def test_cli_defaults_bind_loopback():
    args = serve_parser().parse_args(["--model", "m.gguf"])
    assert (args.host, args.port, args.max_concurrent) == ("127.0.0.1", 8080, 8)


def test_models_health_metrics(engine, server, client):
    url, _ = server
    assert [m.id for m in client.models.list().data] == [MODEL]
    assert client.models.retrieve(MODEL).id == MODEL
    assert httpx.get(url + "/health").json()["status"] == "ok"
    engine.stats["expert_cache_hits"] = 5  # the tiered runtime's stats come out as gauges
    try:
        text = httpx.get(url + "/metrics").text
    finally:
        del engine.stats["expert_cache_hits"]
    assert "\nstrata_expert_cache_hits 5\n" in text
    for name in ("strata_generated_tokens_total", "strata_tokens_per_second", "strata_queue_length",
                 "strata_active_requests", 'strata_requests_finished_total{reason="stop"}'):
        assert name in text
    assert "# TYPE strata_generated_tokens_total counter" in text


def test_chat_completion_plain_and_streamed(engine, client):
    ids = chat_ids(engine)
    want, n = alone(engine, ids, 12)
    r = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=12, temperature=0)
    assert r.object == "chat.completion" and r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content == want
    assert r.choices[0].finish_reason == ("length" if n == 12 else "stop")
    assert (r.usage.prompt_tokens, r.usage.completion_tokens, r.usage.total_tokens) == (len(ids), n, len(ids) + n)

    chunks = list(client.chat.completions.create(model=MODEL, messages=MESSAGES, max_completion_tokens=12,
                                                 temperature=0, stream=True,
                                                 stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == want
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == \
        [r.choices[0].finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == n


def test_completion_text_and_token_prompts(engine, client):
    text = "The three laws of batching are"
    ids = engine.tokenizer.encode(text)
    want, n = alone(engine, ids, 10)
    r = client.completions.create(model=MODEL, prompt=text, max_tokens=10, temperature=0)
    assert r.choices[0].text == want and r.usage.prompt_tokens == len(ids) and r.usage.completion_tokens == n
    r = client.completions.create(model=MODEL, prompt=ids, max_tokens=10, temperature=0)
    assert r.choices[0].text == want
    chunks = list(client.completions.create(model=MODEL, prompt=ids, max_tokens=10, temperature=0, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == want
    assert chunks[-1].choices[0].finish_reason == r.choices[0].finish_reason


def test_stop_strings(engine, client):
    ids = chat_ids(engine)
    full, _ = alone(engine, ids, 16)
    stop = full[len(full) // 2: len(full) // 2 + 2]
    want = full[: full.index(stop)]
    r = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=16, temperature=0,
                                       stop=[stop, "never-appears"])
    assert r.choices[0].message.content == want and r.choices[0].finish_reason == "stop"
    chunks = list(client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=16, temperature=0,
                                                 stop=stop, stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == want
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_seed_reproducible_with_temperature(client):
    def run(seed):
        return client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=12, temperature=1.0,
                                              top_p=0.95, seed=seed).choices[0].message.content

    first = run(7)
    assert run(7) == first and run(8) != first


def test_errors_in_openai_shape(engine, server, client):
    url, _ = server
    with pytest.raises(openai.AuthenticationError) as e:
        openai.OpenAI(base_url=url + "/v1", api_key="wrong", max_retries=0).models.list()
    assert e.value.status_code == 401 and e.value.code == "invalid_api_key"
    r = httpx.post(url + "/v1/chat/completions", json={"model": MODEL, "messages": MESSAGES})
    assert r.status_code == 401 and set(r.json()["error"]) == {"message", "type", "param", "code"}

    with pytest.raises(openai.NotFoundError) as e:
        client.chat.completions.create(model="gpt-nope", messages=MESSAGES, max_tokens=2)
    assert e.value.code == "model_not_found"

    headers = {"Authorization": f"Bearer {KEY}"}
    r = httpx.post(url + "/v1/chat/completions", content=b"{not json", headers=headers)
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
    for body, param in [({"model": MODEL}, "messages"), ({"model": MODEL, "messages": MESSAGES, "temperature": -1}, "temperature"),
                        ({"model": MODEL, "messages": MESSAGES, "n": 2}, "n"),
                        ({"model": MODEL, "messages": MESSAGES, "max_tokens": 0}, "max_tokens"),
                        ({"model": MODEL, "messages": MESSAGES, "stop": 5}, "stop"),
                        ({"model": MODEL, "prompt": {"x": 1}}, "prompt")]:
        endpoint = "/v1/completions" if "prompt" in body else "/v1/chat/completions"
        r = httpx.post(url + endpoint, json=body, headers=headers)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, (body, r.text)

    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt=[5] * CTX, max_tokens=4)
    assert e.value.code == "context_length_exceeded" and e.value.param == "prompt"
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi " * CTX}])
    assert e.value.code == "context_length_exceeded"

    r = httpx.get(url + "/v1/nothing-here", headers=headers)
    assert r.status_code == 404 and "error" in r.json()


def test_queue_full_disconnect_and_shutdown(engine):
    """max_concurrent=1 and no queue: a long stream holds the one slot; closing it frees the slot."""
    app = create_app(engine, MODEL, max_concurrent=1, max_waiting=0)
    sched = app.state.scheduler
    sched.eos_ids = set()  # the long stream must not end on its own
    with serving(app) as url:
        c = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60)
        stream = c.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=CTX, temperature=0,
                                           stream=True)
        next(iter(stream))  # the request holds the slot and decodes on
        assert metric(url, "strata_active_requests") == 1
        with pytest.raises(openai.RateLimitError) as e:
            c.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=2)
        assert e.value.status_code == 429 and e.value.response.headers.get("retry-after")
        assert metric(url, 'strata_requests_rejected_total{reason="queue_full"}') == 1

        stream.close()  # the client leaves mid-stream
        assert wait_for(lambda: metric(url, "strata_active_requests") == 0)
        assert metric(url, 'strata_requests_finished_total{reason="cancelled"}') == 1
        assert sched.stats()["generated_tokens"] < CTX // 2  # it stopped, it did not run to the end
        r = c.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=3, temperature=0)
        assert r.usage.completion_tokens <= 3  # the slot is free again

        # a non-streaming client that gives up is cancelled too
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(url + "/v1/completions", json={"model": MODEL, "prompt": "a", "max_tokens": CTX - 8},
                       timeout=0.5)
        assert wait_for(lambda: metric(url, 'strata_requests_finished_total{reason="cancelled"}') == 2)
        assert metric(url, "strata_active_requests") == 0

        sched.close()
        with pytest.raises(openai.InternalServerError) as e:
            c.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=2)
        assert e.value.status_code == 503 and e.value.code == "service_unavailable"
        assert httpx.get(url + "/health").status_code == 503


def test_sixteen_concurrent_requests_equal_each_alone(engine, server):
    url, _ = server
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(100, 49000, (2 + 3 * i,), generator=g).tolist() for i in range(16)]
    lengths = [4 + (7 * i) % 13 for i in range(16)]
    want = [alone(engine, p, n) for p, n in zip(prompts, lengths)]

    async def run():
        c = openai.AsyncOpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0, timeout=120)
        try:
            return await asyncio.gather(*[
                c.completions.create(model=MODEL, prompt=p, max_tokens=n, temperature=0)
                for p, n in zip(prompts, lengths)])
        finally:
            await c.close()

    got = asyncio.run(run())
    assert [(r.choices[0].text, r.usage.completion_tokens) for r in got] == want


def test_sse_wire_format(server):
    url, _ = server
    body = {"model": MODEL, "prompt": "Hi", "max_tokens": 3, "temperature": 0, "stream": True}
    with httpx.stream("POST", url + "/v1/completions", json=body,
                      headers={"Authorization": f"Bearer {KEY}"}) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        events = [line for line in r.iter_lines() if line]
    assert all(e.startswith("data: ") for e in events) and events[-1] == "data: [DONE]"
    assert json.loads(events[0][6:])["object"] == "text_completion"


# -- one bad request never stops the server ------------------------------------------------------

BAD_SAMPLING = [({"temperature": 1e-300}, "temperature"), ({"repetition_penalty": 1e-300}, "repetition_penalty"),
                ({"seed": 2**64}, "seed"), ({"seed": 10**30}, "seed")]


def test_bad_sampling_values_get_400_and_the_server_goes_on(engine, server, client):
    url, _ = server
    ids = chat_ids(engine)
    want, _ = alone(engine, ids, 12)
    for values, param in BAD_SAMPLING:
        fields = {k: v for k, v in values.items() if k != "repetition_penalty"}
        extra = {k: v for k, v in values.items() if k == "repetition_penalty"}
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=12, extra_body=extra,
                                           **fields)
        assert e.value.status_code == 400 and e.value.param == param, values
        assert httpx.get(url + "/health").status_code == 200
    headers = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}
    for raw in (b'"temperature": NaN', b'"top_p": Infinity', b'"temperature": 1e999', b'"min_p": -0.0e1, "top_k": 1.5'):
        body = b'{"model": "%s", "messages": [{"role": "user", "content": "x"}], %s}' % (MODEL.encode(), raw)
        r = httpx.post(url + "/v1/chat/completions", content=body, headers=headers)
        assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error", (raw, r.text)
    r = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=12, temperature=0)
    assert r.choices[0].message.content == want
    assert httpx.get(url + "/health").status_code == 200


def test_a_request_that_fails_inside_the_scheduler_ends_alone(engine, server, client):
    """Values that slip past validation (here forced in) fail their own request; the rest go on."""
    from strata.runtime.sampling import SamplingParams

    url, app = server
    sched = app.state.scheduler
    ids = chat_ids(engine)
    want, _ = alone(engine, ids, 12)
    for field_, value in [("temperature", 1e-300), ("repetition_penalty", 1e-300), ("seed", 2**64)]:
        params = SamplingParams(temperature=1.0)
        object.__setattr__(params, field_, value)  # what validation now refuses, as if it had not
        bad = sched.submit(ids, 8, params)
        good = sched.submit(ids, 12, SamplingParams())
        with pytest.raises(Exception):
            bad.text()
        good.text()
        assert bad.error is not None and engine.tokenizer.decode(good.token_ids, skip_special_tokens=True) == want
    assert httpx.get(url + "/health").status_code == 200
    r = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=12, temperature=0)
    assert r.choices[0].message.content == want


@pytest.mark.parametrize("route, body", [
    ("/v1/chat/completions", {"messages": MESSAGES}),
    ("/v1/completions", {"prompt": "Hi"}),
])
def test_a_streamed_request_that_fails_ends_with_an_error_event(engine, server, client, monkeypatch, route, body):
    """A failure inside the scheduler reaches a streaming client as one SSE error event (no traceback,
    no `[DONE]`), and the next request is served."""
    from strata.runtime.sampling import SamplingParams

    url, app = server
    sched = app.state.scheduler
    submit = sched.submit

    def failing_submit(ids, max_tokens, params, *rest):
        bad = SamplingParams(temperature=1.0)
        object.__setattr__(bad, "temperature", 1e-300)  # what validation refuses, as if it had not
        return submit(ids, max_tokens, bad, *rest)

    monkeypatch.setattr(sched, "submit", failing_submit)
    request = {"model": MODEL, "max_tokens": 6, "stream": True, "stream_options": {"include_usage": True}, **body}
    with httpx.stream("POST", url + route, json=request, headers={"Authorization": f"Bearer {KEY}"}) as r:
        events = [line for line in r.iter_lines() if line]
    monkeypatch.setattr(sched, "submit", submit)
    assert events and all(e.startswith("data: ") for e in events) and "data: [DONE]" not in events
    error = json.loads(events[-1][6:])["error"]
    assert error["type"] == "server_error" and "generation failed" in error["message"]
    r = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=4, temperature=0)
    assert r.choices[0].message.content


def _rss_peak_kb() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmHWM:"))


def test_nested_json_and_oversized_bodies(engine):
    limit = 1 << 20
    app = create_app(engine, MODEL, max_body_bytes=limit)
    headers = {"Content-Type": "application/json"}
    with serving(app) as url:
        r = httpx.post(url + "/v1/completions", content=b"[" * 100_000, headers=headers)
        assert r.status_code == 400 and "nested" in r.json()["error"]["message"]
        r = httpx.post(url + "/v1/completions", content=b'{"model": "%s", "prompt": %s}'
                       % (MODEL.encode(), b"[" * 50_000 + b"]" * 50_000), headers=headers)
        assert r.status_code == 400

        def chunked(total=64 << 20, piece=64 << 10):  # no Content-Length: the server counts as it reads
            yield b'{"model": "' + MODEL.encode() + b'", "prompt": "'
            for _ in range(total // piece):
                yield b"a" * piece

        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")  # resets VmHWM, so the peak below is this request's
        except OSError:
            pass
        before = _rss_peak_kb()
        start = time.time()
        r = httpx.post(url + "/v1/completions", content=chunked(), headers=headers, timeout=30)
        assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"
        assert time.time() - start < 10 and _rss_peak_kb() - before < 64 << 10  # KiB: under 64 MiB more

        with pytest.raises(httpx.TransportError):  # ... or a 413 read before the send failed
            r = httpx.post(url + "/v1/completions", content=b"x" * (16 << 20), headers=headers, timeout=30)
            assert r.status_code == 413
            raise httpx.TransportError("answered 413 before the body was sent")
        r = httpx.post(url + "/v1/completions", json={"model": MODEL, "prompt": "a" * (limit // 2), "max_tokens": 1})
        assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
        assert httpx.get(url + "/health").status_code == 200
