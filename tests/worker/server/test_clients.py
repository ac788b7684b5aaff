"""Real clients that others wrote, unchanged, against the server on loopback: sglang's frontend language
(RuntimeEndpoint: gen, stream, select, run_batch), ``python -m sglang.bench_serving`` (backends sglang and
sglang-oai on random-ids), and the ``openai`` client on /v1/completions."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.worker.server.served import Served

pytestmark = pytest.mark.multiproc


def test_sglang_frontend(server: Served) -> None:
    import sglang as sgl
    from sglang import RuntimeEndpoint

    sgl.set_default_backend(RuntimeEndpoint(server.url))

    @sgl.function
    def qa(s, q):  # type: ignore[no-untyped-def]
        s += "Q: " + q + "\nA:"
        s += sgl.gen("answer", max_tokens=8, temperature=0)

    @sgl.function
    def pick(s):  # type: ignore[no-untyped-def]
        s += "Is it? "
        s += sgl.select("choice", choices=["yes", "no", "maybe"])

    direct = server.post(
        "/generate", {"text": "Q: Hello\nA:", "sampling_params": {"max_new_tokens": 8, "temperature": 0}}
    ).json()
    answer = qa.run(q="Hello")["answer"]
    assert answer == direct["text"]  # the frontend sees exactly what /generate returns
    streamed = "".join(qa.run(q="Hello", stream=True).text_iter("answer"))
    assert streamed == answer
    assert pick.run()["choice"] in ("yes", "no", "maybe")
    batch = qa.run_batch([{"q": "a"}, {"q": "b"}, {"q": "Hello"}])
    assert len(batch) == 3 and batch[2]["answer"] == answer


@pytest.mark.parametrize("backend", ["sglang", "sglang-oai"])
def test_bench_serving(server: Served, tiny64: Path, backend: str, tmp_path: Path) -> None:
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "sglang.bench_serving",
            "--backend",
            backend,
            "--base-url",
            server.url,
            "--dataset-name",
            "random-ids",
            "--num-prompts",
            "12",
            "--random-input-len",
            "16",
            "--random-output-len",
            "8",
            "--random-range-ratio",
            "1.0",
            "--tokenizer",
            str(tiny64),
            "--request-rate",
            "inf",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,  # it writes its results file into the working directory
    )
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    ok = re.search(r"Successful requests:\s+(\d+)", r.stdout)
    toks = re.search(r"Total generated tokens:\s+(\d+)", r.stdout)
    assert ok and int(ok.group(1)) == 12, r.stdout[-2000:]
    assert toks and int(toks.group(1)) == 12 * 8  # ignore_eos: every request runs to its length


def test_openai_client(server: Served) -> None:
    from openai import OpenAI

    client = OpenAI(base_url=server.url + "/v1", api_key="unused")
    model = client.models.list().data[0].id
    done = client.completions.create(
        model=model, prompt="Hello", max_tokens=6, temperature=0, extra_body={"ignore_eos": True}
    )
    assert done.choices[0].finish_reason == "length" and done.usage is not None
    assert (done.usage.prompt_tokens, done.usage.completion_tokens) == (5, 6)
    direct = server.post(
        "/generate",
        {"text": "Hello", "sampling_params": {"max_new_tokens": 6, "temperature": 0, "ignore_eos": True}},
    ).json()
    assert done.choices[0].text == direct["text"]
    chunks = list(
        client.completions.create(
            model=model,
            prompt=["Hello", "Hi"],
            max_tokens=6,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
    )
    texts: dict[int, str] = {}
    for c in chunks:
        for ch in c.choices:
            texts[ch.index] = texts.get(ch.index, "") + ch.text
    assert texts[0] == done.choices[0].text and set(texts) == {0, 1}
    assert (
        chunks[-1].choices == [] and chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 12
    )
    with_lp = client.completions.create(model=model, prompt="Hello", max_tokens=3, temperature=0, logprobs=2)
    lp = with_lp.choices[0].logprobs
    assert lp is not None and len(lp.token_logprobs or []) == 3 and len((lp.top_logprobs or [])[0]) == 2
