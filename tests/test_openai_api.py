"""OpenAI's API as people use it: the official ``openai`` client (sync, async, streaming) against a real server over
loopback HTTP on a tiny Qwen3 directory with a thinking chat template (tests/byo_models.py): chat and legacy
completions, n > 1, logprobs, stop strings, seeds, token limits, thinkpool's vote in ``extra_body`` and OpenAI's
error body for every error."""

import asyncio
import json

import httpx
import openai
import pytest
from openai import AsyncOpenAI, OpenAI

from byo_models import ANSWERS, bpe_tokenizer, write_model_dir
from http_server import serving
from orchestrator.api import create_app
from orchestrator.jobs import MemoryJobStore
from orchestrator.service import service_factory
from tasks.families import get_family

KEY = "openai-test-key"
MODEL = "tiny-qwen"
FOUR = "What is 2 + 2?"  # the tiny model answers it word for word: thinking, then "So it is \boxed{4}."
CHAT = [{"role": "user", "content": FOUR}]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_model_dir(tmp_path_factory.mktemp("openai") / MODEL, "qwen3")


@pytest.fixture(scope="module")
def server(model_dir):
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("THINKPOOL_API_KEYS", KEY)
        app = create_app(service_factory(model_dir, 4_000_000, 0), store=MemoryJobStore())
    with serving(app) as url:
        yield url


@pytest.fixture(scope="module")
def client(server):
    return OpenAI(base_url=f"{server}/v1", api_key=KEY, max_retries=0)


def chat(client, **options):
    return client.chat.completions.create(model=options.pop("model", MODEL), messages=options.pop("messages", CHAT),
                                          **options)


def streamed_chat(client, **options) -> tuple[dict, dict, list]:
    """Each choice's (thinking, answer) and finish reason, from a stream's chunks; and the chunks."""
    texts, finish, chunks = {}, {}, []
    for chunk in chat(client, stream=True, **options):
        chunks.append(chunk)
        for choice in chunk.choices:
            thinking, answer = texts.get(choice.index, ("", ""))
            texts[choice.index] = (thinking + (getattr(choice.delta, "reasoning_content", None) or ""),
                                   answer + (choice.delta.content or ""))
            if choice.finish_reason:
                finish[choice.index] = choice.finish_reason
    return texts, finish, chunks


# -- chat -------------------------------------------------------------------------------------------------------
def test_a_chat_answer_comes_apart_from_its_thinking_with_its_token_counts(client, model_dir):
    reply = chat(client, max_tokens=60, temperature=0)
    choice = reply.choices[0]
    thinking, answer = ANSWERS[FOUR].removeprefix("<think>").split("</think>")
    assert choice.message.content == answer.strip() and choice.message.reasoning_content == thinking.strip()
    assert choice.finish_reason == "stop" and reply.model == MODEL and reply.object == "chat.completion"
    prompt = get_family("math").encode_chat(CHAT, bpe_tokenizer())  # the messages through the chat template as they are
    assert reply.usage.prompt_tokens == len(prompt)
    assert 0 < reply.usage.completion_tokens < 60
    assert reply.usage.total_tokens == reply.usage.prompt_tokens + reply.usage.completion_tokens
    assert reply.thinkpool["answer"] == "4" and reply.thinkpool["samples"] == 1  # the extension field
    assert reply.system_fingerprint.startswith("fp_")  # the weights' fingerprint
    assert [m.id for m in client.models.list().data] == [MODEL]
    assert client.models.retrieve(MODEL).id == MODEL
    by_path = chat(client, model=str(model_dir), max_tokens=60, temperature=0)  # the model named by its path
    assert by_path.model == MODEL and by_path.system_fingerprint == reply.system_fingerprint


