"""Issue 19: structured output (llguidance) through the engine, synchronous and overlapped.

The model is a tiny random-weight Llama with the default tokenizer's full vocabulary: its outputs
are noise, so only the token mask can make them valid. JSON constraints use
`disable_any_whitespace` (free whitespace lets a random model pad forever); an output cut by
max_tokens must still be a prefix the grammar accepts.
"""

from __future__ import annotations

import json
import re

import jsonschema
import numpy as np
import pytest
from conftest import small_engine_options
from server_utils import make_full_vocab_tiny

from jaxserve.config import EngineConfig
from jaxserve.engine.engine import LLMEngine
from jaxserve.sampling_params import SamplingParams, StructuredOutputsParams

SCHEMAS = {
    "nested": {"type": "object", "additionalProperties": False, "required": ["user"],
               "properties": {"user": {"type": "object", "additionalProperties": False, "required": ["id", "tag"],
                                       "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 999},
                                                      "tag": {"type": "string", "maxLength": 5}}}}},
    "array": {"type": "array", "items": {"type": "integer", "minimum": -5, "maximum": 5}, "minItems": 2,
              "maxItems": 4},
    "enum": {"type": "object", "additionalProperties": False, "required": ["color"],
             "properties": {"color": {"enum": ["red", "green", "blue"]}}},
    "required": {"type": "object", "additionalProperties": False, "required": ["a", "b"],
                 "properties": {"a": {"type": "boolean"}, "b": {"type": "null"},
                                "c": {"type": "string", "maxLength": 3}}},
    "numbers": {"type": "object", "additionalProperties": False, "required": ["x", "n"],
                "properties": {"x": {"type": "number", "minimum": -1.5, "maximum": 2.5},
                               "n": {"type": "integer", "exclusiveMinimum": 10, "maximum": 20}}},
}
REGEXES = [r"[a-c]{3}-[0-9]{2,4}", r"[a-z]{1,6}@[a-z]{1,6}\.(com|org)"]
CHOICES = ["yes", "no", "maybe", "definitely not"]

CONSTRAINTS = ([(f"json-{k}", StructuredOutputsParams(json=v, disable_any_whitespace=True)) for k, v in SCHEMAS.items()]
               + [(f"regex-{i}", StructuredOutputsParams(regex=r)) for i, r in enumerate(REGEXES)]
               + [("choice", StructuredOutputsParams(choice=CHOICES)),
                  ("json_object", StructuredOutputsParams(json_object=True, disable_any_whitespace=True)),
                  ("lark", StructuredOutputsParams(grammar='start: "x=" NUM ";"\nNUM: /[0-9]{1,3}/'))])
PROMPTS = ["Hello there", "Give me JSON:", "1 2 3"]
MAX_TOKENS = 160


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory) -> str:
    return str(make_full_vocab_tiny(tmp_path_factory.mktemp("tiny19")))


def make_engine(path: str, overlap: bool) -> LLMEngine:
    opts = small_engine_options(async_scheduling=overlap)
    opts.pop("show_progress")
    return LLMEngine(EngineConfig(model=path, **opts), show_progress=False)


@pytest.fixture(scope="module")
def engines(tiny_path) -> dict[str, LLMEngine]:
    return {"sync": make_engine(tiny_path, False), "overlap": make_engine(tiny_path, True)}


def run(engine: LLMEngine, requests: list[tuple[str, str, SamplingParams]]) -> dict:
    for rid, prompt, params in requests:
        engine.add_request(rid, prompt, params)
    final = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                final[out.request_id] = out
    engine.check_invariants()
    assert set(final) == {rid for rid, _, _ in requests}
    return final


def check_output(engine: LLMEngine, so: StructuredOutputsParams, out) -> bool:
    """Assert the output obeys the constraint; returns whether it was complete (not cut short)."""
    c = out.outputs[0]
    assert c.finish_reason in ("stop", "length"), (c.finish_reason, out.error)
    if c.finish_reason == "length":  # cut by max_tokens: the tokens must be a valid prefix
        constraint = engine.grammars.constraint(so)
        assert all(constraint.accept(t) for t in c.token_ids), c.text
        return False
    text = c.text
    if so.json is not None:
        jsonschema.validate(json.loads(text), so.json)
    elif so.json_object:
        assert isinstance(json.loads(text), dict)
    elif so.regex is not None:
        assert re.fullmatch(so.regex, text), text
    elif so.choice is not None:
        assert text in so.choice
    else:
        assert re.fullmatch(r"x=[0-9]{1,3};", text), text
    return True


