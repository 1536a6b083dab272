"""``specmemo serve`` end to end: the real ``openai`` client against the real server (uvicorn
on a thread, a free port), on a tiny random-weight model with random heads (greedy, fp32),
and one test on the real default model."""

from __future__ import annotations

import json
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest
import torch

from specmemo_core.runtime.engine import Engine
from specmemo_core.runtime.heads import random_heads
from specmemo_core.serving.api import ApiOptions
from specmemo_core.serving.served import ServedModel, serve_engine
from specmemo_core.serving.server import LocalServer, ServerAddress
from specmemo_core.storage.sources import ModelIdentity
from tests.tiny import tiny_config, tiny_model, tiny_tokenizer

PROMPTS = ["Hello, how are you today?", "The quick brown fox", "Speculative decoding drafts tokens",
           "Memory budgets: weights", "I am fine, thank you!", "lazy dog", "Hello", "verifies them in one"]


@pytest.fixture(scope="module")
def engine() -> Engine:
    torch.set_num_threads(1)  # NOTE: the 2-core CI machine is shared
    heads = random_heads(5, 64, 300, seed=7)
    return Engine(tiny_model(), tiny_tokenizer(), tiny_config(), ModelIdentity("tiny", "0" * 16), heads,
                  None).with_tree("medusa-64")


def start(engine: Engine, *, options: ApiOptions = ApiOptions(), max_waiting: int = 32) -> LocalServer:
    return LocalServer(serve_engine(engine, capacity=1024, max_waiting=max_waiting), ServerAddress(port=0),
                       options).start()


@pytest.fixture(scope="module")
def server(engine: Engine):
    running = start(engine)
    yield running
    running.stop()


def client_of(server: LocalServer, key: str = "anything") -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url, api_key=key, max_retries=0, timeout=60)


@pytest.fixture
def client(server: LocalServer) -> openai.OpenAI:
    return client_of(server)


def ask(client: openai.OpenAI, prompt: str, **kw):
    return client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": prompt}],
                                          **{"max_tokens": 24, "temperature": 0, **kw})


def streamed(client: openai.OpenAI, prompt: str, **kw) -> tuple[str, list]:
    chunks = list(ask(client, prompt, stream=True, **kw))
    return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices), chunks


def test_models_and_a_chat_completion(client: openai.OpenAI) -> None:
    assert [m.id for m in client.models.list().data] == ["tiny"]
    assert client.models.retrieve("tiny").id == "tiny"
    with pytest.raises(openai.NotFoundError, match="not served here"):
        client.models.retrieve("llama-70b")
    reply = ask(client, PROMPTS[0])
    choice = reply.choices[0]
    assert choice.message.role == "assistant" and choice.message.content
    assert choice.finish_reason in ("stop", "length") and reply.object == "chat.completion"
    assert reply.usage.completion_tokens <= 24 and reply.usage.prompt_tokens > 5
    assert reply.specmemo["tree"] == "medusa-64" and reply.specmemo["mean_accepted"] >= 1.0


def test_a_stream_is_the_same_reply_in_openai_chunks(client: openai.OpenAI) -> None:
    whole = ask(client, PROMPTS[1])
    text, chunks = streamed(client, PROMPTS[1], stream_options={"include_usage": True})
    assert text == whole.choices[0].message.content
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-2].choices[0].finish_reason == whole.choices[0].finish_reason
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    assert all(c.usage is None for c in chunks[:-1])


def test_stop_strings_cut_the_reply(client: openai.OpenAI) -> None:
    full = ask(client, PROMPTS[0], max_tokens=40).choices[0].message.content
    stop = full[6:9]
    expected = full[:full.find(stop)]
    cut = ask(client, PROMPTS[0], max_tokens=40, stop=[stop, "never appears"])
    assert cut.choices[0].message.content == expected and cut.choices[0].finish_reason == "stop"
    assert streamed(client, PROMPTS[0], max_tokens=40, stop=stop)[0] == expected


def test_sampling_follows_the_seed_and_top_p(client: openai.OpenAI) -> None:
    """Sampled replies repeat with their seed; a nucleus of one token is the greedy reply."""
    first, again, other = (ask(client, PROMPTS[4], temperature=1.0, seed=s).choices[0].message.content
                           for s in (11, 11, 12))
    assert first == again and first != other
    narrow = ask(client, PROMPTS[4], temperature=1.0, top_p=1e-9, seed=3).choices[0].message.content
    assert narrow == ask(client, PROMPTS[4]).choices[0].message.content


