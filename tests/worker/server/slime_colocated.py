"""slime's colocated weight update against an engine, in a process of its own: slime's own
``_send_to_colocated_engine`` (``slime/backends/megatron_utils/update_weight/update_weight_from_tensor.py``,
unchanged) puts a checkpoint's tensors in SGLang's flattened buckets, gathers them over a one-process gloo
group (the trainer's ranks of one engine) and hands them to slime's ``SGLangEngine`` of the engine (through
the ray stub), whose ``update_weights_from_tensor`` posts them; around it, slime's pause -> flush -> continue.

SGLang's ``MultiprocessingSerializer`` and ``FlattenedTensorBucket`` are the stand-ins of
``tests/worker/server/sglang_tensors.py`` (SGLang's pickled class names), of the current generation or, with
``older``, of the older one (one bucket per dtype). Tensors are shared by name (torch's ``file_system``
strategy), as between processes of one host.

``python -m tests.worker.server.slime_colocated SPEC.json``: SPEC gives the engine's address (``host:port``),
the checkpoint slime names, the safetensors file it sends, ``older`` and where to write the report (each
response, the engine's version after). Exits non-zero (with slime's traceback) on any failure."""

from __future__ import annotations

import json
import logging
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from rollout_worker.proc import free_port
from safetensors.torch import load_file

from tests.thirdparty import slime_code
from tests.worker.server import sglang_tensors as sg


def _no_router(args: Any, has_pd_disaggregation: bool) -> tuple[None, None]:
    return None, None  # slime's engines register with no router (SGLangEngine skips it without an address)


def _sglang(older: bool) -> dict[str, dict[str, Any]]:
    """The working names of SGLang's modules that slime's weight update imports."""
    working: dict[str, dict[str, Any]] = {m: dict(c) for m, c in sg.SGLANG_CLASSES.items()}
    if older:  # what slime imports as FlattenedTensorBucket is SGLang's older bucket
        working[sg.TENSOR_BUCKET_MODULE]["FlattenedTensorBucket"] = sg.OlderFlattenedTensorBucket
    working["sglang.srt.utils"] = {"MultiprocessingSerializer": sg.MultiprocessingSerializer}
    return working


def main(spec_path: str) -> None:
    spec = json.loads(Path(spec_path).read_text())
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    slime_code.install(slime_code.extract(Path(tempfile.mkdtemp(prefix="slime-"))), _sglang(spec["older"]))
    slime_code.install_cpu_accelerator()
    torch.multiprocessing.set_sharing_strategy("file_system")

    import ray
    from slime.backends.megatron_utils.sglang import FlattenedTensorBucket
    from slime.backends.megatron_utils.update_weight.update_weight_from_tensor import (
        _send_to_colocated_engine,
    )
    from slime.backends.sglang_utils.external import start_external_rollout_servers
    from slime.utils.arguments import parse_args

    sys.argv = ["train.py", "--hf-checkpoint", spec["hf_checkpoint"], "--debug-rollout-only"]
    sys.argv += ["--rollout-external-engine-addrs", spec["engine"]]
    sys.argv += ["--rollout-batch-size", "1", "--num-rollout", "1"]  # (required, unused)
    args = parse_args()  # slime's parsing and engine discovery (/server_info)
    servers, init_handles = start_external_rollout_servers(args, start_router=_no_router)
    ray.get(init_handles)  # SGLangEngine.init: the external engine's /server_info checks
    (engine,) = servers["default"].engines

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    gather_group = dist.new_group(ranks=[0], backend="gloo")  # the trainer's ranks of this engine: one
    tensors = list(load_file(spec["update"]).items())
    chunks = [tensors[: len(tensors) // 2], tensors[len(tensors) // 2 :]]  # slime sends a model in chunks
    responses = []
    ray.get(engine.pause_generation.remote())  # as slime's UpdateWeightFromTensor.update_weights
    ray.get(engine.flush_cache.remote())
    for chunk in chunks:
        refs, long_lived = _send_to_colocated_engine(
            chunk, ipc_engine=engine, ipc_gather_src=0, ipc_gather_group=gather_group, weight_version=1
        )
        responses += ray.get(refs)  # (the tensors live until the engine has read them)
        del long_lived
    ray.get(engine.continue_generation.remote())
    report = {
        "responses": responses,
        "version": ray.get(engine.get_weight_version.remote()),
        "multi_dtypes": getattr(FlattenedTensorBucket, "supports_multi_dtypes", False),  # as slime reads it
    }
    Path(spec["out"]).write_text(json.dumps(report))
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