def constrained_requests(temperature: float, seeds: range) -> list[tuple[str, str, SamplingParams]]:
    return [(f"{name}-{seed}", PROMPTS[seed % len(PROMPTS)],
             SamplingParams(max_tokens=MAX_TOKENS, temperature=temperature, seed=seed, structured_outputs=so))
            for name, so in CONSTRAINTS for seed in seeds]


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_outputs_obey_their_constraints_and_overlap_matches_sync(engines, temperature):
    reqs = constrained_requests(temperature, range(1 if temperature == 0.0 else 3))
    results = {mode: run(engine, reqs) for mode, engine in engines.items()}
    complete = 0
    for rid, _, params in reqs:
        sync, overlap = results["sync"][rid], results["overlap"][rid]
        assert sync.outputs[0].token_ids == overlap.outputs[0].token_ids, rid
        assert sync.outputs[0].finish_reason == overlap.outputs[0].finish_reason
        complete += check_output(engines["sync"], params.structured_outputs, sync)
    assert complete >= len(reqs) * 3 // 4  # the bounded grammars mostly finish inside MAX_TOKENS


def test_unconstrained_requests_are_unchanged_beside_constrained_ones(engines):
    plain = [(f"plain-{i}", PROMPTS[i % 3], SamplingParams(max_tokens=24, temperature=t, seed=i, ignore_eos=True))
             for i, t in enumerate([0.0, 1.0, 0.8, 0.0])]
    for mode, engine in engines.items():
        alone = run(engine, plain)
        mixed = run(engine, plain + constrained_requests(1.0, range(1)))
        for rid, _, _ in plain:
            assert mixed[rid].outputs[0].token_ids == alone[rid].outputs[0].token_ids, (mode, rid)


def test_constrained_requests_survive_preemption(engines, tiny_path):
    """A small pool preempts requests (recomputed later): each matcher keeps its state, and the
    outputs are those of the roomy synchronous engine."""
    opts = small_engine_options(async_scheduling=True, num_pages=14, max_num_seqs=8)
    opts.pop("show_progress")
    small = LLMEngine(EngineConfig(model=tiny_path, **opts), show_progress=False)
    so = StructuredOutputsParams(regex="[a-z ]{60,}")
    reqs = [(f"p{i}", PROMPTS[i % 3], SamplingParams(max_tokens=48, temperature=1.0, seed=i, structured_outputs=so))
            for i in range(8)]
    got, want = run(small, reqs), run(engines["sync"], reqs)
    assert small.scheduler.num_preemptions > 0
    for rid, _, _ in reqs:
        assert got[rid].outputs[0].token_ids == want[rid].outputs[0].token_ids, rid
        check_output(small, so, got[rid])


def test_a_model_vocabulary_narrower_than_the_tokenizer_masks_only_its_own_ids(tmp_path):
    """The 256-token tiny models carry the 49,152-token tokenizer: llguidance masks the tokenizer's
    vocabulary and the mask is cut to the model's (single characters live below 256)."""
    from conftest import make_tiny_checkpoint

    path = str(make_tiny_checkpoint("llama3", tmp_path))
    engine = make_engine(path, overlap=True)
    so = StructuredOutputsParams(regex=r"[a-c]{3}-[0-9]{2,4}")
    reqs = [(f"n{i}", [5, 6, 7], SamplingParams(max_tokens=12, temperature=1.0, seed=i, structured_outputs=so))
            for i in range(4)]
    for rid, out in run(engine, reqs).items():
        assert all(t < 256 for t in out.outputs[0].token_ids)
        assert check_output(engine, so, out), rid


def test_offline_llm_generate_with_structured_outputs(engines):
    from jaxserve import LLM

    llm = LLM.__new__(LLM)
    llm.engine = engines["overlap"]  # the offline API over an engine already built
    schema = SCHEMAS["enum"]
    outs = llm.generate(["Pick a colour:", "Again:"], SamplingParams(
        max_tokens=40, temperature=1.0, seed=4, structured_outputs={"json": schema, "disable_any_whitespace": True}),
        use_tqdm=False)
    for out in outs:
        jsonschema.validate(json.loads(out.outputs[0].text), schema)


def test_a_constraint_finishes_the_request_with_stop(engines):
    so = StructuredOutputsParams(choice=["alpha", "beta"])
    out = run(engines["overlap"], [("c", "Pick:", SamplingParams(max_tokens=50, temperature=0.0, structured_outputs=so))])
    c = out["c"].outputs[0]
    assert c.text in ("alpha", "beta") and c.finish_reason == "stop"
    assert len(c.token_ids) < 50


