"""SGLang's whole ``/generate`` surface, driven by the data file derived from SGLang's source
(``rollout_worker/api/sglang_surface.json``): every key at its neutral value is accepted, every other value
of a key we do not implement is a 400 naming the key, every key we implement works at a non-default value."""

from __future__ import annotations

from typing import Any

import httpx
from rollout_worker.api.neutral_keys import sglang_keys, sglang_surface
from rollout_worker.api.sglang import NEUTRAL_GENERATE, NEUTRAL_SAMPLING, GenerateRequest, SamplingParams

from tests.worker.server.served import Served
from tests.worker.server.test_api import gen, sse

GENERATE, SAMPLING = sglang_keys("generate"), sglang_keys("sampling")
PROMPT = [5, 6, 7]
# what sglang-router adds to every /generate body it forwards (slime's gateway)
ROUTER = {
    "model": None,
    "background": False,
    "no_logs": False,
    "return_bytes": False,
    "return_entropy": False,
    "log_metrics": True,
    "return_hidden_states": False,
}
# a key we implement -> a value other than its default that must work
IMPLEMENTED_SAMPLING: dict[str, Any] = {
    "max_new_tokens": 3,
    "stop": ["zz"],
    "stop_token_ids": [1],
    "temperature": 0.7,
    "top_p": 0.9,
    "top_k": 5,
    "min_p": 0.05,
    "min_new_tokens": 1,
    "n": 2,
    "ignore_eos": True,
    "skip_special_tokens": False,
    "spaces_between_special_tokens": False,
    "no_stop_trim": True,
    "sampling_seed": 11,
}
IMPLEMENTED_GENERATE: dict[str, Any] = {
    "rid": "surface-rid",
    "text": "Hello",
    "input_ids": PROMPT,
    "sampling_params": {"max_new_tokens": 2},
    "return_logprob": True,
    "logprob_start_len": 0,
    "top_logprobs_num": 2,
    "return_text_in_logprobs": True,
    "stream": True,
}


def _other(default: Any, kind: str) -> Any:
    """A value of a key that is not neutral."""
    if isinstance(default, bool):
        return not default
    if isinstance(default, int | float):
        return default + 1
    if default is None:
        return {"a": 1} if "dict" in kind.lower() else ("x" if "str" in kind else 1)
    raise AssertionError(f"no other value for default {default!r}")


def test_the_data_file_is_sglangs_surface() -> None:
    s = sglang_surface()
    assert s["sglang_version"].startswith("0.5.")
    assert len(GENERATE) > 60 and len(SAMPLING) > 20
    assert set(ROUTER) <= set(GENERATE) and all(GENERATE[k] == v for k, v in ROUTER.items())
    # every key is either implemented (a field of our models) or refused unless neutral, none forgotten
    for keys, model, neutral in (
        (GENERATE, GenerateRequest, NEUTRAL_GENERATE),
        (SAMPLING, SamplingParams, NEUTRAL_SAMPLING),
    ):
        assert set(model.model_fields) <= set(keys), "a field SGLang does not have"
        assert set(keys) == set(model.model_fields) | set(neutral)
    assert set(IMPLEMENTED_GENERATE) == set(GenerateRequest.model_fields)
    assert set(IMPLEMENTED_SAMPLING) == set(SamplingParams.model_fields)


def test_every_key_at_its_default_or_null_is_accepted(server: Served) -> None:
    short = {"max_new_tokens": 2, "ignore_eos": True}
    defaults = {**GENERATE, "input_ids": PROMPT, "sampling_params": {**SAMPLING, **short}}
    assert gen(server, defaults)["meta_info"]["completion_tokens"] == 2
    nulls = {
        **dict.fromkeys(GENERATE),
        "input_ids": PROMPT,
        "sampling_params": {**dict.fromkeys(SAMPLING), **short},
    }
    assert gen(server, nulls)["meta_info"]["completion_tokens"] == 2
    empties = {k: [] for k, v in NEUTRAL_GENERATE.items() if [] in v}
    empties |= {
        "input_ids": PROMPT,
        "sampling_params": {**{k: {} for k in NEUTRAL_SAMPLING if {} in NEUTRAL_SAMPLING[k]}, **short},
    }
    assert gen(server, empties)["meta_info"]["completion_tokens"] == 2
    # the values that change nothing here
    quiet = {"input_ids": PROMPT, "sampling_params": short, "log_metrics": False, "no_logs": True}
    assert gen(server, quiet)["meta_info"]["completion_tokens"] == 2


