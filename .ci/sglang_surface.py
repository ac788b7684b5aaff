"""Derive the keys of SGLang's ``/generate`` body from an sglang wheel, with their defaults (neutral values).

    pip download --no-deps sglang==0.5.23 -d /tmp/w
    python .ci/sglang_surface.py /tmp/w/sglang-0.5.23-*.whl > worker/rollout_worker/api/sglang_surface.json

Reads ``GenerateReqInput`` (``sglang/srt/managers/io_struct.py``) and the API fields of ``SamplingParams``
(``sglang/srt/sampling/sampling_params.py``, the fields above its "Internal fields" comment) with ``ast``:
nothing of sglang is imported. The engine accepts every key at its default, refuses any other value of a key
it does not implement (``rollout_worker.api.neutral_keys``).
"""

from __future__ import annotations

import ast
import json
import re
import sys
import zipfile
from typing import Any

# names SGLang uses as defaults that are not literals
_CONSTANTS = {"TOP_K_ALL": 1 << 30}
# keys sglang-router (sgl-model-gateway) adds to the bodies it forwards that GenerateReqInput lacks
_ROUTER = {"model": {"type": "Optional[str]", "default": None}}


def _default(node: ast.expr | None) -> Any:
    if node is None:
        raise ValueError("a field without a default")
    if isinstance(node, ast.Call):  # field(default=..., kw_only=True)
        (kw,) = [k for k in node.keywords if k.arg == "default"]
        return _default(kw.value)
    if isinstance(node, ast.Name) and node.id in _CONSTANTS:
        return _CONSTANTS[node.id]
    return ast.literal_eval(node)


def _fields(source: str, name: str, stop: str | None = None) -> dict[str, dict[str, Any]]:
    end = next((i for i, line in enumerate(source.splitlines(), 1) if stop and stop in line), None)
    (cls,) = [n for n in ast.parse(source).body if isinstance(n, ast.ClassDef) and n.name == name]
    return {
        st.target.id: {"type": ast.unparse(st.annotation), "default": _default(st.value)}
        for st in cls.body
        if isinstance(st, ast.AnnAssign)
        and isinstance(st.target, ast.Name)
        and (end is None or st.lineno < end)
    }


def main(wheel: str) -> None:
    version = re.search(r"sglang-([^-]+)-", wheel)
    with zipfile.ZipFile(wheel) as z:
        io_struct = z.read("sglang/srt/managers/io_struct.py").decode()
        sampling = z.read("sglang/srt/sampling/sampling_params.py").decode()
    surface = {
        "sglang_version": version.group(1) if version else "unknown",
        "source": "GenerateReqInput in sglang/srt/managers/io_struct.py; SamplingParams (API fields) in "
        "sglang/srt/sampling/sampling_params.py; router: keys sglang-router adds; "
        "made by .ci/sglang_surface.py",
        "generate": _fields(io_struct, "GenerateReqInput"),
        "sampling": _fields(sampling, "SamplingParams", stop="Internal fields"),
        "router": _ROUTER,
    }
    json.dump(surface, sys.stdout, indent=1)
    sys.stdout.write("\n")


if __name__ == "__main__":
    main(sys.argv[1])