@pytest.mark.parametrize("clients", [2, 8])
def test_concurrent_streams_each_get_the_reply_they_get_alone(client: openai.OpenAI, clients: int) -> None:
    alone = [ask(client, p, max_tokens=16).choices[0].message.content for p in PROMPTS[:clients]]
    with ThreadPoolExecutor(clients) as pool:
        together = list(pool.map(lambda p: streamed(client, p, max_tokens=16)[0], PROMPTS[:clients]))
    assert together == alone


def test_a_client_that_leaves_mid_stream_frees_its_sequence(server: LocalServer, client: openai.OpenAI) -> None:
    slots = server.served.scheduler.decoder
    emitted: dict[int, int] = {}
    real_step = slots.step

    def counting_step():
        out = real_step()
        for seq, tokens in out.items():
            emitted[seq] = emitted.get(seq, 0) + len(tokens)
        return out

    slots.step = counting_step  # a spy on this test's server only
    try:
        long_prompt = next(p for p in PROMPTS if ask(client, p, max_tokens=60).choices[0].finish_reason == "length")
        stream = ask(client, long_prompt, max_tokens=900, stream=True)
        next(iter(stream)), next(iter(stream))
        stream.close()
        deadline = time.monotonic() + 20
        while server.served.scheduler.free_slots == 0 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert slots.free_slots == 1 and server.served.scheduler.free_slots == 1
        assert max(emitted.values()) < 900  # removed when the client left, not at max_tokens
        assert ask(client, PROMPTS[2]).choices[0].message.content
    finally:
        del slots.step


