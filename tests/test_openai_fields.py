"""Issue 19's remaining OpenAI request fields (docs/openai_api.md): `user` (accepted, no effect),
`name` on chat messages (the chat template's to render; refused where the template ignores it),
`best_of` with `n` on completions (vLLM's: best_of candidates, the n of highest cumulative logprob),
`suffix` (refused), and `system_fingerprint` in every response and chunk.

The model is a tiny random Llama with the default tokenizer (whose chat template has no names)."""

from __future__ import annotations

from pathlib import Path

import pytest
from server_utils import make_full_vocab_tiny, post, sse

from jaxserve.server.common import InvalidRequest
from jaxserve.server.http_server import render_chat

MSGS = [{"role": "user", "content": "Say something."}]


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory) -> Path:
    return make_full_vocab_tiny(tmp_path_factory.mktemp("tiny-fields"))


@pytest.fixture(scope="module")
def fields_srv(tiny_path, tmp_path_factory):
    from server_utils import start_server

    server = start_server(tiny_path, tmp_path_factory.mktemp("xla-fields"))
    yield server
    server["proc"].terminate()
    server["proc"].wait(timeout=60)


@pytest.fixture(scope="module")
def client(fields_srv):
    import openai

    return openai.OpenAI(base_url=fields_srv["base"] + "/v1", api_key="-", max_retries=0)


GREEDY = dict(model="tiny", max_tokens=6, temperature=0.0, extra_body={"ignore_eos": True})


# ---- name: decided by the chat template (no server needed) ----------------------------------------

def test_a_template_that_renders_names_takes_them_and_one_that_does_not_refuses_them(tiny_path):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tiny_path))
    named = [{"role": "user", "content": "hi", "name": "alice"}]
    with pytest.raises(InvalidRequest) as err:  # the default (SmolLM2) template ignores names
        render_chat(tok, named)
    assert err.value.param == "messages[0].name"
    assert render_chat(tok, [{"role": "user", "content": "hi"}])  # without a name: fine
    tok.chat_template = ("{% for m in messages %}<|im_start|>{{ m['role'] }}{% if m.get('name') %} ({{ m['name'] }})"
                         "{% endif %}\n{{ m['content'] }}<|im_end|>\n{% endfor %}<|im_start|>assistant\n")
    with_name = render_chat(tok, named)
    assert with_name != render_chat(tok, [{"role": "user", "content": "hi"}])
    assert "(alice)" in tok.decode(with_name)


# ---- through the server -------------------------------------------------------------------------------

@pytest.mark.slow
def test_user_is_accepted_and_changes_nothing(client, fields_srv):
    """`user` is an end-user id for the provider's abuse monitoring: by definition it does not
    steer generation, so the same request with and without it gives the same tokens."""
    for user in ("alice", ""):
        a = client.completions.create(prompt="Hello", user=user, **GREEDY).choices[0].text
        b = client.completions.create(prompt="Hello", **GREEDY).choices[0].text
        assert a == b
        c = client.chat.completions.create(messages=MSGS, user=user, **GREEDY).choices[0].message.content
        d = client.chat.completions.create(messages=MSGS, **GREEDY).choices[0].message.content
        assert c == d
    for path, base in (("/v1/completions", {"prompt": "hi"}), ("/v1/chat/completions", {"messages": MSGS})):
        status, err = post(fields_srv, path, {**base, "max_tokens": 2, "user": 5})
        assert status == 400 and err["error"]["param"] == "user", err


@pytest.mark.slow
def test_system_fingerprint_in_every_response_and_chunk(client):
    a = client.completions.create(prompt="Hello", **GREEDY)
    b = client.chat.completions.create(messages=MSGS, **GREEDY)
    assert a.system_fingerprint and a.system_fingerprint.startswith("fp_")
    assert b.system_fingerprint == a.system_fingerprint  # one server, one configuration
    chunks = list(client.chat.completions.create(messages=MSGS, stream=True, **GREEDY))
    chunks += list(client.completions.create(prompt="Hello", stream=True, **GREEDY))
    assert chunks and all(c.system_fingerprint == a.system_fingerprint for c in chunks)


@pytest.mark.slow
def test_message_names_the_template_ignores_are_400s(fields_srv):
    status, err = post(fields_srv, "/v1/chat/completions",
                       {"messages": [{"role": "system", "content": "Be brief."},
                                     {"role": "user", "content": "hi", "name": "alice"}], "max_tokens": 2})
    assert status == 400 and err["error"]["param"] == "messages[1].name", err
    assert "name" in err["error"]["message"]
    status, err = post(fields_srv, "/v1/chat/completions",
                       {"messages": [{"role": "user", "content": "hi", "name": 7}], "max_tokens": 2})
    assert status == 400 and err["error"]["param"] == "messages[0].name", err


@pytest.mark.slow
def test_best_of_returns_the_n_candidates_of_highest_cumulative_logprob(client):
    kw = dict(model="tiny", prompt="Once upon a time", max_tokens=6, temperature=1.0, seed=5,
              extra_body={"ignore_eos": True})
    every = client.completions.create(n=4, logprobs=0, **kw)
    ranked = sorted(every.choices, key=lambda c: (-sum(c.logprobs.token_logprobs), c.index))
    best = client.completions.create(n=2, best_of=4, **kw)
    assert [c.text for c in best.choices] == [c.text for c in ranked[:2]]
    assert [c.index for c in best.choices] == [0, 1]
    assert all(c.logprobs is None for c in best.choices)  # not asked for: not returned
    assert best.usage.completion_tokens == 4 * 6  # every candidate's tokens count, as OpenAI bills them
    with_lp = client.completions.create(n=1, best_of=4, logprobs=2, **kw)
    assert with_lp.choices[0].text == ranked[0].text
    assert len(with_lp.choices[0].logprobs.top_logprobs[0]) in (2, 3)  # top 2, and the sampled token (as vLLM)
    same = client.completions.create(n=2, best_of=2, **kw)  # best_of == n: plain n
    assert [c.text for c in same.choices] == [c.text for c in every.choices[:2]]


@pytest.mark.slow
@pytest.mark.parametrize("path, body", [
    ("/v1/completions", {"n": 3, "best_of": 2}),  # best_of < n
    ("/v1/completions", {"best_of": 3, "stream": True}),
    ("/v1/completions", {"best_of": 0}),
    ("/v1/completions", {"best_of": "2"}),
    ("/v1/completions", {"best_of": 17}),
    ("/v1/chat/completions", {"best_of": 2}),  # OpenAI's chat has no best_of
    ("/v1/completions", {"suffix": "end"}),  # no fill-in-the-middle
    ("/v1/chat/completions", {"suffix": "end"}),
])
def test_refused_fields_are_400s_naming_them(fields_srv, path, body):
    base = {"messages": MSGS} if "chat" in path else {"prompt": "hi"}
    if body.get("stream"):
        status, events = sse(fields_srv, path, {**base, "max_tokens": 2, **body})
        err = events[0]
    else:
        status, err = post(fields_srv, path, {**base, "max_tokens": 2, **body})
    field = next(k for k in body if k in ("best_of", "suffix"))
    assert status == 400 and err["error"]["param"] == field, err