def test_a_streamed_chat_adds_up_to_the_same_request_unstreamed_for_every_choice(client, server):
    options = {"max_tokens": 60, "n": 3, "temperature": 1.2, "seed": 5}
    whole = chat(client, **options)
    texts, finish, chunks = streamed_chat(client, **options, stream_options={"include_usage": True})
    unstreamed = [(c.message.reasoning_content or "", c.message.content) for c in whole.choices]
    assert sorted(texts.values()) == sorted(unstreamed)
    assert sorted(finish.items()) == [(0, "stop"), (1, "stop"), (2, "stop")]
    assert chunks[-1].usage == whole.usage and chunks[-1].thinkpool["votes"] == whole.thinkpool["votes"]
    assert {c.id for c in chunks} == {chunks[0].id} and all(c.object == "chat.completion.chunk" for c in chunks)
    body = {"model": MODEL, "messages": CHAT, "max_tokens": 60, "n": 2, "stream": True}
    with httpx.stream("POST", f"{server}/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {KEY}"},
                      timeout=120) as response:
        assert response.headers["content-type"].startswith("text/event-stream")
        events = [line.removeprefix("data: ") for line in response.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    indices = {c["index"] for event in events[:-1] for c in json.loads(event)["choices"]}
    assert indices == {0, 1}  # n > 1: every chunk names its choice


def test_the_async_client_completes_and_streams(server):
    async def both():
        client = AsyncOpenAI(base_url=f"{server}/v1", api_key=KEY, max_retries=0)
        reply = await client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=60, temperature=0)
        stream = await client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=60, temperature=0,
                                                      stream=True)
        answer = "".join([chunk.choices[0].delta.content or "" async for chunk in stream if chunk.choices])
        await client.close()
        return reply, answer

    reply, answer = asyncio.run(both())
    assert answer == reply.choices[0].message.content and "\\boxed{4}" in answer


def test_logprobs_cover_the_answer_tokens_with_the_most_likely_alternatives(client):
    reply = chat(client, max_tokens=60, temperature=0, logprobs=True, top_logprobs=3)
    choice = reply.choices[0]
    entries = choice.logprobs.content
    assert "".join(e.token for e in entries).strip() == choice.message.content  # the answer's tokens only
    for entry in entries:
        assert entry.logprob <= 0 and len(entry.top_logprobs) == 3 and bytes(entry.bytes).decode() == entry.token
        assert [t.logprob for t in entry.top_logprobs] == sorted((t.logprob for t in entry.top_logprobs), reverse=True)
        assert entry.top_logprobs[0].token == entry.token  # greedy: the chosen token is the most likely one
        assert entry.top_logprobs[0].logprob == pytest.approx(entry.logprob)
    _, _, chunks = streamed_chat(client, max_tokens=60, temperature=0, logprobs=True, top_logprobs=3)
    streamed = [e for c in chunks for choice in c.choices if choice.logprobs for e in choice.logprobs.content]
    assert [(e.token, e.logprob) for e in streamed] == [(e.token, e.logprob) for e in entries]
    assert chat(client, max_tokens=60, temperature=0).choices[0].logprobs is None  # only when asked


def test_stop_strings_end_the_text_before_them(client):
    full = chat(client, max_tokens=60, temperature=0)
    answer = full.choices[0].message.content
    cut = chat(client, max_tokens=60, temperature=0, stop=["\\boxed", "never seen"])
    assert cut.choices[0].message.content == answer[: answer.index("\\boxed")]
    assert cut.choices[0].finish_reason == "stop" and cut.usage.completion_tokens < full.usage.completion_tokens
    texts, _, _ = streamed_chat(client, max_tokens=60, temperature=0, stop="\\boxed")
    assert texts[0][1] == cut.choices[0].message.content  # a stream holds back what may begin a stop string
    in_thinking = chat(client, max_tokens=60, temperature=0, stop=["two."]).choices[0].message
    assert in_thinking.reasoning_content == "Two and" and not in_thinking.content
    text = client.completions.create(model=MODEL, prompt=FOUR, max_tokens=60, temperature=0, stop=["So it"])
    assert not text.choices[0].text.rstrip().endswith("So it") and "So it" not in text.choices[0].text


def test_token_limits_and_seeds(client):
    short = chat(client, max_tokens=4, temperature=0)
    assert short.choices[0].finish_reason == "length" and short.usage.completion_tokens == 4
    assert chat(client, max_tokens=60, max_completion_tokens=3, temperature=0).usage.completion_tokens == 3
    first = chat(client, max_tokens=30, n=3, temperature=1.5, top_p=0.9, seed=7)
    again = chat(client, max_tokens=30, n=3, temperature=1.5, top_p=0.9, seed=7)
    assert [c.message for c in first.choices] == [c.message for c in again.choices]


