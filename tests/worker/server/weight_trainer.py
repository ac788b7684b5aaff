"""A trainer, as slime's is, pushing a checkpoint to an engine by torch.distributed (run as a process):
rank 0 of a gloo group with every engine rank, made with plain torch (a TCPStore it hosts, prefixed by the
group's name), beside HTTP calls to ``/init_weights_update_group`` and ``/update_weights_from_distributed``.

    python -m tests.worker.server.weight_trainer URL KEY PORT ENGINE_RANKS CHECKPOINT_FILE VERSION

Prints the two responses' JSON bodies, one a line."""

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

GROUP = "trainer_group"


def _post(url: str, key: str, path: str, body: dict[str, Any], out: list[httpx.Response]) -> None:
    with httpx.Client(base_url=url, headers={"Authorization": f"Bearer {key}"}, timeout=120) as c:
        out.append(c.post(path, json=body))


def _in_thread(*args: Any) -> tuple[threading.Thread, list[httpx.Response]]:
    out: list[httpx.Response] = []
    t = threading.Thread(target=_post, args=(*args, out))
    t.start()
    return t, out


def main(url: str, key: str, port: int, engine_ranks: int, checkpoint: str, version: str) -> None:
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
    timeout = timedelta(seconds=60)
    store = dist.TCPStore("127.0.0.1", port, world, is_master=True, timeout=timeout)
    pg = dist.ProcessGroupGloo(dist.PrefixStore(f"{GROUP}/", store), 0, world, timeout)
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
    }
    t, out = _in_thread(url, key, "/update_weights_from_distributed", body)
    for n in names:
        pg.broadcast(tensors[n].contiguous(), 0).wait()
    t.join()
    print(json.dumps(out[0].json()), flush=True)


if __name__ == "__main__":
    a = sys.argv[1:]
    main(a[0], a[1], int(a[2]), int(a[3]), a[4], a[5])