def test_without_the_mask_the_grammar_rejects_and_the_request_aborts(engines, monkeypatch):
    """The mask is what makes outputs valid: with it dropped, the random model's first tokens break
    the grammar, which the engine reports instead of returning invalid output as valid."""
    from jaxserve.engine.scheduler import Scheduler

    monkeypatch.setattr(Scheduler, "_token_bitmask", staticmethod(lambda scheduled, num_rows: None))
    so = StructuredOutputsParams(regex=r"[a-c]{3}-[0-9]{2,4}")
    reqs = [(f"r{i}", "Hello", SamplingParams(max_tokens=20, temperature=1.0, seed=i, structured_outputs=so))
            for i in range(4)]
    out = run(engines["sync"], reqs)
    assert all(o.outputs[0].finish_reason == "abort" and "rejected" in o.error for o in out.values())


def test_min_tokens_yields_to_a_complete_grammar(engines):
    so = StructuredOutputsParams(choice=["no"])
    out = run(engines["sync"], [("m", "Hi", SamplingParams(max_tokens=20, min_tokens=10, temperature=1.0, seed=3,
                                                             structured_outputs=so))])
    c = out["m"].outputs[0]
    assert c.text == "no" and c.finish_reason == "stop"


@pytest.mark.parametrize("kwargs, match", [
    (dict(), "exactly one"),
    (dict(regex="a", choice=["a"]), "exactly one"),
    (dict(choice=[]), "choice"),
    (dict(choice=["a", 3]), "choice"),
    (dict(json="{not json"), "not valid JSON"),
    (dict(json=[1, 2]), "JSON schema"),
    (dict(regex=""), "regex"),
    (dict(json_object=False, regex="a", grammar="start: \"a\""), "exactly one"),
])
def test_structured_outputs_params_are_validated(kwargs, match):
    with pytest.raises(ValueError, match=match):
        StructuredOutputsParams(**kwargs)


def test_sampling_params_take_a_dict_and_refuse_unknown_keys():
    p = SamplingParams(structured_outputs={"regex": "a+"})
    assert p.structured_outputs.regex == "a+"
    with pytest.raises(ValueError, match="whitespace_pattern"):
        SamplingParams(structured_outputs={"regex": "a+", "whitespace_pattern": " "})


@pytest.mark.parametrize("so, match", [
    (StructuredOutputsParams(regex="a(b"), "structured_outputs.regex"),
    (StructuredOutputsParams(json={"type": "objectx"}), "structured_outputs.json"),
    (StructuredOutputsParams(grammar="start: undefined_rule"), "structured_outputs.grammar"),
])
def test_grammars_that_do_not_compile_are_value_errors(engines, so, match):
    engine = engines["sync"]
    with pytest.raises(ValueError, match=match):
        engine.add_request("bad", "Hi", SamplingParams(structured_outputs=so))
    assert not engine.has_unfinished()


def test_compiled_grammars_are_cached(engines):
    grammars = engines["sync"].grammars
    a = grammars.compile(StructuredOutputsParams(json=SCHEMAS["enum"]))
    b = grammars.compile(StructuredOutputsParams(json=json.dumps(SCHEMAS["enum"])))
    assert a is b
    c1, c2 = grammars.constraint(StructuredOutputsParams(json=SCHEMAS["enum"])), \
        grammars.constraint(StructuredOutputsParams(json=SCHEMAS["enum"]))
    assert c1.matcher is not c2.matcher  # each request advances its own copy


