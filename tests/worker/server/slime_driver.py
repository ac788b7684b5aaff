"""slime, run as its rollout-only mode runs it against external engines, in a process of its own: slime's own
code (``tests/thirdparty/slime_code.py``: unchanged, its ray/Megatron/SGLang imports stubbed), its argument
parser with its defaults, its engine discovery and checks, the router it starts itself, two rollouts of its
``generate_rollout`` with partial rollout, and between them its distributed weight update.

``python -m tests.worker.server.slime_driver SPEC.json``: SPEC gives the engines' URLs, the checkpoint slime
names (``hf_checkpoint``), the checkpoint it pushes as the trainer (``update``), the prompt file, extra
arguments and where to write the report: per phase what slime saw, per sample its tokens, log
probabilities, status, weight versions and the rollout it started in. Exits non-zero (with slime's
traceback) on any failure."""

from __future__ import annotations

import json
import logging
import os
import signal
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import requests
import torch
import torch.distributed as dist
from rollout_worker.proc import free_port, when_gone
from safetensors.torch import load_file

from tests.thirdparty import slime_code

log = logging.getLogger("slime-driver")


def _report(samples: list[Any]) -> list[dict[str, Any]]:
    return [
        {
            "index": s.index,
            "prompt": s.prompt,
            "tokens": list(s.tokens),
            "response_length": s.response_length,
            "log_probs": list(s.rollout_log_probs or []),
            "status": s.status.value,
            "weight_versions": list(s.weight_versions),
            "start_rollout_id": s.metadata.get("start_rollout_id"),
        }
        for group in samples
        for s in group
    ]


def _load(url: str) -> int:
    loads = requests.get(f"{url}/v1/loads", timeout=10).json()["loads"]
    return sum(x["num_total_reqs"] for x in loads)


def _workers(router: str, n: int, timeout_s: float = 60.0) -> list[dict[str, Any]]:
    """The router's workers once ``n`` have registered (it registers a POSTed worker in the background after
    probing it), or what it has after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while True:
        workers: list[dict[str, Any]] = requests.get(f"{router}/workers", timeout=10).json()["workers"]
        if len(workers) >= n or time.monotonic() > deadline:
            return workers
        time.sleep(0.2)


def main(spec_path: str) -> None:
    spec = json.loads(Path(spec_path).read_text())
    # the router slime starts is a process of this one's: end the whole group with the test
    parent = os.getppid()
    when_gone(parent, lambda: os.killpg(0, signal.SIGKILL), name="test-gone")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    slime_code.install(slime_code.extract(Path(tempfile.mkdtemp(prefix="slime-"))))
    slime_code.install_cpu_accelerator()
    os.environ["SLIME_HOST_IP"] = "127.0.0.1"  # slime's setting: its router on loopback

    import ray
    from slime.backends.megatron_utils.update_weight.update_weight_from_distributed import (
        UpdateWeightFromDistributed,
    )
    from slime.backends.sglang_utils.external import start_external_rollout_servers
    from slime.ray.rollout import _start_router
    from slime.ray.utils import Lock
    from slime.rollout.base_types import call_rollout_fn
    from slime.rollout.data_source import RolloutDataSourceWithBuffer
    from slime.rollout.sglang_rollout import generate_rollout
    from slime.utils.arguments import parse_args
    from slime.utils.http_utils import init_http_client

    report: dict[str, Any] = {}
    sys.argv = ["train.py", "--hf-checkpoint", spec["hf_checkpoint"], "--debug-rollout-only"]
    sys.argv += ["--rollout-external-engine-addrs", *spec["engines"], *spec["args"]]
    args = parse_args()  # slime's own parsing, checks and engine discovery (/server_info)
    report["args"] = {
        "offload_rollout": args.offload_rollout,
        "rollout_num_gpus": args.rollout_num_gpus,
        "engine_infos": args.rollout_external_engine_infos,
    }

    servers, init_handles = start_external_rollout_servers(args, start_router=_start_router)
    ray.get(init_handles)  # SGLangEngine.init: the external engine's /server_info checks, then /workers
    server = servers["default"]
    router = f"http://{args.sglang_router_ip}:{args.sglang_router_port}"
    report["router_workers"] = _workers(router, len(server.engines))

    init_http_client(args)
    data_source = RolloutDataSourceWithBuffer(args)

    def rollout(rollout_id: int) -> dict[str, Any]:
        out = call_rollout_fn(generate_rollout, args, rollout_id, data_source, evaluation=False)
        return {
            "samples": _report(out.samples),
            "buffered": _report(data_source.buffer),  # the partial rollouts kept for the next one
            "loads_after": [_load(info["url"]) for info in args.rollout_external_engine_infos],
        }

    report["rollout_0"] = rollout(0)

    class Updater(UpdateWeightFromDistributed):
        """slime's distributed updater; what it sends is the update checkpoint's tensors, named as slime's
        Megatron-to-HF conversion names them (its ``_send_weights`` is the subclasses' hook)."""

        def _send_weights(self, pbar: Any) -> None:
            tensors = load_file(spec["update"])
            self._update_bucket_weights_from_distributed(list(tensors.items()), pbar=pbar)

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    from slime.utils.distributed_utils import init_gloo_group

    init_gloo_group()
    updater = Updater(args, [], lambda: {}, model_name="llama", quantization_config=None)
    t = time.monotonic()
    updater.connect_rollout_engines(server.engines, Lock.remote(), engine_gpu_counts=server.engine_gpu_counts)
    updater.update_weights()  # pause -> flush_cache -> broadcast -> continue, as slime does
    updater.disconnect_rollout_engines()
    report["update"] = {
        "seconds": time.monotonic() - t,
        "world_size": 1 + sum(server.engine_gpu_counts),
        "versions": [e.get_weight_version.remote().result() for e in server.engines],
    }

    report["rollout_1"] = rollout(1)
    Path(spec["out"]).write_text(json.dumps(report))
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
