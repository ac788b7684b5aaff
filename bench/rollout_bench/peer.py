"""``rolloutctl bench peer``: the engine against Hugging Face ``transformers`` ``generate`` (float32, batched,
greedy), side by side in one run on the same model, requests and cores.

* request sets: equal lengths (every request the same number of new tokens) and a long-tailed set (a few
  long requests among many short ones), prompts of the same length; with a chat model and ``--chat-prompts``
  (default examples/math.jsonl) also ``natural``: those prompts rendered with its chat template, EOS
  honoured, up to 256 new tokens, so the lengths are the model's own (greedy: loops run to the cap);
* cores: ``c`` cores = our engine with ``c`` rank processes as ``c x 1`` (one torch thread each) against
  transformers with ``torch.set_num_threads(c)`` in one process;
* whole commands: ``rolloutctl generate ...`` against ``python -m rollout_bench.peer hf ...``
  (start-up, model load, generation, output written), wall clock of the subprocess;
* steady state: generation only (ours: first submit to last finish; theirs: the ``model.generate`` call).

Transformers runs a batch until its longest request is done (static batching): on the long-tailed set every
row pays for the longest. Runs alternate the order of the two engines.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, cast

from rollout_worker.api.requests import RequestSpec
from rollout_worker.api.sampling import Sampling
from rollout_worker.proc import rolloutctl

from rollout_bench.record import write_json

Echo = Callable[[str], Any]
TAIL = [8, 8, 12, 12, 16, 16, 20, 24, 28, 32, 40, 48, 64, 96, 192, 384]  # 1,000 tokens, 16 requests


def request_sets(
    vocab: int, prompt_len: int = 32, n: int = 16, equal_len: int = 128
) -> dict[str, list[dict[str, Any]]]:
    rng = random.Random(0)
    prompts = [[rng.randrange(vocab) for _ in range(prompt_len)] for _ in range(n)]
    return {
        "equal": [
            {"id": f"e{i}", "input_ids": p, "max_new_tokens": equal_len, "ignore_eos": True}
            for i, p in enumerate(prompts)
        ],
        "tail": [
            {"id": f"t{i}", "input_ids": p, "max_new_tokens": k, "ignore_eos": True}
            for i, (p, k) in enumerate(zip(prompts, TAIL[:n], strict=True))
        ],
    }


NATURAL_CAP = 256


def natural_set(model: Path, chat_prompts: Path, n: int = 16) -> list[dict[str, Any]]:
    """The first ``n`` chat prompts, rendered and tokenized as a job renders them, EOS honoured."""
    from rollout_worker.data.prompts import ChatTemplate, load_prompts
    from rollout_worker.engine.model.tokenizer import load_tokenizer

    template = ChatTemplate.of_model(model)
    assert template is not None
    tok = load_tokenizer(model)
    return [
        {"id": f"n{i}", "input_ids": tok.encode(p.text or "", add_special_tokens=False).ids,
         "max_new_tokens": NATURAL_CAP}
        for i, p in enumerate(load_prompts(chat_prompts, n, template))
    ]  # fmt: skip


def _write_jsonl(path: Path, rows: list[dict[str, Any]]) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def _ours_steady(
    model: Path, rows: list[dict[str, Any]], cores: int, ignore_eos: bool = True
) -> tuple[float, dict[str, list[int]]]:
    from rollout_worker.engine.config import EngineConfig
    from rollout_worker.engine.driver.fixed_batch import run_batch

    cfg = EngineConfig.load(str(model), cores)
    specs = [
        RequestSpec(r["id"], tuple(r["input_ids"]), r["max_new_tokens"], Sampling(), ignore_eos=ignore_eos)
        for r in rows
    ]
    res = run_batch(cfg, specs)
    return res.gen_s, res.tokens()


def _timed(cmd: list[str]) -> tuple[float, str]:
    t0 = time.perf_counter()
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=3600)
    wall = time.perf_counter() - t0
    if r.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd[:4])} ... failed ({r.returncode}):\n{r.stderr[-2000:]}")
    return wall, r.stdout


def run_peer_bench(
    preset: str,
    cores: list[int],
    runs: int,
    work: Path,
    json_out: Path | None,
    echo: Echo,
    chat_prompts: Path | None = None,
) -> dict[str, Any]:
    from rollout_worker.config.model_config import ModelConfig
    from rollout_worker.data.prompts import ChatTemplate
    from rollout_worker.engine.model.checkpoint import ensure_model

    model = ensure_model(preset, work)
    sets = request_sets(ModelConfig.load(model).vocab_size)
    if chat_prompts is not None and ChatTemplate.of_model(model) is not None:
        sets["natural"] = natural_set(model, chat_prompts)
    tmp = Path(tempfile.mkdtemp())
    results: list[dict[str, Any]] = []
    for name, rows in sets.items():
        prompts = tmp / f"{name}.jsonl"
        _write_jsonl(prompts, rows)
        natural = name == "natural"
        for c in cores:
            ours_cmd = [
                *rolloutctl(),
                "generate",
                "--model",
                str(model),
                "--prompts",
                str(prompts),
                "--out",
                str(tmp / "ours.jsonl"),
                "--ranks",
                str(c),
                "--log-every",
                "1000",
            ]
            hf_cmd = [
                sys.executable,
                "-m",
                "rollout_bench.peer",
                "hf",
                "--model",
                str(model),
                "--prompts",
                str(prompts),
                "--out",
                str(tmp / "hf.jsonl"),
                "--threads",
                str(c),
                *(["--eos"] if natural else []),
            ]
            samples: dict[str, list[float]] = {"ours_cmd": [], "hf_cmd": [], "ours_gen": [], "hf_gen": []}
            agree: list[float] = []
            for i in range(runs):
                order = ["ours", "hf"] if i % 2 == 0 else ["hf", "ours"]
                for who in order:
                    if who == "ours":
                        samples["ours_cmd"].append(_timed(ours_cmd)[0])
                        gen_s, ours_ids = _ours_steady(model, rows, c, ignore_eos=not natural)
                        samples["ours_gen"].append(gen_s)
                    else:
                        wall, out = _timed(hf_cmd)
                        samples["hf_cmd"].append(wall)
                        samples["hf_gen"].append(json.loads(out.strip().splitlines()[-1])["generate_s"])
                hf_ids = {
                    json.loads(x)["id"]: json.loads(x)["output_ids"]
                    for x in (tmp / "hf.jsonl").read_text().split("\n")
                    if x
                }
                agree.append(_agreement(ours_ids, hf_ids))
            med = {k: statistics.median(v) for k, v in samples.items()}
            tokens = sum(len(x) for x in ours_ids.values())  # natural: the lengths our engine drew
            row = {
                "set": name,
                "cores": c,
                "tokens": tokens,
                "runs": runs,
                "samples": samples,
                "median": med,
                "speedup_cmd": med["hf_cmd"] / med["ours_cmd"],
                "speedup_gen": med["hf_gen"] / med["ours_gen"],
                "greedy_agreement": statistics.median(agree),
            }
            results.append(row)
            echo(
                f"  {name}, {c} core(s): whole command ours {med['ours_cmd']:.2f} s vs transformers "
                f"{med['hf_cmd']:.2f} s ({row['speedup_cmd']:.2f}x); generation {med['ours_gen']:.2f} s vs "
                f"{med['hf_gen']:.2f} s ({row['speedup_gen']:.2f}x)"
            )
    echo(
        f"\n{preset}, float32, greedy, 16 requests (equal, tail: random prompts of 32 tokens; natural: chat "
        f"prompts, EOS honoured, cap {NATURAL_CAP}); median of {runs} alternated runs"
    )
    echo(
        "| set | cores | tokens | whole command: ours / transformers | speed-up "
        "| generation: ours / transformers | speed-up | same tokens |"
    )
    echo("|---|---|---|---|---|---|---|---|")
    for r in results:
        m = r["median"]
        echo(
            f"| {r['set']} | {r['cores']} | {r['tokens']} | {m['ours_cmd']:.2f} s / {m['hf_cmd']:.2f} s "
            f"| {r['speedup_cmd']:.2f}x | {m['ours_gen']:.2f} s / {m['hf_gen']:.2f} s "
            f"| {r['speedup_gen']:.2f}x | {100 * r['greedy_agreement']:.0f}% |"
        )
    report = {"benchmark": "peer", "preset": preset, "peer": "transformers generate", "results": results}
    if json_out is not None:
        write_json(json_out, report)
        echo(f"wrote {json_out}")
    return report


def _agreement(ours: dict[str, list[int]], theirs: dict[str, list[int]]) -> float:
    """Fraction of output tokens that equal transformers' (float32: rare argmax ties may differ)."""
    same = total = 0
    for rid, a in ours.items():
        b = theirs[rid]
        total += len(a)
        for x, y in zip(a, b, strict=False):
            if x != y:
                break
            same += 1
    return same / max(total, 1)