def post_raw(server: LocalServer, path: str, body: bytes) -> tuple[int, dict]:
    request = urllib.request.Request(server.url + path, data=body, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def test_bad_requests_get_openai_errors_and_the_server_keeps_serving(server: LocalServer,
                                                                      client: openai.OpenAI) -> None:
    status, body = post_raw(server, "/chat/completions", b'{"messages": [')
    assert status == 400 and body["error"]["code"] == "invalid_json" and body["error"]["message"]
    status, body = post_raw(server, "/nowhere", b"{}")
    assert status == 404 and body["error"]["message"]
    refusals = [
        (openai.NotFoundError, "not served here", dict(model="gpt-4o")),
        (openai.BadRequestError, "context holds", dict(messages=[{"role": "user", "content": "x" * 2**20}])),
        (openai.BadRequestError, "max_tokens must be", dict(max_tokens=-5)),
        (openai.BadRequestError, "context holds", dict(max_tokens=5000)),
    ]
    for error, says, fields in refusals:
        request = {"model": "tiny", "messages": [{"role": "user", "content": "Hi"}], **fields}
        with pytest.raises(error, match=says):
            client.chat.completions.create(**request)
        assert ask(client, PROMPTS[3], max_tokens=4).choices[0].message.content is not None


def test_completions_read_the_prompt_as_it_is(client: openai.OpenAI) -> None:
    whole = client.completions.create(model="tiny", prompt="The quick brown", max_tokens=12, temperature=0)
    assert whole.object == "text_completion" and whole.usage.prompt_tokens == len(tiny_tokenizer()("The quick brown").input_ids)
    stream = client.completions.create(model="tiny", prompt="The quick brown", max_tokens=12, temperature=0,
                                       stream=True)
    assert "".join(c.choices[0].text for c in stream if c.choices) == whole.choices[0].text
    by_ids = client.completions.create(model="tiny", prompt=tiny_tokenizer()("The quick brown").input_ids,
                                       max_tokens=12, temperature=0)
    assert by_ids.choices[0].text == whole.choices[0].text


def test_an_api_key_is_required_when_set_and_a_full_queue_gets_429(engine: Engine) -> None:
    keyed = start(engine, options=ApiOptions(api_key="s3cret"), max_waiting=0)
    try:
        for wrong in ("", "nope"):
            with pytest.raises(openai.AuthenticationError, match="API key"):
                client_of(keyed, wrong or "-").models.list()
        good = client_of(keyed, "s3cret")
        decoder = keyed.served.scheduler.decoder
        real_step = decoder.step
        decoder.step = lambda: (time.sleep(0.05), real_step())[1]  # a spy on this server only: the reply
        # below holds its slot for seconds, not the milliseconds a tiny model needs for 900 tokens
        stream = ask(good, "Hello", max_tokens=900, stream=True)
        next(iter(stream))  # it holds the only slot; no request may wait
        with pytest.raises(openai.RateLimitError, match="busy"):
            ask(good, "Hello")
        stream.close()
        del decoder.step
        deadline = time.monotonic() + 20
        while keyed.served.scheduler.free_slots == 0 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert ask(good, "Hello").choices[0].message.content is not None
    finally:
        keyed.stop()


def test_a_taken_port_or_a_bad_one_is_one_clear_error(server: LocalServer, engine: Engine, capsys) -> None:
    from specmemo_core import cli
    from specmemo_core.errors import ServeError

    with pytest.raises(ServeError, match=f"cannot listen on 127.0.0.1:{server.port}"):
        LocalServer(serve_engine(engine, capacity=64), ServerAddress(port=server.port)).start()
    assert client_of(server).models.list().data  # the first server is unharmed
    assert cli.main(["serve", "--port", "70000"]) == 2  # refused before any model loads
    assert "--port must be from 0 to 65535" in capsys.readouterr().err


def test_request_text_is_logged_only_when_asked(engine: Engine, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level("INFO", logger="specmemo.serve")
    for log_text in (False, True):
        running = start(engine, options=ApiOptions(log_text=log_text))
        try:
            ask(client_of(running), "my secret question", max_tokens=3)
        finally:
            running.stop()
        assert ("my secret question" in caplog.text) is log_text
        assert "prompt tokens" in caplog.text


def test_the_specmemo_serve_command_serves_until_ctrl_c(tmp_path) -> None:
    """``specmemo serve`` as a user runs it, on a tiny model folder: the banner gives the URL,
    a request is answered with the heads' tree, Ctrl-C (SIGINT) ends it with exit code 0."""
    import os
    import signal
    import subprocess
    import sys
    from pathlib import Path

    from tests.tiny import tiny_hf_model

    folder = tmp_path / "tiny-model"
    tiny_hf_model(seed=4).save_pretrained(folder)
    tiny_tokenizer().save_pretrained(folder)
    repo = Path(__file__).resolve().parents[2]
    env = dict(os.environ, SPECMEMO_DATA_DIR=str(tmp_path / "data"), PYTHONPATH=str(repo))
    command = [sys.executable, "-m", "specmemo_core.cli", "serve", "--model", str(folder), "--heads", "random",
               "--tree", "medusa-64", "--port", "0", "--threads", "1", "--max-new-tokens", "5"]
    child = subprocess.Popen(command, stderr=subprocess.PIPE, text=True, env=env, cwd=repo)
    try:
        lines = []
        while not any("Ctrl-C stops" in line for line in lines):
            line = child.stderr.readline()
            assert line, "".join(lines[-20:])  # it exited before it served
            lines.append(line)
        url = next(word for line in lines for word in line.split() if word.startswith("http://127.0.0.1:"))
        reply = openai.OpenAI(base_url=url, api_key="any", max_retries=0, timeout=60).chat.completions.create(
            model="default", messages=[{"role": "user", "content": "Hello"}])
        assert reply.usage.completion_tokens <= 5 and reply.specmemo["tree"] == "medusa-64"
        child.send_signal(signal.SIGINT)
        assert child.wait(timeout=30) == 0
    finally:
        if child.poll() is None:
            child.kill()
        child.stderr.close()


@pytest.mark.integration
def test_the_default_model_served_with_the_planners_tree_answers_as_the_chat_does(shared_data_dir) -> None:
    """The real default model, planned as ``specmemo serve`` plans it: the tree in force is the
    planner's, and the served greedy reply is the chat session's reply, token for token."""
    model_file = shared_data_dir / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf"
    if not model_file.is_file():
        pytest.skip("the default model is not cached here (run tests -m integration once with network)")
    from specmemo_core.planning.device import cpu_device
    from specmemo_core.planning.entry import PlanChoices, load_planned
    from specmemo_core.runtime.decoding import GenerationConfig

    # our own forward, as the server's batches run (a chat on llama.cpp's, where installed, answers in its arithmetic)
    planned = load_planned("default", choices=PlanChoices(backend="torch"), device=cpu_device(),
                           data_folder=shared_data_dir, wait_for_timing=False)
    session = planned.new_session(capacity=1024)
    question = "What is the capital of France? Answer in one sentence."
    expected = "".join(p.text for p in session.send(question, GenerationConfig(max_new_tokens=40)))
    served: ServedModel = serve_engine(planned.engine, capacity=1024)
    running = LocalServer(served, ServerAddress(port=0)).start()
    try:
        reply = openai.OpenAI(base_url=running.url, api_key="any", max_retries=0).chat.completions.create(
            model="default", messages=[{"role": "user", "content": question}], max_tokens=40, temperature=0)
    finally:
        running.stop()
    assert reply.choices[0].message.content == expected and "Paris" in expected
    assert reply.specmemo["tree"] == planned.tree is not None
    assert reply.model == "SmolLM2-135M-Instruct"
