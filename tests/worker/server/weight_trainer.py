"""A trainer, as slime's is, pushing a checkpoint to an engine by torch.distributed (run as a process):
rank 0 of a gloo group with every engine rank, made as slime makes it (its copy of SGLang's
``init_custom_process_group``: a tcp:// rendezvous it hosts, the store prefixed by the group's name),
beside HTTP calls to ``/init_weights_update_group`` and ``/update_weights_from_distributed``.

    python -m tests.worker.server.weight_trainer URL KEY PORT ENGINE_RANKS CHECKPOINT_FILE VERSION [BUCKET]

With BUCKET (``flattened_bucket``), the tensors go in one broadcast of SGLang's current flattened bucket
(every tensor's bytes back to back), as ``load_format: "flattened_bucket"`` announces them. Prints the two
responses' JSON bodies, one a line."""

from __future__ import annotations

import json
import sys
import threading
from datetime import timedelta
from typing import Any

import httpx
import torch
import torch.distributed as dist
from safetensors.torch import load_file
from torch.distributed import distributed_c10d as c10d

from tests.worker.server.sglang_tensors import FlattenedTensorBucket

GROUP = "trainer_group"


def _post(url: str, key: str, path: str, body: dict[str, Any], out: list[httpx.Response]) -> None:
    with httpx.Client(base_url=url, headers={"Authorization": f"Bearer {key}"}, timeout=120) as c:
        out.append(c.post(path, json=body))


def _in_thread(*args: Any) -> tuple[threading.Thread, list[httpx.Response]]:
    out: list[httpx.Response] = []
    t = threading.Thread(target=_post, args=(*args, out))
    t.start()
    return t, out


def _init_process_group(init_method: str, world: int, group_name: str) -> dist.ProcessGroup:
    """Rank 0 of a new group as slime makes it (its copy of SGLang's ``init_custom_process_group``)."""
    timeout = timedelta(seconds=60)
    store, rank, world = next(dist.rendezvous(init_method, 0, world, timeout=timeout))
    store.set_timeout(timeout)
    pg, _ = c10d._new_process_group_helper(
        world,
        rank,
        [],
        dist.Backend("gloo"),
        dist.PrefixStore(group_name, store),
        group_name=group_name,
        timeout=timeout,
    )
    c10d._world.pg_group_ranks[pg] = {i: i for i in range(world)}
    return pg


def main(
    url: str, key: str, port: int, engine_ranks: int, checkpoint: str, version: str, bucket: bool = False
) -> None:
    torch.set_num_threads(1)
    world = 1 + engine_ranks
    init = {
        "master_address": "127.0.0.1",
        "master_port": port,
        "rank_offset": 1,
        "world_size": world,
        "group_name": GROUP,
        "backend": "gloo",
    }
    t, out = _in_thread(url, key, "/init_weights_update_group", init)
    pg = _init_process_group(f"tcp://127.0.0.1:{port}", world, GROUP)
    t.join()
    print(json.dumps(out[0].json()), flush=True)
    tensors = load_file(checkpoint)
    names = sorted(tensors)
    body = {
        "names": names,
        "dtypes": [str(tensors[n].dtype) for n in names],  # "torch.float64", as slime sends them
        "shapes": [list(tensors[n].shape) for n in names],
        "group_name": GROUP,
        "weight_version": version,
        **({"load_format": "flattened_bucket"} if bucket else {}),
    }
    t, out = _in_thread(url, key, "/update_weights_from_distributed", body)
    if bucket:
        flat = FlattenedTensorBucket(named_tensors=[(n, tensors[n]) for n in names]).get_flattened_tensor()
        dist.broadcast(flat, 0, group=pg)
    else:
        for n in names:
            dist.broadcast(tensors[n].contiguous(), 0, group=pg)
    t.join()
    print(json.dumps(out[0].json()), flush=True)


if __name__ == "__main__":
    a = sys.argv[1:]
    main(a[0], a[1], int(a[2]), int(a[3]), a[4], a[5], a[6:] == ["flattened_bucket"])