def hf_main(argv: list[str] | None = None) -> None:
    """The peer's whole command: load with transformers, one batched greedy ``generate``, write JSONL."""
    ap = argparse.ArgumentParser(prog="bench_peer hf")
    ap.add_argument("--model", required=True)
    ap.add_argument("--prompts", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--eos", action="store_true", help="stop each row at the model's EOS")
    a = ap.parse_args(argv)
    import torch
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(a.threads)
    rows = [json.loads(x) for x in Path(a.prompts).read_text().split("\n") if x.strip()]
    model = AutoModelForCausalLM.from_pretrained(a.model, torch_dtype=torch.float32)
    model.eval()
    width = max(len(r["input_ids"]) for r in rows)
    ids = torch.zeros((len(rows), width), dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, r in enumerate(rows):  # left padding, as batched generation needs
        ids[i, width - len(r["input_ids"]) :] = torch.tensor(r["input_ids"])
        mask[i, width - len(r["input_ids"]) :] = 1
    longest = max(r["max_new_tokens"] for r in rows)
    eos = model.generation_config.eos_token_id if a.eos else None
    t0 = time.perf_counter()
    with torch.no_grad():
        out = cast(Any, model).generate(  # (typed differently across transformers' versions)
            input_ids=ids,
            attention_mask=mask,
            max_new_tokens=longest,
            min_new_tokens=None if a.eos else longest,
            do_sample=False,
            eos_token_id=model.generation_config.eos_token_id if a.eos else None,
            pad_token_id=0,
        )
    gen_s = time.perf_counter() - t0
    with Path(a.out).open("w") as f:
        for i, r in enumerate(rows):
            f.write(
                json.dumps({"id": r["id"], "output_ids": _until_eos(out[i, width:].tolist(), r, eos)}) + "\n"
            )
    print(json.dumps({"generate_s": gen_s}))


def _until_eos(ids: list[int], row: dict[str, Any], eos: int | list[int] | None) -> list[int]:
    """A row's output as our engine reports it: its cap, and through its first EOS (the rest is padding)."""
    ids = ids[: row["max_new_tokens"]]
    stops = {eos} if isinstance(eos, int) else set(eos or ())
    end = next((i + 1 for i, t in enumerate(ids) if t in stops), len(ids))
    return ids[:end]


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "hf":
        hf_main(sys.argv[2:])
    else:
        sys.exit("usage: python -m rollout_bench.peer hf --model DIR --prompts FILE --out FILE [--threads N]")