def test_bitmask_unpacking_matches_llguidance():
    import jax.numpy as jnp
    from llguidance.numpy import apply_token_bitmask_inplace

    from jaxserve.engine.sampler import allowed_tokens

    rng = np.random.default_rng(0)
    for vocab in (64, 100, 49152):
        mask = rng.integers(-2**31, 2**31, size=(3, (vocab + 31) // 32), dtype=np.int64).astype(np.int32)
        ref = np.zeros((3, vocab), np.float32)
        apply_token_bitmask_inplace(ref, mask)
        np.testing.assert_array_equal(np.asarray(allowed_tokens(jnp.asarray(mask), vocab)), ref == 0)


# ---- the HTTP server, through the openai client ----------------------------------------------
# x-guidance: llguidance's per-schema options; compact JSON, as disable_any_whitespace gives above.
PERSON = {"type": "object", "additionalProperties": False, "required": ["name", "age", "tags"],
          "x-guidance": {"whitespace_flexible": False},
          "properties": {"name": {"type": "string", "maxLength": 6}, "age": {"type": "integer", "minimum": 0,
                                                                            "maximum": 99},
                         "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 2}}}


@pytest.fixture(scope="module")
def so_srv(tiny_path, tmp_path_factory):
    from server_utils import start_server

    server = start_server(__import__("pathlib").Path(tiny_path), tmp_path_factory.mktemp("xla19"))
    yield server
    server["proc"].terminate()
    server["proc"].wait(timeout=60)


@pytest.fixture(scope="module")
def client(so_srv):
    import openai

    return openai.OpenAI(base_url=so_srv["base"] + "/v1", api_key="-", max_retries=0)


def response_format(schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "person", "schema": schema, "strict": True}}


@pytest.mark.slow
def test_http_response_format_json_schema(client, so_srv):
    from test_server_robust import assert_idle_and_consistent

    msgs = [{"role": "user", "content": "Describe a person."}]
    for seed in range(3):
        r = client.chat.completions.create(model="tiny", messages=msgs, max_tokens=80, temperature=1.0, seed=seed,
                                           response_format=response_format(PERSON))
        assert r.choices[0].finish_reason == "stop"
        jsonschema.validate(json.loads(r.choices[0].message.content), PERSON)
        stream = client.chat.completions.create(model="tiny", messages=msgs, max_tokens=80, temperature=1.0,
                                                seed=seed, response_format=response_format(PERSON), stream=True)
        text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
        assert text == r.choices[0].message.content  # streamed == not streamed
    r = client.chat.completions.create(model="tiny", messages=msgs, max_tokens=80, temperature=1.0, seed=7, n=3,
                                       response_format=response_format(PERSON))
    assert len(r.choices) == 3  # each completion of n has its own matcher
    for choice in r.choices:
        jsonschema.validate(json.loads(choice.message.content), PERSON)
    r = client.completions.create(model="tiny", prompt="Answer:", max_tokens=40, temperature=1.0, seed=1,
                                  extra_body={"structured_outputs": {"choice": ["red", "green"]}})
    assert r.choices[0].text in ("red", "green") and r.choices[0].finish_reason == "stop"
    r = client.completions.create(model="tiny", prompt="Code:", max_tokens=40, temperature=1.0, seed=2,
                                  extra_body={"guided_regex": "[A-Z]{2}[0-9]{3}"})
    assert re.fullmatch("[A-Z]{2}[0-9]{3}", r.choices[0].text)
    r = client.chat.completions.create(model="tiny", messages=msgs, max_tokens=60, temperature=0.0,
                                       response_format={"type": "json_object"})
    assert r.choices[0].finish_reason != "stop" or isinstance(json.loads(r.choices[0].message.content), dict)
    assert_idle_and_consistent(so_srv, timeout=30)


@pytest.mark.slow
@pytest.mark.parametrize("path, body, param", [
    ("/v1/chat/completions", {"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "objectx"}}}}, "response_format"),
    ("/v1/chat/completions", {"response_format": {"type": "yaml"}}, "response_format"),
    ("/v1/chat/completions", {"response_format": {"type": "json_schema", "json_schema": {"schema": {}}}},
     "response_format"),
    ("/v1/completions", {"structured_outputs": {"regex": "a(b"}}, "structured_outputs"),
    ("/v1/completions", {"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs"),
    ("/v1/completions", {"guided_grammar": "start: nope"}, "guided_grammar"),
    ("/v1/completions", {"guided_json": "{bad"}, "guided_json"),
    ("/v1/completions", {"guided_regex": "a", "guided_choice": ["a"]}, "guided_choice"),
])
def test_http_invalid_constraints_are_400s_naming_the_field(so_srv, path, body, param):
    from server_utils import post
    from test_server_robust import assert_idle_and_consistent

    base = {"model": "tiny", "max_tokens": 8}
    base.update({"messages": [{"role": "user", "content": "hi"}]} if "chat" in path else {"prompt": "hi"})
    status, err = post(so_srv, path, {**base, **body})
    assert status == 400, err
    assert err["error"]["param"] == param and err["error"]["type"] == "invalid_request_error", err
    assert_idle_and_consistent(so_srv, timeout=30)


def test_overlapped_engine_steps_constrained_rows_every_call(engines, monkeypatch):
    """Under overlap a constrained row is planned while its last token is still being sampled;
    the model step is launched, the previous step read (its tokens advance the matchers), and the
    sampler launched with the masks made then. So such a row gains a token per step() call, a step
    stays in flight across calls (the device is never drained for the mask), and the tokens are
    the synchronous engine's."""
    so = StructuredOutputsParams(regex="[a-z]{400}")  # longer than 30 tokens: max_tokens ends it
    reqs = [("c", PROMPTS[0], SamplingParams(max_tokens=30, temperature=1.0, seed=1, structured_outputs=so)),
            ("u", PROMPTS[1], SamplingParams(max_tokens=30, temperature=1.0, seed=2, ignore_eos=True))]
    engine = engines["overlap"]
    events: list[str] = []

    def record(obj, attr: str, name: str) -> None:
        fn = getattr(obj, attr)

        def wrapper(*args, **kwargs):
            events.append(name)
            return fn(*args, **kwargs)
        monkeypatch.setattr(obj, attr, wrapper)

    record(engine.runner, "launch", "launch")
    record(engine.runner, "sample", "sample")  # (inside launch when nothing waits for a mask)
    record(engine, "_read", "read")
    for rid, prompt, params in reqs:
        engine.add_request(rid, prompt, params)
    calls, done, final, orders = 0, {}, {}, []
    while engine.has_unfinished():
        calls += 1
        events.clear()
        for out in engine.step():
            if out.finished:
                done[out.request_id], final[out.request_id] = calls, out
        if "c" not in done:
            orders.append(tuple(events))
    engine.check_invariants()
    # Every call after the first: the model step is dispatched before the previous step is read,
    # and the sampler after that read (not read-then-launch, which idles the device meanwhile).
    assert orders[0] == ("launch", "read", "sample") and set(orders[1:]) == {("launch", "read", "sample")}, orders
    # 30 tokens each: the prefill step samples the first, then one per call, +1 for the
    # overlapped read of the last (every other call would take ~60).
    assert done["c"] <= 33 and done["u"] <= 33, (done, calls)
    want = run(engines["sync"], reqs)
    for rid in ("c", "u"):
        assert final[rid].outputs[0].token_ids == want[rid].outputs[0].token_ids, rid
        assert len(final[rid].outputs[0].token_ids) == 30, rid
    assert not check_output(engine, so, final["c"])  # a valid prefix, cut by max_tokens


# A suite of schemas of the kinds agents send (nested objects, arrays, enums, required and optional
# fields, string formats and patterns, bounded numbers, anyOf/oneOf/allOf, $ref), each answered
# greedy and sampled, streamed and not, through the openai client: every answer must validate.
# Strings (formats too), arrays and the digits of fractional numbers (multipleOf) are bounded and whitespace is
# compact (llguidance's x-guidance option): the model is random, and only the grammar ends its output.
SCHEMA_SUITE = json.loads((__import__("pathlib").Path(__file__).parent / "data" / "json_schema_suite.json").read_text())


@pytest.mark.slow
def test_http_schema_suite_always_validates(client, so_srv):
    from concurrent.futures import ThreadPoolExecutor

    from test_server_robust import assert_idle_and_consistent

    assert len(SCHEMA_SUITE) >= 30
    msgs = [{"role": "user", "content": "Answer in JSON."}]

    def answer(job):
        name, temperature, stream = job
        fmt = {"type": "json_schema", "json_schema": {"name": name, "strict": True, "schema": {
            **SCHEMA_SUITE[name], "x-guidance": {"whitespace_flexible": False}}}}
        kw = dict(model="tiny", messages=msgs, max_tokens=90, temperature=temperature, seed=len(name),
                  response_format=fmt)
        if not stream:
            choice = client.chat.completions.create(**kw).choices[0]
            return name, choice.message.content, choice.finish_reason
        text, reason = "", None
        for chunk in client.chat.completions.create(stream=True, **kw):
            if chunk.choices:
                text += chunk.choices[0].delta.content or ""
                reason = chunk.choices[0].finish_reason or reason
        return name, text, reason

    jobs = [(name, t, s) for name in SCHEMA_SUITE for t in (0.0, 1.0) for s in (False, True)]
    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(answer, jobs))
    for (name, temperature, stream), (_, text, reason) in zip(jobs, results):
        assert reason == "stop", (name, temperature, stream, text)
        jsonschema.validate(json.loads(text), SCHEMA_SUITE[name])
    by_job = dict(zip(jobs, results))
    for name in SCHEMA_SUITE:  # streamed == not streamed, greedy and seeded
        for t in (0.0, 1.0):
            assert by_job[(name, t, True)][1] == by_job[(name, t, False)][1], name
    assert_idle_and_consistent(so_srv, timeout=30)


@pytest.mark.slow
def test_grpc_takes_structured_outputs_and_logit_bias_in_metadata(so_srv):
    """The proto is fixed: gRPC clients send these as the `jaxserve-sampling` metadata entry, with
    the HTTP routes' names; the same request over HTTP gives the same tokens."""
    import grpc

    from jaxserve.client import Client
    from server_utils import post
    from test_server_robust import assert_idle_and_consistent

    client = Client(so_srv["grpc"])
    schema = {**PERSON}
    for seed in range(2):
        text, last = client.generate("Describe a person:", max_tokens=80, temperature=1.0, seed=seed,
                                     extra={"structured_outputs": {"json": schema}})
        assert last.finish_reason == "stop"
        jsonschema.validate(json.loads(text), PERSON)
        status, body = post(so_srv, "/v1/completions", {"prompt": "Describe a person:", "max_tokens": 80,
                                                        "temperature": 1.0, "seed": seed,
                                                        "structured_outputs": {"json": schema}})
        assert status == 200 and body["choices"][0]["text"] == text
    text, _ = client.generate("Pick:", max_tokens=20, temperature=1.0, seed=3, extra={"guided_choice": CHOICES})
    assert text in CHOICES
    text, _ = client.generate("Code:", max_tokens=20, temperature=1.0, seed=4,
                              extra={"response_format": {"type": "json_schema", "json_schema": {
                                  "name": "p", "schema": PERSON}}})
    jsonschema.validate(json.loads(text), PERSON)
    forced = [m.token_ids for m in client.stream("Hi", max_tokens=3, temperature=0.0, ignore_eos=True,
                                                  extra={"logit_bias": {"42": 100}})]
    assert [t for ids in forced for t in ids] == [42, 42, 42]
    for extra, field in [({"structured_outputs": {"regex": "a("}}, "jaxserve-sampling"),
                         ({"bogus": 1}, "jaxserve-sampling: bogus is not a known field"),
                         ({"temperature": 0.5}, "jaxserve-sampling.temperature"),
                         ({"logit_bias": {"x": 1}}, "jaxserve-sampling: logit_bias"),
                         ({"guided_regex": "a", "guided_choice": ["a"]}, "jaxserve-sampling: give one"),
                         ({"structured_outputs": {"choice": []}}, "jaxserve-sampling: structured_outputs")]:
        with pytest.raises(grpc.RpcError) as err:
            list(client.stream("hello", max_tokens=4, extra=extra))
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and field in err.value.details(), \
            (extra, err.value.details())
    bad = client._generate(__import__("jaxserve.proto.jaxserve_pb2", fromlist=["x"]).GenerateRequest(text="hi"),
                           metadata=[("jaxserve-sampling", "[1]")])
    with pytest.raises(grpc.RpcError) as err:
        list(bad)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "jaxserve-sampling must be a JSON object" \
        in err.value.details()
    client.close()
    assert_idle_and_consistent(so_srv, timeout=30)


@pytest.mark.slow
def test_offline_generate_gives_the_servers_tokens(engines, so_srv):
    """The same constrained, seeded requests offline (LLM.generate) and through the HTTP server."""
    from jaxserve import LLM
    from server_utils import post

    llm = LLM.__new__(LLM)
    llm.engine = engines["sync"]
    cases = [({"json": PERSON}, "Describe a person:"), ({"choice": CHOICES}, "Pick one:"),
             ({"regex": REGEXES[1]}, "Email:"), ({"grammar": 'start: "x=" NUM ";"\nNUM: /[0-9]{1,3}/'}, "Set:")]
    for seed, (so, prompt) in enumerate(cases):
        out = llm.generate([prompt], SamplingParams(max_tokens=80, temperature=1.0, seed=seed, structured_outputs=so),
                           use_tqdm=False)[0].outputs[0]
        status, body = post(so_srv, "/v1/completions", {"prompt": prompt, "max_tokens": 80, "temperature": 1.0,
                                                        "seed": seed, "structured_outputs": so,
                                                        "return_token_ids": True})
        assert status == 200 and out.finish_reason == body["choices"][0]["finish_reason"] == "stop"
        assert body["choices"][0]["token_ids"] == list(out.token_ids), so