def test_what_sglang_router_adds_is_accepted(server: Served) -> None:
    body = {**ROUTER, "input_ids": PROMPT, "sampling_params": {"max_new_tokens": 3, "temperature": 0}}
    out = gen(server, body)
    assert out["meta_info"]["completion_tokens"] == 3
    chunks = sse(server, "/generate", {**body, "stream": True})
    assert chunks[-1] == "[DONE]" and chunks[-2]["output_ids"] == out["output_ids"]


def test_a_key_we_do_not_implement_is_refused_unless_neutral(server: Served) -> None:
    bad = []
    with server.client() as c:
        for where, neutral, keys in (
            ("", NEUTRAL_GENERATE, GENERATE),
            ("sampling_params.", NEUTRAL_SAMPLING, SAMPLING),
        ):
            kinds = sglang_surface()["generate" if not where else "sampling"] | sglang_surface()["router"]
            for key in neutral:
                value = _other(keys[key], kinds[key]["type"])
                if value in neutral[key]:  # both booleans neutral (log_metrics, no_logs): a wrong type then
                    value = "x"
                sp = {key: value} if where else {}
                body = {"input_ids": PROMPT, "sampling_params": sp} | ({} if where else {key: value})
                r = c.post("/generate", json=body)
                err = r.json().get("error", {}) if r.status_code == 400 else {}
                if err.get("field") != where + key or "not supported" not in err.get("message", ""):
                    bad.append((where + key, value, r.status_code, r.text[:200]))
    assert not bad, bad
    assert len(NEUTRAL_GENERATE) + len(NEUTRAL_SAMPLING) > 70


def test_a_key_we_implement_works_at_another_value(server: Served) -> None:
    base = {
        "input_ids": PROMPT,
        "sampling_params": {"max_new_tokens": 4, "ignore_eos": True, "temperature": 0},
    }
    for key, value in IMPLEMENTED_SAMPLING.items():
        sp = {**base["sampling_params"], key: value}
        if key == "min_new_tokens":
            sp["ignore_eos"] = False
        out = gen(server, {**base, "sampling_params": sp})
        outs = out if isinstance(out, list) else [out]
        assert len(outs) == (value if key == "n" else 1), key
        assert all(o["meta_info"]["completion_tokens"] >= 1 for o in outs), key
    for key, value in IMPLEMENTED_GENERATE.items():
        body = {**base, key: value}
        if key == "text":
            del body["input_ids"]
        if key in ("top_logprobs_num", "logprob_start_len", "return_text_in_logprobs"):
            body["return_logprob"] = True
        if key == "stream":
            assert sse(server, "/generate", body)[-1] == "[DONE]"
            continue
        out = gen(server, body)
        assert out["meta_info"]["completion_tokens"] >= 1, key
        if key == "rid":
            assert out["meta_info"]["id"] == value
        if key == "top_logprobs_num":
            assert all(len(top) == value for top in out["meta_info"]["output_top_logprobs"])
        if key == "logprob_start_len":
            assert len(out["meta_info"]["input_token_logprobs"]) == len(PROMPT)


def test_openai_keys_we_do_not_implement_are_refused_unless_neutral(server: Served) -> None:
    ok = {"model": "m", "prompt": [5, 6], "max_tokens": 2}
    neutral = {"best_of": 1, "echo": False, "suffix": None, "logit_bias": {}, "frequency_penalty": 0}
    with httpx.Client(base_url=server.url, headers=server.headers, timeout=60) as c:
        assert c.post("/v1/completions", json={**ok, **neutral, "presence_penalty": 0.0}).status_code == 200
        for key, value in {"best_of": 2, "echo": True, "suffix": "s", "frequency_penalty": 0.5}.items():
            r = c.post("/v1/completions", json={**ok, key: value})
            assert r.status_code == 400 and r.json()["error"]["field"] == key, r.text
        chat = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
        quiet = {"response_format": {"type": "text"}, "tools": [], "tool_choice": "none", "store": False}
        assert c.post("/v1/chat/completions", json={**chat, **quiet, "logit_bias": None}).status_code == 200
        loud = {
            "tools": [{"type": "function", "function": {"name": "f"}}],
            "response_format": {"type": "json_object"},
            "tool_choice": "required",
            "presence_penalty": 1.0,
        }
        for key, value in loud.items():
            r = c.post("/v1/chat/completions", json={**chat, key: value})
            assert r.status_code == 400 and r.json()["error"]["field"] == key, r.text