def test_an_openai_client_asks_for_a_voted_answer_in_extra_body(client):
    reply = chat(client, max_tokens=60, temperature=0.7, seed=2, extra_body={"samples": 4, "cr": 1})
    vote = reply.thinkpool
    assert vote["samples"] == 4 and sum(vote["votes"].values()) == 4 and vote["answer"] == "4"
    assert len(reply.choices) == 1 and "\\boxed{4}" in reply.choices[0].message.content  # a thread that voted for it
    assert reply.usage.completion_tokens > chat(client, max_tokens=60, temperature=0).usage.completion_tokens
    auto = chat(client, max_tokens=60, extra_body={"samples": "auto"})  # no calibration profile for math: one thread
    assert auto.thinkpool["samples"] == 1 and auto.thinkpool["answer"] == "4"
    with pytest.raises(openai.UnprocessableEntityError) as refused:
        chat(client, max_tokens=60, n=3, extra_body={"samples": 2})
    assert refused.value.body["param"] == "n" and "at most samples (2)" in refused.value.body["message"]


def test_legacy_completions_echo_stream_and_legacy_logprobs(client):
    plain = client.completions.create(model=MODEL, prompt=FOUR, max_tokens=60, temperature=0, logprobs=2)
    choice = plain.choices[0]
    logprobs = choice.logprobs
    assert "".join(logprobs.tokens) == choice.text and len(logprobs.token_logprobs) == len(logprobs.tokens)
    offsets = [sum(len(t) for t in logprobs.tokens[:i]) for i in range(len(logprobs.tokens))]
    assert logprobs.text_offset == offsets
    for top, chosen in zip(logprobs.top_logprobs, logprobs.token_logprobs):
        assert len(top) <= 2 and max(top.values()) == pytest.approx(chosen)
    echoed = client.completions.create(model=MODEL, prompt=FOUR, max_tokens=60, temperature=0, echo=True)
    assert echoed.choices[0].text == FOUR + choice.text
    pieces = {}
    for chunk in client.completions.create(model=MODEL, prompt=FOUR, max_tokens=60, n=2, temperature=1.0, seed=3,
                                           stream=True):
        for part in chunk.choices:
            pieces[part.index] = pieces.get(part.index, "") + part.text
    whole = client.completions.create(model=MODEL, prompt=FOUR, max_tokens=60, n=2, temperature=1.0, seed=3)
    assert sorted(pieces.values()) == sorted(c.text for c in whole.choices)
    with pytest.raises(openai.UnprocessableEntityError) as refused:
        client.completions.create(model=MODEL, prompt=FOUR, echo=True, logprobs=1)
    assert refused.value.body["param"] == "echo"


@pytest.mark.parametrize("options, param", [
    ({"n": 0}, "n"),
    ({"top_logprobs": 2}, "top_logprobs"),
    ({"stop": ["a", "b", "c", "d", "e"]}, "stop"),
    ({"frequency_penalty": 0.5}, "frequency_penalty"),
    ({"max_tokens": 250}, "max_tokens"),  # past the model's context of 256 tokens
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}]}, "tools"),
    ({"messages": [{"role": "system", "content": "only a system message"}]}, "messages"),
    ({"extra_body": {"cr": 8}}, "cr"),
])
def test_bad_requests_get_a_422_in_openais_shape_naming_the_field(client, options, param):
    with pytest.raises(openai.UnprocessableEntityError) as refused:
        chat(client, **options)
    error = refused.value.body
    assert error["param"] == param and error["type"] == "invalid_request_error" and param in error["message"]


def test_every_other_error_is_in_openais_shape_too(client, server):
    with pytest.raises(openai.NotFoundError) as missing:
        chat(client, model="another-model")
    assert missing.value.body["code"] == "model_not_found" and missing.value.body["param"] == "model"
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("another-model")
    with pytest.raises(openai.AuthenticationError) as unknown:
        OpenAI(base_url=f"{server}/v1", api_key="wrong", max_retries=0).models.list()
    assert unknown.value.body["type"] == "authentication_error"
    headers = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}
    not_utf8 = httpx.post(f"{server}/v1/chat/completions", content=b'{"messages": "\xff\xfe"}', headers=headers)
    assert not_utf8.status_code == 400 and "not UTF-8" in not_utf8.json()["error"]["message"]
    broken = httpx.post(f"{server}/v1/completions", content=b'{"prompt": ', headers=headers)
    assert broken.status_code == 422 and set(broken.json()["error"]) == {"message", "type", "param", "code"}
